"""Which method sizes each part of the peak, by the kind of config: the predictor's one dispatch table.

    route = route_for(case)   # the table's first row that matches the case, and the allocator's word on it
    route.row.name, route.allocated, route.reserved, route.device

A config's kind is read off the case (`Kind`): the method, the ZeRO stage, where DeepSpeed keeps the
parameters and the optimizer, `overlap_comm`, whether the model is built under zero.Init, contiguous
gradients, and the allocator (`PYTORCH_CUDA_ALLOC_CONF`). Checkpointing and the stack are not columns: they
change what the trace holds (the trace runs them), not which method sizes a part. The first row of `TABLE`
whose columns all match names the method of each part:

* allocated: `terms` (the closed-form states beside the trace's peaks, harness.predict.states),
  `zero3_step_stream` (the step built as one stream with DeepSpeed's gathers among the model's allocations,
  harness.predict.zero3.stream) or `zero2_stream` (the terms, or the ZeRO-2 stream's allocated peak where it
  is higher, harness.predict.zero2.stream);
* reserved: one of `RESERVED` below; a method that follows the allocator model needs the allocator it
  models (`RESERVED[...].allocators`), and on another one the row's `fallback` sizes it;
* device: the device's own parts beside the allocator (harness.predict.device), the same for every row.

A method can still stand down at run time (DeepSpeed cannot be imported, a stream cannot be built from the
trace): the prediction then says so in its notes, and `check --explain` prints the method that was used.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.models.inputs import InputError
from harness.predict.allocator.allocator import AllocatorConf, AllocConfError
from harness.predict.step import zero_init
from harness.spec.schema import Case, Offload

ANY = "*"


@dataclass(frozen=True)
class Method:
    """A way to size a part of the peak: what it does, in words, and where it lives."""

    name: str
    what: str
    module: str
    allocators: tuple[str, ...] = ("native", "expandable", "async")  # the allocators it follows


ALLOCATED = {m.name: m for m in (
    Method("terms", "the model states beside the trace's step peak, the optimizer step's and ZeRO-3's gathers",
           "harness.predict.states"),
    Method("zero3_step_stream", "the allocator model's allocated peak over the step built as one stream with "
           "DeepSpeed's gathers among the model's allocations", "harness.predict.zero3.stream"),
    Method("zero2_stream", "the larger of the terms' peak and the allocator model's allocated peak over the ZeRO-2 "
           "stream (DeepSpeed's flat copy of the parameters, the gradient partition)", "harness.predict.zero2.stream"),
)}
RESERVED = {m.name: m for m in (
    Method("stream", "the allocator model over the traced load and optimizer steps", "harness.predict.allocator.stream",
           ("native", "expandable")),
    Method("ratio", "allocated x reserved_over_allocated (fitted)", "harness.predict.calibration"),
    Method("zero2_stream", "the allocator model over the load, DeepSpeed's flat buffer and two optimizer steps",
           "harness.predict.zero2.stream", ("native", "expandable")),
    Method("zero3_one_pool", "the allocator model over zero.Init's load, the engine's buffers and four "
           "micro-steps with the gathers in the model's pool", "harness.predict.zero3.stream", ("native",)),
    Method("zero3_model_stream", "the allocator model over the model's own stream, beside the replayed gather "
           "stream's pool and the reduce stream's", "harness.predict.zero3.stream", ("native",)),
    Method("zero3_gather_pool", "(allocated - gathered) x reserved_over_allocated, beside the replayed gather "
           "stream's pool, the fp32 gradient segment and the reduce stream's pool", "harness.predict.zero3.coordinator",
           ("native",)),
    Method("zero3_ratio", "allocated x reserved_over_allocated + zero3_cached_gathers x the largest gathered "
           "parameter, the fp32 gradient segment and the reduce stream's pool", "harness.predict.calibration"),
)}
DEVICE = {m.name: m for m in (
    Method("device_parts", "reserved + the device's parts beside the allocator: the probe's record of the "
           "platform, else the fitted device_overhead (+ DeepSpeed's)", "harness.predict.device"),
)}


@dataclass(frozen=True)
class Kind:
    """The table's columns, read off a case."""

    method: str  # lora, qlora, full
    zero: str  # "none" without DeepSpeed, else the stage
    params: str  # where ZeRO keeps the parameters: device or host
    optimizer: str  # where ZeRO keeps the optimizer: device or host
    overlap: str  # overlap_comm: on or off
    init: str  # the model built under zero.Init: yes or no
    grads: str  # contiguous_gradients: contiguous or scattered
    allocator: str  # native, expandable (native with expandable segments) or async (another backend)

    @classmethod
    def of(cls, case: Case, conf: AllocatorConf | None = None) -> Kind:
        ds = case.deepspeed
        conf = conf or alloc_conf(case)
        allocator = "async" if conf.backend != "native" else "expandable" if conf.expandable_segments else "native"
        if ds is None:
            return cls(case.method.kind, "none", "device", "device", "-", "no", "-", allocator)
        return cls(case.method.kind, str(ds.stage), "host" if ds.offload_param == Offload.cpu else "device",
                   "host" if ds.offload_optimizer == Offload.cpu else "device", "on" if ds.overlap_comm else "off",
                   "yes" if zero_init(case) else "no", "contiguous" if ds.contiguous_gradients else "scattered",
                   allocator)


