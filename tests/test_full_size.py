"""The full-size table under a tiny run (harness.report.full_size): each case's prediction against its
card, and its newest measurement, as written before a variant, never a whole-card run."""

from __future__ import annotations

from types import SimpleNamespace

from harness.baselines.store import Baseline, Figures, PlatformInfo
from harness.report.full_size import full_size, last_measured, table
from harness.spec.cases import CASES_DIR, load_case

GIB = 2**30


def _baseline(case_id: str, variant: str, recorded: str, *peaks_and_days) -> Baseline:
    runs = [Figures(per_card_peak=int(p * GIB), allocated_peak=None, reserved_peak=None, load_footprint=None,
                    tokens_per_s_per_gpu=None, mfu=None, step_times_s=[], outcome="ok" if p < 15 else "oom",
                    recorded=day) for p, day in peaks_and_days]
    return Baseline(case_id=case_id, variant=variant, platform=PlatformInfo(device_name="NVIDIA H100", device_count=1),
                    emulated_card_bytes=None, measured="full depth", steps=3, runs=runs, recorded=recorded)


def test_the_newest_repetition_of_the_case_as_written_is_its_last_measurement():
    baselines = [
        _baseline("x", "", "2026-01-01", (10.0, None), (11.0, "2026-03-01")),
        _baseline("x", "4L", "2026-06-01", (3.0, None)),  # a variant: only where nothing as written
        _baseline("x", "u", "2026-07-01", (40.0, None)),  # a whole-card run: never against the card
        _baseline("y", "", "2026-09-01", (1.0, None)),
    ]
    m = last_measured("x", baselines)
    assert m.figures.per_card_peak == 11 * GIB and m.day == "2026-03-01"
    assert "11.00 GiB fits" in m.cell() and "variant" not in m.cell()


def test_a_case_measured_only_as_a_variant_names_the_variant_and_a_whole_card_run_is_never_taken():
    only_variant = [_baseline("x", "2r8L", "2026-01-01", (20.0, None)), _baseline("x", "u", "2026-02-01", (9.0, None))]
    assert "variant 2r8L" in last_measured("x", only_variant).cell()
    assert last_measured("x", [_baseline("x", "u", "2026-02-01", (9.0, None))]) is None


def test_the_prediction_is_per_card_and_judged_against_the_budget():
    shared = load_case(CASES_DIR / "004-gla-plan-b-bs2.yaml")  # two jobs share each card
    alone = load_case(CASES_DIR / "003-qlora-fix-r16-seq512-gc.yaml")
    predict = {shared.id: 6 * GIB, alone.id: 20 * GIB}
    rows = full_size([shared, alone], [], predict=lambda case: SimpleNamespace(device=predict[case.id]))
    assert rows[0].predicted == 12 * GIB  # per process times the jobs on the card
    text = table(rows)
    assert "12.00 GiB fits" in text.splitlines()[2]
    assert "20.00 GiB oom" in text.splitlines()[3]  # over the 16 GB card's budget


def test_a_case_the_predictor_cannot_model_keeps_its_row_and_says_why():
    case = load_case(CASES_DIR / "003-qlora-fix-r16-seq512-gc.yaml")

    def predict(_case):
        raise NotImplementedError("no trace for this architecture")

    rows = full_size([case], [_baseline(case.id, "", "2026-01-01", (11.0, None))], predict=predict)
    assert rows[0].predicted is None
    row = table(rows).splitlines()[2]
    assert "NotImplementedError: no trace for this architecture" in row and "11.00 GiB fits" in row
