"""Importers: the configs users already have, turned into a `Case` the predictor can size.

    import_config(path, JobSpec(gpus=8, gpu_memory=parse_size("64GiB"))) -> ImportedConfig

Formats, told apart by content (and extension):

- LLaMA-Factory training YAML (`llamafactory-cli train x.yaml`): `model_name_or_path`,
  `finetuning_type`, `lora_*`, `quantization_bit`, `cutoff_len`, `deepspeed` (a path relative to
  the YAML), ... plus every Hugging Face TrainingArguments field. LLaMA-Factory checkpoints by default
  (`disable_gradient_checkpointing: false`) and sets `lora_alpha` to twice the rank when unset.
- Hugging Face TrainingArguments JSON, with the model, LoRA and 4-bit fields training scripts add
  (`model_name_or_path`, `max_length`/`max_seq_length`, `lora_r`, `load_in_4bit`, ...).
- DeepSpeed JSON (through `deepspeed` in either of the above, or `--deepspeed`): "auto" values
  resolved as the Hugging Face integration resolves them; left-out keys take DeepSpeed's defaults.
- The harness's own case YAML (`cases/*.yaml`).

The job's cards (how many, how big, processes per card, launcher) are not in these files; they come
in a `JobSpec` from the command line or a premerge sidecar. Every problem is one `ConfigError`
naming the file, the key and the fix. Settings the lints need that a `Case` does not keep (the keys
as written, `evaluation_strategy`, both precision flags, DeepSpeed's `train_batch_size`, its
`activation_checkpointing` block) are kept beside the case.
"""

from __future__ import annotations

import ast
import difflib
import json
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from harness.architectures import Architecture
from harness.cases import CaseError, _describe, load_case
from harness.dsconfig import auto_sizes
from harness.model_source import ModelSourceError, resolve_model
from harness.schema import Case, Offload, Precision
from harness.units import fmt_gib, parse_size

IMPORTED_GUIDE = "999"  # imported configs belong to no guide; their case ids start with this


class ConfigFormat(str, Enum):
    llamafactory = "llamafactory"
    training_args = "training_args"
    deepspeed = "deepspeed"
    case = "case"


class ConfigError(Exception):
    """A config the harness cannot check, with where (file, key) and what to do (fix)."""

    def __init__(self, path: Path | str | None, key: str | None, problem: str, fix: str = ""):
        super().__init__(problem)
        self.path = None if path is None else Path(path)
        self.key = key
        self.problem = problem
        self.fix = fix

    def __str__(self) -> str:
        where = ": ".join(str(p) for p in (self.path, self.key) if p)
        text = f"{where}: {self.problem}" if where else self.problem
        return text + (f". Fix: {self.fix}" if self.fix else "")


LAUNCHERS = ("python", "torchrun", "deepspeed", "accelerate", "llamafactory-cli")
_CASE_LAUNCHER = {"python": "python", "torchrun": "torchrun", "accelerate": "torchrun",
                  "llamafactory-cli": "torchrun", "deepspeed": "deepspeed"}


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

    @property
    def sources(self) -> tuple[Path, ...]:
        ds = self.deepspeed
        return (self.training.path,) + ((ds.path,) if ds and ds.path != self.training.path else ())

    @property
    def zero_stage(self) -> int | None:
        return None if self.deepspeed is None else self.deepspeed.stage


# --- Reading files ------------------------------------------------------------------------------


def read_mapping(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(path, None, "no such file", "check the path") from None
    except IsADirectoryError:
        raise ConfigError(path, None, "is a directory, not a config file", "name a YAML or JSON file") from None
    except OSError as exc:
        raise ConfigError(path, None, f"cannot read the file ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(path, None, "is not a text file (not UTF-8)", "name a YAML or JSON config file") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(path, None, f"not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}",
                              "fix the JSON syntax (no comments or trailing commas in JSON)") from None
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(path, None, f"not valid YAML{where}: {getattr(exc, 'problem', None) or exc}",
                              "fix the YAML syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(path, None, f"must hold a mapping of settings, not {type(data).__name__}",
                          "write one 'key: value' per setting")
    return data


def detect_format(path: Path, data: dict[str, Any]) -> ConfigFormat:
    keys = set(data)
    if {"id", "method", "target"} <= keys:
        return ConfigFormat.case
    if path.suffix.lower() == ".json":
        if keys & {"zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size"} and not keys & {
                "model_name_or_path", "output_dir", "per_device_train_batch_size"}:
            return ConfigFormat.deepspeed
        return ConfigFormat.training_args
    if path.suffix.lower() in (".yaml", ".yml"):
        return ConfigFormat.llamafactory
    raise ConfigError(path, None, f"unknown config format '{path.suffix}'",
                      "give a LLaMA-Factory YAML (.yaml), a TrainingArguments JSON (.json) or a harness case (.yaml)")


class _Reader:
    """Typed access to one config's keys, with errors that name the file and the key."""

    def __init__(self, path: Path, data: dict[str, Any], prefix: str = ""):
        self.path, self.data, self.prefix = path, data, prefix

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def _fail(self, key: str, problem: str, fix: str = "") -> ConfigError:
        return ConfigError(self.path, self.prefix + key, problem, fix)

    def raw(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key)
        if value is None:
            return default
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.strip().lower() in ("true", "yes", "1")
        raise self._fail(key, f"must be true or false, got {value!r}")

    def int(self, key: str, default: int | None, minimum: int = 0) -> int | None:
        value = self.data.get(key)
        if value is None:
            return default
        if isinstance(value, str) and re.fullmatch(r"\s*-?\d+(\.0*)?(e\d+)?\s*", value):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or float(value) != int(value):
            raise self._fail(key, f"must be a whole number, got {value!r}")
        if int(value) < minimum:
            raise self._fail(key, f"must be at least {minimum}, got {value!r}")
        return int(value)

    def float(self, key: str, default: float | None) -> float | None:
        value = self.data.get(key)
        if value is None:
            return default
        try:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        except (TypeError, ValueError):
            raise self._fail(key, f"must be a number, got {value!r}") from None

    def str(self, key: str, default: str | None) -> str | None:
        value = self.data.get(key)
        return default if value is None else str(value)

    def choice(self, key: str, allowed: tuple[str, ...], default: str | None, why: str = "") -> str | None:
        value = self.str(key, default)
        if value is not None and value.lower() not in allowed:
            raise self._fail(key, f"'{value}' is not supported{why}", f"use one of: {', '.join(allowed)}")
        return None if value is None else value.lower()


