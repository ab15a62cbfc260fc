"""A cold Triton cache's local memory: grown above the default stack to the largest per-thread need of any
autotune candidate the step launches, on every resident thread; found by a survey of the compiled kernels,
kept in results/triton-kernels/ or compiled once into the cache, and never fitted on memory runs."""

from __future__ import annotations

import json

import pytest

from benchmarks.triton_autotune_stack import cold_extra_from_baselines
from harness.measure.card_compute import card_compute
from harness.models.source import load_model
from harness.predict import local_memory
from harness.predict.constants import TRITON_BENCH_BUFFER
from harness.predict.local_memory import ColdLocalMemory, Unavailable, growth_bytes
from harness.predict.triton_kernels import Survey
from harness.spec.cases import CASES_DIR, load_case

GIB = 2**30
FAILING_GLA = CASES_DIR / "004-gla-failing-bs4-2procs.yaml"
H200 = card_compute("nvidia-h200-x1")


def _config(case):
    return dict(load_model(case.model).config)


def test_growth_is_the_rounded_need_above_the_default_stack_on_every_resident_thread():
    threads = H200.resident_threads
    assert threads == 132 * 2048
    assert growth_bytes(0, threads) == 0 and growth_bytes(1024, threads) == 0  # the context starts sized for it
    # 15,072 B + the 512 B syscall stack rounds to 15,616; the default 1,024 + 512 is 1,536
    assert growth_bytes(15_072, threads) == (15_616 - 1_536) * threads
    assert growth_bytes(1_025, threads) == 256 * threads  # one byte over takes the next granule
    assert growth_bytes(100, 10) == 0


def test_the_kept_survey_sizes_what_the_recorded_cold_runs_held_without_them():
    """The Triton release the recorded runs used (the device records') compiled for their card: within 1 % of
    what cold runs held beyond warm ones, per process, though no run of theirs went into the figure."""
    case = load_case(FAILING_GLA)
    got = local_memory.cold_local_memory(case, _config(case), "nvidia-h200-x1")
    assert isinstance(got, ColdLocalMemory), got
    assert got.survey.triton == "3.6.0" and got.source.startswith("results/triton-kernels/")
    observed = cold_extra_from_baselines() * GIB
    assert got.bytes == pytest.approx(observed, rel=0.01)
    assert got.survey.kernel in got.note() and "15,072 B a thread" in got.note()


def test_a_survey_is_found_only_for_its_model_sequence_card_and_release():
    case = load_case(FAILING_GLA)
    key = local_memory.survey_key(case, _config(case), H200, "3.6.0")
    assert local_memory.find_survey(key, [local_memory.SURVEY_DIR]) is not None
    longer = case.model_copy(update={"train": case.train.model_copy(update={"seq_len": 4096})})
    a100 = card_compute("nvidia-a100-sxm4-80gb-x1")
    for other in (local_memory.survey_key(longer, _config(case), H200, "3.6.0"),
                  local_memory.survey_key(case, _config(case), a100, "3.6.0"),
                  local_memory.survey_key(case, _config(case), H200, "3.7.0"),
                  local_memory.survey_key(case, {**_config(case), "hidden_size": 1024}, H200, "3.6.0")):
        assert local_memory.find_survey(other, [local_memory.SURVEY_DIR]) is None


def test_the_jobs_triton_is_the_platforms_device_record_else_the_installed_one(monkeypatch):
    assert local_memory.job_triton("nvidia-h200-x1")[0] == "3.6.0"  # the H200 x2 record, the same card
    monkeypatch.setattr(local_memory, "_version", lambda package: "9.9.9")
    triton, where = local_memory.job_triton("nvidia-a100-sxm4-80gb-x1")
    assert triton == "9.9.9" and "installed here" in where


def _survey(per_thread: int) -> Survey:
    return Survey(triton="9.9.9", fla="0.6.0", sm=90, step={"batch": 2}, max_bytes_per_thread=per_thread,
                  kernel="k", config="B=8192 w1 s3", kernels=1, specializations=3, failed=0)


