"""ZeRO-3's gathered parameters over a training step, as DeepSpeed's own coordinator decides them.

What ZeRO-3 holds gathered on the device is decided at run time by DeepSpeed's
`PartitionedParameterCoordinator` (`runtime/zero/partitioned_param_coordinator.py`): it records the
module order of the first step, then in every later one fetches each module's parameters, prefetches
the next ones up to `stage3_prefetch_bucket_size` while fewer than `stage3_max_live_parameters` are
gathered, and after a module releases only the parameters not used again within
`stage3_max_reuse_distance` elements of the recorded order; parameters of at most
`stage3_param_persistence_threshold` elements stay gathered. Under checkpointing it also ties the
frozen parameters fetched by a recomputed forward to the module whose backward is running, and
releases them with it. None of this is re-derived here: `gathered` runs that class itself, from the
installed DeepSpeed, over the hook events of the case's step (DeepSpeed's hooks recorded on the case's
model, `harness.predict.zero3.hooks`; derived from the module tree, `harness.predict.zero3.order`, for a
layout with no model behind it) with stand-in parameters that carry DeepSpeed's attributes (ds_id,
ds_numel, ds_status, ds_persist, ...) and whose all-gather only records what it would allocate on the device:

* one rank (nothing to gather): each parameter's partition copied to the device
  (`NoGatherHandle`, `param.ds_tensor.to(device)`), freed at its release; nothing where the
  partition is on the device already (no parameter offload: it is counted as the partition);
* a gather of one parameter (`_all_gather_sequential`): a buffer of the parameter rounded up to a
  multiple of the ranks, plus, where the partition lives on the host (parameter offload), its copy
  on the device until the gather is waited on;
* a gather of several (`_all_gather_coalesced`, one `_all_gather_dtype` per communication dtype, and
  the parameters share one): one flat buffer of their partitions times the ranks, freed once the
  coordinator has taken every parameter of it, each then copied out of it (`torch.cat` in
  `AllGatherCoalescedHandle.wait`); with parameter offload, each host partition's copy on the device,
  freed once `torch.cat(..., out=)` has filled the buffer's own rank's slice;
* a parameter a checkpoint's recomputed forward releases: its gathered tensor stays until the module's
  backward is done (the recomputed ops saved it), while the module's pre-backward gathers it again.

Every one of these allocations is made on the coordinator's all-gather stream (`__allgather_stream`:
`all_gather_coalesced` and the handle's `wait` both run under it), so the caching allocator keeps
their blocks in a pool of that stream's own, apart from the model's. `gather_pool` replays the
allocations and frees of every replayed step, in order, through the allocator model
(`harness.predict.allocator.allocator`) on one stream: the reserve that pool reaches (`Gathered.pool_bytes`).

Two rounds of (forward, backward) run: DeepSpeed records the module order in the first and uses it
from the second, which is the steady state every later micro-step repeats (where the gather stream's
pool is wanted, `pool_rounds` steps in all); it starts, as every step after an optimizer step does,
with the persistent parameters gathered (the optimizer step gathers them again at its end,
`_allgather_params_coalesced`; where the pool's steps are replayed, the step whose figures are taken is
the third, the second still gathering them with the others). The result is the largest number of bytes
so gathered at once, over every allocation (a gather's buffer and its host partition's copy are live
together before the wait frees the copy), where it happens, the same during each decoder layer's
backward, the embedding's and elsewhere (the predictor weighs each with the activations held there),
and the bytes gathered when the backward starts (where the loss and logits live). Persistent parameters
are left out: they are resident, counted with the model states (`harness.predict.states`).

The replay needs DeepSpeed installed (it is imported only here, and only when the result is not in
the on-disk cache beside the traces, keyed by the model's module layout, the settings, this code and
DeepSpeed's version). It is single-process: the coordinator's cross-rank consistency checks and
rank-0 logging are switched off while it runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata as md
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from harness.predict.allocator.allocator import AllocatorConf, CachingAllocator
from harness.predict.constants import DS_DEFAULTS, POOL_ROUNDS, ROUNDS, GiB
from harness.predict.dispatch import replays_gather_pool
from harness.predict.step import TraceSpec, reentrant_checkpointing, zero_init
from harness.predict.trace.trace import _cache_dir
from harness.predict.trace.trace import _code_key as model_code_key
from harness.predict.zero3.hooks import HookLog, expand, hook_spec, record
from harness.predict.zero3.order import (
    BACKWARD_START,
    BWD_POST,
    BWD_PRE,
    EVENT_NAMES,
    FWD_POST,
    FWD_PRE,
    RECOMPUTE,
    ModelLayout,
    Module,
    ModuleSpec,
    ParamSpec,
    build_step,
    step_events,
)
from harness.spec.dsconfig import auto_sizes
from harness.spec.files import write_atomic
from harness.spec.schema import Offload

# a coalesced gather's host partition copies: freed within the gather, so in no hook event's figure
COALESCED_STAGING = "host partition copied to the device for a coalesced gather"
# a coalesced gather's flat buffer: its collective is launched once the copies have filled it
COALESCED_BUFFER = "coalesced all-gather buffer"
# a one-parameter gather's input, its host partition copied to the device: NCCL holds it until the gather
# is waited on or its watchdog, polling every 100 ms, has seen the gather done; the replay frees it at the wait
# (harness.predict.zero3.gather_release times when NCCL lets it go)
GATHER_INPUT = "host partition copied to the device as a gather's input"


@dataclass(frozen=True)
class Zero3Spec:
    """Everything the gathered set depends on (hashable; the cache key with the code and DeepSpeed's version)."""

    layout_json: str  # ModelLayout.to_dict(), sorted JSON
    layers: int
    ranks: int
    half_bytes: int
    prefetch_bucket: int
    max_live: int
    max_reuse: int
    persistence_threshold: int
    model_persistence_threshold: int
    offload_param: bool
    checkpointing: str  # none | reentrant | nonreentrant
    input_requires_grad: bool
    alloc_conf: str = ""  # the case's PYTORCH_CUDA_ALLOC_CONF: the gather stream's pool is replayed under it
    pool_rounds: int = 0  # steps whose gathers the pool is replayed over (0: no pool, `Gathered.pool_bytes` 0)
    # bytes per element of the trainable parameters (0: half_bytes): peft's LoRA adapters stay fp32 in a
    # model built under zero.Init (harness.predict.step.zero_init), and DeepSpeed gathers each dtype apart
    trainable_bytes: int = 0
    # the case's TraceSpec at the hooks' shape (zero3_hooks.hook_spec; dataclasses.asdict, sorted JSON):
    # DeepSpeed's hooks are recorded on that model (harness.predict.zero3.hooks); "" for a layout with no
    # model behind it, whose hook order is derived from the module tree (harness.predict.zero3.order.step_events,
    # `checkpointing`, `input_requires_grad`)
    trace_spec_json: str = ""


@dataclass(frozen=True)
class StreamEvent:
    """One device allocation or free of ZeRO-3's gathers, in order (`replay(..., stream=[])`)."""

    kind: str  # alloc | free
    id: int
    nbytes: int
    what: str  # for an allocation: which buffer of DeepSpeed's gather paths


@dataclass(frozen=True)
class HookEvent:
    """One hook event of a replayed step (`replay(..., every_step=[])`)."""

    event: str  # EVENT_NAMES: fwd_pre, fwd_post, bwd_pre, bwd_post
    module: str
    layer: int | None  # the decoder layer of the module; None outside the layers
    backward: bool  # in the backward pass (a recomputed forward's events included)


@dataclass
class Gathered:
    peak_bytes: int  # most bytes of non-persistent parameters gathered at once (buffers + device staging)
    peak_where: str  # the hook event and module at that moment
    backward_start_bytes: int  # gathered when backward starts
    backward_peak_bytes: int  # most gathered at once during backward
    peak_elements: int  # DeepSpeed's own count of available elements at the peak (its n_available_params)
    events: int  # hook events replayed per step
    # the decoder layer (0 the first) whose backward (or recomputation in backward) the peak falls in;
    # -1 where it falls in the forward or outside the layers
    peak_backward_layer: int = -1
    # the most gathered at once during each decoder layer's backward (its recomputation included), by layer,
    # and during the backward of the modules before the layers (the embedding's: every layer's is done)
    layer_backward_peaks: list[int] = dataclasses.field(default_factory=list)
    below_backward_peak: int = 0
    outside_peak: int = 0  # the most gathered at once in the forward and in the backward before the layers'
    pool_bytes: int = 0  # what the gather stream's pool reserves over the replayed steps (`gather_pool`)

    def describe(self, gib: int = GiB) -> str:
        return (f"ZeRO-3 gathered parameters (DeepSpeed's coordinator replayed over the step): peak "
                f"{self.peak_bytes / gib:.2f} GiB at {self.peak_where}; {self.backward_start_bytes / gib:.2f} GiB "
                "when backward starts")


# --- stand-ins for DeepSpeed's parameters ------------------------------------------------------------

class _Ledger:
    """Device bytes of gathered parameters, as DeepSpeed's all-gather paths would allocate them; with
    `stream` set, each allocation and free in order (what a caching-allocator model replays)."""

    def __init__(self, half: int, ranks: int, offload: bool):
        self.half, self.ranks, self.offload = half, ranks, offload
        self.live = 0
        self.high = 0  # the most live since the last hook event's figure was taken (`take_high`)
        self.sizes: dict[int, int] = {}
        self.stream: list | None = None
        # while a recomputed forward releases a module's parameters: the ids of the gathered tensors its ops
        # saved for backward, which the checkpoint keeps (`keep`); None elsewhere
        self.keep: list[int] | None = None

    def part(self, numel: int) -> int:
        return -(-numel // self.ranks)

    def alloc(self, nbytes: int, what: str) -> int:
        """A device allocation of `nbytes`; returns its id (0: nothing allocated)."""
        if nbytes <= 0:
            return 0
        token = len(self.sizes) + 1
        self.sizes[token] = nbytes
        self.live += nbytes
        self.high = max(self.high, self.live)
        if self.stream is not None:
            self.stream.append(StreamEvent("alloc", token, nbytes, what))
        return token

    def take_high(self) -> int:
        """The most bytes live at once since the last call: within a hook event's fetch or release, a
        gather's buffer and host partition copy are live together before the wait frees the copy."""
        high, self.high = max(self.high, self.live), self.live
        return high

    def free(self, token: int) -> None:
        if token:
            nbytes = self.sizes[token]
            self.live -= nbytes
            if self.stream is not None:
                self.stream.append(StreamEvent("free", token, nbytes, ""))


class _Tee(list):
    """Appends to several lists at once (every step's events, the caller's of one step)."""

    def __init__(self, *targets: list):
        super().__init__()
        self.targets = targets

    def append(self, item) -> None:
        for target in self.targets:
            target.append(item)


class _Partition:
    def __init__(self, numel: int):
        self.ds_numel = numel
        self.final_location = None  # not on NVMe


class _Handle:
    """A gather in flight. `wait` makes every parameter of it available; the device bytes move as in
    DeepSpeed: the host partition's staging copy of a one-parameter gather is freed, a coalesced
    gather's flat buffer is split into one tensor per parameter (`torch.cat` in
    `AllGatherCoalescedHandle.wait`) and freed once the coordinator has popped the handle for every
    parameter of it (each registry entry holds the handle, the handle holds the buffer)."""

    def __init__(self, params, ledger: _Ledger, status, flats: list[int] | None = None, staging: int = 0):
        self.params, self.ledger, self.status = params, ledger, status
        self.flats = flats or []  # the ledger's ids of the flat buffers (one per dtype)
        self.staging = ledger.alloc(staging, GATHER_INPUT)
        self.pending = len(params)
        self.done = False

    def wait(self, **_kwargs) -> None:
        self.pending -= 1
        if not self.done:
            self.done = True
            self.ledger.free(self.staging)
            for p in self.params:
                if self.flats:
                    p.own = self.ledger.alloc(p.ds_numel * p.nbytes, "parameter copied out of the buffer")
                p.ds_status = self.status.AVAILABLE
        if self.pending == 0:
            for flat in self.flats:
                self.ledger.free(flat)
            self.flats = []


def _param_class(status, ledger: _Ledger):
    class StandIn:
        """A parameter as DeepSpeed's coordinator sees it; its gathers only book bytes in the ledger."""

        def __init__(self, ds_id: int, numel: int, trainable: bool, persist: bool, nbytes: int):
            self.ds_id, self.ds_numel, self.requires_grad, self.ds_persist = ds_id, numel, trainable, persist
            self.nbytes = nbytes  # bytes per element: the parameter's dtype, which is its communication dtype
            self.ds_shape = (numel,)
            self.ds_status = status.NOT_AVAILABLE
            self.ds_active_sub_modules: set[int] = set()
            self.ds_tensor = _Partition(ledger.part(numel))
            self.ds_secondary_tensor = None
            self.is_external_param = False
            self.nvme_swapper = None
            self.own = 0  # the ledger's id of this parameter's gathered tensor (0: none)

        def partition_numel(self) -> int:
            return self.ds_tensor.ds_numel

        def ds_summary(self, use_debug_name: bool = False) -> str:
            return f"param {self.ds_id} ({self.ds_numel} elements, {self.ds_status})"

        def all_gather_coalesced(self, params, quantize: bool = False, **_kwargs) -> _Handle:
            params = sorted(params, key=lambda p: p.ds_id)  # as DeepSpeed's all_gather_coalesced sorts them
            for p in params:
                p.ds_status = status.INFLIGHT
            if all(p.ds_persist for p in params):  # kept on the device whole: counted with the model states
                return _Handle(params, ledger, status)
            if ledger.ranks == 1:  # NoGatherCoalescedHandle: `param.ds_tensor.to(device)`, a copy of a
                for p in params:  # host partition; a partition already on the device is used as it is
                    if ledger.offload and not p.ds_persist:
                        p.own = ledger.alloc(p.ds_numel * p.nbytes, "host partition copied to the device")
                return _Handle(params, ledger, status)
            if len(params) == 1:  # _all_gather_sequential: the parameter is a view of its own buffer
                p = params[0]
                p.own = ledger.alloc(ledger.part(p.ds_numel) * ledger.ranks * p.nbytes, "all-gather buffer")
                # param_ds_tensor.to(device): a host partition's copy lives until the gather is waited on
                staging = ledger.part(p.ds_numel) * p.nbytes if ledger.offload else 0
                return _Handle(params, ledger, status, staging=staging)
            # _all_gather_coalesced: one `_all_gather_dtype` per communication dtype, in `sort_dtypes` order
            # (by name: bfloat16 and float16 before float32), each its own flat buffer
            groups = [[p for p in params if p.nbytes == b] for b in sorted({p.nbytes for p in params})]
            flats = []
            for group in groups:
                flats.append(ledger.alloc(sum(ledger.part(p.ds_numel) for p in group) * ledger.ranks
                                          * group[0].nbytes, COALESCED_BUFFER))
                if ledger.offload:  # `torch.cat([p.ds_tensor.to(device), ...], out=...)`: each host partition's
                    copies = [ledger.alloc(ledger.part(p.ds_numel) * p.nbytes, COALESCED_STAGING)
                              for p in group]  # copy, freed once the cat has filled the buffer (the list's
                    for token in reversed(copies):  # items released last first)
                        ledger.free(token)
            return _Handle([p for group in groups for p in group], ledger, status, flats=flats)

        def partition(self, free_data: bool = True, **_kwargs) -> None:
            if ledger.keep is not None and self.own:  # saved by the recomputed forward: freed after its backward
                ledger.keep.append(self.own)
            else:
                ledger.free(self.own)
            self.own = 0
            self.ds_status = status.NOT_AVAILABLE

        def __hash__(self) -> int:
            return self.ds_id

        def __eq__(self, other) -> bool:
            return self is other

    return StandIn


class _StandInModule:
    """A module as DeepSpeed's hooks and coordinator see it: ds_id, its own parameters, nothing external."""

    def __init__(self, ds_id: int, name: str, params: list):
        self.ds_id, self.name, self._params = ds_id, name, params
        self._named = [(str(p.ds_id), p) for p in params]  # asked for at every scan of the trace
        self.ds_recompute_parameters: set = set()
        self.training = True

    def named_parameters(self, recurse: bool = False):
        return self._named

    def ds_external_parameters(self):
        return []


# --- the replay -----------------------------------------------------------------------------------

@contextlib.contextmanager
def _single_process(module):
    """The coordinator asserts that every rank recorded the same order (a collective) and logs on rank 0;
    one process stands for every rank here, so both are switched off while it runs.

    A GPU host's DeepSpeed picks the CUDA accelerator, whose streams and events the stand-in parameters
    have none of; the coordinator sees DeepSpeed's CPU accelerator instead, on every host, which
    resolves data dependencies itself (no stream waits) and keeps no fetch events.

    DeepSpeed's NVTX ranges around the coordinator's methods (`deepspeed.utils.nvtx.enable_nvtx`), a
    profiler's markers, are switched off too: the replay does no GPU work to mark, and pushing and popping
    them is a tenth of its time."""
    # heavy: DeepSpeed (and torch), imported only to replay its coordinator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    # heavy: DeepSpeed (and torch), imported only to replay its coordinator
    from deepspeed.utils import nvtx

    cpu = CPU_Accelerator()
    saved = {name: getattr(module, name) for name in ("assert_ints_same_as_other_ranks", "print_rank_0",
                                                      "get_accelerator")}
    ranges = nvtx.enable_nvtx
    module.assert_ints_same_as_other_ranks = lambda ints: None
    module.print_rank_0 = lambda *args, **kwargs: None
    module.get_accelerator = lambda: cpu
    nvtx.enable_nvtx = False
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
        nvtx.enable_nvtx = ranges


def _in_graph_task(fn) -> None:
    """Run `fn` inside autograd's backward, where DeepSpeed tells a checkpoint's recomputation from a
    forward (`torch._C._current_graph_task_id() != -1`)."""
    # heavy: torch, only to replay DeepSpeed's coordinator
    import torch

    class Backward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            fn()
            return grad

    x = torch.zeros(1, requires_grad=True)
    Backward.apply(x).sum().backward()


def _deepspeed():
    """DeepSpeed's coordinator module and parameter states. DeepSpeed's logger writes to the stdout it
    finds at import (its accelerator warning among the first lines); imported here it writes to stderr,
    so that `check --json` keeps stdout to its JSON."""
    with contextlib.redirect_stdout(sys.stderr):
        # heavy: DeepSpeed (and torch), imported only to replay its coordinator
        from deepspeed.runtime.zero import partitioned_param_coordinator as ppc
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    return ppc, ZeroParamStatus


def replay(spec: Zero3Spec, record: list | None = None, stream: list | None = None,
           every_step: list | None = None) -> Gathered:
    """`record`: a list to append (hook event, module name, gathered bytes after it) to, for every event
    of the steady-state step. `stream`: a list to append the steady-state step's allocations and frees
    to, in order (`StreamEvent`); the same list as `record` interleaves them with the hook events.
    `every_step`: a list to append one list per replayed step to, holding that step's hook events
    (`HookEvent`) and allocations and frees, interleaved."""
    ppc, ZeroParamStatus = _deepspeed()
    layout = ModelLayout.from_dict(json.loads(spec.layout_json))
    step = build_step(layout, spec.layers)
    ledger = _Ledger(spec.half_bytes, spec.ranks, spec.offload_param)
    StandIn = _param_class(ZeroParamStatus, ledger)
    params = {}
    persistent = 0
    for ds_id, (key, p) in enumerate(sorted(step.params.items())):  # DeepSpeed's mark_persistent_parameters
        persist = p.numel <= spec.persistence_threshold and persistent + p.numel <= spec.model_persistence_threshold
        persistent += p.numel if persist else 0
        params[key] = StandIn(ds_id, p.numel, p.trainable, persist,
                              spec.trainable_bytes if p.trainable and spec.trainable_bytes else spec.half_bytes)
    modules: dict[int, _StandInModule] = {}

    def stand_in(m: Module) -> _StandInModule:
        if id(m) not in modules:
            modules[id(m)] = _StandInModule(len(modules), m.name, [params[p.key] for p in m.params])
        return modules[id(m)]

    events = _hook_events(spec, step)
    for _, m in events:
        stand_in(m)
    coordinator = ppc.PartitionedParameterCoordinator(
        prefetch_bucket_sz=spec.prefetch_bucket, max_reuse_distance_in_numel=spec.max_reuse,
        max_available_parameters_in_numel=spec.max_live, allgather_stream=None,
        inflight_param_registry=ppc.InflightParamRegistry())
    backward_stack = "_PartitionedParameterCoordinator__active_backward_submodules"
    # the step whose figures are taken: the first to start with the persistent parameters gathered
    steady = ROUNDS if spec.pool_rounds else ROUNDS - 1
    # the embedding: its backward comes after every layer's
    peaks = _Peaks(spec.layers, {m.name for m in step.before}, steady, ledger, coordinator, record, every_step)

    # A parameter a checkpoint's recomputed forward releases (DeepSpeed partitions it at the module's forward
    # hook) keeps its gathered tensor: the recomputed ops saved it for their backward, and the checkpoint holds
    # what a recompute saved until the backward unpacks it. Its bytes go after the module's backward (at its
    # post-backward hook, or with the graph where none fires); its pre-backward gathers it again meanwhile.
    # Phi-3-mini's full fine-tune: each recomputed layer's weights gathered twice over, as recorded.
    saved: dict[int, list[int]] = {}

    def run(seq, round_: int, backward: bool = False) -> None:
        for event, module in seq:
            m = stand_in(module)
            if event in (FWD_PRE, BWD_PRE):
                coordinator.trace_prologue(m)
                if coordinator.is_record_trace():
                    coordinator.record_module(m)
                coordinator.fetch_sub_module(m, forward=event == FWD_PRE)
            elif event == FWD_POST and not m._params:
                pass  # nothing to release (release_sub_module would only scan the trace for its no parameters)
            elif event == FWD_POST and backward:  # a checkpoint's recompute: see `saved`
                ledger.keep = saved.setdefault(id(m), [])
                coordinator.release_sub_module(m, forward=True)
                ledger.keep = None
            elif event == FWD_POST:
                coordinator.release_sub_module(m, forward=True)
            elif event == BWD_POST and not m._params and not m.ds_recompute_parameters:
                # all release_sub_module does for a module with nothing to release: off the backward stack
                getattr(coordinator, backward_stack).pop(m.ds_id, None)
            elif event == BWD_POST:
                for token in saved.pop(id(m), []):  # the backward's saved tensors go before the hook releases
                    ledger.free(token)
                coordinator.release_sub_module(m, forward=False)
            peaks.note(round_, event, m, backward, module.layer)

    split = next(i for i, (e, _) in enumerate(events) if e == BACKWARD_START)
    forward, backward = events[:split], [e for e in events[split + 1:] if e[0] != RECOMPUTE]
    every: list[StreamEvent] = []  # every step's allocations and frees, for the gather stream's pool
    with _single_process(ppc):
        for round_ in range(max(ROUNDS, spec.pool_rounds)):
            if round_ >= steady:
                # every optimizer step ends with DeepSpeed gathering the persistent parameters again
                # (`_allgather_params_coalesced`), so each steady-state step starts with all of them gathered;
                # the recorded gather streams show the first step that prefetches still gathering them with
                # the others, which is where the pool (replayed over more steps) grows
                for p in params.values():
                    if p.ds_persist:
                        p.ds_status = ZeroParamStatus.AVAILABLE
            targets = [every]  # every step's allocations (the pool), the caller's of the steady state, this step's
            if round_ == steady and stream is not None:
                targets.append(stream)
            if every_step is not None:
                every_step.append([])
                targets.append(every_step[-1])
            ledger.stream = every if len(targets) == 1 else _Tee(*targets)
            coordinator.reset_step()  # DeepSpeed's pre-forward hook on the root module
            run(forward, round_)
            if round_ == steady:
                peaks.start_bytes = ledger.live
            _in_graph_task(lambda r=round_: run(backward, r, backward=True))
            coordinator.release_backward_leftovers()  # the engine's backward epilogue
            for tokens in saved.values():  # of modules whose post-backward never fired: freed with the graph
                for token in tokens:
                    ledger.free(token)
            saved.clear()
    best = peaks.best
    return Gathered(peak_bytes=max(best["bytes"], 0), peak_where=best["where"], backward_start_bytes=peaks.start_bytes,
                    backward_peak_bytes=peaks.backward_best, peak_backward_layer=best["layer"],
                    layer_backward_peaks=peaks.layer_peaks, below_backward_peak=peaks.below_peak,
                    outside_peak=peaks.outside, peak_elements=int(best["elements"]), events=len(events),
                    pool_bytes=gather_pool(every, spec.alloc_conf) if spec.pool_rounds else 0)


# the coordinator's count of gathered elements (a name-mangled attribute of PartitionedParameterCoordinator)
_AVAILABLE = "_PartitionedParameterCoordinator__n_available_params"


class _Peaks:
    """What the replay's steady-state step gathers at most, noted after each hook event: the most at once and
    where, per layer's backward, in the embedding's backward (below the layers) and outside both."""

    def __init__(self, layers: int, below_layers: set[str], steady: int, ledger, coordinator, record, every_step):
        self.best = {"bytes": -1, "where": "", "elements": 0, "round": 0, "layer": -1}
        self.layer_peaks = [0] * layers
        self.below_peak = self.outside = self.start_bytes = self.backward_best = 0
        self.below_layers, self.steady = below_layers, steady
        self.ledger, self.coordinator, self.record, self.every_step = ledger, coordinator, record, every_step

    def note(self, round_: int, event: int, m, backward: bool, layer: int | None) -> None:
        if self.every_step is not None:
            self.every_step[-1].append(HookEvent(EVENT_NAMES[event], m.name, layer, backward))
        most = self.ledger.take_high()  # over the event's own allocations, not only after them
        if round_ != self.steady:
            return
        if self.record is not None:
            self.record.append((EVENT_NAMES[event], m.name, self.ledger.live))
        if backward:
            self.backward_best = max(self.backward_best, most)
            if layer is not None:
                self.layer_peaks[layer] = max(self.layer_peaks[layer], most)
            elif m.name in self.below_layers:
                self.below_peak = max(self.below_peak, most)
            else:
                self.outside = max(self.outside, most)
        else:
            self.outside = max(self.outside, most)
        if most > self.best["bytes"]:
            self.best.update(bytes=most, where=f"{EVENT_NAMES[event]} of {m.name}",
                             elements=getattr(self.coordinator, _AVAILABLE, 0),
                             layer=layer if backward and layer is not None else -1)


def _hook_events(spec: Zero3Spec, step) -> list:
    """The step's hook events: as DeepSpeed's hooks fire them on the case's model (harness.predict.zero3.hooks),
    derived from the module tree for a layout with no model behind it."""
    if not spec.trace_spec_json:
        return step_events(step, spec.checkpointing, spec.input_requires_grad)

    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(spec.trace_spec_json).items()}
    return expand(_hook_log(TraceSpec(**fields)), step)  # already at the hooks' shape (spec_for)


@functools.lru_cache(maxsize=32)
def _hook_log(trace_spec):
    """DeepSpeed's hooks recorded on the case's model (harness.predict.zero3.hooks), kept on disk beside the
    traces, keyed by the trace spec, the model code and its libraries."""

    payload = model_code_key() + json.dumps(dataclasses.asdict(trace_spec), sort_keys=True)
    return _cached("hooks", payload, lambda: record(trace_spec), HookLog.to_dict, HookLog.from_dict)


def gather_pool(events: list[StreamEvent], alloc_conf: str = "") -> int:
    """The most the all-gather stream's pool reserves over `events` (every replayed step's allocations and
    frees, in order), replayed through the caching allocator's model under `alloc_conf`. The first step
    gathers as the module order is recorded, the next ones prefetch along it: blocks freed in one order
    and asked for in another are what the pool keeps beyond the bytes gathered at once."""

    conf = AllocatorConf.parse(alloc_conf, "PYTORCH_CUDA_ALLOC_CONF")
    if conf.backend != "native":  # CUDA's own pool allocator: not modelled
        return 0
    sim = CachingAllocator(conf)
    live: dict[int, object] = {}
    peak = 0
    for e in events:
        if e.kind == "alloc":
            live[e.id] = sim.malloc(e.nbytes)
            peak = max(peak, sim.stats.reserved)
        else:
            sim.free(live.pop(e.id))
    return peak


# --- the module layout of a traced model -----------------------------------------------------------

def _discovered_external(module) -> list:
    """Parameters DeepSpeed adds to `module` by its automatic external-parameter discovery.

    During the engine's forward DeepSpeed 0.19's `ZeROOrderedDict.__getitem__` registers a parameter that
    is read while not gathered on the module then running (`FWD_MODULE_STACK[-1]`) and gathers it. peft's
    LoRA layer (`lora.Linear.forward`; its bitsandbytes, GPTQ and AWQ layers alike) reads `lora_A.weight.dtype`
    (`_cast_input_dtype`) inside its own forward, before `lora_A` runs: in the first step, when nothing is
    gathered yet, every active adapter's `lora_A` weight becomes a parameter of the LoRA layer itself. From
    then on the coordinator fetches it at the LoRA layer's hooks (before its `base_layer`), which is where
    it stands in the recorded parameter order and so which gathers the prefetcher coalesces."""
    lora_a = getattr(module, "lora_A", None)
    if lora_a is None or not hasattr(module, "base_layer") or not hasattr(lora_a, "items"):
        return []
    active = getattr(module, "active_adapters", None) or list(lora_a.keys())
    return [lora_a[a].weight for a in active if a in lora_a and hasattr(lora_a[a], "weight")]


def layout_of(model) -> ModelLayout:
    """The parameter-holding modules of a (meta) model with one decoder layer, in definition order."""
    keys: dict[int, int] = {}
    before, layer, after = [], [], []
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False)) + _discovered_external(module)
        if not own:
            continue
        specs = []
        for p in own:
            key = keys.setdefault(id(p), len(keys))
            specs.append((key, p.numel(), bool(p.requires_grad)))

        spec = ModuleSpec(name, tuple(ParamSpec(k, n, t) for k, n, t in specs))
        if ".layers.0." in name:
            layer.append(spec)
        elif layer:
            after.append(spec)
        else:
            before.append(spec)
    if not layer:
        raise ValueError("no module named '.layers.0.' in the model: the decoder layers were not found")
    return ModelLayout(tuple(before), tuple(layer), tuple(after))


