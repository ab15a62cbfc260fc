"""Building a case's model the way its training stack builds it, with random weights.

* full / LoRA: `AutoModelForCausalLM.from_config`. Under ZeRO-3 with DeepSpeed configured first, a
  live `HfDeepSpeedConfig` makes transformers build inside `deepspeed.zero.Init`, so each rank only
  ever holds its partition (guide 002's fix). With `init_order: model_first` the model is built in
  full before DeepSpeed is configured (guide 002's mistake).
* QLoRA: the real bitsandbytes path, `from_pretrained(..., quantization_config=BitsAndBytesConfig)`
  from a random-weight checkpoint written once per config into a cache folder (nothing is
  downloaded), then the stack's k-bit preparation (peft's or LLaMA-Factory's, which differ).
* LoRA adapters through peft's `get_peft_model`.
* The attention kernel the case names (`train.attn_implementation`), else transformers' default.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.models.registry import hf_config, tiny_config, truncated_config
from harness.models.source import load_model
from harness.spec.schema import Case, Precision, Stack
from harness.spec.shape import harness_model_source

DTYPES = {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16, Precision.fp32: torch.float32}


@dataclass
class Built:
    model: torch.nn.Module
    config_dict: dict
    zero_init: bool
    hf_ds_config: object | None  # keep alive: transformers reads it through a weak reference


def train_dtype(case: Case, on_cpu: bool) -> torch.dtype:
    """The compute dtype. fp16 cases run in bf16 on a CPU (same bytes per element; CPU fp16
    training is not supported by DeepSpeed's CPU accelerator)."""
    dtype = DTYPES[case.precision]
    if on_cpu and dtype == torch.float16:
        return torch.bfloat16
    return dtype


def model_config_dict(case: Case, fidelity: str, seq_len: int, layers: int | None = None) -> dict:
    arch = load_model(case.model)
    if fidelity == "tiny":
        return tiny_config(arch, seq_len)
    if layers is not None:
        return truncated_config(arch, layers)
    return dict(arch.config)


def random_checkpoint(config_dict: dict, dtype: torch.dtype, device: torch.device) -> Path:
    """A folder holding config.json, random weights of this config and a tokenizer (`write_tokenizer`):
    a model folder as a user's job loads one, written once and cached."""
    from transformers import AutoModelForCausalLM

    key = hashlib.sha256(json.dumps([config_dict, str(dtype)], sort_keys=True).encode()).hexdigest()[:16]
    from harness.runtime.compile_cache import cache_dir

    root = cache_dir() / "checkpoints"
    folder = root / f"{config_dict['model_type']}-{key}"
    root.mkdir(parents=True, exist_ok=True)
    # Ranks of one job: rank 0 writes (transformers skips saving on other ranks), the rest wait at
    # a barrier. Concurrent independent jobs serialise on a file lock.
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    if distributed and dist.get_rank() != 0:
        dist.barrier()
        return folder
    with open(root / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "config.json").is_file():
            tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
            torch.manual_seed(0)
            with torch.device(device):  # random init is fast on an accelerator
                model = AutoModelForCausalLM.from_config(hf_config(config_dict), dtype=dtype)
            model.save_pretrained(tmp)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
            write_tokenizer(tmp, int(config_dict["vocab_size"]))
            tmp.rename(folder)
        elif not (folder / TOKENIZER_FILE).is_file():  # a folder written before tokenizers were kept
            write_tokenizer(folder, int(config_dict["vocab_size"]))
    if distributed:
        dist.barrier()
    return folder


TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_WORDS = 1024  # the data are token ids, never text: a word list this long is enough to load


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level fast tokenizer in `folder`, as the frameworks' loaders expect beside the weights
    (LLaMA-Factory loads the tokenizer before the model). Its words are ids below the model's
    vocabulary; the training data are synthetic token ids and never pass through it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = max(3, min(vocab_size, TOKENIZER_WORDS))
    vocab = {f"t{i}": i for i in range(words - 2)}
    vocab.update({"<eos>": words - 2, "<pad>": words - 1})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>",
                            unk_token="t0").save_pretrained(folder)


def attention_kwargs(case: Case) -> dict:
    """`attn_implementation` for from_config / from_pretrained where the case names one
    (`train.attn_implementation`); none where it does not, so transformers picks its default."""
    attn = case.train.attn_implementation
    return {} if attn is None else {"attn_implementation": attn}


def bnb_config(case: Case, on_cpu: bool):
    """The case's 4-bit quantization as transformers takes it (fp16 compute as bf16 on a CPU)."""
    from transformers import BitsAndBytesConfig

    q = case.method.quantization
    compute = DTYPES[q.compute_dtype] if not (on_cpu and q.compute_dtype == Precision.fp16) else torch.bfloat16
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=q.quant_type,
                              bnb_4bit_use_double_quant=q.double_quant, bnb_4bit_compute_dtype=compute)


