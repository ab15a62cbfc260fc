"""What the importers take (`JobSpec`) and give (`ImportedConfig` with the files as written)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from harness.models.registry import Architecture
from harness.spec.schema import Case

# Triton kernel cache states a job can start with, as the command line names them, and as `launch.triton_cache`.
TRITON_CACHES = {"cold": "cold", "warm": "shared"}
LAUNCHERS = ("python", "torchrun", "deepspeed", "accelerate", "llamafactory-cli")


class ConfigFormat(str, Enum):
    llamafactory = "llamafactory"
    training_args = "training_args"
    deepspeed = "deepspeed"
    case = "case"


@dataclass(frozen=True)
class JobSpec:
    """Where the job runs and how it is started: what the config files do not say."""

    gpus: int | None = None
    gpu_memory: int | None = None  # bytes per card
    procs_per_gpu: int | None = None  # independent jobs sharing one card (guide 004)
    headroom: float | None = None
    host_ram: int | None = None  # bytes per node
    vendor: str | None = None
    launcher: str | None = None  # one of LAUNCHERS
    model: str | None = None  # overrides model_name_or_path
    deepspeed: Path | None = None  # overrides the config's `deepspeed`
    stack: str | None = None  # peft | llamafactory | plain
    script: Path | None = None  # the training script, scanned for the order of model load and DeepSpeed
    triton_cache: str | None = None  # 'cold' or 'warm' (TRITON_CACHES); None: the case file's, else cold


@dataclass(frozen=True)
class NotModelled:
    """A key that changes memory, read from the config, that the predictor does not model. `raises`: it can
    put the peak above the prediction, so no verdict is claimed (the check says UNDECIDED, naming it);
    otherwise it can only lower the peak, so FITS holds and DOES NOT FIT becomes UNDECIDED."""

    path: Path
    key: str  # as the user finds it in the file ('zero_optimization.offload_optimizer.ratio')
    value: Any
    raises: bool
    why: str  # what it does to memory

    def line(self) -> str:
        effect = "can raise the peak" if self.raises else "can only lower the peak"
        return f"{self.key}: {self.value!r} is read but not modelled ({self.why}; {effect})"

    def as_dict(self) -> dict[str, Any]:
        return {"file": str(self.path), "key": self.key, "value": self.value, "raises_peak": self.raises,
                "why": self.why}


@dataclass(frozen=True)
class ReadAs:
    """A value the training stack reads otherwise than it looks: a boolean written as text, which the
    HF Trainer's dataclasses keep as text and test for truth (`"false"` is true)."""

    path: Path
    key: str
    written: Any
    read_as: Any
    stack: str  # who reads it so ('the HF Trainer', 'DeepSpeed')


@dataclass(frozen=True)
class DeepSpeedFile:
    """A DeepSpeed config as written; None where it says "auto" (the HF integration fills it)."""

    path: Path
    key_prefix: str  # "" for a file of its own, "deepspeed." for a config inlined in the training config
    keys: frozenset[str]
    stage: int
    train_batch_size: int | None
    micro_batch: int | None
    grad_accum: int | None
    fp16: bool | None
    bf16: bool | None
    offload_optimizer: str  # none | cpu
    offload_param: str
    offload_pin_memory: bool  # pin_memory of either offload block
    activation_checkpointing: tuple[str, ...]  # keys of its activation_checkpointing block set true
    zero: dict[str, Any] = field(default_factory=dict, repr=False)  # the case's `deepspeed` block
    not_modelled: tuple[NotModelled, ...] = ()
    read_as: tuple[ReadAs, ...] = ()


@dataclass(frozen=True)
class TrainingFile:
    """The training config as written (what the lints read beside the case)."""

    path: Path
    format: ConfigFormat
    keys: frozenset[str]
    micro_batch: int
    grad_accum: int
    seq_len: int
    fp16: bool
    bf16: bool
    eval_strategy: str | None
    evaluation_strategy: str | None
    gradient_checkpointing: bool
    gradient_checkpointing_key: str  # the key that decided it ("" where a default did)
    method: str  # lora | qlora | full
    quantization_bits: int | None
    deepspeed_ref: str | None  # the `deepspeed` value as written
    checkpointing_reentrant: bool = False  # torch.utils.checkpoint's use_reentrant as the job runs it (with gc on)
    checkpointing_reentrant_key: str = ""  # the key that decided it ("" where the stack's default did)


@dataclass(frozen=True)
class InitOrder:
    """Whether the script builds the model before DeepSpeed is configured (guide 002's mistake)."""

    order: str  # deepspeed_first | model_first
    evidence: str  # "train.py:12 loads the model, train.py:30 configures DeepSpeed", or how it was decided
    path: Path | None = None  # the file that decided it (a training script, a case file)


@dataclass(frozen=True)
class ImportedConfig:
    case: Case | None  # None where the settings are outside what the predictor models (see `unpredictable`)
    arch: Architecture  # what to predict with; a local config.json may differ from `case.model`
    training: TrainingFile
    deepspeed: DeepSpeedFile | None
    launcher: str  # as the user starts it (LAUNCHERS)
    launcher_from: str  # "--launcher", "llamafactory-cli", "the case file", or "assumed"
    world_size: int  # ranks of one job
    gpus: int
    gpu_memory: int
    procs_per_gpu: int
    headroom: float
    host_ram: int | None
    init_order: InitOrder
    unpredictable: str | None = None
    notes: tuple[str, ...] = ()
    not_modelled: tuple[NotModelled, ...] = ()  # the training config's and its DeepSpeed config's
    read_as: tuple[ReadAs, ...] = ()

    @property
    def job_processes(self) -> int:
        """The training processes of the job this config describes (what a prediction's host_ram counts)."""
        return self.world_size * self.procs_per_gpu

    @property
    def node_processes(self) -> int:
        """The training processes on the node with every card busy: independent jobs on the other
        cards (guide 004's seven cards of two jobs each) share its host RAM."""
        return max(self.job_processes, self.gpus * self.procs_per_gpu)

    def node_host_ram(self, job_host_ram: int) -> int:
        """A job's host RAM scaled to the node with every card busy (predicted host RAM is per process)."""
        return job_host_ram * self.node_processes // self.job_processes

    @property
    def sources(self) -> tuple[Path, ...]:
        ds = self.deepspeed
        return (self.training.path,) + ((ds.path,) if ds and ds.path != self.training.path else ())

    @property
    def zero_stage(self) -> int | None:
        return None if self.deepspeed is None else self.deepspeed.stage
