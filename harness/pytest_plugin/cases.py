"""Case tests: every case file of the case folder becomes a test item at each fidelity, selected by markers.

    pytest                      every case at tiny size on the CPU (the default tier)
    pytest -m gpu               every case at full size on the GPUs of this host
    pytest -m dcu               the cases whose target is a Hygon DCU, at full size
    pytest -k 003               the cases whose id contains 003

The plugin (harness.pytest_plugin.plugin) collects the case files itself, so a repository needs
no test file: `harness_case_dir` in its pytest ini (or `--case-dir`) is enough. A malformed case
file is one failing item whose message names the file, the field and the fix; the other cases
still run. A run that fails (OOM, crash, timeout) is a test failure with the numbers, never an
error of the harness.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.judge.session import Session, skip_reason
from harness.pytest_plugin.settings import settings
from harness.report.summary import FINDINGS_TITLE, consulted_line, findings, table, whole_card_line
from harness.runtime import stopping
from harness.runtime.launcher import DEFAULT_TIMEOUT_S
from harness.runtime.run_folder import RunFolder
from harness.spec.cases import CaseError

_SESSION = pytest.StashKey[Session]()

FIDELITIES = ("tiny", "real")


@dataclass(frozen=True)
class CaseParam:
    case_id: str | None
    fidelity: str
    error: CaseError | InvalidFiles | None = None


def _session(config) -> Session:
    if _SESSION not in config.stash:
        # without --harness-run-dir a temporary folder, removed at the end where nothing ran (a
        # --collect-only, every case deselected) or the session was stopped (harness.runtime.run_folder)
        folder = RunFolder(config.getoption("--harness-run-dir"))
        config.add_cleanup(lambda: folder.close(stopped=stopping.stopping()))
        run_dir = str(folder.path)
        if config.getoption("--harness-run-dir") and not _one_worker_runs_the_cases(config):
            # pytest-xdist workers that may each run a case: never two runs in one folder at once
            run_dir = str(Path(run_dir) / config.workerinput["workerid"])
        chosen = settings(config)
        config.stash[_SESSION] = Session(
            case_dir=chosen.case_dir,
            run_root=Path(run_dir),
            baseline_root=chosen.baselines_dir,
            timeout_s=config.getoption("--case-timeout") or DEFAULT_TIMEOUT_S,
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


_PLANNED = pytest.StashKey[list]()
_STARTED = pytest.StashKey[Session]()

# pytest-xdist (`-n 2 --dist loadgroup`) sends every case item to one worker
# (harness.pytest_plugin.xdist_groups): the session that runs them (its background runs, the runs
# one case's claims take from another's) lives in one process.
XDIST_GROUP = "oom-harness-cases"  # harness.pytest_plugin.xdist_groups.GROUP


def _xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def _one_worker_runs_the_cases(config) -> bool:
    """False in a pytest-xdist worker whose items are not grouped (`--dist load`, the default of
    `-n`): each worker would start every selected case in the background, so runs start on demand."""
    return not _xdist_worker(config) or bool(getattr(config.option, "loadgroup", False))


_ERRORS = pytest.StashKey[dict]()

# Invalid case files beyond this many are one failing item, which lists them all: pytest's failure
# summary looks up each failed item's teardown report among every report of the session, so 5,000
# failing items cost it minutes (1,000: 5 CPU-s), where one item listing 5,000 files costs nothing.
MAX_INVALID_ITEMS = 100


def _errors_by_file(config) -> dict[Path, list[CaseError]]:
    """The session's invalid case files by resolved path, made once: each file's collection looks its
    own up (matching every file against every error made collection quadratic in the invalid files:
    5,000 empty case files took over 400 s). Past `MAX_INVALID_ITEMS` files, the next file holds the
    errors of it and of all the files after it."""
    if _ERRORS not in config.stash:
        by_file: dict[Path, list[CaseError]] = {}
        for err in _session(config).errors:
            by_file.setdefault(err.path.resolve(), []).append(err)
        paths = sorted(by_file)
        if len(paths) > MAX_INVALID_ITEMS:
            rest = paths[MAX_INVALID_ITEMS:]
            by_file[rest[0]] = [e for p in rest for e in by_file.pop(p)]
        config.stash[_ERRORS] = by_file
    return config.stash[_ERRORS]


def _invalid_items(collector: CaseFile, case_id: str):
    """The failing items of an invalid case file: one per error, or one for every file past
    `MAX_INVALID_ITEMS` (named after the first of them)."""
    errors = _errors_by_file(collector.config).get(collector.path.resolve(), [])
    files = {e.path for e in errors}
    if len(files) > 1:
        error = InvalidFiles(tuple(errors))
        item = CaseItem.from_parent(collector, name=f"invalid-{case_id}-and-{len(files) - 1}-more",
                                    param=CaseParam(None, "tiny", error))
        item.add_marker(pytest.mark.tiny)
        yield item
        return
    for err in errors:
        item = CaseItem.from_parent(collector, name=f"invalid-{case_id}", param=CaseParam(None, "tiny", err))
        item.add_marker(pytest.mark.tiny)
        yield item


@dataclass(frozen=True)
class InvalidFiles:
    """The invalid case files past `MAX_INVALID_ITEMS`, reported by one item."""

    errors: tuple[CaseError, ...]

    def __str__(self) -> str:
        files = len({e.path for e in self.errors})
        head = (f"{files} more invalid case files (the first {MAX_INVALID_ITEMS} are tests of their own; "
                "these are listed here, each with what is wrong):")
        return "\n".join([head, *(str(e) for e in self.errors)])


class CaseFile(pytest.File):
    """One case file: an item per fidelity, or one failing item naming what is wrong with it."""

    def collect(self):
        session = _session(self.config)
        case_id = self.path.stem
        if case_id in session.cases:
            case = session.cases[case_id][0]
            for fidelity in FIDELITIES:
                item = CaseItem.from_parent(self, name=f"{case_id}-{fidelity}", param=CaseParam(case_id, fidelity))
                for mark in _marks(case, fidelity):
                    item.add_marker(mark)
                if _xdist_worker(self.config):
                    item.add_marker(pytest.mark.xdist_group(XDIST_GROUP))
                yield item
        yield from _invalid_items(self, case_id)


class CaseItem(pytest.Item):
    def __init__(self, *, param: CaseParam, **kwargs):
        super().__init__(**kwargs)
        self.param = param

    def runtest(self) -> None:
        check_case(self.param, _started(self.config))

    def reportinfo(self):
        return self.path, None, f"case {self.name}"


def remember_selected(config, items) -> None:
    """Remember which cases were selected, so their tiny runs can start together. Called last,
    after `-m`/`-k` have deselected: `pytest -m gpu` on a GPU host once started every tiny case in
    the background, on the same GPU and CPUs as the full-size runs it was measuring."""
    config.stash[_PLANNED] = [(item.param.case_id, item.param.fidelity) for item in items
                              if isinstance(item, CaseItem) and item.param.error is None]


def shared_session(config) -> Session:
    """The session the case items judge on: a test that needs a case's run takes it from here, and
    the case item then judges that run instead of running the case a second time. Its background
    runs are not started by this (they start with the first case item)."""
    return _session(config)


def _started(config) -> Session:
    """The session, its selected runs started on first use (never at collection: --collect-only runs nothing)."""
    if _STARTED not in config.stash:
        # one SIGTERM or Ctrl-C from here on kills every job, starts no other and ends the session as
        # interrupted (harness.runtime.stopping); pytest's own handling comes back at the end
        config.add_cleanup(stopping.install())
        session = _session(config)
        if config.getoption("--harness-selected-only"):
            session.selected_only = set(config.stash.get(_PLANNED, []))
        if _one_worker_runs_the_cases(config):
            session.prefetch(config.stash.get(_PLANNED, []), config.getoption("--harness-jobs"))
        config.stash[_STARTED] = session
    return config.stash[_STARTED]


def start_beside(item) -> None:
    """Start the selected tiny runs at a test scheduled with the case items (its parameter id is
    `XDIST_GROUP`, harness.pytest_plugin.xdist_groups) in the pytest-xdist worker that has them: those
    tests come first in the group, and the runs then go on while they do, instead of after them. Only
    there: without xdist such a test runs among every other test of the session, some of which stop
    this process's jobs or replace its zygote."""
    if (_xdist_worker(item.config) and _one_worker_runs_the_cases(item.config)
            and item.nodeid.endswith(f"[{XDIST_GROUP}]") and item.config.stash.get(_PLANNED, None)):
        _started(item.config)


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


