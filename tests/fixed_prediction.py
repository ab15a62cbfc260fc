"""A prediction with figures a test chooses, for tests of what reads a prediction (`check`'s verdict, the
lints, the pre-merge items): the predictor's own `Prediction`, so a field it gains reaches these tests too."""

from __future__ import annotations

from harness.predict.margin import Margin
from harness.predict.predictor import Prediction

GIB = 2**30


def fixed_prediction(allocated: int = 10 * GIB, reserved: int = 11 * GIB, device: int = 12 * GIB,
                     host_ram: int = 100 * GIB, margin: Margin | None = None,
                     notes: tuple[str, ...] = ("a fixed prediction",)) -> Prediction:
    """What `predict` returns for a config on a CUDA card, with these figures; no margin unless given."""
    return Prediction(allocated=allocated, reserved=reserved, device=device, host_ram=host_ram, notes=list(notes),
                      platform="cuda", margin=margin or Margin(0.0, "no margin (a fixed prediction)"))
