"""The predictor's errors on the benchmark, leave-one-out: what the margins are drawn from.

    python benchmarks/predictor_errors.py            rewrite results/predictor/errors.json, print the margins
    python benchmarks/predictor_errors.py --check    exit 1 where the stored table is stale or a margin lets a run
                                                     through

Every blessed baseline of the bundled suite and of the architecture benchmark (benchmarks/architectures:
models in none of the guides) is predicted as it was measured (its variant applied,
the Triton cache it ran with) on its own platform's calibration with its case left out, and its
device figure per card compared with the measured one (`harness.predict.margin.ErrorRecord`).
Baselines of mistakes the harness must detect (`expect: detected`) are left out: they are predicted
as if launched right, so their error is the mistake's. With the trace cache warm this takes seconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from harness.baselines.store import load_baselines
from harness.predict.margin import (
    ERRORS_FILE,
    LEVELS,
    ConfigKind,
    ErrorRecord,
    ErrorTable,
    fit_verdict,
    inputs_digest,
    margin_from,
)
from harness.spec.cases import load_case
from harness.spec.files import write_atomic
from harness.spec.suite import SUITES
from harness.spec.units import fmt_gib


@dataclass(frozen=True)
class Measured:
    """One baseline as the errors see it: the case as measured, and its record."""

    case: object  # harness.spec.schema.Case, the variant applied
    record: ErrorRecord


SOURCES = tuple(SUITES.values())


def measure_errors(sources: tuple[tuple[Path, Path], ...] = SOURCES) -> list[Measured]:
    """Every baseline predicted leave-one-out, against its measured device figure per card."""
    from harness.predict.predictor import predict

    out = []
    for b, case_dir in ((b, case_dir) for baselines_dir, case_dir in sources
                        for b in (load_baselines(baselines_dir) if baselines_dir.is_dir() else [])):
        case = load_case(Path(case_dir) / f"{b.case_id}.yaml")
        if case.expect.outcome == "detected":
            continue
        measured_case = b.case_as_measured(case)
        ok = [r.per_card_peak for r in b.runs if r.outcome == "ok" and r.per_card_peak]
        failed = [r.per_card_peak for r in b.runs if r.outcome != "ok" and r.per_card_peak]
        if not ok and not failed:
            continue
        pred = predict(measured_case, platform=b.platform.key, exclude={b.case_id})
        out.append(Measured(measured_case, ErrorRecord(
            case_id=b.case_id, variant=b.variant, platform=b.platform.key, kind=ConfigKind.of(measured_case),
            outcome="ok" if ok else "oom", predicted=pred.device * measured_case.launch.procs_per_card,
            measured=int(statistics.median(ok)) if ok else max(failed))))
    return out


@dataclass(frozen=True)
class Shortfall:
    """A run the gate would have let through: its prediction plus margin under what it measured."""

    record: ErrorRecord
    margin: float
    called_fits: bool  # the verdict on the case's own card said it fits

    def line(self) -> str:
        r = self.record
        return (f"{r.name}: predicted {fmt_gib(r.predicted)} + {self.margin:.1%} < measured {fmt_gib(r.measured)} "
                f"({r.outcome})")


def false_fits(measured: list[Measured], table: ErrorTable, leave_case_out: bool = False) -> list[Shortfall]:
    """The runs whose prediction plus margin (from `table`) is below the measured figure. An OOM run
    counts only where the verdict on its case's own card also says it fits. `leave_case_out`: each
    margin drawn without the run's own case (the margin's own out-of-sample test)."""
    found = []
    for m in measured:
        r = m.record
        margin = margin_from(table.records, r.kind, exclude={r.case_id} if leave_case_out else frozenset())
        if r.predicted + margin.bytes_of(r.predicted) >= r.measured:
            continue
        procs = m.case.launch.procs_per_card
        verdict = fit_verdict(r.predicted // procs, margin, gpu_memory=m.case.target.card.memory,
                              headroom=m.case.target.headroom, procs_per_gpu=procs)
        if r.outcome == "oom" and not verdict.fits:
            continue
        found.append(Shortfall(r, margin.fraction, verdict.fits))
    return found


def report(table: ErrorTable) -> list[str]:
    """The margin of every kind of config the benchmark holds, and how it was drawn."""
    lines = [f"{'kind of config':62s} {'margin':>7s}  basis"]
    for kind in sorted({r.kind for r in table.records}, key=lambda k: k.label()):
        m = margin_from(table.records, kind)
        lines.append(f"{kind.label():62s} {m.fraction:7.1%}  {m.basis}" + (f"; worst {m.worst}" if m.worst else ""))
    lines.append(f"(groups, narrowest first: {'; '.join(name for name, _ in LEVELS)})")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/predictor_errors.py", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the stored table instead of writing it")
    parser.add_argument("--out", type=Path, default=ERRORS_FILE)
    args = parser.parse_args(argv)
    measured = measure_errors()
    table = ErrorTable(digest=inputs_digest(), records=tuple(m.record for m in measured))
    if args.check:
        stored = ErrorTable.read(args.out)
        problems = []
        if stored.digest != table.digest:
            problems.append(f"{args.out} is stale: rewrite it with `python benchmarks/predictor_errors.py`")
        problems += [s.line() for s in false_fits(measured, stored)]
        print("\n".join(problems) or f"{args.out}: current, and no false fit on {len(measured)} runs")
        return 1 if problems else 0
    write_atomic(args.out, table.to_json())
    print(f"{args.out}: {len(table.records)} runs")
    print("\n".join(report(table)))
    loo = false_fits(measured, table, leave_case_out=True)
    print(f"\nfalse fits with each run's margin drawn from the other cases: {len(loo)} of {len(measured)}")
    for s in loo:
        print("  " + s.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
