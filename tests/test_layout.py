"""The package's layout holds: subpackages import only those below them, and no module imports itself
back through others (an import cycle), lazy imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import harness

# The order data flows in (DESIGN "Layout"): a subpackage may import those before it, never after.
LAYERS = ("models", "spec", "measure", "runtime", "baselines", "judge", "predict", "premerge", "fit", "report",
          "pytest_plugin", "cli")
ROOT = Path(harness.__file__).parent


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every harness module `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("harness"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("harness"))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    return {m: {i for i in _imports(p) if i in modules and i != m} for m, p in modules.items()}


def _layer(module: str) -> str:
    return module.split(".")[1]


def test_every_subpackage_is_in_the_layer_order():
    subpackages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert subpackages == set(LAYERS)
    assert not [p.name for p in ROOT.glob("*.py") if p.name != "__init__.py"], "modules belong in a subpackage"


def test_subpackages_import_only_the_layers_below():
    upward = [f"{m} imports {i}" for m, deps in _graph().items() for i in deps
              if LAYERS.index(_layer(i)) > LAYERS.index(_layer(m))]
    assert not upward


def test_no_import_cycles():
    graph = _graph()
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                cycles.append(" -> ".join([*stack[stack.index(d):], d]))
            elif d not in state:
                visit(d, [*stack, d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles
