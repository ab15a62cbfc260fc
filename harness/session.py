"""One mechanism to run and judge cases, shared by the pytest plugin and the CLI.

A session knows every case, runs each (case, fidelity) at most once (a fix's claim "lower peak
than the failing config" reuses the failing config's run), keeps every report on disk, and judges.
"""

from __future__ import annotations

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


@dataclass
class Session:
    case_dir: Path
    run_root: Path
    timeout_s: float = DEFAULT_TIMEOUT_S
    steps: int | None = None
    cases: dict[str, tuple[Case, Path]] = field(default_factory=dict)
    errors: list[CaseError] = field(default_factory=list)
    _runs: dict[tuple[str, str], CaseRun] = field(default_factory=dict)
    _judged: dict[tuple[str, str], Judgement] = field(default_factory=dict)

    def __post_init__(self):
        self.platform = plat.detect()
        self.accelerators = plat.accelerator_count()
        loaded, self.errors = load_cases(self.case_dir)
        self.cases = {c.id: (c, self.case_dir / f"{c.id}.yaml") for c in loaded}

    def run(self, case_id: str, fidelity: str) -> CaseRun:
        key = (case_id, fidelity)
        if key not in self._runs:
            case, path = self.cases[case_id]
            out = self.run_root / fidelity / case_id
            emulate = None
            if fidelity == "real" and case.launch.procs_per_card == 1:
                emulate = case.target.card.memory  # cap the process at the target card's size
            self._runs[key] = run_case(case, path, fidelity, out, self.platform, self.timeout_s, self.steps, emulate)
            (out / "run.json").write_text(self._runs[key].model_dump_json(indent=1))
        return self._runs[key]

    def judge(self, case_id: str, fidelity: str) -> Judgement:
        key = (case_id, fidelity)
        if key not in self._judged:
            case, _ = self.cases[case_id]
            run = self.run(case_id, fidelity)

            def lookup(other_id: str):
                return self.cases[other_id][0], self.run(other_id, fidelity)

            self._judged[key] = Judgement(case, run, check_outcome(case, run), check_claims(case, run, lookup))
        return self._judged[key]

    def judged(self) -> list[Judgement]:
        return list(self._judged.values())
