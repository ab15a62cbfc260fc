"""What a command writes, checked before it works and taken back when it fails.

`fit`, `case-from`, `report --html` and `run --json` write where their user points them, often in a
folder that holds the user's own files. Before any work (an import, a search, a run) each output is
checked, and refused with `RefusedOutput` (exit 2, naming the path and the option):

- only regular files are written: an existing symbolic link, folder, named pipe or device is refused
  (a rename over `/dev/null` would replace the device; over a link, the link);
- never one of the command's own inputs (`fit --script out/launch.sh --out out/`), and never two
  outputs of one name;
- never an existing file without `--force`;
- names the file system can hold (an empty name, a part over its length limit) and no control
  characters (a newline in a name would become a line of a script or a YAML file).

`Outputs` keeps what a command created: when the command raises, the files it wrote are removed (or,
with `--force`, the files they replaced are put back) and the folders it created are removed, so a
failed command leaves nothing behind; a command that ends without writing anything (nothing fits)
leaves no empty folder either.

    with Outputs(force=args.force, inputs=[config]) as out:
        folder = out.folder(Path(args.out), "--out")
        path = out.file(folder / "launch.sh", "--out")
        ...                                   # the command's work
        out.write(path, text)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from harness.spec.files import (
    RefusedOutput,
    WriteError,
    control_character,
    not_regular,
    os_reason,
    printable,
    write_atomic,
)

__all__ = ["Outputs", "RefusedOutput", "check_name", "check_output"]


def _name_max(path: Path) -> int:
    """The longest name (bytes) the file system of `path`'s nearest existing folder takes (255 on most)."""
    for folder in (path, *path.parents):
        with contextlib.suppress(OSError, ValueError):
            if folder.is_dir():
                return os.pathconf(folder, "PC_NAME_MAX")
    return 255


def check_name(path: Path | str, what: str) -> Path:
    """`path` as a Path, refused (RefusedOutput naming `what`) where it cannot name an output: empty, holding
    a control character, or with a part longer than the file system takes."""
    text = os.fspath(path)
    if text == "":
        raise RefusedOutput(f"{what}: an empty name; name a file or folder to write")
    bad = control_character(text)
    if bad:
        raise RefusedOutput(f"{what} {printable(text)}: the name holds the control character {bad}; name the output "
                            "without control characters")
    path = Path(text)
    limit = _name_max(path.parent if path.parent != path else path)
    long_part = next((p for p in path.parts if len(os.fsencode(p)) > limit), None)
    if long_part is not None:
        raise RefusedOutput(f"{what} {text[:60]}...: the name '{long_part[:40]}...' is {len(os.fsencode(long_part))} "
                            f"bytes, longer than the {limit} this file system takes; name a shorter one")
    return path


def _key(path: Path) -> Path:
    """One spelling of an output's path: its folder resolved, its own name kept (the file may be a link,
    refused as one, or not be there yet)."""
    try:
        return path.parent.resolve() / path.name
    except (OSError, RuntimeError):  # a loop of links in the folder's path
        return Path(os.path.abspath(path))


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except (OSError, RuntimeError):
        return False


def check_output(path: Path | str, what: str, *, force: bool = False, inputs: tuple | list = ()) -> Path:
    """Refuse, before any work, a file a command would write (RefusedOutput naming `what`): a name that
    cannot be one (`check_name`), a path that is there but is not a regular file, one of `inputs`, an
    existing file without `force`, a folder that is a file. (A missing folder is `Outputs.folder`'s to
    create, or `harness.spec.files.check_writable`'s to refuse.)"""
    path = check_name(path, what)
    try:
        return _check_output(path, what, force, inputs)
    except RefusedOutput:
        raise
    except OSError as exc:  # a part of the path is a file, a name too long for the path, no permission
        raise RefusedOutput(f"{what} {printable(str(path))}: cannot be written ({os_reason(exc)}); name another "
                            "file") from None


def _check_output(path: Path, what: str, force: bool, inputs) -> Path:
    shown = printable(str(path))
    kind = not_regular(path)
    if kind == "a folder":
        raise RefusedOutput(f"{what} {shown}: is a folder; name a file")
    if kind:
        raise RefusedOutput(f"{what} {shown}: is {kind}, and only a regular file is written; remove it or name "
                            "another file")
    for source in inputs:
        if source is not None and _same(path, Path(source)):
            raise RefusedOutput(f"{what} {shown}: is one of this command's inputs ({printable(str(source))}), never "
                                "written over; name another output")
    if path.exists() and not force:
        raise RefusedOutput(f"{what} {shown}: exists; pass --force to replace it, or name another file")
    folder = path.parent
    if folder.exists() and not folder.is_dir():
        raise RefusedOutput(f"{what} {shown}: {folder} is not a folder; name a file in a folder")
    return path


