#!/usr/bin/env bash
# The whole test suite on a busy machine: one busy loop per core beside `cargo test --release
# --workspace`, RUNS times in a row (default 3). A test that passes alone but fails here waits for
# a sleep instead of a state, or races: fix the test (or the code), never the machine.
#
#   scripts/stress-tests.sh [RUNS] [-- extra cargo test args]
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-3}
shift || true
[[ "${1:-}" == "--" ]] && shift
export CARGO_TERM_COLOR=never

cargo test --release --workspace --no-run >/dev/null

hogs=()
cleanup() { for p in "${hogs[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
for _ in $(seq "$(nproc)"); do
    (while :; do :; done) &
    hogs+=($!)
done

for i in $(seq "$RUNS"); do
    log=$(mktemp /tmp/kvbridge-stress.XXXXXX.log)
    start=$(date +%s)
    if cargo test --release --workspace "$@" >"$log" 2>&1; then
        echo "run $i/$RUNS: passed in $(( $(date +%s) - start )) s ($(grep -c '^test result: ok' "$log") test binaries)"
        rm -f "$log"
    else
        echo "run $i/$RUNS: FAILED after $(( $(date +%s) - start )) s; log: $log"
        grep -E '^(test .* FAILED|failures:|---- )' "$log" | head -40
        exit 1
    fi
done
