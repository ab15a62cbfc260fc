"""The pytest surface: one test per case and fidelity, markers, and a bad file that fails alone."""

import shutil

from harness.spec.cases import CASES_DIR

pytest_plugins = ["pytester"]

GOOD = "003-qlora-fix-r16-seq512-gc"


def _case_dir(pytester):
    cases = pytester.mkdir("mycases")
    shutil.copy(CASES_DIR / f"{GOOD}.yaml", cases)
    # the good case claims a lower peak than this one; keep the reference valid
    shutil.copy(CASES_DIR / "003-qlora-fix-r32-seq1024-gc.yaml", cases)
    shutil.copy(CASES_DIR / "003-qlora-failing-bs2-seq2048-r64.yaml", cases)
    bad = (CASES_DIR / f"{GOOD}.yaml").read_text().replace("stage: 3", "").replace(
        "id: 003-qlora-fix-r16-seq512-gc", "id: 003-broken").replace("seq_len: 512", "seq_len: 0")
    (cases / "003-broken.yaml").write_text(bad.replace("micro_batch: 1", "micro_batch: 1\n  gradient_acumulation: 4"))
    pytester.makepyfile(test_cases="""
        from harness.pytest_plugin.cases import check_case

        def test_case(harness_case, harness_session):
            check_case(harness_case, harness_session)
    """)
    pytester.makeconftest('pytest_plugins = ["harness.pytest_plugin.cases"]')
    return cases


def test_every_case_is_collected_at_each_fidelity_with_its_markers(pytester):
    cases = _case_dir(pytester)
    result = pytester.runpytest_subprocess("--case-dir", str(cases), "--collect-only", "-q", "-m", "gpu")
    result.stdout.fnmatch_lines([f"*test_case?{GOOD}-real?*"])
    assert f"{GOOD}-tiny" not in result.stdout.str()
    result = pytester.runpytest_subprocess("--case-dir", str(cases), "--collect-only", "-q", "-m", "tiny")
    result.stdout.fnmatch_lines([f"*test_case?{GOOD}-tiny?*", "*test_case?invalid-003-broken?*"])


def test_a_malformed_case_fails_alone_naming_file_field_and_allowed_values(pytester):
    cases = _case_dir(pytester)
    result = pytester.runpytest_subprocess("--case-dir", str(cases), "-k", "invalid", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "003-broken.yaml: invalid case file" in out
    assert "train.gradient_acumulation: unknown key 'gradient_acumulation'; allowed keys here:" in out
    assert "grad_accum" in out
    assert "train.seq_len: Input should be greater than 0" in out


def test_full_size_cases_skip_with_a_reason_without_a_gpu(pytester):
    cases = _case_dir(pytester)
    result = pytester.runpytest_subprocess("--case-dir", str(cases), "-m", "gpu", "-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(skipped=3)
    result.stdout.fnmatch_lines(["*no GPU: full-size runs need CUDA or ROCm (tiny mode covers this case on CPU)*"])


def test_deselected_tiny_cases_are_not_started_in_the_background(pytester, tmp_path):
    """`pytest -m gpu` must not prefetch the tiny runs it deselected: on a GPU host they would
    share the card and the CPUs with the full-size runs being measured."""
    cases = _case_dir(pytester)
    runs = tmp_path / "runs"
    result = pytester.runpytest_subprocess("--case-dir", str(cases), "-m", "gpu", "--harness-run-dir", str(runs),
                                           "-p", "no:cacheprovider")
    result.assert_outcomes(skipped=3)
    assert not (runs / "tiny").exists()


def test_a_claim_about_an_unselected_case_runs_it_and_says_so_unless_selected_only(pytester, tmp_path):
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
