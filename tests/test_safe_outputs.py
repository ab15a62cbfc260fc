"""Outputs nobody can clobber or forge: every command that writes (`fit`, `case-from`, `report --html`,
`run --json`, `bless`) writes only regular files, never over one of its inputs, never over an existing
file without --force, takes back what it wrote when it fails, refuses names it cannot hold (empty,
overlong, control characters) with exit 2 and one line, and writes no user text as lines of a script,
a YAML file or a baseline."""

from __future__ import annotations

import argparse
import errno
import json
import os
import stat
from pathlib import Path

import pytest
from hostile import invoke

from harness.baselines.store import BlessError, bless
from harness.measure.records import CaseRun, ErrorInfo, Failure, Memory, RankReport
from harness.spec import outputs as outputs_module
from harness.spec.cases import CASES_DIR, load_case
from harness.spec.files import RefusedOutput, printable, write_atomic
from harness.spec.identity import case_digest, model_name
from harness.spec.outputs import Outputs, check_name
from harness.spec.units import GIB

DATA = Path(__file__).parent / "data"
LONG = "x" * 300  # a name no common file system takes (255 bytes)
INJECTED = "x\ntouch F\n#"  # a file name that would be three lines of a script


def _special(kind: str, path: Path, elsewhere: Path) -> None:
    """Make `path` a `kind` of file that is not a regular one (`elsewhere`: what a link points to)."""
    if kind == "symlink":
        elsewhere.write_text("theirs")
        path.symlink_to(elsewhere)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "device":  # a character device, as /dev/null is (mknod needs the right to make one)
        try:
            os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("this host does not let the tests make a device (mknod)")


def _kind(path: Path) -> str:
    mode = os.lstat(path).st_mode
    return next(k for k, test in (("symlink", stat.S_ISLNK), ("fifo", stat.S_ISFIFO), ("folder", stat.S_ISDIR),
                                  ("device", stat.S_ISCHR), ("file", stat.S_ISREG)) if test(mode))


KINDS = ["symlink", "fifo", "folder", "device"]


def _one_line_refusal(outcome, *names: str) -> None:
    assert outcome.code == 2, (outcome.code, outcome.out, outcome.err)
    lines = [line for line in outcome.err_lines if not line.startswith(("usage:", " ", "["))]  # '[': torch's log
    assert len(lines) == 1, outcome.err
    for name in names:
        assert name in lines[0], f"{name!r} not named in {lines[0]!r}"


# --- the shared writer ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_the_writer_replaces_only_a_regular_file(tmp_path, kind):
    target = tmp_path / "out.json"
    _special(kind, target, tmp_path / "elsewhere.txt")
    with pytest.raises(RefusedOutput, match=r"out\.json: is a .*only a regular file is written"):
        write_atomic(target, "[]")
    assert _kind(target) == kind  # left as it was, not replaced by a plain file
    if kind == "symlink":
        assert (tmp_path / "elsewhere.txt").read_text() == "theirs"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize(("name", "said"), [("", "an empty name"), (LONG, "300 bytes, longer than"),
                                            ("a\nb", "control character \\n"), ("a\x1b[2Jb", "\\x1b"),
                                            ("a\u2028b", "\\u2028")])
def test_a_name_that_cannot_be_an_output_is_refused(name, said):
    with pytest.raises(RefusedOutput, match=r"^--out") as info:
        check_name(name, "--out")
    assert said in str(info.value) and "\n" not in str(info.value)


def test_a_failed_command_leaves_nothing_and_puts_back_what_it_replaced(tmp_path):
    kept = tmp_path / "kept.txt"
    kept.write_text("old")
    with pytest.raises(RuntimeError, match="the work failed"):
        with Outputs(force=True) as out:
            folder = out.folder(tmp_path / "new" / "deeper", "--out")
            out.write(out.file(folder / "a.json", "--out"), "{}")
            out.write(out.file(kept, "--out"), "new")
            assert kept.read_text() == "new"
            raise RuntimeError("the work failed")
    assert kept.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt"]  # no folder, no copy, no temporary


