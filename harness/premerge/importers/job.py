"""The job's cards, processes and launcher: the command line's (`JobSpec`), else the case file's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.premerge.importers.errors import ConfigError
from harness.premerge.importers.records import LAUNCHERS, TRITON_CACHES, JobSpec
from harness.spec.schema import Case
from harness.spec.units import fmt_gib

_CASE_LAUNCHER = {"python": "python", "torchrun": "torchrun", "accelerate": "torchrun",
                  "llamafactory-cli": "torchrun", "deepspeed": "deepspeed"}


@dataclass(frozen=True)
class Job:
    """The cards and processes of a job, settled: the command line's, else the case file's."""

    gpus: int
    gpu_memory: int
    procs_per_gpu: int
    headroom: float
    host_ram: int | None
    vendor: str
    # `launch.triton_cache`: 'cold' unless told otherwise. A merge gate judges a job's first launch on a
    # host, which compiles flash-linear-attention's Triton kernels (guide 004's OOM); a warm cache is
    # what a host that already ran the job has (--triton-cache warm).
    triton_cache: str = "cold"
    triton_cache_from: str = "not stated: a first launch on a host"

    def ranks(self, launcher: str, has_deepspeed: bool, notes: list[str]) -> int:
        """Ranks of one job: one per GPU, except jobs sharing cards, plain python, and plain DDP."""
        if self.procs_per_gpu > 1:
            notes.append(f"{self.procs_per_gpu} independent single-rank jobs per card")
            return 1
        if launcher == "python":
            return 1
        if not has_deepspeed and self.gpus > 1:
            notes.append("no DeepSpeed: each data-parallel rank holds a full replica; predicted as one rank")
            return 1
        return self.gpus

    def target(self, card_name: str | None = None) -> dict[str, Any]:
        """The case's `target` block."""
        card = {"vendor": self.vendor, "name": card_name or f"{fmt_gib(self.gpu_memory)} card",
                "memory": f"{self.gpu_memory} B", "count": self.gpus}
        return {"card": card, "headroom": self.headroom,
                "host_ram": None if self.host_ram is None else f"{self.host_ram} B"}


def job_of(spec: JobSpec, path: Path, case: Case | None = None) -> Job:
    """Cards and processes from the command line, else from the case file's target."""
    gpus = spec.gpus if spec.gpus is not None else case and case.target.card.count
    memory = spec.gpu_memory if spec.gpu_memory is not None else case and case.target.card.memory
    if gpus is None:
        raise ConfigError(path, None, "the number of GPUs is not known", "pass --gpus N")
    if memory is None:
        raise ConfigError(path, None, "the memory per GPU is not known", "pass --gpu-memory, e.g. --gpu-memory 64GiB")
    if gpus < 1:
        raise ConfigError(None, "--gpus", f"must be at least 1, got {gpus}")
    procs = spec.procs_per_gpu if spec.procs_per_gpu is not None else (case.launch.procs_per_card if case else 1)
    if procs < 1:
        raise ConfigError(None, "--procs-per-gpu", f"must be at least 1, got {procs}")
    headroom = spec.headroom if spec.headroom is not None else (case.target.headroom if case else 0.9)
    if not 0 < headroom <= 1:
        raise ConfigError(None, "--headroom", f"must be in (0, 1], got {headroom}", "e.g. --headroom 0.9")
    host_ram = spec.host_ram if spec.host_ram is not None else (case.target.host_ram if case else None)
    vendor = spec.vendor or (case.target.card.vendor if case else "nvidia")
    if spec.triton_cache is not None:
        if spec.triton_cache not in TRITON_CACHES:
            raise ConfigError(None, "--triton-cache", f"'{spec.triton_cache}' is not a cache state",
                              f"use one of: {', '.join(TRITON_CACHES)}")
        cache, cache_from = TRITON_CACHES[spec.triton_cache], "--triton-cache"
    elif case is not None:
        cache, cache_from = case.launch.triton_cache, "the case file's launch.triton_cache"
    else:
        cache, cache_from = Job.triton_cache, Job.triton_cache_from
    return Job(gpus=gpus, gpu_memory=memory, procs_per_gpu=procs, headroom=headroom, host_ram=host_ram, vendor=vendor,
               triton_cache=cache, triton_cache_from=cache_from)


def launcher_of(spec: JobSpec, default: str, default_from: str) -> tuple[str, str]:
    """The launcher (--launcher, else the format's default) and where it came from."""
    if spec.launcher is None:
        return default, default_from
    if spec.launcher not in LAUNCHERS:
        raise ConfigError(None, "--launcher", f"'{spec.launcher}' is not a launcher the harness knows",
                          f"use one of: {', '.join(LAUNCHERS)}")
    return spec.launcher, "--launcher"


def case_launcher(launcher: str, has_deepspeed: bool) -> str:
    """The case's launcher for how the user starts the job (DeepSpeed's launcher needs a DeepSpeed config)."""
    return "torchrun" if launcher == "deepspeed" and not has_deepspeed else _CASE_LAUNCHER[launcher]
