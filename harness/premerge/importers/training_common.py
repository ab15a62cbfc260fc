"""Settings both training formats (LLaMA-Factory YAML, TrainingArguments JSON) read the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.models.registry import Architecture
from harness.premerge.importers.deepspeed_json import deepspeed_of
from harness.premerge.importers.errors import ConfigError
from harness.premerge.importers.model import hidden_size, model_precision
from harness.premerge.importers.reading import Reader
from harness.premerge.importers.records import ConfigFormat, DeepSpeedFile, JobSpec, TrainingFile


def reject_fsdp(r: Reader, fix: str) -> None:
    for key in ("fsdp", "fsdp_config"):
        if r.raw(key) not in (None, "", [], {}):
            raise r.fail(key, "FSDP is not modelled; the harness shards through DeepSpeed only", fix)


def precision_of(fp16: bool, bf16: bool, arch: Architecture) -> str:
    return "bf16" if bf16 else "fp16" if fp16 else model_precision(arch)


def job_deepspeed(r: Reader, spec: JobSpec, arch: Architecture, notes: list[str]) -> DeepSpeedFile | None:
    """The config's `deepspeed` (or --deepspeed), read for this model; its notes join `notes`."""
    ds, ds_notes = deepspeed_of(r.path, r.data.get("deepspeed"), spec, hidden_size(arch))
    notes += ds_notes
    return ds


def lora_targets(value: Any, path: Path, key: str) -> list[str] | str:
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


def lora_block(r: Reader, rank: int, targets_key: str, targets: Any) -> dict[str, Any]:
    """The case's `method.lora`; alpha defaults to twice the rank."""
    return {"r": rank, "alpha": r.float("lora_alpha", None) or 2 * rank, "dropout": r.float("lora_dropout", 0.0),
            "targets": lora_targets(targets, r.path, targets_key)}


def qlora_method(lora: dict[str, Any], quant_type: str, double_quant: bool, compute_dtype: str) -> dict[str, Any]:
    return {"kind": "qlora", "lora": lora, "quantization": {
        "bits": 4, "quant_type": quant_type, "double_quant": double_quant, "compute_dtype": compute_dtype}}


def default_reentrant(stack: str, method: str) -> bool:
    """use_reentrant where the config does not say: peft's k-bit preparation and LLaMA-Factory use
    reentrant checkpointing, plain transformers does not (as `harness.runtime.build` builds it)."""
    return method == "qlora" or stack == "llamafactory"


def train_block(r: Reader, seq_len: int, gc: bool, reentrant: bool | None) -> dict[str, Any]:
    """The case's `train` block; `reentrant` None: the stack's default."""
    train = {
        "micro_batch": r.int("per_device_train_batch_size", 8, minimum=1),
        "grad_accum": r.int("gradient_accumulation_steps", 1, minimum=1),
        "seq_len": seq_len,
        "gradient_checkpointing": gc,
        "learning_rate": r.float("learning_rate", 5e-5),
        "dataloader_workers": r.int("dataloader_num_workers", 0),
        "pin_memory": r.bool("dataloader_pin_memory", True),
    }
    if gc and reentrant is not None:
        train["checkpointing_reentrant"] = reentrant
    prefetch = r.int("dataloader_prefetch_factor", None, minimum=1)
    if prefetch is not None:
        train["prefetch_factor"] = prefetch
    return train


def training_file(r: Reader, fmt: ConfigFormat, train: dict[str, Any], *, fp16: bool, bf16: bool, gc_key: str,
                  method: str, quantization_bits: int | None, stack: str, reentrant_key: str) -> TrainingFile:
    """The training config as written, for the lints."""
    ref = r.data.get("deepspeed")
    reentrant = train.get("checkpointing_reentrant")
    return TrainingFile(
        path=r.path, format=fmt, keys=frozenset(r.data), micro_batch=train["micro_batch"],
        grad_accum=train["grad_accum"], seq_len=train["seq_len"], fp16=fp16, bf16=bf16,
        eval_strategy=r.str("eval_strategy", None), evaluation_strategy=r.str("evaluation_strategy", None),
        gradient_checkpointing=train["gradient_checkpointing"], gradient_checkpointing_key=gc_key, method=method,
        quantization_bits=quantization_bits, deepspeed_ref=ref if isinstance(ref, str) else None,
        checkpointing_reentrant=default_reentrant(stack, method) if reentrant is None else reentrant,
        checkpointing_reentrant_key=reentrant_key if reentrant is not None else "",
    )
