"""Workers forked from the zygote behave as fresh `python -m` processes do for the launcher: their
own session, output on the case's log, the job's environment, the exit code or the signal, a
timeout that kills their tree, and nothing left once the harness is killed. The zygotes here preload
little, so each test is quick; the real one (the training stack) runs every tiny case."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from harness.measure.records import Failure
from harness.runtime import zygote
from harness.runtime.launcher import Job, plan_jobs, run_jobs
from harness.runtime.platform import Platform
from harness.spec.cases import CASES_DIR, load_case

JOB = '''
import atexit, os, signal, subprocess, sys, time
what = sys.argv[1]
print(f"job {what} pid={os.getpid()} session={os.getsid(0)} cwd={os.getcwd()} X={os.environ.get('X')}", flush=True)
atexit.register(print, "atexit handlers ran", flush=True)
if what == "raise":
    raise ValueError("a bad lora target: q_projj")
if what == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if what == "hang":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[2], "w").write(str(child.pid))
    time.sleep(600)
if what == "owned":
    from harness.runtime.process_tree import exit_with_owner
    exit_with_owner(0.1)
    open(sys.argv[2], "w").write(str(os.getpid()))
    time.sleep(120)
sys.exit(int(what))
'''


@pytest.fixture
def light(tmp_path, monkeypatch):
    """A zygote that preloads only json, and a job module it can run; it is the launcher's zygote
    for the test."""
    (tmp_path / "zjob.py").write_text(JOB)
    root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(root)]))
    z = zygote.Zygote(preload=("json",))
    monkeypatch.setattr(zygote, "_shared", z)
    yield z
    z.close()


def _job(*args: str, **env: str) -> Job:
    return Job([sys.executable, "-m", "zjob", *args], env, preloaded=True)


def test_a_job_exits_with_its_code_in_a_session_of_its_own_with_its_output_on_the_log(light, tmp_path):
    run = run_jobs([_job("3", X="from the job")], tmp_path / "run", 60, "x", "tiny", 1)
    log = Path(run.run_dir, "log.txt").read_text()
    assert run.returncode == 3 and run.error.kind == Failure.crash
    (line,) = [ln for ln in log.splitlines() if ln.startswith("job 3")]
    fields = dict(f.split("=", 1) for f in line.split()[2:5])
    assert fields["pid"] == fields["session"]  # its own session: a timeout kills its whole group
    assert fields["cwd"] == os.getcwd()
    assert "X=from the job" in line
    assert "atexit handlers ran" in log  # it exits as an interpreter does
    assert psutil.Process(light.pid).is_running()  # the zygote forks; it does not run jobs itself


def test_an_exception_is_exit_1_with_its_traceback_and_a_signal_is_named(light, tmp_path):
    run = run_jobs([_job("raise")], tmp_path / "a", 60, "x", "tiny", 1)
    assert run.returncode == 1 and run.error.kind == Failure.crash
    assert "ValueError: a bad lora target: q_projj" in run.error.message
    run = run_jobs([_job("kill")], tmp_path / "b", 60, "x", "tiny", 1)
    assert run.returncode == -signal.SIGKILL and run.error.kind == Failure.host_oom
    assert "SIGKILL" in run.error.message


def test_jobs_run_side_by_side_and_each_gets_its_own_exit_code(light, tmp_path):
    run = run_jobs([_job("0"), _job("4")], tmp_path / "run", 60, "x", "tiny", 0)
    assert run.returncode == 4  # the launcher keeps the worst


def test_a_hang_past_the_timeout_is_killed_with_its_children(light, tmp_path, still_running):
    pid_file = tmp_path / "child.pid"
    started = time.monotonic()
    run = run_jobs([_job("hang", str(pid_file))], tmp_path / "run", 3, "x", "tiny", 1)
    assert time.monotonic() - started < 30
    assert run.error.kind == Failure.timeout
    assert still_running([int(pid_file.read_text())], 5) == []


def test_a_killed_harness_leaves_neither_the_zygote_nor_its_jobs(tmp_path, still_running):
    (tmp_path / "zjob.py").write_text(JOB)
    pid_file = tmp_path / "job.pid"
    harness_code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from harness.runtime import zygote
        from harness.runtime.launcher import Job, run_jobs
        z = zygote.shared()
        open({str(tmp_path / 'zygote.pid')!r}, "w").write(str(z.pid))
        run_jobs([Job([sys.executable, "-m", "zjob", "owned", {str(pid_file)!r}], preloaded=True)],
                 Path({str(tmp_path / 'run')!r}), 120, "x", "tiny", 1)
    """)
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(root)]))
    env[zygote.PRELOAD_ENV] = "json"
    harness = subprocess.Popen([sys.executable, "-c", harness_code], env=env)
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and harness.poll() is None
            time.sleep(0.05)
        job, forked_by = int(pid_file.read_text()), int((tmp_path / "zygote.pid").read_text())
        assert psutil.Process(job).ppid() == forked_by
        harness.send_signal(signal.SIGKILL)
        harness.wait()
        assert still_running([job, forked_by], 15) == []
    finally:
        harness.kill()
        harness.wait()


