"""What the pytest plugin was asked to do: the case folder, the baselines folder, the pre-merge folders.

Each folder comes from the command line, else from the project's pytest ini or pyproject
(`[tool.pytest.ini_options]`), else stays off. A path on the command line is relative to where
pytest runs; one in the ini file is relative to that file. A folder that does not exist is a usage
error naming the option and the path, before anything is collected.
How a case run goes is set by the options of harness.pytest_plugin.options, which `oom-harness run`
takes as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.pytest_plugin.options import BASELINES_DIR, CASE_DIR, PREMERGE_DIRS, SUITE
from harness.spec import suite


@dataclass(frozen=True)
class Settings:
    case_dir: Path | None  # None: no case tests
    baselines_dir: Path
    premerge_dirs: tuple[Path, ...]  # empty: no pre-merge tests
    premerge_files: tuple[str, ...]  # with premerge_dirs: only the configs these files touch

    @property
    def active(self) -> bool:
        return self.case_dir is not None or bool(self.premerge_dirs)

    def folders(self) -> list[Path]:
        return ([self.case_dir] if self.case_dir else []) + list(self.premerge_dirs)


KEY = pytest.StashKey[Settings]()


def _ini_dir(config) -> Path:
    return config.inipath.parent if config.inipath else config.rootpath


def _folder(config, option: str, ini: str) -> Path | None:
    given = config.getoption(option)
    if given:
        return (config.invocation_params.dir / given).resolve()
    value = config.getini(ini)
    return (_ini_dir(config) / value).resolve() if value else None


def _must_exist(path: Path, option: str, ini: str) -> Path:
    if not path.is_dir():
        raise pytest.UsageError(f"oom-harness: {option} / {ini}: no such folder: {path}")
    return path


def resolve(config) -> Settings:
    case_dir = _folder(config, *CASE_DIR)
    if case_dir is None and (config.getoption(SUITE[0]) or config.getini(SUITE[1])):
        case_dir = suite.CASES_DIR
    baselines = _folder(config, *BASELINES_DIR) or suite.BASELINES_DIR
    given = config.getoption(PREMERGE_DIRS[0])
    if given:
        premerge = [(config.invocation_params.dir / d).resolve() for d in given]
    else:
        premerge = [Path(p).resolve() for p in config.getini(PREMERGE_DIRS[1])]
    changed = tuple(c for item in config.getoption("--premerge-files") or [] for c in item.split(",") if c)
    if changed and not premerge:
        premerge = [suite.EXAMPLE_CONFIGS_DIR]
    if case_dir is not None:
        _must_exist(case_dir, *CASE_DIR)
    for d in premerge:
        _must_exist(d, *PREMERGE_DIRS)
    return Settings(case_dir=case_dir, baselines_dir=baselines, premerge_dirs=tuple(premerge),
                    premerge_files=changed)


def settings(config) -> Settings:
    if KEY not in config.stash:
        config.stash[KEY] = resolve(config)
    return config.stash[KEY]
