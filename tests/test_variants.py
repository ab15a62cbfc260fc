"""Measuring a case on fewer ranks, fewer layers or less accumulation, extrapolating in depth, and
judging what such a measurement says about the case as written."""

import json

import pytest

from harness.baselines.store import Figures, bless, load_baselines
from harness.judge.extrapolation import (
    DepthCheck,
    depth_check,
    depth_checks,
    every_fit,
    extrapolate,
    extrapolate_figures,
    fit_line,
)
from harness.judge.regression import against_baseline, limit, no_baseline, tolerance
from harness.judge.session import plan
from harness.judge.verdicts import Verdict, judge_on_variant
from harness.measure.records import CaseRun, ErrorInfo, Failure, Memory, RankReport
from harness.spec.cases import CASES_DIR, load_case
from harness.spec.units import GIB
from harness.spec.variants import Variant, parse_variant

FAILING_32B = load_case(CASES_DIR / "000-lora-z3-offload-cutoff1024-ga16.yaml")  # 8 ranks, 64 GiB, oom
FIX_32B = load_case(CASES_DIR / "000-lora-z3-offload-cutoff1024-ga16-nonreentrant.yaml")  # expect fits
FIX_7B = load_case(CASES_DIR / "003-qlora-fix-r32-seq1024-gc.yaml")  # one card, no DeepSpeed


# --- variants -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "2r", "8L", "2ga", "2r8L", "2r8L2ga", "4L16ga"])
def test_variant_text_round_trips(text):
    v = parse_variant(text)
    assert v.text == text
    assert v.suffix == ("@" + text if text else "")


@pytest.mark.parametrize("bad", ["x", "2", "r2", "0r", "2L2r", "2r 8L"])
def test_a_malformed_variant_is_refused_with_the_forms_it_takes(bad):
    with pytest.raises(ValueError, match="'2r8L2ga'"):
        parse_variant(bad)


def test_a_variant_changes_only_ranks_layers_and_accumulation():
    measured = parse_variant("2r8L2ga").apply(FAILING_32B)
    assert (measured.launch.ranks, measured.layers, measured.train.grad_accum) == (2, 8, 2)
    assert measured.target == FAILING_32B.target  # the card it is judged against stays
    assert measured.deepspeed == FAILING_32B.deepspeed and measured.train.seq_len == 1024
    assert measured.depth_points is None  # it is one of the depths
    # figures stated for the case as written are not checked on a variant
    assert {c.kind for c in measured.claims} == {"trains", "zero3_partitions_parameters"}
    assert Variant().apply(FAILING_32B) is FAILING_32B


def test_a_variant_may_not_raise_ranks_or_split_a_job_without_deepspeed():
    with pytest.raises(ValueError, match="only lower the ranks"):
        Variant(ranks=16).apply(FAILING_32B)
    with pytest.raises(ValueError, match="only lower grad_accum"):
        Variant(grad_accum=64).apply(FAILING_32B)
    with pytest.raises(ValueError, match="exceeds"):
        Variant(layers=65).apply(FAILING_32B)


def test_the_label_says_how_it_was_measured():
    assert parse_variant("2r8L2ga").label(FAILING_32B) == "2 of 8 ranks, 8 of 64 layers, grad accum 2 of 16"
    assert Variant().label(FAILING_32B) == "full depth"


def test_the_plan_fits_the_host():
    assert plan(FAILING_32B, "tiny", 0) == [Variant()]
    assert [v.text for v in plan(FAILING_32B, "real", 2, grad_accum_cap=2)] == ["2r4L2ga", "2r8L2ga"]
    assert [v.text for v in plan(FAILING_32B, "real", 8, full_depth=True)] == [""]
    assert [v.text for v in plan(FIX_7B, "real", 1)] == [""]
    assert [v.text for v in plan(FIX_7B, "real", 1, grad_accum_cap=2)] == ["2ga"]


# --- depth extrapolation ------------------------------------------------------------------------


def test_a_line_through_two_depths_reads_off_the_full_depth():
    line = fit_line([(4, 10.0), (8, 14.0)])
    assert (line.intercept, line.slope) == (6.0, 1.0)
    assert line.at(64) == 70.0
    assert line.worst_residual == 0.0
    with pytest.raises(ValueError, match="two different layer counts"):
        fit_line([(4, 1.0), (4, 2.0)])


def _figures(peak_gib, step_s, outcome="ok", host_gib=None):
    return Figures(per_card_peak=int(peak_gib * GIB), allocated_peak=int(peak_gib * 0.9 * GIB), reserved_peak=None,
                   load_footprint=None, host_peak=None if host_gib is None else int(host_gib * GIB),
                   tokens_per_s_per_gpu=None, mfu=None, step_times_s=[9.0, step_s, step_s], outcome=outcome)


