"""Where an imported config's model comes from: a name the registry knows, or a local config.json.

Configs name their model by `model_name_or_path`: a Hugging Face hub id
(`deepseek-ai/DeepSeek-R1-Distill-Qwen-32B`), or a local directory. Nothing is downloaded, so a hub
id must match an architecture kept in `harness/architectures/` (case-insensitively, on the last path
component, with or without an instruction-tuning suffix such as `-it`, `-chat`, `-instruct`), and a
local directory must hold the model's `config.json` (the weights are not needed: memory depends on
shapes only).

`resolve_model` returns the `Architecture` to predict with and, where the registry holds the same
shapes, the registry name a `Case` can carry; otherwise the case carries the folder itself. A local
config.json is refused, naming what is supported, where the model is none the predictor can build:
shapes that do not divide (the hidden size by the heads, the heads by the key/value heads), a
`model_type` the installed transformers does not know, an encoder-only or encoder-decoder model
(BERT, T5), a vision-language model whose language model transformers does not build on its own
(`qwen2_vl`; Gemma 3's nested `text_config` is sized as its language model). The shapes are checked
as the config.json is read; the rest (`check_folder_buildable`, which imports transformers) once the
job is settled, before anything is traced. `adapter_targets` gives the module names a LoRA
`target_modules` list can name.

A case's `model` is narrower: a registry name exactly, or a folder holding a config.json (relative
to the case file, or absolute). `case_model` normalises it as a case file is read, `load_model`
gives its architecture wherever the case is used (tiny rule, model building, predictor, variants).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

from harness.models.inputs import InputError, load_json
from harness.models.registry import (
    Architecture,
    hf_config,
    known_architectures,
    load_architecture,
    size_problem,
    truncated_config,
)

# Keys whose values decide parameter and activation memory; two configs equal on these are one model.
SHAPE_KEYS = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "vocab_size", "tie_word_embeddings", "head_dim", "num_heads", "expand_k",
    "expand_v", "hidden_ratio",
)
# Keys a config.json must have for the predictor to size the model (GLA-style models name heads
# `num_heads` and may derive the MLP width from `hidden_ratio`).
_REQUIRED = {
    "default": ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size", "vocab_size"),
    "gla": ("model_type", "hidden_size", "num_hidden_layers", "num_heads", "vocab_size"),
}
# Multimodal configs keep the language model in a nested block (Gemma 3: Gemma3ForConditionalGeneration).
_NESTED_TEXT_KEYS = ("text_config", "language_config", "llm_config")
_RATIO_KEYS = ("expand_k", "expand_v", "hidden_ratio")
_MAX_DIM = 2**31 - 1  # vocabularies, widths and layer counts as int32, as the model code indexes them
_TUNING_SUFFIXES = ("-instruct", "-chat", "-it", "-pt", "-base", "-hf")


class ModelSourceError(ValueError):
    """A model reference the harness cannot turn into an architecture; `fix` says what to do."""

    def __init__(self, problem: str, fix: str):
        super().__init__(problem)
        self.problem = problem
        self.fix = fix


@dataclass(frozen=True)
class ResolvedModel:
    arch: Architecture
    registry_name: str | None  # the registry entry with the same shapes, if any
    closest_registry_name: str  # the registry entry nearest in shape (same model type first)
    local_dir: Path | None  # where the config.json came from, for a local model


def _stem(name: str) -> str:
    stem = name.strip().rstrip("/").rsplit("/", 1)[-1].lower()
    for suffix in _TUNING_SUFFIXES:
        if stem.endswith(suffix):
            return stem[: -len(suffix)]
    return stem


def _hub_ids() -> dict[str, str]:
    """Each registry entry's hub id, as its `_source` names it first (`org/Name ...`)."""
    ids: dict[str, str] = {}
    for name in known_architectures():
        match = re.match(r"\s*([\w.-]+/[\w.-]+?)[.:,]?(?:\s|$)", load_architecture(name).source)
        if match:
            ids[name] = match.group(1)
    return ids


