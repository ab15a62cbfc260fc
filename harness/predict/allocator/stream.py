"""The allocation stream of a training run at full depth, built from the traced 1- and 2-layer steps.

The allocator model (`harness.predict.allocator.allocator`) needs what the caching allocator saw: every
allocation and free, in order, each free naming the allocation it releases. The fake-tensor trace
logs them for one micro-step at 1 and 2 layers, each tagged with its phase (forward, backward) and
the decoder layer running (`harness.predict.trace.fake.AllocationLog`; checkpointing's recompute is part of
its layer's backward). This module builds from them the stream of a run:

1. **Load** (`load_stream`), in the order the stack loads the model: transformers' caching-allocator
   warm-up (`from_pretrained` allocates and frees one block the size of the model as loaded, which
   the allocator keeps), every parameter in the order of its checkpoint name (a 4-bit weight
   arrives in the half dtype and is quantized: bitsandbytes' transients and kept blocks), each
   parameter the stack holds wider than it loads (peft's k-bit preparation: non-4-bit half
   parameters to fp32) copied in module order and its loaded copy freed, the LoRA adapters (moved
   in the half dtype, then cast to fp32). A model built with `from_config` on the device
   (`launch.model_source: config`, as the harness's own runs build all but QLoRA) has no warm-up
   block: each parameter comes as its module is built, a tied head is built and freed.
2. **The step at N layers** (`expand`): the 2-layer step with layer 1's forward and backward chunks
   repeated for layers 1..N-1. A free that crosses layers is remapped: an allocation of layer 0
   freed in layer 1 becomes, in copy k, the allocation of copy k-1 that lines up with it (layer 0's
   chunk aligned with layer 1's by size; layer 0 may differ, its input needs no grad); one of layer 1
   freed after the layers is the last copy's; one of layer 1 freed in layer 0's backward (the
   gradient handed down) is freed in every copy's backward, of the copy above it, at the same
   relative position; one of layer 1 freed after the layers whose layer-0 counterpart is freed there
   too (a tensor every layer keeps to the end of the forward) is freed in every copy.
3. **The run** (`run_stream`): load, `min(grad_accum, 2)` micro-steps, the optimizer's first step
   (AdamW's two moments per trainable parameter, a foreach temporary per parameter, then the
   gradients freed by `zero_grad`), and the same again: every later step reuses what the ones before
   it cached. The cuBLAS workspaces come at the first forward and backward, gradients under
   accumulation at each step's first backward.

`simulate_run` replays the run through `CachingAllocator` one optimizer step at a time, until the
allocator's state at a step's end repeats the step before it (from there on every step is served
the same way), and gives its peak; `simulate` replays a stream given whole. Only cases without
DeepSpeed are built: DeepSpeed's buckets, gathers and offload buffers are not in the trace.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field

from harness.predict.allocator.allocator import AllocatorConf, CachingAllocator, round_size, segment_size
from harness.predict.constants import (
    BNB_BLOCKSIZE,
    BNB_NESTED_BLOCKSIZE,
    CUBLAS_HANDLE_WORKSPACE,
    FP32_BYTES,
    HALF_BYTES,
    MAX_STEPS,
    TENSOR_BEFORE_LOAD,
    WARMUP_MIN_NEW,
)
from harness.predict.step import BACKWARD, FORWARD, LAYER_POST, LAYER_PRE, TraceResult, TraceSpec, fused_adamw
from harness.spec.schema import Case


class StreamError(ValueError):
    """A trace whose events cannot be built into a run (no decoder layer tagged, or a layer's chunk
    run twice apart); the predictor then keeps the fitted ratio and says why."""


@dataclass
class Stream:
    """Allocations and frees: `ops[i]` is +id (allocate `sizes[id]` bytes) or -id - 1 (free id)."""

    ops: list[int]
    sizes: list[int]
    phases: list[tuple[str, int]]  # (phase name, index of its first op), in order
    # ids of the allocations another source put in (`expand`'s `between`): DeepSpeed's gathers
    # (harness.predict.zero3.stream), so the peak can be taken apart
    gathers: set[int] = field(default_factory=set)
    # of those, the host partition copies one-parameter gathers hand NCCL as input (`zero3.GATHER_INPUT`),
    # freed at the gather's wait where NCCL may let them go sooner (`harness.predict.zero3.gather_release`)
    gather_inputs: set[int] = field(default_factory=set)
    # of the gathers, every host partition copied to the device (the inputs and a coalesced gather's
    # copies), and the allocations after which a collective is launched: the host's time and the moments
    # NCCL lets an input go at
    host_copies: set[int] = field(default_factory=set)
    launches: set[int] = field(default_factory=set)

    def alloc(self, size: int) -> int:
        self.sizes.append(int(size))
        self.ops.append(len(self.sizes) - 1)
        return len(self.sizes) - 1

    def free(self, ident: int) -> None:
        self.ops.append(-ident - 1)

    def mark(self, name: str) -> None:
        self.phases.append((name, len(self.ops)))


@dataclass(frozen=True)
class RunShape:
    """What of a case shapes its load and its step, beside the traces."""

    layers: int
    grad_accum: int
    half_bytes: int  # the dtype the checkpoint loads in
    double_quant: bool
    accumulated_grads: bool  # the trace ran with gradients already allocated (GA > 1, no DeepSpeed)
    alloc_conf: str = ""
    model_source: str = "checkpoint"  # launch.model_source: from_pretrained's load, or from_config's
    held_before_load: int = 0  # bytes the process holds on the device when the load begins (`start_states`)
    fused_adamw: bool = False  # the optimizer is torch's fused AdamW (`harness.predict.step.fused_adamw`)

    @classmethod
    def of(cls, case: Case, spec: TraceSpec, layers: int) -> RunShape:
        q = case.method.quantization
        return cls(layers=layers, grad_accum=case.train.grad_accum, half_bytes=HALF_BYTES[case.precision.value],
                   double_quant=bool(q is not None and q.double_quant), accumulated_grads=spec.accumulated_grads,
                   alloc_conf=case.launch.env.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                   model_source=case.launch.model_source, fused_adamw=fused_adamw(case))


def start_states(shape):
    """`shape` (a `RunShape`, or another shape with `model_source` and `held_before_load`) once for each
    device state a load can begin from whose runs can differ. `from_pretrained` sizes its caching-allocator
    warm-up by what the cache already holds unused (`_warmup_bytes`): a process that has made any tensor
    on the device before it (importing torchaudio makes one of 4 bytes, and with it a 2 MiB segment of the
    small pool) warms up 2 MiB less, and where the model's largest transients fill the warm-up block to
    within 2 MiB, the step then takes a segment more. Guide 003's r32 config through peft (Qwen1.5-7B,
    nf4) is such a run: its recorded step reserves 12.84 GiB, one 594 MiB segment more than the same
    stream after an empty device's warm-up. A load from a config has no warm-up."""
    if shape.model_source == "config":
        return [shape]
    return [shape, dataclasses.replace(shape, held_before_load=TENSOR_BEFORE_LOAD)]


