"""Argument types that refuse impossible numbers where they are typed: a count below one, a negative
or infinite timeout, a fraction outside (0, 1], a memory size without a unit or below 64 MiB. argparse
turns the refusal into a usage error (exit 2) naming the option. The types the pytest plugin's options
share live in harness.spec.numbers."""

from __future__ import annotations

import argparse

from harness.spec.numbers import MAX_COUNT, MAX_SECONDS, finite, positive_int, seconds, wait_seconds
from harness.spec.units import parse_size

__all__ = ["MAX_COUNT", "MAX_SECONDS", "MIN_MEMORY", "fraction", "layer_counts", "memory_size", "positive_int",
           "seconds", "wait_seconds"]


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


# The least memory a card or a host may be given: below it a size is a slip of the unit (`24MB` for
# `24GB`, `1B`), and a budget of a few bytes divides by zero further on.
MIN_MEMORY = 64 * 2**20


def memory_size(text: str) -> str:
    """A card's or a host's memory with a unit (`64GiB`, `80GB`), at least 64 MiB; returned as written,
    for the importers to read (harness.premerge.importers.parse_size_arg)."""
    try:
        size = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size < MIN_MEMORY:
        raise argparse.ArgumentTypeError(f"{text!r} is less than 64 MiB, too little for a card or a host; "
                                         "check the number and its unit, e.g. 24GiB")
    return text
