"""Wall time of `oom-harness check` on guide 000's 32B config, end to end, in a cold process.

    python benchmarks/bench_check_32b.py [--repeat 3]

Each repetition is a fresh `python -m harness.cli check ...` (imports, config import, the
predictor's fake-tensor trace, lints, the table), as a pre-merge CI job runs it. The predictor keeps
its traces in an on-disk cache (HARNESS_PREDICT_CACHE); the target is judged with that cache off, as
on a fresh CI runner, and the cached figure is printed beside it. Prints every repetition, the
median and the worst, and the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET_S = 10.0
ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "examples" / "000-ds32b-optimized.yaml"
DEEPSPEED = ROOT / "configs" / "examples" / "ds_z3_offload_aggressive.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    cmd = [sys.executable, "-m", "harness.cli", "check", str(CONFIG), "--deepspeed", str(DEEPSPEED),
           "--gpu-memory", "64GiB", "--gpus", "8", "--vendor", "hygon", "--json"]
    env_off = dict(os.environ, HARNESS_PREDICT_CACHE="off")
    cold, result = _time(cmd, env_off, args.repeat, "trace cache off")
    if cold is None:
        return 1
    warm, _ = _time(cmd, dict(os.environ), args.repeat, "trace cache warm")
    worst = max(cold)
    print(f"\noom-harness check, guide 000 32B (8 x 64 GiB, ZeRO-3 offload), {len(cold)} cold processes each:")
    print(f"  trace cache off:  median {statistics.median(cold):.2f} s, worst {worst:.2f} s "
          f"(target {TARGET_S:.0f} s: {'met' if worst <= TARGET_S else 'NOT met'})")
    if warm:
        print(f"  trace cache warm: median {statistics.median(warm):.2f} s, worst {max(warm):.2f} s")
    print(f"predicted device peak {result['device_peak_gib']} GiB per card, fits: {result['fits']}")
    print(f"machine: {os.cpu_count()} CPUs, Python {platform.python_version()}, {platform.machine()}")
    return 0 if worst <= TARGET_S else 1


def _time(cmd: list[str], env: dict, repeat: int, label: str) -> tuple[list[float] | None, dict | None]:
    times, result = [], None
    for i in range(repeat):
        started = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        wall = time.perf_counter() - started
        if proc.returncode not in (0, 1):
            print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
            return None, None
        result = json.loads(proc.stdout)
        times.append(wall)
        print(f"{label}, run {i + 1}: {wall:.2f} s (exit {proc.returncode})", flush=True)
    return times, result


if __name__ == "__main__":
    sys.exit(main())
