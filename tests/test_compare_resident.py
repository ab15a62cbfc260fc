"""`oom-harness compare --resident`: two arms' processes on one card, training in turns
(harness.runtime.turns), with the card's lock passed down to both (harness.runtime.card_lock)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness.runtime import card_lock, turns

ROOT = Path(__file__).resolve().parents[1]

# Runs as an arm's worker would: a gate before each step and after the last, each step logged as it
# starts and ends (two lines, which another arm's step must never come between).
STEPPER = textwrap.dedent("""
    import os, sys, time
    from harness.runtime.turns import Turns
    name, total, log, die_at = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    gate = Turns.from_env(0, 0, 1)
    for step in range(total + 1):
        gate.before_step(step)
        if step == die_at:
            sys.exit(7)
        if step == total:
            break
        with open(log, "a") as f:
            f.write(f"{name} {step} start\\n")
        time.sleep(0.01)
        with open(log, "a") as f:
            f.write(f"{name} {step} end\\n")
""")


def _take_turns(tmp_path, warmup: int, burst: int, bursts: int, die_at: dict[str, int] | None = None) -> Path:
    """Two stepper arms given their turns by `turns.conduct`; the steps' log. Raises what `conduct` raises."""
    script = tmp_path / "stepper.py"
    script.write_text(STEPPER)
    log = tmp_path / "steps.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    gates, procs = [turns.Arm(tmp_path / name) for name in "AB"], []
    total = warmup + burst * bursts
    try:
        for name, gate in zip("AB", gates, strict=True):
            gate.plan(turns.gates(warmup, burst, bursts))
            procs.append(subprocess.Popen([sys.executable, str(script), name, str(total), str(log),
                                           str((die_at or {}).get(name, -1))],
                                          env={**env, turns.TURNS_ENV: str(gate.folder)}))
        turns.conduct(gates, warmup, burst, bursts,
                      lambda i: None if procs[i].poll() is None else f"exited {procs[i].returncode}")
        assert [p.wait(timeout=30) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return log


def test_the_arms_take_turns_that_never_overlap(tmp_path):
    lines = _take_turns(tmp_path, warmup=1, burst=2, bursts=3).read_text().split("\n")[:-1]
    starts, ends = lines[0::2], lines[1::2]
    # each step's end comes right after its start: no other arm's step runs in between
    assert [s.replace("start", "end") for s in starts] == ends
    order = [tuple(s.split()[:2]) for s in starts]
    assert order == [("A", "0"), ("B", "0"),  # the warm-ups, one after the other
                     ("A", "1"), ("A", "2"), ("B", "1"), ("B", "2"),  # pair 1: A B
                     ("B", "3"), ("B", "4"), ("A", "3"), ("A", "4"),  # pair 2: B A
                     ("A", "5"), ("A", "6"), ("B", "5"), ("B", "6")]  # pair 3: A B


def test_an_arm_that_ends_before_its_turn_stops_the_compare(tmp_path):
    with pytest.raises(turns.TurnsError, match="arm B ended before it reached step 2: exited 7"):
        _take_turns(tmp_path, warmup=1, burst=1, bursts=2, die_at={"B": 1})


def test_a_waiting_worker_stops_once_its_compare_has_exited(tmp_path, monkeypatch):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "plan.json").write_text(json.dumps({"gates": [0], "conductor": f"{gone.pid}:0.0"}))
    monkeypatch.setenv(turns.TURNS_ENV, str(tmp_path))
    gate = turns.Turns.from_env(0, 0, 1)
    started = time.monotonic()
    with pytest.raises(turns.TurnsError, match=f"the compare \\(pid {gone.pid}\\) that set this run's turns exited"):
        gate.before_step(0)
    assert time.monotonic() - started < 10
    assert json.loads((tmp_path / "at-rank0-slot0").read_text()) == {"step": 0, "of": 1}


def test_no_turns_without_a_compare_and_a_clear_error_for_a_bad_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(turns.TURNS_ENV, raising=False)
    assert turns.Turns.from_env(0, 0, 1) is None
    monkeypatch.setenv(turns.TURNS_ENV, str(tmp_path))
    with pytest.raises(turns.TurnsError, match=r"no readable plan\.json.*unset it otherwise"):
        turns.Turns.from_env(0, 0, 1)


