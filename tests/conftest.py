"""Fixtures the test files share: isolation of the harness's process-wide state (the card locks a
test's full-size sessions take live in a lock folder of the test's own and are let go after it, so no
test finds a card held by an earlier one), and waiting for processes a test expects to be gone."""

import time

import psutil
import pytest

from harness.runtime import card_lock


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
