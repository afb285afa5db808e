#!/usr/bin/env bash
# Fills build/gpu-wheels (or the folder given) with the small pure-Python
# wheels a bare GPU test machine may lack, for an offline `make gpu-check`
# there: setuptools>=77 (this package's build backend), pytest and hypothesis
# with their dependencies (~5 MB). Run it where a package index is reachable,
# then carry the folder to the GPU machine: bench/gpu_check.sh installs from
# it with --no-index, and only what the machine is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-build/gpu-wheels}
# the GPU machine's Python (wheels are pure Python; the tag only filters)
PY_VERSION=${GPU_PYTHON_VERSION:-3.12}
mkdir -p "$DIR"
"${PYTHON:-python3}" -m pip download --quiet --only-binary=:all: --python-version "$PY_VERSION" --dest "$DIR" \
  'setuptools>=77' 'pytest>=8,<9' 'hypothesis>=6.100'
ls "$DIR"
du -sh "$DIR"
