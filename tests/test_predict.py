"""Behaviour of the predictor (harness.predict.predictor): the directions its terms must move in, the
interface the importers and `oom-harness check` rely on, and leave-one-out calibration.
No timings here (benchmarks/bench_predictor.py has them)."""

from __future__ import annotations

import pytest

from harness.baselines.store import load_baselines
from harness.predict.predictor import Prediction, predict
from harness.spec.cases import CASES_DIR, load_case
from harness.spec.schema import Case

GiB = 2**30


def case(name: str) -> Case:
    return load_case(CASES_DIR / f"{name}.yaml")


def changed(base: Case, **edits) -> Case:
    """A copy of a case with nested fields changed: changed(c, **{"deepspeed.stage": 3})."""
    data = base.model_dump(mode="json")
    data["target"]["card"]["memory"] = f"{base.target.card.memory} B"
    data["claims"] = []  # claims do not change a prediction, and may contradict the edit
    if base.target.host_ram is not None:
        data["target"]["host_ram"] = f"{base.target.host_ram} B"
    for path, value in edits.items():
        node = data
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return Case.model_validate(data)


def test_interface_fields_and_consistency():
    p = predict(case("003-qlora-fix-r32-seq1024-gc"))
    assert isinstance(p, Prediction)
    assert 0 < p.allocated <= p.reserved < p.device
    assert p.host_ram > 0 and p.seconds > 0
    assert all(isinstance(v, int) for v in p.terms.values())
    assert set(p.fitted) <= {"reserved_over_allocated", "zero3_cached_gathers", "device_overhead",
                             "device_overhead_deepspeed", "device_overhead_deepspeed_after_collective",
                             "triton_cold_overhead"}
    assert isinstance(p.notes, list) and isinstance(p.calibrated_on, list) and p.platform


def test_zero3_over_8_ranks_holds_an_eighth_of_the_parameters():
    base = changed(case("001-ladder-rung3-zero3"), **{"target.card.count": 8})
    one = predict(base)
    eight = predict(changed(base, **{"launch.ranks": 8}))
    ratio = eight.terms["zero3_param_partition"] / one.terms["zero3_param_partition"]
    assert ratio == pytest.approx(1 / 8, rel=0.01)
    assert eight.allocated < one.allocated


def test_optimizer_offload_moves_state_to_host():
    on_device = predict(case("001-ladder-rung1-zero2"))
    offloaded = predict(changed(case("001-ladder-rung1-zero2"), **{"deepspeed.offload_optimizer": "cpu"}))
    assert "optimizer_fp32_master_adam" in on_device.terms
    assert "optimizer_fp32_master_adam" not in offloaded.terms
    assert offloaded.terms["host_optimizer_fp32_master_adam"] == on_device.terms["optimizer_fp32_master_adam"]
    assert offloaded.host_ram > on_device.host_ram


def test_parameter_offload_moves_zero3_partition_to_host():
    p = predict(case("001-ladder-rung4-zero3-offload"))
    assert "zero3_param_partition" not in p.terms and p.terms["host_zero3_param_partition"] > 0


def test_checkpointing_lowers_activations():
    with_gc = predict(case("003-qlora-fix-r32-seq1024-gc"))
    without = predict(changed(case("003-qlora-fix-r32-seq1024-gc"), **{"train.gradient_checkpointing": False}))
    assert with_gc.terms["activations_held_after_forward"] < 0.3 * without.terms["activations_held_after_forward"]
    assert with_gc.allocated < without.allocated


def test_four_bit_shrinks_linear_weights_about_fourfold():
    q = case("003-qlora-fix-r32-seq1024-gc-llamafactory")
    lora = changed(q, **{"method.kind": "lora", "method.quantization": None})
    pq, pl = predict(q), predict(lora)
    linear_bf16 = pl.terms["weights"] - pq.terms["weights_other"]
    assert 0.24 < pq.terms["weights_4bit"] / linear_bf16 < 0.28


def test_peft_stack_upcasts_non_quantized_weights():
    peft = predict(case("003-qlora-fix-r32-seq1024-gc"))
    lf = predict(case("003-qlora-fix-r32-seq1024-gc-llamafactory"))
    assert peft.terms["weights_other"] == 2 * lf.terms["weights_other"]
    assert peft.allocated > lf.allocated


