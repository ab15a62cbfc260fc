"""One figure per claim: the accuracy figures the README and docs/predictor.md give are the ones in the
benchmark files they come from (results/bench-*.txt, results/predictor/errors.json), so a benchmark
rerun that moves a figure fails here until the page says the new one."""

from __future__ import annotations

import re
from pathlib import Path

from harness.predict.margin import ERRORS_FILE, ErrorTable
from harness.report import accuracy

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PREDICTOR = ROOT / "docs" / "predictor.md"
CELL = r"\d+\.\d% / \d+\.\d% \(\d+/\d+\)"  # median / worst (within the bound / runs)
SPACED = CELL.replace(" ", r"\s+")  # as the benchmark file aligns it


def _latest(pattern: str) -> Path:
    found = sorted((ROOT / "results").glob(pattern))
    assert found, f"no results/{pattern}"
    return found[-1]


def _squeeze(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _architecture_summary() -> dict[str, tuple[int, tuple[str, str, str]]]:
    """The benchmark's rows of median / worst error by architecture and suite: label -> (runs, cells)."""
    text = _latest("bench-architectures-*.txt").read_text(encoding="utf-8")
    block = text.split("Absolute error, median / worst", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in block.splitlines()[2:]:
        m = re.match(rf"^\s+(.+?)\s+(\d+)\s+({SPACED})\s+({SPACED})\s+({SPACED})\s*$", line)
        if m:
            rows[_squeeze(m.group(1))] = (int(m.group(2)), tuple(_squeeze(c) for c in m.groups()[2:]))
    return rows


def _table_rows(path: Path) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("| ")]


def test_the_benchmark_summary_is_read():
    rows = _architecture_summary()
    assert rows["the architecture benchmark (*)"][0] == 32
    assert {"gemma-2-2b *", "the guides' models", "every run"} <= set(rows)


def test_the_readme_accuracy_table_is_the_architecture_benchmark_file():
    summary = _architecture_summary()
    which = {"of nine models in no guide": "the architecture benchmark (*)",
             "of the guides' five models": "the guides' models"}
    seen = 0
    for cells in _table_rows(README):
        m = re.match(r"^(\d+) (.+)$", cells[0])
        if not m or m.group(2) not in which:
            continue
        runs, figures = summary[which[m.group(2)]]
        assert int(m.group(1)) == runs, f"README: {cells[0]!r} but the benchmark has {runs} runs"
        for given, measured in zip(cells[1:4], figures, strict=True):
            assert given.startswith(measured), f"README row {cells[0]!r}: {given!r}, the benchmark file: {measured!r}"
        seen += 1
    assert seen == len(which), "the README's accuracy table lost a row"


def test_the_predictor_page_opens_with_the_margins_by_kind_from_the_error_table():
    page = PREDICTOR.read_text(encoding="utf-8")
    first = page.index("\n| ")
    assert page.index("## ") > 0 and page.index("## Measured accuracy") < first
    expected = accuracy.markdown(ErrorTable.read(ERRORS_FILE))
    assert page[first + 1:].startswith(expected + "\n"), (
        "docs/predictor.md's first table differs from results/predictor/errors.json; "
        "paste `python -m harness.report.accuracy` over it")


def test_the_predictor_page_gives_each_architecture_the_benchmark_files_figures():
    summary = _architecture_summary()
    rows = [c for c in _table_rows(PREDICTOR) if re.fullmatch(r"`[^`]+`", c[0]) and len(c) == 6]
    named = {c[0].strip("`"): c for c in rows}
    assert len(named) >= 10
    for label, cells in named.items():
        key = label if label in summary else f"{label} *"
        assert key in summary, f"docs/predictor.md names {label!r}, which the benchmark file does not"
        runs, figures = summary[key]
        assert int(cells[2]) == runs
        assert tuple(cells[3:6]) == figures, f"docs/predictor.md row {label!r}: {cells[3:6]}, the file: {figures}"


def test_the_predictor_page_gives_the_reference_estimators_of_the_benchmark_file():
    text = _latest("bench-architectures-*.txt").read_text(encoding="utf-8")
    block = text.split("Reference estimators", 1)[1]
    bench, every = (dict(re.findall(r"^\s+(deepspeed|accelerate|llamafactory|oom-harness)\s+(.+?)\s+\S+$", part, re.M))
                    for part in block.split("every run", 1))
    names = {"DeepSpeed's model-states estimator": "deepspeed", "accelerate's estimate-memory": "accelerate",
             "LLaMA-Factory's table": "llamafactory", "oom-harness `check`": "oom-harness"}
    rows = {c[0]: c for c in _table_rows(PREDICTOR) if c[0] in names}
    assert len(rows) == 4
    for label, cells in rows.items():
        tool = names[label]
        assert cells[1:5] == bench[tool].split(), f"{label}: {cells[1:5]} against {bench[tool].split()}"
        median_abs, worst, under = every[tool].split()[1:]
        assert cells[5:8] == [median_abs, worst, under], f"{label}, every run: {cells[5:8]}"


def test_the_predictor_page_gives_guide_000_at_full_depth_as_the_benchmark_file():
    text = _latest("bench-predictor-*.txt").read_text(encoding="utf-8")
    block = text.split("guide 000 at full depth", 1)[1]
    predicted = {m.group(1): (m.group(2), m.group(3))
                 for m in re.finditer(r"^\s+(000-\S+)\s+(\d+\.\d\d)\s+(\d+\.\d\d)", block, re.M)}
    assert len(predicted) >= 5
    rows = {c[0].strip("`"): c for c in _table_rows(PREDICTOR) if c[0].strip("`") in predicted}
    assert set(rows) == set(predicted)
    for case, cells in rows.items():
        assert (cells[1], cells[2]) == predicted[case], f"{case}: {cells[1:3]}, the file: {predicted[case]}"
