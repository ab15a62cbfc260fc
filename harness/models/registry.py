"""Real architecture configs, kept as data, and the rule that shrinks them for tiny mode.

Memory and speed depend on shapes, not on weight values, so each model is built from its real
Hugging Face config with random weights. The configs live in `harness/architectures/*.json`,
each with the source it was copied from. Nothing is downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

ARCH_DIR = resources.files(__package__).joinpath("architectures")  # package data, in the wheel too

# Fields that only matter for loading checkpoints or generation; they never reach the model class.
_META_KEYS = {"_source", "_name", "_notes"}


@dataclass(frozen=True)
class Architecture:
    name: str
    source: str
    config: dict[str, Any]

    @property
    def model_type(self) -> str:
        return self.config["model_type"]

    @property
    def layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def uses_triton_kernels(self) -> bool:
        """Trains through Triton kernels compiled on the host (flash-linear-attention's GLA), whose first
        compilation holds device memory outside PyTorch's allocator."""
        return self.model_type == "gla"


class UnknownArchitecture(KeyError):
    def __str__(self) -> str:
        return f"unknown model '{self.args[0]}'; known: {', '.join(known_architectures())}"


def known_architectures() -> list[str]:
    return sorted(p.name.removesuffix(".json") for p in ARCH_DIR.iterdir() if p.name.endswith(".json"))


def load_architecture(name: str) -> Architecture:
    path = ARCH_DIR.joinpath(f"{name}.json")
    if not path.is_file():
        raise UnknownArchitecture(name)
    data = json.loads(path.read_text(encoding="utf-8"))
    config = {k: v for k, v in data.items() if k not in _META_KEYS}
    return Architecture(name=name, source=data["_source"], config=config)


# --- Sizes no model has -------------------------------------------------------------------------
# The predictor builds the model at full width and replays its step layer by layer, so its time and
# memory grow with these keys: 100,000 layers still grew (6.7 GB) after 3 minutes of `check`, and a
# hidden size of 2,147,483,520 asked for a 64 GiB tensor. Each bound is several times the largest
# published causal LM's (Llama 3.1 405B: 126 layers, hidden 16,384, MLP 53,248, 128 heads; Gemma 3's
# vocabulary: 262,144); a config past one is a typo or a hostile file, and is refused naming the key.
# Depth costs a cold `check` of a ZeRO-3 offload config about 0.17 CPU-s a layer (Qwen1.5-0.5B's
# widths: 23 CPU-s at 128 layers, 43 at 256), so the deepest config allowed answers in under 90 CPU-s.
SIZE_LIMITS = {
    "num_hidden_layers": 512,
    "hidden_size": 131_072,
    "intermediate_size": 524_288,
    "moe_intermediate_size": 524_288,
    "vocab_size": 4_194_304,
    "num_attention_heads": 4_096,
    "num_key_value_heads": 4_096,
    "head_dim": 16_384,
    "num_experts": 65_536,
    "num_local_experts": 65_536,
    "n_routed_experts": 65_536,
}


def size_problem(config: dict[str, Any]) -> str | None:
    """Why a model config is beyond any model's size (None: it is not): the first key past its bound."""
    for key, limit in SIZE_LIMITS.items():
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            return (f"{key} {value:,} is above {limit:,}, several times any published model's; the predictor "
                    "would build and replay a model of that size for minutes")
    return None


GLA_PACKAGE, GLA_MIN = "flash-linear-attention", (0, 6)


def missing_package(config: dict) -> str | None:
    """What the installed packages lack to build this architecture (None: nothing). GLA needs
    flash-linear-attention 0.6 or newer (the `gla` extra), whose kernels the CPU path and the trace patch."""
    if config.get("model_type") != "gla":
        return None
    import importlib.metadata as md

    try:
        version = md.version(GLA_PACKAGE)
    except md.PackageNotFoundError:
        version = None
    if version is not None and tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) >= GLA_MIN:
        return None
    have = f"{GLA_PACKAGE} {version} is installed" if version else f"{GLA_PACKAGE} is not installed"
    return (f"GLA models need {GLA_PACKAGE} >= {'.'.join(map(str, GLA_MIN))} and {have}: pip install "
            "'oom-harness[gla]' (it needs transformers >= 5.6.2)")


