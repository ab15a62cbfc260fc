"""Where the bundled suite lives: the example cases, their baselines and the example training configs.

In a checkout they are the repository's top-level `cases/`, `results/baselines/` and
`configs/examples/`. An installed wheel carries copies of them in `harness/_bundled/` (the build
step in setup.py puts them there), found with `importlib.resources`. Every default that names the
bundled suite (`--case-dir`, the baselines folder, the pre-merge example configs) asks this module;
a team points the options at its own folders instead.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

BUNDLED = "_bundled"  # the folder of the package that holds the suite in a wheel
CHECKOUT = Path(__file__).resolve().parents[2]


def _root() -> Path:
    """The folder holding `cases/`, `results/baselines/` and `configs/examples/`."""
    if (CHECKOUT / "pyproject.toml").is_file() and (CHECKOUT / "cases").is_dir():
        return CHECKOUT
    bundled = resources.files("harness").joinpath(BUNDLED)
    if not isinstance(bundled, Path):
        raise RuntimeError(f"the bundled suite of oom-harness is not a folder on disk ({bundled}); "
                           "install the package unzipped (pip installs it so)")
    return bundled


ROOT = _root()
CASES_DIR = ROOT / "cases"
BASELINES_DIR = ROOT / "results" / "baselines"
EXAMPLE_CONFIGS_DIR = ROOT / "configs" / "examples"
# The architecture benchmark: models in none of the guides, measured so the predictor's errors (and
# so its margins) cover architectures its constants were never fitted on (benchmarks/architectures).
ARCH_CASES_DIR = ROOT / "benchmarks" / "architectures" / "cases"
ARCH_BASELINES_DIR = ROOT / "results" / "architectures" / "baselines"
# Configs `oom-harness fit` wrote for the guides' failing configs, measured through `fit --verify`:
# the predictor's errors on what fit proposes draw the margins too (benchmarks/fitted).
FITTED_CASES_DIR = ROOT / "benchmarks" / "fitted" / "cases"
FITTED_BASELINES_DIR = ROOT / "results" / "fitted" / "baselines"
# (baselines, their cases) by suite, the runs the predictor's errors and so its margins are measured on
# (benchmarks/predictor_errors.py): the bundled suite, the architecture benchmark (models the constants are
# never fitted on: harness.predict.calibration reads the bundled baselines only), and fit's configs measured
# through --verify (also out of the constants' sample)
SUITES = {"guides": (BASELINES_DIR, CASES_DIR), "architectures": (ARCH_BASELINES_DIR, ARCH_CASES_DIR),
          "fitted": (FITTED_BASELINES_DIR, FITTED_CASES_DIR)}
