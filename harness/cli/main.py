"""The command line: assembles one module per command (accelerate's `commands/` layout).

    oom-harness run | check | case-from | validate | bless | report

Exit codes: 0 all verdicts hold (or the config fits), 1 a case failed, a claim was refuted or a
config does not fit, 2 bad input.
"""

from __future__ import annotations

import argparse
import sys

from harness.cli import bless, case_from, check, report, run, validate

COMMANDS = (run, check, case_from, validate, bless, report)


def _stop_on_sigterm() -> None:
    """`timeout`, CI runners and job schedulers stop with SIGTERM: unwind, so running cases are killed."""
    import signal

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def main(argv=None) -> int:
    _stop_on_sigterm()
    parser = argparse.ArgumentParser(prog="oom-harness", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
