"""Inputs of absurd size answer in seconds: thousands of invalid case files, a model of 100,000 layers,
a hidden size of two billion."""

from __future__ import annotations

import time

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
