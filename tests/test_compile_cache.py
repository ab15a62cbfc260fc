"""A cold Triton cache is a measurement condition: recorded on every run that compiled Triton
kernels, asked for by a case, and never compared against a baseline of the other kind."""

import json
import sys
import types
from pathlib import Path

import pytest

from harness.baselines.store import bless, figures_of, load_baselines
from harness.judge.regression import against_baseline
from harness.measure.records import CaseRun, Memory, RankReport
from harness.runtime import compile_cache
from harness.runtime.launcher import COLD_TRITON_CACHE, plan_jobs
from harness.runtime.platform import Platform
from harness.spec.cases import CASES_DIR, load_case
from harness.spec.units import GIB

FAILING_GLA = CASES_DIR / "004-gla-failing-bs4-2procs.yaml"
PLAN_B = CASES_DIR / "004-gla-plan-b-bs2.yaml"


def test_the_cache_state_is_read_from_the_files_the_run_started_with(tmp_path):
    assert compile_cache.entries(tmp_path / "missing") == 0
    (tmp_path / "abc").mkdir()
    (tmp_path / "abc" / "kernel.cubin").write_bytes(b"x")
    (tmp_path / "abc" / "kernel.json").write_text("{}")
    assert compile_cache.entries(tmp_path) == 2
    assert compile_cache.state(0, 2, used=True) == "cold" and compile_cache.state(2, 2, used=True) == "warm"
    assert compile_cache.state(0, 0, used=False) is None  # a run without Triton kernels has no such state
    # a cache another job had begun to fill, which this run added to: its kernels compiled in this run
    assert compile_cache.state(2, 40, used=True) == "cold"


