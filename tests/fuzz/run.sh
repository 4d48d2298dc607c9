#!/usr/bin/env bash
# tests/fuzz/run.sh: runs fuzzers built by build.sh for a given time each. New coverage goes to
# out/fuzz/corpus/<target>/ (the committed seeds in tests/fuzz/corpus/<target>/ are read, not
# written); a crashing input is written straight into tests/fuzz/crashes/<target>/, where the
# <target>_replay test of ./dev test replays it from then on (commit it with the fix).
# Usage: tests/fuzz/run.sh [target|all] [seconds]     (default: all, 60 s each)
set -euo pipefail
cd "$(dirname "$0")/../.."

ALL=(wire validate config admin)
target=${1:-all}
secs=${2:-60}
if [ "$target" = all ]; then targets=("${ALL[@]}"); else targets=("$target"); fi

failed=()
for t in "${targets[@]}"; do
    bin=out/fuzz/$t
    [ -x "$bin" ] || { echo "fuzz: $bin is not built (tests/fuzz/build.sh)" >&2; exit 2; }
    mkdir -p "out/fuzz/corpus/$t" "tests/fuzz/crashes/$t"
    log=out/fuzz/$t.log
    echo "==> fuzz $t for ${secs}s" >&2
    rc=0
    "$bin" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        -dict=tests/fuzz/kvd.dict -artifact_prefix="tests/fuzz/crashes/$t/" \
        "out/fuzz/corpus/$t" "tests/fuzz/corpus/$t" >"$log" 2>&1 || rc=$?
    runs=$(grep -oE '^stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$' || true)
    cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1 || true)
    echo "fuzz $t: ${runs:-?} runs in ${secs}s, ${cov:-cov: ?}, exit $rc" >&2
    if [ "$rc" != 0 ]; then
        grep -E 'property failed|ERROR:|SUMMARY|Test unit written' "$log" >&2 || tail -20 "$log" >&2
        failed+=("$t")
    fi
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzz: FAILED: ${failed[*]} (inputs saved in tests/fuzz/crashes/; logs in out/fuzz/)" >&2
    exit 1
fi
echo "fuzz: ${targets[*]}: no crash" >&2