def _check_keys(path: Path, data: dict[str, Any], known: frozenset[str], prefix: str = "",
                extra: tuple[str, ...] = ()) -> None:
    unknown = [k for k in data if k not in known and k not in extra]
    if any(isinstance(k, str) and k.isidentifier() for k in unknown) and prefix == "" and known is not DEEPSPEED_KEYS:
        unknown = [k for k in unknown if k not in _installed_training_fields()]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.75)
        fix = (f"did you mean '{close[0]}'?" if close
               else "remove it, or check the spelling against the tool's documentation")
        more = f" (and {len(unknown) - 1} more: {', '.join(map(str, unknown[1:4]))})" if len(unknown) > 1 else ""
        raise ConfigError(path, prefix + str(key), f"unknown key{more}", fix)


def _installed_training_fields() -> frozenset[str]:
    """TrainingArguments fields of the installed transformers, for fields newer than the list here.
    Asked only when a key is not in the list (importing transformers takes seconds)."""
    import dataclasses
    import logging

    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # optional kernels announce themselves while transformers imports
    try:
        from transformers import Seq2SeqTrainingArguments

        return frozenset(f.name for f in dataclasses.fields(Seq2SeqTrainingArguments))
    except Exception:  # noqa: BLE001 - no transformers, or one that fails to import: the list alone decides
        return frozenset()
    finally:
        logging.disable(previous)


def resolve_path(ref: str, config_path: Path) -> Path:
    """A path as written in a config: relative to the config's folder, else to the working directory."""
    candidate = Path(ref).expanduser()
    if candidate.is_absolute():
        return candidate
    for base in (config_path.parent, Path.cwd()):
        if (base / candidate).exists():
            return base / candidate
    return config_path.parent / candidate


# --- DeepSpeed JSON -----------------------------------------------------------------------------


def _auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def read_deepspeed(path: Path, data: dict[str, Any], hidden_size: int, key_prefix: str = "") -> DeepSpeedFile:
    """A DeepSpeed config with its "auto" buckets and thresholds resolved for this model's hidden size
    (what transformers' HfTrainerDeepSpeedConfig writes) and left-out keys at DeepSpeed's defaults."""
    _check_keys(path, data, DEEPSPEED_KEYS, prefix=key_prefix)
    top = _Reader(path, data, key_prefix)
    zero_raw = data.get("zero_optimization") or {}
    if not isinstance(zero_raw, dict):
        raise ConfigError(path, key_prefix + "zero_optimization", "must be a mapping")
    zprefix = key_prefix + "zero_optimization."
    _check_keys(path, zero_raw, DEEPSPEED_ZERO_KEYS, prefix=zprefix)
    zero = {DEEPSPEED_ALIASES.get(k, k): v for k, v in zero_raw.items()}
    z = _Reader(path, zero, zprefix)
    stage = z.int("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise z._fail("stage", f"ZeRO stage {stage} does not exist", "use 0, 1, 2 or 3")

    def offload(name: str) -> tuple[str, bool]:
        block = zero.get(name)
        if block is None:
            return "none", False
        if not isinstance(block, dict):
            raise z._fail(name, "must be a mapping like {\"device\": \"cpu\", \"pin_memory\": false}")
        _check_keys(path, block, DEEPSPEED_OFFLOAD_KEYS, prefix=f"{zprefix}{name}.")
        r = _Reader(path, block, f"{zprefix}{name}.")
        device = r.choice("device", ("none", "cpu", "nvme"), "none")
        if device == "nvme":
            raise r._fail("device", "NVMe offload is not modelled by the predictor", "offload to 'cpu' or 'none'")
        return device, device != "none" and r.bool("pin_memory", False)

    opt_dev, opt_pin = offload("offload_optimizer")
    par_dev, par_pin = offload("offload_param")
    if zero.get("cpu_offload") is True and opt_dev == "none":  # DeepSpeed's legacy spelling
        opt_dev, opt_pin = "cpu", z.bool("cpu_offload_use_pin_memory", False)
    if par_dev != "none" and stage != 3:
        raise z._fail("offload_param", f"parameter offload needs ZeRO stage 3 (this config has stage {stage})",
                      "set zero_optimization.stage to 3, or remove offload_param")
    if opt_dev != "none" and stage == 0:
        raise z._fail("offload_optimizer", "optimizer offload needs ZeRO stage 1, 2 or 3", "set a stage")

    auto = auto_sizes(hidden_size)

    def size(key: str) -> int | None:
        value = zero.get(key)
        if _auto(value):
            return auto.get(key, DEEPSPEED_DEFAULTS.get(key))
        if value is None:
            return DEEPSPEED_DEFAULTS.get(key)
        return z.int(key, None)

    block: dict[str, Any] = {
        "stage": stage,
        "offload_optimizer": opt_dev,
        "offload_param": par_dev,
        "pin_memory": opt_pin or par_pin,
        "overlap_comm": z.bool("overlap_comm", stage == 3),
        "contiguous_gradients": z.bool("contiguous_gradients", True),
        "reduce_bucket_size": size("reduce_bucket_size"),
        "allgather_bucket_size": size("allgather_bucket_size"),
        "sub_group_size": size("sub_group_size"),
    }
    if stage == 3:
        for key in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                    "stage3_max_live_parameters", "stage3_max_reuse_distance"):
            block[key] = size(key)

    def precision(name: str) -> bool | None:
        sub = data.get(name)
        if sub is None:
            return None
        enabled = sub.get("enabled") if isinstance(sub, dict) else sub
        if enabled is None or _auto(enabled):
            return None
        return _Reader(path, {"enabled": enabled}, f"{key_prefix}{name}.").bool("enabled", False)

    def batch(key: str) -> int | None:
        return None if _auto(data.get(key)) else top.int(key, None, minimum=1)

    ac = data.get("activation_checkpointing") or {}
    ac_on = tuple(k for k, v in ac.items() if v is True) if isinstance(ac, dict) else ()
    return DeepSpeedFile(
        path=path, key_prefix=key_prefix, keys=frozenset(data), stage=stage,
        train_batch_size=batch("train_batch_size"), micro_batch=batch("train_micro_batch_size_per_gpu"),
        grad_accum=batch("gradient_accumulation_steps"), fp16=precision("fp16"),
        bf16=precision("bf16") if "bf16" in data else precision("bfloat16"),
        offload_optimizer=opt_dev, offload_param=par_dev, offload_pin_memory=opt_pin or par_pin,
        activation_checkpointing=ac_on, zero=block,
    )


