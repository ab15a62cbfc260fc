"""Stopping a run when told: one SIGTERM or one Ctrl-C ends it within seconds, whatever it is doing.

`timeout`, CI runners and job schedulers stop a command with SIGTERM; a person with Ctrl-C (SIGINT).
A run works in several threads (the tiny runs started in the background by
`harness.judge.session.Session.prefetch`) and its jobs live in sessions of their own, which a
terminal's SIGINT does not reach. Raising in the main thread alone stopped nothing else: the
interpreter waited at exit for the background threads, which went on starting the queued runs (one
SIGTERM at 10 s, still running 100 s later); a second SIGTERM broke that wait with "Exception ignored
... SystemExit: 143"; and a DeepSpeed JIT build killed midway kept its lock for the next run.

`install()` catches both signals (the command line: for the whole process; the pytest plugin: while
its cases run). The first one:

1. marks the process as stopping: from then on the launcher starts no job (`check` raises
   `Stopped`), so every queued or background run ends at once;
2. runs the `on_stop` hooks: the launcher kills every job it runs, with its whole process tree,
   and lets the worker zygote go;
3. raises `Stopped` in the main thread, which unwinds through the blocks that release what the
   run holds (its card locks, the JIT locks of the jobs it killed, its temporary folder).

A process forked from the harness (the predictor's forked traces) inherits the handlers; there a
signal ends the process as it would without them. A second signal while that unwinds is ignored:
the first one's cleanup takes seconds, and an exception raised in the middle of it would leave half
of it undone. A process that started with SIGINT ignored (a shell's background job) keeps ignoring it.

`Stopped` is a KeyboardInterrupt, so no `except Exception` on the way mistakes it for a failure of
the case being run, and pytest reports it as an interrupted session.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(KeyboardInterrupt):
    """The process was told to stop (SIGTERM, SIGINT): nothing more is started."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """What a shell reports for a process ended by this signal (143 for SIGTERM, 130 for SIGINT)."""
        return 128 + self.signum

    def __str__(self) -> str:
        return f"stopped by {self.name}"


_stopping = threading.Event()
_signum: int = signal.SIGTERM
_hooks: list[Callable[[], None]] = []
_installed_by = 0  # the process whose handlers these are (a forked child inherits them)


def on_stop(hook: Callable[[], None]) -> None:
    """Run `hook` once, at the first signal (in the main thread, before `Stopped` is raised there)."""
    _hooks.append(hook)


def stopping() -> bool:
    return _stopping.is_set()


def check() -> None:
    """Raise `Stopped` once the process has been told to stop: called before anything new starts."""
    if _stopping.is_set():
        raise Stopped(_signum)


def stop(signum: int = signal.SIGTERM) -> None:
    """Mark the process as stopping and run the hooks (once; a hook that fails does not keep the
    others from running)."""
    global _signum
    if _stopping.is_set():
        return
    _signum = signum
    _stopping.set()
    for hook in list(_hooks):
        with contextlib.suppress(Exception):
            hook()


def _handle(signum, frame) -> None:
    if os.getpid() != _installed_by:
        # a process forked from this one (the predictor's forked traces): it holds nothing to release,
        # and an exception here would print its traceback; it ends as the signal ends a process
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _stopping.is_set():
        return  # the first signal's cleanup is under way
    stop(signum)
    raise Stopped(signum)


def _install() -> dict[int, object]:
    """Catch the signals in this process's main thread; the handlers they replace (none elsewhere)."""
    global _installed_by
    if threading.current_thread() is not threading.main_thread():
        return {}
    _installed_by = os.getpid()
    saved = {}
    for signum in SIGNALS:
        previous = signal.getsignal(signum)
        if signum == signal.SIGINT and previous == signal.SIG_IGN:
            continue  # started as a background job of a shell: Ctrl-C is not for this process
        saved[signum] = previous
        signal.signal(signum, _handle)
    return saved


def install() -> Callable[[], None]:
    """Catch SIGTERM and SIGINT in this process (the main thread's job; elsewhere nothing is
    installed). Returns what puts the earlier handlers back."""
    saved = _install()

    def restore() -> None:
        for signum, previous in saved.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, previous)

    return restore
