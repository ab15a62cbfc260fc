"""The pytest plugin, loaded through the `pytest11` entry point: inert until a project asks for it.

Installing oom-harness adds this plugin to every pytest run of the environment, so it does
nothing (adds no test, starts nothing) unless one of these is set, on the command line or in the
project's pytest ini / pyproject `[tool.pytest.ini_options]`:

    harness_case_dir = "perf/cases"          --case-dir DIR       case tests, one item per case file and fidelity
    harness = true                           --harness            case tests of the bundled example suite
    harness_premerge_dirs = ["configs/ds"]   --premerge-dir DIR   pre-merge checks of training configs

and where full-size runs find their baselines (default: the bundled suite's):

    harness_baselines_dir = "perf/baselines" --baselines-dir DIR

The plugin collects the case files and training configs itself: a repository needs no test file
and no conftest.py. When pytest runs without paths (`pytest`, `pytest -m gpu`) and a configured
folder lies outside what it would collect (its `testpaths`), the folder is collected too.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.pytest_plugin.options import BASELINES_DIR, CASE_DIR, PREMERGE_DIRS, SUITE, add_run_options
from harness.pytest_plugin.settings import settings

LLAMAFACTORY_PYTHON = "harness_llamafactory_python"  # ini key (harness.runtime.stacks.PYTHON_VARIABLE)

MARKERS = (
    "tiny: a case at tiny size on a CPU (the default tier)",
    "gpu: a case at full size on real GPUs",
    "multigpu: a full-size case that needs several GPUs",
    "dcu: a case whose target is a Hygon DCU (ROCm/HIP)",
    "premerge: pre-merge config checks on a CPU (oom-harness check over a folder of configs and its premerge.yaml)",
)


def pytest_addoption(parser):
    group = parser.getgroup("oom-harness")
    group.addoption(SUITE[0], action="store_true",
                    help="run the case tests of the bundled example suite (where no case folder is set)")
    add_run_options(group.addoption, "pytest")  # --case-dir, --baselines-dir and how a case runs
    group.addoption(PREMERGE_DIRS[0], action="append", default=None,
                    help=f"folder of training configs with a premerge.yaml: one test per config (repeatable; "
                         f"ini: {PREMERGE_DIRS[1]})")
    group.addoption("--premerge-files", action="append", default=None,
                    help="check only configs touched by these files (configs, DeepSpeed JSONs, premerge.yaml; "
                         "repeatable; without a pre-merge folder: the bundled example configs)")
    group.addoption("--premerge-fit", action="store_true",
                    help="a config expected to fit that does not: search a fitting one (oom-harness fit) and "
                         "put its changes in the failure (ini: harness_premerge_fit)")
    parser.addini("harness_premerge_fit", type="bool", default=False,
                  help="oom-harness: pre-merge failures list the changes of a fitted config")
    parser.addini(SUITE[1], type="bool", default=False, help="oom-harness: run the bundled example suite's cases")
    parser.addini(CASE_DIR[1], default="", help="oom-harness: folder of case files, relative to this file")
    parser.addini(BASELINES_DIR[1], default="", help="oom-harness: folder of baselines, relative to this file")
    parser.addini(PREMERGE_DIRS[1], type="paths", default=[],
                  help="oom-harness: folders of training configs to check before merging")
    parser.addini(LLAMAFACTORY_PYTHON, default="",
                  help="oom-harness: the Python of an environment with LLaMA-Factory, relative to this file, for "
                       "llamafactory cases where this one lacks it (HARNESS_LLAMAFACTORY_PYTHON wins)")


def pytest_configure(config):
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    chosen = settings(config)
    _stack_interpreters(config)
    if config.getoption("--memory-history", default=False):
        from harness.runtime import memory_history

        memory_history.request()
    if chosen.active and _args_are_defaults(config):
        covered = [(config.invocation_params.dir / a.split("::")[0]).resolve() for a in config.args]
        config.args.extend(str(f) for f in chosen.folders()
                           if not any(f == c or c in f.parents for c in covered))


def _stack_interpreters(config) -> None:
    """The ini's LLaMA-Factory interpreter, for the workers of llamafactory cases (harness.runtime.stacks),
    where the environment names none and the file is there."""
    value = config.getini(LLAMAFACTORY_PYTHON)
    variable = "HARNESS_LLAMAFACTORY_PYTHON"
    if value and not os.environ.get(variable):
        base = config.inipath.parent if config.inipath else config.rootpath
        path = Path(value) if Path(value).is_absolute() else base / value
        if path.is_file():
            os.environ[variable] = str(path)


def _args_are_defaults(config) -> bool:
    """True where pytest was given no paths (it collects `testpaths` or the current folder)."""
    source = getattr(config, "args_source", None)
    return source is not None and source != pytest.Config.ArgsSource.ARGS


def pytest_collect_file(file_path: Path, parent):
    chosen = settings(parent.config)
    if not chosen.active:
        return None
    folder = file_path.parent.resolve()
    if chosen.case_dir is not None and folder == chosen.case_dir and file_path.suffix == ".yaml":
        from harness.pytest_plugin.cases import CaseFile

        return CaseFile.from_parent(parent, path=file_path)
    if folder in chosen.premerge_dirs:
        from harness.pytest_plugin.premerge import PremergeFile, is_premerge_file

        if is_premerge_file(file_path):
            return PremergeFile.from_parent(parent, path=file_path)
    return None


def pytest_runtest_setup(item):
    """Under `-n 2 --dist loadgroup`, a test scheduled with the case items starts their tiny runs."""
    if settings(item.config).case_dir is not None:
        from harness.pytest_plugin.cases import start_beside

        start_beside(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A full-size case's progress (harness.report.progress) while it runs: they take minutes each."""
    from harness.pytest_plugin.cases import CaseItem

    if not isinstance(item, CaseItem) or item.param.fidelity != "real" or item.param.error is not None:
        return (yield)
    import sys

    from harness.baselines.store import read_baselines
    from harness.pytest_plugin.cases import _session
    from harness.report.progress import Progress, expected_time

    session = _session(item.config)
    folder = session.run_root / "real"
    expected = expected_time(item.param.case_id, "real", folder, read_baselines(session.baseline_root)[0])
    # past pytest's capture: the line is for the person watching, not the test's output
    with Progress(sys.__stderr__).case(f"{item.param.case_id} real", folder, item.param.case_id, expected):
        return (yield)


