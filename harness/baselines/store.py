"""Baselines: measured figures of full-size runs, kept as data per platform, with provenance.

`oom-harness bless RUNS.json` turns the JSON of `oom-harness run --fidelity real --json` into one
file per case under results/baselines/<platform>/. A platform is the card, how many, and the
software that measured (driver, torch and CUDA/ROCm, transformers, peft, DeepSpeed, bitsandbytes).
Nothing measured is ever pasted into code: comparisons read these files.
"""

from __future__ import annotations

import datetime as dt
import re
import statistics
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from harness.measure.records import CaseRun, Clocks
from harness.models.inputs import load_json

RESULTS_DIR = Path(__file__).resolve().parents[2] / "results" / "baselines"


class PlatformInfo(BaseModel):
    device_name: str
    device_count: int
    driver: str | None = None
    versions: dict[str, str] = Field(default_factory=dict)

    @classmethod
    def of_run(cls, run: CaseRun, driver: str | None = None) -> PlatformInfo:
        """The platform a run measured on: its card, how many ranks it used, its software."""
        first = run.ranks[0]
        return cls(device_name=first.device_name, device_count=max(r.world_size for r in run.ranks),
                   driver=driver or first.versions.get("driver"), versions=first.versions)

    @property
    def key(self) -> str:
        name = re.sub(r"[^a-z0-9]+", "-", self.device_name.lower()).strip("-")
        return f"{name}-x{self.device_count}"


class Figures(BaseModel):
    """Bytes and rates of one run. The per-card peak is the device's own figure where known; it and
    the card's tokens/s and MFU are the worst rank's of a sharded job and the sum of the jobs
    sharing a card (`CaseRun.per_card_peak`, `CaseRun.per_card_rate`)."""

    per_card_peak: int | None
    allocated_peak: int | None
    reserved_peak: int | None
    load_footprint: int | None
    host_peak: int | None = None  # host RSS of the worst rank (with its dataloader workers)
    tokens_per_s_per_gpu: float | None
    mfu: float | None
    step_times_s: list[float]
    outcome: str  # ok, or the failure kind (oom, crash, timeout)
    failure: str | None = None
    triton_cache: str | None = None  # 'cold' or 'warm' for runs that compiled Triton kernels (runtime.compile_cache)
    cpu_threads: int | None = None  # OMP threads per process (runtime.launcher.cpu_threads); speed depends on it
    clocks: Clocks | None = None  # the slowest card's SM clock during the timed steps (harness.measure.clocks)
    host_cpu: str | None = None  # the host CPU's model name; speed depends on it
    recorded: str | None = None  # the day of this repetition, where it differs from the baseline's (bless --append)


class Baseline(BaseModel):
    case_id: str
    variant: str = ""  # '' as the case is written; '2r', '8L', '2r8L' (harness.spec.variants)
    platform: PlatformInfo
    emulated_card_bytes: int | None
    measured: str  # how: "full depth", "2 of 8 ranks, 8 of 64 layers" (harness.spec.variants.Variant.label)
    steps: int
    runs: list[Figures]  # one per repetition
    recorded: str
    note: str = ""

    def values(self, attr: str) -> list[float]:
        """One figure over the repetitions that have it."""
        return [getattr(r, attr) for r in self.runs if getattr(r, attr) is not None]


# The run-to-run noise of a peak: two runs of one config differ by less than this share.
MEMORY_FLOOR = 0.02


def spread(values: list[float]) -> tuple[float, float]:
    """(median, largest relative deviation from it) of repeated measurements of one figure."""
    mid = statistics.median(values)
    return mid, (max(abs(v - mid) for v in values) / mid if mid else 0.0)


def figures_of(run: CaseRun, procs_per_card: int) -> Figures:
    ranks = run.ranks
    err = run.first_error()
    steps = [r for r in ranks if r.step is not None]
    return Figures(
        per_card_peak=run.per_card_peak(procs_per_card),
        allocated_peak=max((r.step.allocated for r in steps), default=None),
        reserved_peak=max((r.step.reserved or 0 for r in steps), default=None) or None,
        load_footprint=max((r.load.limiting() for r in ranks if r.load), default=None),
        host_peak=run.host_peak(),
        tokens_per_s_per_gpu=run.per_card_rate(procs_per_card),
        mfu=run.per_card_rate(procs_per_card, "mfu"),
        step_times_s=ranks[0].step_times_s if ranks else [],
        outcome="ok" if err is None else err.kind.value,
        failure=None if err is None else err.message.strip().splitlines()[-1][:400] if err.message else None,
        triton_cache=next((c for c in ("cold", "warm") if any(r.triton_cache == c for r in ranks)), None),
        cpu_threads=max((r.cpu_threads for r in ranks if r.cpu_threads), default=None),
        clocks=min((r.clocks for r in ranks if r.clocks), key=lambda c: c.sm_mhz_median, default=None),
        host_cpu=next((r.host_cpu for r in ranks if r.host_cpu), None),
    )


class BlessError(ValueError):
    """A runs file that cannot be blessed, or runs that would mix software stacks in one baseline."""


