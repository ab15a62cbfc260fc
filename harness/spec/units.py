"""Memory sizes with their units.

Every size inside the harness is an integer number of bytes. Text from users and case files is
parsed here, so "23.52 GiB", "64GB", "512 MiB" and plain byte counts all mean what they say:
GB/MB are powers of ten (as card vendors print them), GiB/MiB powers of two (as PyTorch and
nvidia-smi report them). A size written as text needs its unit ("64" is refused, not read as 64
bytes), and the unit's case means what it means: a lowercase b is a bit, so "16Gb" (gigabits) is
refused with the units to write instead. A bare number in a file a person wrote (`gpu_memory: 80`)
is refused the same way (`bare_numbers=False`); bare numbers are byte counts only where the harness
wrote them itself (a case dumped as JSON and read back). Reports always speak GiB.
"""

from __future__ import annotations

import math
import re

_UNITS = {
    "B": 1,
    "KB": 10**3,
    "kB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}
_ALLOWED = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
_PREFIXES = {"k": "kilo", "m": "mega", "g": "giga", "t": "tera"}

_SIZE_RE = re.compile(r"^\s*(?P<num>\d+(?:\.\d+)?)\s*(?P<unit>[a-zA-Z]*)\s*$")

GIB = 2**30
MIB = 2**20


MAX_SIZE = 2**60  # 1 EiB: far above any card or host; a larger figure is a typo or hostile

# The key of a pydantic validation context saying the data is a file a person wrote (a case file,
# a premerge.yaml): a bare number there is refused, not read as bytes (`parse_size_field`).
WRITTEN = "written_by_a_person"


def parse_size(value: str | int | float, bare_numbers: bool = True) -> int:
    """Return a size in bytes. Strings carry a unit (B, KB..TB, KiB..TiB, case as written: 'Gb' is
    gigabits and refused): '64' alone is refused, as it would silently mean 64 bytes. Numbers are
    bytes (sizes the harness wrote itself); finite, not negative, at most 1 EiB. With
    `bare_numbers=False` (a file a person wrote) a number is refused like '64'."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, (int, float)):
        if not bare_numbers:
            num = f"{value:g}" if isinstance(value, float) else str(value)
            raise ValueError(f"{value!r} has no unit; write {num}GiB or {num}GB (a bare number would mean bytes)")
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
    num, unit = match["num"], match["unit"]
    if not unit:
        raise ValueError(f"{value!r} has no unit; write {num}GiB or {num}GB (or {num}MiB; B for bytes)")
    if unit not in _UNITS:
        raise ValueError(_unit_problem(value, num, unit))
    size = int(float(num) * _UNITS[unit])
    if size > MAX_SIZE:
        raise ValueError(f"{value!r} is above 1 EiB; check the number and its unit")
    return size


def parse_size_field(value: str | int | float, info) -> int:
    """`parse_size` for a field validator: bare numbers refused where the validation context (`info.context`,
    pydantic's ValidationInfo) says the data is a file a person wrote (WRITTEN)."""
    return parse_size(value, bare_numbers=not (getattr(info, "context", None) or {}).get(WRITTEN))


def _unit_problem(value: str, num: str, unit: str) -> str:
    """Why `unit` is refused: bits (a lowercase b), a unit in the wrong case, or no unit at all."""
    canonical = {u.lower(): u for u in _UNITS if u != "kB"}.get(unit.lower())
    if canonical is None:
        return f"unknown unit {unit!r} in {value!r}; allowed: {_ALLOWED}"
    if unit.endswith("b"):
        prefix = _PREFIXES.get(unit[0].lower(), "") if len(unit) > 1 else ""
        bits = (prefix[:2] + "bi" if "i" in unit.lower() else prefix) + "bits"
        suggestion = f"{num}B" if unit == "b" else (f"{num}{canonical}" if "i" in unit.lower()
                                                     else f"{num}{canonical} or {num}{canonical[0]}iB")
        return (f"{value!r} is in {bits} (a lowercase b means bits, not bytes); write {suggestion}; "
                f"units: {_ALLOWED}")
    return f"unit {unit!r} in {value!r}: units are case-sensitive; write {num}{canonical} (units: {_ALLOWED})"


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
        scale = _UNITS[unit]
        if nbytes < scale:
            continue
        for digits in range(3):
            text = f"{nbytes / scale:.{digits}f} {unit}"
            if parse_size(text) == nbytes:
                return text
    return f"{nbytes} B"
