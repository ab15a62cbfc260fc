"""A recorded memory timeline replayed through the allocator model: the check that the model is the allocator.

`replay(timeline)` feeds a rank's recorded allocations and frees (`harness.measure.timeline`), in
order, with their sizes and streams, to `harness.predict.allocator.allocator.CachingAllocator` under the run's
PYTORCH_CUDA_ALLOC_CONF and memory cap, and gives the simulated reserved memory after each action.
The recorded `segment_*` actions are the truth the simulation is compared with
(`MemoryTimeline.curve()`), and recorded addresses serve only to pair a free with its allocation.
One thing is read from them: where the program called `torch.cuda.empty_cache()` (transformers does
before its `caching_allocator_warmup`), which is an input to the allocator, not its decision. A
trace has no entry for the call itself, only the segments it gave back; a run of those is the
allocator's own release on the way to running out of memory when the allocation after it would not
have fitted under the cap beside what was reserved (`_cache_emptied`), and the program's call
otherwise.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from harness.measure.timeline import (
    ALLOC,
    FREE_COMPLETED,
    FREE_REQUESTED,
    OOM,
    SEGMENT_FREE,
    SEGMENT_UNMAP,
    MemoryTimeline,
)
from harness.predict.allocator.allocator import (
    AllocatorConf,
    CachingAllocator,
    Segment,
    Stats,
    round_size,
    segment_size,
)


@dataclass
class Replay:
    reserved: list[int]  # simulated reserved bytes after each action of the timeline
    peak_index: int  # the first action at the simulated peak
    peak_reserved: int
    segments_at_peak: list[Segment]
    oom_index: int | None  # the action at which the model ran out of memory (the replay stops there)
    recorded_oom_index: int | None  # the first `oom` action of the recording
    limit: int | None  # the cap replayed under, bytes
    stats: Stats
    seconds: float

    @property
    def actions_per_second(self) -> float:
        return len(self.reserved) / self.seconds if self.seconds else float("inf")


def replay(timeline: MemoryTimeline, *, conf: AllocatorConf | None = None, limit: int | None = None,
           device_bytes: int | None = None) -> Replay:
    """`conf`: the timeline's own `alloc_conf` unless given. `limit`: the allocator's cap in bytes
    (see `recorded_limit`); None replays without one. The segments at the peak come from a second
    pass that stops there: listing them at every new peak cost 55 ms each with expandable segments,
    99 % of a replay."""
    t0 = time.perf_counter()
    if conf is None:
        conf = AllocatorConf.parse(timeline.alloc_conf, f"the timeline's alloc_conf ({timeline.case_id})")
    emptied = _cache_emptied(timeline, conf, limit)
    sim, reserved, peak, peak_index, oom_index = _run(timeline, conf, limit, device_bytes, emptied)
    at_peak = []
    if peak_index >= 0:
        at_peak = _run(timeline, conf, limit, device_bytes, emptied, stop=peak_index)[0].segments()
    recorded_oom = next((i for i, a in enumerate(timeline.action) if a == OOM), None)
    return Replay(reserved, peak_index, max(peak, 0), at_peak, oom_index, recorded_oom, limit, sim.stats,
                  time.perf_counter() - t0)


def _run(timeline: MemoryTimeline, conf: AllocatorConf, limit: int | None, device_bytes: int | None,
         emptied: set[int], stop: int | None = None):
    """The model through the timeline's actions (up to and including `stop`): (the model, reserved
    after each action, the peak, its first action, the action the model ran out of memory at)."""
    sim = CachingAllocator(conf, limit=limit, device_bytes=device_bytes)
    stats = sim.stats
    live: dict[int, object] = {}
    pending: dict[int, object] = {}
    reserved: list[int] = []
    peak, peak_index = -1, -1
    oom_index = None
    malloc, free_requested, free_completed = sim.malloc, sim.free_requested, sim.free_completed
    for i, (act, addr, size, stream) in enumerate(zip(timeline.action, timeline.addr, timeline.size,
                                                     timeline.stream, strict=True)):
        if act == ALLOC:
            block = malloc(size, stream)
            if block is None:
                oom_index = i
            else:
                live[addr] = block
        elif act == FREE_REQUESTED:
            block = live.pop(addr, None)
            if block is not None:  # allocated before the recording began: not the model's
                free_requested(block)
                pending[addr] = block
        elif act == FREE_COMPLETED:
            block = pending.pop(addr, None)
            if block is not None:
                free_completed(block)
        elif i in emptied:
            sim.empty_cache()
        elif act == OOM:  # the recorded allocation that failed: the model must fail it too
            block = malloc(size, stream)
            if block is None:
                oom_index = i
            else:
                sim.free(block)
        reserved.append(stats.reserved)
        if stats.reserved > peak:
            peak, peak_index = stats.reserved, i
        if oom_index is not None or i == stop:
            break
    return sim, reserved, peak, peak_index, oom_index


def _cache_emptied(timeline: MemoryTimeline, conf: AllocatorConf, limit: int | None) -> set[int]:
    """The first action of each run of recorded segment releases that was the program's
    `empty_cache()`: not followed by an allocation that needed a new segment the cap had no room for."""
    out: set[int] = set()
    actions, sizes = timeline.action, timeline.size
    released = (SEGMENT_FREE, SEGMENT_UNMAP)
    reserved = None
    for i, act in enumerate(actions):
        if act not in released or (i and actions[i - 1] in released):
            continue
        if limit is not None:
            reserved = reserved or timeline.curve().reserved
            j = next((k for k in range(i, len(actions)) if actions[k] in (ALLOC, OOM)), None)
            before = reserved[i - 1] if i else 0
            if j is not None and before + segment_size(round_size(sizes[j], conf)) > limit:
                continue  # the allocator freeing its cache to make room under the cap
        out.add(i)
    return out


def recorded_limit(timeline: MemoryTimeline, runs_dir: Path) -> int | None:
    """The cap the recorded run's allocator had: the emulated card less the process's CUDA context
    (`harness.runtime.measurement` sets the memory fraction so), with the context read from the run
    record in `runs_dir` that names the same case, variant, rank and emulated card. The emulated card
    itself where no record says; None for a run without one."""
    card = timeline.emulated_card_bytes
    if not card:
        return None
    for path in sorted(Path(runs_dir).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for entry in data if isinstance(data, list) else [data]:
            run = entry.get("run") if isinstance(entry, dict) else None
            if not isinstance(run, dict):
                continue
            for rank in run.get("ranks") or ():
                variant = rank.get("variant") or run.get("variant") or entry.get("variant") or ""
                if (rank.get("case_id") == timeline.case_id and variant == timeline.variant
                        and rank.get("rank", 0) == timeline.rank and rank.get("emulated_card_bytes") == card
                        and rank.get("context_bytes")):
                    return card - int(rank["context_bytes"])
    return card
