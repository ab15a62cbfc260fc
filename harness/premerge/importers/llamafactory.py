"""LLaMA-Factory training YAML (`llamafactory-cli train x.yaml`).

`model_name_or_path`, `finetuning_type`, `lora_*`, `quantization_bit`, `cutoff_len`, `deepspeed` (a path
relative to the YAML), ... plus every Hugging Face TrainingArguments field. LLaMA-Factory checkpoints by
default (`disable_gradient_checkpointing: false`), reentrantly (`use_reentrant_gc: true`), and sets
`lora_alpha` to twice the rank when unset. `flash_attn` names the attention kernel (auto: transformers'
default; disabled: eager; sdpa; fa2: flash_attention_2), the case's `train.attn_implementation`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.premerge.importers.build import finish
from harness.premerge.importers.errors import ConfigError
from harness.premerge.importers.init_order import init_order_of
from harness.premerge.importers.job import job_of, launcher_of
from harness.premerge.importers.keys import HF_TRAINING_KEYS, LLAMAFACTORY_KEYS, LLAMAFACTORY_NOT_MODELLED, check_keys
from harness.premerge.importers.model import check_model, model_of
from harness.premerge.importers.reading import Reader
from harness.premerge.importers.records import ConfigFormat, ImportedConfig, InitOrder, JobSpec
from harness.premerge.importers.training_common import (
    check_lora_targets,
    hf_not_modelled,
    job_deepspeed,
    lora_block,
    precision_of,
    qlora_method,
    reject_fsdp,
    train_block,
    training_file,
)

_LF_STAGES = ("sft", "pt")
_QUANT_METHODS = ("bnb", "bitsandbytes")
# LLaMA-Factory's `flash_attn` (configure_attn_implementation) as transformers' attn_implementation;
# auto leaves it to transformers' default
_LF_ATTENTION = {"auto": None, "disabled": "eager", "sdpa": "sdpa", "fa2": "flash_attention_2"}
_MOD_METHODS = ("convert", "load")  # LLaMA-Factory's mixture_of_depths


def import_llamafactory(path: Path, data: dict[str, Any], spec: JobSpec) -> ImportedConfig:
    check_keys(path, data, LLAMAFACTORY_KEYS | HF_TRAINING_KEYS, training_fields=True)
    r = Reader(path, data)
    notes: list[str] = []
    r.choice("stage", _LF_STAGES, "sft", why=" (reward models, PPO, DPO and KTO keep a second model and paired "
             "sequences, which the predictor does not model)")
    finetuning = r.choice("finetuning_type", ("lora", "full"), "lora",
                          why=" (freeze and OFT training are not modelled; the nearest are lora and full)")
    bits = r.int("quantization_bit", None)
    if bits is not None and bits != 4:
        raise r.fail("quantization_bit", f"{bits}-bit weights are not modelled by the predictor (only 4-bit nf4/fp4)",
                     "use quantization_bit: 4, or remove it")
    if bits is not None:
        r.choice("quantization_method", _QUANT_METHODS, "bnb", why=" (only bitsandbytes 4-bit is modelled)")
        if finetuning == "full":
            raise r.fail("quantization_bit", "quantized weights cannot be fully fine-tuned (finetuning_type: full)",
                         "use finetuning_type: lora with quantization_bit, or remove quantization_bit")
    reject_fsdp(r, "use a DeepSpeed config (deepspeed: ds_z3_config.json)")
    _not_modelled(r)

    gc, gc_key = _checkpointing(r)
    fp16, bf16 = r.bool("fp16", False), r.bool("bf16", False) or r.bool("pure_bf16", False)
    model = model_of(path, r.str("model_name_or_path", None), spec)
    precision = precision_of(fp16, bf16, model.arch)
    if not (fp16 or bf16):
        notes.append(f"neither bf16 nor fp16 set: LLaMA-Factory computes in the model's dtype ({precision})")
    ds = job_deepspeed(r, spec, model.arch, notes)

    lora = lora_block(r, r.int("lora_rank", 8, minimum=1), "lora_target", r.raw("lora_target", "all"))
    method: dict[str, Any] = {"kind": "full"} if finetuning == "full" else {"kind": "lora", "lora": lora}
    if bits == 4:
        method = qlora_method(lora, r.choice("quantization_type", ("nf4", "fp4"), "nf4"),
                              r.bool("double_quantization", True), precision if precision != "fp32" else "bf16")
    # LLaMA-Factory passes use_reentrant_gc (default true) to every checkpointed layer, whatever the stack
    train = train_block(r, seq_len=r.int("cutoff_len", 2048, minimum=1), gc=gc,
                        reentrant=r.bool("use_reentrant_gc", True))
    attn = _LF_ATTENTION[r.choice("flash_attn", tuple(_LF_ATTENTION), "auto",
                                  why=" (the attention kernels modelled: auto, disabled, sdpa, fa2)")]
    if attn is not None:
        train["attn_implementation"] = attn
    if r.bool("pure_bf16", False):  # no fp32 upcast of the trainable parameters (init_adapter)
        train["pure_bf16"] = True
    if r.bool("enable_liger_kernel", False):  # load_model's apply_liger_kernel
        train["liger_kernel"] = True
    hf_not_modelled(r, train, ds)
    stack = spec.stack or "llamafactory"
    training = training_file(r, ConfigFormat.llamafactory, train, fp16=fp16, bf16=bf16, gc_key=gc_key,
                             method=method["kind"], quantization_bits=bits, stack=stack,
                             reentrant_key="use_reentrant_gc" if r.has("use_reentrant_gc") else "")
    launcher, launcher_from = launcher_of(spec, "llamafactory-cli", "llamafactory-cli")
    job = job_of(spec, path)
    check_model(path, model, spec)
    if finetuning == "lora":
        check_lora_targets(r, "lora_target", lora["targets"], model.arch, notes)
    init = init_order_of(spec, InitOrder("deepspeed_first",
                                         "LLaMA-Factory configures DeepSpeed before it loads the model"))
    return finish(path, ConfigFormat.llamafactory, training, model, ds, job, launcher, launcher_from,
                  stack, precision, method, train, init, notes, reader=r)


def _not_modelled(r: Reader) -> None:
    """LLaMA-Factory's own keys that change memory and are not modelled (keys.LLAMAFACTORY_NOT_MODELLED)."""
    for key, unmodelled in LLAMAFACTORY_NOT_MODELLED.items():
        if key == "additional_target":
            on = r.raw(key) not in (None, "", [])
        elif key == "mixture_of_depths":
            on = r.choice(key, _MOD_METHODS, None, why=" (LLaMA-Factory's Mixture-of-Depths: convert or load)") \
                is not None
        else:
            on = r.bool(key, False)
        if on:
            r.not_modelled_key(key, unmodelled.entry())


def _checkpointing(r: Reader) -> tuple[bool, str]:
    """Whether LLaMA-Factory checkpoints (it does unless disable_gradient_checkpointing) and the key that said so."""
    disable_gc = r.bool("disable_gradient_checkpointing", False)
    if disable_gc and r.bool("gradient_checkpointing", False):
        raise ConfigError(r.path, "gradient_checkpointing",
                          "contradicts disable_gradient_checkpointing: true",
                          "keep one of them (LLaMA-Factory checkpoints by default; "
                          "disable_gradient_checkpointing: true turns it off)")
    gc = r.bool("gradient_checkpointing", False) or not disable_gc
    gc_key = ("gradient_checkpointing" if r.has("gradient_checkpointing")
              else "disable_gradient_checkpointing" if r.has("disable_gradient_checkpointing") else "")
    return gc, gc_key
