"""Baselines: measured figures of full-size runs, kept as data per platform, with provenance.

`oom-harness bless RUNS.json` turns the JSON of `oom-harness run --fidelity real --json` into one
file per case under results/baselines/<platform>/. A platform is the card, how many, and the
software that measured (driver, torch and CUDA/ROCm, transformers, peft, DeepSpeed, bitsandbytes).
Nothing measured is ever pasted into code: comparisons read these files.
"""

from __future__ import annotations

import datetime as dt
import math
import statistics
import sys
from pathlib import Path

from pydantic import BaseModel, Field, NonNegativeInt, ValidationError, field_validator

from harness.measure.device_parts import platform_key
from harness.measure.records import CaseRun, Clocks
from harness.models.inputs import InputError, load_json
from harness.spec.files import (
    FileName,
    FileNameOrEmpty,
    OutsideFolderError,
    control_character,
    inside,
    printable,
    write_atomic,
)
from harness.spec.suite import BASELINES_DIR

RESULTS_DIR = BASELINES_DIR  # the bundled suite's baselines (harness.spec.suite)


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
        return platform_key(self.device_name, self.device_count)


class Figures(BaseModel):
    """Bytes and rates of one run. The per-card peak is the device's own figure where known; it and
    the card's tokens/s and MFU are the worst rank's of a sharded job and the sum of the jobs
    sharing a card (`CaseRun.per_card_peak`, `CaseRun.per_card_rate`)."""

    per_card_peak: NonNegativeInt | None
    allocated_peak: NonNegativeInt | None
    reserved_peak: NonNegativeInt | None
    load_footprint: NonNegativeInt | None
    host_peak: NonNegativeInt | None = None  # host RSS of the worst rank (with its dataloader workers)
    tokens_per_s_per_gpu: float | None = Field(gt=0, allow_inf_nan=False)
    mfu: float | None = Field(ge=0, allow_inf_nan=False)
    step_times_s: list[float]
    # the device's time of each step (CUDA events; harness.runtime.train), the first rank's; empty where not recorded
    step_device_s: list[float] = Field(default_factory=list)
    outcome: str  # ok, or the failure kind (oom, crash, timeout)
    failure: str | None = None
    triton_cache: str | None = None  # 'cold' or 'warm' for runs that compiled Triton kernels (runtime.compile_cache)
    cpu_threads: int | None = None  # OMP threads per process (runtime.launcher.cpu_threads); speed depends on it
    clocks: Clocks | None = None  # the slowest card's SM clock during the timed steps (harness.measure.clocks)
    host_cpu: str | None = None  # the host CPU's model name; speed depends on it
    recorded: str | None = None  # the day of this repetition, where it differs from the baseline's (bless --append)
    # the attention kernel every rank recorded (harness.measure.records.RankReport.attn_implementation);
    # None where the ranks did not record one, or disagree
    attn_implementation: str | None = None
    # the framework that trained (harness.runtime.stacks: 'llamafactory 0.9.5'); None: the harness's own loop
    stack: str | None = None

    @field_validator("step_times_s")
    @classmethod
    def _durations(cls, value):
        bad = [t for t in value if not math.isfinite(t) or t <= 0]
        if bad:
            raise ValueError(f"step_times_s: {bad[0]!r} is not a duration; step times are seconds above 0")
        return value