def _chunks(events: list[list[int]]) -> list[tuple[int, int, list[list[int]]]]:
    out: list[tuple[int, int, list[list[int]]]] = []
    for e in events:
        if not out or out[-1][:2] != (e[3], e[4]):
            out.append((e[3], e[4], []))
        out[-1][2].append(e)
    return out


def _counterparts(chunks) -> dict[int, int]:
    """Layer 0's allocations lined up with layer 1's, per phase, by size order: layer-0 id -> layer-1 id."""
    out: dict[int, int] = {}
    for phase in (FORWARD, BACKWARD):
        a = [e for ph, layer, evs in chunks if (ph, layer) == (phase, 0) for e in evs if e[0] == 1]
        b = [e for ph, layer, evs in chunks if (ph, layer) == (phase, 1) for e in evs if e[0] == 1]
        matcher = difflib.SequenceMatcher(None, [e[2] for e in a], [e[2] for e in b], autojunk=False)
        for block in matcher.get_matching_blocks():
            for j in range(block.size):
                out[a[block.a + j][1]] = b[block.b + j][1]
    return out


def expand(r1: TraceResult, r2: TraceResult, layers: int, stream: Stream, on_backward=None,
           keep_grads: bool = False, between=None, on_grad=None, on_matmul=None) -> list[int]:
    """Append one micro-step at `layers` decoder layers to `stream`; returns the ids it leaves live.
    `on_backward()` is called where the backward begins (to allocate what the real step allocates
    there and the trace had before it: the autograd thread's cuBLAS workspace). `keep_grads`: the
    parameters have no gradient yet, so each keeps the one its AccumulateGrad is given (the trace,
    run with gradients there, added and freed it), where the backward makes it. `between(phase, layer, i,
    n)` is called before event i of each layer's chunk of n events and after its last (i == n): layer the
    decoder layer at full depth (0 the first), or LAYER_PRE / LAYER_POST; what another source allocates
    in that chunk goes into the stream there. `on_grad(ident)` is called after each allocation handed to a
    trainable parameter's AccumulateGrad (what a gradient hook sees); when it returns True the hook has freed
    it. `on_matmul(phase)` is called where the trace's first matmul of each phase has made its output
    (`TraceResult.matmuls`): there the device's thread for that phase takes its cuBLAS handle and workspace."""
    if layers <= 1:
        chunks = _chunks(r1.events)
        plan = [(ph, layer, evs, 0) for ph, layer, evs in chunks]
        return _emit(plan, {}, {}, 1, stream, on_backward, kept=frozenset(r1.grads) if keep_grads else frozenset(),
                     between=between, grads=_grad_hook(r1, on_grad), matmuls=_matmul_points(r1, chunks, on_matmul))
    chunks = _chunks(r2.events)
    if not any(layer == 1 for _, layer, _ in chunks):
        raise StreamError("the traced 2-layer step has no event of its second decoder layer (no module list "
                          "of decoder layers was found to tag)")
    where = {e[1]: (e[3], e[4]) for _, _, evs in chunks for e in evs if e[0] == 1}
    seen: set[tuple[int, int]] = set()
    plan = []
    for ph, layer, evs in chunks:
        if (ph, layer) in seen and layer in (0, 1):
            raise StreamError(f"the traced step runs layer {layer}'s {('forward', 'backward')[ph]} twice apart")
        seen.add((ph, layer))
        if layer == 1:
            copies = range(1, layers) if ph == FORWARD else range(layers - 1, 0, -1)
            plan += [(ph, layer, evs, k) for k in copies]
        else:
            plan.append((ph, layer, evs, 0))
    counterpart = _counterparts(chunks)
    return _emit(plan, where, counterpart, layers, stream, on_backward, _handed_down(chunks, where),
                 _kept_by_every_layer(chunks, counterpart), frozenset(r2.grads) if keep_grads else frozenset(),
                 between, _grad_hook(r2, on_grad), _matmul_points(r2, chunks, on_matmul))