def test_another_harness_uses_a_running_zygote_through_its_socket(light, tmp_path, still_running):
    """A harness started with the zygote's address (pytest's pytester runs, a CLI a test starts)
    forks its jobs there instead of importing the training stack again: each job gets that
    harness's environment, folder and log, and its exit code goes back to that harness; the zygote
    outlives it, and a job of that harness exits with it."""
    address = light.address()
    assert address and Path(address).is_socket() and Path(address).parent.stat().st_mode & 0o077 == 0
    pid_file = tmp_path / "job.pid"
    work = tmp_path / "elsewhere"
    work.mkdir()
    harness_code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from harness.runtime import zygote
        from harness.runtime.launcher import Job, run_jobs
        run = run_jobs([Job([sys.executable, "-m", "zjob", "6"], {{"X": "theirs"}}, preloaded=True)],
                       Path("run"), 60, "x", "tiny", 1)
        print("code", run.returncode, "zygote", zygote.shared().pid, flush=True)
        run_jobs([Job([sys.executable, "-m", "zjob", "owned", {str(pid_file)!r}], preloaded=True)],
                 Path("owned"), 120, "x", "tiny", 1)
    """)
    env = dict(os.environ, **{zygote.SOCKET_ENV: address, zygote.PRELOAD_ENV: "no-such-module"})
    harness = subprocess.Popen([sys.executable, "-c", harness_code], env=env, cwd=work, stdout=subprocess.PIPE,
                               text=True)
    try:
        assert harness.stdout.readline().split() == ["code", "6", "zygote", str(light.pid)]
        line = next(ln for ln in (work / "run" / "log.txt").read_text().splitlines() if ln.startswith("job 6"))
        assert f"cwd={work}" in line and "X=theirs" in line
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and harness.poll() is None
            time.sleep(0.05)
        job = int(pid_file.read_text())
        assert psutil.Process(job).ppid() == light.pid
        harness.kill()
        harness.wait()
        assert still_running([job], 15) == []
    finally:
        harness.kill()
        harness.wait()
    assert run_jobs([_job("0")], tmp_path / "after", 60, "x", "tiny", 0).returncode == 0  # the zygote serves on


def test_only_cpu_workers_come_from_the_zygote(tmp_path, monkeypatch):
    """A process that initialised CUDA cannot be forked: GPU runs, and torchrun's ranks, start
    fresh interpreters. On a CPU no rank launcher is needed: every rank comes from the zygote."""
    one = CASES_DIR / "003-qlora-fix-r16-seq512-gc.yaml"
    shared = CASES_DIR / "004-gla-plan-a-minimal.yaml"
    ranks = CASES_DIR / "002-gemma27b-full-z3-offload-len2048.yaml"
    rung = CASES_DIR / "001-ladder-rung1-zero2.yaml"  # DeepSpeed's launcher, one rank: no launcher needed
    assert [j.preloaded for j in plan_jobs(load_case(one), one, "tiny", 1, tmp_path, Platform.cpu)] == [True]
    (job,) = plan_jobs(load_case(rung), rung, "tiny", 1, tmp_path, Platform.cpu)
    assert job.preloaded and job.argv[1:3] == ["-m", "harness.runtime.worker"]
    assert {k: job.env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")} == {"RANK": "0", "WORLD_SIZE": "1",
                                                                             "LOCAL_RANK": "0"}
    assert [j.preloaded for j in plan_jobs(load_case(rung), rung, "real", 1, tmp_path, Platform.cuda)] == [False]
    assert [j.preloaded for j in plan_jobs(load_case(shared), shared, "tiny", 1, tmp_path, Platform.cpu)] == [True] * 2
    assert [(j.preloaded, j.ranks) for j in plan_jobs(load_case(ranks), ranks, "tiny", 2, tmp_path,
                                                      Platform.cpu)] == [(True, 2)]
    assert [j.preloaded for j in plan_jobs(load_case(ranks), ranks, "real", 2, tmp_path, Platform.cuda)] == [False]
    assert [j.preloaded for j in plan_jobs(load_case(one), one, "real", 1, tmp_path, Platform.cuda)] == [False]
    monkeypatch.setenv(zygote.ENABLE_ENV, "0")
    assert [j.preloaded for j in plan_jobs(load_case(one), one, "tiny", 1, tmp_path, Platform.cpu)] == [False]


def test_a_zygote_that_died_leaves_the_job_to_a_fresh_interpreter(light, tmp_path, monkeypatch):
    os.kill(light.pid, signal.SIGKILL)
    assert light._gone.wait(10)
    monkeypatch.setattr(zygote, "shared", lambda python=None: light)
    run = run_jobs([_job("0")], tmp_path / "run", 60, "x", "tiny", 0)
    assert run.returncode == 0 and run.error is None
    log = Path(run.run_dir, "log.txt").read_text()
    assert "the worker zygote" in log and "starting the worker in a fresh interpreter" in log


def _another_environment(folder: Path) -> Path:
    """A second virtual environment at `folder` with this one's packages: its own interpreter path."""
    (folder / "bin").mkdir(parents=True)
    (folder / "pyvenv.cfg").write_text(Path(sys.prefix, "pyvenv.cfg").read_text())
    (folder / "lib").symlink_to(Path(sys.prefix, "lib"))
    (folder / "bin" / "python").symlink_to(sys.executable)
    return folder / "bin" / "python"


