"""Blessing full-size runs into baselines, and reporting them against the guides' claims."""

import json

import pytest

from harness.baselines.store import BlessError, bless, load_baselines, spread
from harness.measure.records import CaseRun, Memory, RankReport
from harness.report.markdown import extrapolation_markdown, report_markdown
from harness.spec.units import GIB


def _run(device_peak: float, step_s: float) -> dict:
    rank = RankReport(case_id="003-qlora-fix-r32-seq1024-gc", fidelity="real", rank=0, world_size=1,
                      platform="cuda", device_name="NVIDIA H100 80GB HBM3", emulated_card_bytes=int(15.77 * GIB),
                      load=Memory(allocated=int(6 * GIB), reserved=int(6.2 * GIB), device=int(6.5 * GIB)),
                      step=Memory(allocated=int(9 * GIB), reserved=int(9.5 * GIB), device=int(device_peak * GIB)),
                      step_times_s=[9.0, step_s, step_s], tokens_per_step=16384, flops_per_token=3e10,
                      losses=[12.8, 11.0, 10.5], versions={"torch": "2.11.0", "cuda": "13.0"})
    run = CaseRun(case_id=rank.case_id, fidelity="real", command=[], returncode=0, wall_s=40.0, ranks=[rank])
    return {"case": rank.case_id, "fidelity": "real", "run": json.loads(run.model_dump_json()), "verdicts": []}


def test_repetitions_become_one_baseline_with_their_spread(tmp_path):
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps([_run(10.4, 7.0), _run(10.6, 7.4)]))
    (path,) = bless(runs, driver="580.159.04", root=tmp_path / "baselines", recorded="2026-11-25")
    assert path.parent.name == "nvidia-h100-80gb-hbm3-x1"
    (baseline,) = load_baselines(tmp_path / "baselines")
    assert baseline.platform.driver == "580.159.04"
    assert baseline.measured == "full depth"
    assert len(baseline.runs) == 2
    median, deviation = spread(baseline.values("tokens_per_s_per_gpu"))
    assert median == pytest.approx((16384 / 7.0 + 16384 / 7.4) / 2)
    assert 0.02 < deviation < 0.03
    assert baseline.runs[0].mfu == 16384 / 7.0 * 3e10 / 989.4e12


def test_the_report_puts_the_guides_figures_beside_the_measurement(tmp_path):
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps([_run(10.5, 7.0)]))
    bless(runs, root=tmp_path / "baselines")
    table = report_markdown(load_baselines(tmp_path / "baselines"))
    row = next(line for line in table.splitlines() if line.startswith("| 003-qlora-fix-r32"))
    assert "fits (as expected)" in row
    assert "device_peak 10-12 GiB: 10.50 GiB (holds)" in row
    assert "device_peak 12-14 GiB: 10.50 GiB (refuted)" in row
    assert "+3.69 GiB" in row  # headroom under 90% of 15.77 GiB


def _series_entry(case_id: str, variant: str, peak: float, host: float, step_s: float) -> dict:
    rank = RankReport(case_id=case_id, fidelity="real", rank=0, world_size=2, platform="cuda",
                      device_name="NVIDIA H200",
                      step=Memory(allocated=int(5.4 * GIB), device=int(peak * GIB), host_rss=int(host * GIB)),
                      step_times_s=[9.0, step_s, step_s], tokens_per_step=2048)
    run = CaseRun(case_id=case_id, fidelity="real", variant=variant, command=[], returncode=0, wall_s=1.0, ranks=[rank])
    return {"case": case_id, "run": json.loads(run.model_dump_json())}


