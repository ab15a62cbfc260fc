"""The modules of a model as DeepSpeed's ZeRO-3 coordinator is driven with, and an order of its hooks
derived from the module tree.

A case's model has the order of its hooks recorded: DeepSpeed's own hook registration on the model as the
trace builds it (`harness.predict.zero3.hooks`). What is here serves that and what has no model behind it:

* `ModelLayout`: the parameter-holding modules of a model with one decoder layer, split around the layer
  (`harness.predict.zero3.coordinator.layout_of`); `build_step` repeats the layer to any depth with fresh parameters.
* `step_events`: the hook order derived from a layout alone, for a layout built by hand (the coordinator's
  unit tests): forward in definition order, each module around the modules its name prefixes; backward in
  reverse, a pre-backward where the module's output needs a gradient and a post-backward where its input
  does; a checkpointed layer recomputed whole before its first backward module (non-reentrant) or before
  its backward (reentrant). The recording shows where a real model departs from this: the call order is
  not the definition order (Qwen2's norms), modules without parameters fetch too, a module given its input
  by keyword gets no post-backward, and non-reentrant checkpointing stops the recompute at the last saved
  tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FWD_PRE, FWD_POST, BWD_PRE, BWD_POST, BACKWARD_START, RECOMPUTE = range(6)
EVENT_NAMES = ("forward pre", "forward post", "backward pre", "backward post", "backward start", "recompute")


@dataclass(frozen=True)
class ParamSpec:
    key: int  # one per parameter object (a tied embedding and head share it)
    numel: int
    trainable: bool


@dataclass(frozen=True)
class ModuleSpec:
    name: str
    params: tuple[ParamSpec, ...]  # the module's own parameters (recurse=False)

    @property
    def trainable(self) -> bool:
        return any(p.trainable for p in self.params)


@dataclass(frozen=True)
class ModelLayout:
    """A model's parameter-holding modules in definition order, split around its decoder layers; the
    layer template is layer 0's, repeated to any depth with fresh parameter keys."""

    before: tuple[ModuleSpec, ...]  # the embedding and whatever precedes the first layer
    layer: tuple[ModuleSpec, ...]  # one decoder layer's modules
    after: tuple[ModuleSpec, ...]  # final norm, output head

    def to_dict(self) -> dict:
        def mods(ms):
            return [[m.name, [[p.key, p.numel, p.trainable] for p in m.params]] for m in ms]
        return {"before": mods(self.before), "layer": mods(self.layer), "after": mods(self.after)}

    @classmethod
    def from_dict(cls, d: dict) -> ModelLayout:
        def mods(ms):
            return tuple(ModuleSpec(n, tuple(ParamSpec(k, int(s), bool(t)) for k, s, t in ps)) for n, ps in ms)
        return cls(mods(d["before"]), mods(d["layer"]), mods(d["after"]))


@dataclass
class Module:
    """A module at the case's depth: what DeepSpeed's coordinator is driven with."""

    name: str
    params: list[ParamSpec]
    layer: int | None = None  # decoder layer index; None outside the layers
    children: list[Module] = field(default_factory=list)  # a container's modules (root, decoder layer)

    @property
    def trainable(self) -> bool:
        return any(p.trainable for p in self.params)


@dataclass
class Step:
    """The root and its decoder layers at the case's depth, and every parameter."""

    root: Module
    before: list[Module]
    layers: list[Module]  # containers, each with its modules as children
    after: list[Module]
    params: dict[int, ParamSpec]


def build_step(layout: ModelLayout, layers: int) -> Step:
    keys = {p.key for m in layout.before + layout.after for p in m.params}
    next_key = max([p.key for m in layout.before + layout.layer + layout.after for p in m.params], default=0) + 1
    params: dict[int, ParamSpec] = {}

    def own(specs, layer=None, remap=None):
        out = []
        for m in specs:
            ps = [remap.get(p.key, p) if remap else p for p in m.params]
            for p in ps:
                params[p.key] = p
            out.append(Module(m.name if layer is None else m.name.replace(".layers.0.", f".layers.{layer}.", 1),
                              ps, layer))
        return out

    before = own(layout.before)
    after = own(layout.after)
    decoder = []
    for i in range(layers):
        remap = {}
        for m in layout.layer:
            for p in m.params:
                if p.key in keys:  # shared with a module outside the layers: keep the object
                    continue
                remap[p.key] = ParamSpec(next_key, p.numel, p.trainable)
                next_key += 1
        decoder.append(Module(f"layers.{i}", [], i, own(layout.layer, i, remap)))
    root = Module("root", [], None, before + decoder + after)
    return Step(root, before, decoder, after, params)


