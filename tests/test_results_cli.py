"""`run --json` refuses an output it could not write before any case runs; `validate` fails a claim
naming a case its folder does not hold."""

from __future__ import annotations

import shutil

import pytest
import yaml

from harness.cli.main import main
from harness.spec.cases import CASES_DIR

CASE = "001-ladder-rung1-zero2"
CLAIMING = "000-lora-z3-offload-aggressive-cutoff512-ga32"  # lower_peak_than another 000 case


@pytest.fixture
def no_runs(monkeypatch):
    """Any case run (or even a session) fails the test: the command must stop before them."""
    from harness.judge import session

    def refuse(*args, **kwargs):
        raise AssertionError("a session started: the output should have been refused first")

    monkeypatch.setattr(session, "Session", refuse)


@pytest.mark.parametrize("flag", ["--json", "--benchmark-json"])
def test_run_refuses_an_output_in_a_missing_folder_before_running(tmp_path, capsys, no_runs, flag):
    out = tmp_path / "missing" / "runs.json"
    assert main(["run", "-k", CASE, flag, str(out)]) == 2
    err = capsys.readouterr().err
    assert f"run: {flag} {out}: the folder {out.parent} does not exist; create it or name another file" in err
    assert not out.parent.exists()


def test_run_refuses_a_folder_as_its_json_file(tmp_path, capsys, no_runs):
    assert main(["run", "-k", CASE, "--json", str(tmp_path)]) == 2
    assert "is a folder; name a file" in capsys.readouterr().err


def test_a_full_disk_mid_session_is_reported_and_the_runs_go_on(tmp_path, monkeypatch, capsys):
    import errno
    import os
    from types import SimpleNamespace

    from harness.cli.run import _write_json
    from harness.spec import files

    out = tmp_path / "runs.json"
    out.write_text("[]")
    session = SimpleNamespace(judged=lambda: [], all_runs=lambda: [], run_root=tmp_path / "runs")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "fsync", full)
    _write_json(out, session)  # no exception: the session's later cases still run
    assert f"run: --json {out} could not be written: No space left on device" in capsys.readouterr().err
    assert out.read_text() == "[]"


def _folder_with(tmp_path, *ids):
    folder = tmp_path / "cases"
    folder.mkdir()
    for case_id in ids:
        shutil.copy(CASES_DIR / f"{case_id}.yaml", folder)
    return folder


def test_validate_fails_a_claim_naming_a_case_not_in_its_folder(tmp_path, capsys):
    folder = _folder_with(tmp_path, CLAIMING)
    path = folder / f"{CLAIMING}.yaml"
    refs = [c["case"] for c in yaml.safe_load(path.read_text())["claims"] if c["kind"] == "lower_peak_than"]
    assert refs
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: invalid case file" in err
    assert f"names case '{refs[0]}', which is not in {folder}" in err
    # with the case it names beside it, the same file is valid
    for ref in refs:
        shutil.copy(CASES_DIR / f"{ref}.yaml", folder)
    assert main(["validate", str(folder)]) == 0


def test_validate_passes_the_bundled_suite(capsys):
    assert main(["validate"]) == 0
