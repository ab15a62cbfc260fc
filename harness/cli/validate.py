"""`oom-harness validate`: check case files against the schema; exit 2 naming each problem.

A claim that names another case (`lower_peak_than`) must name a case file of the same folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

from harness.models.inputs import InputError
from harness.spec.cases import CASES_DIR, CaseError, case_files, load_case


def add_parser(subparsers) -> None:
    val = subparsers.add_parser("validate", help="check case files")
    val.add_argument("paths", nargs="*")
    val.set_defaults(func=run)


def run(args) -> int:
    paths: list[Path] = []
    for p in args.paths or [str(CASES_DIR)]:
        path = Path(p)
        paths += sorted(path.glob("*.yaml")) if path.is_dir() else [path]
    empty = [p for p in args.paths if Path(p).is_dir() and not any(Path(p).glob("*.yaml"))]
    if empty:
        raise InputError(empty[0], None, "holds no case file (*.yaml)", "name a folder of case files, or the files")
    bad = 0
    for path in paths:
        try:
            _refers_to_known_cases(path, load_case(path))
            print(f"ok       {path}")
        except CaseError as exc:
            bad += 1
            print(str(exc), file=sys.stderr)
    print(f"{len(paths) - bad} valid, {bad} invalid")
    return 2 if bad else 0


def _refers_to_known_cases(path: Path, case) -> None:
    """A claim naming another case (`lower_peak_than`) names one in the case file's own folder, the folder
    `oom-harness run --case-dir` and pytest read it from; CaseError otherwise."""
    known = {p.stem for p in case_files(path.parent)}
    problems = tuple(f"claims.{i}.case: {claim.kind} names case '{claim.case}', which is not in {path.parent}; "
                     "write the id of a case file in that folder"
                     for i, claim in enumerate(case.claims)
                     if getattr(claim, "case", None) is not None and claim.case not in known)
    if problems:
        raise CaseError(path, problems)
