"""Where compiled code is kept between runs, and whether a run's Triton kernels were compiled in the
run (a cold cache) or loaded from disk (warm).

Everything the harness keeps between runs lives under one folder, `HARNESS_CACHE` (default
~/.cache/oom-harness): DeepSpeed's JIT-built ops (`torch_extensions`, 1-2 min of compiling per op on
a fresh host), Triton's kernels (`triton`) and the random-weight checkpoints. A CI job keeps that one
folder between jobs (`.ci/run` puts it in the checkout's ignored `.cache/`). TORCH_EXTENSIONS_DIR or
TRITON_CACHE_DIR set in the environment win, for the workers and for the launcher's lock cleanup alike.

Each Python environment builds DeepSpeed's ops in a folder of its own: a case whose stack runs on
another environment's interpreter (LLaMA-Factory's, `harness.runtime.stacks`) gets a subfolder named
after that environment. torch's build names the environment's own include paths, so one shared folder
made ninja rebuild every op each time a worker of the other environment used it: the default tier
rebuilt cpu_adam, the CPU fused Adam and the shared-memory collective several times a run, minutes of
compiling with the caches "warm".

flash-linear-attention's kernels are Triton kernels: the first run on a host compiles and autotunes
them. Measured on guide 004's GLA jobs (docs/findings.md), a cold cache costs the first step minutes
and holds 1.9-3.8 GiB more device memory per process outside PyTorch's allocator than a warm one;
the guide's two-job OOM reproduced on a cold cache and not on a warm one. So every figure of a run
that used Triton says which it had, a baseline is not compared across the two, and a case can ask
for a cold cache (`launch.triton_cache: cold`: a fresh, empty cache directory for the run).

Triton keeps its cache in TRITON_CACHE_DIR, else ~/.triton/cache (triton.runtime.cache); the launcher
sets the variable, so the default only matters for a worker started by hand.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
from pathlib import Path


def cache_dir() -> Path:
    """The folder kept between runs."""
    return Path(os.environ.get("HARNESS_CACHE") or Path.home() / ".cache" / "oom-harness")


def extensions_dir(python: str | None = None) -> Path:
    """Where DeepSpeed's ops are JIT-built (torch's cpp_extension reads TORCH_EXTENSIONS_DIR) by workers
    running on `python` (default: this interpreter); another environment's interpreter gets a subfolder."""
    base = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cache_dir() / "torch_extensions")
    if python is None or os.path.abspath(python) == os.path.abspath(sys.executable):
        return base
    return base / environment_name(python)


def environment_name(python: str) -> str:
    """A folder name for the environment of the interpreter at `python` (its path as given: a virtual
    environment's bin/python is a link to the base interpreter, shared by every environment made from it)."""
    path = os.path.abspath(python)
    env = re.sub(r"[^A-Za-z0-9_-]+", "", Path(path).parent.parent.name) or "python"
    return f"env-{env}-{hashlib.sha256(path.encode()).hexdigest()[:8]}"


def shared_triton_dir() -> Path:
    """The Triton cache the workers share (a case with `launch.triton_cache: cold` gets its own)."""
    return Path(os.environ.get("TRITON_CACHE_DIR") or cache_dir() / "triton")


def triton_cache_dir() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def entries(path: Path) -> int:
    """Files in a cache directory (0 when it does not exist)."""
    return sum(1 for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def fresh(path: Path) -> Path:
    """An empty cache directory at `path`, whatever was there before."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def uses_triton_kernels() -> bool:
    """Whether this process ran code that compiles Triton kernels (flash-linear-attention's)."""
    return any(name == "fla" or name.startswith("fla.") for name in sys.modules)


def state(entries_at_start: int, entries_at_end: int, used: bool) -> str | None:
    """'cold' or 'warm' for a run that used Triton kernels on an accelerator; None otherwise.

    Warm only when the cache held files at the start and gained none during the run: kernels compiled
    during the run (its own, or a job sharing the cache compiling the same ones) held their memory
    in this run's steps, whatever the cache held before."""
    if not used:
        return None
    return "warm" if entries_at_start and entries_at_end <= entries_at_start else "cold"
