"""`ConfigError`: every problem with a config, naming the file, the key and the fix."""

from __future__ import annotations

from pathlib import Path


class ConfigError(Exception):
    """A config the harness cannot check, with where (file, key) and what to do (fix)."""

    def __init__(self, path: Path | str | None, key: str | None, problem: str, fix: str = ""):
        super().__init__(problem)
        self.path = None if path is None else Path(path)
        self.key = key
        self.problem = problem
        self.fix = fix

    def __str__(self) -> str:
        where = ": ".join(str(p) for p in (self.path, self.key) if p)
        text = f"{where}: {self.problem}" if where else self.problem
        return text + (f". Fix: {self.fix}" if self.fix else "")
