"""`oom-harness fit`: the guides' failing configs get a config `check` accepts with the global batch kept,
in the input's own format, inside --out only; --allow is respected; exit codes; the throughput model
orders the guides' measured configs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from harness.cli.main import main
from harness.fit.throughput import calibrate, observations
from harness.premerge import check
from harness.premerge.check import run_check
from harness.premerge.importers import JobSpec
from harness.spec.units import GIB

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "configs" / "examples"
DATA = ROOT / "tests" / "data"


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _fit(capsys, *argv) -> tuple[int, dict]:
    # the walk's deadline is for a user waiting; these tests check what it finds, on a host of any load
    code = main(["fit", *map(str, argv), "--json", "--search-seconds", "900"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_guide_000_failing_config_gets_a_config_check_accepts(tmp_path, capsys):
    before = _digest(EXAMPLES)
    config = EXAMPLES / "000-ds32b-failing.yaml"
    spec = JobSpec(gpus=8, gpu_memory=64 * GIB)
    assert not run_check(config, spec).fits
    code, out = _fit(capsys, config, "--gpu-memory", "64GiB", "--gpus", "8", "--out", tmp_path / "out")
    assert code == 0 and out["fits"]
    files = [Path(f) for f in out["files"]]
    assert all(f.resolve().is_relative_to((tmp_path / "out").resolve()) for f in files)
    assert _digest(EXAMPLES) == before  # the inputs are untouched
    fitted = next(f for f in files if f.suffix == ".yaml")
    data = yaml.safe_load(fitted.read_text())
    assert data["per_device_train_batch_size"] * data["gradient_accumulation_steps"] == 16  # the global batch
    assert (fitted.parent / data["deepspeed"]).exists()
    again = run_check(fitted, spec)  # what `oom-harness check` says of the written files
    assert again.fits and again.card_peak == pytest.approx(out["predicted"]["card_peak_gib"] * GIB, rel=1e-3)
    keys = {c[0] for c in out["changes"]}
    assert "per_device_train_batch_size" in keys or "use_reentrant_gc" in keys
    assert all(len(c) == 4 and c[3] for c in out["changes"])  # key, from, to, why
    assert out["predicted_tokens_per_s"] > out["input"]["predicted_tokens_per_s"] > 0


def test_guide_003_needs_a_shorter_cutoff_and_allow_is_respected(tmp_path, capsys):
    config = EXAMPLES / "003-qwen7b-qlora-failing.json"
    job = ["--gpu-memory", "15.77GiB", "--gpus", "1", "--stack", "peft"]
    code, out = _fit(capsys, config, *job, "--out", tmp_path / "none")
    assert code == 1 and not out["fits"] and out["closest"]["over_gib"] > 0
    assert not (tmp_path / "none").exists() or not any((tmp_path / "none").iterdir())

    code, out = _fit(capsys, config, *job, "--out", tmp_path / "cutoff", "--allow", "cutoff")
    assert code == 0
    written = json.loads(next(Path(f) for f in out["files"] if f.endswith(".json")).read_text())
    assert written["lora_r"] == 64 and written["load_in_4bit"]  # rank not allowed: kept
    assert written["max_seq_length"] < 2048
    assert written["per_device_train_batch_size"] * written["gradient_accumulation_steps"] == 16
    fitted = next(Path(f) for f in out["files"] if f.endswith(".json"))
    assert run_check(fitted, JobSpec(gpus=1, gpu_memory=int(15.77 * GIB), stack="peft")).fits
    assert out["search"]["throughput_source"] == "pooled"  # no --platform: every platform's constants

    code, out = _fit(capsys, config, *job, "--out", tmp_path / "h200", "--allow", "cutoff", "--platform",
                     "nvidia-h200-x8")  # a platform without baselines: ranked with its card family's constants
    assert code == 0 and out["search"]["throughput_source"] == "borrowed from nvidia-h200-x2"
    assert "same card family" in out["search"]["throughput_notes"][-1]


def test_a_model_outside_the_registry(tmp_path, capsys):
    config = tmp_path / "in" / "train.json"
    config.parent.mkdir()
    config.write_text(json.dumps({
        "model_name_or_path": str(DATA / "llama-3.1-8b"), "bf16": True, "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 2, "max_length": 4096, "lora_r": 16, "lora_target_modules": "all"}))
    spec = JobSpec(gpus=1, gpu_memory=40 * GIB)
    assert not run_check(config, spec).fits
    code, out = _fit(capsys, config, "--gpu-memory", "40GiB", "--gpus", "1", "--out", tmp_path / "out")
    assert code == 0
    fitted = next(Path(f) for f in out["files"] if f.endswith(".json"))
    data = json.loads(fitted.read_text())
    assert data["per_device_train_batch_size"] * data["gradient_accumulation_steps"] == 16
    assert run_check(fitted, spec).fits


def test_the_search_judges_with_checks_verdict(tmp_path, capsys, monkeypatch):
    """A stricter verdict in CheckResult.fits (a margin) is what fit keeps to, with no change in fit."""
    config = EXAMPLES / "000-ds32b-failing.yaml"
    args = [config, "--gpu-memory", "64GiB", "--gpus", "8"]
    code, loose = _fit(capsys, *args, "--out", tmp_path / "a")
    strict = property(lambda self: self.card_peak is not None and self.card_peak <= 0.4 * self.budget)
    monkeypatch.setattr(check.CheckResult, "fits", strict)
    code, tight = _fit(capsys, *args, "--out", tmp_path / "b")
    assert code == 0
    assert tight["predicted"]["card_peak_gib"] <= 0.4 * tight["predicted"]["budget_gib"]
    assert loose["predicted"]["card_peak_gib"] > 0.4 * loose["predicted"]["budget_gib"]


def test_the_walk_stops_at_the_time_it_is_given(tmp_path, capsys):
    argv = ["fit", str(EXAMPLES / "000-ds32b-failing.yaml"), "--gpu-memory", "64GiB", "--gpus", "8",
            "--out", str(tmp_path / "out"), "--search-seconds", "1e-9"]
    code = main([*argv, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and not out["fits"]
    assert out["search"]["stopped_early"] and out["search"]["predicted"] == 0
    assert not (tmp_path / "out").exists()
    assert main(argv) == 1  # said as a search cut short, not as a verdict on candidates it never reached
    said = capsys.readouterr().out
    assert "no fitting config found in the 0 s the search was given" in said and "no config fits" not in said


def test_a_walk_stopped_after_a_bound_fits_answers_with_it(monkeypatch):
    """The walk predicts a family's micro-batch 1 as the bound of its larger micro-batches before it judges
    them. Where the time limit comes right after such a prediction fits, that config is the answer (the
    best of the fitting ones the walk predicted), never a 'closest' that fits reported as over."""
    import dataclasses
    import types

    from harness.fit import search as search_module
    from harness.predict.predictor import predict

    base = run_check(EXAMPLES / "000-ds32b-failing.yaml", JobSpec(gpus=8, gpu_memory=64 * GIB))
    now = [0.0]
    monkeypatch.setattr(search_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def predict_until_one_fits(case, arch, platform=None):
        p = predict(case, arch, platform=platform)
        if check.CheckResult(config=dataclasses.replace(base.config, case=case), prediction=p, lints=()).fits:
            now[0] = 1e9  # the time limit has passed at the walk's next candidate
        return p

    found = search_module.search(base, frozenset(), predict_until_one_fits, deadline_s=60)
    assert found.stopped_early and found.closest is None
    assert found.best is not None and found.best.fits and found.best.knobs.micro_batch == 1
    assert found.best.result.card_peak <= found.best.result.budget


@pytest.mark.parametrize("argv, says", [
    (["--allow", "everything"], "not a knob"),
    (["--verify"], "has none"),
])
def test_bad_input_exits_2(tmp_path, capsys, argv, says):
    code = main(["fit", str(EXAMPLES / "000-ds32b-failing.yaml"), "--gpu-memory", "64GiB", "--gpus", "8",
                 "--out", str(tmp_path / "out"), *argv])
    assert code == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_out_must_be_a_folder(tmp_path, capsys):
    out = tmp_path / "file"
    out.write_text("x")
    code = main(["fit", str(EXAMPLES / "000-ds32b-failing.yaml"), "--gpu-memory", "64GiB", "--gpus", "8",
                 "--out", str(out)])
    assert code == 2 and "--out" in capsys.readouterr().err
    assert out.read_text() == "x"


H100 = "nvidia-h100-80gb-hbm3-x1"


def _measured(case_id: str) -> float:
    return max(o.tokens_per_s for o in observations() if o.case_id == case_id and o.variant in ("", "u")
               and o.platform == H100)


@pytest.mark.parametrize("ids", [
    ["001-ladder-rung1-zero2", "001-ladder-rung2-zero2-offload", "001-ladder-rung3-zero3",
     "001-ladder-rung4-zero3-offload"],
    ["003-qlora-fix-r32-seq1024-gc", "003-qlora-fix-r16-seq512-gc"],
    ["004-gla-plan-a-minimal", "004-gla-plan-b-bs2", "004-gla-plan-c-1proc"],
])
def test_throughput_model_orders_the_guides_as_measured(ids):
    works = {o.case_id: o.work for o in observations()
             if o.case_id in ids and o.variant in ("", "u") and o.platform == H100}
    assert [_measured(i) for i in ids] == sorted((_measured(i) for i in ids), reverse=True)
    for platform in (H100, None):  # the platform's constants and the pooled ones
        model = calibrate(platform=platform)
        predicted = [model.tokens_per_s(works[i]) for i in ids]
        assert predicted == sorted(predicted, reverse=True), platform
        # also with each case's own baselines left out of the fit (benchmarks/bench_throughput.py)
        left_out = [calibrate(frozenset({i}), platform).tokens_per_s(works[i]) for i in ids]
        assert left_out == sorted(left_out, reverse=True), platform


pytest_plugins = ["pytester"]


def test_premerge_fit_puts_the_fitted_diff_in_the_failure(pytester):
    import shutil

    folder = pytester.mkdir("configs")
    for name in ("000-ds32b-failing.yaml", "ds_z3_offload_config.json"):
        shutil.copy(EXAMPLES / name, folder)
    (folder / "premerge.yaml").write_text("defaults: {gpus: 8, gpu_memory: 64GiB}\nconfigs: {}\n")
    plain = pytester.runpytest_subprocess("--premerge-dir", "configs", "-p", "no:cacheprovider")
    plain.assert_outcomes(failed=1)
    assert "oom-harness fit" not in plain.stdout.str()
    fitted = pytester.runpytest_subprocess("--premerge-dir", "configs", "--premerge-fit", "-p", "no:cacheprovider")
    fitted.assert_outcomes(failed=1)
    fitted.stdout.fnmatch_lines(["*oom-harness fit: this fits at * per card predicted*",
                                 "*gradient_accumulation_steps: 16 -> *"])


@pytest.mark.parametrize(("allowed", "hint"), [
    (frozenset(), "more room: --allow cutoff,quantization,rank (what is trained changes), more GPUs, or bigger cards"),
    (frozenset({"cutoff"}), "more room: --allow cutoff,quantization,rank (what is trained changes), more GPUs"),
    (frozenset({"cutoff", "quantization", "rank"}), "more room: more GPUs, or bigger cards"),
])
def test_when_nothing_fits_the_hint_offers_only_what_was_not_searched(capsys, allowed, hint):
    from types import SimpleNamespace

    from harness.cli.fit import _report_none

    found = SimpleNamespace(base=SimpleNamespace(config=SimpleNamespace(training=SimpleNamespace(path="job.yaml"))),
                            closest=None, considered=10, predicted=4, stopped_early=False, seconds=3.0)
    _report_none(found, False, allowed)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(hint)


def test_guide_004s_jobs_get_a_config_that_survives_compiling_their_kernels(tmp_path, capsys):
    """Two jobs per 23.52 GiB card: as written they fit only once fla's Triton kernels are compiled on
    the host; judged on a first launch (the default), fit turns checkpointing on and keeps the batch."""
    job = ["--gpu-memory", "23.52GiB", "--gpus", "7", "--procs-per-gpu", "2"]
    config = DATA / "fit" / "004-gla-failing.json"
    code, out = _fit(capsys, config, *job, "--out", tmp_path / "cold")
    assert code == 0 and not out["input"]["fits"] and out["fits"]
    written = json.loads(next(Path(f) for f in out["files"] if f.endswith(".json")).read_text())
    assert written["gradient_checkpointing"] is True
    assert written["per_device_train_batch_size"] * written["gradient_accumulation_steps"] == 4
    assert run_check(Path(out["files"][0]), JobSpec(gpus=7, gpu_memory=int(23.52 * GIB), procs_per_gpu=2)).fits

    code, out = _fit(capsys, config, *job, "--triton-cache", "warm", "--out", tmp_path / "warm")
    assert code == 0 and out["input"]["fits"]  # a host that has compiled them: the config as written
    assert {c[0] for c in out["changes"]} == {"launch.sh: PYTORCH_CUDA_ALLOC_CONF"}


def test_verify_sets_the_measurement_against_the_prediction_and_keeps_stdout_one_json(tmp_path, capsys,
                                                                                      monkeypatch):
    """--verify on a GPU host: the run (here: guide 001's rung 1 as measured on an H200, standing in for
    `oom-harness run`) prints its table aside, and fit's JSON says measured against predicted."""
    from harness.cli import fit as fit_command
    from harness.cli import run as run_command

    measured = ROOT / "results" / "runs" / "2026-11-27-h200-fit-001-rung1-verify.json"
    monkeypatch.setattr(fit_command, "_require_gpu", lambda: None)

    def fake_run(args):
        Path(args.json).write_bytes(measured.read_bytes())
        print("case  fid  procs  peak/card  (the run's table)")
        return 0

    monkeypatch.setattr(run_command, "run", fake_run)
    code, out = _fit(capsys, DATA / "fit" / "001-rung1-zero2.json", "--gpu-memory", "12GiB", "--gpus", "1",
                     "--out", tmp_path / "out", "--verify")  # _fit parses stdout as one JSON object
    assert code == 0
    v = out["verified"]
    assert v["outcome"] == "ok" and v["measured_card_peak_gib"] == pytest.approx(10.615, abs=1e-3)
    assert v["predicted_card_peak_gib"] == out["predicted"]["card_peak_gib"]
    assert v["peak_error"] == pytest.approx(v["predicted_card_peak_gib"] / v["measured_card_peak_gib"] - 1, abs=1e-3)
    limit = v["predicted_card_peak_gib"] * (1 + v["margin_fraction"])
    assert isinstance(v["within_margin"], bool)
    if abs(v["measured_card_peak_gib"] - limit) > 2e-3:  # the figures are given to 1 MiB: an edge is not decided here
        assert v["within_margin"] == (v["measured_card_peak_gib"] <= limit)
    assert v["measured_tokens_per_s"] == pytest.approx(6908, rel=0.01)  # the median step
    assert (tmp_path / "out" / "case").is_dir()  # the fitted config, written as the case that ran

    code = main(["fit", str(DATA / "fit" / "001-rung1-zero2.json"), "--gpu-memory", "12GiB", "--gpus", "1",
                 "--out", str(tmp_path / "again"), "--verify"])
    table = capsys.readouterr().out
    assert code == 0 and "(the run's table)" in table
    assert "per card: measured 10.62 GiB" in table and "tokens/s per card: measured 6,908" in table


