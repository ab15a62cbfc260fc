"""The search: every knob setting ranked by predicted throughput, the fastest ones that fit kept.

Each distinct traced step costs seconds (`harness.predict.trace` caches one per TraceSpec); everything
else of a prediction costs about a millisecond. So:

1. Every candidate of `harness.fit.knobs.space` gets its predicted tokens/s from the closed-form
   throughput model (`harness.fit.throughput`), no trace, with the constants of the platform named
   (`--platform`; the nearest of its card family where it has no baselines, pooled where none is
   named). They are walked fastest first, those that
   keep what is trained before those that change it (4-bit weights, cutoff, rank: only where
   `--allow` lets them, and only where nothing that keeps the training fits). Of the fitting
   candidates within `SAME_SPEED` of the fastest, the one with the fewest changes to what is trained,
   then the fewest changes, is chosen: the model does not resolve smaller differences.
2. Before a candidate's own step is traced, its memory is bounded from the same candidate at
   micro-batch 1 (gradient accumulation keeping the global batch): that prediction plus the step's
   transient peak times the extra micro-batch, in reserved bytes. A candidate estimated above the
   budget by more than `SCREEN_SLACK` is passed over without a trace. Traces are shared by every
   candidate that differs only in knobs the traced step does not see (ZeRO stage 0/2, offload,
   buckets, pinning, workers).
3. A candidate is judged by the verdict `oom-harness check` gives (`CheckResult.fits`: the card's
   predicted peak within the budget, and the host's RAM where it is given), so whatever margin that
   verdict holds applies here unchanged.
4. A candidate that does not fit rules out its family at that micro-batch and above.
5. A one-GPU job without DeepSpeed may take ZeRO offload (`harness.fit.zero_offload`): ranked by the
   same model, which prices its CPU Adam and host-device copies. Once a config fits, an offload candidate
   predicted slower than `SAME_SPEED` of it could not be chosen, so it is not predicted (its ZeRO-3
   trace costs seconds). Nor is one whose twin without DeepSpeed (the same knobs, at its micro-batch or
   at 1) was predicted so far over the budget that moving every byte offload can move off the card
   (`_offload_floor`) leaves it over by more than `SCREEN_SLACK`.

The walk stops at the fastest fitting candidate and `RUNNERS_UP` more with different main knobs, or
at the deadline (then the result says so).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from harness.fit.knobs import Knobs, apply, knobs_of, space
from harness.fit.throughput import ThroughputModel, calibrate
from harness.fit.zero_offload import NewDeepSpeed, why_not
from harness.predict.step import liger_applies
from harness.premerge.check import CheckResult
from harness.premerge.importers.model import hidden_size
from harness.spec.schema import Case

SCREEN_SLACK = 1.10  # estimate / budget above which a candidate is passed over without a trace
RUNNERS_UP = 4
SAME_SPEED = 0.95  # predicted tokens/s within this share of the fastest count as equal
DEADLINE_S = 90.0  # the walk's share of fit's 120 s


@dataclass
class Candidate:
    knobs: Knobs
    case: Case
    tokens_per_s: float  # predicted, per card
    changed: int  # knobs that differ from the input's
    changes_training: int  # of them, those that change what is trained (4-bit weights, cutoff, rank)
    result: CheckResult | None = None  # the check's verdict on it, once predicted
    note: str | None = None  # where its tokens/s are modelled, not measured (ThroughputModel.unmeasured)

    @property
    def fits(self) -> bool:
        return bool(self.result is not None and self.result.fits)

    def main(self) -> tuple:
        k = self.knobs
        return (k.micro_batch, k.checkpointing, k.checkpointing and k.reentrant, k.stage, k.offload_optimizer,
                k.offload_param, k.seq_len, k.lora_r, k.four_bit)


@dataclass
class Search:
    base: CheckResult
    best: Candidate | None
    runners_up: list[Candidate]
    closest: Candidate | None  # when nothing fits: the smallest predicted card peak against the budget
    throughput: ThroughputModel
    base_tokens_per_s: float
    considered: int
    predicted: int
    screened_out: int
    seconds: float
    stopped_early: bool
    notes: list[str] = field(default_factory=list)
    offload_not_searched: str | None = None  # why ZeRO offload was not added to a job without DeepSpeed

    def cut_short(self) -> str:
        """What a walk the time limit stopped says where it found nothing: not a verdict on the candidates
        it never reached."""
        return (f"no fitting config found in the {self.seconds:.0f} s the search was given "
                f"({self.predicted} of {self.considered} candidates predicted)")


PredictFn = Callable[..., Any]


def search(base: CheckResult, allow: frozenset[str], predict: PredictFn, *, platform: str | None = None,
           deadline_s: float = DEADLINE_S, runners_up: int = RUNNERS_UP) -> Search:
    t0 = time.perf_counter()
    warnings.simplefilter("ignore", FutureWarning)  # library deprecation chatter from the traced model code
    warnings.simplefilter("ignore", DeprecationWarning)
    imported = base.config
    case0, config = imported.case, imported.arch.config
    model = calibrate(platform=platform)
    k0 = knobs_of(case0)
    no_offload = why_not(imported)
    new_ds = NewDeepSpeed(hidden_size=hidden_size(imported.arch), init_order=imported.init_order.order) \
        if no_offload is None else None

    def apply_(case: Case, k: Knobs) -> Case:
        return apply(case, k, new_ds)

    candidates = []
    for k in space(k0, allow, case0.method.kind, liger_applies(case0.model_copy(
            update={"train": case0.train.model_copy(update={"liger_kernel": True})}), imported.arch.model_type),
            offload=no_offload is None):
        case = apply_(case0, k)
        changed = sum(getattr(k, f.name) != getattr(k0, f.name) for f in dataclasses.fields(k))
        training = sum(getattr(k, name) != getattr(k0, name) for name in ("four_bit", "seq_len", "lora_r"))
        candidates.append(Candidate(k, case, model.predict(case, config), changed, training,
                                    note=model.unmeasured(case)))
    candidates.sort(key=lambda c: (c.changes_training > 0, -c.tokens_per_s, c.changes_training, c.changed))

    predictions: dict[Knobs, CheckResult] = {}

    def judge(k: Knobs, case: Case) -> CheckResult:
        if k not in predictions:
            prediction = predict(case, imported.arch, platform=platform)
            predictions[k] = CheckResult(config=dataclasses.replace(imported, case=case), prediction=prediction,
                                         lints=())
        return predictions[k]

    failed_at: dict[tuple, int] = {}  # family -> smallest micro-batch predicted not to fit
    fitting, screened, stopped = [], 0, False
    seen_main: set[tuple] = set()
    for c in candidates:
        if time.perf_counter() - t0 > deadline_s:
            stopped = True
            break
        k = c.knobs
        fam = k.family()
        if fam in failed_at and k.micro_batch >= failed_at[fam]:
            continue
        if c.main() in seen_main:
            continue
        if len(fitting) > runners_up and (c.changes_training > 0) == (fitting[0].changes_training > 0) \
                and c.tokens_per_s < SAME_SPEED * fitting[0].tokens_per_s:
            break
        if fitting and (c.changes_training > 0) != (fitting[0].changes_training > 0) and len(fitting) > runners_up:
            break
        if fitting and k0.stage is None and k.stage is not None \
                and c.tokens_per_s < SAME_SPEED * fitting[0].tokens_per_s:
            continue  # offload added to the job, slower than a config that fits: never the answer
        if k0.stage is None and k.stage is not None:
            twin = dataclasses.replace(k, stage=None, offload_optimizer=False, offload_param=False,
                                       pin_memory=k0.pin_memory, lean_buckets=False)
            r0 = predictions.get(twin) or predictions.get(dataclasses.replace(
                twin, micro_batch=1, grad_accum=k.micro_batch * k.grad_accum))
            if r0 is not None and r0.card_peak is not None \
                    and _offload_floor(r0, k) * imported.procs_per_gpu > r0.budget * SCREEN_SLACK:
                screened += 1
                continue
        if k.micro_batch > 1:
            one = dataclasses.replace(k, micro_batch=1, grad_accum=k.micro_batch * k.grad_accum)
            r1 = judge(one, apply_(case0, one))
            if not r1.fits and r1.card_peak is not None:
                failed_at[fam] = 1
            p1 = r1.prediction
            estimate = (p1.device + (k.micro_batch - 1) * p1.terms.get("step_transient_peak", 0)
                        * p1.reserved / max(p1.allocated, 1)) * imported.procs_per_gpu
            if r1.card_peak is None or not r1.fits or estimate > r1.budget * SCREEN_SLACK:
                screened += 1
                continue
        c.result = judge(k, c.case)
        if not c.fits:
            failed_at[fam] = min(failed_at.get(fam, k.micro_batch), k.micro_batch)
            continue
        seen_main.add(c.main())
        fitting.append(c)
    best, others = _choose(fitting)
    if best is None:
        # the walk ended (its time limit) before a candidate of its own was judged to fit; a family's micro-batch
        # 1, predicted as the bound of its larger micro-batches, is a candidate too, and one that fits is an answer
        bounds, mains = [], set()
        for c in candidates:  # in walk order, one of each main knob set, as the walk keeps
            r = predictions.get(c.knobs)
            if r is not None and r.fits and c.main() not in mains:
                mains.add(c.main())
                c.result = r
                bounds.append(c)
        best, others = _choose(bounds)
    closest = None
    by_knobs = {c.knobs: c for c in candidates}
    over = [(k, r) for k, r in predictions.items() if k in by_knobs and not r.fits and r.card_peak is not None]
    if best is None and over:
        k, r = min(over, key=lambda kv: kv[1].card_peak / kv[1].budget)
        closest = by_knobs[k]
        closest.result = r
    return Search(base=base, best=best, runners_up=others, closest=closest, throughput=model,
                  base_tokens_per_s=model.predict(case0, config), considered=len(candidates),
                  predicted=len(predictions), screened_out=screened, seconds=time.perf_counter() - t0,
                  stopped_early=stopped, offload_not_searched=no_offload)


def _offload_floor(twin: CheckResult, k: Knobs) -> float:
    """A floor under the device peak of ZeRO offload (`k`) added to a job whose prediction without DeepSpeed
    is `twin`: its peak less everything offload could take off the card (the optimizer's state and step,
    the gradients, trainable and, under ZeRO-3 with the parameters offloaded, every weight), scaled by the
    twin's reserved over allocated so the allocator's share of them goes too."""
    p = twin.prediction
    terms = p.terms
    movable = sum(terms.get(t, 0) for t in ("adam_states", "grads", "lora_params", "optimizer_step_transient"))
    if k.offload_param:
        movable += terms.get("weights", 0)
    return p.device - movable * max(1.0, p.reserved / max(p.allocated, 1))


def _choose(fitting: list[Candidate]) -> tuple[Candidate | None, list[Candidate]]:
    """The best of the fitting candidates (in walk order) and the runners-up: of those within SAME_SPEED
    of the first (the fastest of its kind), the fewest changes to what is trained, then to anything."""
    if not fitting:
        return None, []
    first = fitting[0]
    same = [c for c in fitting if (c.changes_training > 0) == (first.changes_training > 0)
            and c.tokens_per_s >= SAME_SPEED * first.tokens_per_s]
    best = min(same, key=lambda c: (c.changes_training, c.changed, -c.tokens_per_s))
    return best, [c for c in fitting if c is not best][:RUNNERS_UP]
