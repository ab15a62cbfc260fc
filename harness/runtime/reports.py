"""A rank's report written whole or not at all, and what a worker says when it cannot write it.

A report is written to a temporary file and renamed, so a reader never meets half of one. On a full
disk or an unwritable folder the worker says so on stderr (the case's log) and exits with
`EXIT_NO_REPORT`, which tells the launcher also when the log itself is on the full disk: the case
is then a `write_error`, not a crash of the config.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from harness.spec.files import os_reason, write_atomic

EXIT_NO_REPORT = 5
REPORT_NOT_WRITTEN = "[harness.runtime.worker] could not write its report"  # the line the launcher looks for


def write_report(report, path: Path) -> bool:
    """Write a rank's report whole or not at all (a temporary file, then a rename). A full disk or
    an unwritable folder is said on stderr, the case's log, and returns False: the exit code then
    tells the launcher, also where the log is on the same full disk."""
    try:
        write_atomic(path, report.model_dump_json(indent=1))
        return True
    except OSError as exc:  # WriteError: the temporary file is gone and no half report is left
        with contextlib.suppress(OSError):
            print(f"{REPORT_NOT_WRITTEN} {path}: {os_reason(exc)}", file=sys.stderr, flush=True)
        return False
