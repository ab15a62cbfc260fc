"""Judging a case run: its expected outcome, the mistakes it must reveal, and its source's claims.

Every check returns a `Verdict` carrying the measured numbers, so a failure reads as a finding
("claimed X, measured Y"), and the summary table and the pytest failure say the same thing.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from harness.measure.records import CaseRun, Failure
from harness.spec.schema import TINY_CLAIMS, Case
from harness.spec.units import fmt_gib, fmt_mib

if TYPE_CHECKING:  # for annotations only: nothing more is imported at run time
    from harness.judge.extrapolation import Extrapolation
    from harness.spec.variants import Variant

# "finding": refuted, as the case records (`finding` of a claim or of `expect`): the guide is wrong
# and the measurement still says so; shown beside the failures, never failing a test.
Status = Literal["confirmed", "refuted", "not_checkable", "finding"]


@dataclass(frozen=True)
class Verdict:
    what: str  # the claim kind, or "outcome" / "detect"
    status: Status
    detail: str
    quote: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "refuted"

    def line(self) -> str:
        mark = {"confirmed": "ok", "refuted": "REFUTED", "not_checkable": "n/a", "finding": "finding"}[self.status]
        quote = f' ("{self.quote}")' if self.quote else ""
        return f"[{mark}] {self.what}: {self.detail}{quote}"


def _size(nbytes: int | None, fidelity: str) -> str:
    return fmt_mib(nbytes) if fidelity == "tiny" else fmt_gib(nbytes)


def per_card_peak(case: Case, run: CaseRun) -> int | None:
    return run.per_card_peak(case.launch.procs_per_card)


# --- mistakes the harness must detect ------------------------------------------------------------


def detections(case: Case, run: CaseRun) -> dict[str, str]:
    """Mistakes visible in a run, by name, each with the evidence."""
    found: dict[str, str] = {}
    for r in run.ranks:
        z = r.zero
        if z is None or z.stage != 3:
            continue
        full_bytes = (z.total_param_numel * (r.weights.param_bytes_local / max(1, z.local_param_numel))
                      if r.weights else 0)
        if not z.zero_init and r.world_size > 1 and z.materialised_param_bytes_before_engine >= 0.9 * full_bytes:
            found["materialised_before_zero_init"] = (
                f"rank {r.rank} held {_size(z.materialised_param_bytes_before_engine, run.fidelity)} of parameters "
                f"before deepspeed.initialize: the whole model, not 1/{r.world_size} (zero.Init was not used)"
            )
        if r.world_size == 1 and case.target.card.count > 1:
            found["single_process_zero"] = (
                f"ZeRO-{z.stage} ran in one process on a {case.target.card.count}-card target: "
                f"rank 0 holds all {z.total_param_numel} parameters (launch with torchrun/deepspeed)"
            )
    return found


# --- the expected outcome ------------------------------------------------------------------------


def check_outcome(case: Case, run: CaseRun) -> Verdict:
    err = run.first_error()
    expect = case.expect
    if expect.outcome == "detected":
        found = detections(case, run)
        if expect.detect in found:
            return Verdict("detect", "confirmed", found[expect.detect])
        if err is not None:
            return Verdict("detect", "refuted",
                           f"the run failed before the mistake could be seen: {err.kind.value}: "
                           f"{_first_line(err.message)}")
        return Verdict("detect", "refuted",
                       f"'{expect.detect}' was not visible in the run (found: {sorted(found) or 'nothing'})")

    if err is not None and err.kind != Failure.oom:
        return Verdict("outcome", "refuted", f"{err.kind.value} in {err.phase or 'launch'}: {_first_line(err.message)}")
    found = detections(case, run)
    if found and expect.outcome == "fits":
        name, evidence = next(iter(found.items()))
        return Verdict("outcome", "refuted", f"mistake {name}: {evidence}")

    if run.fidelity == "tiny":
        # Tiny sizes say nothing about a real card; an OOM here can only be an emulated limit.
        if err is not None:
            return Verdict("outcome", "refuted", f"out of memory at tiny size: {_first_line(err.message)}")
        return Verdict("outcome", "not_checkable",
                       f"'{expect.outcome}' on {case.target.card.name} is checked at full size")

    budget = case.budget_bytes
    card = case.target.card.memory
    peak = per_card_peak(case, run)
    if expect.outcome == "fits":
        if err is not None:
            return Verdict("outcome", "refuted",
                           f"out of memory on the {fmt_gib(card)} card: {_first_line(err.message)}")
        if peak is None:
            return Verdict("outcome", "refuted", "no peak was measured")
        ok = peak <= budget
        return Verdict("outcome", "confirmed" if ok else "refuted",
                       f"per-card peak {fmt_gib(peak)} {'<=' if ok else '>'} budget {fmt_gib(budget)} "
                       f"({case.target.headroom:.0%} of {fmt_gib(card)})")
    # expect oom
    if err is not None:
        return Verdict("outcome", "confirmed", f"out of memory, as expected: {_first_line(err.message)}")
    if peak is not None and peak > budget:
        return Verdict("outcome", "confirmed",
                       f"per-card peak {fmt_gib(peak)} exceeds the {case.target.headroom:.0%} line {fmt_gib(budget)}")
    return Verdict("outcome", "refuted",
                   f"the failing config fits: per-card peak {fmt_gib(peak)} <= {fmt_gib(budget)} "
                   f"on {fmt_gib(card)}")


def on_a_short_card(verdict: Verdict, run: CaseRun) -> Verdict:
    """An out-of-memory error on a card that had less memory free at the start than the card it
    emulates (another process held the rest) says nothing about the config: neither a refutation of
    a fit nor a confirmation of a guide's OOM."""
    short = run.card_shortfall()
    err = run.first_error()
    if verdict.what != "outcome" or short is None or err is None or err.kind != Failure.oom:
        return verdict
    free, card = short
    return Verdict("outcome", "not_checkable",
                   f"the card had {fmt_gib(free)} free at the start, less than the {fmt_gib(card)} card it emulates: "
                   f"another process held memory on it, so this out-of-memory error says nothing about the config "
                   f"({_first_line(err.message)})")


