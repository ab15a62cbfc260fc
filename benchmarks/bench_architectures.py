"""The predictor's errors by architecture, each architecture left out, beside the reference estimators.

    .venv/bin/python benchmarks/bench_architectures.py

Every finished baseline of the bundled suite (results/baselines), of the architecture benchmark
(results/architectures/baselines: models in none of the guides, benchmarks/architectures) and of fit's
verified configs (results/fitted/baselines: what `fit --verify` measured, benchmarks/fitted) is
predicted as it was measured (its variant applied) on its platform's constants, fitted with every
case of the same model left out (the benchmark's models are never in the fit: the constants come
from the bundled suite only). Peaks that ended in an OOM are only lower bounds and are not counted.

For each run: predicted against measured allocated, reserved and device peaks (device per card),
signed error (prediction / measurement - 1). Then, per architecture and over all runs, the median and
worst absolute error and how many runs are within 5 % (7 % for device). Then the margin check: each
run's margin drawn from the error table (results/predictor/errors.json, as `check` draws it) without
any run of its architecture; a run whose prediction plus that margin is below its measurement is one
the gate would have called a fit on a card between the two. Last, DeepSpeed's, accelerate's and
LLaMA-Factory's estimates of the same runs (harness.predict.reference), against the device peak.
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GiB = 2**30
TOLERANCE = {"allocated": 0.05, "reserved": 0.05, "device": 0.07}  # issue #21's bounds


@dataclass(frozen=True)
class Row:
    suite: str  # "guides", "architectures" or "fitted" (harness.spec.suite.SUITES)
    arch: str
    name: str  # case@variant
    case: object  # the case as measured
    predicted: dict[str, int]
    measured: dict[str, int]
    missing: tuple[str, ...] = ()  # what the prediction could not size: its verdict is undecided

    def error(self, figure: str) -> float:
        return self.predicted[figure] / self.measured[figure] - 1


def arch_of(case) -> str:
    """The model a case trains: its registry name, or its config.json folder's name."""
    return Path(case.model).name


def collect() -> list[Row]:
    from harness.baselines.store import load_baselines
    from harness.predict.predictor import predict
    from harness.spec.cases import load_case
    from harness.spec.suite import SUITES  # the runs the margins are drawn from

    found = []
    for suite, (baselines_dir, case_dir) in SUITES.items():
        cases = {p.stem: load_case(p) for p in sorted(case_dir.glob("*.yaml"))}
        for b in load_baselines(baselines_dir):
            case = cases[b.case_id]
            if case.expect.outcome == "detected":
                continue  # a mistake's figure is the mistake's, not the config's
            ok = [r for r in b.runs if r.outcome == "ok" and r.per_card_peak]
            if not ok:
                continue
            measured_case = b.case_as_measured(case)
            same_model = {cid for cid, c in cases.items() if arch_of(c) == arch_of(case)}
            pred = predict(measured_case, platform=b.platform.key, exclude=same_model)
            procs = measured_case.launch.procs_per_card

            def med(attr, ok=ok):
                return int(statistics.median(getattr(r, attr) for r in ok))

            found.append(Row(
                suite=suite, arch=arch_of(case), name=f"{b.case_id}@{b.variant}" if b.variant else b.case_id,
                case=measured_case,
                predicted={"allocated": pred.allocated, "reserved": pred.reserved, "device": pred.device * procs},
                measured={"allocated": med("allocated_peak"), "reserved": med("reserved_peak"),
                          "device": med("per_card_peak")}, missing=tuple(pred.missing)))
    return found


def summary(rows: list[Row], figure: str) -> str:
    errs = [abs(r.error(figure)) for r in rows]
    within = sum(e <= TOLERANCE[figure] for e in errs)
    return f"{statistics.median(errs):5.1%} / {max(errs):5.1%} ({within}/{len(errs)})"


