"""This repository's own test run: where its caches live, and a header line saying whether they are warm.

It covers everything pytest collects here: tests/, benchmarks/, and the bundled suite's case and
pre-merge items, which the plugin collects from cases/ and configs/examples/ (outside tests/, so
tests/conftest.py does not reach them). A team's repository needs no conftest.py: the plugin registers
itself through its entry point.

The run keeps everything it caches in the checkout's ignored `.cache/oom-harness/`, as CI does
(.ci/run): DeepSpeed's JIT-built ops, Triton's kernels and the random-weight checkpoints
(`HARNESS_CACHE`), and the predictor's traces beside them (`HARNESS_PREDICT_CACHE`, which would
otherwise live in ~/.cache whatever `HARNESS_CACHE` says), so one folder kept between CI jobs keeps
the run warm. A cold cache costs minutes (docs/measuring.md#the-default-tier-and-its-caches). A
variable already set wins.

The test files whose tests mostly wait (on a timeout they provoke, on processes they kill) are
collected first (`WAITING_FIRST`): under `-n 2 --dist loadgroup` the worker that does not run the case
items then runs them while the tiny runs the other worker started in the background use the CPU they
leave idle, instead of leaving a core idle after the tiny runs are done.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
CACHE = ROOT / ".cache" / "oom-harness"
# wall time well above their CPU time: 88 s of wall and 35 CPU-s for test_faults.py and test_launcher.py
WAITING_FIRST = ("tests/test_faults.py", "tests/test_launcher.py", "tests/test_stopping.py", "tests/test_zygote.py")


def pytest_configure(config):
    os.environ.setdefault("HARNESS_CACHE", str(CACHE))
    os.environ.setdefault("HARNESS_PREDICT_CACHE", str(Path(os.environ["HARNESS_CACHE"]) / "predict-trace"))


def _warm(folder: Path) -> str:
    return "warm" if folder.is_dir() and next(folder.iterdir(), None) is not None else "cold"


def pytest_report_header(config):
    """Whether this run starts with its caches warm: a cold one is minutes slower, and says so up front."""
    cache = Path(os.environ["HARNESS_CACHE"])
    predict = os.environ["HARNESS_PREDICT_CACHE"]
    parts = [f"DeepSpeed ops {_warm(cache / 'torch_extensions')}", f"checkpoints {_warm(cache / 'checkpoints')}"]
    if predict.lower() not in ("off", "0", "no", "false"):
        parts.append(f"predictor traces {_warm(Path(predict))}")
    return f"oom-harness caches: {cache} ({', '.join(parts)})"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """`WAITING_FIRST`'s tests ahead of the others, each group in its collection order."""
    items.sort(key=lambda item: item.nodeid.split("::", 1)[0] not in WAITING_FIRST)
