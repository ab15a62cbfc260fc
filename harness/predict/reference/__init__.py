"""The reference estimators beside the predictor: what DeepSpeed, accelerate and LLaMA-Factory's table
say a case needs per card, so a benchmark can show their errors next to ours on the same runs.

    from harness.predict.reference import reference_estimates, estimator_errors

    for e in reference_estimates(case):           # one Estimate per estimator, bytes per card
        print(e.estimator, e.per_card, e.counts, e.leaves_out)
    summaries = estimator_errors([(case, measured_device_peak_per_card), ...])
    summaries["deepspeed"].median_abs, summaries["deepspeed"].worst

* `deepspeed`: DeepSpeed's ZeRO model-states estimators, called from the installed package
  (`harness.predict.reference.deepspeed_states`).
* `accelerate`: the "Training using Adam" figure of `accelerate estimate-memory`, computed by
  accelerate's own functions on the model built offline (`harness.predict.reference.accelerate_memory`).
* `llamafactory`: LLaMA-Factory's README "Hardware Requirement" table, kept as data
  (`harness.predict.reference.llamafactory_table`).

Each takes the model as the case measures it (`case.layers` applied), built on `meta` from its
config (`harness.predict.reference.counts`): no weights, no download. None of them sees the
activations, the allocator or the CUDA context; that is what the comparison shows.
"""

from __future__ import annotations

from harness.predict.reference.errors import ErrorSummary, EstimatorError, estimator_errors
from harness.predict.reference.estimate import Estimate
from harness.predict.reference.estimators import ESTIMATORS, reference_estimates

__all__ = ["ESTIMATORS", "ErrorSummary", "Estimate", "EstimatorError", "estimator_errors", "reference_estimates"]
