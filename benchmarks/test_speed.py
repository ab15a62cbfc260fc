"""The harness's own speed, measured with pytest-benchmark:

    .venv/bin/pytest benchmarks/                      # every benchmark, pytest-benchmark's table
    .venv/bin/pytest benchmarks/ -k check --benchmark-json out.json
    .venv/bin/pytest benchmarks/ -k "default_tier and warm"   # the README's test command, timed

* `oom-harness check` on guide 000's 32B config, each round a fresh process (imports, config import,
  the predictor's fake-tensor trace, calibration, lints, the table), as a pre-merge CI job runs it;
  once with the predictor's on-disk cache off (a fresh CI runner: nothing cached; target 10 s) and
  once with it warm (the trace and the calibration's baseline figures cached; target 1 s).
* the whole tiny suite (every case at tiny size, `oom-harness run`). Run it once before timing on
  a fresh machine, so DeepSpeed's JIT ops and the random checkpoints are cached.
* the default test tier as CI runs it (`DEFAULT_TIER`: the tiny cases, the pre-merge checks and the
  unit tests, on two pytest-xdist workers; target 3 minutes on two cores, warm), with the CPU
  seconds of every process it started; `-k "default_tier and cold"` times it with every cache
  empty, as a CI job that keeps none.
* a tiny worker's start: a fresh interpreter importing the training stack against a job forked
  from the zygote that has imported it (harness.runtime.zygote), with the CPU seconds each takes;
* one tiny case end to end (`oom-harness run -k 003-qlora-fix-r16-seq512-gc`, a cold CLI process
  each round), its worker forked from the zygote and, for comparison, in a fresh interpreter
  (HARNESS_ZYGOTE=0).

    .venv/bin/pytest benchmarks/ -k "worker_start or one_tiny_case"

Targets are printed beside the figures and kept in `extra_info`, not asserted: a slower machine is
a figure to read, not a failing test.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "configs" / "examples"
CHECK_TARGET_S = 10.0  # an empty trace cache, two CPU cores
CHECK_WARM_TARGET_S = 1.0  # the trace and the calibration cached on disk
TINY_SUITE_TARGET_S = 180.0
DEFAULT_TIER_TARGET_S = 180.0
# the README's test command: the repository's default tier on two pytest-xdist workers, the case
# items in one of them (harness.pytest_plugin.xdist_groups)
DEFAULT_TIER = ["-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q"]
# and every test's duration, summed by file to say where the time went (it changes nothing that runs)
DURATIONS = ["--durations=0"]


def _say(request, line: str) -> None:
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():  # print past pytest's output capture
            reporter.write_line(line)


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode not in (0, 1):  # 1: the config does not fit, a verdict, not a failure to run
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc


@pytest.mark.parametrize("trace_cache", ["off", "warm"])
def test_check_32b(benchmark, request, trace_cache, tmp_path):
    cmd = [sys.executable, "-m", "harness.cli", "check", str(EXAMPLES / "000-ds32b-optimized.yaml"),
           "--deepspeed", str(EXAMPLES / "ds_z3_offload_aggressive.json"),
           "--gpu-memory", "64GiB", "--gpus", "8", "--vendor", "hygon", "--json"]
    env = dict(os.environ, HARNESS_PREDICT_CACHE="off" if trace_cache == "off" else str(tmp_path / "trace-cache"))
    if trace_cache == "warm":
        _run(cmd, env)  # fills the cache
    proc = benchmark.pedantic(_run, args=(cmd, env), rounds=3, iterations=1)
    result = json.loads(proc.stdout)
    goal = CHECK_TARGET_S if trace_cache == "off" else CHECK_WARM_TARGET_S
    benchmark.extra_info.update(target_s=goal, device_peak_gib=result["device_peak_gib"], fits=result["fits"],
                                cpus=os.cpu_count(), affinity=len(os.sched_getaffinity(0)))
    data = benchmark.stats.stats.data
    worst = max(data)
    _say(request, f"\noom-harness check 32B, trace cache {trace_cache}: {len(data)} fresh processes, "
                  f"median {sorted(data)[len(data) // 2]:.2f} s, worst {worst:.2f} s; "
                  f"target {goal:g} s: {'met' if worst <= goal else 'NOT met'}")


def test_tiny_suite(benchmark, request, tmp_path):
    out = tmp_path / "runs.json"
    cmd = [sys.executable, "-m", "harness.cli", "run", "--out", str(tmp_path / "runs"), "--json", str(out)]
    benchmark.pedantic(_run, args=(cmd, dict(os.environ)), rounds=1, iterations=1)
    runs = json.loads(out.read_text())
    wall = benchmark.stats.stats.data[0]
    benchmark.extra_info.update(target_s=TINY_SUITE_TARGET_S, cases=len(runs), cpus=os.cpu_count(),
                                case_wall_s={r["case"]: round(r["run"]["wall_s"], 1) for r in runs})
    slowest = sorted(runs, key=lambda r: -r["run"]["wall_s"])[:5]
    _say(request, f"\ntiny suite: {len(runs)} runs in {wall:.0f} s on {os.cpu_count()} cores "
                  f"({'within' if wall <= TINY_SUITE_TARGET_S else 'over'} the {TINY_SUITE_TARGET_S:.0f} s target); "
                  "slowest: " + ", ".join(f"{r['case']} {r['run']['wall_s']:.0f} s" for r in slowest))


@pytest.mark.parametrize("cache", ["warm", "cold"])
def test_default_tier(benchmark, request, cache, tmp_path):
    """The README's test command, in a fresh pytest process from the repository's root. `warm`: with the
    caches this environment names (the checkout's .cache/oom-harness unless HARNESS_CACHE is set; run
    the tier once before, on a fresh machine). `cold`: every cache empty (DeepSpeed's JIT ops, Triton's
    kernels, the random-weight checkpoints, the predictor's traces), as a CI job that keeps none."""
    pytest.importorskip("xdist")
    env = dict(os.environ)
    if cache == "cold":
        empty = tmp_path / "cache"
        env.update(HARNESS_CACHE=str(empty), HARNESS_PREDICT_CACHE=str(empty / "predict-trace"))
        for name in ("TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR"):
            env.pop(name, None)
    cpu = []
    # the load average as the tier starts: what else the machine was running (at the end it is mostly the tier's own)
    load_at_start = os.getloadavg()[0]

    def one():
        before = _children_cpu_s()
        proc = subprocess.run([sys.executable, *DEFAULT_TIER, *DURATIONS], capture_output=True, text=True, cwd=ROOT,
                              env=env)
        cpu.append(_children_cpu_s() - before)
        return proc

    proc = benchmark.pedantic(one, rounds=1, iterations=1)
    wall = benchmark.stats.stats.data[0]
    summary = next((ln for ln in reversed(proc.stdout.splitlines()) if " passed" in ln), "")
    cores = len(os.sched_getaffinity(0))
    by_file = _durations_by_file(proc.stdout)
    slowest = _slowest_tests(proc.stdout)
    benchmark.extra_info.update(cache=cache, target_s=DEFAULT_TIER_TARGET_S if cache == "warm" else None,
                                cpu_s=round(cpu[0], 1), cpus=os.cpu_count(), affinity=cores,
                                load_average_at_start=load_at_start, load_average=os.getloadavg()[0],
                                summary=summary.strip("= "), test_s_by_file=dict(list(by_file.items())[:20]),
                                slowest_tests=slowest)
    target = (f" ({'within' if wall <= DEFAULT_TIER_TARGET_S else 'over'} the {DEFAULT_TIER_TARGET_S:.0f} s target)"
              if cache == "warm" else "")
    _say(request, f"\ndefault tier, {cache} caches: {wall:.0f} s and {cpu[0]:.0f} CPU-s on {cores} cores{target}, "
                  f"load average {load_at_start:.2f} at the start: "
                  f"{summary.strip('= ')}; the two workers' test time {sum(by_file.values()):.0f} s, most in "
                  + ", ".join(f"{name} {secs:.0f} s" for name, secs in list(by_file.items())[:6])
                  + "; slowest tests: " + ", ".join(f"{name} {secs:.0f} s" for name, secs in list(slowest.items())[:5]))
    if proc.returncode != 0:  # timed and said all the same: a failing tier's time is still a figure to read
        pytest.fail(f"the default tier failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")


def _durations_by_file(output: str) -> dict[str, float]:
    """pytest's `--durations` lines ("12.34s call     tests/test_x.py::test_y"), summed by file, largest first.
    The case items are one entry, `cases/`: one worker runs them, two tiny runs at a time in the background."""
    total: dict[str, float] = {}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0].endswith("s") and parts[1] in ("setup", "call", "teardown"):
            with contextlib.suppress(ValueError):
                file = parts[2].split("::", 1)[0]
                file = "cases/" if file.startswith("cases/") else file
                total[file] = total.get(file, 0.0) + float(parts[0][:-1])
    return {k: round(v, 1) for k, v in sorted(total.items(), key=lambda kv: -kv[1])}