# --- cache ------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _code_key() -> str:

    here = Path(__file__).resolve().parent  # harness/predict/zero3
    h = hashlib.sha256()
    for name in ("coordinator.py", "order.py", "hooks.py", "hook_calls.py", "../constants.py"):
        h.update((here / name).read_bytes())
    try:
        h.update(f"deepspeed={md.version('deepspeed')}".encode())
    except md.PackageNotFoundError:
        h.update(b"deepspeed=none")
    return h.hexdigest()


def _cache_path(kind: str, payload: str) -> Path | None:

    folder = _cache_dir()
    if folder is None:
        return None
    return folder / f"zero3-{kind}-{hashlib.sha256((_code_key() + payload).encode()).hexdigest()[:32]}.json"


def _cached(kind: str, payload: str, compute, encode, decode):
    path = _cache_path(kind, payload)
    if path is not None:
        try:
            return decode(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError, KeyError):
            pass
    value = compute()
    if path is not None:
        try:
            write_atomic(path, json.dumps(encode(value)))
        except OSError:
            pass
    return value


@functools.lru_cache(maxsize=32)
def layout(trace_spec) -> ModelLayout:
    """The module layout of the case's model as its stack builds it (harness.predict.trace.fake's builder)."""
    def compute():
        # heavy: torch and transformers, imported only where a step is traced
        from harness.predict.trace.fake import build_as_traced

        model, _ = build_as_traced(trace_spec, 1)
        return layout_of(model)

    from harness.predict.trace.trace import _code_key as model_code_key  # the builder's code and library versions

    payload = model_code_key() + json.dumps(dataclasses.asdict(trace_spec), sort_keys=True)
    return _cached("layout", payload, compute, ModelLayout.to_dict, ModelLayout.from_dict)


