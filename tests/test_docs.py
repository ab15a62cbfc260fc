"""The user documentation stays true: the case-format page is the schema's, links resolve, the README
stays short, and product text tells of the software and its measurements only."""

from __future__ import annotations

import enum
import re
from pathlib import Path
from typing import Annotated, Literal

import pytest
import yaml
from pydantic import BaseModel, Field, field_validator

from harness.premerge import case_format_doc
from harness.spec.schema import Case
from harness.spec.units import parse_size

ROOT = Path(__file__).resolve().parent.parent
CASE_FORMAT = ROOT / "docs" / "case-format.md"
USER_DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "results" / "README.md",
             *sorted((ROOT / "docs").glob("*.md"))]
# Accounts of how the project was built, which product text must not give.
MAKING_OF = re.compile(r"(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth) session"
                       r"|session of 20[0-9]{2}|lent (h100|h200|host|machine|gpu)|device[ ]time|hosts?[ ]lent",
                       re.IGNORECASE)


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
    code: str = Field(json_schema_extra={"pattern": "^[A-Z]+$", "maxLength": 8}, description="checked elsewhere")


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
    assert "| `code` | string | required | at most 8 characters, matches `^[A-Z]+$` | checked elsewhere |" in page


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _headings(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {case_format_doc._anchor(m.strip()) for m in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    broken = []
    for target in _LINK.findall(re.sub(r"```.*?```", "", doc.read_text(encoding="utf-8"), flags=re.S)):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file_part, _, anchor = target.partition("#")
        path = (doc.parent / file_part).resolve() if file_part else doc
        if not path.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in _headings(path):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{doc.relative_to(ROOT)}: " + ", ".join(broken)


def test_readme_stays_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 200, f"README.md has {lines} lines; move detail to docs/"


def _product_text() -> list[Path]:
    files = [*USER_DOCS, *sorted((ROOT / "ci").glob("*.yml"))]
    for folder in ("harness", "cases", "configs", "benchmarks"):
        files += [p for p in sorted((ROOT / folder).rglob("*")) if p.suffix in (".py", ".yaml", ".yml", ".md")]
    return [p for p in files if p.exists()]


def test_product_text_tells_of_the_software_not_of_how_it_was_made():
    hits = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in _product_text()
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if MAKING_OF.search(line)]
    assert not hits, "\n".join(hits)
