"""Hostile inputs for the command line, shared by the corpus (test_hostile_inputs) and the property
tests (test_input_properties): files that are not what they claim, and an in-process runner that
holds each command to its exit codes, a time limit and its output folder."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

import harness
from harness.cli.main import main

ROOT = Path(harness.__file__).resolve().parents[1]
EXAMPLES = ROOT / "configs" / "examples"
CASES = ROOT / "cases"
# What a command may write in the repository: nothing. (The bundled cases and baselines must not change.)
WATCHED = (ROOT / "cases", ROOT / "results", ROOT / "configs", ROOT / "harness")
TIME_LIMIT_S = 20


# --- Files that are not what they claim ---------------------------------------------------------

BILLION_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
    for p, c in zip("abcdefgh", "bcdefghi", strict=True))


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _link(target: str) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        path.symlink_to(target)
    return make


def _text(text: str) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        path.write_text(text, encoding="utf-8")
    return make


def _bytes(data: bytes) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        path.write_bytes(data)
    return make


def _sparse(size: int) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        with open(path, "wb") as f:
            f.truncate(size)
    return make


def _loop(path: Path) -> None:
    other = path.with_name(path.name + ".other")
    other.symlink_to(path.name)
    path.symlink_to(other.name)


def _truncated(source: Path) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        text = source.read_text(encoding="utf-8")
        path.write_text(text[: len(text) // 2], encoding="utf-8")
    return make


# Each: (name, how to make it). Applied to YAML inputs (case files, LLaMA-Factory configs).
YAML_FILES: dict[str, Callable[[Path], None]] = {
    "missing": lambda path: None,
    "directory": lambda path: path.mkdir(),
    "fifo": _fifo,
    "dev-zero": _link("/dev/zero"),
    "dev-null": _link("/dev/null"),
    "symlink-loop": _loop,
    "empty": _text(""),
    "binary": _bytes(bytes(range(256)) * 8),
    "latin-1": _bytes("model: caf\xe9\n".encode("latin-1")),
    "oversize": _text("# padding\n" * 30_000 + "a: 1\n"),
    "oversize-sparse": _sparse(2**30),
    "alias-bomb": _text(BILLION_LAUGHS),
    "self-alias": _text("a: &a [1, *a]\n"),
    "deep-flow": _text("a: " + "[" * 5000 + "]" * 5000 + "\n"),
    "deep-block": _text("".join("  " * i + f"k{i}:\n" for i in range(80)) + "  " * 80 + "v: 1\n"),
    "nan": _text("per_device_train_batch_size: .nan\nid: x\n"),
    "inf": _text("cutoff_len: .inf\n"),
    "neg-inf": _text("learning_rate: -.inf\n"),
    "huge-float": _text("cutoff_len: 1e999\n"),
    "huge-int": _text(f"cutoff_len: {2**70}\n"),
    "list": _text("- a\n- b\n"),
    "scalar": _text("just a sentence\n"),
    "syntax": _text("a: [1, 2\nb: }\n"),
    "tabs": _text("a:\n\tb: 1\n"),
    "control-chars": _text("a: \x07\x1b\n"),
    "truncated-example": _truncated(EXAMPLES / "000-ds32b-optimized.yaml"),
    "duplicate-anchor-merge": _text("base: &b {x: 1}\nm:\n  <<: [*b, *b, *b]\n  <<: *b\n"),
}

# Applied to JSON inputs (TrainingArguments, DeepSpeed, config.json, run files).
JSON_FILES: dict[str, Callable[[Path], None]] = {
    "missing": lambda path: None,
    "directory": lambda path: path.mkdir(),
    "fifo": _fifo,
    "dev-zero": _link("/dev/zero"),
    "symlink-loop": _loop,
    "empty": _text(""),
    "binary": _bytes(b"\x00\x01\xfe\xff" * 64),
    "oversize-sparse": _sparse(2**31),
    "deep": _text("[" * 100_000 + "]" * 100_000),
    "deep-objects": _text('{"a":' * 70 + "1" + "}" * 70),
    "nan": _text('{"per_device_train_batch_size": NaN, "zero_optimization": {"stage": 3}}'),
    "infinity": _text('{"gradient_accumulation_steps": Infinity}'),
    "neg-infinity": _text('{"train_micro_batch_size_per_gpu": -Infinity}'),
    "huge-float": _text('{"max_seq_length": 1e999}'),
    "huge-int": _text('{"max_seq_length": ' + "9" * 5000 + "}"),
    "list": _text("[1, 2, 3]"),
    "string": _text('"a string"'),
    "syntax": _text('{"a": 1,}'),
    "comments": _text('{"a": 1 // no comments in JSON\n}'),
    "truncated-example": _truncated(EXAMPLES / "001-ladder-minimal.json"),
}


def make(folder: Path, name: str, maker: Callable[[Path], None]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    maker(folder / name)
    return folder / name


# --- Running a command --------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    code: int
    out: str
    err: str

    @property
    def err_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.strip()]


def _snapshot() -> dict[str, tuple[int, int]]:
    files = {}
    for top in WATCHED:
        for path in top.rglob("*"):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            st = path.stat()
            files[str(path)] = (st.st_size, st.st_mtime_ns)
    return files


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Fail (not hang) a call that runs past `seconds`."""
    def expire(signum, frame):
        raise _Timeout(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def invoke(argv: list[str], capsys, work: Path, limit_s: float = TIME_LIMIT_S) -> Outcome:
    """`oom-harness ARGV` in this process, from `work` as the working directory, within a time limit.
    Holds it to the rules every command keeps: no traceback on stderr, no exit code outside 0-2
    (3 is an internal error, whose log would go to `work/logs`), nothing written in the repository,
    no process left behind."""
    before = _snapshot()
    capsys.readouterr()
    cwd = os.getcwd()
    os.environ["OOM_HARNESS_LOG_DIR"] = str(work / "logs")
    os.chdir(work)
    try:
        with time_limit(limit_s):
            code = main([str(a) for a in argv])
    finally:
        os.chdir(cwd)
        del os.environ["OOM_HARNESS_LOG_DIR"]
    captured = capsys.readouterr()
    outcome = Outcome(code, captured.out, captured.err)
    assert "Traceback" not in outcome.err, outcome.err
    assert code in (0, 1, 2), f"exit {code}: {outcome.err}"
    assert not (work / "logs").exists(), "an internal error was logged"
    assert _snapshot() == before, "the command wrote in the repository"
    left = _left_running()
    assert not left, f"the command left processes running: {[_named(p) for p in left]}"
    return outcome


def _named(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid}: {' '.join(proc.cmdline())[:200]}"
    except psutil.Error:
        return f"{proc.pid} (gone)"


def _is_zygote(proc: psutil.Process) -> bool:
    try:
        return proc.ppid() == os.getpid() and proc.cmdline()[1:3] == ["-m", "harness.runtime.zygote"]
    except psutil.Error:
        return False


def _left_running() -> list[psutil.Process]:
    """This process's descendants, less the case runs other sessions of it are running meanwhile (the
    plugin's tiny runs in the background) and the worker zygote, which serves every run of this
    process and exits with it (the jobs it forked are runs, counted as such). A process the command
    started and left is not in a running run: its run_jobs has returned."""
    from harness.runtime import launcher, process_tree

    accounted: set[int] = set()
    with launcher.starting_nothing():
        children = psutil.Process().children(recursive=True)
        for pid in launcher.running_jobs():
            accounted.update(p.pid for p in process_tree.tree(pid))
    return [p for p in children if p.pid not in accounted and not _is_zygote(p)]