class Baseline(BaseModel):
    case_id: FileName
    variant: FileNameOrEmpty = ""  # '' as the case is written; '2r', '8L', '2r8L' (harness.spec.variants)
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

    @property
    def runtime(self) -> str:
        """What trained the baseline's runs: 'framework' (a framework's own trainer) or 'harness' (its loop)."""
        return "framework" if any(r.stack for r in self.runs) else "harness"

    def case_as_measured(self, case):
        """`case` (harness.spec.schema.Case) as this baseline ran it: its variant applied, the model
        built as the harness's runs build it (`launch.model_source`), the Triton
        cache the run had ('cold' or a shared warm one) instead of the case's request, and, where the
        case leaves `train.attn_implementation` to transformers' default, the attention kernel its runs
        recorded (`attention`: baselines whose runs predate the record are left as they are)."""
        from harness.spec.variants import parse_variant

        measured = parse_variant(self.variant).apply(case) if self.variant else case
        if measured.launch.runtime != self.runtime and measured.stack.value in ("llamafactory", "hf_trainer"):
            measured = measured.model_copy(update={"launch": measured.launch.model_copy(
                update={"runtime": self.runtime})})
        from harness.spec.shape import harness_model_source

        if measured.launch.model_source != harness_model_source(measured):
            launch = measured.launch.model_copy(update={"model_source": harness_model_source(measured)})
            measured = measured.model_copy(update={"launch": launch})
        attn = self.attention()
        if attn is not None and measured.train.attn_implementation is None:
            train = measured.train.model_copy(update={"attn_implementation": attn})
            measured = measured.model_copy(update={"train": train})
        cache = self.runs[0].triton_cache if self.runs else None
        if cache is None:
            return measured
        launch = measured.launch.model_copy(update={"triton_cache": "cold" if cache == "cold" else "shared"})
        return measured.model_copy(update={"launch": launch})

    def attention(self) -> str | None:
        """The attention kernel the runs recorded, where every run and rank that recorded one recorded
        the same one, else None. Repetitions blessed before the record leave it unset without
        contradicting it: `bless --append` adds only runs of the same platform and software."""
        from typing import get_args

        from harness.spec.schema import AttnImplementation

        kinds = {r.attn_implementation for r in self.runs if r.attn_implementation}
        return kinds.pop() if len(kinds) == 1 and next(iter(kinds)) in get_args(AttnImplementation) else None


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
        step_device_s=ranks[0].step_device_s if ranks else [],
        outcome="ok" if err is None else err.kind.value,
        # the message's last line, its control characters (a terminal's colours, a tab) written as escapes
        failure=None if err is None else printable(err.message.strip().splitlines()[-1][:400]) if err.message else None,
        triton_cache=next((c for c in ("cold", "warm") if any(r.triton_cache == c for r in ranks)), None),
        cpu_threads=max((r.cpu_threads for r in ranks if r.cpu_threads), default=None),
        clocks=min((r.clocks for r in ranks if r.clocks), key=lambda c: c.sm_mhz_median, default=None),
        host_cpu=next((r.host_cpu for r in ranks if r.host_cpu), None),
        attn_implementation=_one_attention(ranks),
        stack=_stack_of(ranks),
    )


def _stack_of(ranks) -> str | None:
    """The framework the ranks trained through, as 'name version', or None (the harness's own loop)."""
    stack = next((r.stack for r in ranks if r.stack is not None), None)
    return None if stack is None else " ".join(filter(None, (stack.name, stack.version)))


def _one_attention(ranks) -> str | None:
    """The attention kernel the ranks of a run recorded: None where none did; ranks that disagree
    give their kernels joined by '+', which matches no case's `train.attn_implementation`."""
    kinds = sorted({r.attn_implementation for r in ranks if r.attn_implementation})
    return "+".join(kinds) or None


class BlessError(InputError):
    """A runs file that cannot be blessed, or runs that would mix software stacks in one baseline: bad
    input, which the command line answers with exit 2 (the message names the file)."""

    def __init__(self, message: str):
        super().__init__(None, None, message)


# No card holds this much: a peak above it is an edited or corrupt record, not a measurement.
ABSURD_BYTES = 2**40


def sourced_runs(paths: list[Path]) -> list[tuple[str, CaseRun]]:
    """The runs of `read_runs`, each with where it came from ('FILE entry N', 'FILE')."""
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
                where = f"entry {i}" if isinstance(data, list) else "its content"
                try:
                    runs.append((f"{f} {where}" if isinstance(data, list) else str(f),
                                 CaseRun.model_validate(entry["run"])))
                except (KeyError, TypeError, ValidationError) as exc:
                    raise BlessError(f"{f}: {where} is not a run of `oom-harness run --json` or a run.json "
                                     f"({_first_problem(exc)})") from exc
    return runs


