"""The verdict table that leads every report: one row per case and platform with the outcome expected
against the outcome measured, the headroom under the budget (GiB and % of the budget), tokens/s against
the baseline as a % with its interval, the change points the history holds, and pass / FAIL / NOT
CHECKED, failures first. A reader who opens the nightly sees first what broke.

The runs given are judged here as `oom-harness run` judged them (harness.judge.regression and the
verdicts their `--json` kept); the committed baselines, listed after them, are judged on their outcome
only: they are what runs are held to.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from harness.spec.units import GIB
from harness.spec.variants import parse_variant

HEADER = ("status", "case", "platform", "expected", "measured", "headroom", "tokens/s vs baseline", "change points",
          "why")
ORDER = {"FAIL": 0, "NOT CHECKED": 1, "finding": 2, "pass": 3}


@dataclass
class Row:
    case: str
    platform: str
    source: str
    expected: str
    measured: str
    headroom: str
    speed: str
    changes: str
    status: str = "pass"
    why: list[str] = field(default_factory=list)

    def cells(self) -> tuple[str, ...]:
        case = self.case + (" [run given]" if self.source == "run given" else "")
        return (self.status, case, self.platform, self.expected, self.measured, self.headroom, self.speed,
                self.changes, "; ".join(self.why) or "-")

    def fail(self, why: str) -> None:
        self.status = "FAIL"
        self.why.append(why)

    def unchecked(self, why: str) -> None:
        if self.status == "pass":
            self.status = "NOT CHECKED"
        self.why.append(why)


def _headroom(case, peak: float | None) -> str:
    budget = case.budget_bytes
    if peak is None or not budget:
        return "-"
    return f"{(budget - peak) / GIB:+.2f} GiB ({(budget - peak) / budget:+.0%})"


def _speed(entry, baselines) -> tuple[str, object | None]:
    """The cell for a run given, and the baseline_speed verdict (None where there is no baseline)."""
    from harness.judge.regression import against_baseline, find_baseline, speed_noise
    from harness.judge.stats import run_vs_baseline

    b = entry.baseline
    run = next((f for f in b.runs if f.outcome == "ok" and f.tokens_per_s_per_gpu), None)
    if run is None:
        return "-", None
    base = find_baseline(b.case_id, b.variant, b.platform.key, baselines)
    if base is None:
        return "no baseline", None
    verdict = next((v for v in against_baseline(entry.case, run, base, pool=baselines)
                    if v.what == "baseline_speed"), None)
    rates = [f.tokens_per_s_per_gpu for f in base.runs if f.outcome == "ok" and f.tokens_per_s_per_gpu]
    if not rates:
        return "-", verdict
    noise = speed_noise(base, baselines)
    weak = " WEAK (1 repetition)" if len(rates) < 2 else ""
    if noise is None:
        return f"{run.tokens_per_s_per_gpu / statistics.median(rates) - 1:+.1%} (no noise estimate){weak}", verdict
    t = run_vs_baseline(run.tokens_per_s_per_gpu, rates, noise)
    return f"{t.change:+.1%} (noise {t.low:+.1%} to {t.high:+.1%}){weak}", verdict


def rows_of(inputs, shifts=()) -> list[Row]:
    """The verdict rows of a report's inputs (harness.report.html.inputs.ReportInputs), failures first.
    `shifts`: change points (harness.judge.changepoints.Shift) of the history, if one is given."""
    baselines = inputs.baselines
    stored = {}
    for name, v in inputs.verdicts:
        stored.setdefault(name, []).append(v)
    rows = []
    for e in inputs.entries:
        b, case = e.baseline, e.case
        variant = parse_variant(b.variant)
        ok = e.outcome == "ok"
        measured = "fits" if ok else e.outcome
        peak = e.median("per_card_peak")
        row = Row(e.name, b.platform.key, "run given" if e.is_run else "baseline", case.expect.outcome, measured,
                  _headroom(case, peak) if variant.as_written else f"- (variant {b.variant})", "-", "-")
        if variant.as_written and case.expect.outcome in ("fits", "oom"):
            if case.expect.outcome != ("fits" if ok else "oom" if e.outcome == "oom" else e.outcome):
                if case.expect.finding:
                    row.status = "finding" if row.status == "pass" else row.status
                    row.why.append(f"expected {case.expect.outcome}, measured {measured}: the guide is wrong, "
                                   "as the case records")
                else:
                    row.fail(f"outcome refuted: expected {case.expect.outcome}, measured {measured}")
        elif variant.uncapped:
            row.expected = "-"
            row.why.append("on the whole card, for the claims that compare configs: no verdict on its target")
        elif not variant.as_written:
            row.why.append(f"measured {b.measured}: the outcome is judged on the case's extrapolation")
        if e.is_run:
            row.speed, verdict = _speed(e, baselines)
            if row.speed == "no baseline":
                row.unchecked("no baseline of this config on this platform: its memory and speed are not checked "
                              "(oom-harness bless)")
            if verdict is not None and verdict.status == "refuted":
                row.fail("tokens/s below the baseline beyond the noise")
            elif verdict is not None and verdict.status == "not_checkable":
                row.unchecked("speed not checked: " + verdict.detail.removeprefix("NOT CHECKED: ")[:160])
            for v in stored.get(e.name, []):
                if v.status == "refuted" and v.what != "outcome":
                    row.fail(f"{v.what} refuted")
        mine = [s for s in shifts if (s.case, s.variant, s.platform) == (b.case_id, b.variant, b.platform.key)]
        if mine:
            row.changes = "; ".join(f"{s.metric} {s.change:+.1%} from {s.recorded[:10]}" for s in mine)
            for s in mine:
                if s.worse:
                    row.fail(f"change point: {s.metric} {s.change:+.1%} from run '{s.first_run}'")
        rows.append(row)
    rows.sort(key=lambda r: (ORDER[r.status], r.source == "baseline", r.case, r.platform))
    return rows


def summary_line(rows: list[Row]) -> str:
    counts = {k: sum(r.status == k for r in rows) for k in ORDER}
    parts = [f"{counts['FAIL']} FAIL", f"{counts['NOT CHECKED']} NOT CHECKED (a check that could not run is no pass)",
             f"{counts['finding']} recorded finding(s)", f"{counts['pass']} pass"]
    return f"{len(rows)} rows: " + ", ".join(parts)
