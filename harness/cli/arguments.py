"""Argument types that refuse impossible numbers where they are typed: a count below one, a negative
or infinite timeout, a fraction outside (0, 1]. argparse turns the refusal into a usage error
(exit 2) naming the option. The types the pytest plugin's options share live in harness.spec.numbers."""

from __future__ import annotations

import argparse

from harness.spec.numbers import MAX_COUNT, MAX_SECONDS, finite, positive_int, seconds, wait_seconds

__all__ = ["MAX_COUNT", "MAX_SECONDS", "fraction", "layer_counts", "positive_int", "seconds", "wait_seconds"]


def layer_counts(text: str) -> list[int]:
    """Layer counts as `4,8`: the depths a full-size run measures at, to extrapolate to the full depth."""
    parts = [p.strip() for p in text.split(",")]
    counts = [positive_int(p) for p in parts]
    if len(counts) < 2 or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"'{text}': write two or more distinct layer counts, e.g. 4,8")
    return sorted(counts)


def fraction(text: str) -> float:
    """A share of something, above 0 and at most 1 (a card's headroom)."""
    value = finite(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is out of range; write a fraction above 0 and at most 1, e.g. 0.9")
    return value
