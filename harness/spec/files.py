"""Writing results so that they cannot be corrupted: names that stay inside their folder, and writes that
either land whole or leave the old file as it was.

Case ids and variants name files (case files, run folders, baselines); a record anyone can edit must
not turn them into paths elsewhere on disk. Every file the harness writes goes through `write_atomic`:
a temporary file in the same folder, flushed to the disk, then renamed over the target, so a full disk
or a killed process leaves the previous file intact and no half-written one behind. It replaces only a
regular file: a rename over a symbolic link, a named pipe or a device (`--json /dev/null` as root) would
put a plain file where the link or the device was, so those are refused (`RefusedOutput`). What a
command checks before it works, and how it undoes a failed write of several files, is
harness.spec.outputs.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
import unicodedata
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator

# letters, digits, '.', '_', '-', starting with a letter or digit (harness.spec.schema.CASE_ID_PATTERN)
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
NAME_MAX = 200
# the process's umask, read once at import (setting it is the only way to read it): new files get the
# mode a plain open() would give them, not mkstemp's owner-only 0600
_UMASK = os.umask(0o022)
os.umask(_UMASK)


class UnsafeNameError(ValueError):
    """A case id or variant that would name a path outside its folder (separators, '..')."""


class OutsideFolderError(ValueError):
    """A path built from a name that resolves outside the folder it belongs in."""


class WriteError(OSError):
    """A result file that could not be written (full disk, no permission); the old file is intact."""


class RefusedOutput(WriteError):
    """A path a command will not write: not a regular file (a symbolic link, a folder, a named pipe, a
    device), one of the command's inputs, an existing file without --force, or a name the file system
    cannot hold. Nothing was written; the command line answers it with exit 2."""


# Characters that end a line or steer a terminal: C0 and C1 controls (newline, ESC, NUL, DEL), the
# Unicode line and paragraph separators (YAML and many editors break lines there), and the bidirectional
# overrides that make text display in another order than it is read.
_BIDI = frozenset("\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _is_control(char: str) -> bool:
    return unicodedata.category(char) in ("Cc", "Zl", "Zp") or char in _BIDI


def control_character(text: str) -> str | None:
    """The first control character in `text`, written as its escape ('\\n', '\\x1b'); None where there is none."""
    return next((ascii(c)[1:-1] for c in text if _is_control(c)), None)


def printable(text: str) -> str:
    """`text` with each control character written as its escape: one line, safe in a comment, a log or a
    terminal, and still saying which character it was."""
    return "".join(ascii(c)[1:-1] if _is_control(c) else c for c in str(text))


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def not_regular(path: Path) -> str | None:
    """What `path` is where it is there but is not a regular file ('a symbolic link', 'a folder', 'a named
    pipe', 'a character device', ...); None where it is a regular file or absent. The link itself is
    looked at, not what it points to."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def refuse_not_regular(path: Path, what: str | None = None) -> None:
    """RefusedOutput unless `path` is a regular file or absent (see `not_regular`)."""
    kind = not_regular(path)
    if kind:
        raise RefusedOutput(f"{(what + ' ') if what else ''}{printable(str(path))}: is {kind}, and only a regular "
                            "file is written (replacing it would put a plain file where it was); remove it or name "
                            "another file")


def name_problem(value: str, empty_ok: bool = False) -> str | None:
    """Why `value` cannot name a file (None: it can)."""
    if value == "" and empty_ok:
        return None
    if not isinstance(value, str) or not re.fullmatch(NAME_PATTERN, value) or ".." in value \
            or len(value) > NAME_MAX:
        return (f"{value!r} is not a safe file name: use letters, digits, '.', '_' and '-', starting with a "
                f"letter or digit, no '..', at most {NAME_MAX} characters")
    return None


def safe_name(value: str, what: str | None = None, empty_ok: bool = False) -> str:
    """`value` if it can name a file, else UnsafeNameError (naming `what` where given; pydantic names
    the field itself)."""
    problem = name_problem(value, empty_ok)
    if problem:
        raise UnsafeNameError(f"{what}: {problem}" if what else problem)
    return value


# Fields of records read back from JSON anyone can edit, that later name files (a case id, a variant):
# refused unless they are safe names, whichever model holds them.
FileName = Annotated[str, AfterValidator(safe_name)]
FileNameOrEmpty = Annotated[str, AfterValidator(lambda value: safe_name(value, empty_ok=True))]


def inside(root: Path, *parts: str) -> Path:
    """`root / parts...`, refused with OutsideFolderError unless it resolves inside `root` (a name
    holding '..' or a separator, or a symbolic link pointing out of the folder)."""
    path = Path(root).joinpath(*parts)
    if not path.resolve().is_relative_to(Path(root).resolve()):
        raise OutsideFolderError(f"{path}: resolves outside {Path(root).resolve()}; name the file with "
                                 "letters, digits, '.', '_' and '-' only")
    return path


def check_writable(path: Path, what: str) -> None:
    """Refuse, before any work is done, a file that could not be written later: its folder missing, not
    a folder or not writable, or the path itself a folder. Raises WriteError naming `what`."""
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        raise WriteError(f"{what} {path}: is a folder; name a file")
    if not folder.is_dir():
        raise WriteError(f"{what} {path}: the folder {folder} does not exist; create it or name another file")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise WriteError(f"{what} {path}: not writable; name a file in a folder you can write to")


def os_reason(exc: OSError) -> str:
    """What the operating system said (e.g. 'No space left on device'), also for a WriteError."""
    cause = exc.__cause__ if isinstance(exc, WriteError) and isinstance(exc.__cause__, OSError) else exc
    return os.strerror(cause.errno) if cause.errno else str(cause)


def write_atomic(path: Path, text: str | bytes, root: Path | None = None) -> Path:
    """Write `text` (or bytes) to `path` whole or not at all: a temporary file in the same folder, flushed and
    synced, renamed over `path`. With `root`, `path` must resolve inside it (OutsideFolderError). A
    `path` that is there but is not a regular file is refused (RefusedOutput) before anything is written. A
    failed write (ENOSPC, EACCES) removes the temporary file, leaves any old file as it was and raises
    WriteError naming the file."""
    path = Path(path)
    if root is not None and not path.resolve().is_relative_to(Path(root).resolve()):
        raise OutsideFolderError(f"{path}: resolves outside {Path(root).resolve()}; name the file with "
                                 "letters, digits, '.', '_' and '-' only")
    refuse_not_regular(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.fchmod(fd, path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~_UMASK)
        with (os.fdopen(fd, "wb") if isinstance(text, bytes) else os.fdopen(fd, "w", encoding="utf-8")) as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        raise WriteError(f"{path}: could not be written ({os_reason(exc)}); the previous file, if any, is unchanged. "
                         "Free space or choose another folder, then run again") from exc
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return path
