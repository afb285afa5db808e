#!/usr/bin/env bash
# Both simulator engines side by side on the Mooncake FAST'25 conversation
# trace: the loop engine (one request at a time, the simulator's own loop)
# and the scheduler engine (SGLang's real Scheduler and event loop in each CP
# rank, only the model worker replaced; closed-loop arrivals, at most
# --max-running-requests 8 in flight, --chunked-prefill-size 1024), at CP 4
# with pools sized from the trace (--capacity default), on SGLang 0.5.18
# (.venv) and 0.5.23 (.venv-0523, --copy library and --copy upstream).
#
#   bash bench/sim_engines.sh TRACE [OUT_DIR] [CONFIG ...]
#
# TRACE: conversation_trace.jsonl; OUT_DIR: default bench/results/engines;
# CONFIG: e.g. 0518-scheduler 0523-upstream-loop (default: all six). Each
# run writes NAME.json (summary) and NAME.txt (the command, the printed
# table and its time). REQUESTS (default 1000) replays the first lines.
set -euo pipefail
cd "$(dirname "$0")/.."
TRACE=${1:?usage: bash bench/sim_engines.sh TRACE [OUT_DIR] [CONFIG ...]}
OUT=${2:-bench/results/engines}
shift $(( $# >= 2 ? 2 : 1 ))
REQUESTS=${REQUESTS:-1000}
mkdir -p "$OUT"

run() {  # NAME PYTHON ENGINE EXTRA...
    local name=$1 py=$2 engine=$3; shift 3
    local args=(--engine "$engine" --trace "$TRACE" --requests "$REQUESTS" --cp-size 4 --no-progress
                --json "$OUT/$name.json" "$@")
    {
        echo "\$ $py -m sglang_cp_hicache simulate ${args[*]}"
        { time "$py" -m sglang_cp_hicache simulate "${args[@]}"; } 2>&1 | grep -v -i 'warn'
    } > "$OUT/$name.txt" || echo "$name: FAILED (see $OUT/$name.txt)"
    echo "$name: done"
}

ALL=(0518-scheduler 0518-loop 0523-library-scheduler 0523-library-loop 0523-upstream-scheduler 0523-upstream-loop)
for config in "${@:-${ALL[@]}}"; do
    engine=${config##*-}
    case $config in
        0518-*) run "$config" .venv/bin/python "$engine" ;;
        0523-library-*) run "$config" .venv-0523/bin/python "$engine" --copy library ;;
        0523-upstream-*) run "$config" .venv-0523/bin/python "$engine" --copy upstream ;;
        *) echo "unknown config $config" >&2; exit 2 ;;
    esac
done