def test_an_earlier_output_removed_comes_back_when_the_command_fails_and_goes_when_it_ends(tmp_path):
    earlier = tmp_path / "x.ds_offload.fitted.json"
    earlier.write_text("earlier")
    with pytest.raises(RuntimeError, match="the work failed"):
        with Outputs(force=True) as out:
            assert out.remove(out.file(earlier, "--out")) and not earlier.exists()
            raise RuntimeError("the work failed")
    assert earlier.read_text() == "earlier" and [p.name for p in tmp_path.iterdir()] == [earlier.name]
    with Outputs(force=True) as out:
        assert out.remove(out.file(earlier, "--out"))
        assert not out.remove(out.file(earlier, "--out"))  # gone already
    assert list(tmp_path.iterdir()) == []  # nothing kept aside either
    with pytest.raises(ValueError, match=r"not named with Outputs\.file"):
        Outputs().remove(earlier)


def test_a_full_disk_while_keeping_the_replaced_file_aside_leaves_it_unchanged(tmp_path, monkeypatch):
    from harness.spec.files import WriteError

    kept = tmp_path / "kept.txt"
    kept.write_text("old")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(outputs_module.shutil, "copy2", full)
    with pytest.raises(WriteError, match=r"kept\.txt: could not be written \(No space left on device\)"):
        with Outputs(force=True) as out:
            out.write(out.file(kept, "--out"), "new")
    assert kept.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["kept.txt"]


def test_a_command_that_writes_nothing_leaves_no_empty_folder_and_one_that_writes_keeps_it(tmp_path):
    with Outputs() as out:
        out.folder(tmp_path / "none", "--out")
    assert not (tmp_path / "none").exists()
    with Outputs() as out:
        path = out.file(out.folder(tmp_path / "some", "--out") / "a.json", "--out")
        out.write(path, "{}")
    assert path.read_text() == "{}" and sorted(p.name for p in path.parent.iterdir()) == ["a.json"]


def test_an_existing_file_an_input_and_two_outputs_of_one_name_are_refused(tmp_path):
    existing = tmp_path / "there.json"
    existing.write_text("mine")
    with pytest.raises(RefusedOutput, match="exists; pass --force to replace it"):
        Outputs().file(existing, "--json")
    with pytest.raises(RefusedOutput, match="is one of this command's inputs"):
        Outputs(force=True, inputs=[tmp_path / "." / "there.json"]).file(existing, "--json")
    out = Outputs()
    out.file(tmp_path / "a.json", "the fitted config")
    with pytest.raises(RefusedOutput, match="the fitted config and the fitted DeepSpeed JSON would both be written"):
        out.file(tmp_path / "a.json", "the fitted DeepSpeed JSON")
    assert existing.read_text() == "mine"


def test_a_loop_of_links_is_refused_as_an_output_not_an_internal_error(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(RefusedOutput, match=r"--json .*a/x\.json: cannot be written \(Too many levels of symbolic"):
        Outputs().file(tmp_path / "a" / "x.json", "--json")
    with pytest.raises(RefusedOutput, match=r"a: is a symbolic link"):
        Outputs(force=True).file(tmp_path / "a", "--json")


def test_a_folder_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    with pytest.raises(RefusedOutput, match=r"--out .*file/sub: cannot write in this folder \(Not a directory\)"):
        Outputs().folder(tmp_path / "file" / "sub", "--out")
    denied = tmp_path / "denied"
    if os.geteuid() != 0:
        denied.mkdir(mode=0o500)
    else:  # root writes anywhere a mode forbids: the folder's refusal, as the operating system gives it
        denied.mkdir()

        def refuse(*args, **kwargs):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

        monkeypatch.setattr(outputs_module.tempfile, "mkstemp", refuse)
    with pytest.raises(RefusedOutput, match=r"denied: cannot write in this folder \(Permission denied\)"):
        Outputs().folder(denied, "--html")


# --- run --json ---------------------------------------------------------------------------------------


@pytest.fixture()
def no_runs(monkeypatch):
    """Any session fails the test: an output must be refused before a case runs."""
    from harness.judge import session

    def refuse(*args, **kwargs):
        raise AssertionError("a session started: the output should have been refused first")

    monkeypatch.setattr(session, "Session", refuse)


@pytest.mark.parametrize("kind", KINDS[:2] + KINDS[3:])  # a folder as --json is refused already (test_results_cli)
def test_run_refuses_a_json_that_is_not_a_regular_file(tmp_path, capsys, no_runs, kind):
    target = tmp_path / "runs.json"
    _special(kind, target, tmp_path / "elsewhere.txt")
    outcome = invoke(["run", "-k", "003-qlora-fix-r16", "--json", target, "--force"], capsys, tmp_path)
    _one_line_refusal(outcome, str(target), "only a regular file is written")
    assert _kind(target) == kind


@pytest.mark.parametrize(("flag", "value", "said"), [
    ("--json", "there.json", "there.json: exists; pass --force to replace it"),
    ("--benchmark-json", "there.json", "there.json: exists; pass --force"),
    ("--json", "", "--json: an empty name"),
    ("--json", LONG, "300 bytes"),
    ("--out", "", "--out: an empty name"),
    ("--html", "", "--html: an empty name"),
    ("--html", "site", "site/index.html: exists; pass --force"),
])
def test_run_refuses_an_output_it_would_clobber_or_cannot_name(tmp_path, capsys, no_runs, flag, value, said):
    (tmp_path / "there.json").write_text("yesterday's runs")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "index.html").write_text("yesterday's report")
    outcome = invoke(["run", "-k", "003-qlora-fix-r16", flag, value], capsys, tmp_path)
    _one_line_refusal(outcome, said)
    assert (tmp_path / "there.json").read_text() == "yesterday's runs"
    assert (tmp_path / "site" / "index.html").read_text() == "yesterday's report"


