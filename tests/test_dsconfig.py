"""DeepSpeed configs: 'auto' values resolved as the HF integration resolves them, and scaled in tiny mode."""

from harness.spec.cases import CASES_DIR, load_case
from harness.spec.dsconfig import deepspeed_config
from harness.spec.shape import run_shape

FAILING = load_case(CASES_DIR / "000-lora-z3-offload-cutoff1024-ga16.yaml")
AGGRESSIVE = load_case(CASES_DIR / "000-lora-z3-offload-aggressive-cutoff512-ga32.yaml")


def test_auto_buckets_follow_the_hidden_size_like_hf():
    cfg = deepspeed_config(FAILING, world_size=8, grad_accum=16, hidden_size=5120, on_cpu=False)
    zero = cfg["zero_optimization"]
    assert zero["reduce_bucket_size"] == 5120 * 5120
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 5120 * 5120)
    assert zero["stage3_param_persistence_threshold"] == 10 * 5120
    assert cfg["train_batch_size"] == 1 * 16 * 8
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}


def test_the_cases_own_thresholds_win_and_pinning_follows_the_case():
    cfg = deepspeed_config(AGGRESSIVE, world_size=8, grad_accum=32, hidden_size=5120, on_cpu=False)
    zero = cfg["zero_optimization"]
    assert zero["stage3_prefetch_bucket_size"] == 10_000_000
    assert zero["stage3_param_persistence_threshold"] == 10_000
    assert zero["offload_param"]["pin_memory"] is False


def test_tiny_mode_scales_element_thresholds_with_the_parameter_size():
    shape = run_shape(AGGRESSIVE, "tiny")
    cfg = deepspeed_config(AGGRESSIVE, shape.ranks, shape.grad_accum, shape.hidden_size, True, shape.ds_size_scale)
    scale = (shape.hidden_size / 5120) ** 2
    zero = cfg["zero_optimization"]
    assert abs(zero["stage3_param_persistence_threshold"] - 10_000 * scale) <= 2
    # the tiny model's attention projections stay above the threshold, so ZeRO-3 still partitions them
    assert shape.hidden_size * shape.hidden_size > zero["stage3_param_persistence_threshold"]
    assert cfg["bf16"]["enabled"] and not cfg["fp16"]["enabled"]
    assert zero["offload_optimizer"]["pin_memory"] is False  # no pinned memory without an accelerator


def test_tiny_buckets_stay_a_multiple_of_deepspeeds_alignment():
    """ZeRO-2 asserts `allgather_bucket_size % 2 == 0`; a scaled odd count crashed DeepSpeed's engine."""
    case = AGGRESSIVE.model_copy(update={"deepspeed": AGGRESSIVE.deepspeed.model_copy(
        update={"stage": 2, "allgather_bucket_size": 500_000_000, "reduce_bucket_size": 50_000_001})})
    for scale in (1.3e-5, 7.7e-7, 0.333):
        zero = deepspeed_config(case, 1, 2, 64, True, scale)["zero_optimization"]
        for key in ("allgather_bucket_size", "reduce_bucket_size"):
            assert zero[key] % 2 == 0 and zero[key] >= 2, (scale, key, zero[key])
            assert abs(zero[key] - case.deepspeed.model_dump()[key] * scale) <= 2
