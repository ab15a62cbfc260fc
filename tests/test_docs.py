"""The user documentation stays true: the case-format page is the schema's."""

from __future__ import annotations

import enum
import re
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, Field, field_validator

from harness.spec import case_format_doc
from harness.spec.schema import Case
from harness.spec.units import parse_size

ROOT = Path(__file__).resolve().parent.parent
CASE_FORMAT = ROOT / "docs" / "case-format.md"


def test_case_format_page_is_generated_from_the_schema():
    expected = case_format_doc.render()
    committed = CASE_FORMAT.read_text(encoding="utf-8") if CASE_FORMAT.exists() else ""
    assert committed == expected, (
        f"docs/case-format.md differs from the schema; regenerate it: {case_format_doc.REGENERATE}")


def test_every_schema_field_has_a_row():
    page = case_format_doc.render()
    seen, todo = set(), [Case]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, fld in model.model_fields.items():
            assert f"| `{name}` |" in page, f"{model.__name__}.{name} is missing from the case-format page"
            todo += [t for t in _models_in(fld.annotation) if t not in seen]


def _models_in(annotation) -> list[type[BaseModel]]:
    import typing

    found = []
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        found.append(annotation)
    for arg in typing.get_args(annotation):
        found += _models_in(arg)
    return found


def test_the_example_case_on_the_page_is_valid():
    page = case_format_doc.render()
    example = re.search(r"```yaml\n(.*?)```", page, re.S).group(1)
    case = Case.model_validate(yaml.safe_load(example))
    assert case.expect.outcome == "fits"


class _Colour(str, enum.Enum):
    red = "red"  # the warm one
    blue = "blue"  # the cold one


class _Inner(BaseModel):
    """An inner block."""

    size: int = Field(description="how big")

    @field_validator("size", mode="before")
    @classmethod
    def _size(cls, value):
        return parse_size(value)


class _A(BaseModel):
    """Kind a."""

    kind: Literal["a"]
    weight: float = Field(default=1.5, gt=0, le=2, description="the weight")


class _B(BaseModel):
    kind: Literal["b"]
    name: str = Field(pattern=r"^[a-z]+$")


class _Root(BaseModel):
    colour: _Colour = _Colour.red
    inner: _Inner
    items: list[Annotated[_A | _B, Field(discriminator="kind", description="the items")]] = Field(
        default_factory=list)
    later: int | None = Field(default=None, ge=3, description="a field added later")


def test_a_schema_of_another_shape_renders_every_part():
    """Fields, models, enums and claim-like unions added to the schema appear without a change here."""
    page = case_format_doc.render(_Root)
    assert "## `inner`" in page and "An inner block." in page
    assert "| `size` | size with a unit" in page
    assert "| `colour` | one of `red`, `blue` | `red` |" in page and "red: the warm one; blue: the cold one" in page
    assert "| `items` | list of [items](#items) | `[]` |  | the items |" in page
    assert "### kind: a" in page and "### kind: b" in page
    assert "| `weight` | number | `1.5` | > 0, <= 2 | the weight |" in page
    assert "| `name` | string | required | matches `^[a-z]+$` |" in page
    assert "| `later` | integer | none | >= 3 | a field added later |" in page
