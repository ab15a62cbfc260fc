"""Configs read as their tools read them: sizes with their units, keys written once, booleans as the HF
Trainer takes them, memory-relevant keys modelled or named as not modelled, model folders the predictor
cannot build refused with what is supported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from fixed_prediction import fixed_prediction

from harness.cli.main import main
from harness.models.inputs import InputError, load_data
from harness.premerge import check
from harness.premerge.importers import ConfigError, JobSpec, import_config
from harness.pytest_plugin.premerge import entries
from harness.spec.cases import CaseError, load_case
from harness.spec.units import GIB, parse_size

ROOT = Path(__file__).resolve().parent.parent
ONE = JobSpec(gpus=1, gpu_memory=parse_size("24GiB"))
LF = {
    "model_name_or_path": "Qwen/Qwen1.5-0.5B-Chat", "stage": "sft", "finetuning_type": "lora",
    "lora_target": "q_proj,v_proj", "output_dir": "out", "per_device_train_batch_size": 1, "cutoff_len": 256,
    "bf16": True,
}
TA = {
    "model_name_or_path": "Qwen/Qwen1.5-0.5B-Chat", "output_dir": "out", "per_device_train_batch_size": 1,
    "max_length": 256, "bf16": True, "lora_r": 8, "lora_target_modules": "q_proj,v_proj",
}
Z2_OFFLOAD = {"train_micro_batch_size_per_gpu": "auto",
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
Z3 = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 3}}


def write(folder: Path, name: str, data: dict | str) -> Path:
    path = folder / name
    if isinstance(data, str):
        path.write_text(data)
    else:
        path.write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data))
    return path


@pytest.fixture
def predicted(monkeypatch):
    """The predictor answers a fixed device peak (GiB)."""
    def use(device_gib: float):
        predicted = fixed_prediction(GIB, GIB, int(device_gib * GIB), 4 * GIB)
        monkeypatch.setattr(check, "_predictor", lambda: lambda case, arch=None, **kw: predicted)
    return use


def run(capsys, *argv) -> tuple[int, str]:
    code = main(["check", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out + err


# --- Units -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, fix", [("16Gb", "write 16GB or 16GiB"), ("16gb", "write 16GB or 16GiB"),
                                       ("16gib", "write 16GiB"), ("512Mb", "write 512MB or 512MiB"),
                                       ("8b", "write 8B"), ("16GIB", "write 16GiB")])
def test_a_unit_in_the_wrong_case_is_refused_with_the_unit_to_write(text, fix):
    with pytest.raises(ValueError, match=fix):
        parse_size(text)


def test_lowercase_b_is_named_as_bits():
    with pytest.raises(ValueError, match="gigabits"):
        parse_size("16Gb")


def test_a_bare_number_a_person_wrote_is_refused_where_the_harness_own_stay_bytes():
    with pytest.raises(ValueError, match="write 80GiB or 80GB"):
        parse_size(80, bare_numbers=False)
    assert parse_size(80) == 80  # a size the harness wrote back as JSON


def _case_file(tmp_path: Path, memory) -> Path:
    data = yaml.safe_load((ROOT / "cases" / "001-ladder-rung1-zero2.yaml").read_text())
    data["id"] = "001-mine"
    data["target"]["card"]["memory"] = memory
    return write(tmp_path, "001-mine.yaml", yaml.safe_dump(data))


def test_a_case_card_of_a_bare_number_is_refused(tmp_path):
    with pytest.raises(CaseError) as err:
        load_case(_case_file(tmp_path, 12))
    assert "target.card.memory" in str(err.value) and "write 12GiB or 12GB" in str(err.value)
    assert load_case(_case_file(tmp_path, "12 GiB")).target.card.memory == 12 * GIB


def test_premerge_yaml_gpu_memory_without_a_unit_is_a_failing_entry(tmp_path):
    write(tmp_path, "lf.yaml", LF)
    write(tmp_path, "premerge.yaml", "defaults: {gpus: 1, gpu_memory: 80}\n")
    [entry] = entries(tmp_path)
    assert entry.problem is not None
    assert "premerge.yaml" in entry.problem and "defaults.gpu_memory" in entry.problem
    assert "write 80GiB or 80GB" in entry.problem


def test_premerge_yaml_gigabits_are_refused(tmp_path):
    write(tmp_path, "lf.yaml", LF)
    write(tmp_path, "premerge.yaml", "defaults: {gpus: 1, gpu_memory: 16Gb}\n")
    [entry] = entries(tmp_path)
    assert entry.problem and "gigabits" in entry.problem


# --- Keys written twice ----------------------------------------------------------------------------


def test_a_key_written_twice_in_yaml_is_refused_with_its_lines(tmp_path):
    path = write(tmp_path, "lf.yaml", "model_name_or_path: x\ncutoff_len: 512\ncutoff_len: 4096\n")
    with pytest.raises(InputError) as err:
        load_data(path)
    assert err.value.key == "cutoff_len" and "lines 2 and 3" in str(err.value)


def test_yaml_merge_keys_may_still_be_overridden(tmp_path):
    path = write(tmp_path, "m.yaml", "base: &b {x: 1, y: 2}\nmine:\n  <<: *b\n  x: 5\n")
    assert load_data(path)["mine"] == {"x": 5, "y": 2}


@pytest.mark.parametrize("name, text, key", [
    ("lf.yaml", "model_name_or_path: Qwen/Qwen1.5-0.5B-Chat\nbf16: true\nbf16: false\n", "bf16"),
    ("ta.json", '{"model_name_or_path": "Qwen/Qwen1.5-0.5B-Chat", "max_length": 256, "max_length": 9}', "max_length"),
])
def test_training_configs_with_a_key_twice_exit_2_naming_it(tmp_path, capsys, name, text, key):
    code, out = run(capsys, write(tmp_path, name, text), "--gpus", 1, "--gpu-memory", "24GiB")
    assert code == 2 and name in out and f"{key}: is written twice" in out


def test_a_deepspeed_json_with_a_key_twice_is_refused(tmp_path):
    ds = write(tmp_path, "ds.json", '{"zero_optimization": {"stage": 3, "stage": 0}}')
    with pytest.raises(ConfigError) as err:
        import_config(write(tmp_path, "lf.yaml", dict(LF, deepspeed=str(ds))), ONE)
    assert err.value.key == "stage" and err.value.path == ds


def test_a_case_file_with_a_key_twice_is_refused(tmp_path):
    text = (ROOT / "cases" / "001-ladder-rung1-zero2.yaml").read_text() + "\nmodel: qwen1.5-7b-chat\n"
    with pytest.raises(CaseError, match="model: is written twice"):
        load_case(write(tmp_path, "001-ladder-rung1-zero2.yaml", text))


def test_premerge_yaml_with_a_key_twice_is_refused(tmp_path):
    write(tmp_path, "lf.yaml", LF)
    write(tmp_path, "premerge.yaml", "defaults:\n  gpus: 1\n  gpus: 8\n")
    [entry] = entries(tmp_path)
    assert entry.problem and "gpus: is written twice" in entry.problem


def test_a_key_twice_inside_gradient_checkpointing_kwargs_text_is_refused(tmp_path):
    kwargs = '{"use_reentrant": false, "use_reentrant": true}'
    with pytest.raises(ConfigError) as err:
        import_config(write(tmp_path, "ta.json", dict(TA, gradient_checkpointing=True,
                                                      gradient_checkpointing_kwargs=kwargs)), ONE)
    assert err.value.key == "gradient_checkpointing_kwargs.use_reentrant"


# --- Booleans as the framework reads them ----------------------------------------------------------


def test_gradient_checkpointing_false_as_text_is_on_as_the_hf_trainer_runs_it(tmp_path):
    imported = import_config(write(tmp_path, "ta.json", dict(TA, gradient_checkpointing="false")), ONE)
    assert imported.case.train.gradient_checkpointing is True
    from harness.premerge.lints import lint
    [finding] = [f for f in lint(imported) if f.code == "boolean-written-as-text"]
    assert finding.key == "gradient_checkpointing" and "reads it as true" in finding.message


def test_llamafactory_disable_gradient_checkpointing_as_text_disables_it(tmp_path):
    imported = import_config(write(tmp_path, "lf.yaml", dict(LF, disable_gradient_checkpointing="false")), ONE)
    assert imported.case.train.gradient_checkpointing is False
    assert [r.key for r in imported.read_as] == ["disable_gradient_checkpointing"]


def test_deepspeed_reads_false_as_text_as_pydantic_does(tmp_path):
    ds = write(tmp_path, "ds.json", {"zero_optimization": {"stage": 3, "overlap_comm": "false"}})
    imported = import_config(write(tmp_path, "lf.yaml", dict(LF, deepspeed=str(ds))), ONE)
    assert imported.deepspeed.zero["overlap_comm"] is False and not imported.read_as


# --- Keys read but not modelled --------------------------------------------------------------------


def _with_ds(tmp_path: Path, ds: dict, **extra) -> Path:
    ds_path = write(tmp_path, "ds.json", ds)
    return write(tmp_path, "lf.yaml", dict(LF, deepspeed=str(ds_path), **extra))


def test_a_partial_optimizer_offload_is_undecided_not_fits(tmp_path, capsys, predicted):
    predicted(4)
    ds = json.loads(json.dumps(Z2_OFFLOAD))
    full = _with_ds(tmp_path, ds)
    code, out = run(capsys, full, "--gpus", 1, "--gpu-memory", "24GiB")
    assert code == 0 and "verdict: FITS" in out
    ds["zero_optimization"]["offload_optimizer"]["ratio"] = 0.3
    code, out = run(capsys, _with_ds(tmp_path, ds), "--gpus", 1, "--gpu-memory", "24GiB")
    assert code == 1 and "verdict: UNDECIDED" in out
    assert "zero_optimization.offload_optimizer.ratio: 0.3 is read but not modelled" in out


@pytest.mark.parametrize("zero, key", [({"zero_hpz_partition_size": 8}, "zero_optimization.zero_hpz_partition_size"),
                                       ({"mics_shard_size": 8}, "zero_optimization.mics_shard_size")])
def test_zero_plus_plus_and_mics_are_named_and_undecided(tmp_path, capsys, predicted, zero, key):
    predicted(4)
    ds = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 3, **zero}}
    code, out = run(capsys, _with_ds(tmp_path, ds), "--gpus", 8, "--gpu-memory", "24GiB")
    assert code == 1 and "UNDECIDED" in out and f"{key}: 8 is read but not modelled" in out


def test_a_deepspeed_optimizer_block_is_modelled_for_adam_and_named_otherwise(tmp_path):
    adam = import_config(_with_ds(tmp_path, dict(Z3, optimizer={"type": "AdamW", "params": {"lr": 1e-4}})), ONE)
    assert adam.not_modelled == ()
    lamb = import_config(_with_ds(tmp_path, dict(Z3, optimizer={"type": "OneBitLamb"})), ONE)
    [entry] = lamb.not_modelled
    assert entry.key == "optimizer.type" and entry.raises


def test_an_8bit_adam_keeps_fits_and_makes_does_not_fit_undecided(tmp_path, capsys, predicted):
    path = write(tmp_path, "lf.yaml", dict(LF, optim="adamw_bnb_8bit"))
    predicted(4)
    code, out = run(capsys, path, "--gpus", 1, "--gpu-memory", "24GiB")
    assert code == 0 and "verdict: FITS" in out and "optim: 'adamw_bnb_8bit' is read but not modelled" in out
    predicted(40)
    code, out = run(capsys, path, "--gpus", 1, "--gpu-memory", "24GiB")
    assert code == 1 and "verdict: UNDECIDED" in out and "can only lower the peak" in out


@pytest.mark.parametrize("extra, key, raises", [
    ({"torch_dtype": "float32"}, "torch_dtype", True),
    ({"torch_dtype": "bfloat16"}, None, None),
    ({"eval_strategy": "steps", "per_device_eval_batch_size": 16}, "per_device_eval_batch_size", True),
    ({"eval_strategy": "steps", "per_device_eval_batch_size": 1}, None, None),
    ({"label_smoothing_factor": 0.1}, "label_smoothing_factor", True),
    ({"torch_compile": True}, "torch_compile", True),
    ({"optim": "adamw_torch_fused"}, None, None),
    ({"optim": "ademamix"}, "optim", True),
    ({"optim": "paged_adamw_8bit"}, "optim", False),
    ({"auto_find_batch_size": True}, "auto_find_batch_size", False),
])
def test_trainingarguments_memory_keys_are_modelled_or_named(tmp_path, extra, key, raises):
    imported = import_config(write(tmp_path, "ta.json", dict(TA, **extra)), ONE)
    assert [(n.key, n.raises) for n in imported.not_modelled] == ([] if key is None else [(key, raises)])


def test_deepspeed_dtypes_and_a_lion_optimizer_are_named(tmp_path):
    ds = dict(Z3, data_types={"grad_accum_dtype": "fp32"}, communication_data_type="fp32", optimizer={"type": "Lion"})
    imported = import_config(_with_ds(tmp_path, ds), ONE)
    assert {(n.key, n.raises) for n in imported.not_modelled} == {
        ("data_types.grad_accum_dtype", True), ("communication_data_type", True), ("optimizer.type", False)}


def test_an_optimizer_transformers_does_not_know_is_refused(tmp_path):
    with pytest.raises(ConfigError) as err:
        import_config(write(tmp_path, "ta.json", dict(TA, optim="adamw_9bit")), ONE)
    assert err.value.key == "optim"


def test_mixture_of_depths_is_named_and_undecided(tmp_path, capsys, predicted):
    predicted(4)
    code, out = run(capsys, write(tmp_path, "lf.yaml", dict(LF, mixture_of_depths="convert")), "--gpus", 1,
                    "--gpu-memory", "24GiB")
    assert code == 1 and "UNDECIDED" in out and "mixture_of_depths: 'convert' is read but not modelled" in out


def test_check_json_lists_the_keys_not_modelled(tmp_path, capsys, predicted):
    predicted(4)
    code, out = run(capsys, write(tmp_path, "lf.yaml", dict(LF, use_dora=True)), "--gpus", 1,
                    "--gpu-memory", "24GiB", "--json")
    data = json.loads(out)
    assert code == 1 and data["decided"] is False
    assert [(n["key"], n["raises_peak"]) for n in data["not_modelled"]] == [("use_dora", True)]


# --- Model folders the predictor cannot build ------------------------------------------------------


def _model(tmp_path: Path, config: dict) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    base = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 4, "intermediate_size": 512, "vocab_size": 1000}
    (folder / "config.json").write_text(json.dumps({**base, **config}))
    return folder


@pytest.mark.parametrize("config, words", [
    ({"model_type": "frobnicator"}, "'frobnicator' is not a model transformers"),
    ({"model_type": "qwen2_vl", "vision_config": {"depth": 2}}, "'qwen2_vl' is a vision-language model"),
    ({"model_type": "bert", "type_vocab_size": 2}, "'bert' is an encoder-only model"),
    ({"hidden_size": 250}, "hidden_size 250 is not divisible by num_attention_heads 4"),
    ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
])
def test_model_folders_the_predictor_cannot_build_exit_2_naming_what_is_supported(tmp_path, capsys, config, words):
    folder = _model(tmp_path, config)
    code, out = run(capsys, write(tmp_path, "lf.yaml", dict(LF, model_name_or_path=str(folder))), "--gpus", 1,
                    "--gpu-memory", "24GiB")
    assert code == 2, out
    assert words in out and "Traceback" not in out and "internal error" not in out
    if "transformers" in words or "model" in words:
        assert "decoder-only causal language models" in out


def test_lora_target_naming_modules_the_model_lacks_names_those_it_has(tmp_path, capsys):
    folder = _model(tmp_path, {})
    path = write(tmp_path, "lf.yaml", dict(LF, model_name_or_path=str(folder), lora_target="c_attn,c_proj"))
    code, out = run(capsys, path, "--gpus", 1, "--gpu-memory", "24GiB")
    assert code == 2 and "lora_target" in out and "c_attn, c_proj" in out
    assert "q_proj" in out and "down_proj" in out and "internal error" not in out


def test_lora_target_with_one_name_the_model_lacks_is_noted(tmp_path):
    folder = _model(tmp_path, {})
    imported = import_config(write(tmp_path, "lf.yaml", dict(LF, model_name_or_path=str(folder),
                                                              lora_target="q_proj,v_prj")), ONE)
    assert any("v_prj matches no module" in n for n in imported.notes)


def test_lora_target_naming_a_block_not_a_layer_is_refused(tmp_path):
    folder = _model(tmp_path, {})
    with pytest.raises(ConfigError, match="'mlp' names a block"):
        import_config(write(tmp_path, "lf.yaml", dict(LF, model_name_or_path=str(folder), lora_target="mlp")), ONE)


# --- The list of keys ------------------------------------------------------------------------------


def test_every_key_listed_as_not_modelled_is_a_key_its_format_knows_and_is_in_the_docs():
    from harness.premerge.importers import keys

    known = {"LLaMA-Factory": (keys.LLAMAFACTORY_NOT_MODELLED, keys.LLAMAFACTORY_KEYS | keys.HF_TRAINING_KEYS),
             "TrainingArguments": (keys.HF_NOT_MODELLED, keys.HF_TRAINING_KEYS),
             "script": (keys.SCRIPT_NOT_MODELLED, keys.SCRIPT_KEYS)}
    page = (ROOT / "docs" / "case-format.md").read_text()
    for table, names in known.values():
        for key in table:
            assert key in names and f"| `{key}` |" in page
    for dotted in keys.DEEPSPEED_NOT_MODELLED:
        *blocks, last = dotted.split(".")
        assert last in (keys.DEEPSPEED_OFFLOAD_KEYS if blocks[-1:] == ["offload_optimizer"]
                        else keys.DEEPSPEED_ZERO_KEYS if blocks[:1] == ["zero_optimization"]
                        else {"type", "grad_accum_dtype"} | keys.DEEPSPEED_KEYS)
        assert f"| `{dotted}` |" in page


def test_a_batch_size_written_as_text_is_refused_where_the_trainer_keeps_it_as_text(tmp_path):
    with pytest.raises(ConfigError) as err:
        import_config(write(tmp_path, "ta.json", dict(TA, per_device_train_batch_size="4")), ONE)
    assert err.value.key == "per_device_train_batch_size" and "write 4 without quotes" in str(err.value)


def test_deepspeed_zero_numbers_written_as_text_are_read_as_pydantic_reads_them(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": "3", "reduce_bucket_size": "1000"}}
    imported = import_config(_with_ds(tmp_path, ds), ONE)
    assert imported.deepspeed.stage == 3 and imported.deepspeed.zero["reduce_bucket_size"] == 1000


def test_a_case_file_naming_lora_targets_the_model_lacks_exits_2(tmp_path, capsys):
    data = yaml.safe_load((ROOT / "cases" / "001-ladder-rung1-zero2.yaml").read_text())
    data["method"]["lora"]["targets"] = ["c_attn"]
    code, out = run(capsys, write(tmp_path, "001-ladder-rung1-zero2.yaml", yaml.safe_dump(data, allow_unicode=True)))
    assert code == 2 and "method.lora.targets" in out and "c_attn" in out and "q_proj" in out


def test_fit_refuses_a_config_with_a_key_that_can_raise_the_peak_naming_it(tmp_path, capsys, predicted):
    predicted(4)
    path = write(tmp_path, "lf.yaml", dict(LF, mixture_of_depths="convert"))
    code = main(["fit", str(path), "--gpus", "1", "--gpu-memory", "24GiB", "--out", str(tmp_path / "out")])
    out = capsys.readouterr()
    assert code == 2 and "mixture_of_depths" in out.err and "fit cannot call any change fitting" in out.err


def test_case_from_names_the_keys_the_case_does_not_hold_and_expects_its_own_verdict(tmp_path, capsys, predicted):
    predicted(4)
    path = write(tmp_path, "lf.yaml", dict(LF, mixture_of_depths="convert"))
    assert main(["case-from", str(path), "--gpus", "1", "--gpu-memory", "24GiB", "--out", str(tmp_path / "cases")]) == 0
    data = yaml.safe_load((tmp_path / "cases" / "lf.yaml").read_text())
    assert data["expect"]["outcome"] == "fits"  # what the case holds fits; the key is named, not held
    assert "mixture_of_depths: 'convert' is read but not modelled" in data["notes"]


def test_deepspeed_precision_enabled_as_text_is_read_as_its_pydantic_model_reads_it(tmp_path):
    ds = write(tmp_path, "ds.json", {"zero_optimization": {"stage": 2}, "fp16": {"enabled": "false"}})
    imported = import_config(write(tmp_path, "lf.yaml", dict(LF, deepspeed=str(ds))), ONE)
    assert imported.deepspeed.fp16 is False and not imported.read_as


def test_check_refuses_gigabits_on_the_command_line(tmp_path, capsys):
    code, out = run(capsys, write(tmp_path, "lf.yaml", LF), "--gpus", 1, "--gpu-memory", "16Gb")
    assert code == 2 and "--gpu-memory" in out and "gigabits" in out and "16GB or 16GiB" in out


def test_a_model_config_json_with_a_key_twice_is_refused(tmp_path, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama", "hidden_size": 256, "hidden_size": 4096}')
    code, out = run(capsys, write(tmp_path, "lf.yaml", dict(LF, model_name_or_path=str(folder))), "--gpus", 1,
                    "--gpu-memory", "24GiB")
    assert code == 2 and "hidden_size: is written twice" in out