def test_run_with_force_takes_an_existing_json_and_still_refuses_a_case_file(tmp_path):
    from harness.cli.run import _check_outputs

    (tmp_path / "there.json").write_text("[]")
    args = argparse.Namespace(json=str(tmp_path / "there.json"), benchmark_json=None, html=None, out=None,
                              case_dir=str(CASES_DIR), force=True)
    _check_outputs(args)  # no refusal: --force replaces it
    args.json = str(CASES_DIR / "003-qlora-fix-r16-seq512-gc.yaml")
    with pytest.raises(RefusedOutput, match="is one of this command's inputs"):
        _check_outputs(args)


# --- report --html ------------------------------------------------------------------------------------


@pytest.fixture()
def no_build(monkeypatch):
    """Building the report fails the test: the output must be refused before the inputs are read."""
    from harness.report.html import build

    def refuse(*args, **kwargs):
        raise AssertionError("the report was built: the output should have been refused first")

    monkeypatch.setattr(build, "build_report", refuse)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "folder"])
def test_report_refuses_an_index_that_is_not_a_regular_file(tmp_path, capsys, no_build, kind):
    (tmp_path / "site").mkdir()
    index = tmp_path / "site" / "index.html"
    _special(kind, index, tmp_path / "elsewhere.html")
    outcome = invoke(["report", "--html", tmp_path / "site", "--force"], capsys, tmp_path)
    _one_line_refusal(outcome, str(index), "is a " + {"symlink": "symbolic link", "fifo": "named pipe"}.get(kind, kind))
    assert _kind(index) == kind


@pytest.mark.parametrize(("value", "said"), [("", "--html: an empty name"), (LONG, "300 bytes"),
                                             ("file/site", "cannot write in this folder (Not a directory)"),
                                             ("site", "site/index.html: exists; pass --force to replace it")])
def test_report_refuses_a_folder_it_cannot_write_or_a_page_it_would_clobber(tmp_path, capsys, no_build, value,
                                                                            said):
    (tmp_path / "file").write_text("")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "index.html").write_text("yesterday's report")
    outcome = invoke(["report", "--html", value], capsys, tmp_path)
    _one_line_refusal(outcome, said)
    assert (tmp_path / "site" / "index.html").read_text() == "yesterday's report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "site"]


def test_report_into_a_folder_it_may_not_write_is_one_line(tmp_path, capsys, no_build, monkeypatch):
    denied = tmp_path / "denied"
    if os.geteuid() != 0:
        denied.mkdir(mode=0o500)
    else:  # root writes anywhere a mode forbids: the refusal, as the operating system gives it

        def refuse(*args, **kwargs):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

        denied.mkdir()
        monkeypatch.setattr(outputs_module.tempfile, "mkstemp", refuse)
    outcome = invoke(["report", "--html", denied / "site"], capsys, tmp_path)
    _one_line_refusal(outcome, "denied/site: cannot write in this folder (Permission denied)")
    assert not (denied / "site").exists()


def test_report_with_force_replaces_the_page_and_a_failed_build_leaves_no_folder(tmp_path, capsys, monkeypatch):
    from harness.report.html import build
    from harness.report.html.page import write_page

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "index.html").write_text("yesterday's report")
    monkeypatch.setattr(build, "build_report", lambda folder, *args, **kwargs: write_page(folder, "<p>today</p>"))
    outcome = invoke(["report", "--html", "site", "--force"], capsys, tmp_path)
    assert outcome.code == 0 and (tmp_path / "site" / "index.html").read_text() == "<p>today</p>"

    def fail(folder, *args, **kwargs):
        (Path(folder) / ".predict-cache").mkdir()  # what a build leaves in the folder on its way
        raise BlessError("runs.json: entry 0 is not a run")

    monkeypatch.setattr(build, "build_report", fail)
    outcome = invoke(["report", "--html", "new/site"], capsys, tmp_path)
    _one_line_refusal(outcome, "entry 0 is not a run")
    assert not (tmp_path / "new").exists()


