"""The predictor: per-GPU peak memory and host memory of a case at full size, on a CPU.

    from harness.predict.predictor import predict, Prediction
    pred = predict(case, arch=None, platform="nvidia-h100-80gb-hbm3-x1", exclude={case.id})
    pred = predict(case, platform="nvidia-h200-x2", exclude={case.id}, variant="2r4L2ga")  # as measured

A prediction (per GPU process; the worst rank of a sharded job) runs these stages in order, each recorded
in `Prediction.stages` with the method that sized it and its figures (`oom-harness check --explain`):

0. route (`harness.predict.dispatch`): the config's kind picks the table's row, which names the method of
   each part below.
1. trace (`harness.predict.traced`): one training micro-step of the real model code at full width with 1
   and 2 layers, on fake tensors, as the case's stack builds and trains it (`harness.predict.trace.trace`);
   extrapolated affinely to the case's depth. Gives the step's transient peak above the model states, the
   activations a forward keeps, the logits, the parameter inventory, and the step's allocations and frees by
   layer (the allocator model's input). Traces are cached in-process and on disk (keyed by spec, code and
   library versions), so a repeated prediction imports neither torch nor transformers.
2. states (`harness.predict.states`): weights (4-bit storage, fp32 upcasts, ZeRO-3 partitions and
   persistent parameters), adapters, gradients, AdamW / DeepSpeed optimizer state, ZeRO buckets and the
   gathered ZeRO-3 parameters (DeepSpeed's coordinator replayed over the step, `harness.predict.zero3.coordinator`;
   the closed form where it cannot be), offload to host, cuBLAS workspaces.
3. allocated (`harness.predict.allocated`): the states beside the largest of the step's peaks (`terms`), or
   the peak of the step built as one stream with DeepSpeed's gathers in it (`zero3_step_stream`).
4. calibration (`harness.predict.calibration`): the fitted constants, per platform, from results/baselines
   at call time (their priors in `harness.predict.constants`).
5. reserved (`harness.predict.reserved`): the allocator model over the run's stream, over a stream with
   DeepSpeed's buffers in it, or allocated x the fitted ratio; ZeRO-3 in parts (the model's pool beside the
   gather stream's, the fp32 gradient segment, the reduce stream's pool).
6. device (`harness.predict.device`): reserved + what the process holds beside the allocator (the device
   probe's parts where a record of the platform exists, else the fitted device_overhead, + DeepSpeed's), +
   for fla on a cold Triton cache the local memory its spilling autotune candidates grow
   (`harness.predict.local_memory`; the fitted triton_cold_overhead where no survey of its kernels exists).
7. host_ram (whole job on one node): per process an assumed base (torch + CUDA libraries), each dataloader
   worker, plus offloaded optimizer state and parameters (pinned: each partition rounded up to a power of
   two, as torch's pinned host allocator does). Not fitted.
8. margin (`harness.predict.margin`): the device figure's uncertainty, the worst leave-one-out shortfall on
   the benchmark's runs of the same kind of config; `harness.predict.margin.fit_verdict` adds it before
   comparing with the card.

For `launch.procs_per_card > 1` every figure is per process; the caller multiplies.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field

from harness.models.registry import Architecture
from harness.models.source import load_model
from harness.predict.allocated import allocated, step_stream
from harness.predict.calibration import OPTIONAL, Calibration, calibrate
from harness.predict.constants import HOST_PER_WORKER, HOST_PROCESS_BASE, PRIORS, GiB
from harness.predict.device import overhead as device_overhead
from harness.predict.dispatch import route_for
from harness.predict.job import Job, Stage
from harness.predict.local_memory import ColdLocalMemory, cold_local_memory
from harness.predict.margin import Margin, margin_for
from harness.predict.reserved import reserved
from harness.predict.trace.trace import TraceSpec
from harness.predict.traced import Traced, traced, with_states
from harness.spec.schema import Case, Offload
from harness.spec.variants import Variant, parse_variant


@dataclass
class Prediction:
    allocated: int
    reserved: int
    device: int
    host_ram: int
    terms: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    calibrated_on: list[str] = field(default_factory=list)
    fitted: list[str] = field(default_factory=list)
    platform: str = "pooled"
    seconds: float = 0.0
    params_total: int = 0  # logical parameter count at the predicted depth (unquantized, unpartitioned)
    largest_layer_params: int = 0  # largest single module (the head or a layer's biggest linear)
    margin: Margin | None = None  # the uncertainty of `device` (harness.predict.margin); predict() always sets it
    # what the job holds that the prediction could not size, each with how to measure it: a verdict on a
    # prediction with something missing is undecided, never "fits" (harness.predict.margin.FitVerdict)
    missing: list[str] = field(default_factory=list)
    route: str = ""  # the dispatch table's row (harness.predict.dispatch.TABLE)
    kind: dict[str, str] = field(default_factory=dict)  # the config's kind, as the table's columns read it
    stages: list[Stage] = field(default_factory=list)  # each stage's method and figures, in the order run

    def gib(self) -> str:
        return (f"allocated {self.allocated / GiB:.2f} GiB, reserved {self.reserved / GiB:.2f} GiB, "
                f"device {self.device / GiB:.2f} GiB, host {self.host_ram / GiB:.2f} GiB")


def predict(case: Case, arch: Architecture | None = None, *, platform: str | None = None,
            exclude=frozenset(), variant=None) -> Prediction:
    """`variant` (a harness.spec.variants.Variant or its text, e.g. '2r4L2ga'): predict the case as
    measured on that variant (ranks, layers, grad accum applied), to compare with a baseline of it.
    `exclude`: case ids left out of the calibration (a case id excludes every variant of it)."""
    t0 = time.perf_counter()
    if variant:
        case = (variant if isinstance(variant, Variant) else parse_variant(variant)).apply(case)
    job = _job(case, arch or load_model(case.model))
    t = traced(job)
    # where the step is built as one stream with DeepSpeed's gathers among the model's allocations, its
    # allocated peak is the step's. Built before the gathered set is waited for (a forked child may still be
    # replaying it); its notes go where it is used.
    t.stepped = step_stream(job, t.stream_notes)
    with_states(job, t)
    a = allocated(job, t)
    cal, values = _calibrated(job, platform, exclude)
    r = reserved(job, t, a, values)
    device = _device(job, cal, values, platform, r.reserved)
    job.terms["allocator_fragmentation"] = r.reserved - a.peak - r.beyond_allocated
    host = _host(job, t)
    margin = margin_for(job.case, exclude=frozenset(exclude))
    job.notes.append(margin.describe())
    job.notes += margin.notes
    return Prediction(
        margin=margin, allocated=int(a.peak), reserved=r.reserved, device=device, host_ram=int(host), terms=job.terms,
        notes=job.notes, calibrated_on=cal.calibrated_on, fitted=[k for k in cal.values],
        platform=cal.platform, seconds=time.perf_counter() - t0, params_total=t.inv.total,
        largest_layer_params=max(t.inv.head, t.inv.largest_layer_module), missing=job.missing,
        route=job.route.row.name, kind=asdict(job.route.kind), stages=job.stages,
    )


def _job(case: Case, arch: Architecture) -> Job:
    """Stage 0: the case at its depth and its route through the dispatch table."""
    layers = case.layers or arch.layers
    job = Job(case, arch, layers, int(arch.config["hidden_size"]), TraceSpec.of(case, arch), route_for(case))
    if case.layers:
        job.notes.append(f"predicted at {layers} of {arch.layers} layers (the case's `layers`)")
    return job


def _calibrated(job: Job, platform: str | None, exclude) -> tuple[Calibration, dict[str, float]]:
    """Stage 4: the fitted constants on the platform's baselines (the case's own left out), priors where
    none was fitted."""
    cal = calibrate(platform, frozenset(exclude))
    job.notes += cal.notes
    values = {k: cal.values.get(k, v) for k, v in PRIORS.items()}
    job.record("calibration", f"fitted on {cal.platform}" if cal.values else "priors", **values)
    return cal, values


def _device(job: Job, cal: Calibration, values: dict[str, float], platform: str | None, reserve: int) -> int:
    """Stage 6: reserved + what the process holds beside the allocator."""
    case, notes = job.case, job.notes
    measured_only = {k: cal.values[k] for k in OPTIONAL if k in cal.values}  # no prior: where measured
    beside = device_overhead(case, job.arch, platform, {**values, **measured_only})
    notes += beside.notes
    overhead = beside.total
    job.terms.update(beside.terms)
    fla = job.arch.uses_triton_kernels
    if fla and case.launch.triton_cache == "cold":
        local = cold_local_memory(case, job.arch.config, platform, announce=_say)
        if isinstance(local, ColdLocalMemory):
            overhead += local.bytes
            job.terms["triton_cold_local_memory"] = local.bytes
            notes.append(local.note())
        elif (cold := cal.values.get("triton_cold_overhead")) is not None:
            overhead += int(cold)
            job.terms["triton_cold_compile"] = int(cold)
            notes.append(f"cold Triton cache: the kernels' local memory is not known ({local.reason}); what the "
                         "recorded cold runs held beyond warm ones stands in")
        else:
            notes.append(f"cold Triton cache: not included ({local.reason}; and no cold run was measured)")
            job.missing.append("what compiling and autotuning flash-linear-attention's kernels holds on a cold "
                               f"Triton cache (GiBs per process, outside the allocator): {local.reason}; or judge "
                               "the job on a warm cache (--triton-cache warm)")
    elif fla:
        notes.append("fla/Triton: predicted on a warm kernel cache; a cold one adds GiBs outside the allocator "
                     "during the first step (launch.triton_cache: cold predicts that)")
    job.record("device", job.route.device, device=reserve + overhead, reserved=reserve, beside_allocator=overhead)
    return reserve + overhead


def _say(line: str) -> None:
    print(f"oom-harness: {line}", file=sys.stderr, flush=True)


def _host(job: Job, t: Traced) -> int:
    """Stage 7: host memory of the whole job on this node."""
    case, states = job.case, t.states
    ranks = case.launch.ranks * case.launch.procs_per_card
    per_proc_host = HOST_PROCESS_BASE + case.train.dataloader_workers * HOST_PER_WORKER
    per_proc_host += sum(states.host.values())
    for k, v in states.host.items():
        job.terms["host_" + k] = int(v)
    job.terms["host_process_base"] = HOST_PROCESS_BASE
    if case.deepspeed is not None and case.deepspeed.offload_param == Offload.cpu:
        job.notes.append("parameter offload: each rank holds its fp16/bf16 partition in host memory")
    job.notes.append("host_ram: per-process base and per-worker figures are assumptions (not fitted)")
    job.record("host", "assumed per process and worker, + offloaded states", host_ram=ranks * per_proc_host,
               per_process=per_proc_host)
    return ranks * per_proc_host
