"""The predictor's reserved stage: what the caching allocator holds at the peak, by the route's method.

One function per method of the dispatch table (`harness.predict.dispatch.RESERVED`), chosen by
`job.route.reserved` in `METHODS`:

* `stream`: the allocator model (harness.predict.allocator.allocator) over the run's allocation stream built from the
  traces (harness.predict.allocator.stream: the load, optimizer steps until the allocator's state repeats);
* `ratio`: allocated x reserved_over_allocated (harness.predict.calibration, fitted per platform);
* `zero2_stream`: the allocator model over a stream with DeepSpeed's ZeRO-2 buffers in it
  (harness.predict.zero2.stream);
* `zero3_one_pool`: the allocator model over zero.Init's load, the engine's buffers and four micro-steps with
  DeepSpeed's gathers in the model's pool (harness.predict.zero3.stream, `overlap_comm: false`);
* `zero3_model_stream`, `zero3_gather_pool`, `zero3_ratio`: ZeRO-3's reserve in parts, the model's pool (its
  own stream built, or the ratio) beside the gather stream's pool (DeepSpeed's all-gathers replayed through
  the allocator model, harness.predict.zero3.coordinator.gather_pool, or zero3_cached_gathers x the largest gathered
  parameter), the optimizer step's fp32 gradient segment (harness.predict.zero3.step) and the reduce
  stream's pool under optimizer offload.

Each returns the reserve and what of it is held apart from the model's pool (`beyond_allocated`).
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.predict.allocated import Allocated
from harness.predict.allocator.stream import RunShape, StreamError, start_states
from harness.predict.calibration import largest_gather_bytes
from harness.predict.constants import TRITON_BENCH_BUFFER, GiB, MiB
from harness.predict.dispatch import alloc_conf
from harness.predict.job import Job
from harness.predict.trace.trace import extrapolate, simulated_run
from harness.predict.traced import Traced, trainable_sizes
from harness.predict.zero3 import stream as zero3_stream
from harness.predict.zero3.step import fp32_grad_segment, reduce_stream_reserve
from harness.spec.schema import Offload


@dataclass
class Reserved:
    reserved: int
    beyond_allocated: int = 0  # held apart from the model's pool: DeepSpeed's streams, the fp32 gradient


def reserved(job: Job, t: Traced, a: Allocated, values: dict[str, float]) -> Reserved:
    """The stage: the route's reserve method; a stream method that cannot be built stands down to the ratio
    (or ZeRO-3's parts), and says so."""
    method = job.route.reserved
    r, used = METHODS[method](job, t, a, values)
    if job.arch.uses_triton_kernels and job.case.launch.triton_cache == "cold":
        r = Reserved(r.reserved + TRITON_BENCH_BUFFER, r.beyond_allocated + TRITON_BENCH_BUFFER)
        job.terms["triton_autotune_buffer"] = TRITON_BENCH_BUFFER
        job.notes.append(f"reserved: + {TRITON_BENCH_BUFFER // MiB} MiB on a cold Triton cache, the buffer Triton's "
                         "autotuner takes through the allocator to clear the L2 cache between its timings, held "
                         "beside the step's pool (assumed from what the recorded cold runs reserve beyond warm ones)")
    job.record("reserved", used, reserved=r.reserved, by_ratio=int(a.peak * values["reserved_over_allocated"]),
               beyond_allocated=r.beyond_allocated)
    return r


def _ratio(job: Job, t: Traced, a: Allocated, values: dict[str, float]) -> tuple[Reserved, str]:
    ratio = values["reserved_over_allocated"]
    conf = alloc_conf(job.case)
    if job.case.deepspeed is not None:
        job.notes.append(f"reserved: allocated x reserved_over_allocated ({ratio:.3f}); the allocator model does "
                         "not see DeepSpeed's buckets, gathers and offload buffers")
    else:
        job.notes.append(f"reserved: allocated x reserved_over_allocated ({ratio:.3f}); backend:{conf.backend} "
                         "hands memory to CUDA's own pool allocator, which the allocator model does not follow")
    return Reserved(int(a.peak * ratio)), "ratio"


def _stream(job: Job, t: Traced, a: Allocated, values: dict[str, float]) -> tuple[Reserved, str]:
    """The allocator model over the run's stream (harness.predict.allocator.stream)."""
    ratio = values["reserved_over_allocated"]
    by_ratio = int(a.peak * ratio)
    try:
        # one run per device state the load can begin from (stream.start_states): the larger reserve
        sims = [simulated_run(job.trace_spec, shape)
                for shape in start_states(RunShape.of(job.case, job.trace_spec, job.layers))]
    except StreamError as exc:
        job.notes.append(f"reserved: allocated x reserved_over_allocated ({ratio:.3f}); the allocator model "
                         f"could not be used: {exc}")
        return Reserved(by_ratio), "ratio"
    sim = max(sims, key=lambda s: s.peak_reserved)
    job.terms["reserved_by_ratio"] = by_ratio
    settled = ("the allocator's state repeating from there on" if sim.settled
               else "the allocator's state still changing: a later step may reserve more")
    starts = ""
    if len(sims) > 1:
        low = min(s.peak_reserved for s in sims)
        starts = (f"; the larger of the loads onto an empty device and onto one that already holds a tensor "
                  f"(from_pretrained's warm-up block is then 2 MiB smaller): {low / GiB:.2f} and "
                  f"{sim.peak_reserved / GiB:.2f} GiB" if sim.peak_reserved - low >= 2**20 else
                  "; within 1 MiB the same from an empty device and from one that already holds a tensor")
    job.notes.append(f"reserved: the allocator model over the traced load and {sim.steps} optimizer steps "
                     f"({settled}; peak during the {sim.peak_phase}{starts}), not allocated x "
                     f"reserved_over_allocated ({ratio:.3f})")
    return Reserved(max(sim.peak_reserved, a.peak)), "stream"


def _zero2_stream(job: Job, t: Traced, a: Allocated, values: dict[str, float]) -> tuple[Reserved, str]:
    """ZeRO-2: the allocator model over the run's stream with DeepSpeed's buffers in it."""
    ratio = values["reserved_over_allocated"]
    # the allocated stage's runs (the same row sizes both), one per device state the load can begin from
    # (stream.start_states): the larger reserve
    run = max(a.zero2, key=lambda r: r.peak_reserved)
    job.terms["reserved_by_ratio"] = int(a.peak * ratio)
    job.terms["zero2_reduction_stream_segments"] = run.reduction_stream_reserved
    what = ("the boundary's fp64/fp32 gradient casts" if job.case.deepspeed.offload_optimizer == Offload.cpu else
            "the IPG buckets, the gradient partition, the fp32 master partition and its moments")
    job.notes.append(f"reserved: the allocator model over the load, DeepSpeed's flat buffer and two optimizer steps "
                     f"with {what} (rank {run.rank}: {run.reduction_stream_reserved / GiB:.2f} GiB in segments "
                     f"of DeepSpeed's reduction stream; peak during the {run.peak_phase}), not allocated x "
                     f"reserved_over_allocated ({ratio:.3f})")
    return Reserved(max(run.peak_reserved, a.peak)), "zero2_stream"


def _zero3_one_pool(job: Job, t: Traced, a: Allocated, values: dict[str, float]) -> tuple[Reserved, str]:
    """ZeRO-3 with `overlap_comm: false` under the native allocator without expandable segments: the allocator
    model's figures over the one-pool stream. The optimizer is on the host and its reduce path runs on the
    default stream too (MiBs for LoRA): no gather stream, reduce stream or fp32 gradient segment is added
    beside it. With the parameters on the host the coordinator's gathers are put where the trace recorded
    DeepSpeed's hooks firing (placement "recorded"): guide 000's non-reentrant fix reserves 6.56 / 6.57 GiB
    built so at 4 / 8 layers, its ranks 6.41 and 6.66 / 6.42 and 6.22 measured; spread evenly over each
    chunk, 6.66 / 5.91. Where the stream cannot be built, `zero3_ratio`."""
    ratio = values["reserved_over_allocated"]
    shape = zero3_stream.OnePoolShape.of(job.case, job.arch, job.layers, zero3_stream.placement_for(job.case))
    one_pool = zero3_stream.simulated_or_none(job.trace_spec, shape, "the one-pool stream", "the ratio", job.notes)
    if not one_pool:
        return _zero3_ratio(job, t, a, values)
    job.terms["reserved_by_ratio"] = int(a.peak * ratio)
    job.notes.append(f"reserved: the allocator model over zero.Init's load, the engine's buffers and four "
                     f"micro-steps with DeepSpeed's gathers in the model's pool (overlap_comm false; peak during "
                     f"the {one_pool.peak_phase}), not allocated x reserved_over_allocated ({ratio:.3f}) and "
                     "zero3_cached_gathers")
    return Reserved(max(one_pool.peak_reserved, a.peak)), "zero3_one_pool"


def _zero3_model_stream(job: Job, t: Traced, a: Allocated, values: dict[str, float]) -> tuple[Reserved, str]:
    """A ZeRO-3 config with `overlap_comm` whose model's stream is built (a full fine-tune with its
    parameters on the device, or on the host under zero.Init; LoRA with them offloaded): the allocator model
    over the model's own stream (zero.Init's load, DeepSpeed's buffers on that stream, four micro-steps of the
    traced step and, with the optimizer on the device, its fp32 partitions, gradient partitions and sub-group
    steps; the coordinator's gathers left to their own stream), beside the replayed gather stream's pool.
    Phi-3-mini's recorded rank-0 model stream (optimizer offload) reserves 4.297 / 3.764 / 6.262 / 6.752 GiB
    at the end of its load, engine, first forward and first backward, the built one the same to the MiB (the
    ratio gave 6.53); Gemma-2-2B's (optimizer on the device) 33.770 at its peak, in the second optimizer step,
    the built one the same (the ratio and the fp32 gradient segment gave 32.85); Mistral-7B's LoRA with
    parameter offload 0.533 / 1.689 / 1.939 after its load, first forward and backward, the built one the
    same. Where the stream cannot be built, `zero3_gather_pool`."""
    return _zero3_parts(job, t, a, values, build_model_stream=True)


def _zero3_gather_pool(job: Job, t: Traced, a: Allocated, values: dict[str, float]) -> tuple[Reserved, str]:
    """ZeRO-3's model pool by the ratio beside the replayed gather stream's pool (`Gathered.pool_bytes`), where
    the rest of the reserve is checked to be the model's pool. Phi-3-mini's and Gemma-2-2B's recorded
    timelines: the gather stream's pool replayed 2.50 and 4.258 GiB, recorded 2.40 and 4.258; Mistral-7B's
    LoRA with parameter offload, guide 000's 32B at 4 layers (reentrant) and at 2 and 4 layers
    (non-reentrant): 13.959, 6.807, 6.387 and 5.668, recorded 13.959, 6.809, 6.387 and 5.668. Not used
    elsewhere (zero3_cached_gathers is): a full fine-tune with its parameters offloaded has no model's stream
    built; fit's LoRA config for guide 000 (no timeline) reserves 2.8 to 3.2 GiB beyond the ratio and the
    replayed pool; an expandable segment's pool is checked on one run (guide 002: 6.96 GiB replayed, 8.05
    recorded). Where the gathered set was not replayed, `zero3_ratio`."""
    return _zero3_parts(job, t, a, values, build_model_stream=False)


def _zero3_ratio(job: Job, t: Traced, a: Allocated, values: dict[str, float]) -> tuple[Reserved, str]:
    """ZeRO-3: allocated x reserved_over_allocated + zero3_cached_gathers x the largest gathered parameter,
    beside the fp32 gradient segment and the reduce stream's pool."""
    return _zero3_parts(job, t, a, values, build_model_stream=False, gather_pool=False)


def _zero3_parts(job: Job, t: Traced, a: Allocated, values: dict[str, float], *, build_model_stream: bool,
                 gather_pool: bool = True) -> tuple[Reserved, str]:
    """ZeRO-3's reserve in parts: the model's pool, the gather stream's, the optimizer step's fp32 gradient
    segment and the reduce stream's pool (the module's docstring)."""
    case, notes, terms = job.case, job.notes, job.terms
    ratio = values["reserved_over_allocated"]
    reserved = int(a.peak * ratio)
    pool = t.gathered.pool_bytes if gather_pool and t.gathered is not None else None
    if pool is None:
        notes.append(f"reserved: allocated x reserved_over_allocated ({ratio:.3f}); the allocator model does "
                     "not see DeepSpeed's buckets, gathers and offload buffers")
    beyond, model_stream, used = 0, None, "zero3_ratio"
    if pool is not None:
        # the gather stream's pool from the replayed gathers, beside the model's own pool: allocated less what
        # is gathered at its peak, times the ratio, or its own stream built and replayed
        held_gathered = (a.stepped.gathered_at_allocated_peak if a.stepped is not None else
                         t.gathered.backward_start_bytes + (a.gathered_above if a.peak == a.gather_peak else 0))
        if build_model_stream:
            shape = zero3_stream.OnePoolShape.of(case, job.arch, job.layers, "none")
            model_stream = zero3_stream.simulated_or_none(job.trace_spec, shape, "the model's stream",
                                                          "the model's pool by the ratio", notes)
        if model_stream is not None:
            terms["reserved_by_ratio"] = reserved
            model_pool = max(model_stream.peak_reserved, a.peak - held_gathered)
            how = (f"the allocator model over its stream (zero.Init's load, DeepSpeed's buffers on it, four "
                   f"micro-steps and their optimizer steps: {model_pool / GiB:.2f} GiB, peak during the "
                   f"{model_stream.peak_phase})")
            used = "zero3_model_stream"
        else:
            model_pool = int((a.peak - held_gathered) * ratio)
            how = f"(allocated - {held_gathered / GiB:.2f} GiB gathered) x reserved_over_allocated ({ratio:.3f})"
            used = "zero3_gather_pool"
        reserved = model_pool + pool
        terms["zero3_gather_stream_pool"] = pool
        beyond += pool - held_gathered
        notes.append(f"reserved: the model's pool as {how}, beside DeepSpeed's gather stream's pool, "
                     f"{pool / GiB:.2f} GiB (the replayed all-gathers through the allocator model), in "
                     "place of zero3_cached_gathers")
    else:
        cached = int(values["zero3_cached_gathers"] * largest_gather_bytes(case))
        reserved += cached
        terms["zero3_cached_gather_blocks"] = cached
        beyond += cached
    # the optimizer step's fp32 gradient on top of the forward and backward's reserve
    forward_backward = max(a.backward_peak, a.retention_peak, a.gather_peak)
    segment = 0 if model_stream is not None else _fp32_grad_segment(job, t)
    if segment:
        extra = max(0, int(forward_backward * ratio) + segment - int(a.peak * ratio))
        reserved += extra
        terms["zero3_fp32_grad_segment"] = extra
        beyond += extra
        if not extra:
            notes.append("the optimizer step's fp32 gradient segment is within allocated x "
                         "reserved_over_allocated: the optimizer step is the allocated peak")
    reduce_pool = _reduce_stream(job, t)
    if reduce_pool:
        reserved += reduce_pool
        terms["zero3_reduce_stream_pool"] = reduce_pool
        beyond += reduce_pool
    return Reserved(reserved, beyond), used


def _reduce_stream(job: Job, t: Traced) -> int:
    """ZeRO-3 with optimizer offload: what DeepSpeed's reduce stream reserves beside the model's pool
    (harness.predict.zero3.step.reduce_stream_reserve), 0 elsewhere."""
    ranks = job.case.launch.ranks
    partitions = [-(-n // ranks) for n in reversed(trainable_sizes(job.case, t.r1, job.layers, t.r2))]
    pool = reduce_stream_reserve(job.case, partitions, alloc_conf(job.case))
    if pool is None:
        return 0
    job.notes.append(f"ZeRO-3 optimizer offload: DeepSpeed's reduce stream reserves {pool / GiB:.2f} GiB of its "
                     "own (partition_grads' device copies, the boundary's fp64 norm and fp32 cast, stage3.py)")
    return pool


def _fp32_grad_segment(job: Job, t: Traced) -> int:
    """ZeRO-3 without optimizer offload: the segment the optimizer step's fp32 gradient of the largest
    sub-group takes beyond the forward and backward's reserve (harness.predict.zero3.step), 0 elsewhere."""
    case, r1, r2, layers = job.case, t.r1, t.r2, job.layers
    sizes = trainable_sizes(case, r1, layers, r2) if case.method.kind == "full" else None
    trainable = sum(sizes) if sizes else round(extrapolate(r1.params.trainable, r2.params.trainable, layers))
    largest = max([e[2] for r in (r1, r2) for e in r.events if e[0] == 1] + [largest_gather_bytes(case)])
    seg = fp32_grad_segment(case, sizes, trainable, largest)
    if seg is None:
        return 0
    job.notes.append(seg.note)
    return seg.bytes


# the dispatch table's reserve methods (harness.predict.dispatch.RESERVED), by name
METHODS = {"stream": _stream, "ratio": _ratio, "zero2_stream": _zero2_stream, "zero3_one_pool": _zero3_one_pool,
           "zero3_model_stream": _zero3_model_stream, "zero3_gather_pool": _zero3_gather_pool,
           "zero3_ratio": _zero3_ratio}
