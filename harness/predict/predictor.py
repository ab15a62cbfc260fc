"""The predictor: per-GPU peak memory and host memory of a case at full size, on a CPU.

    from harness.predict.predictor import predict, Prediction
    pred = predict(case, arch=None, platform="nvidia-h100-80gb-hbm3-x1", exclude={case.id})
    pred = predict(case, platform="nvidia-h200-x2", exclude={case.id}, variant="2r4L2ga")  # as measured

How a prediction is made (per GPU process; the worst rank of a sharded job):

1. Trace (`harness.predict.trace`): one training micro-step of the real model code at full width
   with 1 and 2 layers, on fake tensors, as the case's stack builds and trains it; extrapolated
   affinely to the case's depth (its `layers` when set). Gives the step's transient peak above the
   model states, the activations a forward keeps, the logits, the parameter inventory, and the
   step's allocations and frees by layer (the allocator model's input, step 5). Traces
   are cached in-process and on disk (keyed by spec, code and library versions), so a repeated
   prediction imports neither torch nor transformers.
2. Closed-form states (`harness.predict.states`): weights (4-bit storage, fp32 upcasts, ZeRO-3
   partitions and persistent parameters), adapters, gradients, AdamW / DeepSpeed optimizer state,
   ZeRO buckets and the gathered ZeRO-3 parameters (DeepSpeed's coordinator replayed over the step,
   `harness.predict.zero3`; the closed form for a full fine-tune with parameter offload), offload to
   host, cuBLAS workspaces.
3. allocated = states (with what ZeRO-3 has gathered when backward starts) + max(trace peak,
   optimizer-step transient).
4. ZeRO-3: allocated = max(step 3, states + the most parameters gathered at once + the activations a
   forward keeps) (DeepSpeed keeping weights for reuse, or tying recomputed frozen weights to the root
   under reentrant checkpointing); the closed form's reentrant retention where nothing was replayed
   (`harness.predict.states.zero3_reentrant_retention`). Where the step is built as one stream
   (`harness.predict.zero3_stream`: LoRA with its parameters offloaded or `overlap_comm: false`, a full
   fine-tune with its parameters on the device), allocated is that stream's peak with DeepSpeed's
   gathers among the model's allocations instead (the terms' figure kept as `allocated_by_terms`).
5. reserved: without DeepSpeed, the peak of the allocator model (`harness.predict.allocator`) over
   the run's allocation stream built from the traces (`harness.predict.stream`: the load, optimizer
   steps until the allocator's state repeats from one step to the next); ZeRO-2 with the optimizer on
   the device (LoRA, QLoRA, full) or, for a full fine-tune, on the host the same, over a stream with
   DeepSpeed's buffers in it (`harness.predict.zero2_stream`); other DeepSpeed configs, calibrated
   (`harness.predict.calibration`,
   fitted on results/baselines at call time, per platform): allocated x reserved_over_allocated
   (+ zero3_cached_gathers x the largest gathered parameter's bytes under ZeRO-3), since the stream
   lacks DeepSpeed's buckets and offload buffers; a ZeRO-3 full fine-tune with its parameters on the
   device: (allocated - the gathered bytes in it) x that ratio + the gather stream's pool, DeepSpeed's
   all-gathers replayed through the allocator model (harness.predict.zero3.gather_pool), in place of
   zero3_cached_gathers; with the optimizer on the host the model's pool is the allocator model's over
   its own stream instead of the ratio (`harness.predict.zero3_stream`, `full`); LoRA under ZeRO-3
   with its parameters offloaded the same: the model's stream built
   (`_lora_offload_engine`) beside the replayed gather pool and the reduce stream's; under ZeRO-3 without
   optimizer offload, at least the
   forward and backward's reserve plus the segment the optimizer step's fp32 gradient of the largest
   sub-group takes (`harness.predict.zero3_step`); device = reserved + what the process holds
   beside the allocator
   (`harness.predict.device`: the parts the device probe measured on the platform where a record
   exists, else device_overhead, + device_overhead_deepspeed for DeepSpeed processes), +
   triton_cold_overhead for fla on a cold Triton cache.
6. host_ram (whole job on one node): per process an assumed base (torch + CUDA libraries), each
   dataloader worker, plus offloaded optimizer state and parameters (pinned: each partition
   rounded up to a power of two, as torch's pinned host allocator does). Not fitted.
7. margin (`harness.predict.margin`): the device figure's uncertainty, the worst leave-one-out
   shortfall on the benchmark's runs of the same kind of config; `harness.predict.margin.fit_verdict`
   adds it before comparing with the card.

For `launch.procs_per_card > 1` every figure is per process; the caller multiplies.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field

from harness.models.registry import Architecture
from harness.models.source import load_model
from harness.predict.device import overhead as device_overhead
from harness.predict.margin import MARGIN_FLOOR, Margin, margin_for
from harness.spec.schema import Case, Offload

GiB = 2**30
# Priors, used only where results/ holds no baseline to fit a constant on (say so in notes).
PRIORS = {"reserved_over_allocated": 1.05, "zero3_cached_gathers": 2.0, "device_overhead": 0.6 * GiB,
          "device_overhead_deepspeed": 0.5 * GiB}
# Host-memory assumptions (not fitted: the baselines hold no host figure yet).
HOST_PROCESS_BASE = 3 * GiB  # torch + CUDA libraries + Python of one training process
HOST_PER_WORKER = int(0.5 * GiB)  # one dataloader worker (forked, copy-on-write)


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

    def gib(self) -> str:
        return (f"allocated {self.allocated / GiB:.2f} GiB, reserved {self.reserved / GiB:.2f} GiB, "
                f"device {self.device / GiB:.2f} GiB, host {self.host_ram / GiB:.2f} GiB")


def _inventory(r1, r2, layers: int):
    from harness.predict.states import Inventory
    from harness.predict.trace import extrapolate

    p1, p2 = r1.params, r2.params
    c1, c2 = Counter(p1.sizes), Counter(p2.sizes)
    per_layer = c2 - c1
    fixed = c1 - per_layer
    sizes = list((fixed + Counter({k: v * layers for k, v in per_layer.items()})).elements())
    ex = lambda a, b: round(extrapolate(a, b, layers))  # noqa: E731
    return Inventory(quantizable=ex(p1.quantizable, p2.quantizable), other=ex(p1.other, p2.other),
                     trainable=ex(p1.trainable, p2.trainable), head=p1.head,
                     largest_layer_module=p1.largest_layer_module, sizes=sizes,
                     layer_sizes=list(per_layer.elements()), layers=layers,
                     largest_trainable=max((row[0] for row in (*r1.layout, *r2.layout) if row[3]), default=0),
                     trainable_sizes=_trainable_rows(r1, layers))


def _trainable_rows(r1, layers: int) -> list[int]:
    """The element counts of r1's trainable parameters at the case's depth (layer 0's repeated)."""
    from harness.predict.step import LAYER_POST, LAYER_PRE

    rows = [r for r in r1.layout if r[3]]
    return ([r[0] for r in rows if r[4] in (LAYER_PRE, LAYER_POST)]
            + [r[0] for r in rows if r[4] not in (LAYER_PRE, LAYER_POST)] * layers)


def _zero3_gathered(case: Case, arch: Architecture, layers: int, notes: list[str]):
    """DeepSpeed's coordinator replayed over the case's step (harness.predict.zero3), for LoRA, QLoRA and
    full fine-tunes alike; None where the case is not ZeRO-3 or DeepSpeed is not installed (states.py then
    uses its closed form)."""
    if case.deepspeed is None or case.deepspeed.stage != 3:
        return None
    from harness.predict import zero3

    try:
        return zero3.gathered(zero3.spec_for(case, arch, layers))
    except ImportError as exc:
        notes.append(f"ZeRO-3 gathered set: the closed form; DeepSpeed's coordinator could not be imported ({exc})")
    except (ValueError, RuntimeError, AssertionError) as exc:  # a model or hook order the replay cannot follow
        notes.append(f"ZeRO-3 gathered set: the closed form; DeepSpeed's coordinator could not be replayed ({exc})")
    return None


# Trace specs this process has traced or read: their layout and replay are in its caches too.
_TRACED: set = set()


@dataclass
class _TracedAlongside:
    """The step traced in a forked child while this process replays DeepSpeed's coordinator; where this
    process replays the step stream's steps under their own spec, the child replays the gathered set after
    the trace."""

    child: object  # multiprocessing.Process
    conn: object  # the read end of a pipe the child sends the traces, then (gathered, notes), through
    gathers: bool  # whether the child replays the gathered set

    def keep_trace(self, trace_spec) -> None:
        """The child's traces, kept for `trace_pair`; none where it sent none (it failed: `trace_pair` then
        traces here, where the failure is met again and reported)."""
        from harness.predict.trace import keep_pair

        try:
            keep_pair(trace_spec, self.conn.recv())
        except (EOFError, OSError):
            self.gathers = False  # nothing more comes

    def take_gathered(self, notes: list[str]):
        """The child's (gathered figures,), its notes added to `notes`; None where it replays none or sent
        nothing (the caller then replays in-process, where a failure is met again and reported)."""
        try:
            if not self.gathers:
                return None
            value, child_notes = self.conn.recv()
        except (EOFError, OSError):
            return None
        finally:
            self.conn.close()
            self.child.join()
        notes += child_notes
        return (value,)


def _trace_alongside(case: Case, arch: Architecture, layers: int, trace_spec) -> _TracedAlongside | None:
    """On a cold start of a ZeRO-3 case, trace the step in a forked child while this process replays
    DeepSpeed's coordinator: once the model's module layout is built here (transformers imported once),
    the two are independent and each takes seconds. This process replays what the step stream is built
    from (`zero3.replayed_steps`, four steps), then builds that stream with the child's traces while the
    child replays the gathered set (two steps); where the two specs are one, or no step stream is built,
    this process replays the gathered set (`zero3.gathered`, which keeps its steps) and the child only
    traces. None where nothing is gained or forking is not safe: a trace this process or the disk cache
    already has, one CPU, or threads running in this process (a forked child holds only the forking
    thread, and a lock another thread held stays locked in it)."""
    import multiprocessing
    import threading

    from harness.predict.trace import _load

    if (case.deepspeed is None or case.deepspeed.stage != 3
            or trace_spec in _TRACED
            or (os.cpu_count() or 1) < 2 or threading.active_count() > 1
            or "fork" not in multiprocessing.get_all_start_methods() or _load(trace_spec) is not None):
        return None
    from harness.predict import zero3, zero3_stream

    try:  # the model's layout first, here: it builds the model as the trace will
        zero3.layout(trace_spec)
        spec = zero3.spec_for(case, arch, layers)
        steps = (zero3_stream.step_spec(zero3_stream.OnePoolShape.of(case, arch, layers))
                 if _zero3_step_stream_applies(case) else spec)
    except Exception:  # met again, and reported, by the in-process trace and replay
        return None
    child_gathers = steps != spec
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_trace_in_child, args=(case, arch, layers, trace_spec, child_gathers, send),
                        daemon=True)
    child.start()
    send.close()
    try:
        if child_gathers:
            zero3.replayed_steps(steps)
        else:
            zero3.gathered(spec)
    except Exception:  # met again, and reported, where the prediction replays
        pass
    return _TracedAlongside(child, receive, child_gathers)


