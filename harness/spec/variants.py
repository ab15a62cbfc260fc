"""Measurement variants: a case measured with fewer ranks or fewer layers than it is written with.

A config too big for the cards at hand is measured at full width with fewer layers (and, for
multi-rank ZeRO jobs, on fewer ranks), then extrapolated in depth (`harness.judge.extrapolation`). A
variant is the case itself with those two fields changed; everything else (the card it targets, its
budget, its claims) stays, and every figure measured on a variant carries the variant's label.

Fewer ranks is conservative for a job that fits: ZeRO shards parameters, gradients and optimizer
state over the ranks, so each rank holds at least as much on 2 ranks as on 8, while activations per
rank do not depend on the world size. A "fits" verdict on fewer ranks therefore carries over to the
case as written; an OOM does not, and is never reported as the case's.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.models.source import load_model
from harness.spec.schema import Case


@dataclass(frozen=True)
class Variant:
    ranks: int | None = None  # None: as the case is written
    layers: int | None = None  # None: as the case is written (its `layers`, else full depth)
    grad_accum: int | None = None  # None: as written. Memory does not grow with accumulation past 2
    # micro steps (the gradient buffer exists from the second on), so a run that only needs the peak
    # may cap it; tokens/s then amortises the optimizer step over fewer tokens, and says so.
    uncapped: bool = False  # on the whole card, not emulating the target: a speed for a config that
    # runs out of memory on its own card (guide 001's speed order of rungs that each do)

    @property
    def case_unchanged(self) -> bool:
        return self.ranks is None and self.layers is None and self.grad_accum is None

    @property
    def as_written(self) -> bool:
        return self.case_unchanged and not self.uncapped

    def fewer_ranks(self, case: Case) -> bool:
        """Measured on fewer ranks than `case` is written with: a fit carries over, an excess does not."""
        return self.ranks is not None and self.ranks < case.launch.ranks

    @property
    def suffix(self) -> str:
        """Appended to the case id in run folders and baseline names: '', '@2r', '@8L', '@2r8L'."""
        if self.as_written:
            return ""
        return "@" + self.text

    @property
    def text(self) -> str:
        return ((f"{self.ranks}r" if self.ranks else "") + (f"{self.layers}L" if self.layers else "")
                + (f"{self.grad_accum}ga" if self.grad_accum else "") + ("u" if self.uncapped else ""))

    def label(self, case: Case) -> str:
        """How a figure measured on this variant is described in reports."""
        depth = load_model(case.model).layers
        layers = self.layers or case.layers
        parts = [f"{self.ranks or case.launch.ranks} of {case.launch.ranks} ranks"] if self.ranks else []
        parts.append("full depth" if layers in (None, depth) else f"{layers} of {depth} layers")
        if self.grad_accum:
            parts.append(f"grad accum {self.grad_accum} of {case.train.grad_accum}")
        if self.uncapped:
            parts.append("on the whole card, not its target's")
        return ", ".join(parts)

    def apply(self, case: Case) -> Case:
        """The case as measured. Validated like a case file, so a variant cannot be inconsistent."""
        if self.case_unchanged:
            return case
        data = case.model_dump(mode="json")
        if self.ranks is not None:
            if self.ranks > case.launch.ranks:
                raise ValueError(f"{case.id}: a variant may only lower the ranks ({case.launch.ranks}), not raise them")
            if case.deepspeed is None and self.ranks != case.launch.ranks:
                raise ValueError(f"{case.id}: only DeepSpeed jobs can run on fewer ranks")
            data["launch"]["ranks"] = self.ranks
        if self.layers is not None:
            data["layers"] = self.layers
            data["depth_points"] = None  # this variant is one of those depths
        if self.grad_accum is not None:
            if self.grad_accum > case.train.grad_accum:
                raise ValueError(f"{case.id}: a variant may only lower grad_accum ({case.train.grad_accum})")
            data["train"]["grad_accum"] = self.grad_accum
        # memory claims are about the case as written; a variant checks only the relative ones here.
        # `lower_peak_than` comes back in the session: two configs measured alike compare at every
        # depth and at the full depth (harness.judge.verdicts.lower_peak_on_variants)
        data["claims"] = [c for c in data["claims"] if c["kind"] not in ("memory_range", "oom_tried_to_allocate",
                                                                          "speed_rank", "lower_peak_than",
                                                                          "checkpointing_saving")]
        # sizes were normalised to bytes on load; a variant keeps them as byte counts
        data["target"]["card"]["memory"] = f"{case.target.card.memory} B"
        if case.target.host_ram is not None:
            data["target"]["host_ram"] = f"{case.target.host_ram} B"
        return Case.model_validate(data)


def parse_variant(text: str) -> Variant:
    """'2r', '8L', '2ga', '2r8L2ga', 'u' (the suffix without '@'), as typed on the command line; ''
    is the case as written."""
    import re

    m = re.fullmatch(r"(?:(\d+)r)?(?:(\d+)L)?(?:(\d+)ga)?(u)?", text.strip())
    if not m or any(g is not None and int(g) == 0 for g in m.groups()[:3]):
        raise ValueError(f"variant '{text}': write ranks, layers and/or grad accum as '2r', '8L', '2ga' or "
                         "'2r8L2ga', with 'u' last for the whole card ('2r8Lu')")
    ranks, layers, accum = (int(g) if g else None for g in m.groups()[:3])
    return Variant(ranks=ranks, layers=layers, grad_accum=accum, uncapped=m.group(4) is not None)