@functools.lru_cache(maxsize=64)
def gathered(spec: Zero3Spec) -> Gathered:
    payload = json.dumps(dataclasses.asdict(spec), sort_keys=True)
    if spec.trace_spec_json:  # the hooks are recorded with the installed model code and libraries

        payload = model_code_key() + payload

    def compute() -> Gathered:  # its steps kept: a step stream over the same spec is built from them
        steps: list[list] = []
        result = replay(spec, every_step=steps)
        _keep_steps(spec, steps)
        return result

    return _cached("gathered", payload, compute, dataclasses.asdict, lambda d: Gathered(**d))


_STEPS: dict = {}  # Zero3Spec -> the hook events and gathers of each step its replay ran, for the last few


def replayed_steps(spec: Zero3Spec) -> list[list]:
    """The hook events and gathers of each step the coordinator replays under `spec` (`replay(spec,
    every_step=)`), kept in-process for the specs replayed last (by `gathered` too)."""
    if spec not in _STEPS:
        steps: list[list] = []
        replay(spec, every_step=steps)
        _keep_steps(spec, steps)
    return _STEPS[spec]


def _keep_steps(spec: Zero3Spec, steps: list[list]) -> None:
    while len(_STEPS) >= 4:
        del _STEPS[next(iter(_STEPS))]
    _STEPS[spec] = steps


