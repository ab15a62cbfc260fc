"""`oom-harness fit`: from a config that runs out of memory to the fastest config predicted to fit.

    oom-harness fit train.yaml --gpu-memory 64GiB --gpus 8 --out fitted/
    oom-harness fit args.json --gpu-memory 16GB --gpus 1 --out fitted/ --allow cutoff,rank --json

Searches the knobs that keep the training the same (and, with --allow, those that change it), keeps
the candidates `check`'s verdict says fit, ranks them by predicted tokens/s, writes the best one into
--out in the input's own format and checks the written files again as `check` would. Exit codes: 0 a
fitting config was written; 1 none fits, or none was found within --search-seconds (the closest is
named, with how far it is over); 2 bad input; 3 an internal error. `--verify` runs the written config
at full size on this host's GPU through `oom-harness run` (a GPU host only) and sets what it measured
against the prediction (`harness.fit.verified`; `--json`: `verified`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import replace
from pathlib import Path

from harness.cli.arguments import layer_counts, seconds
from harness.cli.check import add_job_arguments, spec_from_args
from harness.fit.knobs import ALLOWABLE, knobs_of
from harness.fit.search import DEADLINE_S, Candidate, Search, search
from harness.fit.writer import ALLOC_ENV, OverwriteError, Written, fit_inputs, plan_outputs, write_fitted
from harness.premerge.check import CheckResult, PredictFn, as_json, run_check
from harness.premerge.importers import ConfigError, ConfigFormat
from harness.spec.files import WriteError
from harness.spec.outputs import Outputs, check_name
from harness.spec.units import fmt_gib, gib_rounded

EXIT_OK, EXIT_NONE_FITS, EXIT_BAD_INPUT = 0, 1, 2
VERIFY_JSON = "verify.json"  # --verify: the run's record, in --out


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("fit", help="find the fastest config predicted to fit the cards, and write it")
    add_job_arguments(p)
    p.add_argument("--out", required=True, help="folder for the fitted config (the input files are never changed)")
    p.add_argument("--force", action="store_true",
                   help="replace fitted files of the same names already in --out (without it, they are refused)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--allow", type=_allow, default=frozenset(),
                   help=f"also change what is trained: a comma-separated list of {', '.join(ALLOWABLE)} "
                        "(4-bit base weights, a shorter cutoff, a lower LoRA rank)")
    p.add_argument("--verify", action="store_true",
                   help="run the fitted config at full size on this host's GPU (oom-harness run --fidelity real)")
    p.add_argument("--depth-points", type=layer_counts, metavar="L1,L2",
                   help="with --verify: measure at these layer counts and extrapolate to the full depth (a model "
                        "this host cannot hold, or not in reasonable time; on fewer GPUs than the config's, the "
                        "ranks are capped too), e.g. 4,8")
    p.add_argument("--search-seconds", type=seconds, default=DEADLINE_S, metavar="S",
                   help=f"stop the walk over candidates after S seconds with what fits so far (default "
                        f"{DEADLINE_S:g}; a slow or busy host on a cold cache may need more)")
    p.set_defaults(func=run)


def _allow(text: str) -> frozenset[str]:
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(names - set(ALLOWABLE))
    if unknown:
        raise argparse.ArgumentTypeError(f"'{unknown[0]}' is not a knob fit may change; use {', '.join(ALLOWABLE)}")
    return names


class NoGpuError(RuntimeError):
    """--verify on a host without a GPU."""


def _require_gpu() -> None:
    from harness.runtime.platform import accelerator_count

    if accelerator_count() == 0:
        raise NoGpuError("--verify runs the fitted config on this host's GPU, and this host has none (torch sees no "
                         "CUDA or ROCm device). Fix: run fit without --verify here, and `oom-harness run --fidelity "
                         "real --case-dir DIR` on a GPU host with the case fit writes there")


def run(args, predict: PredictFn | None = None) -> int:
    try:
        if args.depth_points and not args.verify:
            raise ConfigError(None, "--depth-points", "is what --verify measures at, and --verify is not given",
                              "add --verify, or leave --depth-points out")
        if args.verify:
            _require_gpu()
        return _fit(args, predict)
    except (ConfigError, OverwriteError, NoGpuError, WriteError) as exc:  # WriteError: an output refused or unwritable
        if args.json:
            print(json.dumps({"error": str(exc)}))
        print(f"oom-harness fit: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _predictor(predict: PredictFn | None) -> PredictFn:
    if predict is not None:
        return predict
    from harness.predict.predictor import predict as real

    return real


def _fit(args, predict: PredictFn | None) -> int:
    spec = spec_from_args(args)
    out = check_name(args.out, "--out")
    if out.exists() and not out.is_dir():
        raise ConfigError(out, "--out", "is a file, not a folder", "name a folder for the fitted config")
    base = run_check(args.config, spec, platform=args.platform, predict=predict)
    imported = base.config
    if imported.training.format == ConfigFormat.case:
        raise ConfigError(imported.training.path, None, "is a harness case file; fit writes training configs",
                          "pass the LLaMA-Factory YAML or TrainingArguments JSON the case was made from")
    if base.prediction is None:
        raise ConfigError(imported.training.path, None, f"cannot be predicted: {imported.unpredictable}",
                          "change the settings the lint names, then run fit again")
    raising = [n for n in imported.not_modelled if n.raises]
    if raising:  # no candidate could be called fitting: say why rather than "no config fits"
        raise ConfigError(raising[0].path, raising[0].key, f"is read but not modelled ({raising[0].why}), and it "
                          "can raise the peak: fit cannot call any change fitting",
                          "remove it to fit the rest, or measure the job with it on a card")
    if args.depth_points:  # before the search, not after it when --verify writes the case
        from harness.premerge.case_writer import check_depth_points

        check_depth_points(args.depth_points, imported.arch.layers)
    # every output named and checked before the search; all of them taken back if fit fails after writing
    with Outputs(force=args.force, inputs=fit_inputs(imported, spec.script)) as outputs:
        plan_outputs(imported, out, outputs, spec.script)
        if args.verify:
            outputs.file(out / VERIFY_JSON, "--verify's record of the run")
        found = search(base, args.allow, _predictor(predict), platform=args.platform, deadline_s=args.search_seconds)
        if found.best is None:
            _report_none(found, args.json, args.allow)
            return EXIT_NONE_FITS
        written = write_fitted(imported, knobs_of(imported.case), found.best.knobs, out,
                               deepspeed_arg=spec.deepspeed, alloc_env=ALLOC_ENV not in imported.case.launch.env,
                               outputs=outputs)
        recheck = run_check(written.config, replace(spec, deepspeed=written.deepspeed if spec.deepspeed else None),
                            platform=args.platform, predict=predict)
        if recheck.fits != found.best.fits or recheck.card_peak != found.best.result.card_peak:
            raise RuntimeError(f"the written config {written.config} checks as {recheck.verdict} with "
                               f"{fmt_gib(recheck.card_peak)} per card, but the search predicted "
                               f"{fmt_gib(found.best.result.card_peak)}")
    verified = _verify(written, spec, out, args) if args.verify else None
    measured = None
    if verified is not None and (out / VERIFY_JSON).is_file():
        from harness.fit.verified import read_verified

        measured = read_verified(out / VERIFY_JSON, recheck, found.best.tokens_per_s, out / "case")
    if args.json:
        print(json.dumps(_as_json(found, written, recheck) | ({"verified": measured.as_json()} if measured else {}),
                         indent=1))
    else:
        print("\n".join([_table(found, written), *(["", *measured.lines()] if measured else [])]))
    return EXIT_OK if verified in (None, 0) else verified


def _verify(written: Written, spec, out: Path, args) -> int:
    """The fitted config as a case, run at full size through `oom-harness run` (its card emulated)."""
    from harness.cli import run as run_command
    from harness.premerge.case_writer import write_case

    case_dir = out / "case"
    write_case(written.config, replace(spec, deepspeed=written.deepspeed if spec.deepspeed else None), case_dir,
               force=True, platform=args.platform, depth_points=args.depth_points)
    parser = argparse.ArgumentParser(prog="oom-harness")
    run_command.add_parser(parser.add_subparsers(dest="command"))
    run_args = parser.parse_args(["run", "--fidelity", "real", "--case-dir", str(case_dir), "--out", str(out / "runs"),
                                  "--json", str(out / VERIFY_JSON), *(["--force"] if args.force else [])])
    # --json: stdout holds the one JSON object, so the run's table goes to stderr
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        return run_command.run(run_args)


# --- output -----------------------------------------------------------------------------------------


def _knobs_text(c: Candidate) -> str:
    k = c.knobs
    gc = ("GC " + ("reentrant" if k.reentrant else "non-reentrant")) if k.checkpointing else "no GC"
    ds = "no DeepSpeed" if k.stage is None else f"ZeRO-{k.stage}" + (
        "+opt offload" if k.offload_optimizer else "") + ("+param offload" if k.offload_param else "") + (
        " (pageable)" if (k.offload_optimizer or k.offload_param) and not k.pin_memory else "")
    extra = [f"cutoff {k.seq_len}", f"r {k.lora_r}" if k.lora_r else "", "4-bit" if k.four_bit else ""]
    return f"mb {k.micro_batch} x GA {k.grad_accum}, {gc}, {ds}, " + ", ".join(e for e in extra if e)


def _candidate_json(c: Candidate) -> dict:
    p = c.result.prediction
    return {"knobs": _knobs_text(c), "tokens_per_s": round(c.tokens_per_s, 1),
            "card_peak_gib": gib_rounded(c.result.card_peak), "budget_gib": gib_rounded(c.result.budget),
            "peak_allocated_gib": gib_rounded(p.allocated), "peak_reserved_gib": gib_rounded(p.reserved),
            "device_peak_gib": gib_rounded(p.device)} | ({"tokens_per_s_note": c.note} if c.note else {})


def _search_json(found: Search) -> dict:
    return {"candidates": found.considered, "predicted": found.predicted, "screened_out": found.screened_out,
            "seconds": round(found.seconds, 2), "stopped_early": found.stopped_early,
            "throughput_constants": {k: float(f"{v:.4g}") for k, v in found.throughput.values.items()},
            "throughput_fitted_on": found.throughput.fitted_on,
            "throughput_platform": found.throughput.platform, "throughput_source": found.throughput.source,
            "throughput_notes": found.throughput.notes, "zero_offload_not_searched": found.offload_not_searched}


def _as_json(found: Search, written: Written, recheck: CheckResult) -> dict:
    best = found.best
    return {
        "fits": True,
        "changes": [c.as_list() for c in written.changes],
        "predicted": _candidate_json(best),
        "predicted_tokens_per_s": round(best.tokens_per_s, 1),
        "input": {"fits": found.base.fits, "card_peak_gib": gib_rounded(found.base.card_peak),
                  "predicted_tokens_per_s": round(found.base_tokens_per_s, 1)},
        "files": [str(f) for f in written.files],
        "removed": [str(f) for f in written.removed],
        "runners_up": [_candidate_json(c) for c in found.runners_up],
        "check": as_json(recheck),
        "search": _search_json(found),
    }


def _runners_table(found: Search) -> list[str]:
    if not found.runners_up:
        return []
    lines = ["", "runners-up:", f"  {'tokens/s':>9}  {'per card':>10}  knobs"]
    for c in found.runners_up:
        lines.append(f"  {c.tokens_per_s:>9.0f}  {fmt_gib(c.result.card_peak):>10}  {_knobs_text(c)}")
    return lines


def _verdict_word(verdict: str) -> str:
    """check's verdict inside a sentence: its capitalised head lowered, the figures (GiB) as they are."""
    head, sep, rest = verdict.partition(" (")
    return head.lower() + sep + rest


