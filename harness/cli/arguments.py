"""Argument types that refuse impossible numbers where they are typed: a count below one, a negative
or infinite timeout, a fraction outside (0, 1]. argparse turns the refusal into a usage error
(exit 2) naming the option."""

from __future__ import annotations

import argparse
import math

# The most a count may be: far above any host, so a typo of many digits is refused, not run.
MAX_COUNT = 1_000_000
MAX_SECONDS = 7 * 24 * 3600.0


def positive_int(text: str) -> int:
    """A whole number from 1 (GPUs, processes, steps, repetitions, jobs)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number; write e.g. 2") from None
    if not 1 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{value} is out of range; write a whole number from 1 to {MAX_COUNT:,}")
    return value


def layer_counts(text: str) -> list[int]:
    """Layer counts as `4,8`: the depths a full-size run measures at, to extrapolate to the full depth."""
    parts = [p.strip() for p in text.split(",")]
    counts = [positive_int(p) for p in parts]
    if len(counts) < 2 or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"'{text}': write two or more distinct layer counts, e.g. 4,8")
    return sorted(counts)


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"'{text}' is not a finite number")
    return value


def seconds(text: str) -> float:
    """A duration in seconds, above zero and at most a week."""
    value = _finite(text)
    if not 0 < value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text} is out of range; write seconds above 0 and at most "
                                         f"{MAX_SECONDS:.0f} (a week), e.g. 900")
    return value


def wait_seconds(text: str) -> float:
    """A wait in seconds: zero (do not wait) up to a week."""
    value = _finite(text)
    if not 0 <= value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text} is out of range; write seconds from 0 to {MAX_SECONDS:.0f} "
                                         "(a week), e.g. 600")
    return value


def fraction(text: str) -> float:
    """A share of something, above 0 and at most 1 (a card's headroom)."""
    value = _finite(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is out of range; write a fraction above 0 and at most 1, e.g. 0.9")
    return value