# --- case-from ----------------------------------------------------------------------------------------

LORA = """\
model_name_or_path: {model}
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 16
lora_target: all
dataset: alpaca_en_demo
template: llama3
cutoff_len: 1024
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
bf16: true
"""
CARD = ["--gpu-memory", "24GiB", "--gpus", "1"]


@pytest.fixture()
def lora_config(tmp_path) -> Path:
    path = tmp_path / "configs" / "lora.yaml"
    path.parent.mkdir()
    path.write_text(LORA.format(model=DATA / "llama-3.1-8b"))
    return path


def test_case_from_refuses_a_config_name_that_would_add_lines_to_the_case(tmp_path, capsys, lora_config):
    named = lora_config.with_name("y\nexpect: {outcome: oom}\nclaims: []\n#.yaml")
    named.write_text(lora_config.read_text())
    outcome = invoke(["case-from", named, *CARD, "--out", "cases"], capsys, tmp_path)
    _one_line_refusal(outcome, printable(str(named)), "control character \\n")
    assert not (tmp_path / "cases").exists()


@pytest.mark.parametrize(("out", "said"), [("", "--out: an empty name"), (LONG, "300 bytes")])
def test_case_from_refuses_an_out_it_cannot_name(tmp_path, capsys, lora_config, out, said):
    outcome = invoke(["case-from", lora_config, *CARD, "--out", out], capsys, tmp_path)
    _one_line_refusal(outcome, said)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configs"]  # nothing in the working folder


def test_case_from_refuses_a_linked_case_file_and_its_own_config(tmp_path, capsys, lora_config):
    cases = tmp_path / "cases"
    cases.mkdir()
    _special("symlink", cases / "lora.yaml", tmp_path / "elsewhere.yaml")
    outcome = invoke(["case-from", lora_config, *CARD, "--out", cases, "--force"], capsys, tmp_path)
    _one_line_refusal(outcome, str(cases / "lora.yaml"), "is a symbolic link")
    assert _kind(cases / "lora.yaml") == "symlink" and (tmp_path / "elsewhere.yaml").read_text() == "theirs"

    before = lora_config.read_text()
    outcome = invoke(["case-from", lora_config, *CARD, "--out", lora_config.parent, "--force"], capsys, tmp_path)
    _one_line_refusal(outcome, str(lora_config), "is one of this command's inputs")
    assert lora_config.read_text() == before


def test_a_case_file_header_writes_a_name_as_one_line():
    from types import SimpleNamespace

    from harness.premerge.case_writer import _header

    result = SimpleNamespace(config=SimpleNamespace(training=SimpleNamespace(path=Path("a\nexpect: x.yaml"))))
    lines = _header(result).splitlines()
    assert len(lines) == 2 and all(line.startswith("# ") for line in lines) and "a\\nexpect: x.yaml" in lines[0]


# --- fit ----------------------------------------------------------------------------------------------

FIT = [DATA / "fit" / "001-rung1-zero2.json", "--gpu-memory", "12GiB", "--gpus", "1"]
FIT_LIMIT_S = 180  # the config's import on a busy two-core host; every refusal here comes before the search