def _slowest_tests(output: str, count: int = 15) -> dict[str, float]:
    """The `count` slowest phases of pytest's `--durations` lines, as "phase node id": seconds, slowest first."""
    found = []
    for line in output.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0].endswith("s") and parts[1] in ("setup", "call", "teardown"):
            with contextlib.suppress(ValueError):
                found.append((float(parts[0][:-1]), f"{parts[1]} {parts[2]}"))
    return {name: secs for secs, name in sorted(found, reverse=True)[:count]}


# what a worker imports before it builds anything; it then writes the CPU seconds it used
STACK_JOB = """
import os, sys
import torch, transformers, peft, deepspeed, harness.runtime.worker
times = os.times()
open(sys.argv[1], "a").write(f"{times.user + times.system}\\n")
"""


@pytest.mark.parametrize("start", ["fresh", "zygote"])
def test_worker_start(benchmark, request, start, tmp_path, monkeypatch):
    """From asking for a worker to its exit, when all it does is import the training stack; the
    CPU seconds are the worker's own (a forked one counts from its fork)."""
    from harness.runtime import zygote

    (tmp_path / "stack_job.py").write_text(STACK_JOB)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), str(ROOT),
                                                                    os.environ.get("PYTHONPATH")])))
    cpu_file = tmp_path / "cpu.txt"
    argv = [sys.executable, "-m", "stack_job", str(cpu_file)]
    log = open(tmp_path / "log.txt", "wb", buffering=0)
    forker = zygote.Zygote() if start == "zygote" else None

    def one():
        if forker is None:
            subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=True)
        else:
            assert forker.start(argv, dict(os.environ), os.getcwd(), log.fileno()).wait(120) == 0

    warm = ""
    try:
        if forker is not None:  # its own imports are paid once per harness process, not per worker
            started = time.perf_counter()
            forker.start([sys.executable, "-m", "json.tool", "--help"], dict(os.environ), os.getcwd(),
                         log.fileno()).wait(300)
            warm = f"; the zygote's own imports took {time.perf_counter() - started:.1f} s, once"
        benchmark.pedantic(one, rounds=5, iterations=1)
    finally:
        if forker is not None:
            forker.close()
        log.close()
    cpu = [float(line) for line in cpu_file.read_text().split()]
    benchmark.extra_info.update(cpus=os.cpu_count(), worker_cpu_s=[round(c, 2) for c in cpu])
    _say(request, f"\nworker start, {start}: median {benchmark.stats.stats.median:.2f} s and "
                  f"{sorted(cpu)[len(cpu) // 2]:.2f} CPU-s per worker{warm}")