def judge_on_variant(case: Case, variant, verdict: Verdict, run: CaseRun, extrapolation=None) -> Verdict:
    """What a verdict measured on a variant says about the case as written.

    Fewer ranks only raise a ZeRO rank's share of the model states, and activations per rank do not
    depend on the world size: a fit on fewer ranks carries over, and so does a refutation of the
    guide's OOM (it fits even on fewer ranks); an OOM on fewer ranks does not. A depth series is
    judged on its extrapolated peak; an OOM at a shallower depth carries over to the full depth."""
    if variant.as_written or verdict.what != "outcome":
        return verdict
    where = variant.label(case)
    fewer_ranks = variant.fewer_ranks(case)
    err = run.first_error()
    if variant.layers is not None:
        if err is not None and err.kind == Failure.oom:
            if case.expect.outcome == "oom" and not fewer_ranks:
                return Verdict("outcome", "confirmed", f"out of memory already at {where}: {_first_line(err.message)}")
            return Verdict("outcome",
                           "refuted" if case.expect.outcome == "fits" and not fewer_ranks else "not_checkable",
                           f"out of memory at {where}: {_first_line(err.message)}")
        if err is not None:
            return verdict
        if extrapolation is None or "per_card_peak" not in extrapolation.values:
            return Verdict("outcome", "not_checkable", f"measured {where} only; no depth fit")
        # each side is judged where it is harder to pass: a fit with the margin the model's full-depth
        # check found, an OOM without it (harness.judge.extrapolation.depth_check)
        plain = int(extrapolation.values["per_card_peak"])
        peak = int(extrapolation.peak_with_margin()) if case.expect.outcome == "fits" else plain
        budget = case.budget_bytes
        fits = peak <= budget
        margin = (f"{fmt_gib(plain)} extrapolated, {extrapolation.margin_text()}"
                  if case.expect.outcome == "fits" else f"{extrapolation.margin_text()}, not added to confirm an OOM")
        detail = (f"per-card peak {fmt_gib(peak)} {'<=' if fits else '>'} budget {fmt_gib(budget)} "
                  f"({extrapolation.label}{', on ' + str(variant.ranks) + ' ranks' if fewer_ranks else ''}; {margin})")
        if case.expect.outcome == "fits":
            return Verdict("outcome", "confirmed" if fits else ("not_checkable" if fewer_ranks else "refuted"), detail)
        if fits:
            return Verdict("outcome", "refuted", "the failing config fits: " + detail)
        return Verdict("outcome", "not_checkable" if fewer_ranks else "confirmed", detail)
    if not fewer_ranks:
        return verdict
    note = (f" (measured on {variant.ranks} of {case.launch.ranks} ranks, "
            f"which bounds the {case.launch.ranks}-rank peak from above)")
    if case.expect.outcome == "fits":
        if verdict.status == "confirmed":
            return Verdict("outcome", "confirmed", verdict.detail + note)
        return Verdict(
            "outcome", "not_checkable", f"does not fit on {variant.ranks} ranks; that says nothing of "
            f"{case.launch.ranks}: {verdict.detail}")
    if case.expect.outcome == "oom":
        if verdict.status == "refuted" and err is None:
            return Verdict("outcome", "refuted", verdict.detail + note)
        return Verdict("outcome", "not_checkable", f"an OOM on {variant.ranks} ranks does not carry over to "
                       f"{case.launch.ranks}: {verdict.detail}")
    return verdict


