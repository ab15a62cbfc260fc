"""LLaMA-Factory's own training path for a case whose stack is `llamafactory`.

What runs is LLaMA-Factory's code, as `llamafactory-cli train config.yaml` runs it:

1. its argument parsing (`llamafactory.hparams.get_train_args`) of the user's YAML (the case's
   `source.config`; for a case written without one, the keys its fields stand for), with only what a
   measurement must change replaced: the model folder (a random-weight checkpoint of the same
   architecture), the batch, accumulation, cutoff length and steps of the run's shape, the DeepSpeed
   config the harness writes for the run, and the output, logging and saving keys;
2. its tokenizer and model loader (`llamafactory.model.load_tokenizer`, `load_model`): `patch_config`
   (dtype, attention kernel from `flash_attn`, quantization, RoPE), Liger (`enable_liger_kernel`),
   `patch_model`, checkpointing with `use_reentrant_gc`, and `init_adapter` (the fp32 upcast of trainable
   parameters unless `pure_bf16`, BAdam or ZeRO-3; LoRA targets through its `find_all_linear_modules`
   and forbidden modules);
3. its trainer, `CustomSeq2SeqTrainer`, where its module imports. LLaMA-Factory's `train.sft` package
   imports its data pipeline, which imports torchaudio unconditionally; where torchaudio does not load
   (PyPI's wheels beside a CPU build of torch), transformers' `Seq2SeqTrainer`, the class it derives
   from, trains with LLaMA-Factory's own optimizer and scheduler factories (`create_custom_optimizer`,
   `create_custom_scheduler`), and the run's record names which trainer ran.

The data are synthetic token ids at the cutoff length (`harness.runtime.data.examples`): nothing is
downloaded, and LLaMA-Factory's dataset loading and templates, which change no memory of a step of
fixed length, are not run.
"""

from __future__ import annotations

import importlib.metadata as md
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.models.inputs import load_yaml
from harness.runtime.stacks import tiny_schedule
from harness.spec.schema import Case, Precision

# transformers' attn_implementation as LLaMA-Factory's `flash_attn` (the inverse of the importer's map)
_FLASH_ATTN = {None: "auto", "eager": "disabled", "sdpa": "sdpa", "flash_attention_2": "fa2"}
# keys of a user's YAML that reach outside the job (hubs, trackers, files of the user's host) or
# evaluate, predict, export or resume: a measured run of the training step does none of these
_DROPPED = frozenset({
    "adapter_name_or_path", "cache_dir", "model_revision", "hf_hub_token", "ms_hub_token", "om_hub_token",
    "dataset_dir", "media_dir", "tokenized_path", "eval_dataset", "val_size", "do_eval", "do_predict",
    "eval_strategy", "evaluation_strategy", "eval_steps", "predict_with_generate", "load_best_model_at_end",
    "resume_from_checkpoint", "push_to_hub", "hub_model_id", "use_swanlab", "swanlab_project",
    "ray_run_name", "ray_storage_path", "ray_num_workers", "export_dir", "plot_loss", "run_name",
    "save_steps", "save_total_limit", "num_train_epochs", "logging_dir", "ref_model", "reward_model",
    "trust_remote_code", "print_param_status", "overwrite_cache", "preprocessing_num_workers",
})


@dataclass
class Arguments:
    """The argument dict handed to LLaMA-Factory, and what the harness changed in it to run on this host."""

    values: dict[str, Any]
    notes: list[str] = field(default_factory=list)


def user_arguments(case: Case) -> dict[str, Any]:
    """The user's LLaMA-Factory YAML the case was made from (`source.config`), or none."""
    source = case.source.config if case.source is not None else None
    if not source:
        return {}
    path = Path(source)
    if path.suffix.lower() not in (".yaml", ".yml"):
        return {}
    data = load_yaml(path) or {}  # the reader `check` used on it: duplicate keys and oversized files refused
    return data if isinstance(data, dict) else {}


def case_arguments(case: Case, on_cpu: bool) -> Arguments:
    """The LLaMA-Factory keys the case's own fields decide (method, precision, checkpointing, attention,
    dataloader): the case is what the harness runs, so these win over the YAML's."""
    m, t = case.method, case.train
    values: dict[str, Any] = {"stage": "sft", "do_train": True,
                              "finetuning_type": "full" if m.kind == "full" else "lora"}
    notes: list[str] = []
    if m.lora is not None:
        targets = m.lora.targets
        values.update(lora_rank=m.lora.r, lora_alpha=m.lora.alpha, lora_dropout=m.lora.dropout,
                      lora_target="all" if targets == "all" else ",".join(targets))
    if m.kind == "qlora":
        q = m.quantization
        values.update(quantization_bit=q.bits, quantization_method="bnb", quantization_type=q.quant_type,
                      double_quantization=q.double_quant)
    precision = case.precision
    if on_cpu and precision == Precision.fp16:
        precision = Precision.bf16
        notes.append("fp16 trained as bf16 on a CPU (same bytes per element; CPU fp16 training is not supported)")
    # pure_bf16 trains bf16 parameters without autocast, in place of bf16
    values["bf16"] = precision == Precision.bf16 and not t.pure_bf16
    values["fp16"] = precision == Precision.fp16
    values["disable_gradient_checkpointing"] = not t.gradient_checkpointing
    if t.checkpointing_reentrant is not None:
        values["use_reentrant_gc"] = t.checkpointing_reentrant
    values["flash_attn"] = _FLASH_ATTN.get(t.attn_implementation, "auto")
    values["pure_bf16"] = t.pure_bf16
    values["enable_liger_kernel"] = t.liger_kernel
    if t.optim is not None:
        values["optim"] = t.optim
    values["learning_rate"] = t.learning_rate
    values["dataloader_num_workers"] = t.dataloader_workers
    values["dataloader_pin_memory"] = t.pin_memory
    if t.prefetch_factor:
        values["dataloader_prefetch_factor"] = t.prefetch_factor
    return Arguments(values, notes)


