"""The launcher classifies whatever a case's processes do, and never crashes itself."""

import os
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from harness.measure.clocks import host_cpu
from harness.measure.records import Failure, RankReport
from harness.runtime.launcher import Job, free_port, plan_jobs, run_case, run_jobs
from harness.runtime.platform import Platform
from harness.spec.cases import CASES_DIR, load_case
from harness.spec.units import GIB

# Runs these tests in the worker of the case items under `-n 2 --dist loadgroup` (the parameter id is
# harness.pytest_plugin.xdist_groups.GROUP): there `bundled_session` is theirs and so are the worker
# zygotes (a zygote's imports are 6-7 CPU-s, once per process), and a test that mostly waits on a
# timeout it provokes waits while their tiny runs go on in the background.
BESIDE_THE_CASES = pytest.mark.parametrize("_beside", [pytest.param(None, id="oom-harness-cases")])


def _job(code: str) -> Job:
    return Job([sys.executable, "-c", textwrap.dedent(code)])


def test_a_process_that_raises_is_a_crash_with_its_error_line(tmp_path):
    run = run_jobs([_job("raise ValueError('bad lora target: q_projj')")], tmp_path, 60, "x", "tiny", 1)
    assert run.error.kind == Failure.crash
    assert "bad lora target: q_projj" in run.error.message
    assert run.returncode == 1


def test_an_out_of_memory_is_classified_with_the_requested_size(tmp_path):
    code = """
        import sys
        sys.stderr.write('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.32 GiB. '
                         'GPU 0 has a total capacity of 15.77 GiB\\n')
        sys.exit(1)
    """
    run = run_jobs([_job(code)], tmp_path, 60, "x", "tiny", 1)
    assert run.error.kind == Failure.oom
    assert run.error.tried_to_allocate == int(2.32 * GIB)


@BESIDE_THE_CASES
def test_a_hang_past_the_timeout_is_killed_with_its_children(tmp_path, _beside):
    code = """
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])
        open(sys.argv[1], 'w').write(str(child.pid))
        time.sleep(600)
    """
    pid_file = tmp_path / "child.pid"
    job = Job([sys.executable, "-c", textwrap.dedent(code), str(pid_file)])
    started = time.monotonic()
    run = run_jobs([job], tmp_path / "run", 3, "x", "tiny", 1)
    assert time.monotonic() - started < 30
    assert run.error.kind == Failure.timeout
    assert "3 s" in run.error.message
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the grandchild outlived the timeout"
        time.sleep(0.1)


def test_a_process_killed_by_sigkill_points_at_host_memory(tmp_path):
    run = run_jobs([_job("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")], tmp_path, 60, "x", "tiny", 1)
    assert run.error.kind == Failure.host_oom
    assert "SIGKILL" in run.error.message


def test_a_silent_success_without_reports_is_not_a_pass(tmp_path):
    run = run_jobs([_job("pass")], tmp_path, 60, "x", "tiny", 2)
    assert run.error.kind == Failure.no_report
    assert not run.ok


