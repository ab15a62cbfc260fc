"""Per case: the measured allocated, reserved and device peaks against the card and its headroom
line, with the predictor's device figure beside them; one figure per platform."""

from __future__ import annotations

from harness.report.html.captions import PREDICTED, measured_where
from harness.report.html.inputs import Entry, ReportInputs
from harness.report.html.page import Section, Table
from harness.report.html.svg import COLORS, Figure, gib, new_figure, to_svg
from harness.spec.units import fmt_gib
from harness.spec.variants import parse_variant


def card_of(e: Entry) -> tuple[int | None, int | None, str]:
    """(card bytes, budget bytes, label) the entry's peak is judged against: the case's card and budget
    as written; the emulated card of a variant (no budget: a shallower or narrower job is not the
    case); none on the whole card."""
    b, case = e.baseline, e.case
    v = parse_variant(b.variant)
    if v.uncapped:
        return None, None, "whole card"
    if v.as_written:
        return case.target.card.memory, case.budget_bytes, case.target.card.name
    card = b.emulated_card_bytes or case.target.card.memory
    return card, None, f"{fmt_gib(card)} card, {b.measured}"


def _figure(platform: str, entries: list[Entry]) -> Figure:
    entries = sorted(entries, key=lambda e: (e.name, e.is_run))
    n = len(entries)
    fig = new_figure(10, 1.2 + 0.42 * n)
    ax = fig.add_subplot()
    h = 0.26
    for i, e in enumerate(entries):
        y = n - 1 - i
        for k, (attr, key) in enumerate((("allocated_peak", "allocated"), ("reserved_peak", "reserved"),
                                         ("per_card_peak", "device"))):
            value = e.median(attr)
            if value is not None:
                ax.barh(y + (1 - k) * h, gib(value), height=h, color=COLORS[key],
                        hatch="//" if e.outcome != "ok" else None, edgecolor="white",
                        label=f"{key} peak (measured)" if i == 0 else None)
        card, budget, _ = card_of(e)
        if card:
            ax.plot([gib(card)] * 2, [y - 0.45, y + 0.45], color=COLORS["card"], lw=2,
                    label="card" if i == 0 else None)
        if budget:
            ax.plot([gib(budget)] * 2, [y - 0.45, y + 0.45], color=COLORS["budget"], lw=1.5, ls="--",
                    label="headroom line (budget)" if i == 0 else None)
        if e.predicted_per_card is not None:
            ax.plot([gib(e.predicted_per_card)], [y - h], marker="D", color=COLORS["predicted"], ls="none",
                    markersize=6, label="device peak (predicted)" if i == 0 else None)
    labels = []
    for e in entries:
        label = e.name + (" [run given]" if e.is_run else "")
        labels.append(label + ("" if e.outcome == "ok" else f" ({e.outcome})"))
    ax.set_yticks(range(n - 1, -1, -1), labels, fontsize=8)
    ax.set_xlabel("GiB per card")
    ax.set_ylim(-0.7, n - 0.3)
    ax.grid(axis="x", alpha=0.3)
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles, strict=True))
    # below the axes: inside, it covered the card ticks of the bottom rows
    fig.legend(unique.values(), unique.keys(), fontsize=7, loc="outside lower center", ncols=3)
    ax.set_title(platform, fontsize=10)
    caption = (f"{platform}: per config, the median over its repetitions of the worst process's allocated and "
               f"reserved peaks and of the card's device peak (NVML), {measured_where([e.baseline for e in entries])}. "
               "Hatched: the run ran out of memory, its figures are those at the failure. Black tick: the card "
               "(a variant's emulated card); dashed red: the case's headroom line (as written only). Diamond: "
               f"{PREDICTED}.")
    return Figure(f"peaks-{platform}", to_svg(fig, f"peaks-{platform}"), caption)


def _row(e: Entry) -> tuple[str, ...]:
    _, budget, label = card_of(e)
    device = e.median("per_card_peak")
    head = "-" if budget is None or device is None else f"{(budget - device) / 2**30:+.2f} GiB"
    pred = e.predicted_per_card
    err = "-" if pred is None or not device or e.outcome != "ok" else f"{pred / device - 1:+.1%}"
    return (e.name, e.baseline.platform.key, e.source, e.outcome, label, fmt_gib(e.median("allocated_peak")),
            fmt_gib(e.median("reserved_peak")), fmt_gib(device), head,
            fmt_gib(pred) if pred is not None else f"- ({e.problem or 'not predicted'})", err)


def section(inputs: ReportInputs) -> Section:
    by_platform = inputs.of_platform()
    figures = [_figure(p, es) for p, es in sorted(by_platform.items())]
    rows = [_row(e) for p in sorted(by_platform) for e in sorted(by_platform[p], key=lambda e: e.name)]
    table = Table(("config", "platform", "source", "outcome", "judged against", "allocated", "reserved",
                   "device", "headroom to the budget", "predicted device", "prediction error"), rows,
                  "Every config in numbers", collapsed=True)
    return Section("peaks", "Peaks against the card", "How close each case comes to its card: the measured "
                   "peaks of every baseline (and of the runs given), the card and the case's headroom line, and "
                   "the predictor's figure beside the measurement.", [*figures, table] if rows else [],
                   "no baseline and no run given")
