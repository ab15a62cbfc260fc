"""Build step: the wheel carries the bundled suite (cases, baselines, example configs) as package data.

It also carries the predictor's benchmark errors (results/predictor/, the margins), the device
probe records (results/device/, where any were measured), the surveys of Triton kernels' local memory
(results/triton-kernels/), and the architecture benchmark and fit's
verified configs the errors are also drawn from (benchmarks/architectures/ and results/architectures/,
benchmarks/fitted/cases/ and results/fitted/).

The repository keeps `cases/`, `results/baselines/` and `configs/examples/` at its top level, beside
the package; a wheel holds only the package. `build_py` copies them into `harness/_bundled/`, where
`harness.spec.suite` finds them once installed. Everything else is in pyproject.toml.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
# what the wheel carries, relative to the checkout; harness.spec.suite reads it back from harness/_bundled/
SHIPPED = {"cases": "*.yaml", "results/baselines": "*/*.json", "configs/examples": "*",
           "results/predictor": "*.json"}
# device probe records (harness.runtime.device_probe), where measured; surveys of Triton kernels
# (harness.predict.local_memory); the architecture benchmark and fit's
# verified configs, whose errors the margins also draw on (results/predictor/errors.json records their digest)
OPTIONAL = {"results/device": "*.json", "results/triton-kernels": "*.json",
            "results/architectures/baselines": "*/*.json", "benchmarks/architectures/cases": "*.yaml",
            "benchmarks/architectures/models": "*/config.json",
            "results/fitted/baselines": "*/*.json", "benchmarks/fitted/cases": "*.yaml"}


class BuildPyWithSuite(build_py):
    def run(self):
        super().run()
        if self.editable_mode:  # an editable install reads the checkout itself
            return
        target = Path(self.build_lib) / "harness" / "_bundled"
        for folder, pattern in {**SHIPPED, **OPTIONAL}.items():
            files = sorted(p for p in (HERE / folder).glob(pattern) if p.is_file())
            if not files and folder in SHIPPED:
                raise SystemExit(f"setup.py: nothing matches {folder}/{pattern}; the bundled suite is incomplete")
            for src in files:
                dest = target / src.relative_to(HERE)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest)


setup(cmdclass={"build_py": BuildPyWithSuite})