def _table(found: Search, written: Written) -> str:
    base, best = found.base, found.best
    lines = [
        f"{base.config.training.path}: {_verdict_word(base.verdict)}, {fmt_gib(base.card_peak)} per card predicted, "
        f"budget {fmt_gib(base.budget)}, about {found.base_tokens_per_s:.0f} tokens/s per card",
        f"fitted: {fmt_gib(best.result.card_peak)} per card predicted (budget {fmt_gib(best.result.budget)}), "
        f"about {best.tokens_per_s:.0f} tokens/s per card",
        f"  {_knobs_text(best)}",
        *([f"  {best.note}"] if best.note else []),
        "",
        "changes:",
    ]
    width = max((len(c.key) for c in written.changes), default=0)
    for c in written.changes:
        lines.append(f"  {c.key:<{width}}  {c.old!s} -> {c.new!s}")
        lines.append(f"  {'':<{width}}  why: {c.why}")
    lines += ["", "written:"] + [f"  {f}" for f in written.files]
    if written.removed:
        lines += ["removed (an earlier fit's, which this config does not name):"] + [f"  {f}" for f in written.removed]
    lines += _runners_table(found)
    lines += ["", f"searched {found.considered} candidates, predicted {found.predicted}, passed over "
              f"{found.screened_out} on a bound, in {found.seconds:.1f} s"
              + (" (stopped at the time limit)" if found.stopped_early else ""),
              f"tokens/s: {found.throughput.notes[-1]}"]
    return "\n".join(lines)


