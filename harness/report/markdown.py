"""REPORT.md: the verdict table first, then the baselines as a markdown table, and the depth
extrapolations they support. Every cell is escaped (`md`): a run record is JSON anyone can edit, and a
device name holding `|` and a line break, or a detail opening an HTML comment, must not add or hide rows."""

from __future__ import annotations

from pathlib import Path

from harness.baselines.store import MEMORY_FLOOR, Baseline
from harness.judge.extrapolation import every_fit
from harness.judge.host_ram import node_text
from harness.judge.verdicts import WHOLE_CARD_CLAIMS
from harness.spec.cases import CASES_DIR, load_case
from harness.spec.units import fmt_gib
from harness.spec.variants import parse_variant


def md(text) -> str:
    """`text` as one markdown table cell or list item: line breaks and control characters become spaces,
    `|` and `\\` are escaped, and `<`, `>`, `&` become entities (no HTML, no comment hides what follows)."""
    out = []
    for ch in str(text):
        if ch in "\r\n\t" or ord(ch) < 32 or 0x7F <= ord(ch) < 0xA0 or ch in "\u2028\u2029":
            out.append(" ")
        elif ch in "\\|":
            out.append("\\" + ch)
        else:
            out.append({"<": "&lt;", ">": "&gt;", "&": "&amp;"}.get(ch, ch))
    return "".join(out)


def _row(cells) -> str:
    return "| " + " | ".join(md(c) for c in cells) + " |"


def verdict_markdown(rows) -> str:
    """The verdict rows (harness.report.verdicts.rows_of) as a markdown table, with the count of each status."""
    from harness.report.verdicts import HEADER, summary_line

    if not rows:
        return ""
    lines = [f"Verdicts, failures first: {summary_line(rows)}.", "", _row(HEADER), "|" + "---|" * len(HEADER)]
    return "\n".join(lines + [_row(r.cells()) for r in rows])