def test_the_report_sets_each_extrapolation_beside_its_full_depth_check(tmp_path):
    case = "000-lora-z3-offload-cutoff1024-ga16-nonreentrant"
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps([_series_entry(case, "2r4L2ga", 10.0, 7.0, 1.0),
                                _series_entry(case, "2r8L2ga", 10.0, 11.0, 2.0),
                                _series_entry(case, "2r2ga", 11.0, 67.0, 20.0)]))
    bless(runs, root=tmp_path / "baselines")
    table = report_markdown(load_baselines(tmp_path / "baselines"))
    row = next(line for line in table.splitlines() if line.startswith(f"| {case} | nvidia-h200-x2, variant 2r2ga"))
    # 10 GiB flat in depth; the full-depth run measured 11 GiB: the fit missed 10%, which becomes the margin
    assert "| 10.00 GiB | flat (within 2%) | 11.00 GiB (+10.0%, " in row
    assert "peak 11.00 GiB (fit -9.1%); host 67.00 GiB (fit +0.0%); 102 tokens/s (fit +25%)" in row


def test_a_whole_card_run_is_reported_as_the_measurement_its_family_claims_are_judged_on(tmp_path):
    """Guide 001's rungs run out of memory on their tiers' cards; their whole-card runs give the
    speed and memory order. Their row must not read as a fit of the target card."""
    case = "001-ladder-rung4-zero3-offload"
    entry = _series_entry(case, "u", 10.04, 7.4, 13.5)
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps([entry]))
    bless(runs, root=tmp_path / "baselines")
    row = next(line for line in report_markdown(load_baselines(tmp_path / "baselines")).splitlines()
               if line.startswith(f"| {case} |"))
    assert "on the whole card, not its target's" in row
    assert "| trains (on the whole card: no verdict on its target) |" in row and "fits" not in row
    assert "| -6.44 GiB |" in row  # 10.04 GiB against the 3.60 GiB budget of its 4 GiB card
    assert "lower_peak_than, optimizer_state_offloaded, speed_rank: judged on this run" in row


def test_a_mistakes_run_is_reported_as_the_mistake_not_as_a_fit(tmp_path):
    """Guide 002's mistakes run at one depth to be detected: their row must neither read as a fit
    nor point to an extrapolation that does not exist."""
    case = "002-gemma27b-wrong-model-before-deepspeed"
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps([_series_entry(case, "2r6L2ga", 33.71, 44.6, 3.3)]))
    bless(runs, root=tmp_path / "baselines")
    table = report_markdown(load_baselines(tmp_path / "baselines"))
    row = next(line for line in table.splitlines() if line.startswith(f"| {case} |"))
    assert "| trains (the mistake to detect: materialised_before_zero_init) | 5.40 GiB / - / 33.71 GiB |" in row
    assert "fits" not in row and "extrapolation" not in row
    assert "Depth extrapolations" not in table  # one depth: no fit


def test_the_report_says_which_triton_cache_a_run_had(tmp_path):
    entry = _run(10.5, 7.0)
    entry["run"]["ranks"][0]["triton_cache"] = "cold"
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps([entry]))
    bless(runs, root=tmp_path / "baselines")
    assert "10.50 GiB (cold Triton cache)" in report_markdown(load_baselines(tmp_path / "baselines"))


def test_append_adds_repetitions_of_another_day_and_refuses_another_stack(tmp_path):
    first, second, upgraded = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    first.write_text(json.dumps([_run(10.5, 7.0)]))
    second.write_text(json.dumps([_run(10.5, 8.4)]))
    bless(first, root=tmp_path / "baselines", recorded="2026-11-25", note="host 1")
    bless(second, root=tmp_path / "baselines", recorded="2026-11-26", note="host 2", append=True)
    (baseline,) = load_baselines(tmp_path / "baselines")
    assert [r.recorded for r in baseline.runs] == ["2026-11-25", "2026-11-26"]
    assert baseline.note == "host 1\n2026-11-26: host 2" and baseline.recorded == "2026-11-26"
    assert spread(baseline.values("tokens_per_s_per_gpu"))[1] == pytest.approx(1.4 / 15.4)  # (8.4 - 7) / (8.4 + 7)
    entry = _run(10.5, 7.0)
    entry["run"]["ranks"][0]["versions"]["torch"] = "2.12.0"
    upgraded.write_text(json.dumps([entry]))
    with pytest.raises(BlessError, match=r"torch 2.11.0 -> 2.12.0.*with --replace"):
        bless(upgraded, root=tmp_path / "baselines", append=True)
    assert len(load_baselines(tmp_path / "baselines")[0].runs) == 2  # nothing written
    with pytest.raises(BlessError, match=r"a baseline exists; pass --replace"):
        bless(second, root=tmp_path / "baselines")  # neither append nor replace: refused, nothing written
    assert len(load_baselines(tmp_path / "baselines")[0].runs) == 2
    bless(second, root=tmp_path / "baselines", replace=True)  # replaced: one repetition
    assert len(load_baselines(tmp_path / "baselines")[0].runs) == 1


