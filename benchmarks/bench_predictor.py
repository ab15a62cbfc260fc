"""Accuracy of the predictor against every GPU baseline in results/, out of sample.

    .venv/bin/python benchmarks/bench_predictor.py [--no-timing]

For each baseline (each platform, each case, as measured: a variant such as '2r8L' is applied to
the case first) the predictor runs with that platform's calibration and the case itself excluded
from it (leave-one-out), and the table shows predicted vs measured peak allocated, reserved and
device (per card: the sum of the processes sharing a card) with relative errors. A run that ended
in an OOM only gives a lower bound (the figure at the failure on its emulated card): for those the
table says whether the prediction is at or above it, never an error.

Beside it, DeepSpeed's model-state estimator and LLaMA-Factory's hardware table as
harness.predict.reference applies them (what each counts: docs/predictor.md, "The reference
estimators"; benchmarks/bench_architectures.py sets accelerate's beside them too).
Their errors are against the measured device peak.

Last, the wall time of `predict()` on guide 000's 32B case in a fresh interpreter (imports included),
with an empty trace cache and with the trace cached on disk (harness.predict.trace.trace).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GiB = 2**30
REFERENCES = ("deepspeed", "llamafactory")  # the columns beside the predictor's


def references(case) -> dict[str, float]:
    """The reference tools' per-card figures for the case as measured (harness.predict.reference)."""
    from harness.predict.reference import reference_estimates

    return {e.estimator: e.per_card for e in reference_estimates(case) if e.estimator in REFERENCES}


def issue6() -> None:
    """Guide 000 (issue #6): per-rank device peak predicted at 8 ranks (as written, full depth)
    beside the 2-rank prediction and the 2-rank measurement or depth extrapolation."""
    from harness.baselines.store import load_baselines
    from harness.judge.extrapolation import extrapolate
    from harness.predict.predictor import predict
    from harness.spec.cases import CASES_DIR, load_case

    baselines = load_baselines()
    print()
    print("Issue #6, guide 000 at full depth (64 layers), per-rank device peak, GiB "
          "(budget: 64 GiB card x 0.9 = 57.60):")
    print(f"  {'case':50s} {'8 ranks pred':>12s} {'2 ranks pred':>12s} {'2 ranks measured / extrapolated':>34s}")
    for path in sorted(CASES_DIR.glob("000-*.yaml")):
        case = load_case(path)
        p8 = predict(case, platform="nvidia-h200-x2", exclude={case.id})
        p2 = predict(case, platform="nvidia-h200-x2", exclude={case.id}, variant="2r2ga")
        seen = []
        for b in baselines:
            if b.case_id == case.id and b.variant == "2r2ga":
                r = b.runs[0]
                seen.append(f"{r.per_card_peak / GiB:.2f} "
                            f"{'measured' if r.outcome == 'ok' else r.outcome.upper() + ' at'}")
        for e in extrapolate(case, baselines):
            if e.base_variant == "2r2ga" and "per_card_peak" in e.values:
                seen.append(f"{e.values['per_card_peak'] / GiB:.2f} extrap.")
        print(f"  {case.id:50s} {p8.device / GiB:12.2f} {p2.device / GiB:12.2f} {'; '.join(seen) or '-':>34s}")
    print("  (predictions leave the case out of the calibration; 2-rank figures at grad accum 2, which does not "
          "change the peak)")


