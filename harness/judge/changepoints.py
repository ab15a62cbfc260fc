"""Change points in a history of nights (harness.baselines.history): the runs after which a metric
shifted, found by a maintained detector rather than a fixed floor, so that a 5% step is named within
a few nights and a noisy metric does not alarm every week.

The detector is PELT (`ruptures`, a maintained change point library): the segmentation of the
series into runs of constant mean that minimises the squared error plus a penalty per change. It runs
on log values scaled by the series' own noise (the median absolute difference of successive nights,
robust to the steps themselves), so one penalty serves every metric whatever its noise. MongoDB's
E-Divisive (`signal-processing-algorithms`) and Apache Otava were the first choices: the former
requires Python 3.11 exactly and numpy < 2 (torch's current wheels need numpy 2), the latter pins
numpy 2.2.0 and brings BigQuery, Postgres and Slack clients; neither installs beside this harness.

A shift counts when it is also larger than `THRESHOLD` (the medians of the segments either side), so a
change that is real but too small to matter names no night. The penalty, minimum segment and threshold
were chosen on simulated histories drawn from the measured run-to-run noise
(benchmarks/throughput_power.py --simulate; the detection rates are in docs/baselines.md).
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass

from harness.baselines.history import METRICS, Entry

PENALTY = 14.0  # per change, in units of the series' noise variance
MIN_SIZE = 3  # nights on each side of a change
THRESHOLD = 0.03  # a shift smaller than this (3%) names no night
MIN_NIGHTS = 6  # a series shorter than this is not searched


def noise_scale(logs: list[float]) -> float:
    """The series' noise: the median absolute difference of successive values over sqrt(2) and the
    normal's MAD constant; steps move few of the differences, so they barely move it."""
    diffs = [abs(b - a) for a, b in itertools.pairwise(logs)]
    if not diffs:
        return 0.0
    return statistics.median(diffs) / (math.sqrt(2) * 0.6745)


def breaks(values: list[float], penalty: float = PENALTY, min_size: int = MIN_SIZE,
           threshold: float = THRESHOLD) -> list[tuple[int, float, float]]:
    """(index of the first value after the change, median before, median after) for each change of
    `values` (positive numbers, in order) larger than `threshold`."""
    import numpy as np
    import ruptures

    if len(values) < max(MIN_NIGHTS, 2 * min_size):
        return []
    logs = [math.log(v) for v in values]
    scale = noise_scale(logs)
    if scale <= 0:  # nights equal to the digit: any shift is a change of the value itself
        scale = max(1e-9, min((abs(b - a) for a, b in itertools.pairwise(logs) if b != a), default=1e-9) / 4)
    signal = np.asarray(logs).reshape(-1, 1) / scale
    ends = ruptures.Pelt(model="l2", min_size=min_size, jump=1).fit(signal).predict(pen=penalty)
    edges = [0, *ends]
    out = []
    for a, b, c in zip(edges, edges[1:], edges[2:], strict=False):
        before, after = statistics.median(values[a:b]), statistics.median(values[b:c])
        if abs(after / before - 1) >= threshold:
            out.append((b, before, after))
    return out


@dataclass(frozen=True)
class Shift:
    """A change point: the series and metric, the first run after it, and the medians either side."""

    platform: str
    case: str
    variant: str
    metric: str
    first_run: str  # Entry.run of the first night after the change
    recorded: str
    index: int  # that night's position in the series
    before: float
    after: float

    @property
    def change(self) -> float:
        return self.after / self.before - 1

    @property
    def worse(self) -> bool:
        return (self.change < 0) == METRICS[self.metric]

    def text(self) -> str:
        name = self.case + (f"@{self.variant}" if self.variant else "")
        return (f"{name} on {self.platform}: {self.metric} {'worse' if self.worse else 'better'} by "
                f"{abs(self.change):.1%} (median {self.before:,.4g} -> {self.after:,.4g}) from run "
                f"'{self.first_run}' on")


def series_of(entries: list[Entry]) -> dict[tuple[str, str, str], list[Entry]]:
    """The finished runs of each case, variant and platform, in the order they were recorded."""
    out: dict[tuple[str, str, str], list[Entry]] = {}
    for e in sorted(entries, key=lambda e: e.recorded):
        if e.outcome == "ok":
            out.setdefault(e.series, []).append(e)
    return out


def shifts(entries: list[Entry], threshold: float = THRESHOLD) -> list[Shift]:
    """Every change point of every metric of every series in `entries`."""
    found = []
    for (platform, case, variant), runs in series_of(entries).items():
        for metric in METRICS:
            points = [e for e in runs if e.metrics.get(metric)]
            for i, before, after in breaks([e.metrics[metric] for e in points], threshold=threshold):
                found.append(Shift(platform, case, variant, metric, points[i].run, points[i].recorded, i,
                                   before, after))
    return found


def new_shifts(entries: list[Entry], new: set[str], threshold: float = THRESHOLD) -> list[Shift]:
    """The change points that appear once the runs named in `new` are added: found with them and not
    (within a night either way) without them. A shift is new on the first night it can be told,
    which may be a few nights after it happened; it is reported once, then stays in the series."""
    before = {(s.platform, s.case, s.variant, s.metric, s.index)
              for s in shifts([e for e in entries if e.run not in new], threshold)}
    return [s for s in shifts(entries, threshold)
            if not any((s.platform, s.case, s.variant, s.metric, s.index + d) in before for d in (-1, 0, 1))]