def test_figures_extrapolate_in_depth_and_are_checked_against_a_full_depth_run():
    e = extrapolate_figures(FAILING_32B, "2r2ga", "h200-x2", {4: [_figures(6.0, 1.0)], 8: [_figures(10.0, 1.5)]},
                            full_depth=_figures(66.0, 9.0))
    assert e.values["per_card_peak"] == pytest.approx(66.0 * GIB, rel=1e-6)
    assert e.step_time_s == pytest.approx(1.0 + 0.125 * 60)
    assert e.tokens_per_s == pytest.approx(1024 * 2 / e.step_time_s)  # seq 1024, batch 1, accum capped at 2
    assert e.error("per_card_peak") == pytest.approx(0.0, abs=1e-6)
    assert e.step_time_error() == pytest.approx((8.5 - 9.0) / 9.0)
    assert e.label == "extrapolated from 4, 8 layers to 64"


def test_a_figure_that_falls_with_depth_is_not_extrapolated():
    e = extrapolate_figures(FAILING_32B, "2r2ga", "k", {4: [_figures(6.0, 1.0, host_gib=20)],
                                                        8: [_figures(7.0, 1.2, host_gib=12)]})
    assert "host_peak" not in e.values and "per_card_peak" in e.values
    assert e.rejected and "host_peak falls with depth" in e.rejected[0]


def test_a_figure_flat_in_depth_within_the_noise_keeps_its_highest_point():
    # guide 002's per-card peak on 2 H200s: 22.39 GiB at 6 layers, 22.18 at 12 (embedding, logits, one layer)
    e = extrapolate_figures(FIX_32B, "2r2ga", "k", {6: [_figures(22.39, 1.0)], 12: [_figures(22.18, 1.2)]})
    assert e.values["per_card_peak"] == pytest.approx(22.39 * GIB, rel=1e-6)
    assert e.lines["per_card_peak"].flat and not e.rejected
    # a fall past the 2% noise floor is still refused
    e = extrapolate_figures(FIX_32B, "2r2ga", "k", {6: [_figures(22.39, 1.0)], 12: [_figures(21.5, 1.2)]})
    assert "per_card_peak" not in e.values and "per_card_peak falls with depth" in e.rejected[0]



def test_step_times_that_fall_with_depth_give_no_throughput():
    # guide 002 on 2 H200s: a CPU-Adam-bound step took 13.4 s at 6 layers and 11.6 s at 12
    e = extrapolate_figures(FIX_32B, "2r2ga", "k", {6: [_figures(22.39, 13.36)], 12: [_figures(22.18, 11.61)]})
    assert e.step_time_s is None and e.tokens_per_s is None
    assert any(r.startswith("step time falls with depth") for r in e.rejected)


def _rank_report(case_id, world, peak_gib, step_s):
    return RankReport(case_id=case_id, fidelity="real", rank=0, world_size=world, platform="cuda",
                      device_name="NVIDIA H200", step=Memory(allocated=int(peak_gib * GIB), device=int(peak_gib * GIB)),
                      step_times_s=[5.0, step_s, step_s], tokens_per_step=2048)


def test_blessed_variants_group_into_a_depth_fit(tmp_path):
    entries = []
    for variant, peak, step in (("2r4L2ga", 6.24, 0.8), ("2r8L2ga", 9.88, 1.7)):
        run = CaseRun(case_id=FAILING_32B.id, fidelity="real", variant=variant, command=[], returncode=0, wall_s=1,
                      ranks=[_rank_report(FAILING_32B.id, 2, peak, step)])
        entries.append({"case": run.case_id, "run": json.loads(run.model_dump_json())})
    (tmp_path / "runs.json").write_text(json.dumps(entries))
    paths = bless(tmp_path / "runs.json", root=tmp_path / "b", recorded="2026-11-26")
    assert sorted(p.name for p in paths) == [f"{FAILING_32B.id}@2r4L2ga.json", f"{FAILING_32B.id}@2r8L2ga.json"]
    baselines = load_baselines(tmp_path / "b")
    assert {b.measured for b in baselines} == {"2 of 8 ranks, 4 of 64 layers, grad accum 2 of 16",
                                               "2 of 8 ranks, 8 of 64 layers, grad accum 2 of 16"}
    (e,) = extrapolate(FAILING_32B, baselines)
    assert e.base_variant == "2r2ga" and e.from_layers == (4, 8)
    assert e.values["per_card_peak"] / GIB == pytest.approx(6.24 + (9.88 - 6.24) / 4 * 60, rel=1e-6)