def _deepspeed_of(config_path: Path, ref: Any, spec: JobSpec,
                  hidden_size: int) -> tuple[DeepSpeedFile | None, list[str]]:
    """The DeepSpeed config of a job: --deepspeed, else the config's `deepspeed` (a path or inline)."""
    if spec.deepspeed is not None:
        path = Path(spec.deepspeed)
        notes = []
        if isinstance(ref, str) and resolve_path(ref, config_path).resolve() != path.resolve():
            notes.append(f"--deepspeed {path} replaces the config's deepspeed: {ref}")
        return read_deepspeed(path, _read_deepspeed_file(path, None, None), hidden_size), notes
    if ref is None:
        return None, []
    if isinstance(ref, dict):
        return read_deepspeed(config_path, ref, hidden_size, key_prefix="deepspeed."), []
    path = resolve_path(str(ref), config_path)
    return read_deepspeed(path, _read_deepspeed_file(path, config_path, "deepspeed"), hidden_size), []


def _read_deepspeed_file(path: Path, referrer: Path | None, key: str | None) -> dict[str, Any]:
    if not path.is_file():
        if referrer is not None:
            raise ConfigError(referrer, key, f"the DeepSpeed config {path} does not exist",
                              "give a path relative to this config's folder, or pass --deepspeed")
        raise ConfigError(path, None, "no such DeepSpeed config file", "check the --deepspeed path")
    data = read_mapping(path)
    if detect_format(path, data) != ConfigFormat.deepspeed and "zero_optimization" not in data:
        raise ConfigError(path, None, "is not a DeepSpeed config (no zero_optimization or batch keys)",
                          "pass a DeepSpeed JSON such as LLaMA-Factory's ds_z3_config.json")
    return data


# --- Model --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Model:
    arch: Architecture
    case_model: str  # the registry name a Case carries
    note: str | None


def _model_of(path: Path, reference: str | None, spec: JobSpec, key: str = "model_name_or_path") -> _Model:
    """The model a config names (or --model names), as an architecture and a registry name."""
    if spec.model is not None:
        reference, where, base_dirs = spec.model, (None, "--model"), (Path.cwd(),)
    else:
        where, base_dirs = (path, key), (path.parent, Path.cwd())
    if reference is None:
        raise ConfigError(path, key, "no model named", "set model_name_or_path (or pass --model)")
    try:
        resolved = resolve_model(str(reference), base_dirs)
    except ModelSourceError as exc:
        raise ConfigError(*where, exc.problem, exc.fix) from None
    note = None
    if resolved.registry_name is None:
        note = (f"model from {resolved.arch.source}: not in the registry; the case names its closest entry "
                f"({resolved.closest_registry_name}) but the prediction uses the local config")
    return _Model(arch=resolved.arch, case_model=resolved.closest_registry_name, note=note)


# --- Building the case --------------------------------------------------------------------------


def _slug(path: Path) -> str:
    slug = re.sub(r"[^a-z0-9.]+", "-", path.stem.lower()).strip("-.")
    return slug or "config"


@dataclass(frozen=True)
class _Job:
    """The cards and processes of a job, settled: the command line's, else the case file's."""

    gpus: int
    gpu_memory: int
    procs_per_gpu: int
    headroom: float
    host_ram: int | None
    vendor: str

    def ranks(self, launcher: str, has_deepspeed: bool, notes: list[str]) -> int:
        """Ranks of one job: one per GPU, except jobs sharing cards, plain python, and plain DDP."""
        if self.procs_per_gpu > 1:
            notes.append(f"{self.procs_per_gpu} independent single-rank jobs per card")
            return 1
        if launcher == "python":
            return 1
        if not has_deepspeed and self.gpus > 1:
            notes.append("no DeepSpeed: each data-parallel rank holds a full replica; predicted as one rank")
            return 1
        return self.gpus

    def target(self, card_name: str | None = None) -> dict[str, Any]:
        """The case's `target` block."""
        card = {"vendor": self.vendor, "name": card_name or f"{fmt_gib(self.gpu_memory)} card",
                "memory": f"{self.gpu_memory} B", "count": self.gpus}
        return {"card": card, "headroom": self.headroom,
                "host_ram": None if self.host_ram is None else f"{self.host_ram} B"}


def _job(spec: JobSpec, path: Path, case: Case | None = None) -> _Job:
    """Cards and processes from the command line, else from the case file's target."""
    gpus = spec.gpus if spec.gpus is not None else case and case.target.card.count
    memory = spec.gpu_memory if spec.gpu_memory is not None else case and case.target.card.memory
    if gpus is None:
        raise ConfigError(path, None, "the number of GPUs is not known", "pass --gpus N")
    if memory is None:
        raise ConfigError(path, None, "the memory per GPU is not known", "pass --gpu-memory, e.g. --gpu-memory 64GiB")
    if gpus < 1:
        raise ConfigError(None, "--gpus", f"must be at least 1, got {gpus}")
    procs = spec.procs_per_gpu if spec.procs_per_gpu is not None else (case.launch.procs_per_card if case else 1)
    if procs < 1:
        raise ConfigError(None, "--procs-per-gpu", f"must be at least 1, got {procs}")
    headroom = spec.headroom if spec.headroom is not None else (case.target.headroom if case else 0.9)
    if not 0 < headroom <= 1:
        raise ConfigError(None, "--headroom", f"must be in (0, 1], got {headroom}", "e.g. --headroom 0.9")
    host_ram = spec.host_ram if spec.host_ram is not None else (case.target.host_ram if case else None)
    vendor = spec.vendor or (case.target.card.vendor if case else "nvidia")
    return _Job(gpus=gpus, gpu_memory=memory, procs_per_gpu=procs, headroom=headroom, host_ram=host_ram, vendor=vendor)


def _case_launcher(launcher: str, has_deepspeed: bool) -> str:
    """The case's launcher for how the user starts the job (DeepSpeed's launcher needs a DeepSpeed config)."""
    return "torchrun" if launcher == "deepspeed" and not has_deepspeed else _CASE_LAUNCHER[launcher]


# Where a case field came from, to name the key a user changes when the combination is invalid.
_SOURCE_KEYS = {
    ConfigFormat.llamafactory: {
        "method.lora.r": "lora_rank", "method.lora.alpha": "lora_alpha", "method.lora.dropout": "lora_dropout",
        "method.lora.targets": "lora_target", "train.seq_len": "cutoff_len",
    },
    ConfigFormat.training_args: {
        "method.lora.r": "lora_r", "method.lora.alpha": "lora_alpha", "method.lora.dropout": "lora_dropout",
        "method.lora.targets": "lora_target_modules", "train.seq_len": "max_length",
    },
}
_COMMON_SOURCE_KEYS = {
    "train.micro_batch": "per_device_train_batch_size", "train.grad_accum": "gradient_accumulation_steps",
    "train.learning_rate": "learning_rate", "train.dataloader_workers": "dataloader_num_workers",
    "train.prefetch_factor": "dataloader_prefetch_factor", "target.card.memory": "--gpu-memory",
    "target.card.count": "--gpus", "target.headroom": "--headroom", "target.host_ram": "--host-ram",
}


