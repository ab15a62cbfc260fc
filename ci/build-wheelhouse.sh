#!/usr/bin/env bash
# Build a wheelhouse for an air-gapped GPU host (common for DCU clusters), on a connected machine.
#
#   ci/build-wheelhouse.sh OUT_DIR [PYTHON_VERSION] [PLATFORM]
#   e.g. ci/build-wheelhouse.sh wheels 3.12 manylinux_2_28_x86_64
#
# Then copy OUT_DIR and this repository to the host and run:  ./setup.sh --wheelhouse OUT_DIR
# torch itself is not included: the host's CUDA or ROCm (DTK) build is kept.
set -euo pipefail
out=${1:?usage: ci/build-wheelhouse.sh OUT_DIR [PYTHON_VERSION] [PLATFORM]}
py=${2:-3.12}
plat=${3:-manylinux_2_28_x86_64}
cd "$(dirname "$0")/.."
mkdir -p "$out"
tags=(--python-version "$py" --implementation cp --only-binary=:all:)
for p in "$plat" manylinux_2_17_x86_64 manylinux2014_x86_64; do tags+=(--platform "$p"); done
# Everything pyproject.toml asks for except torch (and what pip would pull for it), with their needs.
python3 - <<'PY' > "$out/requirements.txt"
import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = deps["dependencies"] + deps["optional-dependencies"]["gpu"]
print("\n".join(r for r in reqs if not r.startswith(("torch", "deepspeed", "triton"))))
PY
python3 -m pip download "${tags[@]}" -d "$out" -r "$out/requirements.txt" setuptools wheel
# DeepSpeed publishes only a source archive; its wheel is pure Python and builds here in seconds.
python3 -m pip wheel --no-deps -w "$out" "$(grep -o 'deepspeed[^"]*' pyproject.toml | head -1)"
python3 -m pip download "${tags[@]}" -d "$out" hjson msgpack py-cpuinfo ninja
echo "wheelhouse ready in $out ($(ls "$out" | wc -l) files)"
