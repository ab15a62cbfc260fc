"""Progress while cases run: the phase read from the case's log, the expected time, an updating line
on a terminal and plain lines elsewhere."""

from __future__ import annotations

import io
import json
import time

from harness.baselines.store import load_baselines
from harness.report.progress import Progress, expected_time, phase_of
from harness.spec.suite import BASELINES_DIR

RUN = BASELINES_DIR.parent / "runs" / "2026-11-26-h100-004-plan-c.json"


def _log(folder, case_id, *whats, rank=0):
    path = folder / case_id / "log.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for what in whats:
            f.write(f"[harness.runtime.worker] {case_id} rank {rank} slot 0: {what} (12.3 s)\n")
    return path


def test_the_phase_is_rank_0s_last_line_in_the_newest_log(tmp_path):
    assert phase_of(tmp_path, "003-a") == "starting"
    _log(tmp_path, "003-a", "loaded, 3.10 GiB peak allocated", "engine ready")
    _log(tmp_path, "003-a", "step 1/5 in 2.00 s", rank=1)
    (tmp_path / "003-a" / "log.txt").open("a").write("a line of DeepSpeed's own\n")
    assert phase_of(tmp_path, "003-a") == "engine ready"
    # another case whose id starts with this one's is not this case
    _log(tmp_path, "003-a-longer", "probes")
    assert phase_of(tmp_path, "003-a") == "engine ready"
    time.sleep(0.01)
    _log(tmp_path, "003-a@2r4L", "step 2/5 in 1.50 s")
    assert phase_of(tmp_path, "003-a") == "step 2/5 in 1.50 s (003-a@2r4L)"


def test_expected_time_from_the_previous_run_else_the_baselines_steps(tmp_path):
    baselines = load_baselines(BASELINES_DIR)
    case = "003-qlora-fix-r16-seq512-gc"
    steps = expected_time(case, "real", tmp_path, baselines)
    assert steps is not None and steps.seconds > 0 and "load not included" in steps.source
    assert expected_time(case, "tiny", tmp_path, baselines) is None
    run = json.loads(RUN.read_text())[0]["run"]
    (tmp_path / case).mkdir()
    (tmp_path / case / "run.json").write_text(json.dumps({**run, "wall_s": 321.0}))
    previous = expected_time(case, "tiny", tmp_path, baselines)
    assert previous.seconds == 321.0 and previous.source == "the previous run"


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _watch(stream, tmp_path):
    progress = Progress(stream, interval_s=0.02)
    expected = expected_time("003-qlora-fix-r16-seq512-gc", "real", tmp_path, load_baselines(BASELINES_DIR))
    with progress.case("[2/7] 003-a real", tmp_path, "003-a", expected):
        time.sleep(0.15)
        _log(tmp_path, "003-a", "loaded, 3.10 GiB peak allocated")
        time.sleep(0.15)
        _log(tmp_path, "003-a", "step 1/5 in 2.00 s")
        time.sleep(0.15)
    return stream.getvalue()


def test_plain_lines_where_no_terminal_one_per_phase(tmp_path):
    out = _watch(io.StringIO(), tmp_path)
    lines = out.splitlines()
    assert "\r" not in out
    assert [line.split(": ")[1].split(",")[0] for line in lines] == ["starting", "loaded", "step 1/5 in 2.00 s"]
    assert all(line.startswith("[2/7] 003-a real: ") and "s expected (the baseline's timed steps" in line
               for line in lines)


def test_one_updating_line_on_a_terminal(tmp_path):
    out = _watch(_Terminal(), tmp_path)
    assert "\n" not in out and out.count("\r") > 5
    assert "loaded, 3.10 GiB" in out and "step 1/5" in out
    assert out.endswith("\r") and out.rsplit("\r", 2)[-2].strip() == ""  # cleared for the summary line
