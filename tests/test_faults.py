"""Faults a case run survives: each ends as a classified result of the case (a `Failure` with its
message), never a crashed or hung harness, and nothing that was measured is lost.

Small scripts stand in for the workers (as in test_launcher.py); the real worker runs only where
its own code is what is tested. The tests marked `gpu` need a CUDA card: `pytest -m gpu tests/test_faults.py`.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from harness.measure.records import CaseRun, ErrorInfo, Failure, Memory, RankReport
from harness.runtime.launcher import Job, free_port, run_jobs
from harness.spec.units import GIB

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


# Under `-n 2 --dist loadgroup` this parameter id runs a test in the worker of the case items
# (harness.pytest_plugin.xdist_groups.GROUP): a test that mostly waits (on a timeout, on a fresh
# worker's imports) then waits while their tiny runs go on in the background. Only tests that leave
# the process's zygote and its jobs alone go there.
BESIDE_THE_CASES = pytest.mark.parametrize("_beside", [pytest.param(None, id="oom-harness-cases")])


def _torchrun(script: Path, *args: str) -> Job:
    return Job([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), *args])


@pytest.fixture(scope="module")
def _rank_zygote(tmp_path_factory):
    """A worker zygote that has imported torch.distributed, and a folder of rank scripts it can run as modules."""
    from harness.runtime import zygote

    scripts = tmp_path_factory.mktemp("rank-scripts")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(scripts), str(ROOT), os.environ.get("PYTHONPATH")])))
        forker = zygote.Zygote(preload=("torch.distributed", "harness.measure.records", "harness.runtime.process_tree"))
    yield forker, scripts
    forker.close()


@pytest.fixture(params=["torchrun", "forked"])
def two_ranks(request, tmp_path, monkeypatch):
    """Start a script as the two ranks of a run: through torchrun (GPU hosts), or by the launcher
    itself with each rank forked from the worker zygote (CPU hosts: harness.runtime.ranks)."""
    if request.param == "torchrun":
        def start(code: str, *args: str) -> Job:
            script = tmp_path / "ranks.py"
            script.write_text(code)
            return _torchrun(script, *args)
        return start
    from harness.runtime import zygote

    forker, scripts = request.getfixturevalue("_rank_zygote")
    monkeypatch.setattr(zygote, "_shared", forker)

    def start(code: str, *args: str) -> Job:
        module = f"ranks_{request.node.name.replace('[', '_').replace(']', '').replace('-', '_')}"
        (scripts / f"{module}.py").write_text(code)
        return Job([sys.executable, "-m", module, *args], {"MASTER_PORT": str(free_port())}, preloaded=True, ranks=2)
    return start


def _report(rank: int, error: ErrorInfo | None = None) -> RankReport:
    return RankReport(case_id="x", fidelity="tiny", rank=rank, world_size=2, platform="cpu", device_name="cpu",
                      step=Memory(allocated=1000), error=error)


# --- (a) a rank killed mid-step ------------------------------------------------------------------------

_STEPPING_RANKS = '''
import os, signal, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from harness.measure.records import ErrorInfo, Failure, Memory, RankReport

out = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
(out / f"pid{rank}").write_text(str(os.getpid()))
t = torch.ones(4)
try:
    for step in range(10_000):
        dist.all_reduce(t)
        if rank == 1 and step == 5:
            os.kill(os.getpid(), getattr(signal, sys.argv[2]))
        time.sleep(0.02)
except Exception as exc:  # as the worker does: the survivor reports what it saw of its peer's death
    report = RankReport(case_id="x", fidelity="tiny", rank=rank, world_size=2, platform="cpu", device_name="cpu",
                        step=Memory(allocated=4096), error=ErrorInfo(kind=Failure.crash, message=str(exc)[:300]))
    (out / f"rank{rank}.json").write_text(report.model_dump_json())
    sys.exit(1)
'''


@pytest.mark.parametrize("sig, kind", [("SIGKILL", Failure.host_oom), ("SIGSEGV", Failure.crash)])
def test_a_rank_killed_mid_step_fails_the_case_naming_the_rank_and_its_signal(tmp_path, sig, kind, still_running,
                                                                               two_ranks):
    """One of two ranks dies of a signal while they all-reduce: the case names that rank and signal
    (not its peer's "Connection closed by peer"), the other rank is stopped, and nothing is left."""
    out = tmp_path / "run"
    out.mkdir()
    started = time.monotonic()
    run = run_jobs([two_ranks(_STEPPING_RANKS, str(out), sig)], out, 120, "x", "tiny", 2)
    assert time.monotonic() - started < 60
    assert run.error is not None and run.error.kind == kind
    assert f"rank 1 (pid {(out / 'pid1').read_text()}) was killed by {sig}" in run.error.message
    assert "stopped the other ranks" in run.error.message
    assert run.first_error() is run.error
    assert [r.rank for r in run.ranks if r.error] in ([0], [])  # the survivor's report, when it wrote one, is kept
    assert still_running([int((out / f"pid{r}").read_text()) for r in (0, 1)], 10) == []


@BESIDE_THE_CASES
def test_a_worker_stopped_by_its_launcher_keeps_what_it_measured(tmp_path, _beside):
    """The real worker, sent SIGTERM mid-step (as torchrun and DeepSpeed's launcher stop the other
    ranks once one has died), writes its report with the figures so far and why it stopped."""
    import threading

    from harness.spec.cases import CASES_DIR

    case = CASES_DIR / "003-qlora-fix-r16-seq512-gc.yaml"
    job = Job([sys.executable, "-m", "harness.runtime.worker", "--case", str(case), "--out-dir", str(tmp_path),
               "--steps", "1000"])
    result = {}
    thread = threading.Thread(target=lambda: result.update(run=run_jobs([job], tmp_path, 300, "x", "tiny", 1)))
    thread.start()
    log = tmp_path / "log.txt"
    deadline = time.monotonic() + 120
    while "step 3/1000" not in (log.read_text() if log.exists() else ""):
        assert thread.is_alive() and time.monotonic() < deadline, "the worker did not reach its third step"
        time.sleep(0.1)
    (worker,) = [p for p in psutil.Process().children()
                 if "harness.runtime.worker" in p.cmdline() and str(tmp_path) in p.cmdline()]
    worker.send_signal(signal.SIGTERM)
    thread.join(60)
    (rank,) = result["run"].ranks
    assert rank.error.kind == Failure.crash and rank.error.phase == "step"
    assert "stopped by SIGTERM" in rank.error.message
    assert rank.load is not None and rank.load.allocated > 0
    assert rank.step is not None and rank.step.allocated > 0 and len(rank.step_times_s) >= 3


def test_a_stop_swallowed_by_a_finalizer_stops_the_worker_at_its_next_progress_line(monkeypatch):
    """SIGTERM landing while Python runs a finalizer (a garbage collection mid-step): Python prints the
    handler's exception and goes on, so the worker asks again at each progress line and stops there."""
    import weakref

    from harness.runtime import worker

    monkeypatch.setattr(worker, "_stopped_by", None)

    class Tensorish:
        pass

    held = Tensorish()
    weakref.finalize(held, worker._stop, signal.SIGTERM, None)
    del held  # the finalizer runs the handler; its Stopped is printed and ignored
    assert worker._stopped_by == signal.SIGTERM
    with pytest.raises(worker.Stopped, match="stopped by SIGTERM"):
        worker._stop_if_asked()


_DEEPSPEED_LOG = """\
[INFO] [launch.py:245:main] process 100 spawned with command: ['python', '-m', 'worker', '--local_rank=0']
[INFO] [launch.py:245:main] process 101 spawned with command: ['python', '-m', 'worker', '--local_rank=1']
[INFO] [launch.py:253:sigkill_handler] Killing subprocess 100
[INFO] [launch.py:253:sigkill_handler] Killing subprocess 101
[ERROR] [launch.py:259:sigkill_handler] ['python', '-m', 'worker', '--local_rank=1'] exits with return code = -9
"""


def test_deepspeeds_launcher_names_no_rank_so_the_one_without_a_report_is_named():
    """DeepSpeed's launcher prints its last rank's command with whichever rank's exit code: the
    rank killed is the one that wrote no report (the stopped ones write theirs)."""
    from harness.runtime.launcher import classify

    stopped = _report(1, ErrorInfo(kind=Failure.crash, message="Stopped: stopped by SIGTERM", phase="step"))
    error = classify(False, 60, [1], [stopped], _DEEPSPEED_LOG, 2)
    assert error.kind == Failure.host_oom and error.message.startswith("rank 0 was killed by SIGKILL")
    both = [_report(0, ErrorInfo(kind=Failure.crash, message="ValueError: bad target")), stopped]
    assert classify(False, 60, [1], both, _DEEPSPEED_LOG.replace("-9", "1"), 2) is None  # their reports say it


# --- (b) a rank hung in a collective -----------------------------------------------------------------------

_HANGING_RANKS = '''
import os, sys, time
from pathlib import Path
from harness.runtime.process_tree import STACK_DUMP_ENV, arm_stack_dump, exit_with_owner

exit_with_owner()
import torch, torch.distributed as dist

out = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
(out / f"pid{rank}").write_text(str(os.getpid()))
# the worker arms its dump at its start, for shortly before the launcher's deadline; here it is armed
# once each rank is where it hangs, so a slow start on a loaded host cannot dump it elsewhere
os.environ[STACK_DUMP_ENV] = "1"
arm_stack_dump(out, rank)


def wait_for_the_peer():
    dist.all_reduce(torch.ones(4))


def stall_before_the_collective():
    time.sleep(600)


stall_before_the_collective() if rank == 1 else wait_for_the_peer()
'''


def test_a_rank_hung_in_a_collective_is_stopped_and_each_rank_is_named_where_it_was(tmp_path, still_running,
                                                                                    two_ranks, request):
    out = tmp_path / "run"
    out.mkdir()
    started = time.monotonic()
    # torchrun's three interpreters import torch before the ranks hang; forked ranks have it imported
    limit = 15 if request.node.callspec.params["two_ranks"] == "torchrun" else 8
    run = run_jobs([two_ranks(_HANGING_RANKS, str(out))], out, limit, "x", "tiny", 2)
    assert time.monotonic() - started < 45
    assert run.error is not None and run.error.kind == Failure.timeout
    message = run.error.message
    assert "rank 0 stuck at" in message, message
    assert "rank 0 stuck at" in message and "in all_reduce" in message.split("rank 0 stuck at")[1].split(";")[0]
    assert "rank 1 stuck at" in message and "in stall_before_the_collective" in message.split("rank 1 stuck at")[1]
    log = Path(run.run_dir, "log.txt").read_text()
    assert "the stacks of rank 0 before the timeout" in log and "the stacks of rank 1 before the timeout" in log
    assert still_running([int((out / f"pid{r}").read_text()) for r in (0, 1)], 10) == []


# --- (c) a worker that prints nothing and writes no report -----------------------------------------------------


def _job(code: str) -> Job:
    return Job([sys.executable, "-c", textwrap.dedent(code)])


def test_a_silent_exit_without_a_report_says_the_log_is_empty(tmp_path):
    run = run_jobs([_job("pass")], tmp_path, 60, "x", "tiny", 1)
    assert run.error.kind == Failure.no_report
    assert "wrote 0 of 1 reports" in run.error.message
    assert "log.txt is empty" in run.error.message


def test_a_silent_failure_without_a_report_is_a_crash_that_says_the_log_is_empty(tmp_path):
    run = run_jobs([_job("import sys; sys.exit(7)")], tmp_path, 60, "x", "tiny", 1)
    assert run.error.kind == Failure.crash
    assert "exit codes [7]" in run.error.message and "log.txt is empty" in run.error.message


def test_an_exit_without_a_report_quotes_the_end_of_the_log(tmp_path):
    run = run_jobs([_job("print('loading the model'); print('giving up quietly')")], tmp_path, 60, "x", "tiny", 1)
    assert run.error.kind == Failure.no_report
    assert "the log ends: loading the model | giving up quietly" in run.error.message


@BESIDE_THE_CASES
def test_a_worker_hanging_silently_times_out_saying_it_printed_nothing(tmp_path, _beside):
    started = time.monotonic()
    run = run_jobs([_job("import time; time.sleep(600)")], tmp_path, 3, "x", "tiny", 1)
    assert time.monotonic() - started < 20
    assert run.error.kind == Failure.timeout
    assert "log.txt is empty" in run.error.message


def test_a_half_written_report_is_a_missing_report_not_a_crash_of_the_harness(tmp_path):
    """A report cut short (a full disk, a process killed mid-write by an older worker) is named."""
    code = f"open({str(tmp_path / 'rank0.json')!r}, 'w').write('{{\"case_id\": \"x\", \"fidel')"
    run = run_jobs([_job(code)], tmp_path, 60, "x", "tiny", 1)
    assert run.error.kind == Failure.no_report
    assert "rank0.json is not a readable report" in run.error.message
    assert run.ranks == []


# --- (d) a foreign process holding memory on the card ------------------------------------------------------------


def test_the_free_memory_at_the_start_counts_the_process_own_context():
    from harness.runtime.measurement import card_room

    def read_free(device):  # a 80 GiB card on which another process holds 70 GiB
        assert device == "cuda:0"
        return int(10 * GIB), int(80 * GIB)

    assert card_room("cuda:0", int(0.5 * GIB), read_free) == int(10.5 * GIB)
    assert card_room("cuda:0", None, read_free) == int(10 * GIB)


def _oom_run(free: int | None, card: int = int(16 * GIB)) -> CaseRun:
    oom = ErrorInfo(kind=Failure.oom, message="CUDA out of memory. Tried to allocate 2.32 GiB", phase="step")
    rank = _report(0, oom)
    rank.fidelity, rank.world_size, rank.platform, rank.emulated_card_bytes = "real", 1, "cuda", card
    rank.card_free_at_start = free
    return CaseRun(case_id="003-qlora-fix-r16-seq512-gc", fidelity="real", command=[], returncode=3, wall_s=1.0,
                   ranks=[rank])


def test_an_oom_on_a_card_another_process_holds_does_not_blame_the_config():
    from harness.judge.verdicts import check_outcome, on_a_short_card
    from harness.spec.cases import CASES_DIR, load_case

    case = load_case(CASES_DIR / "003-qlora-fix-r16-seq512-gc.yaml")  # expects to fit a 16 GB card
    short = _oom_run(free=int(9.5 * GIB), card=case.target.card.memory)
    assert short.card_shortfall() == (int(9.5 * GIB), case.target.card.memory)
    verdict = on_a_short_card(check_outcome(case, short), short)
    assert verdict.status == "not_checkable"
    assert "9.50 GiB free at the start" in verdict.detail and "another process held memory" in verdict.detail
    # the same OOM with the card free is the config's
    free = _oom_run(free=case.target.card.memory + int(0.01 * GIB), card=case.target.card.memory)
    assert free.card_shortfall() is None
    assert on_a_short_card(check_outcome(case, free), free).status == "refuted"


def test_jobs_sharing_a_card_record_what_the_ballast_left_them():
    run = CaseRun(case_id="x", fidelity="real", command=[], returncode=0, wall_s=1.0, ranks=[_report(0)],
                  emulated_card_bytes=int(24 * GIB), card_free_at_start=int(24 * GIB) - 2 * 2**20)
    assert run.card_shortfall() is None  # the ballast's last block rounds: not another process
    run.card_free_at_start = int(20 * GIB)
    assert run.card_shortfall() == (int(20 * GIB), int(24 * GIB))


@pytest.mark.gpu
def test_fault_a_foreign_process_on_the_card_is_recorded_and_not_blamed_on_the_config(tmp_path):
    """On a CUDA card: another process takes all but 1 GiB; a run emulating a 4 GiB card records
    the shortfall, its worker says so in the log, and an OOM there is not the config's."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA card")
    from harness.judge.verdicts import check_outcome, on_a_short_card
    from harness.runtime.launcher import run_case
    from harness.runtime.platform import detect
    from harness.spec.cases import CASES_DIR, load_case

    ready = tmp_path / "held"
    hog = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time, torch
        free, _ = torch.cuda.mem_get_info(0)
        held = torch.empty(free - (1 << 30), dtype=torch.uint8, device="cuda:0")
        open({str(ready)!r}, "w").write("held")
        time.sleep(600)
    """)])
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert hog.poll() is None and time.monotonic() < deadline, "the foreign process could not take the card"
            time.sleep(0.2)
        path = CASES_DIR / "003-qlora-fix-r16-seq512-gc.yaml"
        case = load_case(path)
        run = run_case(case, path, "tiny", tmp_path / "run", detect(), timeout_s=300, steps=2,
                       emulate_card_bytes=4 * 2**30)
        (rank,) = run.ranks
        assert rank.card_free_at_start is not None and rank.card_free_at_start < 2 * 2**30
        assert run.card_shortfall() is not None
        assert "less than the emulated 4.00 GiB card" in Path(run.run_dir, "log.txt").read_text()
        err = run.first_error()
        if err is not None and err.kind == Failure.oom:
            assert on_a_short_card(check_outcome(case, run), run).status == "not_checkable"
    finally:
        hog.kill()
        hog.wait()