def test_jobs_sharing_a_card_start_together_with_their_slots(tmp_path):
    case = load_case(CASES_DIR / "004-gla-plan-a-minimal.yaml")
    jobs = plan_jobs(case, CASES_DIR / "004-gla-plan-a-minimal.yaml", "tiny", 1, tmp_path, Platform.cpu)
    assert len(jobs) == 2
    assert [j.argv[j.argv.index("--slot") + 1] for j in jobs] == ["0", "1"]
    assert all(j.env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True" for j in jobs)
    assert jobs[0].env["MASTER_PORT"] != jobs[1].env["MASTER_PORT"]


def test_several_ranks_are_started_by_the_launcher_on_a_cpu_and_by_torchrun_on_a_gpu(tmp_path):
    """On a CPU the launcher starts each rank of the worker itself, with torchrun's environment
    (harness.runtime.ranks); a GPU host keeps torchrun, or DeepSpeed's launcher where the case names it."""
    path = CASES_DIR / "002-gemma27b-full-z3-offload-len2048.yaml"
    (job,) = plan_jobs(load_case(path), path, "tiny", 2, tmp_path, Platform.cpu)
    assert job.argv[1:3] == ["-m", "harness.runtime.worker"] and job.ranks == 2
    assert {k: job.env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    (job,) = plan_jobs(load_case(path), path, "real", 2, tmp_path, Platform.cuda)  # launched as its guide says
    assert job.argv[1:3] == ["-m", "deepspeed.launcher.runner"] and job.ranks == 1
    assert job.argv[job.argv.index("--num_gpus") + 1] == "2"
    z3 = CASES_DIR / "000-lora-z3-offload-cutoff1024-ga16.yaml"
    (job,) = plan_jobs(load_case(z3), z3, "real", 2, tmp_path, Platform.cuda)
    assert job.argv[1:3] == ["-m", "torch.distributed.run"] and job.ranks == 1
    assert job.argv[job.argv.index("--nproc-per-node") + 1] == "2"
    (job,) = plan_jobs(load_case(z3), z3, "tiny", 2, tmp_path, Platform.cpu)
    assert job.argv[1:3] == ["-m", "harness.runtime.worker"] and job.ranks == 2


def test_full_size_processes_share_the_cores_and_tiny_ones_take_one(tmp_path, monkeypatch):
    import harness.runtime.launcher as launcher

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda pid: set(range(16)))
    gemma = CASES_DIR / "002-gemma27b-full-z3-offload-len2048.yaml"
    (job,) = plan_jobs(load_case(gemma), gemma, "real", 2, tmp_path, Platform.cuda)
    assert job.env["OMP_NUM_THREADS"] == "8"  # 2 ranks on 16 cores, not torchrun's 1
    qlora = CASES_DIR / "003-qlora-fix-r16-seq512-gc.yaml"
    (job,) = plan_jobs(load_case(qlora), qlora, "real", 1, tmp_path, Platform.cuda)
    assert job.env["OMP_NUM_THREADS"] == "16"
    gla = CASES_DIR / "004-gla-plan-b-bs2.yaml"  # guide 004 sets OMP_NUM_THREADS=1 itself: the case's word holds
    assert {j.env["OMP_NUM_THREADS"]
            for j in plan_jobs(load_case(gla), gla, "real", 1, tmp_path, Platform.cuda)} == {"1"}
    (job,) = plan_jobs(load_case(gemma), gemma, "tiny", 2, tmp_path, Platform.cpu)
    assert job.env["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's setting wins
    (job,) = plan_jobs(load_case(gemma), gemma, "real", 2, tmp_path, Platform.cuda)
    assert job.env["OMP_NUM_THREADS"] == "3"


@BESIDE_THE_CASES
def test_a_real_worker_out_of_memory_becomes_a_report_with_numbers(tmp_path, _beside):
    """End to end: the worker runs a case on an emulated card far too small and reports an OOM
    with the phase and the bytes, and the launcher keeps going."""
    path = CASES_DIR / "003-qlora-fix-r16-seq512-gc.yaml"
    case = load_case(path)
    run = run_case(case, path, "tiny", tmp_path, Platform.cpu, timeout_s=300, steps=2,
                   emulate_card_bytes=64 * 1024)
    assert run.returncode == 3
    (rank,) = run.ranks
    assert isinstance(rank, RankReport)
    assert rank.error.kind == Failure.oom
    assert rank.error.phase == "load"
    assert "emulated card" in rank.error.message
    assert rank.step.allocated > 64 * 1024
    assert rank.host_cpu == host_cpu() and rank.host_cpu  # speed depends on the host; Linux names its CPU
    assert rank.clocks is None  # a CPU run has no card clock
    assert Path(run.run_dir, "log.txt").is_file()


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))


