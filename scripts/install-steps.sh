# Sourced by the install scripts: one line per step on the terminal, every
# tool's own output (pip's resolver notes, build banners, apt) in a log file
# that is named, with its last lines, when a step fails.
#
#   begin_install NAME TOTAL_STEPS   # log: build/NAME.log (started afresh)
#   step "what it does" cmd args...  # "NAME [i/N] what it does ... ok (Ts)"
#   say "text"                       # one line of our own

begin_install() {
    INSTALL_NAME=$1
    INSTALL_STEPS=$2
    INSTALL_STEP=0
    INSTALL_T0=$(date +%s)
    mkdir -p build
    INSTALL_LOG="build/$INSTALL_NAME.log"
    : >"$INSTALL_LOG"
}

say() {
    echo "$INSTALL_NAME: $*"
}

step() {
    local label=$1
    shift
    INSTALL_STEP=$((INSTALL_STEP + 1))
    local t0
    t0=$(date +%s)
    printf '%s [%d/%d] %s ... ' "$INSTALL_NAME" "$INSTALL_STEP" "$INSTALL_STEPS" "$label"
    echo "=== [$INSTALL_STEP/$INSTALL_STEPS] $label: $*" >>"$INSTALL_LOG"
    local rc=0
    "$@" >>"$INSTALL_LOG" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "FAILED (exit $rc)"
        {
            echo "$INSTALL_NAME: step '$label' failed; the full output is in $INSTALL_LOG. Its last lines:"
            tail -n 15 "$INSTALL_LOG" | sed 's/^/    /'
            echo "$INSTALL_NAME: FAILED at '$label' (log: $INSTALL_LOG)"
        } >&2
        exit "$rc"
    fi
    echo "ok ($(($(date +%s) - t0)) s)"
}

install_seconds() {
    echo $(($(date +%s) - INSTALL_T0))
}

# "ready" line: the versions a Python snippet prints, or a failure naming the log.
finish_install() {
    local venv=$1 snippet=$2 versions
    if ! versions=$("$venv/bin/python" -c "$snippet" 2>>"$INSTALL_LOG"); then
        echo "$INSTALL_NAME: FAILED: $venv does not import what it should (log: $INSTALL_LOG)" >&2
        tail -n 15 "$INSTALL_LOG" | sed 's/^/    /' >&2
        exit 1
    fi
    say "ready: $venv ($versions) in $(install_seconds) s; log: $INSTALL_LOG"
}