def _trace_in_child(case: Case, arch: Architecture, layers: int, trace_spec, gathers: bool, send) -> None:
    """The forked child: sends the traces, then, where `gathers`, (gathered, notes); it stops at what fails
    (the parent then does it in-process, where the failure is met again and reported). Its torch runs on one
    thread: the OpenMP thread team the parent may have started is not in a forked process, and a parallel
    region waiting on it there never ends."""
    import torch

    from harness.predict.trace import trace_pair

    torch.set_num_threads(1)
    try:
        send.send(trace_pair(trace_spec))
        if gathers:
            notes: list[str] = []
            send.send((_zero3_gathered(case, arch, layers, notes), notes))
    except Exception:
        pass
    finally:
        send.close()


def _trainable_sizes(case: Case, r1, layers: int, r2=None) -> list[int]:
    """The trainable parameters' elements in module order at the case's depth: every parameter of a full
    fine-tune (from the 1- and 2-layer models), the adapters of a LoRA or QLoRA one (layer 0's
    repeated)."""
    from harness.predict.step import LAYER_POST, LAYER_PRE
    from harness.predict.zero3_step import full_depth_sizes

    if case.method.kind == "full":
        return full_depth_sizes(r1.params.sizes, r2.params.sizes, layers)
    rows = [r for r in r1.layout if r[3]]
    before = [r[0] for r in rows if r[4] == LAYER_PRE]
    after = [r[0] for r in rows if r[4] == LAYER_POST]
    return before + [r[0] for r in rows if r[4] not in (LAYER_PRE, LAYER_POST)] * layers + after