def _grad_hook(r: TraceResult, on_grad):
    return (frozenset(r.grads), on_grad) if on_grad is not None else None


def _matmul_points(r: TraceResult, chunks, on_matmul) -> dict:
    """`(id of a chunk's event list, index in it) -> callable`: where `on_matmul(phase)` is called."""
    if on_matmul is None:
        return {}
    points, start = {}, 0
    bounds = []
    for _, _, evs in chunks:
        bounds.append((start, evs))
        start += len(evs)
    for phase, at in enumerate(r.matmuls):
        for first, evs in bounds:
            if at >= 0 and first <= at <= first + len(evs) and (at < first + len(evs) or evs is bounds[-1][1]):
                points[(id(evs), at - first)] = (lambda ph=phase: on_matmul(ph))
                break
    return points


def _kept_by_every_layer(chunks, counterpart: dict[int, int]) -> set[int]:
    """Layer 1's allocations freed after the layers whose layer-0 counterpart is freed after them too:
    what every layer keeps to the end of its pass (not what it hands to the next layer, which the
    next layer frees). At full depth every copy's is freed there, not only the last one's."""
    after = {e[1] for _, layer, evs in chunks if layer not in (0, 1) for e in evs if e[0] == 0}
    return {one for zero, one in counterpart.items() if zero in after and one in after}


def _handed_down(chunks, where) -> dict[int, list[tuple[int, int]]]:
    """Layer 0's backward frees blocks that layer 1 handed down (the gradient of layer 1's input):
    at full depth each layer's backward frees those of the layer above it. Per phase, the frees of
    layer-1 blocks in layer 0's chunk, placed at the same relative position in layer 1's chunk:
    phase -> [(index in layer 1's chunk, traced id)]."""
    evs = {(ph, layer): e for ph, layer, e in chunks if layer in (0, 1)}
    out: dict[int, list[tuple[int, int]]] = {}
    for phase in (FORWARD, BACKWARD):
        zero, one = evs.get((phase, 0)), evs.get((phase, 1))
        if not zero or not one:
            continue
        at = _aligned_positions(zero, one)
        out[phase] = [(at[i], e[1]) for i, e in enumerate(zero)
                      if e[0] == 0 and where.get(e[1], (0, 0))[1] == 1]
    return out


