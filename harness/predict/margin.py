"""A prediction's uncertainty, and the one fits verdict every caller uses (check, pre-merge, fit).

A prediction is a point estimate; a gate that compares it with the card as it stands lets every
under-prediction through as a false "fits". The margin is how far the predictor has fallen short,
out of sample, on the benchmark's runs of the same kind of config:

* The errors: every blessed baseline predicted leave-one-out (its own case left out of the
  calibration), its device figure against the measured one, kept in `results/predictor/errors.json`
  by `python benchmarks/predictor_errors.py` (`ErrorTable`). A run that ran out of memory gives only a
  lower bound; it counts where the prediction is below that bound.
* The kind of a config (`ConfigKind`): the method (LoRA, QLoRA, full), the ZeRO stage (0: no
  DeepSpeed), what is offloaded, and the checkpointing (off, reentrant, non-reentrant).
* The margin of a kind measured on at least `MIN_CASES` cases: its runs' worst under-prediction
  (measured / predicted - 1), at least the run-to-run noise of a peak (`MARGIN_FLOOR`), as a share of
  the prediction. A kind measured on fewer is *not measured*, and says so: its margin is the largest of
  its own runs' worst, the nearest coarser group's that has enough cases (the same method, stage and
  offload; then method and stage; then the method; then every run: `LEVELS`), and the spread of
  errors across the measured kinds (`cross_kind_spread`: the most under-predicted kind's bias plus the
  scatter of runs within a kind), so a kind nobody measured never gets the floor because its few
  neighbours happened to be close.
  With no table at all (a folder without one), `PRIOR_MARGIN` stands in and the notes say so.
* The table records the digest of what it was computed from (the baselines, the cases, the
  predictor's code, the device records); a table computed from something else is stale, and the
  margin's notes say so (tests/test_margin.py fails on it).

`fit_verdict` is the verdict: the predicted card peak (one process's device figure times the
processes sharing the card) plus the margin, against the budget (the card times the headroom).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from harness.spec.schema import Case, Offload
from harness.spec.suite import ROOT
from harness.spec.units import fmt_gib

ERRORS_FILE = ROOT / "results" / "predictor" / "errors.json"
PREDICTOR_CODE = Path(__file__).resolve().parent
# Files of harness/predict/ whose change does not change a prediction (the margin itself, what --explain prints).
_NOT_PREDICTOR = {"margin.py", "explain.py", "__init__.py"}

MARGIN_FLOOR = 0.02  # run-to-run noise of a peak (harness.baselines.store.MEMORY_FLOOR)
MIN_CASES = 4  # a group's margin needs the errors of at least this many cases
PRIOR_MARGIN = 0.25  # no error table to read: a cautious margin, larger than any error the benchmark has shown


@dataclass(frozen=True)
class ConfigKind:
    """What of a config the predictor's error depends on most: the groups of the margin."""

    method: str  # lora, qlora, full
    zero: int  # ZeRO stage, 0 without DeepSpeed
    offload: str  # none, optimizer, optimizer+param
    checkpointing: str  # off, reentrant, non-reentrant
    # QLoRA only: the stack's k-bit path (peft's preparation upcasts what is not 4-bit to fp32,
    # LLaMA-Factory's keeps it in the compute dtype: GiBs apart on a 7B, and so are their errors)
    path: str = ""
    # "cold" for a run on a cold Triton cache: what compiling and autotuning hold is a term of its own
    # (`triton_cold_overhead`), fitted on the few runs that had one, so its errors are not the others'
    triton: str = ""

    @property
    def method_path(self) -> str:
        return f"{self.method}/{self.path}" if self.path else self.method

    @classmethod
    def of(cls, case: Case) -> ConfigKind:
        from harness.predict.step import reentrant_checkpointing

        ds = case.deepspeed
        offload = "none"
        if ds is not None and ds.offload_optimizer != Offload.none:
            offload = "optimizer+param" if ds.offload_param != Offload.none else "optimizer"
        elif ds is not None and ds.offload_param != Offload.none:
            offload = "param"
        gc = "off"
        if case.train.gradient_checkpointing:
            gc = "reentrant" if reentrant_checkpointing(case) else "non-reentrant"
        path = case.stack.qlora_path if case.method.kind == "qlora" else ""
        return cls(method=case.method.kind, zero=0 if ds is None else ds.stage, offload=offload, checkpointing=gc,
                   path=path, triton="cold" if case.launch.triton_cache == "cold" else "")

    def label(self) -> str:
        method = {"lora": "LoRA", "qlora": "QLoRA", "full": "full fine-tune"}.get(self.method, self.method)
        method += {"peft": " (peft's k-bit path)", "llamafactory": " (LLaMA-Factory's path)"}.get(self.path, "")
        zero = "no DeepSpeed" if self.zero == 0 else f"ZeRO-{self.zero}"
        offload = "" if self.offload == "none" else f", {self.offload} offload"
        gc = "no checkpointing" if self.checkpointing == "off" else f"{self.checkpointing} checkpointing"
        cold = ", cold Triton cache" if self.triton == "cold" else ""
        return f"{method}, {zero}{offload}, {gc}{cold}"


