"""`oom-harness compare --resident`: each arm is one run whose process stays on the card for all the pairs,
the arms training in turns (harness.runtime.turns).

A pair of separate runs pays each arm's start every time: imports, the CUDA context, the model's build
and the warm-up step are 10 s and more of a 15-20 s run of a small model, and the timed steps 3 s. Here
each arm starts once, warms up once (one after the other), then trains `--steps` steps per turn while
the other arm's process waits at a gate, in pairs whose order alternates (A B, B A, ...). Each pair's
figures are its two turns' (medians of the turn's steps); the change and its interval are computed as
for separate runs (harness.cli.compare.summarise). The peak is each arm's whole run's, one figure per arm.

What it does not sample: what differs between two starts of one environment (a kernel an autotuner picks
at start-up from noisy timings, where the allocator's pool lands). A compare of clean arms measures that
too: its false alarms are the rate to expect (docs/baselines.md).

Both arms' processes hold their memory on the card at once, so their peaks together must fit on it.
The compare holds the cards' locks (harness.runtime.card_lock) and passes them to both arms.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from harness.models.inputs import InputError

DEFAULT_BURST = 4  # timed steps per turn, where --steps does not say
WARMUP = 1  # steps before the first turn (a run's first step is its warm-up: harness.spec.shape)
STOP_WAIT_S = 30.0  # for an arm's run to end once told to, before it is killed


def check_resident(args) -> None:
    """One case, and at most one variant, in this checkout's suite (or --case-dir): the turns are one run's."""
    from harness.spec.cases import load_cases
    from harness.spec.suite import CASES_DIR

    if len(args.variant) > 1:
        raise InputError(None, "--variant", "--resident measures one variant",
                         "give one --variant, or run one compare per variant")
    from harness.spec.variants import parse_variant

    folder = Path(args.case_dir) if args.case_dir else CASES_DIR
    cases, _ = load_cases(folder)
    matched = sorted((c for c in cases if any(k in c.id for k in args.k)), key=lambda c: c.id)
    if len(matched) != 1:
        ids = [c.id for c in matched]
        found = ", ".join(ids[:5]) + (", ..." if len(ids) > 5 else "") if ids else "none"
        raise InputError(folder, "-k", f"--resident compares one case; -k {' -k '.join(args.k)} matches "
                                       f"{len(ids)} ({found})",
                         "name one case with -k, or leave out --resident")
    case = matched[0]
    if args.base_checkout and not (Path(args.base_checkout) / "harness" / "runtime" / "turns.py").is_file():
        raise InputError(Path(args.base_checkout), "--base-checkout", "this checkout's harness predates --resident "
                         "(no harness/runtime/turns.py): its runs would not stop between turns",
                         "leave out --resident")
    try:
        variant = parse_variant(args.variant[0] if args.variant else "")
    except ValueError as exc:
        raise InputError(None, "--variant", str(exc), "give a variant `oom-harness run --variant` takes") from None
    if args.fidelity == "real" and case.launch.procs_per_card > 1 and not variant.uncapped:
        # the launcher emulates the target card for processes that share one with a ballast that takes
        # the rest of the card (harness.runtime.launcher): a second arm would find nothing left
        raise InputError(folder / f"{case.id}.yaml", "launch.procs_per_card",
                         f"{case.launch.procs_per_card} processes share an emulated "
                         f"{case.target.card.memory / 2**30:.0f} GiB card: a ballast takes the rest of the real "
                         "card, so a second arm would find none of it",
                         "add --variant u (the whole card, no ballast), or leave out --resident")


def _card_locks(fidelity: str) -> tuple[dict[str, str], tuple[int, ...]]:
    """Hold every card for the compare, and what passes the locks down to the arms' runs."""
    if fidelity != "real":  # tiny runs take no lock (harness.runtime.card_lock)
        return {}, ()
    from harness.runtime import card_lock
    from harness.runtime import platform as plat

    platform = plat.detect()
    try:
        card_lock.take(card_lock.card_keys(platform.value, plat.accelerator_count()))
    except card_lock.CardBusy as exc:
        raise InputError(None, None, str(exc), "wait for the other harness to finish") from None
    return card_lock.pass_down()


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + STOP_WAIT_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def measure_resident(args, arm_a, arm_b, folder: Path) -> list[tuple[dict, dict]]:
    """`args.repeats` pairs of turns of one run per arm: [(A's figures, B's figures), ...]."""
    from harness.cli.compare_figures import figures, finished_runs, log_tail
    from harness.runtime import turns

    burst = args.steps or DEFAULT_BURST
    total = WARMUP + args.repeats * burst
    lock_env, fds = _card_locks(args.fidelity)
    sides = [("A", arm_a), ("B", arm_b)]
    gates = [turns.Arm(folder / f"resident-{key}.turns") for key, _ in sides]
    for gate in gates:
        gate.plan(turns.gates(WARMUP, burst, args.repeats))
    procs, logs, jsons = [], [], []
    try:
        for (key, arm), gate in zip(sides, gates, strict=True):
            label = f"resident-{key}"
            jsons.append(folder / f"{label}.json")
            logs.append(folder / f"{label}.log")
            cmd = arm.command(args, folder / label, jsons[-1], steps=total)
            print(f"compare: {label}: {arm.name}, {args.repeats} turns of {burst} steps", file=sys.stderr, flush=True)
            with open(logs[-1], "wb") as log:
                procs.append(subprocess.Popen(cmd, env={**arm.env, **lock_env, turns.TURNS_ENV: str(gate.folder)},
                                              cwd=arm.cwd, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, pass_fds=fds))

        def exited(i: int) -> str | None:
            code = procs[i].poll()
            return None if code is None else f"its run exited {code} ({log_tail(logs[i])})"

        turns.conduct(gates, WARMUP, burst, args.repeats, exited)
        for (_key, arm), proc, log in zip(sides, procs, logs, strict=True):
            if proc.wait() not in (0, 1):  # 1: a case failed its verdicts, still measured
                raise InputError(None, None, f"arm {arm.name} exited {proc.returncode} ({log_tail(log)})",
                                 f"see {log}")
    except turns.TurnsError as exc:
        raise InputError(None, None, str(exc), "see the arm's log (--out keeps it): an arm ends before its turns "
                                               "where it skipped the case or failed, or where its harness predates "
                                               "--resident (no harness/runtime/turns.py)") from None
    finally:
        _stop(procs)
    per_arm = []
    for (_key, arm), path, log in zip(sides, jsons, logs, strict=True):
        runs = finished_runs(path) if path.is_file() else []
        if len(runs) != 1:
            raise InputError(None, None, f"arm {arm.name} finished {len(runs)} runs, not one ({log_tail(log)})",
                             f"see {log}")
        per_arm.append(runs[0])
    pairs = []
    for i in range(args.repeats):
        first, last = WARMUP + i * burst, WARMUP + (i + 1) * burst
        pair = []
        for run in per_arm:
            ranks = [r.model_copy(update={"step_times_s": r.step_times_s[first:last],
                                          "step_device_s": r.step_device_s[first:last], "warmup_steps": 0})
                     for r in run.ranks]
            name, values = figures(run.model_copy(update={"ranks": ranks}))
            pair.append({name: values})
        pairs.append((pair[0], pair[1]))
    return pairs