def test_fewer_layers_predict_less_and_32b_completes():
    full = predict(case("000-lora-z3-offload-cutoff1024-ga16"))
    short = predict(changed(case("000-lora-z3-offload-cutoff1024-ga16"), layers=8, depth_points=None))
    assert short.allocated < full.allocated
    assert short.host_ram < full.host_ram
    assert any("8 of 64 layers" in n for n in short.notes)


def test_procs_per_card_figures_are_per_process():
    two = predict(case("004-gla-plan-b-bs2"))
    one = predict(changed(case("004-gla-plan-b-bs2"), **{"launch.procs_per_card": 1}))
    assert two.device == one.device
    assert two.host_ram > one.host_ram  # host memory is the node's: both jobs


def test_leave_one_out_excludes_the_case():
    b = next(iter(load_baselines()), None)
    if b is None:
        pytest.skip("no baselines in results/")
    c = case(b.case_id)
    inside = predict(c, platform=b.platform.key)
    out = predict(c, platform=b.platform.key, exclude={b.case_id})
    assert b.case_id in inside.calibrated_on
    assert b.case_id not in out.calibrated_on
    assert out.platform == b.platform.key


def test_unknown_platform_falls_back_to_pooled_constants():
    p = predict(case("004-gla-plan-b-bs2"), platform="hygon-dcu-k100-x8")
    assert any("pooled" in n for n in p.notes) or not p.fitted


def _layer_bytes(c: Case) -> int:
    """bf16 bytes of one decoder layer's weights (from the prediction's own inventory)."""
    one = predict(changed(c, layers=1, depth_points=None))
    two = predict(changed(c, layers=2, depth_points=None))
    return (two.params_total - one.params_total) * 2


def test_zero3_reentrant_checkpointing_retains_every_layers_frozen_weights():
    """DeepSpeed's coordinator, replayed: under reentrant checkpointing the recomputed layers' frozen
    weights stay gathered until the end of backward (0.93 GiB per layer measured on guide 000)."""
    failing = case("000-lora-z3-offload-cutoff1024-ga16")  # LLaMA-Factory: reentrant by default
    layer = _layer_bytes(failing)
    at = lambda c, n: predict(c, variant=f"2r{n}L2ga")  # noqa: E731
    re4, re8 = at(failing, 4), at(failing, 8)
    non = changed(failing, **{"train.checkpointing_reentrant": False})
    non4, non8 = at(non, 4), at(non, 8)
    assert re4.allocated > non4.allocated and re8.allocated > non8.allocated
    # reentrant: about one whole layer of weights per layer (not 1/world)
    assert (re8.allocated - re4.allocated) / 4 == pytest.approx(layer, rel=0.1)
    above = lambda p: p.terms["zero3_gathered_above_backward_start"]  # noqa: E731
    assert (above(re8) - above(re4)) / 4 == pytest.approx(layer, rel=0.1)
    # non-reentrant: far less than a layer per layer
    assert (non8.allocated - non4.allocated) / 4 < 0.2 * layer


def test_retention_needs_zero3_checkpointing_and_frozen_weights():
    failing = case("000-lora-z3-offload-cutoff1024-ga16")
    layer = _layer_bytes(failing)
    no_gc = changed(failing, **{"train.gradient_checkpointing": False})
    four, eight = predict(no_gc, variant="2r4L2ga"), predict(no_gc, variant="2r8L2ga")
    # without checkpointing what is kept gathered is bounded by the reuse distance, not the depth
    assert abs(eight.terms["zero3_gathered_above_backward_start"]
               - four.terms["zero3_gathered_above_backward_start"]) < 0.2 * layer
    z2 = predict(changed(failing, **{"deepspeed.stage": 2, "deepspeed.offload_param": "none"}), variant="2r4L2ga")
    assert not any(k.startswith("zero3_") for k in z2.terms)


def test_reuse_distance_and_max_live_change_what_zero3_keeps_gathered():
    """Rung 4 on an H100 peaked 1.32 GiB lower in allocated memory with stage3_max_reuse_distance 0 and
    stage3_max_live_parameters 1e8 than with the defaults; the replayed coordinator sees it."""
    rung4 = case("001-ladder-rung4-zero3-offload")
    default = predict(rung4)
    tight = predict(changed(rung4, **{"deepspeed.stage3_max_reuse_distance": 0,
                                      "deepspeed.stage3_max_live_parameters": 100_000_000}))
    assert default.terms["zero3_gathered_params"] > 1.5 * 2**30  # ~14 layers and the head kept for backward
    assert 1.0 * 2**30 < default.allocated - tight.allocated < 2.5 * 2**30
    assert any("DeepSpeed's coordinator replayed" in n for n in default.notes)