class Outputs:
    """The outputs of one command: each checked when it is named (`folder`, `file`), written with
    `write`, and taken back if the command raises (see the module's docstring)."""

    def __init__(self, *, force: bool = False, inputs: tuple | list = ()):
        self.force = force
        self.inputs = [Path(p) for p in inputs if p is not None]
        self._claimed: dict[Path, str] = {}  # the path (`_key`) -> what named it
        self._created: list[Path] = []  # folders this command created, outermost first
        self._written: list[tuple[Path, Path | None]] = []  # each file written, and the copy of what it replaced
        self._removed: list[tuple[Path, Path]] = []  # each file removed, and where it waits until the command ends

    def __enter__(self) -> Outputs:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self._commit()
        else:
            self._rollback()
        return False

    def folder(self, path: Path | str, what: str) -> Path:
        """The folder `path`, created where missing (with its parents), after making sure a file can be
        created in it. RefusedOutput where it is a file, or where it cannot be created or written."""
        path = check_name(path, what)
        shown = printable(str(path))
        try:
            if path.exists() and not path.is_dir():
                raise RefusedOutput(f"{what} {shown}: is a file, not a folder; name a folder")
            missing = [p for p in (path, *path.parents) if not p.exists()][::-1]
            for folder in missing:
                folder.mkdir()
                self._created.append(folder)
            fd, probe = tempfile.mkstemp(dir=path, prefix=".oom-harness-probe.")
            os.close(fd)
            os.unlink(probe)
        except RefusedOutput:
            raise
        except OSError as exc:
            self._remove_created()
            raise RefusedOutput(f"{what} {shown}: cannot write in this folder ({os_reason(exc)}); name a folder you "
                                "can write to") from None
        return path

    def file(self, path: Path | str, what: str) -> Path:
        """`path`, checked as an output (`check_output`) and as the only output of this command by that name
        (naming it again for the same `what` gives the same output)."""
        path = check_name(path, what)
        key = _key(path)
        if self._claimed.get(key) == what:
            return path
        path = check_output(path, what, force=self.force, inputs=self.inputs)
        if key in self._claimed:
            raise RefusedOutput(f"{printable(str(path))}: {self._claimed[key]} and {what} would both be written to "
                                "this one file; name them apart")
        self._claimed[key] = what
        return path

    def write(self, path: Path, text: str | bytes, root: Path | None = None) -> Path:
        """Write a file named with `file`, whole (harness.spec.files.write_atomic); what it replaces is
        kept aside until the command ends, to be put back if the command fails."""
        path = Path(path)
        if _key(path) not in self._claimed:
            raise ValueError(f"{path}: not named with Outputs.file before it was written")
        backup = None
        if path.exists():
            try:
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".old")
                os.close(fd)
                backup = Path(tmp)
                shutil.copy2(path, backup)
            except OSError as exc:
                if backup is not None:
                    backup.unlink(missing_ok=True)
                raise WriteError(f"{path}: could not be written ({os_reason(exc)}): no room to keep the file it "
                                 "replaces until the command ends; it is unchanged") from exc
        try:
            write_atomic(path, text, root=root)
        except BaseException:
            if backup is not None:
                backup.unlink(missing_ok=True)
            raise
        self._written.append((path, backup))
        return path

    def record(self, path: Path) -> Path:
        """A file named with `file` that other code wrote (whole, with write_atomic): this command's output,
        removed if the command fails after it."""
        if _key(Path(path)) not in self._claimed:
            raise ValueError(f"{path}: not named with Outputs.file before it was written")
        self._written.append((Path(path), None))
        return Path(path)

    def remove(self, path: Path) -> bool:
        """Remove an output named with `file` that an earlier run of the command wrote and this one's answer
        has no place for (replaced under --force, a file left would read as part of the answer): moved aside
        until the command ends, put back if it fails. False where there is none."""
        path = Path(path)
        if _key(path) not in self._claimed:
            raise ValueError(f"{path}: not named with Outputs.file before it was removed")
        if not path.exists():
            return False
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".old")
        os.close(fd)
        os.replace(path, tmp)
        self._removed.append((path, Path(tmp)))
        return True

    @property
    def written(self) -> list[Path]:
        return [p for p, _ in self._written]

    def _commit(self) -> None:
        for _, backup in self._written + self._removed:
            if backup is not None:
                backup.unlink(missing_ok=True)
        self._removed.clear()
        if not self._written:  # nothing written (nothing fits, a refusal): no empty folder stays
            self._remove_created(only_empty=True)

    def _rollback(self) -> None:
        for path, backup in reversed(self._written):
            with contextlib.suppress(OSError):
                if backup is not None:
                    os.replace(backup, path)
                else:
                    path.unlink(missing_ok=True)
        self._written.clear()
        for path, aside in reversed(self._removed):
            with contextlib.suppress(OSError):
                os.replace(aside, path)
        self._removed.clear()
        self._remove_created()

    def _remove_created(self, only_empty: bool = False) -> None:
        """Remove the folders this command created, innermost first (`only_empty`: those left empty)."""
        for folder in reversed(self._created):
            with contextlib.suppress(OSError):
                if only_empty:
                    folder.rmdir()
                else:
                    shutil.rmtree(folder)
        self._created.clear()
