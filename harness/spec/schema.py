"""The case schema: one YAML file describes one scenario: a training config, its cards and what must hold.

A case comes from a guide of the bundled suite (`guide`), from a team's own training config
(`oom-harness case-from`, which fills `source` and `predicted`), or is written by hand. Its model is
a registry name or a folder holding a Hugging Face config.json (`harness.models.source`).

Every model here forbids unknown keys, so a typo in a case file is an error that names the file,
the field and the allowed values (see `harness.spec.cases`), never a silently ignored setting.
"""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_serializer, field_validator, model_validator

from harness.spec.units import parse_size, parse_size_field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Role(str, Enum):
    failing = "failing"  # a config that ran out of memory (a guide's failing config)
    fix = "fix"  # a fix for a failing config
    rung = "rung"  # one rung of a ladder of configs by card size (guide 001)
    wrong_way = "wrong_way"  # a mistake to warn about; the harness must detect it
    config = "config"  # a team's own training config, held to its cards (oom-harness case-from)


class Precision(str, Enum):
    """The dtype weights and activations are computed in (mixed precision: bf16 or fp16)."""

    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


class Stack(str, Enum):
    """The training stack a config comes from; it changes memory (GiBs on a 7B QLoRA).

    llamafactory: LLaMA-Factory itself: its argument parsing, loader, adapter setup (the fp32 upcast of
        trainable parameters unless pure_bf16 or ZeRO-3; its QLoRA path keeps non-4-bit parameters in the
        compute dtype) and trainer (harness.runtime.stacks.llamafactory).
    hf_trainer: transformers' Trainer with the config's TrainingArguments (harness.runtime.stacks.hf_trainer).
    peft: the harness's own loop, with peft's `prepare_model_for_kbit_training` (upcasts non-4-bit
        parameters to fp32) for QLoRA: a user's script.
    plain: the harness's own loop, no k-bit preparation (non-quantized cases).
    """

    peft = "peft"
    llamafactory = "llamafactory"
    hf_trainer = "hf_trainer"
    plain = "plain"

    @property
    def kbit_prepared(self) -> bool:
        """Whether a 4-bit model goes through peft's `prepare_model_for_kbit_training` (peft's and the HF
        Trainer's QLoRA recipes; LLaMA-Factory's path does not), which upcasts what is not 4-bit to fp32."""
        return self in (Stack.peft, Stack.hf_trainer)

    @property
    def qlora_path(self) -> str:
        """The k-bit path a QLoRA case of this stack takes, as the predictor's error table names it."""
        return "peft" if self.kbit_prepared else self.value


class Quantization(Strict):
    """bitsandbytes 4-bit storage of the frozen base weights (QLoRA)."""

    bits: Literal[4] = Field(default=4, description="bits per quantized weight")
    quant_type: Literal["nf4", "fp4"] = Field(default="nf4", description="bitsandbytes' 4-bit data type")
    double_quant: bool = Field(default=True, description="quantize the quantization constants too")
    compute_dtype: Precision = Field(default=Precision.bf16, description="dtype the 4-bit weights are "
                                     "dequantized to for each matmul")


