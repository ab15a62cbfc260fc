"""Installing the harness, each way a team does, into fresh environments on the CPU (slow: minutes).

A venv holding torch stands in for a GPU host's Python (its torch lives in that venv, which a
venv made from it does not see). `setup.sh` must keep that torch; a wheelhouse built by
`ci/build-wheelhouse.sh` for this Python must install with no index; `pip install .` must give a
package that finds its bundled suite and registers its pytest plugin, run from an empty folder.

    pytest -m install tests/install
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.install

ROOT = Path(__file__).resolve().parents[2]
CPU_TORCH = "torch==2.13.0"  # the pin setup.sh installs where there is no torch
UNREACHABLE_INDEX = "http://127.0.0.1:9/simple"  # nothing listens on the discard port


def _env(**extra: str) -> dict[str, str]:
    """This environment without what points Python at the checkout or at the harness's own venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, **extra}


def _offline(**extra: str) -> dict[str, str]:
    """pip with no configured index or wheel folder, and an index address that cannot answer."""
    return _env(PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS="", PIP_EXTRA_INDEX_URL="",
                PIP_INDEX_URL=UNREACHABLE_INDEX, **extra)


def _run(cmd, cwd=None, env=None, timeout=900, with_stderr=False) -> str:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env or _env(), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{cmd} exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout + (done.stderr if with_stderr else "")


def _checkout(dest: Path) -> Path:
    """A fresh copy of the repository: the files git tracks, and new ones it does not ignore."""
    listed = _run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT).split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def _site_packages(python: Path) -> Path:
    return Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())


@pytest.fixture(scope="module")
def host_python(tmp_path_factory) -> Path:
    """A venv with the CPU torch: a GPU host's `python3`, which is itself a venv holding torch."""
    venv = tmp_path_factory.mktemp("host") / "venv"
    _run([sys.executable, "-m", "venv", venv])
    _run([venv / "bin" / "python", "-m", "pip", "install", "-q", CPU_TORCH])
    return venv / "bin" / "python"


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    """The wheelhouse for this Python and platform, torch left out (the host keeps its own)."""
    out = tmp_path_factory.mktemp("wheelhouse")
    _run([ROOT / "ci" / "build-wheelhouse.sh", out], cwd=ROOT, env=_env(PYTHON=sys.executable))
    return out


def _torch_file(python: Path) -> Path:
    return Path(_run([python, "-c", "import torch; print(torch.__file__)"]).strip())


def test_setup_keeps_the_torch_of_the_python_it_is_given(tmp_path, host_python):
    clone = _checkout(tmp_path / "clone")
    _run(["./setup.sh", "--no-run"], cwd=clone, env=_env(PYTHON=str(host_python)))
    venv = clone / ".venv" / "bin"
    assert _torch_file(venv / "python") == _torch_file(host_python)
    assert _torch_file(venv / "python").is_relative_to(host_python.parents[1])
    assert not (_site_packages(venv / "python") / "torch").exists()
    assert "pytest" in _run([venv / "pytest", "--version"], with_stderr=True)
    assert "run" in _run([venv / "oom-harness", "--help"])


def test_the_wheelhouse_holds_every_requirement_but_torch_and_installs_offline(tmp_path, host_python, wheelhouse):
    names = {p.name.split("-")[0].lower() for p in wheelhouse.glob("*.whl")}
    assert {"bitsandbytes", "deepspeed", "transformers", "peft", "pytest", "hypothesis", "setuptools"} <= names
    assert not {n for n in names if n == "torch" or n.startswith("nvidia_cu")}  # the host's torch stays
    clone = _checkout(tmp_path / "clone")
    _run(["./setup.sh", "--no-run", "--wheelhouse", wheelhouse], cwd=clone, env=_offline(PYTHON=str(host_python)))
    venv = clone / ".venv" / "bin"
    assert _torch_file(venv / "python") == _torch_file(host_python)
    _run([venv / "python", "-c", "import deepspeed, bitsandbytes, peft, transformers, fla"])
    assert "run" in _run([venv / "oom-harness", "--help"])


def test_a_built_wheel_carries_the_bundled_suite_and_the_package_data(tmp_path, wheelhouse):
    clone = _checkout(tmp_path / "clone")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index", "--find-links", wheelhouse,
          "-w", tmp_path / "dist", "."], cwd=clone, env=_offline())
    (wheel,) = (tmp_path / "dist").glob("oom_harness-*.whl")
    inside = set(zipfile.ZipFile(wheel).namelist())
    bundled = {
        f"harness/_bundled/{p.relative_to(ROOT)}"
        for pattern in ("cases/*.yaml", "results/baselines/*/*.json", "configs/examples/*",
                        "results/triton-kernels/*.json")
        for p in ROOT.glob(pattern)
    }
    assert len(bundled) > 60 and bundled <= inside
    data = {f"harness/models/architectures/{p.name}" for p in (ROOT / "harness/models/architectures").glob("*.json")}
    assert data and data <= inside
    assert "harness/measure/cards.json" in inside
    entry_points = next(n for n in inside if n.endswith(".dist-info/entry_points.txt"))
    registered = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[pytest11]\noom-harness = harness.pytest_plugin.plugin" in registered


def test_pip_install_gives_the_commands_and_the_plugin_in_an_empty_folder(tmp_path, host_python, wheelhouse):
    clone = _checkout(tmp_path / "clone")
    empty = tmp_path / "empty"
    empty.mkdir()
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv])
    python = venv / "bin" / "python"
    # the host's torch, seen the way setup.sh lets a venv see it
    (_site_packages(python) / "host.pth").write_text(f"{_site_packages(host_python)}\n")
    _run([python, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheelhouse, "."], cwd=clone,
         env=_offline())
    assert "_bundled" in _run([python, "-c", "import harness.spec.suite as s; print(s.CASES_DIR)"], cwd=empty)
    config = clone / "configs" / "examples" / "003-qwen7b-qlora-fix1.json"
    out = _run([venv / "bin" / "oom-harness", "check", config, "--gpus", "1", "--gpu-memory", "15.77GiB",
                "--stack", "peft"], cwd=empty)
    assert "calibrated on: 000-" in out  # the bundled baselines and their cases, read from the package
    out = _run([venv / "bin" / "pytest", "--help"], cwd=empty)
    for option in ("--case-dir", "--baselines-dir", "--premerge-dir", "harness_case_dir", "harness_baselines_dir"):
        assert option in out
    out = _run([venv / "bin" / "pytest", "--harness", "--collect-only", "-q", "-m", "tiny"], cwd=empty)
    cases = len(list((ROOT / "cases").glob("*.yaml")))
    assert f"{cases}/{2 * cases} tests collected" in out  # the bundled suite, from site-packages
