"""ZeRO-2 with optimizer offload: the run's allocation stream with DeepSpeed's own buffers in it.

The allocator model (`harness.predict.allocator`) needs every allocation of the run; the traced step
(`harness.predict.stream`) has the model's, and for a ZeRO-2 engine that offloads the optimizer what
DeepSpeed 0.19.8 adds on the device is few enough to put in by name (runtime/zero/stage_1_and_2.py,
`DeepSpeedZeroOptimizer`):

1. **The load** as `from_config` builds the model on the device (`harness.runtime.build`): every
   parameter in the half dtype, in the layout's order (no warm-up block, no checkpoint); a tied output
   head is built and freed when it is tied to the embedding.
2. **The engine** (`DeepSpeedZeroOptimizer.__init__`): `empty_cache()` before flattening (which gives
   back the segments the load left wholly free), the flat buffer of every trainable parameter in the
   half dtype (`flatten_dense_tensors_aligned`, padded to 2 x ranks elements), the parameters' own
   storage freed (they become views of it), the rank's partition cloned on the device and moved to
   the host as its fp32 master (`weights_partition`), and `temp_grad_buffer_for_gpu_offload`, the
   largest trainable parameter, kept.
3. **The micro-steps** from the traced step at full depth (`harness.predict.stream.expand`), each
   gradient freed as it is accumulated (DeepSpeed copies it into its bucket at once), with the
   cuBLAS workspaces where `run_stream` puts them.
4. **The gradient-accumulation boundary**: `copy_grads_in_partition`, run on DeepSpeed's
   `reduction_stream` under `overlap_comm`, for every parameter slice of the rank's partition casts
   the slice to fp64 for its norm (`set_norm_for_param_grad_in_gpu`, `get_norm_dtype()`: 8 bytes per
   element) and then to fp32 to copy it to the host (`async_inplace_copy_grad_to_fp32_buffer_from_gpu`:
   4 bytes per element). The caching allocator keeps the blocks of each stream apart, so these
   segments are added to what the default stream has cached, never taken from it. Without
   `overlap_comm` they run on the default stream.

Two optimizer steps of `min(grad_accum, 2)` micro-steps each, as `run_stream`; the optimizer itself
runs on the host. Every rank is built (its partition decides the boundary's casts) and the worst
kept. What is left out: DeepSpeed's clone of each gradient larger than `reduce_bucket_size`
(`reduce_independent_p_g_buckets_and_remove_grads`, held until its bucket is reduced) and the IPG
bucket buffers, which the trace's at-once free of every gradient stands in for, and tensors of a few
bytes (norms, overflow flags).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from harness.predict.allocator import AllocatorConf, CachingAllocator
from harness.predict.step import TraceResult, TraceSpec
from harness.predict.stream import CUBLAS_HANDLE_WORKSPACE, Stream, built_from_config, expand, layout_at, module_order
from harness.spec.schema import Case, Offload

DEFAULT_STREAM, REDUCTION_STREAM = 0, 1
NORM_BYTES = 8  # get_norm_dtype(): torch.double where the device has fp64
FP32_BYTES = 4
NCCL_START_ALIGNMENT = 2  # DeepSpeedZeroOptimizer.nccl_start_alignment_factor
EMPTY_CACHE = None  # an op of its own in `Stream.ops`: DeepSpeed's empty_cache() before flattening


@dataclass(frozen=True)
class Zero2Shape:
    """What of a ZeRO-2 offload case shapes its stream beside the traces."""

    layers: int
    grad_accum: int
    ranks: int
    half_bytes: int
    overlap_comm: bool
    alloc_conf: str = ""

    @classmethod
    def of(cls, case: Case, layers: int) -> Zero2Shape:
        from harness.predict.stream import HALF_BYTES

        return cls(layers=layers, grad_accum=case.train.grad_accum, ranks=case.launch.ranks,
                   half_bytes=HALF_BYTES[case.precision.value],
                   overlap_comm=case.deepspeed.overlap_comm,
                   alloc_conf=case.launch.env.get("PYTORCH_CUDA_ALLOC_CONF", ""))


@dataclass(frozen=True)
class Zero2Run:
    peak_reserved: int
    peak_allocated: int
    peak_phase: str
    reduction_stream_reserved: int  # what the boundary's casts hold in segments of their own stream
    rank: int  # the rank whose stream peaked highest


def applies(case: Case) -> bool:
    """A case this stream is built for: a full fine-tune (the model `from_config` builds on the device)
    under ZeRO-2 with the optimizer offloaded and contiguous gradients (the path through
    `copy_grads_in_partition`). A LoRA run's DeepSpeed buffers are its adapters' (MiB) and keep the
    ratio: on guide 001's rung 2 (fp16, no checkpointing) the expanded step leaves one 21 MiB block
    per layer live after each micro-step (`harness.predict.stream.expand` finds no counterpart to
    free), which takes the stream's reserved peak to 30.56 GiB against 28.84 measured; QLoRA loads a
    checkpoint through bitsandbytes, not this load."""
    ds = case.deepspeed
    return (ds is not None and ds.stage == 2 and ds.offload_optimizer == Offload.cpu and ds.contiguous_gradients
            and case.method.kind == "full")


def partition_slices(sizes: list[int], ranks: int, rank: int) -> list[int]:
    """Elements of each parameter (in flat-buffer order) that fall in `rank`'s partition of the flat
    buffer, padded as `flatten_dense_tensors_aligned` pads it: the slices `grad_position` records."""
    total = sum(sizes)
    align = NCCL_START_ALIGNMENT * ranks
    part = -(-total // align) * align // ranks
    lo, hi = rank * part, (rank + 1) * part
    out, start = [], 0
    for n in sizes:
        a, b = max(start, lo), min(start + n, hi)
        if b > a:
            out.append(b - a)
        start += n
    return out


def build(r1: TraceResult, r2: TraceResult, shape: Zero2Shape, rank: int) -> tuple[Stream, set[int]]:
    """The stream of `rank` and the ids of its allocations on the reduction stream."""
    stream = Stream([], [], [])
    side: set[int] = set()
    half = shape.half_bytes
    rows = module_order(layout_at(r1.layout, r2.layout, shape.layers))

    stream.mark("load")
    trainable = built_from_config(rows, r1.params, half, stream)  # the ids of the trainable parameters' storage
    flat_sizes = [r[0] for r in rows if r[3]]
    largest = max(flat_sizes, default=0)

    stream.mark("engine")
    stream.ops.append(EMPTY_CACHE)
    align = NCCL_START_ALIGNMENT * shape.ranks
    flat = -(-sum(flat_sizes) // align) * align
    stream.alloc(flat * half)
    for ident in trainable:  # the trainable parameters become views of the flat buffer; frozen ones stay
        stream.free(ident)
    stream.free(stream.alloc(flat // shape.ranks * half))  # the partition's clone, moved to the host
    stream.alloc(largest * half)  # temp_grad_buffer_for_gpu_offload
    slices = partition_slices(flat_sizes, shape.ranks, rank)

    def boundary():
        for n in reversed(slices):  # the gradients come in the reverse of the parameters' order
            norm = stream.alloc(n * NORM_BYTES)
            stream.free(norm)
            copy = stream.alloc(n * FP32_BYTES)
            stream.free(copy)
            if shape.overlap_comm:
                side.update((norm, copy))

    micro_steps = min(shape.grad_accum, 2)
    for step in range(2):
        left: list[int] = []
        for micro in range(micro_steps):
            stream.mark("step")
            if step == micro == 0:
                stream.alloc(CUBLAS_HANDLE_WORKSPACE)
            hook = (lambda: stream.alloc(CUBLAS_HANDLE_WORKSPACE)) if step == micro == 0 else None
            left += expand(r1, r2, shape.layers, stream, hook)
            if micro == micro_steps - 1:
                boundary()
        stream.mark("optimizer")
        for ident in left:
            stream.free(ident)
    return stream, side


def simulate(stream: Stream, side: set[int], conf: AllocatorConf | None = None) -> tuple[int, int, str, int]:
    """(peak reserved, peak allocated, phase of the reserved peak, reserved on the reduction stream)."""
    sim = CachingAllocator(conf)
    blocks: dict[int, object] = {}
    stats = sim.stats
    peak, peak_at = -1, 0
    for i, op in enumerate(stream.ops):
        if op is EMPTY_CACHE:
            sim.empty_cache()
        elif op >= 0:
            blocks[op] = sim.malloc(stream.sizes[op], REDUCTION_STREAM if op in side else DEFAULT_STREAM)
            if stats.reserved > peak:
                peak, peak_at = stats.reserved, i
        else:
            block = blocks.pop(-op - 1, None)
            if block is not None:
                sim.free(block)
    phase = next((name for name, start in reversed(stream.phases) if start <= peak_at), "load")
    side_reserved = sum(s.size for s in sim.segments() if s.stream == REDUCTION_STREAM)
    return max(peak, 0), stats.peak_allocated, phase, side_reserved


def zero2_offload_run(r1: TraceResult, r2: TraceResult, shape: Zero2Shape) -> Zero2Run:
    """The allocator model over each rank's stream; the rank with the highest reserved peak."""
    conf = AllocatorConf.parse(shape.alloc_conf, "PYTORCH_CUDA_ALLOC_CONF")
    best = None
    for rank in range(shape.ranks):
        peak, allocated, phase, side = simulate(*build(r1, r2, shape, rank), conf)
        if best is None or peak > best.peak_reserved:
            best = Zero2Run(peak, allocated, phase, side, rank)
    return best


@functools.lru_cache(maxsize=64)
def simulated(spec: TraceSpec, shape: Zero2Shape) -> Zero2Run:
    """`zero2_offload_run` over the traces of `spec`, cached in-process and on disk beside the traces
    (keyed by both and by the code of this module, the stream and the allocator model)."""
    from harness.predict.trace import cached_on_disk, trace_pair

    return cached_on_disk("zero2", spec, shape, ("zero2_stream.py", "stream.py", "allocator.py"),
                          lambda: zero2_offload_run(*trace_pair(spec), shape), lambda d: Zero2Run(**d))
