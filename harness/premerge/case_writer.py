"""A team's own training config written as a case file, so it runs nightly like the bundled suite.

    write_case(Path("llama3_lora.yaml"), JobSpec(gpus=1, gpu_memory=24 * GIB), Path("cases"))

The config is imported and predicted as `oom-harness check` does (`harness.premerge.check.run_check`).
The case file keeps the job as the config describes it (model, method, batch, sequence length,
checkpointing, DeepSpeed block, launcher, cards), the card it must fit with its headroom, the outcome
the prediction expects (fits, or oom where the predicted per-card peak plus its margin exceeds the budget; detected
where the config builds the model before ZeRO-3 is configured), and the prediction itself under
`predicted`, to compare measurements with; `predicted` is never asserted. Paths in the case (the model
folder, the source config) are written relative to the case file, so a repository that holds both
can move as a whole.
"""

from __future__ import annotations

import datetime as dt
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from harness.models.source import is_registry_name
from harness.premerge.check import CheckResult, PredictFn, run_check
from harness.premerge.importers import ConfigError, JobSpec
from harness.premerge.importers.model import LOCAL_MODEL_NOTE
from harness.spec.cases import CaseError, parse_case
from harness.spec.files import RefusedOutput, control_character, printable
from harness.spec.outputs import Outputs, check_name
from harness.spec.schema import CASE_ID_PATTERN, Case
from harness.spec.units import fmt_gib, fmt_size_exact


@dataclass(frozen=True)
class WrittenCase:
    path: Path
    case: Case
    check: CheckResult


def predictor_version() -> str:
    """The installed oom-harness version (the predictor's code and constants ship with it)."""
    import importlib.metadata as md

    try:
        return md.version("oom-harness")
    except md.PackageNotFoundError:
        return "source tree"


def _relative(target: str | Path, out_dir: Path) -> str:
    """`target` as written in a case file in `out_dir`: relative to it, so case and config move together."""
    return os.path.relpath(Path(target).resolve(), out_dir.resolve())


def _expected(result: CheckResult) -> dict[str, Any]:
    case = result.config.case
    if case.deepspeed is not None and case.deepspeed.stage == 3 and case.launch.init_order == "model_first":
        return {"outcome": "detected", "detect": "materialised_before_zero_init"}
    return {"outcome": "fits" if result.case_fits else "oom"}


def _predicted(result: CheckResult, today: str) -> dict[str, Any]:
    p = result.prediction
    return {
        "per_card_peak": fmt_gib(result.card_peak),
        "allocated": fmt_gib(p.allocated),
        "host_ram": fmt_gib(result.node_host_ram),
        "budget": fmt_gib(result.budget),
        "margin": fmt_gib(result.fit.margin),
        "calibration": p.platform,
        "predictor_version": predictor_version(),
        "date": today,
    }


# Within this share of the budget, the prediction's error decides the outcome: a full-size run should.
CLOSE_CALL = 0.05


def _notes(result: CheckResult) -> str:
    """The importer's notes and the lints, as `oom-harness check` prints them. The note on where the model's
    config.json was read is left out: the case names that folder itself."""
    lines = [n for n in result.config.notes if not n.startswith(LOCAL_MODEL_NOTE)]
    left = result.fit.headroom / result.budget
    if abs(left) < CLOSE_CALL:
        lines.append(f"close call: the predicted peak with its margin is {abs(left):.1%} "
                     f"{'below' if left >= 0 else 'above'} the budget: expect.outcome is the prediction's, "
                     "a full-size run decides")
    lines += [f.one_line() for f in result.lints]
    lines += [f"{n.line()}: this case does not hold it" for n in result.config.not_modelled]
    return "\n".join(lines)


def case_data(result: CheckResult, out_dir: Path, case_id: str, card_name: str | None = None,
              today: str | None = None) -> dict[str, Any]:
    """The case file's content (in the schema's field order), from an imported and predicted config."""
    case = result.config.case
    written = case.model_dump(mode="json", exclude_defaults=True)
    training = result.config.training.path
    source = {"title": case.source.title if case.source else f"training config {training.name}",
              "config": _relative(training, out_dir)}
    if result.config.deepspeed is not None and result.config.deepspeed.path != training:
        source["deepspeed"] = _relative(result.config.deepspeed.path, out_dir)
    card = case.target.card
    target: dict[str, Any] = {"card": {"vendor": card.vendor, "name": card_name or card.name,
                                       "memory": fmt_size_exact(card.memory), "count": card.count},
                              "headroom": case.target.headroom}
    if case.target.host_ram is not None:
        target["host_ram"] = fmt_size_exact(case.target.host_ram)
    data: dict[str, Any] = {
        "id": case_id,
        "title": f"{training.name} on {card.count} x {card_name or card.name}",
        "role": "config",
        "family": case_id,
        "source": source,
        "model": case.model if is_registry_name(case.model) else _relative(case.model, out_dir),
        "stack": case.stack.value,
        "precision": case.precision.value,
        "method": written["method"],
        "train": written["train"],
    }
    if case.deepspeed is not None:
        data["deepspeed"] = written["deepspeed"]
    data["launch"] = written.get("launch", {})
    data["target"] = target
    data["expect"] = _expected(result)
    data["predicted"] = _predicted(result, today or dt.date.today().isoformat())
    data["claims"] = [{"kind": "trains"}]
    notes = _notes(result)
    if notes:
        data["notes"] = notes
    if not data["launch"]:
        del data["launch"]
    return data


