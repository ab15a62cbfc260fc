"""Writes the case-format reference from the schema itself, so the documentation cannot drift from
what `harness.spec.cases` accepts.

    python -m harness.premerge.case_format_doc > docs/case-format.md

Every pydantic model reachable from `Case` becomes a section, named by its path in a case file
(`target.card`); every field a row: its type, whether it is required or its default, its allowed
values or range (from the field's constraints), and its description. A discriminated union (the
claims) becomes one section per kind. Fields, models and claim kinds added to the schema appear
here without a change to this module; `tests/test_docs.py` fails when docs/case-format.md is stale.
The page ends with the memory-relevant keys of the configs `oom-harness check` reads (LLaMA-Factory
YAML, TrainingArguments JSON, DeepSpeed JSON): how each is modelled, or that it is read and named as
not modelled, from the importers' own tables (harness.premerge.importers.keys).
Imports pydantic, the schema and those tables only (no torch).
"""

from __future__ import annotations

import enum
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass, field

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from harness.spec import schema

REGENERATE = "python -m harness.premerge.case_format_doc > docs/case-format.md"

INTRO = """\
# Case format

<!-- Generated from harness/spec/schema.py by `{regenerate}`: edit the schema, then regenerate. -->

A case is one YAML file: a training configuration, the card it must fit, what is expected of it,
and the claims made about it. One parametrized test runs every case file in a folder (the bundled
suite in `cases/`, or yours with `--case-dir DIR`) at the fidelity the command line asks for: at
tiny size on a CPU, or at full size on GPUs.

Case files are checked strictly: an unknown key, a wrong type or a value out of range fails that
case with the file, the field and the allowed values, and the other cases still run. Rules that
join several fields (a `qlora` method needs a `quantization` block, several ranks need a
`deepspeed` block, a claim about offload needs optimizer offload, ...) are checked the same way.
Check files without running them:

```bash
oom-harness validate cases/my-case.yaml
```

Sizes are written with a unit: `64 GB` (10^9 bytes), `23.52 GiB` (2^30 bytes), `512 MiB`. Units are
case-sensitive (`16Gb` is gigabits, and refused), and a bare number is refused (`memory: 12` would be
12 bytes): write `12GiB` or `12GB`.

A minimal case:

```yaml
id: 003-qlora-fix-r16-seq512-gc
guide: "003"
family: 003-qwen7b-qlora
title: "Qwen1.5-7B-Chat QLoRA nf4 on a 16 GB card, r16, 512 tokens"
role: fix
model: qwen1.5-7b-chat
stack: peft
method:
  kind: qlora
  quantization: {{bits: 4, quant_type: nf4}}
  lora: {{r: 16, alpha: 32, targets: [q_proj, k_proj, v_proj, o_proj]}}
train: {{micro_batch: 1, grad_accum: 32, seq_len: 512, gradient_checkpointing: true}}
target:
  card: {{vendor: nvidia, name: "16 GB card", memory: 15.77 GiB}}
  headroom: 0.9
expect:
  outcome: fits
claims:
  - kind: memory_range
    metric: device_peak
    low: 8 GiB
    high: 10 GiB
    quote: "显存占用预估\uff1a~8-10GB"
```

The rest of this page lists every field. "Required" fields have no default; an optional field left
out takes the default shown ("none" means unset: the harness or the stack decides).
"""

_SIZE = "size with a unit (`64 GB`, `23.52 GiB`)"
_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean"}


@dataclass
class _Section:
    """One model of the schema, at the first path a case file reaches it by."""

    path: str
    model: type[BaseModel]


@dataclass
class _Union:
    """A discriminated union of models (the claims): one section per member, keyed by the discriminator."""

    path: str
    discriminator: str
    members: list[type[BaseModel]]


@dataclass
class _Walk:
    sections: list[_Section] = field(default_factory=list)
    unions: list[_Union] = field(default_factory=list)
    seen: set = field(default_factory=set)


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", title.lower())
    return text.replace(" ", "-")