def test_append_takes_a_version_the_baseline_never_recorded_from_the_new_runs(tmp_path):
    older, newer = tmp_path / "a.json", tmp_path / "b.json"
    older.write_text(json.dumps([_run(10.5, 7.0)]))
    bless(older, root=tmp_path / "baselines", recorded="2026-11-25")  # blessed with no driver known
    newer.write_text(json.dumps([_run(10.5, 7.2)]))
    bless(newer, driver="580.159.04", root=tmp_path / "baselines", recorded="2026-11-26", append=True)
    (baseline,) = load_baselines(tmp_path / "baselines")
    assert len(baseline.runs) == 2 and baseline.platform.driver == "580.159.04"
    assert baseline.note.endswith("first recorded with these runs: driver 580.159.04")
    # a recorded driver that differs is another stack
    other = tmp_path / "c.json"
    other.write_text(json.dumps([_run(10.5, 7.2)]))
    with pytest.raises(BlessError, match=r"driver 580.159.04 -> 590.1"):
        bless(other, driver="590.1", root=tmp_path / "baselines", append=True)


def test_the_extrapolation_table_sets_the_guides_expectation_beside_the_fit(tmp_path):
    refuted, steep = "002-gemma27b-full-z3-offload-len4096", "000-lora-z3-offload-aggressive-cutoff512-ga32"
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps([
        _series_entry(refuted, "2r6L2ga", 28.75, 46.6, 14.0), _series_entry(refuted, "2r12L2ga", 28.96, 75.8, 10.6),
        _series_entry(steep, "2r4L2ga", 10.0, 7.0, 2.3), _series_entry(steep, "2r8L2ga", 14.0, 9.0, 3.5)]))
    bless(runs, root=tmp_path / "baselines")
    rows = {line.split(" | ")[0][2:]: line for line in
            extrapolation_markdown(load_baselines(tmp_path / "baselines")).splitlines() if line.startswith("| 00")}
    # the guide's failing 4096-token config fits: a refutation its case records as a finding
    assert "71.68 GiB: fits (the guide says oom: refuted, as recorded)" in rows[refuted]
    # 1 GiB a layer exceeds 57.60 GiB at 64 layers on 2 of 8 ranks, which says nothing of 8 ranks
    assert "57.60 GiB: exceeds the budget (inconclusive on fewer ranks)" in rows[steep]


def test_several_runs_files_bless_at_once(tmp_path):
    first, second = tmp_path / "single-0.json", tmp_path / "single-1.json"  # the nightly job writes one per GPU
    first.write_text(json.dumps([_run(10.5, 7.0)]))
    second.write_text(json.dumps([_run(10.5, 7.2)]))
    bless([first, second], root=tmp_path / "baselines")
    assert len(load_baselines(tmp_path / "baselines")[0].runs) == 2
    first.write_text(json.dumps([{"case": "x"}]))
    with pytest.raises(BlessError, match=r"single-0.json: entry 0 is not a run of `oom-harness run --json`"):
        bless([first, second], root=tmp_path / "baselines")