def _first_line(text: str) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


# --- claims --------------------------------------------------------------------------------------


def as_recorded(verdict: Verdict, finding: str | None, fidelity: str) -> Verdict:
    """A verdict against what the case records. Where a full-size measurement refuted the guide
    (`finding`), a refutation is the expected result (status "finding") and a confirmation means
    the truth changed (a library, a driver, the harness): refuted, asking for the record to be
    updated. Findings are full-size truths; tiny runs are judged as if none were recorded."""
    if finding is None or fidelity == "tiny" or verdict.status == "not_checkable":
        return verdict
    if verdict.status in ("refuted", "finding"):
        return Verdict(verdict.what, "finding", f"{verdict.detail}; as recorded: {finding}", verdict.quote)
    return Verdict(verdict.what, "refuted",
                   f"the case records that measurement refuted this ({finding}), but now it holds: "
                   f"{verdict.detail}. The truth changed: update or remove `finding` in the case file",
                   verdict.quote)


class NotRun(Exception):
    """A claim consulted a case this session does not run (`Session.selected_only`)."""


def check_claims(case: Case, run: CaseRun, lookup: Callable[[str], tuple[Case, CaseRun]]) -> list[Verdict]:
    return [as_recorded(check_claim(claim, case, run, lookup), claim.finding, run.fidelity) for claim in case.claims]


def check_claim(claim, case: Case, run: CaseRun, lookup) -> Verdict:
    kind, quote = claim.kind, claim.quote
    if run.fidelity == "tiny" and kind not in TINY_CLAIMS:
        return Verdict(kind, "not_checkable", "checked at full size on real cards", quote)
    if kind == "oom_tried_to_allocate":
        return _oom_size(claim, run)
    err = run.first_error()
    try:
        if kind in _WHOLE_CARD and run.fidelity == "real" and err is not None and err.kind == Failure.oom:
            # the config runs out of memory on its card; how it compares with the others and where
            # its optimizer state lives are still facts about it: judged on the whole card
            return _WHOLE_CARD[kind](claim, case, lookup(case.id, uncapped=True)[1], lookup, uncapped=True)
        if err is not None or not run.ranks or any(r.step is None for r in run.ranks):
            why = (f"{err.kind.value} in {err.phase or 'launch'}: {_first_line(err.message)}" if err
                   else "no measurement")
            return Verdict(kind, "not_checkable", f"the run did not finish ({why})", quote)
        return _CHECKS[kind](claim, case, run, lookup)
    except NotRun as exc:  # a case the claim consults is not run in this session
        return Verdict(kind, "not_checkable", str(exc), quote)


def _trains(claim, case, run, lookup):
    bad = []
    for r in run.ranks:
        losses = r.losses
        if not losses or not all(math.isfinite(x) for x in losses):
            bad.append(f"rank {r.rank}: non-finite loss {losses}")
        elif not losses[-1] < losses[0]:
            bad.append(f"rank {r.rank}: loss did not fall ({losses[0]:.4f} -> {losses[-1]:.4f})")
    r0 = run.ranks[0]
    if bad:
        return Verdict(claim.kind, "refuted", "; ".join(bad), claim.quote)
    return Verdict(claim.kind, "confirmed",
                   f"{len(r0.losses)} steps, loss {r0.losses[0]:.4f} -> {r0.losses[-1]:.4f}", claim.quote)


