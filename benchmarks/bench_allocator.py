"""The allocator model against the allocator: every recorded timeline in results/timelines replayed.

    .venv/bin/python benchmarks/bench_allocator.py [results/timelines ...]

(default: the timelines of every bundled suite, results/timelines, results/architectures/timelines and
results/fitted/timelines; a case is looked up in every suite.)

For each timeline (one rank's recorded allocator history, `oom-harness run --memory-history`) the
allocations and frees are replayed through `harness.predict.allocator.allocator` under the run's
PYTORCH_CUDA_ALLOC_CONF and memory cap, and the table shows the recorded reserved peak (from the
recorded segment actions), the simulated one, their error, where each ran out of memory under a cap,
and the replay's speed in actions per second.

Then, for each timeline of a case without DeepSpeed (whose predicted reserved figure is the allocator
model's), the stream the predictor builds from the fake-tensor trace (`harness.predict.allocator.stream`, the
case at the timeline's variant) beside the recording: bytes allocated during the load, allocated and
reserved at its end, and the allocated and reserved peaks after the load (the run's step figures: a
recorded load may also build the random-weight checkpoint on the card, then empty the cache), the built
run replayed as the predictor replays it (optimizer steps until the allocator's state repeats).
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
    from harness.predict.allocator.replay import recorded_limit, replay

    folders = [Path(a) for a in argv] or [ROOT / "results" / d / "timelines" for d in (".", "architectures", "fitted")]
    paths = sorted(p for folder in folders for p in folder.glob("*/*.json.gz"))
    timelines = [(path, MemoryTimeline.load(path)) for path in paths]  # read once, for both tables
    if not timelines:
        print(f"no timelines under {', '.join(map(str, folders))}")
        return 1
    head = (f"{'platform/timeline':<78} {'actions':>8} {'conf':<12} {'cap GiB':>8} {'recorded':>9} "
            f"{'simulated':>9} {'diff MiB':>9} {'error':>7} {'OOM rec/sim':>13} {'actions/s':>10}")
    print(head)
    print("-" * len(head))
    worst = 0.0
    for path, timeline in timelines:
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
    built(timelines)
    return 0


def built(timelines: list) -> None:
    """The predictor's stream, built from the trace, against each recorded run without DeepSpeed
    (`timelines`: (path, MemoryTimeline) pairs)."""
    from harness.measure.timeline import ALLOC
    from harness.models.source import load_model
    from harness.predict.allocator.allocator import CachingAllocator
    from harness.predict.allocator.stream import RunShape, run_stream, simulate_run, start_states
    from harness.predict.trace.trace import TraceSpec, trace_pair
    from harness.spec.cases import load_case
    from harness.spec.suite import SUITES
    from harness.spec.variants import parse_variant

    print("\nbuilt from the trace (harness.predict.allocator.stream) / recorded, GiB; the load's bytes in MiB; peaks "
          "after the load:")
    head = (f"{'platform/timeline':<60} {'load MiB':>17} {'alloc after load':>17} {'reserved after load':>19} "
            f"{'allocated peak':>15} {'reserved peak':>15} {'error':>7}")
    print(head)
    print("-" * len(head))
    for path, timeline in timelines:
        case = load_case(next((d / f"{timeline.case_id}.yaml" for _, d in SUITES.values()
                               if (d / f"{timeline.case_id}.yaml").is_file()), Path(f"{timeline.case_id}.yaml")))
        if case.deepspeed is not None:
            continue
        if timeline.variant:
            case = parse_variant(timeline.variant).apply(case)
        arch = load_model(case.model)
        spec = TraceSpec.of(case, arch)
        r1, r2 = trace_pair(spec)
        # loaded as the recorded process loaded it: onto a device that already held a tensor (the recording's
        # first action, torchaudio's), which shrinks from_pretrained's warm-up
        # (harness.predict.allocator.stream.start_states)
        shape = start_states(RunShape.of(case, spec, case.layers or arch.layers))[-1]
        stream = run_stream(r1, r2, shape, 1)  # its load
        sim = simulate_run(r1, r2, shape)  # the run, as the predictor replays it
        curve = timeline.curve()
        _, end = next(s for s in timeline.phase_spans() if s[0] == "load")[1:]
        rec_load = sum(timeline.size[i] for i in range(end) if timeline.action[i] == ALLOC)
        first_step = next(start for name, start in stream.phases if name == "step")
        ops = stream.ops[:first_step]
        built_load = sum(stream.sizes[op] for op in ops if op >= 0)
        model, blocks = CachingAllocator(), {}
        for op in ops:
            if op >= 0:
                blocks[op] = model.malloc(stream.sizes[op])
            else:
                model.free(blocks.pop(-op - 1))
        alloc, reserved = model.stats.allocated, model.stats.reserved
        # the run's own figures: from the end of the load on (its `step` peaks; the load may also have built
        # the checkpoint on the card, then emptied the cache)
        rec_alloc_peak = max(curve.allocated[end:], default=0)
        rec_res_peak = max(curve.reserved[end:], default=0)
        print(f"{path.parent.name + '/' + path.name.removesuffix('.json.gz'):<60} "
              f"{built_load / 2**20:>8.0f}/{rec_load / 2**20:<8.0f} "
              f"{alloc / GiB:>8.3f}/{curve.allocated[end - 1] / GiB:<8.3f} "
              f"{reserved / GiB:>9.3f}/{curve.reserved[end - 1] / GiB:<9.3f} "
              f"{sim.peak_allocated / GiB:>7.3f}/{rec_alloc_peak / GiB:<7.3f} "
              f"{sim.peak_reserved / GiB:>7.3f}/{rec_res_peak / GiB:<7.3f} "
              f"{100 * (sim.peak_reserved / rec_res_peak - 1):>+6.2f}%")


def _index(i: int | None) -> str:
    return "-" if i is None else str(i)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