def _bless_series(tmp_path, case, series):
    entries = []
    for variant, peak, step in series:
        run = CaseRun(case_id=case.id, fidelity="real", variant=variant, command=[], returncode=0, wall_s=1,
                      ranks=[_rank_report(case.id, 2, peak, step)])
        entries.append({"case": run.case_id, "run": json.loads(run.model_dump_json())})
    (tmp_path / f"{case.id}.json").write_text(json.dumps(entries))
    bless(tmp_path / f"{case.id}.json", root=tmp_path / "b", recorded="2026-11-26")


def test_a_full_depth_measurement_sets_the_margin_of_its_models_extrapolations(tmp_path):
    # the fit says 10.49 GiB at 64 layers, the full-depth run measured 11.29 (guide 000, 2 H200s)
    _bless_series(tmp_path, FIX_32B, [("2r4L2ga", 10.23, 1.4), ("2r8L2ga", 10.25, 2.3), ("2r2ga", 11.29, 15.0)])
    _bless_series(tmp_path, FAILING_32B, [("2r4L2ga", 11.37, 0.9), ("2r8L2ga", 15.08, 1.7)])
    baselines = load_baselines(tmp_path / "b")
    (check,) = depth_checks(baselines)  # only the case with a finished full-depth run is a check
    assert check.case_id == FIX_32B.id and check.extrapolated / GIB == pytest.approx(10.23 + 0.005 * 60, rel=1e-6)
    assert check.missed == pytest.approx(11.29 / 10.53 - 1, rel=1e-6)
    assert depth_check(FIX_32B.model, [check]) is check and depth_check("gemma-3-27b", [check]) is None
    # every fit of the same model carries it, the checked case's own included
    fits = {case.id: e for case, e in every_fit(baselines)}
    other, own = fits[FAILING_32B.id], fits[FIX_32B.id]
    assert (other.check == check
            and other.peak_with_margin() == pytest.approx(other.values["per_card_peak"] * (1 + check.missed)))
    assert own.check == check and own.error("per_card_peak") == pytest.approx(10.53 / 11.29 - 1, rel=1e-6)
    # an extrapolation that came out above the measurement adds nothing
    assert DepthCheck("c", "m", "k", extrapolated=12.0, measured=11.0).missed == 0.0


# --- what a variant's verdict says about the case as written ------------------------------------


def _run(err=None):
    return CaseRun(case_id="x", fidelity="real", command=[], returncode=0, wall_s=1.0, ranks=[], error=err)


OOM = ErrorInfo(kind=Failure.oom, message="CUDA out of memory. Tried to allocate 744.00 MiB.")


def test_a_fit_on_fewer_ranks_carries_over_and_an_oom_does_not():
    fewer = Variant(ranks=2)
    fits = judge_on_variant(FIX_32B, fewer, Verdict("outcome", "confirmed", "peak 10 GiB <= budget"), _run())
    assert fits.status == "confirmed" and "2 of 8 ranks" in fits.detail
    oom = judge_on_variant(FIX_32B, fewer, Verdict("outcome", "refuted", "out of memory"), _run(OOM))
    assert oom.status == "not_checkable"
    # the guide's failing config: an OOM on 2 ranks says nothing of 8, a fit on 2 ranks refutes it
    assert judge_on_variant(FAILING_32B, fewer, Verdict("outcome", "confirmed", "oom"),
                            _run(OOM)).status == "not_checkable"
    assert judge_on_variant(FAILING_32B, fewer, Verdict("outcome", "refuted", "fits"), _run()).status == "refuted"


def test_a_depth_series_is_judged_on_its_extrapolated_peak():
    deep = Variant(layers=8)
    e = extrapolate_figures(FIX_32B, "", "k", {4: [_figures(6.0, 1.0)], 8: [_figures(10.0, 1.5)]})  # 66 GiB
    v = judge_on_variant(FIX_32B, deep, Verdict("outcome", "not_checkable", ""), _run(), e)
    assert v.status == "refuted" and "66.00 GiB > budget 57.60 GiB" in v.detail and "extrapolated" in v.detail
    flat = extrapolate_figures(FIX_32B, "", "k", {4: [_figures(10.2, 1.0)], 8: [_figures(10.3, 1.5)]})
    assert judge_on_variant(FIX_32B, deep, Verdict("outcome", "not_checkable", ""), _run(), flat).status == "confirmed"
    # an OOM at a shallower depth is an OOM at full depth
    assert judge_on_variant(FAILING_32B, deep, Verdict("outcome", "confirmed", ""), _run(OOM)).status == "confirmed"
    assert judge_on_variant(FIX_32B, deep, Verdict("outcome", "refuted", ""), _run(OOM)).status == "refuted"


