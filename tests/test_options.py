"""Options are defined once: every option of a case run is a flag of `oom-harness run` and a pytest
option with the same help, type and default, each refuses the same impossible values, and every
environment variable the package reads is in docs/cli.md's table."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _pytest.config.argparsing import Parser

from harness.cli import run
from harness.pytest_plugin import plugin
from harness.pytest_plugin.options import DEFAULT_TIMEOUT_S, RUN_OPTIONS
from harness.runtime import launcher
from harness.spec import shape

ROOT = Path(__file__).resolve().parent.parent
CLI_DOC = ROOT / "docs" / "cli.md"


def _run_actions() -> dict[str, argparse.Action]:
    parser = argparse.ArgumentParser()
    run.add_parser(parser.add_subparsers())
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["run"]
    return {s: a for a in sub._actions for s in a.option_strings}


def _pytest_parser() -> Parser:
    parser = Parser()
    plugin.pytest_addoption(parser)
    return parser


def _pytest_options() -> dict[str, object]:
    return {name: opt for opt in _pytest_parser().getgroup("oom-harness").options for name in opt.names()}


@pytest.mark.parametrize("option", RUN_OPTIONS, ids=lambda o: o.cli)
def test_each_run_option_is_one_flag_of_run_and_one_pytest_option_with_one_help(option):
    cli = _run_actions()[option.cli]
    pyt = _pytest_options()[option.pytest].attrs()
    assert cli.help == pyt["help"] == option.help
    assert cli.default == pyt.get("default") == (False if option.switch else option.default)
    assert cli.type is pyt.get("type") is option.type
    assert isinstance(cli, argparse._StoreTrueAction) == (pyt.get("const") is True) == option.switch


def test_the_shared_options_cover_every_option_both_surfaces_spell():
    """An option added to one surface and not the other is one of the table's, or one surface's own."""
    shared_cli = {o.cli for o in RUN_OPTIONS}
    cli_only = set(_run_actions()) - shared_cli - {"-h", "--help"}
    # what only `oom-harness run` does: pick cases and fidelities, repeat, shard, write its own JSON
    assert cli_only == {"--fidelity", "-k", "--json", "--variant", "--select", "--shard", "--repeat", "--force"}
    pytest_only = set(_pytest_options()) - {o.pytest for o in RUN_OPTIONS}
    assert pytest_only == {"--harness", "--premerge-dir", "--premerge-files", "--premerge-fit"}


@pytest.mark.parametrize(("flags", "bad"), [(("--steps", "--harness-steps"), "0"),
                                            (("--jobs", "--harness-jobs"), "two"),
                                            (("--timeout", "--case-timeout"), "-1"),
                                            (("--wait-for-card", "--harness-wait-for-card"), "nan")])
def test_both_surfaces_refuse_the_same_impossible_value(flags, bad, capsys):
    from harness.cli.main import main

    cli, pyt = flags
    assert main(["run", cli, bad]) == 2
    assert cli in capsys.readouterr().err
    with pytest.raises(pytest.UsageError, match=re.escape(pyt)):
        _pytest_parser().parse([pyt, bad])


def test_the_pytest_surface_parses_a_value_with_the_shared_type():
    ns = _pytest_parser().parse(["--harness-steps", "3", "--case-timeout", "60", "--harness-full-depth"])
    assert (ns.harness_steps, ns.case_timeout, ns.harness_full_depth) == (3, 60.0, True)


def test_the_defaults_the_help_texts_name_are_the_ones_the_runs_use():
    assert DEFAULT_TIMEOUT_S == launcher.DEFAULT_TIMEOUT_S
    steps = next(o for o in RUN_OPTIONS if o.cli == "--steps")
    assert f"{shape.TINY_STEPS} at tiny size, {shape.REAL_STEPS} at full size" in steps.help


def _env_vars_read_by_the_package() -> set[str]:
    names = set()
    for path in (ROOT / "harness").rglob("*.py"):
        names.update(re.findall(r"[\"']((?:OOM_)?HARNESS_[A-Z_]+)[\"']", path.read_text(encoding="utf-8")))
    return names


def _env_table() -> dict[str, str]:
    text = CLI_DOC.read_text(encoding="utf-8")
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(0) for m in re.finditer(r"^\| `((?:OOM_)?HARNESS_[A-Z_]+)` \|.*$", section, re.M)}


def test_every_environment_variable_the_package_reads_is_in_the_table():
    read = _env_vars_read_by_the_package()
    assert len(read) >= 12  # the search finds them where the package spells them as strings
    table = _env_table()
    assert sorted(read - set(table)) == [], "add these to docs/cli.md's table of environment variables"
    assert sorted(set(table) - read) == [], "docs/cli.md lists variables the package no longer reads"


def test_an_environment_variable_that_sets_an_option_says_which():
    row = _env_table()["OOM_HARNESS_MEMORY_HISTORY"]
    assert "--memory-history" in row


def test_the_command_line_starts_without_importing_pytest():
    """The option table is the CLI's too; importing it must not cost `check` a pytest import."""
    code = "import sys, harness.cli.main; print('pytest' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
