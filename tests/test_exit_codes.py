"""Every command's exit codes mean one thing (docs/cli.md): 0 ok or fits, 1 a verdict failed or does not
fit, 2 bad input (one line naming the file, the key and the fix), 3 an internal error (one line naming
the log that keeps the traceback). Bad input of every kind is in test_hostile_inputs; here each code
of each command."""

from __future__ import annotations

import importlib
import json
import sys

import pytest
from hostile import CASES, EXAMPLES, invoke

from harness.cli import main as cli_main
from harness.models.inputs import InputError

CONFIG = EXAMPLES / "000-ds32b-optimized.yaml"
COMMANDS = {"run": "run", "check": "check", "case-from": "case_from", "validate": "validate", "bless": "bless",
            "report": "report", "compare": "compare"}


def test_check_exits_0_when_it_fits_and_1_when_it_does_not(tmp_path, capsys):
    # 68.7 GiB predicted per card, 72.9 GiB with its margin: 96 GiB cards fit it
    fits = invoke(["check", CONFIG, "--gpu-memory", "96GiB", "--gpus", "8", "--json"], capsys, tmp_path)
    assert fits.code == 0 and json.loads(fits.out)["fits"] is True
    tight = invoke(["check", CONFIG, "--gpu-memory", "24GiB", "--gpus", "8", "--json"], capsys, tmp_path)
    assert tight.code == 1 and json.loads(tight.out)["fits"] is False


def test_case_from_exits_0_when_written(tmp_path, capsys):
    done = invoke(["case-from", CONFIG, "--gpu-memory", "80GiB", "--gpus", "8", "--out", tmp_path / "out"], capsys,
                  tmp_path)
    assert done.code == 0 and (tmp_path / "out" / "000-ds32b-optimized.yaml").is_file()


def test_validate_exits_0_on_the_bundled_suite(tmp_path, capsys):
    done = invoke(["validate", CASES], capsys, tmp_path)
    assert done.code == 0 and "0 invalid" in done.out


def test_report_exits_0_on_the_committed_baselines(tmp_path, capsys):
    assert invoke(["report"], capsys, tmp_path).code == 0


def test_run_exits_0_when_its_shard_holds_nothing_to_run(tmp_path, capsys):
    """No case starts: the selected case is single-rank and --select multi keeps only multi-rank ones."""
    done = invoke(["run", "-k", "003-qlora-fix-r16", "--select", "multi", "--out", tmp_path / "out"], capsys,
                  tmp_path)
    assert done.code == 0 and "nothing to run" in done.out


def test_usage_errors_and_help_are_codes_not_exceptions(tmp_path, capsys):
    assert invoke(["check"], capsys, tmp_path).code == 2  # argparse: the config is required
    assert invoke(["--help"], capsys, tmp_path).code == 0


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_maps_bad_input_to_2_and_a_crash_to_3(command, tmp_path, capsys, monkeypatch):
    module = importlib.import_module(f"harness.cli.{COMMANDS[command]}")
    argv = {"run": ["run"], "check": ["check", str(CONFIG)], "case-from": ["case-from", str(CONFIG), "--out", "x"],
            "validate": ["validate"], "bless": ["bless", "x.json"], "report": ["report"],
            "compare": ["compare", "-k", "003", "--base-python", sys.executable]}[command]
    monkeypatch.setenv("OOM_HARNESS_LOG_DIR", str(tmp_path / "logs"))

    def bad_input(args):
        raise InputError(tmp_path / "f.yaml", "train.seq_len", "must be above zero", "write e.g. 1024")

    monkeypatch.setattr(module, "run", bad_input)
    assert cli_main.main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"oom-harness {command}: {tmp_path / 'f.yaml'}: train.seq_len: must be above zero. Fix: write e.g. " \
                  "1024\n"

    def crash(args):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(module, "run", crash)
    assert cli_main.main(argv) == 3
    err = capsys.readouterr().err
    log = next((tmp_path / "logs").glob("error-*.log"))
    assert err.count("\n") == 1 and "internal error (ZeroDivisionError" in err and str(log) in err
    assert "Traceback" not in err and "ZeroDivisionError: division by zero" in log.read_text()


def test_the_traceback_goes_to_the_state_folder_by_default(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OOM_HARNESS_LOG_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setattr(cli_main.report, "run", lambda args: 1 / 0)
    assert cli_main.main(["report"]) == 3
    assert list((tmp_path / "state" / "oom-harness").glob("error-*.log"))
    assert str(tmp_path / "state" / "oom-harness") in capsys.readouterr().err


def test_oom_harness_debug_lets_the_traceback_through(monkeypatch):
    monkeypatch.setenv("OOM_HARNESS_DEBUG", "1")
    monkeypatch.setattr(cli_main.report, "run", lambda args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        cli_main.main(["report"])


CONSOLE = """
import atexit
import sys
import threading
import time
from pathlib import Path

mark, thread_mark = Path(sys.argv[1]), Path(sys.argv[2])
atexit.register(mark.write_text, "atexit ran")


class Left:  # alive to the end: the interpreter's teardown would finalize it
    def __del__(self, write=Path.write_text, path=mark.with_name("teardown")):
        write(path, "torn down")


left = Left()
sys.argv = ["oom-harness", *sys.argv[3:]]
import harness.cli.main as cli  # noqa: E402

if thread_mark.name != "none":  # a thread still running when the command is done: waited for
    done, command = threading.Event(), cli.main

    def main():
        try:
            return command()
        finally:
            done.set()

    cli.main = main
    threading.Thread(target=lambda: (done.wait(), time.sleep(0.3), thread_mark.write_text("thread ran"))).start()
cli.console()
"""


@pytest.mark.parametrize("thread", [False, True])
def test_the_console_entry_keeps_what_an_exit_guarantees(tmp_path, thread):
    """The `oom-harness` command ends its process without the interpreter's teardown (an object left alive
    is not finalized), yet its exit code is the command's, everything it printed reaches the pipe and the
    handlers registered to run at exit run; where a thread still runs, it is waited for and the
    interpreter exits as usual."""
    import os
    import subprocess
    import sys

    from hostile import ROOT

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    thread_mark = tmp_path / ("thread" if thread else "none")
    ok = subprocess.run([sys.executable, "-c", CONSOLE, str(tmp_path / "ok"), str(thread_mark), "validate",
                         str(CASES)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.rstrip().endswith("0 invalid"), ok.stderr[-2000:]
    assert len(ok.stdout.splitlines()) > 20  # a line per bundled case, then the summary
    assert (tmp_path / "ok").read_text() == "atexit ran"
    assert thread_mark.exists() == thread
    assert (tmp_path / "teardown").exists() == thread
    bad = subprocess.run([sys.executable, "-c", CONSOLE, str(tmp_path / "bad"), str(tmp_path / "none"), "validate",
                          str(tmp_path / "missing.yaml")], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "missing.yaml" in bad.stdout + bad.stderr
    assert (tmp_path / "bad").read_text() == "atexit ran"
