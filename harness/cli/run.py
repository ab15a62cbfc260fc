"""`oom-harness run`: run cases at a fidelity, judge them, print the summary table.

    oom-harness run                    every case at tiny size (on a GPU host: --fidelity real)
    oom-harness run -k 003 --json out.json

Exit codes: 0 every verdict holds, 1 a verdict failed, 2 bad input (an invalid case file is named
and skipped, the valid cases still run; bad options are refused before any case runs).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from harness.cli.arguments import positive_int
from harness.models.inputs import InputError
from harness.pytest_plugin.options import add_run_options
from harness.spec.cases import CASES_DIR
from harness.spec.files import WriteError, check_writable, os_reason, write_atomic
from harness.spec.outputs import check_name, check_output

MAX_SHARDS = 1024  # slices, one per GPU: far above any host


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("run", help="run cases and print a summary table")
    p.add_argument("--fidelity", choices=["tiny", "real"], default="tiny")
    p.add_argument("-k", action="append", help="run only cases whose id contains this (repeatable)")
    p.add_argument("--json", help="also write every run and verdict to this JSON file")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --json, --benchmark-json or --html report (without it, they are refused "
                        "before any case runs)")
    p.add_argument("--variant", action="append",
                   help="measure under a variant instead of judging: '2r' (ranks), '8L' (layers), '2ga' "
                        "(grad accum cap), combined '2r8L2ga'; repeatable")
    p.add_argument("--select", choices=["all", "single", "multi"], default="all",
                   help="only single-rank or only multi-rank cases")
    p.add_argument("--shard", help="K/N: the K-th of N slices of the selected cases (one per GPU)")
    p.add_argument("--repeat", type=positive_int, default=1, help="repetitions of each full-size run (for the spread)")
    add_run_options(p.add_argument, "cli")  # the options pytest takes too (harness.pytest_plugin.settings)
    p.set_defaults(func=run)


def _write_json(path: Path, session) -> bool:
    """Every run of the session (each variant and repetition), the judged ones with their verdicts. A
    failed write (a full disk) is said and returns False: the runs go on, their records stay in the
    run folder."""
    verdicts = {id(j.run): [v.__dict__ for v in j.verdicts] for j in session.judged()}
    entries = [{"case": r.case_id, "fidelity": r.fidelity, "variant": r.variant,
                "run": json.loads(r.model_dump_json()), "verdicts": verdicts.get(id(r), [])}
               for r in session.all_runs()]
    try:
        write_atomic(path, json.dumps(entries, indent=1))
        return True
    except WriteError as exc:
        print(f"run: --json {path} could not be written: {os_reason(exc)}; the runs go on, and each run's "
              f"record is in its folder under {session.run_root}", file=sys.stderr, flush=True)
        return False


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
        if not (k.isdigit() and n.isdigit() and int(k) < int(n) <= MAX_SHARDS):
            raise ValueError(f"'{shard}': write K/N with 0 <= K < N <= {MAX_SHARDS}, e.g. 0/8")
        slices: list[list[str]] = [[] for _ in range(int(n))]
        for members in sorted(_related(selected, session), key=lambda g: (-len(g), g[0])):
            min(slices, key=len).extend(members)
        selected = sorted(slices[int(k)])
    return selected


def _measure_line(run) -> str:
    from harness.baselines.store import figures_of
    from harness.spec.units import fmt_gib, fmt_mib

    f = figures_of(run, 1)
    size = fmt_mib if run.fidelity == "tiny" else fmt_gib
    rate = "-" if f.tokens_per_s_per_gpu is None else f"{f.tokens_per_s_per_gpu:,.0f} tokens/s/GPU"
    return f"{f.outcome}, peak {size(f.per_card_peak)} (worst process), {rate}"


def run(args) -> int:
    from harness.runtime.run_folder import run_folder

    _check_outputs(args)
    # the reports' folder: without --out a temporary one, removed where the run wrote nothing in it
    # or was stopped (SIGTERM, Ctrl-C: harness.runtime.stopping)
    with run_folder(args.out) as run_root:
        return _run(args, run_root)


def _run(args, run_root: Path) -> int:
    from harness.baselines.store import RESULTS_DIR, load_baselines

    args.case_dir = args.case_dir or str(CASES_DIR)  # the option's default: none, for pytest's sake
    if args.memory_history:
        from harness.runtime import memory_history

        memory_history.request()
    from harness.judge.session import Session, skip_reason
    from harness.report.progress import Progress, expected_time
    from harness.report.summary import FINDINGS_TITLE, consulted_line, findings, table, whole_card_line

    session = Session(case_dir=Path(args.case_dir), run_root=run_root, timeout_s=args.timeout, steps=args.steps,
                      full_depth=args.full_depth, grad_accum_cap=args.grad_accum_cap,
                      baseline_root=Path(args.baselines_dir) if args.baselines_dir else RESULTS_DIR,
                      wait_for_card_s=args.wait_for_card)
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
    json_written = True
    if args.selected_only:
        session.selected_only = {(cid, args.fidelity) for cid in selected}
    session.prefetch([(cid, args.fidelity) for cid in selected], args.jobs)
    progress = Progress()
    baselines = load_baselines(session.baseline_root) if args.fidelity == "real" else []  # for the expected times
    for i, cid in enumerate(selected, 1):
        case, _ = session.cases[cid]
        reason = skip_reason(case, args.fidelity, session.platform, session.accelerators)
        if reason:
            skipped.append((cid, reason))
            continue
        folder = run_root / args.fidelity
        with progress.case(f"[{i}/{len(selected)}] {cid} {args.fidelity}", folder, cid,
                           expected_time(cid, args.fidelity, folder, baselines)):
            j = session.judge(cid, args.fidelity)
        status = "FAILED" if j.failed else "ok"
        print(f"[{i}/{len(selected)}] {cid} {args.fidelity}: {status} ({j.run.wall_s:.1f} s)", flush=True)
        for rep in range(1, args.repeat):  # repetitions: the spread the tolerances come from
            for variant in session.plan(cid, args.fidelity):
                extra = session.run(cid, args.fidelity, variant, rep)
                print(f"    repetition {rep + 1}{variant.suffix}: {_measure_line(extra)}", flush=True)
        if args.json:  # rewritten after every case, so an interrupted run keeps what it measured
            json_written = _write_json(Path(args.json), session)
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
    if args.fidelity == "tiny" and judged:
        _print_full_size([j.case for j in judged], session.baseline_root)
    print(f"\n{len(judged)} cases in {time.monotonic() - started:.0f} s; reports in {run_root}")
    if args.html:
        json_written &= _write_html(args, session)
    if any(j.failed for j in judged):
        return 1
    # the valid cases ran; the invalid files, or the --json that could not be written, were named on stderr
    return 2 if session.errors or not json_written else 0


def _check_outputs(args) -> None:
    """Refuse, before any case runs, output files that could not be written after the runs (a missing
    folder, a folder named as the file, an empty or overlong name), that are not regular files (a device,
    a link), that are a case file, or that exist without --force: the runs would be lost, or clobber."""
    from harness.report.html.page import INDEX

    case_dir = Path(args.case_dir or CASES_DIR)
    if not case_dir.is_dir():
        raise InputError(None, "--case-dir", f"{args.case_dir} is not a folder", "name the folder of the case files")
    inputs = sorted(case_dir.glob("*.y*ml"))
    for flag, value in (("--json", args.json), ("--benchmark-json", args.benchmark_json)):
        if value is not None:
            check_writable(check_output(value, flag, force=args.force, inputs=inputs), flag)  # WriteError: exit 2
    if args.html is not None:
        if check_name(args.html, "--html").exists() and not Path(args.html).is_dir():
            raise InputError(None, "--html", f"{args.html} is a file", "name a folder for the report")
        check_output(Path(args.html) / INDEX, "--html", force=args.force)
    if args.out is not None and check_name(args.out, "--out").exists() and not Path(args.out).is_dir():
        raise InputError(None, "--out", f"{args.out} is a file", "name a folder for the reports")


def _write_html(args, session) -> bool:
    """`--html DIR`: the report of the runs just made (harness.report.html). A report that cannot be
    written is said on stderr; the runs and their verdicts stand."""
    from harness.report.html.build import report_runs

    ok, line = report_runs(Path(args.html), session.run_root, session.baseline_root, session.case_dir)
    print(line, file=sys.stdout if ok else sys.stderr, flush=True)
    return ok


def _print_full_size(cases, baselines_dir: Path) -> None:
    """Under a tiny run: each case's predicted full-size peak against its card, and its last baseline."""
    from harness.baselines.store import load_baselines
    from harness.report import full_size

    rows = full_size.full_size(cases, load_baselines(baselines_dir))
    print(f"\n{full_size.TITLE}:\n{full_size.table(rows)}")


def _measure_variants(args, session, selected: list[str], run_root: Path) -> int:
    """`--variant`: measure (no verdicts) each selected case under each variant, e.g. the depths
    of a depth extrapolation, for `oom-harness bless`."""
    from harness.spec.variants import parse_variant

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
                    failed |= not _write_json(Path(args.json), session)
    if args.benchmark_json:
        _write_benchmark(Path(args.benchmark_json), session)
    print(f"reports in {run_root}")
    return 1 if failed else 0


def _write_benchmark(path: Path, session) -> None:
    from harness.baselines.benchjson import write_benchmark_json

    try:
        n = write_benchmark_json(path, session.all_runs(),
                                 {cid: c.launch.procs_per_card for cid, (c, _) in session.cases.items()})
    except WriteError as exc:
        print(f"run: --benchmark-json {exc}", file=sys.stderr)
        return
    print(f"wrote {n} benchmarks in pytest-benchmark's format to {path}")