def test_a_fit_is_judged_with_the_full_depth_margin_and_an_oom_without_it():
    deep = Variant(layers=8)
    e = extrapolate_figures(FIX_32B, "", "k", {4: [_figures(5.0, 1.0)], 8: [_figures(8.5, 1.5)]})  # 57.50 GiB
    assert judge_on_variant(FIX_32B, deep, Verdict("outcome", "not_checkable", ""), _run(), e).status == "confirmed"
    e.check = DepthCheck(FIX_32B.id, FIX_32B.model, "h200-x2", extrapolated=10.0 * GIB, measured=10.5 * GIB)
    v = judge_on_variant(FIX_32B, deep, Verdict("outcome", "not_checkable", ""), _run(), e)
    assert v.status == "refuted" and "60.38 GiB > budget 57.60 GiB" in v.detail and "+5.0%" in v.detail
    # the guide's failing config is confirmed only where the plain extrapolation exceeds the budget
    v = judge_on_variant(FAILING_32B, deep, Verdict("outcome", "not_checkable", ""), _run(), e)
    assert v.status == "refuted" and "57.50 GiB <= budget 57.60 GiB" in v.detail


# --- against the baseline -----------------------------------------------------------------------


def test_tolerances_come_from_the_case_the_spread_or_the_floor():
    assert tolerance(0.1, (1.0, 0.5), 3, 0.05).value == 0.1
    assert tolerance(None, (1.0, 0.04), 3, 0.05).value == pytest.approx(0.12)
    floor = tolerance(None, (1.0, 0.0), 1, 0.05)
    assert floor.value == 0.05 and "one repetition" in floor.why


def _baseline(tmp_path, peaks_and_steps):
    entries = []
    for peak, step in peaks_and_steps:
        run = CaseRun(case_id=FIX_7B.id, fidelity="real", command=[], returncode=0, wall_s=1,
                      ranks=[_rank_report(FIX_7B.id, 1, peak, step)])
        entries.append({"case": run.case_id, "run": json.loads(run.model_dump_json())})
    (tmp_path / "r.json").write_text(json.dumps(entries))
    bless(tmp_path / "r.json", root=tmp_path / "b", recorded="2026-11-26")
    (b,) = load_baselines(tmp_path / "b")
    return b


def test_a_run_without_a_baseline_is_told_which_measurement_has_one(tmp_path):
    """Guide 002's plain-python launch was blessed as 6L2ga (pytest with --harness-grad-accum-cap 2)
    and the nightly job's single-rank step measures it as 6L: the verdict says how to match it."""
    base = _baseline(tmp_path, [(10.0, 1.0)])  # blessed as written
    key = base.platform.key
    why = no_baseline(FIX_7B.id, "8L", key, [base])
    assert why.startswith(f"no baseline for this case measured 8L on {key}; it has one measured as written:")
    (verdict,) = against_baseline(FIX_7B, _figures(10.0, 1.0), None, why)
    assert (verdict.status, verdict.detail) == ("not_checkable", why)
    assert no_baseline(FIX_7B.id, "", "amd-instinct-mi300x-x1", [base]) == (
        f"no baseline for this case on amd-instinct-mi300x-x1 (only on {key}): `oom-harness bless` this run's "
        "JSON once it is reviewed")
    assert "(only on" not in no_baseline("999-unknown", "", key, [base])


def test_a_run_is_held_to_its_baseline(tmp_path):
    base = _baseline(tmp_path, [(10.0, 1.0), (10.0, 1.1), (10.0, 1.0)])  # speed spread ~9%
    same = _figures(10.1, 1.05)
    same.tokens_per_s_per_gpu = 2048 / 1.05
    verdicts = {v.what: v for v in against_baseline(FIX_7B, same, base)}
    assert verdicts["baseline_memory"].status == "confirmed" and verdicts["baseline_speed"].status == "confirmed"
    worse = _figures(10.5, 2.0)  # +5% memory (floor 2%), half the speed (tolerance ~27%)
    worse.tokens_per_s_per_gpu = 2048 / 2.0
    verdicts = {v.what: v for v in against_baseline(FIX_7B, worse, base)}
    assert (verdicts["baseline_memory"].status == "refuted"
            and "10.50 GiB vs baseline 10.00 GiB" in verdicts["baseline_memory"].detail)
    speed = verdicts["baseline_speed"]
    assert speed.status == "refuted" and "3 repetition(s)" in speed.detail and "alpha 0.01" in speed.detail
    assert against_baseline(FIX_7B, same, None)[0].status == "not_checkable"


