"""Number types for options, shared by the command line and the pytest plugin: a count below one, a
negative or infinite timeout is refused where it is typed. argparse (and pytest, which parses its
options with argparse) turns the refusal into a usage error (exit 2) naming the option."""

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


def finite(text: str) -> float:
    """A number that is neither NaN nor infinite."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"'{text}' is not a finite number")
    return value


def seconds(text: str) -> float:
    """A duration in seconds, above zero and at most a week."""
    value = finite(text)
    if not 0 < value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text} is out of range; write seconds above 0 and at most "
                                         f"{MAX_SECONDS:.0f} (a week), e.g. 900")
    return value


def wait_seconds(text: str) -> float:
    """A wait in seconds: zero (do not wait) up to a week."""
    value = finite(text)
    if not 0 <= value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text} is out of range; write seconds from 0 to {MAX_SECONDS:.0f} "
                                         "(a week), e.g. 600")
    return value
