"""A training step's memory timeline: every allocator action of one rank, compact, with its phases.

A GPU worker started with `OOM_HARNESS_MEMORY_HISTORY=1` (`oom-harness run --memory-history`,
`pytest --memory-history`) records PyTorch's allocator history
(`torch.cuda.memory._record_memory_history`) from before the model is loaded to the end of the
training steps, and keeps it here as columns rather than PyTorch's pickled snapshot: a 7B LoRA
step is a few hundred kilobytes gzipped instead of tens of megabytes of stack frames. What is kept:

- every action, in order, with its time, address, size and stream (`ACTIONS`): enough to replay the
  stream through a model of the caching allocator (`harness.predict`) and to draw allocated and
  reserved memory over time (`harness.report`);
- for each allocation, the call site that asked for it (one frame: the innermost one in model,
  adapter, DeepSpeed or optimizer code), so the largest live tensors at the peak can be named;
- the phase of each action (load, forward, backward, optimizer), from the marks the worker sets.

Reading is bounded (`harness.models.inputs.load_gzip_json`) and validated: a timeline file is input.
"""

from __future__ import annotations

import gzip
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field, model_validator

from harness.models.inputs import load_gzip_json
from harness.spec.files import write_atomic

ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
           "segment_unmap", "oom", "snapshot")
ALLOC, FREE_REQUESTED, FREE_COMPLETED, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP, OOM, SNAPSHOT = \
    range(len(ACTIONS))
PHASES = ("load", "engine", "forward", "backward", "optimizer")
TIME_QUANTUM_US = 100  # times are kept to 0.1 ms: finer adds half the file and nothing a plot or a replay uses
_DELTA_COLUMNS = ("t_us", "addr")  # stored as differences from the previous entry: they compress 2-5x better
MAX_FILE_BYTES = 64 * 2**20
MAX_UNPACKED_BYTES = 512 * 2**20
# Frames of these libraries name an allocation better than the torch internals under them.
_NAMING_PARTS = ("/transformers/", "/peft/", "/deepspeed/", "/bitsandbytes/", "/fla/", "/accelerate/",
                 "/torch/optim/", "/torch/utils/checkpoint", "/harness/")


class MemoryTimeline(BaseModel):
    """One rank's allocator actions as parallel columns (index i of each column is action i)."""

    schema_version: int = 1
    case_id: str
    variant: str = ""
    fidelity: str
    platform: str
    device_name: str
    rank: int = 0
    world_size: int = 1
    torch_version: str
    versions: dict[str, str] = {}  # the worker's library, CUDA and driver versions
    alloc_conf: str = ""  # PYTORCH_CUDA_ALLOC_CONF during the run
    emulated_card_bytes: int | None = None
    recorded: str  # ISO date and time
    dropped: bool = False  # the recording's ring buffer was full: the oldest actions are missing
    t_us: list[int] = Field(description="microseconds since the first action, in steps of TIME_QUANTUM_US")
    action: list[int]
    addr: list[int]
    size: list[int]
    stream: list[int]
    site: list[int]  # index into `sites`, -1 when no frame was recorded
    phase: list[int]  # index into PHASES, -1 before the first mark
    sites: list[str] = []

    @model_validator(mode="after")
    def _columns_agree(self) -> MemoryTimeline:
        n = len(self.t_us)
        for name in ("action", "addr", "size", "stream", "site", "phase"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"column {name!r} has {len(getattr(self, name))} entries, t_us has {n}")
        if any(not 0 <= a < len(ACTIONS) for a in self.action):
            raise ValueError(f"an action code is outside 0..{len(ACTIONS) - 1}")
        if any(not -1 <= s < len(self.sites) for s in self.site):
            raise ValueError("a site index names no entry of `sites`")
        if any(not -1 <= p < len(PHASES) for p in self.phase):
            raise ValueError(f"a phase index is outside -1..{len(PHASES) - 1}")
        if any(s < 0 for s in self.size):
            raise ValueError("a size is negative")
        return self

    def __len__(self) -> int:
        return len(self.t_us)

    def save(self, path: Path) -> Path:
        data = self.model_dump()
        for name in _DELTA_COLUMNS:
            column = data[name]
            data[name] = column[:1] + [b - a for a, b in itertools.pairwise(column)]
        data["delta_columns"] = list(_DELTA_COLUMNS)
        text = json.dumps(data, separators=(",", ":")).encode()
        return write_atomic(Path(path), gzip.compress(text, compresslevel=9, mtime=0))

    @classmethod
    def load(cls, path: Path) -> MemoryTimeline:
        from pydantic import ValidationError

        from harness.models.inputs import InputError

        data = load_gzip_json(path, MAX_FILE_BYTES, MAX_UNPACKED_BYTES)
        if isinstance(data, dict):
            for name in data.pop("delta_columns", None) or ():
                if name in _DELTA_COLUMNS and isinstance(data.get(name), list):
                    data[name] = list(itertools.accumulate(data[name])) if all(
                        isinstance(v, int) for v in data[name]) else data[name]
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise InputError(Path(path), ".".join(str(x) for x in first["loc"]) or None, first["msg"],
                             "use a timeline file the harness wrote; it cannot be repaired by hand") from None

    def curve(self) -> Curve:
        """Allocated and reserved bytes after each action."""
        allocated, reserved = [], []
        a = r = 0
        for act, size in zip(self.action, self.size, strict=True):
            if act == ALLOC:
                a += size
            elif act == FREE_REQUESTED:  # torch's allocated figure drops here; a block used on another
                a -= size  # stream is reusable only at its free_completed, which the allocator's replay needs
            elif act in (SEGMENT_ALLOC, SEGMENT_MAP):
                r += size
            elif act in (SEGMENT_FREE, SEGMENT_UNMAP):
                r -= size
            allocated.append(a)
            reserved.append(r)
        return Curve(allocated, reserved)

    def reserved_peak_on(self, stream: int) -> int:
        """The most the run held reserved in segments of one CUDA stream (the caching allocator keeps
        each stream's blocks apart, so DeepSpeed's gather and reduce streams hold pools of their own)."""
        current = peak = 0
        for act, size, s in zip(self.action, self.size, self.stream, strict=True):
            if s != stream:
                continue
            if act in (SEGMENT_ALLOC, SEGMENT_MAP):
                current += size
            elif act in (SEGMENT_FREE, SEGMENT_UNMAP):
                current -= size
            peak = max(peak, current)
        return peak

    def phase_spans(self) -> list[tuple[str, int, int]]:
        """(phase, first action index, last action index + 1) for each run of one phase, in order."""
        spans: list[tuple[str, int, int]] = []
        start = 0
        for i in range(1, len(self.phase) + 1):
            if i == len(self.phase) or self.phase[i] != self.phase[start]:
                if self.phase[start] >= 0:
                    spans.append((PHASES[self.phase[start]], start, i))
                start = i
        return spans

    def live_at(self, index: int) -> list[LiveBlock]:
        """The allocations live (not yet freed) just after action `index`, largest first."""
        live: dict[int, LiveBlock] = {}
        for i in range(index + 1):
            act = self.action[i]
            if act == ALLOC:
                site = self.sites[self.site[i]] if self.site[i] >= 0 else "?"
                phase = PHASES[self.phase[i]] if self.phase[i] >= 0 else "?"
                live[self.addr[i]] = LiveBlock(self.addr[i], self.size[i], site, phase)
            elif act == FREE_REQUESTED:
                live.pop(self.addr[i], None)
        return sorted(live.values(), key=lambda b: -b.size)