def test_a_pytest_run_folder_blesses_directly(tmp_path):
    # pytest --harness-run-dir DIR writes DIR/real/<case>/run.json, repetitions in rep1/, rep2/...
    case_dir = tmp_path / "runs" / "real" / "003-qlora-fix-r32-seq1024-gc"
    (case_dir / "rep1").mkdir(parents=True)
    (case_dir / "run.json").write_text(json.dumps(_run(10.5, 7.0)["run"]))
    (case_dir / "rep1" / "run.json").write_text(json.dumps(_run(10.5, 7.2)["run"]))
    bless([tmp_path / "runs"], root=tmp_path / "baselines")
    assert len(load_baselines(tmp_path / "baselines")[0].runs) == 2
    with pytest.raises(BlessError, match=r"no run\.json below this folder"):
        bless([tmp_path / "baselines"], root=tmp_path / "b2")
    with pytest.raises(BlessError, match=r"missing\.json: cannot be read as JSON"):
        bless([tmp_path / "missing.json"], root=tmp_path / "b2")
    (case_dir / "run.json").write_text("{}")
    with pytest.raises(BlessError, match=r"run.json: its content is not a run"):
        bless([tmp_path / "runs"], root=tmp_path / "b2")


def test_a_cards_tokens_per_s_adds_up_the_jobs_sharing_it_and_takes_the_slowest_rank_of_a_sharded_job():
    from harness.baselines.store import figures_of

    def rank(r, world, slot, step_s):
        return RankReport(case_id="x", fidelity="real", rank=r, world_size=world,
                          process_slot=slot, platform="cuda", device_name="NVIDIA H100 80GB HBM3",
                          step=Memory(allocated=GIB), step_times_s=[9.0, step_s, step_s], tokens_per_step=2048)

    # guide 004: two jobs on one card, one scheduled faster than the other in this run
    shared = CaseRun(case_id="x", fidelity="real", command=[], returncode=0, wall_s=1.0,
                     ranks=[rank(0, 1, 0, 1.0), rank(0, 1, 1, 0.8)])
    assert figures_of(shared, procs_per_card=2).tokens_per_s_per_gpu == pytest.approx(2048 + 2560)
    # ZeRO ranks on a card each step together: the card runs at the slowest rank's pace
    sharded = CaseRun(case_id="x", fidelity="real", command=[], returncode=0, wall_s=1.0,
                      ranks=[rank(0, 2, 0, 1.0), rank(1, 2, 0, 0.8)])
    assert figures_of(sharded, procs_per_card=1).tokens_per_s_per_gpu == pytest.approx(2048)


