#!/usr/bin/env bash
# Creates .venv-0523: the SGLang 0.5.23 environment, CPU-only. It cannot share
# .venv (SGLang 0.5.18 and 0.5.23 are one distribution name). Contents: the CPU
# build of torch 2.13.0 (off 0.5.23's torch==2.14.1 pin, which exists only as a
# CUDA build), triton, this package (editable, with the test and bench extras: matplotlib for simulate --plot), SGLang 0.5.23
# WITHOUT its GPU dependencies, and the light dependencies at 0.5.23's pins.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-0523
t0=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# Keep the venv out of git without touching the repository's .gitignore.
echo '*' > "$VENV/.gitignore"
PIP="$VENV/bin/python -m pip"
C="-c requirements/constraints-0523.txt"
$PIP install -q --upgrade pip
# torch first and pinned: a bare "torch" requirement would pull a CUDA build.
$PIP install -q $C torch==2.13.0
$PIP install -q $C -e ".[test,bench]"
$PIP install -q --no-deps sglang==0.5.23
$PIP install -q $C -r requirements/sglang-0523-light.txt
"$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md
import torch, triton, sglang_cp_hicache
assert md.version("sglang") == "0.5.23", md.version("sglang")
assert not torch.version.cuda, f"CUDA torch slipped in: {torch.__version__}"
print("torch", torch.__version__, "triton", triton.__version__, "sglang", md.version("sglang"))
PYEOF
echo "install-0523: $(( $(date +%s) - t0 ))s"
