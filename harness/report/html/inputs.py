"""What the HTML report is drawn from: the committed baselines, the runs given (each read as the
baseline `bless` would make of it), their cases, the predictor's figure for each, and the recorded
memory timelines. Read once; every section draws from it."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from harness.baselines.store import Baseline, Figures
from harness.spec.schema import Case

TIMELINE_NAMES = ("*.json.gz",)  # results/timelines/<platform>/<case>[@variant].json.gz
RUN_TIMELINE = "rank0-memory.json.gz"  # in a run's folder (`run --memory-history`)


@dataclass
class Entry:
    """One measured config: a baseline, or a run given on the command line read as one."""

    baseline: Baseline
    case: Case
    source: str  # 'baseline' or the run file it came from
    predicted: object | None = None  # harness.predict.predictor.Prediction, per process
    problem: str | None = None  # why there is no prediction

    @property
    def name(self) -> str:
        b = self.baseline
        return b.case_id + (f"@{b.variant}" if b.variant else "")

    @property
    def is_run(self) -> bool:
        return self.source != "baseline"

    def figures(self) -> list[Figures]:
        """The finished repetitions, or every repetition where none finished (an OOM stops at the cap)."""
        return [f for f in self.baseline.runs if f.outcome == "ok"] or self.baseline.runs

    def median(self, attr: str) -> float | None:
        values = [getattr(f, attr) for f in self.figures() if getattr(f, attr) is not None]
        return statistics.median(values) if values else None

    @property
    def outcome(self) -> str:
        return "ok" if any(f.outcome == "ok" for f in self.baseline.runs) else self.baseline.runs[0].outcome

    @property
    def predicted_per_card(self) -> float | None:
        p = self.predicted
        return None if p is None else p.device * self.measured_case.launch.procs_per_card

    @property
    def measured_case(self) -> Case:
        """The case as the baseline ran it (variant and Triton cache)."""
        return self.baseline.case_as_measured(self.case)


@dataclass(frozen=True)
class SuiteRecord:
    """A blessed run of another measured suite than the one reported (the architecture benchmark, fit's
    verified configs), as the predictor's error table holds it: predicted leave-one-out and measured."""

    suite: str  # harness.spec.suite.SUITES
    record: object  # harness.predict.margin.ErrorRecord

    @property
    def name(self) -> str:
        r = self.record
        return r.case_id + (f"@{r.variant}" if r.variant else "")


@dataclass
class ReportInputs:
    entries: list[Entry]
    cases: dict[str, Case]
    timelines: list[tuple[Path, object]]  # (file, harness.measure.timeline.MemoryTimeline)
    verdicts: list[tuple[str, object]] = field(default_factory=list)  # (case@variant, Verdict) of the runs
    skipped: list[str] = field(default_factory=list)  # inputs left out, each with why
    run_paths: list[Path] = field(default_factory=list)
    case_dir: Path | None = None
    other_suites: list[SuiteRecord] = field(default_factory=list)

    @property
    def baselines(self) -> list[Baseline]:
        return [e.baseline for e in self.entries if not e.is_run]

    def of_platform(self) -> dict[str, list[Entry]]:
        out: dict[str, list[Entry]] = {}
        for e in self.entries:
            out.setdefault(e.baseline.platform.key, []).append(e)
        return out


@lru_cache(maxsize=512)
def _predicted(case_json: str, platform: str, exclude: str):
    """The predictor's figures for one measured config (a case with its variant applied), its
    platform's calibration without the case itself (as benchmarks/bench_predictor.py does). Kept
    in-process; the predictor keeps its traces on disk (harness.predict.trace.trace), so a second report
    on one machine traces nothing."""
    from harness.predict.predictor import predict

    return predict(Case.model_validate_json(case_json), platform=platform, exclude={exclude})


@dataclass(frozen=True)
class StoredPrediction:
    """A prediction read from the predictor's error table instead of made again: its device figure."""

    device: float  # per process, as harness.predict.predictor.Prediction.device


def stored_predictions(baselines_dir: Path, case_dir: Path) -> dict[tuple[str, str, str], int]:
    """The bundled suite's predictions as the predictor's error table holds them, by (case, variant,
    platform): per card, leave-one-out, exactly what `predict_entry` computes for those baselines.
    Taken only where the table is current (its digest covers the bundled baselines, cases and the
    predictor's code) and the report is of the bundled suite; else none. Predicting the suite's 56
    configs with an empty trace cache was most of the two minutes a first `report --html` took."""
    from harness.baselines.store import RESULTS_DIR
    from harness.predict.margin import ERRORS_FILE, _table
    from harness.spec.suite import CASES_DIR

    if Path(baselines_dir).resolve() != RESULTS_DIR.resolve() or Path(case_dir).resolve() != CASES_DIR.resolve():
        return {}
    table, stale = _table(str(ERRORS_FILE))
    if table is None or stale:
        return {}
    return {(r.case_id, r.variant, r.platform): r.predicted for r in table.records}