def _source_key(fmt: ConfigFormat, loc: tuple) -> str | None:
    field = ".".join(str(p) for p in loc)
    return {**_COMMON_SOURCE_KEYS, **_SOURCE_KEYS.get(fmt, {})}.get(field)


def _build_case(path: Path, fmt: ConfigFormat, *, model: str, stack: str, precision: str,
                method: dict, train: dict, ds: DeepSpeedFile | None, launcher: str, ranks: int,
                init_order: str, job: _Job) -> Case:
    data = {
        "id": f"{IMPORTED_GUIDE}-{_slug(path)}",
        "guide": IMPORTED_GUIDE,
        "family": f"imported-{fmt.value}",
        "title": f"imported from {path.name}",
        "role": "fix",
        "model": model,
        "stack": stack,
        "precision": precision,
        "method": method,
        "train": train,
        "deepspeed": None if ds is None else {k: v for k, v in ds.zero.items() if v is not None},
        "launch": {"launcher": _case_launcher(launcher, ds is not None), "ranks": ranks,
                   "procs_per_card": job.procs_per_gpu,
                   "init_order": init_order if ds is not None and ds.stage == 3 else "deepspeed_first"},
        "target": job.target(),
        "expect": {"outcome": "fits"},
    }
    try:
        return Case.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = _source_key(fmt, tuple(first["loc"]))
        if key is not None:
            given = "" if isinstance(first.get("input"), dict) else f" (got {first.get('input')!r})"
            raise ConfigError(path, key, f"{first['msg']}{given}", f"change {key}") from None
        problems = "; ".join(_describe(e) for e in exc.errors())
        raise ConfigError(path, None, f"the settings do not make a consistent job: {problems}",
                          "change the settings named above") from None


def _lora_targets(value: Any, path: Path, key: str) -> list[str] | str:
    if isinstance(value, str):
        if value.strip().lower() == "all":
            return "all"
        names = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        names = [v.strip() for v in value if v.strip()]
    else:
        raise ConfigError(path, key, f"must be 'all' or a comma-separated list of module names, got {value!r}")
    if not names:
        raise ConfigError(path, key, "is empty", "name at least one module (q_proj,v_proj) or write 'all'")
    return "all" if "all" in names else names


def _model_precision(arch: Architecture) -> str:
    dtype = str(arch.config.get("torch_dtype") or arch.config.get("dtype") or "bfloat16")
    return {"float16": "fp16", "float32": "fp32"}.get(dtype, "bf16")


def _init_order(spec: JobSpec, default: InitOrder) -> InitOrder:
    return scan_init_order(spec.script) if spec.script is not None else default


def _finish(path: Path, fmt: ConfigFormat, training: TrainingFile, model: _Model, ds: DeepSpeedFile | None,
            spec: JobSpec, job: _Job, launcher: str, launcher_from: str, stack: str,
            precision: str, method: dict, train: dict, init: InitOrder, notes: list[str]) -> ImportedConfig:
    if model.note:
        notes.append(model.note)
    ranks = job.ranks(launcher, ds is not None, notes)
    unpredictable = None
    case = None
    if method["kind"] == "qlora" and ds is not None and ds.stage == 3:
        unpredictable = "4-bit weights under ZeRO-3 are outside what the predictor models (see the lint)"
    else:
        case = _build_case(path, fmt, model=model.case_model, stack=stack, precision=precision, method=method,
                           train=train, ds=ds, launcher=launcher, ranks=ranks, init_order=init.order, job=job)
    return ImportedConfig(
        case=case, arch=model.arch, training=training, deepspeed=ds, launcher=launcher,
        launcher_from=launcher_from, world_size=ranks, gpus=job.gpus, gpu_memory=job.gpu_memory,
        procs_per_gpu=job.procs_per_gpu, headroom=job.headroom, host_ram=job.host_ram,
        init_order=init, unpredictable=unpredictable, notes=tuple(notes),
    )


def _launcher(spec: JobSpec, default: str, default_from: str) -> tuple[str, str]:
    if spec.launcher is None:
        return default, default_from
    if spec.launcher not in LAUNCHERS:
        raise ConfigError(None, "--launcher", f"'{spec.launcher}' is not a launcher the harness knows",
                          f"use one of: {', '.join(LAUNCHERS)}")
    return spec.launcher, "--launcher"


# --- LLaMA-Factory YAML -------------------------------------------------------------------------

_LF_STAGES = ("sft", "pt")
_QUANT_METHODS = ("bnb", "bitsandbytes")


