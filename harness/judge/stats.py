"""The statistics of the speed checks, with their false-alarm rate and power stated (docs/baselines.md).

Speeds are compared on the log scale: run-to-run noise is proportional to the speed (a 3% wobble at
1,000 tokens/s and at 30,000), and a ratio of speeds is a difference of logs.

- `run_vs_baseline`: one run against a baseline's repetitions. The run is a draw from the baseline's
  distribution unless the config slowed: a one-sided t test on its log speed against the repetitions'
  mean, with the prediction error `sigma * sqrt(1 + 1/k)` (k repetitions). Sigma is the run-to-run
  noise pooled over the baselines of the platform (`pooled_noise`): one baseline's two or three
  repetitions estimate it far too loosely to test with. False alarms: `ALPHA` of the clean runs
  (when the noise is as the pool measured it). Power: `detectable` says which slowdown the test
  catches in `POWER` of the runs, from the noncentral t distribution.
- `paired`: the change between two environments measured in pairs on one host (`oom-harness compare`):
  a paired t test on the pairs' log ratios, with its confidence interval.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

ALPHA = 0.01  # the run-versus-baseline check's false-alarm rate: 1 clean run in 100 is flagged
POWER = 0.8  # `detectable` is the slowdown caught this often
INTERVAL = 0.95  # the confidence of the intervals shown with a change
COMPARE_ALPHA = 0.05  # `compare`'s two-sided test: a clean pair of environments is flagged 1 time in 20


@dataclass(frozen=True)
class Noise:
    """The run-to-run noise of log tokens/s: its standard deviation, the degrees of freedom it was
    estimated with, and from what."""

    sigma: float
    df: int
    groups: int  # baselines (at one CPU thread count) it was pooled over

    def text(self) -> str:
        return f"run-to-run noise {self.sigma:.1%} pooled over {self.groups} baseline(s), {self.df} df"


def pooled_noise(groups: list[list[float]]) -> Noise | None:
    """The pooled standard deviation of log values over `groups` of repetitions (each group's own mean
    removed); None where no group has two values."""
    ss, df, used = 0.0, 0, 0
    for values in groups:
        logs = [math.log(v) for v in values if v and v > 0]
        if len(logs) < 2:
            continue
        mean = statistics.fmean(logs)
        ss += sum((x - mean) ** 2 for x in logs)
        df += len(logs) - 1
        used += 1
    if df == 0:
        return None
    return Noise(math.sqrt(ss / df), df, used)


@dataclass(frozen=True)
class SpeedTest:
    """One run's speed against a baseline: its change from the baseline's (geometric) mean, the
    interval the change would fall in by noise alone, whether it is slower beyond `ALPHA`, and the
    slowdown the test detects with `POWER`."""

    change: float  # run / baseline - 1
    low: float  # INTERVAL prediction interval of the change, were the run a clean repetition
    high: float
    p: float  # one-sided: the chance of a run this slow or slower by noise alone
    slower: bool
    detectable: float  # the slowdown (0.1 = 10%) caught with POWER
    repetitions: int
    noise: Noise

    @property
    def weak(self) -> bool:
        """A baseline of one repetition: its mean is that one run, a host's bad night included."""
        return self.repetitions < 2

    def text(self) -> str:
        weak = "; WEAK: the baseline has one repetition (bless --append more)" if self.weak else ""
        return (f"{self.change:+.1%} (noise alone: {self.low:+.1%} to {self.high:+.1%}; one-sided p={self.p:.3g}, "
                f"alpha {ALPHA:g}; detects a {self.detectable:.0%} slowdown {POWER:.0%} of the time; "
                f"{self.repetitions} repetition(s), {self.noise.text()}{weak})")


def _t():
    from scipy import stats

    return stats


@functools.lru_cache(maxsize=1024)
def detectable_slowdown(scale: float, df: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The slowdown a one-sided t test at `alpha` catches with `power`, where the tested log difference
    has standard error `scale` and its noise was estimated with `df` degrees of freedom."""
    from scipy.optimize import brentq

    st = _t()
    crit = st.t.ppf(1 - alpha, df)

    def caught(slowdown: float) -> float:
        nc = -math.log1p(-slowdown) / scale
        return st.nct.sf(crit, df, nc) - power

    if caught(0.999) < 0:
        return 1.0
    return brentq(caught, 1e-9, 0.999)


def critical_ratio(repetitions: int, noise: Noise, alpha: float = ALPHA) -> float:
    """The run-to-baseline ratio below which `run_vs_baseline` calls a run slower."""
    scale = noise.sigma * math.sqrt(1 + 1 / repetitions)
    return math.exp(-_t().t.ppf(1 - alpha, noise.df) * scale)


def run_vs_baseline(run: float, baseline: list[float], noise: Noise, alpha: float = ALPHA) -> SpeedTest:
    st = _t()
    logs = [math.log(v) for v in baseline]
    k = len(logs)
    scale = noise.sigma * math.sqrt(1 + 1 / k)
    diff = math.log(run) - statistics.fmean(logs)
    if scale <= 0:  # repetitions that agree to the last digit: any slower run is slower
        return SpeedTest(math.expm1(diff), 0.0, 0.0, 0.0 if diff < 0 else 1.0, diff < 0, 0.0, k, noise)
    p = float(st.t.cdf(diff / scale, noise.df))
    half = st.t.ppf(0.5 + INTERVAL / 2, noise.df) * scale
    return SpeedTest(math.expm1(diff), math.expm1(-half), math.expm1(half), p, p < alpha,
                     detectable_slowdown(scale, noise.df, alpha), k, noise)


@dataclass(frozen=True)
class PairedChange:
    """The change from arm A to arm B over n pairs: the geometric mean ratio less 1, its INTERVAL
    confidence interval, and the two-sided p value."""

    change: float
    low: float
    high: float
    p: float
    pairs: int

    def verdict(self, threshold: float, alpha: float = COMPARE_ALPHA) -> str:
        """'lower', 'higher' (B's value below or above A's beyond `threshold`, and the test rejects no
        change at `alpha`), 'same' (the interval lies within +-threshold) or 'inconclusive'."""
        if self.pairs < 2:
            return "inconclusive"
        if self.p < alpha and abs(self.change) >= threshold:
            return "lower" if self.change < 0 else "higher"
        if -threshold <= self.low and self.high <= threshold:
            return "same"
        return "inconclusive"

    def text(self) -> str:
        if self.pairs < 2:
            return f"{self.change:+.1%} (one pair: no interval)"
        return f"{self.change:+.1%} [{self.low:+.1%}, {self.high:+.1%}] (p={self.p:.3g}, {self.pairs} pairs)"


def paired(a: list[float], b: list[float]) -> PairedChange:
    """The change from `a` to `b`, measured in pairs (a[i] and b[i] run one after the other)."""
    st = _t()
    d = [math.log(y / x) for x, y in zip(a, b, strict=True)]
    n = len(d)
    mean = statistics.fmean(d)
    if n < 2:
        return PairedChange(math.expm1(mean), math.expm1(mean), math.expm1(mean), 1.0, n)
    sd = statistics.stdev(d)
    if sd == 0:
        return PairedChange(math.expm1(mean), math.expm1(mean), math.expm1(mean), 0.0 if mean else 1.0, n)
    se = sd / math.sqrt(n)
    half = st.t.ppf(0.5 + INTERVAL / 2, n - 1) * se
    p = float(2 * st.t.sf(abs(mean) / se, n - 1))
    return PairedChange(math.expm1(mean), math.expm1(mean - half), math.expm1(mean + half), p, n)
