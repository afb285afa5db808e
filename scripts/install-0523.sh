#!/usr/bin/env bash
# Creates .venv-0523: the SGLang 0.5.23 environment, CPU-only. It cannot share
# .venv (SGLang 0.5.18 and 0.5.23 are one distribution name). Contents: the CPU
# build of torch 2.13.0 (off 0.5.23's torch==2.14.1 pin, which exists only as a
# CUDA build), triton, this package (editable, with the test and bench extras: matplotlib for simulate --plot), SGLang 0.5.23
# WITHOUT its GPU dependencies, and the light dependencies at 0.5.23's pins.
# One line per step; pip's own output: build/install-0523.log.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install-steps.sh
PY=${PYTHON:-python3}
VENV=.venv-0523
PIP="$VENV/bin/python -m pip"
C="-c requirements/constraints-0523.txt"
begin_install install-0523 5

new_venv() {
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    # Keep the venv out of git without touching the repository's .gitignore.
    echo '*' >"$VENV/.gitignore"
    $PIP install -q --upgrade pip
}

step "virtual environment $VENV, pip" new_venv
# torch first and pinned: a bare "torch" requirement would pull a CUDA build.
step "torch 2.13.0 (CPU build)" $PIP install -q $C torch==2.13.0
step "sglang-cp-hicache (editable, test and bench extras)" $PIP install -q $C -e ".[test,bench]"
step "sglang 0.5.23 (without its GPU dependencies)" $PIP install -q --no-deps sglang==0.5.23
step "SGLang's light dependencies (requirements/sglang-0523-light.txt)" $PIP install -q $C -r requirements/sglang-0523-light.txt
finish_install "$VENV" "import importlib.metadata as md
import torch, triton, sglang_cp_hicache
assert md.version('sglang') == '0.5.23', md.version('sglang')
assert not torch.version.cuda, f'CUDA torch slipped in: {torch.__version__}'
print('torch', torch.__version__, 'triton', triton.__version__, 'sglang', md.version('sglang'))"
