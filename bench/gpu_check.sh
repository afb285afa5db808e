#!/usr/bin/env bash
# Prepared GPU check of the CP page-copy kernels: one GPU, under 5 minutes.
#
#   bench/gpu_check.sh [OUT_DIR]            # or: OUT=/some/dir bench/gpu_check.sh
#   bench/gpu_check.sh --cpu [OUT_DIR]      # exercise this script on a CPU-only machine
#   bench/gpu_check.sh --dry-run [OUT_DIR]  # print the stages, run nothing
#
# Needs CUDA torch + triton (+ numpy; matplotlib for the plots) in $PYTHON
# (default: python, else python3). Nothing is fetched: SGLang is optional, and
# this checkout is installed offline by the install stage. OUT_DIR (default
# bench/results/gpu_check_<UTC time>) is created. Stages, each with its own
# time limit; every stage writes its own files and one line of summary.txt
# whatever the others do:
#
#   install    install.log: this checkout importable as sglang_cp_hicache --
#              nothing if it already is; else `pip install --no-deps
#              --no-build-isolation --no-index -e .` (needs setuptools>=77,
#              taken from $GPU_CHECK_WHEELS, default build/gpu-wheels, when the
#              environment lacks it; `make gpu-wheels` fills that folder); if
#              pip cannot, a PYTHONPATH overlay under OUT_DIR (pip never
#              touches an environment that has this package from elsewhere;
#              GPU_CHECK_INSTALL=overlay never runs it). pytest and
#              hypothesis come from the same folder when missing.
#   env        env.json: versions, GPU, whether SGLang imports
#   checks     checks.json: bitwise round trips through all four kernels on
#              cudaHostRegister'ed and pin_memory host buffers, CP 1/2/8 (every
#              rank), all three host layouts; the copies under
#              torch.cuda.set_sync_debug_mode("error")
#   restore    restore/restore_gpu.{csv,json}: bench/bench_restore.py, a
#              100K-token DeepSeek-V3.2 prefix (61 layers) restored layer by
#              layer and backed up, per rank at CP 1/2/8: ms, GB/s and % of the
#              pinned-copy ceiling, bit-exact
#   bandwidth  bandwidth/transfer_gpu_quick.{csv,json} + _d2h.png/_h2d.png:
#              quick sweep (CP 1/2/8), GB/s and % of the measured pinned-copy ceiling
#   pytest     pytest.log: `pytest tests/kernels -k cuda` (SGLang not needed)
#   sglang0523 bench/gpu_check_0523.py: the library kernels vs SGLang 0.5.23's
#              sharded copy path, bitwise + GB/s, CP 1/2/8 (when 0.5.23 is installed)
#
# --cpu runs the same stages on CPU tensors (Triton's interpreter when
# TRITON_INTERPRET=1, else the torch reference) with small pools; its files
# say "cpu" and are no GPU result. Exit status: 0 when every stage that ran
# passed, 1 otherwise, 2 on bad usage.
set -euo pipefail

MODE=gpu
OUT_ARG=""
for arg in "$@"; do
  case "$arg" in
    --cpu) MODE=cpu ;;
    --dry-run) MODE=dry-run ;;
    -h|--help) sed -n '2,/^set -euo/{/^set/!p}' "$0"; exit 0 ;;
    -*) echo "gpu_check: unknown option $arg" >&2; exit 2 ;;
    *) if [ -n "$OUT_ARG" ]; then echo "gpu_check: one OUT_DIR only" >&2; exit 2; fi; OUT_ARG=$arg ;;
  esac
done

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
OUT_DIR=${OUT_ARG:-${OUT:-$ROOT/bench/results/gpu_check_$(date -u +%Y%m%dT%H%M%SZ)}}
PY=${PYTHON:-$(command -v python || command -v python3 || echo python)}
# absolute, since the install stage runs it from another directory
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; *) PY=$(command -v "$PY" || echo "$PY") ;; esac
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/build/gpu-wheels}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
SUMMARY=$OUT_DIR/summary.txt
: > "$SUMMARY"
# Compiled kernels go to a cache inside OUT_DIR unless the caller chose one,
# so stage times are honest and later stages reuse earlier compiles.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$OUT_DIR/triton-cache}
cd "$ROOT"
GIT_SHA=${GPU_CHECK_GIT_SHA:-$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)}

START=$(date +%s)
BUDGET_S=${GPU_CHECK_BUDGET_S:-285}  # whole run, under 5 minutes
FAILED=0

note() { echo "$*" | tee -a "$SUMMARY"; }

