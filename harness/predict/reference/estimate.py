"""One reference estimator's figure for one case: bytes per card, with what it counts and leaves out."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Estimate:
    """A reference tool's estimate of a case's memory on one card.

    `per_card` is what the tool says one card holds, times `launch.procs_per_card` (jobs sharing a
    card, each as the tool sees one job): the figure to set beside the measured per-card device peak.
    `counts` and `leaves_out` are one line each; `basis` names the tool's function or table cell and
    the arguments it was given, so a reader can reproduce the figure."""

    estimator: str  # "deepspeed", "accelerate", "llamafactory"
    per_card: int  # bytes
    counts: str
    leaves_out: str
    basis: str
    host: int | None = None  # host memory of the node, where the tool estimates it (bytes)
