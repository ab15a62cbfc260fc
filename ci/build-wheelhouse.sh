#!/usr/bin/env bash
# Build a wheelhouse for an air-gapped host, on a connected machine: every runtime requirement of
# pyproject.toml (with the extras setup.sh installs: gpu, test, gla, cpu), recursively, as wheels for one Python version and
# platform, so that `./setup.sh --wheelhouse OUT_DIR` installs with no index.
#
#   ci/build-wheelhouse.sh OUT_DIR [PYTHON_VERSION] [PLATFORM] [--with-torch[=SPEC]] [--torch-version V]
#   e.g. ci/build-wheelhouse.sh wheels 3.12 manylinux_2_28_x86_64
#
# PYTHON_VERSION and PLATFORM default to those of $PYTHON (python3) here. PLATFORM names the newest
# glibc of the host (manylinux_2_X_ARCH): wheels tagged for it or any older manylinux (2_17 to 2_X,
# manylinux2014, ...), linux_ARCH or any platform are accepted, whichever tag a project publishes.
# DeepSpeed publishes only a source archive: its wheel is built here (pure Python, seconds).
#
# torch is left out by default: the host keeps its CUDA or ROCm build (setup.sh never replaces
# it), so the requirements are resolved against a placeholder torch of --torch-version (default:
# the oldest pyproject.toml allows) and neither torch nor what only torch needs (nvidia-* CUDA
# libraries, sympy, ...) is downloaded. --with-torch adds torch (default SPEC: the CPU pin
# torch==2.13.0 that setup.sh installs where there is none) and everything it needs.
# A requirement with no wheel for the target stops the build with its name.
set -euo pipefail
usage="usage: ci/build-wheelhouse.sh OUT_DIR [PYTHON_VERSION] [PLATFORM] [--with-torch[=SPEC]] [--torch-version V]"
PYTHON=${PYTHON:-python3}
positional=()
with_torch=""
torch_version=""
while [ $# -gt 0 ]; do
  case "$1" in
    --with-torch) with_torch="torch==2.13.0" ;;
    --with-torch=*) with_torch=${1#--with-torch=} ;;
    --torch-version) torch_version=${2:?$usage}; shift ;;
    -h|--help) echo "$usage"; exit 0 ;;
    -*) echo "build-wheelhouse: unknown option $1; $usage" >&2; exit 2 ;;
    *) positional+=("$1") ;;
  esac
  shift
done
out=${positional[0]:?$usage}
py=${positional[1]:-$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
plat=${positional[2]:-$("$PYTHON" -c 'import platform; v = platform.libc_ver()[1].split("."); print(f"manylinux_{v[0]}_{v[1]}_{platform.machine()}")')}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Every platform tag a host of $plat runs: manylinux_2_17 .. its glibc, the legacy aliases, linux_ARCH.
mapfile -t platforms < <("$PYTHON" - "$plat" <<'PY'
import re, sys
plat = sys.argv[1]
m = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", plat)
if not m:
    print(plat)
    sys.exit(0)
major, minor, arch = int(m[1]), int(m[2]), m[3]
tags = [f"manylinux_{major}_{n}_{arch}" for n in range(minor, 4, -1)]
tags += [f"manylinux{alias}_{arch}" for alias, n in (("2014", 17), ("2010", 12), ("1", 5)) if n <= minor]
print("\n".join([*tags, f"linux_{arch}"]))
PY
)
target=(--python-version "$py" --implementation cp --only-binary=:all:)
for p in "${platforms[@]}"; do target+=(--platform "$p"); done

# The requirements: pyproject's dependencies and the extras setup.sh installs, the build backend.
"$PYTHON" - "$work" "$with_torch" "$torch_version" <<'PY'
import re, sys, tomllib
work, with_torch, torch_version = sys.argv[1:]
data = tomllib.load(open("pyproject.toml", "rb"))
project = data["project"]
extras = project["optional-dependencies"]
reqs = project["dependencies"] + extras["gpu"] + extras["test"] + extras["gla"] + extras["cpu"]
reqs += data["build-system"]["requires"] + ["wheel"]
reqs += ["transformers==5.17.0"]  # what setup.sh installs where a host has no transformers
deepspeed = next(r for r in reqs if re.match(r"deepspeed\b", r))
torch = next(r for r in reqs if re.match(r"torch\b", r))
if not torch_version:
    torch_version = re.search(r">=\s*([\d.]+)", torch)[1]
# DeepSpeed resolves to the wheel built below; torch to the host's stand-in, unless it is included
open(f"{work}/requirements.txt", "w").write("\n".join([*(r for r in reqs if r != torch), with_torch or torch]) + "\n")
open(f"{work}/deepspeed.txt", "w").write(deepspeed + "\n")
open(f"{work}/torch-version.txt", "w").write(torch_version + "\n")
PY

fail() {  # pip's log in $1: name what could not be had, loudly
  local missing
  missing=$(grep -oE "(No matching distribution found for|Could not find a version that satisfies the requirement) [^ ]+" "$1" \
            | awk '{print $NF}' | sort -u | tr '\n' ' ')
  tail -20 "$1" >&2
  [ -n "$missing" ] || missing="a requirement (see the log above) "
  echo "build-wheelhouse: FAILED: no wheel of ${missing}for Python $py on $plat" \
       "(tags tried: ${platforms[*]}, any)" >&2
  exit 1
}

mkdir -p "$work/local"
echo "build-wheelhouse: building DeepSpeed's wheel from its source archive"
"$PYTHON" -m pip wheel -q --no-deps -w "$work/local" -r "$work/deepspeed.txt" >"$work/log" 2>&1 || fail "$work/log"
cp "$work"/local/deepspeed-*.whl "$out/"

extra=(--find-links "$work/local")
if [ -z "$with_torch" ]; then
  # A placeholder torch with no requirements stands in for the host's: resolved against, never kept.
  stub_version="$(cat "$work/torch-version.txt")+placeholder"
  "$PYTHON" - "$work/local" "$stub_version" <<'PY'
import sys, zipfile
folder, version = sys.argv[1:]
info = f"torch-{version}.dist-info"
with zipfile.ZipFile(f"{folder}/torch-{version}-py3-none-any.whl", "w") as whl:
    whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: build-wheelhouse\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    whl.writestr(f"{info}/RECORD", "")
PY
  echo "torch==$stub_version" > "$work/constraints.txt"
  extra+=(-c "$work/constraints.txt")
fi

echo "build-wheelhouse: downloading wheels for Python $py on $plat${with_torch:+ (with $with_torch)}"
"$PYTHON" -m pip download -d "$out" "${target[@]}" "${extra[@]}" -r "$work/requirements.txt" >"$work/log" 2>&1 \
  || fail "$work/log"
rm -f "$out"/torch-*+placeholder-*.whl
echo "build-wheelhouse: ready in $out ($(ls "$out" | wc -l) files, $(du -sh "$out" | cut -f1))"
echo "  on the host: ./setup.sh --wheelhouse $out"
