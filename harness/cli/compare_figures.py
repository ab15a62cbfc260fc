"""What `oom-harness compare` reads from a run: each metric of a finished run, from a `run --json` file
(one run per pair of separate runs, or one turn of a resident arm's run: harness.cli.compare_resident)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def log_tail(log: Path, lines: int = 3) -> str:
    """The last lines of an arm's log, as one line for an error message."""
    try:
        return " | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:])[:300]
    except OSError:
        return ""


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


def provenance(folder: Path, key: str) -> dict | None:
    """What arm `key` ("A" or "B") ran on, from its first finished run in a compare's folder: the card, the
    host's CPU and threads, and the library versions its worker recorded. None where it finished none."""
    for name in (f"pair1-{key}.json", f"resident-{key}.json"):
        path = folder / name
        runs = finished_runs(path) if path.is_file() else []
        if runs and runs[0].ranks:
            rank = runs[0].ranks[0]
            return {"device_name": rank.device_name, "host_cpu": rank.host_cpu, "cpu_threads": rank.cpu_threads,
                    "versions": dict(rank.versions)}
    return None


def described(seen: dict | None) -> str:
    """One line of what an arm ran on: its card and the versions that an upgrade changes."""
    if seen is None:
        return "no finished run"
    versions = seen.get("versions") or {}
    libraries = ", ".join(f"{name} {versions[name]}" for name in ("torch", "triton", "transformers", "peft",
                                                                  "deepspeed", "llamafactory", "cuda", "driver")
                          if name in versions)
    return f"{seen.get('device_name')}, {libraries}"
