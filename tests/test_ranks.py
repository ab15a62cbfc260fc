"""The launcher's own ranks (CPU hosts): torchrun's environment per rank, the first failure named and
the other ranks stopped (SIGTERM, then SIGKILL after the grace), no rank left once the harness is gone.
Plain interpreters stand in for the ranks here; test_faults runs ranks forked from the zygote."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from harness.measure.records import Failure
from harness.runtime.launcher import Job, run_jobs
from harness.runtime.ranks import RankGroup, rank_env

ROOT = Path(__file__).resolve().parents[1]

# each rank writes its environment and pid, then does what its rank's argument says
RANK = '''
import json, os, signal, sys, time
rank = int(os.environ["RANK"])
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
out = sys.argv[1]
json.dump({"pid": os.getpid(), "session": os.getsid(0), **{k: os.environ[k] for k in keys}},
          open(os.path.join(out, f"env{rank}.json"), "w"))
what = sys.argv[2 + rank]
if what == "deaf":  # ignores the launcher's SIGTERM, as a rank stuck in a collective's C code does
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if what.startswith("exit"):
    time.sleep(0.5)
    sys.exit(int(what[4:]))
if what == "owned":
    from harness.runtime.process_tree import exit_with_owner
    exit_with_owner(0.1)
time.sleep(120)
'''


def _ranks(tmp_path: Path, *what: str) -> Job:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    return Job([sys.executable, str(script), str(tmp_path), *what], {"PYTHONPATH": str(ROOT)}, ranks=len(what))


def _env(tmp_path: Path, rank: int) -> dict:
    return json.loads((tmp_path / f"env{rank}.json").read_text())


def test_each_rank_gets_torchruns_environment():
    assert rank_env(1, 4, 29500) == {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
                                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_a_failed_rank_is_named_and_the_others_are_stopped(tmp_path, still_running):
    started = time.monotonic()
    run = run_jobs([_ranks(tmp_path, "sleep", "exit7", "sleep")], tmp_path / "run", 120, "x", "tiny", 3)
    assert time.monotonic() - started < 30  # stopped, not left to the timeout
    envs = [_env(tmp_path, r) for r in range(3)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] and {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert len({e["MASTER_PORT"] for e in envs}) == 1  # one rendezvous
    assert len({e["session"] for e in envs}) == 3  # each in a session of its own, as torchrun starts them
    assert run.error.kind == Failure.crash
    assert run.error.message.startswith(f"rank 1 (pid {envs[1]['pid']}) exited with code 7")
    assert "the launcher stopped the other ranks" in run.error.message
    assert run.returncode == 7
    log = Path(run.run_dir, "log.txt").read_text()
    assert f"rank 1 (pid {envs[1]['pid']}) exited with code 7; stopping the other ranks" in log
    assert still_running([e["pid"] for e in envs], 5) == []


def test_a_rank_deaf_to_sigterm_is_killed_after_the_grace(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path), "deaf", "exit3"],
                              env=rank_env(r, 2, 1), start_new_session=True) for r in range(2)]
    said = []
    group = RankGroup(procs, say=said.append, grace_s=1.0)
    assert group.wait(60) == 3
    assert group.returncodes == [-signal.SIGKILL, 3]
    assert [(d.rank, d.exitcode) for d in group.deaths] == [(1, 3)]  # what followed is not a second cause
    assert said == [f"rank 1 (pid {procs[1].pid}) exited with code 3; stopping the other ranks"]


def test_ranks_that_all_succeed_are_a_success(tmp_path):
    run = run_jobs([_ranks(tmp_path, "exit0", "exit0")], tmp_path / "run", 60, "x", "tiny", 0)
    assert run.error is None and run.returncode == 0


def test_a_timeout_kills_every_rank(tmp_path, still_running):
    run = run_jobs([_ranks(tmp_path, "sleep", "deaf")], tmp_path / "run", 3, "x", "tiny", 2)
    assert run.error.kind == Failure.timeout
    assert still_running([_env(tmp_path, r)["pid"] for r in range(2)], 5) == []


def test_the_ranks_exit_when_the_harness_that_launched_them_is_killed(tmp_path):
    job = _ranks(tmp_path, "owned", "owned")
    harness_code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from harness.runtime.launcher import Job
        from harness.runtime.launcher import run_jobs
        run_jobs([Job({job.argv!r}, {job.env!r}, ranks=2)], Path({str(tmp_path / 'run')!r}), 120, "x", "tiny", 2)
    """)
    harness = subprocess.Popen([sys.executable, "-c", harness_code], env={"PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"env{r}.json").exists() for r in range(2)):
            assert time.monotonic() < deadline and harness.poll() is None
            time.sleep(0.05)
        time.sleep(0.2)  # the files are whole
        ranks = [psutil.Process(_env(tmp_path, r)["pid"]) for r in range(2)]
        harness.kill()
        harness.wait()
        psutil.wait_procs(ranks, timeout=10)
        assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        harness.kill()
        harness.wait()
