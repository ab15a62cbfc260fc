"""ZeRO-2 (harness.predict.zero2.stream): the stream with DeepSpeed's buffers in it. With the optimizer on
the host: the flat buffer and the boundary's gradient casts, against the recorded timeline of the
architecture benchmark's full fine-tune (Qwen2.5-1.5B, rank 0 of 2, 2 x H200). With the optimizer on the
device: the engine's casts and partitions, the IPG buckets and the gradient partition, against the three
recorded LoRA timelines (fit's config for guide 001's rung 1 on one H200, Qwen2.5-7B and OLMoE-1B-7B on
rank 0 of 2 x H200)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.measure.timeline import MemoryTimeline
from harness.predict.allocator.stream import Stream, module_order
from harness.predict.dispatch import route_for
from harness.predict.step import LAYER_POST, LAYER_PRE, ParamInfo, TraceResult
from harness.predict.zero2.stream import (
    REDUCTION_STREAM,
    Zero2Shape,
    _merged,
    _Reducer,
    _Shared,
    _shared_run,
    partition_slices,
    simulate,
)

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


def _measured(case_id: str = CASE_ID, suite: str = "architectures"):
    import statistics

    from harness.baselines.store import load_baselines
    from harness.spec.cases import load_case
    from harness.spec.suite import SUITES

    baselines, cases = SUITES[suite]
    b = next(b for b in load_baselines(baselines) if b.case_id == case_id)
    ok = [r for r in b.runs if r.outcome == "ok"]
    case = b.case_as_measured(load_case(Path(cases) / f"{case_id}.yaml"))
    return case, b.platform.key, {k: statistics.median(getattr(r, f"{k}_peak") for r in ok)
                                  for k in ("allocated", "reserved")}


def _streamed(case) -> bool:
    return route_for(case).reserved == "zero2_stream"


def test_which_zero2_configs_take_the_stream():
    from harness.spec.cases import CASES_DIR, load_case

    case, _, _ = _measured()
    assert _streamed(case)  # a full fine-tune, the optimizer on the host
    assert _streamed(load_case(CASES_DIR / "001-ladder-rung2-zero2-offload.yaml"))  # LoRA, the optimizer on the host
    assert _streamed(load_case(CASES_DIR / "001-ladder-rung1-zero2.yaml"))  # LoRA, the optimizer on the device
    assert _streamed(load_case(CASES_DIR / "000-qlora4bit-z2-cutoff512.yaml"))  # QLoRA, on the device
    assert not _streamed(load_case(CASES_DIR / "001-ladder-rung3-zero3.yaml"))  # ZeRO-3
    rung1 = load_case(CASES_DIR / "001-ladder-rung1-zero2.yaml")
    ds = rung1.deepspeed.model_copy(update={"contiguous_gradients": False})
    scattered = rung1.model_copy(update={"deepspeed": ds})
    assert not _streamed(scattered)  # no copy_grads_in_partition: the ratio
    assert route_for(scattered).reserved == "ratio"
    expandable = rung1.model_copy(update={"launch": rung1.launch.model_copy(
        update={"env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}})})
    assert route_for(expandable).reserved == "zero2_stream"  # the allocator model follows expandable segments
    other = rung1.model_copy(update={"launch": rung1.launch.model_copy(
        update={"env": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}})})
    assert route_for(other).reserved == "ratio"


def test_the_stream_against_the_recorded_timeline():
    """The load, the engine's flat buffer and the first micro-step land on the recorded reserve; the
    boundary's casts take segments of DeepSpeed's reduction stream, which the default stream's cache
    cannot serve, and they make the run's reserved peak."""
    from harness.models.source import load_model
    from harness.predict.allocator.allocator import AllocatorConf
    from harness.predict.trace.trace import TraceSpec, trace_pair
    from harness.predict.zero2.stream import Zero2Shape, build, simulate

    tl = MemoryTimeline.load(TIMELINE)
    recorded, at_end = {}, {}  # phase -> (allocated peak, reserved at its end), the first span of each
    for phase, allocated, reserved in _recorded_phases(tl):
        recorded.setdefault(phase, (allocated, reserved))
    _, recorded_peak = tl.curve().peak("reserved")

    case, _, _ = _measured()
    arch = load_model(case.model)
    spec = TraceSpec.of(case, arch)
    r1, r2 = trace_pair(spec)
    shape = Zero2Shape.of(case, arch.layers)
    stream, side = build(r1, r2, shape, tl.rank)
    for phase, allocated, reserved in _built_phases(stream, side):
        at_end.setdefault(phase, (allocated, reserved))
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


# --- the optimizer on the device -------------------------------------------------------------------------

