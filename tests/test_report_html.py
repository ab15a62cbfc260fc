"""The HTML report without a browser: what the page holds and escapes, where it is written, how long
series are thinned for drawing, and how the command answers bad input (tests/test_report_browser.py
renders it in Chromium)."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest

from harness.cli.main import main
from harness.report.html.page import Section, Table, render
from harness.report.html.svg import Figure, thinned
from harness.spec.suite import BASELINES_DIR, CASES_DIR

pytest.importorskip("matplotlib", reason="the HTML report draws with matplotlib (the test extra)")

TIMELINES = BASELINES_DIR.parent / "timelines"
HOSTILE = '<script>alert("x")</script><img src=x onerror=alert(1)>'


def test_a_long_series_is_thinned_and_keeps_every_extreme():
    rng = np.random.default_rng(0)
    y = rng.normal(size=500_000).cumsum()
    y[123_457] = y.max() + 50  # a one-action spike: the peak a reader looks for
    y[400_001] = y.min() - 50
    x = np.arange(len(y))
    tx, ty = thinned(x, y)
    assert len(ty) <= 3000
    assert ty.max() == y.max() and ty.min() == y.min()
    assert 123_457 in tx and 400_001 in tx
    assert np.all(np.diff(tx) > 0)  # still in order
    _, short_y = thinned(x[:100], y[:100])
    assert len(short_y) == 100


def test_every_text_on_the_page_is_escaped():
    from harness.report.html.svg import new_figure, to_svg

    fig = new_figure(6, 4)
    ax = fig.add_subplot()
    ax.plot([1, 2], label=HOSTILE)
    ax.set_title(HOSTILE)  # a case id or a message drawn in a plot
    ax.legend()
    svg = to_svg(fig, "k")
    assert svg.startswith("<svg") and 'class="plot"' in svg
    section = Section("s", HOSTILE, HOSTILE, [Figure("k", svg, HOSTILE), Table(("h",), [(HOSTILE,)])])
    page = render([section], [HOSTILE], generated="today")
    assert "<script" not in page and "<img" not in page
    assert page.count("&lt;script&gt;") >= 7


def _small_suite(tmp_path):
    """A baselines folder of one card's single-rank cases and one model's depth series, and two timelines."""
    base = tmp_path / "results" / "baselines"
    shutil.copytree(BASELINES_DIR / "nvidia-h200-x1", base / "nvidia-h200-x1")
    series = base / "nvidia-h200-x2"
    series.mkdir()
    for depth in (4, 8):
        name = f"000-qlora4bit-z2-cutoff512@2r{depth}L2ga.json"
        shutil.copy(BASELINES_DIR / "nvidia-h200-x2" / name, series / name)
    lines = tmp_path / "results" / "timelines" / "nvidia-h200-x1"
    lines.mkdir(parents=True)
    for name in ("001-ladder-rung4-zero3-offload.json.gz", "001-ladder-rung4-zero3-offload@u.json.gz"):
        shutil.copy(TIMELINES / "nvidia-h200-x1" / name, lines / name)
    return base


def test_the_report_draws_every_kind_of_figure_and_writes_only_its_page(tmp_path, capsys):
    base = _small_suite(tmp_path)
    out = tmp_path / "site"
    assert main(["report", "--html", str(out), "--baselines-dir", str(base), "--case-dir", str(CASES_DIR)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["index.html"]  # no temporary file left, nothing else
    page = (out / "index.html").read_text()
    keys = re.findall(r'<figure id="fig-([^"]+)"', page)
    for kind in ("peaks-nvidia-h200-x1", "peaks-nvidia-h200-x2", "accuracy", "timeline-0", "timeline-1",
                 "trend-nvidia-h200-x1", "depth", "claims"):
        assert kind in keys, keys
    assert page.count("<svg") == len(keys)
    assert "001-ladder-rung4-zero3-offload@u" in page and "the largest of the" in page
    assert "extrapolated from 4, 8 layers to 64" in page  # the depth fit, labelled
    assert "NVIDIA H200" in page and "580.159.04" in page  # where it was measured
    # the 478k-action timeline is drawn thinned: its figure stays small
    sizes = [len(m) for m in re.findall(r'<figure id="fig-timeline-\d".*?</figure>', page, re.S)]
    assert max(sizes) < 400_000, sizes
    assert "wrote" in capsys.readouterr().out


def test_a_run_given_is_drawn_beside_the_baselines(tmp_path):
    base = _small_suite(tmp_path)
    out = tmp_path / "site"
    run = BASELINES_DIR.parent / "runs" / "2026-11-26-h100-004-plan-c.json"  # with its verdicts
    assert main(["report", "--html", str(out), "--baselines-dir", str(base), str(run)]) == 0
    page = (out / "index.html").read_text()
    assert "peaks-nvidia-h100-80gb-hbm3-x1" in page  # the run's platform, which no baseline here has
    assert "[run given]" in page and "Verdicts of the runs given" in page


def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys):
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    assert main(["report", "--html", str(a_file)]) == 2
    assert "--html" in capsys.readouterr().err
    out = tmp_path / "site"
    assert main(["report", "--html", str(out), str(tmp_path / "missing.json")]) == 2
    not_runs = tmp_path / "runs.json"
    not_runs.write_text('{"not": "a run"}')
    assert main(["report", "--html", str(out), str(not_runs)]) == 2
    assert "runs.json" in capsys.readouterr().err
    assert not (out / "index.html").exists()


def test_the_runs_just_made_are_reported_from_their_run_folder(tmp_path):
    """What `run --html` and `pytest --harness-html` write: every run.json below the run folder."""
    import json

    from harness.report.html.build import report_runs

    base = _small_suite(tmp_path)
    entry = json.loads((BASELINES_DIR.parent / "runs" / "2026-11-26-h100-004-plan-c.json").read_text())[0]
    run_root = tmp_path / "runs"
    (run_root / "real" / entry["case"]).mkdir(parents=True)
    (run_root / "real" / entry["case"] / "run.json").write_text(json.dumps(entry["run"]))
    ok, line = report_runs(tmp_path / "site", run_root, base, CASES_DIR)
    assert ok and line.endswith("index.html")
    page = (tmp_path / "site" / "index.html").read_text()
    assert f"{entry['case']} [run given]" in page
    # a run folder that is not a run: said in the line, nothing raised
    (run_root / "real" / "x").mkdir()
    (run_root / "real" / "x" / "run.json").write_text("{")
    ok, line = report_runs(tmp_path / "site2", run_root, base, CASES_DIR)
    assert not ok and "not written" in line and "run.json" in line


def test_without_matplotlib_the_html_report_is_refused_with_the_install_line(tmp_path, monkeypatch):
    """A host without the report extra gets exit 2 and the pip line, not a traceback."""
    import importlib.util

    from harness.cli.main import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["report", "--html", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def test_the_bundled_suites_accuracy_includes_the_other_measured_suites_and_a_teams_does_not(tmp_path):
    """Reporting the bundled baselines, the accuracy figure also draws the architecture benchmark's and
    fit's verified configs' runs from the error table; a team's own baselines are drawn alone."""
    from harness.predict.margin import ERRORS_FILE, ErrorTable
    from harness.report.html.inputs import other_suites_of

    others = other_suites_of(BASELINES_DIR)
    assert {o.suite for o in others} == {"architectures", "fitted"}
    table = {(r.case_id, r.variant, r.platform) for r in ErrorTable.read(ERRORS_FILE).records}
    assert all((o.record.case_id, o.record.variant, o.record.platform) in table for o in others)
    assert any(o.name == "phi3-mini-full-z3-offload-mb2-s2048-gc@2ga" for o in others)
    assert other_suites_of(_small_suite(tmp_path)) == []
