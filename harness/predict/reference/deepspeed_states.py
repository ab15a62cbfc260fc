"""DeepSpeed's ZeRO model-states estimate for a case, from the installed deepspeed package.

`deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs` and
`deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs` are the functions behind the
documented `estimate_zero{2,3}_model_states_mem_needs_all_cold` printers (which print a table of
every offload choice and return nothing); they return (host bytes, GPU bytes[, largest layer bytes])
for one choice, which is taken from the case's `deepspeed` block:

* stage 3: `cpu_offload` = offload_optimizer is cpu, `cpu_offload_params` = offload_param is cpu,
  `zero_init` = the model is built under DeepSpeed (launch.init_order deepspeed_first);
* stage 2: `cpu_offload` = offload_optimizer is cpu;
* stage 1: DeepSpeed has no stage-1 estimator; the stage-2 one (the same module, the same optimizer
  class) is used, which partitions the 16-bit gradients that ZeRO-1 keeps whole;
* no DeepSpeed or stage 0: the stage-2 estimator on one GPU, no offload (nothing partitioned).

`num_gpus_per_node` is launch.ranks on one node. The estimators assume every parameter trains (full
fine-tuning): for LoRA and QLoRA they are given the base model's parameters, frozen and 4-bit ones
alike, which is what a user of the tool gets.
"""

from __future__ import annotations

from harness.predict.reference.counts import ModelCounts
from harness.predict.reference.estimate import Estimate
from harness.spec.schema import Case, Offload

_LEAVES_OUT = ("activations, LoRA adapters, buckets and gathered prefetch beyond one layer, the allocator's cache "
               "and the CUDA context")
_TRAINABLE = "every parameter counted as trainable (full fine-tuning), frozen and 4-bit base weights included"


def deepspeed_estimate(case: Case, counts: ModelCounts) -> Estimate:
    ds = case.deepspeed
    stage = 0 if ds is None else ds.stage
    n, layer = counts.total_params, counts.largest_layer_params
    opt_off = ds is not None and ds.offload_optimizer == Offload.cpu
    if stage == 3:
        # heavy: DeepSpeed (and torch), only for its own estimator
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        param_off = ds.offload_param == Offload.cpu
        args = dict(total_params=n, largest_layer_params=layer, num_gpus_per_node=case.launch.ranks, num_nodes=1,
                    cpu_offload=opt_off, cpu_offload_params=param_off,
                    zero_init=case.launch.init_order == "deepspeed_first")
        host, gpu, _layer_bytes = estimate_zero3_model_states_mem_needs(**args)
        function = "stage3.estimate_zero3_model_states_mem_needs"
        if opt_off and param_off:
            what = "ZeRO-3 with optimizer and parameter offload: one gathered largest layer (4 B per parameter)"
        elif opt_off:
            what = "ZeRO-3, optimizer offloaded: 16-bit parameter partition (2 B x params / GPUs) + largest layer (4 B)"
        else:
            what = ("ZeRO-3: 18 B x params / GPUs (16-bit parameters and gradients, fp32 master, Adam moments) "
                    "+ largest layer (4 B)")
            if param_off:
                what += " (its estimator has no row for parameter offload without optimizer offload)"
    else:
        # heavy: DeepSpeed (and torch), only for its own estimator
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        gpus = case.launch.ranks if stage else 1
        args = dict(total_params=n, num_gpus_per_node=gpus, num_nodes=1, cpu_offload=opt_off)
        host, gpu = estimate_zero2_model_states_mem_needs(**args)
        function = "stage_1_and_2.estimate_zero2_model_states_mem_needs"
        if stage == 0:
            what = ("no ZeRO (DeepSpeed has no estimator for it): ZeRO-2's on one GPU, 2 B (16-bit parameters) "
                    "+ 18 B (gradients, fp32 master, Adam moments) per parameter")
        elif opt_off:
            what = "ZeRO-2, optimizer offloaded: the 16-bit parameters (2 B per parameter)"
        else:
            what = ("ZeRO-2: 16-bit parameters (2 B per parameter) + 18 B x params / GPUs (gradients, fp32 master, "
                    "Adam moments)")
        if stage == 1:
            what += "; ZeRO-1 counted as ZeRO-2 (DeepSpeed has no stage-1 estimator)"
    procs = case.launch.procs_per_card
    jobs = f"; x {procs} jobs per card" if procs > 1 else ""
    call = ", ".join(f"{k}={v}" for k, v in args.items())
    return Estimate(estimator="deepspeed", per_card=int(gpu) * procs, counts=f"{what}; {_TRAINABLE}{jobs}",
                    leaves_out=_LEAVES_OUT, basis=f"deepspeed.runtime.zero.{function}({call})", host=int(host))
