"""ZeRO-3 with `overlap_comm: false`: the model's allocations and DeepSpeed's gathers in one pool.

    .venv/bin/python benchmarks/bench_zero3_one_pool.py [timeline.json.gz]

With `overlap_comm: false` DeepSpeed 0.19.8's coordinator gathers on the current stream, so its
all-gather buffers share the caching allocator's pool with the model's activations. The default
timeline is fit's verified config for guide 000 (DeepSeek-R1-Distill-Qwen-32B LoRA r8, 2 ranks,
4 layers, rank 0, two optimizer steps of two micro-steps). Printed:

1. **The recording, taken apart.** Reserved at the end of each phase: recorded; replayed through the
   allocator model with the gather paths' allocations (`partition_parameters.py`'s buffers and the
   parameters copied out of them) on a stream of their own, as `overlap_comm: true` would place them;
   and with them left out (the model's pool alone).
2. **The one-pool stream built from the trace** at 4 and 8 layers (`harness.predict.zero3.stream`):
   reserved at the end of each phase, the peaks, with a layer chunk's hook events spread evenly over
   it (what the predictor uses), all at its start, all at its end, and with no gathers (the model's
   pool alone). The trace tags its events by decoder layer and pass, not by module, so where in a
   layer's chunk a module's hooks fire is not known.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GiB, MiB = 2**30, 2**20
TIMELINE = ROOT / "results/fitted/timelines/nvidia-h200-x2/000-ds32b-failing.fitted@2r4L2ga.json.gz"
CASE = ROOT / "benchmarks/fitted/cases/000-ds32b-failing.fitted.yaml"
# call sites of the gather paths' device allocations (with parameters on the device)
GATHER_SITES = ("partition_parameters.py:1343", "partition_parameters.py:1388", "utils/nvtx.py:33")


def _phase_ends(timeline, reserved: list[int]) -> list[tuple[str, int]]:
    return [(phase, reserved[end - 1]) for phase, _, end in timeline.phase_spans()]


def taken_apart(timeline) -> list[str]:
    """Section 1."""
    from harness.measure.timeline import ALLOC, FREE_COMPLETED, FREE_REQUESTED, MemoryTimeline
    from harness.predict.allocator.replay import replay

    def site(i: int) -> str:
        return timeline.sites[timeline.site[i]] if timeline.site[i] >= 0 else "?"

    gather = []  # per action: whether it belongs to an allocation of the gather paths in the step
    owner: dict[int, bool] = {}
    for i, act in enumerate(timeline.action):
        if act == ALLOC:
            owner[timeline.addr[i]] = timeline.phase[i] >= 2 and any(s in site(i) for s in GATHER_SITES)
            gather.append(owner[timeline.addr[i]])
        elif act in (FREE_REQUESTED, FREE_COMPLETED):
            gather.append(owner.get(timeline.addr[i], False))
        else:
            gather.append(False)
    data = timeline.model_dump()
    data["stream"] = [7 if g else s for g, s in zip(gather, data["stream"], strict=True)]
    apart = replay(MemoryTimeline.model_validate(data), limit=None)
    data = timeline.model_dump()
    keep = [not g for g in gather]
    for name in ("t_us", "action", "addr", "size", "stream", "site", "phase"):
        data[name] = [v for v, k in zip(data[name], keep, strict=True) if k]
    alone = replay(MemoryTimeline.model_validate(data), limit=None)
    position = {old: new for new, old in enumerate(i for i, k in enumerate(keep) if k)}
    curve = timeline.curve()
    lines = [f"{'phase':10s} {'recorded':>9s} {'gathers apart':>14s} {'model alone':>12s}"]
    for phase, start, end in timeline.phase_spans():
        last = max((i for i in range(start, end) if i in position), default=None)
        alone_gib = alone.reserved[position[last]] / GiB if last is not None else float("nan")
        lines.append(f"{phase:10s} {curve.reserved[end - 1] / GiB:9.3f} {apart.reserved[end - 1] / GiB:14.3f} "
                     f"{alone_gib:12.3f}")
    own = sum(s.size for s in apart.segments_at_peak if s.stream == 7)
    lines.append(f"{'peak':10s} {curve.peak('reserved')[1] / GiB:9.3f} {apart.peak_reserved / GiB:14.3f} "
                 f"{alone.peak_reserved / GiB:12.3f}   (gathers apart: {own / GiB:.3f} GiB on their own stream)")
    return lines


def main(argv: list[str]) -> int:
    from harness.measure.timeline import MemoryTimeline
    from harness.spec.cases import load_case
    from harness.spec.variants import parse_variant

    timeline = MemoryTimeline.load(Path(argv[0]) if argv else TIMELINE)
    print(f"1. {timeline.case_id}@{timeline.variant}, rank {timeline.rank}: reserved at the end of each phase, GiB")
    print("\n".join("   " + line for line in taken_apart(timeline)))
    recorded = [r for _, r in _phase_ends(timeline, timeline.curve().reserved)]
    from harness.models.source import load_model
    from harness.predict.allocator.allocator import AllocatorConf
    from harness.predict.trace.trace import TraceSpec, trace_pair
    from harness.predict.zero3.stream import PLACEMENTS, OnePoolShape, build, simulate

    case = load_case(CASE)
    print("\n2. The one-pool stream built from the trace: reserved at the end of each phase, GiB (load, engine, "
          "then forward, backward, micro-step end for each of four micro-steps)")
    for variant in ("2r4L", "2r8L"):
        applied = parse_variant(variant).apply(case)
        arch = load_model(applied.model)
        traces = trace_pair(TraceSpec.of(applied, arch))
        for placement in PLACEMENTS:
            run = simulate(build(*traces, OnePoolShape.of(applied, arch, applied.layers, placement)), AllocatorConf())
            row = " ".join(f"{r / GiB:.2f}" for _, r in run.phase_ends)
            print(f"   {variant} gathers {placement:6s}: peak {run.peak_reserved / GiB:6.3f} allocated "
                  f"{run.peak_allocated / GiB:6.3f} | {row}")
        if variant == "2r4L":
            print(f"   {variant} recorded       : peak {max(recorded) / GiB:6.3f} allocated "
                  f"{timeline.curve().peak()[1] / GiB:6.3f} | " + " ".join(f"{r / GiB:.2f}" for r in recorded))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
