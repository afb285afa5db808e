#!/usr/bin/env bash
# Prepared GPU check of the CP page-copy kernels: one GPU, under 5 minutes.
#
#   bench/gpu_check.sh [OUT_DIR]            # or: OUT=/some/dir bench/gpu_check.sh
#   bench/gpu_check.sh --cpu [OUT_DIR]      # exercise this script on a CPU-only machine
#   bench/gpu_check.sh --dry-run [OUT_DIR]  # print the stages, run nothing
#
# Needs CUDA torch + triton and this package installed (pip install -e .);
# SGLang is optional. OUT_DIR (default bench/results/gpu_check_<UTC time>) is
# created. Stages, each with its own time limit; every stage writes its own
# files and one line of summary.txt whatever the others do:
#
#   env        env.json: versions, GPU, whether SGLang imports
#   checks     checks.json: bitwise round trips through all four kernels on
#              cudaHostRegister'ed and pin_memory host buffers, CP 1/2/8 (every
#              rank), all three host layouts; the copies under
#              torch.cuda.set_sync_debug_mode("error")
#   bandwidth  bandwidth/transfer_gpu_quick.{csv,json} + _d2h.png/_h2d.png:
#              quick sweep (CP 1/2/8), GB/s and % of the measured pinned-copy ceiling
#   pytest     pytest.log: `pytest tests -k cuda` when SGLang imports, else skipped
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
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    -*) echo "gpu_check: unknown option $arg" >&2; exit 2 ;;
    *) if [ -n "$OUT_ARG" ]; then echo "gpu_check: one OUT_DIR only" >&2; exit 2; fi; OUT_ARG=$arg ;;
  esac
done

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT_DIR=${OUT_ARG:-${OUT:-$ROOT/bench/results/gpu_check_$(date -u +%Y%m%dT%H%M%SZ)}}
PY=${PYTHON:-python}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
SUMMARY=$OUT_DIR/summary.txt
: > "$SUMMARY"
# Compiled kernels go to a cache inside OUT_DIR unless the caller chose one,
# so stage times are honest and later stages reuse earlier compiles.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$OUT_DIR/triton-cache}
cd "$ROOT"

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

note "gpu_check mode=$MODE out=$OUT_DIR started $(date -u +%Y-%m-%dT%H:%M:%SZ) git=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"

run_stage env 60 "$PY" bench/gpu_check.py env --out "$OUT_DIR"

if [ "$MODE" = gpu ] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  note "no CUDA device visible to $PY: nothing to check (bench/gpu_check.sh --cpu tests this script on a CPU)"
  note "gpu_check finished in $(( $(date +%s) - START ))s: FAIL"
  exit 1
fi

if [ "$MODE" = cpu ]; then
  run_stage checks 240 "$PY" bench/gpu_check.py checks --device cpu --out "$OUT_DIR" \
    --kinds kv_fp8,indexer --host-layouts layer_first,page_first
  run_stage bandwidth 120 "$PY" bench/bench_transfer.py --cpu --quick --pages 1,16 --kinds indexer,kv_fp8 \
    --layers 2 --ceiling-mib 16 --out "$OUT_DIR/bandwidth"
else
  run_stage checks 120 "$PY" bench/gpu_check.py checks --device cuda --out "$OUT_DIR"
  run_stage bandwidth 110 "$PY" bench/bench_transfer.py --gpu --quick --time-budget-s 60 --out "$OUT_DIR/bandwidth"
fi

if [ "$MODE" = cpu ]; then
  note "pytest: SKIPPED (cpu mode: the CUDA tests need a GPU)"
elif [ "$MODE" = dry-run ]; then
  run_stage pytest 120 "$PY" -m pytest tests -k cuda -q
elif "$PY" -c "from sglang_cp_hicache.testing.cpu_support import ensure_sglang_importable as e; e()" \
    > "$OUT_DIR/pytest.log" 2>&1; then
  # exit 5 = no test selected: nothing CUDA-only to run, not a failure
  run_stage pytest 120 bash -c '"$0" -m pytest tests -k cuda -q -rs; rc=$?; [ "$rc" -eq 5 ] && exit 0; exit "$rc"' "$PY"
else
  note "pytest: SKIPPED (SGLang does not import; see pytest.log)"
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
