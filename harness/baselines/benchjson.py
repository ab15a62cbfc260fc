"""Case throughput in pytest-benchmark's JSON format, so `pytest-benchmark compare` and the
dashboards built on its files read full-size runs like any other benchmark.

One benchmark per case (and measurement variant): its rounds are the timed optimizer steps of every
repetition (warm-up steps dropped), in seconds per step; `extra_info` carries tokens/s per GPU, MFU
and the memory figures, which pytest-benchmark has no fields for. The statistics, machine info and
commit info are pytest-benchmark's own (`Stats`, `pytest_benchmark_generate_machine_info`,
`get_commit_info`), so the files cannot drift from what its readers expect.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from harness.measure.records import CaseRun
from harness.spec.files import write_atomic


def benchmark_entries(runs: list[CaseRun], procs_per_card: dict[str, int]) -> list[dict]:
    from pytest_benchmark.stats import Stats

    from harness.baselines.store import figures_of

    grouped: dict[tuple[str, str], list[CaseRun]] = {}
    for run in runs:
        if run.fidelity == "real" and run.ok:
            grouped.setdefault((run.case_id, run.variant), []).append(run)
    entries = []
    for (case_id, variant), reps in sorted(grouped.items()):
        stats = Stats()
        for run in reps:
            r0 = run.ranks[0]
            for t in r0.step_times_s[r0.warmup_steps:]:
                stats.update(t)
        if not stats:
            continue
        figs = [figures_of(r, procs_per_card.get(case_id, 1)) for r in reps]
        r0 = reps[0].ranks[0]
        name = case_id + (f"@{variant}" if variant else "")
        entries.append({
            "group": case_id.split("-")[0],
            "name": name,
            "fullname": f"cases/{case_id}.yaml::{name}",
            "params": {"variant": variant} if variant else None,
            "param": variant or None,
            "extra_info": {
                "unit": "seconds per optimizer step",
                "tokens_per_step": r0.tokens_per_step,
                "tokens_per_s_per_gpu": [f.tokens_per_s_per_gpu for f in figs],
                "mfu": [f.mfu for f in figs],
                "per_card_peak_bytes": [f.per_card_peak for f in figs],
                "allocated_peak_bytes": [f.allocated_peak for f in figs],
                "reserved_peak_bytes": [f.reserved_peak for f in figs],
                # the slowest card's SM clock while the steps were timed (harness.measure.clocks)
                "sm_clock_mhz_median": [f.clocks.sm_mhz_median if f.clocks else None for f in figs],
                "gpu_utilization": [f.clocks.utilization if f.clocks else None for f in figs],
                "device": r0.device_name,
                "ranks": r0.world_size,
                "emulated_card_bytes": r0.emulated_card_bytes,
                "versions": r0.versions,
            },
            "options": {"timer": "torch.cuda.synchronize + time.perf_counter", "warmup": r0.warmup_steps,
                        "repetitions": len(reps)},
            "stats": {**stats.as_dict(), "data": list(stats.data), "iterations": 1},
        })
    return entries


def write_benchmark_json(path: Path, runs: list[CaseRun], procs_per_card: dict[str, int]) -> int:
    from pytest_benchmark import __version__
    from pytest_benchmark.plugin import pytest_benchmark_generate_machine_info
    from pytest_benchmark.utils import get_commit_info

    entries = benchmark_entries(runs, procs_per_card)
    doc = {
        "machine_info": pytest_benchmark_generate_machine_info(),
        "commit_info": get_commit_info("oom-harness"),
        "benchmarks": entries,
        "datetime": dt.datetime.now(dt.timezone.utc).isoformat(),
        "version": __version__,
    }
    write_atomic(Path(path), json.dumps(doc, indent=1))
    return len(entries)
