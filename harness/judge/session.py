"""One mechanism to run and judge cases, shared by the pytest plugin and the CLI.

A session knows every case, runs each (case, fidelity) at most once (a fix's claim "lower peak
than the failing config" reuses the failing config's run), keeps every report on disk, and judges.
"""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from harness.baselines.store import RESULTS_DIR
from harness.judge.extrapolation import Extrapolation
from harness.judge.host_ram import check_host_ram
from harness.judge.verdicts import (
    NotRun,
    Series,
    Verdict,
    as_recorded,
    check_claims,
    check_outcome,
    judge_on_variant,
    lower_peak_on_variants,
    on_a_short_card,
)
from harness.measure.records import CaseRun, ErrorInfo, Failure
from harness.models.registry import missing_package
from harness.models.source import load_model
from harness.runtime import card_lock, zygote
from harness.runtime import platform as plat
from harness.runtime.launcher import DEFAULT_TIMEOUT_S, run_case
from harness.runtime.stacks import unavailable
from harness.spec.cases import CaseError, load_cases
from harness.spec.files import inside, os_reason, printable, write_atomic
from harness.spec.identity import case_digest, model_name
from harness.spec.schema import Case
from harness.spec.variants import Variant, parse_variant


@dataclass
class Judgement:
    case: Case
    run: CaseRun  # the run the claims were judged on (the deepest, for a depth extrapolation)
    outcome: Verdict
    claims: list[Verdict]
    runs: list[CaseRun] = field(default_factory=list)  # every variant measured
    extrapolation: Extrapolation | None = None
    against_baseline: list[Verdict] = field(default_factory=list)
    host_ram: Verdict | None = None  # the node's host RAM against target.host_ram (full size; harness.judge.host_ram)

    @property
    def verdicts(self) -> list[Verdict]:
        host = [self.host_ram] if self.host_ram is not None else []
        return [self.outcome, *host, *self.claims, *self.against_baseline]

    @property
    def failed(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.failed]


def skip_reason(case: Case, fidelity: str, platform: plat.Platform, accelerators: int) -> str | None:
    """Why a case cannot run at this fidelity here (None: it can)."""
    stack = unavailable(case)
    if stack is not None:
        return stack
    missing = missing_package(load_model(case.model).config)
    if missing is not None:
        return missing
    if fidelity == "tiny":
        return None
    if platform == plat.Platform.cpu:
        return "no GPU: full-size runs need CUDA or ROCm (tiny mode covers this case on CPU)"
    if case.launch.ranks > accelerators and (case.deepspeed is None or accelerators < 2):
        return f"needs {case.launch.ranks} GPUs, this host has {accelerators}"
    return None


def plan(case: Case, fidelity: str, accelerators: int, full_depth: bool = False,
         grad_accum_cap: int | None = None) -> list[Variant]:
    """How a case is measured on this host: as written, or (full size only) on as many ranks as the
    host has, at the case's depth points, with accumulation capped when asked (memory does not grow
    past 2 micro steps; see harness.spec.variants). Several variants mean a depth extrapolation."""
    if fidelity == "tiny":
        return [Variant()]
    ranks = case.launch.ranks if case.launch.ranks <= accelerators else accelerators
    capped = ranks if ranks != case.launch.ranks else None
    accum = grad_accum_cap if grad_accum_cap and case.train.grad_accum > grad_accum_cap else None
    if case.depth_points and not full_depth:
        depths = sorted(case.depth_points)
        if case.expect.outcome == "detected":
            depths = depths[:1]  # a mistake shows at any depth; no figure is extrapolated
        return [Variant(ranks=capped, layers=d, grad_accum=accum) for d in depths]
    return [Variant(ranks=capped, grad_accum=accum)]


def _say(line: str) -> None:
    """A line for the person waiting (past pytest's capture: a wait for a card can be long), made
    printable: it names the card's holder as another process wrote it in the shared lock folder."""
    print(f"[oom-harness] {printable(line)}", file=sys.__stderr__ or sys.stderr, flush=True)


def _keep_record(run: CaseRun, path: Path) -> None:
    """Write a run's record whole (a temporary file, then a rename). A full disk or an unwritable
    folder fails the run with a message that says so; the harness goes on with the next case, and
    the figures stay in this session for its verdicts, summary and --json."""
    try:
        write_atomic(path, run.model_dump_json(indent=1))
    except OSError as exc:  # WriteError: no half record is left
        if run.error is not None and run.error.kind == Failure.write_error:
            return  # the run already says its folder cannot be written
        before = (f" (the run itself: {run.error.kind.value}: {run.error.message.splitlines()[0][:200]})"
                  if run.error else "")
        run.error = ErrorInfo(kind=Failure.write_error,
                              message=f"the run record {path} could not be written: {os_reason(exc)}; free space "
                                      f"there or point the run at another folder{before}")


