"""Memory trackers: the same figures on a GPU and on a CPU.

* `LiveTensorTracker` (CPU): the CPU allocator keeps no peak, so a `TorchDispatchMode` sees every
  tensor an operator returns, keeps its storage's byte count while the storage lives (a weakref
  finalizer subtracts it when it dies) and keeps the high-water mark. Views share a storage and are
  counted once. torch has a similar tool (`torch.distributed._tools.mem_tracker.MemTracker`), but
  it is a private API that changes between releases, and we need identical fields on torch 2.11
  (GPU hosts) and 2.13 (CI), so this ~80-line counter is ours.
* `AcceleratorTracker` (CUDA and ROCm/HIP, both through `torch.cuda`): the caching allocator's own
  `max_memory_allocated` / `max_memory_reserved`.
* `Sampler`: a background thread that samples what the device reports for this process (NVML on
  NVIDIA) and the host memory of this process and its children (dataloader workers), keeping maxima:
  the resident set, and its anonymous and shared-memory part (`host_pages`); on NVIDIA also the
  card's SM clock and what held it down (`clock_reader`, harness.measure.clocks).
"""

from __future__ import annotations

import os
import threading
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorTracker(TorchDispatchMode):
    """Counts the bytes of live tensor storages created while the mode is active."""

    def __init__(self) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}
        self._lock = threading.Lock()
        self.live = 0
        self.peak = 0

    # -- bookkeeping ------------------------------------------------------------------------------
    def _forget(self, key: int) -> None:
        with self._lock:
            self.live -= self._sizes.pop(key, 0)

    def _see(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta" or tensor.is_sparse or tensor.is_nested:
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without storage (functional wrappers)
            return
        key = id(storage)
        size = storage.nbytes()
        with self._lock:
            old = self._sizes.get(key)
            if old is None:
                self._sizes[key] = size
                self.live += size
                weakref.finalize(storage, self._forget, key)
            elif old != size:  # resized in place (resize_, set_)
                self._sizes[key] = size
                self.live += size - old
            if self.live > self.peak:
                self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._see(value)
        if func._schema.is_mutable:  # in-place ops may resize their inputs
            for value in tree_flatten((args, kwargs))[0]:
                if isinstance(value, torch.Tensor):
                    self._see(value)
        return out

    def register(self, tensors) -> None:
        """Count tensors that were created before the mode was entered."""
        for t in tensors:
            self._see(t)

    # -- the tracker interface --------------------------------------------------------------------
    def current(self) -> int:
        return self.live

    def reset_peak(self) -> None:
        self.peak = self.live

    def peak_bytes(self) -> int:
        return self.peak


class AcceleratorTracker:
    """The caching allocator's figures on CUDA or ROCm/HIP (both speak `torch.cuda`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def current(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def peak_reserved(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)


def nvml_handle(device_index: int):
    """(pynvml, handle) of torch's CUDA device `device_index`: NVML numbers the physical cards, so
    the index goes through CUDA_VISIBLE_DEVICES first."""
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = device_index
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if device_index < len(ids) and ids[device_index].isdigit():
            physical = int(ids[device_index])
    return pynvml, pynvml.nvmlDeviceGetHandleByIndex(physical)


class _NvmlProcessMemory:
    """Device memory NVML attributes to this process (includes context, cuBLAS, NCCL buffers)."""

    def __init__(self, device_index: int) -> None:
        self._nvml, self._handle = nvml_handle(device_index)
        self._pid = os.getpid()
        self.per_process = True

    def read(self) -> int | None:
        nvml = self._nvml
        try:
            procs = nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except nvml.NVMLError:
            procs = []
        for p in procs:
            if p.pid == self._pid and p.usedGpuMemory is not None:
                return int(p.usedGpuMemory)
        # Containers may hide host PIDs from NVML: fall back to the card's used memory and say so.
        self.per_process = False
        return int(nvml.nvmlDeviceGetMemoryInfo(self._handle).used)


class _AmdSmiProcessMemory:
    """ROCm / Hygon DCU: this process's VRAM through amdsmi (ROCm 6+), the library behind amd-smi."""

    per_process = True

    def __init__(self, index: int) -> None:
        import amdsmi

        amdsmi.amdsmi_init()
        self._amdsmi = amdsmi
        self._handle = amdsmi.amdsmi_get_processor_handles()[index]
        self._pid = os.getpid()

    def read(self) -> int | None:
        entries = self._amdsmi.amdsmi_get_gpu_process_list(self._handle)
        infos = [e if isinstance(e, dict) else self._amdsmi.amdsmi_get_gpu_process_info(self._handle, e)
                 for e in entries]
        return amdsmi_process_vram(infos, self._pid)


def amdsmi_process_vram(infos: list[dict], pid: int) -> int | None:
    """VRAM bytes of `pid` in amdsmi's process records ('memory_usage': {'vram_mem': ...}; older
    releases: 'mem')."""
    for info in infos:
        if int(info.get("pid", -1)) == pid:
            usage = info.get("memory_usage") or {}
            value = usage.get("vram_mem", info.get("mem"))
            return None if value is None else int(value)
    return None


class _SmiCardMemory:
    """ROCm / Hygon DCU without amdsmi: the card's used VRAM from `rocm-smi` or Hygon's `hy-smi`
    (`--showmeminfo vram --json`). Card-level, not per process (`per_process` is False), and each
    call is a subprocess, so it samples less often than the libraries do."""

    per_process = False

    def __init__(self, tool: str, index: int) -> None:
        self._argv = [tool, "--showmeminfo", "vram", "--json"]
        self._index = index

    def read(self) -> int | None:
        import subprocess

        out = subprocess.run(self._argv, capture_output=True, text=True, timeout=10)
        return smi_card_used_vram(out.stdout, self._index) if out.returncode == 0 else None


def smi_card_used_vram(text: str, index: int) -> int | None:
    """'VRAM Total Used Memory (B)' of card `index` in rocm-smi / hy-smi JSON ({"card0": {...}})."""
    import json

    try:
        data = json.loads(text)
    except ValueError:
        return None
    card = data.get(f"card{index}") or {}
    for key, value in card.items():
        if "used" in key.lower() and "vram" in key.lower():
            return int(str(value).strip())
    return None


def device_memory_reader(device: torch.device):
    """A reader of the device's own figure for this process (NVML on NVIDIA; amdsmi, else rocm-smi
    or hy-smi on ROCm / DCU), or None where none is available."""
    if device.type != "cuda":
        return None
    index = device.index or 0
    if torch.version.hip is None:
        try:
            return _NvmlProcessMemory(index)
        except Exception:  # nvidia-ml-py missing or NVML unavailable: report no device figure
            return None
    try:
        return _AmdSmiProcessMemory(index)
    except Exception:  # amdsmi not installed (ROCm < 6, most DCU stacks): the command-line tools
        import shutil

        for tool in ("rocm-smi", "hy-smi"):
            if shutil.which(tool):
                return _SmiCardMemory(tool, index)
        return None


def clock_reader(device: torch.device):
    """The card's SM clock and clock-event reasons (harness.measure.clocks) on NVIDIA, else None."""
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    from harness.measure.clocks import NvmlClockReader

    try:
        return NvmlClockReader(*nvml_handle(device.index or 0))
    except Exception:  # nvidia-ml-py missing, NVML unavailable or the query unsupported: no clocks
        return None


def host_pages(pid: int) -> tuple[int, int | None]:
    """(resident, anonymous + shared) bytes of one process. The resident set also holds file pages
    (libraries, memory-mapped checkpoints) that the kernel can drop under pressure; anonymous pages
    (heap, optimizer state, pinned buffers) and shared memory (batches passed between processes) it
    cannot. Linux reports the split in /proc/<pid>/status (RssAnon, RssShmem), which psutil does not
    read; elsewhere only the resident set is known (None)."""
    import psutil

    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return psutil.Process(pid).memory_info().rss, None
    kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in text.splitlines() if ":" in line)
           if k in ("VmRSS", "RssAnon", "RssShmem")}
    if "VmRSS" not in kib:  # a zombie: nothing resident any more
        return 0, 0
    return kib["VmRSS"] * 1024, (kib["RssAnon"] + kib["RssShmem"]) * 1024 if "RssAnon" in kib else None


