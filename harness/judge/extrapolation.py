"""Depth extrapolation: figures measured at full width with fewer layers, carried to the full depth.

Per-rank memory and step time of a decoder are close to affine in the number of layers: embeddings,
the output head, logits, the CUDA context and the allocator's slack are paid once; weights, their
gradients and optimizer state, checkpointed activations and the per-layer compute are paid per layer.
So two or more depths measured at full width fix a line, and the full depth is read off it.

Every figure made here is labelled "extrapolated from N, M layers"; where a full-depth measurement
of the same variant exists (same ranks and accumulation), the relative error is reported beside it,
which is how the linearity assumption is checked per model. The worst under-prediction such a check
found for a model (`depth_check`) is carried as a margin onto every extrapolated peak of that model
that is judged to fit: the caching allocator's slack grows with the steps and the number of distinct
gather sizes, which a fit over a few shallow runs does not see.

A figure that falls with depth is not affine and is refused, unless the fall stays within the
run-to-run noise of a peak (`baselines.store.MEMORY_FLOOR`): then the figure is flat in depth (a model
whose per-card peak is its embedding, logits and one gathered layer) and its highest point is kept.

numpy's least squares would do the fit; two to four points do not need it, and the closed form keeps
the residual visible.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from harness.baselines.store import Baseline, Figures
from harness.spec.schema import Case


@dataclass(frozen=True)
class Line:
    """value(L) = intercept + slope * L, fitted to (layers, value) points."""

    intercept: float
    slope: float
    points: tuple[tuple[int, float], ...]

    def at(self, layers: int) -> float:
        return self.intercept + self.slope * layers

    @property
    def flat(self) -> bool:
        return self.slope == 0.0

    @property
    def worst_residual(self) -> float:
        """Largest relative misfit among the points themselves (0 for two points)."""
        return max((abs(self.at(x) - y) / y for x, y in self.points if y), default=0.0)


def fit_line(points: list[tuple[int, float]]) -> Line:
    xs = {x for x, _ in points}
    if len(xs) < 2:
        raise ValueError(f"a depth fit needs at least two different layer counts, got {sorted(xs)}")
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return Line(intercept=my - slope * mx, slope=slope, points=tuple(sorted(points)))


# Figures fitted in depth; throughput follows from the fitted step time.
_METRICS = ("per_card_peak", "allocated_peak", "reserved_peak", "load_footprint", "host_peak")


@dataclass
class Extrapolation:
    case_id: str
    base_variant: str  # the variant without its layer count ('2r2ga'): what the fit holds fixed
    platform_key: str
    depth: int
    from_layers: tuple[int, ...]
    values: dict[str, float]  # metric -> extrapolated bytes at full depth
    step_time_s: float | None
    tokens_per_step: int | None
    lines: dict[str, Line] = field(default_factory=dict)
    measured_full_depth: Figures | None = None  # the check, where one exists
    rejected: list[str] = field(default_factory=list)  # figures that were not affine in depth
    check: DepthCheck | None = None  # the full-depth check whose margin applies to this model

    @property
    def margin(self) -> float:
        """How much to add to an extrapolated peak: what the model's full-depth check missed (>= 0)."""
        return self.check.missed if self.check is not None else 0.0

    def peak_with_margin(self) -> float | None:
        peak = self.values.get("per_card_peak")
        return None if peak is None else peak * (1 + self.margin)

    def margin_text(self) -> str:
        if self.check is None:
            return "no full-depth check of this model yet"
        return (f"+{self.margin:.1%}, what the depth fit missed at full depth on {self.check.case_id} "
                f"({self.check.platform_key})")

    @property
    def label(self) -> str:
        return f"extrapolated from {', '.join(map(str, self.from_layers))} layers to {self.depth}"

    @property
    def tokens_per_s(self) -> float | None:
        if not self.step_time_s or not self.tokens_per_step:
            return None
        return self.tokens_per_step / self.step_time_s

    def error(self, metric: str) -> float | None:
        """Relative error of the extrapolation against the full-depth measurement."""
        m = self.measured_full_depth
        truth = None if m is None else getattr(m, metric, None)
        if truth is None or metric not in self.values or m.outcome != "ok":
            return None
        return (self.values[metric] - truth) / truth

    def step_time_error(self) -> float | None:
        m = self.measured_full_depth
        if m is None or m.outcome != "ok" or not self.step_time_s:
            return None
        # a run of a single step has no step past the warm-up: that step is all there is
        truth = _median_step(m) or (m.step_times_s[0] if m.step_times_s else None)
        return None if not truth else (self.step_time_s - truth) / truth


@dataclass(frozen=True)
class DepthCheck:
    """One extrapolation compared with a full-depth measurement of the same variant."""

    case_id: str
    model: str
    platform_key: str
    extrapolated: float  # per-card peak, bytes
    measured: float

    @property
    def missed(self) -> float:
        """The fraction the extrapolation fell short of the measurement (0 when it was above)."""
        return max(0.0, self.measured / self.extrapolated - 1)


