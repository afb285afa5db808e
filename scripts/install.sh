#!/usr/bin/env bash
# Creates .venv with everything the tests need, on a CPU-only machine:
# the CPU build of torch 2.13.0, triton, this package (editable, with test and
# bench extras), SGLang 0.5.18 WITHOUT its GPU dependencies, and Mooncake's
# non-CUDA client. One line per step; pip's own output: build/install-0518.log.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install-steps.sh
PY=${PYTHON:-python3}
VENV=.venv
PIP="$VENV/bin/python -m pip"
C="-c requirements/constraints.txt"

# Mooncake's native client (tests/l3_backends) needs the system's libibverbs1
# even over TCP: added with apt when missing and run as root.
apt_ibverbs=0
if ! ldconfig -p | grep -q 'libibverbs\.so\.1'; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt_ibverbs=1
    fi
fi
begin_install install-0518 $((6 + apt_ibverbs))

new_venv() {
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    $PIP install -q --upgrade pip
}

libibverbs() {
    apt-get update -qq && apt-get install -y -qq libibverbs1
}

step "virtual environment $VENV, pip" new_venv
# torch first and pinned: a bare "torch" requirement would pull a CUDA build.
step "torch 2.13.0 (CPU build)" $PIP install -q $C torch==2.13.0
step "sglang-cp-hicache (editable, test + bench extras)" $PIP install -q $C -e ".[test,bench]"
step "sglang 0.5.18 (without its GPU dependencies)" $PIP install -q --no-deps sglang==0.5.18
step "SGLang's light dependencies (requirements/sglang-light.txt)" $PIP install -q $C -r requirements/sglang-light.txt
if [ "$apt_ibverbs" = 1 ]; then
    step "libibverbs1 (apt, for Mooncake's client)" libibverbs
elif ! ldconfig -p | grep -q 'libibverbs\.so\.1'; then
    say "warning: libibverbs1 missing and cannot be installed here; tests/l3_backends will skip (fail under CI)"
fi
step "Mooncake's non-CUDA client (requirements/mooncake.txt)" $PIP install -q $C -r requirements/mooncake.txt
finish_install "$VENV" "import importlib.metadata as md, torch, triton, sglang_cp_hicache
print('torch', torch.__version__, 'triton', triton.__version__, 'sglang', md.version('sglang'))"