def spec_for(case, arch, layers: int) -> Zero3Spec:
    """The replay's settings for a ZeRO-3 case at `layers` decoder layers: DeepSpeed's values as the
    harness writes its config (harness.spec.dsconfig: the case's, else transformers' 'auto' sizes,
    else DeepSpeed's defaults)."""

    ds = case.deepspeed
    hidden = int(arch.config["hidden_size"])
    auto = auto_sizes(hidden)

    def value(name: str, default: int) -> int:
        v = getattr(ds, name, None)
        if v is None:
            v = auto.get(name, default)
        return int(v)

    trace_spec = TraceSpec.of(case, arch)
    gc = case.train.gradient_checkpointing
    reentrant = gc and reentrant_checkpointing(case)
    return Zero3Spec(
        layout_json=json.dumps(layout(trace_spec).to_dict(), sort_keys=True),
        layers=layers, ranks=case.launch.ranks, half_bytes=4 if case.precision.value == "fp32" else 2,
        prefetch_bucket=value("stage3_prefetch_bucket_size", DS_DEFAULTS["prefetch"]),
        max_live=value("stage3_max_live_parameters", DS_DEFAULTS["max_live"]),
        max_reuse=value("stage3_max_reuse_distance", DS_DEFAULTS["max_reuse"]),
        persistence_threshold=value("stage3_param_persistence_threshold", DS_DEFAULTS["persistence"]),
        model_persistence_threshold=DS_DEFAULTS["model_persistence"],
        offload_param=ds.offload_param == Offload.cpu,
        checkpointing=("reentrant" if reentrant else "nonreentrant") if gc else "none",
        # the embedding's output needs a gradient where checkpointing is on: harness.runtime.build enables
        # input gradients for reentrant checkpointing, and peft's get_peft_model does for any checkpointed
        # model (PeftModel._prepare_model_for_gradient_checkpointing); DeepSpeed's hooks then fetch the
        # embedding again in backward
        input_requires_grad=gc or case.method.kind == "full",
        alloc_conf=case.launch.env.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        pool_rounds=POOL_ROUNDS if replays_gather_pool(case) else 0,
        # peft's adapters are fp32 (autocast_adapter_dtype); the engine leaves a zero.Init model's dtypes alone
        trainable_bytes=4 if case.method.kind in ("lora", "qlora") and zero_init(case) else 0,
        # the spec the hooks are recorded under: configs that differ only in batch or length share the replay
        trace_spec_json=json.dumps(dataclasses.asdict(hook_spec(trace_spec)), sort_keys=True),
    )