def _zero3_reduce_stream(case: Case, r1, r2, layers: int, notes: list[str]) -> int:
    """ZeRO-3 with optimizer offload: what DeepSpeed's reduce stream reserves beside the model's pool
    (harness.predict.zero3_step.reduce_stream_reserve), 0 elsewhere."""
    from harness.predict.zero3_step import reduce_stream_reserve

    ranks = case.launch.ranks
    partitions = [-(-n // ranks) for n in reversed(_trainable_sizes(case, r1, layers, r2))]
    pool = reduce_stream_reserve(case, partitions, _alloc_conf(case))
    if pool is None:
        return 0
    notes.append(f"ZeRO-3 optimizer offload: DeepSpeed's reduce stream reserves {pool / GiB:.2f} GiB of its own "
                 "(partition_grads' device copies, the boundary's fp64 norm and fp32 cast, stage3.py)")
    return pool


def _zero3_fp32_grad_segment(case: Case, r1, r2, layers: int, notes: list[str]) -> int:
    """ZeRO-3 without optimizer offload: the segment the optimizer step's fp32 gradient of the largest
    sub-group takes beyond the forward and backward's reserve (harness.predict.zero3_step), 0 elsewhere."""
    from harness.predict.calibration import largest_gather_bytes
    from harness.predict.trace import extrapolate
    from harness.predict.zero3_step import fp32_grad_segment

    full = case.method.kind == "full"
    sizes = _trainable_sizes(case, r1, layers, r2) if full else None
    trainable = sum(sizes) if sizes else round(extrapolate(r1.params.trainable, r2.params.trainable, layers))
    largest = max([e[2] for r in (r1, r2) for e in r.events if e[0] == 1] + [largest_gather_bytes(case)])
    seg = fp32_grad_segment(case, sizes, trainable, largest)
    if seg is None:
        return 0
    notes.append(seg.note)
    return seg.bytes


def _zero3_gather_pool(case: Case, gathered, conf) -> int | None:
    """What DeepSpeed's all-gather stream reserves of its own (`Gathered.pool_bytes`), where the rest of the
    reserve is checked to be the model's pool: a full fine-tune with its parameters on the device, and LoRA
    with its parameters offloaded, under the allocator's native backend without expandable segments.
    Phi-3-mini's and Gemma-2-2B's recorded timelines: the gather stream's pool replayed 2.50 and 4.258 GiB,
    recorded 2.40 and 4.258; Mistral-7B's LoRA with parameter offload, guide 000's 32B at 4 layers
    (reentrant) and at 2 and 4 layers (non-reentrant): 13.959, 6.807, 6.387 and 5.668, recorded 13.959,
    6.809, 6.387 and 5.668. None elsewhere (zero3_cached_gathers is used): a full fine-tune with its
    parameters offloaded has no model's stream built; fit's LoRA config for guide 000 (no timeline)
    reserves 2.8 to 3.2 GiB beyond the ratio and the replayed pool; an expandable segment's pool is checked
    on one run (guide 002: 6.96 GiB replayed, 8.05 recorded)."""
    from harness.predict.zero3 import uses_gather_pool

    if gathered is None or not uses_gather_pool(case) or conf.backend != "native" or conf.expandable_segments:
        return None
    return gathered.pool_bytes


def _zero3_one_pool(case: Case, arch: Architecture, layers: int, trace_spec, conf, notes: list[str]):
    """ZeRO-3 with `overlap_comm: false` (harness.predict.zero3_stream.applies, and `applies_offload_one_pool`
    with the parameters on the host), under the native allocator without expandable segments: the allocator
    model's figures over the one-pool stream; None elsewhere. The optimizer is on the host and its reduce path
    runs on the default stream too (MiBs for LoRA): no gather stream, reduce stream or fp32 gradient segment
    is added beside it. With the parameters on the host the coordinator's gathers are put where the trace
    recorded DeepSpeed's hooks firing (placement "recorded"): guide 000's non-reentrant fix reserves 6.56 /
    6.57 GiB built so at 4 / 8 layers, its ranks 6.41 and 6.66 / 6.42 and 6.22 measured; spread evenly over
    each chunk, 6.66 / 5.91."""
    from harness.predict import zero3_stream

    if (not (zero3_stream.applies(case) or zero3_stream.applies_offload_one_pool(case))
            or conf.backend != "native" or conf.expandable_segments):
        return None
    shape = zero3_stream.OnePoolShape.of(case, arch, layers, zero3_stream.placement_for(case))
    return _zero3_stream_simulated(trace_spec, shape, "the one-pool stream", "the ratio", notes)


def _zero3_model_stream(case: Case, arch: Architecture, layers: int, trace_spec, notes: list[str]):
    """A ZeRO-3 config with `overlap_comm` whose model's stream is built: a full fine-tune with its
    parameters on the device (harness.predict.zero3_stream.applies_model_stream) or LoRA with them
    offloaded (`applies_offload_model_stream`): the allocator model over the model's own stream (zero.Init's
    load, DeepSpeed's buffers on that stream, four micro-steps of the traced step and, with the optimizer on
    the device, its fp32 partitions, gradient partitions and sub-group steps; the coordinator's gathers left
    to their own stream). Phi-3-mini's recorded rank-0 model stream (optimizer offload) reserves 4.297 /
    3.764 / 6.262 / 6.752 GiB at the end of its load, engine, first forward and first backward, the built one
    the same to the MiB (the ratio gave 6.53); Gemma-2-2B's (optimizer on the device) 33.770 at its peak, in
    the second optimizer step, the built one the same (the ratio and the fp32 gradient segment gave 32.85);
    Mistral-7B's LoRA with parameter offload 0.533 / 1.689 / 1.939 after its load, first forward and
    backward, the built one the same. None elsewhere, or where the stream cannot be built."""
    from harness.predict import zero3, zero3_stream

    if not (zero3_stream.applies_model_stream(case) or zero3_stream.applies_offload_model_stream(case)
            or zero3.applies_full_offload(case)):
        return None
    return _zero3_stream_simulated(trace_spec, zero3_stream.OnePoolShape.of(case, arch, layers, "none"),
                                   "the model's stream", "the model's pool by the ratio", notes)


def _zero3_step_stream(case: Case, arch: Architecture, layers: int, trace_spec, notes: list[str]):
    """A ZeRO-3 config whose step is built as one stream (harness.predict.zero3_stream: `applies`,
    `applies_model_stream`, `applies_offload_model_stream`): the allocator model over that stream with
    the coordinator's gathers put among the model's allocations (each layer's hook events spread over its
    chunk; for `applies_offload_one_pool`, where the trace recorded them), whatever stream they run on; its
    allocated peak counts the gathered bytes and the activations each as they are at that moment. None
    elsewhere, or where it cannot be built."""
    from harness.predict import zero3_stream

    if not _zero3_step_stream_applies(case):
        return None
    # the same shape as `_zero3_one_pool`'s where both apply: one stream for both figures
    shape = zero3_stream.OnePoolShape.of(case, arch, layers, zero3_stream.placement_for(case))
    return _zero3_stream_simulated(trace_spec, shape,
                                   "the step's stream with the gathers", "the terms' peak", notes, "allocated")


def _zero3_step_stream_applies(case: Case) -> bool:
    from harness.predict import zero3, zero3_stream

    return (case.deepspeed is not None and (zero3_stream.applies(case) or zero3_stream.applies_model_stream(case)
                                            or zero3_stream.applies_offload_model_stream(case)
                                            or zero3_stream.applies_offload_one_pool(case)
                                            or zero3.applies_full_offload(case)))


def _zero3_stream_simulated(trace_spec, shape, what: str, instead: str, notes: list[str], figure: str = "reserved"):
    """The allocator model over a ZeRO-3 stream built by harness.predict.zero3_stream (`what`, in words);
    None, with a note that `instead` stands in for `figure`, where DeepSpeed cannot be imported or the
    build cannot follow the trace or the hook order."""
    from harness.predict import zero3_stream

    try:
        return zero3_stream.simulated(trace_spec, shape)
    except ImportError as exc:
        notes.append(f"{figure}: {instead}; DeepSpeed's coordinator could not be imported for {what} ({exc})")
    except (ValueError, RuntimeError, AssertionError) as exc:  # a trace or hook order the build cannot follow
        notes.append(f"{figure}: {instead}; {what} could not be built ({exc})")
    return None


def _alloc_conf(case: Case):
    """The case's PYTORCH_CUDA_ALLOC_CONF (`launch.env`) as the allocator model reads it; one it cannot
    read is bad input."""
    from harness.models.inputs import InputError
    from harness.predict.allocator import AllocatorConf, AllocConfError

    try:
        return AllocatorConf.parse(case.launch.env.get("PYTORCH_CUDA_ALLOC_CONF", ""), "PYTORCH_CUDA_ALLOC_CONF")
    except AllocConfError as exc:
        raise InputError(None, "launch.env", str(exc)) from None


def predict(case: Case, arch: Architecture | None = None, *, platform: str | None = None,
            exclude=frozenset(), variant=None) -> Prediction:
    """`variant` (a harness.spec.variants.Variant or its text, e.g. '2r4L2ga'): predict the case as
    measured on that variant (ranks, layers, grad accum applied), to compare with a baseline of it.
    `exclude`: case ids left out of the calibration (a case id excludes every variant of it)."""
    t0 = time.perf_counter()
    if variant:
        from harness.spec.variants import Variant, parse_variant

        case = (variant if isinstance(variant, Variant) else parse_variant(variant)).apply(case)
    from harness.predict.calibration import OPTIONAL, calibrate
    from harness.predict.states import model_states
    from harness.predict.trace import TraceSpec, extrapolate, trace_pair

    arch = arch or load_model(case.model)
    layers = case.layers or arch.layers
    hidden = int(arch.config["hidden_size"])
    notes: list[str] = []
    missing: list[str] = []
    if case.layers:
        notes.append(f"predicted at {layers} of {arch.layers} layers (the case's `layers`)")

    trace_spec = TraceSpec.of(case, arch)
    alongside = _trace_alongside(case, arch, layers, trace_spec)
    if alongside is not None:
        alongside.keep_trace(trace_spec)
    r1, r2 = trace_pair(trace_spec)
    _TRACED.add(trace_spec)
    if r1.attention_note:
        notes.append(r1.attention_note)
    peak = int(extrapolate(r1.peak, r2.peak, layers))
    held = int(extrapolate(r1.held_after_forward, r2.held_after_forward, layers))
    inv = _inventory(r1, r2, layers)
    # where the step is built as one stream with DeepSpeed's gathers among the model's allocations
    # (harness.predict.zero3_stream), its allocated peak is the step's: the gathered bytes and the
    # activations each at the moment they are live together, not each at its own peak. Built before the
    # gathered set is waited for (a forked child may still be replaying it); its notes go where it is used.
    stream_notes: list[str] = []
    stepped = _zero3_step_stream(case, arch, layers, trace_spec, stream_notes)
    replayed = alongside.take_gathered(notes) if alongside is not None else None
    gathered = replayed[0] if replayed is not None else _zero3_gathered(case, arch, layers, notes)
    states = model_states(case, inv, hidden, gathered)
    notes += states.notes

    dev = dict(states.device)
    resident = states.resident
    grads_in_trace = case.deepspeed is None and case.train.grad_accum == 1
    before_step = resident - (dev.get("grads", 0) if grads_in_trace else 0)
    backward_peak = before_step + peak
    optimizer_peak = resident + states.optimizer_step_extra
    # ZeRO-3 + reentrant checkpointing + frozen weights: every layer's gathered weights held at once
    # (harness.predict.states.zero3_reentrant_retention), at the moment the next parameter is gathered
    retained = states.step_only.get("zero3_reentrant_retained_weights", 0)
    retention_peak = resident + retained if retained else 0
    # ZeRO-3: the most parameters gathered at once (harness.predict.zero3), beside the activations a
    # forward keeps (checkpoints, logits); above the backward's start where DeepSpeed keeps gathered
    # weights for reuse or (reentrant checkpointing) ties recomputed frozen weights to the root module
    above = states.step_only.get("zero3_gathered_above_backward_start", 0)
    # where the replay puts that peak in a layer's backward, the layers above it are done: their saved
    # layer inputs (the checkpoints) are freed, and what a forward through this layer and those below
    # it keeps is held beside it (the output the training loop keeps, logits included, stays); in the
    # embedding's backward every layer's and the loss's are done, and of what the forward kept only that
    # output is left. The gathered bytes and the activations peak together where their sum does: each
    # layer's backward and the embedding's are weighed with what is held there.
    peak_layer = gathered.peak_backward_layer if gathered is not None else -1
    held_at_gather = held if peak_layer < 0 else min(held, int(extrapolate(r1.held_after_forward,
                                                                           r2.held_after_forward, peak_layer + 1)))
    gathered_above = above
    if above and gathered is not None and gathered.layer_backward_peaks:
        # the replay's own peak where it falls outside the layers' backward and the embedding's, beside all
        # that a forward keeps
        outside = gathered.peak_bytes == gathered.outside_peak > max(gathered.layer_backward_peaks)
        candidates = [(gathered.peak_bytes + held, gathered.peak_bytes, held)] if outside else []
        for i, g in enumerate(gathered.layer_backward_peaks):
            h = min(held, int(extrapolate(r1.held_after_forward, r2.held_after_forward, i + 1)))
            candidates.append((g + h, g, h))
        if gathered.below_backward_peak:
            h = min(held, int(r1.logits))
            candidates.append((gathered.below_backward_peak + h, gathered.below_backward_peak, h))
        _, at, held_at_gather = max(candidates)
        gathered_above = max(0, at - gathered.backward_start_bytes)
    gather_peak = resident + gathered_above + held_at_gather if above else 0
    allocated = max(backward_peak, optimizer_peak, retention_peak, gather_peak)
    notes += stream_notes

    terms = {k: int(v) for k, v in dev.items()}
    terms.update({k: int(v) for k, v in states.step_only.items()})
    terms["activations_held_after_forward"] = held
    if gather_peak and gathered_above != above:  # the gathered bytes where they and the activations peak together
        terms["zero3_gathered_above_backward_start"] = int(gathered_above)
    if gather_peak and held_at_gather != held:
        terms["activations_held_at_gather_peak"] = held_at_gather
    terms["logits"] = int(r1.logits)
    terms["step_transient_peak"] = peak
    terms["optimizer_step_transient"] = states.optimizer_step_extra
    where = {backward_peak: "the forward/backward (loss and logits)", optimizer_peak: "the optimizer step",
             retention_peak: "a parameter gather with every layer's frozen weights retained (reentrant checkpointing)",
             gather_peak: "the most ZeRO-3 parameters gathered at once"}
    if stepped is not None:
        terms["allocated_by_terms"] = allocated
        terms["zero3_gathered_at_allocated_peak"] = stepped.gathered_at_allocated_peak
        notes.append(f"allocated: the peak of the step's stream with DeepSpeed's gathers in it (zero.Init's load, the "
                     f"engine's buffers, four micro-steps), {stepped.peak_allocated / GiB:.2f} GiB during the "
                     f"{stepped.allocated_phase}, {stepped.gathered_at_allocated_peak / GiB:.2f} GiB of it gathered; "
                     f"the terms' peak during {where[allocated]} was {allocated / GiB:.2f} GiB")
        allocated = stepped.peak_allocated
        inputs = stepped.gather_inputs_at_allocated_peak
        if inputs:
            terms["zero3_gather_inputs_at_allocated_peak"] = inputs
        if stepped.peak_allocated_held > allocated:
            terms["allocated_with_gather_inputs_held"] = stepped.peak_allocated_held
        if stepped.peak_allocated_held - allocated > MARGIN_FLOOR * allocated or inputs > MARGIN_FLOOR * allocated:
            from harness.predict.gather_release import COPY_BYTES_PER_S, HOST_S_PER_ALLOCATION

            notes.append(f"allocated: {inputs / GiB:.2f} GiB of it are host partition copies handed to NCCL as "
                         "gather inputs; NCCL lets one go once its watchdog (polling every 100 ms) has seen the "
                         "gather done and another collective is launched, so the step is timed (a host spending "
                         f"{HOST_S_PER_ALLOCATION * 1e6:.0f} us per allocation and copying at "
                         f"{COPY_BYTES_PER_S / 1e9:.0f} GB/s, faster than any recorded) and the figure is its "
                         "worst watchdog phase; with every copy held to its gather's wait, "
                         f"{stepped.peak_allocated_held / GiB:.2f} GiB, the most any host's run can reach")
    else:
        notes.append("peak during " + where[allocated])

    cal = calibrate(platform, frozenset(exclude))
    notes += cal.notes
    values = {k: cal.values.get(k, v) for k, v in PRIORS.items()}
    ratio = values["reserved_over_allocated"]
    reserved = int(allocated * ratio)
    conf = _alloc_conf(case)
    from harness.predict import zero2_stream

    one_pool = None
    if zero2_stream.applies(case) and conf.backend == "native":
        # ZeRO-2: the allocator model over the run's stream with DeepSpeed's buffers in it
        # (harness.predict.zero2_stream)
        from harness.predict.stream import start_states

        shape = zero2_stream.Zero2Shape.of(case, layers, hidden)
        # one run per device state the load can begin from (stream.start_states): the larger reserve
        run = max((zero2_stream.simulated(trace_spec, s) for s in start_states(shape)), key=lambda r: r.peak_reserved)
        terms["reserved_by_ratio"] = reserved
        terms["zero2_reduction_stream_segments"] = run.reduction_stream_reserved
        reserved = max(run.peak_reserved, allocated)
        what = ("the boundary's fp64/fp32 gradient casts" if shape.offload else
                "the IPG buckets, the gradient partition, the fp32 master partition and its moments")
        notes.append(f"reserved: the allocator model over the load, DeepSpeed's flat buffer and two optimizer steps "
                     f"with {what} (rank {run.rank}: {run.reduction_stream_reserved / GiB:.2f} GiB in segments "
                     f"of DeepSpeed's reduction stream; peak during the {run.peak_phase}), not allocated x "
                     f"reserved_over_allocated ({ratio:.3f})")
    elif one_pool := _zero3_one_pool(case, arch, layers, trace_spec, conf, notes):
        # ZeRO-3 gathering on the current stream: the allocator model over the model's allocations and
        # DeepSpeed's gathers in one pool (harness.predict.zero3_stream)
        terms["reserved_by_ratio"] = reserved
        reserved = max(one_pool.peak_reserved, allocated)
        notes.append(f"reserved: the allocator model over zero.Init's load, the engine's buffers and four micro-steps "
                     f"with DeepSpeed's gathers in the model's pool (overlap_comm false; peak during the "
                     f"{one_pool.peak_phase}), not allocated x reserved_over_allocated ({ratio:.3f}) and "
                     "zero3_cached_gathers")
    elif case.deepspeed is not None:
        if not (case.deepspeed.stage == 3 and _zero3_gather_pool(case, gathered, conf) is not None):
            notes.append(f"reserved: allocated x reserved_over_allocated ({ratio:.3f}); the allocator model does "
                         "not see DeepSpeed's buckets, gathers and offload buffers")
        # else: the model's pool beside the gather stream's, below
    elif conf.backend != "native":
        notes.append(f"reserved: allocated x reserved_over_allocated ({ratio:.3f}); backend:{conf.backend} hands "
                     "memory to CUDA's own pool allocator, which the allocator model does not follow")
    else:  # the allocator model over the run's stream (harness.predict.stream)
        from harness.predict.stream import RunShape, StreamError, start_states
        from harness.predict.trace import simulated_run

        spec = TraceSpec.of(case, arch)
        try:
            # one run per device state the load can begin from (stream.start_states): the larger reserve
            sims = [simulated_run(spec, shape) for shape in start_states(RunShape.of(case, spec, layers))]
        except StreamError as exc:
            notes.append(f"reserved: allocated x reserved_over_allocated ({ratio:.3f}); the allocator model "
                         f"could not be used: {exc}")
        else:
            sim = max(sims, key=lambda s: s.peak_reserved)
            terms["reserved_by_ratio"] = reserved
            reserved = max(sim.peak_reserved, allocated)
            settled = ("the allocator's state repeating from there on" if sim.settled
                       else "the allocator's state still changing: a later step may reserve more")
            starts = ""
            if len(sims) > 1:
                low = min(s.peak_reserved for s in sims)
                starts = (f"; the larger of the loads onto an empty device and onto one that already holds a tensor "
                          f"(from_pretrained's warm-up block is then 2 MiB smaller): {low / GiB:.2f} and "
                          f"{sim.peak_reserved / GiB:.2f} GiB" if sim.peak_reserved - low >= 2**20 else
                          "; within 1 MiB the same from an empty device and from one that already holds a tensor")
            notes.append(f"reserved: the allocator model over the traced load and {sim.steps} optimizer steps "
                         f"({settled}; peak during the {sim.peak_phase}{starts}), not allocated x "
                         f"reserved_over_allocated ({ratio:.3f})")
    beyond_allocated = 0  # reserved held apart from the model's pool: DeepSpeed's streams, the fp32 gradient
    if case.deepspeed is not None and case.deepspeed.stage == 3 and not one_pool:
        from harness.predict.calibration import largest_gather_bytes

        gather_pool = _zero3_gather_pool(case, gathered, conf)
        model_stream = None
        if gather_pool is not None:
            # the gather stream's pool from the replayed gathers (harness.predict.zero3.gather_pool), beside
            # the model's own pool: allocated less what is gathered at its peak, times the ratio
            held_gathered = (stepped.gathered_at_allocated_peak if stepped is not None else
                             gathered.backward_start_bytes + (gathered_above if allocated == gather_peak else 0))
            model_stream = _zero3_model_stream(case, arch, layers, trace_spec, notes)
            if model_stream is not None:
                # the model's own stream built and replayed (harness.predict.zero3_stream, `full`, no gathers)
                terms["reserved_by_ratio"] = reserved
                model_pool = max(model_stream.peak_reserved, allocated - held_gathered)
                how = (f"the allocator model over its stream (zero.Init's load, DeepSpeed's buffers on it, four "
                       f"micro-steps and their optimizer steps: {model_pool / GiB:.2f} GiB, peak during the "
                       f"{model_stream.peak_phase})")
            else:
                model_pool = int((allocated - held_gathered) * ratio)
                how = (f"(allocated - {held_gathered / GiB:.2f} GiB gathered) x reserved_over_allocated "
                       f"({ratio:.3f})")
            reserved = model_pool + gather_pool
            terms["zero3_gather_stream_pool"] = gather_pool
            beyond_allocated += gather_pool - held_gathered
            notes.append(f"reserved: the model's pool as {how}, beside DeepSpeed's gather stream's pool, "
                         f"{gather_pool / GiB:.2f} GiB (the replayed all-gathers through the allocator model), in "
                         "place of zero3_cached_gathers")
        else:
            cached = int(values["zero3_cached_gathers"] * largest_gather_bytes(case))
            reserved += cached
            terms["zero3_cached_gather_blocks"] = cached
            beyond_allocated += cached
        # the optimizer step's fp32 gradient on top of the forward and backward's reserve
        forward_backward = max(backward_peak, retention_peak, gather_peak)
        segment = 0 if model_stream is not None else _zero3_fp32_grad_segment(case, r1, r2, layers, notes)
        if segment:
            extra = max(0, int(forward_backward * ratio) + segment - int(allocated * ratio))
            reserved += extra
            terms["zero3_fp32_grad_segment"] = extra
            beyond_allocated += extra
            if not extra:
                notes.append("the optimizer step's fp32 gradient segment is within allocated x "
                             "reserved_over_allocated: the optimizer step is the allocated peak")
        pool = _zero3_reduce_stream(case, r1, r2, layers, notes)
        if pool:
            reserved += pool
            terms["zero3_reduce_stream_pool"] = pool
            beyond_allocated += pool
    measured_only = {k: cal.values[k] for k in OPTIONAL if k in cal.values}  # no prior: where measured
    beside = device_overhead(case, arch, platform, {**values, **measured_only})
    notes += beside.notes
    overhead = beside.total
    terms.update(beside.terms)
    fla = arch.uses_triton_kernels
    if fla and case.launch.triton_cache == "cold":
        cold = cal.values.get("triton_cold_overhead")
        if cold is None:
            notes.append("fla/Triton on a cold cache: no cold run measured to fit what compiling adds; not included")
            missing.append("what compiling and autotuning flash-linear-attention's kernels holds on a cold Triton "
                           "cache (GiBs per process, outside the allocator; no baseline it is calibrated on ran on "
                           "a cold cache): bless a run of a case with `launch.triton_cache: cold`, or judge the job "
                           "on a warm cache (--triton-cache warm)")
        else:
            overhead += int(cold)
            terms["triton_cold_compile"] = int(cold)
    elif fla:
        notes.append("fla/Triton: predicted on a warm kernel cache; a cold one adds GiBs outside the allocator "
                     "during the first step (launch.triton_cache: cold predicts that)")
    device = reserved + overhead
    terms["allocator_fragmentation"] = reserved - allocated - beyond_allocated

    # --- host memory of the whole job on this node ---
    ranks = case.launch.ranks * case.launch.procs_per_card
    per_proc_host = HOST_PROCESS_BASE + case.train.dataloader_workers * HOST_PER_WORKER
    per_proc_host += sum(states.host.values())
    host = ranks * per_proc_host
    for k, v in states.host.items():
        terms["host_" + k] = int(v)
    terms["host_process_base"] = HOST_PROCESS_BASE
    if case.deepspeed is not None and case.deepspeed.offload_param == Offload.cpu:
        notes.append("parameter offload: each rank holds its fp16/bf16 partition in host memory")
    notes.append("host_ram: per-process base and per-worker figures are assumptions (not fitted)")

    margin = margin_for(case, exclude=frozenset(exclude))
    notes.append(margin.describe())
    notes += margin.notes

    return Prediction(
        margin=margin, allocated=int(allocated), reserved=reserved, device=device, host_ram=int(host), terms=terms,
        notes=notes, calibrated_on=cal.calibrated_on, fitted=[k for k in cal.values],
        platform=cal.platform, seconds=time.perf_counter() - t0,
        params_total=inv.total, largest_layer_params=max(inv.head, inv.largest_layer_module), missing=missing,
    )