def read_runs(paths: list[Path]) -> list[CaseRun]:
    """The runs in `oom-harness run --json` files, in `run.json` files (one run each), and in every
    `run.json` below a folder (`pytest --harness-run-dir`, `oom-harness run --out`), in that order."""
    runs = []
    for path in map(Path, paths):
        files = sorted(path.rglob("run.json")) if path.is_dir() else [path]
        if path.is_dir() and not files:
            raise BlessError(f"{path}: no run.json below this folder; name a run folder or a `run --json` file")
        for f in files:
            try:
                data = load_json(f)  # within the input limits; an InputError is bad input (exit 2)
            except (OSError, ValueError) as exc:
                raise BlessError(f"{f}: cannot be read as JSON ({exc})") from exc
            entries = data if isinstance(data, list) else [{"run": data}]
            for i, entry in enumerate(entries):
                try:
                    runs.append(CaseRun.model_validate(entry["run"]))
                except (KeyError, TypeError, ValidationError) as exc:
                    where = f"entry {i}" if isinstance(data, list) else "its content"
                    raise BlessError(f"{f}: {where} is not a run of `oom-harness run --json` or a run.json "
                                     f"({str(exc).splitlines()[0]})") from exc
    return runs


def _case_file(case_id: str, case_dirs: list[Path]) -> Path:
    """The file of a run's case: in the first of `case_dirs` that holds it (ids are file names)."""
    for folder in case_dirs:
        path = Path(folder) / f"{case_id}.yaml"
        if path.is_file():
            return path
    raise BlessError(f"case '{case_id}': no {case_id}.yaml in {', '.join(str(d) for d in case_dirs)}; "
                     "pass the folder of its case file with --case-dir")


def bless(runs_json: Path | list[Path], driver: str | None = None, root: Path = RESULTS_DIR, note: str = "",
          recorded: str | None = None, append: bool = False, case_dirs: list[Path] | None = None) -> list[Path]:
    """Write or refresh the baselines of every full-size run in `runs_json` (see `read_runs`).
    Repeated runs of a case in them become repetitions of one baseline. With `append`, they are
    added to the repetitions a baseline already has (runs of another day or another host of the same
    platform), so the spread the tolerances derive from covers them all. Each run's case is read
    from the first of `case_dirs` holding it, then from the bundled suite."""
    from harness.spec.cases import CASES_DIR, CaseError, load_case
    from harness.spec.variants import parse_variant

    folders = [*(case_dirs or []), CASES_DIR]

    day = recorded or dt.date.today().isoformat()
    by_case: dict[tuple[str, str], list[CaseRun]] = {}
    for run in read_runs([runs_json] if isinstance(runs_json, (str, Path)) else runs_json):
        if run.fidelity != "real" or not run.ranks:
            continue
        by_case.setdefault((run.case_id, run.variant), []).append(run)
    baselines: dict[Path, Baseline] = {}
    for (case_id, variant), runs in by_case.items():
        try:
            case = load_case(_case_file(case_id, folders))
        except CaseError as exc:
            raise BlessError(str(exc)) from None
        first = runs[0].ranks[0]
        platform = PlatformInfo.of_run(runs[0], driver)
        v = parse_variant(variant)
        figures = [figures_of(r, case.launch.procs_per_card) for r in runs]
        path = root / platform.key / f"{case_id}{v.suffix}.json"
        if append and path.exists():
            baselines[path] = _appended(Baseline.model_validate_json(path.read_text()),
                                        platform, figures, day, note, path)
            continue
        baselines[path] = Baseline(
            case_id=case_id, variant=variant, platform=platform, emulated_card_bytes=first.emulated_card_bytes,
            measured=v.label(case), steps=len(first.step_times_s) or 0, runs=figures, recorded=day, note=note,
        )
    for path, baseline in baselines.items():  # written only once every run was accepted
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(baseline.model_dump_json(indent=1) + "\n")
    return list(baselines)


def _appended(old: Baseline, platform: PlatformInfo, figures: list[Figures], day: str, note: str,
              path: Path) -> Baseline:
    """`old` with `figures` as further repetitions, each dated; refused across software stacks. A
    version the baseline did not record (runs before the worker recorded it) is not a difference:
    it is taken from these runs, and the note says so."""
    before = {**old.platform.versions, "driver": old.platform.driver}
    after = {**platform.versions, "driver": platform.driver}
    differ = sorted(k for k in before.keys() | after.keys()
                    if before.get(k) is not None and before.get(k) != after.get(k))
    if differ:
        pairs = ", ".join(f"{k} {before.get(k)} -> {after.get(k)}" for k in differ)
        raise BlessError(f"{path}: these runs differ from the baseline's software ({pairs}); a spread across "
                         f"stacks is not noise. Bless without --append to replace the baseline.")
    unrecorded = sorted(k for k in after if before.get(k) is None and after[k] is not None)
    if unrecorded:
        first = ", ".join(f"{k} {after[k]}" for k in unrecorded)
        note = f"{note + '; ' if note else ''}first recorded with these runs: {first}"
        old = old.model_copy(update={"platform": old.platform.model_copy(update={
            "driver": old.platform.driver or platform.driver,
            "versions": {**platform.versions, **old.platform.versions}})})
    for f in old.runs:
        f.recorded = f.recorded or old.recorded
    for f in figures:
        f.recorded = day
    added = f"{day}: {note}" if note else f"{day}: {len(figures)} more repetition(s)"
    return old.model_copy(update={"runs": [*old.runs, *figures], "recorded": day,
                                  "note": f"{old.note}\n{added}" if old.note else added})


def load_baselines(root: Path = RESULTS_DIR) -> list[Baseline]:
    return [Baseline.model_validate_json(p.read_text()) for p in sorted(root.glob("*/*.json"))]
