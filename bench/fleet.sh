#!/usr/bin/env bash
# A fleet of three deployments (0.5.23 CP 4, 0.5.23 CP 2, 0.5.18 CP 2) on the
# Mooncake conversation trace (first REQUESTS requests, 64 tokens a hash id),
# through `python -m sglang_cp_hicache fleet` on ENGINE (default loop, the
# engine of the committed results; ENGINE=scheduler: SGLang's own scheduler,
# file L3 only, so not the `segment` part):
#
#   bash bench/fleet.sh TRACE [OUT_DIR] [PART ...]
#
# PART: `routes` (each --route with --l3-scope fleet and deployment: 6 runs),
# `size` (fleet hit_ratio against the bounded L3 directory's max size,
# SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE, prefix-affinity, fleet scope), `host`
# (against host pages per rank, same), `segment` (against the Mooncake segment
# each CP rank's client lends, --l3 mooncake: one master the fleet starts,
# prefix-affinity, fleet scope; on MOONCAKE_DEPLOYMENTS, 0.5.18 ones by default
# since only .venv has the mooncake wheel), `whole` (with REQUESTS=12031: the whole
# conversation trace, each of WHOLE_SCOPES and WHOLE_ROUTES, --capacity WHOLE_CAPACITY);
# default: the first three. Each run writes
# NAME.json and NAME.txt (the command, the printed table, its time) under
# OUT_DIR (default bench/results/fleet/run-<time>); L3 directories are fresh
# ones under $TMPDIR, removed afterwards. Then: python bench/fleet_table.py OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
TRACE=${1:?usage: bash bench/fleet.sh TRACE [OUT_DIR] [PART ...]}
OUT=${2:-bench/results/fleet/run-$(date +%Y%m%d-%H%M%S)}
shift $(( $# >= 2 ? 2 : 1 ))
REQUESTS=${REQUESTS:-1000}
ENGINE=${ENGINE:-loop}
DEPLOYMENTS=${DEPLOYMENTS:-"0.5.23:cp4 0.5.23:cp2 0.5.18:cp2"}
SIZES=${SIZES:-"2M 8M 32M 128M"}
HOSTS=${HOSTS:-"4 16 64"}
# `whole`: pools hold this share of the trace's distinct pages (0.25 would need ~16 GB of pools on 24 GB)
WHOLE_CAPACITY=${WHOLE_CAPACITY:-0.1}
WHOLE_SCOPES=${WHOLE_SCOPES:-"fleet deployment"}
WHOLE_ROUTES=${WHOLE_ROUTES:-"prefix-affinity round-robin least-loaded"}
SEGMENTS=${SEGMENTS:-"16mb 64mb 256mb"}
MOONCAKE_DEPLOYMENTS=${MOONCAKE_DEPLOYMENTS:-"0.5.18:cp4 0.5.18:cp2 0.5.18:cp2"}
mkdir -p "$OUT"

run() {  # NAME [ENV=VALUE ...] -- FLEET FLAGS...
    local name=$1; shift
    local envs=()
    while [ "$1" != -- ]; do envs+=("$1"); shift; done
    shift
    local l3dir deps=()
    l3dir=$(mktemp -d "${TMPDIR:-/tmp}/fleet-l3-$name-XXXX")
    for d in $DEPLOYMENTS; do deps+=(--deployment "$d${HOST_SUFFIX:-}"); done
    local args=("${deps[@]}" --engine "$ENGINE" --trace "$TRACE" --requests "$REQUESTS" --l3 "${L3:-$l3dir}" --no-progress
                --json "$OUT/$name.json" "$@")
    {
        echo "\$ ${envs[*]} .venv/bin/python -m sglang_cp_hicache fleet ${args[*]}"
        { time env "${envs[@]}" .venv/bin/python -m sglang_cp_hicache fleet "${args[@]}"; } 2>&1
    } > "$OUT/$name.txt" || echo "$name: FAILED (see $OUT/$name.txt)"
    rm -rf "$l3dir"
    echo "$name: $(grep '^result:' "$OUT/$name.txt" || echo 'no result line')"
}

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(routes size host)
for part in "${parts[@]}"; do
    case $part in
        routes)
            for scope in fleet deployment; do
                for route in round-robin prefix-affinity least-loaded; do
                    run "route-$route-$scope" -- --route "$route" --l3-scope "$scope"
                done
            done ;;
        size)
            for size in $SIZES; do
                run "size-$size" SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE="$size" -- --route prefix-affinity
            done ;;
        host)
            for host in $HOSTS; do
                HOST_SUFFIX=":host=$host" run "host-$host" -- --route prefix-affinity
            done ;;
        segment)
            for segment in $SEGMENTS; do
                DEPLOYMENTS=$MOONCAKE_DEPLOYMENTS L3=mooncake run "segment-$segment" -- --route prefix-affinity \
                    --mooncake-segment "$segment"
            done ;;
        whole)  # every request of TRACE (set REQUESTS to the trace's count): each WHOLE_SCOPES x WHOLE_ROUTES
            for scope in $WHOLE_SCOPES; do
                for route in $WHOLE_ROUTES; do
                    name="whole-$route-$scope"
                    [ "$route" != prefix-affinity ] || name="whole-$scope"  # the first runs' names
                    run "$name" -- --route "$route" --l3-scope "$scope" --capacity "$WHOLE_CAPACITY"
                done
            done ;;
        *) echo "unknown part $part" >&2; exit 2 ;;
    esac
done
