"""The device figure beyond reserved memory: the probe's measured parts a config uses, or the fitted overhead.

device = reserved + CUDA/HIP context + cuBLAS + attention kernels (or Triton, for
flash-linear-attention models) + bitsandbytes (QLoRA) + NCCL at the job's world size (several
ranks), or a DeepSpeed job's part at it, NCCL included. The parts are named constants per platform,
measured by `python -m harness.runtime.device_probe` and kept with their provenance in
`results/device/<platform>.json` (`harness.measure.device_parts`). Where the platform has no record,
or its record lacks a part the config uses, the overhead fitted on the baselines stands in
(`device_overhead`, plus `device_overhead_deepspeed` for DeepSpeed; `harness.predict.calibration`),
and the notes say which was used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from harness.measure.device_parts import DeviceRecordError, record_for
from harness.models.registry import Architecture
from harness.spec.schema import Case
from harness.spec.suite import ROOT

DEVICE_DIR = ROOT / "results" / "device"


@dataclass
class Overhead:
    """What a process holds beside the allocator's reserved memory, term by term."""

    terms: dict[str, int]
    source: str  # "probe" or "fitted"
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.terms.values())


def parts_used(case: Case, arch: Architecture) -> list[str]:
    """The probe's parts a training process of this case loads."""
    used = ["cuda_context", "cublas"]
    used.append("triton" if arch.uses_triton_kernels else "attention")
    if case.method.kind == "qlora":
        used.append("bitsandbytes")
    if case.deepspeed is not None:
        used.append("deepspeed")  # the job's NCCL communicators as DeepSpeed makes them, included
    elif case.launch.ranks > 1:
        used.append("nccl")
    return used


def overhead(case: Case, arch: Architecture, platform: str | None, fitted: dict[str, float],
             folder: Path | None = None) -> Overhead:
    """The overhead from the platform's probe record where it has every part the case uses, else the
    fitted constants (`fitted`: the calibration's values, priors filled in)."""
    notes = []
    try:
        record, where = record_for(platform, folder or DEVICE_DIR)
    except DeviceRecordError as exc:
        record, where = None, str(exc)
        notes.append(f"device probe record unreadable: {exc}")
    if record is not None:
        terms, missing = {}, []
        for name in parts_used(case, arch):
            if name in ("nccl", "deepspeed"):
                value, how = (record.nccl_for if name == "nccl" else record.deepspeed_for)(case.launch.ranks)
                notes.append(f"{'NCCL' if name == 'nccl' else 'DeepSpeed'} at {case.launch.ranks} ranks: {how}")
            else:
                value = record.part(name)
            if value is None:
                missing.append(name)
            else:
                terms[f"device_{name}"] = int(value)
        if not missing:
            notes.append(f"device = reserved + the parts the device probe measured on {record.card} "
                         f"(torch {record.torch}, CUDA {record.cuda or record.hip}, driver {record.driver}, "
                         f"{record.date}; {where}): {', '.join(parts_used(case, arch))}")
            return Overhead(terms=terms, source="probe", notes=notes)
        notes.append(f"{where} has no figure for {', '.join(missing)}: the fitted overhead is used")
    else:
        notes.append(f"device = reserved + the overhead fitted on the baselines ({where})")
    terms = {"context_and_workspaces": int(fitted["device_overhead"])}
    if case.deepspeed is not None:
        terms["context_and_workspaces"] += int(fitted["device_overhead_deepspeed"])
    return Overhead(terms=terms, source="fitted", notes=notes)
