"""`oom-harness validate`: check case files against the schema; exit 2 naming each problem."""

from __future__ import annotations

import sys
from pathlib import Path

from harness.spec.cases import CASES_DIR, CaseError, load_case


def add_parser(subparsers) -> None:
    val = subparsers.add_parser("validate", help="check case files")
    val.add_argument("paths", nargs="*")
    val.set_defaults(func=run)


def run(args) -> int:
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
