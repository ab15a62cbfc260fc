"""The repository's own conftest.py keeps the run's caches in the checkout, all in one folder, unless
the environment already names one, and says in the header whether they are warm."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _repo_conftest():
    spec = importlib.util.spec_from_file_location("repo_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_caches_default_to_one_folder_in_the_checkout(monkeypatch):
    monkeypatch.delenv("HARNESS_CACHE", raising=False)
    monkeypatch.delenv("HARNESS_PREDICT_CACHE", raising=False)
    _repo_conftest().pytest_configure(None)
    assert Path(os.environ["HARNESS_CACHE"]) == ROOT / ".cache" / "oom-harness"
    assert Path(os.environ["HARNESS_PREDICT_CACHE"]) == ROOT / ".cache" / "oom-harness" / "predict-trace"


def test_a_cache_the_environment_names_wins_and_the_traces_follow_it(monkeypatch, tmp_path):
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    monkeypatch.delenv("HARNESS_PREDICT_CACHE", raising=False)
    conftest = _repo_conftest()
    conftest.pytest_configure(None)
    assert os.environ["HARNESS_CACHE"] == str(tmp_path)
    assert os.environ["HARNESS_PREDICT_CACHE"] == str(tmp_path / "predict-trace")
    assert conftest.pytest_report_header(None) == (
        f"oom-harness caches: {tmp_path} (DeepSpeed ops cold, checkpoints cold, predictor traces cold)")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "one").write_text("x")
    assert "checkpoints warm" in conftest.pytest_report_header(None)


def test_the_files_that_mostly_wait_are_collected_first_each_in_its_order():
    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    conftest = _repo_conftest()
    names = ["tests/test_allocator.py::test_a", "tests/test_launcher.py::test_b", "cases/x.yaml::x-tiny",
             "tests/test_faults.py::test_c[torchrun]", "tests/test_faults.py::test_c[forked]",
             "tests/test_zygote.py::t"]
    items = [Item(n) for n in names]
    conftest.pytest_collection_modifyitems(None, None, items)
    assert [i.nodeid for i in items] == [
        "tests/test_launcher.py::test_b", "tests/test_faults.py::test_c[torchrun]",
        "tests/test_faults.py::test_c[forked]", "tests/test_zygote.py::t", "tests/test_allocator.py::test_a",
        "cases/x.yaml::x-tiny"]
    assert all((ROOT / f).is_file() for f in conftest.WAITING_FIRST)
