"""The options of a case run, defined once and registered twice: as pytest options
(harness.pytest_plugin.plugin) and as flags of `oom-harness run` (harness.cli.run), the way
pytest-benchmark's `add_*_options` functions serve its plugin and its command line. One table, one
help text and one type per option, so the two surfaces cannot drift apart. The surfaces spell some
names apart: pytest's carry a `harness-` prefix where a plain name (`--timeout`, `--steps`) would meet
another plugin's. Nothing here imports pytest, so the command line starts without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from harness.spec.numbers import positive_int, seconds, wait_seconds

# (option, ini name) of the folders the plugin reads from its ini as well (harness.pytest_plugin.settings)
CASE_DIR = ("--case-dir", "harness_case_dir")
BASELINES_DIR = ("--baselines-dir", "harness_baselines_dir")
PREMERGE_DIRS = ("--premerge-dir", "harness_premerge_dirs")
SUITE = ("--harness", "harness")

DEFAULT_TIMEOUT_S = 900.0  # harness.runtime.launcher.DEFAULT_TIMEOUT_S (a test holds them equal), not imported: heavy


@dataclass(frozen=True)
class Option:
    """One option of a case run, as both surfaces take it."""

    cli: str  # the flag of `oom-harness run`
    pytest: str  # the pytest option
    help: str
    type: Callable[[str], Any] | None = None
    default: Any = None
    switch: bool = False  # a flag without a value (store_true; its default is False)
    metavar: str | None = None

    def kwargs(self) -> dict:
        if self.switch:
            return {"action": "store_true", "default": False, "help": self.help}
        kw = {"default": self.default, "help": self.help}
        if self.type is not None:
            kw["type"] = self.type
        if self.metavar:
            kw["metavar"] = self.metavar
        return kw


RUN_OPTIONS: tuple[Option, ...] = (
    Option(CASE_DIR[0], CASE_DIR[0], metavar="DIR",
           help=f"folder of case files, one test per case and fidelity (pytest ini: {CASE_DIR[1]}; "
                "`oom-harness run` without it: the bundled suite)"),
    Option(BASELINES_DIR[0], BASELINES_DIR[0], metavar="DIR",
           help=f"folder of baselines full-size runs are held to, as `bless --baselines-dir` writes them "
                f"(pytest ini: {BASELINES_DIR[1]}; default: the bundled suite's)"),
    Option("--out", "--harness-run-dir", metavar="DIR",
           help="folder where the workers write their reports (default: a temporary folder)"),
    Option("--timeout", "--case-timeout", type=seconds, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
           help=f"seconds per case run (default: {DEFAULT_TIMEOUT_S:.0f})"),
    Option("--steps", "--harness-steps", type=positive_int, metavar="N",
           help="optimizer steps per case run (default: 4 at tiny size, 6 at full size)"),
    Option("--jobs", "--harness-jobs", type=positive_int, metavar="N",
           help="training processes at once for tiny runs (default: one per CPU core)"),
    Option("--full-depth", "--harness-full-depth", switch=True,
           help="measure cases with depth_points at full depth (a host that holds them)"),
    Option("--grad-accum-cap", "--harness-grad-accum-cap", type=positive_int, metavar="N",
           help="full-size runs accumulate at most N micro steps (peaks do not change past 2; saves time; "
                "labelled in every figure)"),
    Option("--benchmark-json", "--harness-benchmark-json", metavar="FILE",
           help="write full-size throughput in pytest-benchmark's JSON format to this file"),
    Option("--wait-for-card", "--harness-wait-for-card", type=wait_seconds, default=0.0, metavar="SECONDS",
           help="wait up to this long for a card another harness is measuring (default: refuse at once; "
                "the full-size runs then fail as card_busy, naming the other harness)"),
    Option("--selected-only", "--harness-selected-only", switch=True,
           help="run only the selected cases: a claim about another case (a fix's peak against its "
                "failing config, a family's speed order) is not checkable instead of running it"),
    Option("--memory-history", "--memory-history", switch=True,
           help="GPU runs record rank 0's allocator history into the run's folder (rank0-memory.json.gz), "
                "for the report's memory timeline; slows the step, so compare no throughput from it "
                "(environment: OOM_HARNESS_MEMORY_HISTORY=1)"),
    Option("--html", "--harness-html", metavar="DIR",
           help="write the HTML report of the runs made, beside the baselines, as DIR/index.html"),
)


def add_run_options(addoption: Callable[..., Any], surface: Literal["cli", "pytest"]) -> None:
    """Register every option of `RUN_OPTIONS` through `addoption` (argparse's `add_argument`, pytest's
    `group.addoption`) under the names of `surface`."""
    for option in RUN_OPTIONS:
        addoption(getattr(option, surface), **option.kwargs())
