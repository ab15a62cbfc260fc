"""What a session ran beyond the selected cases' own runs, and that its summary says so."""

import json

from harness.baselines.store import RESULTS_DIR
from harness.judge.session import Session
from harness.measure.records import CaseRun
from harness.report.summary import consulted_line, whole_card_line
from harness.runtime import platform as plat
from harness.spec.cases import CASES_DIR

# guide 001's four rungs on one H100, each on its tier's card and on the whole card (`@u`)
MEASURED = RESULTS_DIR.parent / "runs" / "2026-11-26-h100-001-003-004-pytest-gpu-one-host.json"


def test_a_rungs_own_whole_card_run_is_named_apart_from_the_other_rungs_it_consulted(tmp_path, monkeypatch):
    """Rung 4 runs out of memory on its 4 GiB card, so its speed and memory order are judged on the
    whole card: its own `@u` run (2 minutes on an H100) is made whatever is selected, the other
    rungs' `@u` runs only because it consults them (--selected-only leaves those out)."""
    entries = json.loads(MEASURED.read_text())
    runs = {(e["case"], e["run"]["variant"]): CaseRun.model_validate(e["run"]) for e in entries}
    monkeypatch.setattr(Session, "_execute", lambda self, cid, fid, variant, rep: runs[(cid, variant.text)])
    session = Session(case_dir=CASES_DIR, run_root=tmp_path)
    session.platform, session.accelerators = plat.Platform.cuda, 1
    rung4 = "001-ladder-rung4-zero3-offload"
    session.judge(rung4, "real")
    assert session.whole_card() == [(rung4, "real", "u")]
    others = [f"001-ladder-rung{n}-{name}" for n, name in ((1, "zero2"), (2, "zero2-offload"), (3, "zero3"))]
    assert session.consulted() == [(cid, "real", "u") for cid in others]
    assert whole_card_line(session.whole_card()).endswith(f"on their own cards: {rung4}@u [real]")
    assert rung4 not in consulted_line(session.consulted(), "--selected-only")
