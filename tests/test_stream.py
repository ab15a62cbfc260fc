"""The allocation stream built from the traced steps (harness.predict.allocator.stream): layer repetition, frees
that cross layers, the load order, and the traced-and-expanded stream of guide 003 against its
recorded GPU timeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.measure.timeline import ALLOC, MemoryTimeline
from harness.predict.allocator.allocator import round_size
from harness.predict.allocator.stream import (
    TENSOR_BEFORE_LOAD,
    RunShape,
    Stream,
    expand,
    layout_at,
    load_stream,
    run_stream,
    simulate,
    simulate_run,
    start_states,
)
from harness.predict.step import LAYER_POST, LAYER_PRE, ParamInfo, TraceResult

MiB = 2**20
LARGE = 64 * 2**10
F, B = 0, 1
TIMELINE = (Path(__file__).resolve().parent.parent
            / "results/timelines/nvidia-h200-x1/003-qlora-fix-r16-seq512-gc@2ga.json.gz")


def result(events, layout=(), layers=2) -> TraceResult:
    return TraceResult(layers=layers, peak=0, held_after_forward=0, logits=0, params=ParamInfo(), seconds=0.0,
                       events=[list(e) for e in events], layout=[list(r) for r in layout])


def two_layer_step():
    """Embedding output (pre) is layer 0's input; each layer's output is the next one's input and is
    freed in the next layer's backward (checkpointing keeps inputs); layer 0's input needs no grad, so
    layer 0 allocates one block less than layer 1, and its backward frees the gradient layer 1 handed
    down."""
    return result([
        (1, 0, 4 * MiB, F, LAYER_PRE),            # embedding output
        (1, 1, 8 * MiB, F, 0), (0, 1, 8 * MiB, F, 0), (1, 2, 4 * MiB, F, 0),  # transient, then output
        (1, 3, 6 * MiB, F, 1), (1, 4, 8 * MiB, F, 1), (0, 4, 8 * MiB, F, 1), (1, 5, 4 * MiB, F, 1),
        (1, 6, 30 * MiB, F, LAYER_POST), (0, 5, 4 * MiB, F, LAYER_POST),  # logits; last output freed
        (0, 6, 30 * MiB, B, LAYER_POST),
        (1, 7, 16 * MiB, B, 1), (0, 7, 16 * MiB, B, 1), (0, 3, 6 * MiB, B, 1), (0, 2, 4 * MiB, B, 1),
        (1, 9, 5 * MiB, B, 1),                    # the gradient of layer 1's input, handed down
        (1, 8, 16 * MiB, B, 0), (0, 9, 5 * MiB, B, 0), (0, 8, 16 * MiB, B, 0), (0, 0, 4 * MiB, B, 0),
    ])


def live_after(stream: Stream) -> set[int]:
    live: set[int] = set()
    for op in stream.ops:
        if op >= 0:
            live.add(op)
        else:
            assert -op - 1 in live, "a free of an allocation that is not live"
            live.remove(-op - 1)
    return live


@pytest.mark.parametrize("layers", [2, 3, 8])
def test_layer_one_repeats_and_every_block_is_freed_once(layers):
    stream = Stream([], [], [])
    left = expand(result([]), two_layer_step(), layers, stream)
    allocs = [op for op in stream.ops if op >= 0]
    # embedding, layer 0's two, three per layer after it, logits; two backward blocks per layer above 0
    assert len(allocs) == 1 + 2 + 3 * (layers - 1) + 1 + 2 * (layers - 1) + 1
    assert left == [] and live_after(stream) == set()


@pytest.mark.parametrize("layers", [2, 5, 16])
def test_a_free_that_crosses_layers_frees_the_previous_layers_block(layers):
    """Layer k's backward frees layer k-1's output (lined up with layer 0's by size), so the forward
    keeps every layer's output and every saved block until the logits: the peak grows by one layer's
    kept bytes (4 + 6 MiB) per layer, as it does at full depth."""
    stream = Stream([], [], [])
    expand(result([]), two_layer_step(), layers, stream)
    live = peak = 0
    for op in stream.ops:
        live += stream.sizes[op] if op >= 0 else -stream.sizes[-op - 1]
        peak = max(peak, live)
    assert peak == (10 * layers + 28) * MiB


@pytest.mark.parametrize("layers", [3, 24])
def test_what_every_layer_keeps_to_the_end_of_the_forward_is_freed_in_every_copy(layers):
    """A block each layer allocates and the forward frees only after the last layer (layer 0's and
    layer 1's both freed there, as fp16 LoRA without checkpointing does with a 21 MiB block per
    layer): at full depth every layer's is freed there, none left live into the next micro-step."""
    stream = Stream([], [], [])
    left = expand(result([]), result([
        (1, 0, 4 * MiB, F, LAYER_PRE),
        (1, 1, 21 * MiB, F, 0), (1, 2, 4 * MiB, F, 0), (0, 0, 4 * MiB, F, 0),
        (1, 3, 21 * MiB, F, 1), (1, 4, 4 * MiB, F, 1), (0, 2, 4 * MiB, F, 1),
        (0, 1, 21 * MiB, F, LAYER_POST), (0, 3, 21 * MiB, F, LAYER_POST), (0, 4, 4 * MiB, F, LAYER_POST),
    ]), layers, stream)
    assert left == [] and live_after(stream) == set()
    kept = [op for op in stream.ops if op >= 0 and stream.sizes[op] == 21 * MiB]
    assert len(kept) == layers


def test_the_layout_repeats_layer_one_in_place_and_loads_the_checkpoint_in_name_order():
    l2 = [[10, 2, 0, 0, LAYER_POST, 0], [20, 2, 0, 0, LAYER_PRE, 0], [1, 2, 0, 0, 0, 0], [2, 2, 1, 0, 0, 0],
          [1, 2, 0, 0, 1, 0], [2, 2, 1, 0, 1, 0], [3, 2, 0, 0, LAYER_POST, 0], [5, 4, 0, 1, 0, 1], [5, 4, 0, 1, 1, 1]]
    out = layout_at([], l2, 4)
    assert [r[4] for r in out] == [LAYER_POST, LAYER_PRE, 0, 0, 1, 1, 1, 1, 1, 1, LAYER_POST, 0, 1, 1, 1]


def test_load_keeps_the_warmup_block_and_an_upcast_frees_the_half_copy():
    layout = [[1024 * 1024, 4, 0, 0, LAYER_PRE, 0], [4096 * 4096, 2, 1, 0, 0, 0], [8, 4, 0, 1, 0, 1]]  # fp32 as trained
    stream = Stream([], [], [])
    load_stream(result([], layout, 1), result([], layout), RunShape(1, 1, 2, True, False), stream)
    assert stream.sizes[0] == 1024 * 1024 * 2 + 4096 * 4096 // 2  # the warm-up: the model as loaded
    live = live_after(stream)
    kept = sorted(stream.sizes[i] for i in live)
    # fp32 embedding, packed 4-bit weight, its quantized absmax and the absmax's absmax, adapter, 2 cuBLAS
    assert 1024 * 1024 * 4 in kept and 4096 * 4096 // 2 in kept and 4096 * 4096 // 64 in kept
    assert 1024 * 1024 * 2 not in kept and 4096 * 4096 * 2 not in kept


def test_a_tensor_made_before_the_load_shrinks_the_warmup_by_the_cache_it_leaves_unused():
    """transformers' `caching_allocator_warmup` asks for the model's size less what the cache holds reserved
    and unused: a 4-byte tensor takes a 512-byte block of a 2 MiB small-pool segment, so the warm-up is
    2 MiB - 512 bytes smaller, and the tensor stays. A model no larger than twice that cache gets no
    warm-up block; a load from a config has none, so it has one start state."""
    layout = [[1024 * 1024, 4, 0, 0, LAYER_PRE, 0], [4096 * 4096, 2, 1, 0, 0, 0]]
    shape = RunShape(1, 1, 2, True, False)
    empty, held = start_states(shape)
    assert (empty.held_before_load, held.held_before_load) == (0, TENSOR_BEFORE_LOAD)
    model = 1024 * 1024 * 2 + 4096 * 4096 // 2
    stream = Stream([], [], [])
    load_stream(result([], layout, 1), result([], layout), held, stream)
    assert stream.sizes[:2] == [TENSOR_BEFORE_LOAD, model - (2 * MiB - 512)]
    assert 0 in live_after(stream)
    tiny = [[1024, 2, 0, 0, LAYER_PRE, 0]]
    stream = Stream([], [], [])
    load_stream(result([], tiny, 1), result([], tiny), held, stream)
    assert stream.sizes == [TENSOR_BEFORE_LOAD, 2048] and not any(op < 0 for op in stream.ops)  # no warm-up
    assert start_states(RunShape(1, 1, 2, True, False, model_source="config")) == [
        RunShape(1, 1, 2, True, False, model_source="config")]


@pytest.mark.parametrize("name", ["llama3-8b-qlora-r16-mb1-s2048-gc", "mistral-7b-qlora-r64-mb4-s1024-gc-llamafactory",
                                  "phi3-mini-qlora-r16-mb4-s1024"])
def test_the_warmup_block_is_the_one_the_recorded_process_allocated(name):
    """Every recorded run began with a tensor on the device (torchaudio's, made as transformers imports it)
    and then allocated its warm-up block: the built load's, from that start, is the same block."""
    r1, r2, shape = _architecture_run(name)
    timeline = MemoryTimeline.load(ARCH_TIMELINES / f"{name}@2ga.json.gz")
    recorded = next(timeline.size[i] for i in range(len(timeline.action)) if timeline.action[i] == ALLOC
                    and timeline.site[i] >= 0 and "caching_allocator_warmup" in timeline.sites[timeline.site[i]])
    stream = Stream([], [], [])
    load_stream(r1, r2, start_states(shape)[1], stream)
    assert round_size(stream.sizes[1]) == recorded


@pytest.fixture(scope="module")
def qlora_003():
    from harness.spec.cases import CASES_DIR

    _, _, r1, r2, shape = _traced(CASES_DIR / "003-qlora-fix-r16-seq512-gc.yaml")
    return run_stream(r1, r2, shape), MemoryTimeline.load(TIMELINE)


def test_the_expanded_stream_of_003_resembles_its_recorded_timeline(qlora_003):
    """Guide 003 (QLoRA r16, 512 tokens, GA 2, one H200): per phase the traced-and-expanded stream
    allocates about as many blocks of 64 KiB and more (the small ones are bitsandbytes' and the
    trainer's bookkeeping) and about as many bytes as the recorded run, and the allocator model over
    it lands on the recorded reserved and allocated peaks within 1%. The bytes are 3.9 % over (4.1 %
    more blocks), in the backward: the trace sums a tensor's gradients out of place where autograd on
    the device adds them in place (docs/predictor.md, Known limits)."""
    stream, timeline = qlora_003
    recorded = []
    for phase, a, b in timeline.phase_spans():
        if phase == "backward":
            continue  # the stream's micro-step is forward + backward
        n = sum(1 for i in range(a, b) if timeline.action[i] == ALLOC and timeline.size[i] >= LARGE)
        size = sum(timeline.size[i] for i in range(a, b) if timeline.action[i] == ALLOC)
        if phase == "forward":
            c = next(s for s in timeline.phase_spans() if s[1] == b)
            n += sum(1 for i in range(c[1], c[2]) if timeline.action[i] == ALLOC and timeline.size[i] >= LARGE)
            size += sum(timeline.size[i] for i in range(c[1], c[2]) if timeline.action[i] == ALLOC)
        recorded.append((phase, n, size))
    bounds = [s for _, s in stream.phases] + [len(stream.ops)]
    built = []
    for (name, start), end in zip(stream.phases, bounds[1:], strict=True):
        ops = [op for op in stream.ops[start:end] if op >= 0]
        built.append((name, sum(1 for op in ops if stream.sizes[op] >= LARGE), sum(stream.sizes[op] for op in ops)))
    assert [r[0] for r in recorded] == [name.replace("step", "forward") for name, _, _ in built]
    for (phase, n, size), (_, m, built_size) in zip(recorded, built, strict=True):
        if phase == "optimizer":
            continue  # AdamW's small per-parameter tensors: counted apart below
        assert abs(m / n - 1) < 0.1, (phase, n, m)
        assert abs(built_size / size - 1) < 0.08, (phase, size, built_size)
    curve = timeline.curve()
    sim = simulate(stream)
    assert abs(sim.peak_reserved / curve.peak("reserved")[1] - 1) < 0.01
    assert abs(sim.peak_allocated / curve.peak("allocated")[1] - 1) < 0.01
    assert sim.peak_phase == "optimizer"  # the first step's moments, as recorded


def test_guide_003_r32_through_peft_takes_the_segment_its_recorded_run_took():
    """Guide 003's r32 config through peft (Qwen1.5-7B nf4, 1 x 1024 tokens, GA 2, one H200): the recorded
    run reserves 12.84 GiB, its second micro-step's backward taking a third 594 MiB segment for the fp32
    logits' gradient, because the warm-up block's free tail is 592.2 MiB. Built from the same start (a
    tensor already on the device), the run reserves what the recording did (to a 2 MiB segment of the small
    pool); from an empty
    device the warm-up block is 2 MiB larger, the gradient fits in it, and the run reserves one segment
    less. The prediction takes the larger."""
    from harness.predict.predictor import predict
    from harness.spec.cases import CASES_DIR

    case, arch, r1, r2, shape = _traced(CASES_DIR / "003-qlora-fix-r32-seq1024-gc.yaml")
    empty, held = start_states(shape)
    timeline = MemoryTimeline.load(TIMELINE.parent / "003-qlora-fix-r32-seq1024-gc@2ga.json.gz")
    recorded = _after_load(timeline)[1]
    built = simulate_run(r1, r2, held).peak_reserved
    assert abs(built - recorded) <= 2 * MiB  # one segment of the small pool
    assert built - simulate_run(r1, r2, empty).peak_reserved == 594 * MiB - 2 * MiB  # and a 2 MiB smaller warm-up
    assert predict(case, arch).reserved == built


def test_the_simulated_run_is_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_PREDICT_CACHE", str(tmp_path))
    from harness.predict.trace import trace as trace_mod

    layout = [[1024, 2, 0, 1, 0, 0], [1024, 2, 0, 1, 1, 0]]
    pair = (result([(1, 0, MiB, F, 0), (0, 0, MiB, B, 0)], layout[:1], 1),
            result([(1, 0, MiB, F, 0), (1, 1, MiB, F, 1), (0, 1, MiB, B, 1), (0, 0, MiB, B, 0)], layout))
    monkeypatch.setattr(trace_mod, "trace_pair", lambda spec: pair)
    spec = trace_mod.TraceSpec(config_json=json.dumps({"x": 1}), seq_len=1, micro_batch=1, kind="full", stack="plain",
                               dtype="bf16", lora_r=None, lora_targets=None, lora_dropout=0.0, checkpointing=False,
                               reentrant=False, deepspeed=False, accumulated_grads=False)
    shape = RunShape(4, 1, 2, False, False)
    trace_mod.simulated_run.cache_clear()
    first = trace_mod.simulated_run(spec, shape)
    assert list(tmp_path.glob("sim-*.json"))
    monkeypatch.setattr(trace_mod, "trace_pair", lambda spec: pytest.fail("a cached run was simulated again"))
    trace_mod.simulated_run.cache_clear()
    assert trace_mod.simulated_run(spec, shape) == first
    trace_mod.simulated_run.cache_clear()


def test_layers_are_tagged_in_a_module_list_of_any_name():
    import torch

    from harness.predict.trace.fake import _decoder_stack, _layer_index

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(4, 4)
            self.h = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
            self.heads = torch.nn.ModuleList(torch.nn.Linear(4, 1) for _ in range(3))

    net = Net()
    stack = _decoder_stack(net, 3)
    assert stack == "h"  # the list of 3 that holds the most parameters
    assert _layer_index("h.2.weight", stack) == 2 and _layer_index("heads.2.weight", stack) is None


def test_fp32_attention_is_laid_out_and_saved_as_the_cuda_kernels_do():
    """fp32 SDPA (the residual stream after peft's k-bit preparation) runs on CUDA's memory-efficient
    kernel, whose output is (batch, sequence, heads, dim) in memory: transformers' transpose(1, 2)
    .contiguous() of it copies nothing. With grouped-query heads that kernel does not apply and the
    math path keeps the score matrix for backward."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from harness.predict.trace.fake import _cuda_sdpa

    saved: list[tuple[int, ...]] = []
    with FakeTensorMode(), _cuda_sdpa():
        q = torch.empty(1, 4, 64, 32, requires_grad=True)  # contiguous, as after Phi-3's rotary concatenation
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        assert out.transpose(1, 2).is_contiguous()
        k = torch.empty(1, 2, 64, 32, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        half = torch.empty(1, 4, 64, 32, dtype=torch.bfloat16)  # the half dtypes keep the traced kernel
        assert torch.nn.functional.scaled_dot_product_attention(half, half, half, is_causal=True).shape == half.shape
    assert (1, 4, 64, 64) in saved


def test_the_trace_reads_the_harness_rows_as_unpacked():
    """On the device transformers finds no packed sequences in the harness's rows (positions 0..n-1) and
    skips the causal mask; on fake tensors it cannot read them, unless the trace answers as the device."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import masking_utils

    from harness.predict.trace.fake import _unpacked_rows

    with FakeTensorMode():
        positions = torch.arange(8).unsqueeze(0)
        assert masking_utils.find_packed_sequence_indices(positions) is not None
        with _unpacked_rows():
            assert masking_utils.find_packed_sequence_indices(positions) is None


ARCH_TIMELINES = Path(__file__).resolve().parent.parent / "results/architectures/timelines/nvidia-h200-x1"


def test_the_built_stream_of_phi3_qlora_lands_on_its_recorded_allocated_peak():
    """Phi-3-mini QLoRA r16 (4 x 1024 tokens, no checkpointing, GA 2, one H200): the fp32 attention's
    output kept once per layer, as the memory-efficient kernel leaves it, puts the built stream's
    allocated peak on the recorded one (a copy of it per layer had put it 4.6% above)."""
    from harness.models.source import load_model
    from harness.predict.step import TraceSpec
    from harness.predict.trace.trace import trace_pair
    from harness.spec.cases import load_case
    from harness.spec.variants import parse_variant

    cases = Path(__file__).resolve().parent.parent / "benchmarks/architectures/cases"
    case = parse_variant("2ga").apply(load_case(cases / "phi3-mini-qlora-r16-mb4-s1024.yaml"))
    arch = load_model(case.model)
    spec = TraceSpec.of(case, arch)
    r1, r2 = trace_pair(spec)
    sim = simulate(run_stream(r1, r2, RunShape.of(case, spec, case.layers or arch.layers)))
    curve = MemoryTimeline.load(ARCH_TIMELINES / "phi3-mini-qlora-r16-mb4-s1024@2ga.json.gz").curve()
    assert abs(sim.peak_allocated / curve.peak("allocated")[1] - 1) < 0.01


def _traced(path: Path):
    """The case file at `path` at gradient accumulation 2, as the recorded runs trained it (the harness's own
    loop, `launch.runtime`): (case, architecture, traces at 1 and 2 layers, run shape)."""
    from harness.models.source import load_model
    from harness.predict.step import TraceSpec
    from harness.predict.trace.trace import trace_pair
    from harness.spec.cases import load_case
    from harness.spec.variants import parse_variant

    case = parse_variant("2ga").apply(load_case(path))
    case = case.model_copy(update={"launch": case.launch.model_copy(update={"runtime": "harness"})})
    arch = load_model(case.model)
    spec = TraceSpec.of(case, arch)
    return (case, arch, *trace_pair(spec), RunShape.of(case, spec, case.layers or arch.layers))


def _architecture_run(name: str):
    """The traces and run shape of the architecture benchmark's case `name` at gradient accumulation 2."""
    return _traced(Path(__file__).resolve().parent.parent / "benchmarks/architectures/cases" / f"{name}.yaml")[2:]


def _after_load(timeline: MemoryTimeline) -> tuple[int, int]:
    """The recorded allocated and reserved peaks from the end of the load on: the run's step figures (the
    load may also build the random-weight checkpoint on the card, then empty the cache)."""
    curve = timeline.curve()
    end = next(s for s in timeline.phase_spans() if s[0] == "load")[2]
    return max(curve.allocated[end:]), max(curve.reserved[end:])


def test_what_the_loop_drops_after_the_backward_is_a_chunk_after_every_layers():
    """The trace's frees once `backward()` has returned (the loss and the logits, which the training loop
    holds through the backward) are tagged after every layer's backward, apart from layer 0's: a hook that
    fires inside the backward after the layers (the embedding's) goes into a stream before them."""
    from harness.spec.cases import CASES_DIR

    _, _, r1, r2, _ = _traced(CASES_DIR / "003-qlora-fix-r16-seq512-gc.yaml")
    for r in (r1, r2):
        tags = [tuple(e[3:5]) for e in r.events]
        first = tags.index((B, LAYER_PRE))
        assert set(tags[first:]) == {(B, LAYER_PRE)}  # the last chunk, nothing after it
        assert tags[first - 1] == (B, 0)  # right after layer 0's backward
        dropped = r.events[first:]
        assert all(e[0] == 0 for e in dropped)  # frees only
        allocated_in = {e[1]: tuple(e[3:5]) for e in r.events if e[0] == 1}
        assert r.logits in {e[2] for e in dropped if allocated_in[e[1]] == (F, LAYER_POST)}  # the logits among them


def test_the_run_is_replayed_until_the_allocators_state_repeats():
    """Mistral-7B QLoRA as LLaMA-Factory runs it (4 x 1024 tokens, GA 2, one H200): its recorded reserve
    grows in each of the first three optimizer steps (the third by a 512 MiB segment in the second
    micro-step's backward) and not in the three after. The run is replayed until a step ends in the
    state the one before it ended in, and no later step reserves more. Loaded as the recorded process
    loaded it, onto a device that already held a tensor (so transformers' warm-up block is 2 MiB
    smaller), the built run lands on the recorded reserve; loaded onto an empty device, the same stream
    finds room for the third step's 512 MiB block and settles 4.1 % under it."""
    r1, r2, empty = _architecture_run("mistral-7b-qlora-r64-mb4-s1024-gc-llamafactory")
    timeline = MemoryTimeline.load(ARCH_TIMELINES / "mistral-7b-qlora-r64-mb4-s1024-gc-llamafactory@2ga.json.gz")
    recorded = _after_load(timeline)[1]
    held = start_states(empty)[1]
    sim = simulate_run(r1, r2, held)
    assert sim.settled and sim.steps >= 3
    assert abs(sim.peak_reserved / recorded - 1) < 0.001
    assert simulate(run_stream(r1, r2, held, sim.steps + 3)).peak_reserved == sim.peak_reserved
    assert simulate_run(r1, r2, empty).peak_reserved < 0.97 * recorded


def test_a_run_that_repeats_from_its_second_step_is_replayed_twice():
    layout = [[1024, 2, 0, 1, 0, 0], [1024, 2, 0, 1, 1, 0]]
    r1 = result([(1, 0, MiB, F, 0), (0, 0, MiB, B, 0)], layout[:1], 1)
    shape = RunShape(4, 2, 2, False, True)
    sim = simulate_run(r1, two_layer_step(), shape)
    assert sim.settled and sim.steps == 2
    assert sim.peak_reserved == simulate(run_stream(r1, two_layer_step(), shape, 5)).peak_reserved


def test_the_built_stream_of_llama3_qlora_reserves_what_its_recorded_run_did():
    """Llama-3.1-8B QLoRA r16 (1 x 2048 tokens, GA 2, one H200): fp32 grouped-query attention on the math
    path. With `_safe_softmax`'s boolean -inf matrix (128 MiB a layer) and the softmax backward's
    `grad * output` (512 MiB) in the trace, the built stream reserves the recorded 13.95 GiB (without
    them 13.58, -2.7 %)."""
    r1, r2, shape = _architecture_run("llama3-8b-qlora-r16-mb1-s2048-gc")
    timeline = MemoryTimeline.load(ARCH_TIMELINES / "llama3-8b-qlora-r16-mb1-s2048-gc@2ga.json.gz")
    allocated, reserved = _after_load(timeline)
    sim = simulate_run(r1, r2, shape)
    assert abs(sim.peak_reserved / reserved - 1) < 0.005
    assert abs(sim.peak_allocated / allocated - 1) < 0.005


def test_the_trace_sees_what_the_cuda_softmax_kernels_allocate_beside_their_output():
    """`_safe_softmax` (SDPA's math path) keeps a boolean of the scores' shape while it runs; CUDA's
    softmax backward a `grad * output` of it. Both come after the op's output and are freed with it
    still live."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from harness.predict.trace.fake import AllocationLog, _cuda_sdpa

    log = AllocationLog()
    with FakeTensorMode(), _cuda_sdpa():
        q = torch.empty(1, 4, 64, 32, requires_grad=True)
        k = torch.empty(1, 2, 64, 32, requires_grad=True)
        with log:
            log.start_log()
            out = torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
            out.sum().backward()
            events = log.stop_log()
    scores = 4 * 64 * 64
    sizes = [(op, size) for op, _, size, _, _ in events]
    assert (1, scores) in sizes and (0, scores) in sizes  # the boolean matrix, allocated and freed
    fp32 = [i for i, (op, size) in enumerate(sizes) if op == 1 and size == 4 * scores]
    assert len(fp32) >= 4  # scores, softmax; in backward its gradient, the softmax's gradient and grad * output


def test_training_dropout_is_traced_as_cudas_fused_kernel():
    """CUDA's dropout (`dropout_cuda`, Dropout.cu) allocates a boolean mask, then the output, and keeps
    the mask for backward, whose `native_dropout_backward` makes one block; guide 003's recorded timeline
    shows each LoRA adapter's 2 MiB mask before its 8 MiB output. On the trace's cpu tensors
    `aten::dropout` would take the composite path, which keeps a noise tensor of the input's dtype."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from harness.predict.trace.fake import AllocationLog, _cuda_dropout

    log = AllocationLog()
    with FakeTensorMode(), _cuda_dropout():
        x = torch.empty(512, 64, requires_grad=True)
        with log:
            log.start_log()
            base = log.current()
            y = torch.nn.functional.dropout(x, 0.05, training=True)
            z = y.sum()
            del y
            held = log.current() - base
            z.backward()
            events = log.stop_log()
    mask, out = 512 * 64, 512 * 64 * 4
    allocated = [size for op, _, size, _, _ in events if op == 1]
    assert allocated[:2] == [mask, out]
    assert held == mask + z.untyped_storage().nbytes()  # the output freed, the mask kept
    assert allocated.count(out) == 2  # the output, the backward's one block (no noise tensor, no product)


def test_the_fake_4bit_forward_frees_the_restored_absmax_after_its_output():
    """bitsandbytes' `_dequant_linear_fallback` keeps the restored absmax, its sum with the offset and
    the dequantized weight as locals until `F.linear` has made its output (Mistral-7B's timeline:
    `cuda/ops.py` 911, 913, 914, 916, then the three freed); the backward's `dequantize_4bit` frees
    its one absmax copy before the matmul."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from harness.predict.trace.fake import AllocationLog, _Fake4bitMatmul

    log = AllocationLog()
    with FakeTensorMode():
        x = torch.empty(2, 128, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.empty(256, 128)
        with log:
            log.start_log()
            out = _Fake4bitMatmul.apply(x, weight, None)
            forward = log.stop_log()
            log.start_log()
            out.sum().backward()
            backward = log.stop_log()
    absmax, w, o = 256 * 128 // 64 * 4, 256 * 128 * 2, 2 * 256 * 2
    assert [(op, size) for op, _, size, _, _ in forward] == [
        (1, absmax), (1, absmax), (1, w), (1, o), (0, absmax), (0, absmax), (0, w)]
    sizes = [(op, size) for op, _, size, _, _ in backward]
    start = sizes.index((1, absmax))
    assert sizes[start:start + 3] == [(1, absmax), (1, w), (0, absmax)]


def _attention_spec(model: str, attn: str | None):
    """A traced full fine-tune of `model` shrunk to tiny width (2 x 128 tokens), with `attn`."""
    import json

    from harness.models.registry import tiny_config
    from harness.models.source import load_model
    from harness.predict.step import TraceSpec

    config = tiny_config(load_model(str(ARCH_MODELS / model)), 128)
    return TraceSpec(config_json=json.dumps(config, sort_keys=True), seq_len=128, micro_batch=2, kind="full",
                     stack="plain", dtype="bf16", lora_r=None, lora_targets=None, lora_dropout=0.0,
                     checkpointing=False, reentrant=False, deepspeed=False, accumulated_grads=False,
                     attn_implementation=attn), config


ARCH_MODELS = Path(__file__).resolve().parent.parent / "benchmarks/architectures/models"


def test_the_trace_builds_the_model_with_the_cases_attention_kernel():
    """Eager attention keeps every layer's score matrices (batch x heads x seq x seq) for backward; SDPA
    and flash-attention keep none. Llama's default under the local transformers is SDPA: naming it
    changes nothing."""
    from harness.predict.trace.fake import trace
    from harness.predict.trace.trace import _key

    traced = {}
    for attn in (None, "eager", "sdpa", "flash_attention_2"):
        spec, config = _attention_spec("llama-3.1-8b", attn)
        traced[attn] = trace(spec, 1)
        assert traced[attn].attention == (attn or "sdpa")
        assert ("stand-in" in traced[attn].attention_note) == (attn == "flash_attention_2")
        assert "refuses" not in traced[attn].attention_note
    scores = 2 * config["num_attention_heads"] * 128 * 128 * 2  # one bf16 score matrix per head and row
    assert traced[None].held_after_forward == traced["sdpa"].held_after_forward
    assert traced[None].peak == traced["sdpa"].peak
    assert traced["eager"].held_after_forward - traced["sdpa"].held_after_forward >= scores
    assert traced["eager"].held_after_forward - traced["flash_attention_2"].held_after_forward >= scores
    assert len({_key(_attention_spec("llama-3.1-8b", a)[0]) for a in traced}) == 4  # each its own cache entry


def test_a_kernel_the_local_transformers_refuses_is_set_on_the_models_config():
    """transformers 5.24 refuses SDPA for Gemma-2 (logit softcapping): the trace sets it on the built
    model's config, its attention dispatches through SDPA, and the result says so (5.17 builds Gemma-2
    with SDPA: nothing is refused there)."""
    import transformers
    from transformers.models.gemma2.modeling_gemma2 import Gemma2PreTrainedModel

    from harness.predict.trace.fake import trace

    if getattr(Gemma2PreTrainedModel, "_supports_sdpa", False):
        pytest.skip(f"transformers {transformers.__version__} takes SDPA for Gemma-2: nothing to refuse")

    eager_spec, config = _attention_spec("gemma-2-2b", None)
    eager = trace(eager_spec, 1)
    sdpa = trace(_attention_spec("gemma-2-2b", "sdpa")[0], 1)
    assert eager.attention == "eager" and eager.attention_note == ""
    assert sdpa.attention == "sdpa"
    assert "refuses sdpa for Gemma2ForCausalLM" in sdpa.attention_note
    assert "runs through the sdpa interface anyway" in sdpa.attention_note
    scores = 2 * config["num_attention_heads"] * 128 * 128 * 2
    assert eager.held_after_forward - sdpa.held_after_forward >= scores


def test_a_tied_head_stays_tied_in_the_trace():
    """`to_empty` unties the output head from the embedding; the trace ties them again, so the
    layout holds one vocab x hidden weight (the job holds one) and the load builds and frees the head."""
    from harness.predict.trace.fake import trace

    spec, config = _attention_spec("qwen2.5-1.5b", None)
    assert config["tie_word_embeddings"]
    r = trace(spec, 1)
    table = config["vocab_size"] * config["hidden_size"]
    assert r.params.tied_head and r.params.head == table
    assert [row[0] for row in r.layout].count(table) == 1
    stream = Stream([], [], [])
    load_stream(r, r, RunShape(1, 1, 2, False, False, model_source="config"), stream)
    assert stream.sizes[-1] == table * 2 and stream.ops[-1] == -len(stream.sizes)  # the head, built and freed


def test_the_llamafactory_full_fine_tune_is_built_onto_its_recorded_reserved_peak():
    """Qwen2.5-1.5B full fine-tune as LLaMA-Factory runs it (4 x 1024 tokens, checkpointing, GA 2, one
    H200), built as the harness's run built it (from_config on the card), each gradient kept where the
    first micro-step's backward makes it: the allocator model lands on the recorded reserved peak,
    which grows by a 2.3 GiB segment of the fp32 logits in most passes because the gradients split the
    logits' freed segments. With every gradient allocated where the backward begins it came 9% low."""
    from harness.baselines.store import load_baselines
    from harness.models.source import load_model
    from harness.predict.step import TraceSpec
    from harness.predict.trace.trace import trace_pair
    from harness.spec.cases import load_case
    from harness.spec.suite import ARCH_BASELINES_DIR, ARCH_CASES_DIR

    cid = "qwen25-1.5b-full-mb4-s1024-gc-llamafactory"
    baseline = next(b for b in load_baselines(ARCH_BASELINES_DIR) if b.case_id == cid and b.runtime == "harness")
    case = baseline.case_as_measured(load_case(ARCH_CASES_DIR / f"{cid}.yaml"))
    assert case.launch.model_source == "config"
    arch = load_model(case.model)
    spec = TraceSpec.of(case, arch)
    r1, r2 = trace_pair(spec)
    trainable = sum(n * size for n, size, _, t, *_ in r2.layout if t)
    named = {e[1]: e[2] for e in r2.events if e[0] == 1 and e[1] in set(r2.grads)}
    assert sum(named.values()) == trainable  # every gradient AccumulateGrad was given is named
    sim = simulate(run_stream(r1, r2, RunShape.of(case, spec, case.layers or arch.layers)))
    curve = MemoryTimeline.load(ARCH_TIMELINES / f"{cid}@2ga.json.gz").curve()
    assert abs(sim.peak_allocated / curve.peak("allocated")[1] - 1) < 0.005
    assert abs(sim.peak_reserved / curve.peak("reserved")[1] - 1) < 0.005


