"""A card's compute layout: compute capability, multiprocessors, resident threads, shared memory per block.

Kept in `cards.json` beside the cards' peak throughput, from NVIDIA's programming guide and datasheets (the
file's `_compute_source`). Looked up by the card's name as CUDA reports it or by a platform key of results/
('nvidia-h200-x2'); a card not in the table has no layout, and what needs one says so.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources

_TABLE = json.loads(resources.files(__package__).joinpath("cards.json").read_text(encoding="utf-8"))["compute"]


@dataclass(frozen=True)
class CardCompute:
    name: str  # the table's name of the card
    sm: int  # compute capability x 10
    sms: int  # streaming multiprocessors
    threads_per_sm: int  # resident threads per multiprocessor
    shared_per_block: int  # bytes a block may opt into

    @property
    def resident_threads(self) -> int:
        return self.sms * self.threads_per_sm


def _words(text: str) -> str:
    return "-" + re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") + "-"


def card_compute(name_or_platform: str | None) -> CardCompute | None:
    """The layout of the card a name or platform key names (the longest table name it contains), or None."""
    if not name_or_platform:
        return None
    words = _words(name_or_platform)
    for key in sorted(_TABLE, key=len, reverse=True):
        if _words(key) in words:
            return CardCompute(name=key, **_TABLE[key])
    return None