def test_verify_measures_a_config_too_big_for_the_host_at_its_depth_points(tmp_path, capsys, monkeypatch):
    """Guide 000's 64-layer, 8-card config: --verify --depth-points 4,8 writes the case to be measured at
    4 and 8 layers (on as many ranks as the host has) and extrapolated; without --verify it is refused."""
    from harness.cli import fit as fit_command
    from harness.cli import run as run_command
    from harness.spec.cases import load_case

    job = [str(EXAMPLES / "000-ds32b-failing.yaml"), "--gpu-memory", "64GiB", "--gpus", "8", "--search-seconds", "900"]
    assert main(["fit", *job, "--out", str(tmp_path / "no"), "--depth-points", "4,8"]) == 2
    assert "--depth-points" in capsys.readouterr().err and not (tmp_path / "no").exists()

    monkeypatch.setattr(fit_command, "_require_gpu", lambda: None)
    ran = []
    monkeypatch.setattr(run_command, "run", lambda args: ran.append(args) or 0)
    assert main(["fit", *job, "--out", str(tmp_path / "deep"), "--verify", "--depth-points", "4,64"]) == 2
    assert "64 is not below the model's 64 layers" in capsys.readouterr().err and not ran
    assert main(["fit", *job, "--out", str(tmp_path / "out"), "--verify", "--depth-points", "4,8"]) == 0
    (case_file,) = (tmp_path / "out" / "case").glob("*.yaml")
    case = load_case(case_file)
    assert case.depth_points == [4, 8] and case.launch.ranks == 8
    assert ran and ran[0].case_dir == str(tmp_path / "out" / "case") and ran[0].fidelity == "real"