def _first_problem(exc: Exception) -> str:
    if isinstance(exc, ValidationError) and exc.errors():
        e = exc.errors()[0]
        return f"{'.'.join(map(str, e['loc'])) or 'the entry'}: {e['msg']}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def read_runs(paths: list[Path]) -> list[CaseRun]:
    """The runs in `oom-harness run --json` files, in `run.json` files (one run each), and in every
    `run.json` below a folder (`pytest --harness-run-dir`, `oom-harness run --out`), in that order."""
    return [run for _, run in sourced_runs(paths)]


def _case_file(case_id: str, case_dirs: list[Path]) -> Path:
    """The file of a run's case: in the first of `case_dirs` that holds it (ids are file names)."""
    for folder in case_dirs:
        path = Path(folder) / f"{case_id}.yaml"
        if path.is_file():
            return path
    raise BlessError(f"case '{case_id}': no {case_id}.yaml in {', '.join(str(d) for d in case_dirs)}; "
                     "pass the folder of its case file with --case-dir")


def _not_of_case(run: CaseRun, case, case_path: Path, variant) -> str | None:
    """Why `run` is not a measurement of `case` as `case_path` holds it (None: it is): another config
    (digest, model), ranks of another case or of mixed cards, another shape or card than the case's. A
    case's card may be emulated on a bigger one of another vendor, so the vendor is not compared."""
    from harness.spec.identity import case_digest, digest_matches, model_name

    if run.case_digest is not None and not digest_matches(run.case_digest, case):
        return (f"it measured another config than {case_path} (digest {run.case_digest}, the case file's "
                f"{case_digest(case)}): a run relabelled as another case, or a case changed since it ran. "
                "Run the case again, or bless the run under the case it measured")
    if run.model is not None and run.model != model_name(case):
        return f"it measured model '{run.model}', {case_path} names '{model_name(case)}'. Bless it under its own case"
    first = run.ranks[0]
    for r in run.ranks:
        if r.case_id != run.case_id or r.fidelity != run.fidelity:
            return (f"rank {r.rank} reports case '{r.case_id}' at {r.fidelity} size, the run '{run.case_id}' at "
                    f"{run.fidelity} size: a relabelled run. Bless the run under the case it measured")
        if r.platform == "cpu" or (r.platform, r.device_name) != (first.platform, first.device_name):
            return (f"rank {r.rank} ran on {r.platform} '{r.device_name}', rank {first.rank} on {first.platform} "
                    f"'{first.device_name}': a full-size run is measured on one kind of GPU")
        if r.seq_len not in (0, case.train.seq_len) or r.micro_batch not in (0, case.train.micro_batch):
            return (f"rank {r.rank} ran seq_len {r.seq_len}, micro_batch {r.micro_batch}; {case_path} says "
                    f"{case.train.seq_len} and {case.train.micro_batch}. Bless it under the case it measured")
        if variant.as_written and r.emulated_card_bytes not in (None, case.target.card.memory):
            return (f"rank {r.rank} emulated a card of {r.emulated_card_bytes} bytes, {case_path}'s card holds "
                    f"{case.target.card.memory}. Bless it under the case it measured")
    return None


def _impossible(run: CaseRun, figures: Figures, card_bytes: int | None) -> str | None:
    """Why `figures` cannot have been measured (None: they can): a peak above any card or, for a run
    that fit, above its card; an ok run without a peak or a rate."""
    peaks = {k: getattr(figures, k) for k in ("per_card_peak", "allocated_peak", "reserved_peak",
                                               "load_footprint")}
    for key, value in peaks.items():
        if value is not None and value > ABSURD_BYTES:
            return f"{key} {value} bytes is more than any card holds"
    if figures.outcome != "ok":
        return None
    if not figures.per_card_peak:
        return "the run fit but records no peak"
    if card_bytes and figures.per_card_peak > card_bytes:
        return f"the run fit but its per_card_peak {figures.per_card_peak} bytes is above its card's {card_bytes}"
    if run.ranks and any(r.step_times_s for r in run.ranks) and figures.tokens_per_s_per_gpu is None:
        return "the run fit but its step times give no tokens/s (zero tokens or zero-length steps)"
    return None


