"""Each reference estimator's error on measured runs (estimate / measured - 1), for a benchmark table.

Given (case as measured, its measured per-card device peak in bytes) pairs, every estimator's figure
is set against the measurement; `ErrorSummary` gives the median and the worst per estimator. The
case must be the one that ran (a baseline's variant applied first), and the peak the card's: every
process sharing it summed (`launch.procs_per_card`), as the estimates are.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from harness.predict.reference.estimators import ESTIMATORS, reference_estimates
from harness.spec.schema import Case


@dataclass(frozen=True)
class EstimatorError:
    """One estimator on one run."""

    estimator: str
    case_id: str
    estimate: int  # bytes per card
    measured: int  # bytes per card
    statement: str  # what the estimate counts (Estimate.counts)

    @property
    def error(self) -> float:
        """estimate / measured - 1: negative where the estimator said less than the card held."""
        return self.estimate / self.measured - 1


@dataclass(frozen=True)
class ErrorSummary:
    """One estimator over every run given."""

    estimator: str
    runs: tuple[EstimatorError, ...]

    @property
    def median(self) -> float:
        """The median signed error: the estimator's bias."""
        return statistics.median(r.error for r in self.runs)

    @property
    def median_abs(self) -> float:
        return statistics.median(abs(r.error) for r in self.runs)

    @property
    def worst(self) -> EstimatorError:
        """The run with the largest error either way."""
        return max(self.runs, key=lambda r: abs(r.error))

    @property
    def under(self) -> int:
        """Runs the estimator put below the measured peak (where it would have said a config fits
        that did not, on a card between the two)."""
        return sum(r.error < 0 for r in self.runs)


def estimator_errors(measured: Iterable[tuple[Case, int]]) -> dict[str, ErrorSummary]:
    """Every estimator's errors on `measured` (case as run, measured per-card device peak in bytes),
    keyed by estimator name in ESTIMATORS' order; each summary's runs are in the order given (a
    benchmark tells a case's variants apart by their position)."""
    runs: dict[str, list[EstimatorError]] = {name: [] for name in ESTIMATORS}
    for case, peak in measured:
        if not peak or peak <= 0:
            raise ValueError(f"case {case.id}: the measured per-card peak is {peak!r}; give the device peak in "
                             "bytes (a run without one cannot be compared)")
        for e in reference_estimates(case):
            runs[e.estimator].append(EstimatorError(e.estimator, case.id, e.per_card, int(peak), e.counts))
    if not any(runs.values()):
        raise ValueError("no measured runs given: pass (case, measured per-card device peak) pairs")
    return {name: ErrorSummary(name, tuple(found)) for name, found in runs.items()}
