#!/usr/bin/env bash
# Creates build/venv-triton36 (or $VENV_TRITON36): the GPU test machine's
# triton, 3.6.0, with numpy 2.4 and no SGLang, on the CPU build of torch
# 2.13.0 (its CPU wheel does not pin triton), plus this package (editable)
# and the test tools. `make test-triton36` runs the kernel suite there under
# Triton's interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV_TRITON36:-build/venv-triton36}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q torch==2.13.0 triton==3.6.0 'numpy>=2.4,<2.5' 'pytest>=8,<9' 'hypothesis>=6.100' 'matplotlib>=3.7'
$PIP install -q --no-deps -e .
"$VENV/bin/python" -c "import numpy, torch, triton, sglang_cp_hicache.kernels; \
print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)"
