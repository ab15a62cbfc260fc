"""Turns on one card: training processes that stop between bursts of steps until they are told to go on.

`oom-harness compare --resident` measures two environments (arms) on one card without paying each
arm's start (imports, CUDA context, model build, warm-up: 10 s and more of a 15 s run) once per pair:
each arm is one `oom-harness run` whose worker trains for all the pairs, and stops at gates between
bursts of steps while the other arm trains. The conductor (the compare) opens one arm's gate at a time,
so the two never train at once, and the bursts alternate as separate runs' pairs do (A B, B A, ...).

The protocol is files in one folder per arm (`TURNS_ENV` names it; the worker's environment reaches it
through `oom-harness run` and the launcher):

* `plan.json` (the conductor's): the step counts at which the workers stop (`gates`: 0 before the first
  step, after the warm-up, after each burst, and after the last step, before the probes) and the
  conductor (its pid and start time, `harness.runtime.process_tree.owner`, so a later process given the
  pid is not taken for it);
* `at-rank<R>-slot<S>` (each worker's): `{"step": s, "of": n}`: it has stopped before step `s` (0-based,
  the steps done), one of the `n` processes of the run;
* `go` (the conductor's): a step count; a worker stopped at `s` goes on while `go` is above it.

Why files: every process of a run reaches them, whatever launched it (the harness's launcher, torchrun,
a framework's trainer inside it), with nothing passed down but one variable; a write is one `os.replace`.
A worker waiting at a gate polls `go` every `POLL_S`; its step timer starts only once it goes on, and
ranks of one job meet at a barrier before the step, so no rank's timed step includes the wait.
A worker whose conductor has exited stops with an error rather than wait for ever.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

TURNS_ENV = "HARNESS_TURNS"
POLL_S = 0.005


class TurnsError(RuntimeError):
    """The turns could not go on: the conductor exited, or its folder is unreadable."""


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip() or "x")
    except (OSError, ValueError):  # not written yet, or being replaced
        return None


@dataclass
class Turns:
    """A worker's side: stop at the plan's gates until the conductor says go."""

    folder: Path
    gates: frozenset[int]
    conductor: str  # the compare's process, as harness.runtime.process_tree.owner() names it
    name: str  # rank<R>-slot<S>
    processes: int  # of the run: every one stops at each gate

    @classmethod
    def from_env(cls, rank: int, slot: int, processes: int) -> Turns | None:
        """The turns this worker takes, or None where no conductor set any (every run but a resident compare's)."""
        folder = os.environ.get(TURNS_ENV)
        if not folder:
            return None
        path = Path(folder)
        try:
            plan = json.loads((path / "plan.json").read_text())
            gates, conductor = frozenset(int(g) for g in plan["gates"]), str(plan["conductor"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise TurnsError(f"{TURNS_ENV}={folder}: no readable plan.json ({exc}); it is set by "
                             "`oom-harness compare --resident` for its arms, unset it otherwise") from None
        return cls(path, gates, conductor, f"rank{rank}-slot{slot}", processes)

    def before_step(self, done: int) -> None:
        """Called before each step (`done` steps so far) and once after the last: wait here at a gate."""
        if done not in self.gates:
            return
        from harness.runtime.process_tree import alive
        from harness.spec.files import write_atomic

        write_atomic(self.folder / f"at-{self.name}", json.dumps({"step": done, "of": self.processes}))
        go = self.folder / "go"
        checked = time.monotonic()
        while (_read_int(go) or 0) <= done:
            time.sleep(POLL_S)
            if time.monotonic() - checked > 1.0:
                checked = time.monotonic()
                if not alive(self.conductor):
                    raise TurnsError(f"the compare (pid {self.conductor.partition(':')[0]}) that set this run's "
                                     f"turns exited while "
                                     f"it waited before step {done + 1}")
        _meet()


def _meet() -> None:
    """The ranks of one job start the step together: each left the gate on its own poll. A process that
    has not imported torch.distributed has no process group (and is spared importing torch for nothing)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


@dataclass
class Arm:
    """The conductor's side of one arm's folder."""

    folder: Path

    def plan(self, gates: list[int]) -> None:
        from harness.runtime.process_tree import owner
        from harness.spec.files import write_atomic

        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob("at-*"):
            stale.unlink()
        write_atomic(self.folder / "go", "0")
        write_atomic(self.folder / "plan.json", json.dumps({"gates": sorted(gates), "conductor": owner()}))

    def stopped_at(self, step: int) -> bool:
        """Whether every process of the arm's run has stopped before `step`."""
        seen, expected = 0, None
        for path in self.folder.glob("at-*"):
            try:
                at = json.loads(path.read_text())
            except (OSError, ValueError):
                return False
            if at.get("step") != step:
                return False
            seen += 1
            expected = at.get("of")
        return expected is not None and seen >= expected

    def go(self, until: int) -> None:
        """Let the arm's processes train until they reach the gate at `until` steps."""
        from harness.spec.files import write_atomic

        write_atomic(self.folder / "go", str(until))


def gates(warmup: int, burst: int, bursts: int) -> list[int]:
    """Where each arm's processes stop: before the first step, after the warm-up, after each burst."""
    return [0, *(warmup + i * burst for i in range(bursts + 1))]


def order(warmup: int, burst: int, bursts: int) -> list[tuple[int, int]]:
    """The turns, (arm, until which step count), one at a time: each arm's warm-up, then the bursts in
    pairs whose order alternates (A B, B A, ...), as separate runs' pairs alternate."""
    turns = [(0, warmup), (1, warmup)]
    for i in range(bursts):
        until = warmup + (i + 1) * burst
        turns += [(0, until), (1, until)] if i % 2 == 0 else [(1, until), (0, until)]
    return turns


def conduct(arms: list[Arm], warmup: int, burst: int, bursts: int, exited, poll_s: float = 0.01) -> None:
    """Give `arms` their turns (`order`), then let them all finish. `exited(i)` says why arm i's run has
    ended (None while it runs): an arm that ends before its turn is done raises `TurnsError`."""

    def wait(i: int, step: int) -> None:
        while not arms[i].stopped_at(step):
            why = exited(i)
            if why is not None:
                raise TurnsError(f"arm {'AB'[i]} ended before it reached step {step}: {why}")
            time.sleep(poll_s)

    for i in range(len(arms)):
        wait(i, 0)
    for i, until in order(warmup, burst, bursts):
        arms[i].go(until)
        wait(i, until)
    end = warmup + bursts * burst
    for arm in arms:
        arm.go(end + 1)