# --- the session wires it together ---------------------------------------------------------------


def _depth_run(case, variant, per_layer_gib, base_gib=4.0, oom=False):
    from harness.measure.records import Offload, Weights, Zero

    layers = variant.layers
    ranks = []
    for r in range(variant.ranks or 1):
        ranks.append(RankReport(
            case_id=case.id, fidelity="real", rank=r, world_size=variant.ranks, platform="cuda",
            device_name="NVIDIA H200", emulated_card_bytes=case.target.card.memory,
            step=Memory(allocated=int((base_gib + per_layer_gib * layers) * GIB),
                        device=int((base_gib + 1 + per_layer_gib * layers) * GIB)),
            weights=Weights(params_total=1000, params_trainable=10, param_bytes_local=1000),
            zero=Zero(stage=3, zero_init=True, local_param_numel=500, total_param_numel=1000,
                      materialised_param_bytes_before_engine=0),
            offload=Offload(optimizer_class="DeepSpeedCPUAdam", device_state_bytes=0, host_state_bytes=10),
            step_times_s=[5.0, 0.1 * layers, 0.1 * layers], tokens_per_step=2048, losses=[2.0, 1.9, 1.8]))
    return CaseRun(case_id=case.id, fidelity="real", variant=variant.text, command=[], returncode=0, wall_s=1.0,
                   ranks=ranks, error=OOM if oom else None)


def _session_with(monkeypatch, tmp_path, per_layer_gib, baseline_root=None):
    from harness.judge import session as session_mod
    from harness.runtime.platform import Platform

    monkeypatch.setattr(session_mod.plat, "detect", lambda: Platform.cuda)
    monkeypatch.setattr(session_mod.plat, "accelerator_count", lambda: 2)
    s = session_mod.Session(case_dir=CASES_DIR, run_root=tmp_path, grad_accum_cap=2,
                            baseline_root=baseline_root or tmp_path / "no-baselines")
    monkeypatch.setattr(s, "_execute", lambda cid, fid, v, rep: _depth_run(s.cases[cid][0], v, per_layer_gib))
    return s


def test_a_depth_series_on_fewer_ranks_is_judged_on_its_extrapolation(monkeypatch, tmp_path):
    flat = _session_with(monkeypatch, tmp_path, per_layer_gib=0.01)
    j = flat.judge(FIX_32B.id, "real")
    assert [r.variant for r in j.runs] == ["2r4L2ga", "2r8L2ga"]
    assert j.extrapolation is not None and j.extrapolation.from_layers == (4, 8)
    assert j.outcome.status == "confirmed" and "extrapolated from 4, 8 layers to 64, on 2 ranks" in j.outcome.detail
    # the comparison with the failing config is judged on its series, measured alike (here with the
    # same synthetic peaks, so not lower)
    lower = next(v for v in j.claims if v.what == "lower_peak_than")
    assert lower.status == "refuted" and "(2 of 8 ranks): at 4 layers" in lower.detail
    growing = _session_with(monkeypatch, tmp_path / "g", per_layer_gib=0.93)
    j = growing.judge(FIX_32B.id, "real")
    # 66 GiB extrapolated on 2 ranks: does not fit there, which says nothing of 8 ranks
    assert j.outcome.status == "not_checkable" and "> budget" in j.outcome.detail


def test_each_depth_of_a_series_is_held_to_its_own_baseline(monkeypatch, tmp_path):
    entries = [{"case": FIX_32B.id, "run": json.loads(_depth_run(FIX_32B, v, 0.01).model_dump_json())}
               for v in (Variant(ranks=2, layers=4, grad_accum=2), Variant(ranks=2, layers=8, grad_accum=2))]
    (tmp_path / "runs.json").write_text(json.dumps(entries))
    bless(tmp_path / "runs.json", root=tmp_path / "b", recorded="2026-11-26")
    # 0.03 GiB per layer instead of 0.01: +1.6% at 4 layers (within the 2% floor), +3.1% at 8
    j = _session_with(monkeypatch, tmp_path / "s", per_layer_gib=0.03,
                      baseline_root=tmp_path / "b").judge(FIX_32B.id, "real")
    memory = [v for v in j.against_baseline if v.what == "baseline_memory"]
    assert [v.status for v in memory] == ["confirmed", "refuted"]
    assert memory[1].detail.startswith("2 of 8 ranks, 8 of 64 layers, grad accum 2 of 16: per-card peak 5.24 GiB")
    assert j.failed
    unblessed = _session_with(monkeypatch, tmp_path / "u", per_layer_gib=0.03).judge(FIX_32B.id, "real")
    assert [v.status for v in unblessed.against_baseline] == ["not_checkable", "not_checkable"]