def _section_title(path: str) -> str:
    return f"`{path}`"


def _union_title(path: str) -> str:
    return path.rsplit(".", 1)[-1].replace("_", " ").capitalize()


def _kind_title(union: _Union, member: type[BaseModel]) -> str:
    return f"{union.discriminator}: {_discriminator_value(member, union.discriminator)}"


def _strip(annotation):
    """(annotation without Annotated wrappers, the FieldInfo metadata they carried)."""
    infos = []
    while typing.get_origin(annotation) is typing.Annotated:
        annotation, *extra = typing.get_args(annotation)
        infos += extra
    return annotation, infos


def _union_args(annotation) -> list | None:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return list(typing.get_args(annotation))
    return None


def _is_model(t) -> bool:
    return inspect.isclass(t) and issubclass(t, BaseModel)


def _discriminator(infos: list, fld: FieldInfo | None) -> str | None:
    for info in infos:
        if isinstance(info, FieldInfo) and isinstance(info.discriminator, str):
            return info.discriminator
    if fld is not None and isinstance(fld.discriminator, str):
        return fld.discriminator
    return None


def _discriminator_value(model: type[BaseModel], key: str) -> str:
    values = typing.get_args(model.model_fields[key].annotation)
    return ", ".join(str(v) for v in values)


def _walk(model: type[BaseModel], path: str, walk: _Walk) -> None:
    if model in walk.seen:
        return
    walk.seen.add(model)
    walk.sections.append(_Section(path, model))
    for name, fld in model.model_fields.items():
        _visit(fld.annotation, f"{path}.{name}" if path else name, fld, walk)


def _visit(annotation, path: str, fld: FieldInfo | None, walk: _Walk) -> None:
    annotation, infos = _strip(annotation)
    args = _union_args(annotation)
    if args is not None:
        members = [a for a in args if a is not type(None)]
        key = _discriminator(infos, fld)
        if key and all(_is_model(m) for m in members):
            if not any(u.path == path for u in walk.unions):
                walk.unions.append(_Union(path, key, members))
            return
        for member in members:
            _visit(member, path, None, walk)
        return
    if typing.get_origin(annotation) in (list, dict, tuple, set, frozenset):
        for arg in typing.get_args(annotation):
            _visit(arg, path, None, walk)
        return
    if _is_model(annotation):
        _walk(annotation, path, walk)


def _literal_text(values) -> str:
    return "one of " + ", ".join(f"`{_value_text(v)}`" for v in values) if len(values) > 1 \
        else f"`{_value_text(values[0])}`"


def _value_text(value) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    return repr(value)


class _Types:
    """Type names of annotations, with links to the sections of models and unions."""

    def __init__(self, walk: _Walk):
        self.model_paths = {s.model: s.path for s in walk.sections}
        self.union_paths = {tuple(u.members): u.path for u in walk.unions}

    def text(self, annotation, infos=()) -> str:
        annotation, more = _strip(annotation)
        infos = [*infos, *more]
        args = _union_args(annotation)
        if args is not None:
            members = [a for a in args if a is not type(None)]
            path = self.union_paths.get(tuple(members))
            if path is not None:
                return f"[{_union_title(path).lower()}](#{_anchor(_union_title(path))})"
            return ", or ".join(self.text(m) for m in members)
        origin = typing.get_origin(annotation)
        if origin is typing.Literal:
            return _literal_text(typing.get_args(annotation))
        if origin in (list, tuple, set, frozenset):
            inner = typing.get_args(annotation)
            return "list of " + (self.text(inner[0]) if inner else "values")
        if origin is dict:
            key, value = typing.get_args(annotation)
            return f"mapping of {self.text(key)} to {self.text(value)}"
        if inspect.isclass(annotation) and issubclass(annotation, enum.Enum):
            return _literal_text(list(annotation))
        if _is_model(annotation):
            path = self.model_paths.get(annotation, annotation.__name__)
            return f"mapping: [{_section_title(path)}](#{_anchor(_section_title(path))})"
        if annotation in _SCALARS:
            return _SCALARS[annotation]
        return re.sub(r"\b[\w.]+\.(\w+)", r"\1", str(annotation)).replace("typing.", "")