def test_report_of_a_nights_runs_shows_them_and_what_failed(tmp_path, capsys):
    """The nightly job publishes its own runs in the report's table, not only the baselines."""
    from harness.cli.main import main

    entry = _run(10.5, 7.0)
    entry["verdicts"] = [{"what": "baseline_speed", "status": "refuted", "quote": "",
                          "detail": "2,341 tokens/s per GPU vs baseline 2,379 (floor 2,360)"},
                         {"what": "outcome", "status": "confirmed", "quote": "", "detail": "fits"}]
    runs = tmp_path / "single-0.json"
    runs.write_text(json.dumps([entry]))
    from harness.baselines.store import RESULTS_DIR

    committed = RESULTS_DIR / "nvidia-h100-80gb-hbm3-x1" / "003-qlora-fix-r32-seq1024-gc.json"
    before = committed.read_text()
    assert main(["report", str(runs)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Verdicts, failures first:")  # the verdict table leads
    head, _ = out.split(f"Measured in {runs} (these runs, not the committed baselines)")
    assert "| FAIL | 003-qlora-fix-r32-seq1024-gc [run given] | nvidia-h100-80gb-hbm3-x1 | fits | fits |" in head
    assert "| 003-qlora-fix-r32-seq1024-gc | NVIDIA H100 80GB HBM3 x1, full depth |" in out
    assert out.rstrip().endswith("Verdicts that failed:\n- 003-qlora-fix-r32-seq1024-gc: [REFUTED] baseline_speed: "
                                 "2,341 tokens/s per GPU vs baseline 2,379 (floor 2,360)")
    assert committed.read_text() == before  # reported, not blessed


def _with_attention(entry: dict, attn: str | None) -> dict:
    entry["run"]["ranks"][0]["attn_implementation"] = attn
    return entry


def test_the_case_as_measured_takes_the_attention_kernel_its_runs_recorded(tmp_path):
    """A case that leaves the kernel to transformers is predicted with the one its runs recorded; a
    repetition from before the record does not contradict it; runs that disagree, a case naming its
    own kernel and a baseline without the record are left as they are."""
    from harness.spec.cases import CASES_DIR, load_case

    case = load_case(CASES_DIR / "003-qlora-fix-r32-seq1024-gc.yaml")
    assert case.train.attn_implementation is None
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps([_run(10.5, 7.0)]))
    new.write_text(json.dumps([_with_attention(_run(10.5, 7.0), "sdpa")]))
    bless(old, root=tmp_path / "b", recorded="2026-11-25")
    (before,) = load_baselines(tmp_path / "b")
    assert before.runs[0].attn_implementation is None
    assert before.case_as_measured(case).train.attn_implementation is None
    bless(new, root=tmp_path / "b", recorded="2026-11-27", append=True)
    (after,) = load_baselines(tmp_path / "b")
    assert [r.attn_implementation for r in after.runs] == [None, "sdpa"]
    measured = after.case_as_measured(case)
    assert measured.train.attn_implementation == "sdpa"
    assert measured.model_copy(update={"train": case.train}) == case  # nothing else changed
    data = case.model_dump(mode="json")
    data["train"]["attn_implementation"] = "eager"
    own = type(case).model_validate(data)
    assert after.case_as_measured(own).train.attn_implementation == "eager"
    eager = tmp_path / "eager.json"
    eager.write_text(json.dumps([_with_attention(_run(10.5, 7.0), "eager")]))
    bless(eager, root=tmp_path / "b", recorded="2026-11-27", append=True)
    (mixed,) = load_baselines(tmp_path / "b")
    assert mixed.case_as_measured(case).train.attn_implementation is None


def test_ranks_that_disagree_on_the_attention_kernel_record_none_of_them(tmp_path):
    entry = _with_attention(_run(10.5, 7.0), "sdpa")
    second = dict(entry["run"]["ranks"][0], rank=1, attn_implementation="eager")
    entry["run"]["ranks"].append(second)
    from harness.baselines.store import figures_of

    run = CaseRun.model_validate(entry["run"])
    assert figures_of(run, 1).attn_implementation == "eager+sdpa"
    assert figures_of(CaseRun.model_validate(_run(10.5, 7.0)["run"]), 1).attn_implementation is None


def test_the_case_as_measured_builds_the_model_as_the_harness_built_it(tmp_path):
    """The harness's runs build a QLoRA model from a checkpoint and every other from its config on the
    card; a case describes a job (a checkpoint load by default), so its baseline is predicted with the
    load its runs made. A 4-bit model built from its config is refused, naming the field."""
    import pydantic

    from harness.spec.cases import CASES_DIR, load_case

    raw = tmp_path / "runs.json"
    raw.write_text(json.dumps([_run(10.5, 7.0)]))
    bless(raw, root=tmp_path / "b", recorded="2026-11-27")
    (baseline,) = load_baselines(tmp_path / "b")
    lora = load_case(CASES_DIR / "000-lora-z3-offload-cutoff1024-ga16.yaml")
    qlora = load_case(CASES_DIR / "003-qlora-fix-r32-seq1024-gc.yaml")
    assert lora.launch.model_source == qlora.launch.model_source == "checkpoint"
    measured = baseline.case_as_measured(lora)
    assert measured.launch.model_source == "config"
    assert measured.model_copy(update={"launch": lora.launch}) == lora  # nothing else changed
    assert baseline.case_as_measured(qlora).launch.model_source == "checkpoint"
    data = qlora.model_dump(mode="json")
    data["launch"]["model_source"] = "config"
    with pytest.raises(pydantic.ValidationError, match="model_source"):
        type(qlora).model_validate(data)