class Sampler:
    """Samples the device figure and host memory (self + children) every `interval` seconds, and
    the card's clock where a `clock_reader` is given (harness.measure.clocks)."""

    def __init__(self, device_reader=None, interval: float = 0.02, clock_reader=None) -> None:
        import psutil

        from harness.measure.clocks import ClockSamples

        self._proc = psutil.Process()
        self._device_reader = device_reader
        self._clocks = None if clock_reader is None else ClockSamples(clock_reader)
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="harness-sampler", daemon=True)
        self.device_peak: int | None = None
        self.host_peak = 0  # resident set
        self.host_anon_peak: int | None = None  # its anonymous and shared-memory part (host_pages)

    def _host(self) -> tuple[int, int | None]:
        rss, anon = host_pages(self._proc.pid)
        for child in self._proc.children(recursive=True):
            try:
                child_rss, child_anon = host_pages(child.pid)
            except Exception:  # a worker that exited between listing and reading
                continue
            rss += child_rss
            anon = None if anon is None or child_anon is None else anon + child_anon
        return rss, anon

    def sample(self) -> None:
        rss, anon = self._host()
        self.host_peak = max(self.host_peak, rss)
        if anon is not None:
            self.host_anon_peak = max(self.host_anon_peak or 0, anon)
        if self._device_reader is not None:
            value = self._device_reader.read()
            if value is not None:
                self.device_peak = max(self.device_peak or 0, value)
        if self._clocks is not None:
            try:
                self._clocks.sample()
            except Exception:  # a query this card or driver refuses: stop reading clocks, keep the memory
                self._clocks = None

    def clocks(self):
        """The card's clock since `reset_clocks` (`report.Clocks`), or None where it was not read."""
        return None if self._clocks is None else self._clocks.summary()

    def reset_clocks(self) -> None:
        """Start the clock's window anew (the worker: after the warm-up steps, so the clock and the
        share of the time kernels ran cover the steps tokens/s is timed on, not a compilation)."""
        if self._clocks is not None:
            self._clocks.reset()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()

    def reset(self) -> None:
        self.device_peak = None
        self.host_peak = 0
        self.host_anon_peak = None
        self.sample()

    def __enter__(self):
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.sample()
        return False
