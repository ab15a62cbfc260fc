"""The throughput model's error on every baseline, leave-one-case-out: a case's own baselines (every
platform's, every variant's) never fit the constants that predict it. Prints one line per baseline
(measured tokens/s per card, predicted with the platform's constants and with the pooled ones), the
median and worst absolute error per platform, each platform's fitted constants, and whether the
guides' measured orders hold.

    python benchmarks/bench_throughput.py > results/bench-throughput-$(date +%F).txt
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from harness.baselines.store import load_baselines
from harness.fit.throughput import TERMS, calibrate, observations

ORDERS = (["001-ladder-rung1-zero2", "001-ladder-rung2-zero2-offload", "001-ladder-rung3-zero3",
           "001-ladder-rung4-zero3-offload"],
          ["003-qlora-fix-r32-seq1024-gc", "003-qlora-fix-r16-seq512-gc"],
          ["004-gla-plan-a-minimal", "004-gla-plan-b-bs2", "004-gla-plan-c-1proc"])
H100 = "nvidia-h100-80gb-hbm3-x1"


def _summary(errors: list[float]) -> str:
    worst = max(errors, key=abs)
    return (f"median {statistics.median(abs(e) for e in errors):.0%}, worst {worst:+.0%}, "
            f"within 25%: {sum(abs(e) <= 0.25 for e in errors)} of {len(errors)}")


def main() -> None:
    obs = observations()
    own, pooled = defaultdict(list), defaultdict(list)
    print(f"{'platform':<26} {'case@variant':<62} {'thr':>3} {'measured':>9} {'platform':>9} {'error':>6} "
          f"{'pooled':>9} {'error':>6}")
    for o in obs:
        mine = calibrate(frozenset({o.case_id}), o.platform).tokens_per_s(o.work)
        every = calibrate(frozenset({o.case_id})).tokens_per_s(o.work)
        own[o.platform].append(mine / o.tokens_per_s - 1)
        pooled[o.platform].append(every / o.tokens_per_s - 1)
        name = o.case_id + (f"@{o.variant}" if o.variant else "")
        print(f"{o.platform:<26} {name:<62} {o.work.threads:>3} {o.tokens_per_s:>9.0f} {mine:>9.0f} "
              f"{own[o.platform][-1]:>+6.0%} {every:>9.0f} {pooled[o.platform][-1]:>+6.0%}")
    print("\nabsolute error, leave-one-case-out (per-platform constants | pooled constants):")
    for platform in sorted(own):
        print(f"  {platform:<26} {_summary(own[platform])} | {_summary(pooled[platform])}")
    cold = [f"{b.platform.key} {b.case_id}" + (f"@{b.variant}" if b.variant else "") for b in load_baselines()
            if (ok := [r for r in b.runs if r.outcome == "ok"]) and all(r.triton_cache == "cold" for r in ok)]
    everything = [e for v in own.values() for e in v]
    print(f"  {'all ' + str(len(obs)) + ' baselines':<26} {_summary(everything)} | "
          f"{_summary([e for v in pooled.values() for e in v])}")
    print(f"  left out, every run on a cold Triton cache: {', '.join(cold) or 'none'}")

    models = {p: calibrate(platform=p) for p in sorted(own)}
    models["pooled"] = calibrate()
    print("\nconstants fitted on every baseline (per platform; pooled):")
    print(f"  {'':<32} " + " ".join(f"{p[:14]:>14}" for p in models))
    for k in TERMS:
        print(f"  {k:<32} " + " ".join(f"{m.values[k]:>14.4g}" for m in models.values()))
    for p in ("nvidia-h100-80gb-hbm3-x8", "nvidia-h100-pcie-x1", "nvidia-h200-x8", "hygon-k100-x8"):
        print(f"  {p}: {calibrate(platform=p).notes[-1]}")

    print(f"\norders (measured on {H100}; predicted leave-one-case-out with its constants):")
    for ids in ORDERS:
        rows = [o for o in obs if o.case_id in ids and o.variant in ("", "u") and o.platform == H100]
        measured = [max(o.tokens_per_s for o in rows if o.case_id == i) for i in ids]
        predicted = [calibrate(frozenset({i}), H100).tokens_per_s(next(o.work for o in rows if o.case_id == i))
                     for i in ids]
        holds = measured == sorted(measured, reverse=True) and predicted == sorted(predicted, reverse=True)
        print(f"  {' > '.join(ids)}: measured {', '.join(f'{m:.0f}' for m in measured)}; "
              f"predicted {', '.join(f'{p:.0f}' for p in predicted)}: {'holds' if holds else 'DOES NOT HOLD'}")


if __name__ == "__main__":
    main()
