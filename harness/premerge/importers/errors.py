"""`ConfigError`: every problem with a config, naming the file, the key and the fix."""

from __future__ import annotations

from harness.models.inputs import InputError


class ConfigError(InputError):
    """A config the harness cannot check, with where (file, key) and what to do (fix); bad input, so
    the command line exits 2 on it."""
