"""`oom-harness case-from`: a team's training config becomes a case file that validates, names its
source, expects what the prediction says, runs at tiny size, and is blessed from outside the bundled
suite."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from harness.cli.main import main
from harness.measure.records import CaseRun, Memory, RankReport
from harness.runtime.stacks import unavailable
from harness.spec.cases import load_case
from harness.spec.units import GIB

DATA = Path(__file__).parent / "data"

LLAMAFACTORY_LORA = """\
### model
model_name_or_path: ../models/llama-3.1-8b
### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 16
lora_target: all
### dataset
dataset: alpaca_en_demo
template: llama3
cutoff_len: 1024
### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
bf16: true
"""

ZERO3 = {"zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_max_live_parameters": 1e9},
         "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto",
         "gradient_accumulation_steps": "auto"}


@pytest.fixture()
def team(tmp_path) -> Path:
    """A team's repository: training configs in configs/, the model's config.json in models/."""
    shutil.copytree(DATA / "llama-3.1-8b", tmp_path / "models" / "llama-3.1-8b")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "llama3_lora_sft.yaml").write_text(LLAMAFACTORY_LORA)
    return tmp_path


def _case_from(team: Path, *args: str) -> int:
    return main(["case-from", str(team / "configs" / "llama3_lora_sft.yaml"), "--out", str(team / "cases"), *args])


def test_a_llamafactory_config_becomes_a_case_naming_its_source(team, capsys):
    assert _case_from(team, "--gpu-memory", "24GiB", "--gpus", "1") == 0
    path = team / "cases" / "llama3_lora_sft.yaml"
    assert f"wrote {path}" in capsys.readouterr().out
    data = yaml.safe_load(path.read_text())
    assert "guide" not in data
    assert data["model"] == "../models/llama-3.1-8b"  # relative to the case file: the repo moves as a whole
    assert data["source"]["config"] == "../configs/llama3_lora_sft.yaml"
    assert "LLaMA-Factory" in data["source"]["title"]
    case = load_case(path)
    assert Path(case.model) == (team / "models" / "llama-3.1-8b").resolve()
    assert (case.stack.value, case.method.kind, case.method.lora.r, case.method.lora.alpha) == ("llamafactory",
                                                                                               "lora", 16, 32)
    assert (case.train.seq_len, case.train.grad_accum, case.train.gradient_checkpointing) == (1024, 8, True)
    assert case.target.card.memory == 24 * GIB and case.target.card.count == 1 and case.target.headroom == 0.9
    # the expected outcome is the prediction's, and the prediction is kept beside it
    p = case.predicted
    assert p.per_card_peak > 15 * GIB  # 8.03 B bf16 weights alone are 14.96 GiB
    assert p.budget == pytest.approx(0.9 * 24 * GIB, rel=0.001)
    assert 0 < p.margin < p.per_card_peak
    assert case.expect.outcome == ("fits" if p.per_card_peak + p.margin <= p.budget else "oom")
    assert p.predictor_version and p.date


def test_the_expected_outcome_follows_the_cards(team):
    assert _case_from(team, "--gpu-memory", "80GiB", "--gpus", "1", "--id", "on-80g", "--card-name", "H100") == 0
    assert _case_from(team, "--gpu-memory", "16GB", "--gpus", "1", "--id", "on-16g") == 0
    big, small = load_case(team / "cases" / "on-80g.yaml"), load_case(team / "cases" / "on-16g.yaml")
    assert big.expect.outcome == "fits" and big.target.card.name == "H100"
    assert small.expect.outcome == "oom"
    assert "memory: 16 GB" in (team / "cases" / "on-16g.yaml").read_text()  # the size as the vendor prints it
    assert big.predicted.per_card_peak == small.predicted.per_card_peak  # the same job on other cards


def test_a_deepspeed_config_is_kept_in_the_case(team):
    (team / "configs" / "ds_z3.json").write_text(json.dumps(ZERO3))
    assert _case_from(team, "--deepspeed", str(team / "configs" / "ds_z3.json"), "--gpu-memory", "24GiB",
                      "--gpus", "4") == 0
    data = yaml.safe_load((team / "cases" / "llama3_lora_sft.yaml").read_text())
    assert data["source"]["deepspeed"] == "../configs/ds_z3.json"
    case = load_case(team / "cases" / "llama3_lora_sft.yaml")
    assert case.deepspeed.stage == 3 and case.deepspeed.stage3_max_live_parameters == 10**9
    assert case.launch.ranks == 4 and case.target.card.count == 4


def test_a_training_arguments_json_with_a_registry_model(team):
    """A registry model stays a registry name in the case (no folder to find)."""
    config = {"model_name_or_path": "Qwen/Qwen1.5-7B-Chat", "output_dir": "out", "per_device_train_batch_size": 2,
              "gradient_accumulation_steps": 4, "max_seq_length": 512, "bf16": True, "lora_r": 8,
              "lora_alpha": 16, "lora_target_modules": ["q_proj", "v_proj"], "gradient_checkpointing": True}
    (team / "configs" / "qwen_sft.json").write_text(json.dumps(config))
    assert main(["case-from", str(team / "configs" / "qwen_sft.json"), "--gpu-memory", "40GiB", "--gpus", "1",
                 "--out", str(team / "cases")]) == 0
    data = yaml.safe_load((team / "cases" / "qwen_sft.yaml").read_text())
    assert data["model"] == "qwen1.5-7b-chat" and "TrainingArguments" in data["source"]["title"]
    case = load_case(team / "cases" / "qwen_sft.yaml")
    assert (case.train.micro_batch, case.train.seq_len, case.method.lora.targets) == (2, 512, ["q_proj", "v_proj"])


@pytest.mark.parametrize(("args", "where"), [
    (["--gpu-memory", "24GiB"], "--gpus"),
    (["--gpus", "1", "--gpu-memory", "24 parsecs"], "--gpu-memory"),
    (["--gpus", "1", "--gpu-memory", "24GiB", "--id", "../escape"], "--id"),
    (["--gpus", "1", "--gpu-memory", "24GiB", "--depth-points", "8,32"], "--depth-points"),  # Llama-3.1-8B: 32 layers
])
def test_bad_input_is_one_line_naming_the_key_and_the_fix(team, capsys, args, where):
    assert _case_from(team, *args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("oom-harness case-from:") and where in err
    assert not (team / "cases").exists() or not list((team / "cases").glob("*.yaml"))


def test_a_missing_model_folder_names_the_config_and_its_key(team, capsys):
    text = LLAMAFACTORY_LORA.replace("../models/llama-3.1-8b", "../models/llama-3.3-70b")
    (team / "configs" / "llama3_lora_sft.yaml").write_text(text)
    assert _case_from(team, "--gpu-memory", "24GiB", "--gpus", "1") == 2
    err = capsys.readouterr().err
    assert "llama3_lora_sft.yaml: model_name_or_path" in err and "Fix:" in err and "config.json" in err


def test_an_existing_case_is_replaced_only_when_asked(team, capsys):
    assert _case_from(team, "--gpu-memory", "24GiB", "--gpus", "1") == 0
    assert _case_from(team, "--gpu-memory", "80GiB", "--gpus", "1") == 2
    assert "--force" in capsys.readouterr().err
    assert load_case(team / "cases" / "llama3_lora_sft.yaml").target.card.memory == 24 * GIB
    assert _case_from(team, "--gpu-memory", "80GiB", "--gpus", "1", "--force") == 0
    assert load_case(team / "cases" / "llama3_lora_sft.yaml").target.card.memory == 80 * GIB


def test_a_full_disk_keeps_the_case_file_it_would_replace(team, capsys, monkeypatch):
    import errno

    from harness.spec import files

    assert _case_from(team, "--gpu-memory", "24GiB", "--gpus", "1") == 0
    path = team / "cases" / "llama3_lora_sft.yaml"
    before = path.read_text()

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "fsync", full)
    assert _case_from(team, "--gpu-memory", "80GiB", "--gpus", "1", "--force") == 2
    assert f"{path}: could not be written (No space left on device)" in capsys.readouterr().err
    assert path.read_text() == before
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def _real_run(case_id: str) -> dict:
    rank = RankReport(case_id=case_id, fidelity="real", rank=0, world_size=1, platform="cuda",
                      device_name="NVIDIA H100 80GB HBM3", emulated_card_bytes=24 * GIB,
                      load=Memory(allocated=int(15.2 * GIB), reserved=int(15.3 * GIB), device=int(15.9 * GIB)),
                      step=Memory(allocated=int(19 * GIB), reserved=int(20 * GIB), device=int(20.8 * GIB)),
                      step_times_s=[9.0, 2.0, 2.0], tokens_per_step=8192, flops_per_token=3e10,
                      losses=[12.8, 11.0, 10.5], versions={"torch": "2.13.0", "cuda": "13.0"})
    run = CaseRun(case_id=case_id, fidelity="real", command=[], returncode=0, wall_s=40.0, ranks=[rank])
    return {"case": case_id, "fidelity": "real", "run": json.loads(run.model_dump_json()), "verdicts": []}


def test_a_team_case_is_blessed_from_its_own_folder(team, capsys):
    assert _case_from(team, "--gpu-memory", "24GiB", "--gpus", "1") == 0
    runs = team / "runs.json"
    runs.write_text(json.dumps([_real_run("llama3_lora_sft")]))
    baselines = team / "baselines"
    assert main(["bless", str(runs), "--baselines-dir", str(baselines)]) == 2
    assert "--case-dir" in capsys.readouterr().err  # not in the bundled suite: says where to point
    assert main(["bless", str(runs), "--case-dir", str(team / "cases"), "--baselines-dir", str(baselines)]) == 0
    (path,) = baselines.glob("*/llama3_lora_sft.json")
    blessed = json.loads(path.read_text())
    assert blessed["case_id"] == "llama3_lora_sft" and blessed["measured"] == "full depth"
    assert blessed["runs"][0]["per_card_peak"] == int(20.8 * GIB)


# Under `-n 2 --dist loadgroup` this id runs the test in the worker of the case items
# (harness.pytest_plugin.xdist_groups.GROUP), whose zygote of LLaMA-Factory's interpreter is started
# already: the tiny run below forks its worker from it instead of paying that zygote's imports again.
BESIDE_THE_CASES = pytest.mark.parametrize("_beside", [pytest.param(None, id="oom-harness-cases")])


@BESIDE_THE_CASES
def test_the_written_case_runs_green_at_tiny_size(team, capsys, _beside):
    """The whole path a team's CI takes: case-from, then `oom-harness run --case-dir DIR --fidelity tiny`.
    (Its worker runs on LLaMA-Factory's interpreter, forked from this process's zygote of that interpreter.)"""
    assert _case_from(team, "--gpu-memory", "24GiB", "--gpus", "1") == 0
    reason = unavailable(load_case(team / "cases" / "llama3_lora_sft.yaml"))
    if reason is not None:  # a LLaMA-Factory config runs through LLaMA-Factory (harness.runtime.stacks)
        pytest.skip(reason)
    out = team / "run.json"
    code = main(["run", "--case-dir", str(team / "cases"), "--fidelity", "tiny", "--out", str(team / "runs"),
                 "--json", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.out + printed.err
    (entry,) = json.loads(out.read_text())
    assert entry["case"] == "llama3_lora_sft" and entry["run"]["returncode"] == 0
    verdicts = {v["what"]: v["status"] for v in entry["verdicts"]}
    assert verdicts["trains"] == "confirmed"
    # the tiny model is Llama-3.1-8B shrunk: same class, rope scaling and 4:1 grouped-query attention
    (rank,) = entry["run"]["ranks"]
    used = rank["model_config_used"]
    assert used["architectures"] == ["LlamaForCausalLM"] and used["rope_scaling"]["rope_type"] == "llama3"
    assert used["num_attention_heads"] == 4 * used["num_key_value_heads"] and used["hidden_size"] < 4096
    assert rank["losses"][-1] < rank["losses"][0]
    assert rank["attn_implementation"] == "sdpa"  # what transformers picked for Llama, recorded with the run


def test_depth_points_make_a_case_measured_shallow_and_extrapolated(team, capsys):
    """--depth-points: the case's full-size runs measure at those depths (on as many ranks as the host
    has) and extrapolate to the full depth, as the bundled suite's 32B cases do."""
    from harness.judge.session import plan

    (team / "configs" / "ds_z3.json").write_text(json.dumps(ZERO3))
    assert _case_from(team, "--gpu-memory", "80GiB", "--gpus", "8", "--deepspeed", str(team / "configs" / "ds_z3.json"),
                      "--depth-points", "8,4") == 0
    case = load_case(team / "cases" / "llama3_lora_sft.yaml")
    assert case.depth_points == [4, 8] and case.launch.ranks == 8
    assert [v.suffix for v in plan(case, "real", accelerators=2)] == ["@2r4L", "@2r8L"]
    assert main(["case-from", str(team / "configs" / "llama3_lora_sft.yaml"), "--out", str(team / "more"),
                 "--gpu-memory", "80GiB", "--gpus", "1", "--depth-points", "4"]) == 2  # one depth fits no line
    assert "two or more distinct layer counts" in capsys.readouterr().err


def test_the_attention_kernel_a_config_names_is_written_into_the_case(team):
    """LLaMA-Factory's flash_attn: disabled builds the model with eager attention: the case names it."""
    config = team / "configs" / "llama3_lora_sft.yaml"
    config.write_text(LLAMAFACTORY_LORA + "flash_attn: disabled\n")
    assert _case_from(team, "--gpu-memory", "80GiB", "--gpus", "1") == 0
    path = team / "cases" / "llama3_lora_sft.yaml"
    assert yaml.safe_load(path.read_text())["train"]["attn_implementation"] == "eager"
    assert load_case(path).train.attn_implementation == "eager"
