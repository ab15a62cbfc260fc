"""The guides' claims: each stated range (a peak, a load footprint, a share of the card) against the
figure measured for its case, and every verdict of the runs given."""

from __future__ import annotations

from harness.judge.extrapolation import every_fit
from harness.report.html.captions import measured_where
from harness.report.html.inputs import ReportInputs
from harness.report.html.page import Section, Table
from harness.report.html.svg import Figure, gib, new_figure, to_svg
from harness.spec.units import fmt_gib
from harness.spec.variants import parse_variant

FIGURE = {"device_peak": "per_card_peak", "usage_fraction": "per_card_peak", "load_footprint": "load_footprint"}


def _points(inputs: ReportInputs, case, metric: str, fits) -> list[tuple[float, str, bool, bool]]:
    """(bytes, where, extrapolated, finished) for each measurement of the case as written, else each
    full-depth extrapolation of it."""
    attr = FIGURE[metric]
    out = []
    for e in inputs.entries:
        v = parse_variant(e.baseline.variant)
        if e.case.id == case.id and v.as_written:
            value = e.median(attr)
            if value is not None:
                out.append((value, e.baseline.platform.key + (" (run given)" if e.is_run else ""), False,
                            e.outcome == "ok"))
    if not out:
        for c, fit in fits:
            if c.id == case.id and attr in fit.values:
                out.append((fit.values[attr], f"{fit.platform_key}, {fit.label}", True, True))
    return out


def section(inputs: ReportInputs) -> Section:
    fits = every_fit(inputs.baselines, inputs.case_dir)
    rows, drawn = [], []
    for case in sorted(inputs.cases.values(), key=lambda c: c.id):
        for claim in case.claims:
            if claim.kind != "memory_range":
                continue
            card = case.target.card.memory
            scale = card if claim.metric == "usage_fraction" else 1
            low, high = claim.low * scale, claim.high * scale
            want = (f"{claim.low:.0%}-{claim.high:.0%} of {fmt_gib(card)}" if claim.metric == "usage_fraction"
                    else f"{fmt_gib(claim.low)}-{fmt_gib(claim.high)}")
            points = _points(inputs, case, claim.metric, fits)
            for value, where, extrapolated, finished in points:
                holds = low <= value <= high and finished
                status = "holds" if holds else ("refuted, as recorded" if claim.finding else "refuted")
                rows.append((case.id, claim.metric, want, fmt_gib(value) + (" (extrapolated)" if extrapolated else ""),
                             where, status, claim.quote or "-"))
            drawn.append((case, claim, low, high, points))
    s = Section("claims", "The guides' claims against the measurements", "Each range a guide states, drawn as a "
                "bar, with the figure measured for its case (as written; where only shallower depths were measured, "
                "the full-depth extrapolation, labelled). Claims about what a change saves or costs are judged on "
                "a run's probes: their verdicts follow for the runs given.", empty="no stated range and no run given")
    if drawn:
        fig = new_figure(10, 1.0 + 0.45 * len(drawn))
        ax = fig.add_subplot()
        n = len(drawn)
        for i, (_, _, low, high, points) in enumerate(drawn):
            y = n - 1 - i
            ax.barh(y, gib(high - low), left=gib(low), height=0.5, color="#9ecae1", label="claimed range")
            for value, _, extrapolated, finished in points:
                ok = low <= value <= high and finished
                ax.plot([gib(value)], [y], marker="o", ls="none", markersize=7,
                        mfc="none" if extrapolated else ("#2ca02c" if ok else "#d62728"),
                        mec="#2ca02c" if ok else "#d62728",
                        label=("extrapolated" if extrapolated else "measured") + (", inside" if ok else ", outside"))
        ax.set_yticks(range(n - 1, -1, -1), [f"{c.id}: {cl.metric}" for c, cl, *_ in drawn], fontsize=7)
        # every bar and every dot inside the axis (a fixed range clipped the widest bars)
        right = max([gib(high) for *_, high, _ in drawn] + [gib(v) for *_, pts in drawn for v, *_ in pts] + [1.0])
        ax.set_xlim(0, right * 1.08)
        ax.set_ylim(-0.7, n - 0.3)
        ax.set_xlabel("GiB (a share of the card drawn as its GiB)")
        ax.grid(axis="x", alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=True))
        fig.legend(unique.values(), unique.keys(), fontsize=7, loc="outside lower center", ncols=4)
        used = [e.baseline for e in inputs.entries if e.case.id in {c.id for c, *_ in drawn}]
        caption = ("Bars: the ranges the guides state (their own words are in the table). Dots: the per-card device "
                   f"peak or load footprint measured for the case, median over repetitions, {measured_where(used)}; "
                   "hollow dots are depth extrapolations, not measurements. Green inside the range, red outside or "
                   "where the run did not finish.")
        s.items.append(Figure("claims", to_svg(fig, "claims"), caption))
        s.items.append(Table(("case", "metric", "claimed", "measured", "where", "verdict", "the guide's words"), rows,
                             "Every stated range"))
    if inputs.verdicts:
        s.items.append(Table(("config", "claim or check", "verdict", "measured", "the source's words"),
                             [(name, v.what, v.status, v.detail, v.quote or "-") for name, v in inputs.verdicts],
                             "Verdicts of the runs given", collapsed=True))
    return s
