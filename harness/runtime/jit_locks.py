"""JIT-build locks that nobody holds any more, removed before a case starts.

DeepSpeed builds its ops (cpu_adam, fused_adam) on first use through torch's cpp_extension, which
guards a build directory with a `lock` file (torch.utils.file_baton.FileBaton): the builder creates
it and keeps it open, everyone else polls until it disappears, silently and without a deadline.
A builder killed mid-build (a case's timeout, an OOM kill, Ctrl-C) leaves the file behind, and
every later run that needs the op hangs in `deepspeed.initialize` until its own timeout. That is
the hang DeepSpeed users meet as "stuck after loading the model" and cure by deleting
torch_extensions; here the harness removes exactly the locks no living process holds open.
"""

from __future__ import annotations

import time
from pathlib import Path

import psutil

LOCK_NAME = "lock"


def _held(paths: set[str]) -> set[str]:
    """Which of `paths` some process has open (processes we may not inspect are skipped)."""
    held: set[str] = set()
    for proc in psutil.process_iter():
        try:
            for f in proc.open_files():
                if f.path in paths:
                    held.add(f.path)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return held


def _unheld(locks: list[Path]) -> list[Path]:
    held = _held({str(p) for p in locks})  # one pass over the processes for all the locks
    return [p for p in locks if str(p) not in held]


def remove_stale(extensions_dir: Path, recheck_after_s: float = 0.5) -> list[Path]:
    """Remove the build locks under `extensions_dir` that no process holds; return them.

    A lock seen unheld is looked at again after `recheck_after_s`: a builder that is just
    releasing it closes the file before deleting it, and in that instant it looks abandoned."""
    if not extensions_dir.is_dir():
        return []
    # torch puts a build in <root>/<name>, older layouts in <root>/<py_cu>/<name>
    locks = [p for p in (*extensions_dir.glob(f"*/{LOCK_NAME}"), *extensions_dir.glob(f"*/*/{LOCK_NAME}"))
             if p.is_file()]
    if not locks:  # the usual case: no build under way; the walk over every process's files is skipped
        return []
    candidates = _unheld(locks)
    if not candidates:
        return []
    time.sleep(recheck_after_s)
    removed = []
    for lock in _unheld([p for p in candidates if p.exists()]):
        try:
            lock.unlink()
            removed.append(lock)
        except FileNotFoundError:  # released meanwhile
            pass
    return removed