def margins(rows: list[Row]) -> tuple[list[str], list[str]]:
    """Runs whose prediction plus the margin drawn without their architecture is below the measurement
    (false fits), and runs whose verdict was undecided (the prediction said what it could not size)."""
    from harness.predict.margin import ERRORS_FILE, ConfigKind, ErrorTable, margin_from

    table = ErrorTable.read(ERRORS_FILE)
    by_arch = defaultdict(set)
    for r in rows:
        by_arch[r.arch].add(r.name.split("@")[0])
    out, undecided = [], []
    for r in rows:
        m = margin_from(table.records, ConfigKind.of(r.case), exclude=frozenset(by_arch[r.arch]))
        covered = r.predicted["device"] * (1 + m.fraction)
        line = (f"  {r.name} ({r.arch}): predicted {r.predicted['device'] / GiB:.2f} GiB + {m.fraction:.1%} "
                f"{'<' if covered < r.measured['device'] else '>='} measured {r.measured['device'] / GiB:.2f} GiB")
        if r.missing:
            undecided.append(f"{line}; undecided, not in it: {'; '.join(x.split(':')[0] for x in r.missing)}")
        elif covered < r.measured["device"]:
            out.append(line)
    return out, undecided


def main() -> int:
    rows = collect()
    print("Predicted (each architecture left out of the constants) vs measured, GiB per card; error = pred/meas - 1")
    head = f"{'run':58s} {'suite':13s} | {'allocated p/m':>13s} {'err':>7s} | {'reserved p/m':>13s} {'err':>7s} | " \
           f"{'device p/m':>13s} {'err':>7s}"
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = " | ".join(f"{r.predicted[f] / GiB:6.2f}/{r.measured[f] / GiB:6.2f} {r.error(f):+7.1%}"
                           for f in ("allocated", "reserved", "device"))
        print(f"{r.name[:58]:58s} {r.suite:13s} | {cells}")

    print()
    print("Absolute error, median / worst (runs within 5 % allocated and reserved, 7 % device), by architecture:")
    print(f"  {'architecture':34s} {'runs':>4s}  {'allocated':24s} {'reserved':24s} {'device':24s}")
    groups = defaultdict(list)
    for r in rows:
        groups[(r.suite, r.arch)].append(r)
    for (suite, arch), rs in sorted(groups.items()):
        mark = {"architectures": " *", "fitted": " (fit's config)"}.get(suite, "")
        print(f"  {arch + mark:34s} {len(rs):4d}  "
              + " ".join(f"{summary(rs, f):24s}" for f in ("allocated", "reserved", "device")))
    for label, rs in (("the architecture benchmark (*)", [r for r in rows if r.suite == "architectures"]),
                      ("the guides' models", [r for r in rows if r.suite == "guides"]),
                      ("fit's configs, verified", [r for r in rows if r.suite == "fitted"]), ("every run", rows)):
        if rs:
            print(f"  {label:34s} {len(rs):4d}  " + " ".join(f"{summary(rs, f):24s}"
                                                              for f in ("allocated", "reserved", "device")))
    print("  (* a model in none of the guides)")

    print()
    short, undecided = margins(rows)
    print(f"Margin check, each run's margin drawn without its architecture: {len(short)} of {len(rows)} runs "
          f"measured above prediction + margin, {len(undecided)} undecided (no verdict claimed)")
    print("\n".join(short + undecided))

    from harness.predict.reference import estimator_errors

    print()
    print("Reference estimators against the measured device peak per card (estimate/measured - 1):")
    for label, rs in (("the architecture benchmark", [r for r in rows if r.suite == "architectures"]),
                      ("every run", rows)):
        summaries = estimator_errors((r.case, r.measured["device"]) for r in rs)
        print(f"  {label}, {len(rs)} runs")
        print(f"  {'estimator':14s} {'median':>8s} {'median |e|':>10s} {'worst':>9s}  {'under':>5s}  worst run")
        for name, s in summaries.items():
            print(f"  {name:14s} {s.median:+8.1%} {s.median_abs:10.1%} {s.worst.error:+9.1%}  {s.under:5d}  "
                  f"{s.worst.case_id}")
        errs = [r.error("device") for r in rs]
        worst = max(rs, key=lambda r: abs(r.error("device")))
        print(f"  {'oom-harness':14s} {statistics.median(errs):+8.1%} {statistics.median(map(abs, errs)):10.1%} "
              f"{worst.error('device'):+9.1%}  {sum(e < 0 for e in errs):5d}  {worst.name.split('@')[0]}")
    print("  (under: runs the estimate put below the measured peak)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