def report_markdown(baselines: list[Baseline], case_dir: Path = CASES_DIR) -> str:
    """One row per baseline: target card, measured peaks, headroom, speed, and the guide's
    memory claims beside the measurement. The baselines' cases are read from `case_dir`."""

    lines = [
        ("| case | measured on | target card (budget) | outcome "
         "| peak allocated / reserved (worst process) / device (per card) | headroom "
         "| host RAM per node (processes x worst process) | tokens/s/GPU | MFU | guide's claims vs measured |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in baselines:
        case = load_case(case_dir / f"{b.case_id}.yaml")
        r = b.runs[0]
        budget = case.budget_bytes
        head = "-" if r.per_card_peak is None else f"{(budget - r.per_card_peak) / 2**30:+.2f} GiB"
        peaks = " / ".join(fmt_gib(x) for x in (r.allocated_peak, r.reserved_peak, r.per_card_peak))
        if r.outcome != "ok":
            peaks += " (at the failure)"
        if r.triton_cache:
            peaks += f" ({r.triton_cache} Triton cache)"
        claims = []
        for c in case.claims:
            if c.kind != "memory_range":
                continue
            if c.metric == "usage_fraction":
                value = r.per_card_peak / case.target.card.memory if r.per_card_peak else None
                got = "-" if value is None else f"{value:.0%}"
                want = f"{c.low:.0%}-{c.high:.0%}"
            else:
                value = r.load_footprint if c.metric == "load_footprint" else r.per_card_peak
                got = fmt_gib(value)
                want = f"{c.low / 2**30:.0f}-{c.high / 2**30:.0f} GiB"
            ok = value is not None and c.low <= value <= c.high and r.outcome == "ok"
            mark = "(holds)" if ok else ("(refuted, as recorded)" if c.finding else "(refuted)")
            claims.append(f"{c.metric} {want}: {got} {mark}")
        verdict = r.outcome if r.outcome != "ok" else "fits"
        mark = _against_guide(case, verdict)
        rate = "-" if r.tokens_per_s_per_gpu is None else f"{r.tokens_per_s_per_gpu:,.0f}"
        mfu = "-" if r.mfu is None else f"{r.mfu:.1%}"
        where = f"{b.platform.device_name} x{b.platform.device_count}, {b.measured}"
        card = f"{case.target.card.name} ({fmt_gib(budget)})"
        # a shallower depth says nothing of the node: its extrapolation below does
        variant = parse_variant(b.variant)
        host = "-" if variant.layers else node_text(case, r.host_peak)
        if variant.uncapped:
            # measured for the claims that compare configs: its target card's verdict is in the
            # case's own row, and the headroom says how far the whole-card peak overshoots it
            judged = sorted({c.kind for c in case.claims if c.kind in WHOLE_CARD_CLAIMS})
            claims = [f"{', '.join(judged)}: judged on this run"] if judged else []
            verdict = "trains" if r.outcome == "ok" else r.outcome
            mark = "on the whole card: no verdict on its target"
        elif case.expect.outcome == "detected":
            # what the mistake costs, measured; whether it was detected is the run's verdict. Its
            # variant is a single depth (a mistake shows at any depth), so nothing is extrapolated.
            verdict = "trains" if r.outcome == "ok" else r.outcome
            mark, claims = f"the mistake to detect: {case.expect.detect}", []
        elif b.variant:
            claims, mark = ["stated for the case as written: see the extrapolation below"], "a measured variant"
        lines.append(_row((b.case_id, where, card, f"{verdict} ({mark})", peaks, head, host, rate, mfu,
                           "; ".join(claims) or "-")))
    extra = extrapolation_markdown(baselines, case_dir)
    return "\n".join(lines) + ("\n\n" + extra if extra else "")


def _against_guide(case, outcome: str, carries: bool = True) -> str:
    """A measured (or extrapolated) outcome beside the case's expectation, and its recorded finding.
    `carries` is False for an excess measured on fewer ranks, which says nothing of the case."""
    expected = case.expect.outcome
    if not carries:
        return "inconclusive on fewer ranks"
    if outcome == expected:
        return "as expected"
    if case.expect.finding:
        return f"the guide says {expected}: refuted, as recorded"
    return f"expected {expected}"


def extrapolation_markdown(baselines: list[Baseline], case_dir: Path = CASES_DIR) -> str:
    """Depth fits of the measured variants: the full-depth figures they predict, labelled as
    extrapolated, the full-depth measurement beside them where one exists, and the margin the
    model's full-depth check adds before a fit is judged."""

    rows = []
    for case, e in every_fit(baselines, case_dir):
        peak = e.values.get("per_card_peak")
        budget = case.budget_bytes
        judged = e.peak_with_margin() if case.expect.outcome == "fits" else peak
        verdict = "-"
        if judged is not None:
            fits = judged <= budget
            fewer_ranks = parse_variant(e.base_variant).fewer_ranks(case)
            mark = _against_guide(case, "fits" if fits else "oom", carries=fits or not fewer_ranks)
            verdict = f"{'fits' if fits else 'exceeds the budget'} ({mark})"
        check = "-"
        m = e.measured_full_depth
        if m is not None and m.outcome == "ok":
            check = f"peak {fmt_gib(m.per_card_peak)} (fit {e.error('per_card_peak'):+.1%})"
            if e.error("host_peak") is not None:
                check += f"; host {fmt_gib(m.host_peak)} (fit {e.error('host_peak'):+.1%})"
            if m.tokens_per_s_per_gpu and e.tokens_per_s:
                check += (f"; {m.tokens_per_s_per_gpu:,.0f} tokens/s "
                          f"(fit {e.tokens_per_s / m.tokens_per_s_per_gpu - 1:+.0%})")
        elif m is not None:
            check = (f"measured: {m.outcome} at {fmt_gib(m.per_card_peak)} "
                     f"on the {fmt_gib(case.target.card.memory)} card")
        line = e.lines.get("per_card_peak")
        per_layer = "-" if line is None else (
            f"flat (within {MEMORY_FLOOR:.0%})" if line.flat else f"{line.slope / 2**30:.3f} GiB")
        margin = "-" if peak is None else (
            f"{fmt_gib(e.peak_with_margin())} (+{e.margin:.1%}, {e.check.case_id})" if e.check else "none (unchecked)")
        rate = "-" if e.tokens_per_s is None else f"{e.tokens_per_s:,.0f}"
        if e.tokens_per_s is None and any(r.startswith("step time") for r in e.rejected):
            rate = "- (step time falls with depth)"
        host = node_text(case, e.values.get("host_peak"))
        rows.append(_row((case.id, f"{e.platform_key}, variant {e.base_variant or 'as written'}", e.label,
                          fmt_gib(peak), per_layer, margin, host, rate, f"{fmt_gib(budget)}: {verdict}", check)))
    if not rows:
        return ""
    intro = ("Depth extrapolations (extrapolated figures, not measurements). A fit is judged with the margin "
             "its model's full-depth check found (the worst shortfall of an extrapolation against a full-depth "
             "measurement of the same model); an expected OOM without it.")
    columns = ("case", "measured on", "extrapolation", "per-card peak at full depth", "per layer",
               "with the full-depth margin", "host RAM per node (processes x worst rank)", "tokens/s/GPU", "budget",
               "full-depth check")
    head = [intro, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(head + rows)
