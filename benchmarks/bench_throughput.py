"""The throughput model's error on every baseline, leave-one-out: a case's own baselines never fit the
constants that predict it. Prints one line per baseline (measured and predicted tokens/s per card), the
median and worst absolute error, the fitted constants, and whether the guides' measured orders hold.

    python benchmarks/bench_throughput.py > results/bench-throughput-$(date +%F).txt
"""

from __future__ import annotations

import statistics

from harness.fit.throughput import calibrate, observations


def main() -> None:
    obs = observations()
    errors = []
    print(f"{'platform':<28} {'case@variant':<62} {'measured':>9} {'predicted':>9} {'error':>7}")
    for o in obs:
        predicted = calibrate(frozenset({o.case_id})).tokens_per_s(o.work)
        error = predicted / o.tokens_per_s - 1
        errors.append(abs(error))
        name = o.case_id + (f"@{o.variant}" if o.variant else "")
        print(f"{o.platform:<28} {name:<62} {o.tokens_per_s:>9.0f} {predicted:>9.0f} {error:>+7.0%}")
    print(f"\n{len(obs)} baselines; absolute error median {statistics.median(errors):.0%}, "
          f"worst {max(errors):.0%}; within 25%: {sum(e <= 0.25 for e in errors)}")
    model = calibrate()
    print("\nconstants fitted on every baseline:")
    for k, v in model.values.items():
        print(f"  {k:<32} {v:.4g}")
    print("\norders (measured on one H100; predicted leave-one-out):")
    for ids in (["001-ladder-rung1-zero2", "001-ladder-rung2-zero2-offload", "001-ladder-rung3-zero3",
                 "001-ladder-rung4-zero3-offload"],
                ["003-qlora-fix-r32-seq1024-gc", "003-qlora-fix-r16-seq512-gc"],
                ["004-gla-plan-a-minimal", "004-gla-plan-b-bs2", "004-gla-plan-c-1proc"]):
        rows = [o for o in obs if o.case_id in ids and o.variant in ("", "u") and o.platform.startswith("nvidia-h100")]
        measured = [max(o.tokens_per_s for o in rows if o.case_id == i) for i in ids]
        predicted = [calibrate(frozenset({i})).tokens_per_s(next(o.work for o in rows if o.case_id == i))
                     for i in ids]
        holds = measured == sorted(measured, reverse=True) and predicted == sorted(predicted, reverse=True)
        print(f"  {' > '.join(ids)}: measured {', '.join(f'{m:.0f}' for m in measured)}; "
              f"predicted {', '.join(f'{p:.0f}' for p in predicted)}: {'holds' if holds else 'DOES NOT HOLD'}")


if __name__ == "__main__":
    main()
