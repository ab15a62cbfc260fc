"""The page's first section: the verdict table (harness.report.verdicts), failures first, so that the
first screen says what broke, what could not be checked and what passed."""

from __future__ import annotations

from harness.report.html.inputs import ReportInputs
from harness.report.html.page import Section, Table
from harness.report.verdicts import HEADER, rows_of, summary_line


def section(inputs: ReportInputs, shifts=()) -> Section:
    rows = rows_of(inputs, shifts)
    s = Section("verdicts", "Verdicts", "One row per case and platform: the outcome the case expects against the "
                "one measured, the headroom under the budget, tokens/s against the baseline with the interval "
                "noise alone would give, the change points of the history, and the verdict. FAIL first, then "
                "NOT CHECKED (a check that could not run is no pass). " + (summary_line(rows) + "." if rows else ""),
                empty="no baseline and no run given")
    if rows:
        classes = [r.status.lower().replace(" ", "-") for r in rows]
        s.items = [Table(HEADER, [r.cells() for r in rows], key="verdict-table", classes=classes)]
    return s
