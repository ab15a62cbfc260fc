"""The DeepSpeed config a case implies, with "auto" values resolved as the HF integration does."""

from __future__ import annotations

from harness.spec.schema import Case, Offload, Precision

# DeepSpeedZeroOptimizer.nccl_start_alignment_factor (deepspeed/runtime/zero/stage_1_and_2.py, 0.19.8): ZeRO-1/2
# pad partitions to it and assert that allgather_bucket_size is a multiple of it
NCCL_START_ALIGNMENT = 2


def auto_sizes(hidden_size: int) -> dict[str, int]:
    """What transformers' HfTrainerDeepSpeedConfig puts for 'auto' buckets and thresholds
    (LLaMA-Factory's ds_z*_config.json files leave them 'auto')."""
    return {
        "reduce_bucket_size": hidden_size * hidden_size,
        "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "stage3_param_persistence_threshold": 10 * hidden_size,
    }


def deepspeed_config(case: Case, world_size: int, grad_accum: int, hidden_size: int, on_cpu: bool,
                     size_scale: float = 1.0) -> dict | None:
    """`size_scale` shrinks element-count buckets and thresholds with the model (tiny mode), so a
    threshold keeps partitioning the same share of parameters at tiny size."""
    ds = case.deepspeed
    if ds is None:
        return None
    auto = auto_sizes(hidden_size)

    def pick(name: str, value: int | None) -> int | None:
        """The case's value, else HF's 'auto' value, scaled with the model (0 stays 0)."""
        base = value if value is not None else auto.get(name)
        if base is None:
            return None
        if base <= 0 or size_scale == 1.0:
            return base
        # a scaled bucket stays a multiple of ZeRO-1/2's alignment, which DeepSpeed asserts
        return max(NCCL_START_ALIGNMENT, NCCL_START_ALIGNMENT * round(base * size_scale / NCCL_START_ALIGNMENT))

    zero: dict = {
        "stage": ds.stage,
        "overlap_comm": ds.overlap_comm,
        "contiguous_gradients": ds.contiguous_gradients,
        "reduce_bucket_size": pick("reduce_bucket_size", ds.reduce_bucket_size),
    }
    if ds.allgather_bucket_size is not None:
        zero["allgather_bucket_size"] = pick("allgather_bucket_size", ds.allgather_bucket_size)
    if ds.sub_group_size is not None:
        zero["sub_group_size"] = pick("sub_group_size", ds.sub_group_size)
    if ds.offload_optimizer != Offload.none:
        zero["offload_optimizer"] = {"device": ds.offload_optimizer.value, "pin_memory": ds.pin_memory and not on_cpu}
    if ds.stage == 3:
        zero["stage3_prefetch_bucket_size"] = pick("stage3_prefetch_bucket_size", ds.stage3_prefetch_bucket_size)
        zero["stage3_param_persistence_threshold"] = pick(
            "stage3_param_persistence_threshold", ds.stage3_param_persistence_threshold
        )
        for name in ("stage3_max_live_parameters", "stage3_max_reuse_distance"):
            value = getattr(ds, name)
            if value is not None:
                zero[name] = pick(name, value)
        zero["stage3_gather_16bit_weights_on_model_save"] = False
        if ds.offload_param != Offload.none:
            zero["offload_param"] = {"device": ds.offload_param.value, "pin_memory": ds.pin_memory and not on_cpu}

    fp16 = case.precision == Precision.fp16 and not on_cpu
    bf16 = case.precision == Precision.bf16 or (case.precision == Precision.fp16 and on_cpu)
    return {
        "train_micro_batch_size_per_gpu": case.train.micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": case.train.micro_batch * grad_accum * world_size,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": fp16, "loss_scale": 0, "initial_scale_power": 16},
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": case.train.learning_rate, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