class _Dumper(yaml.SafeDumper):
    """Safe YAML with long text (the notes) as a literal block, as a person writes it."""


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text or len(text) > 100 else None))


def _header(result: CheckResult) -> str:
    c = result.config
    return (f"# A case made by `oom-harness case-from` from {printable(c.training.path.name)}. `expect` is what runs "
            "assert;\n"
            "# `predicted` is the prediction when it was written, kept to compare measurements with.\n")


MAX_CASE_ID = 100  # characters: a file name well within every file system's limit


def default_case_id(config: Path) -> str:
    """The config file's name as a case id."""
    slug = re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9._-]+", "-", config.stem)).strip("-._")
    return slug[:MAX_CASE_ID].strip("-._") or "config"


def check_depth_points(depth_points: list[int], layers: int) -> None:
    """--depth-points for a model of `layers` layers: each below the full depth (ConfigError naming the flag)."""
    if max(depth_points) >= layers:
        raise ConfigError(None, "--depth-points", f"{max(depth_points)} is not below the model's {layers} layers",
                          "measure at a few shallow depths, e.g. 4,8")


def _with_depth_points(data: dict[str, Any], depth_points: list[int], result: CheckResult) -> dict[str, Any]:
    """The case's data with `depth_points` in the schema's place (after `model`), each below the full depth."""
    check_depth_points(depth_points, result.config.arch.layers)
    out: dict[str, Any] = {}
    for key, value in data.items():
        out[key] = value
        if key == "model":
            out["depth_points"] = list(depth_points)
    return out


def _control_problem(given: Path | str | None) -> ConfigError | None:
    bad = given is not None and control_character(str(given))
    if not bad:
        return None
    return ConfigError(Path(printable(str(given))), None, f"the name holds the control character {bad}, which would "
                       "be written into the case file", "rename it without control characters")


def _refuse_read_names(result: CheckResult, path: Path) -> None:
    """The files the import found (the DeepSpeed JSON the config names, the model's folder): none may be
    the case file, and no name written into the case may hold a control character."""
    model = result.config.case.model
    for source in [*result.config.sources, None if is_registry_name(model) else model]:
        problem = _control_problem(source)
        if problem:
            raise problem
        if source is not None and Path(source).resolve() == path.resolve():
            raise RefusedOutput(f"the case file {path}: is one of this command's inputs, never written over; "
                                "name another with --id or --out")


def write_case(config: Path | str, spec: JobSpec, out_dir: Path | str, *, case_id: str | None = None,
               card_name: str | None = None, platform: str | None = None, force: bool = False,
               predict: PredictFn | None = None, today: str | None = None,
               depth_points: list[int] | None = None) -> WrittenCase:
    """Import, predict and write `out_dir/<case_id>.yaml`. Raises ConfigError on bad input.

    `depth_points`: layer counts its full-size runs measure at, extrapolating to the full depth (a
    config whose full depth the GPU host at hand cannot hold, or not in reasonable time)."""
    config, out_dir = Path(config), check_name(out_dir, "--out")  # '' would be the current folder
    case_id = case_id or default_case_id(config)
    if not re.fullmatch(CASE_ID_PATTERN, case_id) or ".." in case_id or len(case_id) > MAX_CASE_ID:
        raise ConfigError(None, "--id", f"'{case_id[:MAX_CASE_ID]}' is not a safe file name",
                          f"use up to {MAX_CASE_ID} letters, digits, '.', '_' and '-', starting with a letter or "
                          "digit")
    inputs = [config, spec.deepspeed, spec.script]
    problem = next(filter(None, map(_control_problem, [*inputs, out_dir])), None)
    if problem:
        raise problem
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(out_dir, "--out", "is a file, not a folder", "name a folder for the case file")
    # the case file checked before the import and the prediction; the folder taken back if they fail
    with Outputs(force=force, inputs=inputs) as outputs:
        folder = outputs.folder(out_dir, "--out")
        path = outputs.file(folder / f"{case_id}.yaml", "the case file")
        result = run_check(config, spec, platform=platform, predict=predict)
        if result.prediction is None:
            raise ConfigError(config, None, f"no expected outcome can be predicted: {result.config.unpredictable}",
                              "change the settings the lint names, then run case-from again")
        _refuse_read_names(result, path)
        data = case_data(result, out_dir, case_id, card_name, today)
        if depth_points:
            data = _with_depth_points(data, depth_points, result)
        try:
            case = parse_case(data, path)  # the file must load as it will be read: relative to its folder
        except CaseError as exc:
            raise ConfigError(config, None, "the case written from it is invalid: " + "; ".join(exc.problems),
                              "report it with the config attached") from None
        text = _header(result) + yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=110)
        outputs.write(path, text, root=out_dir)
    return WrittenCase(path=path, case=case, check=result)
