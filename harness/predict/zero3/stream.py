"""ZeRO-3 with `overlap_comm: false`: the model's allocations and DeepSpeed's gathers in one pool.

With `overlap_comm` on, DeepSpeed 0.19.8's coordinator gathers on an all-gather stream of its own, whose
pool the caching allocator keeps apart from the model's (`harness.predict.zero3.coordinator.gather_pool`). With it
off (`PartitionedParameterCoordinator` gets no stream: `partitioned_param_coordinator.py`,
`stage3.py`) every gather is made on the current stream, and its buffers take and split the blocks the
model's activations freed. The recorded rank-0 timeline of fit's LoRA config for guide 000 (32B, 2
ranks, 4 layers, `results/fitted/timelines/`) shows what that costs: its reserve, 29.77 GiB, is 23.61
for the model's allocations alone and 27.73 with the gathers on a stream of their own. In the first
micro-step that prefetches, the prefetched gather buffers occupy the segments the MLP's intermediates
had made (864 MiB), the intermediates split the segment the previous micro-step's bf16 logits freed
(2376 MiB), the logits split one of the fp32 logits' segments (4752 MiB), and the logits' gradient
takes a new one: 4.64 GiB more, in that micro-step's backward.

`build` makes that one-pool stream for a LoRA case with its parameters on the device and the optimizer
offloaded (the dispatch table's `zero3-lora-one-pool` row), whose engine keeps little else on the device:

1. **The load** under `zero.Init` (the recorded `partition_parameters.py` allocations): each frozen
   parameter, in module definition order, built whole in the half dtype, its partition (one rank's
   share) kept and the whole freed; peft's adapters moved in the half dtype and cast to fp32.
2. **The engine**: each adapter made a ZeRO parameter (its partition kept, a persistent one's whole
   storage in the flat buffer below), `empty_cache()`, `defragment()`'s flat buffer of the persistent
   parameters, and the IPG bucket (`_setup_for_real_optimizer`: `reduce_bucket_size` elements in the
   half dtype, with contiguous gradients). The optimizer's fp32 partitions and gradients are on the host.
3. **Four micro-steps** (two optimizer steps of two, as the recorded runs made): the traced step at full
   depth (`harness.predict.allocator.stream.expand`), with the coordinator's allocations and frees of the same
   step (`harness.predict.zero3.coordinator.replay(..., every_step=[])`, one list per step: the first step
   records the module order, the next prefetch along it, the third on start with the persistent
   parameters gathered) put into the
   chunk of the decoder layer and pass whose module hooks made them. The forward's cuBLAS workspace
   comes with the first matmul, in the first layer (the recording has it in the block the embedding's
   gather had freed), the autograd thread's where the backward begins.

**A full fine-tune with `overlap_comm`** (row `zero3-full-model-stream`) gathers on the coordinator's stream,
whose pool `coordinator.gather_pool` replays; its model's stream (stream 0) is `build` with `full` and no gathers:
zero.Init's load (every parameter built whole, its partition kept), the engine (the partitions moved to the
host, `empty_cache()`, `defragment()`'s flat buffer of every partition, the IPG bucket, each trainable
parameter gathered alone and partitioned again as `create_reduce_and_remove_grad_hooks` registers its hook),
then the four micro-steps. With the optimizer on the device the engine also makes the fp32 master
partitions of each sub-group, `initialize_optimizer_states`' transient buffer and the gradient partitions'
flat buffer, and each accumulation boundary runs the optimizer step (`_device_step`: the fp64 norm copies,
each sub-group's flattened gradient and its fp32 cast, the Adam moments in the first step) before the
training loop drops the step's outputs. Phi-3-mini's recorded rank-0 stream 0 (optimizer offload, 32
layers) reserves 4.297 / 3.764 / 6.262 / 6.752 GiB at the end of its load, engine, first forward and first
backward and 6.754 from then on; the built stream the same at every phase end to 2 MiB (the ratio gave
6.53). Gemma-2-2B's (optimizer on the device, 26 layers) reserves 14.768 at the engine's end, 20.631 after
the first micro-step, 28.088 after the first optimizer step and 33.770 in the second; the built stream the
same at every phase end but the load's (2.56 against 4.21: the run gathers parameters while loading), its
allocated peak 27.64 GiB as recorded (the ratio and the fp32 gradient segment gave 32.85).

**A full fine-tune with its parameters offloaded** (row `zero3-full-offload`) is `build` with `full`
and `offload_param`: `_full_offload_engine`'s load and engine, then the micro-steps.

**The step's allocated peak** (`harness.predict.predictor`): for every config above, `build` with the
gathers placed (`spread`) is the step with the model's allocations and DeepSpeed's on one timeline,
whatever stream the gathers run on; `simulate` gives its allocated peak and what of it was gathered
(`Stream.gathers`). On eleven recorded timelines of such configs it lands within -0.4 to +0.2 % of the
recorded allocated peak, where the most gathered and the activations each at its own peak gave up to
+5 % (guide 000 non-reentrant) and +11 % (Llama-3.1-8B's LoRA with parameter offload); on guide 002's
+1.7 %, and on Qwen2.5-1.5B's full fine-tune with parameter offload +1.8 %, timed as NCCL lets a
gather's host partition copy go before its wait (`harness.predict.zero3.gather_release`; +10.3 % with every
copy held to its wait, as the replay frees them).

The trace tags its allocations by decoder layer and pass, not by module. Where inside a layer's chunk
each module's hooks fire is recorded by the 2-layer trace of a config with its parameters on the host and
no `overlap_comm` (`TraceResult.hooks`), and `build` with placement `recorded` puts each chunk's hook
events there (`_recorded_marks`, `_positions`); elsewhere, and where a chunk's recorded hook events are
not the replayed ones, it spreads them evenly over the chunk's allocations and frees (each hook's gathers
before the allocations that follow it). The reserved figure depends on that placement
(`benchmarks/bench_zero3_one_pool.py`): on fit's recorded 4-layer run the model's pool alone is built to
2 MiB (23.611 against 23.609 GiB, every phase within 10 MiB), and with the gathers in it the built peak
is 30.61 GiB spread evenly, 29.77 with each chunk's hook events at its start and 28.31 at its end
(recorded 29.77). On guide 000's non-reentrant fix with its parameters offloaded, spread gives 6.66 / 5.91
GiB at 4 / 8 layers and recorded 6.56 / 6.57, where rank 0 made 6.41 / 6.42 and the worst rank 6.66 / 6.42.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import re
from dataclasses import dataclass

from harness.predict.allocator.allocator import AllocatorConf, CachingAllocator
from harness.predict.allocator.stream import Stream, _chunks, expand
from harness.predict.constants import (
    CUBLAS_HANDLE_WORKSPACE,
    DS_DEFAULTS,
    FP32_BYTES,
    MICRO_STEPS,
    NORM_BYTES,
    OFFLOAD_MICRO_STEPS,
)
from harness.predict.dispatch import row_of
from harness.predict.step import BACKWARD, FORWARD, LAYER_POST, LAYER_PRE, TraceSpec
from harness.predict.trace.trace import cached_on_disk, trace_pair
from harness.predict.zero3 import coordinator, gather_release
from harness.predict.zero3.coordinator import HookEvent, spec_for
from harness.predict.zero3.order import EVENT_NAMES
from harness.predict.zero3.step import sub_groups
from harness.spec.dsconfig import auto_sizes
from harness.spec.schema import Case, Offload

EMPTY_CACHE = None  # an op of its own in `Stream.ops`: the engine's empty_cache()
# of a layer chunk's hook events: where the trace recorded DeepSpeed's hooks firing (else spread), evenly
# spread, all at the chunk's start, all at its end; none: no gathers
PLACEMENTS = ("recorded", "spread", "start", "end", "none")


@dataclass(frozen=True)
class OnePoolShape:
    """What of a case shapes its one-pool stream beside the traces."""

    zero3_spec: str  # harness.predict.zero3.coordinator.Zero3Spec as sorted JSON (the module layout, the settings)
    ranks: int
    half_bytes: int
    ipg_bucket: int  # elements of the IPG bucket; 0 without contiguous gradients
    micro_steps: int
    alloc_conf: str = ""
    placement: str = "spread"
    full: bool = False  # a full fine-tune: every parameter trains, its flat partition buffer on the device
    sub_group_size: int = 0  # a full fine-tune's optimizer on the device: DeepSpeed's sub_group_size; 0 on the host
    accumulation: int = 2  # micro-steps per optimizer step
    offload_param: bool = False  # the partitions on the host (`offload_param`): zero.Init keeps none on the device

    @classmethod
    def of(cls, case: Case, arch, layers: int, placement: str = "spread") -> OnePoolShape:

        ds = case.deepspeed
        spec = dataclasses.replace(spec_for(case, arch, layers), pool_rounds=MICRO_STEPS)
        bucket = ds.reduce_bucket_size or auto_sizes(int(arch.config["hidden_size"]))["reduce_bucket_size"]
        full = case.method.kind == "full"
        on_device = full and ds.offload_optimizer == Offload.none
        offload_model_stream = row_of(case).name == "zero3-lora-offload" and placement == "none"
        steps = OFFLOAD_MICRO_STEPS if offload_model_stream else MICRO_STEPS
        return cls(zero3_spec=json.dumps(dataclasses.asdict(spec), sort_keys=True), ranks=case.launch.ranks,
                   half_bytes=spec.half_bytes, ipg_bucket=bucket if ds.contiguous_gradients else 0,
                   micro_steps=steps, alloc_conf=case.launch.env.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                   placement=placement, full=full,
                   sub_group_size=(ds.sub_group_size or DS_DEFAULTS["sub_group_size"]) if on_device else 0,
                   accumulation=max(1, min(case.train.grad_accum, 2)), offload_param=spec.offload_param)


@dataclass(frozen=True)
class OnePoolRun:
    peak_reserved: int
    peak_allocated: int
    peak_phase: str
    phase_ends: list[tuple[str, int]]  # reserved at the end of each marked phase
    allocated_phase: str = ""  # the phase of the allocated peak
    gathered_at_allocated_peak: int = 0  # bytes of DeepSpeed's gathers live at the allocated peak
    # of those, host partition copies handed to NCCL as gather inputs (`Stream.gather_inputs`) NCCL still held
    gather_inputs_at_allocated_peak: int = 0
    # the allocated peak with every gather input held to its wait: above `peak_allocated` where NCCL lets
    # some go sooner (`harness.predict.zero3.gather_release`), the figure no host's run exceeds
    peak_allocated_held: int = 0


def placement_for(case: Case) -> str:
    """Where a case's step stream puts each chunk's hook events: where the trace recorded them for the
    one-pool configs with the parameters on the host (`zero3-lora-offload-one-pool`, whose reserve turns on
    it; both its figures come from that stream), spread evenly elsewhere (guide 002's allocated peak, placed
    where recorded, falls under its runs: docs/predictor.md, "Where the hooks fire")."""
    return "recorded" if row_of(case).name == "zero3-lora-offload-one-pool" else "spread"


def _chunk_of(backward: bool, layer: int | None, seen: dict[bool, bool]) -> tuple[int, int]:
    """The (pass, layer) chunk a hook event falls in: its module's decoder layer, else LAYER_PRE or
    LAYER_POST by which side of the layers it fires, `seen` saying whether a layer's event has come yet in
    each pass (updated here)."""
    if layer is not None:
        seen[backward] = True
    elif backward:
        layer = LAYER_PRE if seen[True] else LAYER_POST
    else:
        layer = LAYER_POST if seen[False] else LAYER_PRE
    return (BACKWARD if backward else FORWARD), layer


def _groups(items: list) -> list[tuple[int, int, list[list]]]:
    """One replayed step's items -> [(pass, layer, pieces)] in order: a piece is what the coordinator
    allocates and frees at one hook event (its fetch or release, logged before the event), then the
    event; a module outside the layers is LAYER_PRE or LAYER_POST by which side of them its hook fires."""

    out: list[tuple[int, int, list[list]]] = []
    seen = {False: False, True: False}
    pending: list = []
    for item in items:
        if not isinstance(item, HookEvent):
            pending.append(item)
            continue
        phase, layer = _chunk_of(item.backward, item.layer, seen)
        if not out or out[-1][:2] != (phase, layer):
            out.append((phase, layer, []))
        out[-1][2].append([*pending, item])
        pending = []
    if pending and out:
        out[-1][2].append(pending)
    return out


def _params(layout, layers: int) -> list[tuple[int, bool]]:
    """(elements, trainable) of every parameter in module definition order at `layers` layers, each once: a
    tied head, and a LoRA layer's `lora_A` weight that it holds as DeepSpeed discovers it
    (`coordinator.layout_of`) beside its `lora_A` module."""
    out, seen = [], set()
    for m in layout.before:
        for p in m.params:
            if p.key not in seen:
                seen.add(p.key)
                out.append((p.numel, p.trainable))
    for _ in range(layers):
        mine = set()
        for m in layout.layer:
            for p in m.params:
                if p.key not in seen and p.key not in mine:
                    mine.add(p.key)
                    out.append((p.numel, p.trainable))
    for m in layout.after:
        for p in m.params:
            if p.key not in seen:
                seen.add(p.key)
                out.append((p.numel, p.trainable))
    return out


def _lora_engine(stream: Stream, params: list[tuple[int, bool]], half: int, ranks: int, ipg_bucket: int,
                 threshold: int) -> None:
    """zero.Init's load of a LoRA model and the engine's buffers (module docstring, steps 1 and 2)."""
    stream.mark("load")
    for n, trainable in params:  # zero.Init: each frozen parameter built whole, its partition kept
        if not trainable:
            whole = stream.alloc(n * half)
            stream.alloc(-(-n // ranks) * half)
            stream.free(whole)
    adapters = []
    for n, trainable in params:  # peft moves each adapter in the half dtype and casts it to fp32
        if trainable:
            moved = stream.alloc(n * half)
            adapters.append((n, stream.alloc(n * FP32_BYTES)))
            stream.free(moved)
    stream.mark("engine")
    for n, ident in adapters:  # made ZeRO parameters: a partition each, a persistent one's in defragment's buffer
        stream.free(ident)
        if n > threshold:
            stream.alloc(-(-n // ranks) * FP32_BYTES)
    stream.ops.append(EMPTY_CACHE)
    stream.alloc(sum(n * (FP32_BYTES if t else half) for n, t in params if n <= threshold))  # defragment()
    if ipg_bucket:
        stream.alloc(ipg_bucket * half)


def _gather_alone(stream: Stream, elements: int, ranks: int, element_bytes: int) -> None:
    """One parameter with its partition on the host gathered alone and let go (`_allgather_params_sequential`):
    a buffer of its partition times the ranks, the host partition's copy on the device, both freed."""
    part = -(-elements // ranks) * element_bytes
    buffer, staging = stream.alloc(part * ranks), stream.alloc(part)
    stream.free(staging)
    stream.free(buffer)


def _lora_offload_engine(stream: Stream, params: list[tuple[int, bool]], half: int, ranks: int, ipg_bucket: int,
                         threshold: int, trainable_bytes: int) -> None:
    """zero.Init's load of a LoRA model with its parameters offloaded, and the engine's buffers, on the
    model's stream, as DeepSpeed 0.19.8 makes them (`partition_parameters.py`, `stage3.py`; the recorded
    rank-0 timelines of Mistral-7B and guide 000's 32B):

    * zero.Init builds each frozen parameter whole in the half dtype (`wrapped_fn`) and moves its
      partition to the host (`_partition_param`), freeing the whole; a persistent one (at most
      `stage3_param_persistence_threshold` elements) stays whole on the device;
    * the weights are then set through `GatheredParameters` (transformers' loading and initialization
      under ZeRO-3): each partitioned parameter gathered alone (`_allgather_params_sequential`: a
      buffer of the partition times the ranks and the host partition's copy), then freed;
    * peft moves every adapter to the device in the half dtype (`_move_adapter_to_device_of_base_layer`),
      then casts each to fp32 (`cast_adapter_dtype`), its half copy freed;
    * the engine makes each adapter a ZeRO parameter: a partitioned one goes to the host (its fp32
      storage freed), a persistent one stays; no flat buffer of the partitions on the device (with
      `offload_param` it is on the host, `_create_param_groups_fp16_flat_cpu_memory`); the IPG bucket
      (`_setup_for_real_optimizer`); then `create_reduce_and_remove_grad_hooks` gathers each trainable
      parameter alone and partitions it again (buffer and host partition copy, at its fp32 dtype).

    Between them no `empty_cache()` runs: the blocks the load freed stay cached for the step."""
    stream.mark("load")
    for n, trainable in params:
        if not trainable:
            whole = stream.alloc(n * half)
            if n > threshold:
                stream.free(whole)
    for n, trainable in params:
        if not trainable and n > threshold:
            _gather_alone(stream, n, ranks, half)
    moved = [(n, stream.alloc(n * half)) for n, trainable in params if trainable]  # every adapter, then
    adapters = []  # each cast in turn, its half copy freed
    for n, ident in moved:
        adapters.append((n, stream.alloc(n * trainable_bytes)))
        stream.free(ident)
    stream.mark("engine")
    for n, ident in adapters:
        if n > threshold:
            stream.free(ident)
    if ipg_bucket:
        stream.alloc(ipg_bucket * half)
    for n, _ in adapters:
        _gather_alone(stream, n, ranks, trainable_bytes)


def _full_offload_engine(stream: Stream, params: list[tuple[int, bool]], half: int, ranks: int, ipg_bucket: int,
                         threshold: int) -> None:
    """zero.Init's load of a full fine-tune with its parameters offloaded, and the engine's buffers, on the
    model's stream, as DeepSpeed 0.19.8 makes them: `_lora_offload_engine`'s load and engine for a model
    whose every parameter trains and none is added by peft (each built whole, its partition moved to the
    host; each set through `GatheredParameters`; the IPG bucket; each trainable parameter gathered alone
    and partitioned again as its hook is registered). A persistent parameter stays whole on the device
    and is gathered already."""
    stream.mark("load")
    for n, _ in params:
        whole = stream.alloc(n * half)
        if n > threshold:
            stream.free(whole)
    gathered = [n for n, _ in params if n > threshold]
    for n in gathered:
        _gather_alone(stream, n, ranks, half)
    stream.mark("engine")
    if ipg_bucket:
        stream.alloc(ipg_bucket * half)
    for n in gathered:
        _gather_alone(stream, n, ranks, half)


def _full_engine(stream: Stream, params: list[tuple[int, bool]], half: int, ranks: int, ipg_bucket: int,
                 groups: list[int]) -> None:
    """zero.Init's load of a full fine-tune and the engine's buffers, as DeepSpeed 0.19.8's stage 3 makes
    them with the optimizer on the host (`stage3.py`): each parameter built whole in the half dtype, its
    partition kept; `_create_fp16_partitions_with_defragmentation` moves every partition to the host
    (`move_to_cpu`), empties the cache and copies them back into one flat buffer (`defragment`); the IPG
    bucket (`_setup_for_real_optimizer`); then `create_reduce_and_remove_grad_hooks` gathers each
    trainable parameter alone (`param.all_gather()`: `_allgather_params_sequential`'s buffer of the
    partition times the ranks, on the current stream) and partitions it again. With the optimizer on the
    device (`groups`, the sub-groups' elements) the engine also makes, after the flat buffer,
    `_create_fp32_partitions`' master weights (each sub-group's half partition cast to fp32, `.to`, and
    its `.clone()` kept; the cast freed when the next one's name is rebound), `initialize_optimizer_states`'
    zeroed fp32 buffer of the largest sub-group (freed at once) and, after the IPG bucket,
    `grad_partitions_flat_buffer` (every partition, in the gradient dtype: the half one)."""
    stream.mark("load")
    parts = []
    for n, _ in params:
        whole = stream.alloc(n * half)
        parts.append(stream.alloc(-(-n // ranks) * half))
        stream.free(whole)
    stream.mark("engine")
    for ident in parts:
        stream.free(ident)
    stream.ops.append(EMPTY_CACHE)
    total = sum(-(-n // ranks) for n, _ in params)
    stream.alloc(total * half)  # defragment()
    cast = None
    for g in groups:  # _create_fp32_partitions: `converted = ....to(fp32)`, its clone kept
        previous, cast = cast, stream.alloc(g * FP32_BYTES)
        if previous is not None:
            stream.free(previous)
        stream.alloc(g * FP32_BYTES)
    if cast is not None:
        stream.free(cast)
    if groups:  # initialize_optimizer_states' gradient_buffer
        stream.free(stream.alloc(max(groups) * FP32_BYTES))
    if ipg_bucket:
        stream.alloc(ipg_bucket * half)
    if groups:  # grad_partitions_flat_buffer
        stream.alloc(total * half)
    for n, trainable in params:
        if trainable:
            stream.free(stream.alloc(-(-n // ranks) * ranks * half))


def _outputs_dropped(stream: Stream) -> list[int]:
    """Take off the end of `stream` the frees that drop the step's outputs and return their ids: the trace
    ends its step with `del out` (the loss and the logits, allocated in the forward) after the backward,
    where the training loop drops them only after `engine.step()` (`harness.runtime.train`). They are the
    frees after the micro-step's last allocation of blocks allocated before its backward began."""
    begin = next(start for name, start in reversed(stream.phases) if name == "backward")
    after = [op for op in stream.ops[begin:] if op is not EMPTY_CACHE and op >= 0]
    first_backward_id = min(after) if after else len(stream.sizes)
    end = len(stream.ops)
    while end > begin and stream.ops[end - 1] is not EMPTY_CACHE and stream.ops[end - 1] < 0:
        end -= 1
    held = [-op - 1 for op in stream.ops[end:] if -op - 1 < first_backward_id]
    stream.ops[end:] = [op for op in stream.ops[end:] if -op - 1 >= first_backward_id]
    return held


def _device_step(stream: Stream, partitions: list[int], groups: list[int], half: int, first: bool) -> None:
    """DeepSpeed 0.19.8's ZeRO-3 optimizer step on the device at an accumulation boundary (`stage3.py`):
    `get_grad_norm_direct` casts each gradient partition to fp64 for its norm, one at a time; then for each
    sub-group `_prepare_fp32_grad_for_sub_group` flattens its gradient partitions (the half dtype) and casts
    them to fp32 (the flat copy freed), the first step creates the Adam moments (`fused_adam.py`, fp32,
    lazily), and `_release_sub_group` frees the fp32 gradient."""
    for n in partitions:
        stream.free(stream.alloc(n * NORM_BYTES))
    for g in groups:
        flat = stream.alloc(g * half)
        grad = stream.alloc(g * FP32_BYTES)
        stream.free(flat)
        if first:
            stream.alloc(g * FP32_BYTES)
            stream.alloc(g * FP32_BYTES)
        stream.free(grad)


@functools.lru_cache(maxsize=16384)  # the same names in every replayed step
def _norm(name: str) -> str:
    """A module name with its indices dropped: a decoder layer's modules at full depth against the
    traced layer standing for them."""
    return re.sub(r"\.\d+(?=\.|$)", ".#", name)


def _recorded_marks(r2) -> dict[tuple[int, int], list[list[tuple[int, str, str]]]]:
    """Where the 2-layer trace recorded DeepSpeed's hooks firing (`TraceResult.hooks`), grouped as `_groups`
    groups a replayed step's hook events: (pass, layer) -> for each group of that key in order, its events
    as (position in the trace's chunk of that key, event name, module name without indices). A position
    outside that chunk is clamped to its ends; a key's k-th group takes the k-th chunk of that key."""
    # heavy: torch and transformers, imported only where a step is traced
    from harness.predict.trace.fake import _layer_index

    if not r2.hooks:
        return {}
    runs: dict[tuple[int, int], list[tuple[int, int]]] = {}
    start = 0
    for phase, layer, evs in _chunks(r2.events):
        runs.setdefault((phase, layer), []).append((start, len(evs)))
        start += len(evs)
    # the decoder layers' list: the outermost module list with both a .0 and a .1 (an MoE layer's experts
    # are one inside it)
    names = {name for *_, name in r2.hooks}
    stack = min((m.group(1) for name in names if (m := re.match(r"(.*)\.1$", name)) and f"{m.group(1)}.0" in names),
                key=lambda n: (len(n), n), default="")
    groups: list[tuple[tuple[int, int], list]] = []
    seen = {False: False, True: False}
    for at, backward, event, name in r2.hooks:
        key = _chunk_of(bool(backward), _layer_index(name, stack), seen)
        if not groups or groups[-1][0] != key:
            groups.append((key, []))
        groups[-1][1].append((at, EVENT_NAMES[event], _norm(name)))
    out: dict[tuple[int, int], list[list[tuple[int, str, str]]]] = {}
    for key, marks in groups:
        k = len(out.setdefault(key, []))
        chunk = runs.get(key, [])
        first, n = chunk[min(k, len(chunk) - 1)] if chunk else (0, 0)
        out[key].append([(min(max(at - first, 0), n), event, name) for at, event, name in marks])
    return out


def _positions(pieces: list[list], marks: list[tuple[int, str, str]] | None, n: int) -> list[int] | None:
    """The position in its chunk (events before it) of each piece's hook event, where the trace recorded the
    same hook events in the same order (`_recorded_marks`); a piece after the last hook event at the end.
    None where they differ."""

    hooked = [p[-1] for p in pieces if p and isinstance(p[-1], HookEvent)]
    if marks is None or len(hooked) != len(marks) or any(  # a decoder layer is named apart from its stack
            h.event != e or not (_norm(h.module).endswith(m) or m.endswith(_norm(h.module)))
            for h, (_, e, m) in zip(hooked, marks, strict=True)):
        return None
    out, it, last = [], iter(marks), 0
    for piece in pieces:
        if piece and isinstance(piece[-1], HookEvent):
            last = max(last, next(it)[0])
            out.append(last)
        else:
            out.append(n)
    return out


def step_spec(shape: OnePoolShape):
    """The replay's settings a shape's build runs the coordinator under."""

    return coordinator.Zero3Spec(**json.loads(shape.zero3_spec))


def build(r1, r2, shape: OnePoolShape) -> Stream:
    """The one-pool stream of rank 0."""

    spec = step_spec(shape)
    steps: list[list] = [[] for _ in range(shape.micro_steps)]
    if shape.placement != "none":  # the coordinator's hook events and gathers of each step
        steps = coordinator.replayed_steps(spec)
    half, ranks, layers = shape.half_bytes, shape.ranks, spec.layers
    params = _params(coordinator.ModelLayout.from_dict(json.loads(spec.layout_json)), layers)

    stream = Stream([], [], [])
    partitions = [-(-n // ranks) for n, trainable in params if trainable]
    groups = sub_groups(partitions, shape.sub_group_size) if shape.sub_group_size else []
    if shape.full and shape.offload_param:
        _full_offload_engine(stream, params, half, ranks, shape.ipg_bucket, spec.persistence_threshold)
    elif shape.full:
        _full_engine(stream, params, half, ranks, shape.ipg_bucket, groups)
    elif shape.offload_param:
        _lora_offload_engine(stream, params, half, ranks, shape.ipg_bucket, spec.persistence_threshold,
                             spec.trainable_bytes or half)
    else:
        _lora_engine(stream, params, half, ranks, shape.ipg_bucket, spec.persistence_threshold)

    marks = _recorded_marks(r2) if shape.placement == "recorded" and layers > 1 else {}
    ids: dict[int, int] = {}

    def put(item) -> None:
        if shape.placement == "none" or not isinstance(item, coordinator.StreamEvent):
            return
        if item.kind == "alloc":
            ids[item.id] = stream.alloc(item.nbytes)
            stream.gathers.add(ids[item.id])
            if item.what == coordinator.GATHER_INPUT:
                stream.gather_inputs.add(ids[item.id])
            if item.what in (coordinator.GATHER_INPUT, coordinator.COALESCED_STAGING):
                stream.host_copies.add(ids[item.id])
            if item.what in (coordinator.GATHER_INPUT, coordinator.COALESCED_BUFFER):
                stream.launches.add(ids[item.id])
        else:
            stream.free(ids.pop(item.id))

    for step, items in enumerate(steps[:shape.micro_steps]):
        queue = _groups(items)
        active: dict[tuple[int, int], list] = {}
        taken: dict[tuple[int, int], int] = {}  # groups of recorded marks taken so far, by the traced chunk's key

        def between(phase: int, layer: int, i: int, n: int, queue=queue, active=active, step=step,
                    taken=taken) -> None:
            key = (phase, layer)
            if phase == BACKWARD and stream.phases[-1][0] != "backward":
                stream.mark("backward")
            if i == 0:
                pieces: list = []
                if any(g[:2] == key for g in queue):
                    while queue[0][:2] != key:  # hooks of a pass the trace has no chunk for
                        for piece in queue.pop(0)[2]:
                            for item in piece:
                                put(item)
                    pieces = queue.pop(0)[2]
                if layer in (LAYER_PRE, LAYER_POST):  # the k-th chunk of its key, as the trace made them
                    traced = key
                    k = taken[traced] = taken.get(traced, -1) + 1
                else:  # every decoder layer after the first stands for the traced second one
                    traced, k = (phase, min(layer, 1)), 0
                groups = marks.get(traced, [])
                active[key] = [pieces, 0, _positions(pieces, groups[k] if k < len(groups) else None, n)
                               if marks else None]
                if step == 0 and key == (FORWARD, 0):  # the first matmul: the forward thread's cuBLAS handle
                    stream.alloc(CUBLAS_HANDLE_WORKSPACE)
            pieces, done, positions = active[key]
            h = len(pieces)
            if positions is not None:  # each hook event where the trace recorded it
                want = h if i >= n else bisect.bisect_right(positions, i)  # the positions never fall
            else:
                want = (h if i >= n or shape.placement == "start" else 0 if shape.placement == "end"
                        else min(h, i * h // max(n, 1) + 1))
            for piece in pieces[done:want]:
                for item in piece:
                    put(item)
            active[key][1] = max(done, want)

        stream.mark("forward")
        hook = (lambda: stream.alloc(CUBLAS_HANDLE_WORKSPACE)) if step == 0 else None
        left = expand(r1, r2, layers, stream, hook, between=between)
        for _, _, pieces in queue:
            for piece in pieces:
                for item in piece:
                    put(item)
        stream.mark("optimizer")
        if groups and (step + 1) % shape.accumulation == 0:  # engine.step(), before the loop drops its outputs
            held = _outputs_dropped(stream)
            _device_step(stream, partitions, groups, half, first=step + 1 == shape.accumulation)
            for ident in held:
                stream.free(ident)
        for ident in left:  # the loss and logits the training loop held, dropped after the micro-step
            stream.free(ident)
    return stream


def simulate(stream: Stream, conf: AllocatorConf | None = None) -> OnePoolRun:
    """The allocator model over `stream`: its reserved peak (each gather input held to its wait), and its
    allocated peak with the inputs let go as NCCL lets them (`harness.predict.zero3.gather_release`)."""
    sim = CachingAllocator(conf)
    clock = gather_release.Clock() if stream.gather_inputs else None
    blocks: dict[int, object] = {}
    gathered_after: list[int] = []  # timed: the gathers' and their inputs' live bytes after each op
    inputs_after: list[int] = []
    ends = [*[start for _, start in stream.phases][1:], len(stream.ops)]
    phase_ends: list[tuple[str, int]] = []
    peak, peak_at = -1, 0
    gathered, most, most_at, most_gathered = 0, 0, 0, 0  # the gathers' live bytes; the allocated peak's
    inputs = most_inputs = 0  # the same of the gathers' host partition copies
    allocations = 0  # the host's time: harness.predict.zero3.gather_release
    for i, op in enumerate(stream.ops):
        if op is EMPTY_CACHE:
            sim.empty_cache()
        elif op >= 0:
            blocks[op] = block = sim.malloc(stream.sizes[op])
            allocations += 1
            if block is not None and op in stream.gathers:
                gathered += block.size
                inputs += block.size if op in stream.gather_inputs else 0
                if clock is not None:
                    clock.gather(op, block.size, allocations, i, host_copy=op in stream.host_copies,
                                 gather_input=op in stream.gather_inputs, launch=op in stream.launches)
            if sim.stats.reserved > peak:
                peak, peak_at = sim.stats.reserved, i
            if sim.stats.allocated > most:
                most, most_at, most_gathered, most_inputs = sim.stats.allocated, i, gathered, inputs
        else:
            block = blocks.pop(-op - 1, None)
            if block is not None:
                if -op - 1 in stream.gathers:
                    gathered -= block.size  # before the free: a freed block merges with its free neighbours
                    inputs -= block.size if -op - 1 in stream.gather_inputs else 0
                if clock is not None:
                    clock.freed(-op - 1, i)
                sim.free(block)
        if clock is not None:
            clock.allocated.append(sim.stats.allocated)
            gathered_after.append(gathered)
            inputs_after.append(inputs)
        while len(phase_ends) < len(ends) and i == ends[len(phase_ends)] - 1:
            phase_ends.append((stream.phases[len(phase_ends)][0], sim.stats.reserved))
    held = sim.stats.peak_allocated
    if clock is not None:
        released = gather_release.worst_phase(clock)
        most, most_at = released.peak, released.at
        let_go = sum(clock.inputs[ident].nbytes for ident in released.let_go)  # live inputs, all of them
        most_gathered, most_inputs = gathered_after[most_at] - let_go, inputs_after[most_at] - let_go

    def phase(at: int) -> str:
        return next((name for name, start in reversed(stream.phases) if start <= at), "load")

    return OnePoolRun(max(peak, 0), most, phase(peak_at), phase_ends, phase(most_at), most_gathered, most_inputs,
                      held)


@functools.lru_cache(maxsize=16)
def simulated(spec: TraceSpec, shape: OnePoolShape) -> OnePoolRun:
    """`simulate(build(...))` over the traces of `spec`, cached in-process and on disk beside the traces
    (keyed by both and by the code of this module, the replay, the stream and the allocator model)."""

    def make() -> OnePoolRun:
        conf = AllocatorConf.parse(shape.alloc_conf, "launch.env.PYTORCH_CUDA_ALLOC_CONF")
        return simulate(build(*trace_pair(spec), shape), conf)

    def load(d: dict) -> OnePoolRun:
        d["phase_ends"] = [tuple(x) for x in d["phase_ends"]]
        return OnePoolRun(**d)

    code = ("zero3/stream.py", "zero3/coordinator.py", "zero3/order.py", "zero3/hooks.py", "zero3/step.py",
            "allocator/stream.py", "allocator/allocator.py", "zero3/gather_release.py", "constants.py")
    return cached_on_disk("zero3pool", spec, shape, code, make, load)


def simulated_or_none(trace_spec: TraceSpec, shape: OnePoolShape, what: str, instead: str, notes: list[str],
                      figure: str = "reserved") -> OnePoolRun | None:
    """`simulated`, or None, with a note that `instead` stands in for `figure`, where DeepSpeed cannot be
    imported or the build cannot follow the trace or the hook order (`what`: the stream, in words)."""
    try:
        return simulated(trace_spec, shape)
    except ImportError as exc:
        notes.append(f"{figure}: {instead}; DeepSpeed's coordinator could not be imported for {what} ({exc})")
    except (ValueError, RuntimeError, AssertionError) as exc:  # a trace or hook order the build cannot follow
        notes.append(f"{figure}: {instead}; {what} could not be built ({exc})")
    return None
