"""Baselines that cannot be corrupted: `bless` refuses runs that escape their folder, runs relabelled as
another case, impossible figures and an existing baseline without --replace; `report` writes nothing;
a corrupt baseline is named and skipped."""

from __future__ import annotations

import errno
import json
import math
import os
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from harness.baselines.store import Baseline, BlessError, bless, load_baselines, read_baselines
from harness.cli.main import main
from harness.measure.records import CaseRun, Memory, RankReport
from harness.spec import files
from harness.spec.cases import CASES_DIR, load_case
from harness.spec.identity import case_digest, model_name
from harness.spec.schema import Case
from harness.spec.units import GIB

CASE = "003-qlora-fix-r32-seq1024-gc"  # seq 1024, micro batch 1, a 15.77 GiB nvidia card
OTHER = "003-qlora-fix-r16-seq512-gc"  # the same model, seq 512


def _entry(case_id: str = CASE, peak_gib: float = 10.5, digest: str | None = "of-case", **rank_fields) -> dict:
    case = load_case(CASES_DIR / f"{CASE}.yaml")
    fields = dict(case_id=CASE, fidelity="real", rank=0, world_size=1, platform="cuda",
                  device_name="NVIDIA H100 80GB HBM3", emulated_card_bytes=case.target.card.memory,
                  step=Memory(allocated=int(9 * GIB), reserved=int(9.5 * GIB), device=int(peak_gib * GIB)),
                  step_times_s=[9.0, 7.0, 7.0], tokens_per_step=16384, seq_len=1024, micro_batch=1,
                  versions={"torch": "2.11.0"})
    rank = RankReport(**{**fields, **rank_fields})
    run = CaseRun(case_id=CASE, fidelity="real", command=[], returncode=0, wall_s=40.0, ranks=[rank],
                  case_digest=case_digest(case) if digest == "of-case" else digest,
                  model=model_name(case) if digest == "of-case" else None)
    data = json.loads(run.model_dump_json())
    data["case_id"] = case_id  # what an edited record says
    return {"case": case_id, "fidelity": "real", "run": data, "verdicts": []}