def baselines_of(runs: list[tuple[str, CaseRun]], driver: str | None = None, root: Path = RESULTS_DIR,
                 note: str = "", recorded: str | None = None, append: bool = False,
                 case_dirs: list[Path] | None = None, replace: bool = False) -> dict[Path, Baseline]:
    """The baselines `bless` would write for `runs` (from `sourced_runs`), by the path each would take
    under `root`; nothing is written. Refuses, as BlessError naming the run's file: a run that is not
    a measurement of the case it names, impossible figures, and (without `replace` or `append`) a
    baseline that exists."""
    from harness.spec.cases import CASES_DIR, CaseError, load_case
    from harness.spec.variants import parse_variant

    folders = [*(case_dirs or []), CASES_DIR]

    day = recorded or dt.date.today().isoformat()
    by_case: dict[tuple[str, str], list[tuple[str, CaseRun]]] = {}
    for where, run in runs:
        if run.fidelity != "real" or not run.ranks:
            continue
        by_case.setdefault((run.case_id, run.variant), []).append((where, run))
    baselines: dict[Path, Baseline] = {}
    for (case_id, variant), sourced in by_case.items():
        case_path = _case_file(case_id, folders)
        try:
            case = load_case(case_path)
            v = parse_variant(variant)
        except (CaseError, ValueError) as exc:
            raise BlessError(str(exc)) from None
        card = case.target.card.memory if v.as_written else None
        figures = []
        for where, run in sourced:
            problem = _not_of_case(run, case, case_path, v)
            try:
                f = figures_of(run, case.launch.procs_per_card)
            except ValidationError as exc:
                problem = problem or f"impossible figures ({_first_problem(exc)})"
            else:
                problem = problem or _impossible(run, f, run.ranks[0].emulated_card_bytes or card)
                figures.append(f)
            if problem:
                raise BlessError(f"{where}: run of '{case_id}{v.suffix}' refused: {problem}")
        runs_of = [run for _, run in sourced]
        first = runs_of[0].ranks[0]
        platform = PlatformInfo.of_run(runs_of[0], driver)
        try:
            path = inside(root, platform.key, f"{case_id}{v.suffix}.json")
        except OutsideFolderError as exc:
            raise BlessError(str(exc)) from None
        if path.exists() and append:
            try:
                old = Baseline.model_validate_json(path.read_text())
            except (OSError, ValueError) as exc:
                raise BlessError(f"{path}: the baseline to append to is unreadable ({_first_problem(exc)}); "
                                 "bless with --replace to write it anew") from None
            baselines[path] = _appended(old, platform, figures, day, note, path)
            continue
        if path.exists() and not replace:
            raise BlessError(f"{path}: a baseline exists; pass --replace to replace it, or --append to add these "
                             "runs as further repetitions")
        baselines[path] = Baseline(
            case_id=case_id, variant=variant, platform=platform, emulated_card_bytes=first.emulated_card_bytes,
            measured=v.label(case), steps=len(first.step_times_s) or 0, runs=figures, recorded=day, note=note,
        )
    return baselines


def control_field(value, where: str = "") -> tuple[str, str] | None:
    """The first field of a record (`model_dump(mode="json")`) whose text, or key, holds a control
    character, as (dotted field, the character's escape); None where there is none."""
    if isinstance(value, str):
        bad = control_character(value)
        return (where, bad) if bad else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        field = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else str(key)
        bad = control_character(key) if isinstance(key, str) else None
        found = (field, bad) if bad else control_field(item, field)
        if found:
            return found
    return None


