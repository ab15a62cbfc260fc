"""Inputs of absurd size answer in seconds: thousands of invalid case files, a model of 100,000 layers,
a hidden size of two billion."""

from __future__ import annotations

import time

import pytest

from harness.spec.suite import EXAMPLE_CONFIGS_DIR

pytest_plugins = ["pytester"]


def test_thousands_of_invalid_case_files_are_reported_in_seconds(pytester):
    """Collection matched every file against every error (5,000 empty files: over 400 s), and pytest's
    failure summary is itself quadratic in failed items: past 100 invalid files, one item lists the rest."""
    from harness.pytest_plugin.cases import MAX_INVALID_ITEMS

    cases = pytester.mkdir("cases")
    for i in range(1000):
        (cases / f"c{i:04d}.yaml").write_text("" if i % 2 else "id: [")
    started = time.monotonic()
    result = pytester.runpytest("--case-dir", str(cases), "-p", "no:cacheprovider", "-q")
    took = time.monotonic() - started
    result.assert_outcomes(failed=MAX_INVALID_ITEMS + 1)
    out = result.stdout.str()
    rest, first = 1000 - MAX_INVALID_ITEMS, f"c{MAX_INVALID_ITEMS:04d}"
    result.stdout.fnmatch_lines([f"*case invalid-{first}-and-{rest - 1}-more*",
                                 f"*{rest} more invalid case files*"])
    assert "c0999.yaml: invalid case file" in out and "c0000.yaml: invalid case file" in out  # each one named
    assert took < 30, f"{took:.0f} s"


def _model_folder(tmp_path, **sizes):
    import json

    from harness.models.registry import load_architecture

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(load_architecture("qwen1.5-0.5b-chat").config, **sizes)))
    return folder


@pytest.mark.parametrize(("key", "value"), [("num_hidden_layers", 100_000), ("hidden_size", 2_147_483_520),
                                            ("vocab_size", 2**31 - 1)])
def test_a_model_of_absurd_size_is_refused_at_once_naming_the_key(tmp_path, capsys, key, value):
    """100,000 layers: `check` still growing (6.7 GB) after 3 minutes; a hidden size of two billion: a
    64 GiB tensor asked for, then an internal error."""
    from harness.cli.main import main

    folder = _model_folder(tmp_path, **{key: value})
    started = time.monotonic()
    code = main(["check", str(EXAMPLE_CONFIGS_DIR / "001-ladder-minimal.json"), "--gpu-memory", "24GiB", "--gpus", "1",
                 "--model", str(folder)])
    said = capsys.readouterr().err
    assert code == 2, said
    assert f"{key} {value:,} is above" in said and str(folder / "config.json") in said
    assert time.monotonic() - started < 10


def test_every_bundled_architecture_is_within_the_size_bounds():
    from harness.models.registry import known_architectures, load_architecture, size_problem

    assert [n for n in known_architectures() if size_problem(load_architecture(n).config)] == []