# --- (e) a full disk while writing results ------------------------------------------------------------------------

_FULL_DISK = '''
import errno, os, pathlib, sys


def full(fd):  # every file written whole (harness.spec.files.write_atomic) meets a full disk
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


os.fsync = full
'''


def test_a_full_disk_for_a_workers_report_is_a_write_error_naming_the_file(tmp_path):
    """The real worker's report writing, on a disk that is full: a clear write_error, no
    half-written report left behind, and the harness goes on."""
    code = _FULL_DISK + textwrap.dedent(f"""
        from harness.measure.records import RankReport
        from harness.runtime.reports import EXIT_NO_REPORT, write_report
        report = RankReport(case_id="x", fidelity="tiny", rank=0, world_size=1, platform="cpu", device_name="cpu")
        ok = write_report(report, pathlib.Path({str(tmp_path)!r}) / "rank0.json")
        sys.exit(0 if ok else EXIT_NO_REPORT)
    """)
    run = run_jobs([Job([sys.executable, "-c", code])], tmp_path, 60, "x", "tiny", 1)
    assert run.error.kind == Failure.write_error
    assert "could not write its report" in run.error.message and "rank0.json" in run.error.message
    assert "No space left on device" in run.error.message
    assert not list(tmp_path.glob("rank0.*"))