def _did_not_fit(claim, probes, *names) -> Verdict | None:
    """Not checkable where a probe the claim needs ran out of memory (the run itself trained)."""
    missed = [f"{n} ({probes.did_not_fit[n]})" for n in names if n in probes.did_not_fit]
    if not missed:
        return None
    return Verdict(claim.kind, "not_checkable", f"the probe did not fit the card: {'; '.join(missed)}", claim.quote)


def _checkpointing(claim, case, run, lookup):
    r = run.ranks[0]
    on, off = r.probes.activation_bytes, r.probes.activation_bytes_without_checkpointing
    if on is None or off is None or off <= 0:
        return (_did_not_fit(claim, r.probes, "forward", "forward_without_checkpointing")
                or Verdict(claim.kind, "refuted", "the checkpointing probe did not run", claim.quote))
    saving = 1 - on / off
    ok = saving >= claim.min_saving
    return Verdict(claim.kind, "confirmed" if ok else "refuted",
                   f"activations held for backward {_size(on, run.fidelity)} with vs {_size(off, run.fidelity)} "
                   f"without checkpointing: {saving:.0%} saved (needs >= {claim.min_saving:.0%})", claim.quote)


def _checkpointing_saving(claim, case, run, lookup):
    """What checkpointing saved in the worst process (its activations with and without, measured by
    the probe) against the guide's figure for it."""
    r = max(run.ranks, key=lambda r: r.step.limiting())
    on, off = r.probes.activation_bytes, r.probes.activation_bytes_without_checkpointing
    if on is None or off is None:
        return (_did_not_fit(claim, r.probes, "forward", "forward_without_checkpointing")
                or Verdict(claim.kind, "not_checkable", "the checkpointing probe did not run", claim.quote))
    saved = off - on
    if claim.metric == "activation_bytes":
        value = saved
        detail = (f"checkpointing saves {fmt_gib(saved)} of activations ({fmt_gib(off)} -> {fmt_gib(on)}), "
                  f"claimed {fmt_gib(claim.low, 1)} to {fmt_gib(claim.high, 1)}")
    else:
        peak = r.step.limiting()
        value = saved / (peak + saved)
        detail = (f"checkpointing saves {fmt_gib(saved)}, {value:.0%} of the {fmt_gib(peak + saved)} peak it "
                  f"would be without ({fmt_gib(peak)} measured + the saving), claimed "
                  f"{claim.low:.0%}-{claim.high:.0%}")
    ok = claim.low <= value <= claim.high
    return Verdict(claim.kind, "confirmed" if ok else "refuted", detail, claim.quote)


CHECKPOINTING_COST_FLOOR = 0.02  # two points of slowdown: what timings of a few passes cannot tell apart


def _checkpointing_speed(claim, case, run, lookup):
    """The share of tokens/s checkpointing costs, per process, against the guide's figure. The claim
    holds where some pairing of the timings seen gives it: the costs range from the fastest pass
    with checkpointing against the slowest without to the other way round, widened by
    CHECKPOINTING_COST_FLOOR. (Three times the timings' spread around the medians, the first rule,
    allowed +/- 53% on the H100 and so confirmed a measured 37% against the guide's 8%.)"""
    timed = [r for r in run.ranks if r.probes.pass_s_with_checkpointing and r.probes.pass_s_without_checkpointing]
    if not timed:
        p = run.ranks[0].probes
        return (_did_not_fit(claim, p, "passes_with_checkpointing", "passes_without_checkpointing")
                or Verdict(claim.kind, "not_checkable", "the timed passes did not run", claim.quote))
    details, ok = [], True
    for r in timed:
        on, off = r.probes.pass_s_with_checkpointing, r.probes.pass_s_without_checkpointing
        cost = 1 - statistics.median(off) / statistics.median(on)
        low, high = 1 - max(off) / min(on), 1 - min(off) / max(on)
        holds = low - CHECKPOINTING_COST_FLOOR <= claim.cost <= high + CHECKPOINTING_COST_FLOOR
        ok &= holds
        who = f"process {r.rank}.{r.process_slot}: " if len(run.ranks) > 1 else ""
        details.append(f"{who}costs {cost:.1%} (a forward and backward in {statistics.median(on):.3f} s with it, "
                       f"{statistics.median(off):.3f} s without; {low:.0%} to {high:.0%} over the {len(on)} "
                       f"timings each way)")
    return Verdict(claim.kind, "confirmed" if ok else "refuted",
                   f"checkpointing {'; '.join(details)}; claimed {claim.cost:.0%} (+/- {CHECKPOINTING_COST_FLOOR:.0%})",
                   claim.quote)


