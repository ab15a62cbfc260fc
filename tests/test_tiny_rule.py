"""The tiny rule keeps each architecture's family traits, and the result builds and runs."""

import pytest
import torch

from harness.models.registry import (
    TINY_VOCAB,
    hf_config,
    known_architectures,
    load_architecture,
    tiny_config,
    truncated_config,
)

ARCHS = known_architectures()


def test_every_guide_model_is_registered():
    assert set(ARCHS) >= {
        "deepseek-r1-distill-qwen-32b", "gemma-3-27b", "qwen1.5-7b-chat", "gla-1.3b-100b",
        "qwen1.5-0.5b-chat", "qwen1.5-1.8b-chat",
    }
    for name in ARCHS:
        assert load_architecture(name).source, f"{name} has no provenance"


@pytest.mark.parametrize("name", ARCHS)
def test_tiny_keeps_class_tying_and_head_layout(name):
    arch = load_architecture(name)
    tiny = tiny_config(arch, 64)
    full = arch.config
    assert tiny["model_type"] == full["model_type"]
    assert tiny.get("tie_word_embeddings") == full.get("tie_word_embeddings")
    assert tiny["vocab_size"] == TINY_VOCAB
    assert tiny["hidden_size"] < full["hidden_size"]
    if "num_key_value_heads" in full:
        full_ratio = full["num_attention_heads"] // full["num_key_value_heads"]
        tiny_ratio = tiny["num_attention_heads"] // tiny["num_key_value_heads"]
        assert tiny_ratio == full_ratio  # GQA stays GQA, MHA stays MHA
        assert tiny["intermediate_size"] / tiny["hidden_size"] == pytest.approx(
            full["intermediate_size"] / full["hidden_size"], rel=0.15)


def test_gemma_keeps_an_explicit_head_dim_and_both_attention_kinds():
    arch = load_architecture("gemma-3-27b")
    tiny = tiny_config(arch, 128)
    assert tiny["head_dim"] * tiny["num_attention_heads"] != tiny["hidden_size"]
    assert set(tiny["layer_types"]) == {"sliding_attention", "full_attention"}
    assert tiny["num_hidden_layers"] == len(tiny["layer_types"])
    assert tiny["sliding_window"] < 128  # the sliding layers really slide at the tiny length


def test_qwen_32b_keeps_its_5_to_1_grouped_query_attention():
    tiny = tiny_config(load_architecture("deepseek-r1-distill-qwen-32b"), 64)
    assert (tiny["num_attention_heads"], tiny["num_key_value_heads"]) == (5, 1)


def test_special_tokens_stay_inside_the_tiny_vocabulary():
    for name in ARCHS:
        tiny = tiny_config(load_architecture(name), 64)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if isinstance(tiny.get(key), int):
                assert 0 <= tiny[key] < TINY_VOCAB


@pytest.mark.parametrize("name", ARCHS)
def test_tiny_models_build_and_compute_a_loss(name):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(load_architecture(name), 32)
    if cfg["model_type"] == "gla":
        from harness.models import fla_cpu

        fla_cpu.apply()
    model = AutoModelForCausalLM.from_config(hf_config(cfg))
    ids = torch.randint(0, TINY_VOCAB, (2, 32))
    out = model(input_ids=ids, labels=ids)
    assert torch.isfinite(out.loss)
    assert out.logits.shape == (2, 32, TINY_VOCAB)
    assert type(model).__name__ == load_architecture(name).config["architectures"][0]


def test_truncation_keeps_width_and_cuts_depth():
    arch = load_architecture("gemma-3-27b")
    cut = truncated_config(arch, 6)
    assert cut["hidden_size"] == 5376 and cut["num_hidden_layers"] == 6
    assert cut["layer_types"] == arch.config["layer_types"][:6]
    with pytest.raises(ValueError):
        truncated_config(arch, 0)
