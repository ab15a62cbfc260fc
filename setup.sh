#!/usr/bin/env bash
# Set up the harness in ./.venv, then (unless --no-run) run every case at tiny size and print the table.
#
#   ./setup.sh                     set up, then run the bundled cases in tiny mode
#   ./setup.sh --no-run            set up only
#   ./setup.sh --wheelhouse DIR    install offline from a folder of wheels (ci/build-wheelhouse.sh makes it)
#   PYTHON=/opt/env/bin/python ./setup.sh   use that interpreter and keep its torch
#   ./setup.sh --stack llamafactory         a second environment, .venv-lf, with LLaMA-Factory 0.9.5 and the
#                                  versions it pins (ci/stacks/), for llamafactory cases and the matrix's other end
#
# torch: the torch of $PYTHON (a CUDA or ROCm build: system Python, venv or conda) is kept. The new
# venv sees that interpreter's site-packages through a .pth file, so pip counts torch (and what
# came with it) as installed and never replaces it; the venv's own packages come first. Where
# $PYTHON has no torch, the CPU wheel torch==2.13.0 is installed first, so no later requirement
# pulls a multi-GB CUDA build. transformers likewise: the host's is kept, else transformers==5.17.0.
# Every library the environment already has (torch, transformers, peft, accelerate, trl, datasets) is held
# at its version while the harness installs (a pip constraints file), so an existing LLaMA-Factory
# environment keeps its pins. Extras: gpu and test always, cpu (Triton) with a CPU build of torch, gla
# (flash-linear-attention 0.6) where the kept transformers allows it (>= 5.6.2).
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
RUN=1
WHEELHOUSE=""
STACK=""
CPU_TORCH="torch==2.13.0"
# transformers where the host has none: the version the bundled baselines were measured with
BASELINE_TRANSFORMERS="transformers==5.17.0"
HOST_PTH="_oom_harness_host_python.pth"
while [ $# -gt 0 ]; do
  case "$1" in
    --no-run) RUN=0 ;;
    --wheelhouse) WHEELHOUSE=${2:?--wheelhouse needs a folder}; shift ;;
    --stack) STACK=${2:?--stack needs a name: llamafactory}; shift ;;
    *) echo "setup.sh: unknown option $1 (use --no-run, --wheelhouse DIR, --stack llamafactory)" >&2; exit 2 ;;
  esac
  shift
done
STACK_FILE=""
case "$STACK" in
  "") VENV=${VENV:-.venv} ;;
  llamafactory) VENV=${VENV:-.venv-lf}; STACK_FILE=ci/stacks/llamafactory-0.9.5.txt; STACK_PACKAGE="llamafactory==0.9.5" ;;
  *) echo "setup.sh: --stack $STACK: no such stack (known: llamafactory)" >&2; exit 2 ;;
esac

pip_args=(-q --disable-pip-version-check)
if [ -n "$WHEELHOUSE" ]; then
  [ -d "$WHEELHOUSE" ] || { echo "setup.sh: --wheelhouse $WHEELHOUSE: no such folder" >&2; exit 2; }
  pip_args+=(--no-index --find-links "$(cd "$WHEELHOUSE" && pwd)")
fi
pip() { "$VENV/bin/python" -m pip "$@"; }

# The folders that hold $PYTHON's torch and its other packages (its site-packages, wherever that
# interpreter keeps them), asked of the interpreter itself; empty where it has no torch.
host_dirs=$("$PYTHON" - <<'PY' 2>/dev/null || true
import os, site, sys
try:
    import torch
except Exception:
    sys.exit(0)
dirs = [os.path.dirname(os.path.dirname(torch.__file__)), *site.getsitepackages()]
seen = []
for d in dirs:
    if os.path.isdir(d) and d not in seen:
        seen.append(d)
print("\n".join(seen))
PY
)

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
venv_site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -n "$host_dirs" ]; then
  host_torch=$("$PYTHON" -c 'import torch; print(torch.__version__, torch.__file__)' 2>/dev/null)
  echo "setup: keeping the torch of $PYTHON: ${host_torch%% *} (${host_torch#* })"
  printf '%s\n' "$host_dirs" > "$venv_site/$HOST_PTH"