@BESIDE_THE_CASES
def test_a_real_worker_on_a_full_disk_exits_with_its_own_code(tmp_path, _beside):
    """End to end through worker.main: a run that fails at load on a tiny emulated card, whose
    report then meets a full disk, is classified as the disk, not as the worker's crash."""
    from harness.spec.cases import CASES_DIR

    case = CASES_DIR / "003-qlora-fix-r16-seq512-gc.yaml"
    code = _FULL_DISK + "from harness.runtime import worker\nsys.exit(worker.main(sys.argv[1:]))\n"
    job = Job([sys.executable, "-c", code, "--case", str(case), "--out-dir", str(tmp_path), "--steps", "1",
               "--emulate-card-bytes", str(64 * 1024)])
    run = run_jobs([job], tmp_path, 300, "x", "tiny", 1)
    assert run.returncode == 5
    assert run.error.kind == Failure.write_error and "No space left on device" in run.error.message


def test_a_run_folder_that_cannot_be_made_is_a_write_error_not_a_crash(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the run's folder should go")
    run = run_jobs([_job("pass")], blocker / "run", 60, "x", "tiny", 1)
    assert run.error.kind == Failure.write_error
    assert str(blocker / "run") in run.error.message


def test_a_full_disk_for_the_run_record_fails_that_case_and_the_next_case_runs(tmp_path, monkeypatch):
    import pathlib

    import harness.judge.session as session_module
    from harness.judge.session import Session
    from harness.spec.cases import CASES_DIR

    def fake_run_case(case, path, fidelity, out, *args, **kwargs):
        out.mkdir(parents=True, exist_ok=True)
        return CaseRun(case_id=case.id, fidelity=fidelity, command=["worker"], returncode=0, wall_s=1.0,
                       ranks=[_report(0)], run_dir=str(out))

    from harness.spec import files

    real_mkstemp = files.tempfile.mkstemp
    full_for = {"003-qlora-fix-r16-seq512-gc"}

    def mkstemp(*args, dir=None, **kwargs):  # the disk of that case's folder is full
        if pathlib.Path(dir).name in full_for:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(session_module, "run_case", fake_run_case)
    monkeypatch.setattr(files.tempfile, "mkstemp", mkstemp)
    session = Session(case_dir=CASES_DIR, run_root=tmp_path)
    first = session.run("003-qlora-fix-r16-seq512-gc", "tiny")
    assert first.error.kind == Failure.write_error
    assert "run.json could not be written: No space left on device" in first.error.message
    assert first.ranks[0].step.allocated == 1000  # what was measured stays in the session
    assert not list((tmp_path / "tiny" / "003-qlora-fix-r16-seq512-gc").glob("run.*"))
    judged = session.judge("003-qlora-fix-r16-seq512-gc", "tiny")
    assert judged.outcome.status == "refuted" and "write_error" in judged.outcome.detail
    second = session.run("003-qlora-fix-r32-seq1024-gc", "tiny")
    assert second.error is None
    assert (tmp_path / "tiny" / "003-qlora-fix-r32-seq1024-gc" / "run.json").is_file()


def test_a_full_disk_for_the_json_of_a_run_is_said_and_the_cases_go_on(tmp_path, monkeypatch, capsys):

    from harness.cli.run import _write_json
    from harness.judge.session import Session
    from harness.spec import files
    from harness.spec.cases import CASES_DIR

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    session = Session(case_dir=CASES_DIR, run_root=tmp_path / "runs")
    with monkeypatch.context() as disk:
        disk.setattr(files.os, "fsync", full)
        assert _write_json(tmp_path / "runs.json", session) is False
    said = capsys.readouterr().err
    assert f"run: --json {tmp_path / 'runs.json'} could not be written: No space left on device" in said
    assert str(tmp_path / "runs") in said
    assert _write_json(tmp_path / "runs.json", session) is True and (tmp_path / "runs.json").read_text() == "[]"


# --- (f) the harness itself killed ---------------------------------------------------------------------------------


def test_a_killed_harness_leaves_no_job_and_the_next_run_in_its_folder_starts_clean(tmp_path):
    """SIGKILL of the harness mid-run: its job exits (it watches its owner), and the next run in the
    same folder removes what was left (a half-written report, a probe lock, an earlier report),
    so none of it is read as the new run's result."""
    out = tmp_path / "run"
    pid_file = tmp_path / "job.pid"
    job_code = textwrap.dedent(f"""
        import os, time
        from harness.runtime.process_tree import exit_with_owner
        exit_with_owner(0.1)
        out = {str(out)!r}
        open(os.path.join(out, "rank0.json"), "w").write('{{"case_id": "x"}}')  # an earlier, corrupt report
        open(os.path.join(out, "rank1.tmp"), "w").write("half")
        open(os.path.join(out, "probes-card0.lock"), "w").close()
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        time.sleep(120)
    """)
    harness_code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from harness.runtime.launcher import Job, run_jobs
        run_jobs([Job([sys.executable, "-c", {job_code!r}])], Path({str(out)!r}), 120, "x", "tiny", 1)
    """)
    harness = subprocess.Popen([sys.executable, "-c", harness_code])
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and harness.poll() is None
            time.sleep(0.05)
        job = psutil.Process(int(pid_file.read_text()))
        harness.send_signal(signal.SIGKILL)
        harness.wait()
        job.wait(timeout=10)  # raises psutil.TimeoutExpired if it outlives the harness
    finally:
        harness.kill()
        harness.wait()
    assert {p.name for p in out.iterdir()} >= {"rank0.json", "rank1.tmp", "probes-card0.lock"}
    run = run_jobs([_job("pass")], out, 60, "x", "tiny", 1)
    assert run.error.kind == Failure.no_report and run.ranks == []
    assert not (out / "rank1.tmp").exists() and not (out / "probes-card0.lock").exists()
    assert "removed 3 files an earlier run left" in run.log_tail


def test_a_killed_harness_leaves_the_card_lock_free_for_the_next(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_LOCK_DIR", str(tmp_path / "locks"))
    holder = _lock_holder(tmp_path, "host-test")
    from harness.runtime import card_lock

    with pytest.raises(card_lock.CardBusy):
        card_lock.take(["host-test"])
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    card_lock.take(["host-test"])  # at once: the kernel released the dead holder's lock
    assert card_lock.held() == {"host-test"}
    card_lock.release()


# --- (g) a second harness on the same card ----------------------------------------------------------------------


def _lock_holder(tmp_path: Path, key: str) -> subprocess.Popen:
    """Another harness process holding a card's lock."""
    ready = tmp_path / f"holding-{key}"
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from harness.runtime import card_lock
        card_lock.take([{key!r}])
        open({str(ready)!r}, "w").close()
        time.sleep(120)
    """)], env=dict(os.environ))
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    return proc


def test_a_second_harness_is_refused_a_card_another_is_measuring(tmp_path, monkeypatch):
    from harness.runtime import card_lock

    monkeypatch.setenv("HARNESS_LOCK_DIR", str(tmp_path / "locks"))
    assert card_lock.card_keys("cpu", 0) == []  # a CPU host makes no full-size run: nothing to lock
    key = "GPU-5a1f0c3e-test"
    holder = _lock_holder(tmp_path, key)
    try:
        with pytest.raises(card_lock.CardBusy) as refused:
            card_lock.take([key])
        message = str(refused.value)
        assert f"card {key} is being measured by another harness, pid {holder.pid}" in message
        assert "--wait-for-card" in message
    finally:
        holder.kill()
        holder.wait()


def test_a_second_harness_asked_to_wait_says_so_and_takes_the_card_once_free(tmp_path, monkeypatch):
    import threading

    from harness.runtime import card_lock

    monkeypatch.setenv("HARNESS_LOCK_DIR", str(tmp_path / "locks"))
    holder = _lock_holder(tmp_path, "gpu-a")
    said = []
    try:
        with pytest.raises(card_lock.CardBusy, match="after waiting 1 s"):
            card_lock.take(["gpu-a"], wait_s=1, say=said.append)
        threading.Timer(1.0, holder.kill).start()
        started = time.monotonic()
        card_lock.take(["gpu-a"], wait_s=60, say=said.append)
        assert 0.5 < time.monotonic() - started < 30
        assert card_lock.held() == {"gpu-a"}
        assert said and f"pid {holder.pid}" in said[0] and "waiting up to" in said[0]
        card_lock.release()
    finally:
        holder.kill()
        holder.wait()


def test_a_full_size_run_on_a_card_another_harness_holds_is_refused_as_card_busy(tmp_path, monkeypatch):
    """Through the session: the refusal is the case's result, named, and no process starts."""
    import harness.judge.session as session_module
    from harness.judge.session import Session
    from harness.runtime.platform import Platform
    from harness.spec.cases import CASES_DIR

    monkeypatch.setenv("HARNESS_LOCK_DIR", str(tmp_path / "locks"))
    started = []
    monkeypatch.setattr(session_module, "run_case", lambda *a, **k: started.append(a))
    monkeypatch.setattr(session_module.card_lock, "card_keys", lambda platform, count: ["gpu-b"])
    holder = _lock_holder(tmp_path, "gpu-b")
    try:
        session = Session(case_dir=CASES_DIR, run_root=tmp_path / "runs")
        session.platform, session.accelerators = Platform.cuda, 1
        run = session.run("003-qlora-fix-r16-seq512-gc", "real")
        assert run.error.kind == Failure.card_busy and f"pid {holder.pid}" in run.error.message
        assert started == []
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.gpu
def test_fault_ballast_exits_when_its_harness_is_killed(tmp_path):
    """On a CUDA card: the ballast a card-sharing run starts holds the card's spare memory; killing
    the harness with SIGKILL frees the card within seconds."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA card")
    pid_file = tmp_path / "ballast.pid"
    harness_code = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from harness.runtime.launcher import _start_ballast
        with open({str(tmp_path / 'log.txt')!r}, "wb") as log:
            proc, free = _start_ballast(4 << 30, Path({str(tmp_path)!r}), log)
        open({str(pid_file)!r}, "w").write(str(proc.pid))
        time.sleep(600)
    """)
    harness = subprocess.Popen([sys.executable, "-c", harness_code])
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text():
            assert harness.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        ballast = psutil.Process(int(pid_file.read_text()))
        harness.send_signal(signal.SIGKILL)
        harness.wait()
        ballast.wait(timeout=15)
    finally:
        harness.kill()
        harness.wait()


@pytest.mark.gpu
def test_fault_cards_are_locked_by_their_uuid_and_a_second_harness_is_refused(tmp_path, monkeypatch):
    """On a CUDA host: the cards are named by NVML's UUID, and `oom-harness run --fidelity real`
    while another harness holds them ends at once with card_busy, starting no worker."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA card")
    from harness.runtime import card_lock

    monkeypatch.setenv("HARNESS_LOCK_DIR", str(tmp_path / "locks"))
    keys = card_lock.card_keys("cuda", torch.cuda.device_count())
    assert len(keys) == torch.cuda.device_count()
    pytest.importorskip("pynvml")
    assert all(k.startswith(("GPU-", "MIG-")) for k in keys), keys
    holders = [_lock_holder(tmp_path, key) for key in keys]
    try:
        started = time.monotonic()
        cli = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--fidelity", "real",
                              "-k", "003-qlora-fix-r16-seq512-gc", "--out", str(tmp_path / "runs")],
                             capture_output=True, text=True, timeout=300)
        assert cli.returncode == 1, cli.stdout + cli.stderr
        assert "card_busy" in cli.stdout
        assert time.monotonic() - started < 120
        assert not list((tmp_path / "runs").rglob("log.txt"))  # no worker started
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()
