"""Every fitted constant of the predictor and of the throughput model, per platform, with what it was fitted on.

    python benchmarks/fitted_constants.py            print them
    python benchmarks/fitted_constants.py --json     the same as one JSON object

Nothing is fitted by hand or stored: `harness.predict.calibration` fits the memory constants, and
`harness.fit.throughput` the throughput constants, at call time on the blessed baselines (results/baselines),
so blessing a run refits them. This command shows what the current baselines give, beside the priors used
where nothing is fitted (`harness.predict.constants.PRIORS`, `harness/fit/throughput.json`).
"""

from __future__ import annotations

import argparse
import json
import sys

from harness.fit import throughput
from harness.predict import calibration
from harness.predict.constants import PRIORS


def memory_constants() -> dict[str, dict]:
    """The predictor's constants per platform (and pooled over every platform): value and the cases."""
    out = {}
    for platform in [None, *calibration.platforms()]:
        cal = calibration.calibrate(platform)
        out[platform or "pooled"] = {
            name: {"value": cal.values.get(name, PRIORS.get(name)), "fitted": name in cal.values,
                   "cases": cal.used.get(name, [])}
            for name in (*calibration.FITTED, *calibration.OPTIONAL)}
    return out


def throughput_constants() -> dict[str, dict]:
    """The throughput model's constants per platform with baselines (and pooled): value and the cases."""
    out = {}
    for platform in [None, *sorted({o.platform for o in throughput.observations()})]:
        model = throughput.calibrate(platform=platform)
        out[platform or "pooled"] = {"source": model.source, "cases": sorted(set(model.fitted_on)),
                                     "values": dict(model.values)}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/fitted_constants.py", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    memory, speed = memory_constants(), throughput_constants()
    if args.json:
        print(json.dumps({"memory": memory, "throughput": speed}, indent=1, default=str))
        return 0
    print("memory (harness.predict.calibration; priors in harness.predict.constants.PRIORS)")
    for platform, constants in memory.items():
        print(f"  {platform}")
        for name, c in constants.items():
            if c["value"] is None:
                print(f"    {name:46s} not measured")
                continue
            how = f"fitted on {len(c['cases'])} cases" if c["fitted"] else "prior"
            print(f"    {name:46s} {c['value']:>16.4g}  {how}")
    print("\nthroughput (harness.fit.throughput; priors in harness/fit/throughput.json)")
    for platform, model in speed.items():
        print(f"  {platform} ({model['source']}, {len(model['cases'])} cases)")
        for name, value in model["values"].items():
            print(f"    {name:46s} {value:>16.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
