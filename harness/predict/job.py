"""What every stage of a prediction reads and adds to: the case at its depth, its route through the
dispatch table, and the notes, terms and stage records gathered so far (harness.predict.predictor)."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.models.registry import Architecture
from harness.predict.dispatch import Route
from harness.spec.schema import Case


@dataclass
class Stage:
    """One stage of a prediction as `check --explain` prints it: the method that sized it (after any
    stand-in at run time) and the figures it produced: bytes, or a fitted ratio."""

    name: str
    method: str
    figures: dict[str, float] = field(default_factory=dict)


@dataclass
class Job:
    case: Case
    arch: Architecture
    layers: int  # the depth predicted at: the case's `layers`, else the model's
    hidden: int
    trace_spec: object  # harness.predict.trace.trace.TraceSpec
    route: Route
    notes: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    terms: dict[str, int] = field(default_factory=dict)
    stages: list[Stage] = field(default_factory=list)

    def record(self, name: str, method: str, **figures: float) -> None:
        self.stages.append(Stage(name, method, dict(figures)))
