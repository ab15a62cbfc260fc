"""Pre-merge tests: every training config of a folder checked like `oom-harness check`, one item each.

    pytest -m premerge                                  the folders of harness_premerge_dirs (ini)
    pytest -m premerge --premerge-dir configs/team-a    another folder (repeatable)
    pytest -m premerge --premerge-files configs/team-a/ds_z3.json   only what a pull request touched

A folder's `premerge.yaml` says what each config runs on (the config files do not):

    defaults: {gpus: 8, gpu_memory: 64GiB}              # for every config of the folder
    configs:
      sft-32b.yaml: {vendor: hygon, expect: fits}       # expect: fits (default) | oom
      old-32b.yaml: {expect: oom}
      plain-python.json: {launcher: python, lints: [deepspeed-plain-python]}   # mistakes it must show

Each YAML/JSON training config in the folder is one item (DeepSpeed JSONs are checked through the
configs that use them); a broken premerge.yaml, or an entry naming no config, is a failing item of
premerge.yaml. An item fails with the check's table when a config expected to fit does not, when
a lint of severity error fires that the entry does not list, or when one it lists does not fire.
`--premerge-files` keeps the configs whose own file, DeepSpeed file or premerge.yaml is listed.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from harness.models.inputs import InputError, load_yaml
from harness.premerge.check import CheckResult, run_check, table
from harness.premerge.importers import ConfigError, ConfigFormat, JobSpec, detect_format, read_mapping, resolve_path
from harness.pytest_plugin.settings import settings
from harness.spec.units import WRITTEN, parse_size_field

SIDECAR = "premerge.yaml"
_CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


class PremergeSettings(BaseModel):
    """One config's job, or a folder's defaults: what `oom-harness check` takes as flags."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpus: int | None = Field(default=None, gt=0)
    gpu_memory: int | None = None
    procs_per_gpu: int | None = Field(default=None, gt=0)
    headroom: float | None = Field(default=None, gt=0, le=1)
    host_ram: int | None = None
    vendor: Literal["nvidia", "hygon", "amd"] | None = None
    launcher: Literal["python", "torchrun", "deepspeed", "accelerate", "llamafactory-cli"] | None = None
    model: str | None = None
    deepspeed: str | None = None
    stack: Literal["peft", "llamafactory", "hf_trainer", "plain"] | None = None
    script: str | None = None
    platform: str | None = None
    triton_cache: Literal["cold", "warm"] | None = None
    expect: Literal["fits", "oom"] | None = None
    lints: list[str] | None = None  # error lints this config is expected to raise

    @field_validator("gpu_memory", "host_ram", mode="before")
    @classmethod
    def _size(cls, value, info: ValidationInfo):
        return None if value is None else parse_size_field(value, info)


