"""Control characters from inputs print as escapes: an ANSI escape sequence or a NUL byte in a config
value reached the terminal raw (a screen cleared, a clipboard written, the rest of a line hidden)."""

from __future__ import annotations

import io
import json
import subprocess
import sys

from harness.cli.terminal import Sanitized, sanitize

HOSTILE = "\x1b[2J\x1b]52;c;ZXZpbA==\x07evil\x00x\u202eexe.txt\x9b31m"


def test_the_command_line_prints_a_config_values_control_characters_as_escapes(tmp_path):
    config = tmp_path / "train.json"
    config.write_text(json.dumps({"model_name_or_path": HOSTILE, "per_device_train_batch_size": 1,
                                  "output_dir": "o", "max_seq_length": 512}))
    done = subprocess.run([sys.executable, "-m", "harness.cli", "check", str(config), "--gpu-memory", "24GiB",
                           "--gpus", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert not any(c in done.stderr + done.stdout for c in "\x1b\x07\x00\u202e\x9b")
    assert r"\x1b[2J\x1b]52;c;ZXZpbA==\x07evil\x00x\u202eexe.txt\x9b31m" in done.stderr


def test_newlines_tabs_and_the_progress_lines_carriage_return_pass():
    out = io.StringIO()
    Sanitized(out).write("a\tb\r\nc\x1b[0m")
    assert out.getvalue() == "a\tb\r\nc\\x1b[0m"
    assert sanitize("plain 64 GiB ü") == "plain 64 GiB ü"


def test_a_wait_for_a_card_prints_its_holders_control_characters_as_escapes(capfd):
    """The line a wait for a card prints goes past the command line's streams (and pytest's capture) to the
    terminal, and names the holder as the lock file says: a file every user of the host may write."""
    import fcntl
    import os

    import pytest

    from harness.judge.session import _say
    from harness.runtime import card_lock

    path = card_lock.lock_dir() / "card-cuda0.lock"
    path.write_text(f"pid 1 ({HOSTILE})")
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another holder: a second open file description
        with pytest.raises(card_lock.CardBusy):
            card_lock.take(["cuda0"], wait_s=0.2, say=_say)
    finally:
        os.close(fd)
    err = capfd.readouterr().err
    assert "is being measured by another harness" in err
    assert not any(c in err for c in "\x1b\x07\x00\u202e\x9b")
    assert sanitize(HOSTILE) in err
