"""`oom-harness run --shard K/N`: the nightly job's one slice of the single-rank cases per GPU."""

import pytest

from harness.cases import CASES_DIR
from harness.cli import _slice
from harness.session import Session


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    return Session(case_dir=CASES_DIR, run_root=tmp_path_factory.mktemp("runs"))


def test_every_single_rank_case_is_in_exactly_one_shard(session):
    every = sorted(session.cases)
    single = _slice(every, session, "single", None)
    shards = [_slice(every, session, "single", f"{k}/8") for k in range(8)]
    assert sorted(cid for s in shards for cid in s) == single


def test_cases_whose_claims_consult_each_other_share_a_shard(session):
    """Guide 004's plans compare with its failing case (which compiles its kernels on an empty cache
    for minutes), guide 001's rungs are ranked against each other: split over GPUs, every shard
    would run the others' cases again."""
    every = sorted(session.cases)
    shards = [_slice(every, session, "single", f"{k}/8") for k in range(8)]
    for prefix in ("001-", "003-", "004-"):
        holding = [s for s in shards if any(cid.startswith(prefix) for cid in s)]
        assert len(holding) == 1, prefix
        assert sorted(c for c in holding[0] if c.startswith(prefix)) == [
            c for c in _slice(every, session, "single", None) if c.startswith(prefix)]


def test_a_malformed_shard_is_an_error_naming_the_form(session):
    with pytest.raises(ValueError, match="write K/N with 0 <= K < N"):
        _slice(sorted(session.cases), session, "single", "8/8")
