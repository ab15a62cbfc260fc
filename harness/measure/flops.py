"""Model FLOPs per trained token and utilisation against a card's peak (MFU).

Per token: c * N + 12 * L * d_attn * s, the convention of the PaLM paper (appendix B), where N is
the number of weights in matrix multiplications a token passes through (linear layers, the output
head included; of a mixture-of-experts layer, the experts it is routed to: stacked expert weights
times experts per token over experts), L the
softmax-attention layers, d_attn the attention width and s the sequence length. c is 6 when every
weight is trained (forward 2N, input gradients 2N, weight gradients 2N) and 4 when the base weights
are frozen (LoRA, QLoRA: no weight gradients for them). Recomputation by checkpointing is not model
FLOPs and is not counted. Linear-attention layers (GLA) count only their projections.
"""

from __future__ import annotations

import json
from importlib import resources

_CARDS = json.loads(resources.files(__package__).joinpath("cards.json").read_text(encoding="utf-8"))


_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def linear_weight_count(model, config: dict | None = None) -> int:
    """Weights of the matrix multiplications a token passes through: every `nn.Linear` (LoRA adapters
    left out) and, given the model's `config`, the routed share of stacked expert weights."""
    import torch

    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and not hasattr(module, "lora_A"):
            shape = getattr(getattr(module.weight, "quant_state", None), "shape", None)
            total += int(shape.numel()) if shape is not None else module.in_features * module.out_features
    return total + (_routed_expert_weights(model, config) if config else 0)


def _routed_expert_weights(model, config: dict) -> int:
    """Mixture-of-experts layers that keep each projection of all experts in one 3-D parameter
    (experts x out x in; transformers 5's fused experts, not `nn.Linear`): their weights times the
    share of experts a token is routed to."""
    experts = next((int(config[k]) for k in _EXPERT_COUNT_KEYS if config.get(k)), 0)
    per_token = int(config.get("num_experts_per_tok") or 0)
    if not experts or not per_token:
        return 0
    total = 0
    for param in model.parameters():
        shape = tuple(getattr(param, "ds_shape", None) or param.shape)  # ZeRO-3 partitions keep ds_shape
        if len(shape) == 3 and shape[0] == experts:
            total += shape[0] * shape[1] * shape[2]
    return total * per_token // experts


def flops_per_token(linear_weights: int, config: dict, seq_len: int, full_finetune: bool) -> float:
    c = 6 if full_finetune else 4
    attention = 0
    if config.get("model_type") != "gla":
        heads = int(config.get("num_attention_heads", 0))
        head_dim = int(config.get("head_dim") or config["hidden_size"] // max(1, heads))
        attention = 12 * int(config["num_hidden_layers"]) * heads * head_dim * seq_len
    return c * linear_weights + attention


def peak_flops(device_name: str) -> float | None:
    """The card's dense bf16 peak in FLOP/s, or None where no datasheet figure is kept."""
    table = _CARDS["peak_tflops_bf16"]
    for key in sorted(table, key=len, reverse=True):
        if key.lower() in device_name.lower():
            return table[key] * 1e12
    return None