@dataclass(frozen=True)
class LiveBlock:
    addr: int
    size: int
    site: str
    phase: str  # the phase that allocated it


@dataclass(frozen=True)
class Curve:
    allocated: list[int]
    reserved: list[int]

    def peak(self, which: str = "allocated") -> tuple[int, int]:
        """(action index, bytes) of the first maximum of `which`."""
        values = getattr(self, which)
        if not values:
            return -1, 0
        best = max(range(len(values)), key=values.__getitem__)
        return best, values[best]


def site_of(frames: list[dict]) -> str | None:
    """The frame that names an allocation: the innermost one in model, adapter, DeepSpeed, optimizer
    or harness code, else the innermost Python frame."""
    if not frames:
        return None
    chosen = next((f for f in frames if any(part in f.get("filename", "") for part in _NAMING_PARTS)), frames[0])
    parts = Path(chosen.get("filename", "?")).parts
    return f"{'/'.join(parts[-2:])}:{chosen.get('line', 0)} {chosen.get('name', '?')}"


def from_snapshot(snapshot: dict, device_index: int, phase_of, initial: list[dict] | None = None,
                  **meta) -> MemoryTimeline:
    """A `MemoryTimeline` from `torch.cuda.memory._snapshot()`'s trace of one device;
    `phase_of(entry)` gives each entry's index of PHASES (or -1). `initial`: the segments that already
    existed when recording began (`_snapshot()["segments"]` then), put first as actions at time 0, so
    the timeline replays from an empty allocator."""
    traces = snapshot.get("device_traces") or []
    entries = [e for e in (traces[device_index] if device_index < len(traces) else []) if e.get("action") in ACTIONS]
    sites: dict[str, int] = {}
    cols: dict[str, list[int]] = {k: [] for k in ("t_us", "action", "addr", "size", "stream", "site", "phase")}

    def add(t, act, addr, size, stream, site, phase):
        cols["t_us"].append(t)
        cols["action"].append(ACTIONS.index(act))
        cols["addr"].append(int(addr))
        cols["size"].append(int(size))
        cols["stream"].append(int(stream))
        cols["site"].append(sites.setdefault(site, len(sites)) if site is not None else -1)
        cols["phase"].append(phase)

    for seg in initial or ():
        if seg.get("device", device_index) != device_index:
            continue
        add(0, "segment_alloc", seg.get("address", 0), seg.get("total_size", 0), seg.get("stream", 0), None, -1)
        for block in seg.get("blocks") or ():
            if block.get("state") == "active_allocated":
                add(0, "alloc", block.get("address", 0), block.get("size", 0), seg.get("stream", 0),
                    "(allocated before recording)", -1)
    t0 = entries[0].get("time_us", 0) if entries else 0
    for e in entries:
        act = e["action"]
        add((int(e.get("time_us", t0)) - t0) // TIME_QUANTUM_US * TIME_QUANTUM_US, act, e.get("addr", 0),
            e.get("size", 0), e.get("stream", 0), site_of(e.get("frames") or []) if act == "alloc" else None,
            phase_of(e))
    return MemoryTimeline(**meta, **cols, sites=list(sites))