def test_verify_at_depth_points_sets_each_measured_shape_against_its_own_prediction(tmp_path, capsys, monkeypatch):
    """Guide 000's fitted 8-card config as two H200s measured it at 4 and 8 layers: the full-size peak is
    not measured, so the output sets each measured shape against the prediction for that shape (a
    depth fit carried from 2 ranks would not be the 8-rank job's peak), and says the margin missed."""
    from harness.cli import fit as fit_command
    from harness.cli import run as run_command

    measured = ROOT / "results" / "runs" / "2026-11-27-h200x2-fit-000-verify.json"
    monkeypatch.setattr(fit_command, "_require_gpu", lambda: None)
    monkeypatch.setattr(run_command, "run", lambda args: Path(args.json).write_bytes(measured.read_bytes()) and 0)
    job = [EXAMPLES / "000-ds32b-failing.yaml", "--gpu-memory", "64GiB", "--gpus", "8"]
    code, out = _fit(capsys, *job, "--out", tmp_path / "out", "--verify", "--depth-points", "4,8")
    v = out["verified"]
    assert code == 0 and v["outcome"] == "ok" and v["measured_card_peak_gib"] is None
    shapes = {p["shape"]: p for p in v["depth_points"]}
    assert set(shapes) == {"2 of 8 ranks, 4 of 64 layers", "2 of 8 ranks, 8 of 64 layers"}
    four = shapes["2 of 8 ranks, 4 of 64 layers"]
    assert four["measured_gib"] == pytest.approx(31.53, abs=0.01)  # the device figure of the worse rank
    assert four["error"] == pytest.approx(four["predicted_gib"] / four["measured_gib"] - 1, abs=1e-3)
    # the shortfall as the margin computes it; this run sets its kind's margin, so it sits at the edge
    within = all(p["measured_gib"] / p["predicted_gib"] - 1 <= v["margin_fraction"] + 1e-3 for p in shapes.values())
    assert v["within_margin"] is within

    assert main(["fit", *map(str, job), "--out", str(tmp_path / "again"), "--verify", "--depth-points", "4,8"]) == 0
    text = capsys.readouterr().out
    assert "measured at smaller shapes" in text and "2 of 8 ranks, 8 of 64 layers: measured 32.78 GiB" in text


def test_a_fitted_candidate_keeps_the_attention_kernel_of_the_config():
    """Every candidate fit predicts is the config with other knobs: its attention kernel stays."""
    import dataclasses

    from harness.fit.knobs import apply, knobs_of
    from harness.spec.cases import CASES_DIR, load_case

    case = load_case(CASES_DIR / "003-qlora-fix-r32-seq1024-gc.yaml")
    data = case.model_dump(mode="json")
    data["train"]["attn_implementation"] = "eager"
    case = type(case).model_validate(data)
    k = knobs_of(case)
    fitted = apply(case, dataclasses.replace(k, micro_batch=k.micro_batch * 2, checkpointing=False))
    assert fitted.train.attn_implementation == "eager" and fitted.train.micro_batch == 2 * case.train.micro_batch