def test_a_job_on_another_interpreter_is_forked_from_that_interpreters_zygote(light, tmp_path, monkeypatch):
    """A LLaMA-Factory case's workers run on that environment's interpreter: they come from a zygote
    started on it (which has imported that environment's stack), never from this interpreter's."""
    other = _another_environment(tmp_path / "venv-lf")
    monkeypatch.setattr(zygote, "PRELOAD", ("json",))
    monkeypatch.setattr(zygote, "_others", {})
    try:
        run = run_jobs([Job([str(other), "-m", "zjob", "0"], preloaded=True)], tmp_path / "run", 60, "x", "tiny", 0)
        assert run.returncode == 0 and run.error is None
        theirs = zygote._others[os.path.abspath(other)]
        assert theirs is not light and theirs.pid != light.pid
        assert psutil.Process(theirs.pid).cmdline()[0] == str(other)  # started on that interpreter
        assert zygote.shared(str(other)) is theirs and zygote.shared(sys.executable) is light
        log = Path(run.run_dir, "log.txt").read_text()
        assert "job 0" in log and "fresh interpreter" not in log
    finally:
        for z in zygote._others.values():
            z.close()
    # the plan: a case of another environment's stack is forked on a CPU host too
    lf = CASES_DIR / "003-qlora-fix-r32-seq1024-gc-llamafactory.yaml"
    monkeypatch.setattr("harness.runtime.launcher.interpreter", lambda case: str(other))
    (job,) = plan_jobs(load_case(lf), lf, "tiny", 1, tmp_path / "plan", Platform.cpu)
    assert job.preloaded and job.argv[0] == str(other)
