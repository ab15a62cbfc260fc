"""The throughput checks: the run-versus-baseline test's false-alarm rate, the change point detector on
a history, the history file, `compare` on arms that differ by an injected delay, and the markdown
report's escaping of forged run records (issue: a `|` and a line break in a device name added a row)."""

from __future__ import annotations

import json
import math
import os
import random
import stat
import sys
from pathlib import Path

import pytest

from harness.baselines import history
from harness.judge import changepoints, stats
from harness.measure.records import CaseRun, Memory, RankReport

GIB = 2**30


def test_the_speed_test_flags_clean_runs_at_its_stated_rate_and_states_its_power():
    rng = random.Random(7)
    noise = stats.Noise(0.02, 40, 10)
    base = [1000 * math.exp(rng.gauss(0, 0.02)) for _ in range(3)]
    clean = [stats.run_vs_baseline(1000 * math.exp(rng.gauss(0, 0.02)), base, noise).slower for _ in range(400)]
    assert sum(clean) / len(clean) < 3 * stats.ALPHA  # about 1 in 100; 3 in 100 allows for the draw
    test = stats.run_vs_baseline(900, base, noise)
    assert test.slower and test.detectable == pytest.approx(0.073, abs=0.002)  # 2% noise: a 7.3% drop is caught
    # the stated power is what the test does: slowdowns of the detectable size are caught ~80% of the time
    size = test.detectable
    caught = [stats.run_vs_baseline(1000 * (1 - size) * math.exp(rng.gauss(0, 0.02)), [1000.0] * 3, noise).slower
              for _ in range(400)]
    assert 0.7 < sum(caught) / len(caught) < 0.9


def test_a_paired_change_has_an_interval_and_a_verdict():
    a = [100.0, 102.0, 99.0, 101.0, 100.5]
    slower = stats.paired(a, [x * 0.95 for x in a[:2]] + [a[2] * 0.951, a[3] * 0.949, a[4] * 0.95])
    assert slower.change == pytest.approx(-0.05, abs=0.001) and slower.low < -0.05 < slower.high
    assert slower.verdict(0.02) == "lower"
    same = stats.paired(a, [x * (1 + d) for x, d in zip(a, (0.002, -0.001, 0.001, -0.002, 0.0), strict=True)])
    assert same.verdict(0.02) == "same"
    assert stats.paired(a[:1], a[:1]).verdict(0.02) == "inconclusive"


def _nights(values, case="c", start=1):
    days = [f"2026-10-{start + i:02d}T02:00:00Z" for i in range(len(values))]
    return [history.Entry(run=f"{days[i]} {case}", recorded=days[i],
                          runner="r", platform="nvidia-h200-x1", case=case, outcome="ok",
                          metrics={"tokens_per_s_per_gpu": v}) for i, v in enumerate(values)]


def test_a_5_percent_step_is_named_within_5_nights_and_30_quiet_nights_raise_nothing():
    rng = random.Random(3)
    quiet = [1000 * math.exp(rng.gauss(0, 0.01)) for _ in range(30)]
    assert changepoints.shifts(_nights(quiet)) == []
    stepped = quiet + [950 * math.exp(rng.gauss(0, 0.01)) for _ in range(5)]
    entries = _nights(stepped)
    (shift,) = changepoints.shifts(entries)
    assert shift.index == 30 and shift.first_run == entries[30].run and shift.worse
    assert shift.change == pytest.approx(-0.05, abs=0.015)
    # new on the night it can first be told; the night after, the same shift is no longer new
    found = [changepoints.new_shifts(entries[:n], {entries[n - 1].run}) for n in range(31, 36)]
    assert sum(len(f) for f in found) == 1
    assert "worse by" in next(f for f in found if f)[0].text()


def test_the_history_appends_lines_and_skips_a_torn_one(tmp_path):
    path = history.history_file(tmp_path / "h", "gpu runner #1")
    assert path.name == "gpu-runner-1.jsonl"
    history.append(path, _nights([1000.0, 1010.0]))
    with open(path, "a") as f:
        f.write('{"format": 1, "run": "torn\n')
    history.append(path, _nights([990.0], start=3))
    warned = []
    entries = history.read(path, warned.append)
    assert [e.metrics["tokens_per_s_per_gpu"] for e in entries] == [1000.0, 1010.0, 990.0]
    assert len(warned) == 1 and f"{path}:3: skipped" in warned[0]


