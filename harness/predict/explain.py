"""What `oom-harness check --explain` prints: the dispatch table's row a config took, and the method and
figures of each stage of its prediction, in the order they ran (harness.predict.predictor)."""

from __future__ import annotations

from dataclasses import asdict

from harness.predict.dispatch import ALLOCATED, DEVICE, RESERVED, TABLE, describe
from harness.spec.units import fmt_gib

# a stage's methods by its name: a method name can size more than one part (`zero2_stream` sizes both
# allocated and reserved, each with its own description)
_METHODS = {"allocated": ALLOCATED, "reserved": RESERVED, "device": DEVICE}
# figures that are not bytes: ratios, and counts of elements
_RATIOS = {"reserved_over_allocated", "zero3_cached_gathers"}
_COUNTS = {"parameters"}


def _figure(name: str, value: float) -> str:
    if name in _RATIOS:
        return f"{value:.3f}"
    if name in _COUNTS:
        return f"{value:,.0f}"
    return fmt_gib(value)


def explain_dict(prediction) -> dict:
    """The route and the stages, for `check --explain --json`."""
    return {"route": prediction.route, "kind": dict(prediction.kind),
            "stages": [asdict(s) for s in prediction.stages]}


def explain_lines(prediction) -> list[str]:
    """The route, the row's methods and each stage's method and figures."""
    row = next(r for r in TABLE if r.name == prediction.route)
    lines = [f"dispatch: row `{row.name}` (when {describe(row.when())})",
             f"  this config: {describe(prediction.kind)}",
             f"  allocated by `{row.allocated}`, reserved by `{row.reserved}` "
             f"(on another allocator `{row.fallback}`), device by `{row.device}`",
             "stages, in the order they ran:"]
    for stage in prediction.stages:
        what = _METHODS.get(stage.name, {}).get(stage.method)
        lines.append(f"  {stage.name}: `{stage.method}`" + (f" ({what.what}; {what.module})" if what else ""))
        lines += [f"      {name:<36} {_figure(name, value)}" for name, value in stage.figures.items()]
    return lines