def every_fit(baselines: list[Baseline], case_dir: Path | None = None) -> list[tuple[Case, Extrapolation]]:
    """Every (case, depth fit) the baselines allow, each fit carrying its model's full-depth check.
    The cases are read from `case_dir` (default: the bundled suite's)."""
    from harness.spec.cases import CASES_DIR, load_case

    pairs = []
    for case_id in sorted({b.case_id for b in baselines if b.variant}):
        path = (case_dir or CASES_DIR) / f"{case_id}.yaml"
        if path.exists():
            case = load_case(path)
            pairs += [(case, e) for e in extrapolate(case, baselines)]
    checks = _checks(pairs)
    for case, e in pairs:
        e.check = depth_check(case.model, checks)
    return pairs


def depth_checks(baselines: list[Baseline], case_dir: Path | None = None) -> list[DepthCheck]:
    """Every extrapolation the baselines hold a finished full-depth measurement for."""
    return _checks(every_fit(baselines, case_dir))


def _checks(pairs: list[tuple[Case, Extrapolation]]) -> list[DepthCheck]:
    out = []
    for case, e in pairs:
        m, peak = e.measured_full_depth, e.values.get("per_card_peak")
        if m is not None and m.outcome == "ok" and m.per_card_peak and peak:
            out.append(DepthCheck(case.id, case.model, e.platform_key, peak, m.per_card_peak))
    return out


def depth_check(model: str, checks: list[DepthCheck]) -> DepthCheck | None:
    """The check of this model that the depth fit missed by most: the margin its extrapolations carry."""
    mine = [c for c in checks if c.model == model]
    return max(mine, key=lambda c: c.missed, default=None)


def _median_step(f: Figures) -> float | None:
    timed = sorted(f.step_times_s[1:])  # the first step is warm-up
    return timed[len(timed) // 2] if timed else None


def extrapolate_figures(case, base_variant: str, platform_key: str, by_depth: dict[int, list[Figures]],
                        full_depth: Figures | None = None) -> Extrapolation:
    """Fit each figure in depth over runs at two or more layer counts (repetitions: their median)."""
    from harness.baselines.store import MEMORY_FLOOR
    from harness.models.source import load_model
    from harness.spec.shape import run_shape
    from harness.spec.variants import parse_variant

    depth = case.layers or load_model(case.model).layers
    lines, values, rejected = {}, {}, []
    for metric in _METRICS:
        pts = [(L, median([getattr(r, metric) for r in runs if getattr(r, metric) is not None]))
               for L, runs in by_depth.items() if any(getattr(r, metric) is not None for r in runs)]
        if len({x for x, _ in pts}) >= 2:
            line = fit_line(pts)
            if line.slope < 0:  # memory cannot shrink with depth
                top = max(y for _, y in line.points)
                if (top - min(y for _, y in line.points)) / top > MEMORY_FLOOR:  # not affine here
                    rejected.append(f"{metric} falls with depth "
                                    f"({', '.join(f'{x}L: {y / 2**30:.2f} GiB' for x, y in line.points)})")
                    continue
                line = Line(intercept=top, slope=0.0, points=line.points)  # flat within the noise
            lines[metric] = line
            values[metric] = line.at(depth)
    steps = [(L, median([t for r in runs if (t := _median_step(r))])) for L, runs in by_depth.items()
             if any(_median_step(r) for r in runs)]
    step = None
    if len({x for x, _ in steps}) >= 2:
        line = fit_line(steps)
        if line.slope < 0:  # a deeper model cannot step faster: these step times are noise, not a line
            rejected.append("step time falls with depth "
                            f"({', '.join(f'{x}L: {y:.2f} s' for x, y in line.points)})")
        else:
            lines["step_time_s"] = line
            step = line.at(depth)
    measured_case = parse_variant(base_variant).apply(case)
    return Extrapolation(
        case_id=case.id, base_variant=base_variant, platform_key=platform_key, depth=depth,
        from_layers=tuple(sorted(by_depth)), values=values, step_time_s=step,
        tokens_per_step=run_shape(measured_case, "real").tokens_per_step, lines=lines, measured_full_depth=full_depth,
        rejected=rejected,
    )


def extrapolate(case, baselines: list[Baseline]) -> list[Extrapolation]:
    """Every depth fit the baselines of one case allow: measured variants that differ only in their
    layer count, with at least two depths that finished, on one platform (`every_fit` adds each
    model's full-depth check)."""
    from harness.models.source import load_model
    from harness.spec.variants import Variant, parse_variant

    depth = case.layers or load_model(case.model).layers
    groups: dict[tuple[str, str], dict[int, list[Figures]]] = {}
    full: dict[tuple[str, str], Baseline] = {}
    for b in baselines:
        if b.case_id != case.id:
            continue
        v = parse_variant(b.variant)
        base = Variant(ranks=v.ranks, grad_accum=v.grad_accum).text
        layers = v.layers or depth
        if layers == depth:
            full[(b.platform.key, base)] = b
        elif all(r.outcome == "ok" for r in b.runs):
            groups.setdefault((b.platform.key, base), {})[layers] = b.runs
    return [extrapolate_figures(case, base, key, by_depth, full[(key, base)].runs[0] if (key, base) in full else None)
            for (key, base), by_depth in sorted(groups.items()) if len(by_depth) >= 2]
