"""`oom-harness report`: the baselines, or a night's runs, as a markdown table."""

from __future__ import annotations

import json
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
    rep.set_defaults(func=run)


def run(args) -> int:
    """The committed baselines as a table; with run files, those runs instead (a night's measurement,
    in the same table, built in memory as `bless` would write them), and the verdicts that failed in
    them. Writes nothing."""
    from harness.baselines.store import baselines_of, load_baselines, sourced_runs
    from harness.report.markdown import report_markdown

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


def _failed_verdicts(paths: list[Path]) -> list[str]:
    """The refuted verdicts kept in `run --json` files (run folders and run.json files hold none)."""
    from harness.baselines.store import BlessError
    from harness.judge.verdicts import Verdict

    lines = []
    for path in paths:
        data = json.loads(path.read_text()) if path.is_file() else []
        for i, e in enumerate(data if isinstance(data, list) else []):
            try:
                name = e["case"] + (f"@{e['variant']}" if e.get("variant") else "")
                lines += [f"- {name}: {Verdict(**v).line()}" for v in e.get("verdicts", [])
                          if v["status"] == "refuted"]
            except (KeyError, TypeError, AttributeError) as exc:
                raise BlessError(f"{path}: entry {i} has a verdict record `oom-harness run --json` does not write "
                                 f"({type(exc).__name__}: {exc}); restore the file as the run wrote it") from None
    return lines
