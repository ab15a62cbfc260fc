"""Hugging Face TrainingArguments JSON, with the model, LoRA and 4-bit fields training scripts add
(`model_name_or_path`, `max_length`/`max_seq_length`, `lora_r`, `load_in_4bit`, ...)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.models.inputs import InputError, parse_json
from harness.premerge.importers.build import finish
from harness.premerge.importers.errors import ConfigError
from harness.premerge.importers.init_order import init_order_of
from harness.premerge.importers.job import job_of, launcher_of
from harness.premerge.importers.keys import HF_TRAINING_KEYS, SCRIPT_KEYS, SCRIPT_NOT_MODELLED, check_keys
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

_GC_KWARGS = "gradient_checkpointing_kwargs"
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def import_training_args(path: Path, data: dict[str, Any], spec: JobSpec) -> ImportedConfig:
    check_keys(path, data, HF_TRAINING_KEYS | SCRIPT_KEYS, training_fields=True)
    r = Reader(path, data)
    notes: list[str] = []
    reject_fsdp(r, "use a DeepSpeed config")
    if r.bool("load_in_8bit", False) or r.bool("use_8bit", False):
        key = "load_in_8bit" if r.has("load_in_8bit") else "use_8bit"
        raise r.fail(key, "8-bit weights are not modelled by the predictor (only 4-bit nf4/fp4)", "use load_in_4bit")
    four_bit = r.bool("load_in_4bit", False) or r.bool("use_4bit", False)
    lora_keys = [k for k in ("lora_r", "lora_rank") if r.has(k)]
    if len(lora_keys) == 2 and r.int("lora_r", 0) != r.int("lora_rank", 0):
        raise r.fail("lora_rank", f"contradicts lora_r ({r.raw('lora_r')} vs {r.raw('lora_rank')})",
                     "keep one of them")
    use_lora = bool(lora_keys) or r.bool("use_peft", False)
    if four_bit and not use_lora:
        raise r.fail("load_in_4bit", "4-bit weights can only be trained through LoRA adapters, and no lora_r is set",
                     "set lora_r (and lora_alpha, lora_target_modules)")
    seq_len = _seq_len(r)

    model = model_of(path, r.str("model_name_or_path", None), spec)
    fp16, bf16 = r.bool("fp16", False), r.bool("bf16", False)
    precision = precision_of(fp16, bf16, model.arch)
    ds = job_deepspeed(r, spec, model.arch, notes)
    method: dict[str, Any] = {"kind": "full"}
    if use_lora:
        rank = r.int(lora_keys[0], 8, minimum=1) if lora_keys else 8
        target_key = next((k for k in ("lora_target_modules", "target_modules", "lora_target") if r.has(k)), None)
        if target_key is None:
            raise ConfigError(path, "lora_target_modules", "LoRA is on but no target modules are named",
                              "set lora_target_modules, e.g. \"q_proj,k_proj,v_proj,o_proj\" or \"all\"")
        lora = lora_block(r, rank, target_key, data[target_key])
        method = {"kind": "lora", "lora": lora}
        if four_bit:
            compute = r.str("bnb_4bit_compute_dtype", None)
            compute = {**_DTYPES, None: precision}.get(compute, compute)
            if compute not in ("bf16", "fp16", "fp32"):
                raise r.fail("bnb_4bit_compute_dtype", f"'{r.raw('bnb_4bit_compute_dtype')}' is not a dtype",
                             "use bfloat16 or float16")
            method = qlora_method(lora, r.choice("bnb_4bit_quant_type", ("nf4", "fp4"), "nf4"),
                                  r.bool("bnb_4bit_use_double_quant", False), compute)
    gc = r.bool("gradient_checkpointing", False)
    reentrant = _use_reentrant(r)
    train = train_block(r, seq_len=seq_len, gc=gc, reentrant=reentrant)
    if r.has("logits_to_keep"):
        train["logits_to_keep"] = r.int("logits_to_keep", None)
    attn = r.choice("attn_implementation", ("eager", "sdpa", "flash_attention_2"), None,
                    why=" (the attention kernels modelled: eager, sdpa, flash_attention_2)")
    if attn is not None:
        train["attn_implementation"] = attn
    hf_not_modelled(r, train, ds)
    _script_not_modelled(r, precision)
    stack = spec.stack or "hf_trainer"  # the Trainer the TrainingArguments are for
    training = training_file(r, ConfigFormat.training_args, train, fp16=fp16, bf16=bf16,
                             gc_key="gradient_checkpointing" if r.has("gradient_checkpointing") else "",
                             method=method["kind"], quantization_bits=4 if four_bit else None, stack=stack,
                             reentrant_key=f"{_GC_KWARGS}.use_reentrant")
    job = job_of(spec, path)
    check_model(path, model, spec)
    if use_lora:
        check_lora_targets(r, target_key, method["lora"]["targets"], model.arch, notes)
    default_launcher = "torchrun" if job.gpus > 1 and job.procs_per_gpu == 1 else "python"
    launcher, launcher_from = launcher_of(spec, default_launcher, "assumed")
    if launcher_from == "assumed" and job.gpus > 1:
        notes.append(f"launcher not stated: assumed {launcher} (pass --launcher)")
    init = init_order_of(spec, InitOrder("deepspeed_first", "assumed: TrainingArguments are built before the model "
                                         "(pass --script to check the training script)"))
    return finish(path, ConfigFormat.training_args, training, model, ds, job, launcher, launcher_from,
                  stack, precision, method, train, init, notes, reader=r)


def _script_not_modelled(r: Reader, precision: str) -> None:
    """The model-loading fields scripts add, where they load the model otherwise than the case predicts."""
    for key in ("torch_dtype", "dtype"):
        dtype = r.str(key, None)
        if dtype is None or dtype.lower() == "auto":
            continue
        loaded = {**_DTYPES, "bf16": "bf16", "fp16": "fp16", "fp32": "fp32", "float": "fp32",
                  "half": "fp16"}.get(dtype.lower())
        if loaded is None:
            raise r.fail(key, f"'{dtype}' is not a dtype", "use bfloat16, float16, float32 or auto")
        if loaded != precision:
            r.not_modelled_key(key, SCRIPT_NOT_MODELLED[key].entry(raises=loaded == "fp32"),
                               f"loaded in {loaded}, predicted in {precision}")
    if r.raw("model_init_kwargs") not in (None, {}, ""):
        r.not_modelled_key("model_init_kwargs", SCRIPT_NOT_MODELLED["model_init_kwargs"].entry())


def _seq_len(r: Reader) -> int:
    seq_keys = [k for k in ("max_length", "max_seq_length", "model_max_length") if r.has(k)]
    if not seq_keys:
        raise ConfigError(r.path, "max_length", "no sequence length is set",
                          "set max_length (TRL SFTConfig) or max_seq_length to the tokens per sample")
    seq_len = r.int(seq_keys[0], None, minimum=1)
    if len({r.int(k, None) for k in seq_keys}) > 1:
        raise r.fail(seq_keys[1], f"contradicts {seq_keys[0]} ({r.raw(seq_keys[1])} vs {seq_len})", "keep one of them")
    return seq_len


def _use_reentrant(r: Reader) -> bool | None:
    """`gradient_checkpointing_kwargs: {"use_reentrant": ...}` (a mapping, or the JSON string the command line
    passes); None where it does not say."""
    kwargs = r.raw(_GC_KWARGS, {})
    if isinstance(kwargs, str):
        try:
            kwargs = parse_json(kwargs, r.path) if kwargs.strip() else {}
        except InputError as exc:
            if exc.key is not None:  # a key written twice inside the text
                raise r.fail(f"{_GC_KWARGS}.{exc.key}", exc.problem, exc.fix) from None
            kwargs = None
    if not isinstance(kwargs, dict):
        raise r.fail(_GC_KWARGS, f"must be a mapping like {{\"use_reentrant\": false}}, got {r.raw(_GC_KWARGS)!r}")
    if kwargs.get("use_reentrant") is None:
        return None
    return r.sub(kwargs, f"{_GC_KWARGS}.").bool("use_reentrant", False)  # torch tests it for truth
