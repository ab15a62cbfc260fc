"""The predictor's numbers have one home: `harness.predict.constants`, each with its provenance.

A module of harness/predict/ that binds a number at module level, or binds again a name the constants
module defines, grows a second home for a figure; these tests name the module and the line."""

from __future__ import annotations

import ast
from pathlib import Path

import harness.predict
from harness.predict import constants

PREDICT = Path(harness.predict.__file__).parent
CONSTANTS = Path(constants.__file__)

# Module-level numbers that label things rather than size them (a pass, a stream, a layer position)
LABELS = {"LAYER_PRE", "LAYER_POST", "FORWARD", "BACKWARD", "DEFAULT_STREAM", "REDUCTION_STREAM"}
# The margin's own settings live with the margin (harness.predict.margin): how the error table is read, not a
# figure of the prediction
MARGIN_SETTINGS = {"MARGIN_FLOOR", "MIN_CASES", "PRIOR_MARGIN"}


def _numeric(node: ast.expr) -> bool:
    """A literal number, an arithmetic of literal numbers, or a tuple / dict of them."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return _numeric(node.operand)
    if isinstance(node, ast.BinOp):
        return _numeric(node.left) and _numeric(node.right)
    if isinstance(node, ast.Tuple):
        return bool(node.elts) and all(_numeric(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return bool(node.values) and all(_numeric(v) for v in node.values)
    return False


def _bindings(path: Path):
    """(name, line, numeric) for every name a module binds at its top level."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            names = target.elts if isinstance(target, ast.Tuple) else [target]
            for name in names:
                if isinstance(name, ast.Name):
                    yield name.id, node.lineno, _numeric(value)


def _modules():
    # reference/: other tools' estimators, copied with their own figures to compare against (not the predictor's)
    return [p for p in sorted(PREDICT.rglob("*.py"))
            if p != CONSTANTS and "reference" not in p.relative_to(PREDICT).parts]


def test_no_module_of_the_predictor_binds_a_number_outside_the_constants():
    stray = [f"{p.relative_to(PREDICT.parent.parent)}:{line}: {name}" for p in _modules()
             for name, line, numeric in _bindings(p) if numeric and name not in LABELS | MARGIN_SETTINGS]
    assert not stray, "move these to harness/predict/constants.py, with where each comes from"


def test_no_constant_is_defined_twice():
    defined = {name for name, _, _ in _bindings(CONSTANTS)}
    names = [name for name, _, _ in _bindings(CONSTANTS)]
    assert len(names) == len(set(names)), "a name bound twice in constants.py"
    again = [f"{p.relative_to(PREDICT.parent.parent)}:{line}: {name}" for p in _modules()
             for name, line, _ in _bindings(p) if name in defined]
    assert not again, "import these from harness.predict.constants instead of binding them again"


def test_every_constant_says_where_it_comes_from():
    """Each constant has a comment on its line or in the block of comment lines right above it."""
    lines = CONSTANTS.read_text().splitlines()
    bare = []
    for name, line, numeric in _bindings(CONSTANTS):
        if not numeric or name in ("KiB", "MiB", "GiB"):
            continue
        own = "#" in lines[line - 1]
        above = line >= 2 and lines[line - 2].lstrip().startswith("#")
        if not (own or above):
            bare.append(f"{name} (line {line})")
    assert not bare


def test_the_scan_sees_a_stray_number(tmp_path):
    """The scan itself: a module-level figure, a tuple of them and an arithmetic are all seen."""
    module = tmp_path / "m.py"
    module.write_text("A = 32 * 2**20\nB, C = 1.5, 4\nD = {'x': 1}\nE = 'text'\nF = True\n")
    found = {name for name, _, numeric in _bindings(module) if numeric}
    assert found == {"A", "B", "C", "D"}
