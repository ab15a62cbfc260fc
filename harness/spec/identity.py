"""What identifies the case a run measured, so that a run relabelled as another case is caught.

A run record names its case by id, and anyone can edit the id. It also keeps a digest of what decides
the measurement (the model's depth, the method, the training shape, DeepSpeed, the launch, the card)
and the model's name; `oom-harness bless` compares both with the case file it blesses the run under.
Claims, expectations and notes are left out: rewording them does not change what was measured.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from harness.spec.schema import Case

MEASURED = ("layers", "stack", "precision", "method", "train", "deepspeed", "launch")


def model_name(case: Case) -> str:
    """The case's model as a registry name, or the name of the folder holding its config.json (the folder
    itself moves with the checkout)."""
    return Path(case.model).name if "/" in case.model or "\\" in case.model else case.model


def case_digest(case: Case) -> str:
    """A digest of the parts of `case` that decide what a run of it measures (16 hex digits)."""
    data = case.model_dump(mode="json", include=set(MEASURED))
    if data["train"].get("attn_implementation") is None:  # unset: the digest of a case written before the field
        data["train"].pop("attn_implementation", None)
    data["card"] = case.target.card.model_dump(mode="json")
    data["model"] = model_name(case)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
