"""accelerate's `estimate-memory` training figure for a case, from the installed accelerate package.

`accelerate estimate-memory MODEL` builds the hub model's `AutoModel` in float32 on `meta`, sizes it
with `accelerate.utils.calculate_maximum_sizes`, and prints, per dtype, "Training using Adam": the
largest value of `accelerate.commands.estimate.estimate_training_usage(total_size, dtype)` (model,
gradients, optimizer, step). Here the model comes from the case's config instead of the hub
(`harness.predict.reference.counts`) and the dtype is the case's precision; the figure is computed
by those same two functions. accelerate has no training figure for int8 or int4 ("N/A"): a QLoRA
case gets the row of its precision, quantization unseen.
"""

from __future__ import annotations

from harness.predict.reference.counts import ModelCounts
from harness.predict.reference.estimate import Estimate
from harness.spec.schema import Case, Precision

DTYPE = {Precision.bf16: "bfloat16", Precision.fp16: "float16", Precision.fp32: "float32"}
_LEAVES_OUT = ("an untied output head (it sizes AutoModel), activations, ZeRO partitioning and offload (one device "
               "holds all), quantization, the CUDA context")


def accelerate_estimate(case: Case, counts: ModelCounts) -> Estimate:
    # heavy: accelerate imports torch; only the reference estimators need it
    from accelerate.commands.estimate import estimate_training_usage

    dtype = DTYPE[case.precision]
    sizes = estimate_training_usage(counts.accelerate_total_bytes, dtype)
    figure = max(sizes.values())  # as estimate_command prints it
    per_param = figure / counts.accelerate_total_bytes * 4  # bytes per float32 element
    procs = case.launch.procs_per_card
    jobs = f"; x {procs} jobs per card" if procs > 1 else ""
    terms = ", ".join(f"{k} {v}" for k, v in sizes.items())
    return Estimate(
        estimator="accelerate", per_card=int(figure) * procs,
        counts=(f"'Training using Adam' at {dtype}: the largest of model, gradients, optimizer and step "
                f"({per_param:g} B per base-model parameter), not their sum{jobs}"),
        leaves_out=_LEAVES_OUT,
        basis=(f"accelerate.commands.estimate.estimate_training_usage({counts.accelerate_total_bytes}, '{dtype}') "
               f"-> {terms}; the size from accelerate.utils.calculate_maximum_sizes(AutoModel, float32)"))