# From the narrowest group to every run: (its name, what of a kind it matches on).
# A run on a cold Triton cache is grouped only with others on one.
LEVELS: tuple[tuple[str, Callable[[ConfigKind], tuple]], ...] = (
    ("this kind", lambda k: (k.triton, k.method_path, k.zero, k.offload, k.checkpointing)),
    ("same method, ZeRO stage and offload", lambda k: (k.triton, k.method_path, k.zero, k.offload)),
    ("same method and ZeRO stage", lambda k: (k.triton, k.method, k.zero)),
    ("same method", lambda k: (k.triton, k.method)),
    ("every config", lambda k: (k.triton,)),
)


@dataclass(frozen=True)
class ErrorRecord:
    """One baseline predicted leave-one-out: the device figure per card, predicted and measured."""

    case_id: str
    variant: str
    platform: str
    kind: ConfigKind
    outcome: Literal["ok", "oom"]  # oom: `measured` is where the run failed, a lower bound
    predicted: int
    measured: int

    @property
    def shortfall(self) -> float:
        """How far the prediction fell short of the measured figure, as a share of the prediction
        (negative: it was above). For an OOM run, only a shortfall is known (0 where it is above)."""
        short = self.measured / self.predicted - 1
        return max(short, 0.0) if self.outcome == "oom" else short

    @property
    def name(self) -> str:
        return f"{self.case_id}{'@' + self.variant if self.variant else ''} on {self.platform}"

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ErrorRecord:
        return cls(**{**d, "kind": ConfigKind(**d["kind"])})


@dataclass(frozen=True)
class ErrorTable:
    """The benchmark's leave-one-out errors, and the digest of what they were computed from."""

    digest: str
    records: tuple[ErrorRecord, ...]

    def to_json(self) -> str:
        return json.dumps({"digest": self.digest, "written_by": "python benchmarks/predictor_errors.py",
                           "records": [r.as_dict() for r in self.records]}, indent=1) + "\n"

    @classmethod
    def read(cls, path: Path) -> ErrorTable:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return cls(digest=data["digest"], records=tuple(ErrorRecord.from_dict(r) for r in data["records"]))


@dataclass(frozen=True)
class Margin:
    """The share of a prediction added before it is compared with the card, and where it comes from."""

    fraction: float
    basis: str  # which runs set it, in words
    kind: ConfigKind | None = None
    cases: tuple[str, ...] = ()  # the cases whose errors set it
    worst: str | None = None  # the run with the largest shortfall
    notes: tuple[str, ...] = ()

    def bytes_of(self, predicted: int) -> int:
        return math.ceil(predicted * self.fraction)

    def describe(self) -> str:
        worst = f"; worst {self.worst}" if self.worst else ""
        kind = f"{self.kind.label()}: " if self.kind else ""
        return f"margin {self.fraction:.1%} ({kind}{self.basis}{worst})"