def _report_none(found: Search, as_json_output: bool, allowed: frozenset[str]) -> None:
    c = found.closest
    over = None if c is None else c.result.card_peak - c.result.budget
    if as_json_output:
        print(json.dumps({"fits": False, "changes": [], "files": [],
                          "closest": None if c is None else _candidate_json(c) | {"over_gib": gib_rounded(over)},
                          "input": {"fits": found.base.fits, "card_peak_gib": gib_rounded(found.base.card_peak)},
                          "search": _search_json(found)}, indent=1))
        return
    path = found.base.config.training.path
    if found.stopped_early:
        lines = [f"{path}: {found.cut_short()}; --search-seconds gives it longer"]
    else:
        lines = [f"{path}: no config fits ({found.considered} candidates searched, {found.predicted} predicted)"]
    if c is not None:
        lines.append(f"closest: {_knobs_text(c)}: {fmt_gib(c.result.card_peak)} per card predicted against a budget of "
                     f"{fmt_gib(c.result.budget)}, {fmt_gib(over)} over")
    left = [name for name in ALLOWABLE if name not in allowed]  # only what this search did not already try
    allow = f"--allow {','.join(sorted(allowed | set(left)))} (what is trained changes), " if left else ""
    lines.append(f"more room: {allow}more GPUs, or bigger cards")
    print("\n".join(lines))
