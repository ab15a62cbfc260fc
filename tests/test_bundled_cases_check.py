"""`oom-harness check` accepts every bundled case file: a case read back from its own JSON dump (as the
case-file importer and variants do) validates again, sizes with their units included."""

from __future__ import annotations

import pytest
from fixed_prediction import fixed_prediction

from harness.cli.main import main
from harness.premerge import check
from harness.spec.cases import CASES_DIR, case_files, load_case
from harness.spec.schema import Case
from harness.spec.units import GIB

BUNDLED = case_files(CASES_DIR)


def test_the_bundled_suite_has_size_ranges_to_read_back():
    # the cases whose memory_range / checkpointing_saving sizes were once dumped as bare bytes
    ids = {p.stem for p in BUNDLED}
    assert {"003-qlora-fix-r16-seq512-gc", "003-qlora-fix-r32-seq1024-gc", "004-gla-plan-a-minimal"} <= ids


@pytest.mark.parametrize("path", BUNDLED, ids=lambda p: p.stem)
def test_a_case_validates_again_from_its_own_json_dump(path):
    case = load_case(path)
    again = Case.model_validate(case.model_dump(mode="json"))
    assert again == case


def test_a_size_range_is_dumped_with_its_unit_and_a_fraction_without():
    case = load_case(CASES_DIR / "003-qlora-fix-r32-seq1024-gc.yaml")
    dumped = [c for c in case.model_dump(mode="json")["claims"] if c["kind"] == "memory_range"]
    assert dumped[0]["low"] == f"{10 * GIB} B" and dumped[0]["high"] == f"{12 * GIB} B"
    fractions = [c for c in load_case(CASES_DIR / "000-lora-z3-offload-cutoff1024-ga16.yaml").model_dump(mode="json")
                 ["claims"] if c.get("metric") == "usage_fraction"]
    assert fractions and all(isinstance(c["low"], float) for c in fractions)


@pytest.mark.parametrize("path", BUNDLED, ids=lambda p: p.stem)
def test_check_accepts_every_bundled_case_file(path, monkeypatch, capsys):
    from harness.models.registry import missing_package
    from harness.models.source import load_model
    from harness.spec.cases import load_case

    missing = missing_package(load_model(load_case(path).model).config)
    if missing is not None:  # GLA (guide 004) in an environment without the gla extra: refused, and says why
        pytest.skip(missing)
    predicted = fixed_prediction(3 * GIB, 4 * GIB, 5 * GIB, 20 * GIB, notes=("fake prediction",))
    monkeypatch.setattr(check, "_predictor", lambda: lambda *args, **kwargs: predicted)
    code = main(["check", str(path)])
    out, err = capsys.readouterr()
    assert code in (0, 1), err
    assert "verdict:" in out
