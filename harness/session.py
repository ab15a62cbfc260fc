"""One mechanism to run and judge cases, shared by the pytest plugin and the CLI.

A session knows every case, runs each (case, fidelity) at most once (a fix's claim "lower peak
than the failing config" reuses the failing config's run), keeps every report on disk, and judges.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from harness import platform as plat
from harness.cases import CaseError, load_cases
from harness.launcher import DEFAULT_TIMEOUT_S, run_case
from harness.report import CaseRun
from harness.schema import Case
from harness.verdicts import Verdict, check_claims, check_outcome


@dataclass
class Judgement:
    case: Case
    run: CaseRun
    outcome: Verdict
    claims: list[Verdict]

    @property
    def verdicts(self) -> list[Verdict]:
        return [self.outcome, *self.claims]

    @property
    def failed(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.failed]


def skip_reason(case: Case, fidelity: str, platform: plat.Platform, accelerators: int) -> str | None:
    """Why a case cannot run at this fidelity here (None: it can)."""
    if fidelity == "tiny":
        return None
    if platform == plat.Platform.cpu:
        return "no GPU: full-size runs need CUDA or ROCm (tiny mode covers this case on CPU)"
    if case.launch.ranks > accelerators:
        return f"needs {case.launch.ranks} GPUs, this host has {accelerators}"
    return None


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

    def __init__(self, session: "Session", fidelity: str):
        self._session, self._fidelity = session, fidelity

    def __call__(self, case_id: str):
        return self._session.cases[case_id][0], self._session.run(case_id, self._fidelity)

    def family(self, name: str):
        ids = sorted(cid for cid, (c, _) in self._session.cases.items() if c.family == name)
        return [self(cid) for cid in ids]


@dataclass
class Session:
    case_dir: Path
    run_root: Path
    timeout_s: float = DEFAULT_TIMEOUT_S
    steps: int | None = None
    cases: dict[str, tuple[Case, Path]] = field(default_factory=dict)
    errors: list[CaseError] = field(default_factory=list)
    _runs: dict[tuple[str, str], Future] = field(default_factory=dict)
    _judged: dict[tuple[str, str], Judgement] = field(default_factory=dict)

    def __post_init__(self):
        self._lock = threading.Lock()
        self.platform = plat.detect()
        self.accelerators = plat.accelerator_count()
        loaded, self.errors = load_cases(self.case_dir)
        self.cases = {c.id: (c, self.case_dir / f"{c.id}.yaml") for c in loaded}

    def _execute(self, case_id: str, fidelity: str) -> CaseRun:
        case, path = self.cases[case_id]
        out = self.run_root / fidelity / case_id
        emulate = case.target.card.memory if fidelity == "real" else None
        run = run_case(case, path, fidelity, out, self.platform, self.timeout_s, self.steps, emulate)
        (out / "run.json").write_text(run.model_dump_json(indent=1))
        return run

    def run(self, case_id: str, fidelity: str) -> CaseRun:
        key = (case_id, fidelity)
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
                future.set_result(self._execute(case_id, fidelity))
            except BaseException as exc:  # surfaced to every waiter
                future.set_exception(exc)
        return self._runs[key].result()

    def prefetch(self, keys: list[tuple[str, str]], processes: int | None = None) -> None:
        """Start tiny runs in the background, at most `processes` training processes at once
        (default: one per CPU core). Tiny figures are byte counts, which concurrency does not
        change; full-size runs are never run concurrently (they share the GPUs they measure)."""
        budget = _ProcessBudget(processes or os.cpu_count() or 1)
        todo = [k for k in keys if k[1] == "tiny" and k[0] in self.cases and k not in self._runs]
        if not todo:
            return
        pool = ThreadPoolExecutor(max_workers=budget.capacity, thread_name_prefix="harness-run")

        def task(case_id: str, fidelity: str) -> None:
            from harness.shape import run_shape

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
            case, _ = self.cases[case_id]
            run = self.run(case_id, fidelity)

            lookup = _Lookup(self, fidelity)
            self._judged[key] = Judgement(case, run, check_outcome(case, run), check_claims(case, run, lookup))
        return self._judged[key]

    def judged(self) -> list[Judgement]:
        return list(self._judged.values())
