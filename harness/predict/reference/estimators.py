"""Every reference estimator's figure for one case, in a fixed order."""

from __future__ import annotations

from collections.abc import Callable

from harness.predict.reference.accelerate_memory import accelerate_estimate
from harness.predict.reference.counts import ModelCounts, model_counts
from harness.predict.reference.deepspeed_states import deepspeed_estimate
from harness.predict.reference.estimate import Estimate
from harness.predict.reference.llamafactory_table import llamafactory_estimate
from harness.spec.schema import Case

ESTIMATORS: dict[str, Callable[[Case, ModelCounts], Estimate]] = {
    "deepspeed": deepspeed_estimate,
    "accelerate": accelerate_estimate,
    "llamafactory": llamafactory_estimate,
}


def reference_estimates(case: Case) -> list[Estimate]:
    """One estimate per estimator (ESTIMATORS' order) for the case as measured."""
    counts = model_counts(case)
    return [estimate(case, counts) for estimate in ESTIMATORS.values()]
