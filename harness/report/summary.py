"""The summary table printed after a run of cases (by the CLI and at the end of pytest)."""

from __future__ import annotations

from harness.judge.host_ram import node_host_need
from harness.judge.session import Judgement
from harness.report.columns import aligned
from harness.spec.units import GIB, fmt_gib, fmt_mib

COLUMNS = ("case", "fid", "procs", "load", "peak/card", "host/node", "tok/s/card", "loss", "outcome", "claims",
           "vs baseline")
BASELINE_CHECKS = {"baseline_memory": "memory", "baseline_speed": "speed", "change_point": "change point"}


def _vs_baseline(j: Judgement) -> str:
    """What the run's regression checks found: the checks that failed, then those that could not run
    (a speed NOT CHECKED is no pass), else ok; '-' where nothing was held to a baseline (tiny runs)."""
    found = [v for v in j.against_baseline if v.what in BASELINE_CHECKS]
    if not j.against_baseline:
        return "-"
    failed = sorted({BASELINE_CHECKS[v.what] for v in found if v.status == "refuted"})
    unchecked = sorted({BASELINE_CHECKS.get(v.what, "baseline") for v in j.against_baseline
                        if v.status == "not_checkable"})
    parts = [f"{w} FAILED" for w in failed] + [f"{w} NOT CHECKED" for w in unchecked]
    return ", ".join(parts) or "ok"



def _host(j: Judgement) -> str:
    """The node's host need over what it may use, where it was judged (harness.judge.host_ram)."""
    if j.host_ram is None:
        return "-"
    need = node_host_need(j.case, j.run, j.extrapolation)
    if need is None:
        return "n/a"
    cell = f"{need.total / GIB:.0f}/{need.usable / GIB:.0f} GiB"
    return {"confirmed": cell, "refuted": cell + " FAILED", "not_checkable": f"({cell})"}[j.host_ram.status]


def _row(j: Judgement) -> tuple[str, ...]:
    run, case = j.run, j.case
    size = fmt_mib if run.fidelity == "tiny" else fmt_gib
    ranks = run.ranks
    load = max((r.load.limiting() for r in ranks if r.load), default=None)
    peak = run.per_card_peak(case.launch.procs_per_card)
    card_rate = run.per_card_rate(case.launch.procs_per_card)
    rate = f"{card_rate:,.0f}" if card_rate else "-"
    losses = ranks[0].losses if ranks else []
    loss = f"{losses[0]:.3f}->{losses[-1]:.3f}" if losses else "-"
    procs = f"{len({r.rank for r in ranks}) or case.launch.ranks}x{case.launch.procs_per_card}"
    counts = {s: sum(v.status == s for v in j.claims) for s in ("confirmed", "refuted", "not_checkable", "finding")}
    claims = f"{counts['confirmed']} ok"
    if counts["refuted"]:
        claims += f", {counts['refuted']} REFUTED"
    if counts["finding"]:
        claims += f", {counts['finding']} finding{'s' if counts['finding'] > 1 else ''}"
    if counts["not_checkable"]:
        claims += f", {counts['not_checkable']} n/a"
    outcome = {"confirmed": "ok", "refuted": "FAILED", "not_checkable": "-", "finding": "finding"}[j.outcome.status]
    if j.outcome.status == "not_checkable":
        outcome = f"({case.expect.outcome})"
    err = run.first_error()
    if err is not None:
        outcome = f"{err.kind.value}" + {"confirmed": " ok", "finding": " (finding)"}.get(j.outcome.status, "")
    name = case.id + (run.variant and f"@{run.variant}")
    e = j.extrapolation
    if e is not None and "per_card_peak" in e.values:
        # the peak the outcome was judged on: with the full-depth margin for a fit (harness.judge.extrapolation)
        with_margin = case.expect.outcome == "fits" and e.margin > 0
        name = case.id + f" (extrapolated from {','.join(map(str, e.from_layers))}L" + (
            f", +{e.margin:.1%} full-depth margin)" if with_margin else ")")
        peak = int(e.peak_with_margin() if with_margin else e.values["per_card_peak"])
        if e.tokens_per_s:
            rate = f"{e.tokens_per_s:,.0f}"
    return (name, run.fidelity, procs, size(load), size(peak), _host(j), rate, loss, outcome, claims, _vs_baseline(j))


def table(judgements: list[Judgement]) -> str:
    rows = [COLUMNS] + [_row(j) for j in judgements]
    return aligned(rows)


def consulted_line(consulted: list[tuple[str, str, str]], option: str) -> str:
    """The runs made only for other cases' claims (`Session.consulted`), and the `option` that
    leaves such claims unchecked instead."""
    runs = ", ".join(f"{cid}{'@' + variant if variant else ''} [{fid}]" for cid, fid, variant in consulted)
    return f"also run, for the claims of the cases above: {runs} ({option} leaves those claims unchecked instead)"


def whole_card_line(runs: list[tuple[str, str, str]]) -> str:
    """The judged cases' own whole-card runs (`Session.whole_card`): the time they took is theirs."""
    names = ", ".join(f"{cid}@{variant} [{fid}]" for cid, fid, variant in runs)
    return (f"also run on the whole card, for claims that compare configs which run out of memory on "
            f"their own cards: {names}")


FINDINGS_TITLE = "findings (refuted claims and outcomes; recorded findings last)"


def findings(judgements: list[Judgement]) -> str:
    """Every refuted claim or outcome, with its numbers, then the guides' statements that
    measurement refutes as the cases record (`finding`), which fail nothing."""
    failed, recorded = [], []
    for j in judgements:
        for v in j.verdicts:
            line = f"{j.case.id} [{j.run.fidelity}] {v.line()}"
            if v.failed:
                failed.append(line)
            elif v.status == "finding":
                recorded.append(line)
    return "\n".join(failed + recorded)