def rel(pred: float, meas: float) -> float:
    return pred / meas - 1


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x / GiB:6.2f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-timing", action="store_true")
    args = parser.parse_args(argv)

    from harness.baselines.store import load_baselines
    from harness.predict.predictor import predict
    from harness.spec.cases import CASES_DIR, load_case

    rows = []
    host_rows = []
    worst = {"allocated": (0.0, ""), "reserved": (0.0, ""), "device": (0.0, "")}
    ref_worst = {"deepspeed": [], "llamafactory": []}
    print("Predicted (leave-one-out) vs measured peaks, GiB. device = per card (sum of processes sharing it).")
    header = (f"{'case':44s} {'platform':26s} {'var':7s} {'outcome':7s} | {'alloc p/m':>15s} {'err':>7s} | "
              f"{'reserved p/m':>15s} {'err':>7s} | {'device p/m':>15s} {'err':>7s} | "
              f"{'DS est':>6s} {'err':>7s} | {'LF tab':>6s} {'err':>7s}")
    print(header)
    print("-" * len(header))
    for b in load_baselines():
        try:
            case = load_case(CASES_DIR / f"{b.case_id}.yaml")
        except Exception as exc:
            print(f"{b.case_id}: case file unreadable ({exc}); skipped")
            continue
        try:
            measured_case = b.case_as_measured(case)  # its variant, and the Triton cache it had
        except Exception as exc:
            print(f"{b.case_id}@{b.variant}: variant not applicable ({exc}); skipped")
            continue
        procs = measured_case.launch.procs_per_card
        pred = predict(measured_case, platform=b.platform.key, exclude={b.case_id})
        assert b.case_id not in pred.calibrated_on
        runs_ok = [r for r in b.runs if r.outcome == "ok"]
        oom = not runs_ok
        runs = runs_ok or b.runs
        # a mistake to detect is predicted as its config would run launched right: shown, not counted
        mistake = case.expect.outcome == "detected"
        outcome = "mistake" if mistake else "OOM" if oom else "ok"

        def med(attr, runs=runs):
            vals = [getattr(r, attr) for r in runs if getattr(r, attr) is not None]
            return statistics.median(vals) if vals else None

        m_alloc, m_res, m_dev = med("allocated_peak"), med("reserved_peak"), med("per_card_peak")
        p_alloc, p_res, p_dev = pred.allocated, pred.reserved, pred.device * procs
        refs_of = references(measured_case)  # per card: every job sharing it counted
        ds, lf = refs_of["deepspeed"], refs_of["llamafactory"]
        cells = []
        for name, p, m in (("allocated", p_alloc, m_alloc), ("reserved", p_res, m_res), ("device", p_dev, m_dev)):
            if m is None:
                cells.append(f"{fmt(p)}/{fmt(m)} {'-':>7s}")
                continue
            if oom:
                cells.append(f"{fmt(p)}/{fmt(m)} {'>=' if p >= m else '< !':>7s}")
            else:
                e = rel(p, m)
                if abs(e) > abs(worst[name][0]) and not mistake:
                    worst[name] = (e, f"{b.case_id} ({b.platform.key})")
                cells.append(f"{fmt(p)}/{fmt(m)} {e:+7.1%}")
        refs = []
        for key, est in (("deepspeed", ds), ("llamafactory", lf)):
            if est is None or m_dev is None:
                refs.append(f"{fmt(est):>6s} {'-':>7s}")
            elif oom:
                refs.append(f"{fmt(est):>6s} {'>=' if est >= m_dev else '< !':>7s}")
            else:
                e = rel(est, m_dev)
                if not mistake:
                    ref_worst[key].append((abs(e), e, b.case_id))
                refs.append(f"{fmt(est):>6s} {e:+7.1%}")
        print(f"{b.case_id:44s} {b.platform.key:26s} {b.variant or '-':7s} {outcome:7s} | "
              + " | ".join(cells) + " | " + " | ".join(refs))
        rows.append((b, pred))
        m_host = med("host_peak")
        if m_host is not None:  # per-rank RSS (worst rank) x the processes on this node
            node = m_host * measured_case.launch.ranks * procs
            host_rows.append((f"{b.case_id}@{b.variant or '-'}", pred.host_ram, node, oom, mistake))
    print()
    for name, (e, where) in worst.items():
        print(f"worst {name:9s} error (finished runs): {e:+.1%}  {where}")
    for key, errs in ref_worst.items():
        if errs:
            _, e, cid = max(errs)
            print(f"worst {key} reference error (device peak, finished runs): {e:+.1%}  {cid} "
                  f"({len(errs)} cases apply)")
        else:
            print(f"{key} reference: applies to no finished run")
    print()
    print("Host RAM of the job on one node, GiB: predicted Prediction.host_ram vs measured host_peak "
          "(worst rank's RSS) x ranks x processes per card (every rank of these runs shared one node).")
    herrs = []
    for name, p, m, oom, mistake in host_rows:
        e = rel(p, m)
        if not oom and not mistake:
            herrs.append((abs(e), e, name))
        note = "  (OOM run)" if oom else "  (mistake)" if mistake else ""
        print(f"  {name:60s} {p / GiB:7.2f} / {m / GiB:7.2f}  {e:+7.1%}{note}")
    if herrs:
        _, e, name = max(herrs)
        print(f"worst host RAM error (finished runs): {e:+.1%}  {name}")
    print()
    print("OOM rows: the measured figure is where the run failed on its emulated card, a lower bound; "
          "'>=' means the prediction is at or above it ('< !' means it predicts a fit that OOMed).")
    print("mistake rows (expect: detected, guide 002's wrong launches) are predicted as if launched right and "
          "are not counted in the worst errors: the predictor does not model what the mistake costs.")
    if rows:
        pred = rows[-1][1]
        print(f"fitted constants: {', '.join(pred.fitted)} (per platform, from results/baselines)")

    issue6()

    if not args.no_timing:
        code = ("import time; t=time.perf_counter()\n"
                "from harness.spec.cases import load_case, CASES_DIR\n"
                "from harness.predict.predictor import predict\n"
                "c = load_case(CASES_DIR / '000-lora-z3-offload-cutoff1024-ga16.yaml')\n"
                "p = predict(c)\n"
                "print(f'{time.perf_counter()-t:.2f} {p.seconds:.2f}')\n")
        import os
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            for label, cache in (("cold (empty trace cache)", tmp), ("warm (trace cached on disk)", tmp)):
                env = dict(os.environ, HARNESS_PREDICT_CACHE=cache)
                t0 = time.perf_counter()
                out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
                wall = time.perf_counter() - t0
                try:
                    total, inner = out.stdout.split()[-2:]
                    print(f"predict() on 000-lora-z3-offload-cutoff1024-ga16 (32B, 8 ranks), fresh interpreter, "
                          f"{label}: {float(total):.2f} s imports included (predict() itself {float(inner):.2f} s; "
                          f"process wall {wall:.2f} s)")
                except ValueError:
                    print("timing run failed:", out.stderr[-2000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
