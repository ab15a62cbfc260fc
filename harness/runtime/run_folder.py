"""The folder a run's reports go to when its user names none: a temporary one, taken back when the run
leaves nothing in it or is stopped.

`oom-harness run` without `--out`, and the pytest plugin without `--harness-run-dir`, write every
case's reports and logs under a fresh `oom-harness-*` folder of the temporary directory, and say
where at the end. A run refused at once (no case matched, a bad option), one that skipped every
case, and a pytest session that collected its cases and ran none left that folder behind empty, one
per run; a run stopped by SIGTERM or Ctrl-C left a half-written one. Now:

* a run that wrote nothing there removes the folder;
* a stopped run removes it, after its background runs have ended (`launcher.settle`): what the
  killed jobs wrote is no result;
* a run that measured keeps it, and says where it is.

A folder the user named is theirs: it is never removed.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

PREFIX = "oom-harness-"


class RunFolder:
    def __init__(self, given: str | Path | None):
        self.temporary = not given
        self.path = Path(tempfile.mkdtemp(prefix=PREFIX)) if self.temporary else Path(given)

    def close(self, stopped: bool = False) -> None:
        """Take a temporary folder back: always after a stop, else where nothing was written in it."""
        if not self.temporary or not self.path.exists():
            return
        if stopped:
            from harness.runtime.launcher import settle

            settle()
            shutil.rmtree(self.path, ignore_errors=True)
            return
        with contextlib.suppress(OSError):  # not empty: the run's reports, which it said where to find
            self.path.rmdir()


@contextlib.contextmanager
def run_folder(given: str | Path | None) -> Iterator[Path]:
    """The run's folder (`given`, else a temporary one) for the block, taken back as `RunFolder.close` says."""
    folder = RunFolder(given)
    stopped = False
    try:
        yield folder.path
    except KeyboardInterrupt:  # harness.runtime.stopping.Stopped, or Ctrl-C
        stopped = True
        raise
    finally:
        folder.close(stopped)