def _aligned_positions(zero: list[list[int]], one: list[list[int]]) -> list[int]:
    """For each event of layer 0's chunk, the index in layer 1's chunk of the event it lines up with
    (the chunks matched by operation and size; layer 0 lacks what its input's gradient costs); an event
    in a stretch without a match goes where that stretch of layer 1's chunk goes, proportionally."""
    matcher = difflib.SequenceMatcher(None, [(e[0], e[2]) for e in zero], [(e[0], e[2]) for e in one],
                                      autojunk=False)
    at = [0] * len(zero)
    for _, a1, a2, b1, b2 in matcher.get_opcodes():
        for i in range(a1, a2):
            at[i] = b1 + (i - a1) * (b2 - b1) // (a2 - a1)
    return at


def _emit(plan, where, counterpart, layers: int, stream: Stream, on_backward=None, handed=None,
          every_copy=frozenset(), kept=frozenset(), between=None, grads=None, matmuls=None) -> list[int]:
    ids: dict[tuple[int, int], int] = {}  # (copy, traced id) -> stream id
    live: set[int] = set()
    grad_ids, on_grad = grads or (frozenset(), None)

    def release(target):
        ident = ids.get(target)
        if ident is not None and ident in live:
            live.discard(ident)
            stream.free(ident)

    for phase, layer, evs, k in plan:
        if phase == BACKWARD and on_backward is not None:
            on_backward()
            on_backward = None
        down = list((handed or {}).get(phase, ())) if layer == 1 and k + 1 < layers else []
        at = k if layer in (0, 1) else layer  # the decoder layer this chunk stands for at full depth
        for index, (op, tid, size, _, _) in enumerate(evs):
            if matmuls and (id(evs), index) in matmuls:
                matmuls.pop((id(evs), index))()
            if between is not None:
                between(phase, at, index, len(evs))
            while down and down[0][0] <= index:  # the block the copy above handed down to this one
                release((k + 1, down.pop(0)[1]))
            if op == 1:
                ident = stream.alloc(size)
                ids[(k, tid)] = ident
                live.add(ident)
                if tid in grad_ids and on_grad(ident):
                    live.discard(ident)
                continue
            if tid in kept:
                continue  # a parameter's gradient, kept by the parameter
            la = where.get(tid, (0, layer))[1] if where else layer
            if la == 1 and layer not in (0, 1) and tid in every_copy:
                for copy in range(1, layers):
                    release((copy, tid))
                continue
            if la == 1:
                target = (k if layer == 1 else 1 if layer == 0 else layers - 1, tid)
            elif la == 0 and layer == 1 and k > 1:
                if tid not in counterpart:
                    continue  # no allocation of layer 1 lines up with it: nothing to free in that copy
                target = (k - 1, counterpart[tid])
            elif la in (LAYER_PRE, LAYER_POST) and layer == 1 and k != layers - 1:
                continue  # freed once, in the copy that stands for the last layer
            else:
                target = (0, tid)
            release(target)
        for _, tid in down:
            release((k + 1, tid))
        if matmuls and (id(evs), len(evs)) in matmuls:
            matmuls.pop((id(evs), len(evs)))()
        if between is not None:
            between(phase, at, len(evs), len(evs))
    return sorted(live)


@dataclass
class Loaded:
    """What the load leaves each parameter in: `wide`, (id, elements, layer, trainable) of every parameter
    held wider than the half dtype (peft's fp32 adapters, the k-bit preparation's fp32 upcasts), in load
    order; `trainable`, the ids of the trainable parameters held in the half dtype."""

    wide: list[tuple[int, int, int, bool]]
    trainable: list[int]


