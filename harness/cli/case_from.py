"""`oom-harness case-from`: a team's training config turned into a case file of its own suite.

    oom-harness case-from llama3_lora.yaml --gpu-memory 24GiB --gpus 1 --out cases/
    oom-harness run --case-dir cases/ --fidelity tiny      # on CI's CPUs
    oom-harness run --case-dir cases/ --fidelity real      # on the GPU host, nightly

The case keeps the job as the config describes it, the card it must fit with its headroom, the
outcome the prediction expects, and the prediction under `predicted` (informational, never asserted).
Exit codes: 0 the case was written, 2 bad input (one line naming the file, the key and the fix).
"""

from __future__ import annotations

from harness.cli.arguments import layer_counts
from harness.cli.check import add_job_arguments, spec_from_args
from harness.models.source import model_label
from harness.spec.units import fmt_gib


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "case-from", help="write a case file from a training config (LLaMA-Factory YAML, TrainingArguments JSON)")
    add_job_arguments(p)
    p.add_argument("--out", required=True, help="the folder of the case file (the team's --case-dir)")
    p.add_argument("--id", help="the case id and file name (default: the config's file name)")
    p.add_argument("--card-name", help="the card's name in the case, e.g. 'RTX 4090' (default: its memory)")
    p.add_argument("--force", action="store_true",
                   help="replace a case file of the same id (without it, an existing one is refused)")
    p.add_argument("--depth-points", type=layer_counts, metavar="L1,L2",
                   help="full-size runs measure at these layer counts and extrapolate to the full depth (a model "
                        "the GPU host cannot hold, or not in reasonable time), e.g. 4,8")
    p.set_defaults(func=run)


def run(args) -> int:
    from harness.models.inputs import InputError
    from harness.premerge.case_writer import write_case
    from harness.spec.files import RefusedOutput, WriteError

    try:
        written = write_case(args.config, spec_from_args(args), args.out, case_id=args.id,
                             card_name=args.card_name, platform=args.platform, force=args.force,
                             depth_points=args.depth_points)
    except RefusedOutput:  # names the option or the file itself; main answers it with exit 2
        raise
    except WriteError as exc:  # the case file could not be written: name the option that chose its folder
        raise InputError(None, "--out", str(exc)) from None
    case, result = written.case, written.check
    print(f"wrote {written.path}")
    print(f"  model {model_label(case.model)}, {case.method.kind}, micro batch {case.train.micro_batch} x accumulation "
          f"{case.train.grad_accum}, {case.train.seq_len} tokens")
    print(f"  predicted per-card peak {fmt_gib(result.card_peak)} against a budget of {fmt_gib(result.budget)} "
          f"({case.target.headroom:g} of {case.target.card.count} x {fmt_gib(case.target.card.memory)}): "
          f"expects {case.expect.outcome}")
    for line in case.notes.splitlines():
        print(f"  {line}")
    print(f"run it: oom-harness run --case-dir {args.out} -k {case.id} --fidelity tiny (CPU) or --fidelity real (GPU)")
    return 0
