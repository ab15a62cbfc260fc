"""The device figure beyond reserved memory: the probe's measured parts a config uses, or the fitted overhead.

device = reserved + CUDA/HIP context + cuBLAS + attention kernels (or Triton, for
flash-linear-attention models) + bitsandbytes (QLoRA) + NCCL at the job's world size (several
ranks), or a DeepSpeed job's part at it, NCCL included (two communicators where the job's process
group ran a collective before the engine was made, `collective_before_engine`). The parts are named
constants per platform, measured by `python -m harness.runtime.device_probe` and kept with their provenance in
`results/device/<platform>.json` (`harness.measure.device_parts`). Where the platform has no record,
or its record lacks a part the config uses, the overhead fitted on the baselines stands in
(`device_overhead`, plus `device_overhead_deepspeed` or `..._after_collective` for DeepSpeed;
`harness.predict.calibration`),
and the notes say which was used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from harness.measure.device_parts import DeviceRecord, DeviceRecordError, record_for
from harness.models.registry import Architecture
from harness.predict.step import framework_trains
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
    if case.deepspeed is not None:  # the job's NCCL communicators as DeepSpeed makes them, included
        used.append("deepspeed_after_collective" if collective_before_engine(case) else "deepspeed")
    elif case.launch.ranks > 1 or trainer_process_group(case):
        used.append("nccl")
    return used


def trainer_process_group(case: Case) -> bool:
    """Whether a framework's trainer makes an NCCL communicator even for one rank: in a rank's environment
    (torchrun's, which the harness's launcher gives every worker, `harness.runtime.ranks`) the HF Trainer's
    accelerate state initialises the process group and its first barrier makes the communicator. Measured:
    every one-rank LLaMA-Factory run held 1.29 GiB above its reserved peak, the one-rank DeepSpeed runs'
    figure, against 0.74 GiB for the harness's own loop (results/runs/2026-11-29-h200-llamafactory.json). A
    one-GPU `llamafactory-cli train` outside the harness starts no process group and holds 0.55 GiB less."""
    return framework_trains(case)


def collective_before_engine(case: Case) -> bool:
    """Whether a DeepSpeed job runs a collective on its default process group before deepspeed.initialize:
    then that group's NCCL communicator is made first and the engine's data-parallel group makes a second one
    (`DEEPSPEED_AFTER_COLLECTIVE`; on an H200 390 MiB more per rank at one rank, 288 at two). A job that loads
    a checkpoint does: the harness's ranks wait at a barrier while rank 0 writes the random-weight
    checkpoint (`harness.runtime.build`), as a Trainer's wait while its main process prepares the data. A
    job that builds its model from its config on the card (the harness's other runs) makes the engine first."""
    return case.launch.model_source == "checkpoint"


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
            if name == "nccl":
                value, how = record.nccl_for(case.launch.ranks)
                notes.append(f"NCCL at {case.launch.ranks} ranks: {how}")
            elif name.startswith("deepspeed"):
                after = name == "deepspeed_after_collective"
                value, how = record.deepspeed_for(case.launch.ranks, after_collective=after)
                notes.append(f"DeepSpeed at {case.launch.ranks} ranks"
                             f"{' after a collective on the default process group' if after else ''}: {how}")
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
        name = "device_overhead_deepspeed"
        if collective_before_engine(case):
            if fitted.get(name + "_after_collective") is not None:
                name += "_after_collective"
            else:
                extra, said = second_communicator(case.launch.ranks, folder or DEVICE_DIR)
                if extra is not None:
                    terms["second_nccl_communicator"] = extra
                notes.append("no baseline of a DeepSpeed job whose process group ran a collective before its engine "
                             f"on this platform: fitted on those that did not, {said}")
        terms["context_and_workspaces"] += int(fitted[name])
    return Overhead(terms=terms, source="fitted", notes=notes)


def second_communicator(ranks: int, folder: Path) -> tuple[int | None, str]:
    """What a DeepSpeed job's second NCCL communicator holds per rank at `ranks` ranks, as the probe measured it on
    another platform (`DEEPSPEED_AFTER_COLLECTIVE` less `DEEPSPEED`: NCCL's buffers, not the card's), for a
    platform whose baselines have no such job: (bytes or None, what the notes say)."""
    for path in sorted(Path(folder).glob("*.json")):
        try:
            record = DeviceRecord.read(path)
        except DeviceRecordError:
            continue
        after, _ = record.deepspeed_for(ranks, after_collective=True)
        plain, how = record.deepspeed_for(ranks)
        if after is not None and plain is not None:
            extra = max(0, after - plain)
            return extra, (f"plus the second NCCL communicator the device probe measured on {record.card} "
                           f"({record.date}, {how}): {extra / 2**20:.0f} MiB")
    return None, "with no probe record that measured a second NCCL communicator"
