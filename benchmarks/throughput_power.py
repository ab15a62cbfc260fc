"""The measured power of the throughput checks: how often each catches a slowdown of 3, 5 and 10%, and
how often it flags a clean run (docs/baselines.md#power).

On one GPU (default): three cases of different kinds, each on the whole card, in runs that take turns,
clean and slowed by HARNESS_INJECT_DELAY (a delay in backward, harness.runtime.train), until the time
budget is spent. Then, from those runs alone:

- the run-versus-baseline test (harness.judge.stats.run_vs_baseline): each run against the case's
  other clean runs, the noise pooled over the cases' clean runs: false alarms among clean runs,
  detections among slowed ones;
- `compare` (harness.judge.stats.paired): each window of `--pairs` consecutive (clean, slowed) pairs,
  and each window of (clean, clean) pairs, with compare's own verdict rule.

    python benchmarks/throughput_power.py --out "$OUT" --budget-s 420

On a CPU (`--simulate`): the change point detector (harness.judge.changepoints) on simulated nightly
histories: 30 clean nights, then 5 nights after a 5% step, the night-to-night noise drawn at the
run-to-run noise of the repetitions in results/baselines (pooled over configs without CPU-side work,
repetitions of one day and thread count) and at lower levels, with 1 and several runs a night.

    python benchmarks/throughput_power.py --simulate --out results/
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (case, kind): a LoRA (GLA, one process), a QLoRA (guide 003's fix) and a LoRA under ZeRO-3, each on one
# card; measured on the whole card (variant u)
CASES = [("004-gla-plan-c-1proc", "LoRA"), ("003-qlora-fix-r16-seq512-gc", "QLoRA"),
         ("001-ladder-rung3-zero3", "ZeRO-3 LoRA")]
SLOWDOWNS = ("3%", "5%", "10%")
ONE_HOST_RUNS = ROOT / "results" / "runs" / "2026-11-29-h200-throughput-injected-slowdowns.json"


# --- on the GPU ----------------------------------------------------------------------------------


def _one_run(delay: str | None, out: Path, steps: int, label: str, fidelity: str = "real",
             repeat: int = 1) -> list[dict]:
    """One `oom-harness run` of the three cases, each on the whole card (variant u: the speed, not the
    emulated card, is measured), slowed by `delay`; each finished case's tokens/s and step times."""
    from harness.measure.records import CaseRun

    json_path = out / f"{label}.json"
    cmd = [sys.executable, "-m", "harness.cli", "run", "--fidelity", fidelity, "--selected-only",
           "--steps", str(steps), "--out", str(out / label), "--json", str(json_path)]
    if fidelity == "real" and repeat > 1:  # repetitions share the process's start (imports, the zygote)
        cmd += ["--repeat", str(repeat)]
    for case, _ in CASES:
        cmd += ["-k", case]
    if fidelity == "real":
        cmd += ["--variant", "u"]
    env = {**os.environ}
    env.pop("HARNESS_INJECT_DELAY", None)
    if delay:
        env["HARNESS_INJECT_DELAY"] = delay
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    (out / f"{label}.log").write_text(proc.stdout + proc.stderr)
    if not json_path.is_file():
        return []
    found = []
    for entry in json.loads(json_path.read_text()):
        run = CaseRun.model_validate(entry["run"])
        if run.ok and run.case_id in {c for c, _ in CASES}:
            walls = [t for r in run.ranks for t in r.step_times_s[r.warmup_steps:]]
            found.append({"case": run.case_id, "variant": run.variant, "delay": delay or "", "label": label,
                          "tokens_per_s": run.per_card_rate(1),
                          "device_step_s": max((r.device_step_s for r in run.ranks if r.device_step_s), default=None),
                          "wall_step_s": statistics.median(walls) if walls else None})
    return found


