"""The memory timeline of each recorded rank: allocated and reserved bytes over the load and the
training steps, the forward, backward and optimizer phases shaded, the peak marked and the largest
tensors live at it named (harness.measure.timeline)."""

from __future__ import annotations

import numpy as np

from harness.measure.timeline import OOM, MemoryTimeline
from harness.report.html.captions import software
from harness.report.html.inputs import ReportInputs
from harness.report.html.page import Fold, Section, Table
from harness.report.html.svg import COLORS, Figure, gib, new_figure, thinned, to_svg
from harness.spec.units import fmt_gib

PHASE_COLORS = {"load": "#eeeeee", "engine": "#dddddd", "forward": "#cfe2ff", "backward": "#ffe0b3",
                "optimizer": "#d4f0d4"}
LIVE_SHOWN = 8


def _name(tl: MemoryTimeline) -> str:
    return tl.case_id + (f"@{tl.variant}" if tl.variant else "")


def step_around(tl: MemoryTimeline, index: int) -> tuple[int, int]:
    """(first, last + 1) action of the training step holding action `index`: from the forward phase that
    began at or before it to the end of the optimizer phase after it (the recording's end where none)."""
    spans = tl.phase_spans()
    starts = [s for phase, s, _ in spans if phase == "forward" and s <= index]
    first = starts[-1] if starts else 0
    ends = [e for phase, s, e in spans if phase == "optimizer" and e > index and s >= first]
    return first, (ends[0] if ends else len(tl))


def _draw(ax, tl: MemoryTimeline, t, curve, lo: int, hi: int, peak_i: int, peak: int, live) -> None:
    for phase, start, end in tl.phase_spans():
        start, end = max(start, lo), min(end, hi)
        if start < end:
            ax.axvspan(t[start], t[end - 1] if end - 1 > start else t[start] + 1e-4, color=PHASE_COLORS[phase],
                       lw=0, label=phase)
    top = 0.0
    for which in ("reserved", "allocated"):
        values = np.asarray(getattr(curve, which)[lo:hi], dtype=float) / 2**30
        x, y = thinned(t[lo:hi], values)
        ax.plot(x, y, color=COLORS[which], lw=1, label=which)
        top = max(top, float(values.max(initial=0)))
    if lo <= peak_i < hi:
        ax.plot([t[peak_i]], [gib(peak)], marker="v", color="black", ls="none", label="allocated peak")
        if live:
            # the label runs toward the middle of the axes from the peak, never past their edges
            span = (t[hi - 1] - t[lo]) or 1.0
            where = (t[peak_i] - t[lo]) / span
            ha = "left" if where < 0.35 else "right" if where > 0.65 else "center"
            site = live[0].site if len(live[0].site) <= 60 else live[0].site[:57] + "..."
            ax.annotate(f"{fmt_gib(live[0].size)}: {site}", (t[peak_i], gib(peak)), fontsize=7,
                        xytext=(0, 10), textcoords="offset points", ha=ha, annotation_clip=True, clip_on=True)
    for i in [i for i in range(lo, hi) if tl.action[i] == OOM][:3]:
        ax.axvline(t[i], color="red", lw=1.5, label="out of memory")
    card = gib(tl.emulated_card_bytes)
    if card and card < 1.6 * top:  # a card far above the curve would flatten it; the caption names it
        ax.axhline(card, color=COLORS["card"], ls="--", lw=1, label="emulated card")
        top = max(top, card)
    ax.set_ylim(0, top * 1.25 or 1)
    ax.set_ylabel("GiB")
    ax.grid(alpha=0.3)


def _figure(key: str, tl: MemoryTimeline) -> tuple[Figure, Table]:
    curve = tl.curve()
    t = np.asarray(tl.t_us, dtype=float) / 1e6
    peak_i, peak = curve.peak("allocated")
    live = tl.live_at(peak_i) if peak_i >= 0 else []
    lo, hi = step_around(tl, max(peak_i, 0))
    fig = new_figure(10, 5.2)
    whole, step = fig.subplots(2, 1, height_ratios=[1, 1.4])
    _draw(whole, tl, t, curve, 0, len(tl), peak_i, peak, live)
    whole.set_title(f"{_name(tl)}, rank {tl.rank} of {tl.world_size}: the whole recording", fontsize=9)
    _draw(step, tl, t, curve, lo, hi, peak_i, peak, live)
    step.set_title("the training step holding the allocated peak", fontsize=9)
    step.set_xlabel("seconds since recording began")
    handles, names = [], []
    for ax in (whole, step):
        for h, la in zip(*ax.get_legend_handles_labels(), strict=True):
            if la not in names:
                handles.append(h)
                names.append(la)
    fig.legend(handles, names, fontsize=7, loc="outside right upper")
    card = f"a {fmt_gib(tl.emulated_card_bytes)} card emulated on an" if tl.emulated_card_bytes else "the whole"
    span = f"{t[lo]:.2f}-{t[hi - 1]:.2f} s" if hi > lo else "-"
    drawn = min(len(tl), 2 * 1500)
    caption = (f"{_name(tl)}: rank {tl.rank}'s allocator over the model's load and its training steps, measured on "
               f"{card} {tl.device_name} ({software([tl.versions], [tl.versions.get('driver')])}; "
               f"PYTORCH_CUDA_ALLOC_CONF={tl.alloc_conf or 'unset'}), recorded {tl.recorded}. {len(tl):,} allocator "
               f"actions, drawn as at most {drawn:,} points per line that keep every bucket's lowest and highest; "
               f"below, the step holding the allocated peak ({span}). Allocated peak "
               f"{fmt_gib(peak)}, reserved peak {fmt_gib(max(curve.reserved, default=0))}. Measured, nothing "
               "predicted." + (" The recording's buffer overflowed: the earliest actions are missing." if tl.dropped
                               else ""))
    rows = [(fmt_gib(b.size), b.site, b.phase) for b in live[:LIVE_SHOWN]]
    table = Table(("size", "allocated at", "phase"), rows,
                  f"{_name(tl)}: the largest of the {len(live)} tensors live at the allocated peak")
    return Figure(key, to_svg(fig, key), caption), table


def section(inputs: ReportInputs) -> Section:
    # one timeline of each family of cases is shown; the others, whose shape differs little from it
    # (the same guide at another depth, rank count or library version), fold under it
    groups: dict[str, list] = {}
    for _path, tl in sorted(inputs.timelines, key=lambda p: (_name(p[1]), str(p[0]))):
        case = inputs.cases.get(tl.case_id)
        groups.setdefault(case.family if case is not None and case.family else tl.case_id, []).append(tl)
    items: list = []
    n = 0
    for family, tls in groups.items():
        shown = []
        for tl in tls:
            shown.append(list(_figure(f"timeline-{n}", tl)))  # each figure followed by the tensors at its peak
            n += 1
        items += shown[0]
        if len(shown) > 1:
            names = ", ".join(_name(tl) for tl in tls[1:])
            items.append(Fold(f"{len(shown) - 1} more timeline(s) of {family}: {names}",
                              [i for pair in shown[1:] for i in pair]))
    s = Section("timelines", "Memory over a training step", "Each recorded rank's allocated and reserved memory "
                "from the model's load through its steps (`oom-harness run --memory-history`), with the phases "
                "shaded and the largest live tensors at the peak named.", empty="no memory timeline recorded "
                "(results/timelines, or rank0-memory.json.gz in the run folders given)")
    s.items = items
    return s
