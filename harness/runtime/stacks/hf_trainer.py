"""transformers' `Trainer` for a case whose stack is `hf_trainer` (a `TrainingArguments` config).

The user's JSON (the case's `source.config`) is parsed as their script parses it, by `HfArgumentParser`
into `TrainingArguments`; keys of their script's own dataclasses (the model path, LoRA settings) are
not TrainingArguments fields and are read from the case instead. The model is loaded as such a script
loads it: `from_pretrained` of the checkpoint in the case's dtype (with a `BitsAndBytesConfig` for QLoRA,
then peft's `prepare_model_for_kbit_training`, as peft's and transformers' QLoRA recipes do), LoRA
adapters through peft's `get_peft_model`. Checkpointing, mixed precision, the optimizer, DeepSpeed
(ZeRO, offload), Liger (`use_liger_kernel`) and the dataloader are the Trainer's own.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from harness.models.inputs import load_json
from harness.runtime.stacks import tiny_schedule
from harness.spec.schema import Case, Precision

# keys a measured run replaces or drops: outputs, logging, saving, evaluation, hubs, resuming
_DROPPED = frozenset({
    "eval_strategy", "evaluation_strategy", "do_eval", "do_predict", "eval_steps", "load_best_model_at_end",
    "resume_from_checkpoint", "push_to_hub", "hub_model_id", "hub_token", "run_name", "logging_dir",
    "save_steps", "save_total_limit", "num_train_epochs", "metric_for_best_model",
})


def user_arguments(case: Case) -> dict[str, Any]:
    """The user's TrainingArguments JSON the case was made from (`source.config`), or none."""
    source = case.source.config if case.source is not None else None
    if not source or Path(source).suffix.lower() != ".json":
        return {}
    data = load_json(source)  # the reader `check` used on it: duplicate keys and oversized files refused
    return data if isinstance(data, dict) else {}


def run_arguments(case: Case, shape, out_dir: Path, ds_config: Path | None, on_cpu: bool) -> tuple[dict, list[str]]:
    """TrainingArguments' values for the run: the user's, the case's over them, and what a measurement
    replaces; with notes on what this host changed."""
    from transformers import TrainingArguments

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    values = {k: v for k, v in user_arguments(case).items() if k in fields and k not in _DROPPED}
    notes: list[str] = []
    t = case.train
    precision = case.precision
    if on_cpu and precision == Precision.fp16:
        precision = Precision.bf16
        notes.append("fp16 trained as bf16 on a CPU (same bytes per element; CPU fp16 training is not supported)")
    values.update(bf16=precision == Precision.bf16, fp16=precision == Precision.fp16,
                  gradient_checkpointing=t.gradient_checkpointing, learning_rate=t.learning_rate,
                  dataloader_num_workers=t.dataloader_workers, dataloader_pin_memory=t.pin_memory)
    values["use_liger_kernel"] = t.liger_kernel
    if t.optim is not None:
        values["optim"] = t.optim
    if t.gradient_checkpointing and t.checkpointing_reentrant is not None:
        values["gradient_checkpointing_kwargs"] = {"use_reentrant": t.checkpointing_reentrant}
    if t.prefetch_factor:
        values["dataloader_prefetch_factor"] = t.prefetch_factor
    values.update(output_dir=str(out_dir / "trainer"), per_device_train_batch_size=shape.micro_batch,
                  gradient_accumulation_steps=shape.grad_accum, max_steps=shape.steps, logging_steps=1,
                  save_strategy="no", report_to="none", disable_tqdm=True, seed=0, remove_unused_columns=False)
    if ds_config is not None:
        values["deepspeed"] = str(ds_config)
    else:
        values.pop("deepspeed", None)
    notes += tiny_schedule(values, shape)
    if on_cpu:
        values["use_cpu"] = True  # the Trainer refuses bf16 on a host without a GPU unless told it is one
    if on_cpu and values.get("use_liger_kernel"):
        values["use_liger_kernel"] = False
        notes.append("use_liger_kernel dropped on a CPU: Liger's Triton kernels run on GPUs only")
    return values, notes


def version() -> str:
    """The Trainer's version: transformers'."""
    import importlib.metadata as md

    return md.version("transformers")


def parse(values: dict):
    """`TrainingArguments` as the user's script parses its JSON. Creating it makes a DeepSpeed config live,
    so under ZeRO-3 `from_pretrained` builds the model partitioned, as in the user's job."""
    from transformers import HfArgumentParser, TrainingArguments

    (args,) = HfArgumentParser(TrainingArguments).parse_dict(values)
    return args


def load(case: Case, checkpoint: Path, dtype, device) -> Any:
    """The model as a Trainer script loads it: `from_pretrained`, k-bit preparation for QLoRA, LoRA adapters."""
    from transformers import AutoModelForCausalLM

    from harness.runtime.build import attention_kwargs, bnb_config, lora_model

    kwargs: dict[str, Any] = {"dtype": dtype, **attention_kwargs(case)}
    if case.method.kind == "qlora":
        kwargs.update(quantization_config=bnb_config(case, device.type == "cpu"), device_map={"": device})
    model = AutoModelForCausalLM.from_pretrained(checkpoint, **kwargs)
    if case.method.kind == "qlora":
        from peft import prepare_model_for_kbit_training

        # the Trainer turns checkpointing on itself (TrainingArguments.gradient_checkpointing)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    elif device.type != "cpu" and not _zero3_live():
        model = model.to(device)
    if case.method.kind in ("lora", "qlora"):
        model = lora_model(case, model)
    return model


def _zero3_live() -> bool:
    from transformers.integrations import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


def make_trainer(model, args, tokenizer, dataset, callbacks: list):
    from transformers import DataCollatorForSeq2Seq, Trainer

    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    return Trainer(model=model, args=args, data_collator=collator, train_dataset=dataset, callbacks=callbacks,
                   processing_class=tokenizer)