def _logged(fn, *, backward_too: bool = True):
    """The events `AllocationLog` logs while `fn()` builds an output (and, with `backward_too`, while the
    gradient of its sum flows back), on fake tensors with the trace's SDPA."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from harness.predict.trace.fake import AllocationLog, _cuda_sdpa

    log = AllocationLog()
    with FakeTensorMode(), _cuda_sdpa(), log:
        log.start_log()
        out = fn(torch)
        if backward_too:
            log.backward = True
            log.tag = (B, 0)
            out.sum().backward()
        return log.stop_log(), log


def test_half_attention_runs_on_cudnn_with_its_seed_offset_and_backward_workspace():
    """bf16 SDPA on an H100/H200 (torch 2.11, CUDA 13) is cuDNN's: the forward allocates the dropout
    seed and offset (8 bytes each) before the output and the fp32 log-sum-exp; the backward, after dq,
    dk and dv, one workspace (fp32 row sums and dQ accumulator, and dK, dV per query head for grouped
    heads: Mistral-7B's 128.5 MiB at 4 x 1024 tokens), freed at once. Without a gradient no log-sum-exp."""
    def attention(torch):
        q = torch.empty(2, 4, 64, 32, dtype=torch.bfloat16, requires_grad=True)
        k = torch.empty(2, 2, 64, 32, dtype=torch.bfloat16, requires_grad=True)
        return torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)

    events, _ = _logged(attention)
    out, lse = 2 * 4 * 64 * 32 * 2, 2 * 4 * 64 * 4
    allocs = [(e[2], e[3]) for e in events if e[0] == 1]
    forward = [size for size, phase in allocs if phase == F]
    assert forward[-4:] == [8, 8, out, lse]
    workspace = 2 * 4 * 64 * 4 + 2 * 4 * 64 * 32 * 4 + 2 * (2 * 4 * 64 * 32 * 2)
    backward = [(op, size) for op, _, size, phase, _ in events if phase == B]
    at = backward.index((1, workspace))
    assert backward[at + 1] == (0, workspace)
    assert [size for op, size in backward[:at] if op == 1][-3:] == [out, out // 2, out // 2]  # dq, dk, dv

    def no_grad(torch):
        with torch.no_grad():
            return attention(torch)

    events, _ = _logged(no_grad, backward_too=False)
    assert [e[2] for e in events if e[0] == 1][-3:] == [8, 8, out]


def test_fp32_efficient_attention_backward_allocates_delta_and_its_workspace():
    """fp32 SDPA without grouped heads is the memory-efficient kernel's; its f32 backward computes
    `delta` eagerly (a product of the output's shape, two row sums) and takes a workspace for the split
    keys' dQ accumulator: 128 x 64 tiles for head dim 96 (Phi-3-mini's 64.03 MiB at 4 x 1024 tokens)."""
    def attention(torch):
        q = torch.empty(1, 4, 64, 96, requires_grad=True)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    events, _ = _logged(attention)
    backward = [(op, size) for op, _, size, phase, _ in events if phase == B]
    product, rows = 1 * 4 * 64 * 96 * 4, 1 * 64 * 4 * 4
    workspace = 1 * 4 * (1 * 2 * (4 + 128 * 64)) * 4
    at = next(i for i in range(len(backward) - 1) if backward[i:i + 2] == [(1, product), (1, rows)])
    assert [size for op, size in backward[:at] if op == 1][-3:] == [product] * 3  # grad_q, grad_k, grad_v
    assert backward[at:at + 8] == [(1, product), (1, rows), (1, rows), (0, rows), (0, product),
                                   (1, workspace), (0, rows), (0, workspace)]


def test_the_engine_sums_two_gradients_in_place_unless_the_first_is_a_view():
    """Where a tensor feeds two branches, the engine adds the second gradient into the first
    (`InputBuffer::add`, `can_accumulate_inplace`): no block for the sum. A view made in backward keeps
    its base, which holds the storage too: then the sum is a new block, as on the device."""
    def two_branches(torch):
        x = torch.empty(4, 256, requires_grad=True)
        h = x * 2
        return (h @ torch.empty(256, 256)) + (h @ torch.empty(256, 256))

    def a_view_first(torch):
        x = torch.empty(4, 256, requires_grad=True)
        h = x * 2
        return (h @ torch.empty(256, 256)).sum() + (h.reshape(8, 128) @ torch.empty(128, 128)).sum()

    grad = 4 * 256 * 4
    events, _ = _logged(two_branches)
    assert sum(1 for op, _, size, phase, _ in events if op == 1 and size == grad and phase == B) == 3
    events, _ = _logged(a_view_first)
    assert sum(1 for op, _, size, phase, _ in events if op == 1 and size == grad and phase == B) == 4


def test_the_autograd_threads_cublas_workspace_follows_the_backwards_first_matmul():
    """The autograd thread takes its cuBLAS handle, and its 32 MiB workspace, at the backward's first
    matmul, after that matmul's output (the head's, after the loss's gradients): where the trace saw it."""
    from harness.predict.constants import CUBLAS_HANDLE_WORKSPACE

    step = two_layer_step()
    step.matmuls = [-1, 12]  # after layer 1's first backward allocation (event 11 is the head's free)
    stream = run_stream(result([]), step, RunShape(2, 1, 2, False, False), 1)
    sizes = [stream.sizes[op] for op in stream.ops if op >= 0]
    first_backward = sizes.index(16 * MiB)
    assert sizes[first_backward + 1] == CUBLAS_HANDLE_WORKSPACE
    assert sizes.count(CUBLAS_HANDLE_WORKSPACE) == 2


@pytest.mark.parametrize("name, layers", [("mistral-7b-qlora-r64-mb4-s1024-gc-llamafactory", 32),
                                          ("qwen25-1.5b-full-mb4-s1024-gc-llamafactory", 28)])
def test_a_layers_backward_in_the_trace_allocates_as_the_recorded_one(name, layers):
    """Mistral-7B QLoRA and Qwen2.5-1.5B's full fine-tune through LLaMA-Factory (4 x 1024 tokens, one
    H200): one decoder layer's recomputed forward and backward, blocks of 1 MiB and more, in the
    recorded order and sizes: with the engine's sums in place (out of place where the first gradient is
    a view: Qwen's biased q, k, v projections), cuDNN's attention workspace (the trace's is 256 bytes
    short of the recorded one) and, for Qwen's bias and norm gradients, the reductions' staging
    buffers. The trace runs with the gradients of earlier micro-steps there: the recording's second
    micro-step, its second layer."""
    from harness.measure.timeline import FREE_COMPLETED

    _, r2, _ = _architecture_run(name)
    timeline = MemoryTimeline.load(ARCH_TIMELINES / f"{name}@2ga.json.gz")
    big = 2**20
    recorded = [(1 if a == ALLOC else 0, s) for a, s in zip(timeline.action, timeline.size, strict=True)
                if a in (ALLOC, FREE_COMPLETED) and s >= big]
    workspace = next(s for op, s in recorded if op == 1 and s % 512)
    marks = [i for i, (op, s) in enumerate(recorded) if op == 1 and s == workspace]
    period = recorded[marks[layers + 1]:marks[layers + 2]]
    traced = [(op, workspace if abs(size - workspace) < 512 else size) for op, _, size, phase, layer in r2.events
              if phase == B and layer == 1 and size >= big]
    start = traced.index((1, workspace))
    assert traced[start:] + traced[:start] == period


def test_a_reduction_split_across_blocks_stages_its_partial_sums():
    """A bias's gradient summed over 4 x 1024 rows of 1536 (Qwen2.5-1.5B's q_proj): `gpu_reduce_kernel`
    splits each output's rows across 64 blocks and stages their partial sums in a 48 MiB buffer beside
    48 bytes of semaphores, after the output and freed before the kernel returns; a norm's mean over
    each row's 1536 needs none."""
    def biased(torch):
        x = torch.empty(4, 1024, 1536, dtype=torch.bfloat16)
        bias = torch.empty(1536, dtype=torch.bfloat16, requires_grad=True)
        return (x + bias) * x  # a dense gradient reaches the sum

    events, _ = _logged(biased)
    backward = [(op, size) for op, _, size, phase, _ in events if phase == B]
    at = backward.index((1, 3072))  # the bias's gradient
    assert backward[at:at + 5] == [(1, 3072), (1, 48 * MiB), (1, 48), (0, 48), (0, 48 * MiB)]

    def norm(torch):
        return torch.empty(4, 1024, 1536, requires_grad=True).pow(2).mean(-1, keepdim=True)

    events, _ = _logged(norm, backward_too=False)
    assert [e[2] for e in events if e[0] == 1][-1] == 4 * 1024 * 4


def test_a_trainers_step_frees_the_logits_before_its_backward():
    """The HF Trainer's `compute_loss` returns the loss alone, so the model's outputs, the half-precision
    logits among them, are gone before the backward; the harness's own loop holds them through it. Where
    the step peaks in the loss's backward (a vocabulary far wider than the model), the trainer's trace
    peaks lower by exactly the logits, and the forward leaves them out of what it holds."""
    import dataclasses

    from harness.predict.trace.fake import trace
    from harness.predict.trace.trace import _key

    spec, config = _attention_spec("llama-3.1-8b", None)
    own, trainer = trace(spec, 1), trace(dataclasses.replace(spec, loss_only=True), 1)
    logits = 2 * 128 * config["vocab_size"] * 2  # micro-batch 2 x 128 tokens, bf16
    assert own.logits == trainer.logits == logits
    assert own.held_after_forward - trainer.held_after_forward == logits
    assert own.peak - trainer.peak == logits
    assert _key(spec) != _key(dataclasses.replace(spec, loss_only=True))


def test_the_frameworks_cases_are_traced_with_the_trainers_loss():
    """Which cases take the Trainer's step: LLaMA-Factory's and the HF Trainer's, not the harness's own loop."""
    from harness.models.source import load_model
    from harness.predict.step import TraceSpec
    from harness.spec.cases import load_case

    cases = Path(__file__).resolve().parent.parent / "benchmarks/architectures/cases"
    arch = load_model(str(ARCH_MODELS / "llama-3.1-8b"))
    assert TraceSpec.of(load_case(cases / "llama3-8b-qlora-s4096-lf.yaml"), arch).loss_only
    assert not TraceSpec.of(load_case(cases / "llama3-8b-qlora-r16-mb1-s2048-gc.yaml"), arch).loss_only
    mistral = load_model(str(ARCH_MODELS / "mistral-7b-v0.3"))
    assert TraceSpec.of(load_case(cases / "mistral-7b-lora-hf.yaml"), mistral).loss_only
