"""The command line: `oom-harness run` (cases and a summary table), `oom-harness validate`.

    oom-harness run                    every case at tiny size (on a GPU host: --fidelity real)
    oom-harness run -k 003 --json out.json
    oom-harness validate cases/        check case files; exit 2 with the problems
    oom-harness check llamafactory.yaml --gpu-memory 64GiB --gpus 8    pre-merge: does a config fit?

Exit codes: 0 all verdicts hold, 1 a case failed or a claim was refuted, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from harness.cases import CASES_DIR, CaseError, load_case
from harness.check import add_arguments as check_arguments
from harness.check import command as check_command


def _cmd_validate(args) -> int:
    paths: list[Path] = []
    for p in args.paths or [str(CASES_DIR)]:
        path = Path(p)
        paths += sorted(path.glob("*.yaml")) if path.is_dir() else [path]
    bad = 0
    for path in paths:
        try:
            load_case(path)
            print(f"ok       {path}")
        except CaseError as exc:
            bad += 1
            print(str(exc), file=sys.stderr)
    print(f"{len(paths) - bad} valid, {bad} invalid")
    return 2 if bad else 0


def _write_json(path: Path, session) -> None:
    """Every run of the session (each variant and repetition), the judged ones with their verdicts."""
    verdicts = {id(j.run): [v.__dict__ for v in j.verdicts] for j in session.judged()}
    entries = [{"case": r.case_id, "fidelity": r.fidelity, "variant": r.variant,
                "run": json.loads(r.model_dump_json()), "verdicts": verdicts.get(id(r), [])}
               for r in session.all_runs()]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries, indent=1))
    tmp.replace(path)


def _related(selected: list[str], session) -> list[list[str]]:
    """The selected cases in groups whose claims consult each other (a claim naming another case, a
    family's speed order): a group's cases run in one session, so a consulted case is run once."""
    group = {cid: cid for cid in selected}

    def root(cid):
        while group[cid] != cid:
            cid = group[cid]
        return cid

    def join(a, b):
        if a in group and b in group:
            group[root(a)] = root(b)

    by_family: dict[str, str] = {}
    for cid in selected:
        case = session.cases[cid][0]
        for claim in case.claims:
            if getattr(claim, "case", None):
                join(cid, claim.case)
        if case.family:
            join(cid, by_family.setdefault(case.family, cid))
    groups: dict[str, list[str]] = {}
    for cid in selected:
        groups.setdefault(root(cid), []).append(cid)
    return list(groups.values())


def _slice(selected: list[str], session, select: str, shard: str | None) -> list[str]:
    """`--select single|multi` and `--shard K/N`: one slice of the single-rank cases per GPU (each
    run pinned to its GPU with CUDA_VISIBLE_DEVICES), the multi-rank cases in a run of their own.
    Cases whose claims consult each other stay in one slice (`_related`), so no shard runs another
    shard's case again; the groups are dealt out largest first to the slice with the fewest cases."""
    def ranks(cid):
        return session.cases[cid][0].launch.ranks

    if select != "all":
        selected = [cid for cid in selected if (ranks(cid) == 1) == (select == "single")]
    if shard:
        k, _, n = shard.partition("/")
        if not (k.isdigit() and n.isdigit() and int(k) < int(n)):
            raise ValueError(f"'{shard}': write K/N with 0 <= K < N, e.g. 0/8")
        slices: list[list[str]] = [[] for _ in range(int(n))]
        for members in sorted(_related(selected, session), key=lambda g: (-len(g), g[0])):
            min(slices, key=len).extend(members)
        selected = sorted(slices[int(k)])
    return selected


def _measure_line(run) -> str:
    from harness.baselines import figures_of
    from harness.units import fmt_gib, fmt_mib

    f = figures_of(run, 1)
    size = fmt_mib if run.fidelity == "tiny" else fmt_gib
    rate = "-" if f.tokens_per_s_per_gpu is None else f"{f.tokens_per_s_per_gpu:,.0f} tokens/s/GPU"
    return f"{f.outcome}, peak {size(f.per_card_peak)} (worst process), {rate}"


def _cmd_run(args) -> int:
    from harness.session import Session, skip_reason
    from harness.summary import FINDINGS_TITLE, consulted_line, findings, table, whole_card_line

    run_root = Path(args.out or tempfile.mkdtemp(prefix="oom-harness-"))
    session = Session(case_dir=Path(args.case_dir), run_root=run_root, timeout_s=args.timeout, steps=args.steps,
                      full_depth=args.full_depth, grad_accum_cap=args.grad_accum_cap)
    for err in session.errors:
        print(str(err), file=sys.stderr)
    matched = [cid for cid in sorted(session.cases) if not args.k or any(k in cid for k in args.k)]
    if not matched:
        print("no case matches" + (f" {' or '.join(args.k)}" if args.k else f" (none in {args.case_dir})"),
              file=sys.stderr)
        return 2
    try:
        selected = _slice(matched, session, args.select, args.shard)
    except ValueError as exc:
        print(f"--shard: {exc}", file=sys.stderr)
        return 2
    if not selected:
        # Not an error: a runner with more GPUs than groups of related cases (the nightly job gives
        # each GPU a shard) has shards with nothing to run.
        kind = {"single": "single-rank ", "multi": "multi-rank ", "all": ""}[args.select]
        where = f" in shard {args.shard}" if args.shard else ""
        print(f"nothing to run: none of the {len(matched)} matching cases is a {kind}case{where}")
        return 0
    started = time.monotonic()
    if args.variant:
        return _measure_variants(args, session, selected, run_root)
    skipped = []
    if args.selected_only:
        session.selected_only = {(cid, args.fidelity) for cid in selected}
    session.prefetch([(cid, args.fidelity) for cid in selected], args.jobs)
    for i, cid in enumerate(selected, 1):
        case, _ = session.cases[cid]
        reason = skip_reason(case, args.fidelity, session.platform, session.accelerators)
        if reason:
            skipped.append((cid, reason))
            continue
        j = session.judge(cid, args.fidelity)
        status = "FAILED" if j.failed else "ok"
        print(f"[{i}/{len(selected)}] {cid} {args.fidelity}: {status} ({j.run.wall_s:.1f} s)", flush=True)
        for rep in range(1, args.repeat):  # repetitions: the spread the tolerances come from
            for variant in session.plan(cid, args.fidelity):
                extra = session.run(cid, args.fidelity, variant, rep)
                print(f"    repetition {rep + 1}{variant.suffix}: {_measure_line(extra)}", flush=True)
        if args.json:  # rewritten after every case, so an interrupted run keeps what it measured
            _write_json(Path(args.json), session)
    judged = session.judged()
    if args.benchmark_json:
        _write_benchmark(Path(args.benchmark_json), session)
    print()
    print(table(judged))
    consulted = session.consulted()
    if consulted:
        print(consulted_line(consulted, "--selected-only"))
    whole_card = session.whole_card()
    if whole_card:
        print(whole_card_line(whole_card))
    for cid, reason in skipped:
        print(f"skipped {cid}: {reason}")
    found = findings(judged)
    if found:
        print(f"\n{FINDINGS_TITLE.capitalize()}:\n" + found)
    print(f"\n{len(judged)} cases in {time.monotonic() - started:.0f} s; reports in {run_root}")
    failed = any(j.failed for j in judged) or bool(session.errors)
    return 1 if failed else 0


def _measure_variants(args, session, selected: list[str], run_root: Path) -> int:
    """`--variant`: measure (no verdicts) each selected case under each variant, e.g. the depths
    of a depth extrapolation, for `oom-harness bless`."""
    from harness.variants import parse_variant

    try:
        variants = [parse_variant(v) for v in args.variant]
        for cid in selected:
            for v in variants:
                v.apply(session.cases[cid][0])
    except ValueError as exc:
        print(f"--variant: {exc}", file=sys.stderr)
        return 2
    failed = False
    for cid in selected:
        for v in variants:
            for rep in range(args.repeat):
                run = session.run(cid, args.fidelity, v, rep)
                failed |= not run.ok
                print(f"{cid}{v.suffix} rep {rep + 1}: {_measure_line(run)} ({run.wall_s:.0f} s)", flush=True)
                if args.json:
                    _write_json(Path(args.json), session)
    if args.benchmark_json:
        _write_benchmark(Path(args.benchmark_json), session)
    print(f"reports in {run_root}")
    return 1 if failed else 0


def _write_benchmark(path: Path, session) -> None:
    from harness.benchjson import write_benchmark_json

    n = write_benchmark_json(path, session.all_runs(),
                             {cid: c.launch.procs_per_card for cid, (c, _) in session.cases.items()})
    print(f"wrote {n} benchmarks in pytest-benchmark's format to {path}")


def _stop_on_sigterm() -> None:
    """`timeout`, CI runners and job schedulers stop with SIGTERM: unwind, so running cases are killed."""
    import signal

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def _cmd_bless(args) -> int:
    from harness.baselines import BlessError, bless

    try:
        paths = bless([Path(r) for r in args.runs], driver=args.driver, note=args.note or "", append=args.append)
    except BlessError as exc:
        print(f"bless: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(f"wrote {path}")
    return 0


def _cmd_report(args) -> int:
    """The committed baselines as a table; with run files, those runs instead (a night's measurement,
    in the same table, blessed into a scratch folder), and the verdicts that failed in them."""
    from harness.baselines import BlessError, bless, load_baselines, report_markdown

    if not args.runs:
        print(report_markdown(load_baselines()))
        return 0
    paths = [Path(r) for r in args.runs]
    with tempfile.TemporaryDirectory(prefix="oom-harness-report-") as scratch:
        try:
            bless(paths, root=Path(scratch))
        except BlessError as exc:
            print(f"report: {exc}", file=sys.stderr)
            return 2
        table = report_markdown(load_baselines(Path(scratch)))
    print(f"Measured in {', '.join(map(str, paths))} (these runs, not the committed baselines):\n")
    print(table or "(no full-size run in them)")
    print("\nVerdicts that failed:\n" + ("\n".join(_failed_verdicts(paths)) or "none"))
    return 0


def _failed_verdicts(paths: list[Path]) -> list[str]:
    """The refuted verdicts kept in `run --json` files (run folders and run.json files hold none)."""
    from harness.verdicts import Verdict

    lines = []
    for path in paths:
        data = json.loads(path.read_text()) if path.is_file() else []
        for e in data if isinstance(data, list) else []:
            name = e["case"] + (f"@{e['variant']}" if e.get("variant") else "")
            lines += [f"- {name}: {Verdict(**v).line()}" for v in e.get("verdicts", []) if v["status"] == "refuted"]
    return lines


def main(argv=None) -> int:
    _stop_on_sigterm()
    parser = argparse.ArgumentParser(prog="oom-harness", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run cases and print a summary table")
    run.add_argument("--fidelity", choices=["tiny", "real"], default="tiny")
    run.add_argument("-k", action="append", help="run only cases whose id contains this (repeatable)")
    run.add_argument("--case-dir", default=str(CASES_DIR))
    run.add_argument("--out", help="folder for the reports (default: a temporary folder)")
    run.add_argument("--json", help="also write every run and verdict to this JSON file")
    run.add_argument("--timeout", type=float, default=900.0, help="seconds per case run")
    run.add_argument("--steps", type=int, default=None, help="optimizer steps per case run")
    run.add_argument("--variant", action="append",
                     help="measure under a variant instead of judging: '2r' (ranks), '8L' (layers), '2ga' "
                          "(grad accum cap), combined '2r8L2ga'; repeatable")
    run.add_argument("--select", choices=["all", "single", "multi"], default="all",
                     help="only single-rank or only multi-rank cases")
    run.add_argument("--shard", help="K/N: the K-th of N slices of the selected cases (one per GPU)")
    run.add_argument("--benchmark-json", help="write full-size throughput as pytest-benchmark JSON here")
    run.add_argument("--repeat", type=int, default=1, help="repetitions of each full-size run (for the spread)")
    run.add_argument("--grad-accum-cap", type=int, default=None,
                     help="full-size runs accumulate at most N micro steps (peaks do not change past 2; "
                          "saves time; labelled in every figure)")
    run.add_argument("--full-depth", action="store_true",
                     help="measure cases with depth_points at full depth (a host that holds them)")
    run.add_argument("--jobs", type=int, default=None,
                     help="training processes at once for tiny runs (default: one per CPU core)")
    run.add_argument("--selected-only", action="store_true",
                     help="run only the selected cases: a claim about another case (a fix's peak against its "
                          "failing config, a family's speed order) is not checkable instead of running it")
    run.set_defaults(func=_cmd_run)
    bl = sub.add_parser("bless", help="write or refresh baselines from a `run --fidelity real --json` file")
    bl.add_argument("runs", nargs="+", help="`run --fidelity real --json` files, run.json files, or run folders "
                                           "(pytest --harness-run-dir): one baseline per case and variant")
    bl.add_argument("--driver", help="the GPU driver version, where the reports lack it")
    bl.add_argument("--note", help="a line of provenance kept with the baselines")
    bl.add_argument("--append", action="store_true",
                    help="add the runs as further repetitions of existing baselines (same platform and software)")
    bl.set_defaults(func=_cmd_bless)
    rep = sub.add_parser("report", help="print the baselines (or the runs given) as a markdown table")
    rep.add_argument("runs", nargs="*", help="`run --fidelity real --json` files or run folders: report these "
                                              "runs and their failed verdicts instead of the committed baselines")
    rep.set_defaults(func=_cmd_report)
    val = sub.add_parser("validate", help="check case files")
    val.add_argument("paths", nargs="*")
    val.set_defaults(func=_cmd_validate)
    chk = sub.add_parser("check", help="pre-merge: predict whether a training config fits its cards, and lint it")
    check_arguments(chk)
    chk.set_defaults(func=check_command)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
