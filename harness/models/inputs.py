"""Reading the files users give the harness within limits, so hostile input is refused fast, by name.

Every reader of a user's file goes through here: case YAML (`harness.spec.cases`), training and
DeepSpeed configs (`harness.premerge.importers.reading`), a model's config.json
(`harness.models.source`), run and baseline JSON. The limits hold before anything is parsed:

- regular files only: a FIFO, a device (`/dev/zero`) or a directory is refused without opening it
  for a blocking read;
- a size limit per format (PyYAML reads about 100-200 KiB a second, so YAML gets the smaller one);
- YAML: nesting depth, and the node count with every alias expanded as often as it is used (an
  alias bomb is a few hundred bytes that expand to billions of nodes), and no alias that contains
  itself; counted on the composed node graph, before any object is built;
- JSON: nesting depth, and no `NaN`/`Infinity`;
- numbers finite (YAML `.nan`, `.inf`; JSON `1e999`) and integers within 64 bits, wherever they are;
- no key written twice in one mapping: YAML and JSON would keep the last and drop the first without a
  word, so a config reviewed at one value runs at another.

A problem is one `InputError` naming the file, the key where there is one, and the fix. It is the
exception every layer raises for bad input; the command line exits 2 on it (`harness.cli.main`).
"""

from __future__ import annotations

import json
import math
import os
import stat
import zlib
from pathlib import Path
from typing import Any

import yaml

MAX_YAML_BYTES = 256 * 2**10
MAX_JSON_BYTES = 8 * 2**20  # run files of a night are about 1 MiB; parsing and checking 8 MiB takes 1-3 s
MAX_DEPTH = 64
MAX_YAML_NODES = 100_000
MAX_INT = 2**63


class InputError(ValueError):
    """Input the harness refuses, with where (file, key) and what to do (fix); the CLI exits 2 on it."""

    def __init__(self, path: Path | str | None, key: str | None, problem: str, fix: str = ""):
        super().__init__(problem)
        self.path = None if path is None else Path(path)
        self.key = key
        self.problem = problem
        self.fix = fix

    def __str__(self) -> str:
        where = ": ".join(str(p) for p in (self.path, self.key) if p)
        text = f"{where}: {self.problem}" if where else self.problem
        return text + (f". Fix: {self.fix}" if self.fix else "")


def _human(nbytes: int) -> str:
    return f"{nbytes / 2**20:.0f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def read_bytes(path: Path | str, max_bytes: int) -> bytes:
    """A regular file's bytes, at most `max_bytes` of them; never blocks on a FIFO or a device."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InputError(path, None, "no such file", "check the path") from None
    except OSError as exc:
        raise InputError(path, None, f"cannot read the file ({exc.strerror})") from None
    _regular(path, st.st_mode)
    if st.st_size > max_bytes:
        raise _too_big(path, st.st_size, max_bytes)
    try:
        # O_NONBLOCK: a file swapped for a FIFO after the check above still cannot block the open.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise InputError(path, None, f"cannot read the file ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        _regular(path, os.fstat(f.fileno()).st_mode)
        raw = f.read(max_bytes + 1)  # a file that grows (or lies about its size) is still cut off
    if len(raw) > max_bytes:
        raise _too_big(path, len(raw), max_bytes)
    return raw


def read_text(path: Path | str, max_bytes: int) -> str:
    """A regular file's text (UTF-8), at most `max_bytes` long; never blocks on a FIFO or a device."""
    path = Path(path)
    raw = read_bytes(path, max_bytes)
    if b"\x00" in raw:
        raise InputError(path, None, "is a binary file, not text", "name a YAML or JSON text file")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise InputError(path, None, "is not a text file (not UTF-8)", "save it as UTF-8 text") from None