def test_a_full_size_run_appends_to_the_history_and_a_new_shift_fails_it(tmp_path, monkeypatch):
    from harness.judge.session import Session
    from harness.spec.suite import CASES_DIR

    monkeypatch.setenv(history.RUNNER_ENV, "nightly-1")
    s = Session(case_dir=CASES_DIR, run_root=tmp_path / "runs", history_root=tmp_path / "hist")
    case = s.cases["003-qlora-fix-r16-seq512-gc"][0]

    def run(rate):
        rank = RankReport(case_id=case.id, fidelity="real", rank=0, world_size=1, platform="cuda",
                          device_name="NVIDIA H200", step=Memory(allocated=GIB, device=GIB),
                          step_times_s=[5.0, 2048 / rate, 2048 / rate], tokens_per_step=2048)
        return CaseRun(case_id=case.id, fidelity="real", command=[], returncode=0, wall_s=1.0, ranks=[rank])

    rng = random.Random(5)
    verdicts = [s._history(case, [run(1000 * math.exp(rng.gauss(0, 0.01)))]) for _ in range(12)]
    assert all(v.status == "confirmed" for vs in verdicts for v in vs)
    assert verdicts[-1][0].detail.startswith("no new change point over 12 night(s)")
    after = [s._history(case, [run(900 * math.exp(rng.gauss(0, 0.01)))]) for _ in range(5)]
    failed = [v for vs in after for v in vs if v.status == "refuted"]
    assert len(failed) >= 1 and "tokens_per_s_per_gpu worse by" in failed[0].detail
    lines = (tmp_path / "hist" / "nightly-1.jsonl").read_text().splitlines()
    assert len(lines) == 17 and json.loads(lines[0])["case"] == case.id


def test_the_summary_says_a_speed_that_was_not_checked():
    """A check that could not run is no pass: the terminal summary's last column says so."""
    from harness.judge.session import Judgement
    from harness.judge.verdicts import Verdict
    from harness.report.summary import table
    from harness.spec.cases import load_case
    from harness.spec.suite import CASES_DIR

    case = load_case(CASES_DIR / "003-qlora-fix-r16-seq512-gc.yaml")
    run = CaseRun(case_id=case.id, fidelity="real", command=[], returncode=0, wall_s=1.0)
    ok = Verdict("outcome", "confirmed", "fits")
    memory = Verdict("baseline_memory", "confirmed", "")

    def last_cell(against):
        return table([Judgement(case, run, ok, [], [run], None, against)]).splitlines()[2].rsplit("  ", 1)[-1]

    assert last_cell([memory, Verdict("baseline_speed", "not_checkable", "NOT CHECKED: ...")]) == "speed NOT CHECKED"
    assert last_cell([memory, Verdict("baseline_speed", "refuted", "")]).strip() == "speed FAILED"
    assert last_cell([memory, Verdict("baseline_speed", "confirmed", "")]).strip() == "ok"


STAND_IN = '''#!{python}
"""A stand-in for `python -m harness.cli run`: writes a run JSON whose step times are 1 s with 0.5%
noise, lengthened by HARNESS_INJECT_DELAY as the worker's hook would (harness.runtime.train.Delay)."""
import json, os, random, sys
from harness.measure.records import CaseRun, Memory, RankReport
from harness.runtime.train import Delay
args = sys.argv
out = args[args.index("--json") + 1]
delay = Delay(os.environ.get("HARNESS_INJECT_DELAY"))
with open(os.environ["STAND_IN_LOG"], "a") as f:
    f.write(os.environ.get("ARM", "?") + "\\n")
times = [1.0 * (1 + random.gauss(0, 0.005)) * (1 + delay.share) + delay.seconds for _ in range(6)]
rank = RankReport(case_id="003-qlora-fix-r16-seq512-gc", fidelity="real", rank=0, world_size=1, platform="cuda",
                  device_name="NVIDIA H200", step=Memory(allocated=2**30, device=2**30),
                  step_times_s=[5.0, *times], step_device_s=[4.0, *[t * 0.9 for t in times]], tokens_per_step=2048)
run = CaseRun(case_id=rank.case_id, fidelity="real", command=[], returncode=0, wall_s=1.0, ranks=[rank])
json.dump([{{"case": run.case_id, "run": json.loads(run.model_dump_json()), "verdicts": []}}], open(out, "w"))
'''


