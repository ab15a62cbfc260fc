"""The model a config names (or --model names): the architecture to predict with and what a case names it by."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harness.models.registry import Architecture, missing_package
from harness.models.source import ModelSourceError, check_folder_buildable, resolve_model
from harness.premerge.importers.errors import ConfigError
from harness.premerge.importers.records import JobSpec

# The note that says a model was read from a local config.json (a case file names that folder itself).
LOCAL_MODEL_NOTE = "model from "


@dataclass(frozen=True)
class ModelRef:
    arch: Architecture
    case_model: str  # what a Case carries: the registry name, else the config.json folder (absolute)
    note: str | None


def model_of(path: Path, reference: str | None, spec: JobSpec, key: str = "model_name_or_path") -> ModelRef:
    """The model a config names (or --model names), as an architecture and what a case names it by."""
    if spec.model is not None:
        reference, where, base_dirs = spec.model, (None, "--model"), (Path.cwd(),)
    else:
        where, base_dirs = (path, key), (path.parent, Path.cwd())
    if reference is None:
        raise ConfigError(path, key, "no model named", "set model_name_or_path (or pass --model)")
    try:
        resolved = resolve_model(str(reference), base_dirs)
    except ModelSourceError as exc:
        raise ConfigError(*where, exc.problem, exc.fix) from None
    if resolved.registry_name is not None:
        return ModelRef(arch=resolved.arch, case_model=resolved.registry_name, note=None)
    note = f"{LOCAL_MODEL_NOTE}{resolved.arch.source}: not in the registry; sized from that config.json"
    return ModelRef(arch=resolved.arch, case_model=str(resolved.local_dir.resolve()), note=note)


def check_model(path: Path, model: ModelRef, spec: JobSpec, key: str = "model_name_or_path") -> None:
    """Refuse a model folder the predictor cannot build (harness.models.source.check_buildable). Imports
    transformers: called once the job's flags are known good, so a bad flag is refused before it. A model
    whose package is not installed here (GLA without the gla extra) is refused, naming the package."""
    where = (None, "--model") if spec.model is not None else (path, key)
    missing = missing_package(model.arch.config)
    if missing is not None:
        raise ConfigError(*where, missing, "install the extra, or check this config where it is installed")
    if model.note is None:  # a registry entry
        return
    try:
        check_folder_buildable(model.arch, Path(model.case_model))
    except ModelSourceError as exc:
        raise ConfigError(*where, exc.problem, exc.fix) from None


def hidden_size(arch: Architecture) -> int:
    return int(arch.config["hidden_size"])


def model_precision(arch: Architecture) -> str:
    """The dtype the model computes in when the config sets neither bf16 nor fp16."""
    dtype = str(arch.config.get("torch_dtype") or arch.config.get("dtype") or "bfloat16")
    return {"float16": "fp16", "float32": "fp32"}.get(dtype, "bf16")
