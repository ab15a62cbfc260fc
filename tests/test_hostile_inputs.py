"""Hostile input, across check, case-from, validate, run, bless and report: exit 2 with one line naming
the file or the key (or 1 with a verdict), never a traceback, a hang, or a file written outside the
output folder. Generated (every kind of bad file in `hostile` against every command that reads that
kind) and hand-written (values and arguments that parse but mean nothing)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest
from hostile import CASES, EXAMPLES, JSON_FILES, ROOT, YAML_FILES, invoke, make

from harness.cli import main as cli_main

CONFIG = EXAMPLES / "000-ds32b-optimized.yaml"
JSON_CONFIG = EXAMPLES / "001-ladder-minimal.json"
CASE = CASES / "003-qlora-failing-bs2-seq2048-r64.yaml"  # names no other case
JOB = ["--gpu-memory", "64GiB", "--gpus", "8"]


def _refused(outcome, *names: str) -> None:
    """Exit 2, and a message that names what was wrong: one line for check and case-from (argparse's
    usage errors end with their one `error:` line), a block naming the file for validate and run."""
    assert outcome.code == 2, (outcome.code, outcome.out, outcome.err)
    lines = outcome.err_lines
    assert lines, "no message on stderr"
    text = " ".join(lines)
    for name in names:
        assert name in text, f"{name!r} not named in: {outcome.err}"


def _one_line(outcome) -> None:
    lines = [line for line in outcome.err_lines if not line.startswith(("usage:", " "))]
    assert len(lines) == 1, outcome.err


# --- Generated: every kind of bad file, against every command that reads it ----------------------


@pytest.mark.parametrize("kind", sorted(YAML_FILES))
def test_check_refuses_a_bad_yaml_config(kind, tmp_path, capsys):
    path = make(tmp_path / "in", f"{kind}.yaml", YAML_FILES[kind])
    outcome = invoke(["check", path, *JOB], capsys, tmp_path)
    _refused(outcome, path.name)
    _one_line(outcome)


@pytest.mark.parametrize("kind", sorted(JSON_FILES))
def test_check_refuses_a_bad_json_config(kind, tmp_path, capsys):
    path = make(tmp_path / "in", f"{kind}.json", JSON_FILES[kind])
    outcome = invoke(["check", path, *JOB, "--json"], capsys, tmp_path)
    _refused(outcome, path.name)
    _one_line(outcome)
    assert path.name in json.loads(outcome.out)["error"]


@pytest.mark.parametrize("kind", sorted(JSON_FILES))
def test_check_refuses_a_bad_deepspeed_file(kind, tmp_path, capsys):
    path = make(tmp_path / "in", f"ds-{kind}.json", JSON_FILES[kind])
    outcome = invoke(["check", CONFIG, *JOB, "--deepspeed", path], capsys, tmp_path)
    _refused(outcome, path.name)
    _one_line(outcome)


@pytest.mark.parametrize("kind", sorted(set(JSON_FILES) - {"missing", "directory"}))
def test_check_refuses_a_model_folder_with_a_bad_config_json(kind, tmp_path, capsys):
    model = tmp_path / "in" / "model"
    make(model, "config.json", JSON_FILES[kind])
    outcome = invoke(["check", CONFIG, *JOB, "--model", model], capsys, tmp_path)
    _refused(outcome, "config.json")
    _one_line(outcome)


@pytest.mark.parametrize("kind", sorted(YAML_FILES))
def test_validate_refuses_a_bad_case_file(kind, tmp_path, capsys):
    path = make(tmp_path / "in", f"{kind}.yaml", YAML_FILES[kind])
    outcome = invoke(["validate", path], capsys, tmp_path)
    _refused(outcome, path.name)
    assert "0 valid, 1 invalid" in outcome.out or kind == "directory"  # a folder: "holds no case file"


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "binary", "alias-bomb", "deep-flow", "nan", "oversize",
                                  "symlink-loop", "directory"])
def test_run_names_a_bad_case_file_and_starts_nothing(kind, tmp_path, capsys):
    folder = tmp_path / "in" / "cases"
    path = make(folder, f"{kind}.yaml", YAML_FILES[kind])
    outcome = invoke(["run", "--case-dir", folder, "--out", tmp_path / "out"], capsys, tmp_path, limit_s=10)
    _refused(outcome, path.name, "no case matches")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("run.json"))


@pytest.mark.parametrize("kind", sorted(JSON_FILES))
@pytest.mark.parametrize("command", ["bless", "report"])
def test_bless_and_report_refuse_a_bad_runs_file(command, kind, tmp_path, capsys):
    path = make(tmp_path / "in", f"runs-{kind}.json", JSON_FILES[kind])
    extra = ["--baselines-dir", tmp_path / "out"] if command == "bless" else []
    outcome = invoke([command, path, *extra], capsys, tmp_path)
    _refused(outcome, path.name)
    _one_line(outcome)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "alias-bomb", "binary", "nan", "deep-flow"])
def test_case_from_refuses_a_bad_config_and_writes_nothing(kind, tmp_path, capsys):
    path = make(tmp_path / "in", f"{kind}.yaml", YAML_FILES[kind])
    outcome = invoke(["case-from", path, *JOB, "--out", tmp_path / "out"], capsys, tmp_path)
    _refused(outcome, path.name)
    _one_line(outcome)
    assert not any((tmp_path / "out").rglob("*")) if (tmp_path / "out").exists() else True


# --- Hand-written: values that parse but mean nothing ---------------------------------------------


def _edited(source, tmp_path, old: str, new: str):
    text = source.read_text(encoding="utf-8")
    assert old in text, old
    (tmp_path / "in").mkdir(exist_ok=True)
    for name in ("ds_z3_offload_aggressive.json", "ds_z3_offload_config.json", "ds_z2_config.json"):
        shutil.copy(EXAMPLES / name, tmp_path / "in" / name)
    path = tmp_path / "in" / source.name
    path.write_text(text.replace(old, new, 1), encoding="utf-8")
    return path


CONFIG_EDITS = [
    ("per_device_train_batch_size: 1", "per_device_train_batch_size: .nan", "per_device_train_batch_size"),
    ("per_device_train_batch_size: 1", "per_device_train_batch_size: -1", "per_device_train_batch_size"),
    ("per_device_train_batch_size: 1", "per_device_train_batch_size: 1.5", "per_device_train_batch_size"),
    ("per_device_train_batch_size: 1", "per_device_train_batch_size: [1]", "per_device_train_batch_size"),
    ("per_device_train_batch_size: 1", "per_device_train_batch_size: {a: 1}", "per_device_train_batch_size"),
    ("per_device_train_batch_size: 1", "per_device_train_batch_size: one", "per_device_train_batch_size"),
    ("per_device_train_batch_size: 1", "per_device_train_batch_size: 1e999", "per_device_train_batch_size"),
    ("gradient_accumulation_steps: 32", "gradient_accumulation_steps: .inf", "gradient_accumulation_steps"),
    ("gradient_accumulation_steps: 32", "gradient_accumulation_steps: 0", "gradient_accumulation_steps"),
    ("gradient_accumulation_steps: 32", "gradient_accumulation_steps: \"1e999\"", "gradient_accumulation_steps"),
    ("cutoff_len: 512", "cutoff_len: 0", "cutoff_len"),
    ("cutoff_len: 512", "cutoff_len: 99999999999", "cutoff_len"),
    ("cutoff_len: 512", "cutoff_len: -.nan", "cutoff_len"),
    ("lora_rank: 8", "lora_rank: -8", "lora_rank"),
    ("lora_rank: 8", "lora_rank: 100000", "lora_rank"),
    ("lora_alpha: 16", "lora_alpha: \"nan\"", "lora_alpha"),
    ("lora_dropout: 0", "lora_dropout: 2", "lora_dropout"),
    ("learning_rate: 5.0e-5", "learning_rate: \"inf\"", "learning_rate"),
    ("bf16: true", "bf16: maybe", "bf16"),
    ("gradient_checkpointing: true", "gradient_checkpointing: [true]", "gradient_checkpointing"),
    ("deepspeed: ds_z3_offload_aggressive.json", "deepspeed: /dev/zero", "zero"),
    ("deepspeed: ds_z3_offload_aggressive.json", "deepspeed: missing.json", "missing.json"),
    ("deepspeed: ds_z3_offload_aggressive.json", "deepspeed: {zero_optimization: {stage: 7}}", "stage"),
    ("deepspeed: ds_z3_offload_aggressive.json", "deepspeed: {zero_optimization: [1]}", "zero_optimization"),
    ("deepspeed: ds_z3_offload_aggressive.json", "deepspeed: 42", "42"),
    ("model_name_or_path: deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", "model_name_or_path: ../../../etc",
     "model_name_or_path"),
    ("model_name_or_path: deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", "model_name_or_path: [a, b]",
     "model_name_or_path"),
    ("model_name_or_path: deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", "model_name_or_path: nosuch/model-7b",
     "model_name_or_path"),
    ("finetuning_type: lora", "finetuning_type: telepathy", "finetuning_type"),
]


@pytest.mark.parametrize("old, new, named", CONFIG_EDITS, ids=[e[1] for e in CONFIG_EDITS])
def test_check_refuses_a_bad_value_naming_its_key(old, new, named, tmp_path, capsys):
    path = _edited(CONFIG, tmp_path, old, new)
    outcome = invoke(["check", path, *JOB], capsys, tmp_path)
    _refused(outcome, named)
    _one_line(outcome)


DEEPSPEED_EDITS = [
    ('"stage": 3', '"stage": NaN', "stage"),
    ('"stage": 3', '"stage": "three"', "stage"),
    ('"stage": 3', '"stage": 3.5', "stage"),
    ('"stage": 3', '"stage": 1e400', "stage"),
    ('"device": "cpu"', '"device": "floppy"', "device"),
]


@pytest.mark.parametrize("old, new, named", DEEPSPEED_EDITS, ids=[e[1] for e in DEEPSPEED_EDITS])
def test_check_refuses_a_bad_deepspeed_value(old, new, named, tmp_path, capsys):
    ds = _edited(EXAMPLES / "ds_z3_offload_config.json", tmp_path, old, new)
    outcome = invoke(["check", CONFIG, *JOB, "--deepspeed", ds], capsys, tmp_path)
    _refused(outcome, named)
    _one_line(outcome)


MODEL_EDITS = [
    ('"vocab_size": 128256', '"vocab_size": "128256"', "vocab_size"),
    ('"vocab_size": 128256', '"vocab_size": -1', "vocab_size"),
    ('"vocab_size": 128256', '"vocab_size": NaN', "vocab_size"),
    ('"hidden_size": 4096', '"hidden_size": 4096.5', "hidden_size"),
    ('"hidden_size": 4096', '"hidden_size": true', "hidden_size"),
    ('"num_hidden_layers": 32', '"num_hidden_layers": 0', "num_hidden_layers"),
    ('"num_hidden_layers": 32', '"num_hidden_layers": 99999999999999', "num_hidden_layers"),
    ('"num_attention_heads": 32', '"num_attention_heads": [32]', "num_attention_heads"),
    ('"tie_word_embeddings": false', '"tie_word_embeddings": "no"', "tie_word_embeddings"),
    ('"model_type": "llama"', '"model_type": 7', "model_type"),
]


@pytest.mark.parametrize("old, new, named", MODEL_EDITS, ids=[e[1] for e in MODEL_EDITS])
def test_check_refuses_a_config_json_with_a_bad_shape_naming_the_key(old, new, named, tmp_path, capsys):
    source = ROOT / "tests" / "data" / "llama-3.1-8b" / "config.json"
    text = source.read_text()
    assert old in text, old
    model = tmp_path / "in" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(text.replace(old, new))
    outcome = invoke(["check", CONFIG, *JOB, "--model", model], capsys, tmp_path)
    _refused(outcome, "config.json", named)
    _one_line(outcome)


ARGUMENTS = [
    (["check", CONFIG, "--gpu-memory", "64", "--gpus", "8"], "write 64GiB"),
    (["check", CONFIG, "--gpu-memory", "-64GiB", "--gpus", "8"], "--gpu-memory"),
    (["check", CONFIG, "--gpu-memory", "nan GiB", "--gpus", "8"], "--gpu-memory"),
    (["check", CONFIG, "--gpu-memory", "1e999GiB", "--gpus", "8"], "--gpu-memory"),
    (["check", CONFIG, "--gpu-memory", "99999999999 TiB", "--gpus", "8"], "--gpu-memory"),
    (["check", CONFIG, "--gpu-memory", "", "--gpus", "8"], "--gpu-memory"),
    (["check", CONFIG, "--gpu-memory", "64 parsecs", "--gpus", "8"], "--gpu-memory"),
    (["check", CONFIG, "--gpu-memory", "0GiB", "--gpus", "8"], "--gpu-memory"),
    (["check", CONFIG, *JOB, "--host-ram", "512"], "write 512GiB"),
    (["check", CONFIG, "--gpu-memory", "64GiB", "--gpus", "0"], "--gpus"),
    (["check", CONFIG, "--gpu-memory", "64GiB", "--gpus", "-8"], "--gpus"),
    (["check", CONFIG, "--gpu-memory", "64GiB", "--gpus", "eight"], "--gpus"),
    (["check", CONFIG, "--gpu-memory", "64GiB", "--gpus", "1e9"], "--gpus"),
    (["check", CONFIG, "--gpu-memory", "64GiB", "--gpus", "99999999999"], "--gpus"),
    (["check", CONFIG, *JOB, "--headroom", "nan"], "--headroom"),
    (["check", CONFIG, *JOB, "--headroom", "inf"], "--headroom"),
    (["check", CONFIG, *JOB, "--headroom", "0"], "--headroom"),
    (["check", CONFIG, *JOB, "--headroom", "1.5"], "--headroom"),
    (["check", CONFIG, *JOB, "--procs-per-gpu", "0"], "--procs-per-gpu"),
    (["check", CONFIG, *JOB, "--launcher", "mpirun"], "--launcher"),
    (["check", CONFIG, *JOB, "--script", "/dev/zero"], "zero"),
    (["check", CONFIG, *JOB, "--script", ROOT / "harness"], "harness"),
    (["check", CONFIG, *JOB, "--deepspeed", ROOT / "configs"], "configs"),
    (["check", JSON_CONFIG, "--gpu-memory", "16GiB"], "--gpus"),
    (["check", "config.toml", *JOB], "config.toml"),
    (["run", "--timeout", "-1"], "--timeout"),
    (["run", "--timeout", "0"], "--timeout"),
    (["run", "--timeout", "nan"], "--timeout"),
    (["run", "--timeout", "inf"], "--timeout"),
    (["run", "--steps", "0"], "--steps"),
    (["run", "--steps", "-3"], "--steps"),
    (["run", "--repeat", "0"], "--repeat"),
    (["run", "--jobs", "0"], "--jobs"),
    (["run", "--grad-accum-cap", "0"], "--grad-accum-cap"),
    (["run", "--fidelity", "huge"], "--fidelity"),
    (["run", "--case-dir", "no/such/folder"], "--case-dir"),
    (["run", "--json", "no/such/folder/runs.json"], "--json"),
    (["run", "--benchmark-json", "no/such/folder/bench.json"], "--benchmark-json"),
    (["run", "-k", "003-qlora-fix-r16", "--shard", "3/2"], "--shard"),
    (["run", "-k", "003-qlora-fix-r16", "--shard", "x"], "--shard"),
    (["run", "-k", "003-qlora-fix-r16", "--shard", "0/99999999999999999999"], "--shard"),  # was 24 GB of lists
    (["run", "-k", "003-qlora-fix-r16", "--variant", "../8L"], "--variant"),
    (["run", "-k", "no-such-case-anywhere"], "no case matches"),
    (["case-from", CONFIG, *JOB, "--out", "out", "--id", "../escape"], "--id"),
    (["case-from", CONFIG, *JOB, "--out", "out", "--id", "a/b"], "--id"),
    (["case-from", CONFIG, *JOB, "--out", "out", "--id", ".."], "--id"),
    (["case-from", CONFIG, *JOB, "--out", "out", "--id", "x" * 300], "--id"),
    (["case-from", CONFIG, *JOB, "--out", "/proc/self"], "--out"),
    (["case-from", CONFIG, *JOB, "--out", "/proc/self/new-folder"], "--out"),
    (["case-from", CONFIG, "--gpu-memory", "24", "--gpus", "1", "--out", "out"], "write 24GiB"),
    (["bless", "no-such-runs.json", "--baselines-dir", "out"], "no-such-runs.json"),
    (["report", "no-such-runs.json"], "no-such-runs.json"),
    (["validate", "no-such-case.yaml"], "no-such-case.yaml"),
    (["no-such-command"], "invalid choice"),
]


@pytest.mark.parametrize("argv, named", ARGUMENTS, ids=[" ".join(map(str, a[0][:1] + a[0][-2:])) for a in ARGUMENTS])
def test_bad_arguments_are_refused_before_anything_runs(argv, named, tmp_path, capsys):
    outcome = invoke(argv, capsys, tmp_path, limit_s=10)
    _refused(outcome, named)
    _one_line(outcome)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*"))


CASE_EDITS = [
    ("micro_batch: 2", "micro_batch: .nan", "micro_batch"),
    ("micro_batch: 2", "micro_batch: \"2\"", None),  # pydantic reads "2" as 2: not an error
    ("micro_batch: 2", "micro_batch: 0", "micro_batch"),
    ("headroom: 0.9", "headroom: .inf", "headroom"),
    ("headroom: 0.9", "headroom: -0.9", "headroom"),
    ("memory: 15.77 GiB", "memory: \"16\"", "write 16GiB"),
    ("memory: 15.77 GiB", "memory: 16 parsecs", "memory"),
    ("memory: 15.77 GiB", "memory: .nan", "memory"),
    ("id: 003-qlora-failing-bs2-seq2048-r64", "id: ../../etc/passwd", "id"),
    ("id: 003-qlora-failing-bs2-seq2048-r64", "id: [1, 2]", "id"),
]


@pytest.mark.parametrize("old, new, named", CASE_EDITS, ids=[e[1] for e in CASE_EDITS])
def test_validate_names_the_field_of_a_bad_case_value(old, new, named, tmp_path, capsys):
    text = CASE.read_text()
    assert old in text, old
    path = tmp_path / "in" / CASE.name
    path.parent.mkdir()
    path.write_text(text.replace(old, new, 1))
    outcome = invoke(["validate", path], capsys, tmp_path)
    if named is None:
        assert outcome.code == 0
        return
    _refused(outcome, path.name, named)


def test_validate_names_a_lower_peak_than_whose_case_does_not_exist(tmp_path, capsys):
    source = next(p for p in sorted(CASES.glob("*.yaml")) if "lower_peak_than" in p.read_text())
    path = tmp_path / "in" / source.name
    path.parent.mkdir()
    shutil.copy(source, path)  # alone in its folder: the case it names is missing
    outcome = invoke(["validate", path], capsys, tmp_path)
    _refused(outcome, path.name, "lower_peak_than", "which is not in")


def test_a_bad_case_file_beside_good_ones_is_named_and_does_not_stop_the_others(tmp_path, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy(CASE, folder / CASE.name)
    make(folder, "binary.yaml", YAML_FILES["binary"])
    outcome = invoke(["validate", folder], capsys, tmp_path)
    _refused(outcome, "binary.yaml")
    assert f"ok       {folder / CASE.name}" in outcome.out and "1 valid, 1 invalid" in outcome.out


RUN_FILES = [
    ([{"case": "x"}], "entry 0"),
    ([{"run": "not a run"}], "entry 0"),
    ([{"run": {"case_id": "x"}}], "entry 0"),
    ({"case_id": 7, "fidelity": "real"}, "its content"),
]


@pytest.mark.parametrize("data, named", RUN_FILES, ids=[str(i) for i in range(len(RUN_FILES))])
@pytest.mark.parametrize("command", ["bless", "report"])
def test_bless_and_report_refuse_runs_that_are_not_runs(command, data, named, tmp_path, capsys):
    path = tmp_path / "in" / "runs.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data))
    extra = ["--baselines-dir", tmp_path / "out"] if command == "bless" else []
    outcome = invoke([command, path, *extra], capsys, tmp_path)
    _refused(outcome, "runs.json", named)
    _one_line(outcome)
    assert not (tmp_path / "out").exists()


# --- What the limits buy: fast refusals and verdicts that mean what they say ----------------------


def test_an_alias_bomb_and_a_gigabyte_file_are_refused_in_well_under_a_second(tmp_path, capsys):
    bomb = make(tmp_path / "in", "bomb.yaml", YAML_FILES["alias-bomb"])
    big = make(tmp_path / "in", "big.json", JSON_FILES["oversize-sparse"])
    for path, named in ((bomb, "alias"), (big, "above the limit")):
        started = time.monotonic()
        outcome = invoke(["check", path, *JOB], capsys, tmp_path)
        assert time.monotonic() - started < 1.0
        _refused(outcome, named)


def test_host_ram_too_small_for_the_prediction_does_not_fit(tmp_path, capsys):
    job = ["--gpu-memory", "96GiB", "--gpus", "8"]  # the card fits, margin included: only the host can refuse it
    outcome = invoke(["check", CONFIG, *job, "--host-ram", "1GiB", "--json"], capsys, tmp_path)
    result = json.loads(outcome.out)
    assert outcome.code == 1 and result["fits"] is False and result["host_ram_fits"] is False
    assert result["host_ram_node_gib"] > 1 and "host RAM" in result["verdict"]
    roomy = json.loads(invoke(["check", CONFIG, *job, "--host-ram", "4TiB", "--json"], capsys, tmp_path).out)
    assert roomy["host_ram_fits"] is True and roomy["fits"] is True


@pytest.mark.parametrize("case", sorted(CASES.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_bundled_case_file_is_checked_not_refused(case, tmp_path, capsys):
    """A case file is a config `check` reads: a verdict (0 or 1), never a refusal of the suite's own files."""
    outcome = invoke(["check", case], capsys, tmp_path)
    assert outcome.code in (0, 1), outcome.err
    assert "verdict:" in outcome.out