def test_triton_kernels_count_as_used_once_flash_linear_attention_is_imported(monkeypatch):
    for name in [n for n in sys.modules if n == "fla" or n.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    assert not compile_cache.uses_triton_kernels()
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    assert compile_cache.uses_triton_kernels()


def test_a_cold_case_gets_an_empty_cache_shared_by_its_jobs(tmp_path):
    case = load_case(FAILING_GLA)
    assert case.launch.triton_cache == "cold" and case.launch.procs_per_card == 2
    stale = tmp_path / COLD_TRITON_CACHE / "old"
    stale.mkdir(parents=True)
    (stale / "kernel.cubin").write_bytes(b"x")  # left by an earlier run in the same folder
    jobs = plan_jobs(case, FAILING_GLA, "real", 1, tmp_path, Platform.cuda)
    dirs = {job.env["TRITON_CACHE_DIR"] for job in jobs}
    assert dirs == {str(tmp_path / COLD_TRITON_CACHE)} and compile_cache.entries(tmp_path / COLD_TRITON_CACHE) == 0
    shared = plan_jobs(load_case(PLAN_B), PLAN_B, "real", 1, tmp_path / "b", Platform.cuda)
    assert all(str(tmp_path) not in job.env["TRITON_CACHE_DIR"] for job in shared)


def _run(peak_gib, cache):
    rank = RankReport(case_id="004-gla-plan-b-bs2", fidelity="real", rank=0, world_size=1, platform="cuda",
                      device_name="NVIDIA H100 80GB HBM3",
                      step=Memory(allocated=int(peak_gib * GIB), device=int(peak_gib * GIB)),
                      step_times_s=[30.0, 0.4, 0.4], tokens_per_step=1024, triton_cache=cache)
    return CaseRun(case_id=rank.case_id, fidelity="real", command=[], returncode=0, wall_s=1, ranks=[rank])


def test_peaks_are_compared_only_between_runs_with_the_same_cache_state(tmp_path):
    case = load_case(PLAN_B)
    (tmp_path / "r.json").write_text(json.dumps([{"case": case.id,
                                                  "run": json.loads(_run(3.97, "warm").model_dump_json())}]))
    bless(tmp_path / "r.json", root=tmp_path / "b", recorded="2026-11-26")
    (baseline,) = load_baselines(tmp_path / "b")
    assert baseline.runs[0].triton_cache == "warm"
    cold = {v.what: v for v in against_baseline(case, figures_of(_run(6.2, "cold"), 1), baseline)}
    assert cold["baseline_memory"].status == "not_checkable" and "cold Triton cache" in cold["baseline_memory"].detail
    warm = {v.what: v for v in against_baseline(case, figures_of(_run(6.2, "warm"), 1), baseline)}
    assert warm["baseline_memory"].status == "refuted"  # the same 2.2 GiB on a warm cache is a regression


def test_the_predictors_device_overhead_is_fitted_on_warm_runs_only(tmp_path):
    from harness.predict.calibration import calibrate

    def entry(case_id, reserved_gib, device_gib, cache):
        rank = RankReport(case_id=case_id, fidelity="real", rank=0, world_size=1, platform="cuda",
                          device_name="NVIDIA H100 80GB HBM3", triton_cache=cache,
                          step_times_s=[1.0, 0.4, 0.4], tokens_per_step=1024,
                          step=Memory(allocated=int(3 * GIB), reserved=int(reserved_gib * GIB),
                                      device=int(device_gib * GIB)))
        run = CaseRun(case_id=case_id, fidelity="real", command=[], returncode=0, wall_s=1, ranks=[rank])
        return {"case": case_id, "run": json.loads(run.model_dump_json())}

    (tmp_path / "r.json").write_text(json.dumps([entry("004-gla-plan-c-1proc", 3.25, 3.97, "warm"),
                                                 entry("004-gla-plan-a-minimal", 3.6, 7.6, "cold")]))
    bless(tmp_path / "r.json", root=tmp_path / "b", recorded="2026-11-26")
    cal = calibrate("nvidia-h100-80gb-hbm3-x1", root=tmp_path / "b")
    assert cal.values["device_overhead"] / GIB == pytest.approx(0.72)
    assert cal.used["device_overhead"] == ["004-gla-plan-c-1proc"]


def test_a_cold_gla_case_on_no_named_card_is_predicted_with_what_measured_cold_runs_held():
    """No card, no compute layout to size the kernels' local memory on: the cold runs' figure stands in
    (tests/test_local_memory.py has the surveyed term)."""
    from harness.predict.predictor import predict

    cold = load_case(FAILING_GLA)
    warm = cold.model_copy(update={"launch": cold.launch.model_copy(update={"triton_cache": "shared"})})
    p_cold, p_warm = predict(cold, exclude={cold.id}), predict(warm, exclude={cold.id})
    extra = p_cold.terms["triton_cold_compile"]
    assert extra > 1 * GIB  # results/ holds cold runs of guide 004 (2.7-3.6 GiB beyond a warm process)
    buffer = p_cold.terms["triton_autotune_buffer"]  # the autotuner's, through the allocator
    assert p_cold.device == p_warm.device + extra + buffer and "triton_cold_compile" not in p_warm.terms
    # two such processes no longer fit the 23.52 GiB card, as the cold H100 run found
    assert 2 * p_cold.device > cold.budget_bytes >= 2 * p_warm.device


def test_jit_ops_and_kernels_are_kept_under_one_cache_folder_that_ci_keeps(tmp_path, monkeypatch):
    """DeepSpeed's JIT-built ops and Triton's kernels go under HARNESS_CACHE for every worker, and
    the launcher clears interrupted builds' locks in that same folder; an explicit
    TORCH_EXTENSIONS_DIR wins for both."""
    from harness.runtime.launcher import run_jobs

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    job = plan_jobs(load_case(PLAN_B), PLAN_B, "tiny", 1, tmp_path, Platform.cpu)[0]
    assert job.env["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "cache" / "torch_extensions")
    assert job.env["TRITON_CACHE_DIR"] == str(tmp_path / "cache" / "triton")
    stale = tmp_path / "cache" / "torch_extensions" / "cpu_adam" / "lock"
    stale.parent.mkdir(parents=True)
    stale.touch()
    run_jobs([type(job)([sys.executable, "-c", "pass"])], tmp_path / "run", 60, "x", "tiny", 0)
    assert not stale.exists()  # a job without the variable builds in the default folder: cleared there
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "own"))
    assert plan_jobs(load_case(PLAN_B), PLAN_B, "tiny", 1, tmp_path, Platform.cpu)[0].env[
        "TORCH_EXTENSIONS_DIR"] == str(tmp_path / "own")
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert "HARNESS_CACHE=${HARNESS_CACHE:-$PWD/.cache/oom-harness}" in ci


def test_each_python_environment_builds_deepspeeds_ops_in_a_folder_of_its_own(tmp_path, monkeypatch):
    """A LLaMA-Factory case's workers run on that environment's interpreter, whose torch headers live at
    other paths: sharing one build folder with this environment's workers made ninja rebuild every op
    whenever the other environment had used it last."""
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    other = tmp_path / ".venv-lf" / "bin" / "python"
    other.parent.mkdir(parents=True)
    other.symlink_to(sys.executable)  # a virtual environment's interpreter: a link to the same base Python
    case_path = CASES_DIR / "000-lora-z3-offload-aggressive-cutoff512-ga32.yaml"
    case = load_case(case_path)

    def folders(python, out):
        monkeypatch.setattr("harness.runtime.launcher.interpreter", lambda c: python)
        return {job.env["TORCH_EXTENSIONS_DIR"] for job in plan_jobs(case, case_path, "tiny", 2, out, Platform.cpu)}

    lf, own = folders(str(other), tmp_path / "a"), folders(sys.executable, tmp_path / "b")
    assert own == {str(tmp_path / "torch_extensions")}
    (lf_dir,) = lf
    assert Path(lf_dir).parent == tmp_path / "torch_extensions" and Path(lf_dir).name.startswith("env-venv-lf-")
    # stable across processes, and one per environment path
    assert compile_cache.extensions_dir(str(other)) == Path(lf_dir)
    assert compile_cache.extensions_dir(str(tmp_path / "venv2" / "bin" / "python")) != Path(lf_dir)
