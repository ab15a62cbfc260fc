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
    bl.add_argument("--case-dir", action="append", default=[],
                    help="a folder of case files the runs belong to (repeatable; the bundled suite is searched last)")
    bl.add_argument("--baselines-dir", help="the folder of baselines to write (default: the bundled results/baselines)")
    bl.add_argument("--append", action="store_true",
                    help="add the runs as further repetitions of existing baselines (same platform and software)")
    bl.add_argument("--replace", action="store_true",
                    help="replace existing baselines with these runs (without it, an existing baseline is refused)")
    bl.set_defaults(func=run)


def run(args) -> int:
    from harness.baselines.store import RESULTS_DIR, bless

    if args.append and args.replace:
        print("bless: --append adds to a baseline, --replace writes it anew; pass one of them", file=sys.stderr)
        return 2
    from harness.spec.outputs import check_name

    # '' is refused, not read as the default: it would write into the bundled results/baselines
    root = check_name(args.baselines_dir, "--baselines-dir") if args.baselines_dir is not None else RESULTS_DIR
    # a BlessError or a WriteError is bad input: main answers it with one line and exit 2
    paths = bless([Path(r) for r in args.runs], driver=args.driver, note=args.note or "", append=args.append,
                  root=root, case_dirs=[Path(d) for d in args.case_dir], replace=args.replace)
    for path in paths:
        print(f"wrote {path}")
    return 0
