"""One harness at a time on a card: a lock per accelerator, so no two harnesses measure one card at once.

Two harnesses on one GPU (two CI jobs on one runner, an engineer's `pytest -m gpu` while the
nightly job runs) would each measure the other's memory and time, and each other's out-of-memory
errors would read as the configs'. A harness takes the lock of every card it can see before its
first full-size run and keeps it until it exits. Tiny runs take none: their figures are byte counts
of each process's own tensors, which another process does not change, many run at once by design,
and a tiny suite on a GPU host (a test suite starting harnesses within harnesses) would refuse
itself. A tiny run beside a full-size one on the same card still takes some of its memory, which the
full-size run's start records (harness.measure.records.CaseRun.card_shortfall).

The lock is an `flock` on one file per card in a folder every user of the host shares
(`HARNESS_LOCK_DIR`, default /tmp/oom-harness-locks). The kernel releases it when its holder exits,
however it exits: a harness killed with SIGKILL leaves the file, unlocked, and the next harness
takes it at once. The file names its holder (pid, command, since when) for the message of the
harness that finds it taken. Cards are named by NVML's UUID where it is installed, else by their
index (CUDA_VISIBLE_DEVICES may renumber them; its indices are read in PCI bus order, which is
CUDA's order among identical cards).

A harness may run under another that holds its cards for it: `oom-harness compare --resident` takes the
cards, then starts its two arms' harnesses at once, each training only while the other waits
(harness.runtime.turns). It passes them the descriptors that hold the locks, named in `INHERITED_ENV`
(`key=fd,...`); a harness counts a card as its own where such a descriptor is open on that card's lock
file (the same open file holds the same `flock`), and takes it as usual otherwise.

A harness that finds a card taken refuses at once: each full-size run is a `card_busy` failure
that names the holder. `--wait-for-card SECONDS` (pytest: `--harness-wait-for-card`) waits that
long instead, saying once whom it waits for. Harnesses in containers that share a GPU but not /tmp
do not see each other's locks; the free memory each run records at its start still shows the
other (harness.measure.records.CaseRun.card_shortfall).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import threading
import time
from pathlib import Path

LOCK_DIR_ENV = "HARNESS_LOCK_DIR"
INHERITED_ENV = "HARNESS_CARD_LOCK_FDS"
POLL_S = 0.5


class CardBusy(RuntimeError):
    """A card is being measured by another harness."""


def lock_dir() -> Path:
    path = Path(os.environ.get(LOCK_DIR_ENV) or "/tmp/oom-harness-locks")
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # shared by every user of the host, as /tmp is
            path.chmod(0o1777)
    return path


def _nvml_uuid(index: int) -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
        return uuid.decode() if isinstance(uuid, bytes) else uuid
    except Exception:  # no NVML (ROCm, nvidia-ml-py missing): the index names the card
        return None


def card_keys(platform: str, count: int) -> list[str]:
    """A name for each card this process can see, stable across processes that see it differently
    (none on a host without accelerators, where no full-size run is made)."""
    if platform == "cpu" or count == 0:
        return []
    visible = (os.environ.get("CUDA_VISIBLE_DEVICES") if platform == "cuda" else
               os.environ.get("HIP_VISIBLE_DEVICES") or os.environ.get("CUDA_VISIBLE_DEVICES"))
    entries = [e.strip() for e in visible.split(",") if e.strip()] if visible else [str(i) for i in range(count)]
    keys = []
    for entry in entries[:count]:
        if not entry.isdigit():  # GPU-<uuid> or MIG-<uuid> already
            keys.append(entry)
            continue
        uuid = _nvml_uuid(int(entry)) if platform == "cuda" else None
        keys.append(uuid or f"{platform}{entry}")
    return keys


def _holder() -> str:
    command = " ".join(sys.argv)[:200] or sys.executable
    return f"pid {os.getpid()} ({command}) since {time.strftime('%Y-%m-%d %H:%M:%S')}"


_HELD: dict[str, int] = {}  # card -> the descriptor holding its flock, for the whole process
_GUARD = threading.Lock()  # the session's threads take cards one at a time: two descriptors of one process conflict


def _try(key: str) -> str | None:
    """Take one card's lock: None when taken, else who holds it."""
    path = _lock_path(key)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    with contextlib.suppress(OSError):  # another user's harness must be able to open it too
        os.fchmod(fd, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        try:
            return path.read_text().strip() or "another process"
        except OSError:
            return "another process"
    os.ftruncate(fd, 0)
    os.write(fd, _holder().encode())
    _HELD[key] = fd
    return None


def take(keys: list[str], wait_s: float = 0.0, say=None) -> None:
    """Hold every card of `keys` for this process (one process is one harness: a card it holds
    already is not taken again). Cards are taken in sorted order, so two harnesses never hold one
    each and wait for the other's. `wait_s` 0 refuses at once; otherwise wait up to `wait_s`
    seconds, and `say` hears once whom for. Raises CardBusy naming the holder and the option."""
    with _GUARD:
        _take(keys, wait_s, say)


def _lock_path(key: str) -> Path:
    return lock_dir() / f"card-{key}.lock"


def _inherited() -> None:
    """Count as held the cards whose lock a parent harness passed down open (`INHERITED_ENV`)."""
    for item in filter(None, os.environ.get(INHERITED_ENV, "").split(",")):
        key, _, fd_text = item.rpartition("=")
        if not key or key in _HELD or not fd_text.isdigit():
            continue
        fd = int(fd_text)
        try:
            opened, on_disk = os.fstat(fd), _lock_path(key).stat()
        except OSError:  # not open in this process, or no such lock file: take the card as usual
            continue
        if (opened.st_dev, opened.st_ino) == (on_disk.st_dev, on_disk.st_ino):
            _HELD[key] = fd


def pass_down() -> tuple[dict[str, str], tuple[int, ...]]:
    """The environment and descriptors that let a child harness use the cards this process holds."""
    return {INHERITED_ENV: ",".join(f"{key}={fd}" for key, fd in sorted(_HELD.items()))}, tuple(_HELD.values())


def _take(keys: list[str], wait_s: float, say) -> None:
    _inherited()
    deadline = time.monotonic() + wait_s
    said = False
    for key in sorted(set(keys) - set(_HELD)):
        while (holder := _try(key)) is not None:
            if time.monotonic() >= deadline:
                waited = f" after waiting {wait_s:.0f} s" if wait_s else ""
                raise CardBusy(f"card {key} is being measured by another harness, {holder}{waited}; "
                               "wait for it to finish, or pass --wait-for-card SECONDS "
                               "(pytest: --harness-wait-for-card) to wait for it")
            if say is not None and not said:
                say(f"card {key} is being measured by another harness, {holder}: waiting up to {wait_s:.0f} s")
                said = True
            time.sleep(POLL_S)


def held() -> set[str]:
    return set(_HELD)


def release() -> None:
    """Let other harnesses take the cards this process holds (its exit does it too)."""
    with _GUARD:
        for fd in _HELD.values():
            with contextlib.suppress(OSError):
                os.close(fd)  # closing the only descriptor releases the flock
        _HELD.clear()
