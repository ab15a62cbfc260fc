"""A full-size run against its baseline: the per-card peak must not rise, tokens/s must not drop,
each beyond a tolerance.

The tolerance is the case's own (`expect.memory_tolerance`, `expect.speed_tolerance`) where the case
sets one; otherwise it comes from the noise the baseline's repetitions showed: three times their
largest relative deviation from the median, and never below a floor (allocator peaks repeat to the
byte on one software stack, step times do not). A baseline of a single repetition has no spread;
the floor alone applies and the verdict says so.

Three times a wide spread can reach past zero: repetitions from different hosts of one card kind
differ in speed by up to 75% (docs/baselines.md), and a floor below zero tokens/s is a check
that cannot fail. So a derived limit is also bounded by the repetitions themselves: a run may be no
slower than the slowest of them, and use no more memory than the highest, by more than the floor.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from harness.baselines.store import MEMORY_FLOOR, Baseline, Figures, load_baselines, spread
from harness.judge.verdicts import Verdict
from harness.measure.clocks import clock_note
from harness.spec.schema import Case
from harness.spec.units import fmt_gib

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


def find_baseline(case_id: str, variant: str, platform_key: str,
                  baselines: list[Baseline] | None = None) -> Baseline | None:
    for b in baselines if baselines is not None else load_baselines():
        if b.case_id == case_id and b.variant == variant and b.platform.key == platform_key:
            return b
    return None


def no_baseline(case_id: str, variant: str, platform_key: str, baselines: list[Baseline] | None = None) -> str:
    """Why a run has no baseline, and what would give it one: a baseline blessed under another
    variant (guide 002's plain-python launch was blessed from `pytest --harness-grad-accum-cap 2`
    as 6L2ga, and the nightly job's single-rank step measures it as 6L) or on another platform."""
    mine = [b for b in (baselines if baselines is not None else load_baselines()) if b.case_id == case_id]
    here = sorted({b.variant or "as written" for b in mine if b.platform.key == platform_key})
    measured = variant or "as written"
    if here:
        return (f"no baseline for this case measured {measured} on {platform_key}; it has one measured "
                f"{' and '.join(here)}: measure it that way (layers, ranks and --grad-accum-cap make the "
                f"variant) or `oom-harness bless` this run's JSON")
    elsewhere = sorted({b.platform.key for b in mine})
    return (f"no baseline for this case on {platform_key}" + (f" (only on {', '.join(elsewhere)})" if elsewhere else "")
            + ": `oom-harness bless` this run's JSON once it is reviewed")


@dataclass(frozen=True)
class Limit:
    value: float  # the most (memory) or the least (speed) a run may show
    why: str


def limit(values: list[float], explicit: float | None, floor: float, upper: bool) -> Limit:
    """The bound on a figure whose baseline repetitions are `values`: the median plus (memory,
    `upper`) or minus (speed) the tolerance, bounded by the repetitions' own range plus the floor."""
    mid, deviation = spread(values)
    tol = tolerance(explicit, (mid, deviation), len(values), floor)
    sign = 1 if upper else -1
    by_spread = Limit(mid * (1 + sign * tol.value), f"{'+' if upper else '-'}{tol.value:.1%}: {tol.why}")
    if explicit is not None or len(values) < 2:
        return by_spread
    extreme = max(values) if upper else min(values)
    by_range = extreme * (1 + sign * floor)
    if (by_range < by_spread.value) if upper else (by_range > by_spread.value):
        return Limit(by_range, f"the {'highest' if upper else 'slowest'} of {len(values)} repetitions "
                               f"{'plus' if upper else 'less'} {floor:.0%}; {tol.why} would allow "
                               f"{'+' if upper else '-'}{tol.value:.0%}")
    return by_spread


def _under_condition(baseline: Baseline, attr: str, value, what: str, figure: str,
                     say) -> tuple[list[float], Verdict | None]:
    """The repetitions' `figure` measured under the run's condition `attr` (the Triton cache, the CPU
    threads): those of its value where some repetitions recorded it; every repetition where none
    did (blessed before the condition was recorded; the caller says so). Where repetitions recorded
    it and none under the run's value, nothing is comparable: `say(run's, baseline's)` words why."""
    seen = {getattr(r, attr) for r in baseline.runs if getattr(r, attr) is not None}
    if not value or not seen:
        return baseline.values(figure), None
    same = [getattr(r, figure) for r in baseline.runs if getattr(r, attr) == value and getattr(r, figure) is not None]
    if same:
        return same, None
    return [], Verdict(what, "not_checkable", say(value, " and ".join(str(v) for v in sorted(seen))))


def _host_side(figures: Figures, baseline: Baseline) -> str:
    """What the host contributed to a speed: the card's clock and what held it down, and a host CPU
    other than the baseline's (speed moves with both; memory does not)."""
    note = clock_note(figures.clocks, [r.clocks for r in baseline.runs if r.clocks])
    theirs = sorted({r.host_cpu for r in baseline.runs if r.host_cpu})
    if figures.host_cpu and theirs and figures.host_cpu not in theirs:
        note += f"; this host's CPU is {figures.host_cpu}, the baseline's {' and '.join(theirs)}"
    return note


def against_baseline(case: Case, figures: Figures, baseline: Baseline | None, missing: str = "") -> list[Verdict]:
    """`missing`: why there is no baseline (`no_baseline`), where `baseline` is None."""
    if baseline is None:
        return [Verdict("baseline", "not_checkable", missing or "no baseline for this case on this platform "
                                                             "(oom-harness bless)")]
    if figures.outcome != "ok" or any(r.outcome != "ok" for r in baseline.runs):
        return [Verdict("baseline", "not_checkable", f"run {figures.outcome}, baseline "
                        f"{baseline.runs[0].outcome}: only finished runs are compared")]
    out = []
    # compiling Triton kernels holds GiBs outside the allocator (harness.runtime.compile_cache): not a regression
    peaks, other = _under_condition(baseline, "triton_cache", figures.triton_cache, "baseline_memory", "per_card_peak",
                                    lambda run, base: f"this run had a {run} Triton cache, the baseline {base}; "
                                                      "peaks are compared between runs of one kind")
    if other:
        out.append(other)
    if peaks and figures.per_card_peak is not None:
        most = limit(peaks, case.expect.memory_tolerance, MEMORY_FLOOR, upper=True)
        ok = figures.per_card_peak <= most.value
        out.append(Verdict("baseline_memory", "confirmed" if ok else "refuted",
                           f"per-card peak {fmt_gib(figures.per_card_peak)} vs baseline "
                           f"{fmt_gib(statistics.median(peaks))} (limit {fmt_gib(most.value)}, {most.why}; "
                           f"recorded {baseline.recorded})"))
    # a CPU-bound step (CPU Adam under offload) scales with the threads: not a regression
    rates, other = _under_condition(baseline, "cpu_threads", figures.cpu_threads, "baseline_speed",
                                    "tokens_per_s_per_gpu",
                                    lambda run, base: f"this run had {run} CPU threads per process, the baseline "
                                                      f"{base}; speeds are compared at one thread count")
    if other:
        out.append(other)
    if rates and figures.tokens_per_s_per_gpu is not None:
        least = limit(rates, case.expect.speed_tolerance, SPEED_FLOOR, upper=False)
        ok = figures.tokens_per_s_per_gpu >= least.value
        every = len(baseline.values("tokens_per_s_per_gpu"))
        unrecorded = ("; the baseline's CPU threads were not recorded"
                      if figures.cpu_threads and not baseline.values("cpu_threads")
                      else f"; the {len(rates)} of {every} repetitions at {figures.cpu_threads} CPU "
                           f"thread{'s' if figures.cpu_threads > 1 else ''}"
                      if len(rates) < every else "")
        out.append(Verdict("baseline_speed", "confirmed" if ok else "refuted",
                           f"{figures.tokens_per_s_per_gpu:,.0f} tokens/s per GPU vs baseline "
                           f"{statistics.median(rates):,.0f} (floor {least.value:,.0f}, {least.why}){unrecorded}"
                           f"{_host_side(figures, baseline)}"))
    return out or [Verdict("baseline", "not_checkable", "the baseline holds no peak or speed to compare")]
