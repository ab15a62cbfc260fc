"""Which rank of a multi-rank run died, and of what: read from its launcher's summary, or seen by the harness.

torchrun and DeepSpeed's launcher exit 1 whatever killed a rank, and stop the other ranks
themselves; the rank that was killed (the kernel's OOM killer, a segfault in a kernel, a `kill -9`)
writes no report. What they print names it: torchrun a block per failed rank with its exit code
("Root Cause (first observed failure)" and the others); DeepSpeed's launcher only "<command>
exits with return code = -9", with the command of its last rank whichever failed, so the rank is
the one without a report (the others write theirs when the launcher stops them). A case that fails
this way is reported as that rank and its signal, not as the error the surviving ranks saw once
their peer was gone ("Connection closed by peer"). Ranks the harness starts itself (CPU hosts,
`harness.runtime.ranks`) need no summary: their exit status names the rank.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass


@dataclass(frozen=True)
class RankDeath:
    rank: int | None  # None: the launcher did not say which
    exitcode: int  # negative: killed by that signal
    pid: int | None = None

    @property
    def signal_name(self) -> str | None:
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    def describe(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else "a rank (its launcher did not say which)"
        pid = f" (pid {self.pid})" if self.pid else ""
        if self.signal_name:
            return f"{who}{pid} was killed by {self.signal_name}"
        return f"{who}{pid} exited with code {self.exitcode}"


_RANK = re.compile(r"^\s*rank\s*:\s*(?P<rank>\d+)")
_EXIT = re.compile(r"^\s*exitcode\s*:\s*(?P<code>-?\d+)(?:\s*\(pid:\s*(?P<pid>\d+)\))?")
# DeepSpeed's launcher prints the failed code with the command of its last rank, whichever failed
_DEEPSPEED = re.compile(r"exits with return code = (?P<code>-?\d+)")


def deaths(log: str) -> list[RankDeath]:
    """Every failed rank the launcher lists, once each: torchrun's root cause first."""
    lines = log.splitlines()
    found: dict[int, RankDeath] = {}
    root: int | None = None
    in_root = False
    for i, line in enumerate(lines):
        if line.strip() == "Root Cause (first observed failure):":
            in_root = True
        elif m := _RANK.match(line):
            for detail in lines[i + 1:i + 4]:
                if e := _EXIT.match(detail):
                    rank = int(m["rank"])
                    found.setdefault(rank, RankDeath(rank, int(e["code"]), int(e["pid"]) if e["pid"] else None))
                    if in_root and root is None:
                        root = rank
                    break
        elif (m := _DEEPSPEED.search(line)) and not found:
            found[-1] = RankDeath(None, int(m["code"]))
    return sorted(found.values(), key=lambda d: d.rank != root)


def unreported_death(found: list[RankDeath], reported_ranks: set[int], world: int) -> RankDeath | None:
    """The rank to blame for a run its launcher stopped: one that died without writing its report,
    of a signal other than the SIGTERM the launcher stops the others with. torchrun's "Root Cause"
    is the earliest exit it saw, which is not always the cause: a rank that reported its peer's
    death and aborted in gloo's shutdown (SIGABRT) was once stamped in the same second as the peer
    the kernel had killed. `found`: the failed ranks (`deaths` of a launcher's summary, and those
    the harness saw fail itself)."""
    candidates = [d for d in found if d.rank not in reported_ranks]
    candidates.sort(key=lambda d: (d.signal_name is None, d.signal_name == "SIGTERM"))
    if not candidates:
        return None
    death = candidates[0]
    if death.rank is None:  # DeepSpeed's: the one rank of `world` without a report, where only one is
        missing = sorted(set(range(world)) - reported_ranks)
        if not missing:
            return None  # every rank reported: their reports say what happened
        death = RankDeath(missing[0] if len(missing) == 1 else None, death.exitcode)
    return death
