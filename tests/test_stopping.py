"""Runs that stop when told: one SIGTERM or one Ctrl-C to `oom-harness run` ends it within 10 s with one
line, its whole process tree killed, the JIT-build locks its jobs held removed and its temporary
folder gone; a JIT-build lock whose holder died is taken back while a run waits on it; a run refused
at once leaves no folder behind.

The harness runs as `oom-harness run` does (the command line's own entry point, the session, the
zygote, the launcher) on a bundled tiny case, with two things swapped for speed: the worker is a
stand-in that does what a DeepSpeed op build does to the extensions folder (torch's FileBaton: a
`lock` file created exclusively and kept open while it builds, polled for by every other process
that needs the op), and the zygote preloads nothing heavy.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from harness.spec.cases import CASES_DIR

CASE = "001-ladder-rung1-zero2"
STOP_WITHIN_S = 10.0

# What the worker does, as a DeepSpeed worker building (or waiting for) cpu_adam does with the lock
# torch.utils.file_baton.FileBaton keeps in the op's build folder.
FAKE_WORKER = textwrap.dedent("""
    import os, subprocess, sys, time
    lock = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "cpu_adam", "lock")
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    pids = [os.getpid()]
    if os.environ["FAKE_MODE"] == "build":  # the builder: holds the lock, a compiler in a session of its own
        fd = os.open(lock, os.O_CREAT | os.O_EXCL)
        compiler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        pids.append(compiler.pid)
        open(os.environ["FAKE_PIDS"], "w").write(" ".join(map(str, pids)))
        time.sleep(600)
    else:  # another process needing the op: FileBaton.wait polls until the lock is gone
        open(os.environ["FAKE_PIDS"], "w").write(" ".join(map(str, pids)))
        while os.path.exists(lock):
            time.sleep(0.1)
""")

DRIVER = textwrap.dedent("""
    import signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's foreground command
    import harness.runtime.launcher as launcher
    from harness.runtime import platform
    launcher.WORKER = "fake_worker"
    platform.detect = lambda: platform.Platform.cpu  # no torch import to find out
    platform.accelerator_count = lambda: 0
    from harness.cli.main import console
    sys.argv = ["oom-harness", "run", *sys.argv[1:]]
    console()
""")


def _holder(lock: Path) -> subprocess.Popen:
    """Another harness's builder of the op: it holds the lock until killed."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    code = (f"import os, sys, time; os.open({str(lock)!r}, os.O_CREAT | os.O_EXCL); print('held', flush=True); "
            "time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


class Harness:
    """`oom-harness run -k CASE` in a process group of its own, with its own temporary folder."""

    def __init__(self, tmp_path: Path, mode: str):
        self.tmp = tmp_path / "tmp"
        self.tmp.mkdir()
        (tmp_path / "fake_worker.py").write_text(FAKE_WORKER)
        (tmp_path / "driver.py").write_text(DRIVER)
        self.ext = tmp_path / "ext"
        self.lock = self.ext / "cpu_adam" / "lock"
        self.pids_file = tmp_path / "pids"
        path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, TMPDIR=str(self.tmp), PYTHONPATH=path, HARNESS_ZYGOTE_PRELOAD="json",
                   TORCH_EXTENSIONS_DIR=str(self.ext), FAKE_MODE=mode, FAKE_PIDS=str(self.pids_file),
                   HARNESS_LOCK_DIR=str(tmp_path / "locks"), HARNESS_ZYGOTE="1")
        env.pop("HARNESS_ZYGOTE_SOCKET", None)  # a zygote of its own, whose end is part of the stop
        self.proc_env = env
        self.err = tmp_path / "stderr"
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), "--case-dir", str(CASES_DIR),
                                          "-k", CASE, "--timeout", "300"], env=env, stdout=subprocess.DEVNULL,
                                         stderr=err, start_new_session=True)

    def started(self, within_s: float = 120) -> list[int]:
        """Every process of the harness once its job runs: the job's own (the worker, its compiler) and
        the harness's descendants (the zygote, the workers it forked)."""
        deadline = time.monotonic() + within_s
        while not (self.pids_file.exists() and self.pids_file.read_text()):
            assert self.proc.poll() is None, self.err.read_text()
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.05)
        pids = {int(p) for p in self.pids_file.read_text().split()}
        pids |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        self.pids = sorted(pids)
        return self.pids

    def kill_leftovers(self) -> None:
        """Where a test failed: nothing of this harness outlives it."""
        for pid in [self.proc.pid, *getattr(self, "pids", [])]:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass

    def stop(self, signum: int) -> float:
        """SIGTERM as `timeout` and CI runners send it (to the process); Ctrl-C as a terminal sends it
        (to the foreground process group). The seconds until the harness exited."""
        sent = time.monotonic()
        if signum == signal.SIGINT:
            os.killpg(self.proc.pid, signum)
        else:
            self.proc.send_signal(signum)
        try:
            self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return time.monotonic() - sent

    def left_in_tmp(self) -> list[str]:
        return sorted(p.name for p in self.tmp.iterdir() if p.name.startswith("oom-harness-"))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_one_signal_stops_a_run_mid_build_leaving_no_process_lock_or_folder(tmp_path, signum, still_running):
    harness = Harness(tmp_path, "build")
    try:
        pids = harness.started()
        assert harness.lock.exists()
        took = harness.stop(signum)
        said = [line for line in harness.err.read_text().splitlines() if line.strip()]
        assert took < STOP_WITHIN_S, said
        assert harness.proc.returncode == 128 + signum
        name = signal.Signals(signum).name
        assert said == [f"oom-harness run: stopped by {name}; nothing it started is left running"]
        assert still_running(pids, 2) == []  # the worker, its compiler (a session of its own), the zygote
        assert not harness.lock.exists()  # the next run's job would wait on it, or build the op again
        assert harness.left_in_tmp() == []  # the run's folder and the zygote's
    finally:
        harness.kill_leftovers()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_one_signal_stops_a_run_waiting_on_another_harness_lock(tmp_path, signum, still_running):
    harness = None
    holder = _holder(tmp_path / "ext" / "cpu_adam" / "lock")
    try:
        harness = Harness(tmp_path, "wait")
        pids = harness.started()
        time.sleep(0.5)  # waiting on the lock
        took = harness.stop(signum)
        said = [line for line in harness.err.read_text().splitlines() if line.strip()]
        assert took < STOP_WITHIN_S, said
        assert harness.proc.returncode == 128 + signum and len(said) == 1 and "stopped by" in said[0]
        assert still_running(pids, 2) == []
        assert harness.left_in_tmp() == []
        assert harness.lock.exists() and holder.poll() is None  # another harness's build goes on
    finally:
        holder.kill()
        holder.wait()
        if harness is not None:
            harness.kill_leftovers()


