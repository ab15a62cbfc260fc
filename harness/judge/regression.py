"""A full-size run against its baseline: the per-card peak must not rise, tokens/s must not drop.

Speed is judged by a statistical test (harness.judge.stats.run_vs_baseline): the run's log tokens/s
against the mean of the baseline's repetitions, with the run-to-run noise pooled over the platform's
baselines; it flags a clean run with probability `stats.ALPHA` and states, in every verdict, the
slowdown it catches with `stats.POWER`. Speeds are compared across CPU thread counts where the config
does no CPU-side work (no offload: the host only launches kernels); where it does and no repetition
ran at the run's thread count, the verdict says NOT CHECKED (`not_checkable`), never a pass. Where no
baseline of the platform has two repetitions, nothing estimates the noise: the old fixed floor
applies and the verdict calls the check weak.

Memory, and speed under a case's own `expect.speed_tolerance`, keep a tolerance: the case's own where
it sets one; otherwise three times the repetitions' largest relative deviation from the median, never
below a floor (allocator peaks repeat to the byte on one software stack). Three times a wide spread
can reach past zero, so a derived limit is also bounded by the repetitions themselves: a run may use
no more memory than the highest of them by more than the floor.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from harness.baselines.store import MEMORY_FLOOR, Baseline, Figures, load_baselines, spread
from harness.judge.stats import Noise, pooled_noise, run_vs_baseline
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
                  baselines: list[Baseline] | None = None, runtime: str | None = None) -> Baseline | None:
    """The case's baseline for this variant and platform; with `runtime`, only one whose runs trained the same
    way (a framework's runs are not held to the harness loop's, `Baseline.runtime`)."""
    for b in baselines if baselines is not None else load_baselines():
        if b.case_id == case_id and b.variant == variant and b.platform.key == platform_key and (
                runtime is None or b.runtime == runtime):
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


def cpu_side_work(case: Case) -> str | None:
    """What of the config runs on the host's CPU, whose speed then moves with its threads (None: nothing)."""
    from harness.spec.schema import Offload

    ds = case.deepspeed
    if ds is not None and ds.offload_optimizer != Offload.none:
        return "its optimizer steps on the CPU (DeepSpeed's optimizer offload, CPU Adam)"
    if ds is not None and ds.offload_param != Offload.none:
        return "its parameters are offloaded to host memory"
    return None


def speed_noise(baseline: Baseline, pool: list[Baseline] | None) -> Noise | None:
    """The run-to-run noise of log tokens/s: pooled over the repetitions of every baseline of the
    platform in `pool` (each baseline's repetitions at one CPU thread count a group), `baseline`'s
    own included; over every platform's where none of this one's has two repetitions."""
    def groups(of: list[Baseline]) -> list[list[float]]:
        out: dict[tuple, list[float]] = {}
        for b in of:
            for r in b.runs:
                if r.outcome == "ok" and r.tokens_per_s_per_gpu:
                    out.setdefault((id(b), r.cpu_threads), []).append(r.tokens_per_s_per_gpu)
        return list(out.values())

    every = [b for b in (pool or []) if b is not baseline] + [baseline]
    same = [b for b in every if b.platform.key == baseline.platform.key]
    return pooled_noise(groups(same)) or pooled_noise(groups(every))