def test_fit_never_writes_over_its_training_script(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    script = out / "launch.sh"
    script.write_text('print("the team\'s training script")\n')
    outcome = invoke(["fit", *FIT, "--script", script, "--out", out, "--force"], capsys, tmp_path, FIT_LIMIT_S)
    _one_line_refusal(outcome, str(script), "is one of this command's inputs")
    assert script.read_text() == 'print("the team\'s training script")\n'
    assert sorted(p.name for p in out.iterdir()) == ["launch.sh"]


@pytest.mark.parametrize("force", [False, True])
def test_fit_refuses_an_existing_or_linked_launch_script(tmp_path, capsys, force):
    out = tmp_path / "out"
    out.mkdir()
    if force:  # --force replaces a file, never a link
        _special("symlink", out / "launch.sh", tmp_path / "elsewhere.sh")
    else:
        (out / "launch.sh").write_text("mine")
    outcome = invoke(["fit", *FIT, "--out", out, "--json", *(["--force"] if force else [])], capsys, tmp_path,
                     FIT_LIMIT_S)
    said = "is a symbolic link" if force else "exists; pass --force to replace it"
    _one_line_refusal(outcome, str(out / "launch.sh"), said)
    assert said in json.loads(outcome.out)["error"]
    assert sorted(p.name for p in out.iterdir()) == ["launch.sh"]
    assert (tmp_path / "elsewhere.sh").read_text() == "theirs" if force else (out / "launch.sh").read_text() == "mine"


def test_fit_refuses_a_config_name_that_would_add_lines_to_launch_sh(tmp_path, capsys):
    named = tmp_path / f"{INJECTED}.json"
    named.write_text((DATA / "fit" / "001-rung1-zero2.json").read_text())
    (tmp_path / "ds_z2.json").write_text((DATA / "fit" / "ds_z2.json").read_text())
    outcome = invoke(["fit", named, *FIT[1:], "--out", tmp_path / "out"], capsys, tmp_path, FIT_LIMIT_S)
    _one_line_refusal(outcome, printable(str(named)), "control character \\n")
    assert not (tmp_path / "out").exists() and not (tmp_path / "F").exists()


@pytest.mark.parametrize(("out", "said"), [("", "--out: an empty name"), (LONG, "300 bytes")])
def test_fit_refuses_an_out_it_cannot_name(tmp_path, capsys, out, said):
    outcome = invoke(["fit", *FIT, "--out", out], capsys, tmp_path, FIT_LIMIT_S)
    _one_line_refusal(outcome, said)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def same_names(tmp_path_factory):
    """A TrainingArguments `train.json` naming a DeepSpeed JSON also called `train.json`, in another folder,
    imported once: (the imported config, its knobs, knobs that change the DeepSpeed stage)."""
    from dataclasses import replace

    from harness.fit.knobs import knobs_of
    from harness.premerge.check import run_check
    from harness.premerge.importers import JobSpec

    root = tmp_path_factory.mktemp("same-names")
    (root / "ds").mkdir()
    (root / "ds" / "train.json").write_text((DATA / "fit" / "ds_z2.json").read_text())
    config = json.loads((DATA / "fit" / "001-rung1-zero2.json").read_text()) | {"deepspeed": "ds/train.json"}
    (root / "train.json").write_text(json.dumps(config))
    imported = run_check(root / "train.json", JobSpec(gpus=1, gpu_memory=12 * GIB)).config
    k0 = knobs_of(imported.case)
    return imported, k0, replace(k0, stage=3, micro_batch=1, grad_accum=16)


def test_fit_writes_a_deepspeed_json_named_as_its_config_under_a_name_of_its_own(tmp_path, same_names):
    from harness.fit.writer import write_fitted

    imported, k0, k = same_names
    written = write_fitted(imported, k0, k, tmp_path / "out", deepspeed_arg=None, alloc_env=True)
    assert len(set(written.files)) == 3 and written.deepspeed != written.config
    config = json.loads(written.config.read_text())
    ds = json.loads((written.config.parent / config["deepspeed"]).read_text())
    assert config["deepspeed"] == written.deepspeed.name != written.config.name
    assert ds["zero_optimization"]["stage"] == 3 and "per_device_train_batch_size" not in ds
    assert config["per_device_train_batch_size"] == 1 and "zero_optimization" not in config


def test_fit_takes_back_every_file_when_a_write_fails_and_replaces_only_with_force(tmp_path, same_names,
                                                                                   monkeypatch):
    from harness.fit import writer
    from harness.spec import files

    imported, k0, k = same_names
    out = tmp_path / "out"
    real = files.write_atomic

    def full_at_launch(path, text, root=None):
        if Path(path).name == "launch.sh":
            raise files.WriteError(f"{path}: could not be written (No space left on device)")
        return real(path, text, root)

    monkeypatch.setattr(outputs_module, "write_atomic", full_at_launch)
    with pytest.raises(files.WriteError, match=r"launch\.sh: could not be written"):
        writer.write_fitted(imported, k0, k, out, deepspeed_arg=None, alloc_env=True)
    assert not out.exists()  # the config and DeepSpeed JSON written before it are gone, and the folder
    monkeypatch.undo()

    first = writer.write_fitted(imported, k0, k, out, deepspeed_arg=None, alloc_env=True)
    with pytest.raises(RefusedOutput, match="exists; pass --force"):
        writer.write_fitted(imported, k0, k0, out, deepspeed_arg=None, alloc_env=False)
    assert "PYTORCH_CUDA_ALLOC_CONF" in first.files[-1].read_text()
    again = writer.write_fitted(imported, k0, k0, out, deepspeed_arg=None, alloc_env=False, force=True)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in again.files[-1].read_text()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in again.files)  # no copies left