class Lora(Strict):
    """LoRA adapters (peft): low-rank trainable matrices beside frozen weights."""

    r: int = Field(gt=0, le=1024, description="adapter rank")
    alpha: float = Field(gt=0, description="scaling numerator (the update is scaled by alpha / r)")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on the adapters' input")
    targets: list[str] | Literal["all"] = Field(
        description="module names, or 'all' for every linear layer except the output head"
    )

    @field_validator("targets")
    @classmethod
    def _targets_not_empty(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("list at least one module name, or write 'all'")
        return value


class Method(Strict):
    """What is trained: LoRA adapters, LoRA on 4-bit weights (QLoRA), or every weight."""

    kind: Literal["lora", "qlora", "full"] = Field(
        description="lora and qlora need a `lora` block; qlora also a `quantization` block")
    lora: Lora | None = Field(default=None, description="the adapters (lora, qlora)")
    quantization: Quantization | None = Field(default=None, description="the 4-bit storage (qlora only)")

    @model_validator(mode="after")
    def _consistent(self):
        if self.kind in ("lora", "qlora") and self.lora is None:
            raise ValueError(f"method.kind '{self.kind}' needs a 'lora' block (r, alpha, targets)")
        if self.kind == "full" and self.lora is not None:
            raise ValueError("method.kind 'full' trains every weight; remove the 'lora' block")
        if self.kind == "qlora" and self.quantization is None:
            raise ValueError("method.kind 'qlora' needs a 'quantization' block (bits: 4, quant_type)")
        if self.kind != "qlora" and self.quantization is not None:
            raise ValueError("a 'quantization' block needs method.kind 'qlora'")
        return self


# transformers' attn_implementation values a case may name (train.attn_implementation)
AttnImplementation = Literal["eager", "sdpa", "flash_attention_2"]


class Train(Strict):
    """The training loop: batch shape, accumulation, checkpointing, data loading."""

    micro_batch: int = Field(gt=0, le=4096, description="sequences per forward and backward, per process")
    grad_accum: int = Field(gt=0, le=65536, description="micro steps accumulated per optimizer step")
    seq_len: int = Field(gt=0, le=1_048_576, description="tokens per sequence (cutoff_len, max_seq_length)")
    gradient_checkpointing: bool = Field(default=False, description="recompute activations in backward "
                                         "instead of keeping them")
    checkpointing_reentrant: bool | None = Field(
        default=None,
        description="torch.utils.checkpoint's use_reentrant; omitted: the stack's default (peft's k-bit "
        "preparation and LLaMA-Factory's use_reentrant_gc: true; plain: false, the transformers default)")
    learning_rate: float = Field(default=1e-4, gt=0, description="AdamW's learning rate")
    dataloader_workers: int = Field(default=0, ge=0, le=256, description="DataLoader worker processes "
                                    "(each holds host memory)")
    pin_memory: bool = Field(default=True, description="the DataLoader's pin_memory")
    prefetch_factor: int | None = Field(default=None, gt=0, description="batches each DataLoader worker "
                                        "loads ahead; omitted: torch's default")
    logits_to_keep: int | None = Field(
        default=None, ge=0, description="passed to the model in evaluation forwards (guide 004)"
    )
    attn_implementation: AttnImplementation | None = Field(
        default=None,
        description="the attention kernel the model is built with (transformers' attn_implementation: eager keeps "
        "every layer's score matrices for backward, sdpa and flash_attention_2 do not); omitted: the installed "
        "transformers' default for the model, which differs between versions and architectures")
    pure_bf16: bool = Field(
        default=False,
        description="LLaMA-Factory's pure_bf16: trainable parameters stay in bf16; without it LLaMA-Factory upcasts "
        "them to fp32 (except under ZeRO-3) and trains under bf16 autocast (stack: llamafactory only)")
    liger_kernel: bool = Field(
        default=False,
        description="Liger's kernels, as LLaMA-Factory's enable_liger_kernel or the HF Trainer's use_liger_kernel "
        "apply them (stacks llamafactory and hf_trainer): the fused linear cross-entropy never builds the logits")
    optim: Literal["adamw_torch", "adamw_torch_fused"] | None = Field(
        default=None,
        description="the Trainer's AdamW (stacks llamafactory and hf_trainer, without DeepSpeed): adamw_torch "
        "(foreach: a temporary as large as the trainable parameters at each step) or adamw_torch_fused; "
        "omitted: transformers' default, adamw_torch_fused with torch >= 2.8")


class Offload(str, Enum):
    """Where DeepSpeed keeps offloaded state: on the card (none) or in host memory (cpu)."""

    none = "none"
    cpu = "cpu"


class DeepSpeed(Strict):
    """DeepSpeed ZeRO settings, written to the job's DeepSpeed config (harness.spec.dsconfig).

    Counts are elements, as in DeepSpeed's own config; omitted: DeepSpeed's default (at tiny size,
    element-count thresholds scale with the parameter count)."""

    stage: Literal[0, 1, 2, 3] = Field(description="ZeRO stage: 1 shards optimizer state, 2 also "
                                       "gradients, 3 also parameters")
    offload_optimizer: Offload = Field(default=Offload.none, description="optimizer state (and, under "
                                       "ZeRO-3, the fp32 gradient partition) in host memory")
    offload_param: Offload = Field(default=Offload.none, description="parameter partitions in host "
                                   "memory (stage 3 only)")
    pin_memory: bool = Field(default=True, description="page-locked host buffers for offloaded state")
    overlap_comm: bool = Field(default=True, description="overlap gradient reduction with backward "
                               "(a second reduce bucket)")
    contiguous_gradients: bool = Field(default=True, description="copy gradients into one contiguous "
                                       "buffer as they are produced")
    reduce_bucket_size: int | None = Field(default=None, gt=0, description="elements per gradient "
                                           "reduction bucket")
    allgather_bucket_size: int | None = Field(default=None, gt=0, description="elements per all-gather "
                                              "bucket (stages 1 and 2)")
    stage3_prefetch_bucket_size: int | None = Field(default=None, ge=0, description="elements of "
                                                    "parameters gathered ahead of use")
    stage3_param_persistence_threshold: int | None = Field(default=None, ge=0, description="parameters "
                                                           "smaller than this stay whole on every rank")
    stage3_max_live_parameters: int | None = Field(default=None, ge=0, description="most gathered "
                                                   "elements kept on the card at once")
    stage3_max_reuse_distance: int | None = Field(default=None, ge=0, description="a gathered parameter "
                                                  "used again within this many elements is kept, not freed")
    sub_group_size: int | None = Field(default=None, gt=0, description="elements per optimizer step "
                                       "group (bounds the optimizer's transient memory)")

    @model_validator(mode="after")
    def _consistent(self):
        if self.offload_param != Offload.none and self.stage != 3:
            raise ValueError("deepspeed.offload_param needs stage 3 (ZeRO-1/2 keep parameters on the card)")
        if self.offload_optimizer != Offload.none and self.stage == 0:
            raise ValueError("deepspeed.offload_optimizer needs stage 1, 2 or 3")
        stage3_only = [
            "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "stage3_max_live_parameters",
            "stage3_max_reuse_distance",
        ]
        set_wrong = [k for k in stage3_only if getattr(self, k) is not None and self.stage != 3]
        if set_wrong:
            raise ValueError(f"{', '.join(set_wrong)} only apply to stage 3")
        return self


class Launch(Strict):
    """How the job is started: launcher, processes, environment."""

    launcher: Literal["python", "torchrun", "deepspeed"] = Field(
        default="python", description="python starts one process; torchrun and deepspeed start `ranks`")
    ranks: int = Field(default=1, gt=0, le=1024, description="training processes of one job")
    procs_per_card: int = Field(
        default=1, gt=0, le=16, description="independent training jobs sharing one card (guide 004)"
    )
    init_order: Literal["deepspeed_first", "model_first"] = Field(
        default="deepspeed_first",
        description="model_first materialises the model before DeepSpeed is configured (guide 002's mistake)",
    )
    model_source: Literal["checkpoint", "config"] = Field(
        default="checkpoint",
        description="how the job builds its model: 'checkpoint' loads it with from_pretrained (what a "
        "fine-tuning job does), 'config' builds it with from_config on the card; the load's allocations, "
        "and what the caching allocator keeps of them, differ. The harness's own runs build a QLoRA model "
        "from a random-weight checkpoint and every other from its config (harness.runtime.build); a "
        "baseline is predicted the way its runs built the model",
    )
    runtime: Literal["framework", "harness"] = Field(
        default="framework",
        description="what trains a llamafactory or hf_trainer case: 'framework', the framework itself "
        "(harness.runtime.stacks); 'harness', the harness's own loop, which trained every case before the "
        "frameworks ran: its baselines are predicted that way (no autocast, no LLaMA-Factory upcast, torch's "
        "foreach AdamW, no Liger) and are not held against a framework's runs",
    )
    env: dict[str, str] = Field(default_factory=dict, description="environment of the training "
                                "processes (PYTORCH_CUDA_ALLOC_CONF, OMP_NUM_THREADS, ...)")
    triton_cache: Literal["shared", "cold"] = Field(
        default="shared",
        description="Triton kernels (flash-linear-attention): 'shared' keeps compiled kernels between runs "
        "on a host; 'cold' gives every run an empty cache, as the first run on a fresh host has "
        "(compiling and autotuning hold more device memory; harness.runtime.compile_cache)",
    )

    @model_validator(mode="after")
    def _consistent(self):
        if self.ranks > 1 and self.launcher == "python":
            raise ValueError(
                f"launch.ranks is {self.ranks} but launch.launcher is 'python', which starts one process; "
                "use 'torchrun' or 'deepspeed'"
            )
        return self


Vendor = Literal["nvidia", "hygon", "amd"]


class Card(Strict):
    """The card the config must fit; a smaller card is emulated on a bigger one."""

    vendor: Vendor = Field(description="hygon and amd cards run under ROCm/HIP (`pytest -m dcu` selects "
                           "hygon targets)")
    name: str = Field(description="the card as people name it, shown in reports")
    memory: int = Field(description="per card, with a unit: '64 GB', '23.52 GiB'")
    count: int = Field(default=1, gt=0, le=1024, description="cards of one host")

    @field_validator("memory", mode="before")
    @classmethod
    def _size(cls, value, info: ValidationInfo):
        size = parse_size_field(value, info)
        if size <= 0:
            raise ValueError("card memory must be above zero")
        return size


class Target(Strict):
    """Where the config must fit: the card, the share of it a run may use, the host."""

    card: Card
    headroom: float = Field(
        default=0.9, gt=0, le=1, description="the fraction of the card a run may use (guides: < 90%)"
    )
    host_ram: int | None = Field(
        default=None, description="host memory of the machine (the host of target.card), with a unit; "
        "full-size runs judge the node's host RSS against a share of it (harness.judge.host_ram)")

    @field_validator("host_ram", mode="before")
    @classmethod
    def _size(cls, value, info: ValidationInfo):
        return None if value is None else parse_size_field(value, info)


def _finding_field(subject: str):
    """`finding` of a claim or of `expect`: measurement refuted the source (harness.judge.verdicts.as_recorded)."""
    return Field(
        default=None, min_length=1,
        description=f"a full-size measurement refuted {subject}: what was measured, on which card, when. "
        "Full-size runs then expect the refutation to reproduce (a finding, not a failure) and fail "
        "once the source's statement holds again, so the recorded truth gets updated")


class Expect(Strict):
    """What a full-size run must show, and how far it may move from its baseline.

    `detect` names the mistake to flag, exactly when `outcome` is detected: the model built before
    DeepSpeed's ZeRO-3 init (materialised_before_zero_init), or a ZeRO job launched as one process
    (single_process_zero)."""

    outcome: Literal["fits", "oom", "detected"] = Field(
        description="fits: within the headroom; oom: exceeds the card (a failing config); "
        "detected: a mistake the harness must flag"
    )
    detect: Literal["materialised_before_zero_init", "single_process_zero"] | None = Field(
        default=None,
        description="for outcome `detected`: the mistake a run must reveal (the full model materialised on "
        "every rank before ZeRO-3 partitions it; ZeRO launched as a single process)")
    finding: str | None = _finding_field("`outcome` (which stays the source's)")
    memory_tolerance: float | None = Field(
        default=None, gt=0, lt=1,
        description="allowed rise of the per-card peak over its baseline; omitted: derived from the "
        "baseline's spread over repetitions (harness.judge.regression)")
    speed_tolerance: float | None = Field(
        default=None, gt=0, lt=1,
        description="allowed drop of tokens/s below its baseline; omitted: derived from the spread")

    @model_validator(mode="after")
    def _consistent(self):
        if (self.outcome == "detected") != (self.detect is not None):
            raise ValueError("expect.detect names the mistake exactly when expect.outcome is 'detected'")
        return self


class Source(Strict):
    """Where the case comes from: a guide, a post, an incident report, a team's training config."""

    title: str = Field(min_length=1, description="what the source is, e.g. 'LLaMA-Factory config of the nightly SFT'")
    url: str | None = Field(default=None, min_length=1, description="where to read it")
    quote: str | None = Field(default=None, min_length=1, description="the source's own words the case checks")
    config: str | None = Field(
        default=None, min_length=1,
        description="the training config the case was made from (oom-harness case-from), relative to the case "
                    "file or absolute")
    deepspeed: str | None = Field(default=None, min_length=1,
                                  description="the DeepSpeed config it was made with, relative to the case file or "
                                              "absolute")

    @field_validator("config", "deepspeed")
    @classmethod
    def _from_case_folder(cls, value, info: ValidationInfo):
        """A relative path becomes absolute (relative to `base_dir` in the validation context, the case
        file's folder), so a framework's run reads the user's own config from any working directory."""
        base_dir = (info.context or {}).get("base_dir")
        if value is None or base_dir is None or Path(value).is_absolute():
            return value
        return str((Path(base_dir) / value).resolve())


class Predicted(Strict):
    """The predictor's figures for the case at full size when the case was written (oom-harness
    case-from): kept to compare measurements with, never asserted."""

    per_card_peak: int = Field(description="device memory of the worst process on one card, with a unit")
    allocated: int | None = Field(default=None, description="the allocator's peak of that process, with a unit")
    host_ram: int | None = Field(default=None, description="host memory of the job on one node, with a unit")
    budget: int | None = Field(default=None, description="target.card.memory times target.headroom, with a unit")
    margin: int | None = Field(default=None, description="the prediction's margin (its benchmark error for this "
                                                          "kind of config), with a unit: expect.outcome is fits "
                                                          "where per_card_peak plus it is within the budget")
    calibration: str = Field(min_length=1, description="the baselines' platform the constants were fitted on, "
                                                       "or 'pooled'")
    predictor_version: str = Field(min_length=1, description="the oom-harness version that predicted")
    date: str = Field(pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$", description="the day of the prediction, YYYY-MM-DD")

    @field_validator("per_card_peak", "allocated", "host_ram", "budget", "margin", mode="before")
    @classmethod
    def _size(cls, value, info: ValidationInfo):
        return None if value is None else parse_size_field(value, info)


# --- Claims -------------------------------------------------------------------------------------
# A claim is a sentence of the case's source turned into something a measurement can confirm or
# refute. `quote` keeps the source's words (the guide's, for the bundled suite); `kind` says how the
# harness checks it.


class _Claim(Strict):
    quote: str | None = Field(default=None, min_length=1, description="the source's own words (a guide's, a post's)")
    finding: str | None = _finding_field("this claim")


class TrainsClaim(_Claim):
    """The config trains: its steps finish and the loss is finite."""

    kind: Literal["trains"]


class CheckpointingClaim(_Claim):
    """Gradient checkpointing recomputes: the activation memory of a step drops when it is on."""

    kind: Literal["checkpointing_saves_activations"]
    min_saving: float = Field(default=0.2, gt=0, lt=1, description="at least this fraction saved")


class QuantizedWeightsClaim(_Claim):
    """4-bit storage: quantized linear weights take about a quarter of their bf16 bytes."""

    kind: Literal["quantized_weights_shrink"]
    max_ratio: float = Field(default=0.3, gt=0, le=1, description="quantized bytes / bf16 bytes at most")


class Zero3PartitionClaim(_Claim):
    """ZeRO-3 holds about 1/world of the parameters on each rank."""

    kind: Literal["zero3_partitions_parameters"]
    tolerance: float = Field(default=0.25, gt=0, lt=1, description="relative slack around 1/world")


class OffloadClaim(_Claim):
    """Optimizer offload moves the optimizer state off the card, into host memory."""

    kind: Literal["optimizer_state_offloaded"]


class LogitsToKeepClaim(_Claim):
    """`train.logits_to_keep` shrinks the logits an evaluation forward holds."""

    kind: Literal["logits_to_keep_shrinks_logits"]


class LowerPeakThanClaim(_Claim):
    """This variant's per-card peak is below another case's (a fix against its failing config)."""

    kind: Literal["lower_peak_than"]
    case: str = Field(description="id of the case this one peaks below (run too when selected)")


class _RangeClaim(_Claim):
    """A figure the guide states as a range: sizes with units for the metrics in `SIZES`, fractions
    between 0 and 1 (of `FRACTION_OF`) for the others."""

    SIZES: ClassVar[tuple[str, ...]] = ()
    FRACTION_OF: ClassVar[str] = ""
    metric: str
    low: float = Field(description="low end: a size with a unit ('10 GiB') for a size metric, else a "
                       "fraction between 0 and 1")
    high: float = Field(description="high end, written like low")

    @model_validator(mode="before")
    @classmethod
    def _units(cls, data):
        if isinstance(data, dict) and data.get("metric") in cls.SIZES:
            data = dict(data)
            for key in ("low", "high"):
                if key in data:
                    if isinstance(data[key], (int, float)) and not isinstance(data[key], bool):
                        raise ValueError(f"{key}: write a size with a unit, e.g. '{data[key]} GiB'")
                    data[key] = parse_size(data[key])
        return data

    @field_serializer("low", "high", when_used="json")
    def _with_unit(self, value: float):
        """Sizes are written back with their unit, so a case dumped as JSON validates again (bytes
        without a unit are refused above, as a number that may have meant GiB)."""
        return f"{int(value)} B" if self.metric in self.SIZES else value

    @model_validator(mode="after")
    def _ordered(self):
        if self.low > self.high:
            raise ValueError(f"{self.kind} low {self.low} is above high {self.high}")
        if self.metric not in self.SIZES and not (0 <= self.low <= self.high <= 1):
            raise ValueError(f"{self.metric} bounds are fractions of {self.FRACTION_OF} between 0 and 1, e.g. 0.3")
        return self


class MemoryRangeClaim(_RangeClaim):
    """A stated figure, e.g. guide 003's 'training ~10-12 GB'; checked on real cards.
    device_peak / load_footprint take sizes with units ('10 GB'); usage_fraction takes fractions of
    the card (0.76)."""

    SIZES = ("device_peak", "load_footprint")
    FRACTION_OF = "the card"
    kind: Literal["memory_range"]
    metric: Literal["device_peak", "load_footprint", "usage_fraction"] = Field(
        description="device_peak: the per-card peak at the step; load_footprint: after the model is "
        "built; usage_fraction: the peak as a share of the card")


class CheckpointingSavingClaim(_RangeClaim):
    """The guide's own figure for what checkpointing saves, checked on real cards: the activations it
    no longer holds for backward, as a size (`activation_bytes`: guide 004's '3-5GB'), or as a share
    of the step's device peak without it, taken as the peak plus what it saves (`peak_fraction`:
    guide 003's 'saves about 30-50% of the memory')."""

    SIZES = ("activation_bytes",)
    FRACTION_OF = "the peak"
    kind: Literal["checkpointing_saving"]
    metric: Literal["activation_bytes", "peak_fraction"] = Field(
        description="activation_bytes: the activations saved, a size; peak_fraction: the share of the peak")


class CheckpointingSpeedClaim(_Claim):
    """The guide's figure for what checkpointing costs in speed (guide 004: '-8%'), checked on real
    cards against timed training forwards and backwards with it and without it (single-process jobs;
    the optimizer step, the same either way, is left out). `cost`: the share of tokens per second lost."""

    kind: Literal["checkpointing_speed_cost"]
    cost: float = Field(gt=0, lt=1, description="the claimed share of tokens/s lost (0.08 for '-8%')")


class OomAllocationClaim(_Claim):
    """The size the failing run asked for when it ran out of memory (checked where it reproduces)."""

    kind: Literal["oom_tried_to_allocate"]
    size: int = Field(description="the size in the guide's error message ('Tried to allocate 2.32 GiB')")

    @field_validator("size", mode="before")
    @classmethod
    def _size(cls, value, info: ValidationInfo):
        return parse_size_field(value, info)


class SpeedRankClaim(_Claim):
    """Position in the guide's claimed speed order within the family (1 = fastest)."""

    kind: Literal["speed_rank"]
    rank: int = Field(gt=0, description="1 for the fastest of the family")


Claim = Annotated[
    TrainsClaim | CheckpointingClaim | CheckpointingSavingClaim | CheckpointingSpeedClaim | QuantizedWeightsClaim
    | Zero3PartitionClaim | OffloadClaim | LogitsToKeepClaim | LowerPeakThanClaim | MemoryRangeClaim
    | OomAllocationClaim | SpeedRankClaim,
    Field(discriminator="kind", description="what the source says about the config, each checked by measurement"),
]

# Claims that are physically meaningful at tiny size on a CPU.
TINY_CLAIMS = {
    "trains",
    "checkpointing_saves_activations",
    "quantized_weights_shrink",
    "zero3_partitions_parameters",
    "optimizer_state_offloaded",
    "logits_to_keep_shrinks_logits",
    "lower_peak_than",
}


# Case ids name files (the case file, run folders, baselines): letters, digits, '.', '_', '-'.
CASE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class Case(Strict):
    id: str = Field(
        json_schema_extra={"pattern": CASE_ID_PATTERN, "maxLength": 200},
        description="the case file's name without .yaml: letters, digits, '.', '_' and '-', starting with a "
                    "letter or digit (it also names run folders and baselines)")
    guide: str | None = Field(
        default=None, pattern=r"^[0-9]{3}$",
        description="the bundled suite's guide number; the id then starts with it ('003-...')")
    source: Source | None = None
    family: str = Field(min_length=1, description="cases of one family are compared with each other")
    title: str = Field(description="one line shown in tables and reports")
    role: Role
    model: str = Field(
        min_length=1,
        description="a registry name (harness/models/architectures), or a folder holding a Hugging Face "
                    "config.json, relative to the case file or absolute (any causal LM transformers builds)")
    layers: int | None = Field(
        default=None, gt=0,
        description="measure at full width with this many layers (full-size runs too big for the cards "
        "at hand); omitted: the architecture's full depth",
    )
    depth_points: list[int] | None = Field(
        default=None, min_length=2,
        description="full-size runs measure at these layer counts (full width) and extrapolate to the full "
        "depth: for configs whose full depth the GPUs or the host at hand cannot hold",
    )
    stack: Stack = Stack.plain
    precision: Precision = Precision.bf16
    method: Method
    train: Train
    deepspeed: DeepSpeed | None = None
    launch: Launch = Field(default_factory=Launch)
    target: Target
    expect: Expect
    claims: list[Claim] = Field(default_factory=list)
    predicted: Predicted | None = None
    notes: str = Field(default="", description="free text for readers: the scenario, its provenance, caveats")

    @field_validator("id")
    @classmethod
    def _safe_id(cls, value):
        if not re.fullmatch(CASE_ID_PATTERN, value) or ".." in value or len(value) > 200:
            raise ValueError("not a safe file name: use letters, digits, '.', '_' and '-', starting with a letter "
                             "or digit, no '..', at most 200 characters (the id names the case file, its run "
                             "folders and its baselines)")
        return value

    @field_validator("model")
    @classmethod
    def _resolvable_model(cls, value, info: ValidationInfo):
        """A registry name stays; a folder becomes absolute (relative to `base_dir` in the validation
        context, the case file's folder), so every process that reads the case finds it."""
        from harness.models.source import ModelSourceError, case_model

        base_dir = (info.context or {}).get("base_dir")
        try:
            return case_model(value, base_dir)
        except ModelSourceError as exc:
            raise ValueError(f"{exc.problem}; {exc.fix}") from None

    @model_validator(mode="after")
    def _consistent(self):
        if self.layers is not None or self.depth_points is not None:
            from harness.models.source import load_model

            full_depth = load_model(self.model).layers
            if self.layers is not None and self.layers > full_depth:
                raise ValueError(f"layers {self.layers} exceeds the model's {full_depth} layers")
            depth = self.layers or full_depth
            if self.depth_points is not None and (
                    len(set(self.depth_points)) != len(self.depth_points)
                    or any(not 0 < d < depth for d in self.depth_points)):
                raise ValueError(f"depth_points must be distinct layer counts between 1 and {depth - 1}")
        if self.guide is not None and not self.id.startswith(self.guide + "-"):
            raise ValueError(f"id '{self.id}' must start with its guide number '{self.guide}-'")
        if self.deepspeed is None and self.launch.launcher == "deepspeed":
            raise ValueError("launch.launcher is 'deepspeed' but the case has no 'deepspeed' block")
        if self.deepspeed is None and self.launch.ranks > 1:
            raise ValueError("several ranks without a 'deepspeed' block: the harness shards only through DeepSpeed")
        if self.launch.model_source == "config" and self.method.kind == "qlora":
            raise ValueError("launch.model_source 'config' with method.kind 'qlora': a 4-bit model is quantized "
                             "as it loads from a checkpoint; use 'checkpoint'")
        if self.launch.init_order == "model_first" and (self.deepspeed is None or self.deepspeed.stage != 3):
            raise ValueError("launch.init_order 'model_first' only matters for ZeRO-3 (deepspeed.stage: 3)")
        if self.method.kind == "qlora" and self.deepspeed is not None and self.deepspeed.stage == 3:
            raise ValueError("4-bit weights cannot be partitioned by ZeRO-3 here; use deepspeed.stage 2 (guide 000)")
        if self.launch.procs_per_card > 1 and self.launch.ranks > 1:
            raise ValueError("procs_per_card > 1 models independent single-rank jobs; set launch.ranks to 1")
        if self.launch.ranks > self.target.card.count:
            raise ValueError(
                f"launch.ranks {self.launch.ranks} exceeds target.card.count {self.target.card.count}"
            )
        kinds = [c.kind for c in self.claims]
        if "zero3_partitions_parameters" in kinds and (self.deepspeed is None or self.deepspeed.stage != 3):
            raise ValueError("claim 'zero3_partitions_parameters' needs deepspeed.stage 3")
        if "optimizer_state_offloaded" in kinds and (
            self.deepspeed is None or self.deepspeed.offload_optimizer == Offload.none
        ):
            raise ValueError("claim 'optimizer_state_offloaded' needs deepspeed.offload_optimizer: cpu")
        if "quantized_weights_shrink" in kinds and self.method.kind != "qlora":
            raise ValueError("claim 'quantized_weights_shrink' needs method.kind 'qlora'")
        if "checkpointing_saves_activations" in kinds and not self.train.gradient_checkpointing:
            raise ValueError("claim 'checkpointing_saves_activations' needs train.gradient_checkpointing: true")
        if "logits_to_keep_shrinks_logits" in kinds and not self.train.logits_to_keep:
            raise ValueError("claim 'logits_to_keep_shrinks_logits' needs train.logits_to_keep >= 1")
        return self

    @property
    def world_size(self) -> int:
        return self.launch.ranks

    @property
    def procs_per_node(self) -> int:
        """Training processes the case puts on one host: every card of `target.card` busy, each with
        `launch.procs_per_card` processes (guide 004: 7 cards x 2 = 14 jobs on one 251 GiB host; a
        ZeRO job: one rank per card). `target.card` is one host's cards, and `launch.ranks` never
        exceeds their count (validated above), so a job on fewer ranks than cards still counts every
        card: the case's other cards run copies of it. A case that leaves cards idle (guide 002's
        plain-python launch) is a mistake to detect, not a count to judge (`harness.judge.host_ram`)."""
        return self.target.card.count * self.launch.procs_per_card

    @property
    def budget_bytes(self) -> int:
        """What one card may hold for this case: card memory times the headroom fraction."""
        return int(self.target.card.memory * self.target.headroom)