def registry_name_for(reference: str) -> str | None:
    """The registry entry a hub id or a registry name refers to, else None."""
    known = known_architectures()
    last = reference.strip().rstrip("/").rsplit("/", 1)[-1].lower()
    if last in known:
        return last
    wanted = _stem(reference)
    for name in known:
        if _stem(name) == wanted:
            return name
    for name, hub_id in _hub_ids().items():
        if _stem(hub_id) == wanted:
            return name
    return None


def _text_config(data: dict) -> dict:
    for key in _NESTED_TEXT_KEYS:
        nested = data.get(key)
        if isinstance(nested, dict) and "hidden_size" in nested:
            merged = dict(nested)
            if "tie_word_embeddings" not in merged and "tie_word_embeddings" in data:
                merged["tie_word_embeddings"] = data["tie_word_embeddings"]
            merged.setdefault("torch_dtype", data.get("torch_dtype") or data.get("dtype"))
            return merged
    return data


def architecture_from_config_json(path: Path | str) -> Architecture:
    """An `Architecture` from a Hugging Face config.json (a file, or the directory holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():  # what exists but is no regular file, the reader names as such
        raise ModelSourceError(
            f"no config.json in {path.parent}",
            "put the model's config.json in that directory (the weights are not needed)",
        )
    try:
        data = load_json(path)
    except InputError as exc:
        raise ModelSourceError(str(InputError(exc.path, exc.key, exc.problem)),
                               exc.fix or "copy the model's config.json again") from None
    if not isinstance(data, dict):
        raise ModelSourceError(f"{path} must hold a JSON object", "copy the model's config.json again")
    config = _text_config(data)
    required = _REQUIRED["gla" if config.get("model_type") == "gla" else "default"]
    missing = [k for k in required if config.get(k) in (None, "")]
    if missing:
        raise ModelSourceError(
            f"{path} lacks {', '.join(missing)}",
            "use the model's full config.json as published with the model",
        )
    _check_shapes(path, config)
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    name = path.parent.name or path.parent.resolve().name
    return Architecture(name=f"local:{name}", source=str(path.resolve()), config=config)


def _check_shapes(path: Path, config: dict) -> None:
    """The shape keys hold what the model code will compute with: whole numbers above zero (a
    `vocab_size` of "32000" would fail deep inside the model code), positive finite ratios, a boolean."""
    for key in SHAPE_KEYS:
        value = config.get(key)
        if value is None:
            continue
        if key == "model_type":
            ok, want = isinstance(value, str), "a string such as \"qwen2\""
        elif key == "tie_word_embeddings":
            ok, want = isinstance(value, bool), "true or false"
        elif key in _RATIO_KEYS:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 2**20
            want = "a number above zero"
        else:
            ok = isinstance(value, int) and not isinstance(value, bool) and 0 < value <= _MAX_DIM
            want = f"a whole number from 1 to {_MAX_DIM:,}"
        if not ok:
            raise ModelSourceError(f"{path}: {key} must be {want}, got {value!r}",
                                   f"write {key} as the model's published config.json has it")
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads and config.get("head_dim") is None and config["hidden_size"] % heads:
        raise ModelSourceError(
            f"{path}: hidden_size {config['hidden_size']} is not divisible by num_attention_heads {heads}, and no "
            "head_dim is given: the heads would not split the hidden size",
            "write hidden_size, num_attention_heads (and head_dim) as the model's published config.json has them")
    if heads and kv_heads and heads % kv_heads:
        raise ModelSourceError(
            f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}: grouped-query "
            "attention shares each key/value head among a whole number of query heads",
            "write num_key_value_heads as a divisor of num_attention_heads, as the published config.json has it")
    too_big = size_problem(config)
    if too_big:
        raise ModelSourceError(f"{path}: {too_big}", "write the sizes as the model's published config.json has them")


# What the predictor builds: a causal language model transformers builds with AutoModelForCausalLM
# (or flash-linear-attention's GLA). Named in the errors below.
SUPPORTED = ("decoder-only causal language models that transformers builds with AutoModelForCausalLM (llama, "
             "mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe, gemma2, gemma3_text, phi3, olmoe, deepseek_v2, "
             "deepseek_v3, ...), GLA, and a multimodal config whose text_config is one of them (Gemma 3)")


def check_buildable(arch: Architecture, raw_model_type: str | None = None) -> None:
    """Refuse a local config.json the predictor cannot build as a causal language model (ModelSourceError,
    naming what is supported). `raw_model_type`: the config.json's own model_type where its text_config was
    taken. Imports transformers (seconds): asked where a model is about to be traced anyway."""
    model_type = arch.model_type
    if model_type == "gla":
        return
    from transformers import __version__ as version
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    where, fix = arch.source, f"use the config.json of a model of these kinds: {SUPPORTED}"
    shown = raw_model_type or model_type
    if shown in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelSourceError(f"{where}: model_type '{shown}' is a vision-language model, and transformers "
                               f"{version} does not build its language model on its own; the harness sizes "
                               "text models only", fix)
    if model_type not in CONFIG_MAPPING_NAMES:
        raise ModelSourceError(f"{where}: model_type '{model_type}' is not a model transformers {version} knows "
                               "(models with their own code, trust_remote_code, are not run)", fix)
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES or model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        kind = "encoder-decoder" if model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES else "encoder-only"
        raise ModelSourceError(f"{where}: model_type '{model_type}' is an {kind} model; the harness sizes "
                               "decoder-only causal language models", fix)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelSourceError(f"{where}: model_type '{model_type}' is not a causal language model "
                               f"(transformers {version} has no AutoModelForCausalLM class for it)", fix)
    try:
        hf_config(arch.config)
    except Exception as exc:  # transformers' own validation of the config (a strict dataclass in 5.x)
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise ModelSourceError(f"{where}: transformers {version} refuses this config: {reason}",
                               "write the config.json as published with the model") from None


def check_folder_buildable(arch: Architecture, folder: Path) -> None:
    """`check_buildable` for a model folder's config.json (its own model_type named where its text_config was
    taken)."""
    raw_type = load_json(Path(folder) / "config.json").get("model_type")
    check_buildable(arch, raw_type if raw_type != arch.model_type else None)


@functools.lru_cache(maxsize=8)
def _adapter_targets(config_json: str) -> tuple[frozenset[str], frozenset[str]]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    config = json.loads(config_json)
    if config["model_type"] == "gla":
        import fla  # noqa: F401  registers GLA with the transformers Auto classes
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(config))
    kinds = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, Conv1D)
    names = [name for name, module in model.named_modules() if name]
    adaptable = frozenset(name for name, module in model.named_modules() if name and isinstance(module, kinds))
    return frozenset(names), adaptable


# Layers built to list module names: every kind of layer appears within the first few (dense layers before
# the experts, sliding and global attention), and a whole 64-layer model takes seconds even on the meta device.
_NAME_LAYERS = 4


def adapter_targets(arch: Architecture) -> tuple[frozenset[str], frozenset[str]]:
    """The model's module names (full, dotted), and those of the modules LoRA can adapt (linear, embedding,
    convolution), from the model built on the meta device (no memory, no weights) with its first
    `_NAME_LAYERS` layers: a name of a deeper layer differs only by its index."""
    config = truncated_config(arch, min(arch.layers, _NAME_LAYERS)) if arch.model_type != "gla" else dict(arch.config)
    if arch.model_type == "gla":
        config["num_hidden_layers"] = min(arch.layers, _NAME_LAYERS)
    return _adapter_targets(json.dumps(config, sort_keys=True))


def lora_target_matches(target: str, names: frozenset[str]) -> list[str]:
    """The module names a peft `target_modules` entry matches: the name itself, or a name ending in '.' + it."""
    return [n for n in names if n == target or n.endswith("." + target)]


def is_registry_name(model: str) -> bool:
    return model in known_architectures()


def case_model(value: str, base_dir: Path | None = None) -> str:
    """A case's `model` as the harness keeps it: a registry name as written, a config.json folder as
    an absolute path (a relative one is taken from `base_dir`, the case file's folder, else the
    working directory), so the case means the same model in every process that reads it."""
    value = str(value).strip()
    if is_registry_name(value):
        return value
    folder = Path(value).expanduser()
    if not folder.is_absolute():
        folder = (base_dir or Path.cwd()) / folder
    if not folder.is_dir():
        raise ModelSourceError(
            f"unknown model '{value}': not a registry name ({', '.join(known_architectures())}) and no "
            f"folder {folder}",
            "name a registry entry, or a folder holding the model's config.json, relative to the case file "
            "or absolute")
    folder = folder.resolve()
    architecture_from_config_json(folder)  # readable, and a model the predictor can size
    return str(folder)


def load_model(model: str) -> Architecture:
    """The architecture of a case's `model` (a registry name, or a config.json folder as `case_model`
    keeps it)."""
    if is_registry_name(model):
        return load_architecture(model)
    return architecture_from_config_json(Path(model))


def model_label(model: str) -> str:
    """A case's model as reports name it: the registry name, or the config.json folder's name."""
    return model if is_registry_name(model) else Path(model).name


def same_shapes(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in SHAPE_KEYS)


def _distance(a: dict, b: dict) -> float:
    score = 0.0 if a.get("model_type") == b.get("model_type") else 1e6
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"):
        x, y = a.get(key) or 1, b.get(key) or 1
        score += abs(float(x) - float(y)) / max(float(x), float(y))
    return score


def closest_registry_name(arch: Architecture) -> str:
    return min(known_architectures(), key=lambda n: _distance(arch.config, load_architecture(n).config))


def _local_dir(reference: str, base_dirs: tuple[Path, ...]) -> Path | None:
    ref = Path(reference).expanduser()
    candidates = [ref] if ref.is_absolute() else [d / ref for d in base_dirs]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    return None


def _looks_like_path(reference: str) -> bool:
    return reference.startswith(("/", "./", "../", "~")) or reference.count("/") > 1 or "\\" in reference


def resolve_model(reference: str, base_dirs: tuple[Path, ...] = (Path.cwd(),)) -> ResolvedModel:
    """A registry name, a hub id the registry knows, or a local directory with a config.json.

    A local directory is looked up in `base_dirs` in order (the config's folder, then the working
    directory). A directory wins over a registry name of the same spelling: it is what the training
    job would load."""
    reference = str(reference).strip()
    if not reference:
        raise ModelSourceError("the model is empty", "name a local directory with a config.json or a known model")
    local = _local_dir(reference, base_dirs)
    if local is not None:
        arch = architecture_from_config_json(local)
        matches = [n for n in known_architectures() if same_shapes(arch.config, load_architecture(n).config)]
        registry = matches[0] if matches else None
        return ResolvedModel(arch=arch, registry_name=registry,
                             closest_registry_name=registry or closest_registry_name(arch), local_dir=local)
    name = registry_name_for(reference)
    if name is not None:
        return ResolvedModel(arch=load_architecture(name), registry_name=name, closest_registry_name=name,
                             local_dir=None)
    if _looks_like_path(reference):
        raise ModelSourceError(
            f"'{reference}' is not a directory (looked in {', '.join(str(d) for d in base_dirs)})",
            "point it at a local directory holding the model's config.json",
        )
    raise ModelSourceError(
        f"'{reference}' is neither a local directory nor a model the harness knows "
        f"(known: {', '.join(known_architectures())})",
        "point it at a local directory holding the model's config.json (no weights needed), "
        "or add the architecture to harness/architectures/",
    )
