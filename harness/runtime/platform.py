"""Where a run happens (CUDA, ROCm/DCU, CPU) and how its failures read.

One place knows the platforms: the worker asks it for the device and the communication backend,
the launcher asks it to classify what a dead process printed.
"""

from __future__ import annotations

import glob
import re
from dataclasses import dataclass
from enum import Enum


class Platform(str, Enum):
    cuda = "cuda"
    rocm = "rocm"  # AMD and Hygon DCU, through HIP; torch still speaks torch.cuda
    cpu = "cpu"


# the device files a GPU driver makes: NVIDIA's (Jetson's nvhost among them), the ROCm kernel driver's (AMD,
# Hygon DCU), WSL's. A host with none of them has no card torch could find.
DEVICE_FILES = ("/dev/nvidia*", "/dev/nvhost*", "/dev/kfd", "/dev/dxg")


def no_device_files() -> bool:
    """No GPU driver's device file on this host: the platform is the CPU, known without importing
    torch (1.8 s of CPU in each harness process that only runs tiny cases or collects them)."""
    return not any(glob.glob(pattern) for pattern in DEVICE_FILES)


def detect() -> Platform:
    if no_device_files():
        return Platform.cpu
    import torch

    if torch.cuda.is_available():
        return Platform.rocm if torch.version.hip else Platform.cuda
    return Platform.cpu


def accelerator_count() -> int:
    if no_device_files():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def dist_backend(platform: Platform) -> str:
    return "gloo" if platform == Platform.cpu else "nccl"  # RCCL answers to 'nccl' on ROCm


@dataclass(frozen=True)
class OomInfo:
    platform: str  # "cuda", "hip" or "cpu"
    tried_to_allocate: int | None  # bytes
    message: str


_SIZE = r"(?P<num>[\d.]+)\s*(?P<unit>[KMGT]i?B)"
_OOM_PATTERNS = [
    (re.compile(r"CUDA out of memory\.?(?: Tried to allocate " + _SIZE + ")?"), "cuda"),
    (re.compile(r"HIP out of memory\.?(?: Tried to allocate " + _SIZE + ")?"), "hip"),
    # the harness's emulated card limit on CPU (tiny mode), worded like the GPU message
    (re.compile(r"CPU out of memory \(emulated card\)\.?(?: Tried to allocate " + _SIZE + ")?"), "cpu"),
    # cuBLAS/hipBLAS could not allocate its handle or workspace: the device is out of memory
    (re.compile(r"CUBLAS_STATUS_ALLOC_FAILED"), "cuda"),
    (re.compile(r"HIPBLAS_STATUS_ALLOC_FAILED|rocblas_status_memory_error"), "hip"),
    (re.compile(r"DefaultCPUAllocator: (?:not enough memory|can't allocate memory)"
                r"(?:: you tried to allocate (?P<bytes>\d+) bytes)?"), "cpu"),
]


def parse_oom(text: str) -> OomInfo | None:
    """Find an out-of-memory error in an exception message or a log."""
    from harness.spec.units import parse_size

    for pattern, platform in _OOM_PATTERNS:
        m = pattern.search(text)
        if not m:
            continue
        size = None
        groups = m.groupdict()
        if groups.get("num"):
            size = parse_size(f"{groups['num']} {groups['unit']}")
        elif groups.get("bytes"):
            size = int(groups["bytes"])
        line = next((ln for ln in text.splitlines() if m.group(0) in ln), m.group(0))
        return OomInfo(platform=platform, tried_to_allocate=size, message=line.strip()[:500])
    return None
