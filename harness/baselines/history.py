"""History: every full-size run's figures, one line each, in a file per runner, so that a change point
detector (harness.judge.changepoints) can find the night a metric shifted.

A baseline holds the repetitions someone blessed; the history holds every night, blessed or not. Its
format (docs/baselines.md#history) is JSON Lines, one file per runner: `<dir>/<runner>.jsonl`, each
line one case run (`Entry`), appended in the order the runs finished. A line is never rewritten, so
the files merge in git and sit in any artifact store. The runner's name is `HARNESS_RUNNER`, else the
host's name; the folder is `HARNESS_HISTORY_DIR` (the nightly workflow sets results/history).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import socket
import sys
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from harness.measure.records import CaseRun

FORMAT = 1
HISTORY_ENV = "HARNESS_HISTORY_DIR"
RUNNER_ENV = "HARNESS_RUNNER"

# the metrics kept, each with whether a higher value is better
METRICS = {"tokens_per_s_per_gpu": True, "device_step_s": False, "mfu": True, "per_card_peak": False}


class Entry(BaseModel):
    """One full-size run of one case (one variant) on one runner."""

    format: int = FORMAT
    run: str  # unique: the time it finished and the case, '2026-11-29T02:00:00Z 003-...@2r'
    recorded: str  # ISO 8601, UTC
    runner: str
    platform: str  # harness.measure.device_parts.platform_key: card kind and count
    case: str
    variant: str = ""
    outcome: str  # ok, or the failure kind
    metrics: dict[str, float] = Field(default_factory=dict)  # METRICS that the run measured
    cpu_threads: int | None = None
    host_cpu: str | None = None
    versions: dict[str, str] = Field(default_factory=dict)
    commit: str | None = None  # the harness checkout's commit, where known ($GITHUB_SHA)

    @property
    def series(self) -> tuple[str, str, str]:
        """What one series of nights holds: one case and variant on one platform."""
        return (self.platform, self.case, self.variant)


def runner_name() -> str:
    return os.environ.get(RUNNER_ENV) or socket.gethostname() or "runner"


def history_dir() -> Path | None:
    value = os.environ.get(HISTORY_ENV, "")
    return Path(value) if value else None


def history_file(folder: Path, runner: str) -> Path:
    """`folder`/<runner>.jsonl, the runner's name reduced to a file name."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", runner).strip(".-") or "runner"
    return Path(folder) / f"{name}.jsonl"


def entry_of(run: CaseRun, procs_per_card: int, runner: str | None = None, when: dt.datetime | None = None) -> Entry:
    """The history line of a full-size run."""
    from harness.baselines.store import PlatformInfo

    when = when or dt.datetime.now(dt.timezone.utc)
    stamp = when.strftime("%Y-%m-%dT%H:%M:%SZ")
    err = run.first_error()
    metrics = {"tokens_per_s_per_gpu": run.per_card_rate(procs_per_card),
               "mfu": run.per_card_rate(procs_per_card, "mfu"),
               "per_card_peak": run.per_card_peak(procs_per_card),
               "device_step_s": max((r.device_step_s for r in run.ranks if r.device_step_s), default=None)}
    first = run.ranks[0] if run.ranks else None
    return Entry(run=f"{stamp} {run.case_id}{'@' + run.variant if run.variant else ''}", recorded=stamp,
                 runner=runner or runner_name(), platform=PlatformInfo.of_run(run).key if run.ranks else "-",
                 case=run.case_id, variant=run.variant, outcome="ok" if err is None else err.kind.value,
                 metrics={k: float(v) for k, v in metrics.items() if v},
                 cpu_threads=first.cpu_threads if first else None, host_cpu=first.host_cpu if first else None,
                 versions=first.versions if first else {}, commit=os.environ.get("GITHUB_SHA"))


def append(path: Path, entries: list[Entry]) -> None:
    """Add `entries` at the end of the file (created with its folder where missing), one line each,
    in one write: a line is whole or absent."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(e.model_dump_json() + "\n" for e in entries)
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


def read(path: Path, warn=None) -> list[Entry]:
    """The entries of a history file; a line that is not an entry is named (`warn`, default stderr) and
    skipped, so one torn line does not hide the nights around it."""
    out = []
    warn = warn or (lambda line: print(f"oom-harness: warning: {line}", file=sys.stderr))
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(Entry.model_validate(json.loads(line)))
        except (ValueError, ValidationError) as exc:
            warn(f"{path}:{n}: skipped, not a history entry ({str(exc).splitlines()[0][:120]})")
    return out


def read_all(folder: Path) -> dict[str, list[Entry]]:
    """runner -> its entries, for every *.jsonl in `folder`."""
    return {p.stem: read(p) for p in sorted(Path(folder).glob("*.jsonl"))} if Path(folder).is_dir() else {}
