"""The page's first section: the verdict table (harness.report.verdicts), failures first, so that the
first screen says what broke, what could not be checked and what passed."""

from __future__ import annotations

from harness.report.html.inputs import ReportInputs
from harness.report.html.page import Section, Table
from harness.report.verdicts import HEADER, rows_of, summary_line


def section(inputs: ReportInputs, shifts=()) -> Section:
    rows = rows_of(inputs, shifts)
    s = Section("verdicts", "Verdicts", (summary_line(rows) + ". " if rows else "") + "Failures first; per "
                "case and platform, the outcome expected and measured, the headroom, tokens/s against the baseline "
                "with the range noise alone gives, and the history's change points.",
                empty="no baseline and no run given", lead=True)
    if rows:
        classes = [r.status.lower().replace(" ", "-") for r in rows]
        s.items = [Table(HEADER, [r.cells() for r in rows], key="verdict-table", classes=classes)]
    return s