def summary(config) -> list[tuple[str, list[str]]]:
    """What the session ran, as (section title, lines), after writing the files the options ask
    for (pytest-benchmark JSON, the HTML report). Made where the cases ran: the test process, or
    the pytest-xdist worker that ran them (the controller prints what its workers send)."""
    if _SESSION not in config.stash:
        return []
    session = config.stash[_SESSION]
    judged = session.judged()
    if not judged:
        return []
    lines = []
    bench_path = config.getoption("--harness-benchmark-json")
    if bench_path:
        from harness.baselines.benchjson import write_benchmark_json

        n = write_benchmark_json(Path(bench_path), session.all_runs(),
                                 {cid: c.launch.procs_per_card for cid, (c, _) in session.cases.items()})
        lines.append(f"oom-harness: {n} benchmarks written to {bench_path} (pytest-benchmark format)")
    lines.append(table(judged))
    consulted = session.consulted()
    if consulted:
        lines.append(consulted_line(consulted, "--harness-selected-only"))
    whole_card = session.whole_card()
    if whole_card:
        lines.append(whole_card_line(whole_card))
    if config.getoption("--harness-html"):
        from harness.report.html.build import report_runs

        _, line = report_runs(Path(config.getoption("--harness-html")), session.run_root, session.baseline_root,
                              session.case_dir)
        lines.append(line)
    sections = [("oom-harness cases", lines)]
    found = findings(judged)
    if found:
        sections.append((f"oom-harness {FINDINGS_TITLE}", [found]))
    return sections


def terminal_summary(terminalreporter, sections: list[tuple[str, list[str]]]) -> None:
    for title, lines in sections:
        terminalreporter.section(title)
        for line in lines:
            terminalreporter.write_line(line)
