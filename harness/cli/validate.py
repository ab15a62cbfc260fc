"""`oom-harness validate`: check case files against the schema; exit 2 naming each problem.

A claim that names another case (`lower_peak_than`) must name a case file of the same folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

from harness.models.inputs import InputError
from harness.spec.cases import CASES_DIR, CaseError, load_case


def add_parser(subparsers) -> None:
    val = subparsers.add_parser("validate", help="check case files")
    val.add_argument("paths", nargs="*")
    val.set_defaults(func=run)


def _references(case, path: Path) -> list[str]:
    """The other cases this case's claims name that have no file beside it."""
    known = {p.stem for p in path.parent.glob("*.yaml")}
    return [f"claims: {claim.kind} names case '{ref}', which has no file {ref}.yaml in {path.parent}"
            for claim in case.claims if (ref := getattr(claim, "case", None)) is not None and ref not in known]


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
            case = load_case(path)
            problems = _references(case, path)
            if problems:
                raise CaseError(path, tuple(problems))
            print(f"ok       {path}")
        except CaseError as exc:
            bad += 1
            print(str(exc), file=sys.stderr)
    print(f"{len(paths) - bad} valid, {bad} invalid")
    return 2 if bad else 0