def test_a_child_harness_uses_the_card_its_parent_holds_for_it(tmp_path, monkeypatch):
    """The compare holds the card; its arms' harnesses take it through the descriptor passed down,
    where any other harness is refused."""
    monkeypatch.setenv(card_lock.LOCK_DIR_ENV, str(tmp_path))
    card_lock.take(["GPU-test"])
    try:
        env, fds = card_lock.pass_down()
        child = textwrap.dedent("""
            from harness.runtime import card_lock
            try:
                card_lock.take(["GPU-test"])
                print("took")
            except card_lock.CardBusy as exc:
                print("busy:", exc)
        """)
        base = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        passed = subprocess.run([sys.executable, "-c", child], env={**base, **env}, pass_fds=fds,
                                capture_output=True, text=True, timeout=60)
        assert passed.stdout.strip() == "took", passed.stderr
        other = subprocess.run([sys.executable, "-c", child], env=base, capture_output=True, text=True, timeout=60)
        assert other.stdout.startswith("busy: card GPU-test is being measured by another harness"), other.stderr
        # the variable alone, without the open descriptor, takes nothing
        forged = subprocess.run([sys.executable, "-c", child], env={**base, **env}, capture_output=True, text=True,
                                timeout=60)
        assert forged.stdout.startswith("busy:"), forged.stderr
    finally:
        card_lock.release()


def test_resident_compare_refuses_more_than_one_case(capsys, tmp_path):
    from harness.cli.main import main

    assert main(["compare", "-k", "003", "--base-python", sys.executable, "--resident"]) == 2
    err = capsys.readouterr().err
    assert "--resident compares one case" in err and "leave out --resident" in err
    # processes sharing an emulated card: the ballast leaves no room for the second arm
    assert main(["compare", "-k", "004-gla-failing-bs4", "--base-python", sys.executable, "--resident"]) == 2
    err = capsys.readouterr().err
    assert "004-gla-failing-bs4-2procs.yaml: launch.procs_per_card: 2 processes share an emulated 24 GiB card" in err
    assert "add --variant u" in err
    # an older checkout's runs would train straight through the turns
    old = tmp_path / "old"
    (old / "harness" / "cli").mkdir(parents=True)
    (old / "harness" / "cli" / "main.py").write_text("")
    assert main(["compare", "-k", "003-qlora-fix-r16-seq512", "--base-checkout", str(old), "--resident"]) == 2
    assert "predates --resident (no harness/runtime/turns.py)" in capsys.readouterr().err


def test_resident_compare_pairs_the_turns_of_one_run_per_arm(tmp_path, capsys, monkeypatch):
    """Real tiny workers: each arm is one run (a warm-up step, then one step per turn), and each pair's
    figures are its two turns'. Whether a CPU's noise lets two pairs call the slowdown significant is not
    asserted (a loaded CI machine's steps vary by more than the delay); the verdicts' logic is tested with
    a stand-in (test_throughput_checks.py) and the detection rate measured on a GPU (docs/baselines.md)."""
    import statistics

    from harness.cli.main import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out, runs = tmp_path / "compare.json", tmp_path / "runs"
    code = main(["compare", "-k", "003-qlora-fix-r16-seq512", "--fidelity", "tiny", "--base-python", sys.executable,
                 "--resident", "--repeats", "2", "--steps", "1", "--env", "HARNESS_INJECT_DELAY=0.5s",
                 "--json", str(out), "--out", str(runs)])
    result = json.loads(out.read_text())
    rows = {r["metric"]: r for r in result["rows"]}
    assert code == (1 if any(r["verdict"] == "worse" for r in result["rows"]) else 0)
    assert result["resident"] and rows["tokens_per_s"]["pairs"] == 2
    for arm in "AB":  # one run per arm, of the warm-up and both turns
        (entry,) = json.loads((runs / f"resident-{arm}.json").read_text())
        (rank,) = entry["run"]["ranks"]
        steps = rank["step_times_s"]
        assert len(steps) == 3 and (rank["injected_delay"] == "0.5s") == (arm == "B")
        assert arm == "A" or min(steps) >= 0.5  # the delay is in every step of B's one run
        # the arm's figure: the median over its turns (one step each) of each turn's rate
        turns = [rank["tokens_per_step"] / t for t in steps[1:]]
        assert rows["tokens_per_s"][arm.lower()] == pytest.approx(statistics.median(turns))
    printed = capsys.readouterr().out
    assert "turns of one process per arm" in printed
    from importlib.metadata import version

    for key in "AB":  # what each arm ran on: this interpreter's libraries, on the CPU
        assert result["arms"][key]["device_name"] == "cpu"
        assert result["arms"][key]["versions"]["torch"] == version("torch")
        assert f"torch {version('torch')}" in printed
        assert result["arms"][key]["versions"]["triton"] == version("triton")  # the kernels' compiler, too
        assert f"triton {version('triton')}" in printed
