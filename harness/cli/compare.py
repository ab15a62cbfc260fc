"""`oom-harness compare`: one set of cases under two environments, measured in turns on the same host and
cards, each metric's change with its confidence interval and a verdict: the check before upgrading
transformers, DeepSpeed or a driver.

    oom-harness compare -k 003-qlora-fix --fidelity real --base-python OLD_VENV/bin/python --repeats 5
    oom-harness compare -k 003 --base-checkout ../main-before --repeats 5

Arm A is the base (`--base-python`, `--base-checkout`: an older checkout's `harness` run by this
interpreter, or both), arm B this environment. The arms run `oom-harness run` one after the other,
in pairs whose order alternates (A B, B A, A B, ...), so that a drift of the host over the minutes
(heat, another job) falls on both arms alike. Each pair gives each arm's tokens/s, device step time,
wall step time and per-card peak; the change from A to B is the geometric mean of the pairs' ratios,
with its 95% interval from a paired t test (harness.judge.stats.paired). A metric is worse where the
test rejects no change at `stats.COMPARE_ALPHA` and the change is beyond `--threshold`; the command
then exits 1. Exit 2 for a usage error or an arm that could not run.

With `--resident` (harness.cli.compare_resident) each arm is one run for all the pairs, its process kept
on the card, the two arms training in turns: the same pairs and statistics without each pair's start.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from harness.cli.arguments import fraction, positive_int
from harness.models.inputs import InputError

# metric -> (whether higher is better, how to print a value)
METRICS = {
    "tokens_per_s": (True, lambda v: f"{v:,.0f}"),
    "device_step_s": (False, lambda v: f"{v:.4f} s"),
    "wall_step_s": (False, lambda v: f"{v:.4f} s"),
    "per_card_peak": (False, lambda v: f"{v / 2**30:.3f} GiB"),
}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("compare", help="measure cases under two environments in turns; report each "
                                              "metric's change with its interval")
    p.add_argument("-k", action="append", required=True,
                   help="the cases whose id contains this (repeatable), as `run -k` selects them")
    p.add_argument("--base-python", help="the interpreter of arm A (an older virtual environment's bin/python)")
    p.add_argument("--base-checkout", help="a checkout of the harness whose code arm A runs (PYTHONPATH)")
    p.add_argument("--python", help="the interpreter of arm B (default: the one running this command)")
    p.add_argument("--base-env", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable of arm A only (repeatable)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable of arm B only (repeatable), e.g. HARNESS_INJECT_DELAY=5%%")
    p.add_argument("--repeats", type=positive_int, default=5, help="pairs of runs (default 5)")
    p.add_argument("--resident", action="store_true",
                   help="one run per arm for all the pairs: each arm's process stays on the card and the arms "
                        "train in turns, a burst of --steps steps each (default 4); one case and variant, and both "
                        "arms' peaks must fit on the card together")
    p.add_argument("--fidelity", choices=["tiny", "real"], default="real")
    p.add_argument("--steps", type=positive_int,
                   help="optimizer steps of each run (the cases' own by default); with --resident, of each turn")
    p.add_argument("--variant", action="append", default=[],
                   help="measure under this variant, as `run --variant` does ('u': the whole card; repeatable)")
    p.add_argument("--case-dir", help="the folder of the case files, for both arms (default: each arm's bundled "
                                      "suite)")
    p.add_argument("--threshold", type=fraction, default=0.02,
                   help="the smallest change that counts, as a fraction (default 0.02: 2%%)")
    p.add_argument("--out", help="keep each run's folder and JSON here (default: a temporary folder, removed)")
    p.add_argument("--json", help="write the comparison to this JSON file")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --json, and an earlier compare's runs in --out (without it, both are "
                        "refused before any run)")
    p.set_defaults(func=run)


def _pairs(text: list[str], option: str) -> dict[str, str]:
    out = {}
    for item in text:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InputError(None, option, f"'{item}' is not KEY=VALUE", f"write {option} NAME=VALUE")
        out[key] = value
    return out


@dataclass(frozen=True)
class Arm:
    name: str  # "A (base)" or "B (this environment)"
    python: str
    env: dict[str, str]
    cwd: str | None = None

    def command(self, args, out: Path, json_path: Path, steps: int | None = None) -> list[str]:
        cmd = [self.python, "-m", "harness.cli", "run", "--fidelity", args.fidelity, "--out", str(out),
               "--json", str(json_path), "--selected-only"]
        for k in args.k:
            cmd += ["-k", k]
        if steps or args.steps:
            cmd += ["--steps", str(steps or args.steps)]
        for v in args.variant:
            cmd += ["--variant", v]
        if args.case_dir:
            cmd += ["--case-dir", str(Path(args.case_dir).resolve())]
        if args.force:  # an earlier compare's run of this pair in --out, which `check_outputs` let through
            cmd.append("--force")
        return cmd


def arms(args) -> tuple[Arm, Arm]:
    if not args.base_python and not args.base_checkout:
        raise InputError(None, "--base-python", "compare needs a base environment to compare with",
                         "pass --base-python OLD_VENV/bin/python or --base-checkout DIR")
    python = args.base_python or sys.executable
    if not Path(python).is_file():
        raise InputError(Path(python), "--base-python", "no such interpreter",
                         "name a virtual environment's bin/python")
    from harness.runtime.zygote import SOCKET_ENV

    # each arm forks its workers from a zygote of its own code, never from one this process shares
    env_a = {k: v for k, v in os.environ.items() if k != SOCKET_ENV}
    cwd = None
    if args.base_checkout:
        checkout = Path(args.base_checkout).resolve()
        if not (checkout / "harness" / "cli" / "main.py").is_file():
            raise InputError(checkout, "--base-checkout", "not a checkout of the harness (no harness/cli/main.py)",
                             "name the folder a `git clone` or `git worktree add` of the harness made")
        env_a["PYTHONPATH"] = os.pathsep.join([str(checkout), *filter(None, [env_a.get("PYTHONPATH")])])
        cwd = str(checkout)
    env_a.update(_pairs(args.base_env, "--base-env"))
    env_b = {k: v for k, v in os.environ.items() if k != SOCKET_ENV}
    env_b.update(_pairs(args.env, "--env"))
    python_b = args.python or sys.executable
    if not Path(python_b).is_file():
        raise InputError(Path(python_b), "--python", "no such interpreter", "name a virtual environment's bin/python")
    return Arm("A (base)", python, env_a, cwd), Arm("B (this environment)", python_b, env_b)


def _figures(json_path: Path) -> dict[str, dict[str, float]]:
    """case[@variant] -> metric -> value, of each finished run in a `run --json` file."""
    from harness.cli.compare_figures import figures, finished_runs

    return dict(figures(run) for run in finished_runs(json_path))


def _run_arm(arm: Arm, args, folder: Path, label: str) -> dict[str, dict[str, float]]:
    json_path = folder / f"{label}.json"
    cmd = arm.command(args, folder / label, json_path)
    print(f"compare: {label}: {arm.name}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, env=arm.env, cwd=arm.cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, stdin=subprocess.DEVNULL)
    log = folder / f"{label}.log"
    log.write_text(proc.stdout)
    if proc.returncode not in (0, 1) or not json_path.is_file():  # 1: a case failed its verdicts, still measured
        from harness.cli.compare_figures import log_tail

        raise InputError(None, None, f"arm {arm.name} exited {proc.returncode} in {label} ({log_tail(log)})",
                         f"run `{' '.join(cmd)}` to see why")
    return _figures(json_path)


def measure(args, arm_a: Arm, arm_b: Arm, folder: Path) -> list[tuple[dict, dict]]:
    """`args.repeats` pairs, the order alternating: [(A's figures, B's figures), ...]."""
    pairs = []
    for i in range(args.repeats):
        order = [("A", arm_a), ("B", arm_b)] if i % 2 == 0 else [("B", arm_b), ("A", arm_a)]
        got = {key: _run_arm(arm, args, folder, f"pair{i + 1}-{key}") for key, arm in order}
        pairs.append((got["A"], got["B"]))
    return pairs


def summarise(pairs: list[tuple[dict, dict]], threshold: float) -> list[dict]:
    """One row per case and metric: each arm's median, the change with its interval, the verdict."""
    from harness.judge.stats import paired

    rows = []
    names = sorted({n for a, b in pairs for n in a.keys() & b.keys()})
    for name in names:
        for metric, (higher_better, _) in METRICS.items():
            both = [(a[name][metric], b[name][metric]) for a, b in pairs
                    if metric in a.get(name, {}) and metric in b.get(name, {})]
            if not both:
                continue
            xa, xb = [x for x, _ in both], [y for _, y in both]
            change = paired(xa, xb)
            direction = change.verdict(threshold)
            verdict = {"lower": "worse" if higher_better else "better",
                       "higher": "better" if higher_better else "worse"}.get(direction, direction)
            rows.append({"case": name, "metric": metric, "a": statistics.median(xa), "b": statistics.median(xb),
                         "change": change.change, "low": change.low, "high": change.high, "p": change.p,
                         "pairs": change.pairs, "verdict": verdict})
    return rows


