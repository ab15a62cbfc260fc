"""What `fit --verify` measured, set against what the search predicted for the same config.

The run says whether the fitted config fit its (emulated) card; this says how far the prediction
was from it: the measured per-card peak against the predicted one and against the prediction plus
its margin (the figure the verdict was drawn from), and the measured tokens/s per card against the
throughput model's. A measured peak above the prediction plus its margin is a fit the margin did not
cover, whatever the card's headroom absorbed, and is said as such.

A config too big for the host (`--depth-points`) runs at a few layer counts on the ranks the host
has. Its full-size peak is then not measured, and a depth fit carried from ranks it does not have
would not be it either (ZeRO-3 shards over 2 ranks what the job shards over 8). So each measured
shape is set against the prediction for that same shape: the predictor's error there is the figure
that says whether the full-size verdict can be trusted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harness.baselines.store import read_runs
from harness.premerge.check import CheckResult
from harness.spec.units import fmt_gib, gib_rounded


@dataclass(frozen=True)
class DepthPoint:
    """One shape of a depth series: measured against the prediction for the same shape."""

    shape: str  # "4 of 64 layers, 2 of 8 ranks"
    measured: int  # per-card peak, bytes
    predicted: int

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1


@dataclass(frozen=True)
class Verified:
    run_json: Path
    outcome: str  # "ok", or the run's failure kind ("oom", "timeout", ...)
    measured_card_peak: int | None  # bytes; None where no step was measured, or only smaller shapes were
    predicted_card_peak: int
    margin: int  # bytes added to the prediction before the verdict (FitVerdict.margin)
    margin_fraction: float
    budget: int
    measured_tokens_per_s: float | None  # per card
    predicted_tokens_per_s: float
    points: tuple[DepthPoint, ...] = ()  # a depth series (`--depth-points`), each shape as measured

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
        """The measured peak within the prediction plus its margin; for a depth series, every measured
        shape within its own prediction plus the same fraction (None: nothing measured)."""
        if self.points:
            # the shortfall as the margin computes it (harness.predict.margin): the run that sets the
            # margin is within it
            return all(p.measured / p.predicted - 1 <= self.margin_fraction for p in self.points)
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
        if self.points:
            out.append(f"  per card: predicted {fmt_gib(self.predicted_card_peak)} at full size, with its margin "
                       f"{fmt_gib(self.predicted_with_margin)} ({self.margin_fraction:.1%}), budget "
                       f"{fmt_gib(self.budget)}; measured at smaller shapes, each against its own prediction:")
            out += [f"    {p.shape}: measured {fmt_gib(p.measured)}, predicted {fmt_gib(p.predicted)} "
                    f"({p.error:+.1%})" for p in self.points]
            if not self.within_margin:
                out.append(f"  a measured shape is above its prediction plus {self.margin_fraction:.1%}: the margin "
                           "would not have covered it")
        elif self.measured_card_peak is not None:
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
                "tokens_error": None if self.tokens_error is None else round(self.tokens_error, 4),
                "depth_points": [{"shape": p.shape, "measured_gib": gib_rounded(p.measured),
                                  "predicted_gib": gib_rounded(p.predicted), "error": round(p.error, 4)}
                                 for p in self.points]}


def read_verified(run_json: Path, predicted: CheckResult, predicted_tokens_per_s: float,
                  case_dir: Path | None = None) -> Verified:
    """The verify run's JSON (`oom-harness run --json`) against the written config's check: one run
    at full size, or a depth series of the case in `case_dir` (`--depth-points`)."""
    runs = read_runs([run_json])
    procs = predicted.config.procs_per_gpu
    fit = predicted.fit
    error = next((e for r in runs if (e := r.first_error()) is not None), None)
    single = len(runs) == 1
    return Verified(
        run_json=Path(run_json), outcome="ok" if error is None else error.kind.value,
        measured_card_peak=runs[0].per_card_peak(procs) if single else None,
        predicted_card_peak=fit.predicted, margin=fit.margin, margin_fraction=fit.margin_of.fraction,
        budget=fit.budget, measured_tokens_per_s=runs[0].per_card_rate(procs) if single else None,
        predicted_tokens_per_s=predicted_tokens_per_s,
        points=() if single else _depth_points(runs, case_dir, run_json, procs))


def _depth_points(runs: list, case_dir: Path | None, run_json: Path, procs: int) -> tuple[DepthPoint, ...]:
    from harness.baselines.store import PlatformInfo
    from harness.predict.predictor import predict
    from harness.spec.cases import load_case
    from harness.spec.variants import parse_variant

    ids = {r.case_id for r in runs}
    if len(ids) != 1 or case_dir is None:
        raise ValueError(f"{run_json} holds {len(runs)} runs of {sorted(ids)}: a verify run is one case, "
                         "at full size or at the depth points of its case")
    case = load_case(Path(case_dir) / f"{ids.pop()}.yaml")
    points = []
    for run in runs:
        peak = run.per_card_peak(procs)
        if peak is None:  # a shape that measured no step: the outcome says why
            continue
        variant = parse_variant(run.variant)
        shape = variant.apply(case)
        points.append(DepthPoint(variant.label(case), peak,
                                 predict(shape, platform=PlatformInfo.of_run(run).key).device * procs))
    return tuple(points)
