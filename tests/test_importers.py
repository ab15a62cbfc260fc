"""Importers: LLaMA-Factory YAML, DeepSpeed JSON, TrainingArguments JSON and case files into a Case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from harness.models.registry import load_architecture
from harness.models.source import ModelSourceError, architecture_from_config_json, registry_name_for, resolve_model
from harness.premerge.importers import ConfigError, JobSpec, import_config, scan_init_order
from harness.spec.schema import Offload
from harness.spec.units import parse_size

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "configs" / "examples"
DCU = JobSpec(gpus=8, gpu_memory=parse_size("64GiB"), vendor="hygon")
ONE = JobSpec(gpus=1, gpu_memory=parse_size("16GiB"))
H32 = 5120  # DeepSeek-R1-Distill-Qwen-32B hidden size

LF_MIN = {
    "model_name_or_path": "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B",
    "stage": "sft",
    "finetuning_type": "lora",
    "dataset": "alpaca",
    "template": "deepseek3",
    "output_dir": "out",
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 4,
    "cutoff_len": 512,
    "bf16": True,
}

TA_MIN = {
    "model_name_or_path": "Qwen/Qwen1.5-7B-Chat",
    "output_dir": "out",
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 16,
    "max_seq_length": 1024,
    "bf16": True,
}


def write(tmp_path: Path, name: str, data) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data), encoding="utf-8")
    return path


# --- LLaMA-Factory YAML -------------------------------------------------------------------------


def test_guide000_yaml_becomes_its_case():
    imported = import_config(EXAMPLES / "000-ds32b-optimized.yaml", DCU)
    case = imported.case
    assert case.model == "deepseek-r1-distill-qwen-32b"
    assert imported.arch.name == "deepseek-r1-distill-qwen-32b"
    assert case.stack.value == "llamafactory"
    assert case.method.kind == "lora"
    assert (case.method.lora.r, case.method.lora.alpha, case.method.lora.targets) == (8, 16, "all")
    assert (case.train.micro_batch, case.train.grad_accum, case.train.seq_len) == (1, 32, 512)
    assert case.train.gradient_checkpointing is True
    assert case.train.pin_memory is False  # dataloader_pin_memory: false
    assert case.precision.value == "bf16"
    ds = case.deepspeed
    assert ds.stage == 3 and ds.offload_optimizer == Offload.cpu and ds.offload_param == Offload.cpu
    assert ds.pin_memory is False
    assert ds.stage3_prefetch_bucket_size == 10_000_000  # 1e7 in the JSON, an int here
    assert ds.stage3_param_persistence_threshold == 10_000
    assert ds.reduce_bucket_size == H32 * H32  # "auto"
    assert case.launch.launcher == "torchrun" and case.launch.ranks == 8
    assert case.target.card.memory == 64 * 2**30 and case.target.card.count == 8
    assert case.target.card.vendor == "hygon"
    assert imported.sources == (EXAMPLES / "000-ds32b-optimized.yaml", EXAMPLES / "ds_z3_offload_aggressive.json")


def test_llamafactory_defaults(tmp_path):
    """LLaMA-Factory checkpoints by default, alpha defaults to twice the rank, targets to all."""
    data = dict(LF_MIN, lora_rank=16)
    imported = import_config(write(tmp_path, "lf.yaml", data), ONE)
    case = imported.case
    assert case.train.gradient_checkpointing is True
    assert imported.training.gradient_checkpointing_key == ""
    assert case.method.lora.alpha == 32
    assert case.method.lora.targets == "all"
    assert case.deepspeed is None


def test_llamafactory_disable_gradient_checkpointing(tmp_path):
    data = dict(LF_MIN, disable_gradient_checkpointing=True)
    assert import_config(write(tmp_path, "lf.yaml", data), ONE).case.train.gradient_checkpointing is False


@pytest.mark.parametrize("flash_attn, attn", [("auto", None), ("disabled", "eager"), ("sdpa", "sdpa"),
                                               ("fa2", "flash_attention_2"), (None, None)])
def test_llamafactory_flash_attn_names_the_attention_kernel(tmp_path, flash_attn, attn):
    """flash_attn (LLaMA-Factory's configure_attn_implementation) becomes train.attn_implementation;
    auto, or no key, leaves it to transformers' default."""
    data = dict(LF_MIN) if flash_attn is None else dict(LF_MIN, flash_attn=flash_attn)
    assert import_config(write(tmp_path, "lf.yaml", data), ONE).case.train.attn_implementation == attn


def test_llamafactory_flash_attn_not_modelled_names_the_key(tmp_path):
    with pytest.raises(ConfigError) as err:
        import_config(write(tmp_path, "lf.yaml", dict(LF_MIN, flash_attn="fa3")), ONE)
    assert err.value.key == "flash_attn" and "fa2" in str(err.value)


def test_training_args_attn_implementation_is_the_cases(tmp_path):
    case = import_config(write(tmp_path, "ta.json", dict(TA_MIN, attn_implementation="eager")), ONE).case
    assert case.train.attn_implementation == "eager"
    assert import_config(write(tmp_path, "ta.json", TA_MIN), ONE).case.train.attn_implementation is None
    with pytest.raises(ConfigError) as err:
        import_config(write(tmp_path, "ta.json", dict(TA_MIN, attn_implementation="flex")), ONE)
    assert err.value.key == "attn_implementation"


def test_llamafactory_use_reentrant_gc(tmp_path):
    """use_reentrant_gc (LLaMA-Factory's default: true) becomes train.checkpointing_reentrant."""
    default = import_config(write(tmp_path, "lf.yaml", LF_MIN), ONE)
    assert default.case.train.checkpointing_reentrant is True
    assert default.training.checkpointing_reentrant is True and default.training.checkpointing_reentrant_key == ""
    off = import_config(write(tmp_path, "lf.yaml", dict(LF_MIN, use_reentrant_gc=False)), ONE)
    assert off.case.train.checkpointing_reentrant is False
    assert off.training.checkpointing_reentrant_key == "use_reentrant_gc"
    no_gc = dict(LF_MIN, disable_gradient_checkpointing=True, use_reentrant_gc=False)
    assert import_config(write(tmp_path, "lf.yaml", no_gc), ONE).case.train.checkpointing_reentrant is None
    with pytest.raises(ConfigError) as err:
        import_config(write(tmp_path, "lf.yaml", dict(LF_MIN, use_reentrant_gc="sometimes")), ONE)
    assert err.value.key == "use_reentrant_gc"


def test_contradictory_checkpointing_keys(tmp_path):
    data = dict(LF_MIN, disable_gradient_checkpointing=True, gradient_checkpointing=True)
    with pytest.raises(ConfigError) as err:
        import_config(write(tmp_path, "lf.yaml", data), ONE)
    assert err.value.key == "gradient_checkpointing"
    assert "disable_gradient_checkpointing" in str(err.value)


def test_lora_target_list_and_quantization(tmp_path):
    data = dict(LF_MIN, lora_target="q_proj, v_proj", quantization_bit=4, deepspeed=None)
    case = import_config(write(tmp_path, "lf.yaml", data), ONE).case
    assert case.method.kind == "qlora"
    assert case.method.lora.targets == ["q_proj", "v_proj"]
    assert case.method.quantization.quant_type == "nf4" and case.method.quantization.double_quant is True


@pytest.mark.parametrize("extra, key, words", [
    ({"quantization_bit": 8}, "quantization_bit", "8-bit"),
    ({"quantization_bit": 4, "finetuning_type": "full"}, "quantization_bit", "full"),
    ({"finetuning_type": "freeze"}, "finetuning_type", "freeze"),
    ({"stage": "dpo"}, "stage", "dpo"),
    ({"quantization_bit": 4, "quantization_method": "gptq"}, "quantization_method", "gptq"),
    ({"lora_rank": "eight"}, "lora_rank", "whole number"),
    ({"fsdp": "full_shard"}, "fsdp", "FSDP"),
])
def test_unsupported_settings_name_the_key(tmp_path, extra, key, words):
    with pytest.raises(ConfigError) as err:
        import_config(write(tmp_path, "lf.yaml", dict(LF_MIN, **extra)), ONE)
    assert err.value.key == key
    assert words in str(err.value)
    assert str(tmp_path / "lf.yaml") in str(err.value)


def test_unknown_key_suggests_the_close_one(tmp_path):
    with pytest.raises(ConfigError) as err:
        import_config(write(tmp_path, "lf.yaml", dict(LF_MIN, lora_rnak=8)), ONE)
    assert err.value.key == "lora_rnak"
    assert "did you mean 'lora_rank'" in str(err.value)


def test_known_irrelevant_keys_are_accepted(tmp_path):
    data = dict(LF_MIN, plot_loss=True, report_to="none", ddp_timeout=180000000, flash_attn="auto",
                preprocessing_num_workers=8, include_num_input_tokens_seen=True, lr_scheduler_type="cosine")
    assert import_config(write(tmp_path, "lf.yaml", data), ONE).case is not None


def test_deepspeed_path_relative_to_the_yaml(tmp_path, monkeypatch):
    sub = tmp_path / "sub"
    sub.mkdir()
    write(sub, "ds.json", {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"})
    monkeypatch.chdir(tmp_path)  # the working directory is not the YAML's folder
    imported = import_config(write(sub, "lf.yaml", dict(LF_MIN, deepspeed="ds.json")), DCU)
    assert imported.case.deepspeed.stage == 2
    assert imported.deepspeed.path == sub / "ds.json"


def test_missing_deepspeed_file_names_the_key(tmp_path):
    with pytest.raises(ConfigError) as err:
        import_config(write(tmp_path, "lf.yaml", dict(LF_MIN, deepspeed="nope.json")), DCU)
    assert err.value.key == "deepspeed" and "nope.json" in str(err.value)


def test_cli_deepspeed_replaces_the_configs(tmp_path):
    other = write(tmp_path, "z2.json", {"zero_optimization": {"stage": 2}})
    spec = JobSpec(gpus=8, gpu_memory=parse_size("64GiB"), deepspeed=other)
    imported = import_config(EXAMPLES / "000-ds32b-optimized.yaml", spec)
    assert imported.case.deepspeed.stage == 2
    assert any("replaces" in n for n in imported.notes)


def test_gpus_are_required(tmp_path):
    with pytest.raises(ConfigError) as err:
        import_config(write(tmp_path, "lf.yaml", LF_MIN), JobSpec(gpu_memory=parse_size("64GiB")))
    assert "--gpus" in str(err.value)


def test_several_procs_per_gpu_are_independent_jobs(tmp_path):
    spec = JobSpec(gpus=7, gpu_memory=parse_size("23.52GiB"), procs_per_gpu=2)
    imported = import_config(write(tmp_path, "lf.yaml", LF_MIN), spec)
    assert imported.case.launch.ranks == 1 and imported.case.launch.procs_per_card == 2


# --- DeepSpeed JSON -----------------------------------------------------------------------------


def test_auto_values_resolved_as_hf_does():
    imported = import_config(EXAMPLES / "000-ds32b-failing.yaml", DCU)
    ds = imported.case.deepspeed
    assert ds.reduce_bucket_size == H32 * H32
    assert ds.stage3_prefetch_bucket_size == int(0.9 * H32 * H32)
    assert ds.stage3_param_persistence_threshold == 10 * H32
    assert ds.stage3_max_live_parameters == 10**9 and ds.sub_group_size == 10**9
    assert ds.pin_memory is True
    assert imported.deepspeed.train_batch_size is None  # "auto": the HF integration fills it
    assert imported.deepspeed.fp16 is None and imported.deepspeed.bf16 is None


def test_left_out_deepspeed_keys_take_deepspeeds_defaults(tmp_path):
    ds = write(tmp_path, "ds.json", {"zero_optimization": {"stage": 3}})
    case = import_config(write(tmp_path, "lf.yaml", dict(LF_MIN, deepspeed="ds.json")), DCU).case
    assert case.deepspeed.stage3_prefetch_bucket_size == 50_000_000
    assert case.deepspeed.stage3_param_persistence_threshold == 100_000
    assert case.deepspeed.reduce_bucket_size == 500_000_000
    assert ds.exists()


@pytest.mark.parametrize("zero, key, words", [
    ({"stage": 2, "offload_param": {"device": "cpu"}}, "zero_optimization.offload_param", "stage 3"),
    ({"stage": 3, "offload_param": {"device": "nvme"}}, "zero_optimization.offload_param.device", "NVMe"),
    ({"stage": 5}, "zero_optimization.stage", "does not exist"),
    ({"stage": 3, "stage3_prefetch_bucket_sise": 1}, "zero_optimization.stage3_prefetch_bucket_sise", "did you mean"),
])
def test_bad_deepspeed_settings(tmp_path, zero, key, words):
    write(tmp_path, "ds.json", {"zero_optimization": zero})
    with pytest.raises(ConfigError) as err:
        import_config(write(tmp_path, "lf.yaml", dict(LF_MIN, deepspeed="ds.json")), DCU)
    assert err.value.key == key and words in str(err.value)
    assert err.value.path == tmp_path / "ds.json"


def test_deepspeed_json_alone_is_not_a_training_config():
    with pytest.raises(ConfigError) as err:
        import_config(EXAMPLES / "ds_z3_offload_config.json", DCU)
    assert "--deepspeed" in str(err.value)


# --- TrainingArguments JSON ---------------------------------------------------------------------


def test_training_args_qlora():
    imported = import_config(EXAMPLES / "003-qwen7b-qlora-fix1.json", ONE)
    case = imported.case
    assert case.model == "qwen1.5-7b-chat"
    assert case.method.kind == "qlora"
    assert (case.method.lora.r, case.method.lora.alpha, case.method.lora.dropout) == (32, 64, 0.05)
    assert case.method.quantization.compute_dtype.value == "bf16"
    # a TrainingArguments config trains with the HF Trainer, whose QLoRA recipe prepares 4-bit models through peft
    assert case.stack.value == "hf_trainer" and case.stack.kbit_prepared
    assert (case.train.micro_batch, case.train.grad_accum, case.train.seq_len) == (1, 16, 1024)
    assert case.train.gradient_checkpointing is True  # TrainingArguments: off unless set; set here
    assert case.train.dataloader_workers == 2
    assert imported.launcher == "python"


def test_training_args_needs_a_sequence_length(tmp_path):
    data = {k: v for k, v in TA_MIN.items() if k != "max_seq_length"}
    with pytest.raises(ConfigError) as err:
        import_config(write(tmp_path, "ta.json", data), ONE)
    assert err.value.key == "max_length"


def test_training_args_checkpointing_off_by_default(tmp_path):
    assert import_config(write(tmp_path, "ta.json", TA_MIN), ONE).case.train.gradient_checkpointing is False


@pytest.mark.parametrize("kwargs, reentrant", [
    ({"use_reentrant": False}, False), ({"use_reentrant": True}, True), ('{"use_reentrant": false}', False),
    ({}, None), (None, None),
])
def test_training_args_gradient_checkpointing_kwargs(tmp_path, kwargs, reentrant):
    data = dict(TA_MIN, gradient_checkpointing=True)
    if kwargs is not None:
        data["gradient_checkpointing_kwargs"] = kwargs
    imported = import_config(write(tmp_path, "ta.json", data), ONE)
    assert imported.case.train.checkpointing_reentrant is reentrant
    assert imported.training.checkpointing_reentrant is bool(reentrant)  # plain transformers: non-reentrant


@pytest.mark.parametrize("kwargs, key", [
    ("use_reentrant", "gradient_checkpointing_kwargs"),
    ({"use_reentrant": "maybe"}, "gradient_checkpointing_kwargs.use_reentrant"),
])
def test_training_args_bad_gradient_checkpointing_kwargs(tmp_path, kwargs, key):
    data = dict(TA_MIN, gradient_checkpointing=True, gradient_checkpointing_kwargs=kwargs)
    with pytest.raises(ConfigError) as err:
        import_config(write(tmp_path, "ta.json", data), ONE)
    assert err.value.key == key


def test_training_args_four_bit_needs_lora(tmp_path):
    with pytest.raises(ConfigError) as err:
        import_config(write(tmp_path, "ta.json", dict(TA_MIN, load_in_4bit=True)), ONE)
    assert err.value.key == "load_in_4bit"


def test_training_args_on_several_gpus_assumes_torchrun(tmp_path):
    write(tmp_path, "ds.json", {"zero_optimization": {"stage": 2}})
    imported = import_config(write(tmp_path, "ta.json", dict(TA_MIN, deepspeed="ds.json")),
                             JobSpec(gpus=4, gpu_memory=parse_size("80GB")))
    assert imported.launcher == "torchrun" and imported.case.launch.ranks == 4
    assert any("assumed torchrun" in n for n in imported.notes)


def test_qlora_with_zero3_is_imported_but_not_predictable(tmp_path):
    write(tmp_path, "ds.json", {"zero_optimization": {"stage": 3}})
    imported = import_config(write(tmp_path, "lf.yaml", dict(LF_MIN, quantization_bit=4, deepspeed="ds.json")), DCU)
    assert imported.case is None and "ZeRO-3" in imported.unpredictable


# --- Case files ---------------------------------------------------------------------------------


def test_case_file_keeps_its_target_unless_overridden():
    path = ROOT / "cases" / "004-gla-failing-bs4-2procs.yaml"
    imported = import_config(path, JobSpec())
    assert imported.case.id == "004-gla-failing-bs4-2procs"
    assert (imported.gpus, imported.procs_per_gpu) == (7, 2)
    assert imported.gpu_memory == parse_size("23.52GiB")
    overridden = import_config(path, JobSpec(procs_per_gpu=1, gpu_memory=parse_size("40GiB")))
    assert overridden.case.launch.procs_per_card == 1 and overridden.case.target.card.memory == 40 * 2**30


def test_invalid_case_file(tmp_path):
    data = yaml.safe_load((ROOT / "cases" / "003-qlora-fix-r32-seq1024-gc.yaml").read_text())
    data["id"] = "003-broken"
    data["train"]["micro_btach"] = 1
    with pytest.raises(ConfigError) as err:
        import_config(write(tmp_path, "003-broken.yaml", data), JobSpec())
    assert "micro_btach" in str(err.value)


# --- Models -------------------------------------------------------------------------------------


@pytest.mark.parametrize("reference, name", [
    ("deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", "deepseek-r1-distill-qwen-32b"),
    ("Qwen/Qwen1.5-7B-Chat", "qwen1.5-7b-chat"),
    ("google/gemma-3-27b-it", "gemma-3-27b"),
    ("fla-hub/gla-1.3B-100B", "gla-1.3b-100b"),
    ("qwen1.5-0.5b-chat", "qwen1.5-0.5b-chat"),
    ("meta-llama/Llama-2-7b-hf", None),
])
def test_hub_ids_map_to_the_registry(reference, name):
    assert registry_name_for(reference) == name


def _config_dir(tmp_path: Path, name: str, config: dict) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_local_config_equal_to_the_registry(tmp_path):
    config = dict(load_architecture("qwen1.5-7b-chat").config)
    folder = _config_dir(tmp_path, "Qwen1.5-7B-Chat", config)
    imported = import_config(write(tmp_path, "ta.json", dict(TA_MIN, model_name_or_path=str(folder))), ONE)
    assert imported.case.model == "qwen1.5-7b-chat"
    assert imported.arch.source.endswith("config.json")
    assert not any("not in the registry" in n for n in imported.notes)


def test_local_config_unlike_the_registry_is_carried_beside_the_case(tmp_path):
    config = dict(load_architecture("qwen1.5-7b-chat").config, num_hidden_layers=40)
    folder = _config_dir(tmp_path, "my-qwen", config)
    imported = import_config(write(tmp_path, "ta.json", dict(TA_MIN, model_name_or_path="my-qwen")), ONE)
    assert imported.arch.layers == 40  # what the predictor sizes
    assert imported.case.model == str(folder.resolve())  # the case names the folder itself
    assert any("not in the registry" in n for n in imported.notes)
    assert folder.is_dir()


def test_multimodal_config_uses_its_text_config(tmp_path):
    text = dict(load_architecture("gemma-3-27b").config)
    folder = _config_dir(tmp_path, "gemma", {"model_type": "gemma3", "text_config": text, "vision_config": {}})
    resolved = resolve_model(str(folder))
    assert resolved.registry_name == "gemma-3-27b"


def test_model_dir_without_config(tmp_path):
    (tmp_path / "empty-model").mkdir()
    with pytest.raises(ConfigError) as err:
        import_config(write(tmp_path, "ta.json", dict(TA_MIN, model_name_or_path="empty-model")), ONE)
    assert err.value.key == "model_name_or_path" and "config.json" in str(err.value)


def test_config_json_missing_shapes(tmp_path):
    folder = _config_dir(tmp_path, "partial", {"model_type": "qwen2", "hidden_size": 64})
    with pytest.raises(ModelSourceError) as err:
        architecture_from_config_json(folder)
    assert "num_hidden_layers" in err.value.problem


def test_unknown_hub_id(tmp_path):
    with pytest.raises(ConfigError) as err:
        import_config(write(tmp_path, "ta.json", dict(TA_MIN, model_name_or_path="meta-llama/Llama-2-7b-hf")), ONE)
    assert "config.json" in err.value.fix


# --- Training scripts ---------------------------------------------------------------------------


def test_scan_finds_the_model_built_before_deepspeed(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments\n"
        "tok = AutoTokenizer.from_pretrained('m')\n"
        "model = AutoModelForCausalLM.from_pretrained('m')\n"
        "args = TrainingArguments(output_dir='o', deepspeed='ds.json')\n")
    found = scan_init_order(script)
    assert found.order == "model_first" and "train.py:3" in found.evidence


def test_scan_accepts_deepspeed_first(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "from transformers import AutoModelForCausalLM\n"
        "from transformers.integrations import HfDeepSpeedConfig\n"
        "dschf = HfDeepSpeedConfig('ds.json')\n"
        "model = AutoModelForCausalLM.from_pretrained('m')\n")
    assert scan_init_order(script).order == "deepspeed_first"


# --- The Triton kernel cache a job starts with ------------------------------------------------------

FIT_DATA = ROOT / "tests" / "data" / "fit"


def test_a_training_config_is_judged_on_its_first_launch_unless_told_warm():
    """Guide 004's jobs ran out of memory compiling fla's kernels on their first launch; an imported
    config does not say whether the host has them, so it is predicted cold, and the note says how to
    ask for a warm cache."""
    spec = JobSpec(gpus=7, gpu_memory=parse_size("23.52GiB"), procs_per_gpu=2)
    cold = import_config(FIT_DATA / "004-gla-failing.json", spec)
    assert cold.case.launch.triton_cache == "cold"
    assert any("cold Triton cache" in n and "--triton-cache warm" in n for n in cold.notes)
    warm = import_config(FIT_DATA / "004-gla-failing.json", JobSpec(**{**spec.__dict__, "triton_cache": "warm"}))
    assert warm.case.launch.triton_cache == "shared"
    assert any("warm Triton cache" in n and "--triton-cache" in n for n in warm.notes)


def test_a_case_file_keeps_its_triton_cache_unless_the_flag_says():
    path = ROOT / "cases" / "004-gla-plan-b-bs2.yaml"
    assert import_config(path, JobSpec()).case.launch.triton_cache == "shared"
    assert import_config(path, JobSpec(triton_cache="cold")).case.launch.triton_cache == "cold"
    failing = ROOT / "cases" / "004-gla-failing-bs4-2procs.yaml"
    assert import_config(failing, JobSpec()).case.launch.triton_cache == "cold"
    assert import_config(failing, JobSpec(triton_cache="warm")).case.launch.triton_cache == "shared"


def test_a_model_without_triton_kernels_is_untouched_by_the_cache_state(tmp_path):
    """Its case is the one it was before the cache state existed (the same digest, so runs of it still
    bless), whatever --triton-cache says."""
    path = write(tmp_path, "ta.json", TA_MIN)
    imported = import_config(path, ONE)
    assert not any("Triton" in n for n in imported.notes)
    assert imported.case.launch.triton_cache == "shared"
    told = import_config(path, JobSpec(**{**ONE.__dict__, "triton_cache": "cold"}))
    assert told.case.launch.triton_cache == "shared"


def test_an_unknown_triton_cache_state_names_the_flag():
    with pytest.raises(ConfigError) as err:
        import_config(FIT_DATA / "004-gla-failing.json", JobSpec(gpus=1, gpu_memory=parse_size("24GiB"),
                                                                  triton_cache="lukewarm"))
    assert "--triton-cache" in str(err.value) and "cold, warm" in str(err.value)
