"""Which platform a throughput prediction borrows from, and the host CPU threads its processes get.

A platform is a baseline folder's name (`nvidia-h100-80gb-hbm3-x2`: the card and its count). The
throughput model keeps constants per platform, fitted on that platform's baselines; a platform with
none borrows from the nearest one that has some: the same card family (`nvidia-h100`, `nvidia-h200`),
the same card first, then the closest card count. The host each platform was measured on is data
(`platforms.json`): the cores per card the launcher shares among a card's processes, which is how many
threads DeepSpeed's CPU Adam runs on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources

from harness.measure.device_parts import card_of
from harness.spec.schema import Case

_DATA = json.loads(resources.files(__package__).joinpath("platforms.json").read_text(encoding="utf-8"))
THREADS_WHEN_UNRECORDED = int(_DATA["thread_rule"]["threads_when_unrecorded"])


@dataclass(frozen=True)
class Host:
    """The host a platform's baselines ran on, as far as the step time depends on it."""

    platform: str | None  # the platform folder it was recorded for; None: the default
    cores_per_card: int  # CPU cores the launcher shares among one card's processes
    cpu: str | None
    provenance: str

    def threads(self, case: Case) -> int:
        """Threads of each of `case`'s processes: the case's own OMP_NUM_THREADS, else the launcher's
        equal share of the cores (harness.runtime.launcher.cpu_threads)."""
        own = case.launch.env.get("OMP_NUM_THREADS", "")
        if own.isdigit() and int(own) > 0:
            return int(own)
        return max(1, self.cores_per_card // case.launch.procs_per_card)


def family(platform: str) -> str:
    """The card family of a platform: vendor and model ('nvidia-h100-80gb-hbm3-x2' -> 'nvidia-h100')."""
    return "-".join(card_of(platform).split("-")[:2])


def card_count(platform: str) -> int:
    m = re.search(r"-x(\d+)$", platform)
    return int(m.group(1)) if m else 1


def nearest(platform: str, known: list[str] | set[str]) -> str | None:
    """The platform of `known` to borrow from: `platform` itself, else the same card family (the same
    card first, then the closest card count, the larger on a tie), else None."""
    if platform in known:
        return platform
    same = [k for k in known if family(k) == family(platform)]
    if not same:
        return None
    return min(same, key=lambda k: (card_of(k) != card_of(platform), abs(card_count(k) - card_count(platform)),
                                    -card_count(k), k))


def host(platform: str | None) -> Host:
    """The host of `platform` (platforms.json), of the nearest listed platform of its family, or the default."""
    listed = _DATA["platforms"]
    key = nearest(platform, set(listed)) if platform else None
    entry = listed[key] if key else _DATA["default"]
    return Host(platform=key, cores_per_card=int(entry["cores_per_card"]), cpu=entry.get("cpu"),
                provenance=entry["provenance"])