def _quantized(claim, case, run, lookup):
    w = run.ranks[0].weights
    if not w or not w.quantized_linear_bytes:
        return Verdict(claim.kind, "refuted", "no 4-bit linear layers were found in the model", claim.quote)
    ratio = w.quantized_linear_bytes / w.quantized_linear_bf16_bytes
    ok = ratio <= claim.max_ratio
    return Verdict(claim.kind, "confirmed" if ok else "refuted",
                   f"4-bit linear weights {_size(w.quantized_linear_bytes, run.fidelity)} vs "
                   f"{_size(w.quantized_linear_bf16_bytes, run.fidelity)} in bf16: {ratio:.2f}x "
                   f"(needs <= {claim.max_ratio})",
                   claim.quote)


def _zero3(claim, case, run, lookup):
    details, ok = [], True
    for r in run.ranks:
        z = r.zero
        if z is None or z.stage != 3:
            return Verdict(claim.kind, "refuted", "the run did not use ZeRO-3", claim.quote)
        share = z.local_param_numel / z.total_param_numel
        want = 1 / r.world_size
        good = abs(share - want) <= claim.tolerance * want and r.world_size > 1
        ok &= good
        details.append(f"rank {r.rank}: {share:.3f} of parameters (1/{r.world_size} = {want:.3f})")
    return Verdict(claim.kind, "confirmed" if ok else "refuted", "; ".join(details[:2]), claim.quote)


def _whole_card_note(uncapped: bool, each: bool = True) -> str:
    """What a verdict judged on whole-card runs (`_WHOLE_CARD`) adds to its detail."""
    if not uncapped:
        return ""
    return f" ({'each ' if each else ''}on the whole card: this case runs out of memory on its own)"


def _offloaded(claim, case, run, lookup, uncapped: bool = False):
    where = _whole_card_note(uncapped, each=False)
    if uncapped and (run.first_error() is not None or not run.ranks):
        return Verdict(claim.kind, "not_checkable", "the run on the whole card did not finish either", claim.quote)
    o = run.ranks[0].offload
    if o is None:
        return Verdict(claim.kind, "refuted", "no DeepSpeed optimizer state was found" + where, claim.quote)
    ok = o.device_state_bytes == 0 and o.host_state_bytes > 0 and o.optimizer_class == "DeepSpeedCPUAdam"
    return Verdict(claim.kind, "confirmed" if ok else "refuted",
                   f"{o.optimizer_class}: {_size(o.host_state_bytes, run.fidelity)} of optimizer state on the host, "
                   f"{_size(o.device_state_bytes, run.fidelity)} on the device{where}", claim.quote)


def _logits(claim, case, run, lookup):
    p = run.ranks[0].probes
    if p.eval_logits_bytes is None or p.eval_logits_bytes_all is None:
        return (_did_not_fit(claim, p, "eval", "eval_all_logits")
                or Verdict(claim.kind, "refuted", "the evaluation probe did not run", claim.quote))
    expected = p.eval_logits_bytes_all * case.train.logits_to_keep / run.ranks[0].seq_len
    ok = p.eval_logits_bytes < p.eval_logits_bytes_all and p.eval_logits_bytes <= expected
    detail = (f"evaluation logits {_size(p.eval_logits_bytes, run.fidelity)} with logits_to_keep="
              f"{case.train.logits_to_keep} vs {_size(p.eval_logits_bytes_all, run.fidelity)} for every position")
    if p.train_logits_bytes is not None and p.train_logits_bytes >= p.eval_logits_bytes_all:
        detail += "; training forwards (with labels) keep every position, so it saves nothing during training"
    return Verdict(claim.kind, "confirmed" if ok else "refuted", detail, claim.quote)


