"""The pytest surface: the plugin loads through its entry point, stays inert until asked, and turns
each case file into an item per fidelity with markers; a bad file fails alone."""

import contextlib
import importlib.metadata
import shutil

import pytest

from harness.pytest_plugin.settings import settings
from harness.spec import suite
from harness.spec.cases import CASES_DIR

pytest_plugins = ["pytester"]

GOOD = "003-qlora-fix-r16-seq512-gc"


# The two tests that run cases fork their workers from this process's zygote (`shared_zygote`), 6-7
# CPU-s of imports once per process: under `-n 2 --dist loadgroup` this id puts them in the worker of
# the case items, whose zygote is started already (harness.pytest_plugin.xdist_groups.GROUP).
BESIDE_THE_CASES = pytest.mark.parametrize("_beside", [pytest.param(None, id="oom-harness-cases")])


def _case_dir(pytester):
    """A team's folder of case files: no test file, no conftest.py (the entry point loads the plugin)."""
    cases = pytester.mkdir("mycases")
    shutil.copy(CASES_DIR / f"{GOOD}.yaml", cases)
    # the good case claims a lower peak than this one; keep the reference valid
    shutil.copy(CASES_DIR / "003-qlora-fix-r32-seq1024-gc.yaml", cases)
    shutil.copy(CASES_DIR / "003-qlora-failing-bs2-seq2048-r64.yaml", cases)
    bad = (CASES_DIR / f"{GOOD}.yaml").read_text().replace("stage: 3", "").replace(
        "id: 003-qlora-fix-r16-seq512-gc", "id: 003-broken").replace("seq_len: 512", "seq_len: 0")
    (cases / "003-broken.yaml").write_text(bad.replace("micro_batch: 1", "micro_batch: 1\n  gradient_acumulation: 4"))
    return cases


def _configured(pytester, *args):
    """`pytester.parseconfigure`, without the full garbage collection pytest's unraisable-exception
    plugin runs when that config is unconfigured at the test's end, as pytester's own in-process runs
    do: in an xdist worker that has run hundreds of tests it took seconds per config."""
    config = pytester.parseconfigure(*args)
    with contextlib.suppress(ImportError):  # a private key of pytest's (pytester sets it for inline runs)
        from _pytest.unraisableexception import gc_collect_iterations_key

        config.stash[gc_collect_iterations_key] = 0
    return config


def test_the_plugin_is_registered_through_the_pytest11_entry_point():
    found = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="pytest11")}
    assert found.get("oom-harness") == "harness.pytest_plugin.plugin"


