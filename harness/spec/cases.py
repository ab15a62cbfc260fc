"""Loading case files, with errors a user can act on.

A case's model folder (a Hugging Face config.json) is found relative to the case file's folder.

A malformed case file never stops the other cases: `load_cases` returns the good ones and a
`CaseError` for each bad one, naming the file, the field, what was wrong and what is allowed.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ValidationError

from harness.models.inputs import InputError, load_yaml
from harness.spec.schema import Case
from harness.spec.suite import CASES_DIR  # the bundled suite's cases, the default folder
from harness.spec.units import WRITTEN


@dataclass(frozen=True)
class CaseError(InputError):
    """A case file that is not a case: one problem per line, each naming its field (bad input: exit 2)."""

    path: Path
    problems: tuple[str, ...]
    key: typing.ClassVar[None] = None  # each problem names its own field
    fix: typing.ClassVar[str] = ""  # each problem says what is allowed

    @property
    def problem(self) -> str:
        return "; ".join(self.problems)

    def __str__(self) -> str:
        lines = [f"{self.path}: invalid case file"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


def _allowed_values(model: type[BaseModel], loc: tuple) -> str | None:
    """Describe the keys or values allowed at a location of the schema, for the error message."""
    current: typing.Any = model
    parent_fields = None
    for part in loc:
        if isinstance(part, int):
            continue
        fields = getattr(current, "model_fields", None)
        if fields is None:
            return None
        if part not in fields:
            return "allowed keys here: " + ", ".join(sorted(fields))
        parent_fields = fields
        current = _unwrap(fields[part].annotation)
    if parent_fields is None:
        return None
    literal = _literal_values(current)
    return f"allowed: {', '.join(map(str, literal))}" if literal else None


def _unwrap(annotation):
    """Strip Optional/list/Annotated down to the model or type inside."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (list, tuple):
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) == 1:
            return models[0]
        if len(args) == 1:
            return _unwrap(args[0])
    return annotation


def _literal_values(annotation) -> list | None:
    import enum

    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [m.value for m in annotation]
    if typing.get_origin(annotation) in (typing.Union,):
        for arg in typing.get_args(annotation):
            values = _literal_values(arg)
            if values:
                return values
    return None


def _describe(error: dict) -> str:
    loc = tuple(error["loc"])
    # pydantic puts the discriminator tag into the location of a claim; drop it for readability.
    field = ".".join(str(p) for p in loc) or "(top level)"
    msg = error["msg"]
    if error["type"] == "extra_forbidden":
        msg = f"unknown key '{loc[-1]}'"
        hint = _allowed_values(Case, loc)
    elif error["type"] in ("literal_error", "enum"):
        hint = None  # pydantic already lists the allowed values
    else:
        hint = _allowed_values(Case, loc) if error["type"] == "missing" else None
    given = error.get("input")
    given_text = ""
    if error["type"] not in ("missing", "extra_forbidden") and not isinstance(given, dict):
        given_text = f" (got {given!r})"
    return f"{field}: {msg}{given_text}" + (f"; {hint}" if hint else "")


def parse_case(data: object, path: Path) -> Case:
    if not isinstance(data, dict):
        raise CaseError(path, (f"the file must hold a mapping of case fields, not {type(data).__name__}",))
    try:
        return Case.model_validate(data, context={"base_dir": path.parent, WRITTEN: True})
    except ValidationError as exc:
        raise CaseError(path, tuple(_describe(e) for e in exc.errors())) from None


def load_case(path: Path | str) -> Case:
    path = Path(path)
    try:
        data = load_yaml(path)
    except InputError as exc:
        where = f"{exc.key}: " if exc.key else ""
        raise CaseError(path, (where + exc.problem + (f"; {exc.fix}" if exc.fix else ""),)) from None
    case = parse_case(data, path)
    if case.id != path.stem:
        raise CaseError(path, (f"id: '{case.id}' must equal the file name without '.yaml' ('{path.stem}')",))
    return case


def case_files(directory: Path = CASES_DIR) -> list[Path]:
    return sorted(p for p in directory.glob("*.yaml"))


def load_cases(directory: Path = CASES_DIR) -> tuple[list[Case], list[CaseError]]:
    """Every case in a folder: the valid ones, and one error per invalid file."""
    cases: list[Case] = []
    errors: list[CaseError] = []
    for path in case_files(directory):
        try:
            cases.append(load_case(path))
        except CaseError as exc:
            errors.append(exc)
    ids = [c.id for c in cases]
    known = set(ids)
    for case in cases:
        for claim in case.claims:
            ref = getattr(claim, "case", None)
            if ref is not None and ref not in known:
                errors.append(
                    CaseError(
                        directory / f"{case.id}.yaml",
                        (f"claims: lower_peak_than names case '{ref}', which does not exist",),
                    )
                )
    return cases, errors