def _speed(case: Case, figures: Figures, baseline: Baseline, pool: list[Baseline] | None) -> list[Verdict]:
    """The run's tokens/s against the baseline's repetitions: a statistical test (harness.judge.stats)
    where the noise can be estimated, else the fixed floor, said to be weak. Across CPU thread counts
    only where the config does no CPU-side work; elsewhere, without repetitions at the run's threads,
    the speed is not checked, and the verdict says so."""
    if figures.tokens_per_s_per_gpu is None:
        return []
    out = []
    host_bound = cpu_side_work(case)
    threads = sorted({r.cpu_threads for r in baseline.runs if r.cpu_threads})
    note = ""
    if host_bound:
        rates, other = _under_condition(
            baseline, "cpu_threads", figures.cpu_threads, "baseline_speed", "tokens_per_s_per_gpu",
            lambda run, base: f"NOT CHECKED: this run had {run} CPU threads per process, the baseline {base}, and "
                              f"{host_bound}: its speed moves with the threads. Bless a run at {run} threads "
                              "(bless --append) or set OMP_NUM_THREADS to the baseline's")
        if other:
            return [other]
        every = len(baseline.values("tokens_per_s_per_gpu"))
        if figures.cpu_threads and not threads:
            note = "; the baseline's CPU threads were not recorded"
        elif len(rates) < every:
            note = (f"; the {len(rates)} of {every} repetitions at {figures.cpu_threads} CPU "
                    f"thread{'s' if figures.cpu_threads > 1 else ''} ({host_bound})")
    else:
        rates = [r.tokens_per_s_per_gpu for r in baseline.runs if r.tokens_per_s_per_gpu and r.outcome == "ok"]
        if figures.cpu_threads and threads and threads != [figures.cpu_threads]:
            note = (f"; compared across CPU threads ({figures.cpu_threads} here, {' and '.join(map(str, threads))} "
                    "in the baseline): the config does no CPU-side work")
    if not rates:
        return out
    rate = figures.tokens_per_s_per_gpu
    device = _device_change(figures, baseline)
    noise = speed_noise(baseline, pool) if case.expect.speed_tolerance is None else None
    if noise is not None:
        test = run_vs_baseline(rate, rates, noise)
        out.append(Verdict("baseline_speed", "refuted" if test.slower else "confirmed",
                           f"{rate:,.0f} tokens/s per GPU vs baseline {statistics.geometric_mean(rates):,.0f}: "
                           f"{test.text()}{note}{device}{_host_side(figures, baseline)}"))
        return out
    least = limit(rates, case.expect.speed_tolerance, SPEED_FLOOR, upper=False)
    weak = ("" if case.expect.speed_tolerance is not None else
            "; WEAK: no repetitions to estimate the noise from, so a fixed floor (bless --append more runs)")
    out.append(Verdict("baseline_speed", "confirmed" if rate >= least.value else "refuted",
                       f"{rate:,.0f} tokens/s per GPU vs baseline {statistics.median(rates):,.0f} "
                       f"({rate / statistics.median(rates) - 1:+.1%}; floor {least.value:,.0f}, {least.why}){weak}"
                       f"{note}{device}{_host_side(figures, baseline)}"))
    return out


def speed_floor(case: Case, baseline: Baseline, pool: list[Baseline] | None) -> float | None:
    """The least tokens/s per GPU a run may show against all of the baseline's finished repetitions: the
    statistical test's critical value (`stats.ALPHA`), or the fixed floor where no noise is estimated.
    For drawing: the check itself compares only like with like (`_speed`)."""
    from harness.judge.stats import ALPHA, critical_ratio

    rates = [r.tokens_per_s_per_gpu for r in baseline.runs if r.tokens_per_s_per_gpu and r.outcome == "ok"]
    if not rates:
        return None
    noise = speed_noise(baseline, pool) if case.expect.speed_tolerance is None else None
    if noise is None:
        return limit(rates, case.expect.speed_tolerance, SPEED_FLOOR, upper=False).value
    return statistics.geometric_mean(rates) * critical_ratio(len(rates), noise, ALPHA)


def _device_change(figures: Figures, baseline: Baseline) -> str:
    """The change of the device's own step time (CUDA events), where both sides recorded it."""
    def median_device(f: Figures) -> float | None:
        timed = f.step_device_s[1:] if len(f.step_device_s) > 1 else f.step_device_s
        return statistics.median(timed) if timed else None

    mine = median_device(figures)
    theirs = [t for t in map(median_device, baseline.runs) if t]
    if not mine or not theirs:
        return ""
    base = statistics.median(theirs)
    return f"; step time on the device {mine:.3f} s vs {base:.3f} s ({mine / base - 1:+.1%})"


def _host_side(figures: Figures, baseline: Baseline) -> str:
    """What the host contributed to a speed: the card's clock and what held it down, and a host CPU
    other than the baseline's (speed moves with both; memory does not)."""
    note = clock_note(figures.clocks, [r.clocks for r in baseline.runs if r.clocks])
    theirs = sorted({r.host_cpu for r in baseline.runs if r.host_cpu})
    if figures.host_cpu and theirs and figures.host_cpu not in theirs:
        note += f"; this host's CPU is {figures.host_cpu}, the baseline's {' and '.join(theirs)}"
    return note


def against_baseline(case: Case, figures: Figures, baseline: Baseline | None, missing: str = "",
                     pool: list[Baseline] | None = None) -> list[Verdict]:
    """`missing`: why there is no baseline (`no_baseline`), where `baseline` is None. `pool`: the
    baselines the speed check's run-to-run noise is pooled over (`speed_noise`; default: this one)."""
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
    out += _speed(case, figures, baseline, pool)
    return out or [Verdict("baseline", "not_checkable", "the baseline holds no peak or speed to compare")]
