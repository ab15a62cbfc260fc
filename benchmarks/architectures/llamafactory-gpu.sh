#!/usr/bin/env bash
# Full-size runs of the architecture benchmark's LLaMA-Factory cases (`*-lf*`) on a GPU host, through
# LLaMA-Factory 0.9.5 and the versions it pins, where the host's Python has a CUDA torch but another
# transformers and peft and no LLaMA-Factory: the pinned stack goes into an overlay folder that comes
# first on PYTHONPATH, from a wheelhouse of wheels for the host's Python (no index needed):
#
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d WHEELS \
#       transformers==5.6.0 peft==0.18.1 accelerate==1.11.0 trl==0.24.0 datasets==4.0.0 dill==0.3.8 \
#       multiprocess==0.70.16 fsspec==2025.3.0 omegaconf==2.4.0 llamafactory==0.9.5 liger-kernel==0.8.5 \
#       tokenizers==0.22.2 pydantic pydantic-core annotated-types typing-inspection typing-extensions
#   benchmarks/architectures/llamafactory-gpu.sh WHEELS OUT [-k PATTERN ...]
#
# A host with its own LLaMA-Factory environment needs none of this: `oom-harness run --fidelity real
# --case-dir benchmarks/architectures/cases -k=-lf` in it. The runs land in OUT/runs.json, the host's
# facts (card, driver, CPU, library versions) in each rank's record.
set -euo pipefail
wheels=${1:?usage: llamafactory-gpu.sh WHEELS OUT [oom-harness run options]}
out=${2:?usage: llamafactory-gpu.sh WHEELS OUT [oom-harness run options]}
shift 2
[ $# -gt 0 ] || set -- -k=-lf
cd "$(dirname "$0")/../.."
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
python3 -c 'import llamafactory, transformers, peft, accelerate, torch; print("stack: llamafactory", llamafactory.__version__, "transformers", transformers.__version__, "peft", peft.__version__, "accelerate", accelerate.__version__, "torch", torch.__version__)'
python3 -m harness.cli.main run --fidelity real --case-dir benchmarks/architectures/cases --json "$out/runs.json" \
    --force "$@"
