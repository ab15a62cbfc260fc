"""The launcher: one fresh process group per case run, and a classified result whatever happens.

* one rank: `python -m harness.runtime.worker`; on a CPU host forked from the worker zygote, which
  has imported the training stack once (`harness.runtime.zygote`; HARNESS_ZYGOTE=0: a fresh
  interpreter each);
* several ranks: on a GPU host `torchrun` or DeepSpeed's launcher, as the case says; on a CPU host
  the launcher starts the ranks itself, each forked from the zygote with the environment torchrun
  gives it (`harness.runtime.ranks`; gloo);
* several independent jobs sharing one card (guide 004): that many concurrent workers, each with
  its slot number, started together so they compete for the card as they do in production.

A timeout kills every process the jobs started; the workers have dumped their Python stacks just
before, and the error names the line they hung on (`harness.runtime.process_tree`). A SIGTERM or
Ctrl-C to the harness kills every job of every run under way and starts no other
(`harness.runtime.stopping`); the DeepSpeed JIT-build locks a killed job held are removed with it,
and one whose holder dies while a run waits on it is removed within seconds
(`harness.runtime.jit_locks`). Whatever the children did
(exit, raise, run out of memory, get killed, hang), the result is a `CaseRun` with a classified
error and the numbers the workers managed to write; the harness itself never crashes on a bad case.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from harness.measure.records import CaseRun, ErrorInfo, Failure, RankReport, short_of
from harness.runtime import compile_cache, jit_locks, process_tree, stopping, zygote
from harness.runtime.platform import Platform, parse_oom
from harness.runtime.rank_deaths import RankDeath, deaths, unreported_death
from harness.runtime.ranks import RankGroup, rank_env
from harness.runtime.reports import EXIT_NO_REPORT, REPORT_NOT_WRITTEN
from harness.runtime.stacks import interpreter
from harness.spec.schema import Case
from harness.spec.variants import Variant

COLD_TRITON_CACHE = "triton-cache"  # under a run's folder, for a case with launch.triton_cache: cold

DEFAULT_TIMEOUT_S = 900

WORKER = "harness.runtime.worker"  # the module each training process runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Job:
    """One job the launcher starts: a single worker, torchrun/deepspeed for all ranks (GPU hosts), or
    `ranks` processes of argv, each with its rank's environment (CPU hosts: `harness.runtime.ranks`).
    `preloaded`: forked from the worker zygote instead of a fresh interpreter (argv is then
    `python -m MODULE ...`; CPU hosts only: a process that initialised CUDA cannot be forked)."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    preloaded: bool = False
    ranks: int = 1


def worker_args(case_path: Path, fidelity: str, out_dir: Path, steps: int | None, slot: int,
                emulate_card_bytes: int | None, variant: str = "") -> list[str]:
    args = ["--case", str(case_path), "--fidelity", fidelity, "--out-dir", str(out_dir), "--slot", str(slot)]
    if variant:
        args += ["--variant", variant]
    if steps:
        args += ["--steps", str(steps)]
    if emulate_card_bytes:
        args += ["--emulate-card-bytes", str(emulate_card_bytes)]
    return args


