"""Building the HTML report: read the inputs once, draw every section, write `index.html` into the
report's folder and nothing anywhere else.

    from harness.report.html.build import build_report
    build_report(Path("out"), baselines_dir, case_dir, runs=[Path("runs.json")])
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from harness.report.html import accuracy, claims, depth, peaks, timelines, trend, verdicts
from harness.report.html.inputs import read_inputs
from harness.report.html.page import Section, Table, render, write_page

SECTIONS = (peaks, accuracy, timelines, trend, depth, claims)  # after the verdicts, which lead the page
CACHE = ".predict-cache"  # the predictor's trace cache, inside the report's folder


@contextlib.contextmanager
def _cache_inside(folder: Path):
    """The predictor keeps its traces on disk (harness.predict.trace.trace; by default in the home folder's
    cache): while a report is built they go into a folder inside the report's, removed once the page is
    drawn, so that `report --html` leaves nothing but its page. A cache the user named
    (HARNESS_PREDICT_CACHE, "off" included) is theirs to share between reports, and is used as it is."""
    old = os.environ.get("HARNESS_PREDICT_CACHE")
    if old is not None:
        yield
        return
    cache = Path(folder).resolve() / f"{CACHE}-{os.getpid()}"
    os.environ["HARNESS_PREDICT_CACHE"] = str(cache)
    try:
        yield
    finally:
        os.environ.pop("HARNESS_PREDICT_CACHE", None)
        shutil.rmtree(cache, ignore_errors=True)


def timelines_dir_of(baselines_dir: Path) -> Path:
    """results/timelines beside results/baselines."""
    return Path(baselines_dir).parent / "timelines"


def build_report(folder: Path, baselines_dir: Path, case_dir: Path, runs: list[Path] = (),
                 timeline_dirs: list[Path] | None = None, generated: str | None = None, shifts=()) -> Path:
    """Write the report into `folder` (created where missing) and return the page's path. Raises
    BlessError for a run file that cannot be read, WriteError where the page cannot be written.
    `shifts`: the change points of the runners' histories (harness.judge.changepoints), shown in the
    verdict table."""
    timeline_dirs = [timelines_dir_of(baselines_dir)] if timeline_dirs is None else timeline_dirs
    with _cache_inside(folder):
        inputs = read_inputs(Path(baselines_dir), Path(case_dir), list(runs), timeline_dirs)
    sections = [verdicts.section(inputs, shifts)] + [module.section(inputs) for module in SECTIONS]
    if inputs.skipped:
        sections.append(Section("skipped", "Inputs left out", "Files the report could not use, each with why.",
                                [Table(("file", ), [(s,) for s in inputs.skipped])]))
    sources = [f"baselines in {baselines_dir}", f"cases in {case_dir}"]
    sources += [f"memory timelines in {d}" for d in timeline_dirs]
    sources += [f"runs in {p}" for p in runs]
    return write_page(Path(folder), render(sections, sources, generated))


def report_runs(folder: Path, run_root: Path, baselines_dir: Path, case_dir: Path) -> tuple[bool, str]:
    """The report of the runs just made (every run.json below `run_root`) beside the baselines, for
    `run --html` and `pytest --harness-html`: (written, the line to print). A report that cannot be
    written is a line saying why, never an exception: the runs' verdicts stand on their own."""
    from harness.models.inputs import InputError
    from harness.spec.files import WriteError

    runs = [Path(run_root)] if any(Path(run_root).rglob("run.json")) else []
    try:
        page = build_report(folder, baselines_dir, case_dir, runs)
    except (InputError, WriteError, OSError) as exc:
        return False, f"oom-harness: the HTML report was not written ({' | '.join(str(exc).splitlines())})"
    return True, f"HTML report of these runs: {page}"