def measure(out: Path, budget_s: float, steps: int, fidelity: str = "real", repeat: int = 1) -> list[dict]:
    """Rounds of a clean run and a slowed one (the order alternating), the slowdown cycling 10%, 5%, 3%,
    until the budget ends: a run is started only where the time left holds one as long as the longest."""
    runs, deadline, round_no, longest = [], time.monotonic() + budget_s, 0, 0.0
    while True:
        delay = SLOWDOWNS[::-1][round_no % 3]
        for d in ([None, delay] if round_no % 2 == 0 else [delay, None]):
            if time.monotonic() + longest >= deadline:
                return runs
            started = time.monotonic()
            got = _one_run(d, out, steps, f"r{round_no}-{d or 'clean'}".replace("%", "pc"), fidelity, repeat)
            longest = max(longest, time.monotonic() - started)
            for r in got:
                r["round"] = round_no
                print(json.dumps(r), flush=True)
            runs += got
        round_no += 1


def analyse(runs: list[dict], pairs: int) -> dict:
    from harness.judge.stats import ALPHA, paired, pooled_noise, run_vs_baseline

    out: dict = {"alpha": ALPHA, "cases": {}}
    clean_by_case = {c: [r["tokens_per_s"] for r in runs if r["case"] == c and not r["delay"]] for c, _ in CASES}
    noise = pooled_noise(list(clean_by_case.values()))
    out["noise"] = None if noise is None else {"sigma": noise.sigma, "df": noise.df}
    for case, _ in CASES:
        mine = [r for r in runs if r["case"] == case]
        clean = clean_by_case[case]
        res: dict = {"clean_runs": len(clean)}
        if noise is not None and len(clean) >= 2:
            fa = [run_vs_baseline(x, clean[:i] + clean[i + 1:], noise).slower for i, x in enumerate(clean)]
            res["run_vs_baseline"] = {"false_alarms": sum(fa), "of": len(fa)}
            for d in SLOWDOWNS:
                slowed = [r["tokens_per_s"] for r in mine if r["delay"] == d]
                hits = [run_vs_baseline(x, clean, noise).slower for x in slowed]
                res["run_vs_baseline"][d] = {"detected": sum(hits), "of": len(hits),
                                             "measured_change": (statistics.median(slowed) / statistics.median(clean)
                                                                 - 1) if slowed else None}
        # compare: consecutive (clean, slowed) pairs of a round, in windows of `pairs`
        res["compare"] = {}
        for d in SLOWDOWNS:
            rounds = sorted({r["round"] for r in mine if r["delay"] == d})
            both = []
            for k in rounds:  # a round's clean and slowed repetitions, paired in order
                a = [r["tokens_per_s"] for r in mine if r["round"] == k and not r["delay"]]
                b = [r["tokens_per_s"] for r in mine if r["round"] == k and r["delay"] == d]
                both += list(zip(a, b, strict=False))
            windows = [both[i:i + pairs] for i in range(0, len(both) - pairs + 1, pairs)]
            flagged = [paired([x for x, _ in w], [y for _, y in w]).verdict(0.02) == "lower" for w in windows]
            res["compare"][d] = {"flagged": sum(flagged), "of": len(flagged)}
        cl = [(clean[i], clean[i + 1]) for i in range(0, len(clean) - 1, 2)]
        windows = [cl[i:i + pairs] for i in range(0, len(cl) - pairs + 1, pairs)]
        res["compare"]["clean"] = {"false_alarms": sum(paired([x for x, _ in w], [y for _, y in w]).verdict(0.02)
                                                       in ("lower", "higher") for w in windows), "of": len(windows)}
        out["cases"][case] = res
    return out


# --- the change point detector, simulated -------------------------------------------------------