def lora_model(case: Case, model):
    """The case's LoRA adapters through peft's `get_peft_model`."""
    from peft import LoraConfig, get_peft_model

    lora = case.method.lora
    targets = "all-linear" if lora.targets == "all" else list(lora.targets)
    config = LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets, task_type="CAUSAL_LM"
    )
    return get_peft_model(model, config)


def checkpointing_active(model) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def set_checkpointing(model, on: bool, reentrant: bool = False) -> None:
    """Turn Hugging Face activation checkpointing on or off. transformers 5.20+ names it
    `activation_checkpointing_*`; older 5.x releases (the GPU hosts' 5.17) `gradient_checkpointing_*`."""
    if on:
        kwargs = {"use_reentrant": reentrant}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    elif hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def _reentrant(case: Case) -> bool:
    """use_reentrant as the case's stack sets it, unless the case says (train.checkpointing_reentrant)."""
    if case.train.checkpointing_reentrant is not None:
        return case.train.checkpointing_reentrant
    return case.method.kind == "qlora" or case.stack == Stack.llamafactory


def _enable_checkpointing(model, reentrant: bool) -> None:
    set_checkpointing(model, True, reentrant)
    if reentrant:
        # reentrant checkpointing only recomputes when the block input requires grad
        model.enable_input_require_grads()
    model.config.use_cache = False


def prepare_checkpoint(case: Case, fidelity: str, device: torch.device, seq_len: int,
                       layers: int | None = None) -> Path | None:
    """Write the random-weight checkpoint a case loads from (QLoRA, and every case a framework trains),
    outside the measured phases: it is the harness's stand-in for a downloaded model, not part of the
    scenario."""
    if harness_model_source(case) != "checkpoint":
        return None
    return random_checkpoint(model_config_dict(case, fidelity, seq_len, layers),
                              train_dtype(case, device.type == "cpu"),
                              device)


def build_model(case: Case, fidelity: str, device: torch.device, ds_config: dict | None, seq_len: int,
                layers: int | None = None, checkpoint: Path | None = None) -> Built:
    from transformers import AutoModelForCausalLM

    on_cpu = device.type == "cpu"
    dtype = train_dtype(case, on_cpu)
    config_dict = model_config_dict(case, fidelity, seq_len, layers)
    if config_dict["model_type"] == "gla" and on_cpu:
        from harness.models import fla_cpu

        fla_cpu.apply()
    torch.manual_seed(0)

    hf_ds_config = None
    zero3 = ds_config is not None and ds_config["zero_optimization"]["stage"] == 3
    if zero3 and case.launch.init_order == "deepspeed_first":
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds_config = HfDeepSpeedConfig(ds_config)

    if harness_model_source(case) == "checkpoint":  # QLoRA: quantized as it loads
        folder = checkpoint or random_checkpoint(config_dict, dtype, device)
        model = AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=bnb_config(case, on_cpu), dtype=dtype, device_map={"": device},
            **attention_kwargs(case)
        )
        gc_on = case.train.gradient_checkpointing
        if case.stack == Stack.peft:
            from peft import prepare_model_for_kbit_training

            model = prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=gc_on,
                gradient_checkpointing_kwargs={"use_reentrant": _reentrant(case)},
            )
        elif gc_on:  # LLaMA-Factory: no fp32 upcast
            _enable_checkpointing(model, reentrant=_reentrant(case))
    else:
        if hf_ds_config is not None:  # built inside zero.Init: each rank holds its partition
            model = AutoModelForCausalLM.from_config(hf_config(config_dict), dtype=dtype, **attention_kwargs(case))
        else:
            # Built where it trains. Random init of a 7-8B model on one CPU thread takes minutes; on
            # the card it takes a second and allocates the same tensors in the same order as
            # `.to(device)` would (the initialisers write in place).
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(hf_config(config_dict), dtype=dtype,
                                                         **attention_kwargs(case))
        if case.train.gradient_checkpointing:
            _enable_checkpointing(model, reentrant=_reentrant(case))
    if checkpointing_active(model) != case.train.gradient_checkpointing:
        # a run measured without the case's checkpointing is another config's figure, not this one's
        raise RuntimeError(f"{case.id}: activation checkpointing is {'on' if checkpointing_active(model) else 'off'} "
                           f"in the built model, but the case asks for it "
                           f"{'on' if case.train.gradient_checkpointing else 'off'}")

    zero_init = any(hasattr(p, "ds_id") for p in model.parameters())
    if case.method.kind in ("lora", "qlora"):
        model = lora_model(case, model)
    model.train()  # from_pretrained returns eval mode, where HF checkpointing is silently off
    return Built(model=model, config_dict=config_dict, zero_init=zero_init, hf_ds_config=hf_ds_config)
