"""Reading a config file into a mapping, paths as written in one, and typed access to its keys.

Booleans are read as the stack that reads the file reads them. The HF Trainer's argument dataclasses
(TrainingArguments, LLaMA-Factory's, a script's through HfArgumentParser.parse_dict/parse_json_file)
keep a value as written and test it for truth: `"false"` is a non-empty string, so true (text that is
no boolean at all, `"sometimes"`, is refused rather than read as that true). DeepSpeed's
config models are pydantic's, which read "false", "no", "off", "0" as false and refuse other text.
A boolean written as text that reads otherwise than it looks is recorded (`ReadAs`) for the lints. A
whole number written as text ("4") is refused where a dataclass would keep it as text (the Trainer's
arithmetic and its DataLoader then fail on it) and read as the number where pydantic reads it.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from harness.models.inputs import InputError, load_data
from harness.premerge.importers.errors import ConfigError
from harness.premerge.importers.records import NotModelled, ReadAs

_TRUE_TEXT = ("true", "yes", "1", "on", "t", "y")
_FALSE_TEXT = ("false", "no", "0", "off", "f", "n")
# who reads the booleans of a file, by the semantics above
PYTHON_TRUTH, PYDANTIC = "the HF Trainer (a non-empty text is true)", "DeepSpeed (pydantic)"
DEEPSPEED_TRUTH = "DeepSpeed (a non-empty text is true)"  # its top-level keys, read raw (get_scalar_param)


def read_mapping(path: Path) -> dict[str, Any]:
    """A YAML or JSON file's settings (by extension), within the input limits of `harness.models.inputs`,
    or one ConfigError saying what is wrong."""
    try:
        data = load_data(path)
    except InputError as exc:
        raise ConfigError(exc.path, exc.key, exc.problem, exc.fix) from None
    if not isinstance(data, dict):
        raise ConfigError(path, None, f"must hold a mapping of settings, not {type(data).__name__}",
                          "write one 'key: value' per setting")
    return data


def resolve_path(ref: str, config_path: Path) -> Path:
    """A path as written in a config: relative to the config's folder, else to the working directory."""
    candidate = Path(ref).expanduser()
    if candidate.is_absolute():
        return candidate
    for base in (config_path.parent, Path.cwd()):
        if (base / candidate).exists():
            return base / candidate
    return config_path.parent / candidate


class Reader:
    """Typed access to one config's keys, with errors that name the file and the key. `booleans`: who
    reads them (PYTHON_TRUTH, PYDANTIC). Readers of one job share `read_as` (booleans written as text
    that read otherwise than they look) and `not_modelled` (memory-relevant keys the predictor does
    not model), passed on to the ImportedConfig."""

    def __init__(self, path: Path, data: dict[str, Any], prefix: str = "", booleans: str = PYTHON_TRUTH,
                 read_as: list[ReadAs] | None = None, not_modelled: list[NotModelled] | None = None):
        self.path, self.data, self.prefix, self.booleans = path, data, prefix, booleans
        self.read_as = [] if read_as is None else read_as
        self.not_modelled = [] if not_modelled is None else not_modelled

    def sub(self, data: dict[str, Any], prefix: str) -> Reader:
        """A reader of a block inside this config (same file, same stack, same records)."""
        return Reader(self.path, data, prefix, self.booleans, self.read_as, self.not_modelled)

    def not_modelled_key(self, key: str, entry: tuple[bool, str], detail: str = "", value: Any = None) -> None:
        """Record `key` as read but not modelled (records.NotModelled); `entry` is (raises, why) from the
        tables of importers.keys, `detail` what this value adds to the why."""
        raises, why = entry
        self.not_modelled.append(NotModelled(self.path, self.prefix + key,
                                             self.data.get(key) if value is None else value, raises,
                                             f"{why} ({detail})" if detail else why))

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def fail(self, key: str, problem: str, fix: str = "") -> ConfigError:
        return ConfigError(self.path, self.prefix + key, problem, fix)

    def raw(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key)
        if value is None:
            return default
        if isinstance(value, bool):
            return value
        if type(value) is int and value in (0, 1):
            return bool(value)
        if not isinstance(value, str):
            raise self.fail(key, f"must be true or false, got {value!r}")
        text = value.lower()
        looks = True if text.strip() in _TRUE_TEXT else False if text.strip() in _FALSE_TEXT else None
        if self.booleans == PYDANTIC:
            if text not in _TRUE_TEXT + _FALSE_TEXT:
                raise self.fail(key, f"must be true or false, got {value!r} (DeepSpeed refuses it)",
                                "write true or false without quotes")
            return text in _TRUE_TEXT
        read = bool(value)  # the dataclass keeps the text; the Trainer tests it for truth
        if looks is None and read:  # no boolean at all: refused rather than run as the true it would be
            raise self.fail(key, f"must be true or false, got {value!r} ({self.booleans.split(' (')[0]} would "
                            "take this text as true)", "write true or false without quotes")
        if looks is not read:
            self.read_as.append(ReadAs(self.path, self.prefix + key, value, read, self.booleans))
        return read

    def int(self, key: str, default: int | None, minimum: int = 0) -> int | None:
        value = self.data.get(key)
        if value is None:
            return default
        if isinstance(value, str) and re.fullmatch(r"\s*-?\d+(\.0*)?(e\d+)?\s*", value):
            if self.booleans != PYDANTIC:  # a dataclass keeps the text; arithmetic and the DataLoader fail on it
                raise self.fail(key, f"is the text {value!r}, not a number: {self.booleans.split(' (')[0]} keeps it "
                                "as text and the job fails on it", f"write {value.strip()} without quotes")
            value = float(value)  # pydantic reads it as the number
        if isinstance(value, float) and not math.isfinite(value):
            raise self.fail(key, f"must be a whole number, got {value!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or float(value) != int(value):
            raise self.fail(key, f"must be a whole number, got {value!r}")
        if int(value) < minimum:
            raise self.fail(key, f"must be at least {minimum}, got {value!r}")
        return int(value)

    def float(self, key: str, default: float | None) -> float | None:
        value = self.data.get(key)
        if value is None:
            return default
        try:
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            raise self.fail(key, f"must be a number, got {value!r}") from None
        if not math.isfinite(number):
            raise self.fail(key, f"must be a finite number, got {value!r}")
        return number

    def str(self, key: str, default: str | None) -> str | None:
        value = self.data.get(key)
        return default if value is None else str(value)

    def choice(self, key: str, allowed: tuple[str, ...], default: str | None, why: str = "") -> str | None:
        value = self.str(key, default)
        if value is not None and value.lower() not in allowed:
            raise self.fail(key, f"'{value}' is not supported{why}", f"use one of: {', '.join(allowed)}")
        return None if value is None else value.lower()
