"""The pytest plugin: every case file becomes a test at each fidelity, selected by markers.

    pytest                      every case at tiny size on the CPU (the default tier)
    pytest -m gpu               every case at full size on the GPUs of this host
    pytest -m dcu               the cases whose target is a Hygon DCU, at full size
    pytest -k 003               one guide's cases

Loaded from the project's conftest.py. A malformed case file is one failing test whose message
names the file, the field and the fix; the other cases still run. A run that fails (OOM, crash,
timeout) is a test failure with the numbers, never an error of the harness.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.judge.session import Session, skip_reason
from harness.report.summary import FINDINGS_TITLE, consulted_line, findings, table, whole_card_line
from harness.runtime.launcher import DEFAULT_TIMEOUT_S
from harness.spec.cases import CASES_DIR, CaseError

_SESSION = pytest.StashKey[Session]()

FIDELITIES = ("tiny", "real")


@dataclass(frozen=True)
class CaseParam:
    case_id: str | None
    fidelity: str
    error: CaseError | None = None


def pytest_addoption(parser):
    group = parser.getgroup("oom-harness")
    group.addoption("--case-dir", default=str(CASES_DIR), help="folder of case files (default: cases/)")
    group.addoption("--harness-run-dir", default=None,
                    help="where workers write their reports (default: a temporary folder)")
    group.addoption("--case-timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per case run")
    group.addoption("--harness-steps", type=int, default=None, help="optimizer steps per case run")
    group.addoption("--harness-jobs", type=int, default=None,
                    help="training processes at once for tiny runs (default: one per CPU core)")
    group.addoption("--harness-full-depth", action="store_true",
                    help="measure cases with depth_points at full depth (a host that holds them)")
    group.addoption("--harness-grad-accum-cap", type=int, default=None,
                    help="full-size runs accumulate at most N micro steps (peaks do not change past 2)")
    group.addoption("--harness-benchmark-json", default=None,
                    help="write full-size throughput in pytest-benchmark's JSON format to this file")
    group.addoption("--harness-wait-for-card", type=float, default=0.0, metavar="SECONDS",
                    help="wait up to this long for a card another harness is measuring (default: refuse at once; "
                         "the full-size runs then fail as card_busy, naming the other harness)")
    group.addoption("--harness-selected-only", action="store_true",
                    help="run only the selected cases: a claim about another case (a fix's peak against its "
                         "failing config, a family's speed order) is not checkable instead of running it")


def _session(config) -> Session:
    if _SESSION not in config.stash:
        run_dir = config.getoption("--harness-run-dir") or tempfile.mkdtemp(prefix="oom-harness-")
        config.stash[_SESSION] = Session(
            case_dir=Path(config.getoption("--case-dir")),
            run_root=Path(run_dir),
            timeout_s=config.getoption("--case-timeout"),
            steps=config.getoption("--harness-steps"),
            full_depth=config.getoption("--harness-full-depth"),
            grad_accum_cap=config.getoption("--harness-grad-accum-cap"),
            wait_for_card_s=config.getoption("--harness-wait-for-card"),
        )
    return config.stash[_SESSION]


def _marks(case, fidelity: str) -> list:
    if fidelity == "tiny":
        return [pytest.mark.tiny]
    marks = [pytest.mark.gpu]
    if case.launch.ranks > 1:
        marks.append(pytest.mark.multigpu)
    if case.target.card.vendor == "hygon":
        marks.append(pytest.mark.dcu)
    return marks


def pytest_generate_tests(metafunc):
    if "harness_case" not in metafunc.fixturenames:
        return
    session = _session(metafunc.config)
    params = []
    for case_id, (case, _) in sorted(session.cases.items()):
        for fidelity in FIDELITIES:
            params.append(pytest.param(CaseParam(case_id, fidelity), id=f"{case_id}-{fidelity}",
                                       marks=_marks(case, fidelity)))
    for err in session.errors:
        params.append(pytest.param(CaseParam(None, "tiny", err), id=f"invalid-{err.path.stem}",
                                   marks=[pytest.mark.tiny]))
    metafunc.parametrize("harness_case", params)


_PLANNED = pytest.StashKey[list]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Remember which cases were selected, so their tiny runs can start together. Last, after
    `-m`/`-k` have deselected: `pytest -m gpu` on a GPU host once started every tiny case in the
    background, on the same GPU and CPUs as the full-size runs it was measuring."""
    config.stash[_PLANNED] = [
        (item.callspec.params["harness_case"].case_id, item.callspec.params["harness_case"].fidelity)
        for item in items
        if hasattr(item, "callspec") and "harness_case" in item.callspec.params
        and item.callspec.params["harness_case"].error is None
    ]


@pytest.fixture(scope="session")
def harness_session(request) -> Session:
    session = _session(request.config)
    if request.config.getoption("--harness-selected-only"):
        session.selected_only = set(request.config.stash.get(_PLANNED, []))
    session.prefetch(request.config.stash.get(_PLANNED, []), request.config.getoption("--harness-jobs"))
    return session


def check_case(param: CaseParam, session: Session) -> None:
    """Run one case at one fidelity and fail the test with the findings if any verdict is refuted."""
    if param.error is not None:
        pytest.fail(str(param.error), pytrace=False)
    case, _ = session.cases[param.case_id]
    reason = skip_reason(case, param.fidelity, session.platform, session.accelerators)
    if reason:
        pytest.skip(reason)
    judgement = session.judge(param.case_id, param.fidelity)
    if judgement.failed:
        lines = [f"{case.id} [{param.fidelity}] {case.title}"]
        lines += ["  " + v.line() for v in judgement.verdicts]
        err = judgement.run.first_error()
        if err is not None:
            lines.append(f"  run: {err.kind.value} in {err.phase or 'launch'}; "
                         f"reports and log in {judgement.run.run_dir}")
        pytest.fail("\n".join(lines), pytrace=False)
    if param.fidelity == "real" and judgement.outcome.status == "not_checkable":
        # measured on fewer ranks or layers, where the result does not carry over to the case
        pytest.skip(f"inconclusive here: {judgement.outcome.detail}")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _SESSION not in config.stash:
        return
    session = config.stash[_SESSION]
    judged = session.judged()
    if not judged:
        return
    bench_path = config.getoption("--harness-benchmark-json")
    if bench_path:
        from harness.baselines.benchjson import write_benchmark_json

        n = write_benchmark_json(Path(bench_path), session.all_runs(),
                                 {cid: c.launch.procs_per_card for cid, (c, _) in session.cases.items()})
        terminalreporter.write_line(f"oom-harness: {n} benchmarks written to {bench_path} (pytest-benchmark format)")
    terminalreporter.section("oom-harness cases")
    terminalreporter.write_line(table(judged))
    consulted = session.consulted()
    if consulted:
        terminalreporter.write_line(consulted_line(consulted, "--harness-selected-only"))
    whole_card = session.whole_card()
    if whole_card:
        terminalreporter.write_line(whole_card_line(whole_card))
    found = findings(judged)
    if found:
        terminalreporter.section(f"oom-harness {FINDINGS_TITLE}")
        terminalreporter.write_line(found)