def test_stopping_the_harness_kills_the_running_case(tmp_path, still_running):
    """A run interrupted from outside (SIGTERM to the CLI, Ctrl-C) takes its process groups with it."""
    import threading

    code = """
        import sys, time
        open(sys.argv[1], 'w').write('started')
        time.sleep(600)
    """
    marker = tmp_path / "started"
    job = Job([sys.executable, "-c", textwrap.dedent(code), str(marker)])
    pids = []
    real_popen = __import__("subprocess").Popen

    def spy(*a, **k):
        p = real_popen(*a, **k)
        if a and a[0] == job.argv:  # not a process some other test's background thread starts
            pids.append(p.pid)
        return p

    def interrupt():
        while not marker.exists():
            time.sleep(0.05)
        import _thread
        _thread.interrupt_main()

    import signal

    import harness.runtime.launcher as launcher

    launcher.subprocess.Popen, saved = spy, launcher.subprocess.Popen
    # a pytest started in the background by a shell (`pytest &`, CI scripts) inherits SIGINT ignored,
    # and interrupt_main() then does nothing: Ctrl-C is what this test stands for
    saved_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            run_jobs([job], tmp_path / "run", 120, "x", "tiny", 1)
    finally:
        launcher.subprocess.Popen = saved
        signal.signal(signal.SIGINT, saved_handler)
    assert len(pids) == 1 and still_running(pids, 5) == []


@BESIDE_THE_CASES
def test_a_timeout_kills_torchruns_ranks_too(tmp_path, still_running, _beside):
    """torchrun starts each rank in a session of its own; killing torchrun's group used to leave
    the ranks running (on a GPU: holding the card the next case measures)."""
    script = tmp_path / "rank.py"
    script.write_text("import os, time\n"
                      "open(os.path.join(os.path.dirname(__file__), 'pid' + os.environ['RANK']), 'w')"
                      ".write(str(os.getpid()))\n"
                      "time.sleep(600)\n")
    job = Job([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               str(script)])
    run = run_jobs([job], tmp_path / "run", 10, "x", "tiny", 2)
    assert run.error.kind == Failure.timeout
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
    assert still_running(pids, 5) == [], "torchrun's ranks outlived the timeout"


@BESIDE_THE_CASES
def test_a_timeout_names_the_line_the_worker_hung_on(tmp_path, _beside):
    """The worker arms a stack dump for shortly before the launcher's deadline; on a timeout the
    error says where the main thread was and what the worker last reported."""
    case_path = CASES_DIR / "003-qlora-fix-r16-seq512-gc.yaml"
    code = """
        import sys, threading, time
        import harness.runtime.worker as worker

        def wait_for_a_lock_nobody_releases(args):
            print('[harness.runtime.worker] 003 rank 0 slot 0: loaded, 3.48 GiB peak allocated (1.0 s)', flush=True)
            threading.Thread(target=time.sleep, args=(600,), daemon=True).start()  # a sampler-like thread
            while True:
                time.sleep(0.1)

        worker.run = wait_for_a_lock_nobody_releases
        worker.main(sys.argv[1:5])
    """
    job = Job([sys.executable, "-c", textwrap.dedent(code), "--case", str(case_path), "--out-dir", str(tmp_path)])
    run = run_jobs([job], tmp_path, 8, "x", "tiny", 1)
    assert run.error.kind == Failure.timeout
    assert "in wait_for_a_lock_nobody_releases" in run.error.message
    assert "last progress: '[harness.runtime.worker] 003 rank 0 slot 0: loaded" in run.error.message
    assert "most recent call first" in Path(run.run_dir, "log.txt").read_text()


def test_where_stuck_reads_the_main_thread_among_the_dumped_threads():
    from harness.runtime.process_tree import where_stuck

    dump = textwrap.dedent('''\
        Current thread 0x00007f26614496c0 (most recent call first):
          File "/usr/lib/python3.12/threading.py", line 359 in wait
          File "/work/harness/measure/trackers.py", line 270 in _run
          File "/usr/lib/python3.12/threading.py", line 1012 in run
          File "/usr/lib/python3.12/threading.py", line 1045 in _bootstrap_inner
          File "/usr/lib/python3.12/threading.py", line 1002 in _bootstrap

        Thread 0x00007f266228bb80 (most recent call first):
          File "/site/lib/python3.12/site-packages/torch/utils/file_baton.py", line 49 in wait
          File "/site/lib/python3.12/site-packages/torch/utils/cpp_extension.py", line 2380 in _jit_compile
          File "/work/harness/runtime/worker.py", line 383 in run
          File "/usr/lib/python3.12/runpy.py", line 88 in _run_code
        ''')
    assert where_stuck(dump) == "torch/utils/file_baton.py:49 in wait (from harness/runtime/worker.py:383 in run)"
    assert where_stuck("no dump in this log\n") is None


