#!/usr/bin/env bash
# Creates .venv with everything the tests need, on a CPU-only machine:
# the CPU build of torch 2.13.0, triton, this package (editable, with test and
# bench extras), and SGLang 0.5.18 WITHOUT its GPU dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
C="-c requirements/constraints.txt"
$PIP install -q --upgrade pip
# torch first and pinned: a bare "torch" requirement would pull a CUDA build.
$PIP install -q $C torch==2.13.0
$PIP install -q $C -e ".[test,bench]"
$PIP install -q --no-deps sglang==0.5.18
$PIP install -q $C -r requirements/sglang-light.txt
# Mooncake's store for the L3 backend tests (tests/l3_backends): its native
# client needs the system's libibverbs1 even over TCP.
if ! ldconfig -p | grep -q 'libibverbs\.so\.1'; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null
    else
        echo "install: libibverbs1 missing and cannot be installed here; tests/l3_backends will skip (fail under CI)" >&2
    fi
fi
$PIP install -q $C -r requirements/mooncake.txt
.venv/bin/python -c "import torch, triton, sglang_cp_hicache; print('torch', torch.__version__, 'triton', triton.__version__)"
