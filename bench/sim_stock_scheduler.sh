#!/usr/bin/env bash
# SGLang 0.5.18 under its real Scheduler: the library's CP cache at CP 2
# against stock HiRadixCache at CP 1 with the same logical pools (2 x 10 - 1
# = 19 device pages, 60 host pages of logical room), on the simulator's
# synthetic chat workload (120 requests, seed 0), both through
# `simulate --engine scheduler` (closed-loop arrivals, 8 running, chunk 1024).
# Stock's paged allocator runs a Triton kernel, so both runs set
# TRITON_INTERPRET=1 (the library's allocator never calls it).
#
#   bash bench/sim_stock_scheduler.sh [OUT_DIR]    (default bench/results/stock_scheduler)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/stock_scheduler}
mkdir -p "$OUT"
run() {  # NAME ARGS...
    local name=$1; shift
    local args=(--engine scheduler --no-progress --json "$OUT/$name.json" "$@")
    {
        echo "\$ TRITON_INTERPRET=1 .venv/bin/python -m sglang_cp_hicache simulate ${args[*]}"
        { time TRITON_INTERPRET=1 .venv/bin/python -m sglang_cp_hicache simulate "${args[@]}"; } 2>&1 | grep -v -i 'warn'
    } > "$OUT/$name.txt" || echo "$name: FAILED (see $OUT/$name.txt)"
    echo "$name: done"
}
run 0518-scheduler-library-cp2 --cp-size 2 --device-pages 10 --host-pages 30
run 0518-scheduler-stock-cp1 --cp-size 1 --device-pages 20 --host-pages 60