else
  rm -f "$venv_site/$HOST_PTH"
fi

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "setup: no torch found; installing the CPU build $CPU_TORCH"
  if ! pip install "${pip_args[@]}" "$CPU_TORCH"; then
    echo "setup.sh: could not install $CPU_TORCH${WHEELHOUSE:+ from $WHEELHOUSE}. Give PYTHON= an interpreter" \
         "that has torch${WHEELHOUSE:+, or build the wheelhouse with ci/build-wheelhouse.sh --with-torch}." >&2
    exit 1
  fi
fi
# transformers: the host's is kept, and predictions follow it (the order of DeepSpeed's ZeRO-3 hooks is
# recorded on the installed stack); where there is none, the version the bundled suite was measured with,
# so that its baselines and expectations hold (transformers 5.23 changed what ZeRO-3 holds under reentrant
# checkpointing: docs/findings.md)
if [ -n "$STACK_FILE" ]; then
  echo "setup: installing the $STACK stack ($STACK_FILE), then $STACK_PACKAGE without its serving and UI requirements"
  pip install "${pip_args[@]}" -r "$STACK_FILE"
  pip install "${pip_args[@]}" --no-deps "$STACK_PACKAGE"
fi
if ! "$VENV/bin/python" -c "import transformers" 2>/dev/null; then
  echo "setup: no transformers found; installing $BASELINE_TRANSFORMERS, the bundled baselines' version"
  pip install "${pip_args[@]}" "$BASELINE_TRANSFORMERS"
fi
extras="gpu,test"
if "$VENV/bin/python" -c 'import sys, torch; sys.exit(torch.version.cuda is not None or torch.version.hip is not None)' \
     2>/dev/null; then
  extras+=",cpu"  # Triton for the CPU build (GPU builds of torch bring their own)
fi
# the libraries the environment has now stay at their versions while the harness installs
kept=$(mktemp)
trap 'rm -f "$kept"' EXIT
"$VENV/bin/python" - > "$kept" <<'PY'
import importlib.metadata as md
for name in ("torch", "transformers", "peft", "accelerate", "trl", "datasets"):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        pass
PY
if "$VENV/bin/python" -c 'import sys, transformers; from packaging.version import Version as V; sys.exit(V(transformers.__version__) < V("5.6.2"))' \
     2>/dev/null; then
  extras+=",gla"
else
  echo "setup: no flash-linear-attention: it needs transformers >= 5.6.2, and this environment keeps" \
       "$("$VENV/bin/python" -c 'import transformers; print(transformers.__version__)'); GLA cases are skipped"
fi
echo "setup: installing the harness and its libraries (extras: $extras; kept: $(tr '\n' ' ' < "$kept"))"
pip install "${pip_args[@]}" -c "$kept" -e ".[$extras]"
rm -f "$kept"
# pip writes no pytest script where pytest came from $PYTHON's packages: install it into the venv
# itself (same version, its dependencies already present), so .venv/bin/pytest exists.
if [ ! -x "$VENV/bin/pytest" ]; then
  pytest_version=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("pytest"))')
  pip install "${pip_args[@]}" --ignore-installed --no-deps "pytest==$pytest_version" 2>/dev/null \
    || pip install "${pip_args[@]}" --ignore-installed "pytest>=8.1"
fi

if [ -n "$host_dirs" ]; then  # the host's torch must still be the one imported
  kept=$("$VENV/bin/python" -c 'import torch; print(torch.__version__, torch.__file__)' 2>/dev/null)
  if [ "$kept" != "$host_torch" ]; then
    echo "setup.sh: torch changed: $PYTHON has $host_torch, $VENV imports $kept" >&2
    exit 1
  fi
fi
for cmd in oom-harness pytest; do
  [ -x "$VENV/bin/$cmd" ] || { echo "setup.sh: $VENV/bin/$cmd is missing after the install" >&2; exit 1; }
done
"$VENV/bin/python" -c "import torch, transformers, peft, deepspeed; print(f'setup: torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, deepspeed {deepspeed.__version__}')" 2>/dev/null

if [ "$RUN" = 1 ]; then
  exec "$VENV/bin/oom-harness" run
fi