def measured_noise() -> dict:
    """The run-to-run noise of log tokens/s in results/baselines: repetitions of one config, one day and
    one thread count, configs without CPU-side work (no offload)."""
    from harness.baselines.store import load_baselines
    from harness.judge.regression import cpu_side_work
    from harness.judge.stats import pooled_noise
    from harness.spec.cases import CASES_DIR, load_case

    groups: dict = {}
    for b in load_baselines():
        if cpu_side_work(load_case(CASES_DIR / f"{b.case_id}.yaml")):
            continue
        for r in b.runs:
            if r.outcome == "ok" and r.tokens_per_s_per_gpu and r.cpu_threads:
                key = (b.platform.key, b.case_id, b.variant, r.cpu_threads, r.recorded or b.recorded)
                groups.setdefault(key, []).append(r.tokens_per_s_per_gpu)
    noise = pooled_noise(list(groups.values()))
    quiet = min((statistics.stdev([math.log(v) for v in vs]), k) for k, vs in groups.items() if len(vs) >= 3)
    out = {"pooled_sigma": noise.sigma, "df": noise.df, "groups": noise.groups,
           "quietest_sigma": quiet[0], "quietest": f"{quiet[1][1]} on {quiet[1][0]} at {quiet[1][3]} thread(s)"}
    # the clean runs of one host in one sitting, in blocks between slowed ones (the GPU measurement above)
    if ONE_HOST_RUNS.is_file():
        data = json.loads(ONE_HOST_RUNS.read_text())
        clean = [b["tokens_per_s_per_gpu"] for b in data["blocks"] if not b["delay"]]
        host = pooled_noise(clean)
        out.update(one_host_sigma=host.sigma, one_host_df=host.df,
                   one_host=f"{data['what'].split(' ')[0]} on one {data['platform']['device_name']}, "
                            f"{sum(map(len, clean))} clean runs in {len(clean)} blocks")
    return out


def simulate(sigma: float, per_night: int, trials: int, seed: int, step: float = 0.05, clean: int = 30,
             after: int = 5) -> dict:
    from harness.judge.changepoints import breaks

    rng = random.Random(seed)

    def night(level: float) -> float:
        return statistics.median(level * math.exp(rng.gauss(0, sigma)) for _ in range(per_night))

    alarms = found = 0
    delays = []
    for _ in range(trials):
        quiet = [night(1000.0) for _ in range(clean)]
        alarms += bool(breaks(quiet))
        series = quiet + [night(1000.0 * (1 - step)) for _ in range(after)]
        for n in range(clean + 1, clean + after + 1):
            if any(i >= clean - 1 and a < b for i, b, a in breaks(series[:n])):
                found += 1
                delays.append(n - clean)
                break
    return {"sigma": sigma, "runs_per_night": per_night, "trials": trials,
            "false_alarm_on_30_clean_nights": alarms / trials, "found_within_5_nights": found / trials,
            "median_nights_to_find": statistics.median(delays) if delays else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of the JSON written (default $OUT)")
    p.add_argument("--budget-s", type=float, default=420, help="seconds of runs on the GPU (default 420)")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run (default 6)")
    p.add_argument("--pairs", type=int, default=3, help="pairs per compare (default 3)")
    p.add_argument("--repeat", type=int, default=2,
                   help="repetitions of each case in one `run` (default 2: the process's start is shared)")
    p.add_argument("--simulate", action="store_true", help="the change point detector on simulated histories (CPU)")
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--fidelity", choices=["real", "tiny"], default="real",
                   help="tiny: the same loop on a CPU, to try the script (its speeds say nothing of a GPU)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    if args.simulate:
        noise = measured_noise()
        levels = [noise["pooled_sigma"], noise["quietest_sigma"]] + (
            [noise["one_host_sigma"]] if "one_host_sigma" in noise else []) + [0.02, 0.01]
        rows = [simulate(s, r, args.trials, seed=11) for s in levels for r in (1, 5)]
        result = {"when": stamp, "measured_noise": noise, "simulations": rows}
        (out / "changepoint-power.json").write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result, indent=1))
        return 0
    runs = measure(out, args.budget_s, args.steps, args.fidelity, args.repeat)
    result = {"when": stamp, "cases": CASES, "runs": runs, "analysis": analyse(runs, args.pairs)}
    (out / "throughput-power.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["analysis"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
