"""The ranks of a multi-rank run on a CPU host, started by the launcher itself: torchrun's job without its interpreters.

torchrun is a fresh interpreter that starts a fresh interpreter per rank, each importing torch,
transformers, peft and DeepSpeed again (8-9 CPU-s a rank on the CI's machine, for a few seconds of
tiny training). On a CPU host the launcher does what torchrun does for one node instead, and forks
each rank from the worker zygote (`harness.runtime.zygote`) where it runs:

* each rank gets the environment torchrun gives it (`rank_env`: RANK, LOCAL_RANK, WORLD_SIZE,
  LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rank 0 hosts the rendezvous store, as a rank does
  under torchrun with no agent store);
* each rank runs in a session of its own (as torchrun starts them), and the ranks are waited on and
  killed as one job (`RankGroup`, which the launcher treats as it treats a process);
* when a rank fails (a non-zero exit or a signal), the others are stopped as torchrun stops them:
  SIGTERM, on which the worker writes what it measured, then SIGKILL after `STOP_GRACE_S`; the
  rank that failed is named with its pid and exit code or signal (`RankGroup.deaths`), read from
  its exit status rather than from a launcher's printout.

GPU hosts keep torchrun (and DeepSpeed's launcher): a process that has initialised CUDA cannot be
forked, and ranks there also need their devices placed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from typing import Protocol

from harness.runtime.rank_deaths import RankDeath

STOP_GRACE_S = 15.0  # from SIGTERM to SIGKILL for the ranks still running once one has failed


class Process(Protocol):
    """What the launcher waits on: a `subprocess.Popen`, or a job the zygote forked."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def rank_env(rank: int, world: int, port: int | str) -> dict[str, str]:
    """The environment torchrun gives a rank of a one-node run of `world` ranks."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


class RankGroup:
    """The processes of one run's ranks (index = rank), waited on like one `subprocess.Popen`:
    `wait` returns once every rank has exited, `returncode` is the first failed rank's code (0 when
    all succeeded). The first failure stops the other ranks; `say` gets one line about it for the log."""

    def __init__(self, ranks: list[Process], say=lambda line: None, grace_s: float = STOP_GRACE_S):
        if not ranks:
            raise ValueError("a rank group needs at least one rank")
        self.ranks = list(ranks)
        self.pid = self.ranks[0].pid
        self.returncode: int | None = None
        self.deaths: list[RankDeath] = []  # the rank whose failure stopped the others (what follows is its doing)
        self._say = say
        self._grace_s = grace_s
        self._cond = threading.Condition()
        self._exited: dict[int, int] = {}
        self._stopping = False  # the group is being stopped: from a failed rank, or killed by the launcher
        for rank, proc in enumerate(self.ranks):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"harness-rank{rank}", daemon=True).start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.ranks]

    @property
    def returncodes(self) -> list[int | None]:
        """Each rank's exit code (None while it runs); negative: the signal that ended it."""
        with self._cond:
            return [self._exited.get(rank) for rank in range(len(self.ranks))]

    def _watch(self, rank: int, proc: Process) -> None:
        code = proc.wait()
        stop = False
        with self._cond:
            self._exited[rank] = code
            if code != 0 and not self._stopping:  # the first failure; what follows is its consequence
                self.deaths.append(RankDeath(rank, code, proc.pid))
                stop = self._stopping = True
            if len(self._exited) == len(self.ranks):
                codes = [self._exited[r] for r in range(len(self.ranks))]
                self.returncode = self.deaths[0].exitcode if self.deaths else next((c for c in codes if c), 0)
            self._cond.notify_all()
        if stop and len(self._exited) < len(self.ranks):
            self._say(f"{self.deaths[0].describe()}; stopping the other ranks")
            self._stop_others()

    def _running(self) -> list[int]:
        with self._cond:
            return [p.pid for rank, p in enumerate(self.ranks) if rank not in self._exited]

    def _stop_others(self) -> None:
        """torchrun's way: SIGTERM (the worker writes its report and exits), SIGKILL after the grace."""
        for pid in self._running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        with self._cond:
            self._cond.wait_for(lambda: len(self._exited) == len(self.ranks), self._grace_s)
        for pid in self._running():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)

    def mark_killed(self) -> None:
        """The launcher is killing the group (a timeout, the harness stopped): no rank's exit is then
        a failure to stop the others for."""
        with self._cond:
            self._stopping = True

    def poll(self) -> int | None:
        with self._cond:
            return self.returncode if len(self._exited) == len(self.ranks) else None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            done = self._cond.wait_for(lambda: len(self._exited) == len(self.ranks),
                                       None if deadline is None else max(0.0, deadline - time.monotonic()))
            if not done:
                raise subprocess.TimeoutExpired(f"ranks {self.pids}", timeout)
            return self.returncode