def _lower_peak(claim, case, run, lookup, uncapped: bool = False):
    """This config's per-card peak below another's; `uncapped`: both measured on the whole card, for
    a case that runs out of memory on its own (its peak there is only where it stopped)."""
    where = _whole_card_note(uncapped)
    if uncapped and (run.first_error() is not None or per_card_peak(case, run) is None):
        return Verdict(claim.kind, "not_checkable", "no peak measured on the whole card either", claim.quote)
    other_case, other_run = lookup(claim.case, uncapped=uncapped)
    mine, theirs = per_card_peak(case, run), per_card_peak(other_case, other_run)
    err = other_run.first_error()
    if theirs is None or (uncapped and err is not None):
        if err is not None and err.kind == Failure.oom:
            return Verdict(claim.kind, "confirmed", f"{claim.case} ran out of memory; this one peaks at "
                           f"{_size(mine, run.fidelity)}{where}", claim.quote)
        return Verdict(claim.kind, "not_checkable", f"{claim.case} has no peak to compare with{where}", claim.quote)
    ok = mine < theirs
    return Verdict(claim.kind, "confirmed" if ok else "refuted",
                   f"per-card peak {_size(mine, run.fidelity)} vs {_size(theirs, run.fidelity)} for "
                   f"{claim.case}{where}", claim.quote)


@dataclass
class Series:
    """A case as measured on this host: its variants (harness.judge.session.plan), their runs, and the
    depth fit of the runs (harness.judge.extrapolation.Extrapolation) where there are two depths or more."""

    variants: list[Variant]
    runs: list[CaseRun]
    extrapolation: Extrapolation | None = None


def _shards_alike(case: Case, other: Case) -> bool:
    """Same model, method, ZeRO stage and offload: every rank holds the same share of the same
    states in both, so fewer ranks raise both peaks by the same bytes."""
    def sharding(c: Case):
        ds = c.deepspeed
        return None if ds is None else (ds.stage, ds.offload_optimizer, ds.offload_param)

    return case.model == other.model and case.method == other.method and sharding(case) == sharding(other)


def lower_peak_on_variants(claim, case: Case, mine: Series, other: Case, theirs: Series) -> Verdict:
    """`lower_peak_than` for a case measured on variants (fewer ranks, fewer layers, capped
    accumulation; harness.spec.variants): the two configs compare where both were measured alike, at every
    depth, and at the full depth where both have a depth fit (the verdict is the full depth's then:
    the claim is about the case as written). On fewer ranks only where they shard alike."""
    def no(why: str) -> Verdict:
        return Verdict(claim.kind, "not_checkable", why, claim.quote)

    variants = [v.text for v in mine.variants]
    label = mine.variants[-1].label(case)
    if variants != [v.text for v in theirs.variants]:
        return no(f"measured {label}; {claim.case} {theirs.variants[-1].label(other)}: not alike")
    if mine.variants[-1].fewer_ranks(case) and not _shards_alike(case, other):
        return no(f"measured {label}, and {claim.case} shards other states (model, method, ZeRO stage or "
                  f"offload differ): fewer ranks need not raise both peaks alike")
    pairs, lower = [], []
    for v, run, their_run in zip(mine.variants, mine.runs, theirs.runs, strict=True):
        where = f"{v.layers} layers" if v.layers else label
        err, their_err = run.first_error(), their_run.first_error()
        if err is not None:
            return no(f"this config failed at {where}: {err.kind.value}")
        mine_peak = per_card_peak(case, run)
        if their_err is not None and their_err.kind == Failure.oom:
            pairs.append(f"at {where} {_size(mine_peak, run.fidelity)} vs out of memory")
            lower.append(True)
            continue
        theirs_peak = per_card_peak(other, their_run)
        if their_err is not None or mine_peak is None or theirs_peak is None:
            return no(f"no pair of peaks to compare at {where}")
        pairs.append(f"at {where} {_size(mine_peak, run.fidelity)} vs {_size(theirs_peak, run.fidelity)}")
        lower.append(mine_peak < theirs_peak)
    ok = all(lower)
    fits = [s.extrapolation.values.get("per_card_peak") if s.extrapolation else None for s in (mine, theirs)]
    if None not in fits:
        pairs.append(f"extrapolated to the full depth {fmt_gib(fits[0])} vs {fmt_gib(fits[1])}")
        ok = fits[0] < fits[1]
    ranks = f" ({mine.variants[-1].ranks} of {case.launch.ranks} ranks)" if mine.variants[-1].fewer_ranks(case) else ""
    return Verdict(claim.kind, "confirmed" if ok else "refuted",
                   f"per-card peak vs {claim.case}{ranks}: {'; '.join(pairs)}", claim.quote)


