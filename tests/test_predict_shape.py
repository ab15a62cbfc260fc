"""The predictor stays a pipeline a newcomer can read: `predict()` a few named stages, no function of
harness/predict/ longer than a screenful and a half, and every import inside a function saying why it is
there (a heavy or optional library, or a cycle it avoids)."""

from __future__ import annotations

import ast
from pathlib import Path

import harness.predict
from harness.predict import predictor

PREDICT = Path(harness.predict.__file__).parent
# harness/predict/margin.py's one in-function import (of `step`) moves to its top with that module's next change
IMPORTS_LEFT = {"margin.py"}
MAX_FUNCTION_LINES = 120
MAX_PREDICT_LINES = 80


def _functions():
    for path in sorted(PREDICT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path, node


def test_predict_is_a_few_named_stages():
    tree = ast.parse(Path(predictor.__file__).read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "predict"]
    assert node.end_lineno - node.lineno + 1 < MAX_PREDICT_LINES


def test_no_function_of_the_predictor_is_longer_than_it_can_be_read():
    long = [f"{p.relative_to(PREDICT)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for p, n in _functions() if n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long


def test_an_import_inside_a_function_says_why():
    """An import at the top of a module unless it is heavy, optional or would close a cycle, and then a
    comment on its line or the line above says so (one comment heads a run of imports)."""
    bare = []
    for path, fn in _functions():
        if str(path.relative_to(PREDICT)) in IMPORTS_LEFT:
            continue
        lines = path.read_text().splitlines()
        for node in ast.walk(fn):
            for body in (getattr(node, f, None) for f in ("body", "orelse", "finalbody", "handlers")):
                if not isinstance(body, list):
                    continue
                previous = None
                for stmt in body:
                    is_import = isinstance(stmt, (ast.Import, ast.ImportFrom))
                    if is_import and not isinstance(previous, (ast.Import, ast.ImportFrom)):
                        own, above = lines[stmt.lineno - 1], lines[stmt.lineno - 2]
                        if "#" not in own and not above.lstrip().startswith("#"):
                            bare.append(f"{path.relative_to(PREDICT)}:{stmt.lineno} {own.strip()}")
                    previous = stmt
    assert not bare, "move these to the module's top, or say on the line above why they are inside the function"
