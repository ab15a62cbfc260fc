"""The counts of a model that its step time depends on, in closed form from its config.json.

The throughput model (`harness.fit.throughput`) needs, per model: the weights a token passes through
in matrix multiplications, the decoder layers, the linear modules and parameter tensors of one layer
(kernel launches and ZeRO-3's per-parameter hooks scale with them) and the parameter count. Read from
the Hugging Face config keys, without building the model, so ranking thousands of candidates and
calibrating on every baseline costs no trace.

Families: standard decoder layers (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3: q, k, v, o and a gated
MLP) and GLA (flash-linear-attention). A mixture-of-experts config counts the experts a token is
routed to (`num_experts_per_tok`) as its MLP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Parameter tensors beside the linear weights of one layer: two norms; Qwen2's q, k, v biases;
# Gemma 3's two extra norms and q/k norms.
_EXTRA_TENSORS = {"qwen2": 2 + 3, "gemma3_text": 2 + 2 + 2, "gemma3": 2 + 2 + 2, "gemma2": 4}


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    vocab: int
    tied: bool
    layer_linear_weights: int  # weights of one layer's matrix multiplications (routed experts only)
    layer_linears: int  # linear modules of one layer (kernel launches scale with them)
    layer_tensors: int  # parameter tensors of one layer (ZeRO-3 gathers and releases each)
    layer_params: int  # parameters of one layer (every expert of a mixture-of-experts layer)

    @property
    def linear_weights(self) -> int:
        """Weights of every matrix multiplication a token passes through, the output head included."""
        return self.layers * self.layer_linear_weights + self.vocab * self.hidden

    @property
    def params(self) -> int:
        """Every parameter: layers, the embedding and an untied head."""
        return self.layers * self.layer_params + self.vocab * self.hidden * (1 if self.tied else 2)

    def at_depth(self, layers: int) -> ModelShape:
        return ModelShape(layers, self.hidden, self.vocab, self.tied, self.layer_linear_weights, self.layer_linears,
                          self.layer_tensors, self.layer_params)

    @classmethod
    def of(cls, config: dict[str, Any]) -> ModelShape:
        cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        h = int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
        vocab = int(cfg.get("vocab_size") or 0)
        tied = bool(cfg.get("tie_word_embeddings", False))
        if cfg.get("model_type") == "gla":
            return cls._gla(cfg, h, layers, vocab, tied)
        heads = int(cfg.get("num_attention_heads") or 1)
        kv = int(cfg.get("num_key_value_heads") or heads)
        d = int(cfg.get("head_dim") or h // heads)
        attention = h * heads * d * 2 + h * kv * d * 2
        experts = int(next((cfg[k] for k in ("num_local_experts", "num_experts", "n_routed_experts")
                            if cfg.get(k)), 0) or 0)
        inter = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 4 * h) if experts \
            else int(cfg.get("intermediate_size") or 4 * h)
        mlp = 3 * h * inter
        routed = int(cfg.get("num_experts_per_tok") or 1) if experts else 1
        extra = _EXTRA_TENSORS.get(str(cfg.get("model_type")), 2)
        return cls(layers=layers, hidden=h, vocab=vocab, tied=tied,
                   layer_linear_weights=attention + mlp * routed, layer_linears=4 + 3 * routed,
                   layer_tensors=4 + 3 * max(1, experts) + extra + (1 if experts else 0),
                   layer_params=attention + mlp * max(1, experts) + extra * h)

    @classmethod
    def _gla(cls, cfg: dict[str, Any], h: int, layers: int, vocab: int, tied: bool) -> ModelShape:
        key = int(h * float(cfg.get("expand_k", 0.5)))
        value = int(h * float(cfg.get("expand_v", 1)))
        low_rank = int(cfg.get("gate_low_rank_dim") or 16)
        inter = cfg.get("intermediate_size")
        if not inter:  # fla's GLAMLP: hidden_ratio * h * 2/3, rounded up to a multiple of 256
            inter = int(h * float(cfg.get("hidden_ratio", 4)) * 2 / 3)
            inter = 256 * ((inter + 255) // 256)
        inter = int(inter)
        attention = h * key * 2 + h * value * 2 + value * h + (h * low_rank + low_rank * key)
        mlp = 3 * h * inter
        linears = 5 + 2 + 2  # q, k, v, output gate, o; the gate's two low-rank factors; fused gate-up, down
        return cls(layers=layers, hidden=h, vocab=vocab, tied=tied, layer_linear_weights=attention + mlp,
                   layer_linears=linears, layer_tensors=linears + 3, layer_params=attention + mlp + 3 * h)
