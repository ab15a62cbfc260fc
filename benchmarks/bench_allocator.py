"""The allocator model against the allocator: every recorded timeline in results/timelines replayed.

    .venv/bin/python benchmarks/bench_allocator.py [results/timelines]

For each timeline (one rank's recorded allocator history, `oom-harness run --memory-history`) the
allocations and frees are replayed through `harness.predict.allocator` under the run's
PYTORCH_CUDA_ALLOC_CONF and memory cap, and the table shows the recorded reserved peak (from the
recorded segment actions), the simulated one, their error, where each ran out of memory under a cap,
and the replay's speed in actions per second.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GiB = 2**30


def main(argv: list[str]) -> int:
    from harness.measure.timeline import MemoryTimeline
    from harness.predict.replay import recorded_limit, replay

    folder = Path(argv[0]) if argv else ROOT / "results" / "timelines"
    paths = sorted(folder.glob("*/*.json.gz"))
    if not paths:
        print(f"no timelines under {folder}")
        return 1
    head = (f"{'platform/timeline':<78} {'actions':>8} {'conf':<12} {'cap GiB':>8} {'recorded':>9} "
            f"{'simulated':>9} {'diff MiB':>9} {'error':>7} {'OOM rec/sim':>13} {'actions/s':>10}")
    print(head)
    print("-" * len(head))
    worst = 0.0
    for path in paths:
        timeline = MemoryTimeline.load(path)
        _, recorded = timeline.curve().peak("reserved")
        limit = recorded_limit(timeline, ROOT / "results" / "runs")
        t0 = time.perf_counter()
        result = replay(timeline, limit=limit)
        seconds = time.perf_counter() - t0
        error = (result.peak_reserved - recorded) / recorded if recorded else 0.0
        worst = max(worst, abs(error))
        oom = f"{_index(result.recorded_oom_index)}/{_index(result.oom_index)}"
        cap = f"{limit / GiB:.2f}" if limit else "-"
        print(f"{path.parent.name + '/' + path.name.removesuffix('.json.gz'):<78} {len(timeline):>8} "
              f"{timeline.alloc_conf or 'default':<12.12} {cap:>8} {recorded / GiB:>9.3f} "
              f"{result.peak_reserved / GiB:>9.3f} {(result.peak_reserved - recorded) / 2**20:>+9.0f} "
              f"{100 * error:>+6.2f}% {oom:>13} {len(result.reserved) / seconds:>10.0f}")
    print(f"\nreserved peaks in GiB; worst error {100 * worst:.2f}% (target 1%)")
    return 0


def _index(i: int | None) -> str:
    return "-" if i is None else str(i)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