def _import_llamafactory(path: Path, data: dict[str, Any], spec: JobSpec) -> ImportedConfig:
    _check_keys(path, data, LLAMAFACTORY_KEYS | HF_TRAINING_KEYS)
    r = _Reader(path, data)
    notes: list[str] = []
    r.choice("stage", _LF_STAGES, "sft", why=" (reward models, PPO, DPO and KTO keep a second model and paired "
             "sequences, which the predictor does not model)")
    finetuning = r.choice("finetuning_type", ("lora", "full"), "lora",
                          why=" (freeze and OFT training are not modelled; the nearest are lora and full)")
    bits = r.int("quantization_bit", None)
    if bits is not None and bits != 4:
        raise r._fail("quantization_bit", f"{bits}-bit weights are not modelled by the predictor (only 4-bit nf4/fp4)",
                      "use quantization_bit: 4, or remove it")
    if bits is not None:
        r.choice("quantization_method", _QUANT_METHODS, "bnb", why=" (only bitsandbytes 4-bit is modelled)")
        if finetuning == "full":
            raise r._fail("quantization_bit", "quantized weights cannot be fully fine-tuned (finetuning_type: full)",
                          "use finetuning_type: lora with quantization_bit, or remove quantization_bit")
    for key in ("fsdp", "fsdp_config"):
        if r.has(key) and r.raw(key) not in ("", [], {}):
            raise r._fail(key, "FSDP is not modelled; the harness shards through DeepSpeed only",
                          "use a DeepSpeed config (deepspeed: ds_z3_config.json)")
    for key in ("use_dora", "pissa_init", "use_galore", "use_apollo", "use_badam", "use_unsloth", "enable_liger_kernel",
                "use_llama_pro", "use_adam_mini"):
        if r.bool(key, False):
            notes.append(f"{key}: true is not modelled; the prediction is for plain {finetuning}")
    if r.has("additional_target"):
        notes.append("additional_target: modules trained in full beside LoRA are not modelled")

    disable_gc = r.bool("disable_gradient_checkpointing", False)
    if disable_gc and r.bool("gradient_checkpointing", False):
        raise ConfigError(path, "gradient_checkpointing",
                          "contradicts disable_gradient_checkpointing: true",
                          "keep one of them (LLaMA-Factory checkpoints by default; "
                          "disable_gradient_checkpointing: true turns it off)")
    gc = r.bool("gradient_checkpointing", False) or not disable_gc
    gc_key = ("gradient_checkpointing" if r.has("gradient_checkpointing")
              else "disable_gradient_checkpointing" if r.has("disable_gradient_checkpointing") else "")

    fp16, bf16 = r.bool("fp16", False), r.bool("bf16", False) or r.bool("pure_bf16", False)
    model = _model_of(path, r.str("model_name_or_path", None), spec)
    precision = "bf16" if bf16 else "fp16" if fp16 else _model_precision(model.arch)
    if not (fp16 or bf16):
        notes.append(f"neither bf16 nor fp16 set: LLaMA-Factory computes in the model's dtype ({precision})")
    ds, ds_notes = _deepspeed_of(path, data.get("deepspeed"), spec, int(model.arch.config["hidden_size"]))
    notes += ds_notes

    rank = r.int("lora_rank", 8, minimum=1)
    lora = {"r": rank, "alpha": r.float("lora_alpha", None) or 2 * rank, "dropout": r.float("lora_dropout", 0.0),
            "targets": _lora_targets(r.raw("lora_target", "all"), path, "lora_target")}
    method: dict[str, Any] = {"kind": "full"} if finetuning == "full" else {"kind": "lora", "lora": lora}
    if bits == 4:
        method = {"kind": "qlora", "lora": lora, "quantization": {
            "bits": 4, "quant_type": r.choice("quantization_type", ("nf4", "fp4"), "nf4"),
            "double_quant": r.bool("double_quantization", True),
            "compute_dtype": precision if precision != "fp32" else "bf16"}}
    train = _train_block(r, seq_len=r.int("cutoff_len", 2048, minimum=1), gc=gc)
    training = TrainingFile(
        path=path, format=ConfigFormat.llamafactory, keys=frozenset(data), micro_batch=train["micro_batch"],
        grad_accum=train["grad_accum"], seq_len=train["seq_len"], fp16=fp16, bf16=bf16,
        eval_strategy=r.str("eval_strategy", None), evaluation_strategy=r.str("evaluation_strategy", None),
        gradient_checkpointing=gc, gradient_checkpointing_key=gc_key, method=method["kind"],
        quantization_bits=bits, deepspeed_ref=data.get("deepspeed") if isinstance(data.get("deepspeed"), str) else None,
    )
    launcher, launcher_from = _launcher(spec, "llamafactory-cli", "llamafactory-cli")
    job = _job(spec, path)
    init = _init_order(spec, InitOrder("deepspeed_first",
                                       "LLaMA-Factory configures DeepSpeed before it loads the model"))
    return _finish(path, ConfigFormat.llamafactory, training, model, ds, spec, job, launcher, launcher_from,
                   spec.stack or "llamafactory", precision, method, train, init, notes)


def _train_block(r: _Reader, seq_len: int, gc: bool) -> dict[str, Any]:
    train = {
        "micro_batch": r.int("per_device_train_batch_size", 8, minimum=1),
        "grad_accum": r.int("gradient_accumulation_steps", 1, minimum=1),
        "seq_len": seq_len,
        "gradient_checkpointing": gc,
        "learning_rate": r.float("learning_rate", 5e-5),
        "dataloader_workers": r.int("dataloader_num_workers", 0),
        "pin_memory": r.bool("dataloader_pin_memory", True),
    }
    prefetch = r.int("dataloader_prefetch_factor", None, minimum=1)
    if prefetch is not None:
        train["prefetch_factor"] = prefetch
    return train


# --- Hugging Face TrainingArguments JSON --------------------------------------------------------


