"""ZeRO-2: the run's allocation stream with DeepSpeed's own buffers in it.

The allocator model (`harness.predict.allocator.allocator`) needs every allocation of the run; the traced step
(`harness.predict.allocator.stream`) has the model's, and what DeepSpeed 0.19.8's ZeRO-2 engine adds on the device
(runtime/zero/stage_1_and_2.py, `DeepSpeedZeroOptimizer`) is few enough to put in by name. Both builds share
the load, the flat buffer, the micro-steps and the norms' fp64 casts; they differ in where the optimizer
and the gradient partition live.

**With the optimizer on the host** (a full fine-tune, `build`, `offload=True`):

1. **The load** as `from_config` builds the model on the device (`harness.runtime.build`): every
   parameter in the half dtype, in the layout's order (no warm-up block, no checkpoint); a tied output
   head is built and freed when it is tied to the embedding.
2. **The engine** (`DeepSpeedZeroOptimizer.__init__`): `empty_cache()` before flattening (which gives
   back the segments the load left wholly free), the flat buffer of every trainable parameter in the
   half dtype (`flatten_dense_tensors_aligned`, padded to 2 x ranks elements), the parameters' own
   storage freed (they become views of it), the rank's partition cloned on the device and moved to
   the host as its fp32 master (`weights_partition`), and `temp_grad_buffer_for_gpu_offload`, the
   largest trainable parameter, kept.
3. **The micro-steps** from the traced step at full depth (`harness.predict.allocator.stream.expand`), each
   gradient freed as it is accumulated (DeepSpeed copies it into its bucket at once), with the
   cuBLAS workspaces (below).
4. **The gradient-accumulation boundary**: `copy_grads_in_partition`, run on DeepSpeed's
   `reduction_stream` under `overlap_comm`, for every parameter slice of the rank's partition casts
   the slice to fp64 for its norm (`set_norm_for_param_grad_in_gpu`, `get_norm_dtype()`: 8 bytes per
   element) and then to fp32 to copy it to the host (`async_inplace_copy_grad_to_fp32_buffer_from_gpu`:
   4 bytes per element). The caching allocator keeps the blocks of each stream apart, so these
   segments are added to what the default stream has cached, never taken from it. Without
   `overlap_comm` they run on the default stream.

Left out there: DeepSpeed's clone of each gradient larger than `reduce_bucket_size`
(`reduce_independent_p_g_buckets_and_remove_grads`, held until its bucket is reduced) and the IPG
bucket buffers, which the trace's at-once free of every gradient stands in for, and tensors of a few
bytes (norms, overflow flags).

**With the optimizer on the device** (LoRA, QLoRA or a full fine-tune, `offload=False`), each allocation
as the recorded timelines show it (`results/fitted/timelines/`, `results/architectures/timelines/`):

1. **The load** as the case's stack loads it (`harness.predict.allocator.stream.load_stream`), peft's adapters (and,
   through peft's k-bit preparation, a 4-bit model's unquantized parameters) in fp32.
2. **The engine**: `_cast_module_mixed_precision` (runtime/engine.py) casts every fp32 parameter to the
   half dtype in module order (the fp32 copy freed); `empty_cache()`; the flat buffer as above; the
   rank's partition cloned in the half dtype and cast to its fp32 master (`weights_partition`, kept, the
   clone freed); `initialize_optimizer_states`' fp32 gradient partition, allocated and dropped.
3. **The micro-steps**, with DeepSpeed's gradient hook (`reduce_independent_p_g_buckets_and_remove_grads`)
   after each gradient the backward hands a parameter: at the first, `setup_buckets` allocates the IPG
   buffers (`reduce_bucket_size` elements in the half dtype; two under `overlap_comm`); a gradient that
   would overflow the bucket reduces it first (`reduce_ipg_grads`); each gradient is then copied into the
   bucket and freed, one larger than the bucket kept until the next reduction. A reduction on several
   ranks whose bucket spans two ranks' partitions flattens its slices (`allreduce_bucket`: a transient of
   the bucket's elements); the first reduction of the rank's own parameters allocates `grads_in_partition`
   (`copy_grads_in_partition`: every parameter of the partition, in the half dtype), both on the
   `reduction_stream` under `overlap_comm`. The backward's end reduces what is left, and
   `_release_ipg_buffers` drops the IPG buffers. The first micro-step's partition buffer holds the
   gradients to the step; a later micro-step's is freed at its backward's end (so on all three recorded
   timelines).
4. **The step** (`DeepSpeedZeroOptimizer.step`): `get_grad_norm_direct` casts each gradient of the
   partition to fp64 for its norm; the partition's gradients flattened (half) and cast to fp32
   (`single_grad_partition`, held through the update); the flat copy and the gradients freed; at the
   first step DeepSpeed's FusedAdam makes its two moments (fp32, the partition); the fp32 gradient freed.
   What the fp16 loss scaler and the overflow checks allocate are a few bytes each.

The backward's cuBLAS workspace comes at the autograd thread's first matmul, the output head's input
gradient (`TraceResult.matmuls`, the backward's first), after the loss's backward, as the recorded timelines
show it: placed where the backward begins, it splits the segment the loss's fp32 upcast left free and the
log-softmax's gradient takes a segment of its own.

Two optimizer steps of `min(grad_accum, 2)` micro-steps each, as `run_stream`. Every rank is built (its
partition decides the boundary's casts and buffers) and the worst kept.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from harness.predict.allocator.allocator import AllocatorConf, CachingAllocator
from harness.predict.allocator.stream import (
    BACKWARD,
    RunShape,
    Stream,
    backward_matmul_traced,
    built_from_config,
    expand,
    layout_at,
    load_stream,
    module_order,
)
from harness.predict.constants import CUBLAS_HANDLE_WORKSPACE, FP32_BYTES, HALF_BYTES, NCCL_START_ALIGNMENT, NORM_BYTES
from harness.predict.step import TraceResult, TraceSpec
from harness.predict.trace.trace import cached_on_disk, trace_pair
from harness.spec.dsconfig import auto_sizes
from harness.spec.schema import Case, Offload

DEFAULT_STREAM, REDUCTION_STREAM = 0, 1
EMPTY_CACHE = None  # an op of its own in `Stream.ops`: DeepSpeed's empty_cache() before flattening


@dataclass(frozen=True)
class Zero2Shape:
    """What of a ZeRO-2 case shapes its stream beside the traces."""

    layers: int
    grad_accum: int
    ranks: int
    half_bytes: int
    overlap_comm: bool
    alloc_conf: str = ""
    offload: bool = True  # the optimizer on the host
    bucket: int = 0  # reduce_bucket_size, elements (the optimizer on the device)
    model_source: str = "config"
    double_quant: bool = False
    kbit_fp32: bool = False  # peft's k-bit preparation held the unquantized parameters in fp32 before the engine
    # bytes on the device when the load begins (harness.predict.allocator.stream.start_states)
    held_before_load: int = 0

    @classmethod
    def of(cls, case: Case, layers: int, hidden: int = 0) -> Zero2Shape:

        ds = case.deepspeed
        q = case.method.quantization
        offload = ds.offload_optimizer == Offload.cpu
        return cls(layers=layers, grad_accum=case.train.grad_accum, ranks=case.launch.ranks,
                   half_bytes=HALF_BYTES[case.precision.value], overlap_comm=ds.overlap_comm,
                   alloc_conf=case.launch.env.get("PYTORCH_CUDA_ALLOC_CONF", ""), offload=offload,
                   bucket=0 if offload else ds.reduce_bucket_size or auto_sizes(hidden)["reduce_bucket_size"],
                   model_source="config" if offload else case.launch.model_source,
                   double_quant=bool(q is not None and q.double_quant),
                   kbit_fp32=case.method.kind == "qlora" and case.stack.kbit_prepared)


@dataclass(frozen=True)
class Zero2Run:
    peak_reserved: int
    peak_allocated: int
    peak_phase: str
    reduction_stream_reserved: int  # what DeepSpeed's reduction stream holds in segments of its own
    rank: int  # the rank whose stream peaked highest


def partition_slices(sizes: list[int], ranks: int, rank: int) -> list[int]:
    """Elements of each parameter (in flat-buffer order) that fall in `rank`'s partition of the flat
    buffer, padded as `flatten_dense_tensors_aligned` pads it: the slices `grad_position` records."""
    lo, hi = _partition_range(sizes, ranks, rank)
    out, start = [], 0
    for n in sizes:
        a, b = max(start, lo), min(start + n, hi)
        if b > a:
            out.append(b - a)
        start += n
    return out


def _partition_range(sizes: list[int], ranks: int, rank: int) -> tuple[int, int]:
    align = NCCL_START_ALIGNMENT * ranks
    part = -(-sum(sizes) // align) * align // ranks
    return rank * part, (rank + 1) * part


def _engine_flat(stream: Stream, trainable: list[int], sizes: list[int], shape: Zero2Shape) -> int:
    """`empty_cache()`, then the flat buffer of the trainable parameters, whose own storage is freed (they
    become views of it). Returns the partition's elements."""
    stream.mark("engine")
    stream.ops.append(EMPTY_CACHE)
    align = NCCL_START_ALIGNMENT * shape.ranks
    flat = -(-sum(sizes) // align) * align
    stream.alloc(flat * shape.half_bytes)
    for ident in trainable:
        stream.free(ident)
    return flat // shape.ranks


def _norm_casts(stream: Stream, slices, side: set[int] | None = None) -> None:
    """Each gradient slice cast to fp64 for its norm and freed (`get_norm_dtype()`)."""
    for n in slices:
        ident = stream.alloc(n * NORM_BYTES)
        stream.free(ident)
        if side is not None:
            side.add(ident)


def _backward_workspace(r1: TraceResult, r2: TraceResult, shape: Zero2Shape, stream: Stream) -> dict:
    """`expand`'s hook that gives the autograd thread its cuBLAS workspace: after the output of the
    backward's first matmul (the head's input gradient) where the trace found it, else where the
    backward begins."""
    def workspace():
        stream.alloc(CUBLAS_HANDLE_WORKSPACE)

    if backward_matmul_traced(r1, r2, shape.layers):
        return {"on_matmul": lambda phase: workspace() if phase == BACKWARD else None}
    return {"on_backward": workspace}


def _micro_steps(r1: TraceResult, r2: TraceResult, shape: Zero2Shape, stream: Stream, at_boundary,
                 on_grad=None, after_backward=None) -> None:
    """Two optimizer steps of `min(grad_accum, 2)` micro-steps: `at_boundary(step)` after the last
    micro-step's backward, `after_backward(micro)` after each, `on_grad(micro)` the gradient hook of each
    micro-step. The cuBLAS workspaces come at the first forward and at the first backward's first matmul."""
    micro_steps = min(shape.grad_accum, 2)
    for step in range(2):
        left: list[int] = []
        for micro in range(micro_steps):
            stream.mark("step")
            first = step == micro == 0
            if first:
                stream.alloc(CUBLAS_HANDLE_WORKSPACE)
            left += expand(r1, r2, shape.layers, stream, on_grad=on_grad(micro) if on_grad else None,
                           **(_backward_workspace(r1, r2, shape, stream) if first else {}))
            if after_backward is not None:
                after_backward(micro)
            if micro == micro_steps - 1:
                at_boundary(step)
        stream.mark("optimizer")
        for ident in left:
            stream.free(ident)


def _rows(r1: TraceResult, r2: TraceResult, shape: Zero2Shape) -> list:
    """The parameters in module order at the case's depth; the trainable ones make the flat buffer."""
    return module_order(layout_at(r1.layout, r2.layout, shape.layers))


def build(r1: TraceResult, r2: TraceResult, shape: Zero2Shape, rank: int) -> tuple[Stream, set[int]]:
    """The stream of `rank` and the ids of its allocations on the reduction stream."""
    if not shape.offload:
        return _merged(_build_shared(r1, r2, shape), rank)
    stream = Stream([], [], [])
    side: set[int] = set()
    half = shape.half_bytes
    rows = _rows(r1, r2, shape)

    stream.mark("load")
    trainable = built_from_config(rows, r1.params, half, stream)  # the ids of the trainable parameters' storage
    flat_sizes = [r[0] for r in rows if r[3]]
    largest = max(flat_sizes, default=0)

    part = _engine_flat(stream, trainable, flat_sizes, shape)
    stream.free(stream.alloc(part * half))  # the partition's clone, moved to the host
    stream.alloc(largest * half)  # temp_grad_buffer_for_gpu_offload
    slices = partition_slices(flat_sizes, shape.ranks, rank)

    def boundary(step):
        for n in reversed(slices):  # the gradients come in the reverse of the parameters' order
            _norm_casts(stream, (n,), side if shape.overlap_comm else None)
            copy = stream.alloc(n * FP32_BYTES)
            stream.free(copy)
            if shape.overlap_comm:
                side.add(copy)

    _micro_steps(r1, r2, shape, stream, boundary)
    return stream, side


@dataclass
class _Shared:
    """The on-device build of every rank at once. Under ZeRO-2 the ranks' streams differ only in what their
    partition decides: when `grads_in_partition` is made and how large it is, and the step's fp64 norm
    casts. `stream` holds the rest, the same on every rank; `side[rank]` that rank's own allocations
    (position in `stream.ops` before which each comes, size, or -1 - the index of the allocation it frees:
    the partition buffer, and under `overlap_comm` allreduce_bucket's transients, the same on every rank);
    `casts`, the positions of the step's norm casts; `slices[rank]`, the elements each casts; `on_side`,
    whether the rank's own allocations are on DeepSpeed's reduction stream (`overlap_comm`)."""

    stream: Stream
    side: list[list[tuple[int, int]]]
    casts: list[int]
    slices: list[list[int]]
    on_side: bool


class _Reducer:
    """DeepSpeed's gradient hook over one micro-step (`reduce_independent_p_g_buckets_and_remove_grads`),
    for every rank at once, the gradients in the reverse of the flat buffer's order."""

    def __init__(self, shared: _Shared, shape: Zero2Shape, sizes: list[int], keep_partition: bool):
        self.shared, self.stream, self.shape = shared, shared.stream, shape
        self.sizes = sizes
        self.bounds = [_partition_range(sizes, shape.ranks, r) for r in range(shape.ranks)]
        self.position = sum(sizes)  # the flat offset where the next gradient's parameter ends
        self.next = len(sizes) - 1
        self.buffers: list[int] = []
        self.bucket: list[tuple[int, int]] = []  # (start, elements) of each parameter in the bucket
        self.large: list[int] = []  # gradients larger than the bucket, kept until their reduction
        self.partition: dict[int, int] = {}  # rank -> index of its grads_in_partition in its side list
        self.keep_partition = keep_partition

    def _own(self, rank: int, op: int) -> int:
        side = self.shared.side[rank]
        side.append((len(self.stream.ops), op))
        return len(side) - 1

    def __call__(self, ident: int) -> bool:
        if self.next < 0:
            return False
        n = self.sizes[self.next]
        self.next -= 1
        self.position -= n
        half = self.shape.half_bytes
        if not self.buffers:  # setup_buckets
            self.buffers = [self.stream.alloc(self.shape.bucket * half)
                            for _ in range(2 if self.shape.overlap_comm else 1)]
        if sum(e for _, e in self.bucket) + n > self.shape.bucket:
            self.reduce()
        self.bucket.append((self.position, n))
        if n > self.shape.bucket:
            self.large.append(ident)
            return False
        self.stream.free(ident)  # copied into the bucket: the gradient becomes a view of it
        return True

    def reduce(self) -> None:
        if not self.bucket:
            return
        lo = min(start for start, _ in self.bucket)
        hi = max(start + n for start, n in self.bucket)
        if sum(1 for a, b in self.bounds if a < hi and b > lo) > 1:  # allreduce_bucket flattens the slices
            size = sum(n for _, n in self.bucket) * self.shape.half_bytes
            if self.shape.overlap_comm:  # on the reduction stream, among each rank's own allocations
                for rank in range(self.shape.ranks):
                    self._own(rank, -1 - self._own(rank, size))
            else:
                self.stream.free(self.stream.alloc(size))
        for rank, (a, b) in enumerate(self.bounds):  # copy_grads_in_partition, at the rank's first reduction
            if rank not in self.partition and lo < b and hi > a:
                elements = sum(n for start, n in _starts(self.sizes) if start < b and start + n > a)
                self.partition[rank] = self._own(rank, elements * self.shape.half_bytes)
        for ident in self.large:
            self.stream.free(ident)
        self.large, self.bucket = [], []

    def epilogue(self) -> dict[int, int]:
        """The backward's end: the last reduction, the IPG buffers dropped. Returns the partition buffers
        the step uses (rank -> index in its side list); a later micro-step's are freed here."""
        self.reduce()
        if not self.keep_partition:
            for rank, index in self.partition.items():
                self._own(rank, -1 - index)
        for ident in reversed(self.buffers):
            self.stream.free(ident)
        return self.partition if self.keep_partition else {}


def _starts(sizes: list[int]):
    start = 0
    for n in sizes:
        yield start, n
        start += n


def _build_shared(r1: TraceResult, r2: TraceResult, shape: Zero2Shape) -> _Shared:
    shared = _Shared(Stream([], [], []), [[] for _ in range(shape.ranks)], [], [], shape.overlap_comm)
    stream = shared.stream
    half = shape.half_bytes
    run = RunShape(layers=shape.layers, grad_accum=shape.grad_accum, half_bytes=half,
                   double_quant=shape.double_quant, accumulated_grads=False, alloc_conf=shape.alloc_conf,
                   model_source=shape.model_source, held_before_load=shape.held_before_load)
    loaded = load_stream(r1, r2, run, stream, before_engine=True, kbit_fp32=shape.kbit_fp32)
    rows = module_order(layout_at(r1.layout, r2.layout, shape.layers))
    sizes = [r[0] for r in rows if r[3]]
    shared.slices = [partition_slices(sizes, shape.ranks, rank) for rank in range(shape.ranks)]

    trainable = list(loaded.trainable)
    for ident, n, _, grad in sorted(loaded.wide, key=lambda w: w[2]):  # _cast_module_mixed_precision
        cast = stream.alloc(n * half)
        stream.free(ident)
        if grad:
            trainable.append(cast)
    part = _engine_flat(stream, trainable, sizes, shape)
    clone = stream.alloc(part * half)  # weights_partition: the partition cloned, then cast to fp32
    stream.alloc(part * FP32_BYTES)
    stream.free(clone)
    stream.free(stream.alloc(part * FP32_BYTES))  # initialize_optimizer_states' gradient partition
    state: dict = {"kept": {}, "reducer": None, "first_step": True}

    def on_grad(micro):
        state["reducer"] = _Reducer(shared, shape, sizes, keep_partition=micro == 0)
        return state["reducer"]

    def after_backward(micro):
        kept = state["reducer"].epilogue()
        if micro == 0:
            state["kept"] = kept

    def boundary(step):
        stream.mark("optimizer")
        shared.casts.append(len(stream.ops))  # get_grad_norm_direct: each slice of the partition in fp64
        flat = stream.alloc(part * half)
        grad32 = stream.alloc(part * FP32_BYTES)
        stream.free(flat)
        for rank, index in state["kept"].items():  # free_grad_in_param_list: the gradients' buffer
            shared.side[rank].append((len(stream.ops), -1 - index))
        if state["first_step"]:
            stream.alloc(part * FP32_BYTES)  # exp_avg
            stream.alloc(part * FP32_BYTES)  # exp_avg_sq
            state["first_step"] = False
        stream.free(grad32)

    _micro_steps(r1, r2, shape, stream, boundary, on_grad, after_backward)
    return shared


def _merged(shared: _Shared, rank: int) -> tuple[Stream, set[int]]:
    """One rank's whole stream: the shared one with the rank's own allocations and norm casts put in."""
    src = shared.stream
    stream = Stream([], [], [])
    side: set[int] = set()
    own = shared.side[rank]
    ids: dict[int, int] = {}  # index in `own` -> id in the merged stream
    mapping: dict[int, int] = {}
    starts = dict((start, name) for name, start in reversed(src.phases))
    casts = set(shared.casts)
    j = 0
    for p in range(len(src.ops) + 1):
        while j < len(own) and own[j][0] == p:
            op = own[j][1]
            if op >= 0:
                ids[j] = stream.alloc(op)
                if shared.on_side:
                    side.add(ids[j])
            else:
                stream.free(ids[-1 - op])
            j += 1
        if p in casts:
            _norm_casts(stream, shared.slices[rank])
        if p == len(src.ops):
            break
        if p in starts:
            stream.mark(starts[p])
        op = src.ops[p]
        if op is EMPTY_CACHE:
            stream.ops.append(EMPTY_CACHE)
        elif op >= 0:
            mapping[op] = stream.alloc(src.sizes[op])
        else:
            stream.free(mapping[-op - 1])
    return stream, side


def _shared_run(shared: _Shared, conf: AllocatorConf) -> Zero2Run | None:
    """Every rank's figures from one replay of the shared stream, where the ranks' own allocations are on
    the reduction stream (the caching allocator serves each stream from its own segments, so that stream's
    reserve adds to the default stream's) and each norm cast fits a cached block (allocated and freed at
    once, it leaves the allocator's blocks as they were). None where that does not hold: every rank is
    then replayed whole."""
    if not shared.on_side or conf.expandable_segments or conf.garbage_collection_threshold > 0.0:
        return None
    src = shared.stream
    sim = CachingAllocator(conf)
    stats = sim.stats
    blocks: dict[int, object] = {}
    reserved = [0] * len(src.ops)  # the default stream's after each op
    allocated = [0] * len(src.ops)
    cast_peak: dict[int, int] = {}  # position -> allocated there plus the largest cast of any rank
    casts = set(shared.casts)
    for p, op in enumerate(src.ops):
        if p in casts:
            for slices in shared.slices:
                if not all(sim.fits(n * NORM_BYTES) for n in slices):
                    return None
            cast_peak[p] = stats.allocated + max((n * NORM_BYTES for s in shared.slices for n in s), default=0)
        if op is EMPTY_CACHE:
            sim.empty_cache()
        elif op >= 0:
            blocks[op] = sim.malloc(src.sizes[op])
        else:
            block = blocks.pop(-op - 1, None)
            if block is not None:
                sim.free(block)
        reserved[p], allocated[p] = stats.reserved, stats.allocated
    best = None
    for rank, own in enumerate(shared.side):
        side = CachingAllocator(conf)
        held: dict[int, object] = {}
        events = []  # (position, side reserved, side allocated) after each own op
        for index, (position, op) in enumerate(own):
            if op >= 0:
                held[index] = side.malloc(op, REDUCTION_STREAM)
            else:
                side.free(held.pop(-1 - op))
            events.append((position, side.stats.reserved, side.stats.allocated))
        peak, at, peak_alloc = -1, 0, 0
        prev, s_res, s_alloc = 0, 0, 0
        for position, res, alloc in [*events, (len(src.ops), None, None)]:
            if position > prev:  # shared ops prev..position-1 with the rank's own reserve s_res
                top = max(range(prev, position), key=reserved.__getitem__)
                if reserved[top] + s_res > peak:
                    peak, at = reserved[top] + s_res, top
                peak_alloc = max(peak_alloc, max(allocated[prev:position]) + s_alloc)
                prev = position
            if res is None:
                break
            before = reserved[position - 1] if position > 0 else 0
            if before + res > peak:
                peak, at = before + res, max(position - 1, 0)
            s_res, s_alloc = res, alloc
        for position, value in cast_peak.items():
            peak_alloc = max(peak_alloc, value + _side_at(events, position, 2))
        phase = next((name for name, start in reversed(src.phases) if start <= at), "load")
        run = Zero2Run(max(peak, 0), peak_alloc, phase, side.stats.reserved, rank)
        if best is None or run.peak_reserved > best.peak_reserved:
            best = run
    return best


def _distinct_ranks(shared: _Shared) -> list[int]:
    """The first rank of each set whose own allocations and norm casts are the same: their merged streams
    are the same, and so are their replays (guide 000's QLoRA at 8 ranks and 64 layers: one set)."""
    return _first_of_each([(tuple(own), tuple(slices)) for own, slices in zip(shared.side, shared.slices, strict=True)])


def _first_of_each(keys: list) -> list[int]:
    """The first rank of each set of ranks with equal keys (what makes a rank's stream), in rank order:
    ranks alike replay alike, so one of each set is replayed."""
    first: dict = {}
    for rank, key in enumerate(keys):
        first.setdefault(tuple(key), rank)
    return sorted(first.values())


def _side_at(events, position: int, column: int) -> int:
    value = 0
    for event in events:
        if event[0] > position:
            break
        value = event[column]
    return value


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


def zero2_run(r1: TraceResult, r2: TraceResult, shape: Zero2Shape) -> Zero2Run:
    """The allocator model over each rank's stream; the rank with the highest reserved peak."""
    conf = AllocatorConf.parse(shape.alloc_conf, "PYTORCH_CUDA_ALLOC_CONF")
    if not shape.offload:
        shared = _build_shared(r1, r2, shape)
        run = _shared_run(shared, conf)
        if run is not None:
            return run
        streams = ((rank, _merged(shared, rank)) for rank in _distinct_ranks(shared))
    else:  # with the optimizer on the host a rank's stream differs from another's only by its partition's slices
        sizes = [r[0] for r in _rows(r1, r2, shape) if r[3]]
        slices = [partition_slices(sizes, shape.ranks, rank) for rank in range(shape.ranks)]
        streams = ((rank, build(r1, r2, shape, rank)) for rank in _first_of_each(slices))
    best = None
    for rank, (stream, side) in streams:
        peak, allocated, phase, side_reserved = simulate(stream, side, conf)
        if best is None or peak > best.peak_reserved:
            best = Zero2Run(peak, allocated, phase, side_reserved, rank)
    return best


@functools.lru_cache(maxsize=64)
def simulated(spec: TraceSpec, shape: Zero2Shape) -> Zero2Run:
    """`zero2_run` over the traces of `spec`, cached in-process and on disk beside the traces
    (keyed by both and by the code of this module, the stream and the allocator model)."""

    return cached_on_disk("zero2", spec, shape,
                          ("zero2/stream.py", "allocator/stream.py", "allocator/allocator.py", "constants.py"),
                          lambda: zero2_run(*trace_pair(spec), shape), lambda d: Zero2Run(**d))
