#!/usr/bin/env bash
# The Mooncake FAST'25 conversation trace through the simulator: CP 2/4/8 on
# SGLang 0.5.18 (.venv) and 0.5.23 (.venv-0523, library and upstream copies),
# with and without L3, the first REQUESTS requests at block scale 64 (one page
# a hash id). Every CP size has the same logical capacity: 512 device pages and
# HOST_LOGICAL host pages (a quarter of the 20,540 whole pages the first 1,000
# requests touch). Runs without L3 also replay the plain (non-CP) stack of the
# same release with that capacity in one pool (--compare-non-cp, single).
#
#   bash bench/sim_traces.sh TRACE [OUT_DIR] [CONFIG ...]
#
# TRACE: conversation_trace.jsonl of the Mooncake release; OUT_DIR: default
# bench/results/traces/run-<time> (a new directory: committed results are
# never overwritten unless named); CONFIG: e.g. 0518-cp4 0523-library-cp4-l3
# (default: all 15). Each run writes NAME.json (summary) and NAME.txt (the
# command, the printed table and its time); L3 runs use a fresh directory
# under $TMPDIR, removed afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
TRACE=${1:?usage: bash bench/sim_traces.sh TRACE [OUT_DIR] [CONFIG ...]}
OUT=${2:-bench/results/traces/run-$(date +%Y%m%d-%H%M%S)}
shift $(( $# >= 2 ? 2 : 1 ))
REQUESTS=${REQUESTS:-1000}
DEVICE_LOGICAL=512
HOST_LOGICAL=5136
mkdir -p "$OUT"

run() {  # NAME PYTHON CP L3(l3|-) EXTRA...
    local name=$1 py=$2 cp=$3 l3=$4; shift 4
    local l3dir=""
    local args=(--engine loop --cp-size "$cp" --device-pages $((DEVICE_LOGICAL / cp)) --host-pages $((HOST_LOGICAL / cp))
                --trace "$TRACE" --requests "$REQUESTS" --no-progress --json "$OUT/$name.json" "$@")
    if [ "$l3" = l3 ]; then
        l3dir=$(mktemp -d "${TMPDIR:-/tmp}/cp-l3-$name-XXXX")
        args+=(--l3 "$l3dir")
    else
        args+=(--compare-non-cp --non-cp-group single)
    fi
    {
        echo "\$ $py -m sglang_cp_hicache simulate ${args[*]}"
        { time "$py" -m sglang_cp_hicache simulate "${args[@]}"; } 2>&1
    } > "$OUT/$name.txt" || echo "$name: FAILED (see $OUT/$name.txt)"
    [ -z "$l3dir" ] || rm -rf "$l3dir"
    echo "$name: $(grep '^result:' "$OUT/$name.txt" || echo 'no result line')"
}

ALL=()
for cp in 4 2 8; do
    ALL+=(0518-cp$cp 0523-library-cp$cp 0523-upstream-cp$cp 0518-cp$cp-l3 0523-library-cp$cp-l3)
done
for config in "${@:-${ALL[@]}}"; do
    cp=${config##*cp}; cp=${cp%%-*}
    case $config in
        0518-cp*-l3) run "$config" .venv/bin/python "$cp" l3 ;;
        0518-cp*) run "$config" .venv/bin/python "$cp" - ;;
        0523-library-cp*-l3) run "$config" .venv-0523/bin/python "$cp" l3 --copy library ;;
        0523-library-cp*) run "$config" .venv-0523/bin/python "$cp" - --copy library ;;
        0523-upstream-cp*) run "$config" .venv-0523/bin/python "$cp" - --copy upstream ;;
        *) echo "unknown config $config" >&2; exit 2 ;;
    esac
done