class _ProcessBudget:
    """At most `capacity` training processes at once; a run takes as many as it starts."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self.used = 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cond:
            # a run larger than the whole budget still runs, alone
            self._cond.wait_for(lambda: self.used == 0 or self.used + n <= self.capacity)
            self.used += n

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()


class _Lookup:
    """What a claim may consult: another case's run, or every run of a family (same fidelity)."""

    def __init__(self, session: Session, fidelity: str):
        self._session, self._fidelity = session, fidelity

    def __call__(self, case_id: str, uncapped: bool = False):
        """The other case as measured here (the same kind of variant as this one) and its run;
        `uncapped`: on the whole card instead of its emulated one. NotRun where the session runs
        only the selected cases and this is not one of them."""
        self._may_run(case_id)
        case = self._session.cases[case_id][0]
        variant = replace(self._session.plan(case_id, self._fidelity)[-1], uncapped=uncapped)
        return variant.apply(case), self._session.run(case_id, self._fidelity, variant)

    def series(self, case_id: str) -> Series:
        """Every variant of the other case as measured here, and its depth fit."""
        self._may_run(case_id)
        return self._session.series(case_id, self._fidelity)

    def _may_run(self, case_id: str) -> None:
        only = self._session.selected_only
        if only is not None and (case_id, self._fidelity) not in only:
            raise NotRun(f"needs a run of {case_id}, which was not selected (--harness-selected-only)")

    def family(self, name: str, uncapped: bool = False):
        ids = sorted(cid for cid, (c, _) in self._session.cases.items() if c.family == name)
        return [self(cid, uncapped) for cid in ids]