def _import_training_args(path: Path, data: dict[str, Any], spec: JobSpec) -> ImportedConfig:
    _check_keys(path, data, HF_TRAINING_KEYS | SCRIPT_KEYS)
    r = _Reader(path, data)
    notes: list[str] = []
    for key in ("fsdp", "fsdp_config"):
        if r.raw(key) not in (None, "", [], {}):
            raise r._fail(key, "FSDP is not modelled; the harness shards through DeepSpeed only",
                          "use a DeepSpeed config")
    if r.bool("load_in_8bit", False) or r.bool("use_8bit", False):
        key = "load_in_8bit" if r.has("load_in_8bit") else "use_8bit"
        raise r._fail(key, "8-bit weights are not modelled by the predictor (only 4-bit nf4/fp4)", "use load_in_4bit")
    four_bit = r.bool("load_in_4bit", False) or r.bool("use_4bit", False)
    lora_keys = [k for k in ("lora_r", "lora_rank") if r.has(k)]
    if len(lora_keys) == 2 and r.int("lora_r", 0) != r.int("lora_rank", 0):
        raise r._fail("lora_rank", f"contradicts lora_r ({r.raw('lora_r')} vs {r.raw('lora_rank')})",
                      "keep one of them")
    use_lora = bool(lora_keys) or r.bool("use_peft", False)
    if four_bit and not use_lora:
        raise r._fail("load_in_4bit", "4-bit weights can only be trained through LoRA adapters, and no lora_r is set",
                      "set lora_r (and lora_alpha, lora_target_modules)")
    seq_keys = [k for k in ("max_length", "max_seq_length", "model_max_length") if r.has(k)]
    if not seq_keys:
        raise ConfigError(path, "max_length", "no sequence length is set",
                          "set max_length (TRL SFTConfig) or max_seq_length to the tokens per sample")
    seq_len = r.int(seq_keys[0], None, minimum=1)
    if len({r.int(k, None) for k in seq_keys}) > 1:
        raise r._fail(seq_keys[1], f"contradicts {seq_keys[0]} ({r.raw(seq_keys[1])} vs {seq_len})", "keep one of them")

    model = _model_of(path, r.str("model_name_or_path", None), spec)
    fp16, bf16 = r.bool("fp16", False), r.bool("bf16", False)
    precision = "bf16" if bf16 else "fp16" if fp16 else _model_precision(model.arch)
    ds, ds_notes = _deepspeed_of(path, data.get("deepspeed"), spec, int(model.arch.config["hidden_size"]))
    notes += ds_notes
    method: dict[str, Any] = {"kind": "full"}
    if use_lora:
        rank = r.int(lora_keys[0], 8, minimum=1) if lora_keys else 8
        target_key = next((k for k in ("lora_target_modules", "target_modules", "lora_target") if r.has(k)), None)
        if target_key is None:
            raise ConfigError(path, "lora_target_modules", "LoRA is on but no target modules are named",
                              "set lora_target_modules, e.g. \"q_proj,k_proj,v_proj,o_proj\" or \"all\"")
        lora = {"r": rank, "alpha": r.float("lora_alpha", None) or 2 * rank, "dropout": r.float("lora_dropout", 0.0),
                "targets": _lora_targets(data[target_key], path, target_key)}
        method = {"kind": "lora", "lora": lora}
        if four_bit:
            compute = r.str("bnb_4bit_compute_dtype", None)
            compute = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", None: precision}.get(compute, compute)
            if compute not in ("bf16", "fp16", "fp32"):
                raise r._fail("bnb_4bit_compute_dtype", f"'{r.raw('bnb_4bit_compute_dtype')}' is not a dtype",
                              "use bfloat16 or float16")
            method = {"kind": "qlora", "lora": lora, "quantization": {
                "bits": 4, "quant_type": r.choice("bnb_4bit_quant_type", ("nf4", "fp4"), "nf4"),
                "double_quant": r.bool("bnb_4bit_use_double_quant", False), "compute_dtype": compute}}
    gc = r.bool("gradient_checkpointing", False)
    train = _train_block(r, seq_len=seq_len, gc=gc)
    if r.has("logits_to_keep"):
        train["logits_to_keep"] = r.int("logits_to_keep", None)
    training = TrainingFile(
        path=path, format=ConfigFormat.training_args, keys=frozenset(data), micro_batch=train["micro_batch"],
        grad_accum=train["grad_accum"], seq_len=seq_len, fp16=fp16, bf16=bf16,
        eval_strategy=r.str("eval_strategy", None), evaluation_strategy=r.str("evaluation_strategy", None),
        gradient_checkpointing=gc,
        gradient_checkpointing_key="gradient_checkpointing" if r.has("gradient_checkpointing") else "",
        method=method["kind"], quantization_bits=4 if four_bit else None,
        deepspeed_ref=data.get("deepspeed") if isinstance(data.get("deepspeed"), str) else None,
    )
    job = _job(spec, path)
    default_launcher = "torchrun" if job.gpus > 1 and job.procs_per_gpu == 1 else "python"
    launcher, launcher_from = _launcher(spec, default_launcher, "assumed")
    if launcher_from == "assumed" and job.gpus > 1:
        notes.append(f"launcher not stated: assumed {launcher} (pass --launcher)")
    stack = spec.stack or ("peft" if four_bit else "plain")
    init = _init_order(spec, InitOrder("deepspeed_first", "assumed: TrainingArguments are built before the model "
                                       "(pass --script to check the training script)"))
    return _finish(path, ConfigFormat.training_args, training, model, ds, spec, job, launcher, launcher_from,
                   stack, precision, method, train, init, notes)


# --- The harness's own case files ---------------------------------------------------------------


def _import_case(path: Path, spec: JobSpec) -> ImportedConfig:
    """A harness case file; the command line may change its cards, processes, launcher and model."""
    try:
        written = load_case(path)
    except CaseError as exc:
        raise ConfigError(path, None, "invalid case file: " + "; ".join(exc.problems),
                          "see the schema in harness/schema.py") from None
    job = _job(spec, path, written)
    notes: list[str] = []
    model = _model_of(path, written.model, spec, key="model")
    launcher, launcher_from = _launcher(spec, written.launch.launcher, "the case file")
    has_ds = written.deepspeed is not None
    init = scan_init_order(spec.script) if spec.script is not None else \
        InitOrder(written.launch.init_order, "the case file's launch.init_order", path)
    data = written.model_dump(mode="json")
    data["model"] = model.case_model
    ranks = written.launch.ranks
    if spec.gpus is not None or spec.procs_per_gpu is not None or spec.launcher is not None:
        ranks = job.ranks(launcher, has_ds, notes)
    data["launch"].update(launcher=_case_launcher(launcher, has_ds), ranks=ranks, procs_per_card=job.procs_per_gpu,
                          init_order=init.order if has_ds and written.deepspeed.stage == 3 else "deepspeed_first")
    data["target"] = job.target(written.target.card.name if spec.gpu_memory is None else None)
    try:
        case = Case.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(_describe(e) for e in exc.errors())
        raise ConfigError(path, None, f"with the command-line settings: {problems}",
                          "change the flags or the case file") from None
    ds = None if case.deepspeed is None else _deepspeed_of_case(path, case)
    training = TrainingFile(
        path=path, format=ConfigFormat.case, keys=frozenset(read_mapping(path)),
        micro_batch=case.train.micro_batch, grad_accum=case.train.grad_accum, seq_len=case.train.seq_len,
        fp16=case.precision == Precision.fp16, bf16=case.precision == Precision.bf16, eval_strategy=None,
        evaluation_strategy=None, gradient_checkpointing=case.train.gradient_checkpointing,
        gradient_checkpointing_key="train.gradient_checkpointing", method=case.method.kind,
        quantization_bits=4 if case.method.quantization else None, deepspeed_ref=None,
    )
    if model.note:
        notes.append(model.note)
    return ImportedConfig(
        case=case, arch=model.arch, training=training, deepspeed=ds, launcher=launcher, launcher_from=launcher_from,
        world_size=case.launch.ranks, gpus=job.gpus, gpu_memory=job.gpu_memory, procs_per_gpu=job.procs_per_gpu,
        headroom=job.headroom, host_ram=job.host_ram, init_order=init, notes=tuple(notes),
    )


def _deepspeed_of_case(path: Path, case: Case) -> DeepSpeedFile:
    """A case's `deepspeed` block seen as a DeepSpeed file (no "auto", no batch keys, no precision)."""
    d = case.deepspeed
    offloaded = Offload.cpu in (d.offload_optimizer, d.offload_param)
    return DeepSpeedFile(path=path, key_prefix="deepspeed.", keys=frozenset(d.model_fields_set), stage=d.stage,
                         train_batch_size=None, micro_batch=None, grad_accum=None, fp16=None, bf16=None,
                         offload_optimizer=d.offload_optimizer.value, offload_param=d.offload_param.value,
                         offload_pin_memory=d.pin_memory and offloaded, activation_checkpointing=(),
                         zero=d.model_dump(mode="json"))


# --- Training scripts: does the model come before DeepSpeed? -------------------------------------

_MODEL_LOADERS = ("from_pretrained", "from_config")
_DS_CONFIGURERS = ("HfDeepSpeedConfig", "TrainingArguments", "Seq2SeqTrainingArguments", "SFTConfig", "Init",
                   "initialize", "Accelerator")