def cpu_threads(fidelity: str, processes: int) -> str:
    """OMP_NUM_THREADS for each training process of a run, where neither the environment nor the
    case sets it. Tiny runs: one (many run at once on the CI's cores, and their figures are bytes).
    Full size: an equal share of the cores this harness may use, as DeepSpeed's `--bind_cores_to_rank`
    gives each rank. A step that is CPU-bound (DeepSpeed's CPU Adam under optimizer offload is an
    OpenMP loop) runs as many times slower on one thread, torchrun's default for several processes,
    which it asks users to tune; OpenMP's default, every core in every process, oversubscribes a
    host whose processes share it."""
    if fidelity == "tiny":
        return "1"
    return str(max(1, len(os.sched_getaffinity(0)) // max(1, processes)))


def plan_jobs(case: Case, case_path: Path, fidelity: str, ranks: int, out_dir: Path, platform: Platform,
              steps: int | None = None, emulate_card_bytes: int | None = None, variant: str = "") -> list[Job]:
    """`case` is the case as measured (a variant applied); `case_path` and `variant` tell the
    worker how to rebuild it."""
    py = interpreter(case) or sys.executable  # a framework's own environment (harness.runtime.stacks)
    base_env = {
        "OMP_NUM_THREADS": (os.environ.get("OMP_NUM_THREADS")
                            or cpu_threads(fidelity, ranks * case.launch.procs_per_card)),
        # DeepSpeed JIT-builds cpu_adam once (1-2 min); keep the build between runs, one folder per environment
        "TORCH_EXTENSIONS_DIR": str(compile_cache.extensions_dir(py)),
        # flash-linear-attention's Triton kernels compile and autotune on first use (minutes on a
        # fresh GPU host); keep them between runs too
        "TRITON_CACHE_DIR": str(compile_cache.shared_triton_dir()),
    }
    base_env.update(case.launch.env)  # the case's own (PYTORCH_CUDA_ALLOC_CONF, thread limits, ...)
    if case.launch.triton_cache == "cold":  # every job of this run compiles into one empty cache
        base_env["TRITON_CACHE_DIR"] = str(compile_cache.fresh(out_dir / COLD_TRITON_CACHE))
    jobs: list[Job] = []
    launcher = case.launch.launcher
    if platform == Platform.cpu:
        # a CPU host needs no rank launcher: the launcher starts each rank itself with the environment
        # torchrun gives it, forked from the zygote instead of torchrun's interpreter and a fresh one
        # per rank (DeepSpeed's runner would count accelerators to place ranks, and find none)
        launcher = "python"
    for slot in range(case.launch.procs_per_card):
        wargs = worker_args(case_path, fidelity, out_dir, steps, slot, emulate_card_bytes, variant)
        port = str(free_port())
        if launcher == "python":
            jobs.append(Job([py, "-m", WORKER, *wargs], dict(base_env, **rank_env(0, ranks, port)),
                            preloaded=platform == Platform.cpu and zygote.enabled(), ranks=ranks))
        elif launcher == "torchrun":
            jobs.append(Job([py, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(ranks),
                             "--master-addr", "127.0.0.1", "--master-port", port, "-m", WORKER, *wargs],
                            dict(base_env)))
        else:
            jobs.append(Job([py, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port", port,
                             "--module", WORKER, *wargs], dict(base_env)))
    return jobs


def _pids(proc) -> list[int]:
    return proc.pids if isinstance(proc, RankGroup) else [proc.pid]


def _kill_group(proc) -> None:
    """Kill a job and everything it started (torchrun's ranks, and the launcher's own, live in
    sessions of their own)."""
    if isinstance(proc, RankGroup):
        proc.mark_killed()
    for pid in _pids(proc):
        process_tree.kill(process_tree.tree(pid))
        try:
            os.killpg(pid, signal.SIGKILL)  # the tree walk misses what is already reparented
        except ProcessLookupError:
            pass


@contextlib.contextmanager
def _reaped(procs: list[subprocess.Popen], ext_dirs: list[Path] = ()):
    """Each job runs in its own session (so a timeout can kill its whole tree), which also means
    nothing kills it when the harness itself is stopped: do it here, on any way out, and remove the
    JIT-build locks (`ext_dirs`) the killed jobs held, or the next run of that op waits on them."""
    try:
        yield
    except BaseException:
        for proc in procs:
            _kill_group(proc)
            proc.wait()
        with _running_lock:
            _running.difference_update(pid for p in procs for pid in _pids(p))
        if procs:
            _remove_stale_locks(ext_dirs)
        raise


def _remove_stale_locks(ext_dirs, log=None) -> None:
    for ext_dir in ext_dirs:
        for lock in jit_locks.remove_stale(Path(ext_dir)):
            if log is not None:
                _note(log, f"removed {lock}: a JIT build was interrupted and no process holds its lock, "
                           "which would hang this run")


def _ext_dirs(jobs: list[Job]) -> list[Path]:
    """The folders the jobs JIT-build DeepSpeed's ops in (their locks are there)."""
    return [Path(d) for d in sorted({job.env.get("TORCH_EXTENSIONS_DIR") or str(compile_cache.extensions_dir())
                                     for job in jobs})]


_in_flight = 0  # run_case and run_jobs calls under way in this process, every thread's
_in_flight_cond = threading.Condition()


@contextlib.contextmanager
def _counted():
    global _in_flight
    with _in_flight_cond:
        _in_flight += 1
    try:
        yield
    finally:
        with _in_flight_cond:
            _in_flight -= 1
            _in_flight_cond.notify_all()


def settle(timeout_s: float = 10.0) -> bool:
    """Wait until no run of this process is under way (after a stop: each ends within seconds, and
    writes nothing more in its folder); False if one still is after `timeout_s`."""
    with _in_flight_cond:
        return _in_flight_cond.wait_for(lambda: _in_flight == 0, timeout_s)


def _kill_running() -> None:
    """At a stop: kill every job this process runs, each with its whole tree (the threads waiting on
    them then see them gone). The set is copied without its lock: a thread starting a job can hold
    that lock for as long as the zygote takes to start, and this runs in a signal handler."""
    for _ in range(3):
        try:
            pids = list(_running)
            break
        except RuntimeError:  # changed while copied
            continue
    else:
        return
    trees = [proc for pid in pids for proc in process_tree.tree(pid)]
    with contextlib.suppress(psutil.Error, OSError):
        process_tree.kill(trees, wait_s=3.0)  # all killed first, then one wait for all of them
    for pid in pids:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


stopping.on_stop(_kill_running)


def _start_ballast(leave_bytes: int, out_dir: Path, log, timeout_s: float = 120) -> tuple[subprocess.Popen, int | None]:
    """The ballast process, once it holds the card's spare memory, and the device memory it left
    free (below `leave_bytes` where another process held memory on the card before it)."""
    ready = out_dir / "ballast.ready"
    ready.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "harness.runtime.ballast", "--leave", str(leave_bytes),
                             "--ready", str(ready)], env={**os.environ, process_tree.OWNER_ENV: process_tree.owner()},
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill_group(proc)
            raise RuntimeError("the ballast process could not take the card's spare memory; see log.txt")
        time.sleep(0.2)  # waiting on another process's CUDA start-up; nothing to block on
    text = ready.read_text().strip()
    return proc, int(text) if text.isdigit() else None


EARLIER_RESULTS = ("rank*.json", "rank*.tmp", process_tree.STACKS_GLOB, "run.json", "run.tmp", "ballast.ready",
                   "probes-card*.lock")  # what a run leaves in its folder: cleared before the next run there


def _clear_earlier(out_dir: Path) -> list[str]:
    """Remove what an earlier run left in this folder (finished, or cut short with the harness
    killed): its reports would otherwise be read as this run's, and a half-written one as a
    corrupt result. Returns the names removed."""
    removed = []
    for pattern in EARLIER_RESULTS:
        for path in sorted(out_dir.glob(pattern)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path.name)
    return removed


_running: set[int] = set()  # the jobs some run_jobs call of this process is waiting on
_running_lock = threading.RLock()  # re-entered by running_jobs() under starting_nothing()


def running_jobs() -> set[int]:
    """The pids of the jobs this process's launcher is running now (every thread's runs; the zygote
    and what a job started are not in it). Held while a job starts, so a process listed before this
    call returns is in it if a run started it."""
    with _running_lock:
        return set(_running)


@contextlib.contextmanager
def starting_nothing():
    """No job starts while this is held: a caller can list processes and `running_jobs` consistently."""
    with _running_lock:
        yield


def _start(job: Job, env: dict[str, str], log):
    """Start a job, its output on the case's log: one process in a session of its own, or for a job
    of several ranks one such process per rank, waited on and killed as one (`RankGroup`)."""
    stopping.check()
    if job.ranks == 1:
        return _start_one(job, env, log)
    port = env.get("MASTER_PORT") or str(free_port())
    ranks = []
    with _reaped(ranks):  # a rank that fails to start takes the ones started before it down
        for rank in range(job.ranks):
            ranks.append(_start_one(job, {**env, **rank_env(rank, job.ranks, port)}, log))
    return RankGroup(ranks, say=lambda line: _note(log, line))


def _start_one(job: Job, env: dict[str, str], log):
    """One process in a session of its own, its output on the case's log: forked from the worker
    zygote where the job asks for it and the zygote works, else in a fresh interpreter."""
    with _running_lock:
        if job.preloaded:
            try:
                # the zygote of the job's interpreter: another environment's has imported that one's stack
                proc = zygote.shared(job.argv[0]).start(job.argv, env, os.getcwd(), log.fileno())
                _running.add(proc.pid)
                return proc
            except zygote.ZygoteError as exc:
                stopping.check()  # the zygote was let go at a stop: start nothing in its place
                _note(log, f"{exc}; starting the worker in a fresh interpreter")
        stopping.check()
        proc = subprocess.Popen(job.argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        _running.add(proc.pid)
        return proc


def _note(log, line: str) -> None:
    """A line of the launcher's own in the case's log; a full disk loses the line, not the run."""
    with contextlib.suppress(OSError):
        log.write(f"[harness.runtime.launcher] {line}\n".encode())


def _not_written(case_id: str, fidelity: str, out_dir: Path, exc: OSError) -> CaseRun:
    return CaseRun(case_id=case_id, fidelity=fidelity, command=[], returncode=None, wall_s=0.0,
                   error=ErrorInfo(kind=Failure.write_error,
                                   message=f"cannot write the run's folder {out_dir}: {exc.strerror or exc}; "
                                           "free space there or point the run at a writable folder"),
                   run_dir=str(out_dir))


def _read_reports(out_dir: Path) -> tuple[list[RankReport], list[str]]:
    """The rank reports in the folder, and a line for each that cannot be read (cut short by a
    full disk, or not a report): those are missing reports, never a crash of the harness."""
    reports, unreadable = [], []
    for path in sorted(out_dir.glob("rank*.json")):
        try:
            reports.append(RankReport.model_validate_json(path.read_text()))
        except (OSError, ValueError) as exc:  # pydantic's ValidationError and UnicodeDecodeError are ValueErrors
            unreadable.append(f"{path.name} is not a readable report ({str(exc).splitlines()[0][:200]})")
    return reports, unreadable


# While a run waits on its jobs, this often it removes the JIT-build locks whose holder has died: a
# job waiting on one (torch's FileBaton polls for it to go, without a deadline) goes on at once.
JIT_LOCK_CHECK_S = 5.0


def run_jobs(jobs: list[Job], out_dir: Path, timeout_s: float, case_id: str, fidelity: str,
             expected_reports: int, ballast_leave_bytes: int | None = None) -> CaseRun:
    """Run the jobs in `out_dir` and classify what they left. Raises `stopping.Stopped` where the
    harness was told to stop (before anything starts, or with every job killed)."""
    with _counted():
        stopping.check()
        return _run_jobs(jobs, out_dir, timeout_s, case_id, fidelity, expected_reports, ballast_leave_bytes)


def _run_jobs(jobs: list[Job], out_dir: Path, timeout_s: float, case_id: str, fidelity: str,
              expected_reports: int, ballast_leave_bytes: int | None) -> CaseRun:
    log_path = out_dir / "log.txt"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        earlier = _clear_earlier(out_dir)
        log = open(log_path, "wb", buffering=0)  # closed by the with below; unbuffered, so closing cannot fail
    except OSError as exc:
        return _not_written(case_id, fidelity, out_dir, exc)
    started = time.monotonic()
    procs: list[subprocess.Popen] = []
    timed_out = False
    ballast = None
    card_free = None
    ext_dirs = _ext_dirs(jobs)
    with log, _reaped(procs, ext_dirs):
        if earlier:
            _note(log, f"removed {len(earlier)} files an earlier run left in {out_dir}: {', '.join(earlier)}")
        if ballast_leave_bytes:
            try:
                ballast, card_free = _start_ballast(ballast_leave_bytes, out_dir, log)
                procs.append(ballast)
                if short_of(card_free, ballast_leave_bytes):
                    _note(log, f"the card has {card_free / 2**30:.2f} GiB free for the jobs, less than the emulated "
                               f"{ballast_leave_bytes / 2**30:.2f} GiB card: another process holds memory on it")
            except RuntimeError as exc:
                return CaseRun(case_id=case_id, fidelity=fidelity, command=[], returncode=None, wall_s=0.0,
                               error=ErrorInfo(kind=Failure.crash, message=str(exc)), run_dir=str(out_dir))
        _remove_stale_locks(ext_dirs, log)
        for job in jobs:
            env = dict(os.environ)
            env.update(job.env)
            env.setdefault("PYTHONUNBUFFERED", "1")
            env[process_tree.STACK_DUMP_ENV] = str(process_tree.stack_dump_after(timeout_s))
            env[process_tree.OWNER_ENV] = process_tree.owner()
            procs.append(_start(job, env, log))
        timed_out = _wait(procs, ballast, started + timeout_s, ext_dirs, log)
        stopping.check()  # jobs killed by a stop are no result: `_reaped` ends the rest of the run
        if timed_out:
            for proc in procs:
                if proc is not ballast:
                    _kill_group(proc)
                    proc.wait()
            _remove_stale_locks(ext_dirs, log)
        if ballast is not None:
            procs.remove(ballast)
            _kill_group(ballast)
            ballast.wait()
        stuck = process_tree.where_ranks_stuck(out_dir) if timed_out else []
        for who, _, dump in stuck:  # on a full disk they stay in their own files
            _note(log, f"the stacks of {who} before the timeout:\n{dump}")
    with _running_lock:
        _running.difference_update(pid for p in procs for pid in _pids(p))
    wall = time.monotonic() - started
    job_codes = [p.returncode for p in procs]  # a rank group's: its first failed rank's
    codes = [code for p in procs for code in (p.returncodes if isinstance(p, RankGroup) else [p.returncode])]
    seen = [death for p in procs if isinstance(p, RankGroup) for death in p.deaths]
    log_text = log_path.read_text(errors="replace") if log_path.exists() else ""
    ranks, unreadable = _read_reports(out_dir)
    run = CaseRun(case_id=case_id, fidelity=fidelity, command=jobs[0].argv if jobs else [],
                  returncode=max(job_codes, key=abs) if job_codes else None, wall_s=wall, ranks=ranks,
                  log_tail=log_text[-6000:], run_dir=str(out_dir),
                  emulated_card_bytes=ballast_leave_bytes, card_free_at_start=card_free)
    run.error = classify(timed_out, timeout_s, codes, ranks, log_text, expected_reports,
                         [(who, where) for who, where, _ in stuck], unreadable, seen)
    return run


def _wait(procs, ballast, deadline: float, ext_dirs: list[Path], log) -> bool:
    """Wait for every job but the ballast until `deadline`; True when one was still running then.
    Every `JIT_LOCK_CHECK_S` the JIT-build locks whose holder died are removed, and a stop ends the wait."""
    for proc in procs:
        if proc is ballast:
            continue
        while True:
            try:
                proc.wait(timeout=max(0.0, min(deadline - time.monotonic(), JIT_LOCK_CHECK_S)))
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    return True
                stopping.check()
                _remove_stale_locks(ext_dirs, log)
    return False


def classify(timed_out: bool, timeout_s: float, codes: list[int], ranks: list[RankReport], log: str,
             expected_reports: int, stuck: list[tuple[str, str]] = (), unreadable: list[str] = (),
             seen: list[RankDeath] = ()) -> ErrorInfo | None:
    """Turn what the processes left behind into one error (or None when all went well).
    Errors the workers wrote themselves stay in their rank reports; this covers the rest.
    `stuck`: (who, where) of each rank that dumped its stacks before a timeout; `unreadable`: a line
    for each report that could not be read; `seen`: the failed ranks of the launcher's own rank
    groups (the others' come from what torchrun or DeepSpeed's launcher printed)."""
    if timed_out:
        message = f"no result after {timeout_s:.0f} s; every process of the run was killed"
        progress = _last_progress(log)
        if progress:
            message += f"; last progress: {progress!r}"
        if stuck:
            message += "; " + "; ".join(f"{who} stuck at {where}" for who, where in stuck) + " (all stacks in log.txt)"
        elif where := process_tree.where_stuck(log):
            message += f"; stuck at {where} (all stacks in log.txt)"
        elif not progress:
            message += f"; {_tail_note(log)}"
        return ErrorInfo(kind=Failure.timeout, message=message)
    if EXIT_NO_REPORT in codes or REPORT_NOT_WRITTEN in log:
        said = next((ln.strip() for ln in reversed(log.splitlines()) if REPORT_NOT_WRITTEN in ln), None)
        return ErrorInfo(kind=Failure.write_error,
                         message=f"{said or f'a worker exited {EXIT_NO_REPORT}: it could not write its report'}; "
                                 "what it measured is lost: free space in the run's folder or point the run at "
                                 "another one")
    death = unreported_death([*seen, *deaths(log)], {r.rank for r in ranks}, expected_reports)
    if death is not None:
        # a rank that died without a report (killed, or failed before it could write one)
        kind = Failure.host_oom if death.signal_name == "SIGKILL" else Failure.crash
        why = (" (the kernel's OOM killer is the usual sender of SIGKILL: check host RAM)"
               if kind == Failure.host_oom else "")
        detail = "" if death.signal_name else f": {_last_error_line(log)}"
        return ErrorInfo(kind=kind, message=f"{death.describe()}{why}{detail}; the launcher stopped the other ranks")
    reported = [r for r in ranks if r.error is not None]
    if reported:
        return None  # the worker's own classification is in its report
    if any(c is not None and c < 0 for c in codes) or any(c == 137 for c in codes):
        sig = next((-c for c in codes if c is not None and c < 0), 9)
        oom = parse_oom(log)
        if oom is not None:
            return ErrorInfo(kind=Failure.oom, message=oom.message, tried_to_allocate=oom.tried_to_allocate)
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        kind = Failure.host_oom if sig == signal.SIGKILL else Failure.crash
        why = (" (the kernel's OOM killer is the usual sender of SIGKILL: check host RAM)"
               if kind == Failure.host_oom else "")
        return ErrorInfo(kind=kind, message=f"a process was killed by {name}{why}")
    if any(c != 0 for c in codes):
        oom = parse_oom(log)
        if oom is not None:
            return ErrorInfo(kind=Failure.oom, message=oom.message, tried_to_allocate=oom.tried_to_allocate)
        return ErrorInfo(kind=Failure.crash, message=_last_error_line(log) or f"exit codes {codes}; {_tail_note(log)}")
    if len(ranks) < expected_reports:
        message = f"exited 0 but wrote {len(ranks)} of {expected_reports} reports"
        if unreadable:
            message += "; " + "; ".join(unreadable)
        return ErrorInfo(kind=Failure.no_report, message=f"{message}; {_tail_note(log)}")
    return None


def _tail_note(log: str, lines: int = 3) -> str:
    """What the log says last, for a run that left nothing else to go on."""
    kept = [ln.strip() for ln in log.strip().splitlines() if ln.strip()][-lines:]
    if not kept:
        return "log.txt is empty: the processes printed nothing"
    return "the log ends: " + " | ".join(kept)[-600:]


def _last_progress(log: str) -> str | None:
    """The last line a worker printed about where it is (`progress` in harness.runtime.worker)."""
    for line in reversed(log.splitlines()):
        if line.startswith("[harness.runtime.worker]") and REPORT_NOT_WRITTEN not in line:
            return line.strip()[:300]
    return None


def _last_error_line(log: str) -> str:
    for line in reversed(log.strip().splitlines()):
        if "Error" in line or "Exception" in line:
            return line.strip()[:1000]
    return log.strip().splitlines()[-1][:1000] if log.strip() else ""


def run_case(case: Case, case_path: Path, fidelity: str, out_dir: Path, platform: Platform,
             timeout_s: float = DEFAULT_TIMEOUT_S, steps: int | None = None,
             emulate_card_bytes: int | None = None, variant: Variant = Variant()) -> CaseRun:
    """Run a case (under a measurement variant, if given). `emulate_card_bytes` makes a bigger
    device behave as the target card: a cap per process for one job, a ballast process for several
    jobs sharing the card (GPU only)."""
    from harness.spec.shape import run_shape

    with _counted():
        stopping.check()
        case = variant.apply(case)
        shape = run_shape(case, fidelity, steps)
        shared = case.launch.procs_per_card > 1 and platform != Platform.cpu and emulate_card_bytes
        jobs = plan_jobs(case, case_path, fidelity, shape.ranks, out_dir, platform, steps,
                         None if shared else emulate_card_bytes, variant.text)
        try:
            run = run_jobs(jobs, out_dir, timeout_s, case.id, fidelity, shape.ranks * case.launch.procs_per_card,
                           ballast_leave_bytes=emulate_card_bytes if shared else None)
        finally:
            if case.launch.triton_cache == "cold":  # the compiled kernels are not a result: keep the run folder small
                shutil.rmtree(out_dir / COLD_TRITON_CACHE, ignore_errors=True)
        run.variant = variant.text
        return run
