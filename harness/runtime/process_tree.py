"""Stopping a case's processes, all of them, and reading back where the hung ones were.

Killing a job's process group is not enough: torchrun starts each rank in a session of its own
(torch.distributed.elastic's subprocess handler passes `start_new_session=True`), so a timeout
that kills torchrun's group orphans the ranks, which go on holding the GPU the next case measures.
The tree is therefore collected through the parent links (psutil) before anything is killed.

Shortly before the launcher's deadline every worker dumps the Python stack of each of its threads
into a file of its own in the run's folder (`stacks-rank<R>[-slot<S>].txt`, appended to the case's
log after a timeout): `faulthandler.dump_traceback_later`, armed by `arm_stack_dump` from
`STACK_DUMP_ENV`. One file per rank is what lets a timeout say where each rank was: a collective
that hangs shows as one rank waiting in `all_reduce` and another somewhere else. The watchdog is
a C thread of the worker, so the dump needs neither the GIL nor a signal. (Asking the workers with
SIGUSR1 at the deadline printed nothing on an H100 host for ranks compiling Triton kernels; the
cause was not found.) `where_stuck` reads the innermost frames back, so a timeout names the line a run hung on.

Jobs run in sessions of their own, so nothing stops them when the harness itself is stopped
without a chance to clean up: `timeout` sends SIGTERM to its own process group only, and a SIGKILL
runs no handler. On an H100 a `timeout 575 pytest -m gpu` left a card-sharing case's ballast holding
54 GiB of the card for the next command. So the launcher names itself in `OWNER_ENV`, and every
worker and ballast exits once that process is gone (`exit_with_owner`).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import psutil

STACK_DUMP_ENV = "HARNESS_STACK_DUMP_AFTER_S"  # seconds after a worker's start
OWNER_ENV = "HARNESS_OWNER"  # "<pid>:<start time>" of the harness process that launched a job
EXIT_ORPHANED = 4


def owner() -> str:
    """This process as the owner of the jobs it starts (its start time guards against pid reuse)."""
    me = psutil.Process()
    return f"{me.pid}:{me.create_time()}"


def alive(owner_text: str) -> bool:
    """Whether the process `owner()` named is still running (not a later process given its pid)."""
    pid, _, started = owner_text.partition(":")
    try:
        return psutil.Process(int(pid)).create_time() == float(started)
    except (psutil.NoSuchProcess, ValueError):
        return False


def exit_with_owner(interval_s: float = 1.0, owner_text: str | None = None) -> threading.Thread | None:
    """Exit this process (code EXIT_ORPHANED) once the harness process that launched it is gone.
    A daemon thread checks every `interval_s`; nothing is watched when no owner is named."""
    owner_text = owner_text or os.environ.get(OWNER_ENV)
    if not owner_text:
        return None

    def watch():
        while alive(owner_text):
            time.sleep(interval_s)
        print(f"[harness] the harness process {owner_text.partition(':')[0]} that launched this one is gone: "
              "exiting, so the card is free for the next run", file=sys.stderr, flush=True)
        os._exit(EXIT_ORPHANED)

    thread = threading.Thread(target=watch, name="harness-owner-watch", daemon=True)
    thread.start()
    return thread


STACKS_GLOB = "stacks-rank*.txt"
_dump_file = None  # kept open for faulthandler's watchdog thread


def stack_file(out_dir: Path, rank: int, slot: int = 0) -> Path:
    return Path(out_dir) / (f"stacks-rank{rank}" + (f"-slot{slot}" if slot else "") + ".txt")


def arm_stack_dump(out_dir: Path, rank: int, slot: int = 0) -> Path | None:
    """Dump every thread's stack into this rank's stack file `STACK_DUMP_ENV` seconds from now
    (nothing is armed when the launcher set no deadline)."""
    global _dump_file
    after = os.environ.get(STACK_DUMP_ENV)
    if not after:
        return None
    path = stack_file(out_dir, rank, slot)
    path.parent.mkdir(parents=True, exist_ok=True)
    _dump_file = open(path, "w")  # faulthandler writes to it from its own thread, later
    faulthandler.dump_traceback_later(float(after), exit=False, file=_dump_file)
    atexit.register(_disarm, path)
    return path


def _disarm(path: Path) -> None:
    """At a normal exit: no dump is coming, and an empty stack file is no result."""
    faulthandler.cancel_dump_traceback_later()
    if _dump_file is not None:
        _dump_file.close()
    with contextlib.suppress(OSError):
        if path.stat().st_size == 0:
            path.unlink()


def where_ranks_stuck(out_dir: Path) -> list[tuple[str, str, str]]:
    """(who, where, dump) for every rank that dumped its stacks into the run's folder: who is
    'rank 1' or 'rank 0 slot 1', where as `where_stuck` reads it."""
    found = []
    for path in sorted(Path(out_dir).glob(STACKS_GLOB)):
        text = path.read_text(errors="replace")
        place = where_stuck(text)
        if place is None:
            continue
        rank, _, slot = path.stem.removeprefix("stacks-rank").partition("-slot")
        found.append((f"rank {rank}" + (f" slot {slot}" if slot else ""), place, text))
    return found


def stack_dump_after(timeout_s: float) -> float:
    """When a worker should dump its stacks: before the launcher kills it at `timeout_s`, with room
    for the later start of ranks behind torchrun or DeepSpeed's launcher (a few seconds)."""
    return max(1.0, timeout_s - min(15.0, timeout_s / 4))


def tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants (those still alive), parents first."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill(procs: list[psutil.Process], wait_s: float = 10.0) -> None:
    """SIGKILL every process given and every process group they lead, and wait until they are
    gone (so the next case finds the GPU free). Our own children are left for their Popen to
    reap: psutil reaping them would cost subprocess their exit codes."""
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    others = []
    for proc in procs:
        try:
            if proc.ppid() != os.getpid():
                others.append(proc)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(others, timeout=wait_s)


_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ .*\(most recent call first\):$")
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def _short(path: str) -> str:
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    if "/harness/" in path:  # the harness's own modules by their package path
        return "harness/" + path.rsplit("/harness/", 1)[1]
    parts = path.split("/")
    return "/".join(parts[-2:])


def where_stuck(log: str) -> str | None:
    """One entry per dumped main thread: its innermost frame and, when that is in a library, the
    innermost frame of the harness that led there. None when the log holds no dump.

    A dump need not say which thread is the main one (the watchdog's dump names none "Current"); a
    main thread is the one whose outermost frame is not threading's bootstrap."""
    lines = log.splitlines()
    places: list[str] = []
    for i, line in enumerate(lines):
        if not _THREAD.match(line):
            continue
        frames = []
        for frame_line in lines[i + 1:]:
            m = _FRAME.match(frame_line)
            if not m:
                break
            frames.append(m)
        if not frames or frames[-1]["func"] == "_bootstrap":
            continue
        inner = frames[0]
        place = f"{_short(inner['file'])}:{inner['line']} in {inner['func']}"
        ours = next((f for f in frames if "/harness/" in f["file"]), None)
        if ours is not None and ours is not inner:
            place += f" (from {_short(ours['file'])}:{ours['line']} in {ours['func']})"
        if place not in places:
            places.append(place)
    return "; ".join(places) or None
