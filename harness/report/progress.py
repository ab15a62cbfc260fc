"""Progress a person can follow while cases run: which case, the phase its training processes report,
the time it has taken and the time it is expected to take.

The phase is read from the case's own log (`log.txt` in its run folder), where every worker writes a
line as it loads, starts its engine, finishes a step and probes (harness.runtime.worker), so nothing
in the runtime has to know it is watched. The expected time is the previous run's wall time in the
same run folder where one is there, else the steps the case's baseline timed (the load is not in it,
and the line says so). On a terminal the line updates in place; elsewhere (a CI log) a plain line is
written when the phase changes, and at most once a minute while it does not.

    progress = Progress()
    with progress.case("[3/12] 003-qlora-fix-r16-seq512-gc real", run_root / "real", case_id, expected):
        session.judge(case_id, "real")
"""

from __future__ import annotations

import re
import statistics
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_WORKER_LINE = re.compile(r"\[harness\.runtime\.worker\] \S+ rank (\d+)[^:]*: (.+?) \(\d+\.\d s\)\s*$")
TAIL_BYTES = 8192
PLAIN_EVERY_S = 60.0


@dataclass(frozen=True)
class Expected:
    seconds: float
    source: str  # 'the previous run', "the baseline's timed steps (load not included)"


def expected_time(case_id: str, fidelity: str, folder: Path, baselines=()) -> Expected | None:
    """How long the case should take: the previous run recorded in `folder` (`run.json` of the run
    folder `Session` uses, before it is replaced), else, at full size, the sum of the step times of the
    case's baseline as written (the median over its repetitions)."""
    from harness.measure.records import CaseRun

    record = Path(folder) / case_id / "run.json"
    try:
        return Expected(CaseRun.model_validate_json(record.read_text()).wall_s, "the previous run")
    except (OSError, ValueError):
        pass
    if fidelity != "real":
        return None
    sums = [sum(f.step_times_s) for b in baselines if b.case_id == case_id and not b.variant
            for f in b.runs if f.step_times_s]
    return Expected(statistics.median(sums), "the baseline's timed steps (load not included)") if sums else None


def phase_of(folder: Path, case_id: str) -> str:
    """The last thing the case's rank 0 (else any rank) reported in its newest log.txt: 'loaded, 3.10 GiB
    peak allocated', 'step 2/5 in 1.20 s', 'probes'; 'starting' before any."""
    dirs = [d for d in Path(folder).glob(f"{case_id}*") if d.name == case_id or d.name.startswith(case_id + "@")]
    logs = [p for d in dirs for p in d.rglob("log.txt")]
    if not logs:
        return "starting"
    newest = max(logs, key=lambda p: p.stat().st_mtime)
    try:
        with newest.open("rb") as f:
            f.seek(max(0, newest.stat().st_size - TAIL_BYTES))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return "starting"
    found = [m for m in map(_WORKER_LINE.search, lines) if m]
    if not found:
        return "starting"
    rank0 = [m for m in found if m.group(1) == "0"]
    where = "" if newest.parent.name == case_id else f" ({newest.parent.relative_to(folder)})"
    return (rank0 or found)[-1].group(2) + where


class Progress:
    """Writes the progress of one case at a time to `stream` (default: stderr)."""

    def __init__(self, stream=None, interval_s: float | None = None):
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = interval_s if interval_s is not None else (1.0 if self.tty else 5.0)

    def line(self, label: str, phase: str, elapsed: float, expected: Expected | None) -> str:
        text = f"{label}: {phase}, {elapsed:.0f} s"
        if expected is not None:
            text += f" of ~{expected.seconds:.0f} s expected ({expected.source})"
        return text

    @contextmanager
    def case(self, label: str, folder: Path, case_id: str, expected: Expected | None = None):
        """Report the case's progress until the block ends."""
        done = threading.Event()
        started = time.monotonic()
        last = {"phase": None, "at": 0.0, "width": 0}

        def tick() -> None:
            phase = phase_of(folder, case_id)
            now = time.monotonic()
            text = self.line(label, phase, now - started, expected)
            if self.tty:
                self.stream.write("\r" + text.ljust(last["width"]))
                last["width"] = len(text)
            elif phase != last["phase"] or now - last["at"] >= PLAIN_EVERY_S:
                self.stream.write(text + "\n")
                last["at"] = now
            last["phase"] = phase
            self.stream.flush()

        def watch() -> None:
            while not done.wait(self.interval_s):
                try:
                    tick()
                except (OSError, ValueError):  # a log being replaced, a closed stream: the next tick tries again
                    pass

        thread = threading.Thread(target=watch, name="harness-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
            if self.tty and last["width"]:
                self.stream.write("\r" + " " * last["width"] + "\r")  # the summary line takes its place
                self.stream.flush()
