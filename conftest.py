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
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent
CACHE = ROOT / ".cache" / "oom-harness"


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
