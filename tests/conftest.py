"""Fixtures the test files share: isolation of the harness's process-wide state (the card locks a
test's full-size sessions take live in a lock folder of the test's own and are let go after it, so no
test finds a card held by an earlier one), waiting for processes a test expects to be gone, and the
session the bundled cases' items are judged on (a test that needs a bundled case's run shares it,
except under pytest-xdist)."""

import contextlib
import os
import time

import psutil
import pytest

from harness.runtime import card_lock
from harness.spec.cases import CASES_DIR

with contextlib.suppress(ImportError):  # hypothesis comes with the test extra
    from hypothesis import settings as hypothesis_settings

    # Examples per property test where the test does not set its own: the default tier's profile tries
    # 30 (derandomized: the same 30 each run); `pytest --hypothesis-profile deep` searches further.
    hypothesis_settings.register_profile("tier", max_examples=30)
    hypothesis_settings.register_profile("deep", max_examples=600)
    hypothesis_settings.load_profile("tier")


@pytest.fixture(autouse=True)
def _caches_kept_under_pytester(request, monkeypatch):
    """pytester gives the pytest it runs a HOME of its own, where the harness's caches (DeepSpeed's
    JIT ops, the random-weight checkpoints, the predictor's traces) would be empty: a cold
    predictor trace of guide 000's 32B config is most of a minute. Point it at this process's.
    Hypothesis's plugin, which no pytester run uses, imports Hypothesis whole at every run's end
    (1.3 CPU-s a run)."""
    if "pytester" not in request.fixturenames:
        return
    from harness.predict.trace.trace import _cache_dir
    from harness.runtime.compile_cache import cache_dir

    monkeypatch.setenv("HARNESS_CACHE", str(cache_dir()))
    monkeypatch.setenv("HARNESS_PREDICT_CACHE", str(_cache_dir() or "off"))
    monkeypatch.setenv("PYTEST_ADDOPTS", " ".join(filter(None, [os.environ.get("PYTEST_ADDOPTS"),
                                                                "-p no:hypothesispytest"])))


@pytest.fixture
def shared_zygote(monkeypatch):
    """A harness this test starts (pytester's pytest, the CLI) forks its workers from this process's
    zygote instead of importing the training stack in one of its own."""
    from harness.runtime import zygote

    if zygote.enabled():
        address = zygote.shared().address()
        if address:
            monkeypatch.setenv(zygote.SOCKET_ENV, address)


@pytest.fixture(autouse=True)
def _own_card_locks(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HARNESS_LOCK_DIR", str(tmp_path_factory.mktemp("card-locks")))
    yield
    card_lock.release()


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _still_running(pids: list[int], within_s: float) -> list[int]:
    """The processes of `pids` still running after up to `within_s` seconds (a zombie counts as gone)."""
    deadline = time.monotonic() + within_s
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _running(p)]
        time.sleep(0.1)
    return alive


@pytest.fixture
def still_running():
    return _still_running


@pytest.fixture(scope="session")
def bundled_session(request, tmp_path_factory):
    """The session that runs and judges the bundled cases' items (the plugin's, where this
    repository's ini points it at the bundled suite), so a test's run of a bundled case is the case
    item's run: run once. Elsewhere, a session of its own."""
    from harness.judge.session import Session
    from harness.pytest_plugin.cases import _one_worker_runs_the_cases, shared_session
    from harness.pytest_plugin.settings import settings

    # under `-n 2 --dist loadgroup` a test using this runs in the cases' worker (test_launcher's
    # BESIDE_THE_CASES), so the case item judges the same run
    if settings(request.config).case_dir == CASES_DIR.resolve() and _one_worker_runs_the_cases(request.config):
        return shared_session(request.config)
    # under pytest-xdist's other schedulers the case items may run in another worker, into the same
    # folders: a run of their own, which never meets theirs
    return Session(case_dir=CASES_DIR, run_root=tmp_path_factory.mktemp("bundled-runs"))

