"""`report --html` of the bundled suite with an empty trace cache took about two minutes: it predicted
each of the suite's 56 measured configs again, which the predictor's error table holds already
(leave-one-out, per card, computed from the same baselines, cases and predictor code)."""

from __future__ import annotations

import pytest

from harness.baselines.store import RESULTS_DIR
from harness.predict import margin
from harness.predict.margin import ERRORS_FILE, ErrorTable
from harness.report.html import inputs
from harness.spec.suite import CASES_DIR


@pytest.fixture
def current_table(monkeypatch):
    """The error table as current (the working tree's predictor may have changed since it was written)."""
    table = ErrorTable.read(ERRORS_FILE)
    monkeypatch.setattr(margin, "inputs_digest", lambda root=None: table.digest)
    margin._table.cache_clear()
    yield table
    margin._table.cache_clear()


def test_the_bundled_suites_predictions_come_from_the_current_error_table(current_table, monkeypatch):
    def no_prediction(*args):
        raise AssertionError("predicted again a config the error table holds")

    records = {(r.case_id, r.variant, r.platform): r.predicted for r in current_table.records}
    read = inputs.read_inputs(RESULTS_DIR, CASES_DIR, [], [], predict=False)
    monkeypatch.setattr(inputs, "_predicted", no_prediction)
    stored = inputs.stored_predictions(RESULTS_DIR, CASES_DIR)
    held = [e for e in read.entries if (e.case.id, e.baseline.variant, e.baseline.platform.key) in records]
    assert len(held) >= 40  # most of the suite's baselines
    for e in held:
        inputs.predict_entry(e, stored)
        assert e.predicted_per_card == pytest.approx(records[(e.case.id, e.baseline.variant, e.baseline.platform.key)])


def test_a_stale_table_or_another_suite_is_predicted_as_before(current_table, tmp_path, monkeypatch):
    assert inputs.stored_predictions(tmp_path, CASES_DIR) == {}  # a team's own baselines
    monkeypatch.setattr(margin, "inputs_digest", lambda root=None: "changed since")
    margin._table.cache_clear()
    assert inputs.stored_predictions(RESULTS_DIR, CASES_DIR) == {}