ON_DEVICE = {  # case id, suite, recorded timeline
    "rung1": ("001-rung1-zero2.fitted", "fitted",
              ROOT / "results/fitted/timelines/nvidia-h200-x1/001-rung1-zero2.fitted@2ga.json.gz"),
    "qwen25-7b": ("qwen25-7b-lora-z2-mb2-s1024-gc", "architectures",
                  ROOT / "results/architectures/timelines/nvidia-h200-x2/qwen25-7b-lora-z2-mb2-s1024-gc@2ga.json.gz"),
    "olmoe": ("olmoe-1b-7b-lora-z2-mb2-s1024-gc", "architectures",
              ROOT / "results/architectures/timelines/nvidia-h200-x2/olmoe-1b-7b-lora-z2-mb2-s1024-gc@2ga.json.gz"),
}


def _shape(bucket: int, ranks: int = 1) -> Zero2Shape:
    return Zero2Shape(layers=1, grad_accum=2, ranks=ranks, half_bytes=2, overlap_comm=True, offload=False,
                      bucket=bucket)


def _hook(bucket: int, sizes: list[int], ranks: int = 1, keep: bool = True):
    shared = _Shared(Stream([], [], []), [[] for _ in range(ranks)], [], [], True)
    return shared, _Reducer(shared, _shape(bucket, ranks), sizes, keep_partition=keep)


def _own_allocations(shared, rank: int) -> list[int]:
    return [op for _, op in shared.side[rank] if op >= 0]


def test_the_gradient_hook_fills_the_bucket_and_reduces_it_before_it_overflows():
    sizes = [4, 4, 4, 4]  # one rank: every parameter is in its partition
    shared, hook = _hook(8, sizes)
    stream = shared.stream
    grads = [stream.alloc(n * 2) for n in reversed(sizes)]
    assert [hook(g) for g in grads[:2]] == [True, True]  # copied into the bucket, then freed
    assert [stream.sizes[i] for i in hook.buffers] == [16, 16]  # setup_buckets: two IPG buffers (overlap_comm)
    assert shared.side[0] == []  # the bucket holds 8 elements: not reduced yet
    hook(grads[2])  # 8 + 4 > 8: the bucket is reduced first, and the partition buffer is made
    assert _own_allocations(shared, 0) == [16 * 2]
    kept = hook.epilogue()
    assert kept == {0: 0}  # the first micro-step's buffer is held to the step
    assert stream.ops[-2:] == [-hook.buffers[1] - 1, -hook.buffers[0] - 1]  # the IPG buffers dropped


def test_a_later_micro_steps_partition_buffer_is_freed_at_its_backwards_end():
    shared, hook = _hook(100, [4, 4], keep=False)
    for n in (4, 4):
        hook(shared.stream.alloc(n * 2))
    assert hook.epilogue() == {}
    assert [op for _, op in shared.side[0]] == [8 * 2, -1]


def test_a_reduction_over_two_ranks_partitions_flattens_it_and_only_the_ranks_own_make_its_buffer():
    sizes = [4, 4, 4, 4]  # two ranks: rank 0 holds parameters 0 and 1, which come last in the backward
    shared, hook = _hook(8, sizes, ranks=2)
    grads = [shared.stream.alloc(n * 2) for n in reversed(sizes)]
    for g in grads[:3]:
        hook(g)  # the third reduces parameters 3 and 2: rank 1's
    assert _own_allocations(shared, 0) == [] and _own_allocations(shared, 1) == [8 * 2]
    hook(grads[3])
    hook.epilogue()  # reduces parameters 1 and 0: rank 0's
    assert _own_allocations(shared, 0) == [8 * 2]  # no bucket spanned both partitions: nothing flattened
    shared, hook = _hook(12, sizes, ranks=2)
    for n in reversed(sizes):
        hook(shared.stream.alloc(n * 2))  # parameters 3, 2 and 1 fill the bucket; 0 reduces them
    hook.epilogue()
    for rank in (0, 1):  # they span both partitions: allreduce_bucket's transient, on every rank, freed at once
        assert shared.side[rank][:2] == [(shared.side[rank][0][0], 12 * 2), (shared.side[rank][0][0], -1)]
    assert _own_allocations(shared, 1)[1] == 8 * 2 and _own_allocations(shared, 0)[1] == 8 * 2


def test_a_gradient_larger_than_the_bucket_is_kept_until_its_reduction():
    shared, hook = _hook(4, [2, 10])
    stream = shared.stream
    big = stream.alloc(20)
    assert hook(big) is False and -big - 1 not in stream.ops
    hook(stream.alloc(4))  # 10 + 2 > 4: the bucket (the large gradient) is reduced, and the gradient freed
    assert -big - 1 in stream.ops


