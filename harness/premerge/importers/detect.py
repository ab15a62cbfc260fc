"""Which kind of config a file is, told apart by its keys and its extension."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.premerge.importers.errors import ConfigError
from harness.premerge.importers.records import ConfigFormat

_CASE_KEYS = {"id", "method", "target"}
_DEEPSPEED_MARKERS = {"zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size"}
_TRAINING_MARKERS = {"model_name_or_path", "output_dir", "per_device_train_batch_size"}


def detect_format(path: Path, data: dict[str, Any]) -> ConfigFormat:
    keys = set(data)
    if _CASE_KEYS <= keys:
        return ConfigFormat.case
    if path.suffix.lower() == ".json":
        if keys & _DEEPSPEED_MARKERS and not keys & _TRAINING_MARKERS:
            return ConfigFormat.deepspeed
        return ConfigFormat.training_args
    if path.suffix.lower() in (".yaml", ".yml"):
        return ConfigFormat.llamafactory
    raise ConfigError(path, None, f"unknown config format '{path.suffix}'",
                      "give a LLaMA-Factory YAML (.yaml), a TrainingArguments JSON (.json) or a harness case (.yaml)")
