"""Full-size runs judge the node's host RAM against the case's `target.host_ram` (harness.judge.host_ram)."""

import json

from harness.baselines.store import Figures, bless, load_baselines
from harness.judge.extrapolation import extrapolate_figures
from harness.judge.host_ram import HOST_RAM_FRACTION, check_host_ram
from harness.measure.records import CaseRun, ErrorInfo, Failure, Memory, RankReport
from harness.report.markdown import report_markdown
from harness.spec.cases import CASES_DIR, load_case
from harness.spec.schema import Case
from harness.spec.units import GIB
from harness.spec.variants import Variant

PLAN_B = load_case(CASES_DIR / "004-gla-plan-b-bs2.yaml")  # 7 cards x 2 jobs on a 251 GiB host, expect fits
FAILING_GLA = load_case(CASES_DIR / "004-gla-failing-bs4-2procs.yaml")  # expect oom
FIX_7B = load_case(CASES_DIR / "003-qlora-fix-r32-seq1024-gc.yaml")  # no host_ram stated


def _with_host_ram(base: Case, host_ram: str) -> Case:
    """A case as written with its host's RAM stated (claims dropped: they hold byte counts now)."""
    data = base.model_dump(mode="json")
    data["target"]["card"]["memory"] = f"{base.target.card.memory} B"
    data["target"]["host_ram"] = host_ram
    data["claims"] = []
    return Case.model_validate(data)


FIX_32B = _with_host_ram(load_case(CASES_DIR / "000-lora-z3-offload-cutoff1024-ga16-nonreentrant.yaml"), "256 GiB")


def _run(case: Case, host_gib: list[float | None], variant: str = "", fidelity: str = "real", error=None) -> CaseRun:
    """One report per process (a rank, or a job sharing the card), each with its host RSS."""
    sharing = case.launch.procs_per_card > 1
    ranks = [RankReport(case_id=case.id, fidelity=fidelity, rank=0 if sharing else i, process_slot=i if sharing else 0,
                        world_size=1 if sharing else len(host_gib), platform="cuda", device_name="test card",
                        step=Memory(allocated=GIB, device=2 * GIB, host_rss=None if h is None else int(h * GIB)),
                        step_times_s=[2.0, 1.0, 1.0], tokens_per_step=1024, losses=[2.0, 1.5, 1.0])
             for i, h in enumerate(host_gib)]
    return CaseRun(case_id=case.id, fidelity=fidelity, variant=variant, command=[], returncode=0, wall_s=1.0,
                   ranks=ranks, error=error)


def _host_figures(host_gib: float) -> Figures:
    return Figures(per_card_peak=int(10 * GIB), allocated_peak=int(5 * GIB), reserved_peak=None, load_footprint=None,
                   host_peak=int(host_gib * GIB), tokens_per_s_per_gpu=None, mfu=None, step_times_s=[], outcome="ok")


def test_the_node_counts_every_card_and_every_job_on_it():
    assert PLAN_B.procs_per_node == 14  # the guide's "总计14个并行训练任务"
    assert load_case(CASES_DIR / "004-gla-plan-c-1proc.yaml").procs_per_node == 7
    assert FIX_32B.procs_per_node == 8
    assert PLAN_B.target.host_ram == 251 * GIB


def test_a_node_within_its_host_passes_with_the_figures():
    v = check_host_ram(PLAN_B, Variant(), _run(PLAN_B, [3.0, 5.0]))  # the worst job: 5 GiB
    assert v.what == "host_ram" and v.status == "confirmed"
    assert "14 processes x 5.00 GiB (measured" in v.detail
    assert "= 70.00 GiB on the node <= 200.80 GiB usable" in v.detail
    assert f"({HOST_RAM_FRACTION:.0%} of the host's 251.00 GiB)" in v.detail


def test_a_node_over_its_host_fails_with_what_to_change():
    v = check_host_ram(PLAN_B, Variant(), _run(PLAN_B, [15.0, 14.0]))
    assert v.status == "refuted" and v.failed
    assert "14 processes x 15.00 GiB" in v.detail and "210.00 GiB on the node > 200.80 GiB usable" in v.detail
    assert "train.dataloader_workers: 2" in v.detail and "launch.procs_per_card: 2" in v.detail
    assert "train.pin_memory: false" in v.detail and "target.host_ram" in v.detail


