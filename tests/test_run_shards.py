"""`oom-harness run --shard K/N`: the nightly job's one slice of the single-rank cases per GPU."""

import pytest

from harness.cli.main import main
from harness.cli.run import _slice
from harness.judge.session import Session
from harness.spec.cases import CASES_DIR


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


def test_an_empty_shard_runs_nothing_and_succeeds(capsys):
    """A runner with more GPUs than groups of related cases: the nightly job starts a shard per GPU,
    and a shard with nothing to run must not turn the night red (seen on two H100s with `-k 003`,
    where every 003 case shares one shard)."""
    assert main(["run", "--select", "single", "--shard", "1/2", "-k", "003-"]) == 0
    assert "nothing to run: none of the 4 matching cases is a single-rank case in shard 1/2" in capsys.readouterr().out


def test_a_filter_matching_no_case_is_still_an_error(capsys):
    assert main(["run", "--select", "single", "--shard", "0/2", "-k", "no-such-case"]) == 2
    assert "no case matches no-such-case" in capsys.readouterr().err