def margin_from(records: Iterable[ErrorRecord], kind: ConfigKind, exclude=frozenset(),
                min_cases: int = MIN_CASES) -> Margin:
    """The margin of `kind` from `records`, the cases in `exclude` left out (a leave-one-out margin).

    A kind measured on at least `min_cases` cases: its runs' worst shortfall. A kind measured on fewer is
    not measured: its margin is the largest of its own runs' worst shortfall, the nearest coarser group's
    that has enough cases (`LEVELS`), and the spread of errors across the measured kinds
    (`cross_kind_spread`): how far a kind nobody measured may sit from its prediction."""
    pool = [r for r in records if r.case_id not in exclude and r.kind.triton == kind.triton]
    if not pool:
        return Margin(fraction=PRIOR_MARGIN, kind=kind, basis="no benchmark error to draw on; a cautious prior",
                      notes=("no predictor error table: the margin is a prior",))
    mine = [r for r in pool if LEVELS[0][1](r.kind) == LEVELS[0][1](kind)]
    mine_cases = _ok_cases(mine)
    if len(mine_cases) >= min_cases:
        worst = max(mine, key=lambda r: r.shortfall)
        return Margin(fraction=max(MARGIN_FLOOR, worst.shortfall), kind=kind, cases=tuple(mine_cases),
                      basis=f"{LEVELS[0][0]}, {len(mine)} runs of {len(mine_cases)} cases", worst=_worst_text(worst))
    level, group = next(((name, g) for name, key in LEVELS[1:]
                         if len(_ok_cases(g := [r for r in pool if key(r.kind) == key(kind)])) >= min_cases),
                        (LEVELS[-1][0], pool))
    spread = cross_kind_spread(pool)
    worst = max(mine + group, key=lambda r: r.shortfall)
    fraction = max(MARGIN_FLOOR, worst.shortfall, spread)
    measured = f"{len(mine_cases)} measured case{'s' * (len(mine_cases) != 1)}, fewer than {min_cases}"
    basis = (f"margin not measured for this kind ({measured}): the largest of the spread of errors across "
             f"{len(_kinds(pool))} measured kinds ({spread:.1%}) and the worst run of {level} "
             f"({len(group)} runs of {len(_ok_cases(group))} cases, {worst.shortfall:+.1%})")
    return Margin(fraction=fraction, kind=kind, basis=basis, cases=tuple(_ok_cases(group)),
                  worst=_worst_text(worst) if worst.shortfall >= spread else None)


def cross_kind_spread(records: list[ErrorRecord]) -> float:
    """How far a kind of config nobody measured may fall short of its prediction, from the kinds that were
    measured, taken as draws of the same predictor: the largest bias of a kind (the median shortfall of its
    finished runs; 0 where every kind is over-predicted) plus the most a run fell short beyond its own
    kind's bias (the scatter of runs of one kind: platforms, variants, repetitions). The kinds' biases are
    used as measured, not mirrored: the predictor errs on the high side by design, and a kind it
    over-predicts says nothing of one it would under-predict beyond what the other kinds show."""
    bias = {k: statistics.median(r.shortfall for r in rs) for k, rs in _kinds(records).items()}
    if not bias:
        return 0.0
    scatter = max((r.shortfall - bias[LEVELS[0][1](r.kind)] for r in records
                   if LEVELS[0][1](r.kind) in bias), default=0.0)
    return max(max(bias.values()), 0.0) + max(scatter, 0.0)


def _kinds(records: Iterable[ErrorRecord]) -> dict[tuple, list[ErrorRecord]]:
    """The finished runs by kind (the narrowest level of `LEVELS`)."""
    out: dict[tuple, list[ErrorRecord]] = {}
    for r in records:
        if r.outcome == "ok":
            out.setdefault(LEVELS[0][1](r.kind), []).append(r)
    return out


def _ok_cases(records: Iterable[ErrorRecord]) -> list[str]:
    return sorted({r.case_id for r in records if r.outcome == "ok"})


def _worst_text(worst: ErrorRecord) -> str | None:
    return (f"{worst.name} measured {worst.shortfall:.1%} above its prediction"
            if worst.shortfall > MARGIN_FLOOR else None)


# --- the stored table and its freshness -----------------------------------------------------------


def source_files(root: Path = ROOT) -> list[Path]:
    """What the error table depends on: the baselines, the cases (the bundled suite's, the architecture
    benchmark's with its models, and fit's verified configs'), the device records, the surveys of Triton
    kernels, the cards' compute layouts, the predictor's code."""
    files = sorted((root / "results" / "baselines").glob("*/*.json"))
    files += sorted((root / "cases").glob("*.yaml"))
    files += sorted((root / "results" / "architectures" / "baselines").glob("*/*.json"))
    files += sorted((root / "benchmarks" / "architectures" / "cases").glob("*.yaml"))
    files += sorted((root / "benchmarks" / "architectures" / "models").glob("*/config.json"))
    files += sorted((root / "results" / "fitted" / "baselines").glob("*/*.json"))
    files += sorted((root / "benchmarks" / "fitted" / "cases").glob("*.yaml"))
    files += sorted((root / "results" / "device").glob("*.json"))
    files += sorted((root / "results" / "triton-kernels").glob("*.json"))
    files += [root / "harness" / "measure" / "cards.json"]
    # the package and its subpackages (trace/, allocator/, zero2/, zero3/); `reference/` holds other tools' estimates
    files += sorted(p for p in PREDICTOR_CODE.rglob("*.py")
                    if p.name not in _NOT_PREDICTOR and "reference" not in p.relative_to(PREDICTOR_CODE).parts)
    return [p for p in files if p.is_file()]  # a folder named like a case file is not an input