@dataclass
class Session:
    case_dir: Path
    run_root: Path
    timeout_s: float = DEFAULT_TIMEOUT_S
    steps: int | None = None
    full_depth: bool = False  # ignore the cases' depth points (a host that holds the full depth)
    grad_accum_cap: int | None = None  # full-size runs accumulate at most this many micro steps
    baseline_root: Path = RESULTS_DIR  # the baselines full-size runs are held to
    # (case id, fidelity) pairs a claim may have run: None runs whatever a claim consults (guide
    # 004's plan A compares with its failing case, which compiles on an empty Triton cache for
    # minutes); a set leaves claims about other cases not checkable instead
    selected_only: set[tuple[str, str]] | None = None
    # seconds to wait for a card another harness is measuring before a full-size run (0: refuse at
    # once; harness.runtime.card_lock)
    wait_for_card_s: float = 0.0
    # where each full-size run appends its line of history (harness.baselines.history) and is searched
    # for change points: None takes HARNESS_HISTORY_DIR, and keeps no history where that is unset
    history_root: Path | None = None
    cases: dict[str, tuple[Case, Path]] = field(default_factory=dict)
    errors: list[CaseError] = field(default_factory=list)
    _runs: dict[tuple[str, str, str, int], Future] = field(default_factory=dict)
    _judged: dict[tuple[str, str], Judgement] = field(default_factory=dict)

    def __post_init__(self):
        self._lock = threading.Lock()
        self._platform: plat.Platform | None = None
        self._accelerators: int | None = None
        loaded, self.errors = load_cases(self.case_dir)
        self.cases = {c.id: (c, self.case_dir / f"{c.id}.yaml") for c in loaded}

    # The host's platform and accelerators, found on first use: finding them imports torch (1.8 s of
    # CPU), which a session that only collects its cases (`pytest --collect-only`) never needs.
    @property
    def platform(self) -> plat.Platform:
        if self._platform is None:
            self._platform = plat.detect()
        return self._platform

    @platform.setter
    def platform(self, value: plat.Platform) -> None:
        self._platform = value

    @property
    def accelerators(self) -> int:
        if self._accelerators is None:
            self._accelerators = plat.accelerator_count()
        return self._accelerators

    @accelerators.setter
    def accelerators(self, value: int) -> None:
        self._accelerators = value

    @cached_property
    def _baselines(self):
        """The baselines full-size runs are held to, read once a session."""
        from harness.baselines.store import load_baselines

        return load_baselines(self.baseline_root)

    @cached_property
    def _depth_checks(self):
        """The full-depth checks among the baselines (for depth series only)."""
        from harness.judge.extrapolation import depth_checks

        return depth_checks(self._baselines, self.case_dir)

    def plan(self, case_id: str, fidelity: str) -> list[Variant]:
        return plan(self.cases[case_id][0], fidelity, self.accelerators, self.full_depth, self.grad_accum_cap)

    def _execute(self, case_id: str, fidelity: str, variant: Variant, repetition: int) -> CaseRun:
        case, path = self.cases[case_id]
        out = inside(self.run_root, fidelity, case_id + variant.suffix, f"rep{repetition}" if repetition else "")
        if fidelity == "real":  # full-size figures are the card's: no other harness may measure it meanwhile
            try:
                card_lock.take(card_lock.card_keys(self.platform.value, self.accelerators), self.wait_for_card_s, _say)
            except card_lock.CardBusy as exc:
                return CaseRun(case_id=case_id, fidelity=fidelity, variant=variant.text, command=[], returncode=None,
                               wall_s=0.0, error=ErrorInfo(kind=Failure.card_busy, message=str(exc)),
                               run_dir=str(out))
        emulate = case.target.card.memory if fidelity == "real" and not variant.uncapped else None
        run = run_case(case, path, fidelity, out, self.platform, self.timeout_s, self.steps, emulate, variant)
        run.case_digest, run.model = case_digest(case), model_name(case)  # what `bless` checks the run against
        _keep_record(run, out / "run.json")
        return run

    def all_runs(self) -> list[CaseRun]:
        """Every run that finished, repetitions included (for JSON reports and blessing)."""
        return [f.result() for f in self._runs.values() if f.done() and f.exception() is None]

    def run(self, case_id: str, fidelity: str, variant: Variant = Variant(), repetition: int = 0) -> CaseRun:
        key = (case_id, fidelity, variant.text, repetition)
        with self._lock:
            if key not in self._runs:
                future: Future = Future()
                future.set_running_or_notify_cancel()
                self._runs[key] = future
                mine = True
            else:
                mine = False
        if mine:
            try:
                future.set_result(self._execute(case_id, fidelity, variant, repetition))
            except BaseException as exc:  # surfaced to every waiter
                future.set_exception(exc)
        return self._runs[key].result()

    def prefetch(self, keys: list[tuple[str, str]], processes: int | None = None) -> None:
        """Start tiny runs in the background, at most `processes` training processes at once
        (default: one per CPU core). Tiny figures are byte counts, which concurrency does not
        change; full-size runs are never run concurrently (they share the GPUs they measure)."""
        budget = _ProcessBudget(processes or os.cpu_count() or 1)
        todo = [k for k in keys if k[1] == "tiny" and k[0] in self.cases and (*k, "", 0) not in self._runs]
        if not todo:
            return
        if self.platform == plat.Platform.cpu and zygote.enabled():
            zygote.warm()  # its imports overlap the first runs (multi-rank ones start torchrun)
        pool = ThreadPoolExecutor(max_workers=budget.capacity, thread_name_prefix="harness-run")

        def task(case_id: str, fidelity: str) -> None:
            from harness.spec.shape import run_shape

            case, _ = self.cases[case_id]
            weight = run_shape(case, fidelity, self.steps).ranks * case.launch.procs_per_card
            budget.acquire(weight)
            try:
                self.run(case_id, fidelity)
            except BaseException:  # the waiting test reports it
                pass
            finally:
                budget.release(weight)

        for key in todo:
            pool.submit(task, *key)
        pool.shutdown(wait=False)

    def judge(self, case_id: str, fidelity: str) -> Judgement:
        key = (case_id, fidelity)
        if key not in self._judged:
            self._judged[key] = self._judge(case_id, fidelity)
        return self._judged[key]

    def _judge(self, case_id: str, fidelity: str) -> Judgement:
        from harness.baselines.store import PlatformInfo, figures_of
        from harness.judge.regression import against_baseline, find_baseline, no_baseline

        case, _ = self.cases[case_id]
        series = self.series(case_id, fidelity)
        variants, runs, extrapolation = series.variants, series.runs, series.extrapolation
        measured_case, run = variants[-1].apply(case), runs[-1]
        lookup = _Lookup(self, fidelity)
        if len(variants) > 1:
            # the first run that failed (if any) decides the outcome of a depth series
            run = next((r for r in runs if not r.ok), run)
        outcome = judge_on_variant(case, variants[-1], check_outcome(measured_case, run), run, extrapolation)
        outcome = on_a_short_card(outcome, run)
        outcome = as_recorded(outcome, case.expect.finding, fidelity)
        host_ram = check_host_ram(case, variants[-1], run, extrapolation)
        claims = check_claims(measured_case, run, lookup)
        for c in case.claims:
            if c in measured_case.claims:
                continue
            if c.kind == "lower_peak_than":  # two configs measured alike compare (harness.judge.verdicts)
                try:
                    claims.append(lower_peak_on_variants(c, case, series, self.cases[c.case][0], lookup.series(c.case)))
                except NotRun as exc:
                    claims.append(Verdict(c.kind, "not_checkable", str(exc), c.quote))
                continue
            claims.append(Verdict(c.kind, "not_checkable",
                                  f"stated for the case as written; measured {variants[-1].label(case)}", c.quote))
        regression: list[Verdict] = []
        if fidelity == "real":
            # every measured variant against its own baseline: a depth series regresses at one depth
            for variant, measured in zip(variants, runs, strict=True):
                if not measured.ranks:
                    continue
                key = PlatformInfo.of_run(measured).key
                runtime = "framework" if any(r.stack for r in measured.ranks) else "harness"
                found = find_baseline(case_id, variant.text, key, self._baselines, runtime)
                why = "" if found else no_baseline(case_id, variant.text, key, self._baselines)
                if not found and find_baseline(case_id, variant.text, key, self._baselines):
                    why = (f"no baseline of this case measured through {case.stack.value} itself on {key}: its "
                           "baseline was measured through the harness's own loop; `oom-harness bless` this run")
                verdicts = against_baseline(case, figures_of(measured, case.launch.procs_per_card), found, why,
                                            self._baselines)
                regression += [replace(v, detail=f"{variant.label(case)}: {v.detail}") if len(variants) > 1 else v
                               for v in verdicts]
            regression += self._history(case, [r for r in runs if r.ranks])
        return Judgement(measured_case, run, outcome, claims, runs, extrapolation, regression, host_ram)

    def _history(self, case: Case, runs: list[CaseRun]) -> list[Verdict]:
        """Append the runs to this runner's history and search the case's series for change points
        (harness.judge.changepoints): a new one that makes a metric worse fails the case."""
        from harness.baselines import history
        from harness.judge.changepoints import new_shifts

        root = self.history_root or history.history_dir()
        if root is None or not runs:
            return []
        path = history.history_file(root, history.runner_name())
        entries = [history.entry_of(r, case.launch.procs_per_card) for r in runs]
        try:
            history.append(path, entries)
        except OSError as exc:
            return [Verdict("change_point", "not_checkable", f"the history {path} could not be written: "
                                                              f"{os_reason(exc)}")]
        mine = {e.series for e in entries}
        every = [e for e in history.read(path) if e.series in mine]
        found = new_shifts(every, {e.run for e in entries})
        out = [Verdict("change_point", "refuted" if s.worse else "confirmed", s.text() + f" ({path})")
               for s in found]
        if not out:
            nights = max(sum(1 for e in every if e.series == k and e.outcome == "ok") for k in mine)
            out.append(Verdict("change_point", "confirmed", f"no new change point over {nights} night(s) of {path}"))
        return out

    def series(self, case_id: str, fidelity: str) -> Series:
        """The runs of every variant the case is measured on here, and their depth fit (two depths or
        more that finished)."""
        from harness.baselines.store import PlatformInfo, figures_of
        from harness.judge.extrapolation import depth_check, extrapolate_figures

        case, _ = self.cases[case_id]
        variants = self.plan(case_id, fidelity)
        runs = [self.run(case_id, fidelity, v) for v in variants]
        extrapolation = None
        if len(variants) > 1:
            figures = {v.layers: [figures_of(r, case.launch.procs_per_card)]
                       for v, r in zip(variants, runs, strict=True)}
            ok = {L: f for L, f in figures.items() if f[0].outcome == "ok"}
            if len(ok) >= 2:
                platform_key = PlatformInfo.of_run(runs[-1]).key if runs[-1].ranks else ""
                extrapolation = extrapolate_figures(case, Variant(ranks=variants[-1].ranks).text, platform_key, ok)
                extrapolation.check = depth_check(case.model, self._depth_checks)
        return Series(variants, runs, extrapolation)

    def judged(self) -> list[Judgement]:
        return list(self._judged.values())

    def consulted(self) -> list[tuple[str, str, str]]:
        """(case id, fidelity, variant) of the runs made only because a claim consulted them: cases
        that were not judged themselves."""
        judged = set(self._judged)
        return sorted({(cid, fid, variant) for cid, fid, variant, _ in self._runs if (cid, fid) not in judged})

    def whole_card(self) -> list[tuple[str, str, str]]:
        """(case id, fidelity, variant) of the judged cases' own whole-card runs: made because a
        claim compares the config with others and the config runs out of memory on its own card
        (guide 001's rungs: 1-3 minutes each on an H100). Selecting fewer cases does not avoid them."""
        judged = set(self._judged)
        return sorted({(cid, fid, variant) for cid, fid, variant, _ in self._runs
                       if (cid, fid) in judged and parse_variant(variant).uncapped})
