"""What the harness knows of each case at full size: its predicted peak against its target card, and its
last measured baseline. Printed under a tiny run's table, so that a run on a CPU also says how the
full-size configs stand.

The prediction is `oom-harness check`'s (harness.predict.predictor, calibrated on the baselines); the
measurement is the newest repetition of the case's baseline, as written where one exists, else of a
measured variant (fewer ranks or layers), named as such. Whole-card runs (variant `u`) are left out:
their peak is not against the target card.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.baselines.store import Baseline, Figures
from harness.report.columns import aligned
from harness.spec.schema import Case
from harness.spec.units import fmt_gib
from harness.spec.variants import parse_variant

COLUMNS = ("case", "target card (budget)", "predicted/card", "expected", "last measured/card")


@dataclass(frozen=True)
class Measured:
    """One repetition of a baseline: the newest of the case's."""

    baseline: Baseline
    figures: Figures

    @property
    def day(self) -> str:
        return self.figures.recorded or self.baseline.recorded

    def cell(self) -> str:
        b, f = self.baseline, self.figures
        where = f"{b.platform.device_name} x{b.platform.device_count}"
        variant = f", variant {b.variant}" if b.variant else ""
        outcome = "fits" if f.outcome == "ok" else f.outcome
        return f"{fmt_gib(f.per_card_peak)} {outcome} ({where}{variant}, {self.day})"


def last_measured(case_id: str, baselines: list[Baseline]) -> Measured | None:
    """The newest repetition of the case's baseline as written, else of its newest measured variant."""
    mine = [b for b in baselines if b.case_id == case_id and not parse_variant(b.variant).uncapped]
    as_written = [b for b in mine if not b.variant]
    candidates = [Measured(b, f) for b in (as_written or mine) for f in b.runs]
    return max(candidates, key=lambda m: m.day, default=None)


@dataclass(frozen=True)
class FullSize:
    case: Case
    predicted: int | None  # per card: the device figure times the jobs sharing the card
    problem: str | None  # why there is no prediction
    measured: Measured | None

    def row(self) -> tuple[str, ...]:
        case = self.case
        budget = case.budget_bytes
        card = f"{case.target.card.name} ({fmt_gib(budget)})"
        if self.predicted is None:
            predicted = f"- ({self.problem})"
        else:
            predicted = f"{fmt_gib(self.predicted)} {'fits' if self.predicted <= budget else 'oom'}"
        measured = self.measured.cell() if self.measured else "-"
        return (case.id, card, predicted, case.expect.outcome, measured)


def full_size(cases: list[Case], baselines: list[Baseline], predict=None) -> list[FullSize]:
    """Each case's prediction and newest measurement. `predict` defaults to the harness's predictor
    (imported here: it pulls in torch on a cold trace cache)."""
    if predict is None:
        from harness.predict.predictor import predict
    rows = []
    for case in cases:
        predicted, problem = None, None
        try:
            predicted = predict(case).device * case.launch.procs_per_card
        except (ValueError, KeyError, NotImplementedError, RuntimeError) as exc:
            # a case the predictor cannot model yet still gets its row and its measurement
            problem = f"{type(exc).__name__}: {exc}".splitlines()[0][:80]
        rows.append(FullSize(case, predicted, problem, last_measured(case.id, baselines)))
    return rows


def table(rows: list[FullSize]) -> str:
    cells = [COLUMNS] + [r.row() for r in rows]
    return aligned(cells)


TITLE = ("At full size: the predicted peak per card (device figure, as `oom-harness check` gives it) against "
         "the case's card and headroom, and the newest baseline where one was measured")