def inputs_digest(root: Path = ROOT) -> str:
    h = hashlib.sha256()
    for p in source_files(root):
        # by path: allocator/ and zero2/ each hold a stream.py
        name = p.relative_to(root).as_posix() if p.is_relative_to(root) else p.name
        h.update(name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:32]


@functools.lru_cache(maxsize=4)
def _table(path: str) -> tuple[ErrorTable | None, str | None]:
    """(the table, a note when it is missing, unreadable or stale)."""
    try:
        table = ErrorTable.read(Path(path))
    except FileNotFoundError:
        return None, f"{path}: no predictor error table; the margin is a prior ({PRIOR_MARGIN:.0%})"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, (f"{path}: unreadable predictor error table ({exc}); the margin is a prior ({PRIOR_MARGIN:.0%}). "
                      "Rewrite it with `python benchmarks/predictor_errors.py`")
    if table.digest != inputs_digest():
        return table, (f"{path} was computed before the baselines, cases or predictor last changed; rewrite it "
                       "with `python benchmarks/predictor_errors.py`")
    return table, None


def margin_for(case: Case, *, exclude=frozenset(), path: Path = ERRORS_FILE) -> Margin:
    """The margin of a case's kind of config, from the stored error table."""
    table, note = _table(str(path))
    kind = ConfigKind.of(case)
    if table is None:
        return Margin(fraction=PRIOR_MARGIN, kind=kind, basis="no benchmark error to draw on; a cautious prior",
                      notes=(note,) if note else ())
    m = margin_from(table.records, kind, exclude)
    return Margin(**{**asdict(m), "kind": kind, "notes": m.notes + ((note,) if note else ())})


# --- the verdict ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FitVerdict:
    """A card's predicted peak with its margin against the budget."""

    predicted: int  # the card's peak: one process's device figure times the processes sharing the card
    margin: int
    budget: int  # card memory times the headroom
    margin_of: Margin = field(compare=False)
    missing: tuple[str, ...] = ()  # what the prediction could not size (`Prediction.missing`)

    @property
    def needed(self) -> int:
        return self.predicted + self.margin

    @property
    def decided(self) -> bool:
        """False where the prediction lacks a part of the job: then nothing is claimed either way."""
        return not self.missing

    @property
    def fits(self) -> bool:
        """Within the budget with the margin, and nothing of the job left unsized."""
        return self.decided and self.needed <= self.budget

    @property
    def headroom(self) -> int:
        """What the budget leaves once the prediction and its margin are in (negative: short by that much)."""
        return self.budget - self.needed

    def summary(self) -> str:
        sign = "<=" if self.needed <= self.budget else ">"
        line = (f"predicted {fmt_gib(self.predicted)} + margin {fmt_gib(self.margin)} ({self.margin_of.fraction:.1%}) "
                f"= {fmt_gib(self.needed)} {sign} budget {fmt_gib(self.budget)}")
        return line + "".join(f"; not in it: {m}" for m in self.missing)


def fit_verdict(device: int, margin: Margin, *, gpu_memory: int, headroom: float, procs_per_gpu: int = 1,
                missing: tuple[str, ...] | list[str] = ()) -> FitVerdict:
    """Does the predicted card peak (`device`, one process's predicted device figure, times the processes
    sharing the card), with its margin, stay within the card times the headroom? Undecided where the
    prediction says it could not size part of the job (`missing`)."""
    predicted = device * procs_per_gpu
    return FitVerdict(predicted=predicted, margin=margin.bytes_of(predicted), budget=int(gpu_memory * headroom),
                      margin_of=margin, missing=tuple(missing))