def test_the_summary_shows_the_peak_a_fit_was_judged_on():
    from harness.judge.session import Judgement
    from harness.report.summary import table

    e = extrapolate_figures(FIX_32B, "2r2ga", "k", {4: [_figures(5.0, 1.0)], 8: [_figures(8.5, 1.5)]})  # 57.50 GiB
    e.check = DepthCheck(FIX_32B.id, FIX_32B.model, "h200-x2", extrapolated=10.0 * GIB, measured=10.5 * GIB)
    run = CaseRun(case_id=FIX_32B.id, fidelity="real", variant="2r8L2ga", command=[], returncode=0, wall_s=1.0,
                  ranks=[_rank_report(FIX_32B.id, 2, 8.5, 1.5)])
    verdict = Verdict("outcome", "refuted", "")
    row = table([Judgement(FIX_32B, run, verdict, [], [run], e)]).splitlines()[2]
    assert "(extrapolated from 4,8L, +5.0% full-depth margin)" in row and "60.38 GiB" in row


def test_a_wide_spread_says_how_little_the_speed_test_can_catch(tmp_path):
    # two hosts: 2,048 and 1,024 tokens/s. A run at 890 tokens/s is within what such noise gives; the
    # verdict says which slowdown it would catch, rather than pass a floor of zero
    base = _baseline(tmp_path, [(10.0, 1.0), (10.0, 2.0)])
    slow = _figures(10.0, 2.3)
    slow.tokens_per_s_per_gpu = 2048 / 2.3
    speed = {v.what: v for v in against_baseline(FIX_7B, slow, base)}["baseline_speed"]
    assert speed.status == "confirmed"
    assert "detects a 100% slowdown 80% of the time; 2 repetition(s), run-to-run noise 49.0%" in speed.detail
    # the case's own tolerance keeps the floor, bounded by the slowest repetition
    assert limit([2048.0, 1024.0], None, 0.05, upper=False).value == pytest.approx(1024 * 0.95)
    assert limit([100.0, 101.0, 99.0], None, 0.05, upper=False).why.startswith("-5.0%: floor 5%")


def test_a_slow_run_names_its_cards_clock_and_a_host_cpu_other_than_the_baselines(tmp_path):
    """Peaks equal to the byte, speed a third lower (guide 003's r32 fixes on one H100 host): the
    verdict shows whether the card was held down or the host differs, beside the numbers."""
    from harness.measure.records import Clocks

    base = _baseline(tmp_path, [(10.0, 1.0), (10.0, 1.0)])
    for r in base.runs:
        r.clocks = Clocks(samples=300, utilization=0.91, sm_mhz_median=1980, sm_mhz_min=1755, sm_mhz_max=1980)
        r.host_cpu = "Intel(R) Xeon(R) Platinum 8480+"
    slow = _figures(10.0, 1.5)
    slow.tokens_per_s_per_gpu = 2048 / 1.5
    slow.clocks = Clocks(samples=2950, utilization=0.58, sm_mhz_median=1410, sm_mhz_min=1395, sm_mhz_max=1980,
                         slowed={"power cap": 0.64, "thermal (software)": 0.005})
    slow.host_cpu = "AMD EPYC 9454 48-Core Processor"
    speed = {v.what: v for v in against_baseline(FIX_7B, slow, base)}["baseline_speed"]
    assert speed.status == "refuted"
    assert speed.detail.endswith(
        "; SM clock 1,410 MHz while busy (median of 2,950 samples; the card's maximum 1,980), the baseline's "
        "1,980 MHz; held down by power cap in 64% of them; kernels running 58% of the time, the baseline's 91%; "
        "this host's CPU is AMD EPYC 9454 48-Core Processor, the baseline's Intel(R) Xeon(R) Platinum 8480+")
    # a record from before a slowdown needed a clock below the maximum: at 1,980 MHz throughout, nothing held it
    slow.clocks = Clocks(samples=999, sm_mhz_median=1980, sm_mhz_min=1980, sm_mhz_max=1980, slowed={"power cap": 0.14})
    assert "held down" not in {v.what: v for v in against_baseline(FIX_7B, slow, base)}["baseline_speed"].detail
    slow.clocks = slow.host_cpu = None  # runs from before either was recorded say nothing of them
    assert {v.what: v for v in against_baseline(FIX_7B, slow, base)}["baseline_speed"].detail.endswith("1 df)")


