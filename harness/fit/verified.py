"""What `fit --verify` measured, set against what the search predicted for the same config.

The run says whether the fitted config fit its (emulated) card; this says how far the prediction
was from it: the measured per-card peak against the predicted one and against the prediction plus
its margin (the figure the verdict was drawn from), and the measured tokens/s per card against the
throughput model's. A measured peak above the prediction plus its margin is a fit the margin did not
cover, whatever the card's headroom absorbed, and is said as such.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harness.baselines.store import read_runs
from harness.premerge.check import CheckResult
from harness.spec.units import fmt_gib, gib_rounded


@dataclass(frozen=True)
class Verified:
    run_json: Path
    outcome: str  # "ok", or the run's failure kind ("oom", "timeout", ...)
    measured_card_peak: int | None  # bytes; None where the run measured no step
    predicted_card_peak: int
    margin: int  # bytes added to the prediction before the verdict (FitVerdict.margin)
    margin_fraction: float
    budget: int
    measured_tokens_per_s: float | None  # per card
    predicted_tokens_per_s: float

    @property
    def peak_error(self) -> float | None:
        """predicted / measured - 1 (negative: the prediction was low)."""
        if not self.measured_card_peak:
            return None
        return self.predicted_card_peak / self.measured_card_peak - 1

    @property
    def predicted_with_margin(self) -> int:
        """What the verdict compared with the budget (FitVerdict.needed)."""
        return self.predicted_card_peak + self.margin

    @property
    def within_margin(self) -> bool | None:
        """The measured peak within the prediction plus its margin (None: nothing measured)."""
        if self.measured_card_peak is None:
            return None
        return self.measured_card_peak <= self.predicted_with_margin

    @property
    def tokens_error(self) -> float | None:
        if not self.measured_tokens_per_s:
            return None
        return self.predicted_tokens_per_s / self.measured_tokens_per_s - 1

    def lines(self) -> list[str]:
        out = [f"verified ({self.run_json}): {self.outcome}"]
        if self.measured_card_peak is not None:
            out.append(f"  per card: measured {fmt_gib(self.measured_card_peak)}, predicted "
                       f"{fmt_gib(self.predicted_card_peak)} ({self.peak_error:+.1%}), with its margin "
                       f"{fmt_gib(self.predicted_with_margin)} ({self.margin_fraction:.1%}), budget "
                       f"{fmt_gib(self.budget)}")
            if not self.within_margin:
                out.append("  the measured peak is above the prediction plus its margin: the margin did not "
                           "cover this config" + (", the card's headroom did" if self.outcome == "ok" else ""))
        if self.measured_tokens_per_s:
            out.append(f"  tokens/s per card: measured {self.measured_tokens_per_s:,.0f}, predicted "
                       f"{self.predicted_tokens_per_s:,.0f} ({self.tokens_error:+.1%})")
        return out

    def as_json(self) -> dict:
        return {"run_json": str(self.run_json), "outcome": self.outcome,
                "measured_card_peak_gib": gib_rounded(self.measured_card_peak),
                "predicted_card_peak_gib": gib_rounded(self.predicted_card_peak),
                "peak_error": None if self.peak_error is None else round(self.peak_error, 4),
                "margin_fraction": round(self.margin_fraction, 4), "within_margin": self.within_margin,
                "budget_gib": gib_rounded(self.budget),
                "measured_tokens_per_s": None if self.measured_tokens_per_s is None
                else round(self.measured_tokens_per_s, 1),
                "predicted_tokens_per_s": round(self.predicted_tokens_per_s, 1),
                "tokens_error": None if self.tokens_error is None else round(self.tokens_error, 4)}


def read_verified(run_json: Path, predicted: CheckResult, predicted_tokens_per_s: float) -> Verified:
    """The verify run's JSON (`oom-harness run --json`, one run) against the written config's check."""
    (run,) = read_runs([run_json])
    procs = predicted.config.procs_per_gpu
    error = run.first_error()
    fit = predicted.fit
    return Verified(
        run_json=Path(run_json), outcome="ok" if error is None else error.kind.value,
        measured_card_peak=run.per_card_peak(procs), predicted_card_peak=fit.predicted,
        margin=fit.margin, margin_fraction=fit.margin_of.fraction, budget=fit.budget,
        measured_tokens_per_s=run.per_card_rate(procs), predicted_tokens_per_s=predicted_tokens_per_s)