def scan_init_order(script: Path) -> InitOrder:
    """Which comes first in a training script: building the model (`*.from_pretrained`, `from_config`)
    or configuring DeepSpeed (`HfDeepSpeedConfig`, `TrainingArguments(deepspeed=...)`, `zero.Init`,
    `deepspeed.initialize`). Under ZeRO-3 a model built first is materialised whole on every rank
    (guide 002). A static look at the source: the first of each, by line."""
    script = Path(script)
    try:
        tree = ast.parse(script.read_text(encoding="utf-8"), filename=str(script))
    except (FileNotFoundError, IsADirectoryError):
        raise ConfigError(script, None, "no such training script", "check the --script path") from None
    except UnicodeDecodeError:
        raise ConfigError(script, None, "is not a text file (not UTF-8)", "name the Python training script") from None
    except SyntaxError as exc:
        raise ConfigError(script, None, f"not valid Python at line {exc.lineno}: {exc.msg}") from None
    loads, configures = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            callee = ast.unparse(node.func)
            if name in _MODEL_LOADERS and "Tokenizer" not in callee and "Config." not in callee:
                loads.append(node.lineno)
            elif name.endswith(_DS_CONFIGURERS) or name in _DS_CONFIGURERS:
                configures.append(node.lineno)
    if not loads:
        return InitOrder("deepspeed_first", f"{script.name}: no from_pretrained/from_config call found", script)
    first_load = min(loads)
    first_conf = min(configures) if configures else None
    if first_conf is None or first_load < first_conf:
        after = (f", {script.name}:{first_conf} configures DeepSpeed" if first_conf
                 else ", and nothing configures DeepSpeed before it")
        return InitOrder("model_first", f"{script.name}:{first_load} builds the model{after}", script)
    return InitOrder("deepspeed_first", f"{script.name}:{first_conf} configures DeepSpeed before "
                     f"{script.name}:{first_load} builds the model", script)


# --- Entry point --------------------------------------------------------------------------------


