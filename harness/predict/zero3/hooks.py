"""The order in which DeepSpeed's ZeRO-3 hooks fire over a training step, recorded on the case's model.

DeepSpeed drives its parameter coordinator from hooks on every module of the model
(`DeepSpeedZeRoOffload.setup_zero_stage3_hooks`, runtime/zero/parameter_offload.py): a forward pre-hook
fetches a module's parameters and a forward hook releases them; a function applied to the module's
outputs fetches them again when the gradient reaches them, one applied to its positional inputs
releases them when the gradient has passed. Which of these fire, and in what order, is decided by the
model code, peft, transformers' checkpointing and autograd, so `record` does not derive it: it registers
DeepSpeed's own hooks (that method, from the installed DeepSpeed) on the model as the trace builds it,
two decoder layers on fake tensors (`harness.predict.trace.fake.fake_step`), with a coordinator that only
writes each call down, and runs one forward and backward as the case's stack does. What the recording
holds that a derivation from the module tree would have to guess:

* the call order, not the definition order (Qwen2's and Llama's norms are defined after the MLP and
  called before attention and the MLP; Phi-3 defines `o_proj` before `qkv_proj`);
* modules that hold no parameter (containers, activations, LoRA's dropouts): each one's fetch is a
  prefetch opportunity for the coordinator;
* the hooks autograd never fires: a module whose input is passed by keyword (`self_attn`) or needs no
  gradient (the embedding's token ids) gets no post-backward;
* checkpointing's recompute: non-reentrant checkpointing recomputes a layer when its backward first
  unpacks a saved tensor, after the pre-backward hooks down to that module, and stops at the last
  tensor the backward needs (`torch.utils.checkpoint`'s early stop), so the hooks after it never fire;
  whether the layer's own hooks fire again depends on what transformers checkpoints (`__call__` in
  5.17, `forward` in later versions).

`expand` lays the two recorded layers out at the case's depth (layer 0 as recorded, every later layer as
layer 1) for `harness.predict.zero3.coordinator.replay`. The recording is cached on disk beside the layout, keyed by
the trace spec, this code and the libraries' versions (`harness.predict.zero3.coordinator`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from harness.predict.constants import RECORDED_LAYERS, RECORDED_TOKENS
from harness.predict.zero3.hook_calls import Recorder, hooked, module_stack_kept
from harness.predict.zero3.order import BACKWARD_START, BWD_POST, BWD_PRE, Module, Step


def hook_spec(trace_spec):
    """The trace spec the hooks are recorded under: the case's, at one sequence of `RECORDED_TOKENS`."""

    return dataclasses.replace(trace_spec, seq_len=RECORDED_TOKENS, micro_batch=1, accumulated_grads=False)


@dataclass(frozen=True)
class HookLog:
    """One training step's hook events of a model with `RECORDED_LAYERS` decoder layers: (event, module
    name), the events of `harness.predict.zero3.order`, `BACKWARD_START` where backward begins."""

    events: tuple[tuple[int, str], ...]
    stack: str  # the name of the module list that holds the decoder layers

    def to_dict(self) -> dict:
        return {"events": [list(e) for e in self.events], "stack": self.stack}

    @classmethod
    def from_dict(cls, d: dict) -> HookLog:
        return cls(tuple((int(e), str(n)) for e, n in d["events"]), str(d["stack"]))


def record(trace_spec) -> HookLog:
    """The hook events of one training step of the case's model (two decoder layers), as DeepSpeed's hooks
    fire them (`harness.predict.zero3.coordinator` keeps them on disk)."""
    # heavy: torch and transformers, imported only where a step is traced
    from harness.predict.trace.fake import (
        _decoder_stack,
        fake_step,
    )

    recorder = Recorder({})
    stack = [""]

    def prepare(model) -> None:
        recorder.names.update({id(m): name or "root" for name, m in model.named_modules()})
        stack[0] = _decoder_stack(model, RECORDED_LAYERS)
        hooked(model, recorder)

    with module_stack_kept():
        fake_step(trace_spec, RECORDED_LAYERS, prepare)
    events = recorder.events
    first_backward = next((i for i, (e, _) in enumerate(events) if e in (BWD_PRE, BWD_POST)), None)
    if first_backward is None or not stack[0]:
        raise ValueError("no backward hook fired, or no decoder layers were found: the hook order was not recorded")
    events.insert(first_backward, (BACKWARD_START, "root"))
    return HookLog(tuple(events), stack[0])


def expand(log: HookLog, step: Step) -> list[tuple[int, Module]]:
    """The recorded events at the step's depth, each with the step's module of that name (its parameters at
    that layer; a module that holds none, a new one): layer 0 as recorded, each later layer as layer 1.
    A ValueError where a recorded layer's events are not one run in forward and one in backward."""
    # heavy: torch and transformers, imported only where a step is traced
    from harness.predict.trace.fake import _layer_index

    depth = len(step.layers)
    split = next(i for i, (e, _) in enumerate(log.events) if e == BACKWARD_START)
    by_name: dict[str, Module] = {m.name: m for m in step.before + step.after}
    for i, layer in enumerate(step.layers):
        by_name[f"{log.stack}.{i}"] = layer
        by_name.update({m.name: m for m in layer.children})

    def module(name: str, layer: int | None) -> Module:
        if name not in by_name:
            by_name[name] = Module(name, [], layer)
        return by_name[name]

    def lay_out(events, backward: bool) -> list[tuple[int, Module]]:
        head, blocks, tail = [], {0: [], 1: []}, []
        last = None
        for event, name in events:
            layer = _layer_index(name, log.stack)
            if layer is None:
                (tail if last is not None else head).append((event, name))
                continue
            if layer != last and blocks[layer]:
                raise ValueError(f"the hooks of decoder layer {layer} fired in more than one run")
            if tail:
                raise ValueError("hooks outside the decoder layers fired between them")
            blocks[layer].append((event, name))
            last = layer
        order = range(depth - 1, -1, -1) if backward else range(depth)
        out = [(e, module(n, None)) for e, n in head]
        for i in order:
            template = blocks[0] if i == 0 else blocks[1]
            src = f".{0 if i == 0 else 1}"
            pattern = re.compile(re.escape(log.stack + src) + r"(?=\.|$)")
            out += [(e, module(pattern.sub(f"{log.stack}.{i}", n, count=1), i)) for e, n in template]
        return out + [(e, module(n, None)) for e, n in tail]

    forward = lay_out(log.events[:split], backward=False)
    backward = lay_out(log.events[split + 1:], backward=True)
    return [*forward, (BACKWARD_START, step.root), *backward]