def _size_fields(model: type[BaseModel]) -> set[str]:
    """Fields a `before` validator passes through `parse_size`: written with a unit, stored in bytes."""
    found = set()
    for dec in model.__pydantic_decorators__.field_validators.values():
        func = getattr(dec.func, "__func__", dec.func)
        code = getattr(func, "__code__", None)
        if dec.info.mode == "before" and code is not None and {"parse_size", "parse_size_field"} & set(code.co_names):
            found.update(dec.info.fields)
    return found


def _constraints(fld: FieldInfo) -> str:
    parts = []
    for meta in fld.metadata:
        if isinstance(meta, annotated_types.Gt):
            parts.append(f"> {meta.gt}")
        elif isinstance(meta, annotated_types.Ge):
            parts.append(f">= {meta.ge}")
        elif isinstance(meta, annotated_types.Lt):
            parts.append(f"< {meta.lt}")
        elif isinstance(meta, annotated_types.Le):
            parts.append(f"<= {meta.le}")
        elif isinstance(meta, annotated_types.MinLen):
            parts.append(f"at least {meta.min_length} " + ("items" if _is_listy(fld) else "characters"))
        elif isinstance(meta, annotated_types.MaxLen):
            parts.append(f"at most {meta.max_length} " + ("items" if _is_listy(fld) else "characters"))
        elif getattr(meta, "pattern", None):
            parts.append(f"matches `{meta.pattern}`")
    extra = fld.json_schema_extra if isinstance(fld.json_schema_extra, dict) else {}
    unit = "items" if _is_listy(fld) else "characters"
    for key, text in (("exclusiveMinimum", "> {}"), ("minimum", ">= {}"), ("exclusiveMaximum", "< {}"),
                      ("maximum", "<= {}"), ("minLength", "at least {} " + unit),
                      ("maxLength", "at most {} " + unit), ("minItems", "at least {} items"),
                      ("maxItems", "at most {} items"), ("pattern", "matches `{}`")):
        if key in extra:  # constraints a field states for its JSON schema only (checked by a validator)
            parts.append(text.format(extra[key]))
    return ", ".join(parts)


def _is_listy(fld: FieldInfo) -> bool:
    annotation, _ = _strip(fld.annotation)
    args = _union_args(annotation) or [annotation]
    return any(typing.get_origin(a) in (list, tuple, set, frozenset) for a in args)


def _default(fld: FieldInfo) -> str:
    if fld.is_required():
        return "required"
    if fld.default_factory is not None:
        value = fld.default_factory()
        if isinstance(value, BaseModel):
            return "its defaults"
        return "`[]`" if isinstance(value, list) else "`{}`" if isinstance(value, dict) else f"`{value!r}`"
    if fld.default is None:
        return "none"
    return f"`{_value_text(fld.default)}`"


def _doc(obj) -> str:
    """The object's own docstring (not one inherited), as one paragraph."""
    text = obj.__dict__.get("__doc__") if inspect.isclass(obj) else None
    return " ".join(inspect.cleandoc(text).split()) if text else ""


def _first_sentence(text: str) -> str:
    match = re.match(r"(.+?[.:])(\s|$)", text)
    return match.group(1).rstrip(":.") if match else text


