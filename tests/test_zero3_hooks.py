"""DeepSpeed's ZeRO-3 hooks, recorded on the case's model, fire as in a real run (harness.predict.zero3.hooks)."""

import json
from pathlib import Path

import pytest

from harness.predict.zero3.order import (
    BACKWARD_START,
    BWD_POST,
    BWD_PRE,
    EVENT_NAMES,
    FWD_POST,
    FWD_PRE,
    ModelLayout,
    ModuleSpec,
    ParamSpec,
    build_step,
)

pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parent.parent
CASE = "000-lora-z3-offload-cutoff1024-ga16-nonreentrant"
REAL_RUN = ROOT / "tests" / "data" / "zero3-hooks-000-nonreentrant-tiny.tsv"
LAYER1 = "base_model.model.model.layers.1"


@pytest.fixture(scope="module")
def recorded():
    from harness.models.source import load_model
    from harness.predict.step import TraceSpec
    from harness.predict.zero3.hooks import hook_spec, record
    from harness.spec.cases import load_case
    from harness.spec.variants import parse_variant

    case = parse_variant("2r4L2ga").apply(load_case(ROOT / "cases" / f"{CASE}.yaml"))
    return record(hook_spec(TraceSpec.of(case, load_model(case.model))))


def _named(log) -> list[tuple[str, str]]:
    return [(EVENT_NAMES[e], name) for e, name in log.events if e != BACKWARD_START]


def test_the_recorded_order_is_a_real_runs_call_for_call(recorded):
    """The hooks recorded on the full-width model (two layers, fake tensors) against DeepSpeed's coordinator
    logged in a real ZeRO-3 run of the same case (tiny, two ranks on gloo): every fetch and release, in order.
    The recompute's own layer hooks depend on transformers' version (they fire in 5.17, not from 5.23)."""
    import transformers

    lines = REAL_RUN.read_text().splitlines()
    version = next(line for line in lines if line.startswith("# transformers ")).split()[2].rstrip(",")
    if transformers.__version__ != version:
        pytest.skip(f"the real run was logged with transformers {version}; {transformers.__version__} is installed")
    real = [tuple(line.split("\t")) for line in lines if not line.startswith("#")]
    assert _named(recorded) == real


def test_non_reentrant_checkpointing_recomputes_after_the_pre_backwards_and_stops_at_the_last_saved_tensor(recorded):
    events = _named(recorded)
    down_b = f"{LAYER1}.mlp.down_proj.lora_B.default"
    start = events.index(("backward pre", LAYER1))
    end = events.index(("backward post", LAYER1))
    layer = events[start:end]
    recompute = [i for i, (e, _) in enumerate(layer) if e.startswith("forward")]
    # the gradient reaches the layer, its MLP, the down projection and its lora_B before anything is recomputed
    assert [n for e, n in layer[:recompute[0]] if e == "backward pre"] == [
        LAYER1, f"{LAYER1}.mlp", f"{LAYER1}.mlp.down_proj", down_b]
    # the recompute ends inside lora_B's forward (its matmul saves the last tensor the backward needs): its
    # forward hook and those of the modules around it never fire
    assert layer[recompute[-1]] == ("forward pre", down_b)
    assert ("forward post", down_b) not in layer and ("forward post", f"{LAYER1}.mlp.down_proj") not in layer
    # call order: the input norm before attention, the post-attention norm between attention and the MLP
    forward = events[:events.index(("backward pre", "root"))]
    order = [n for e, n in forward if e == "forward pre" and n.startswith(LAYER1 + ".")]
    assert order.index(f"{LAYER1}.input_layernorm") < order.index(f"{LAYER1}.self_attn.q_proj")
    assert (order.index(f"{LAYER1}.self_attn.o_proj") < order.index(f"{LAYER1}.post_attention_layernorm")
            < order.index(f"{LAYER1}.mlp.gate_proj"))


def test_hooks_autograd_never_fires_are_not_recorded(recorded):
    """DeepSpeed releases a module after backward through its positional inputs: attention, called with its
    hidden states by keyword, and the embedding, whose input is token ids, get no post-backward hook."""
    events = _named(recorded)
    assert ("backward pre", f"{LAYER1}.self_attn") in events
    assert ("backward post", f"{LAYER1}.self_attn") not in events
    assert ("backward pre", "base_model.model.model.embed_tokens") in events
    assert ("backward post", "base_model.model.model.embed_tokens") not in events


def _layout() -> ModelLayout:
    return ModelLayout(before=(ModuleSpec("m.embed", (ParamSpec(0, 100, False),)),),
                       layer=(ModuleSpec("m.layers.0.attn", (ParamSpec(10, 50, False),)),
                              ModuleSpec("m.layers.0.mlp", (ParamSpec(11, 60, True),))),
                       after=(ModuleSpec("m.head", (ParamSpec(1, 100, False),)),))


def _log(events):
    from harness.predict.zero3.hooks import HookLog

    return HookLog.from_dict(json.loads(json.dumps({"events": events, "stack": "m.layers"})))


def test_the_two_recorded_layers_are_laid_out_at_the_cases_depth():
    from harness.predict.zero3.hooks import expand

    layer = lambda i, e: [[e, f"m.layers.{i}"], [e, f"m.layers.{i}.attn"], [e, f"m.layers.{i}.act"],  # noqa: E731
                          [e, f"m.layers.{i}.mlp"]]
    log = _log([[FWD_PRE, "root"], [FWD_PRE, "m.embed"], *layer(0, FWD_PRE), *layer(1, FWD_PRE), [FWD_PRE, "m.head"],
                [BACKWARD_START, "root"], [BWD_PRE, "m.head"], *layer(1, BWD_PRE), *layer(0, BWD_PRE),
                [BWD_PRE, "m.embed"]])
    step = build_step(_layout(), 4)
    events = expand(log, step)
    names = [(e, m.name) for e, m in events]
    forward = [n for e, n in names[:names.index((BACKWARD_START, "root"))] if n.endswith(".mlp")]
    backward = [n for e, n in names[names.index((BACKWARD_START, "root")):] if n.endswith(".mlp")]
    assert forward == [f"m.layers.{i}.mlp" for i in range(4)]
    assert backward == [f"m.layers.{i}.mlp" for i in (3, 2, 1, 0)]
    # a module that holds parameters is the step's own, with that layer's parameters; one that holds none
    # (the activation) a module of its own in that layer; the layer itself the step's container
    mlp3 = next(m for e, m in events if m.name == "m.layers.3.mlp")
    assert mlp3 is step.layers[3].children[1] and mlp3.params[0].trainable
    act2 = next(m for e, m in events if m.name == "m.layers.2.act")
    assert act2.params == [] and act2.layer == 2
    assert [e for e, m in events if m is step.layers[1]] == [FWD_PRE, BWD_PRE]


def test_hooks_of_one_layer_in_two_runs_are_refused():
    from harness.predict.zero3.hooks import expand

    log = _log([[FWD_PRE, "m.layers.0.attn"], [FWD_PRE, "m.layers.1.attn"], [FWD_POST, "m.layers.0.attn"],
                [BACKWARD_START, "root"], [BWD_PRE, "m.layers.1.attn"], [BWD_POST, "m.layers.0.attn"]])
    with pytest.raises(ValueError, match="more than one run"):
        expand(log, build_step(_layout(), 3))
