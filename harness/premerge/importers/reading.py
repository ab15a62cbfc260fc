"""Reading a config file into a mapping, paths as written in one, and typed access to its keys."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from harness.models.inputs import InputError, load_data
from harness.premerge.importers.errors import ConfigError


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
    """Typed access to one config's keys, with errors that name the file and the key."""

    def __init__(self, path: Path, data: dict[str, Any], prefix: str = ""):
        self.path, self.data, self.prefix = path, data, prefix

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
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.strip().lower() in ("true", "yes", "1")
        raise self.fail(key, f"must be true or false, got {value!r}")

    def int(self, key: str, default: int | None, minimum: int = 0) -> int | None:
        value = self.data.get(key)
        if value is None:
            return default
        if isinstance(value, str) and re.fullmatch(r"\s*-?\d+(\.0*)?(e\d+)?\s*", value):
            value = float(value)
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
