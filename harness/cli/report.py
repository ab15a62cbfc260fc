"""`oom-harness report`: the verdict table (harness.report.verdicts: failures first), then the baselines,
or a night's runs, as a markdown table; with `--html DIR`, as a static page of plots
(harness.report.html) written into DIR and nowhere else. `--history DIR` adds the change points of the
runners' histories (harness.baselines.history)."""

from __future__ import annotations

from pathlib import Path

from harness.spec.suite import BASELINES_DIR, CASES_DIR


def add_parser(subparsers) -> None:
    rep = subparsers.add_parser("report", help="print the baselines (or the runs given) as a markdown table")
    rep.add_argument("runs", nargs="*", help="`run --fidelity real --json` files or run folders: report these "
                                              "runs and their failed verdicts instead of the committed baselines")
    rep.add_argument("--case-dir", default=str(CASES_DIR),
                     help="folder of the baselines' case files (default: the bundled suite)")
    rep.add_argument("--baselines-dir", default=str(BASELINES_DIR),
                     help="folder of baselines (default: the bundled suite's)")
    rep.add_argument("--html", metavar="DIR",
                     help="write the report as DIR/index.html (plots as inline SVG; opens from disk): the baselines, "
                          "the memory timelines and the runs given, instead of printing the table")
    rep.add_argument("--force", action="store_true",
                     help="with --html: replace an index.html already in DIR (without it, it is refused)")
    rep.add_argument("--history", metavar="DIR", default=None,
                     help="a folder of run histories (<runner>.jsonl; default: $HARNESS_HISTORY_DIR): show their "
                          "change points and series")
    rep.add_argument("--timelines-dir", default=None,
                     help="folder of memory timelines for --html (default: 'timelines' beside the baselines folder)")
    rep.set_defaults(func=run)


def run(args) -> int:
    """The committed baselines as a table; with run files, those runs instead (a night's measurement,
    in the same table, built in memory as `bless` would write them), and the verdicts that failed in
    them. Writes nothing."""
    from harness.baselines.store import baselines_of, load_baselines, sourced_runs
    from harness.report.html.inputs import read_inputs
    from harness.report.markdown import report_markdown, verdict_markdown
    from harness.report.verdicts import rows_of

    if args.html is not None:  # '' too: refused by write_html, not read as "no --html"
        return write_html(args)
    for path in map(Path, args.runs):
        if not path.exists():
            raise_missing(path)
    # the verdict table leads: what failed, what could not be checked, what passed
    inputs = read_inputs(Path(args.baselines_dir), Path(args.case_dir), [Path(r) for r in args.runs], [],
                         predict=False)
    verdicts = verdict_markdown(rows_of(inputs, history_shifts(args)))
    if verdicts:
        print(verdicts + "\n")
    if not args.runs:
        print(report_markdown(load_baselines(Path(args.baselines_dir)), Path(args.case_dir)))
        return 0
    paths = [Path(r) for r in args.runs]
    # every run its own baseline, whatever exists in results/: reported, never compared or written. A
    # BlessError (a run that cannot be read as a baseline) is bad input: main answers it with exit 2.
    case_dirs = [Path(args.case_dir)]
    table = report_markdown(list(baselines_of(sourced_runs(paths), replace=True, case_dirs=case_dirs).values()),
                            Path(args.case_dir))
    failed = _failed_verdicts(paths)
    print(f"Measured in {', '.join(map(str, paths))} (these runs, not the committed baselines):\n")
    print(table or "(no full-size run in them)")
    print("\nVerdicts that failed:\n" + ("\n".join(failed) or "none"))
    return 0


def raise_missing(path: Path):
    from harness.models.inputs import InputError

    raise InputError(path, None, "no such file or folder", "name a `run --json` file or a run folder")


def history_shifts(args) -> list:
    """The change points of every runner's history in `--history` (or $HARNESS_HISTORY_DIR)."""
    from harness.baselines.history import history_dir, read_all
    from harness.judge.changepoints import shifts

    folder = Path(args.history) if getattr(args, "history", None) else history_dir()
    if folder is None:
        return []
    return [s for entries in read_all(folder).values() for s in shifts(entries)]


def write_html(args) -> int:
    """`--html DIR`: the page, written whole into DIR (created where missing). A DIR that is a file or
    cannot be written, an index.html there without --force or that is not a regular file, or a run file
    that cannot be read, is bad input (exit 2)."""
    import importlib.util

    from harness.models.inputs import InputError
    from harness.report.html.build import build_report
    from harness.report.html.page import INDEX
    from harness.spec.outputs import Outputs, check_name

    if importlib.util.find_spec("matplotlib") is None:
        raise InputError(None, "--html", "the HTML report draws its plots with matplotlib, which is not installed",
                         "pip install 'oom-harness[report]' (or matplotlib) into this environment")
    folder = check_name(args.html, "--html")
    if folder.exists() and not folder.is_dir():
        raise InputError(None, "--html", f"{folder} is a file", "name a folder for the report")
    for path in map(Path, args.runs):
        if not path.exists():
            raise InputError(path, None, "no such file or folder", "name a `run --json` file or a run folder")
    timelines = [Path(args.timelines_dir)] if args.timelines_dir else None
    # the page checked and its folder made writable before the inputs are read; a failed build leaves no folder
    with Outputs(force=args.force, inputs=args.runs) as outputs:
        folder = outputs.folder(folder, "--html")
        outputs.file(folder / INDEX, "--html")
        page = outputs.record(build_report(folder, Path(args.baselines_dir), Path(args.case_dir),
                                           [Path(r) for r in args.runs], timelines, shifts=history_shifts(args)))
    print(f"wrote {page}")
    return 0


def _failed_verdicts(paths: list[Path]) -> list[str]:
    """The refuted verdicts kept in `run --json` files (run folders and run.json files hold none)."""
    from harness.report.html.inputs import verdicts_of
    from harness.report.markdown import md

    return [f"- {md(name)}: {md(v.line())}" for name, v in verdicts_of(paths) if v.status == "refuted"]
