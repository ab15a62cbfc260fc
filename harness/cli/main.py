"""The command line: assembles one module per command (accelerate's `commands/` layout).

    oom-harness run | check | fit | case-from | validate | bless | report | compare

Exit codes, the same for every command (docs/cli.md):

    0  all verdicts hold, the config fits, the file was written
    1  a case failed, a claim was refuted, a config does not fit (a verdict, on stdout)
    2  bad input: one line on stderr naming the file, the key and the fix (`InputError`), or a
       usage error from the argument parser
    3  an internal error: one line on stderr saying where the traceback was written
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import sys
import tempfile
import traceback
from pathlib import Path

from harness.cli import bless, case_from, check, compare, fit, report, run, terminal, validate
from harness.models.inputs import InputError
from harness.runtime import stopping
from harness.spec.files import WriteError

COMMANDS = (run, check, fit, case_from, validate, bless, report, compare)
EXIT_OK, EXIT_FAIL, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3


def log_dir() -> Path:
    """Where internal errors leave their tracebacks: $OOM_HARNESS_LOG_DIR, else the user's state folder
    ($XDG_STATE_HOME/oom-harness, ~/.local/state/oom-harness)."""
    if os.environ.get("OOM_HARNESS_LOG_DIR"):
        return Path(os.environ["OOM_HARNESS_LOG_DIR"])
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "oom-harness"


def _write_traceback(command: str, argv: list[str]) -> Path:
    """The traceback of the exception being handled, in a file of its own (the state folder, else the
    temporary folder where that is not writable)."""
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    text = f"oom-harness {command}\nargv: {argv}\n\n{traceback.format_exc()}"
    for folder in (log_dir(), Path(tempfile.gettempdir()) / "oom-harness"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"error-{stamp}-{os.getpid()}.log"
            path.write_text(text, encoding="utf-8")
            return path
        except OSError:
            continue
    raise OSError("no writable folder for the traceback")


class _Parser(argparse.ArgumentParser):
    """argparse with a bad flag said in one line, `oom-harness COMMAND: argument --x: what is wrong` (exit 2), as
    every other bad input is; `--help` still prints the usage. Subcommand parsers are made of this class."""

    def error(self, message):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: {_one_line(message)}\n")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _Parser(prog="oom-harness", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage errors (exit 2) and --help (exit 0), as a code for callers in-process
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
    try:
        return args.func(args)
    except KeyboardInterrupt as exc:  # harness.runtime.stopping.Stopped, or a Ctrl-C before its handler
        stopped = exc if isinstance(exc, stopping.Stopped) else stopping.Stopped(signal.SIGINT)
        print(f"oom-harness {args.command}: {stopped}; nothing it started is left running", file=sys.stderr,
              flush=True)
        return stopped.exit_code
    except (InputError, WriteError) as exc:  # WriteError: a result file that could not be written (disk, rights)
        print(f"oom-harness {args.command}: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:
        if os.environ.get("OOM_HARNESS_DEBUG"):
            raise
        try:
            where = f"the traceback is in {_write_traceback(args.command, argv)}"
        except OSError:
            where = "no folder was writable for the traceback; OOM_HARNESS_DEBUG=1 prints it"
        print(f"oom-harness {args.command}: internal error ({type(exc).__name__}: {_one_line(str(exc))[:200]}); "
              f"{where}; please report it with that file", file=sys.stderr)
        return EXIT_INTERNAL


def _one_line(text: str) -> str:
    return " | ".join(line.strip() for line in text.splitlines() if line.strip())


def console() -> None:
    """The `oom-harness` command and `python -m harness.cli`: `main`, then the process ends without the
    interpreter's teardown. Once torch._dynamo is imported (transformers and peft import it) that teardown,
    collecting and freeing every object of those libraries, takes 0.7 to 0.9 s on two CPU cores, a tenth of
    a cold `check`, for memory the operating system takes back anyway. What is registered to run at exit
    runs first (atexit: logging's flush, multiprocessing's reaping of children, weakref finalizers such as
    temporary folders' removal) and the standard streams are flushed. Where another thread still runs,
    the interpreter exits as usual, which waits for it."""
    import atexit
    import threading

    # `timeout`, CI runners and job schedulers stop with SIGTERM, a person with Ctrl-C: either one
    # kills every job, releases what the command holds and ends it with one line (128 + the signal)
    stopping.install()
    # control characters of the inputs (an ANSI escape, a NUL in a config value) print as escapes
    terminal.sanitize_standard_streams()
    code = main()
    if threading.active_count() > 1:
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)


if __name__ == "__main__":
    console()
