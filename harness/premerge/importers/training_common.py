"""Settings both training formats (LLaMA-Factory YAML, TrainingArguments JSON) read the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.models.registry import Architecture
from harness.models.source import adapter_targets, lora_target_matches
from harness.premerge.importers.deepspeed_json import deepspeed_of
from harness.premerge.importers.errors import ConfigError
from harness.premerge.importers.keys import HF_NOT_MODELLED, HF_OPTIMIZERS
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


def check_lora_targets(r: Reader, key: str, targets: list[str] | str, arch: Architecture, notes: list[str]) -> None:
    """Targets as peft matches them (a module's name, or its dotted tail): none matching is refused as peft
    refuses it (naming the modules the model has); a container module (peft cannot adapt it) likewise; a
    name matching nothing beside others that match is skipped by peft, and said in a note."""
    if targets == "all":
        return
    names, adaptable = adapter_targets(arch)
    have = sorted({n.rsplit(".", 1)[-1] for n in adaptable if not n.rsplit(".", 1)[-1].isdigit()})
    unmatched = []
    for target in targets:
        found = lora_target_matches(target, names)
        if found and not any(n in adaptable for n in found):
            raise r.fail(key, f"'{target}' names a block of the model ({found[0]}), not a layer LoRA can adapt",
                         f"name its layers, from: {', '.join(have)} (or write all)")
        if not found and not any(part.isdigit() for part in target.split(".")):  # a deeper layer's index: not built
            unmatched.append(target)
    if len(unmatched) == len(targets):
        raise r.fail(key, f"no module of {arch.name} is named {', '.join(unmatched)} (peft refuses it)",
                     f"name modules the model has: {', '.join(have)} (or write all)")
    if unmatched:
        notes.append(f"{r.prefix}{key}: {', '.join(unmatched)} matches no module of {arch.name}; peft skips it "
                     f"(the model has {', '.join(have)})")


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


def hf_not_modelled(r: Reader, train: dict[str, Any], ds: DeepSpeedFile | None) -> None:
    """TrainingArguments fields that change memory beyond the case, recorded on `r` as read but not modelled
    (both formats hold them: LLaMA-Factory passes every TrainingArguments field through)."""
    optim = r.str("optim", None)
    if ds is not None and "optimizer" in ds.keys:
        optim = None  # DeepSpeed's own optimizer replaces the Trainer's (its block is read with the DeepSpeed file)
    if optim is not None and optim.lower() in ("adamw_torch", "adamw_torch_fused"):
        train["optim"] = optim.lower()  # foreach or fused: a step's temporaries differ (predict.step.fused_adamw)
    if r.bool("use_liger_kernel", False):  # the Trainer applies Liger's kernels to the model
        train["liger_kernel"] = True
    if r.bool("adafactor", False):
        r.not_modelled_key("adafactor", HF_NOT_MODELLED["adafactor"].entry())
    if optim is not None:
        effect = HF_OPTIMIZERS.get(optim.lower())
        if effect is None and optim.lower() not in installed_optimizers():
            raise r.fail("optim", f"'{optim}' is not an optimizer TrainingArguments knows",
                         "use one of transformers' OptimizerNames, e.g. adamw_torch_fused or adamw_bnb_8bit")
        if effect != "modelled":
            r.not_modelled_key("optim", HF_NOT_MODELLED["optim"].entry(raises=effect != "smaller"),
                               "less state than AdamW" if effect == "smaller" else "state unlike AdamW's")
    eval_on = str(r.str("eval_strategy", None) or r.str("evaluation_strategy", None) or "no").lower() != "no"
    eval_batch = r.int("per_device_eval_batch_size", 8, minimum=1)
    if eval_on and eval_batch > train["micro_batch"]:
        r.not_modelled_key("per_device_eval_batch_size", HF_NOT_MODELLED["per_device_eval_batch_size"].entry(),
                           f"{eval_batch} against {train['micro_batch']}", value=eval_batch)
    checks = {"label_smoothing_factor": lambda: r.float("label_smoothing_factor", 0.0),
              "torch_compile": lambda: r.bool("torch_compile", False),
              "auto_find_batch_size": lambda: r.bool("auto_find_batch_size", False),
              "torch_empty_cache_steps": lambda: r.int("torch_empty_cache_steps", None, minimum=1) is not None}
    for key, counts in checks.items():
        if counts():
            r.not_modelled_key(key, HF_NOT_MODELLED[key].entry())


def installed_optimizers() -> frozenset[str]:
    """TrainingArguments' optimizer names in the installed transformers (for names newer than HF_OPTIMIZERS).
    Asked only for a name not in that list (importing transformers takes seconds)."""
    try:
        from transformers.training_args import OptimizerNames
    except Exception:  # no transformers, or one that fails to import: the list alone decides
        return frozenset(HF_OPTIMIZERS)
    return frozenset(o.value for o in OptimizerNames)