def test_a_full_fine_tune_under_zero3_holds_what_deepspeed_prefetched_for_backward():
    """Phi-3-mini's full fine-tune under ZeRO-3 (architecture benchmark) measured 8.07 GiB allocated
    against 6.39 predicted when its gathered set was the closed form (the head or one module plus the
    prefetch bucket). DeepSpeed's coordinator, replayed, finds more when backward starts: at the end of
    the forward it prefetches the backward's first modules while fewer than stage3_max_live_parameters
    (1e9 elements by default) are gathered, and does not release a parameter its prefetch has marked for
    a later step; so about that many elements stay gathered. The replay is used for full fine-tunes as
    for LoRA, and the limit changes the prediction."""
    from harness.spec.suite import ARCH_CASES_DIR

    phi3 = load_case(ARCH_CASES_DIR / "phi3-mini-full-z3-offload-mb2-s2048-gc.yaml")
    layer = _layer_bytes(phi3)
    default = predict(phi3)
    tight = predict(changed(phi3, **{"deepspeed.stage3_max_live_parameters": 100_000_000}))
    assert any("DeepSpeed's coordinator replayed" in n for n in default.notes)
    assert default.terms["zero3_gathered_params"] == pytest.approx(1_000_000_000 * 2, rel=0.1)
    assert default.terms["zero3_gathered_params"] > tight.terms["zero3_gathered_params"] + 3 * layer
    assert default.allocated - tight.allocated > 3 * layer


def test_variant_predicts_the_case_as_measured():
    c = case("000-qlora4bit-z2-cutoff512")
    from harness.spec.variants import parse_variant

    assert predict(c, variant="2r4L2ga").allocated == predict(parse_variant("2r4L2ga").apply(c)).allocated
    assert predict(c, variant="2r8L2ga").allocated > predict(c, variant="2r4L2ga").allocated


def test_leave_one_out_excludes_every_variant_of_the_case():
    variants = [b for b in load_baselines() if b.variant]
    if not variants:
        pytest.skip("no variant baselines in results/")
    b = variants[0]
    p = predict(case(b.case_id), platform=b.platform.key, exclude={b.case_id}, variant=b.variant)
    assert b.case_id not in p.calibrated_on


def test_zero3_with_optimizer_offload_keeps_its_gradient_partition_on_the_host():
    # guide 002's full fine-tune on 2 H200s allocated 11.15 GiB at 6 and at 12 layers: no per-layer
    # gradient partition on the card (DeepSpeed's grad_partitions_flat_buffer lives on the host)
    offloaded = case("002-gemma27b-full-z3-offload-len2048")
    on_card = changed(offloaded, **{"deepspeed.offload_optimizer": "none"})
    p_off, p_on = predict(offloaded), predict(on_card)
    assert "grad_partition" not in p_off.terms and p_off.terms["host_fp32_grad_partition"] > 0
    assert p_on.terms["grad_partition"] == p_off.terms["host_fp32_grad_partition"] // 2  # bf16 vs fp32


def test_pinned_parameter_offload_rounds_each_partition_for_full_fine_tunes_too():
    full = case("002-gemma27b-full-z3-offload-len2048")
    unpinned = changed(full, **{"deepspeed.pin_memory": False})
    pinned_host, plain_host = (predict(full).terms["host_zero3_param_partition"],
                               predict(unpinned).terms["host_zero3_param_partition"])
    assert plain_host < pinned_host < 2 * plain_host  # torch's pinned allocator rounds each block to a power of two


def test_a_mistakes_baselines_do_not_calibrate_the_predictor(tmp_path):
    """Guide 002's model materialised before DeepSpeed keeps its blocks cached (reserved 2.9 times
    allocated on two H100s): that is the mistake's cost, not the allocator's habit."""
    from harness.baselines.store import RESULTS_DIR, bless
    from harness.predict.calibration import calibrate

    bless(RESULTS_DIR.parent / "runs" / "2026-11-26-h100x2-002-pytest-gpu.json", root=tmp_path, recorded="2026-11-26")
    cal = calibrate("nvidia-h100-80gb-hbm3-x2", root=tmp_path)
    assert cal.used["zero3_cached_gathers"] == ["002-gemma27b-full-z3-offload-len2048",
                                                "002-gemma27b-full-z3-offload-len4096"]
    assert "002-gemma27b-wrong-model-before-deepspeed" not in cal.calibrated_on


