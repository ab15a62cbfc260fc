"""Under ZeRO-3 the trace's linear layers are DeepSpeed's `LinearFunctionForZeroStage3`
(harness.predict.trace.fake._Zero3Linear): a frozen layer keeps its input for backward."""

import contextlib
import sys
from pathlib import Path

import pytest
import torch

from harness.predict.trace.fake import _zero3_linear, _Zero3Linear

MiB = 2**20


def _saved_bytes(fn, params=()) -> tuple[int, torch.Tensor]:
    """The bytes of the distinct storages other than `params`' that autograd saves while `fn` runs, and
    its output."""
    storages = {}
    held = {p.untyped_storage().data_ptr() for p in params}

    def pack(t):
        if t.untyped_storage().data_ptr() not in held:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), out


def _linear(frozen: bool, bias: bool, dims: int):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32, bias=bias)
    layer.requires_grad_(not frozen)
    x = torch.randn(*((3, 5, 64) if dims == 3 else (15, 64)), requires_grad=True)
    return layer, x


@pytest.mark.parametrize("frozen", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dims", [2, 3])
def test_the_trace_linear_saves_and_computes_what_deepspeeds_does(frozen, bias, dims):
    """Against DeepSpeed's own class (deepspeed/runtime/zero/linear.py): the same tensors saved, the same
    output and gradients. Autograd's own linear saves no input for a frozen layer."""
    pytest.importorskip("deepspeed")
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3

    layer, x = _linear(frozen, bias, dims)
    params = list(layer.parameters())
    ours, out = _saved_bytes(lambda: _Zero3Linear.apply(x, layer.weight, layer.bias), params)
    theirs, expected = _saved_bytes(lambda: LinearFunctionForZeroStage3.apply(x, layer.weight, layer.bias),
                                    params)
    plain, _ = _saved_bytes(lambda: torch.nn.functional.linear(x, layer.weight, layer.bias), params)
    assert ours == theirs
    torch.testing.assert_close(out, expected)
    grads = []
    for fn in (_Zero3Linear, LinearFunctionForZeroStage3):
        x.grad = None
        layer.zero_grad(set_to_none=True)
        fn.apply(x, layer.weight, layer.bias).square().sum().backward()
        grads.append([t.grad for t in (x, layer.weight, layer.bias) if t is not None])
    for a, b in zip(*grads, strict=True):
        if a is None or b is None:
            assert a is b
        else:
            torch.testing.assert_close(a, b)
    assert ours == x.numel() * x.element_size()
    assert plain == (0 if frozen else ours)  # autograd's linear keeps the input only for the weight's gradient


def test_the_zero3_linear_is_torchs_linear_only_while_enabled():
    original = torch.nn.functional.linear
    with _zero3_linear(False):
        assert torch.nn.functional.linear is original
    with _zero3_linear(True):
        layer, x = _linear(True, False, 3)
        y = layer(x)
        assert type(y.grad_fn).__name__ == "_Zero3LinearBackward"
    assert torch.nn.functional.linear is original


def test_a_zero3_case_traces_with_deepspeeds_linear_and_others_do_not():
    from harness.models.source import load_model
    from harness.predict.step import TraceSpec
    from harness.spec.cases import CASES_DIR, load_case

    specs = {name: TraceSpec.of(case, load_model(case.model)) for name in
             ("001-ladder-rung1-zero2", "001-ladder-rung4-zero3-offload", "003-qlora-fix-r16-seq512-gc")
             for case in [load_case(Path(CASES_DIR) / f"{name}.yaml")]}
    assert [s.zero3_linear for s in specs.values()] == [False, True, False]


TIMELINE = (Path(__file__).resolve().parent.parent
            / "results/timelines/nvidia-h200-x1/001-ladder-rung4-zero3-offload@u.json.gz")


def test_the_zero3_step_holds_what_guide_001s_recorded_rung_held_at_its_peak():
    """Guide 001 rung 4 (Qwen1.5-1.8B, LoRA r16 on q, k, v, o, fp16, 1 x 1024 tokens, no checkpointing,
    ZeRO-3 with parameter offload, one H200): at the recorded allocated peak (the loss's backward) the
    step's own allocations (those of the forward and backward, less DeepSpeed's gathered parameters and
    the two cuBLAS workspaces) add up to 5,031.45 MiB; the trace, extrapolated to the 24 layers, to the
    same within 0.1 MiB. Under DeepSpeed's linear every layer's frozen projections keep their inputs, the
    two RMSNorm outputs (read by q, k, v and by gate, up) and down_proj's input: 18.75 MiB a layer, 450 MiB
    in all, that autograd's linear would have freed."""
    from harness.measure.timeline import MemoryTimeline
    from harness.models.source import load_model
    from harness.predict.step import TraceSpec
    from harness.predict.trace.trace import extrapolate, trace_pair
    from harness.spec.cases import CASES_DIR, load_case
    from harness.spec.variants import parse_variant

    timeline = MemoryTimeline.load(TIMELINE)
    peak, _ = timeline.curve().peak("allocated")
    recorded = sum(b.size for b in timeline.live_at(peak) if b.phase in ("forward", "backward")
                   and "zero/partition_parameters" not in b.site and b.size != 32 * MiB)
    case = parse_variant("u").apply(load_case(Path(CASES_DIR) / "001-ladder-rung4-zero3-offload.yaml"))
    arch = load_model(case.model)
    r1, r2 = trace_pair(TraceSpec.of(case, arch))
    assert extrapolate(r1.peak, r2.peak, arch.layers) == pytest.approx(recorded, abs=0.1 * MiB)