def test_a_jit_build_lock_nobody_holds_is_removed_before_a_run(tmp_path):
    """A build killed mid-way leaves torch's FileBaton lock behind and every later build waits on
    it forever; a lock a live builder holds open stays."""
    ext = tmp_path / "torch_extensions"
    (ext / "cpu_adam").mkdir(parents=True)
    (ext / "fused_adam").mkdir()
    stale, held = ext / "cpu_adam" / "lock", ext / "fused_adam" / "lock"
    stale.touch()
    holder_code = ("import os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); "
                   "open(sys.argv[2], 'w').close(); time.sleep(60)")
    ready = tmp_path / "holding"
    holder = __import__("subprocess").Popen([sys.executable, "-c", holder_code, str(held), str(ready)])
    try:
        while not ready.exists():
            time.sleep(0.05)
        job = Job([sys.executable, "-c", "import sys; open(sys.argv[1], 'w').write('{}')", str(tmp_path / "x")],
                  {"TORCH_EXTENSIONS_DIR": str(ext)})
        run = run_jobs([job], tmp_path / "run", 60, "x", "tiny", 0)
        assert not stale.exists()
        assert held.exists()
        assert f"removed {stale}" in run.log_tail
    finally:
        holder.kill()
        holder.wait()


@pytest.fixture(scope="module")
def plan_a_tiny(bundled_session):
    """Guide 004's plan A, tiny, on the CPU: two jobs sharing one card, claiming checkpointing's
    speed cost (the run its case item is judged on)."""
    run = bundled_session.run("004-gla-plan-a-minimal", "tiny")
    assert run.ok, run.log_tail
    return run


@BESIDE_THE_CASES
def test_a_case_claiming_checkpointings_speed_cost_times_passes_with_and_without_it(plan_a_tiny, _beside):
    """Guide 004's plan A claims checkpointing costs 8% of the speed: its worker times three
    forwards and backwards each way (end to end)."""
    for r in plan_a_tiny.ranks:
        assert len(r.probes.pass_s_with_checkpointing) == 3 and len(r.probes.pass_s_without_checkpointing) == 3
        assert all(t > 0 for t in r.probes.pass_s_with_checkpointing + r.probes.pass_s_without_checkpointing)


@BESIDE_THE_CASES
def test_jobs_sharing_a_card_take_turns_for_their_probes(plan_a_tiny, _beside):
    """Their training runs side by side; their probes (checkpointing off, every logit) one after the
    other, so one job's ablation is not measured against, or run out of the card by, the other's."""
    windows = sorted(r.probes.window for r in plan_a_tiny.ranks)
    assert len(windows) == 2 and not plan_a_tiny.ranks[0].probes.did_not_fit
    (_, first_end), (second_start, _) = windows
    assert first_end <= second_start


def test_jobs_exit_when_the_harness_that_launched_them_is_killed(tmp_path):
    """A harness stopped without cleaning up (`timeout` SIGTERMs its own group; SIGKILL runs no
    handler) must not leave its jobs, which live in sessions of their own, holding the card."""
    pid_file = tmp_path / "job.pid"
    job_code = (f"import os, time; from harness.runtime.process_tree import exit_with_owner; "
                f"exit_with_owner(0.1); open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)")
    harness_code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from harness.runtime.launcher import Job, run_jobs
        run_jobs([Job([sys.executable, "-c", {job_code!r}])], Path({str(tmp_path / 'run')!r}), 120, "x", "tiny", 1)
    """)
    harness = __import__("subprocess").Popen([sys.executable, "-c", harness_code])
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and harness.poll() is None
            time.sleep(0.05)
        job = psutil.Process(int(pid_file.read_text()))
        harness.kill()
        harness.wait()
        job.wait(timeout=10)  # raises psutil.TimeoutExpired if it outlives the harness
    finally:
        harness.kill()
        harness.wait()