def test_speeds_are_compared_across_thread_counts_only_without_cpu_side_work(tmp_path):
    """Guide 003's fix has no offload: its step does not wait on the host's threads, so a host with
    another core count is still compared (and a 10% slowdown fails it). A CPU Adam step is not:
    without a repetition at the run's threads its speed is NOT CHECKED, never passed."""
    from harness.judge.regression import cpu_side_work

    steps = [1.0, 1.01, 0.99, 1.0, 1.005]  # repetitions 1% apart
    base = _baseline(tmp_path, [(10.0, s) for s in steps])
    for r in base.runs:
        r.cpu_threads = 8
    assert cpu_side_work(FIX_7B) is None
    clean = _figures(10.0, 1.0)
    clean.tokens_per_s_per_gpu, clean.cpu_threads = 2048 / 1.0, 16
    speed = {v.what: v for v in against_baseline(FIX_7B, clean, base)}["baseline_speed"]
    assert speed.status == "confirmed" and "compared across CPU threads (16 here, 8 in the baseline)" in speed.detail
    slowed = _figures(10.0, 1.0 / 0.9)
    slowed.tokens_per_s_per_gpu, slowed.cpu_threads = 2048 * 0.9, 16
    speed = {v.what: v for v in against_baseline(FIX_7B, slowed, base)}["baseline_speed"]
    assert speed.status == "refuted" and speed.detail.startswith("1,843 tokens/s per GPU vs baseline 2,046: -9.9%")
    # the same figures for a config whose optimizer steps on the CPU
    offload = FIX_7B.model_copy(update={"id": FIX_7B.id, "deepspeed": FIX_32B.deepspeed})
    assert cpu_side_work(offload) is not None
    verdicts = {v.what: v for v in against_baseline(offload, slowed, base)}
    assert verdicts["baseline_speed"].status == "not_checkable"
    assert verdicts["baseline_speed"].detail.startswith("NOT CHECKED: this run had 16 CPU threads per process, "
                                                        "the baseline 8")
    assert verdicts["baseline_memory"].status == "confirmed"  # memory does not depend on threads
    slowed.cpu_threads = 8
    assert {v.what: v for v in against_baseline(offload, slowed, base)}["baseline_speed"].status == "refuted"


def test_a_baseline_of_one_repetition_is_weak(tmp_path):
    base = _baseline(tmp_path, [(10.0, 1.0)])
    run = _figures(10.0, 1.0)
    run.tokens_per_s_per_gpu = 2048 * 0.97
    speed = {v.what: v for v in against_baseline(FIX_7B, run, base)}["baseline_speed"]
    assert speed.status == "confirmed" and "WEAK: no repetitions to estimate the noise from" in speed.detail
    (tmp_path / "o").mkdir()
    other = _baseline(tmp_path / "o", [(10.0, 1.0), (10.0, 1.02), (10.0, 0.98)])  # a pool of three, 2% apart
    speed = {v.what: v for v in against_baseline(FIX_7B, run, base, pool=[other])}["baseline_speed"]
    assert "WEAK: the baseline has one repetition" in speed.detail
    assert "noise 2.0% pooled over 1 baseline(s), 2 df" in speed.detail


def test_an_uncapped_variant_runs_on_the_whole_card(monkeypatch, tmp_path):
    from harness.judge import session as session_mod
    from harness.runtime.platform import Platform

    rung1 = "001-ladder-rung1-zero2"
    seen = []

    def fake_run_case(case, path, fidelity, out, platform, timeout, steps, emulate, variant):
        seen.append((emulate, variant.text))
        out.mkdir(parents=True)
        return CaseRun(case_id=case.id, fidelity=fidelity, variant=variant.text, command=[], returncode=0, wall_s=0.0)

    monkeypatch.setattr(session_mod, "run_case", fake_run_case)
    monkeypatch.setattr(session_mod.plat, "detect", lambda: Platform.cuda)
    monkeypatch.setattr(session_mod.plat, "accelerator_count", lambda: 1)
    s = session_mod.Session(case_dir=CASES_DIR, run_root=tmp_path, baseline_root=tmp_path / "none")
    s.run(rung1, "real", Variant(uncapped=True))
    s.run(rung1, "real")
    card = s.cases[rung1][0].target.card.memory
    assert seen == [(None, "u"), (card, "")]
    assert (tmp_path / "real" / f"{rung1}@u" / "run.json").is_file()
    assert parse_variant("2r8Lu") == Variant(ranks=2, layers=8, uncapped=True)
    assert Variant(uncapped=True).apply(s.cases[rung1][0]) is s.cases[rung1][0]  # the case itself is unchanged
    assert Variant(uncapped=True).label(s.cases[rung1][0]) == "full depth, on the whole card, not its target's"