@pytest.mark.parametrize("start", ["fresh", "zygote"])
def test_one_tiny_case(benchmark, request, start, tmp_path):
    """`oom-harness run` of one tiny case in a cold CLI process, as a developer runs one case (its
    claim of a lower peak than 003-qlora-fix-r32-seq1024-gc runs that case too: two workers)."""
    case = "003-qlora-fix-r16-seq512-gc"
    env = dict(os.environ, HARNESS_ZYGOTE="1" if start == "zygote" else "0")
    cpu = []

    def one():
        before = _children_cpu_s()
        _run([sys.executable, "-m", "harness.cli", "run", "-k", case, "--out", str(tmp_path / "runs"),
              "--json", str(tmp_path / "runs.json")], env)
        cpu.append(_children_cpu_s() - before)

    benchmark.pedantic(one, rounds=3, iterations=1)
    runs = json.loads((tmp_path / "runs.json").read_text())  # the case, and the one its claim compares with
    assert case in {r["case"] for r in runs}
    assert all(r["run"]["error"] is None for r in runs), [r["run"]["error"] for r in runs]
    benchmark.extra_info.update(cpus=os.cpu_count(), cpu_s=[round(c, 1) for c in cpu])
    _say(request, f"\none tiny case ({case}), worker {start}: median {benchmark.stats.stats.median:.1f} s, "
                  f"{sorted(cpu)[1]:.1f} CPU-s (the CLI, the zygote and the worker)")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