# --- Through a real process: what reaches the terminal --------------------------------------------


def _cli(*argv, env_extra=None, cwd=None, timeout=60):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(cwd), "OMP_NUM_THREADS": "1",
           **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "harness.cli", *map(str, argv)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


@pytest.mark.parametrize("kind", ["fifo", "alias-bomb", "nan", "deep-flow"])
def test_a_separate_process_prints_one_line_and_no_traceback(kind, tmp_path):
    path = make(tmp_path / "in", f"{kind}.yaml", YAML_FILES[kind])
    done = _cli("check", path, *JOB, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and path.name in done.stderr


def test_a_separate_run_names_a_fifo_case_file_and_exits_without_starting_a_case(tmp_path):
    folder = tmp_path / "in"
    path = make(folder, "fifo.yaml", YAML_FILES["fifo"])
    done = _cli("run", "--case-dir", folder, "--out", tmp_path / "out", "--timeout", "5", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert path.name in done.stderr and "not a regular file" in done.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("run.json"))


def test_a_separate_bless_refuses_dev_zero_at_once(tmp_path):
    path = make(tmp_path / "in", "runs.json", JSON_FILES["dev-zero"])
    done = _cli("bless", path, "--baselines-dir", tmp_path / "out", cwd=tmp_path, timeout=30)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "not a regular file" in done.stderr
    assert not (tmp_path / "out").exists()


def test_an_internal_error_exits_3_with_the_log_named_and_the_traceback_kept(tmp_path, capsys, monkeypatch):
    def broken(args):
        return {}["no such key"]

    monkeypatch.setenv("OOM_HARNESS_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setattr(cli_main.validate, "run", broken)
    code = cli_main.main(["validate"])
    err = capsys.readouterr().err
    assert code == 3 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "internal error (KeyError" in err
    logs = list((tmp_path / "logs").glob("error-*.log"))
    assert len(logs) == 1 and str(logs[0]) in err
    assert "Traceback" in logs[0].read_text() and "no such key" in logs[0].read_text()