def _refuse_control(baselines: dict[Path, Baseline], runs: list[tuple[str, CaseRun]]) -> None:
    """BlessError for a baseline whose text holds a control character: a device name, a version, a note
    is one line, and a newline or a terminal escape kept in a baseline would forge the rows of every
    report made from it. Names the field and the run file it came from (or the option)."""
    for path, baseline in baselines.items():
        # the note is one line per blessing, joined by bless itself; its lines' text (--note, the versions a
        # run first recorded) is checked where it comes from
        found = control_field(baseline.model_dump(mode="json", exclude={"note"}))
        if not found:
            continue
        field, bad = found
        source = next((where for where, run in runs if run.case_id == baseline.case_id
                       and run.variant == baseline.variant), str(path))
        raise BlessError(f"{source}: field {field} of the baseline {path.name} would hold the control character "
                         f"{bad}; a run record's text is one line of plain text: fix the record, or run the case "
                         "again")


def bless(runs_json: Path | list[Path], driver: str | None = None, root: Path = RESULTS_DIR, note: str = "",
          recorded: str | None = None, append: bool = False, case_dirs: list[Path] | None = None,
          replace: bool = False) -> list[Path]:
    """Write the baselines of every full-size run in `runs_json` (see `read_runs`, `baselines_of`).
    Repeated runs of a case in them become repetitions of one baseline. An existing baseline is
    replaced only with `replace`; with `append`, the runs are added to the repetitions it already has
    (runs of another day or another host of the same platform), so the spread the tolerances derive
    from covers them all. Each run's case is read from the first of `case_dirs` holding it, then from
    the bundled suite. Each file is written whole or not at all (WriteError: the old one is intact)."""
    for option, text in (("--note", note), ("--driver", driver)):
        bad = control_character(text or "")
        if bad:
            raise BlessError(f"{option}: holds the control character {bad}; give one line of plain text")
    paths = [runs_json] if isinstance(runs_json, (str, Path)) else list(runs_json)
    runs = sourced_runs(paths)
    for where, run in runs:  # `report` reads such runs; a baseline never holds one
        slowed = next((r.injected_delay for r in run.ranks if r.injected_delay), None)
        if slowed:
            raise BlessError(f"{where}: run of '{run.case_id}' refused: it was slowed on purpose "
                             f"(HARNESS_INJECT_DELAY={slowed}), a test of the checks, not a measurement")
    baselines = baselines_of(runs, driver, root, note, recorded, append, case_dirs, replace)
    if not baselines:
        raise BlessError(f"{', '.join(map(str, paths))}: no full-size run to bless (tiny runs and empty files hold "
                         "none); bless the --json of `oom-harness run --fidelity real`")
    _refuse_control(baselines, runs)
    for path, baseline in baselines.items():  # written only once every run was accepted
        write_atomic(path, baseline.model_dump_json(indent=1) + "\n", root=root)
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
                         f"stacks is not noise. Bless with --replace to replace the baseline.")
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


def read_baselines(root: Path = RESULTS_DIR) -> tuple[list[Baseline], list[str]]:
    """The baselines under `root` that can be read, and a line for each file that cannot (empty,
    truncated, not JSON, missing fields, impossible figures) naming the file and the problem."""
    good, bad = [], []
    for path in sorted(Path(root).glob("*/*.json")):
        try:
            good.append(Baseline.model_validate_json(path.read_text()))
        except (OSError, ValueError) as exc:
            problem = "empty" if path.is_file() and not path.stat().st_size else _first_problem(exc)
            bad.append(f"{path}: skipped, not a baseline ({problem}); bless its case again with --replace, "
                       "or delete the file")
    return good, bad


def load_baselines(root: Path = RESULTS_DIR) -> list[Baseline]:
    """The readable baselines under `root`; each unreadable one is named on stderr and skipped, so one
    corrupt file does not stop `check`, `run` or `report`."""
    good, bad = read_baselines(root)
    for line in bad:
        print(f"oom-harness: warning: {line}", file=sys.stderr)
    return good
