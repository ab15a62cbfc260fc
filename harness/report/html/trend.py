"""Tokens per second per night: every repetition of every baseline at its date, the host CPU it ran
on as its marker, with the band the regression check lets pass (harness.judge.regression.speed_floor),
and the runs given after the last night, each with its change in %."""

from __future__ import annotations

import datetime as dt
import math
import statistics

from harness.judge.regression import speed_floor
from harness.judge.stats import ALPHA
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


def _figure(platform: str, groups: dict[str, list[Entry]], hosts: list[str], pool) -> Figure:
    names = sorted(groups)
    rows = math.ceil(len(names) / COLS)
    fig = new_figure(10, 2.3 * rows + 0.4)
    axes = fig.subplots(rows, COLS, squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.set_axis_off()
    import matplotlib.dates as mdates
    import matplotlib.transforms as mtransforms

    days = [_day(f.recorded or e.baseline.recorded) for es in groups.values() for e in es if not e.is_run
            for f in e.baseline.runs] or [dt.datetime.now()]
    # a run given carries no date of its own: it is drawn in a column of its own after the last night, never
    # at the day the report was built
    slot = max(days) + dt.timedelta(days=2)
    for ax, name in zip(axes.flat, names, strict=False):
        base = [e for e in groups[name] if not e.is_run]
        values = [f.tokens_per_s_per_gpu for e in base for f in e.baseline.runs if f.tokens_per_s_per_gpu]
        floor = mid = None
        if values:
            floor = speed_floor(base[0].case, base[0].baseline, pool)
            mid = statistics.geometric_mean(values)  # as the speed test and the verdict table give the change
            ax.axhspan(floor, max([*values, mid]) * 1.02, color="#2ca02c", alpha=0.12, lw=0,
                       label="allowed by the regression check")
            ax.axhline(floor, color="#2ca02c", lw=1, ls="--")
        on_day: dict[dt.datetime, int] = {}
        given = 0
        for e in groups[name]:
            for f in e.baseline.runs:
                if not f.tokens_per_s_per_gpu:
                    continue
                if e.is_run:
                    x = slot + dt.timedelta(hours=given * 6)
                    given += 1
                    below = floor is not None and f.tokens_per_s_per_gpu < floor
                    ax.plot([x], [f.tokens_per_s_per_gpu], marker="*", markersize=11, ls="none",
                            color="red" if below else "black", label="run given")
                    if mid:
                        ax.annotate(f"{f.tokens_per_s_per_gpu / mid - 1:+.0%}", (x, f.tokens_per_s_per_gpu),
                                    xytext=(0, 7), textcoords="offset points", ha="center", fontsize=6,
                                    color="red" if below else "black", annotation_clip=True)
                    continue
                host = f.host_cpu or "host not recorded"
                marker = MARKERS[hosts.index(host) % len(MARKERS)]
                day = _day(f.recorded or e.baseline.recorded)
                k = on_day[day] = on_day.get(day, -1) + 1
                ax.plot([day + k * SPREAD_IN_DAY], [f.tokens_per_s_per_gpu], marker=marker, ls="none", alpha=0.75,
                        color=f"C{hosts.index(host) % 10}", label=host[:40])
        if given:
            ax.axvspan(slot - dt.timedelta(hours=12), slot + dt.timedelta(hours=6 * given + 6), color="#eeeeee",
                       lw=0, zorder=0)
            ax.text(slot, 0.02, "runs given", transform=mtransforms.blended_transform_factory(ax.transData,
                                                                                              ax.transAxes),
                    fontsize=6, color="#555555")
        ax.set_xlim(min(days) - dt.timedelta(days=1), slot + dt.timedelta(days=1.5 if given else 0))
        # ticks on the nights only: the column of the runs given is no date
        step = max(1, (max(days) - min(days)).days // 4)
        first = min(days).replace(hour=0, minute=0, second=0, microsecond=0)
        ax.set_xticks([first + dt.timedelta(days=d) for d in range(0, (max(days) - first).days + 2, step)])
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%Y-%m-%d"))
        ax.set_title(name, fontsize=7)
        ax.tick_params(labelsize=6)
        ax.set_ylabel("tokens/s per GPU", fontsize=6)
        ax.grid(alpha=0.3)
    shared_legend(fig, axes, ncols=3)
    fig.suptitle(platform, fontsize=10)
    entries = [e for es in groups.values() for e in es]
    caption = (f"{platform}: tokens/s per GPU of every repetition at the day it ran (the marker is its host CPU), "
               f"{measured_where([e.baseline for e in entries])}. Green: what the regression check lets pass, down to "
               f"the statistical test's critical value (false alarms {ALPHA:.0%}; docs/baselines.md), computed over "
               "all repetitions (the check itself compares a run only with repetitions it can be compared with). "
               "Stars: the runs given, in a column after the last night (a run record carries no date), each "
               "with its change from the baseline's (geometric) mean; red when below the band. Measured, nothing "
               "predicted.")
    return Figure(f"trend-{platform}", to_svg(fig, f"trend-{platform}"), caption)


def section(inputs: ReportInputs) -> Section:
    by_platform: dict[str, dict[str, list[Entry]]] = {}
    for e in inputs.entries:
        if any(f.tokens_per_s_per_gpu for f in e.baseline.runs):
            by_platform.setdefault(e.baseline.platform.key, {}).setdefault(e.name, []).append(e)
    hosts = sorted({f.host_cpu or "host not recorded" for e in inputs.entries for f in e.baseline.runs})
    items: list = [_figure(p, groups, hosts, inputs.baselines) for p, groups in sorted(by_platform.items())]
    rows = [(e.name, p, e.source, "undated (run given)" if e.is_run else f.recorded or e.baseline.recorded,
             f"{f.tokens_per_s_per_gpu:,.0f}",
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