def import_config(path: Path | str, spec: JobSpec = JobSpec()) -> ImportedConfig:
    """Read a training config (any supported format) and the DeepSpeed config it names."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(path, None, "is a directory, not a config file", "name a YAML or JSON config file")
    if spec.deepspeed is not None and not Path(spec.deepspeed).is_file():
        raise ConfigError(spec.deepspeed, None, "no such DeepSpeed config file", "check the --deepspeed path")
    data = read_mapping(path)
    fmt = detect_format(path, data)
    if fmt == ConfigFormat.case:
        return _import_case(path, spec)
    if fmt == ConfigFormat.deepspeed:
        raise ConfigError(path, None, "is a DeepSpeed config; it does not name a model or a batch",
                          "check the training config and pass this file with --deepspeed")
    if fmt == ConfigFormat.llamafactory:
        return _import_llamafactory(path, data, spec)
    return _import_training_args(path, data, spec)


def parse_size_arg(text: str, flag: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise ConfigError(None, flag, str(exc), "write a size with a unit, e.g. 64GiB or 16 GB") from None


# --- Known keys, kept as data -------------------------------------------------------------------
# Known keys that do not change memory are accepted and ignored; a key in none of these lists is an
# error naming the key (with the closest known one), so a typo never passes silently. Where a newer
# transformers adds a TrainingArguments field, the installed one is asked before a key is called unknown.

# Hugging Face transformers TrainingArguments / Seq2SeqTrainingArguments (4.4x-5.x).
HF_TRAINING_KEYS = frozenset("""
output_dir overwrite_output_dir do_train do_eval do_predict eval_strategy evaluation_strategy
prediction_loss_only per_device_train_batch_size per_device_eval_batch_size per_gpu_train_batch_size
per_gpu_eval_batch_size gradient_accumulation_steps eval_accumulation_steps eval_delay
torch_empty_cache_steps learning_rate weight_decay adam_beta1 adam_beta2 adam_epsilon max_grad_norm
num_train_epochs max_steps lr_scheduler_type lr_scheduler_kwargs warmup_ratio warmup_steps log_level
log_level_replica log_on_each_node logging_dir logging_strategy logging_first_step logging_steps
logging_nan_inf_filter save_strategy save_steps save_total_limit save_safetensors save_on_each_node
save_only_model restore_callback_states_from_checkpoint no_cuda use_cpu use_mps_device seed data_seed
jit_mode_eval use_ipex bf16 fp16 fp16_opt_level half_precision_backend bf16_full_eval fp16_full_eval
tf32 local_rank ddp_backend tpu_num_cores tpu_metrics_debug debug dataloader_drop_last eval_steps
dataloader_num_workers dataloader_prefetch_factor past_index run_name disable_tqdm remove_unused_columns
label_names load_best_model_at_end metric_for_best_model greater_is_better ignore_data_skip fsdp
fsdp_min_num_params fsdp_config fsdp_transformer_layer_cls_to_wrap accelerator_config
parallelism_config deepspeed label_smoothing_factor optim optim_args adafactor group_by_length
length_column_name report_to project trackio_space_id ddp_find_unused_parameters ddp_bucket_cap_mb
ddp_broadcast_buffers dataloader_pin_memory dataloader_persistent_workers skip_memory_metrics
use_legacy_prediction_loop push_to_hub resume_from_checkpoint hub_model_id hub_strategy hub_token
hub_private_repo hub_always_push hub_revision gradient_checkpointing gradient_checkpointing_kwargs
include_inputs_for_metrics include_for_metrics eval_do_concat_batches fp16_backend
push_to_hub_model_id push_to_hub_organization push_to_hub_token mp_parameters auto_find_batch_size
full_determinism torchdynamo ray_scope ddp_timeout torch_compile torch_compile_backend
torch_compile_mode include_tokens_per_second include_num_input_tokens_seen neftune_noise_alpha
optim_target_modules batch_eval_metrics eval_on_start use_liger_kernel liger_kernel_config
eval_use_gather_object average_tokens_across_devices sortish_sampler predict_with_generate
generation_max_length generation_num_beams generation_config
""".split())

# LLaMA-Factory's own arguments (model, data, fine-tuning, generation), as of 0.9.x.
LLAMAFACTORY_KEYS = frozenset("""
model_name_or_path adapter_name_or_path adapter_folder cache_dir use_fast_tokenizer resize_vocab
split_special_tokens add_tokens add_special_tokens new_special_tokens model_revision low_cpu_mem_usage
rope_scaling flash_attn shift_attn mixture_of_depths use_unsloth use_unsloth_gc enable_liger_kernel
moe_aux_loss_coef disable_gradient_checkpointing use_reentrant_gc upcast_layernorm
upcast_lmhead_output train_from_scratch infer_backend offload_folder use_cache infer_dtype
hf_hub_token ms_hub_token om_hub_token print_param_status trust_remote_code compute_dtype device_map
model_max_length block_diag_attn quantization_method quantization_bit quantization_type
double_quantization quantization_device_map export_dir export_size export_device
export_quantization_bit export_quantization_dataset export_quantization_nsamples
export_quantization_maxlen export_legacy_format export_hub_model_id image_max_pixels image_min_pixels
image_do_pan_and_scan crop_to_patches video_max_pixels video_min_pixels video_fps video_maxlen
use_audio_in_video audio_sampling_rate vllm_maxlen vllm_gpu_util vllm_enforce_eager
vllm_max_lora_rank vllm_config sglang_maxlen sglang_mem_fraction sglang_tp_size sglang_config
sglang_lora_backend
template dataset eval_dataset dataset_dir media_dir cutoff_len train_on_prompt mask_history streaming
buffer_size mix_strategy interleave_probs overwrite_cache preprocessing_batch_size
preprocessing_num_workers max_samples eval_num_beams ignore_pad_token_for_loss val_size
eval_on_each_dataset packing neat_packing tool_format default_system enable_thinking tokenized_path
data_shared_file_system
freeze_trainable_layers freeze_trainable_modules freeze_extra_modules freeze_multi_modal_projector
freeze_vision_tower freeze_language_model additional_target lora_alpha lora_dropout lora_rank
lora_target loraplus_lr_ratio loraplus_lr_embedding use_rslora use_dora pissa_init pissa_iter
pissa_convert create_new_adapter module_dropout oft_rank oft_block_size oft_target pref_beta pref_ftx
pref_bco_weight pref_loss dpo_label_smoothing kto_chosen_weight kto_rejected_weight simpo_gamma
ppo_buffer_size ppo_epochs ppo_score_norm ppo_target ppo_whiten_rewards ref_model ref_model_adapters
ref_model_quantization_bit reward_model reward_model_adapters reward_model_quantization_bit
reward_model_type ld_alpha use_galore galore_target galore_rank galore_update_interval galore_scale
galore_proj_type galore_layerwise use_apollo apollo_target apollo_rank apollo_update_interval
apollo_scale apollo_proj apollo_proj_type apollo_scale_type apollo_layerwise apollo_scale_front
use_badam badam_mode badam_start_block badam_switch_mode badam_switch_interval badam_update_ratio
badam_mask_mode badam_verbose use_swanlab swanlab_project swanlab_workspace swanlab_run_name
swanlab_mode swanlab_api_key swanlab_logdir swanlab_lark_webhook_url swanlab_lark_secret pure_bf16
stage finetuning_type use_llama_pro use_adam_mini use_muon use_mca freeze_vision_tower
compute_accuracy disable_shuffling early_stopping_steps plot_loss include_effective_tokens_per_second
do_sample temperature top_p top_k num_beams max_length max_new_tokens repetition_penalty
length_penalty skip_special_tokens
""".split())

# Training scripts that take TrainingArguments as JSON usually add model, data, LoRA and 4-bit
# fields with these (transformers / TRL SFTConfig / peft LoraConfig / BitsAndBytesConfig) names.
SCRIPT_KEYS = frozenset("""
model_name_or_path data_path dataset_name dataset_config train_file validation_file
trust_remote_code torch_dtype dtype attn_implementation model_max_length max_length max_seq_length
packing padding_free dataset_text_field dataset_num_proc completion_only_loss assistant_only_loss
model_init_kwargs dataset_kwargs eos_token pad_token chat_template_path logits_to_keep
use_peft lora_r lora_rank lora_alpha lora_dropout lora_target_modules lora_target target_modules
load_in_4bit use_4bit load_in_8bit use_8bit bnb_4bit_quant_type bnb_4bit_use_double_quant
bnb_4bit_compute_dtype bnb_4bit_quant_storage
""".split())

# DeepSpeed's top-level config keys and its zero_optimization keys (0.14-0.19).
DEEPSPEED_KEYS = frozenset("""
train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps gradient_clipping
steps_per_print wall_clock_breakdown dump_state prescale_gradients gradient_predivide_factor
zero_allow_untested_optimizer zero_force_ds_cpu_optimizer fp16 bf16 bfloat16 amp optimizer scheduler
zero_optimization activation_checkpointing flops_profiler tensorboard wandb csv_monitor comet
comms_logger communication_data_type seq_parallel_communication_data_type data_types elasticity aio
autotuning checkpoint compression_training data_efficiency curriculum_learning pipeline
sparse_attention memory_breakdown disable_allgather gradient_accumulation_dtype
load_universal_checkpoint use_data_before_expert_parallelism graph_harvesting compile timers
hybrid_engine torch_autocast nebula sparse_gradients eigenvalue progressive_layer_drop
quantize_training zero_quantized_weights dataloader_drop_last
""".split())

DEEPSPEED_ZERO_KEYS = frozenset("""
stage contiguous_gradients reduce_scatter reduce_bucket_size use_multi_rank_bucket_allreduce
allgather_partitions allgather_bucket_size overlap_comm load_from_fp32_weights elastic_checkpoint
offload_param offload_optimizer sub_group_size cpu_offload_param cpu_offload_use_pin_memory cpu_offload
prefetch_bucket_size stage3_prefetch_bucket_size param_persistence_threshold
stage3_param_persistence_threshold model_persistence_threshold stage3_model_persistence_threshold
max_live_parameters stage3_max_live_parameters max_reuse_distance stage3_max_reuse_distance
gather_16bit_weights_on_model_save stage3_gather_16bit_weights_on_model_save
stage3_gather_fp16_weights_on_model_save module_granularity_threshold use_all_reduce_for_fetch_params
stage3_use_all_reduce_for_fetch_params ignore_unused_parameters legacy_stage1 round_robin_gradients
zero_hpz_partition_size zero_quantized_weights zero_quantized_nontrainable_weights
zero_quantized_gradients zeropp_loco_param mics_shard_size mics_hierarchical_params_gather
memory_efficient_linear pipeline_loading_checkpoint override_module_apply log_trace_cache_warnings
""".split())

DEEPSPEED_OFFLOAD_KEYS = frozenset("""
device nvme_path buffer_count buffer_size max_in_cpu pin_memory pipeline_read pipeline_write
fast_init ratio
""".split())

# The stage-3 keys DeepSpeed also accepts without their `stage3_` prefix.
DEEPSPEED_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
}

# What DeepSpeed uses where a config leaves a key out (deepspeed/runtime/zero/config.py).
DEEPSPEED_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "sub_group_size": 1_000_000_000,
}