class Sidecar(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    defaults: PremergeSettings = Field(default_factory=PremergeSettings)
    configs: dict[str, PremergeSettings] = Field(default_factory=dict)


@dataclass(frozen=True)
class PremergeEntry:
    config: Path
    settings: PremergeSettings
    problem: str | None = None  # a broken sidecar or a missing file: the test fails with this

    @property
    def test_id(self) -> str:
        return f"{self.config.parent.name}/{self.config.name}"


def load_sidecar(folder: Path) -> Sidecar:
    path = folder / SIDECAR
    if not path.is_file():
        return Sidecar()
    try:
        data = load_yaml(path)  # the one reader of users' files: its limits, duplicate keys refused
    except InputError as exc:
        raise ConfigError(exc.path, exc.key, exc.problem, exc.fix) from None
    try:
        # a person wrote it: `gpu_memory: 80` is refused, not read as 80 bytes
        return Sidecar.model_validate(data or {}, context={WRITTEN: True})
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        raise ConfigError(path, key, msg, "see the format in harness/pytest_plugin/premerge.py") from None


def _is_training_config(path: Path) -> bool:
    try:
        return detect_format(path, read_mapping(path)) != ConfigFormat.deepspeed
    except ConfigError:
        return True  # unreadable: keep it, so its test shows the problem


def _deepspeed_path(path: Path, settings: PremergeSettings) -> Path | None:
    if settings.deepspeed:
        return (path.parent / settings.deepspeed).resolve()
    try:
        ref = read_mapping(path).get("deepspeed")
    except ConfigError:
        return None
    return resolve_path(ref, path).resolve() if isinstance(ref, str) else None


def entries(folder: Path) -> list[PremergeEntry]:
    """The tests of one folder: each training config with its merged settings."""
    folder = Path(folder)
    if not folder.is_dir():
        return [PremergeEntry(folder, PremergeSettings(), f"{folder}: no such folder")]
    try:
        sidecar = load_sidecar(folder)
    except ConfigError as exc:
        return [PremergeEntry(folder / SIDECAR, PremergeSettings(), str(exc))]
    found = [p for p in sorted(folder.iterdir())
             if p.suffix.lower() in _CONFIG_SUFFIXES and p.name != SIDECAR and _is_training_config(p)]
    out = []
    defaults = sidecar.defaults.model_dump(exclude_none=True)
    for path in found:
        own = sidecar.configs.get(path.name)
        merged = PremergeSettings.model_validate({**defaults, **(own.model_dump(exclude_none=True) if own else {})})
        out.append(PremergeEntry(path, merged))
    for name in sorted(set(sidecar.configs) - {p.name for p in found}):
        out.append(PremergeEntry(folder / name, PremergeSettings(),
                                 f"{folder / SIDECAR}: configs.{name}: no such training config in {folder}"))
    return out


def select(all_entries: list[PremergeEntry], changed: list[str]) -> list[PremergeEntry]:
    """The entries a change touches: the config itself, its DeepSpeed file, or its folder's sidecar."""
    wanted = {Path(c).resolve() for c in changed}
    kept = []
    for e in all_entries:
        touched = {e.config.resolve(), (e.config.parent / SIDECAR).resolve()}
        ds = _deepspeed_path(e.config, e.settings) if e.problem is None else None
        if ds is not None:
            touched.add(ds)
        if touched & wanted:
            kept.append(e)
    return kept


def spec_of(entry: PremergeEntry) -> JobSpec:
    s, base = entry.settings, entry.config.parent
    return JobSpec(gpus=s.gpus, gpu_memory=s.gpu_memory, procs_per_gpu=s.procs_per_gpu, headroom=s.headroom,
                   host_ram=s.host_ram, vendor=s.vendor, launcher=s.launcher, model=s.model,
                   deepspeed=None if s.deepspeed is None else base / s.deepspeed, stack=s.stack,
                   script=None if s.script is None else base / s.script, triton_cache=s.triton_cache)


def judge(entry: PremergeEntry, result: CheckResult) -> list[str]:
    """What is wrong with a check result against the entry's expectations (empty: the test passes)."""
    expect = entry.settings.expect or "fits"
    expected_lints = set(entry.settings.lints or [])
    errors = {f.code for f in result.errors}
    problems = []
    fit = f" ({result.fit.summary()})" if result.fit is not None else ""
    if expect == "fits" and not result.fits:
        problems.append("expected to fit, but " + (f"it does not{fit}" if result.fits is False else result.verdict))
    if expect == "oom" and result.fits is not False:
        problems.append("expected not to fit (expect: oom), but "
                        + (f"it fits{fit}" if result.fits else result.verdict))
    unexpected = sorted(errors - expected_lints)
    if unexpected:
        problems.append(f"lint error(s): {', '.join(unexpected)}")
    missing = sorted(expected_lints - {f.code for f in result.lints})
    if missing:
        problems.append(f"expected lint(s) did not fire: {', '.join(missing)}")
    return problems


def check_entry(entry: PremergeEntry, fit_dir: Path | None = None) -> CheckResult:
    """Run one entry's check; fail the calling test with the check's table when it does not hold. With
    `fit_dir` (`--premerge-fit`), a config expected to fit that does not gets a fitted config written
    there, and the failure lists its changes (`harness.fit.suggest`)."""
    if entry.problem:
        pytest.fail(entry.problem, pytrace=False)
    try:
        result = run_check(entry.config, spec_of(entry), platform=entry.settings.platform)
    except ConfigError as exc:
        pytest.fail(f"{exc}\n(set what the config does not say in {entry.config.parent / SIDECAR})", pytrace=False)
    problems = judge(entry, result)
    if problems:
        fitted = ""
        if fit_dir is not None and result.fits is False and (entry.settings.expect or "fits") == "fits":
            from harness.fit.suggest import fit_diff
            from harness.predict.predictor import predict

            fitted = "\n\n" + fit_diff(result, fit_dir, predict, deepspeed_arg=spec_of(entry).deepspeed,
                                        platform=entry.settings.platform)
        pytest.fail(f"{entry.config}: " + "; ".join(problems) + "\n\n" + table(result) + fitted, pytrace=False)
    return result


# --- collection (harness.pytest_plugin.plugin hands these files over) ----------------------------

_ENTRIES = pytest.StashKey[dict]()


def folder_entries(config, folder: Path) -> list[PremergeEntry]:
    """A folder's entries, read once a run, narrowed to what `--premerge-files` touches."""
    cache = config.stash.setdefault(_ENTRIES, {})
    if folder not in cache:
        found = entries(folder)
        changed = settings(config).premerge_files
        cache[folder] = select(found, list(changed)) if changed else found
    return cache[folder]


class PremergeFile(pytest.File):
    """A training config (its entry), or the folder's premerge.yaml (the problems it has)."""

    def collect(self):
        me = self.path.resolve()
        for entry in folder_entries(self.config, me.parent):
            mine = entry.config.resolve() == me if entry.problem is None else me.name == SIDECAR
            if mine:
                name = "premerge" if entry.problem is None else f"premerge[{entry.config.name}]"
                item = PremergeItem.from_parent(self, name=name, entry=entry)
                item.add_marker(pytest.mark.premerge)
                yield item


class PremergeItem(pytest.Item):
    def __init__(self, *, entry: PremergeEntry, **kwargs):
        super().__init__(**kwargs)
        self.entry = entry

    def runtest(self) -> None:
        fit = self.config.getoption("--premerge-fit") or self.config.getini("harness_premerge_fit")
        fit_dir = Path(tempfile.mkdtemp(prefix="oom-harness-fit-")) if fit else None
        check_entry(self.entry, fit_dir)

    def reportinfo(self):
        return self.path, None, f"premerge {self.entry.test_id}"


def is_premerge_file(path: Path) -> bool:
    return path.suffix.lower() in _CONFIG_SUFFIXES