def run_arguments(case: Case, shape, checkpoint: Path, out_dir: Path, ds_config: Path | None,
                  on_cpu: bool) -> Arguments:
    """The full argument dict of the run: the user's YAML, the case's keys over it, and what a
    measurement replaces (model folder, shape, DeepSpeed config, output, logging, saving)."""
    user = user_arguments(case)
    mine = case_arguments(case, on_cpu)
    values = {k: v for k, v in user.items() if k not in _DROPPED}
    values.update(mine.values)
    values.update(
        model_name_or_path=str(checkpoint), output_dir=str(out_dir / "trainer"), overwrite_output_dir=True,
        per_device_train_batch_size=shape.micro_batch, gradient_accumulation_steps=shape.grad_accum,
        cutoff_len=shape.seq_len, max_steps=shape.steps, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=0,
    )
    values.setdefault("dataset", "synthetic")  # never loaded: the trainer is handed the synthetic examples
    values.setdefault("template", "empty")
    if ds_config is not None:
        values["deepspeed"] = str(ds_config)
    else:
        values.pop("deepspeed", None)
    notes = list(mine.notes)
    notes += tiny_schedule(values, shape)
    if on_cpu:
        values["use_cpu"] = True  # the Trainer refuses bf16 on a host without a GPU unless told it is one
    if on_cpu and values.get("enable_liger_kernel"):
        values["enable_liger_kernel"] = False  # Liger's kernels are Triton kernels for GPUs
        notes.append("enable_liger_kernel dropped on a CPU: Liger's Triton kernels run on GPUs only")
    if on_cpu and values.get("pure_bf16"):
        values["pure_bf16"] = False  # LLaMA-Factory refuses pure_bf16 where no GPU supports bf16
        values["bf16"] = True
        notes.append("pure_bf16 dropped on a CPU (LLaMA-Factory refuses it without a bf16 GPU): bf16 mixed "
                     "precision, the trainable parameters upcast to fp32 as without it")
    return Arguments(values, notes)


def version() -> str:
    return md.version("llamafactory")


@dataclass
class Loaded:
    model: Any
    tokenizer: Any
    model_args: Any
    training_args: Any
    finetuning_args: Any


def parse(arguments: Arguments):
    """LLaMA-Factory's parsing of the arguments (its checks, its post-processing of dtypes and devices).
    Creating its TrainingArguments makes a DeepSpeed config live, so under ZeRO-3 the model is then
    built partitioned, as in the user's job."""
    from llamafactory.hparams import get_train_args

    model_args, _data_args, training_args, finetuning_args, _generating = get_train_args(dict(arguments.values))
    return model_args, training_args, finetuning_args


def load(parsed) -> Loaded:
    """LLaMA-Factory's tokenizer and model loader, adapters and upcasts included."""
    from llamafactory.model import load_model, load_tokenizer

    model_args, training_args, finetuning_args = parsed
    tokenizer = load_tokenizer(model_args)["tokenizer"]
    model = load_model(tokenizer, model_args, finetuning_args, is_trainable=True)
    return Loaded(model, tokenizer, model_args, training_args, finetuning_args)


def trainer_class():
    """LLaMA-Factory's `CustomSeq2SeqTrainer` where its package imports, else None (see the module's
    docstring: its data pipeline imports torchaudio)."""
    try:
        from llamafactory.train.sft.trainer import CustomSeq2SeqTrainer
    except ImportError:
        return None
    return CustomSeq2SeqTrainer


def make_trainer(loaded: Loaded, dataset, callbacks: list):
    """The trainer LLaMA-Factory's SFT workflow makes for this model, over the synthetic examples."""
    from transformers import DataCollatorForSeq2Seq

    collator = DataCollatorForSeq2Seq(loaded.tokenizer, model=loaded.model, pad_to_multiple_of=None,
                                      label_pad_token_id=-100)
    custom = trainer_class()
    if custom is not None:
        # as LLaMA-Factory's run_sft makes it: the tokenizer module's tokenizer and processor (none for text)
        return custom(model=loaded.model, args=loaded.training_args, finetuning_args=loaded.finetuning_args,
                      data_collator=collator, train_dataset=dataset, callbacks=callbacks,
                      tokenizer=loaded.tokenizer, processor=None)
    return _seq2seq_with_lf_optimizer(loaded, dataset, collator, callbacks)


def _seq2seq_with_lf_optimizer(loaded: Loaded, dataset, collator, callbacks: list):
    """transformers' Seq2SeqTrainer with LLaMA-Factory's optimizer and scheduler factories, as its
    CustomSeq2SeqTrainer sets them (`create_optimizer`, `create_scheduler` overridden)."""
    from llamafactory.train.trainer_utils import create_custom_optimizer, create_custom_scheduler
    from transformers import Seq2SeqTrainer

    finetuning_args = loaded.finetuning_args

    class LlamaFactorySeq2SeqTrainer(Seq2SeqTrainer):
        def create_optimizer(self):
            if self.optimizer is None:
                self.optimizer = create_custom_optimizer(self.model, self.args, finetuning_args)
            return super().create_optimizer()

        def create_scheduler(self, num_training_steps, optimizer=None):
            create_custom_scheduler(self.args, num_training_steps, optimizer)
            return super().create_scheduler(num_training_steps, optimizer)

    return LlamaFactorySeq2SeqTrainer(model=loaded.model, args=loaded.training_args, data_collator=collator,
                                      train_dataset=dataset, callbacks=callbacks, processing_class=loaded.tokenizer)