def _memory_range(claim, case, run, lookup):
    r_peak = per_card_peak(case, run)
    if claim.metric == "load_footprint":
        value = max((r.load.limiting() for r in run.ranks if r.load), default=None)
    elif claim.metric == "usage_fraction":
        value = r_peak / case.target.card.memory if r_peak else None
    else:
        value = r_peak
    if value is None:
        return Verdict(claim.kind, "not_checkable", "no figure measured", claim.quote)
    ok = claim.low <= value <= claim.high
    if claim.metric == "usage_fraction":
        detail = f"measured {value:.0%} of the card, claimed {claim.low:.0%}-{claim.high:.0%}"
    else:
        detail = (f"measured {claim.metric} {fmt_gib(value)}, claimed {fmt_gib(claim.low, 1)} to "
                  f"{fmt_gib(claim.high, 1)}")
    return Verdict(claim.kind, "confirmed" if ok else "refuted", detail, claim.quote)


def _oom_size(claim, run, *_):
    err = run.first_error()
    if err is None or err.kind != Failure.oom or err.tried_to_allocate is None:
        return Verdict(claim.kind, "not_checkable", "no OOM with a requested size to compare", claim.quote)
    ok = abs(err.tried_to_allocate - claim.size) <= 0.02 * claim.size
    return Verdict(claim.kind, "confirmed" if ok else "refuted",
                   f"tried to allocate {fmt_gib(err.tried_to_allocate)}, the source saw {fmt_gib(claim.size)}",
                   claim.quote)


def _speed_rank(claim, case, run, lookup, uncapped: bool = False):
    """The claimed speed order against the measured tokens/s of the family's other ranked cases;
    `uncapped`: every case of the family measured on the whole card, for a case that runs out of
    memory on its own."""
    where = _whole_card_note(uncapped)
    mine = run.per_card_rate(case.launch.procs_per_card)
    if mine is None or run.first_error() is not None:
        return Verdict(claim.kind, "not_checkable", "no throughput measured" + where, claim.quote)
    compared, wrong = [], []
    for other_case, other_run in lookup.family(case.family, uncapped=uncapped):
        theirs = other_run.per_card_rate(other_case.launch.procs_per_card)
        other_rank = next((c.rank for c in other_case.claims if c.kind == "speed_rank"), None)
        if other_case.id == case.id or theirs is None or other_rank is None or other_run.first_error():
            continue
        compared.append(other_case.id)
        if (other_rank < claim.rank) != (theirs > mine):
            wrong.append(f"{other_case.id} (rank {other_rank}) runs {theirs:,.0f} tokens/s")
    if not compared:
        return Verdict(claim.kind, "not_checkable", "no other ranked case of the family finished", claim.quote)
    detail = f"rank {claim.rank} at {mine:,.0f} tokens/s per GPU{where}"
    if wrong:
        return Verdict(claim.kind, "refuted", detail + "; out of order against " + "; ".join(wrong), claim.quote)
    return Verdict(claim.kind, "confirmed", detail + f", in order against {len(compared)} other(s)", claim.quote)


# claims about the config rather than its card (how it compares with others, where its optimizer
# state lives), judged on the whole card where the config runs out of its own card's memory
_WHOLE_CARD = {"speed_rank": _speed_rank, "lower_peak_than": _lower_peak, "optimizer_state_offloaded": _offloaded}
WHOLE_CARD_CLAIMS = frozenset(_WHOLE_CARD)

_CHECKS = {
    "trains": _trains,
    "checkpointing_saves_activations": _checkpointing,
    "checkpointing_saving": _checkpointing_saving,
    "checkpointing_speed_cost": _checkpointing_speed,
    "quantized_weights_shrink": _quantized,
    "zero3_partitions_parameters": _zero3,
    "optimizer_state_offloaded": _offloaded,
    "logits_to_keep_shrinks_logits": _logits,
    "lower_peak_than": _lower_peak,
    "memory_range": _memory_range,
    "oom_tried_to_allocate": lambda claim, case, run, lookup: _oom_size(claim, run),
    "speed_rank": _speed_rank,
}