def table(rows: list[dict]) -> str:
    from harness.report.columns import aligned

    cells = [("case", "metric", "A (base)", "B (this)", "change B vs A [95% interval]", "verdict")]
    for r in rows:
        show = METRICS[r["metric"]][1]
        interval = (f"{r['change']:+.1%} [{r['low']:+.1%}, {r['high']:+.1%}]" if r["pairs"] > 1
                    else f"{r['change']:+.1%} (one pair: no interval)")
        cells.append((r["case"], r["metric"], show(r["a"]), show(r["b"]), interval,
                      r["verdict"].upper() if r["verdict"] == "worse" else r["verdict"]))
    return aligned(cells)


def check_outputs(args) -> None:
    """Refuse, before any run, what the command would write over or could not write: an existing --json
    without --force (or one that cannot be written), an --out that is a file, or an --out holding an
    earlier compare's runs without --force (each arm's `run` would refuse its JSON after the pairs before
    it had run)."""
    from harness.spec.files import RefusedOutput, check_writable
    from harness.spec.outputs import check_name, check_output

    if args.json is not None:
        check_writable(check_output(args.json, "--json", force=args.force), "--json")
    if args.out is None:
        return
    folder = check_name(args.out, "--out")
    if folder.exists() and not folder.is_dir():
        raise RefusedOutput(f"--out {folder}: a file; name a folder for the runs")
    earlier = sorted(p.name for pattern in ("pair*-[AB]*", "resident-[AB]*")
                     for p in folder.glob(pattern)) if folder.is_dir() else []
    if earlier and not args.force:
        raise RefusedOutput(f"--out {folder}: holds an earlier compare's runs ({', '.join(earlier[:3])}"
                            f"{', ...' if len(earlier) > 3 else ''}); name an empty folder, or pass --force to "
                            "replace them")


