"""What `oom-harness compare` reads from a run: each metric of a finished run, from a `run --json` file
(one run per pair of separate runs, or one turn of a resident arm's run: harness.cli.compare_resident)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def finished_runs(json_path: Path) -> list:
    """The finished runs (`CaseRun`) of a `run --json` file."""
    from harness.measure.records import CaseRun

    runs = [CaseRun.model_validate(entry["run"]) for entry in json.loads(json_path.read_text())]
    return [run for run in runs if run.ok]


def figures(run) -> tuple[str, dict[str, float]]:
    """case[@variant], and metric -> value of one finished run."""
    procs = max(1, len({r.process_slot for r in run.ranks}))
    name = run.case_id + (f"@{run.variant}" if run.variant else "")
    walls = [statistics.median(r.step_times_s[r.warmup_steps:]) for r in run.ranks
             if r.step_times_s[r.warmup_steps:]]
    values = {"tokens_per_s": run.per_card_rate(procs),
              "device_step_s": max((r.device_step_s for r in run.ranks if r.device_step_s), default=None),
              "wall_step_s": max(walls, default=None),
              "per_card_peak": run.per_card_peak(procs)}
    return name, {k: float(v) for k, v in values.items() if v}
