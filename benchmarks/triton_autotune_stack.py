"""The per-thread stack of every Triton kernel (and autotune candidate) a GLA training step launches.

Guide 004's GLA case holds ~3.5 GiB per process outside PyTorch's allocator on a cold Triton cache (H100
and H200, any batch) and not on a warm one (flash-linear-attention caches its autotune results). The
predictor sizes that from the kernels (`harness.predict.local_memory`): the CUDA driver grows a context's
local memory to the largest per-thread need of any kernel launched, times every resident thread, and on a
cold cache the autotuner launches every candidate. This script runs the survey the predictor runs
(`harness.predict.triton_kernels`: the step on CPU tensors with every launch intercepted, each candidate
compiled for the card with the imported Triton and read with its cuobjdump), prints every candidate and
compares the predictor's term with what the recorded cold runs held beyond the warm ones.

    python benchmarks/triton_autotune_stack.py --out stack.json
    python benchmarks/triton_autotune_stack.py --out stack.json --save   # and keep it in results/triton-kernels/

The compiler is the Triton that is imported; another release allocates registers and spills differently,
and fla prunes some candidates by Triton version. To compile with the GPU hosts' release, install it into a
folder and put that first on the path:

    pip install --no-deps --target /tmp/triton-3.6 triton==3.6.0
    PYTHONPATH=/tmp/triton-3.6 python benchmarks/triton_autotune_stack.py --out stack-3.6.json --save

Which candidate wins each autotuning is decided by timing on the GPU and is not known here; on a cold
cache every one is launched. Exit codes: 0 compiled, 1 a compile or the step failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.measure.card_compute import CardCompute, card_compute  # noqa: E402
from harness.predict import local_memory  # noqa: E402
from harness.predict.constants import SURVEY_BATCH  # noqa: E402
from harness.predict.triton_kernels import Target, per_kernel, survey  # noqa: E402
from harness.spec.units import GIB  # noqa: E402

DEFAULT_CASE = str(ROOT / "cases" / "004-gla-plan-c-1proc.yaml")
DEFAULT_PLATFORM = "nvidia-h100-80gb-hbm3-x1"


def resident_gib(bytes_per_thread: int, threads: int) -> float:
    """`bytes_per_thread` of local memory on every resident thread, in GiB."""
    return bytes_per_thread * threads / GIB


def bytes_per_thread_for(gib: float, threads: int) -> float:
    """The per-thread local memory that would account for `gib` GiB over `threads` threads."""
    return gib * GIB / threads


def table(rows: list[dict], card: CardCompute) -> str:
    head = (f"{'kernel':46} {'config':40} {'REG':>4} {'STACK':>6} {'LOCAL':>6} "
            f"{f'x {card.resident_threads:,} GiB':>14} {'grown, GiB':>10}")
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (-(r.get("bytes_per_thread") or 0), r["kernel"], r["config"])):
        if "error" in r:
            lines.append(f"{r['kernel']:46} {r['config']:40} compile failed: {r['error']}")
            continue
        grown = local_memory.growth_bytes(r["bytes_per_thread"], card.resident_threads) / GIB
        lines.append(f"{r['kernel']:46} {r['config']:40} {r['reg']:>4} {r['stack']:>6} {r['local']:>6} "
                     f"{resident_gib(r['bytes_per_thread'], card.resident_threads):>14.3f} {grown:>10.3f}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--case", default=DEFAULT_CASE,
                        help="a GLA case file (default: guide 004's plan C, cases/004-gla-plan-c-1proc)")
    parser.add_argument("--platform", default=DEFAULT_PLATFORM,
                        help=f"the platform whose card to compile for (default {DEFAULT_PLATFORM}; its compute "
                             "layout from harness/measure/cards.json)")
    parser.add_argument("--batch", type=int, default=SURVEY_BATCH,
                        help=f"sequences per step (default {SURVEY_BATCH}, what the predictor surveys)")
    parser.add_argument("--only", default=None, metavar="REGEX",
                        help="report only the kernels whose name matches this regular expression (default: all)")
    parser.add_argument("--save", action="store_true",
                        help="also keep the survey in results/triton-kernels/, where the predictor finds it for "
                             "jobs of this model, sequence length, card and Triton release")
    parser.add_argument("--observed-gib", type=float, default=None,
                        help="the memory outside the allocator to compare with (default: what the recorded cold "
                             "runs of guide 004 hold beyond the warm ones, per process: `cold_extra_from_baselines`)")
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error("--batch takes a positive count")
    if args.only is not None:
        try:
            re.compile(args.only)
        except re.error as exc:
            parser.error(f"--only {args.only!r}: not a regular expression ({exc})")
    if not Path(args.case).is_file():
        parser.error(f"--case {args.case}: no such file; give a case YAML such as {DEFAULT_CASE}")
    if card_compute(args.platform) is None:
        parser.error(f"--platform {args.platform}: its card is not in harness/measure/cards.json's compute table; "
                     "add its compute capability, multiprocessors, threads and shared memory there")
    if args.save and args.only is not None:
        parser.error("--save keeps the whole survey; leave out --only")
    return args


def cold_extra_from_baselines(baselines: Path = ROOT / "results" / "baselines") -> float | None:
    """GiB per process that the recorded runs of guide 004's GLA cases hold outside the allocator on a cold
    Triton cache beyond a warm one: the mean over finished runs of (card peak / processes - reserved), cold
    less warm. None where either kind of run is missing."""
    from harness.spec.cases import load_case

    outside: dict[str, list[float]] = {"cold": [], "warm": []}
    for path in sorted(baselines.glob("*/004-gla-*.json")):
        data = json.loads(path.read_text())
        case_file = ROOT / "cases" / f"{data['case_id']}.yaml"
        if not case_file.is_file():  # a fitted config's baseline: its processes are in its own case file
            continue
        procs = load_case(case_file).launch.procs_per_card
        for run in data.get("runs", []):
            if run.get("outcome") == "ok" and run.get("triton_cache") in outside and run.get("per_card_peak"):
                outside[run["triton_cache"]].append(run["per_card_peak"] / procs - run["reserved_peak"])
    if not outside["cold"] or not outside["warm"]:
        return None
    return (sum(outside["cold"]) / len(outside["cold"]) - sum(outside["warm"]) / len(outside["warm"])) / 2**30


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.observed_gib is None:
        args.observed_gib = round(cold_extra_from_baselines() or 0.0, 3)
    from harness.models.source import load_model
    from harness.spec.cases import load_case

    case = load_case(args.case)
    card = card_compute(args.platform)
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    result, rows = survey(case, args.batch, Target(card.sm, card.sms, card.shared_per_block, f"NVIDIA {card.name}"),
                          progress)
    shown = [r for r in rows if args.only is None or re.search(args.only, r["kernel"])]
    print(table(shown, card))
    threads = card.resident_threads
    grown = local_memory.growth_bytes(result.max_bytes_per_thread, threads) / GIB
    print(f"\n{'kernel':46} {'specs':>5} {'min B/thr':>9} {'max B/thr':>9}  config of the max")
    for name, k in per_kernel(shown).items():
        print(f"{name:46} {k['specializations']:>5} {k['min_bytes_per_thread']:>9} {k['max_bytes_per_thread']:>9}  "
              f"{k['max_config']}")
    print(f"\nTriton {result.triton}, sm_{card.sm}, {threads:,} resident threads: the most is {result.kernel} "
          f"[{result.config}] at {result.max_bytes_per_thread:,} B/thread; the predictor's cold-cache term "
          f"(grown above the default stack) {grown:.3f} GiB; the recorded cold runs held {args.observed_gib} GiB "
          f"beyond warm ones ({bytes_per_thread_for(args.observed_gib, threads):,.0f} B/thread)")
    summary = {**asdict(result), "platform": args.platform, "resident_threads": threads,
               "predicted_gib": round(grown, 4), "observed_gib": args.observed_gib}
    Path(args.out).write_text(json.dumps({"summary": summary, "rows": shown}, indent=1) + "\n")
    if args.save:
        key = local_memory.survey_key(case, dict(load_model(case.model).config), card, result.triton)
        path = local_memory.SURVEY_DIR / key.file_name()
        local_memory.write_survey(path, key, result)
        print(f"saved {path.relative_to(ROOT)}")
    return 1 if result.failed else 0


if __name__ == "__main__":
    sys.exit(main())