def run(args) -> int:
    from harness.cli.compare_figures import described, provenance
    from harness.spec.files import write_atomic

    arm_a, arm_b = arms(args)
    check_outputs(args)
    if args.resident:
        from harness.cli.compare_resident import check_resident
        from harness.cli.compare_resident import measure_resident as how

        check_resident(args)
    else:
        how = measure
    with contextlib.ExitStack() as stack:
        if args.out:
            folder = Path(args.out).resolve()  # arm A may run in the base checkout's folder
            folder.mkdir(parents=True, exist_ok=True)
        else:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="oom-harness-compare-")))
        pairs = how(args, arm_a, arm_b, folder)
        seen = {key: provenance(folder, key) for key in "AB"}
    rows = summarise(pairs, args.threshold)
    if not rows:
        print("compare: no case finished in both arms; see each run's log (--out keeps them)", file=sys.stderr)
        return 1
    kind = ("turns of one process per arm" if args.resident else "in turns") + " (A B, B A, ...)"
    print(f"{args.repeats} pairs, {kind}; worse/better: beyond {args.threshold:.0%} and "
          "a paired t test at p < 0.05; same: the interval lies within the threshold\n")
    print(table(rows))
    print(f"\nA (base): {described(seen['A'])}\nB (this): {described(seen['B'])}")
    if args.json:
        result = {"threshold": args.threshold, "repeats": args.repeats, "resident": args.resident, "arms": seen,
                  "rows": rows}
        write_atomic(Path(args.json), json.dumps(result, indent=1) + "\n")
    return 1 if any(r["verdict"] == "worse" for r in rows) else 0
