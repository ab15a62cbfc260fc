"""Importers: the configs users already have, turned into a `Case` the predictor can size.

    import_config(path, JobSpec(gpus=8, gpu_memory=parse_size("64GiB"))) -> ImportedConfig

Formats, told apart by content and extension (`detect`):

- LLaMA-Factory training YAML (`llamafactory`).
- Hugging Face TrainingArguments JSON with the fields training scripts add (`training_args`).
- DeepSpeed JSON, through `deepspeed` in either of the above or `--deepspeed` (`deepspeed_json`).
- The harness's own case YAML (`case_file`).

The job's cards (how many, how big, processes per card, launcher) are not in these files; they come
in a `JobSpec` from the command line or a premerge sidecar (`job`). Every problem is one `ConfigError`
naming the file, the key and the fix. Settings the lints need that a `Case` does not keep (the keys
as written, `evaluation_strategy`, both precision flags, DeepSpeed's `train_batch_size`, its
`activation_checkpointing` block, reentrant checkpointing) are kept beside the case (`records`).

The modules: `records` (what goes in and comes out), `errors`, `reading` (files, paths, typed keys),
`keys` (known keys as data), `detect`, `deepspeed_json`, `model`, `job`, `init_order` (training
scripts), `training_common` and `build` (what the training formats share), one module per format.
"""

from __future__ import annotations

from pathlib import Path

from harness.premerge.importers.case_file import import_case
from harness.premerge.importers.deepspeed_json import read_deepspeed
from harness.premerge.importers.detect import detect_format
from harness.premerge.importers.errors import ConfigError
from harness.premerge.importers.init_order import scan_init_order
from harness.premerge.importers.llamafactory import import_llamafactory
from harness.premerge.importers.reading import read_mapping, resolve_path
from harness.premerge.importers.records import (
    LAUNCHERS,
    TRITON_CACHES,
    ConfigFormat,
    DeepSpeedFile,
    ImportedConfig,
    InitOrder,
    JobSpec,
    TrainingFile,
)
from harness.premerge.importers.training_args import import_training_args
from harness.spec.units import parse_size

__all__ = [
    "LAUNCHERS", "TRITON_CACHES", "ConfigError", "ConfigFormat", "DeepSpeedFile", "ImportedConfig", "InitOrder",
    "JobSpec", "TrainingFile", "detect_format", "import_config", "parse_size_arg", "read_deepspeed", "read_mapping",
    "resolve_path", "scan_init_order",
]


def import_config(path: Path | str, spec: JobSpec = JobSpec()) -> ImportedConfig:
    """Read a training config (any supported format) and the DeepSpeed config it names."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(path, None, "is a directory, not a config file", "name a YAML or JSON config file")
    if spec.deepspeed is not None and not Path(spec.deepspeed).exists():
        raise ConfigError(spec.deepspeed, None, "no such DeepSpeed config file", "check the --deepspeed path")
    data = read_mapping(path)
    fmt = detect_format(path, data)
    if fmt == ConfigFormat.case:
        return import_case(path, spec)
    if fmt == ConfigFormat.deepspeed:
        raise ConfigError(path, None, "is a DeepSpeed config; it does not name a model or a batch",
                          "check the training config and pass this file with --deepspeed")
    if fmt == ConfigFormat.llamafactory:
        return import_llamafactory(path, data, spec)
    return import_training_args(path, data, spec)


def parse_size_arg(text: str, flag: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise ConfigError(None, flag, str(exc)) from None