def test_a_missing_survey_is_compiled_once_and_then_read_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(local_memory, "SURVEY_DIR", tmp_path / "kept")
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(local_memory, "job_triton", lambda platform: ("9.9.9", "a test"))
    monkeypatch.setattr(local_memory, "can_compile", lambda triton: None)
    compiled = []

    def compile_survey(case, card, key, announce=None):
        compiled.append(key)
        announce(f"compiling for sm_{card.sm}")
        return _survey(5_000)

    monkeypatch.setattr(local_memory, "compile_survey", compile_survey)
    said = []
    case = load_case(FAILING_GLA)
    first = local_memory.cold_local_memory(case, _config(case), "nvidia-h200-x1", announce=said.append)
    again = local_memory.cold_local_memory(case, _config(case), "nvidia-h200-x1", announce=said.append)
    assert len(compiled) == 1 and said == ["compiling for sm_90"]
    assert first.bytes == again.bytes == growth_bytes(5_000, H200.resident_threads)
    [cached] = (tmp_path / "cache" / "triton-kernels").glob("*.json")
    data = json.loads(cached.read_text())
    assert data["key"]["triton"] == "9.9.9" and data["survey"]["max_bytes_per_thread"] == 5_000
    assert str(cached) == again.source


@pytest.mark.parametrize("damage", ["{not json", '{"key": {"model": "x"}}', ""])
def test_a_damaged_cached_survey_is_compiled_again_and_replaced(monkeypatch, tmp_path, damage):
    monkeypatch.setattr(local_memory, "SURVEY_DIR", tmp_path / "kept")
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(local_memory, "job_triton", lambda platform: ("9.9.9", "a test"))
    monkeypatch.setattr(local_memory, "can_compile", lambda triton: None)
    monkeypatch.setattr(local_memory, "compile_survey", lambda case, card, key, announce=None: _survey(6_000))
    case = load_case(FAILING_GLA)
    key = local_memory.survey_key(case, _config(case), H200, "9.9.9")
    path = tmp_path / "cache" / "triton-kernels" / key.file_name()
    path.parent.mkdir(parents=True)
    path.write_text(damage)
    got = local_memory.cold_local_memory(case, _config(case), "nvidia-h200-x1")
    assert isinstance(got, ColdLocalMemory) and got.survey.max_bytes_per_thread == 6_000
    assert local_memory.read_survey(path)[0] == key  # replaced by the compiled one


def test_a_survey_that_cannot_be_kept_still_sizes_the_prediction(monkeypatch, tmp_path):
    from harness.spec.files import WriteError

    monkeypatch.setattr(local_memory, "SURVEY_DIR", tmp_path / "kept")
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(local_memory, "job_triton", lambda platform: ("9.9.9", "a test"))
    monkeypatch.setattr(local_memory, "can_compile", lambda triton: None)
    monkeypatch.setattr(local_memory, "compile_survey", lambda case, card, key, announce=None: _survey(6_000))

    def full_disk(path, key, survey, recorded=None):
        raise WriteError(f"{path}: could not be written (No space left on device)")

    monkeypatch.setattr(local_memory, "write_survey", full_disk)
    case = load_case(FAILING_GLA)
    got = local_memory.cold_local_memory(case, _config(case), "nvidia-h200-x1")
    assert isinstance(got, ColdLocalMemory) and got.survey.max_bytes_per_thread == 6_000
    assert "not kept in the cache" in got.note() and "No space left on device" in got.note()


@pytest.mark.parametrize("child", ["fails", "prints nothing", "hangs"])
def test_a_survey_child_that_fails_says_how(monkeypatch, tmp_path, child):
    """The child gets the case as JSON (read back whole) and the card's layout; what it did wrong is said."""
    import subprocess

    from harness.spec.schema import Case

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    case = load_case(FAILING_GLA)
    seen = {}

    def run(command, **kwargs):
        seen["command"] = command
        seen["case"] = Case.model_validate_json(open(command[-1], encoding="utf-8").read())
        if child == "hangs":
            raise subprocess.TimeoutExpired(command, kwargs["timeout"])
        code, out = (1, "") if child == "fails" else (0, "")
        return subprocess.CompletedProcess(command, code, out, "Traceback ...\nRuntimeError: Boom")

    monkeypatch.setattr(local_memory.subprocess, "run", run)
    key = local_memory.survey_key(case, _config(case), H200, "9.9.9")
    with pytest.raises(RuntimeError) as err:
        local_memory.compile_survey(case, H200, key)
    assert seen["case"] == case
    assert seen["command"][1:3] == ["-m", "harness.predict.triton_kernels"] and "--sm" in seen["command"]
    said = str(err.value)
    assert {"fails": "exit 1", "prints nothing": "printed no survey", "hangs": "did not finish"}[child] in said
    assert child != "fails" or "Boom" in said