def test_a_lock_whose_holder_died_is_taken_back_while_the_run_waits(tmp_path, monkeypatch):
    """A builder killed mid-build (the first of two runs, stopped) leaves torch's lock: the job of the
    run waiting on it polls for it forever, and the run ended only at its timeout."""
    from harness.measure.records import Failure
    from harness.runtime import launcher
    from harness.runtime.launcher import Job, run_jobs

    monkeypatch.setattr(launcher, "JIT_LOCK_CHECK_S", 1.0)
    lock = tmp_path / "ext" / "cpu_adam" / "lock"
    holder = _holder(lock)
    waiter = ("import os, time\n"
              f"while os.path.exists({str(lock)!r}): time.sleep(0.1)\n"
              "print('the lock is gone: building the op', flush=True)\n")
    job = Job([sys.executable, "-c", waiter], {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")})
    try:
        threading.Timer(2.0, holder.kill).start()
        started = time.monotonic()
        run = run_jobs([job], tmp_path / "run", 120, "x", "tiny", 1)
    finally:
        holder.kill()
        holder.wait()
    assert time.monotonic() - started < 30  # not the 120 s timeout
    assert run.returncode == 0 and run.error.kind != Failure.timeout  # it wrote no report: no_report
    assert "the lock is gone" in run.log_tail and f"removed {lock}" in run.log_tail
    assert not lock.exists()


def test_a_run_refused_at_once_leaves_no_temporary_folder(tmp_path, monkeypatch, capsys):
    import tempfile

    from harness.cli.main import main

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["run", "-k", "no-such-case"]) == 2
    assert "no case matches no-such-case" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("oom-harness-")] == []


def test_a_process_forked_from_the_harness_ends_quietly_at_a_signal(tmp_path):
    """The predictor forks traces; `timeout` signals the whole process group. The fork inherited the
    harness's handlers and printed a Stopped traceback of its own beside the harness's one line."""
    code = textwrap.dedent("""
        import os, signal, sys, time
        from harness.runtime import stopping
        stopping.install()
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        time.sleep(0.5)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), stopping.stopping())
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == [str(-signal.SIGTERM), "False"]  # ended by the signal; the parent goes on
    assert done.stderr == ""


PYTEST_DRIVER = textwrap.dedent("""
    import signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's foreground command
    import harness.runtime.launcher as launcher
    from harness.runtime import platform
    launcher.WORKER = "fake_worker"
    platform.detect = lambda: platform.Platform.cpu
    platform.accelerator_count = lambda: 0
    import pytest
    sys.exit(pytest.main(["-p", "no:cacheprovider", "-p", "no:xdist", "-q", *sys.argv[1:]]))
""")


def test_one_sigterm_stops_pytest_running_the_cases(tmp_path, still_running):
    """The plugin runs the cases through the same launcher: pytest, told once, ends as interrupted
    (pytest's own Ctrl-C is a KeyboardInterrupt, which the same handler raises)."""
    signum = signal.SIGTERM
    harness = Harness(tmp_path, "build")
    harness.proc.kill()  # the command line's: this test starts pytest instead
    harness.proc.wait()
    (tmp_path / "driver.py").write_text(PYTEST_DRIVER)
    env = dict(harness.proc_env)
    with open(harness.err, "w") as err:
        harness.proc = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), "--case-dir", str(CASES_DIR),
                                         "-k", f"{CASE}-tiny", str(CASES_DIR)], env=env, stdout=err,
                                        stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)
    try:
        pids = harness.started()
        took = harness.stop(signum)
        said = harness.err.read_text()
        assert took < STOP_WITHIN_S, said
        assert harness.proc.returncode == 2, said  # pytest's "interrupted"
        assert f"Stopped: stopped by {signal.Signals(signum).name}" in said  # interrupted, with one line
        assert still_running(pids, 2) == []
        assert not harness.lock.exists()
        assert harness.left_in_tmp() == []
    finally:
        harness.kill_leftovers()