Node = tuple[Module, list]  # a module and the modules inside it (its name's children), in order


def nested(modules: list[Module]) -> list[Node]:
    """`modules` (in definition order) as a forest by name: a module whose name prefixes the next ones'
    (a LoRA layer holding its adapters' `lora_A` weight, `base_layer`, `lora_A`, `lora_B`) encloses
    them, as its forward encloses theirs."""
    roots: list[Node] = []
    stack: list[tuple[str, list[Node]]] = [("", roots)]
    for m in modules:
        while len(stack) > 1 and not m.name.startswith(stack[-1][0] + "."):
            stack.pop()
        node: Node = (m, [])
        stack[-1][1].append(node)
        stack.append((m.name, node[1]))
    return roots


def step_events(step: Step, checkpointing: str, input_requires_grad: bool) -> list[tuple[int, Module]]:
    """(event, module) in the order DeepSpeed's hooks fire over one forward and backward.
    `checkpointing`: "none", "reentrant" or "nonreentrant". `BACKWARD_START` marks where backward
    begins (the loss and the logits live); `RECOMPUTE` where a checkpointed layer's forward is
    recomputed (the driver runs what follows inside autograd's graph task)."""
    ev: list[tuple[int, Module]] = []
    grad_in: dict[int, bool] = {}  # id(module) -> its input needs a gradient
    flowing = input_requires_grad
    for m in step.before:
        grad_in[id(m)] = flowing
        flowing = flowing or m.trainable
    layer_in: list[bool] = []
    for layer in step.layers:
        layer_in.append(flowing)
        for m in layer.children:
            grad_in[id(m)] = flowing
        flowing = flowing or any(m.trainable for m in layer.children)
    for m in step.after:
        grad_in[id(m)] = flowing
        flowing = flowing or m.trainable

    def out_grad(m: Module) -> bool:
        return grad_in[id(m)] or m.trainable

    def fwd(nodes: list[Node]) -> None:
        for m, inner in nodes:
            ev.append((FWD_PRE, m))
            fwd(inner)
            ev.append((FWD_POST, m))

    def bwd(nodes: list[Node], first_pre: Module | None = None) -> None:
        """Reverse order; a module's pre-backward before those of the modules inside it, its
        post-backward after theirs. `first_pre`: its pre-backward has been written already."""
        for m, inner in reversed(nodes):
            if out_grad(m) and m is not first_pre:
                ev.append((BWD_PRE, m))
            bwd(inner)
            if out_grad(m) and grad_in[id(m)]:
                ev.append((BWD_POST, m))

    def layer_fwd(layer: Module, nodes: list[Node]) -> None:
        ev.append((FWD_PRE, layer))
        fwd(nodes)
        ev.append((FWD_POST, layer))

    ev.append((FWD_PRE, step.root))
    fwd(nested(step.before))
    for layer in step.layers:
        layer_fwd(layer, nested(layer.children))
    fwd(nested(step.after))
    ev.append((FWD_POST, step.root))

    ev.append((BACKWARD_START, step.root))
    ev.append((BWD_PRE, step.root))
    bwd(nested(step.after))
    for layer, needs in reversed(list(zip(step.layers, layer_in, strict=True))):
        nodes = nested(layer.children)
        if not any(out_grad(m) for m in layer.children) and not needs:
            continue
        if checkpointing == "reentrant":
            ev.append((RECOMPUTE, layer))
            layer_fwd(layer, nodes)
            ev.append((BWD_PRE, layer))
            bwd(nodes)
            if needs:
                ev.append((BWD_POST, layer))
            continue
        ev.append((BWD_PRE, layer))
        first = next((m for m, _ in reversed(nodes) if out_grad(m)), None)
        if checkpointing == "nonreentrant" and first is not None:
            ev.append((BWD_PRE, first))
            ev.append((RECOMPUTE, layer))
            layer_fwd(layer, nodes)
        bwd(nodes, first_pre=first if checkpointing == "nonreentrant" else None)
        if needs:
            ev.append((BWD_POST, layer))
    bwd(nested(step.before))
    return ev