def hf_config(config: dict):
    """A transformers config object from a config dict (the registry's, a config.json's, a tiny or
    truncated one): what every model the harness builds, traces or sizes is made from."""
    from transformers import AutoConfig

    if config["model_type"] == "gla":
        missing = missing_package(config)
        if missing is not None:  # a user's environment without the gla extra: say so, as bad input
            from harness.models.inputs import InputError

            raise InputError(None, "model_type", missing)
        import fla  # noqa: F401  registers GLA with the transformers Auto classes
    cfg = dict(config)
    cfg.pop("architectures", None)
    cfg.pop("torch_dtype", None)
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)

# --- The tiny rule ------------------------------------------------------------------------------
# Same model class and code path, shrunk: GQA kept as GQA (same query/key-value head ratio where it
# fits), tied embeddings kept tied, explicit head_dim kept explicit, every kind of layer (sliding and
# global attention, dense and mixture-of-experts) kept present, the expert count and routing kept,
# and every MLP width (dense, expert, shared expert) keeping its ratio to the hidden size. The rule
# reads only the Hugging Face config keys, so it holds for any causal LM of these families (Llama,
# Mistral, Qwen2/3, Phi-3, Gemma 2/3, Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3's latent attention, ...),
# not only the registry's.

TINY_HEAD_DIM = 16
TINY_LAYERS = 2
TINY_VOCAB = 512
TINY_MIN_HEADS = 4
# Widths that scale with the hidden size: the dense MLP, experts' and shared experts' MLPs.
_WIDTH_KEYS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
# Low-rank attention projections (multi-head latent attention) shrink with the heads' width.
_RANK_KEYS = ("q_lora_rank", "kv_lora_rank")
# Per-head widths of multi-head latent attention; set to the tiny head size.
_HEAD_WIDTH_KEYS = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# Layer counts that must not exceed the tiny depth (dense layers before the experts, window layers).
_LAYER_COUNT_KEYS = ("max_window_layers", "first_k_dense_replace")
_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _tiny_heads(heads: int, kv_heads: int) -> tuple[int, int]:
    ratio = max(1, heads // kv_heads)
    if ratio == 1:
        return TINY_MIN_HEADS, TINY_MIN_HEADS
    tiny_kv = max(1, TINY_MIN_HEADS // ratio)
    return tiny_kv * ratio, tiny_kv


def _round8(x: float) -> int:
    return max(8, round(x / 8) * 8)


def _tiny_widths(cfg: dict[str, Any], full: dict[str, Any], hidden: int) -> None:
    for key in _WIDTH_KEYS:
        if cfg.get(key):
            cfg[key] = _round8(hidden * full[key] / full["hidden_size"])


def _tiny_rope(cfg: dict[str, Any], full: dict[str, Any]) -> None:
    """Rope scalings with one factor per rotary frequency (Phi-3's longrope) keep one per tiny frequency."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    frequencies = int(head_dim * float(cfg.get("partial_rotary_factor") or 1.0)) // 2
    for key in ("rope_scaling", "rope_parameters"):
        block = full.get(key)
        if isinstance(block, dict) and any(isinstance(v, list) for v in block.values()):
            cfg[key] = {k: (v[:frequencies] if isinstance(v, list) else v) for k, v in block.items()}


def _tiny_layer_kinds(cfg: dict[str, Any]) -> None:
    """Two layers, or one of each kind where the config lists the kinds (sliding and full attention)."""
    layer_types = cfg.get("layer_types")
    if layer_types:
        kinds = list(dict.fromkeys(layer_types))  # one layer of each kind, in first-seen order
        cfg["layer_types"] = kinds if len(kinds) >= TINY_LAYERS else kinds * TINY_LAYERS
        cfg["num_hidden_layers"] = len(cfg["layer_types"])
    else:
        cfg["num_hidden_layers"] = TINY_LAYERS
        if int(cfg.get("sliding_window_pattern") or 0) > TINY_LAYERS:
            # every N-th layer global (Gemma 3, Cohere 2): one sliding, then one global
            cfg["sliding_window_pattern"] = TINY_LAYERS
    for key in _LAYER_COUNT_KEYS:
        if cfg.get(key) is not None:
            # dense layers before the experts: keep one of each kind where there were any
            cfg[key] = min(int(cfg[key]), cfg["num_hidden_layers"] - (key == "first_k_dense_replace"))
    if isinstance(cfg.get("mlp_only_layers"), list):
        cfg["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if i < cfg["num_hidden_layers"]]


def _tiny_attention(cfg: dict[str, Any], full: dict[str, Any]) -> int:
    """Shrink heads and widths of a softmax-attention model; return the tiny hidden size."""
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    t_heads, t_kv = _tiny_heads(heads, kv_heads)
    hidden = t_heads * TINY_HEAD_DIM
    if cfg.get("head_dim") and cfg["head_dim"] * heads != cfg["hidden_size"]:
        # attention width differs from the hidden size (Gemma): keep their ratio
        hidden = _round8(hidden * cfg["hidden_size"] / (cfg["head_dim"] * heads))
    cfg.update(hidden_size=hidden, num_attention_heads=t_heads, num_key_value_heads=t_kv, vocab_size=TINY_VOCAB)
    _tiny_widths(cfg, full, hidden)
    if "head_dim" in cfg:
        cfg["head_dim"] = TINY_HEAD_DIM
    if "query_pre_attn_scalar" in cfg:
        # Gemma scales queries by this instead of head_dim; keep its ratio to the head size.
        cfg["query_pre_attn_scalar"] = round(TINY_HEAD_DIM * full["query_pre_attn_scalar"]
                                             / (full.get("head_dim") or full["hidden_size"] // heads))
    for key in _RANK_KEYS:
        if cfg.get(key):
            cfg[key] = _round8(cfg[key] * hidden / full["hidden_size"])
    for key in _HEAD_WIDTH_KEYS:
        if cfg.get(key):
            cfg[key] = TINY_HEAD_DIM
    return hidden


def tiny_config(arch: Architecture, max_seq_len: int) -> dict[str, Any]:
    """A small config of the same family as `arch`, able to run sequences of `max_seq_len`."""
    cfg = dict(arch.config)
    if arch.model_type == "gla":
        heads = int(cfg.get("num_heads", 4))
        hidden = heads * TINY_HEAD_DIM * 2  # expand_k 0.5 keeps key heads of TINY_HEAD_DIM
        # heads (and any key-value heads) stay as they are: only their width shrinks
        cfg.update(hidden_size=hidden, num_hidden_layers=TINY_LAYERS, vocab_size=TINY_VOCAB)
        _tiny_widths(cfg, arch.config, hidden)
    else:
        _tiny_attention(cfg, arch.config)
        _tiny_rope(cfg, arch.config)
        _tiny_layer_kinds(cfg)
        if cfg.get("sliding_window"):
            # keep the window smaller than the sequence, so sliding layers really slide
            cfg["sliding_window"] = max(4, min(int(cfg["sliding_window"]), max_seq_len // 2))
    cfg["max_position_embeddings"] = max(int(cfg.get("max_position_embeddings") or 0), max_seq_len)
    for key in _TOKEN_KEYS:
        if isinstance(cfg.get(key), int) and cfg[key] >= TINY_VOCAB:
            cfg[key] = TINY_VOCAB - 1 - _TOKEN_KEYS.index(key)
        elif isinstance(cfg.get(key), list):
            cfg[key] = [t if t < TINY_VOCAB else TINY_VOCAB - 1 - _TOKEN_KEYS.index(key) for t in cfg[key]]
    return cfg


def truncated_config(arch: Architecture, layers: int) -> dict[str, Any]:
    """Full width, fewer layers: for measuring configs too big for the cards at hand."""
    if not 0 < layers <= arch.layers:
        raise ValueError(f"layers must be in 1..{arch.layers} for {arch.name}, got {layers}")
    cfg = dict(arch.config)
    cfg["num_hidden_layers"] = layers
    if cfg.get("layer_types"):
        cfg["layer_types"] = cfg["layer_types"][:layers]
    if cfg.get("max_window_layers") is not None:
        cfg["max_window_layers"] = min(int(cfg["max_window_layers"]), layers)
    return cfg
