"""Result files: names that stay inside their folder, writes that land whole or leave the old file."""

from __future__ import annotations

import errno
import os

import pytest

from harness.spec import files
from harness.spec.files import OutsideFolderError, UnsafeNameError, WriteError, inside, safe_name, write_atomic


@pytest.mark.parametrize("name", ["../x", "a/b", "a\\b", "..", "x..y", ".hidden", "", "a b", "/etc/passwd", "é"])
def test_a_name_with_separators_or_dots_is_refused(name):
    with pytest.raises(UnsafeNameError, match=r"case_id: .* is not a safe file name"):
        safe_name(name, "case_id")


@pytest.mark.parametrize("name", ["003-qlora-fix-r32-seq1024-gc", "2r8L2ga", "a.b_c-d"])
def test_a_plain_name_passes(name):
    assert safe_name(name, "case_id") == name


def test_a_variant_may_be_empty():
    assert safe_name("", "variant", empty_ok=True) == ""


def test_a_path_built_from_a_name_stays_inside_its_root(tmp_path):
    assert inside(tmp_path, "p", "x.json") == tmp_path / "p" / "x.json"
    with pytest.raises(OutsideFolderError, match="resolves outside"):
        inside(tmp_path / "root", "p", "../../../x.json")
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "link").symlink_to(tmp_path)  # a link out of the folder is outside too
    with pytest.raises(OutsideFolderError):
        inside(tmp_path / "root", "link", "x.json")


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "a.json"
    write_atomic(path, "one")
    write_atomic(path, "two")
    assert path.read_text() == "two"
    assert sorted(p.name for p in path.parent.iterdir()) == ["a.json"]


def test_a_new_file_gets_the_umasks_mode_and_a_replaced_one_keeps_its_own(tmp_path):
    old = os.umask(0o022)
    try:
        new = write_atomic(tmp_path / "new.json", "x")
    finally:
        os.umask(old)
    assert new.stat().st_mode & 0o777 == 0o666 & ~files._UMASK
    kept = tmp_path / "kept.json"
    kept.write_text("old")
    kept.chmod(0o640)
    write_atomic(kept, "new")
    assert kept.stat().st_mode & 0o777 == 0o640


def test_a_write_outside_its_root_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(OutsideFolderError):
        write_atomic(tmp_path / "root" / ".." / "escaped.json", "x", root=tmp_path / "root")
    assert not (tmp_path / "escaped.json").exists()


@pytest.mark.parametrize("failing", ["write", "fsync", "replace"])
def test_a_full_disk_leaves_the_old_file_intact_and_names_the_file(tmp_path, monkeypatch, failing):
    path = tmp_path / "baseline.json"
    path.write_text("old")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if failing == "write":  # the data does not fit: the temporary file's write fails
        real_fdopen = os.fdopen

        def fdopen(fd, *args, **kwargs):
            f = real_fdopen(fd, *args, **kwargs)
            monkeypatch.setattr(f, "write", full)
            return f

        monkeypatch.setattr(files.os, "fdopen", fdopen)
    else:
        monkeypatch.setattr(files.os, failing, full)
    with pytest.raises(WriteError, match=r"baseline\.json: could not be written \(No space left on device\); "
                                         r"the previous file, if any, is unchanged"):
        write_atomic(path, "new " * 1000)
    monkeypatch.undo()
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["baseline.json"]  # no temporary file left behind


def test_check_writable_refuses_a_missing_folder_a_folder_and_a_read_only_folder(tmp_path):
    with pytest.raises(WriteError, match=r"--json .*missing/out\.json: the folder .*missing does not exist"):
        files.check_writable(tmp_path / "missing" / "out.json", "--json")
    with pytest.raises(WriteError, match="is a folder"):
        files.check_writable(tmp_path, "--json")
    files.check_writable(tmp_path / "out.json", "--json")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(WriteError, match="not writable"):
            files.check_writable(ro / "out.json", "--json")
