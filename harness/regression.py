"""A full-size run against its baseline: the per-card peak must not rise, tokens/s must not drop,
each beyond a tolerance.

The tolerance is the case's own (`expect.memory_tolerance`, `expect.speed_tolerance`) where the case
sets one; otherwise it comes from the noise the baseline's repetitions showed: three times their
largest relative deviation from the median, and never below a floor (allocator peaks repeat to the
byte on one software stack, step times do not). A baseline of a single repetition has no spread;
the floor alone applies and the verdict says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.baselines import Baseline, Figures, load_baselines
from harness.schema import Case
from harness.units import fmt_gib
from harness.verdicts import Verdict

MEMORY_FLOOR = 0.02
SPEED_FLOOR = 0.05
SPREAD_FACTOR = 3.0


@dataclass(frozen=True)
class Tolerance:
    value: float
    why: str


def tolerance(explicit: float | None, spread: tuple[float, float] | None, repetitions: int, floor: float) -> Tolerance:
    if explicit is not None:
        return Tolerance(explicit, "set by the case")
    if spread is None or repetitions < 2:
        return Tolerance(floor, f"floor {floor:.0%}: the baseline has one repetition, so no spread")
    derived = SPREAD_FACTOR * spread[1]
    if derived <= floor:
        return Tolerance(floor, f"floor {floor:.0%} (spread over {repetitions} repetitions: {spread[1]:.1%})")
    return Tolerance(derived, f"{SPREAD_FACTOR:g} x the spread over {repetitions} repetitions ({spread[1]:.1%})")


def find_baseline(case_id: str, variant: str, platform_key: str, baselines: list[Baseline] | None = None) -> Baseline | None:
    for b in baselines if baselines is not None else load_baselines():
        if b.case_id == case_id and b.variant == variant and b.platform.key == platform_key:
            return b
    return None


def against_baseline(case: Case, figures: Figures, baseline: Baseline | None) -> list[Verdict]:
    if baseline is None:
        return [Verdict("baseline", "not_checkable", "no baseline for this case on this platform (oom-harness bless)")]
    if figures.outcome != "ok" or any(r.outcome != "ok" for r in baseline.runs):
        return [Verdict("baseline", "not_checkable", f"run {figures.outcome}, baseline "
                        f"{baseline.runs[0].outcome}: only finished runs are compared")]
    out = []
    peak = baseline.spread("per_card_peak")
    caches = {r.triton_cache for r in baseline.runs} - {None}
    if figures.triton_cache and caches and caches != {figures.triton_cache}:
        # compiling Triton kernels holds GiBs outside the allocator (harness.compile_cache): not a regression
        out.append(Verdict("baseline_memory", "not_checkable",
                           f"this run had a {figures.triton_cache} Triton cache, the baseline "
                           f"{' and '.join(sorted(caches))}; peaks are compared between runs of one kind"))
        peak = None
    if peak is not None and figures.per_card_peak is not None:
        tol = tolerance(case.expect.memory_tolerance, peak, len(baseline.runs), MEMORY_FLOOR)
        limit = peak[0] * (1 + tol.value)
        ok = figures.per_card_peak <= limit
        out.append(Verdict("baseline_memory", "confirmed" if ok else "refuted",
                           f"per-card peak {fmt_gib(figures.per_card_peak)} vs baseline {fmt_gib(peak[0])} "
                           f"(limit {fmt_gib(limit)}, +{tol.value:.1%}: {tol.why}; recorded {baseline.recorded})"))
    speed = baseline.spread("tokens_per_s_per_gpu")
    if speed is not None and figures.tokens_per_s_per_gpu is not None:
        tol = tolerance(case.expect.speed_tolerance, speed, len(baseline.runs), SPEED_FLOOR)
        floor = speed[0] * (1 - tol.value)
        ok = figures.tokens_per_s_per_gpu >= floor
        out.append(Verdict("baseline_speed", "confirmed" if ok else "refuted",
                           f"{figures.tokens_per_s_per_gpu:,.0f} tokens/s per GPU vs baseline {speed[0]:,.0f} "
                           f"(floor {floor:,.0f}, -{tol.value:.1%}: {tol.why})"))
    return out or [Verdict("baseline", "not_checkable", "the baseline holds no peak or speed to compare")]
