"""DeepSpeed ZeRO offload for a one-GPU job that runs without DeepSpeed: which jobs can take it, the
DeepSpeed JSON `fit` writes for it, and the case's `deepspeed` block that JSON reads as.

On one card, ZeRO shards nothing; what it gives is offload. ZeRO-2 with the optimizer offloaded keeps the
fp32 master weights and Adam's moments in host memory (DeepSpeed's CPU Adam steps them there); ZeRO-3
with the optimizer and the parameters offloaded also keeps the 16-bit weights there, gathering each
layer's onto the card for the pass that needs it. The training is the same (the same AdamW with the
Trainer's hyperparameters: the JSON's `optimizer` block takes them as "auto"); the step is slower.

The JSON is LLaMA-Factory's `examples/deepspeed/ds_z2_offload_config.json` and
`ds_z3_offload_config.json` (the HF integration fills the "auto" values from the TrainingArguments; the
importer resolves them as it does: `harness.premerge.importers.deepspeed_json`), with AdamW named as
DeepSpeed's optimizer so that the offloaded step runs DeepSpeed's CPU Adam, not torch's AdamW on the
host. Only stacks whose trainer reads the config's `deepspeed` key take it: LLaMA-Factory and the HF
Trainer (a TrainingArguments config, or a peft script that hands its TrainingArguments to a Trainer);
a script with its own loop does not.
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from harness.spec.schema import Stack

# What LLaMA-Factory's DeepSpeed examples hold beside the ZeRO block, and the optimizer the offloaded step needs.
_COMMON: dict[str, Any] = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
}
_ZERO2_OFFLOAD: dict[str, Any] = {  # ds_z2_offload_config.json
    "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "allgather_partitions": True,
    "allgather_bucket_size": 500_000_000, "overlap_comm": False, "reduce_scatter": True,
    "reduce_bucket_size": 500_000_000, "contiguous_gradients": True, "round_robin_gradients": True,
}
_ZERO3_OFFLOAD: dict[str, Any] = {  # ds_z3_offload_config.json
    "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
    "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": False, "contiguous_gradients": True,
    "sub_group_size": 1_000_000_000, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000, "stage3_gather_16bit_weights_on_model_save": True,
}
# The optimizers a job may have for DeepSpeed's AdamW to replace it without changing the training.
ADAMW = (None, "adamw_torch", "adamw_torch_fused")
_TRAINERS = ("Trainer", "SFTTrainer", "Seq2SeqTrainer")


@dataclass(frozen=True)
class NewDeepSpeed:
    """What a case needs to take a DeepSpeed block it does not have: the model's hidden size (DeepSpeed's
    "auto" buckets are sized by it) and the order in which the job builds its model and configures
    DeepSpeed (under ZeRO-3 a model built first is materialised whole on the card)."""

    hidden_size: int
    init_order: str = "deepspeed_first"


def offload_config(stage: int, pin_memory: bool, lean: dict[str, int] | None = None) -> dict[str, Any]:
    """The DeepSpeed JSON for ZeRO-2 with the optimizer offloaded (`stage` 2) or ZeRO-3 with the optimizer and
    the parameters offloaded (`stage` 3), its offload buffers pinned or pageable, `lean` bucket and live-set
    values (elements) written over the examples' where given."""
    if stage not in (2, 3):
        raise ValueError(f"ZeRO offload is stage 2 or 3, not {stage}")
    zero = copy.deepcopy(_ZERO2_OFFLOAD if stage == 2 else _ZERO3_OFFLOAD)
    for block in ("offload_optimizer", "offload_param"):
        if block in zero:
            zero[block]["pin_memory"] = pin_memory
    for key, value in (lean or {}).items():
        if (stage != 3 and key.startswith("stage3_")) or (stage == 3 and key == "allgather_bucket_size"):
            continue  # settings of the other stages (ZeRO-3 gathers by its prefetch bucket)
        zero[key] = value
    return {**copy.deepcopy(_COMMON), "zero_optimization": zero}


@lru_cache(maxsize=64)
def _block(stage: int, pin_memory: bool, lean: tuple[tuple[str, int], ...], hidden_size: int) -> tuple:
    from harness.premerge.importers import read_deepspeed  # the importer's reading, so a recheck reads the same

    ds = read_deepspeed(Path("deepspeed.json"), offload_config(stage, pin_memory, dict(lean)), hidden_size)
    return tuple((k, v) for k, v in ds.zero.items() if v is not None)


def offload_block(stage: int, pin_memory: bool, lean: dict[str, int] | None, hidden_size: int) -> dict[str, Any]:
    """The case's `deepspeed` block for `offload_config(stage, pin_memory, lean)`, read as the importer reads
    the written file (its "auto" values resolved for `hidden_size`)."""
    return dict(_block(stage, pin_memory, tuple(sorted((lean or {}).items())), hidden_size))


def trainer_script(script: Path | None) -> bool:
    """Whether a training script hands its arguments to a transformers Trainer (a call of `Trainer`,
    `SFTTrainer` or `Seq2SeqTrainer`, or a class ending in `Trainer`): then it honours `deepspeed`."""
    if script is None or Path(script).suffix != ".py" or not Path(script).is_file():
        return False
    try:
        tree = ast.parse(Path(script).read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in _TRAINERS or name.endswith("Trainer"):
                return True
    return False


def why_not(imported) -> str | None:
    """Why `fit` does not add DeepSpeed ZeRO offload to this job (an `ImportedConfig`), or None where it
    may: one GPU, one process on it, no DeepSpeed yet, a stack whose trainer reads `deepspeed`, AdamW."""
    case = imported.case
    if imported.deepspeed is not None or case.deepspeed is not None:
        return "the job already runs DeepSpeed: its own stages are searched"
    if imported.gpus != 1 or imported.world_size != 1 or imported.procs_per_gpu != 1:
        return "offload is added to one-GPU jobs only"
    if case.stack == Stack.plain or (case.stack == Stack.peft and not trainer_script(imported.init_order.path)):
        return (f"the {case.stack.value} stack trains in its own loop, which does not read `deepspeed` (a peft "
                "script that hands its arguments to a Trainer: pass it with --script)")
    if case.train.optim not in ADAMW or any(n.key in ("optim", "adafactor") for n in imported.not_modelled):
        return "the job's optimizer is not AdamW, which DeepSpeed's CPU Adam would replace"
    return None
