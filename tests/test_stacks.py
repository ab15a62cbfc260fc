"""The framework stacks (harness.runtime.stacks): what a LLaMA-Factory or HF Trainer run is handed, where its
workers run, and, at tiny size, that the framework itself trained (its upcast, its trainer, our callback)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from harness.runtime import stacks
from harness.runtime.stacks import hf_trainer, llamafactory
from harness.spec.cases import load_case
from harness.spec.shape import run_shape

CASE = {
    "id": "stack-lf", "family": "stacks", "title": "a LLaMA-Factory job", "role": "config",
    "model": "qwen1.5-0.5b-chat", "stack": "llamafactory",
    "method": {"kind": "lora", "lora": {"r": 8, "alpha": 16, "targets": ["q_proj", "v_proj"]}},
    "train": {"micro_batch": 2, "grad_accum": 4, "seq_len": 1024, "gradient_checkpointing": True},
    "target": {"card": {"vendor": "nvidia", "name": "H200", "memory": "140 GiB"}, "headroom": 0.9},
    "expect": {"outcome": "fits"},
}


# The tiny runs below fork their workers from a zygote of their interpreter (this one's, or
# LLaMA-Factory's), 6-7 CPU-s of imports once per process: under `-n 2 --dist loadgroup` this id puts
# them in the worker of the case items, whose zygotes are started already
# (harness.pytest_plugin.xdist_groups.GROUP).
BESIDE_THE_CASES = pytest.mark.parametrize("_beside", [pytest.param(None, id="oom-harness-cases")])


def _case(tmp_path: Path, config: dict | None = None, suffix: str = ".yaml", **changes):
    data = {**CASE, **changes}
    if config is not None:
        path = tmp_path / f"user{suffix}"
        path.write_text(yaml.safe_dump(config) if suffix == ".yaml" else __import__("json").dumps(config))
        data["source"] = {"title": "the team's config", "config": path.name}
    case_path = tmp_path / f"{data['id']}.yaml"
    case_path.write_text(yaml.safe_dump(data))
    return load_case(case_path)


def test_llamafactory_arguments_keep_the_users_keys_and_replace_what_a_run_must(tmp_path):
    user = {"model_name_or_path": "Qwen/Qwen1.5-0.5B-Chat", "stage": "sft", "finetuning_type": "lora",
            "lora_rank": 64, "enable_liger_kernel": True, "use_reentrant_gc": False, "upcast_layernorm": True,
            "dataset": "alpaca_en_demo", "template": "qwen", "cutoff_len": 4096, "output_dir": "saves/x",
            "per_device_train_batch_size": 8, "hf_hub_token": "secret", "eval_strategy": "steps",
            "val_size": 0.1, "push_to_hub": True, "deepspeed": "ds_z3.json", "num_train_epochs": 3}
    case = _case(tmp_path, user)
    shape = run_shape(case, "tiny")
    args = llamafactory.run_arguments(case, shape, Path("/ckpt"), tmp_path, None, on_cpu=False)
    v = args.values
    # the user's own keys that change the job stay; those the case holds (train.liger_kernel) are the case's
    assert v["use_reentrant_gc"] is False and v["upcast_layernorm"] is True and v["enable_liger_kernel"] is False
    assert v["template"] == "qwen" and v["dataset"] == "alpaca_en_demo"
    # the case decides the method (its rank, its targets)
    assert v["lora_rank"] == 8 and v["lora_target"] == "q_proj,v_proj" and v["finetuning_type"] == "lora"
    # the run's shape, model folder and outputs replace the user's
    assert v["model_name_or_path"] == "/ckpt" and v["cutoff_len"] == shape.seq_len
    assert v["per_device_train_batch_size"] == shape.micro_batch and v["max_steps"] == shape.steps
    assert v["output_dir"] == str(tmp_path / "trainer") and v["report_to"] == "none"
    # what reaches outside the job or evaluates is gone; no DeepSpeed config where the run has none
    for key in ("hf_hub_token", "eval_strategy", "val_size", "push_to_hub", "deepspeed", "num_train_epochs"):
        assert key not in v
    # at tiny size the learning rate is held constant (a few steps show the loss falling); nothing else moves
    assert args.notes == ["tiny size: the learning rate held constant, so a few steps show the loss falling"]
    assert v["lr_scheduler_type"] == "constant"


def test_llamafactory_arguments_say_what_a_cpu_host_changes(tmp_path):
    case = _case(tmp_path, {"enable_liger_kernel": True, "pure_bf16": True}, precision="fp16",
                 train={**CASE["train"], "liger_kernel": True, "pure_bf16": True})
    args = llamafactory.run_arguments(case, run_shape(case, "tiny"), Path("/ckpt"), tmp_path,
                                      tmp_path / "ds.json", on_cpu=True)
    assert args.values["enable_liger_kernel"] is False and args.values["pure_bf16"] is False
    assert args.values["bf16"] is True and args.values["fp16"] is False and args.values["use_cpu"] is True
    assert args.values["deepspeed"] == str(tmp_path / "ds.json")
    assert len(args.notes) == 4 and any("Liger" in n for n in args.notes)


def test_a_case_without_a_config_stands_for_its_own_llamafactory_keys(tmp_path):
    case = _case(tmp_path, method={"kind": "qlora", "quantization": {"bits": 4, "quant_type": "nf4"},
                                   "lora": {"r": 16, "alpha": 32, "targets": "all"}},
                 train={**CASE["train"], "gradient_checkpointing": False, "attn_implementation": "eager"})
    v = llamafactory.case_arguments(case, on_cpu=False).values
    assert v["quantization_bit"] == 4 and v["quantization_type"] == "nf4" and v["lora_target"] == "all"
    assert v["disable_gradient_checkpointing"] is True and v["flash_attn"] == "disabled"


def test_hf_trainer_arguments_take_only_training_arguments_fields(tmp_path):
    user = {"model_name_or_path": "m", "lora_r": 64, "optim": "adamw_torch_fused", "use_liger_kernel": True,
            "lr_scheduler_type": "cosine", "warmup_ratio": 0.03, "eval_strategy": "steps", "bf16": False}
    case = _case(tmp_path, user, suffix=".json", stack="hf_trainer")
    values, notes = hf_trainer.run_arguments(case, run_shape(case, "tiny"), tmp_path, None, on_cpu=False)
    values["use_cpu"] = True  # parsed on this host, which has no GPU
    assert "model_name_or_path" not in values and "lora_r" not in values and "eval_strategy" not in values
    # the user's optimizer stays; Liger is the case's to say (train.liger_kernel), which the importer reads
    assert values["optim"] == "adamw_torch_fused" and values["use_liger_kernel"] is False
    # at tiny size the learning rate is held constant; the case's precision wins over the user's
    assert values["lr_scheduler_type"] == "constant" and "warmup_ratio" not in values and values["bf16"] is True
    assert values["gradient_checkpointing"] is True and len(notes) == 1 and "tiny size" in notes[0]
    args = hf_trainer.parse(values)
    shape = run_shape(case, "tiny")
    assert args.max_steps == shape.steps and args.gradient_accumulation_steps == shape.grad_accum == 2


def test_workers_run_where_the_framework_is(tmp_path, monkeypatch):
    case = _case(tmp_path)
    monkeypatch.setattr(stacks.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delenv("HARNESS_LLAMAFACTORY_PYTHON", raising=False)
    assert stacks.interpreter(case) is None
    reason = stacks.unavailable(case)
    assert "llamafactory is not installed" in reason and "setup.sh --stack llamafactory" in reason
    monkeypatch.setenv("HARNESS_LLAMAFACTORY_PYTHON", sys.executable)
    assert stacks.interpreter(case) == sys.executable and stacks.unavailable(case) is None
    monkeypatch.setenv("HARNESS_LLAMAFACTORY_PYTHON", str(tmp_path / "missing-python"))
    assert "not an executable file" in stacks.unavailable(case)
    plain = _case(tmp_path, stack="plain", id="stack-plain")
    assert stacks.interpreter(plain) == sys.executable and stacks.unavailable(plain) is None


def _tiny_run(tmp_path: Path, case):
    from harness.runtime.launcher import run_case
    from harness.runtime.platform import Platform

    run = run_case(case, tmp_path / f"{case.id}.yaml", "tiny", tmp_path / "run", Platform.cpu, timeout_s=300,
                   steps=2)
    assert run.error is None, run.error
    (rank,) = run.ranks
    return rank


@BESIDE_THE_CASES
def test_an_hf_trainer_case_trains_through_transformers_trainer(tmp_path, _beside):
    case = _case(tmp_path, stack="hf_trainer", id="stack-hf")
    rank = _tiny_run(tmp_path, case)
    assert rank.stack.name == "hf_trainer" and rank.stack.trainer == "Trainer"
    assert rank.stack.version == rank.versions["transformers"]
    assert len(rank.step_times_s) == 2 and len(rank.losses) == 2  # timed and logged by the callback
    assert rank.step.allocated > rank.load.allocated > 0
    assert rank.probes.checkpointing_effective  # the Trainer turned checkpointing on, and it recomputes


@BESIDE_THE_CASES
def test_a_llamafactory_full_fine_tune_keeps_its_upcast(tmp_path, _beside):
    """LLaMA-Factory's init_adapter casts a full fine-tune's trainable parameters to fp32 (no pure_bf16, no
    ZeRO-3): the run holds 4 bytes a parameter, which the harness's own bf16 loop never did."""
    case = _case(tmp_path, id="stack-lf-full", method={"kind": "full"})
    reason = stacks.unavailable(case)
    if reason is not None:
        pytest.skip(reason)
    rank = _tiny_run(tmp_path, case)
    assert rank.stack.name == "llamafactory" and rank.stack.version == "0.9.5"
    assert rank.stack.trainer in ("CustomSeq2SeqTrainer", "LlamaFactorySeq2SeqTrainer")
    assert rank.weights.param_bytes_local == 4 * rank.weights.params_total
    assert len(rank.step_times_s) == 2 and len(rank.losses) == 2