def load_gzip_json(path: Path | str, max_bytes: int, max_unpacked: int) -> Any:
    """A gzip-compressed JSON file: at most `max_bytes` on disk and `max_unpacked` once unpacked (a
    small file that unpacks to gigabytes is refused, not inflated)."""
    path = Path(path)
    raw = read_bytes(path, max_bytes)
    try:
        unpacker = zlib.decompressobj(wbits=31)  # 31: the gzip container
        text = unpacker.decompress(raw, max_unpacked + 1)
    except zlib.error as exc:
        raise InputError(path, None, f"is not a gzip file ({exc})", "name a .json.gz file the harness wrote") from None
    if len(text) > max_unpacked or unpacker.unconsumed_tail:
        raise InputError(path, None, f"unpacks to more than {_human(max_unpacked)}",
                         "name a .json.gz file the harness wrote") from None
    try:
        return parse_json(text.decode("utf-8"), path)
    except UnicodeDecodeError:
        raise InputError(path, None, "does not unpack to UTF-8 text",
                         "name a .json.gz file the harness wrote") from None


def _regular(path: Path, mode: int) -> None:
    if stat.S_ISDIR(mode):
        raise InputError(path, None, "is a directory, not a file", "name a file")
    if not stat.S_ISREG(mode):
        raise InputError(path, None, "is not a regular file (a FIFO, a device or a socket)",
                         "name a regular file; copy a stream to a file first")


def _too_big(path: Path, size: int, limit: int) -> InputError:
    return InputError(path, None, f"is {size:,} bytes, above the limit of {_human(limit)} for this kind of file",
                      "name the config itself; a file this large is not a config")


# --- YAML ---------------------------------------------------------------------------------------


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with a nesting limit while composing (its composer recurses per level)."""

    def __init__(self, stream, path: Path):
        super().__init__(stream)
        self.path = path
        self.depth = 0

    def compose_node(self, parent, index):
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH + 1:  # containers count, the scalar at the bottom does not
                raise _too_deep(self.path)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        """A mapping whose own keys are each written once (keys merged in with `<<: *alias` may be
        overridden, as YAML means them to be)."""
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node)
                if key in seen:
                    raise _duplicate(self.path, key, f"lines {seen[key] + 1} and {key_node.start_mark.line + 1}")
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _duplicate(path: Path | None, key: Any, where: str) -> InputError:
    return InputError(path, str(key), f"is written twice ({where}); only the last would count",
                      "keep one of them")


def _too_deep(path: Path | None, key: str | None = None) -> InputError:
    return InputError(path, key, f"nests deeper than {MAX_DEPTH} levels", "flatten the file; no config nests so deep")


def _node_children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_graph(root: yaml.Node, path: Path) -> None:
    """Refuse a node graph whose expansion (each alias counted every time it is used) exceeds the node
    or depth limit, or that contains itself. Iterative, each node measured once (memoized)."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            open_nodes.discard(key)
            kids = _node_children(node)
            size[key] = 1 + sum(size[id(k)] for k in kids)
            depth[key] = 0 if isinstance(node, yaml.ScalarNode) else 1 + max((depth[id(k)] for k in kids), default=0)
            if size[key] > MAX_YAML_NODES:
                raise InputError(path, None, f"expands to more than {MAX_YAML_NODES:,} values through its aliases "
                                 "(*name)", "write the values out; an alias used this often is an alias bomb")
            if depth[key] > MAX_DEPTH:
                raise _too_deep(path)
            continue
        if key in size:
            continue
        if key in open_nodes:
            raise InputError(path, None, "an alias (*name) is used inside its own anchor (&name)",
                             "remove the self-reference")
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((k, False) for k in _node_children(node) if id(k) not in size)


def parse_yaml(text: str, path: Path | str) -> Any:
    """The value of a YAML document, within the limits (module docstring)."""
    path = Path(path)
    loader = None
    try:
        loader = _BoundedLoader(text, path)  # its reader refuses control characters here
        node = loader.get_single_node()
        if node is None:
            return None
        _check_graph(node, path)
        data = loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise InputError(path, None, f"not valid YAML{where}: {getattr(exc, 'problem', None) or exc}",
                         "fix the YAML syntax") from None
    except RecursionError:
        raise _too_deep(path) from None
    finally:
        if loader is not None:
            loader.dispose()
    check_values(data, path)
    return data


def load_yaml(path: Path | str, max_bytes: int = MAX_YAML_BYTES) -> Any:
    return parse_yaml(read_text(path, max_bytes), path)


# --- JSON ---------------------------------------------------------------------------------------


