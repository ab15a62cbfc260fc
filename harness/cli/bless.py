"""`oom-harness bless`: write or extend baselines from the JSON of full-size runs."""

from __future__ import annotations

import sys
from pathlib import Path


def add_parser(subparsers) -> None:
    bl = subparsers.add_parser("bless", help="write or refresh baselines from a `run --fidelity real --json` file")
    bl.add_argument("runs", nargs="+", help="`run --fidelity real --json` files, run.json files, or run folders "
                                           "(pytest --harness-run-dir): one baseline per case and variant")
    bl.add_argument("--driver", help="the GPU driver version, where the reports lack it")
    bl.add_argument("--note", help="a line of provenance kept with the baselines")
    bl.add_argument("--append", action="store_true",
                    help="add the runs as further repetitions of existing baselines (same platform and software)")
    bl.set_defaults(func=run)


def run(args) -> int:
    from harness.baselines.store import BlessError, bless

    try:
        paths = bless([Path(r) for r in args.runs], driver=args.driver, note=args.note or "", append=args.append)
    except BlessError as exc:
        print(f"bless: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(f"wrote {path}")
    return 0
