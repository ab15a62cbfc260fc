"""What identifies the case a run measured, so that a run relabelled as another case is caught.

A run record names its case by id, and anyone can edit the id. It also keeps a digest of what decides
the measurement (the model's depth, the method, the training shape, DeepSpeed, the launch, the card)
and the model's name; `oom-harness bless` compares both with the case file it blesses the run under.
Claims, expectations and notes are left out: rewording them does not change what was measured.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

from harness.spec.schema import Case

MEASURED = ("layers", "stack", "precision", "method", "train", "deepspeed", "launch")


def model_name(case: Case) -> str:
    """The case's model as a registry name, or the name of the folder holding its config.json (the folder
    itself moves with the checkout)."""
    return Path(case.model).name if "/" in case.model or "\\" in case.model else case.model


# Fields added to the schema after runs were recorded, with their defaults: a case that leaves one at its
# default has the digest it had before the field existed, so its recorded runs still match it.
ADDED_LATER = {("train", "attn_implementation"): None, ("train", "pure_bf16"): False,
               ("train", "liger_kernel"): False, ("train", "optim"): None, ("launch", "runtime"): "framework"}


def case_digest(case: Case, kept: frozenset = frozenset()) -> str:
    """A digest of the parts of `case` that decide what a run of it measures (16 hex digits). A field added
    later (`ADDED_LATER`) at its default is left out, unless `kept` names it."""
    data = case.model_dump(mode="json", include=set(MEASURED))
    for (block, key), default in ADDED_LATER.items():
        if (block, key) not in kept and block in data and data[block].get(key, default) == default:
            data[block].pop(key, None)
    data["card"] = case.target.card.model_dump(mode="json")
    data["model"] = model_name(case)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def digest_matches(digest: str, case: Case) -> bool:
    """Whether a run recorded with `digest` measured `case`: the case's digest as any schema since the run
    had it, the later fields it leaves at their defaults present or not."""
    later = list(ADDED_LATER)
    return any(digest == case_digest(case, frozenset(combo))
               for n in range(len(later) + 1) for combo in itertools.combinations(later, n))