def test_one_replay_for_every_rank_gives_each_ranks_own_replay():
    """The ranks differ only in their own allocations on the reduction stream and the step's norm casts:
    one replay of the shared stream, each rank's own allocations beside it, gives what replaying each
    rank's whole stream gives."""
    from harness.predict.allocator.allocator import AllocatorConf

    shared = _Shared(Stream([], [], []), [[], []], [], [[3 * 2**20], [2**20, 2**20]], True)
    stream = shared.stream
    stream.mark("step")
    a = stream.alloc(30 * 2**20)
    shared.side[0].append((len(stream.ops), 12 * 2**20))  # rank 0's buffer, then rank 1's larger one
    b = stream.alloc(8 * 2**20)
    shared.side[1].append((len(stream.ops), 25 * 2**20))
    stream.free(a)
    shared.casts.append(len(stream.ops))
    stream.alloc(40 * 2**20)
    stream.free(b)
    shared.side[0].append((len(stream.ops), -1))
    shared.side[1].append((len(stream.ops), -1))
    run = _shared_run(shared, AllocatorConf())
    whole = [simulate(*_merged(shared, rank), AllocatorConf()) for rank in (0, 1)]
    assert run.rank == 1 and run.peak_reserved == whole[1][0] > whole[0][0]
    assert run.reduction_stream_reserved == whole[1][3]


def test_ranks_with_the_same_own_allocations_are_replayed_once(monkeypatch):
    """Where the ranks' own allocations are on the default stream (no `overlap_comm`), each rank's whole
    stream is replayed; ranks whose own allocations and norm casts are the same have the same stream, and
    one of them is replayed for all. Guide 000's QLoRA at 8 ranks: 8 replays -> 1."""
    from harness.predict.allocator.allocator import AllocatorConf
    from harness.predict.zero2 import stream as zero2_stream

    shared = _Shared(Stream([], [], []), [[], [], []], [], [[2**20], [3 * 2**20], [2**20]], False)
    stream = shared.stream
    stream.mark("step")
    a = stream.alloc(30 * 2**20)
    for rank, size in enumerate((12, 25, 12)):  # ranks 0 and 2 alike, rank 1 larger
        shared.side[rank].append((len(stream.ops), size * 2**20))
    stream.free(a)
    shared.casts.append(len(stream.ops))
    stream.alloc(40 * 2**20)
    for rank in range(3):
        shared.side[rank].append((len(stream.ops), -1))
    whole = [simulate(*_merged(shared, rank), AllocatorConf()) for rank in range(3)]
    assert whole[0] == whole[2] != whole[1]
    replayed = []
    monkeypatch.setattr(zero2_stream, "_build_shared", lambda r1, r2, shape: shared)
    monkeypatch.setattr(zero2_stream, "simulate", lambda *a: replayed.append(a) or simulate(*a))
    run = zero2_stream.zero2_run(None, None, Zero2Shape(layers=1, grad_accum=1, ranks=3, half_bytes=2,
                                                        overlap_comm=False, offload=False))
    assert len(replayed) == 2
    best = max(range(3), key=lambda rank: whole[rank][0])
    assert (run.rank, run.peak_reserved, run.peak_allocated) == (best, whole[best][0], whole[best][1])


def test_with_the_optimizer_on_the_host_ranks_with_the_same_slices_are_built_once(monkeypatch):
    """With the optimizer on the host a rank's stream differs from another's only by the slices of the flat
    buffer its partition holds: one rank of each set with the same slices is built and replayed."""
    from harness.predict.zero2 import stream as zero2_stream

    sizes = [4, 4, 4, 4, 4, 4, 8]  # 8 elements a rank: [4, 4] on ranks 0 to 2, [8] on rank 3
    slices = [partition_slices(sizes, 4, rank) for rank in range(4)]
    monkeypatch.setattr(zero2_stream, "_rows", lambda r1, r2, shape: [(n, None, None, True) for n in sizes])
    built = []

    def build(r1, r2, shape, rank):  # a stream as large as the rank's largest slice
        built.append(rank)
        stream = Stream([], [], [])
        stream.mark("step")
        stream.alloc(max(partition_slices(sizes, 4, rank)) * 16 * 2**20)
        return stream, set()

    monkeypatch.setattr(zero2_stream, "build", build)
    run = zero2_stream.zero2_run(None, None, Zero2Shape(layers=1, grad_accum=1, ranks=4, half_bytes=2,
                                                        overlap_comm=False, offload=True))
    distinct = sorted({tuple(s): r for r, s in reversed(list(enumerate(slices)))}.values())
    assert built == distinct == [0, 3]
    assert run.rank == 3


F_, B_ = 0, 1


