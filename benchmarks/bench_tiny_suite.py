"""Wall time of the whole tiny suite (every case, tiny size, on this machine's CPUs).

    python benchmarks/bench_tiny_suite.py [--jobs N]

Prints each case's wall time and the total against the 3-minute target. Run it once before
timing so DeepSpeed's JIT ops (cpu_adam, the CPU fused Adam, the shared-memory collective) are
built and cached; the first run on a fresh machine also pays for those builds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 180.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "runs.json"
        cmd = [sys.executable, "-m", "harness.cli", "run", "--out", str(Path(tmp) / "runs"), "--json", str(out)]
        if args.jobs:
            cmd += ["--jobs", str(args.jobs)]
        started = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if not out.exists():
            print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
            return 1
        runs = json.loads(out.read_text())
    print(f"machine: {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}")
    for r in sorted(runs, key=lambda r: -r["run"]["wall_s"]):
        print(f"  {r['case']:<48} {r['run']['wall_s']:6.1f} s")
    print(f"tiny suite: {len(runs)} cases in {wall:.1f} s wall "
          f"({'within' if wall <= TARGET_S else 'over'} the {TARGET_S:.0f} s target); exit {proc.returncode}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