def load_stream(r1: TraceResult, r2: TraceResult, shape: RunShape, stream: Stream, before_engine: bool = False,
                kbit_fp32: bool = False) -> Loaded:
    """Append the model's load to `stream`. `before_engine`: a DeepSpeed engine casts the module to the half
    dtype after the load, so the traced layout holds every parameter at that width; before it, peft held
    the adapters in fp32 (`autocast_adapter_dtype`), as without DeepSpeed, and with `kbit_fp32` (peft's
    stack on a 4-bit model) `prepare_model_for_kbit_training` every parameter it did not quantize."""
    layout = layout_at(r1.layout, r2.layout, shape.layers)
    half = shape.half_bytes
    stream.mark("load")
    if shape.held_before_load:
        stream.alloc(shape.held_before_load)
    base = [row for row in layout if not row[5]]
    if before_engine and kbit_fp32:
        base = [[n, size if q else max(size, 4), q, *rest] for n, size, q, *rest in base]
    if shape.model_source == "config":
        loaded = Loaded([], built_from_config(base, r1.params, half, stream))
    else:
        loaded = Loaded(_loaded_from_checkpoint(base, shape, stream), [])
    # peft moves every adapter to its base layer's device in the half dtype, then casts each to fp32
    # (autocast_adapter_dtype): the half copies are freed one by one
    adapters = [(n, max(size, 4) if before_engine else size, layer, grad)
                for n, size, _, grad, layer, adapter in layout if adapter]
    moved = [stream.alloc(n * min(size, half)) for n, size, _, _ in adapters]
    for (n, size, layer, grad), ident in zip(adapters, moved, strict=True):
        if size > half:
            loaded.wide.append((stream.alloc(n * size), n, layer, bool(grad)))
            stream.free(ident)
        elif grad:
            loaded.trainable.append(ident)
    return loaded


def module_order(layout: list[list[int]]) -> list[list[int]]:
    """The layout's rows in the order the model's modules hold them: before the decoder layers, the
    layers in turn, after them (the layout itself is in checkpoint-name order)."""
    def key(item):
        index, row = item
        layer = row[4]
        return (0 if layer == LAYER_PRE else 2 if layer == LAYER_POST else 1, layer, index)

    return [row for _, row in sorted(enumerate(layout), key=key)]


def built_from_config(base: list[list[int]], params, half: int, stream: Stream) -> list[int]:
    """`from_config` on the device: each parameter allocated as its module is built, in the half
    dtype (`module_order`; a checkpoint's name order within a layer), no warm-up block; a tied output
    head is built as a Linear of its own, then tied to the embedding and its weight freed. Returns the
    ids of the trainable parameters' storage."""
    trainable = []
    for n, _, _, grad, *_ in module_order(base):
        ident = stream.alloc(n * half)
        if grad:
            trainable.append(ident)
    if params.tied_head and params.head:
        stream.free(stream.alloc(params.head * half))
    return trainable


