"""From the settings read to an `ImportedConfig`: the case (validated, errors named by the user's key)
and everything the lints read beside it."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import ValidationError

from harness.premerge.importers.errors import ConfigError
from harness.premerge.importers.job import Job, case_launcher
from harness.premerge.importers.model import ModelRef
from harness.premerge.importers.reading import Reader
from harness.premerge.importers.records import (
    ConfigFormat,
    DeepSpeedFile,
    ImportedConfig,
    InitOrder,
    NotModelled,
    ReadAs,
    TrainingFile,
)
from harness.spec.cases import _describe
from harness.spec.schema import Case

# Where a case field came from, to name the key a user changes when the combination is invalid.
_SOURCE_KEYS = {
    ConfigFormat.llamafactory: {
        "method.lora.r": "lora_rank", "method.lora.alpha": "lora_alpha", "method.lora.dropout": "lora_dropout",
        "method.lora.targets": "lora_target", "train.seq_len": "cutoff_len",
        "train.checkpointing_reentrant": "use_reentrant_gc", "train.attn_implementation": "flash_attn",
    },
    ConfigFormat.training_args: {
        "method.lora.r": "lora_r", "method.lora.alpha": "lora_alpha", "method.lora.dropout": "lora_dropout",
        "method.lora.targets": "lora_target_modules", "train.seq_len": "max_length",
        "train.checkpointing_reentrant": "gradient_checkpointing_kwargs.use_reentrant",
        "train.attn_implementation": "attn_implementation",
    },
}
_COMMON_SOURCE_KEYS = {
    "train.micro_batch": "per_device_train_batch_size", "train.grad_accum": "gradient_accumulation_steps",
    "train.learning_rate": "learning_rate", "train.dataloader_workers": "dataloader_num_workers",
    "train.prefetch_factor": "dataloader_prefetch_factor", "target.card.memory": "--gpu-memory",
    "target.card.count": "--gpus", "target.headroom": "--headroom", "target.host_ram": "--host-ram",
    "launch.procs_per_card": "--procs-per-gpu", "launch.ranks": "--gpus",
}


_FORMAT_TITLES = {ConfigFormat.llamafactory: "LLaMA-Factory config",
                  ConfigFormat.training_args: "Hugging Face TrainingArguments config"}


def _slug(path: Path) -> str:
    """The config file's name as a case id (harness.spec.schema.CASE_ID_PATTERN)."""
    slug = re.sub(r"\.{2,}", ".", re.sub(r"[^a-z0-9.]+", "-", path.stem.lower())).strip("-.")
    return slug or "config"


def _source_key(fmt: ConfigFormat, loc: tuple) -> str | None:
    field = ".".join(str(p) for p in loc)
    return {**_COMMON_SOURCE_KEYS, **_SOURCE_KEYS.get(fmt, {})}.get(field)


def build_case(path: Path, fmt: ConfigFormat, *, model: str, stack: str, precision: str,
               method: dict, train: dict, ds: DeepSpeedFile | None, launcher: str, ranks: int,
               init_order: str, job: Job, triton_cache: str = "shared") -> Case:
    data = {
        "id": _slug(path),
        "source": {"title": f"{_FORMAT_TITLES.get(fmt, 'training config')} {path.name}", "config": str(path)}
        | ({} if ds is None or ds.path == path else {"deepspeed": str(ds.path)}),
        "family": f"imported-{fmt.value}",
        "title": f"imported from {path.name}",
        "role": "config",
        "model": model,
        "stack": stack,
        "precision": precision,
        "method": method,
        "train": train,
        "deepspeed": None if ds is None else {k: v for k, v in ds.zero.items() if v is not None},
        "launch": {"launcher": case_launcher(launcher, ds is not None), "ranks": ranks,
                   "procs_per_card": job.procs_per_gpu, "triton_cache": triton_cache,
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


def case_triton_cache(arch, job: Job) -> str:
    """`launch.triton_cache` of the case: the job's for a model with Triton kernels; 'shared' (the
    schema's default, which changes nothing) for every other model."""
    return job.triton_cache if arch is not None and arch.uses_triton_kernels else "shared"


def triton_notes(arch, job: Job) -> list[str]:
    """Which kernel cache a model with Triton kernels is predicted on, and where that came from."""
    if arch is None or not arch.uses_triton_kernels:
        return []
    state = "a cold Triton cache (compiling fla's kernels)" if job.triton_cache == "cold" else "a warm Triton cache"
    other = "warm" if job.triton_cache == "cold" else "cold"
    return [f"predicted on {state}: {job.triton_cache_from}; --triton-cache {other} predicts the other"]


def assemble(case: Case | None, model: ModelRef, training: TrainingFile, ds: DeepSpeedFile | None, *, launcher: str,
             launcher_from: str, ranks: int, job: Job, init: InitOrder, notes: list[str],
             unpredictable: str | None = None, not_modelled: tuple[NotModelled, ...] = (),
             read_as: tuple[ReadAs, ...] = ()) -> ImportedConfig:
    """The ImportedConfig; keys read but not modelled, and booleans read otherwise than they look, are
    the training config's (`not_modelled`, `read_as`) and its DeepSpeed config's."""
    return ImportedConfig(
        case=case, arch=model.arch, training=training, deepspeed=ds, launcher=launcher,
        launcher_from=launcher_from, world_size=ranks, gpus=job.gpus, gpu_memory=job.gpu_memory,
        procs_per_gpu=job.procs_per_gpu, headroom=job.headroom, host_ram=job.host_ram,
        init_order=init, unpredictable=unpredictable, notes=tuple(notes),
        not_modelled=tuple(not_modelled) + (ds.not_modelled if ds else ()),
        read_as=tuple(read_as) + (ds.read_as if ds else ()),
    )


def finish(path: Path, fmt: ConfigFormat, training: TrainingFile, model: ModelRef, ds: DeepSpeedFile | None,
           job: Job, launcher: str, launcher_from: str, stack: str,
           precision: str, method: dict, train: dict, init: InitOrder, notes: list[str],
           reader: Reader | None = None) -> ImportedConfig:
    """A training format's settings, read, as an ImportedConfig (its case left out where unpredictable);
    `reader`: the training config's, with what it recorded."""
    if model.note:
        notes.append(model.note)
    notes += triton_notes(model.arch, job)
    ranks = job.ranks(launcher, ds is not None, notes)
    unpredictable = None
    case = None
    if method["kind"] == "qlora" and ds is not None and ds.stage == 3:
        unpredictable = "4-bit weights under ZeRO-3 are outside what the predictor models (see the lint)"
    else:
        case = build_case(path, fmt, model=model.case_model, stack=stack, precision=precision, method=method,
                          train=train, ds=ds, launcher=launcher, ranks=ranks, init_order=init.order, job=job,
                          triton_cache=case_triton_cache(model.arch, job))
    return assemble(case, model, training, ds, launcher=launcher, launcher_from=launcher_from, ranks=ranks, job=job,
                    init=init, notes=notes, unpredictable=unpredictable,
                    not_modelled=tuple(reader.not_modelled) if reader else (),
                    read_as=tuple(reader.read_as) if reader else ())
