"""Tokens per second per night: every repetition of every baseline at its date, the host CPU it ran
on as its marker, with the band the regression check allows (harness.judge.regression.limit), and
the runs given beside them."""

from __future__ import annotations

import datetime as dt
import math

from harness.judge.regression import SPEED_FLOOR, limit
from harness.report.html.captions import measured_where
from harness.report.html.inputs import Entry, ReportInputs
from harness.report.html.page import Section, Table
from harness.report.html.svg import Figure, new_figure, shared_legend, to_svg

MARKERS = "os^vPX*<>"
COLS = 3


def _day(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text[:10])


SPREAD_IN_DAY = dt.timedelta(hours=1.5)  # repetitions of one day drawn side by side, not on top of each other


def _clock(f) -> str:
    c = f.clocks
    if c is None:
        return "-"
    slowed = ", ".join(f"{k} {v:.0%}" for k, v in sorted(c.slowed.items()) if v) or "not slowed"
    return f"SM {c.sm_mhz_median} MHz (max {c.sm_mhz_max}; {slowed})"


def _figure(platform: str, groups: dict[str, list[Entry]], hosts: list[str]) -> Figure:
    names = sorted(groups)
    rows = math.ceil(len(names) / COLS)
    fig = new_figure(10, 2.3 * rows + 0.4)
    axes = fig.subplots(rows, COLS, squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.set_axis_off()
    import matplotlib.dates as mdates

    every_day = [_day(f.recorded or e.baseline.recorded) for es in groups.values() for e in es for f in e.baseline.runs]
    for ax, name in zip(axes.flat, names, strict=False):
        base = [e for e in groups[name] if not e.is_run]
        values = [f.tokens_per_s_per_gpu for e in base for f in e.baseline.runs if f.tokens_per_s_per_gpu]
        if values:
            case = base[0].case
            floor = limit(values, case.expect.speed_tolerance, SPEED_FLOOR, upper=False).value
            mid = sorted(values)[len(values) // 2]
            ax.axhspan(floor, max([*values, mid]) * 1.02, color="#2ca02c", alpha=0.12, lw=0,
                       label="allowed by the regression check")
            ax.axhline(floor, color="#2ca02c", lw=1, ls="--")
        on_day: dict[dt.datetime, int] = {}
        for e in groups[name]:
            for f in e.baseline.runs:
                if not f.tokens_per_s_per_gpu:
                    continue
                host = f.host_cpu or "host not recorded"
                marker = MARKERS[hosts.index(host) % len(MARKERS)]
                day = _day(f.recorded or e.baseline.recorded)
                k = on_day[day] = on_day.get(day, -1) + 1
                day += k * SPREAD_IN_DAY
                if e.is_run:
                    below = values and f.tokens_per_s_per_gpu < floor
                    ax.plot([day], [f.tokens_per_s_per_gpu], marker="*", markersize=11, ls="none",
                            color="red" if below else "black", label="run given")
                else:
                    ax.plot([day], [f.tokens_per_s_per_gpu], marker=marker, ls="none", alpha=0.75,
                            color=f"C{hosts.index(host) % 10}", label=host[:40])
        ax.set_xlim(min(every_day) - dt.timedelta(days=1), max(every_day) + dt.timedelta(days=2))
        ax.xaxis.set_major_locator(mdates.DayLocator(interval=max(1, (max(every_day) - min(every_day)).days // 4)))
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%Y-%m-%d"))
        ax.set_title(name, fontsize=7)
        ax.tick_params(labelsize=6)
        ax.set_ylabel("tokens/s per GPU", fontsize=6)
        ax.grid(alpha=0.3)
    shared_legend(fig, axes, ncols=3)
    fig.suptitle(platform, fontsize=10)
    entries = [e for es in groups.values() for e in es]
    caption = (f"{platform}: tokens/s per GPU of every repetition at the day it ran (the marker is its host CPU), "
               f"{measured_where([e.baseline for e in entries])}. Green: what the regression check allows, "
               "the median less max(5%, 3 x the spread), bounded by the slowest repetition less 5%, computed over "
               "all repetitions (the check itself compares a run only with repetitions at its CPU thread count and "
               "Triton cache). Stars: the runs given, red when below the band. Measured, nothing predicted.")
    return Figure(f"trend-{platform}", to_svg(fig, f"trend-{platform}"), caption)


def section(inputs: ReportInputs) -> Section:
    by_platform: dict[str, dict[str, list[Entry]]] = {}
    for e in inputs.entries:
        if any(f.tokens_per_s_per_gpu for f in e.baseline.runs):
            by_platform.setdefault(e.baseline.platform.key, {}).setdefault(e.name, []).append(e)
    hosts = sorted({f.host_cpu or "host not recorded" for e in inputs.entries for f in e.baseline.runs})
    items: list = [_figure(p, groups, hosts) for p, groups in sorted(by_platform.items())]
    rows = [(e.name, p, e.source, f.recorded or e.baseline.recorded, f"{f.tokens_per_s_per_gpu:,.0f}",
             f"{f.mfu:.1%}" if f.mfu is not None else "-", f.host_cpu or "-", _clock(f),
             str(f.cpu_threads or "-"), f.triton_cache or "-")
            for p, groups in sorted(by_platform.items()) for name in sorted(groups) for e in groups[name]
            for f in e.baseline.runs if f.tokens_per_s_per_gpu]
    if rows:
        items.append(Table(("config", "platform", "source", "day", "tokens/s/GPU", "MFU", "host CPU", "clock",
                            "CPU threads", "Triton cache"), rows, "Every repetition", collapsed=True))
    return Section("speed", "Tokens per second, night by night", "Every repetition each baseline holds, at the "
                   "day it ran, with its host and clock, and the band the regression check allows.", items,
                   "no baseline or run records tokens/s")