def test_the_plugin_is_inert_in_a_project_that_did_not_ask_for_it(pytester):
    _case_dir(pytester)
    pytester.makepyfile(test_own="def test_own():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["plugins: *oom-harness*", "collected 1 item"])  # loaded, and adds nothing
    assert "oom-harness cases" not in result.stdout.str()
    result = pytester.runpytest_inprocess("--help")
    result.stdout.fnmatch_lines(["*--case-dir*", "*--baselines-dir*", "*--premerge-dir*", "*harness_case_dir*"])


def test_a_project_asks_in_its_ini_and_pytest_collects_the_cases_outside_its_testpaths(pytester):
    _case_dir(pytester)
    pytester.mkdir("tests")
    (pytester.path / "tests" / "test_own.py").write_text("def test_own():\n    pass\n")
    pytester.makepyprojecttoml("""
        [tool.pytest.ini_options]
        testpaths = ["tests"]
        harness_case_dir = "mycases"
    """)
    result = pytester.runpytest_inprocess("--collect-only", "-q", "-m", "gpu")
    result.stdout.fnmatch_lines([f"mycases/{GOOD}.yaml::{GOOD}-real"])
    assert f"{GOOD}-tiny" not in result.stdout.str()
    result = pytester.runpytest_inprocess("--collect-only", "-q", "tests")  # paths given: only those
    result.stdout.fnmatch_lines(["tests/test_own.py::test_own", "1 test collected*"])


def test_the_bundled_suite_on_request(pytester):
    result = pytester.runpytest_inprocess("--harness", "--collect-only", "-q", "-m", "tiny")
    collected = {line.rsplit("::", 1)[-1] for line in result.stdout.lines if "::" in line}
    assert collected == {f"{p.stem}-tiny" for p in suite.CASES_DIR.glob("*.yaml")}


def test_folders_come_from_the_command_line_or_relative_to_the_ini_file(pytester, tmp_path, monkeypatch):
    cases = _case_dir(pytester)
    pytester.makeini("[pytest]\nharness_case_dir = mycases\nharness_baselines_dir = perf/baselines\n")
    config = _configured(pytester, )
    chosen = settings(config)
    assert chosen.case_dir == cases.resolve()
    assert chosen.baselines_dir == (pytester.path / "perf" / "baselines").resolve()
    config = _configured(pytester, f"--baselines-dir={tmp_path}")
    assert settings(config).baselines_dir == tmp_path.resolve()
    from harness.pytest_plugin.cases import _session
    from harness.runtime import platform

    # no torch import inside an in-process pytester run (its module snapshot would drop torch half-loaded)
    monkeypatch.setattr(platform, "detect", lambda: platform.Platform.cpu)
    monkeypatch.setattr(platform, "accelerator_count", lambda: 0)
    assert _session(config).baseline_root == tmp_path.resolve()  # what full-size runs are held to


def test_the_bundled_baselines_are_the_default(pytester):
    _case_dir(pytester)
    config = _configured(pytester, "--case-dir", "mycases")
    assert settings(config).baselines_dir == suite.BASELINES_DIR


def test_a_missing_folder_is_a_usage_error_naming_the_option(pytester):
    result = pytester.runpytest_inprocess("--case-dir", "nowhere")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--case-dir / harness_case_dir: no such folder: *nowhere*"])


def test_premerge_items_come_from_the_folders_configs_and_its_sidecar(pytester):
    folder = pytester.mkdir("configs")
    for name in ("003-qwen7b-qlora-fix1.json", "ds_z2_config.json"):
        shutil.copy(suite.EXAMPLE_CONFIGS_DIR / name, folder)
    (folder / "premerge.yaml").write_text(
        "defaults: {gpus: 1, gpu_memory: 16GiB}\nconfigs:\n  gone.yaml: {expect: oom}\n")
    result = pytester.runpytest_subprocess("--premerge-dir", "configs", "-p", "no:cacheprovider", "-rA")
    result.stdout.fnmatch_lines(["PASSED configs/003-qwen7b-qlora-fix1.json::premerge",
                                 "FAILED configs/premerge.yaml::premerge?gone.yaml?*"])
    result.stdout.fnmatch_lines(["*premerge.yaml: configs.gone.yaml: no such training config in *configs"])
    result.assert_outcomes(passed=1, failed=1)  # the DeepSpeed JSON is checked through the config using it


def test_every_case_is_collected_at_each_fidelity_with_its_markers(pytester):
    cases = _case_dir(pytester)
    result = pytester.runpytest_inprocess("--case-dir", str(cases), "--collect-only", "-q", "-m", "gpu")
    result.stdout.fnmatch_lines([f"mycases/{GOOD}.yaml::{GOOD}-real"])
    assert f"{GOOD}-tiny" not in result.stdout.str()
    result = pytester.runpytest_inprocess("--case-dir", str(cases), "--collect-only", "-q", "-m", "tiny")
    result.stdout.fnmatch_lines(["mycases/003-broken.yaml::invalid-003-broken", f"mycases/{GOOD}.yaml::{GOOD}-tiny"])


def test_a_malformed_case_fails_alone_naming_file_field_and_allowed_values(pytester):
    cases = _case_dir(pytester)
    result = pytester.runpytest_inprocess("--case-dir", str(cases), "-k", "invalid", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "003-broken.yaml: invalid case file" in out
    assert "train.gradient_acumulation: unknown key 'gradient_acumulation'; allowed keys here:" in out
    assert "grad_accum" in out
    assert "train.seq_len: Input should be greater than 0" in out


def test_full_size_cases_skip_with_a_reason_and_deselected_tiny_cases_are_not_started_without_a_gpu(pytester,
                                                                                                       tmp_path):
    """Without a GPU, `pytest -m gpu` skips every full-size case, saying why. And it must not prefetch
    the tiny runs it deselected: on a GPU host they would share the card and the CPUs with the
    full-size runs being measured. (One pytest process checks both.)"""
    cases = _case_dir(pytester)
    runs = tmp_path / "runs"
    result = pytester.runpytest_subprocess("--case-dir", str(cases), "-m", "gpu", "-rs", "--harness-run-dir", str(runs),
                                           "-p", "no:cacheprovider")
    result.assert_outcomes(skipped=3)
    result.stdout.fnmatch_lines(["*no GPU: full-size runs need CUDA or ROCm (tiny mode covers this case on CPU)*"])
    assert not (runs / "tiny").exists()


@BESIDE_THE_CASES
def test_a_claim_about_an_unselected_case_runs_it_and_says_so_unless_selected_only(pytester, tmp_path,
                                                                                    shared_zygote, _beside):
    """Fix 3 claims a lower peak than fix 1: selecting fix 3 alone runs fix 1 too (on a GPU, guide
    004's plan A so ran its failing case, minutes of cold compilation), and the summary names it.
    --harness-selected-only runs nothing unselected and leaves the claim unchecked, saying why."""
    cases = _case_dir(pytester)
    args = ["--case-dir", str(cases), "-k", f"{GOOD}-tiny", "-p", "no:cacheprovider", "-rA"]
    result = pytester.runpytest_subprocess(*args, "--harness-run-dir", str(tmp_path / "all"))
    result.assert_outcomes(passed=1)
    fix_1 = "003-qlora-fix-r32-seq1024-gc"
    result.stdout.fnmatch_lines([f"also run, for the claims of the cases above: {fix_1} [[]tiny[]]*"])
    assert (tmp_path / "all" / "tiny" / fix_1).is_dir()
    only = tmp_path / "only"
    result = pytester.runpytest_subprocess(*args, "--harness-run-dir", str(only), "--harness-selected-only")
    result.assert_outcomes(passed=1)
    assert not (only / "tiny" / fix_1).exists()
    assert "also run" not in result.stdout.str()
    from harness.judge.session import Session

    session = Session(case_dir=cases, run_root=only, selected_only={(GOOD, "tiny")})
    lower = next(v for v in session.judge(GOOD, "tiny").claims if v.what == "lower_peak_than")
    assert lower.status == "not_checkable"
    assert f"needs a run of {fix_1}, which was not selected" in lower.detail


@BESIDE_THE_CASES
def test_under_xdist_the_cases_run_in_one_worker_and_are_summed_up_once(pytester, tmp_path, shared_zygote, _beside):
    """`pytest -n 2 --dist loadgroup`: every case item goes to one worker (whose session runs each
    case once, and lends a case's run to another case's claim), and the controller prints the
    table that worker sends. A test scheduled with them (its parameter id) runs in that worker, ahead
    of the case items, and their runs are under way while it runs."""
    pytest.importorskip("xdist")
    cases = pytester.mkdir("tiny_cases")  # collected after test_beside.py: the group's test comes first
    fix_1, failing = "003-qlora-fix-r32-seq1024-gc", "003-qlora-failing-bs2-seq2048-r64"
    for name in (GOOD, fix_1, failing):  # GOOD claims a lower peak than fix 1
        shutil.copy(CASES_DIR / f"{name}.yaml", cases)
    pytester.makepyfile(test_own="import pytest\n\n@pytest.mark.parametrize('n', range(4))\ndef test_own(n):\n"
                                 "    pass\n")
    runs = tmp_path / "runs"
    pytester.makepyfile(test_beside=f"""
        import time
        from pathlib import Path

        import pytest


        @pytest.mark.parametrize("_beside", [pytest.param(None, id="oom-harness-cases")])
        def test_the_case_runs_go_on_meanwhile(_beside):
            started = Path({str(runs / "tiny")!r})
            deadline = time.monotonic() + 120
            while not (started.is_dir() and any(started.iterdir())):
                assert time.monotonic() < deadline, "no case run started while a test beside them ran"
                time.sleep(0.05)
        """)
    result = pytester.runpytest_subprocess("--case-dir", str(cases), "-n", "2", "--dist", "loadgroup", "-m", "not gpu",
                                           "-v", "-p", "no:cacheprovider", "--harness-run-dir", str(runs))
    result.assert_outcomes(passed=8)
    grouped = [line for line in result.stdout.lines if "PASSED tiny_cases/" in line or "PASSED test_beside" in line]
    assert len({line.split()[0] for line in grouped}) == 1, result.stdout.str()  # one worker
    assert "test_beside" in grouped[0], result.stdout.str()  # ahead of the case items
    out = result.stdout.str()
    assert out.count("oom-harness cases") == 1
    result.stdout.fnmatch_lines([f"{name} *tiny*" for name in sorted((GOOD, fix_1, failing))])
    assert "also run" not in out  # GOOD's claim took the run of fix 1's item
    assert sorted(p.name for p in (runs / "tiny").iterdir()) == sorted((GOOD, fix_1, failing))


def test_an_xdist_worker_whose_items_are_not_grouped_runs_cases_on_demand_in_a_folder_of_its_own(pytester, tmp_path,
                                                                                               monkeypatch):
    """`-n 2` without `--dist loadgroup`: every worker may get case items, so none starts every case
    in the background, and each runs into a folder of its own under --harness-run-dir."""
    from harness.judge.session import Session
    from harness.pytest_plugin import cases as plugin_cases

    _case_dir(pytester)
    started = []
    monkeypatch.setattr(Session, "prefetch", lambda self, keys, jobs=None: started.append(keys))
    for grouped, folder in ((False, tmp_path / "runs" / "gw1"), (True, tmp_path / "runs")):
        config = _configured(pytester, "--case-dir", "mycases", "--harness-run-dir", str(tmp_path / "runs"))
        config.workerinput = {"workerid": "gw1"}
        config.option.loadgroup = grouped
        config.stash[plugin_cases._PLANNED] = [(GOOD, "tiny")]
        assert plugin_cases._started(config).run_root == folder
        assert started == ([[(GOOD, "tiny")]] if grouped else [])


def test_a_test_parametrized_with_the_cases_group_id_is_scheduled_with_the_case_items():
    """xdist's node ids keep a parameter id where its marks are lost: a test that takes a case's run
    from the cases' session joins their group by it (and only such a test)."""
    from harness.pytest_plugin.xdist_groups import GROUP, beside_the_cases

    assert beside_the_cases(f"tests/test_launcher.py::test_jobs_sharing_a_card_take_turns_for_their_probes[{GROUP}]")
    assert not beside_the_cases("tests/test_launcher.py::test_jobs_sharing_a_card_take_turns_for_their_probes")
    assert not beside_the_cases("tests/test_fit.py::test_x[oom-harness-cases-2]")