def test_fewer_ranks_carry_a_fit_over_but_leave_an_excess_inconclusive():
    fewer = Variant(ranks=2, grad_accum=2)
    under = check_host_ram(FIX_32B, fewer, _run(FIX_32B, [20.0, 20.0], "2r2ga"))  # 8 x 20 = 160 GiB of 204.8
    assert under.status == "confirmed" and "bounds the 8-rank figure from above" in under.detail
    over = check_host_ram(FIX_32B, fewer, _run(FIX_32B, [58.0, 58.2], "2r2ga"))  # 8 x 58.2 GiB: 465.6 GiB
    assert over.status == "not_checkable" and not over.failed
    assert "over the host on 2 ranks, which says nothing of 8" in over.detail and "465.60 GiB" in over.detail
    # the same figure on the case's own ranks is an excess
    assert check_host_ram(FIX_32B, Variant(grad_accum=2), _run(FIX_32B, [58.2] * 8, "2ga")).status == "refuted"


def test_a_depth_series_is_judged_on_its_extrapolated_host_figure():
    e = extrapolate_figures(FIX_32B, "", "k", {4: [_host_figures(6.0)], 8: [_host_figures(7.0)]})  # 21 GiB at 64L
    deep = Variant(layers=8)
    ok = check_host_ram(FIX_32B, deep, _run(FIX_32B, [7.0] * 8, "8L"), e)
    assert ok.status == "confirmed" and "8 processes x 21.00 GiB (extrapolated from 4, 8 layers to 64" in ok.detail
    steep = extrapolate_figures(FIX_32B, "", "k", {4: [_host_figures(8.0)], 8: [_host_figures(10.0)]})  # 38 GiB
    v = check_host_ram(FIX_32B, deep, _run(FIX_32B, [10.0] * 8, "8L"), steep)
    assert v.status == "refuted" and "304.00 GiB on the node > 204.80 GiB" in v.detail and "extrapolated" in v.detail
    # a shallower depth without a fit says nothing of the full depth
    none = check_host_ram(FIX_32B, deep, _run(FIX_32B, [10.0] * 8, "8L"))
    assert none.status == "not_checkable" and "8 of 64 layers only" in none.detail


def test_no_host_ram_no_verdict_and_no_figure_not_checkable():
    assert check_host_ram(FIX_7B, Variant(), _run(FIX_7B, [500.0])) is None
    missing = check_host_ram(PLAN_B, Variant(), _run(PLAN_B, [None, None]))
    assert missing.status == "not_checkable" and "no host memory was measured" in missing.detail
    # tiny figures are scaled; the guide's failing config is judged on its card only
    assert check_host_ram(PLAN_B, Variant(), _run(PLAN_B, [500.0, 500.0], fidelity="tiny")) is None
    assert check_host_ram(FAILING_GLA, Variant(), _run(FAILING_GLA, [500.0, 500.0])) is None
    crash = ErrorInfo(kind=Failure.host_oom, message="Killed", phase="step")
    assert check_host_ram(PLAN_B, Variant(), _run(PLAN_B, [500.0, 500.0], error=crash)).status == "not_checkable"


def test_the_session_fails_the_case_and_the_table_shows_the_node(monkeypatch, tmp_path):
    from harness.judge import session as session_mod
    from harness.report.summary import table
    from harness.runtime.platform import Platform

    monkeypatch.setattr(session_mod.plat, "detect", lambda: Platform.cuda)
    monkeypatch.setattr(session_mod.plat, "accelerator_count", lambda: 1)
    s = session_mod.Session(case_dir=CASES_DIR, run_root=tmp_path)
    monkeypatch.setattr(s, "_execute", lambda cid, fid, v, rep: _run(s.cases[cid][0], [15.0, 15.0]))
    j = s.judge(PLAN_B.id, "real")
    assert j.host_ram is not None and j.host_ram in j.failed and j.host_ram in j.verdicts
    assert "210/201 GiB FAILED" in table([j]).splitlines()[2]


def test_the_report_shows_the_node_host_ram(tmp_path):
    run = _run(PLAN_B, [3.0, 3.5])
    (tmp_path / "runs.json").write_text(json.dumps([{"case": PLAN_B.id, "run": json.loads(run.model_dump_json())}]))
    bless(tmp_path / "runs.json", root=tmp_path / "b")
    rows = report_markdown(load_baselines(tmp_path / "b")).splitlines()
    row = next(ln for ln in rows if ln.startswith(f"| {PLAN_B.id}"))
    assert "14 x 3.50 GiB = 49.00 GiB of 200.80 GiB usable" in row
