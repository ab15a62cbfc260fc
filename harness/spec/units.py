"""Memory sizes with their units.

Every size inside the harness is an integer number of bytes. Text from users and case files is
parsed here, so "23.52 GiB", "64GB", "512 MiB" and plain byte counts all mean what they say:
GB/MB are powers of ten (as card vendors print them), GiB/MiB powers of two (as PyTorch and
nvidia-smi report them). A size written as text needs its unit ("64" is refused, not read as 64
bytes); numbers are byte counts, as the harness writes them back. Reports always speak GiB.
"""

from __future__ import annotations

import math
import re

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

_SIZE_RE = re.compile(r"^\s*(?P<num>\d+(?:\.\d+)?)\s*(?P<unit>[a-zA-Z]*)\s*$")

GIB = 2**30
MIB = 2**20


MAX_SIZE = 2**60  # 1 EiB: far above any card or host; a larger figure is a typo or hostile


def parse_size(value: str | int | float) -> int:
    """Return a size in bytes. Strings carry a unit (B, KB..TB, KiB..TiB): '64' alone is refused, as
    it would silently mean 64 bytes. Numbers are bytes (sizes the harness wrote itself); finite,
    not negative, at most 1 EiB."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError(f"size {value!r} is not a finite number; write a size with a unit, e.g. '64 GiB'")
        if value < 0:
            raise ValueError(f"size {value!r} is negative")
        if value > MAX_SIZE:
            raise ValueError(f"size {value!r} is above 1 EiB; write a size with a unit, e.g. '64 GiB'")
        return int(value)
    match = _SIZE_RE.match(str(value))
    if not match:
        raise ValueError(
            f"{value!r} is not a size; write a number and a unit, e.g. '16 GB', '23.52 GiB', '512 MiB'"
        )
    if not match["unit"]:
        num = match["num"]
        raise ValueError(f"{value!r} has no unit; write {num}GiB (or {num}GB, {num}MiB; B for bytes)")
    unit = match["unit"].lower()
    if unit not in _UNITS:
        allowed = ", ".join(k.upper().replace("I", "i") for k in _UNITS)
        raise ValueError(f"unknown unit {match['unit']!r} in {value!r}; allowed: {allowed}")
    size = int(float(match["num"]) * _UNITS[unit])
    if size > MAX_SIZE:
        raise ValueError(f"{value!r} is above 1 EiB; check the number and its unit")
    return size


def gib(nbytes: int | float | None) -> float | None:
    """Bytes to GiB (None stays None)."""
    return None if nbytes is None else nbytes / GIB


def gib_rounded(nbytes: int | float | None) -> float | None:
    """Bytes to GiB to three decimals, as the commands' `--json` records give them (None stays None)."""
    return None if nbytes is None else round(nbytes / GIB, 3)


def fmt_gib(nbytes: int | float | None, digits: int = 2) -> str:
    return "-" if nbytes is None else f"{nbytes / GIB:.{digits}f} GiB"


def fmt_mib(nbytes: int | float | None, digits: int = 1) -> str:
    return "-" if nbytes is None else f"{nbytes / MIB:.{digits}f} MiB"


def fmt_size_exact(nbytes: int) -> str:
    """The shortest text with a unit that `parse_size` reads back as exactly `nbytes`: '24 GiB',
    '64 GB', '23.52 GiB'; a plain byte count where no unit gives it exactly. For files written back."""
    for unit in ("TiB", "TB", "GiB", "GB", "MiB", "MB", "KiB", "KB"):
        scale = _UNITS[unit.lower()]
        if nbytes < scale:
            continue
        for digits in range(3):
            text = f"{nbytes / scale:.{digits}f} {unit}"
            if parse_size(text) == nbytes:
                return text
    return f"{nbytes} B"