@dataclass(frozen=True)
class Row:
    """A kind of config and the methods that size its peak. A column left out matches every value; "a|b"
    matches either."""

    name: str
    allocated: str
    reserved: str
    fallback: str  # the reserve on an allocator `reserved` does not follow
    device: str = "device_parts"
    method: str = ANY
    zero: str = ANY
    params: str = ANY
    optimizer: str = ANY
    overlap: str = ANY
    init: str = ANY
    grads: str = ANY

    def when(self) -> dict[str, str]:
        """The columns this row sets."""
        return {c: getattr(self, c) for c in COLUMNS if getattr(self, c) != ANY}

    def matches(self, kind: Kind) -> bool:
        return all(getattr(kind, c) in want.split("|") for c, want in self.when().items())


COLUMNS = ("method", "zero", "params", "optimizer", "overlap", "init", "grads")
# the columns in words (docs, `check --explain`)
LABELS = {"method": "method", "zero": "ZeRO", "params": "parameters on", "optimizer": "optimizer on",
          "overlap": "overlap_comm", "init": "zero.Init", "grads": "gradients", "allocator": "allocator"}


def describe(columns: dict[str, str]) -> str:
    """Columns and their values in words: "method lora, ZeRO 3, parameters on host"."""
    return ", ".join(f"{LABELS[c]} {v.replace('|', ' or ')}" for c, v in columns.items()) or "any other"

# The first row that matches a case is its route.
TABLE = (
    Row("no-deepspeed", zero="none",
        allocated="terms", reserved="stream", fallback="ratio"),
    Row("zero2-stream", zero="2", params="device", grads="contiguous",
        allocated="zero2_stream", reserved="zero2_stream", fallback="ratio"),
    Row("zero3-lora-one-pool", method="lora", zero="3", params="device", optimizer="host", overlap="off",
        allocated="zero3_step_stream", reserved="zero3_one_pool", fallback="zero3_ratio"),
    Row("zero3-lora-offload-one-pool", method="lora", zero="3", params="host", optimizer="host", overlap="off",
        init="yes", allocated="zero3_step_stream", reserved="zero3_one_pool", fallback="zero3_ratio"),
    Row("zero3-full-model-stream", method="full", zero="3", params="device", overlap="on",
        allocated="zero3_step_stream", reserved="zero3_model_stream", fallback="zero3_ratio"),
    Row("zero3-full-offload", method="full", zero="3", params="host", overlap="on", init="yes",
        allocated="zero3_step_stream", reserved="zero3_model_stream", fallback="zero3_ratio"),
    Row("zero3-lora-offload", method="lora", zero="3", params="host", overlap="on", init="yes",
        allocated="zero3_step_stream", reserved="zero3_model_stream", fallback="zero3_ratio"),
    Row("zero3-full-gather-pool", method="full", zero="3", params="device", overlap="off",
        allocated="terms", reserved="zero3_gather_pool", fallback="zero3_ratio"),
    Row("zero3", zero="3",
        allocated="terms", reserved="zero3_ratio", fallback="zero3_ratio"),
    Row("deepspeed",
        allocated="terms", reserved="ratio", fallback="ratio"),
)


@dataclass(frozen=True)
class Route:
    """The row a case matched, and the methods it gives on the case's allocator."""

    kind: Kind
    row: Row

    @property
    def allocated(self) -> str:
        return self.row.allocated

    @property
    def reserved(self) -> str:
        """The row's reserve method where it follows the case's allocator, else the row's fallback."""
        return self.row.reserved if self.kind.allocator in RESERVED[self.row.reserved].allocators else self.row.fallback

    @property
    def device(self) -> str:
        return self.row.device