def predict_entry(entry: Entry, stored: dict[tuple[str, str, str], int] | None = None) -> None:
    """Fill `entry.predicted` (or `entry.problem`) with the prediction of the config as it was measured:
    its variant applied, and the Triton cache the run had rather than the case's request. A prediction
    `stored` for its baseline (`stored_predictions`) is taken as it is."""
    case = entry.measured_case
    per_card = (stored or {}).get((entry.case.id, entry.baseline.variant, entry.baseline.platform.key))
    if per_card is not None:
        entry.predicted = StoredPrediction(device=per_card / case.launch.procs_per_card)
        return
    try:
        entry.predicted = _predicted(case.model_dump_json(), entry.baseline.platform.key, entry.case.id)
    except (ValueError, KeyError, NotImplementedError, RuntimeError) as exc:
        # a config the predictor cannot model yet still gets its measurement drawn
        entry.problem = f"{type(exc).__name__}: {exc}".splitlines()[0][:120]


def read_inputs(baselines_dir: Path, case_dir: Path, run_paths: list[Path], timeline_dirs: list[Path],
                predict: bool = True) -> ReportInputs:
    """Everything the report draws. A run file that cannot be read is bad input (BlessError, exit 2);
    a baseline of a case no longer in `case_dir`, or a timeline that cannot be read, is left out and
    named on the page."""
    from harness.baselines.store import baselines_of, load_baselines, sourced_runs
    from harness.models.inputs import InputError
    from harness.spec.cases import CaseError, load_case

    skipped: list[str] = []
    cases: dict[str, Case] = {}

    def case_of(case_id: str) -> Case | None:
        if case_id not in cases:
            path = Path(case_dir) / f"{case_id}.yaml"
            try:
                cases[case_id] = load_case(path)
            except (CaseError, OSError, ValueError) as exc:
                skipped.append(f"{case_id}: no readable case file {path} ({str(exc).splitlines()[0][:120]})")
                return None
        return cases[case_id]

    entries = []
    for b in load_baselines(Path(baselines_dir)):
        case = case_of(b.case_id)
        if case is not None:
            entries.append(Entry(b, case, "baseline"))
    run_paths = [Path(p) for p in run_paths]
    if run_paths:
        sourced = sourced_runs(run_paths)
        made = baselines_of(sourced, replace=True, case_dirs=[Path(case_dir)])
        where = {(run.case_id, run.variant): src.split(" entry ")[0] for src, run in sourced}
        for b in made.values():
            # a run record carries no date: `baselines_of` would date it today, the day of the report
            b = b.model_copy(update={"recorded": "", "runs": [f.model_copy(update={"recorded": None})
                                                               for f in b.runs]})
            case = case_of(b.case_id)
            if case is not None:
                entries.append(Entry(b, case, where.get((b.case_id, b.variant), "run")))
    if predict:
        stored = stored_predictions(baselines_dir, case_dir)
        for e in entries:
            predict_entry(e, stored)
    from harness.measure.timeline import MemoryTimeline

    timelines = []
    files = [p for d in timeline_dirs if Path(d).is_dir() for p in sorted(Path(d).rglob("*.json.gz"))]
    files += [p for d in run_paths if d.is_dir() for p in sorted(d.rglob(RUN_TIMELINE))]
    for path in files:
        try:
            timelines.append((path, MemoryTimeline.load(path)))
        except (InputError, OSError, ValueError) as exc:
            skipped.append(f"{path}: not a memory timeline ({str(exc).splitlines()[0][:120]})")
    return ReportInputs(entries, cases, timelines, verdicts_of(run_paths), skipped, run_paths, Path(case_dir),
                        other_suites_of(Path(baselines_dir)) if predict else [])


def other_suites_of(baselines_dir: Path) -> list[SuiteRecord]:
    """Where the bundled suite is reported: the other suites the predictor's errors are measured on, from
    its error table (already predicted, each case left out), matched to their baselines. Elsewhere (a
    team's own suite) none: those suites are the bundled suite's evidence, not the team's."""
    from harness.baselines.store import RESULTS_DIR, load_baselines
    from harness.predict.margin import ERRORS_FILE, ErrorTable
    from harness.spec.suite import SUITES

    if Path(baselines_dir).resolve() != RESULTS_DIR.resolve() or not ERRORS_FILE.is_file():
        return []
    try:
        records = ErrorTable.read(ERRORS_FILE).records
    except (OSError, ValueError, KeyError, TypeError):  # the margins say so; the report draws without it
        return []
    out = []
    for suite, (suite_baselines, _) in SUITES.items():
        if Path(suite_baselines).resolve() == RESULTS_DIR.resolve() or not Path(suite_baselines).is_dir():
            continue
        keys = {(b.case_id, b.variant, b.platform.key) for b in load_baselines(Path(suite_baselines))}
        out += [SuiteRecord(suite, r) for r in records if (r.case_id, r.variant, r.platform) in keys]
    return out


def verdicts_of(paths: list[Path]) -> list[tuple[str, object]]:
    """Every verdict kept in `run --json` files, with its case and variant (run folders hold none).
    A record `run --json` does not write is bad input (BlessError)."""
    import json

    from harness.baselines.store import BlessError
    from harness.judge.verdicts import Verdict

    out = []
    for path in paths:
        data = json.loads(path.read_text()) if path.is_file() else []
        for i, e in enumerate(data if isinstance(data, list) else []):
            try:
                name = e["case"] + (f"@{e['variant']}" if e.get("variant") else "")
                out += [(name, Verdict(**v)) for v in e.get("verdicts", [])]
            except (KeyError, TypeError, AttributeError) as exc:
                raise BlessError(f"{path}: entry {i} has a verdict record `oom-harness run --json` does not write "
                                 f"({type(exc).__name__}: {exc}); restore the file as the run wrote it") from None
    return out
