#!/usr/bin/env bash
# Set up the harness in ./.venv, then (unless --no-run) run every case at tiny size and print the table.
#
#   ./setup.sh                     set up, then run the bundled cases in tiny mode
#   ./setup.sh --no-run            set up only
#   ./setup.sh --wheelhouse DIR    install offline from a folder of wheels (air-gapped hosts)
#
# torch: a torch already importable by $PYTHON (the CUDA or ROCm build of a GPU host) is kept, and
# the venv sees it (--system-site-packages). Where there is none, the CPU wheel torch==2.13.0 is
# installed first, so no later requirement pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
RUN=1
WHEELHOUSE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --no-run) RUN=0 ;;
    --wheelhouse) WHEELHOUSE=$2; shift ;;
    *) echo "setup.sh: unknown option $1 (use --no-run, --wheelhouse DIR)" >&2; exit 2 ;;
  esac
  shift
done

pip_args=(-q --disable-pip-version-check)
if [ -n "$WHEELHOUSE" ]; then
  pip_args+=(--no-index --find-links "$WHEELHOUSE")
fi

if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "setup: keeping this host's torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "setup: no torch found; installing the CPU build torch==2.13.0"
  "$VENV/bin/python" -m pip install "${pip_args[@]}" "torch==2.13.0"
fi
echo "setup: installing the harness and its libraries"
"$VENV/bin/python" -m pip install "${pip_args[@]}" -e ".[gpu]"
"$VENV/bin/python" -c "import torch, transformers, peft, deepspeed; print(f'setup: torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, deepspeed {deepspeed.__version__}')" 2>/dev/null

if [ "$RUN" = 1 ]; then
  exec "$VENV/bin/oom-harness" run
fi