def _recorded_phases(tl: MemoryTimeline) -> list[tuple[str, int, int]]:
    curve = tl.curve()
    return [(phase, max(curve.allocated[start:end]), curve.reserved[end - 1]) for phase, start, end in tl.phase_spans()]


def _built_phases(stream: Stream, side: set[int]) -> list[tuple[str, int, int]]:
    from harness.predict.allocator.allocator import AllocatorConf, CachingAllocator
    from harness.predict.zero2.stream import EMPTY_CACHE

    sim, blocks, out = CachingAllocator(AllocatorConf()), {}, []
    starts: dict[int, str] = {}
    for name, start in stream.phases:
        starts.setdefault(start, name)
    current, peak = None, 0
    for i, op in enumerate([*stream.ops, 0]):
        if i in starts or i == len(stream.ops):
            if current is not None:
                out.append((current, peak, sim.stats.reserved))
            if i == len(stream.ops):
                break
            current, peak = starts[i], 0
        if op is EMPTY_CACHE:
            sim.empty_cache()
        elif op >= 0:
            blocks[op] = sim.malloc(stream.sizes[op], REDUCTION_STREAM if op in side else 0)
        else:
            sim.free(blocks.pop(-op - 1))
        peak = max(peak, sim.stats.allocated)
    return out


@pytest.mark.parametrize("name", sorted(ON_DEVICE))
def test_the_on_device_stream_against_the_recorded_timeline(name):
    """The load and the engine land on the recorded reserve; after the first micro-step's backward the
    reserve is the recording's (three fp32 segments of the loss, not four: the backward's cuBLAS workspace
    comes after the loss's backward); the reserved peak is the recording's to 1 %."""
    from harness.models.source import load_model
    from harness.predict.allocator.allocator import AllocatorConf
    from harness.predict.trace.trace import TraceSpec, trace_pair
    from harness.predict.zero2.stream import build

    case_id, suite, path = ON_DEVICE[name]
    tl = MemoryTimeline.load(path)
    case, _, _ = _measured(case_id, suite)
    arch = load_model(case.model)
    r1, r2 = trace_pair(TraceSpec.of(case, arch))
    shape = Zero2Shape.of(case, arch.layers, int(arch.config["hidden_size"]))
    assert not shape.offload and _streamed(case)
    stream, side = build(r1, r2, shape, tl.rank)
    recorded, built = _recorded_phases(tl), _built_phases(stream, side)
    assert [p for p, _, _ in built[:3]] == ["load", "engine", "step"]
    for (phase, _, rec), (_, _, got) in zip(recorded[:2], built[:2], strict=True):
        assert got == pytest.approx(rec, rel=0.005), phase
    first_backward = next(r for p, _, r in recorded if p == "backward")
    assert built[2][2] == pytest.approx(first_backward, rel=0.005)
    _, recorded_peak = tl.curve().peak("reserved")
    peak, _, _, _ = simulate(stream, side, AllocatorConf())
    assert peak == pytest.approx(recorded_peak, rel=0.01)


def test_the_prediction_of_fits_rung1_config_under_zero2():
    """-11.0 % on reserved with the ratio (8.30 against 9.33 GiB)."""
    from harness.predict.predictor import predict

    case, platform, measured = _measured("001-rung1-zero2.fitted", "fitted")
    p = predict(case, platform=platform, exclude={case.id})
    assert p.reserved == pytest.approx(measured["reserved"], rel=0.01)
    assert p.terms["reserved_by_ratio"] < 0.92 * measured["reserved"]


def test_the_load_before_the_engine_holds_the_adapters_and_a_peft_4bit_models_rest_in_fp32():
    from harness.predict.allocator.stream import RunShape, load_stream

    # as a DeepSpeed trace holds them: every parameter in the half dtype
    layout = [[64, 2, 0, 0, LAYER_PRE, 0], [256, 2, 1, 0, 0, 0], [8, 2, 0, 1, 0, 1]]
    r = TraceResult(layers=1, peak=0, held_after_forward=0, logits=0, params=ParamInfo(), seconds=0.0,
                    layout=[list(row) for row in layout])
    shape = RunShape(1, 1, 2, False, False)
    for kbit, wide in ((False, [(8, True)]), (True, [(64, False), (8, True)])):
        stream = Stream([], [], [])
        loaded = load_stream(r, r, shape, stream, before_engine=True, kbit_fp32=kbit)
        assert [(n, grad) for _, n, _, grad in loaded.wide] == wide
        assert all(stream.sizes[ident] == n * 4 for ident, n, _, _ in loaded.wide)
    stream = Stream([], [], [])
    assert load_stream(r, r, shape, stream).wide == []  # without an engine: as the layout holds them
