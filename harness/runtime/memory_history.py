"""Recording a rank's allocator history on a GPU run, for its memory timeline
(`harness.measure.timeline`).

Opt-in (`OOM_HARNESS_MEMORY_HISTORY=1` in the worker's environment, which `oom-harness run
--memory-history` and `pytest --memory-history` set): recording Python stacks for every allocation
slows the step, so a run that records is not one whose tokens/s is compared. Rank 0 only; the CPU
has no caching allocator to record.
"""

from __future__ import annotations

import bisect
import datetime
import os
import sys
import time
from pathlib import Path

from harness.measure.timeline import PHASES, from_snapshot

ENV = "OOM_HARNESS_MEMORY_HISTORY"
FILE = "rank0-memory.json.gz"
MAX_ENTRIES = 2_000_000  # actions kept; a 7B LoRA step is tens of thousands
_PREFIX = "oom-harness:"


def request() -> None:
    """Ask every worker this harness starts from now on to record (they inherit the environment)."""
    os.environ[ENV] = "1"


def wanted(on_gpu: bool, rank: int) -> bool:
    return on_gpu and rank == 0 and os.environ.get(ENV, "") not in ("", "0")


class History:
    """Records from `start()` until `finish()`; `phase(name)` labels every allocation after it."""

    def __init__(self, active: bool, device, out_dir: Path, meta: dict):
        self.active = active
        self.device = device
        self.path = Path(out_dir) / FILE
        self.meta = meta
        self.written: Path | None = None
        self.initial: list[dict] = []  # segments that existed before recording began
        self.marks: list[tuple[int, int]] = []  # (unix microseconds, index of PHASES), for a torch without metadata
        self._torch = None

    def start(self) -> None:
        if not self.active:
            return
        import torch

        self._torch = torch
        self.initial = torch.cuda.memory._snapshot(self.device).get("segments") or []
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, context="alloc", stacks="python",
                                                 device=self.device)
        self.phase("load")

    def phase(self, name: str) -> None:
        if self._torch is None:
            return
        if hasattr(self._torch.cuda.memory, "_set_memory_metadata"):
            self._torch.cuda.memory._set_memory_metadata(_PREFIX + name)
        self.marks.append((time.time_ns() // 1000, PHASES.index(name)))

    def finish(self) -> Path | None:
        """Stop recording and write the timeline (once; later calls return the same path). A failure to
        write is reported on stderr and costs the run nothing else."""
        if self._torch is None:
            return self.written
        torch, self._torch = self._torch, None
        try:
            snapshot = torch.cuda.memory._snapshot(self.device)
            torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
            if hasattr(torch.cuda.memory, "_set_memory_metadata"):
                torch.cuda.memory._set_memory_metadata("")
            traces = snapshot.get("device_traces") or []
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            entries = traces[index] if index < len(traces) else []
            timeline = from_snapshot(
                snapshot, index, lambda entry: _phase_index(entry, self.marks), self.initial, **self.meta,
                torch_version=torch.__version__,
                alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                recorded=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                dropped=len(entries) >= MAX_ENTRIES,
            )
            self.written = timeline.save(self.path)
        except Exception as exc:  # the timeline is an extra; the run's own report must still be written
            print(f"[harness.runtime.memory_history] no timeline: {type(exc).__name__}: {exc}", file=sys.stderr)
        return self.written


def _phase_index(entry: dict, marks: list[tuple[int, int]]) -> int:
    """The phase of one trace entry: its metadata where torch records it, else the last mark at or
    before its time (the allocator's trace times are microseconds of the Unix clock)."""
    metadata = entry.get("user_metadata", "")
    if isinstance(metadata, str) and metadata.startswith(_PREFIX) and metadata[len(_PREFIX):] in PHASES:
        return PHASES.index(metadata[len(_PREFIX):])
    i = bisect.bisect_right(marks, (int(entry.get("time_us", 0)), len(PHASES))) - 1
    return marks[i][1] if i >= 0 else -1