_FROM_WORKERS = pytest.StashKey[list]()
_WORKER_OUTPUT = "oom_harness_summary"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    if settings(config).case_dir is not None:
        from harness.pytest_plugin.cases import remember_selected

        remember_selected(config, items)


def pytest_sessionfinish(session):
    """In a pytest-xdist worker: the summary of the cases it ran, for the controller to print."""
    config = session.config
    if hasattr(config, "workeroutput") and settings(config).case_dir is not None:
        from harness.pytest_plugin.cases import summary

        config.workeroutput[_WORKER_OUTPUT] = summary(config)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's controller, under `--dist loadgroup`: the case items in one group."""
    chosen = settings(config)
    if config.getvalue("dist") != "loadgroup" or chosen.case_dir is None:
        return None
    from harness.pytest_plugin.xdist_groups import CaseGroupScheduling

    return CaseGroupScheduling(config, log, chosen.case_dir)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: keep what a worker's cases came to."""
    sections = getattr(node, "workeroutput", {}).get(_WORKER_OUTPUT)
    if sections:
        node.config.stash.setdefault(_FROM_WORKERS, []).extend(sections)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if settings(config).case_dir is not None:
        from harness.pytest_plugin.cases import summary, terminal_summary

        terminal_summary(terminalreporter, config.stash.get(_FROM_WORKERS, None) or summary(config))