def _loaded_from_checkpoint(base: list[list[int]], shape: RunShape, stream: Stream) -> list[tuple[int, int, int, bool]]:
    """`from_pretrained`: the warm-up block, then each parameter in checkpoint order. Returns (id, elements,
    layer, False) of each parameter copied wider than it loads."""
    half = shape.half_bytes
    warmup = _warmup_bytes(sum(-(-n // 2) if q else n * half for n, _, q, *_ in base), shape.held_before_load)
    if warmup:
        stream.free(stream.alloc(warmup))
    kept_half: list[tuple[int, int, int, int]] = []  # (id, elements, layer, bytes each as trained) of the rest
    for n, size, q, _, layer, _ in base:
        if not q:
            kept_half.append((stream.alloc(n * half), n, layer, size))
            continue
        weight = stream.alloc(n * half)  # the half weight, then bitsandbytes' quantize_4bit
        absmax = stream.alloc(-(-n // BNB_BLOCKSIZE) * FP32_BYTES)
        stream.alloc(-(-n // 2))  # the packed 4-bit weight, kept
        if shape.double_quant:
            offset = stream.alloc(-(-n // BNB_BLOCKSIZE) * FP32_BYTES)
            stream.alloc(-(-n // (BNB_BLOCKSIZE * BNB_NESTED_BLOCKSIZE)) * FP32_BYTES)  # the absmax's own absmax, kept
            stream.alloc(-(-n // BNB_BLOCKSIZE))  # the quantized absmax, kept
            stream.free(offset)
            stream.free(absmax)
        stream.free(weight)
    # a parameter the stack holds wider than it loads (peft's prepare_model_for_kbit_training, an fp32
    # upcast of trainable weights) is copied, in module order, and its loaded copy freed
    kept_half.sort(key=lambda item: item[2])
    wide = []
    for ident, n, layer, size in kept_half:
        if size > half:
            wide.append((stream.alloc(n * size), n, layer, False))
            stream.free(ident)
    return wide


def _warmup_bytes(model_bytes: int, held: int) -> int:
    """The block transformers' `caching_allocator_warmup` (5.17) allocates and frees before loading a model of
    `model_bytes` on the device (each parameter at its loaded size, a 4-bit weight half a byte an element):
    less the cache the allocator already holds unused, where the rest is still larger than that; the
    request is made as fp16 elements. `held`: bytes of tensors already on the device (in one block).
    transformers also caps the block at the card's memory less 1.2 GiB; a model that large does not fit the
    card, so the cap changes no verdict and is left out."""
    unused = segment_size(round_size(held)) - round_size(held) if held else 0
    if model_bytes - unused > unused:
        model_bytes -= unused
    elif model_bytes - unused > WARMUP_MIN_NEW:
        model_bytes = unused + 1  # the least that still takes a new segment
    else:
        model_bytes = 0
    return model_bytes // 2 * 2


def _gradients(layout: list[list[int]], stream: Stream) -> list[int]:
    return [stream.alloc(n * size) for n, size, _, trainable, *_ in layout if trainable]


def layout_at(l1: list[list[int]], l2: list[list[int]], layers: int) -> list[list[int]]:
    """The parameter layout at `layers` decoder layers: the 2-layer layout with each run of layer 1's
    rows repeated in place (a checkpoint's sorted names keep a layer's tensors together)."""
    if layers <= 1:
        return l1
    out: list[list[int]] = []
    run: list[list[int]] = []
    for row in [*l2, [0, 0, 0, 0, LAYER_PRE, -1]]:
        if row[4] == 1:
            run.append(row)
            continue
        out += run * (layers - 1)
        run = []
        if row[5] >= 0:
            out.append(row)
    return out


def _optimizer_step(layout: list[list[int]], grads: list[int], first: bool, stream: Stream,
                    fused: bool = False) -> None:
    """torch AdamW (foreach; `fused`: one kernel, no temporaries) and the trainer's zero_grad(set_to_none=True)."""
    stream.mark("optimizer")
    trainable = [n * size for n, size, _, t, *_ in layout if t]
    if first:
        for b in trainable:  # exp_avg, exp_avg_sq, created at the first step
            stream.alloc(b)
            stream.alloc(b)
    temps = [] if fused else [stream.alloc(b) for b in trainable]  # the foreach temporary list
    for ident in temps:
        stream.free(ident)
    for ident in grads:
        stream.free(ident)



class _Run:
    """The run's stream, built one optimizer step at a time: `min(grad_accum, 2)` micro-steps, then the
    optimizer. The cuBLAS workspaces come at the first forward and the first backward. Under gradient
    accumulation (where the trace ran with gradients allocated) a step's first micro-step keeps each
    gradient where its backward makes it, as AccumulateGrad keeps the first gradient it is given (a
    trace that did not name them has them all allocated where the backward begins)."""

    def __init__(self, r1: TraceResult, r2: TraceResult, shape: RunShape):
        self.r1, self.r2, self.shape = r1, r2, shape
        self.stream = Stream([], [], [])
        load_stream(r1, r2, shape, self.stream)
        self.layout = layout_at(r1.layout, r2.layout, shape.layers)
        self.named = bool((r1 if shape.layers <= 1 else r2).grads)
        self.steps = 0

    def step(self) -> None:
        stream, shape, first = self.stream, self.shape, self.steps == 0
        grads: list[int] = []

        # the cuBLAS workspaces: the forward thread's where the step begins (its first matmul comes
        # early, transformers 5.17's rotary embedding); the autograd thread's after the output of the
        # backward's first matmul where the trace says where that is (the head's), else where the
        # backward begins
        placed = [False, backward_matmul_traced(self.r1, self.r2, shape.layers)]

        def on_backward():
            if first and not placed[1]:
                stream.alloc(CUBLAS_HANDLE_WORKSPACE)
            grads.extend(_gradients(self.layout, stream) if shape.accumulated_grads and not self.named else ())

        def on_matmul(phase: int):
            if placed[phase]:
                stream.alloc(CUBLAS_HANDLE_WORKSPACE)

        left: list[int] = []
        for micro in range(min(shape.grad_accum, 2)):
            stream.mark("step")
            if first and micro == 0 and not placed[0]:
                stream.alloc(CUBLAS_HANDLE_WORKSPACE)
            left += expand(self.r1, self.r2, shape.layers, stream, on_backward if micro == 0 else None,
                           keep_grads=micro == 0 and shape.accumulated_grads,
                           on_matmul=on_matmul if first and micro == 0 else None)
        _optimizer_step(self.layout, grads + left, first, stream, shape.fused_adamw)
        self.steps += 1


def backward_matmul_traced(r1: TraceResult, r2: TraceResult, layers: int) -> bool:
    """Whether the trace `expand` emits at `layers` (`r1` at one layer, else `r2`) logged where the
    backward's first matmul made its output (`TraceResult.matmuls`): there the autograd thread takes its
    cuBLAS workspace, else where the backward begins."""
    matmuls = (r1 if layers <= 1 else r2).matmuls
    return len(matmuls) > BACKWARD and matmuls[BACKWARD] >= 0


def run_stream(r1: TraceResult, r2: TraceResult, shape: RunShape, steps: int = 2) -> Stream:
    """Load, then `steps` optimizer steps (`_Run`)."""
    run = _Run(r1, r2, shape)
    for _ in range(steps):
        run.step()
    return run.stream


@dataclass(frozen=True)
class Simulated:
    """The allocator model's figures over a run's stream."""

    peak_reserved: int
    peak_allocated: int
    peak_phase: str  # the phase in which reserved memory peaked
    actions: int
    steps: int = 0  # optimizer steps replayed (`simulate_run`; 0: a stream given whole)
    settled: bool = True  # the allocator's state repeated from one step's end to the next's


class _Replay:
    """A stream fed through `CachingAllocator` as it grows; the reserved peak and where it came."""

    def __init__(self, stream: Stream, conf: AllocatorConf | None):
        self.stream, self.sim = stream, CachingAllocator(conf)
        self.blocks: dict[int, object] = {}
        self.done, self.peak, self.peak_at = 0, -1, 0

    def advance(self) -> None:
        stats, blocks, sizes = self.sim.stats, self.blocks, self.stream.sizes
        malloc, free = self.sim.malloc, self.sim.free
        peak, peak_at = self.peak, self.peak_at
        ops = self.stream.ops
        for i in range(self.done, len(ops)):
            op = ops[i]
            if op >= 0:
                blocks[op] = malloc(sizes[op])
                if stats.reserved > peak:
                    peak, peak_at = stats.reserved, i
            else:
                block = blocks.pop(-op - 1, None)
                if block is not None:
                    free(block)
        self.done, self.peak, self.peak_at = len(ops), peak, peak_at

    def result(self, steps: int = 0, settled: bool = True) -> Simulated:
        phase = next((name for name, start in reversed(self.stream.phases) if start <= self.peak_at), "load")
        return Simulated(max(self.peak, 0), self.sim.stats.peak_allocated, phase, len(self.stream.ops), steps,
                         settled)


def simulate(stream: Stream, conf: AllocatorConf | None = None) -> Simulated:
    replay = _Replay(stream, conf)
    replay.advance()
    return replay.result()


def simulate_run(r1: TraceResult, r2: TraceResult, shape: RunShape, conf: AllocatorConf | None = None,
                 max_steps: int = MAX_STEPS) -> Simulated:
    """The allocator model over the run, one optimizer step after another until the allocator's state at
    a step's end is the one the step before it ended in. From the second step on every step's stream is
    the same, so from that point each step serves its requests from the same blocks as the one before,
    and no later step reserves more: the peak has been reached. Until then a step can still find no
    fitting free block where the one before it found one (the blocks it frees last are not where they
    were), and the reserve grows: Mistral-7B's QLoRA as LLaMA-Factory runs it grows by a 512 MiB segment
    in its third step, and repeats from there. At least two steps are replayed; at most `max_steps`
    (then `settled` is False)."""
    run = _Run(r1, r2, shape)
    replay = _Replay(run.stream, conf)
    before = None
    while run.steps < max_steps:
        run.step()
        replay.advance()
        state = replay.sim.fingerprint()
        if run.steps >= 2 and state == before:
            return replay.result(run.steps, True)
        before = state
    return replay.result(run.steps, False)
