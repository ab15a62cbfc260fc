"""When NCCL lets a gather's input go: the allocated peak of a ZeRO-3 step with its parameters on the host.

With `offload_param` each one-parameter gather hands NCCL a copy of the rank's host partition on the
device (`param.ds_tensor.to(device)`, `_all_gather_sequential`). The process group keeps a collective's
input until its watchdog thread, waking every 100 ms, has seen the collective done and the main thread
then launches another one, or until the gather is waited on. The replay of DeepSpeed's coordinator has
no clock and frees each copy at its wait (`harness.predict.zero3.coordinator.GATHER_INPUT`), so where the
coordinator prefetches many gathers ahead of their waits it holds copies the run had let go: on
Qwen2.5-1.5B's full fine-tune at 512 tokens, 709 MiB of copies at the built peak where the recorded run
held 334 (+10 % on allocated). The recorded copies went in batches 100 ms apart, each a few
milliseconds of gathers long.

`worst_phase` gives the step stream a host clock and the watchdog a phase:

* the host spends `HOST_S_PER_ALLOCATION` per allocation of the stream, and copies a host partition to
  the device at `COPY_BYTES_PER_S`; a gather is done when its input's copy is (the collective itself is
  short beside the host's time between gathers). The copy is a blocking one on the compute stream, so
  the host waits there for the device to reach it: the device's compute only makes the run's clock
  longer than this one, and a shorter clock lets fewer copies go;
* a collective is launched after each one-parameter gather's copy and with each coalesced gather's
  buffer (`Stream.launches`); the reduce-scatters of the gradients are not in the stream, so the model
  has fewer launches to let an input go at than the run: it holds more, never less;
* an input goes at the first launch after the first watchdog poll after its gather is done, or at its
  wait, whichever comes first.

Which inputs are live at a moment turns on where the polls fall, which no config sets: every step of a
long run meets another phase. The figure is the highest allocated peak over `PHASES` phases spread over
one poll period, on a host faster than any recorded (the recorded ZeRO-3 steps with their parameters
offloaded, two H200s, `results/architectures/timelines/`, `results/timelines/`: 170 to 450 us of host
per allocator action once warm; pinned host-to-device copies at about 50 GB/s, PCIe Gen5 x16's rate):
a faster host launches more gathers within a poll and lets fewer go. On Qwen2.5-1.5B's recorded
timeline the figure is +1.8 % (+10.3 % with every copy held to its wait); a host twice as slow (every
core of the recording host busy beside the run) measured 1.2 % less. Of the other baselines with
parameter offload only guide 002's at 2,048 tokens move, by -0.4 % (docs/predictor.md, "When NCCL
lets a gather's input go").
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field

from harness.predict.constants import COPY_BYTES_PER_S, HOST_S_PER_ALLOCATION, PHASES, WATCHDOG_POLL_S


@dataclass
class Input:
    """A gather's input: its block's bytes, the host time its gather is done, the op that frees it at its
    wait (None: live to the stream's end)."""

    nbytes: int
    done: float
    waited: int | None = None


@dataclass
class Clock:
    """The step stream's moments that decide when an input goes, collected as it is simulated."""

    copied: int = 0  # bytes of host partitions copied to the device so far
    allocated: list[int] = field(default_factory=list)  # allocated bytes after each op
    launches: list[int] = field(default_factory=list)  # op index of each collective launched, in order
    launched_at: list[float] = field(default_factory=list)  # its host time
    inputs: dict[int, Input] = field(default_factory=dict)  # by the stream's id

    def gather(self, ident: int, nbytes: int, allocations: int, index: int, *, host_copy: bool,
               gather_input: bool, launch: bool) -> None:
        """Op `index`, the stream's `allocations`-th allocation, allocated `nbytes` (its block) for a
        gather: the host's time to it, then the collective it launches."""
        self.copied += nbytes if host_copy else 0
        now = allocations * HOST_S_PER_ALLOCATION + self.copied / COPY_BYTES_PER_S
        if gather_input:
            self.inputs[ident] = Input(nbytes, now)
        if launch:
            self.launches.append(index)
            self.launched_at.append(now)

    def freed(self, ident: int, index: int) -> None:
        if ident in self.inputs:
            self.inputs[ident].waited = index


@dataclass(frozen=True)
class Released:
    """The allocated peak with NCCL letting inputs go, at the worst phase tried."""

    peak: int
    at: int  # the op index of the peak
    let_go: frozenset[int]  # ids of the inputs let go before their waits and not yet waited on at the peak


def _candidates(clock: Clock) -> list[tuple[int, Input, int, int, int]]:
    """The inputs some phase lets go before their waits: (id, input, end, lo, hi), the launches that can
    let it go being lo..hi (the first after its gather is done, the first a poll period later)."""
    out = []
    at, n = clock.launched_at, len(clock.allocated)
    for ident, one in clock.inputs.items():
        lo = bisect.bisect_left(at, one.done)
        end = n if one.waited is None else one.waited
        if lo < len(at) and clock.launches[lo] + 1 < end:
            out.append((ident, one, end, lo, bisect.bisect_left(at, one.done + WATCHDOG_POLL_S, lo)))
    return out


def _let_go(clock: Clock, phase: float, candidates: list) -> list[tuple[int, int, int]]:
    """(first op index without it, op index of its wait, id) of each of the `candidates` let go before its
    wait when the watchdog first polls `phase` seconds in."""
    out = []
    for ident, one, end, lo, hi in candidates:
        poll = phase + math.ceil((one.done - phase) / WATCHDOG_POLL_S) * WATCHDOG_POLL_S
        k = bisect.bisect_left(clock.launched_at, poll, lo, hi)  # the poll is before launch hi
        if k == len(clock.launches):
            continue
        gone = clock.launches[k] + 1  # the launch's own allocation still sees the input
        if gone < end:
            out.append((gone, end, ident))
    return out


def worst_phase(clock: Clock) -> Released:
    """The highest allocated peak over the phases tried, each input let go as NCCL would."""
    n = len(clock.allocated)
    candidates = _candidates(clock)
    lists = [_let_go(clock, i * WATCHDOG_POLL_S / PHASES, candidates) for i in range(PHASES)]
    # between two moments where what was let go changes, the peak is the stream's own there
    bounds = sorted({0, n, *(x for spans in lists for gone, end, _ in spans for x in (gone, end))})
    tops = []
    for a, b in itertools.pairwise(bounds):
        segment = clock.allocated[a:b]
        value = max(segment)
        tops.append((value, a + segment.index(value)))
    best = None
    for spans in lists:
        change: dict[int, int] = {}
        for gone, end, ident in spans:
            change[gone] = change.get(gone, 0) + clock.inputs[ident].nbytes
            change[end] = change.get(end, 0) - clock.inputs[ident].nbytes
        out = 0
        for a, (value, top) in zip(bounds, tops, strict=False):
            out += change.get(a, 0)
            if best is None or value - out > best[0]:
                best = (value - out, top, spans)
    value, top, spans = best
    return Released(value, top, frozenset(ident for gone, end, ident in spans if gone <= top < end))
