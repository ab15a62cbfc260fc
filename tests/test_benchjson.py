"""Full-size throughput written in pytest-benchmark's format, readable by `pytest-benchmark compare`."""

import json
import subprocess
import sys

import pytest

from harness.baselines.benchjson import benchmark_entries, write_benchmark_json
from harness.measure.records import CaseRun, Memory, RankReport
from harness.spec.units import GIB


def _run(case_id, steps, variant="", fidelity="real", ok=True):
    rank = RankReport(case_id=case_id, fidelity=fidelity, rank=0, world_size=1, platform="cuda",
                      device_name="NVIDIA H100 80GB HBM3", step=Memory(allocated=int(9 * GIB), device=int(10 * GIB)),
                      step_times_s=steps, tokens_per_step=4096, flops_per_token=4e10)
    return CaseRun(case_id=case_id, fidelity=fidelity, variant=variant, command=[], returncode=0, wall_s=1,
                   ranks=[rank],
                   error=None if ok else {"kind": "oom", "message": "out of memory"})


def test_repetitions_pool_their_timed_steps_and_warmup_is_dropped():
    runs = [_run("003-a", [9.0, 1.0, 1.2]), _run("003-a", [8.0, 1.1, 1.3]), _run("003-a", [9.0, 2.0], variant="8L"),
            _run("003-b", [1.0, 1.0], fidelity="tiny"), _run("003-c", [1.0, 1.0], ok=False)]
    entries = {e["name"]: e for e in benchmark_entries(runs, {})}
    assert set(entries) == {"003-a", "003-a@8L"}  # tiny and failed runs are not throughput
    stats = entries["003-a"]["stats"]
    assert sorted(stats["data"]) == [1.0, 1.1, 1.2, 1.3] and stats["rounds"] == 4
    assert stats["median"] == pytest.approx(1.15) and stats["min"] == 1.0
    info = entries["003-a"]["extra_info"]
    assert info["per_card_peak_bytes"] == [int(10 * GIB)] * 2
    assert info["tokens_per_s_per_gpu"] == [pytest.approx(4096 / 1.1), pytest.approx(4096 / 1.2)]
    assert info["sm_clock_mhz_median"] == [None, None]  # not read (no NVML here)


def test_the_cards_clock_goes_with_each_repetition():
    from harness.measure.records import Clocks

    run = _run("003-a", [9.0, 1.0, 1.2])
    run.ranks[0].clocks = Clocks(samples=100, utilization=0.62, sm_mhz_median=1410, sm_mhz_min=1395, sm_mhz_max=1980)
    (entry,) = benchmark_entries([run], {})
    assert entry["extra_info"]["sm_clock_mhz_median"] == [1410]
    assert entry["extra_info"]["gpu_utilization"] == [0.62]


def test_pytest_benchmark_compare_reads_the_files(tmp_path):
    a, b = tmp_path / "0001_a.json", tmp_path / "0002_b.json"
    assert write_benchmark_json(a, [_run("003-a", [9.0, 1.0, 1.2])], {}) == 1
    write_benchmark_json(b, [_run("003-a", [9.0, 1.4, 1.5])], {})
    doc = json.loads(a.read_text())
    assert {"machine_info", "commit_info", "benchmarks", "datetime", "version"} <= set(doc)
    proc = subprocess.run([sys.executable, "-m", "pytest_benchmark", "compare", str(a), str(b)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("003-a ")]
    assert len(rows) == 2 and "0001_a" in proc.stdout and "0002_b" in proc.stdout, proc.stdout
