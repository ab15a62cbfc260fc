"""ZeRO-2 with optimizer offload (harness.predict.zero2_stream): the stream with DeepSpeed's flat buffer
and the boundary's gradient casts, against the recorded timeline of the architecture benchmark's full
fine-tune (Qwen2.5-1.5B, rank 0 of 2, 2 x H200)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.measure.timeline import MemoryTimeline
from harness.predict.step import LAYER_POST, LAYER_PRE
from harness.predict.stream import module_order
from harness.predict.zero2_stream import applies, partition_slices

ROOT = Path(__file__).resolve().parent.parent
CASE_ID = "qwen25-1.5b-full-z2-offload-mb4-s1024-gc"
TIMELINE = ROOT / f"results/architectures/timelines/nvidia-h200-x2/{CASE_ID}@2ga.json.gz"
GiB = 2**30


def test_partition_slices_split_the_padded_flat_buffer_between_ranks():
    # 10 elements over 2 ranks, padded to 12 (2 x ranks): rank 0 holds [0, 6), rank 1 [6, 12)
    assert partition_slices([4, 4, 2], 2, 0) == [4, 2]
    assert partition_slices([4, 4, 2], 2, 1) == [2, 2]
    assert partition_slices([7], 1, 0) == [7]


def test_module_order_puts_the_layers_between_what_comes_before_and_after():
    rows = [[1, 2, 0, 1, LAYER_POST, 0], [2, 2, 0, 1, 1, 0], [3, 2, 0, 1, LAYER_PRE, 0], [4, 2, 0, 1, 0, 0]]
    assert [r[0] for r in module_order(rows)] == [3, 4, 2, 1]


def _measured():
    import statistics

    from harness.baselines.store import load_baselines
    from harness.predict.errors import ARCH_BASELINES_DIR, ARCH_CASES_DIR
    from harness.spec.cases import load_case

    b = next(b for b in load_baselines(ARCH_BASELINES_DIR) if b.case_id == CASE_ID)
    ok = [r for r in b.runs if r.outcome == "ok"]
    case = b.case_as_measured(load_case(ARCH_CASES_DIR / f"{CASE_ID}.yaml"))
    return case, b.platform.key, {k: statistics.median(getattr(r, f"{k}_peak") for r in ok)
                                  for k in ("allocated", "reserved")}


def test_only_full_fine_tunes_under_zero2_with_optimizer_offload_take_the_stream():
    from harness.spec.cases import CASES_DIR, load_case

    case, _, _ = _measured()
    assert applies(case)
    assert not applies(load_case(CASES_DIR / "001-ladder-rung2-zero2-offload.yaml"))  # LoRA: the ratio
    assert not applies(load_case(CASES_DIR / "001-ladder-rung1-zero2.yaml"))  # no offload


def test_the_stream_against_the_recorded_timeline():
    """The load, the engine's flat buffer and the first micro-step land on the recorded reserve; the
    boundary's casts take segments of DeepSpeed's reduction stream, which the default stream's cache
    cannot serve, and they make the run's reserved peak."""
    from harness.models.source import load_model
    from harness.predict.allocator import AllocatorConf, CachingAllocator
    from harness.predict.trace import TraceSpec, trace_pair
    from harness.predict.zero2_stream import EMPTY_CACHE, REDUCTION_STREAM, Zero2Shape, build, simulate

    tl = MemoryTimeline.load(TIMELINE)
    curve = tl.curve()
    recorded = {}  # phase -> (allocated peak, reserved at its end), the first span of each
    for phase, start, end in tl.phase_spans():
        recorded.setdefault(phase, (max(curve.allocated[start:end]), curve.reserved[end - 1]))
    _, recorded_peak = curve.peak("reserved")

    case, _, _ = _measured()
    arch = load_model(case.model)
    spec = TraceSpec.of(case, arch)
    r1, r2 = trace_pair(spec)
    shape = Zero2Shape.of(case, arch.layers)
    stream, side = build(r1, r2, shape, tl.rank)
    sim, blocks, at_end = CachingAllocator(AllocatorConf()), {}, {}
    starts = {start: name for name, start in stream.phases}
    peak_alloc, current = 0, None
    for i, op in enumerate(stream.ops):
        if i in starts:
            if current is not None:
                at_end.setdefault(current, (peak_alloc, sim.stats.reserved))
            current, peak_alloc = starts[i], 0
        if op is EMPTY_CACHE:
            sim.empty_cache()
        elif op >= 0:
            blocks[op] = sim.malloc(stream.sizes[op], REDUCTION_STREAM if op in side else 0)
        else:
            sim.free(blocks.pop(-op - 1))
        peak_alloc = max(peak_alloc, sim.stats.allocated)
    for phase in ("load", "engine"):
        assert at_end[phase][0] == pytest.approx(recorded[phase][0], rel=0.005), phase
        assert at_end[phase][1] == pytest.approx(recorded[phase][1], rel=0.005), phase
    assert at_end["step"][1] == pytest.approx(recorded["backward"][1], rel=0.01)  # 14.33 GiB after one micro-step
    recorded_side = _recorded_segments_off_the_default_stream(tl)
    peak, _, _, side_reserved = simulate(stream, side, AllocatorConf())
    assert side_reserved == pytest.approx(recorded_side, rel=0.05)  # 1.88 GiB recorded
    assert peak == pytest.approx(recorded_peak, rel=0.01)  # 16.21 GiB


def _recorded_segments_off_the_default_stream(tl: MemoryTimeline) -> int:
    from harness.measure.timeline import SEGMENT_ALLOC, SEGMENT_FREE

    total = 0
    for act, size, stream in zip(tl.action, tl.size, tl.stream, strict=True):
        if stream != 0 and act == SEGMENT_ALLOC:
            total += size
        elif stream != 0 and act == SEGMENT_FREE:
            total -= size
    return total


def test_the_prediction_of_the_full_fine_tune_under_zero2_offload():
    from harness.predict.predictor import predict

    case, platform, measured = _measured()
    p = predict(case, platform=platform, exclude={case.id})
    assert p.reserved == pytest.approx(measured["reserved"], rel=0.02)  # 16.21 GiB (the ratio gave 13.57)
    assert p.terms["zero2_reduction_stream_segments"] > 1.5 * GiB
    assert any("reduction stream" in n for n in p.notes)