def test_another_installed_release_stands_in_for_the_jobs_and_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(local_memory, "SURVEY_DIR", tmp_path / "kept")
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(local_memory, "_version", lambda package: "9.9.9" if package == "triton" else None)
    monkeypatch.setattr(local_memory, "can_compile",
                        lambda triton: None if triton == "9.9.9" else f"Triton {triton} is not installed here")
    monkeypatch.setattr(local_memory, "compile_survey", lambda case, card, key, announce=None: _survey(5_000))
    case = load_case(FAILING_GLA)
    got = local_memory.cold_local_memory(case, _config(case), "nvidia-h200-x1")
    assert isinstance(got, ColdLocalMemory) and got.bytes == growth_bytes(5_000, H200.resident_threads)
    assert "Triton 9.9.9, the one installed here, not the job's 3.6.0" in got.note()


def test_a_kept_survey_of_another_fla_release_stands_in_when_none_compiles(monkeypatch, tmp_path):
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    real = local_memory._version
    monkeypatch.setattr(local_memory, "_version", lambda package: "0.7.0" if package == "fla-core" else real(package))
    monkeypatch.setattr(local_memory, "can_compile", lambda triton: "no compiler in this test")
    case = load_case(FAILING_GLA)
    got = local_memory.cold_local_memory(case, _config(case), "nvidia-h200-x1")
    assert isinstance(got, ColdLocalMemory) and got.survey.triton == "3.6.0" and got.survey.fla == "0.6.0"
    assert "flash-linear-attention 0.6.0, not the 0.7.0 installed here" in got.note()
    exact = local_memory.survey_key(case, _config(case), H200, "3.6.0")
    assert exact.fla == "0.7.0" and local_memory.find_survey(exact, [local_memory.SURVEY_DIR]) is None


def test_without_a_survey_a_compiler_or_a_card_it_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setattr(local_memory, "SURVEY_DIR", tmp_path / "kept")
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    case = load_case(FAILING_GLA)
    monkeypatch.setattr(local_memory, "can_compile", lambda triton: f"no NVIDIA backend in Triton {triton}")
    got = local_memory.cold_local_memory(case, _config(case), "nvidia-h200-x1")
    assert isinstance(got, Unavailable)
    assert "with Triton 3.6.0 (the job's" in got.reason and "--save" in got.reason
    got = local_memory.cold_local_memory(case, _config(case), "rtx-4090-x1")
    assert isinstance(got, Unavailable) and "cards.json" in got.reason
    got = local_memory.cold_local_memory(case, _config(case), None)
    assert isinstance(got, Unavailable) and "--platform" in got.reason


def test_a_cold_gla_case_carries_the_surveyed_term_and_two_processes_do_not_fit():
    """Guide 004's failing pair, predicted with every GLA run left out: the cold term is the survey's, and
    two such processes no longer fit the 23.52 GiB card, as the cold H100 run found."""
    from harness.predict.predictor import predict

    cold = load_case(FAILING_GLA)
    warm = cold.model_copy(update={"launch": cold.launch.model_copy(update={"triton_cache": "shared"})})
    gla = frozenset(p.stem for p in CASES_DIR.glob("004-*.yaml")) | {"004-gla-failing.fitted"}
    platform = "nvidia-h100-80gb-hbm3-x1"
    p_cold, p_warm = predict(cold, platform=platform, exclude=gla), predict(warm, platform=platform, exclude=gla)
    term = p_cold.terms["triton_cold_local_memory"]
    assert term == growth_bytes(15_072, 132 * 2048)  # Triton 3.6's swiglu_fwdbwd candidate
    # and the autotuner's L2-clearing buffer, held beside the step's pool
    assert p_cold.reserved == p_warm.reserved + TRITON_BENCH_BUFFER == p_warm.reserved + 256 * 2**20
    assert p_cold.device == p_warm.device + term + TRITON_BENCH_BUFFER and "triton_cold_compile" not in p_cold.terms
    assert any("swiglu_fwdbwd_kernel" in n for n in p_cold.notes)
    assert 2 * p_cold.device > cold.budget_bytes >= 2 * p_warm.device