# run_stage NAME CAP_SECONDS COMMAND...: runs with the smaller of CAP and the
# time left, output in NAME.log, one summary line; never stops the script.
run_stage() {
  local name=$1 cap=$2 rc=0 t0 left limit
  shift 2
  left=$(( BUDGET_S - ($(date +%s) - START) ))
  limit=$(( cap < left ? cap : left ))
  if [ "$limit" -lt 5 ]; then
    note "$name: SKIPPED (time budget spent)"
    FAILED=1
    return 0
  fi
  if [ "$MODE" = dry-run ]; then
    note "$name: would run (limit ${limit}s): $*"
    return 0
  fi
  echo "== $name (limit ${limit}s)"
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1 || rc=$?
  tail -n 5 "$OUT_DIR/$name.log" || true
  if [ "$rc" -eq 0 ]; then
    note "$name: OK in $(( $(date +%s) - t0 ))s"
  else
    [ "$rc" -eq 124 ] && note "$name: TIMED OUT after ${limit}s" || note "$name: FAILED (exit $rc) in $(( $(date +%s) - t0 ))s"
    FAILED=1
  fi
  return 0
}

# ----------------------------------------------------------------------------- install
# The checkout sglang_cp_hicache and its kernels import from (run from / so
# the current directory is not on the path), or nothing.
import_root() {
  (cd / && "$PY" -c 'import os, sglang_cp_hicache as p, sglang_cp_hicache.kernels as k
at = lambda m: os.path.dirname(os.path.dirname(os.path.realpath(m.__file__)))
print(at(p) if at(p) == at(k) else "mixed: %s and %s" % (at(p), at(k)))') 2>/dev/null || true
}

# pyproject's license field needs setuptools >= 77 (its bdist_wheel is built in: no `wheel`).
has_setuptools() {
  "$PY" -c 'import setuptools, sys; sys.exit(tuple(map(int, setuptools.__version__.split(".")[:2])) < (77, 0))' \
    2>/dev/null
}

# pip install from the carried-in wheels only (never an index).
from_wheels() {
  [ -d "$WHEELS" ] || { echo "no wheel folder $WHEELS"; return 1; }
  timeout 120 "$PY" -m pip install --no-index --find-links "$WHEELS" "$@"
}

# A package folder of symlinks (the package plus kernels/ as its kernels
# subpackage, as pyproject maps it) first on PYTHONPATH: needs no pip.
use_overlay() {
  local dir=$OUT_DIR/pythonpath/sglang_cp_hicache entry
  mkdir -p "$dir"
  for entry in "$ROOT"/sglang_cp_hicache/*; do ln -sfn "$entry" "$dir/$(basename "$entry")"; done
  ln -sfn "$ROOT/kernels" "$dir/kernels"
  export PYTHONPATH=$OUT_DIR/pythonpath${PYTHONPATH:+:$PYTHONPATH}
}

# Makes this checkout importable; prints how. 0 = pip or already, 3 = overlay, 1 = neither.
# pip runs only where the package is not installed at all: an install of
# another checkout is left as it is, and this one goes first on PYTHONPATH.
install_package() {
  local at
  at=$(import_root)
  if [ "$at" = "$ROOT" ]; then echo "already installed from $ROOT"; return 0; fi
  if [ -z "$at" ] && [ "${GPU_CHECK_INSTALL:-auto}" = overlay ]; then
    echo "sglang_cp_hicache is not installed; GPU_CHECK_INSTALL=overlay: no pip"
  elif [ -z "$at" ]; then
    echo "sglang_cp_hicache is not installed; installing $ROOT offline"
    has_setuptools || from_wheels 'setuptools>=77' || echo "setuptools>=77 is neither installed nor in $WHEELS"
    if has_setuptools && timeout 120 "$PY" -m pip install --no-deps --no-build-isolation --no-index -e "$ROOT" \
        && [ "$(import_root)" = "$ROOT" ]; then
      echo "installed: pip install --no-deps --no-build-isolation --no-index -e $ROOT"
      return 0
    fi
  else
    echo "sglang_cp_hicache imports from $at, not from $ROOT: left installed"
  fi
  use_overlay
  [ "$(import_root)" = "$ROOT" ] || { echo "not importable even through $OUT_DIR/pythonpath"; return 1; }
  echo "using the PYTHONPATH overlay $OUT_DIR/pythonpath"
  return 3
}

# pytest + hypothesis for the pytest stage: the environment's, else the
# carried wheels (into the environment, else into the overlay folder).
install_test_deps() {
  "$PY" -c 'import pytest, hypothesis' 2>/dev/null && { echo "pytest and hypothesis present"; return 0; }
  [ "${GPU_CHECK_INSTALL:-auto}" = overlay ] && return 1
  from_wheels pytest hypothesis && return 0
  [ -d "$WHEELS" ] || return 1
  mkdir -p "$OUT_DIR/pythonpath"
  case ":${PYTHONPATH:-}:" in *":$OUT_DIR/pythonpath:"*) ;; *) export PYTHONPATH=$OUT_DIR/pythonpath${PYTHONPATH:+:$PYTHONPATH} ;; esac
  timeout 120 "$PY" -m pip install --no-index --find-links "$WHEELS" --target "$OUT_DIR/pythonpath" pytest hypothesis
}

run_install() {
  local rc=0 t0
  if [ "$MODE" = dry-run ]; then
    note "install: would run: $PY -m pip install --no-deps --no-build-isolation --no-index -e $ROOT (only if this checkout is not importable; setuptools>=77, pytest, hypothesis from $WHEELS if missing; else a PYTHONPATH overlay)"
    return 0
  fi
  echo "== install"
  t0=$(date +%s)
  install_package > "$OUT_DIR/install.log" 2>&1 || rc=$?
  tail -n 3 "$OUT_DIR/install.log"
  case $rc in
    0) note "install: OK in $(( $(date +%s) - t0 ))s ($(tail -n 1 "$OUT_DIR/install.log"))" ;;
    3) note "install: OK in $(( $(date +%s) - t0 ))s through a PYTHONPATH overlay (see install.log)" ;;
    *) note "install: FAILED (see install.log)"; FAILED=1 ;;
  esac
  install_test_deps >> "$OUT_DIR/install.log" 2>&1 || true
}

note "gpu_check mode=$MODE out=$OUT_DIR started $(date -u +%Y-%m-%dT%H:%M:%SZ) git=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"

run_install
run_stage env 60 "$PY" bench/gpu_check.py env --out "$OUT_DIR"

if [ "$MODE" = gpu ] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  note "no CUDA device visible to $PY: nothing to check (bench/gpu_check.sh --cpu tests this script on a CPU)"
  note "gpu_check finished in $(( $(date +%s) - START ))s: FAIL"
  exit 1
fi

if [ "$MODE" = cpu ]; then
  run_stage checks 240 "$PY" bench/gpu_check.py checks --device cpu --out "$OUT_DIR" \
    --kinds kv_fp8,indexer --host-layouts layer_first,page_first
  run_stage restore 120 "$PY" bench/bench_restore.py --cpu --host-layouts layer_first,page_first \
    --git-sha "$GIT_SHA" --out "$OUT_DIR/restore"
  run_stage bandwidth 120 "$PY" bench/bench_transfer.py --cpu --quick --pages 1,16 --kinds indexer,kv_fp8 \
    --layers 2 --ceiling-mib 16 --git-sha "$GIT_SHA" --out "$OUT_DIR/bandwidth"
else
  run_stage checks 100 "$PY" bench/gpu_check.py checks --device cuda --out "$OUT_DIR"
  # 100K tokens x 61 layers, fp8 then bf16 KV, CP 1/2/8: no new configuration after 40 s
  run_stage restore 75 "$PY" bench/bench_restore.py --time-budget-s 40 --git-sha "$GIT_SHA" --out "$OUT_DIR/restore"
  run_stage bandwidth 90 "$PY" bench/bench_transfer.py --gpu --quick --time-budget-s 50 --git-sha "$GIT_SHA" \
    --out "$OUT_DIR/bandwidth"
fi

# The CUDA-only kernel tests; SGLang is not needed (tests/conftest.py skips
# what imports it). exit 5 = no test selected: not a failure.
if [ "$MODE" = cpu ]; then
  note "pytest: SKIPPED (cpu mode: the CUDA tests need a GPU)"
elif [ "$MODE" = gpu ] && ! "$PY" -c 'import pytest, hypothesis' > /dev/null 2>&1; then
  note "pytest: SKIPPED (pytest/hypothesis not importable and not in $WHEELS: make gpu-wheels)"
else
  run_stage pytest 90 bash -c '"$0" -m pytest tests/kernels -k cuda -q -rs; rc=$?; [ "$rc" -eq 5 ] && exit 0; exit "$rc"' "$PY"
fi

# SGLang 0.5.23's sharded copy path vs this library's kernels (needs SGLang
# 0.5.23 + sgl_kernel in this environment; the script exits 3 when not).
if [ "$MODE" = gpu ]; then
  rc=0
  "$PY" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('sglang') == '0.5.23' else 3)" \
    > /dev/null 2>&1 || rc=$?
  if [ "$rc" -eq 0 ]; then
    run_stage sglang0523 60 "$PY" bench/gpu_check_0523.py --out "$OUT_DIR/sglang0523"
  else
    note "sglang0523: SKIPPED (SGLang 0.5.23 not installed here)"
  fi
fi

note "gpu_check finished in $(( $(date +%s) - START ))s: $([ "$FAILED" -eq 0 ] && echo PASS || echo FAIL)"
exit "$FAILED"