def alloc_conf(case: Case) -> AllocatorConf:
    """The case's PYTORCH_CUDA_ALLOC_CONF (`launch.env`) as the allocator model reads it; one it cannot read
    is bad input."""

    try:
        return AllocatorConf.parse(case.launch.env.get("PYTORCH_CUDA_ALLOC_CONF", ""), "PYTORCH_CUDA_ALLOC_CONF")
    except AllocConfError as exc:
        raise InputError(None, "launch.env", str(exc)) from None


def route_for(case: Case, conf: AllocatorConf | None = None) -> Route:
    kind = Kind.of(case, conf)
    return Route(kind, next(row for row in TABLE if row.matches(kind)))


def row_of(case: Case) -> Row:
    """The row of the case's kind of config, whatever its allocator (the replays that do not depend on it
    ask this)."""
    kind = Kind.of(case, AllocatorConf())
    return next(row for row in TABLE if row.matches(kind))


def replays_gather_pool(case: Case) -> bool:
    """Whether the predictor takes the gather stream's pool from the replay (`Gathered.pool_bytes`), so the
    replay runs the extra steps that pool needs: the rows whose reserve method reads it."""
    return row_of(case).reserved in ("zero3_model_stream", "zero3_gather_pool")


# What each stream row was checked on (the recorded timelines in results/timelines)
EVIDENCE = {
    "zero2-stream": "ZeRO-2 with contiguous gradients (the path through `copy_grads_in_partition`), the optimizer "
    "on the device or on the host. LoRA with the optimizer on the host kept the ratio while the trace's dropout "
    "kept a noise tensor of the input's dtype where CUDA keeps a boolean mask: guide 001's rung 2, fp16 without "
    "checkpointing, then built to 30.56 GiB against 28.84 measured; with the mask, 29.31.",
    "zero3-lora-one-pool": "LoRA on a half-precision model, the parameters on the device, the optimizer on the "
    "host, without overlap_comm: the device allocations beside the model's are the gathers and two buffers (the "
    "recorded timeline shows DeepSpeed's other step allocations, the reduce path's norms and partition copies, "
    "to be MiBs).",
    "zero3-lora-offload-one-pool": "The same with the parameters on the host and the model built under zero.Init "
    "(LLaMA-Factory's ds_z3_offload_config.json): the gathers and their host partition copies share the model's "
    "pool; the gathers are put where the trace recorded the hooks firing. Guide 000's non-reentrant fix: "
    "allocated 5.44 / 5.46 GiB against 5.44 / 5.45 measured at 4 / 8 layers, reserved 6.56 / 6.57 against the "
    "worst rank's 6.66 / 6.42 (the ranks 0.2 GiB apart, each the same to the MiB in a second run); spread "
    "evenly, the reserve is 6.66 / 5.91.",
    "zero3-full-model-stream": "A full fine-tune with overlap_comm (the gathers on their own stream): the model's "
    "stream is zero.Init's load, the flat partition buffer, the IPG bucket, the traced step and, with the "
    "optimizer on the device, its fp32 partitions, gradient partitions and sub-group steps.",
    "zero3-full-offload": "A full fine-tune with the parameters on the host, built under zero.Init (the optimizer "
    "is on the host with them): checked on the recorded streams of guide 002's Gemma-3-27B (its allocated peak) "
    "and Qwen2.5-1.5B (stream 0's reserve to the MiB).",
    "zero3-lora-offload": "LoRA with the parameters on the host under zero.Init: the model's stream is zero.Init's "
    "load with the checkpoint's gathers, peft's adapters, the IPG bucket and the hook registration's gathers of "
    "the adapters, then the traced step. Checked on the recorded streams of Mistral-7B (reentrant checkpointing) "
    "and guide 000's 32B (reentrant and not, to the MiB).",
}


def table_text() -> str:
    """The table as Markdown (docs/predictor.md holds this text; a test keeps the two the same)."""
    head = ("row", "when (other columns: any)", "allocated", "reserved", "reserved on another allocator")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in TABLE:
        methods = " | ".join(f"`{m}`" for m in (row.allocated, row.reserved, row.fallback))
        lines.append(f"| `{row.name}` | {describe(row.when())} | {methods} |")
    return "\n".join(lines)
