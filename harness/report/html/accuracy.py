"""The predictor's accuracy at a glance: its device figure against the measured per-card peak for
every blessed run (and the runs given), out of sample (each case left out of its own calibration)."""

from __future__ import annotations

import statistics

from harness.report.html.captions import PREDICTED, measured_where
from harness.report.html.inputs import ReportInputs
from harness.report.html.page import Section, Table
from harness.report.html.svg import Figure, gib, new_figure, to_svg
from harness.spec.units import fmt_gib

# The other suites the predictor's errors are measured on, drawn beside the bundled suite's baselines.
SUITE_LABELS = {"architectures": "architecture benchmark", "fitted": "fit's verified configs"}
SUITE_MARKERS = {"architectures": "D", "fitted": "P"}


def section(inputs: ReportInputs) -> Section:
    entries = [e for e in inputs.entries if e.predicted is not None and e.median("per_card_peak")]
    s = Section("accuracy", "Prediction against measurement", "Every blessed run's measured per-card device peak "
                "beside what the predictor says for the same config, leaving the case out of its calibration. A "
                "run that ran out of memory gives only a lower bound: the figure at the failure.",
                empty="nothing was both measured and predicted")
    if not entries:
        return s
    fig = new_figure(7, 6)
    ax = fig.add_subplot()
    platforms = sorted({e.baseline.platform.key for e in entries})
    top = 0.0
    rows = []
    for e in entries:
        measured, predicted = e.median("per_card_peak"), e.predicted_per_card
        top = max(top, gib(measured), gib(predicted))
        mistake = e.case.expect.outcome == "detected"
        marker = "^" if e.outcome != "ok" else ("x" if mistake else ("*" if e.is_run else "o"))
        k = platforms.index(e.baseline.platform.key)
        # hollow, and a size for each platform: one config measured alike on two platforms shows as two
        # rings, not one marker hiding the other
        ax.plot([gib(measured)], [gib(predicted)], marker=marker, ls="none", alpha=0.9, mfc="none", mew=1.3,
                markersize=6 + 3 * k, color=f"C{k}", label=e.baseline.platform.key)
        if e.outcome != "ok":
            verdict = "at or above the failure" if predicted >= measured else "below the failure: misses the OOM"
        else:
            verdict = f"{predicted / measured - 1:+.1%}" + (" (a mistake to detect: shown, not counted)"
                                                             if mistake else "")
        rows.append((e.name, e.baseline.platform.key, e.source, e.outcome, fmt_gib(measured), fmt_gib(predicted),
                     verdict))
    other = [o for o in inputs.other_suites if o.record.outcome == "ok"]
    for o in other:
        r = o.record
        top = max(top, gib(r.measured), gib(r.predicted))
        ax.plot([gib(r.measured)], [gib(r.predicted)], marker=SUITE_MARKERS.get(o.suite, "s"), ls="none", alpha=0.8,
                mfc="none", color="dimgray", label=SUITE_LABELS.get(o.suite, o.suite))
        rows.append((o.name, r.platform, SUITE_LABELS.get(o.suite, o.suite), r.outcome, fmt_gib(r.measured),
                     fmt_gib(r.predicted), f"{r.predicted / r.measured - 1:+.1%}"))
    ax.plot([0, top * 1.05], [0, top * 1.05], color="black", lw=1, label="prediction = measurement")
    ax.fill_between([0, top * 1.05], [0, top * 0.95], [0, top * 1.155], color="grey", alpha=0.15, lw=0,
                    label="within 10%")
    ax.set_xlim(0, top * 1.05)
    ax.set_ylim(0, top * 1.05)
    ax.set_xlabel("measured per-card peak, GiB")
    ax.set_ylabel("predicted per-card peak, GiB")
    ax.grid(alpha=0.3)
    from matplotlib.lines import Line2D

    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    # each platform as its colour and ring size, each kind of point as its shape: a platform's entry
    # would otherwise show whichever shape its first point had
    for k, key in enumerate(platforms):
        unique[key] = Line2D([], [], marker="o", ls="none", mfc="none", mew=1.3, markersize=6 + 3 * k, color=f"C{k}")
    shapes = {"o": "finished (a blessed run)", "^": "ran out of memory (a lower bound)", "x": "a mistake to detect",
              "*": "a run given"}
    for marker, what in shapes.items():
        unique[what] = Line2D([], [], marker=marker, ls="none", mfc="none", color="dimgray")
    # outside the axes: inside, it hid the largest outlier and the ticks
    fig.legend(unique.values(), unique.keys(), fontsize=7, loc="outside right upper")
    errors = sorted(abs(e.predicted_per_card / e.median("per_card_peak") - 1) for e in entries
                    if e.outcome == "ok" and e.case.expect.outcome != "detected")
    summary = (f" Over the {len(errors)} finished runs the median error is {statistics.median(errors):.1%} and the "
               f"worst {errors[-1]:.1%}." if errors else "")
    for suite in dict.fromkeys(o.suite for o in other):
        errs = sorted(abs(o.record.predicted / o.record.measured - 1) for o in other if o.suite == suite)
        summary += (f" Open markers: {SUITE_LABELS.get(suite, suite)}, {len(errs)} runs from the predictor's "
                    f"error table (results/predictor/errors.json), median error {statistics.median(errs):.1%}, "
                    f"worst {errs[-1]:.1%}.")
    where = measured_where([e.baseline for e in entries])
    caption = (f"Measured: the per-card device peak, median over repetitions, {where}. "
               f"{PREDICTED[0].upper() + PREDICTED[1:]}. Triangles: runs that ran out of memory (measured at the "
               "failure, a lower bound); crosses: configs that are mistakes to detect; stars: the runs given. "
               "Markers are hollow and larger for each further platform, so equal points show as rings."
               + summary)
    s.items = [Figure("accuracy", to_svg(fig, "accuracy"), caption),
               Table(("config", "platform", "source", "outcome", "measured", "predicted", "error"), rows,
                     "Every prediction", collapsed=True)]
    return s