def _enum_comments(cls: type[enum.Enum]) -> dict[str, str]:
    """The comment after each member of an enum's source (`failing = "failing"  # what it means`)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    comments, line_name = {}, {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and tok.start[1] == 4 and tok.string in cls.__members__:
            line_name[tok.start[0]] = tok.string
        elif tok.type == tokenize.COMMENT and tok.start[0] in line_name:
            comments[line_name[tok.start[0]]] = tok.string.lstrip("#").strip()
    return comments


def _enum_text(cls: type[enum.Enum]) -> str:
    """An enum's docstring, else its members' comments ("failing: ...; fix: ...")."""
    if _doc(cls):
        return _doc(cls)
    comments = _enum_comments(cls)
    return "; ".join(f"{cls[name].value}: {text}" for name, text in comments.items())


def _item_description(annotation) -> str:
    """A description carried by the annotation itself (`Annotated[..., Field(description=...)]`), also
    inside a list: the claims' union carries its own."""
    annotation, infos = _strip(annotation)
    for info in infos:
        if isinstance(info, FieldInfo) and info.description:
            return info.description
    for arg in typing.get_args(annotation) if typing.get_origin(annotation) in (list, tuple) else ():
        found = _item_description(arg)
        if found:
            return found
    return ""


def _description(fld: FieldInfo) -> str:
    annotation, _ = _strip(fld.annotation)
    members = [a for a in (_union_args(annotation) or [annotation]) if a is not type(None)]
    text = fld.description or _item_description(fld.annotation)
    if not text:
        text = next((_first_sentence(_doc(m)) for m in members if _is_model(m) and _doc(m)), "")
    for member in members:
        if inspect.isclass(member) and issubclass(member, enum.Enum) and _enum_text(member):
            text = f"{text} {_enum_text(member)}".strip()
    return " ".join(text.split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(model: type[BaseModel], types_: _Types, skip: set[str] = frozenset()) -> list[str]:
    sizes = _size_fields(model)
    rows = ["| field | type | required / default | allowed | description |", "|---|---|---|---|---|"]
    for name, fld in model.model_fields.items():
        if name in skip:
            continue
        kind = _SIZE if name in sizes else types_.text(fld.annotation)
        rows.append("| " + " | ".join(_cell(c) for c in (
            f"`{name}`", kind, _default(fld), _constraints(fld), _description(fld))) + " |")
    return rows


def _tiny_note(kind: str) -> str:
    tiny = getattr(schema, "TINY_CLAIMS", None)
    if tiny is None:
        return ""
    return "tiny and full size" if kind in tiny else "full size only"


def _render_union(union: _Union, types_: _Types) -> list[str]:
    title = _union_title(union.path)
    key = union.discriminator
    common = set.intersection(*(set(m.model_fields) for m in union.members)) - {key}
    base = union.members[0]
    lines = [f"## {title}", "",
             f"Each entry of `{union.path}` is a mapping whose `{key}` says what it is and how it is "
             "checked. Where a claim is checked: at tiny size on a CPU, or only at full size on GPUs "
             "(a figure in GiB means nothing for a shrunken model).", ""]
    if common:
        lines += [f"Fields every {title.lower().rstrip('s')} has:", ""]
        lines += _table(base, types_, skip=set(base.model_fields) - common)
        lines.append("")
    lines += [f"| {key} | checked at | what it says |", "|---|---|---|"]
    for member in union.members:
        value = _discriminator_value(member, key)
        anchor = _anchor(_kind_title(union, member))
        lines.append(f"| [`{value}`](#{anchor}) | {_tiny_note(value)} | {_cell(_doc(member))} |")
    lines.append("")
    for member in union.members:
        lines += [f"### {_kind_title(union, member)}", ""]
        if _doc(member):
            lines += [_doc(member), ""]
        own = set(member.model_fields) - common - {key}
        if own:
            lines += _table(member, types_, skip=set(member.model_fields) - own)
        else:
            lines.append(f"No fields beyond `{key}` and the common ones.")
        lines.append("")
    return lines


def render(root: type[BaseModel] = schema.Case) -> str:
    """The whole page for case files whose top level is `root`."""
    walk = _Walk()
    _walk(root, "", walk)
    types_ = _Types(walk)
    lines = [INTRO.format(regenerate=REGENERATE)]
    toc = ["Sections: [top level](#top-level)"]
    toc += [f"[{_section_title(s.path)}](#{_anchor(_section_title(s.path))})" for s in walk.sections[1:]]
    toc += [f"[{_union_title(u.path).lower()}](#{_anchor(_union_title(u.path))})" for u in walk.unions]
    lines += [", ".join(toc) + ".", ""]
    for section in walk.sections:
        title = "Top level" if not section.path else _section_title(section.path)
        lines += [f"## {title}", ""]
        if _doc(section.model):
            lines += [_doc(section.model), ""]
        lines += _table(section.model, types_)
        lines.append("")
    for union in walk.unions:
        lines += _render_union(union, types_)
    lines += render_config_keys()
    return "\n".join(lines).rstrip() + "\n"


_EFFECT = {True: "can raise the peak: UNDECIDED", False: "can only lower it: FITS holds, DOES NOT FIT is UNDECIDED",
           None: "depends on the value (below)"}


def render_config_keys() -> list[str]:
    """The section on the keys of users' configs that change memory: modelled, or named as not modelled."""
    from harness.models.source import SUPPORTED
    from harness.premerge.importers import keys

    prose = ["`oom-harness check` and `case-from` read LLaMA-Factory YAML, TrainingArguments JSON and DeepSpeed "
             "JSON into a case. Every key that changes memory is either modelled (first table: the case field it "
             "sets) or read and named as not modelled: `check` lists it under \"read, not modelled\" (and in "
             "`--json` as `not_modelled`). One that can raise the peak leaves the verdict UNDECIDED (exit 1), as "
             "an unsized part of the job does; one that can only lower it keeps FITS and makes DOES NOT FIT "
             "UNDECIDED. A key not in any list of known keys is an error naming the closest known one; known keys "
             "not listed here do not change memory.",
             "Values are read as the framework reads them: the HF Trainer's dataclasses keep a boolean written as "
             "text and test it for truth (`gradient_checkpointing: \"false\"` is on; the lint "
             "`boolean-written-as-text` says so), DeepSpeed's pydantic blocks read `\"false\"` as false, and text "
             "that is no boolean is refused. A key written twice in one mapping is refused in every file.",
             f"A model folder (`model_name_or_path` naming a folder with a config.json) holds one of these: "
             f"{SUPPORTED}. Another model type, an encoder-only or encoder-decoder model (BERT, T5), a "
             "vision-language model whose language model transformers does not build alone (Qwen2-VL), and "
             "shapes that do not divide (the hidden size by the heads, the heads by the key/value heads) are "
             "refused, naming what is supported. LoRA targets are checked against the model's modules."]
    lines = ["## Keys of the configs `check` reads", ""]
    for paragraph in prose:
        lines += [*textwrap.wrap(paragraph, 104), ""]
    lines += ["### Modelled", "", "| format | key | modelled as |", "|---|---|---|"]
    for fmt, table in keys.MODELLED_KEYS.items():
        lines += [f"| {fmt} | `{key}` | {_cell(how)} |" for key, how in table.items()]
    lines += ["", "### Read, not modelled", "", "| format | key | counts when | effect | what it does |",
              "|---|---|---|---|---|"]
    tables = {"LLaMA-Factory YAML": keys.LLAMAFACTORY_NOT_MODELLED,
              "TrainingArguments (both training formats)": keys.HF_NOT_MODELLED,
              "TrainingArguments JSON: script fields": keys.SCRIPT_NOT_MODELLED,
              "DeepSpeed JSON": keys.DEEPSPEED_NOT_MODELLED}
    for fmt, table in tables.items():
        lines += [f"| {fmt} | `{key}` | {_cell(u.when)} | {_EFFECT[u.raises]} | {_cell(u.why)} |"
                  for key, u in table.items()]
    return [*lines, ""]


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
