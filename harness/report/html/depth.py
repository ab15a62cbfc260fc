"""Depth extrapolations: the per-card peaks measured at a few depths, the line fitted through them,
the full-depth figure it gives (with the margin the model's full-depth check found) and, where one
was measured, the full-depth run beside it (harness.judge.extrapolation)."""

from __future__ import annotations

import math

from harness.judge.extrapolation import every_fit
from harness.report.html.captions import measured_where
from harness.report.html.inputs import ReportInputs
from harness.report.html.page import Section, Table
from harness.report.html.svg import COLORS, Figure, gib, new_figure, shared_legend, to_svg
from harness.spec.units import fmt_gib

COLS = 3


def section(inputs: ReportInputs) -> Section:
    baselines = inputs.baselines
    fits = [(c, e) for c, e in every_fit(baselines, inputs.case_dir) if "per_card_peak" in e.lines]
    s = Section("depth", "Depth extrapolations", "Configs too deep for the cards at hand are measured at full "
                "width with fewer layers; memory is close to affine in the layer count, so a line through the "
                "measured depths gives the full depth. Extrapolated figures are not measurements.",
                empty="no case has baselines at two or more depths")
    if not fits:
        return s
    rows = math.ceil(len(fits) / COLS)
    fig = new_figure(10, 2.6 * rows + 0.5)
    axes = fig.subplots(rows, COLS, squeeze=False)
    for ax in axes.flat[len(fits):]:
        ax.set_axis_off()
    table = []
    for ax, (case, e) in zip(axes.flat, fits, strict=False):
        line = e.lines["per_card_peak"]
        xs = [x for x, _ in line.points]
        ax.plot(xs, [gib(y) for _, y in line.points], "o", color=COLORS["device"], label="measured")
        ax.plot([0, e.depth], [gib(line.at(0)), gib(line.at(e.depth))], "-", color="#777777", lw=1, label="fit")
        peak = e.values["per_card_peak"]
        with_margin = e.peak_with_margin()
        ax.plot([e.depth], [gib(peak)], "o", mfc="none", color="black", label="extrapolated")
        if e.margin:
            ax.errorbar([e.depth], [gib(peak)], yerr=[[0], [gib(with_margin - peak)]], color="black", capsize=3,
                        label="+ full-depth margin")
        m = e.measured_full_depth
        if m is not None and m.per_card_peak:
            ax.plot([e.depth], [gib(m.per_card_peak)], "s", color="red" if m.outcome != "ok" else COLORS["device"],
                    label="measured at full depth" + ("" if m.outcome == "ok" else f" ({m.outcome})"))
        ax.axhline(gib(case.budget_bytes), color=COLORS["budget"], ls="--", lw=1, label="budget")
        ax.set_title(f"{case.id}\n{e.platform_key}, {e.base_variant or 'as written'}", fontsize=7)
        ax.set_xlabel("layers", fontsize=7)
        ax.set_ylabel("GiB per card", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.grid(alpha=0.3)
        check = "-"
        if m is not None and m.outcome == "ok":
            check = f"{fmt_gib(m.per_card_peak)} measured (fit {e.error('per_card_peak'):+.1%})"
        elif m is not None:
            check = f"{m.outcome} at {fmt_gib(m.per_card_peak)}"
        table.append((case.id, e.platform_key, e.base_variant or "as written", e.label, fmt_gib(peak),
                      f"{fmt_gib(with_margin)} ({e.margin_text()})", fmt_gib(case.budget_bytes),
                      "fits" if with_margin <= case.budget_bytes else "exceeds", check))
    shared_legend(fig, axes, ncols=6)
    used = [b for b in baselines if b.case_id in {c.id for c, _ in fits} and b.variant]
    caption = ("Per-card device peak against the layer count: dots measured at full width with fewer layers "
               f"({measured_where(used)}); the grey line is the least-squares fit; the hollow dot is the "
               "extrapolated full-depth peak (extrapolated, not measured), its bar the margin the model's full-depth "
               "check adds before a fit is judged; a square is a full-depth measurement of the same variant; "
               "dashed red is the case's budget.")
    s.items = [Figure("depth", to_svg(fig, "depth"), caption),
               Table(("case", "platform", "variant", "extrapolation", "peak at full depth",
                      "with the full-depth margin", "budget", "verdict", "full-depth check"), table,
                     "Extrapolations in numbers")]
    return s