def test_reserved_comes_from_the_allocator_model_without_deepspeed_and_says_so():
    plain = predict(case("003-qlora-fix-r16-seq512-gc"), platform="nvidia-h200-x1")
    assert any(n.startswith("reserved: the allocator model") for n in plain.notes)
    assert plain.reserved != plain.terms["reserved_by_ratio"]
    assert plain.allocated <= plain.reserved
    ratio = predict(case("002-gemma27b-full-z3-offload-len2048"))  # a full fine-tune, ZeRO-3 offload: the ratio
    assert any(n.startswith("reserved: allocated x reserved_over_allocated") for n in ratio.notes)
    assert "reserved_by_ratio" not in ratio.terms
    offloaded = predict(case("001-ladder-rung2-zero2-offload"))  # LoRA, ZeRO-2 optimizer offload: the stream
    assert any(n.startswith("reserved: the allocator model over the load, DeepSpeed's flat buffer")
               for n in offloaded.notes)
    sharded = predict(case("000-qlora4bit-z2-cutoff512"), platform="nvidia-h200-x2", variant="2r2L2ga")
    assert any(n.startswith("reserved: the allocator model over the load, DeepSpeed's flat buffer")
               for n in sharded.notes)  # ZeRO-2, the optimizer on the device: DeepSpeed's buffers in the stream
    assert sharded.reserved != sharded.terms["reserved_by_ratio"]