# --- bless --------------------------------------------------------------------------------------------

CASE = "003-qlora-fix-r32-seq1024-gc"


def _runs(tmp_path: Path, fidelity: str = "real", error: ErrorInfo | None = None, **rank_fields) -> Path:
    case = load_case(CASES_DIR / f"{CASE}.yaml")
    fields = dict(case_id=CASE, fidelity=fidelity, rank=0, world_size=1, platform="cuda",
                  device_name="NVIDIA H100 80GB HBM3", emulated_card_bytes=case.target.card.memory,
                  step=Memory(allocated=int(9 * GIB), reserved=int(9.5 * GIB), device=int(10.5 * GIB)),
                  step_times_s=[9.0, 7.0, 7.0], tokens_per_step=16384, seq_len=1024, micro_batch=1,
                  versions={"torch": "2.11.0"}, error=error)
    run = CaseRun(case_id=CASE, fidelity=fidelity, command=[], returncode=0 if error is None else 1, wall_s=40.0,
                  ranks=[RankReport(**{**fields, **rank_fields})], case_digest=case_digest(case),
                  model=model_name(case))
    path = tmp_path / "runs.json"
    path.write_text(json.dumps([{"case": CASE, "fidelity": fidelity, "run": json.loads(run.model_dump_json()),
                                 "verdicts": []}]))
    return path


@pytest.mark.parametrize(("fields", "named"), [
    ({"device_name": "H100 | fits |\n| forged"}, "platform.device_name"),
    ({"versions": {"torch": "2.11.0\x1b[2J"}}, "platform.versions.torch"),
    ({"host_cpu": "EPYC\n<!--"}, "runs[0].host_cpu"),
])
def test_bless_refuses_control_characters_in_what_it_keeps(tmp_path, capsys, fields, named):
    runs = _runs(tmp_path, **fields)
    outcome = invoke(["bless", runs, "--baselines-dir", tmp_path / "b"], capsys, tmp_path)
    _one_line_refusal(outcome, str(runs), f"field {named}", "control character")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("option", ["--note", "--driver"])
def test_bless_refuses_a_note_or_driver_of_more_than_one_line(tmp_path, capsys, option):
    outcome = invoke(["bless", _runs(tmp_path), "--baselines-dir", tmp_path / "b", option, "ok\n| forged |"], capsys,
                     tmp_path)
    _one_line_refusal(outcome, option, "control character \\n")
    assert not (tmp_path / "b").exists()


def test_bless_into_an_empty_baselines_dir_is_refused(tmp_path, capsys):
    outcome = invoke(["bless", _runs(tmp_path), "--baselines-dir", ""], capsys, tmp_path)
    _one_line_refusal(outcome, "--baselines-dir: an empty name")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs.json"]


def test_bless_of_runs_holding_no_full_size_run_is_refused(tmp_path, capsys):
    runs = _runs(tmp_path, fidelity="tiny", platform="cpu")
    outcome = invoke(["bless", runs, "--baselines-dir", tmp_path / "b"], capsys, tmp_path)
    _one_line_refusal(outcome, str(runs), "no full-size run to bless")
    runs.write_text("[]")
    _one_line_refusal(invoke(["bless", runs, "--baselines-dir", tmp_path / "b"], capsys, tmp_path), "no full-size run")
    assert not (tmp_path / "b").exists()


def test_a_failed_runs_message_is_kept_as_one_line_of_escapes(tmp_path):
    error = ErrorInfo(kind=Failure.oom, message="Traceback ...\n\x1b[31mCUDA out of memory\tTried 2 GiB\n<!--")
    (path,) = bless(_runs(tmp_path, error=error, step=None, step_times_s=[]), root=tmp_path / "b")
    kept = json.loads(path.read_text())["runs"][0]
    assert kept["outcome"] == "oom" and kept["failure"] == "<!--"
    error = ErrorInfo(kind=Failure.oom, message="\x1b[31mCUDA out of memory\tTried 2 GiB")
    (path,) = bless(_runs(tmp_path, error=error, step=None, step_times_s=[]), root=tmp_path / "b", replace=True)
    assert json.loads(path.read_text())["runs"][0]["failure"] == "\\x1b[31mCUDA out of memory\\tTried 2 GiB"
