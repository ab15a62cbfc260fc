"""What every figure's caption says of its numbers: where they were measured (card, count, driver and
software), when, and what in the figure is predicted or extrapolated rather than measured."""

from __future__ import annotations

from harness.baselines.store import Baseline

VERSION_KEYS = ("torch", "cuda", "rocm", "transformers", "peft", "deepspeed", "bitsandbytes", "flash-linear-attention")


def _joined(values) -> str:
    return " / ".join(sorted({v for v in values if v}))


def software(versions: list[dict[str, str]], drivers: list[str | None]) -> str:
    """'driver 580.1, torch 2.11.0, cuda 13.0, ...': each version as recorded, several where they differ."""
    parts = [f"driver {_joined(drivers)}"] if any(drivers) else []
    for key in VERSION_KEYS:
        seen = _joined(v.get(key) for v in versions)
        if seen:
            parts.append(f"{key} {seen}")
    return ", ".join(parts) or "software not recorded"


def days(baselines: list[Baseline]) -> str:
    """'2026-11-25 to 2026-11-26'; runs given, which carry no date, are said to be undated."""
    every = {f.recorded or b.recorded for b in baselines for f in b.runs}
    dates = sorted(d for d in every if d)
    undated = " and undated runs given" if "" in every else ""
    if not dates:
        return "no date recorded" if not undated else "undated (runs given)"
    return (dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}") + undated


def measured_where(baselines: list[Baseline]) -> str:
    """'NVIDIA H200 x2 (driver ..., torch ...), recorded 2026-11-25 to 2026-11-26'."""
    cards = _joined(f"{b.platform.device_name} x{b.platform.device_count}" for b in baselines)
    sw = software([b.platform.versions for b in baselines], [b.platform.driver for b in baselines])
    return f"measured on {cards} ({sw}), recorded {days(baselines)}"


PREDICTED = ("predicted: `oom-harness check`'s predictor for the config as measured (its variant applied), "
             "calibrated on this platform's baselines of the other cases (the case itself left out)")