@pytest.fixture
def stand_in(tmp_path):
    path = tmp_path / "python"
    path.write_text(STAND_IN.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_compare_flags_an_injected_slowdown_and_passes_a_clean_pair(tmp_path, stand_in, monkeypatch, capsys):
    from harness.cli.main import main

    log = tmp_path / "arms.log"
    monkeypatch.setenv("STAND_IN_LOG", str(log))
    common = ["compare", "-k", "003-qlora-fix-r16", "--base-python", str(stand_in), "--python", str(stand_in),
              "--base-env", "ARM=A", "--env", "ARM=B"]
    out = tmp_path / "slow.json"
    assert main([*common, "--repeats", "3", "--env", "HARNESS_INJECT_DELAY=5%", "--json", str(out)]) == 1
    assert log.read_text().split() == ["A", "B", "B", "A", "A", "B"]  # in turns, the order alternating
    rows = {r["metric"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["tokens_per_s"]["verdict"] == "worse" and rows["tokens_per_s"]["change"] == pytest.approx(-0.048,
                                                                                                         abs=0.01)
    assert rows["tokens_per_s"]["low"] < rows["tokens_per_s"]["change"] < rows["tokens_per_s"]["high"]
    assert rows["device_step_s"]["verdict"] == "worse" and rows["per_card_peak"]["verdict"] == "same"
    arms = json.loads(out.read_text())["arms"]  # what each arm ran on, from its runs' records
    assert arms["A"]["device_name"] == arms["B"]["device_name"] == "NVIDIA H200"
    printed = capsys.readouterr().out
    assert "WORSE" in printed and "A (base): NVIDIA H200" in printed and "B (this): NVIDIA H200" in printed
    assert main([*common, "--repeats", "2", "--json", str(out), "--force"]) == 0
    rows = {r["metric"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["tokens_per_s"]["verdict"] in ("same", "inconclusive")


def test_compare_refuses_what_it_would_write_over_before_any_run(tmp_path, stand_in, monkeypatch, capsys):
    """An existing --json, or an --out holding an earlier compare's runs, is refused before any arm runs
    (without it, the first arm's `run` refused its own JSON after starting); --force replaces both."""
    from harness.cli.main import main

    log = tmp_path / "arms.log"
    monkeypatch.setenv("STAND_IN_LOG", str(log))
    common = ["compare", "-k", "003-qlora-fix-r16", "--base-python", str(stand_in), "--python", str(stand_in),
              "--repeats", "2"]
    out, runs = tmp_path / "compare.json", tmp_path / "runs"
    assert main([*common, "--json", str(out), "--out", str(runs)]) == 0
    first = out.read_text()
    assert sorted(p.name for p in runs.glob("pair*.json")) == ["pair1-A.json", "pair1-B.json", "pair2-A.json",
                                                                "pair2-B.json"]
    log.unlink()
    assert main([*common, "--json", str(out)]) == 2
    assert "--json" in capsys.readouterr().err and not log.exists() and out.read_text() == first
    assert main([*common, "--json", str(tmp_path / "other.json"), "--out", str(runs)]) == 2
    err = capsys.readouterr().err
    assert "holds an earlier compare's runs (pair1-A.json, pair1-A.log" in err and "--force" in err
    assert not log.exists()
    assert main([*common, "--json", str(out), "--out", str(runs), "--force"]) == 0
    assert log.read_text().split() == ["?", "?", "?", "?"]


def test_compare_refuses_a_missing_base(tmp_path, capsys):
    from harness.cli.main import main

    assert main(["compare", "-k", "003"]) == 2
    assert "--base-python OLD_VENV/bin/python or --base-checkout DIR" in capsys.readouterr().err
    assert main(["compare", "-k", "003", "--base-checkout", str(tmp_path)]) == 2
    assert "not a checkout of the harness" in capsys.readouterr().err


def _run_entry(device_name: str, detail: str) -> dict:
    rank = RankReport(case_id="003-qlora-fix-r32-seq1024-gc", fidelity="real", rank=0, world_size=1, platform="cuda",
                      device_name=device_name, emulated_card_bytes=int(15.77 * GIB),
                      step=Memory(allocated=10 * GIB, device=10 * GIB), step_times_s=[9.0, 1.0, 1.0],
                      tokens_per_step=2048, seq_len=1024, micro_batch=1)
    run = CaseRun(case_id=rank.case_id, fidelity="real", command=[], returncode=0, wall_s=1.0, ranks=[rank])
    return {"case": run.case_id, "variant": "", "run": json.loads(run.model_dump_json()),
            "verdicts": [{"what": "baseline_speed", "status": "refuted", "quote": "", "detail": detail},
                         {"what": "claim", "status": "refuted", "quote": "", "detail": "the row after it"}]}


def test_a_forged_run_record_adds_no_row_and_hides_none(tmp_path, capsys):
    from harness.cli.main import main

    runs = tmp_path / "runs.json"
    forged = "NVIDIA H100 80GB HBM3 | x | x | fits | 1 GiB |\n| 999-forged | H100 | card | fits (as expected) |"
    runs.write_text(json.dumps([_run_entry(forged, "ok\n\n<!--")]))
    assert main(["report", str(runs)]) == 0
    out = capsys.readouterr().out
    assert "999-forged" in out  # shown, as text
    rows = [line for line in out.splitlines() if line.startswith("| ") and "999-forged" in line]
    assert rows and all("003-qlora-fix-r32-seq1024-gc" in line for line in rows)  # inside the real row's cells
    assert not any(line.startswith("| 999-forged") for line in out.splitlines())
    assert "<!--" not in out and "&lt;!--" in out
    failed = out.split("Verdicts that failed:\n")[1].splitlines()
    assert len(failed) == 2 and failed[1].endswith("[REFUTED] claim: the row after it")


def test_report_html_keeps_the_predictors_cache_in_its_folder(tmp_path, monkeypatch):
    """The predictor writes its traces where harness.predict.trace.trace._cache_dir says (the home folder's
    cache by default): while the report is built, that is inside the report's folder."""
    pytest.importorskip("matplotlib")
    from harness.predict.trace import trace
    from harness.report.html import inputs
    from harness.report.html.build import build_report

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("HARNESS_PREDICT_CACHE", raising=False)
    seen = []

    def predicted(case_json, platform, exclude):
        seen.append(trace._cache_dir())
        raise ValueError("not predicted in this test")

    monkeypatch.setattr(inputs, "_predicted", predicted)
    base = tmp_path / "baselines"
    source = Path("results/baselines/nvidia-h200-x1")
    (base / source.name).mkdir(parents=True)
    for name in ("003-qlora-fix-r16-seq512-gc.json", "004-gla-failing-bs4-2procs.json"):
        (base / source.name / name).write_text((source / name).read_text())
    page = build_report(tmp_path / "out", base, Path("cases"), timeline_dirs=[])
    assert seen and all(d.parent == (tmp_path / "out").resolve() for d in seen)
    assert "HARNESS_PREDICT_CACHE" not in os.environ
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["index.html"]  # the cache went with the build
    text = page.read_text()
    assert text.index('id="verdicts"') < text.index('id="peaks"')
    assert '<tr class="fail"><td>FAIL</td><td>004-gla-failing-bs4-2procs</td>' in text


def test_the_delay_hook_lengthens_each_step_by_its_share():
    import time

    from harness.runtime.train import Delay, DelayError

    assert (Delay("5%").share, Delay("0.02s").seconds, Delay(None).active, Delay("").active) == (0.05, 0.02, False,
                                                                                               False)
    for bad in ("5", "fast", "-3%", "nan%"):
        with pytest.raises(DelayError, match="HARNESS_INJECT_DELAY"):
            Delay(bad)
    delay, synced = Delay("50%"), []
    delay.start()
    t0 = time.perf_counter()
    time.sleep(0.04)  # the step's own work
    delay.spend(0.5, lambda: synced.append(True))  # waits for the device first, then half of the 0.04 s
    time.sleep(0.04)
    delay.spend(0.5, lambda: synced.append(True))
    elapsed = time.perf_counter() - t0
    assert synced == [True, True] and 0.115 <= elapsed < 0.2  # 0.08 s of work, 0.04 s of delay


def test_a_run_without_a_baseline_is_not_checked_in_the_verdict_table(tmp_path, capsys):
    from harness.cli.main import main

    runs = tmp_path / "runs.json"
    entry = _run_entry("NVIDIA A100-SXM4-80GB", "x")
    entry["verdicts"] = []
    runs.write_text(json.dumps([entry]))
    assert main(["report", str(runs)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "[run given]" in line)
    assert row.startswith("| NOT CHECKED | 003-qlora-fix-r32-seq1024-gc [run given] | nvidia-a100-sxm4-80gb-x1 |")
    assert "no baseline of this config on this platform" in row