def test_the_allocator_models_reserved_follows_the_alloc_conf():
    """expandable_segments maps pages instead of caching whole segments: less reserved than the default."""
    base = case("003-qlora-fix-r16-seq512-gc")
    default = predict(base, platform="nvidia-h200-x1")
    expandable = predict(changed(base, **{"launch.env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}),
                         platform="nvidia-h200-x1")
    assert expandable.reserved < default.reserved
    assert expandable.allocated == default.allocated


def test_the_cuda_pool_backend_keeps_the_ratio_and_says_why():
    base = case("003-qlora-fix-r16-seq512-gc")
    p = predict(changed(base, **{"launch.env": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}}),
                platform="nvidia-h200-x1")
    assert any("backend:cudaMallocAsync" in n and n.startswith("reserved: allocated x") for n in p.notes)
    assert "reserved_by_ratio" not in p.terms


ALONGSIDE = """
import dataclasses
import json
import sys
import threading

from harness.predict import predictor

from harness.predict.zero3 import coordinator

from harness.predict.zero3 import stream as zero3_stream
from harness.predict.trace.fake import trace
from harness.predict.predictor import predict
from harness.predict.trace.trace import TraceSpec, trace_pair
from harness.predict.traced import trace_alongside, zero3_gathered
from harness.spec.cases import CASES_DIR, load_case
from harness.spec.variants import parse_variant

# guide 000's no-overlap fix at 4 layers: its step stream replays four steps under a spec of its own
case = parse_variant("2r4L2ga").apply(
    load_case(CASES_DIR / "000-lora-z3-offload-cutoff1024-ga16-nonreentrant-no-overlap.yaml"))
arch = predictor.load_model(case.model)
if sys.argv[1] == "serial":  # a thread besides this one: nothing is forked
    threading.Thread(target=threading.Event().wait, daemon=True).start()
    assert trace_alongside(case, arch, case.layers, TraceSpec.of(case, arch)) is None
elif sys.argv[1] == "child-fails":  # the forked trace fails: this process traces and replays the rest itself
    import os

    from harness.predict.trace import trace as trace_module

    parent, traced = os.getpid(), trace_module.trace_pair

    def trace_here_only(spec):
        if os.getpid() != parent:
            raise RuntimeError("the forked trace fails")
        return traced(spec)

    trace_module.trace_pair = trace_here_only
    spec = TraceSpec.of(case, arch)
    alongside = trace_alongside(case, arch, case.layers, spec)
    alongside.keep_trace(spec)
    assert not alongside.gathers and alongside.take_gathered([]) is None and alongside.child.exitcode == 0
else:
    assert threading.active_count() == 1
    spec = TraceSpec.of(case, arch)
    alongside = trace_alongside(case, arch, case.layers, spec)
    assert alongside is not None and alongside.gathers
    steps = zero3_stream.step_spec(zero3_stream.OnePoolShape.of(case, arch, case.layers))
    assert list(coordinator._STEPS) == [steps]  # replayed here while the child traced
    alongside.keep_trace(spec)
    untimed = lambda r: {k: v for k, v in dataclasses.asdict(r).items() if k != "seconds"}  # noqa: E731
    assert [untimed(r) for r in trace_pair(spec)] == [untimed(trace(spec, n)) for n in (1, 2)]
    notes = []
    (forked,) = alongside.take_gathered(notes)
    assert alongside.child.exitcode == 0
    here = []
    assert forked == zero3_gathered(case, arch, case.layers, here) and notes == here
    # rung 3 builds no step stream: this process replays the gathered set, the child only traces
    rung3 = load_case(CASES_DIR / "001-ladder-rung3-zero3.yaml")
    rung3_arch = predictor.load_model(rung3.model)
    rung3_spec = TraceSpec.of(rung3, rung3_arch)
    replayed = coordinator.gathered.cache_info().currsize
    alongside = trace_alongside(rung3, rung3_arch, rung3_arch.layers, rung3_spec)
    assert alongside is not None and not alongside.gathers
    assert coordinator.gathered.cache_info().currsize == replayed + 1  # replayed here while the child traced
    alongside.keep_trace(rung3_spec)
    assert alongside.take_gathered([]) is None and alongside.child.exitcode == 0
    other = load_case(CASES_DIR / "003-qlora-fix-r16-seq512-gc.yaml")  # no DeepSpeed: nothing to fork
    other_arch = predictor.load_model(other.model)
    assert trace_alongside(other, other_arch, 1, TraceSpec.of(other, other_arch)) is None
prediction = predict(case)
assert trace_alongside(case, arch, case.layers, TraceSpec.of(case, arch)) is None  # traced here
figures = dataclasses.asdict(prediction)
figures.pop("seconds")
print(json.dumps(figures, sort_keys=True))
"""


def test_a_cold_zero3_prediction_traces_in_a_fork_while_deepspeed_is_replayed(tmp_path):
    """With nothing cached, the step is traced in a forked process while this one replays DeepSpeed's
    coordinator for the step stream, and the child then replays the gathered set: its traces, figures
    and notes are the ones this process makes, and the prediction is the one made with nothing forked
    (a thread running) or with a child that fails (this process then does its work); once traced,
    nothing is forked. In fresh interpreters: forking is refused where threads run (pytest-xdist's
    workers have some)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, HARNESS_PREDICT_CACHE="off",
               PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    figures = {}
    for mode in ("forked", "serial", "child-fails"):
        proc = subprocess.run([sys.executable, "-c", ALONGSIDE, mode], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        figures[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["forked"] == figures["serial"] == figures["child-fails"]
    assert figures["forked"]["reserved"] > figures["forked"]["allocated"] > 0


def _architecture_run(case_id: str):
    """(the case as measured, its measured median allocated and reserved peaks) of an architecture-benchmark run."""
    import statistics

    from harness.spec.suite import ARCH_BASELINES_DIR, ARCH_CASES_DIR

    b = next(b for b in load_baselines(ARCH_BASELINES_DIR) if b.case_id == case_id)
    ok = [r for r in b.runs if r.outcome == "ok"]
    measured = {k: statistics.median(getattr(r, f"{k}_peak") for r in ok) for k in ("allocated", "reserved")}
    return b.case_as_measured(load_case(ARCH_CASES_DIR / f"{case_id}.yaml")), b.platform.key, measured


def test_zero2_with_optimizer_offload_keeps_one_largest_parameter_buffer_not_a_gradient_partition():
    # DeepSpeed 0.19.8's ZeRO-2 under cpu_offload copies each reduced gradient to the host and keeps on
    # the device only temp_grad_buffer_for_gpu_offload, the largest trainable parameter's size
    full, platform, measured = _architecture_run("qwen25-1.5b-full-z2-offload-mb4-s1024-gc")
    p = predict(full, platform=platform, exclude={full.id})
    assert "grad_partition" not in p.terms
    assert p.terms["zero2_offload_grad_buffer"] == 151936 * 1536 * 2  # Qwen2.5-1.5B's tied embedding, bf16
    assert p.allocated == pytest.approx(measured["allocated"], rel=0.02)  # measured 11.87 GiB (2 x H200)
    on_card = predict(changed(full, **{"deepspeed.offload_optimizer": "none"}), platform=platform, exclude={full.id})
    assert "zero2_offload_grad_buffer" not in on_card.terms and on_card.terms["grad_partition"] > 0
    lora = predict(case("001-ladder-rung2-zero2-offload"))  # LoRA: the buffer is the largest adapter's
    assert 0 < lora.terms["zero2_offload_grad_buffer"] < 2**20 * 8