class _NonFinite:
    """JSON's NaN/Infinity/-Infinity as read, so the walk can name the key holding it."""

    def __init__(self, name: str):
        self.name = name


def _unique_keys(path: Path):
    """json's object_pairs_hook: an object as a dict, refused where a key is written twice."""
    def hook(pairs: list) -> dict:
        data = dict(pairs)
        if len(data) != len(pairs):
            seen: set = set()
            key = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise _duplicate(path, key, "in one object")
        return data
    return hook


def parse_json(text: str, path: Path | str) -> Any:
    """The value of a JSON document, within the limits (module docstring)."""
    path = Path(path)
    try:
        data = json.loads(text, parse_constant=_NonFinite, object_pairs_hook=_unique_keys(path))
    except json.JSONDecodeError as exc:
        raise InputError(path, None, f"not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}",
                         "fix the JSON syntax (no comments or trailing commas in JSON)") from None
    except RecursionError:
        raise _too_deep(path) from None
    except InputError:  # a key written twice
        raise
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise InputError(path, None, f"not valid JSON: {exc}", "write numbers of ordinary size") from None
    check_values(data, path)
    return data


def load_json(path: Path | str, max_bytes: int = MAX_JSON_BYTES) -> Any:
    return parse_json(read_text(path, max_bytes), path)


def load_data(path: Path | str) -> Any:
    """A YAML or JSON file (by its extension: `.json` is JSON, anything else YAML)."""
    return load_json(path) if Path(path).suffix.lower() == ".json" else load_yaml(path)


# --- Values -------------------------------------------------------------------------------------


def _key(chain: tuple | None) -> str | None:
    """The key path ('zero_optimization.stage', 'claims[2].low') of a chain (parent chain, part)."""
    parts = []
    while chain is not None:
        chain, part = chain
        parts.append(part)
    text = ""
    for part in reversed(parts):
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or None


def _bad_scalar(value: Any) -> str | None:
    """What is wrong with a scalar, or None: not finite, or an integer beyond 64 bits."""
    kind = type(value)
    if kind is float:
        return None if math.isfinite(value) else f"{value!r} is not a finite number"
    if kind is int:
        return None if -MAX_INT <= value < MAX_INT else f"{value} is out of range (beyond 64 bits)"
    if kind is _NonFinite:
        return f"{value.name} is not a finite number"
    return None


def _refuse(path: Path | str | None, chain: tuple | None, problem: str) -> InputError:
    fix = ("write a finite number (NaN and infinity are not settings)" if "finite" in problem
           else "write a number of sensible size")
    return InputError(None if path is None else Path(path), _key(chain), problem, fix)


def _plain_numbers(items: list) -> bool:
    """Every item an int within 64 bits, or every item a finite float (or text, booleans, nulls): nothing
    in the list to refuse or to walk into. False sends the list through the item by item walk, which
    names the bad item."""
    kinds = set(map(type, items))
    if kinds == {int}:
        return -MAX_INT <= min(items) and max(items) < MAX_INT
    if kinds == {float}:
        return all(map(math.isfinite, items))
    return kinds <= {str, bool, type(None)}


def check_values(data: Any, path: Path | str | None = None) -> None:
    """Refuse nesting past the depth limit, numbers that are not finite, and integers beyond 64 bits,
    naming the key that holds them. Iterative (a deep value cannot exhaust the stack), one pass with
    the key path built only for the error."""
    problem = _bad_scalar(data)
    if problem:
        raise _refuse(path, None, problem)
    if not isinstance(data, (dict, list)):
        return
    stack: list[tuple[Any, tuple | None, int]] = [(data, None, 1)]
    while stack:
        value, chain, level = stack.pop()
        if level > MAX_DEPTH:
            raise _too_deep(None if path is None else Path(path), _key(chain))
        if type(value) is list and _plain_numbers(value):
            continue  # a timeline's column of half a million numbers: checked whole, in C
        for part, item in value.items() if type(value) is dict else enumerate(value):
            kind = type(item)
            if kind is dict or kind is list:
                stack.append((item, (chain, part), level + 1))
            elif kind is float or kind is int or kind is _NonFinite:
                problem = _bad_scalar(item)
                if problem:
                    raise _refuse(path, (chain, part), problem)