# --- claims comparing two configs, both measured on variants -----------------------------------

MEASURED_002 = CASES_DIR.parent / "results" / "runs" / "2026-11-26-h100x2-002-pytest-gpu.json"
MEASURED_000 = CASES_DIR.parent / "results" / "runs" / "2026-11-26-h100x2-000-pytest-gpu.json"


def _judged_on(tmp_path, monkeypatch, measured, case_id):
    """A session on two H100s (accumulation capped at 2) that judges the runs measured there."""
    from harness.judge.session import Session
    from harness.runtime import platform as plat

    entries = json.loads(measured.read_text())
    runs = {(e["case"], e["run"]["variant"]): CaseRun.model_validate(e["run"]) for e in entries}
    monkeypatch.setattr(Session, "_execute", lambda self, cid, fid, v, rep: runs[(cid, v.text)])
    session = Session(case_dir=CASES_DIR, run_root=tmp_path, grad_accum_cap=2)
    session.platform, session.accelerators = plat.Platform.cuda, 2
    return {v.what: v for v in session.judge(case_id, "real").claims}


def test_a_lower_peak_is_judged_at_every_depth_and_at_the_full_depth_of_two_alike_series(tmp_path, monkeypatch):
    """Guide 002's 'lower max_length from 4096 to 2048': both configs measured at 6 and 12 of 62 layers
    on 2 of 4 ranks; they shard alike, so the comparison carries to 4 ranks."""
    lower = _judged_on(tmp_path, monkeypatch, MEASURED_002, "002-gemma27b-full-z3-offload-len2048")["lower_peak_than"]
    assert lower.status == "confirmed"
    assert lower.detail == ("per-card peak vs 002-gemma27b-full-z3-offload-len4096 (2 of 4 ranks): at 6 layers "
                            "21.78 GiB vs 28.50 GiB; at 12 layers 21.68 GiB vs 28.83 GiB; extrapolated to the full "
                            "depth 21.78 GiB vs 31.60 GiB")


def test_the_full_depth_decides_and_a_higher_peak_refutes():
    from harness.judge.verdicts import Series, lower_peak_on_variants

    case, other = load_case(CASES_DIR / "002-gemma27b-full-z3-offload-len2048.yaml"), load_case(
        CASES_DIR / "002-gemma27b-full-z3-offload-len4096.yaml")
    variants = [Variant(ranks=2, layers=6, grad_accum=2), Variant(ranks=2, layers=12, grad_accum=2)]

    def series(peaks, full):
        runs = [CaseRun(case_id=case.id, fidelity="real", command=[], returncode=0, wall_s=1,
                        ranks=[_rank_report(case.id, 2, p, 1.0)]) for p in peaks]
        return Series(variants, runs, extrapolate_figures(case, "2r2ga", "k", {
            6: [_figures(peaks[0], 1.0)], 12: [_figures(full, 1.0)]}) if full else None)

    claim = next(c for c in case.claims if c.kind == "lower_peak_than")
    # lower at both depths, but the lines cross before the full depth: the case as written decides
    crossing = lower_peak_on_variants(claim, case, series([20.0, 22.0], 22.0), other, series([21.0, 22.5], 22.5))
    assert crossing.status == "refuted" and "extrapolated to the full depth" in crossing.detail
    # no depth fit on one side: every measured depth decides
    higher = lower_peak_on_variants(claim, case, series([22.0, 22.0], None), other, series([21.0, 21.0], None))
    assert higher.status == "refuted" and higher.detail.endswith("at 12 layers 22.00 GiB vs 21.00 GiB")


def test_configs_that_shard_differently_are_not_compared_on_fewer_ranks(tmp_path, monkeypatch):
    """Guide 000's 4-bit ZeRO-2 fix against the bf16 ZeRO-3 failing config: on 2 of 8 ranks ZeRO-3's
    shards are 4 times what they are on 8, ZeRO-2's weights are not sharded at all."""
    lower = _judged_on(tmp_path, monkeypatch, MEASURED_000, "000-qlora4bit-z2-cutoff512")["lower_peak_than"]
    assert lower.status == "not_checkable"
    assert "shards other states (model, method, ZeRO stage or offload differ)" in lower.detail
    alike = _judged_on(tmp_path / "b", monkeypatch, MEASURED_000,
                       "000-lora-z3-offload-cutoff1024-ga16-nonreentrant")["lower_peak_than"]
    assert alike.status == "confirmed"
    assert alike.detail.endswith("extrapolated to the full depth 10.50 GiB vs 67.07 GiB")