def _write(tmp_path: Path, *entries: dict, name: str = "runs.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(list(entries)))
    return path


def _files(*roots: Path) -> set[Path]:
    return {p for root in roots for p in root.rglob("*")}


# --- names and folders --------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["case_id", "variant", "rank_case_id"])
def test_a_record_naming_a_path_outside_the_folder_is_refused_and_nothing_is_written(tmp_path, where, capsys):
    entry = _entry()
    if where == "case_id":
        entry["run"]["case_id"] = "../../escaped"
    elif where == "variant":
        entry["run"]["variant"] = "../../escaped"
    else:
        entry["run"]["ranks"][0]["case_id"] = "../../escaped"
    runs = _write(tmp_path, entry)
    before = _files(tmp_path)
    with pytest.raises(BlessError, match=r"runs\.json: entry 0 is not a run .*is not a safe file name"):
        bless(runs, root=tmp_path / "baselines")
    assert main(["bless", str(runs), "--baselines-dir", str(tmp_path / "baselines")]) == 2
    assert main(["report", str(runs)]) == 2
    assert "not a safe file name" in capsys.readouterr().err
    assert _files(tmp_path) == before
    assert not (tmp_path.parent / "escaped.json").exists()


def test_a_baseline_naming_a_path_outside_its_folder_is_not_a_baseline():
    with pytest.raises(ValidationError, match="not a safe file name"):
        Baseline.model_validate({"case_id": "../x", "platform": {"device_name": "H100", "device_count": 1},
                                 "emulated_card_bytes": None, "measured": "", "steps": 1, "runs": [],
                                 "recorded": "2026-11-26"})


# --- a run relabelled as another case -----------------------------------------------------------


def test_runs_record_what_identifies_their_case():
    a, b = (load_case(CASES_DIR / f"{c}.yaml") for c in (CASE, OTHER))
    assert case_digest(a) != case_digest(b)
    assert case_digest(Case.model_validate(a.model_dump(mode="json"))) == case_digest(a)
    # a reworded claim or note does not change what was measured
    assert case_digest(a.model_copy(update={"notes": "reworded", "claims": []})) == case_digest(a)
    assert model_name(a) == "qwen1.5-7b-chat"


def test_a_run_relabelled_as_another_case_is_refused(tmp_path):
    entry = _entry(OTHER)
    for rank in entry["run"]["ranks"]:
        rank["case_id"], rank["seq_len"] = OTHER, 512  # the relabelling made thorough
    with pytest.raises(BlessError, match=rf"runs\.json entry 0: run of '{OTHER}' refused: it measured another config"):
        bless(_write(tmp_path, entry), root=tmp_path / "baselines")
    assert not (tmp_path / "baselines").exists()


def test_a_record_from_before_the_digest_is_still_read_and_checked_by_its_shape(tmp_path):
    old = _entry(digest=None)
    del old["run"]["case_digest"], old["run"]["model"]  # as older runs were written
    (path,) = bless(_write(tmp_path, old), root=tmp_path / "baselines")
    assert path.name == f"{CASE}.json"
    relabelled = _entry(OTHER, digest=None)  # the ranks still say what they ran
    with pytest.raises(BlessError, match=rf"rank 0 reports case '{CASE}' at real size, the run '{OTHER}'"):
        bless(_write(tmp_path, relabelled), root=tmp_path / "b2")
    for rank in relabelled["run"]["ranks"]:
        rank["case_id"] = OTHER
    with pytest.raises(BlessError, match=r"ran seq_len 1024, micro_batch 1; .* says 512 and 1"):
        bless(_write(tmp_path, relabelled), root=tmp_path / "b2")


def test_a_run_of_another_model_is_refused(tmp_path):
    entry = _entry()
    entry["run"]["case_digest"], entry["run"]["model"] = None, "llama-3.1-8b"
    with pytest.raises(BlessError, match=r"it measured model 'llama-3.1-8b', .* names 'qwen1.5-7b-chat'"):
        bless(_write(tmp_path, entry), root=tmp_path / "baselines")


def test_a_run_on_an_emulated_card_of_another_size_is_refused(tmp_path):
    entry = _entry(emulated_card_bytes=24 * GIB)
    with pytest.raises(BlessError, match=r"emulated a card of 25769803776 bytes"):
        bless(_write(tmp_path, entry), root=tmp_path / "baselines")


# --- impossible figures -------------------------------------------------------------------------


def _edited(path: str, value) -> dict:
    entry = _entry()
    target = entry["run"]["ranks"][0]
    *parents, key = path.split(".")
    for p in parents:
        target = target[p]
    target[key] = value
    return entry


@pytest.mark.parametrize(("path", "value", "message"), [
    ("step.device", -1, r"step\.device: Input should be greater than or equal to 0"),
    ("step.allocated", -5 * GIB, r"step\.allocated: Input should be greater than or equal to 0"),
    ("step_times_s", [9.0, -7.0, 7.0], r"step_times_s.*not a duration"),
    ("step_times_s", [9.0, math.nan, 7.0], r"step_times_s\[1\]: NaN is not a finite number"),
    ("tokens_per_step", -16384, r"tokens_per_step: Input should be greater than or equal to 0"),
])
def test_a_negative_or_not_a_number_figure_is_refused_naming_it(tmp_path, path, value, message):
    runs = _write(tmp_path, _edited(path, value))
    with pytest.raises(BlessError, match=message):
        bless(runs, root=tmp_path / "baselines")
    assert not (tmp_path / "baselines").exists()


@pytest.mark.parametrize(("path", "value", "message"), [
    ("step.device", int(20 * GIB), r"the run fit but its per_card_peak 21474836480 bytes is above its card's"),
    ("step.device", 2**50, r"per_card_peak 1125899906842624 bytes is more than any card holds"),
    ("step_times_s", [9.0, 0.0, 0.0], r"step_times_s.*not a duration"),
    ("tokens_per_step", 0, r"its step times give no tokens/s"),
])
def test_a_figure_no_run_can_measure_is_refused(tmp_path, path, value, message):
    runs = _write(tmp_path, _entry(), _edited(path, value))  # one bad repetition refuses the lot
    with pytest.raises(BlessError, match=r"runs\.json entry 1: run of .* refused: .*" + message):
        bless(runs, root=tmp_path / "baselines")
    assert not (tmp_path / "baselines").exists()


def test_an_out_of_memory_run_may_peak_above_its_card(tmp_path):
    entry = _edited("step.device", int(20 * GIB))
    entry["run"]["ranks"][0]["error"] = {"kind": "oom", "message": "CUDA out of memory"}
    bless(_write(tmp_path, entry), root=tmp_path / "baselines")
    assert load_baselines(tmp_path / "baselines")[0].runs[0].outcome == "oom"


# --- replacing ----------------------------------------------------------------------------------


def test_an_existing_baseline_is_replaced_only_with_replace(tmp_path, capsys):
    root = tmp_path / "baselines"
    first, second = _write(tmp_path, _entry()), _write(tmp_path, _entry(peak_gib=11.0), name="night-2.json")
    assert main(["bless", str(first), "--baselines-dir", str(root)]) == 0
    (path,) = root.glob("*/*.json")
    before = path.read_text()
    assert main(["bless", str(second), "--baselines-dir", str(root)]) == 2
    assert "a baseline exists; pass --replace to replace it, or --append" in capsys.readouterr().err
    assert path.read_text() == before
    assert main(["bless", str(second), "--baselines-dir", str(root), "--append", "--replace"]) == 2
    assert main(["bless", str(second), "--baselines-dir", str(root), "--append"]) == 0
    assert len(load_baselines(root)[0].runs) == 2
    assert main(["bless", str(second), "--baselines-dir", str(root), "--replace"]) == 0
    (baseline,) = load_baselines(root)
    assert [r.per_card_peak for r in baseline.runs] == [int(11.0 * GIB)]


def test_a_full_disk_while_blessing_keeps_the_old_baseline(tmp_path, monkeypatch, capsys):
    root = tmp_path / "baselines"
    bless(_write(tmp_path, _entry()), root=root)
    (path,) = root.glob("*/*.json")
    before = path.read_text()

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "fsync", full)
    code = main(["bless", str(_write(tmp_path, _entry(peak_gib=11.0), name="b.json")), "--baselines-dir", str(root),
                 "--replace"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{path}: could not be written (No space left on device)" in err
    assert path.read_text() == before
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


# --- corrupt baselines --------------------------------------------------------------------------


def test_a_corrupt_baseline_is_named_and_skipped(tmp_path, capsys):
    root = tmp_path / "baselines"
    bless(_write(tmp_path, _entry()), root=root)
    (good,) = root.glob("*/*.json")
    text = good.read_text()
    corrupt = {"empty.json": "", "truncated.json": text[: len(text) // 2], "not-json.json": "<html>",
               "missing.json": json.dumps({k: v for k, v in json.loads(text).items() if k != "runs"}),
               "negative.json": text.replace(str(int(10.5 * GIB)), "-1")}
    for name, content in corrupt.items():
        (good.parent / name).write_text(content)
    baselines, bad = read_baselines(root)
    assert [b.case_id for b in baselines] == [CASE]
    assert len(bad) == len(corrupt)
    for name, line in zip(sorted(corrupt), bad, strict=True):
        assert line.startswith(f"{good.parent / name}: skipped, not a baseline (")
    assert "(empty)" in bad[0] and "runs: Field required" in "".join(bad)
    assert len(load_baselines(root)) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == len(corrupt) and all(line.startswith("oom-harness: warning: ") for line in err)


def test_a_corrupt_baseline_does_not_stop_the_calibration_check_uses(tmp_path, capsys):
    from harness.predict.calibration import calibrate

    root = tmp_path / "baselines"
    bless(_write(tmp_path, _entry()), root=root)
    (good,) = root.glob("*/*.json")
    (good.parent / "truncated.json").write_text(good.read_text()[:100])
    cal = calibrate(root=root)
    assert cal is not None
    assert "truncated.json: skipped, not a baseline" in capsys.readouterr().err


def test_a_corrupt_baseline_does_not_stop_a_session(tmp_path, capsys):
    from harness.judge.session import Session

    root = tmp_path / "baselines"
    bless(_write(tmp_path, _entry()), root=root)
    (next(root.glob("*")) / "empty.json").write_text("")
    session = Session(case_dir=CASES_DIR, run_root=tmp_path / "runs", baseline_root=root)
    assert [b.case_id for b in session._baselines] == [CASE]
    assert "empty.json: skipped, not a baseline (empty)" in capsys.readouterr().err


def test_a_session_run_records_its_case_identity(tmp_path, monkeypatch):
    from harness.judge import session as session_module
    from harness.spec.variants import Variant

    def fake_run_case(case, path, fidelity, out, *args):
        out.mkdir(parents=True, exist_ok=True)
        return CaseRun(case_id=case.id, fidelity=fidelity, command=[], returncode=0, wall_s=1.0)

    monkeypatch.setattr(session_module, "run_case", fake_run_case)
    session = session_module.Session(case_dir=CASES_DIR, run_root=tmp_path / "runs")
    run = session._execute(CASE, "tiny", Variant(), 0)
    written = CaseRun.model_validate_json((tmp_path / "runs" / "tiny" / CASE / "run.json").read_text())
    assert written.case_digest == run.case_digest == case_digest(load_case(CASES_DIR / f"{CASE}.yaml"))
    assert written.model == "qwen1.5-7b-chat"


# --- report reads only --------------------------------------------------------------------------


_WRITES: list[str] | None = None  # while a list: every write, rename, removal or new folder, as it happens


def _audit(event: str, args: tuple) -> None:
    if _WRITES is None:
        return
    if event == "open":
        path, mode, flags = args
        writing = any(c in mode for c in "wax+") if isinstance(mode, str) else \
            bool((flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        if writing and "__pycache__" not in str(path):
            _WRITES.append(f"open {path} {mode or flags}")
    elif event in ("os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "os.truncate", "shutil.rmtree"):
        _WRITES.append(f"{event} {args[0]}")


sys.addaudithook(_audit)


def test_report_writes_nothing(tmp_path, monkeypatch, capsys):
    global _WRITES
    from harness.baselines.store import RESULTS_DIR

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    runs = _write(tmp_path, _entry())
    before, results_before = _files(tmp_path), {p: p.stat().st_mtime_ns for p in RESULTS_DIR.rglob("*")}
    _WRITES = []
    try:
        code = main(["report", str(runs)])
        writes, _WRITES = _WRITES, None
    finally:
        _WRITES = None
    assert code == 0
    assert "| 003-qlora-fix-r32-seq1024-gc | NVIDIA H100 80GB HBM3 x1, full depth |" in capsys.readouterr().out
    assert writes == []  # not even a scratch folder it removes again
    assert _files(tmp_path) == before
    assert {p: p.stat().st_mtime_ns for p in RESULTS_DIR.rglob("*")} == results_before


def test_report_names_a_verdict_record_missing_a_field(tmp_path, capsys):
    entry = _entry()
    entry["verdicts"] = [{"status": "refuted"}]
    assert main(["report", str(_write(tmp_path, entry))]) == 2
    assert "runs.json: entry 0 has a verdict record" in capsys.readouterr().err


def test_check_names_a_corrupt_baseline_and_still_answers(tmp_path, monkeypatch, capsys):
    """`check` calibrates its prediction on the baselines; a truncated one used to fail every check."""
    import shutil

    from harness.baselines.store import RESULTS_DIR
    from harness.predict import calibration

    root = tmp_path / "baselines"
    shutil.copytree(RESULTS_DIR, root)
    broken = next(root.glob("*/*.json"))
    broken.write_text(broken.read_text()[:200])
    monkeypatch.setattr(calibration.calibrate, "__defaults__", (None, frozenset(), root, CASES_DIR))
    code = main(["check", str(CASES_DIR / "001-ladder-rung1-zero2.yaml")])
    out, err = capsys.readouterr()
    assert code in (0, 1), err
    assert "verdict:" in out
    assert f"{broken}: skipped, not a baseline (" in err
