"""Isolation of the harness's process-wide state between tests: the card locks a test's full-size
sessions take (harness.runtime.card_lock) live in a lock folder of the test's own and are let go
after it, so no test finds a card held by an earlier one."""

import pytest

from harness.runtime import card_lock


@pytest.fixture(autouse=True)
def _own_card_locks(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HARNESS_LOCK_DIR", str(tmp_path_factory.mktemp("card-locks")))
    yield
    card_lock.release()
