#!/usr/bin/env bash
# run.sh — the GPU device check, run from a bundle that `./dev gpu-bundle` built elsewhere.
#
# Needs nothing but this folder, bash with coreutils, glibc/libstdc++ and the NVIDIA driver's
# libcuda.so.1: every binary here carries the libraries it links in lib/ (RUNPATH $ORIGIN).
# Steps, each with its own time limit, all within 8 minutes; each appends its section to
# $OUT/gpu_results.md (or ./gpu_results.md without $OUT) as soon as it finishes:
#   load     every binary's libraries resolve (the dynamic loader's --list, no GPU needed)
#   probe    device report and the facts kvd relies on (gpu_probe: granularity, VMM fd export and
#            import, non-zero map offsets, IPC handles); no GPU visible -> exit 2 at once
#   tests    every requires-gpu test of the build (tests.txt; an empty list is a failure), with
#            KVD_EXPECT_GPU=1 so a test that would skip fails instead
#   selftest kvd on cuda-vmm and on cuda-ipc, `kvctl selftest isolation` against each
#   zerocopy tests/gpu/zero_copy_bench (attention over kvd's memory vs self-allocated)
#   tiers    tests/gpu/tiers_copy_bench (a GPU pool's T0 <-> T1 copies vs cuMemcpy, pinned and
#            pageable)
#   kernels  kernels/kvk_bench (copy_blocks vs cudaMemcpy, decode attention vs HBM peak)
#   then every executable in checks.d/ (later GPU checks), in name order
# Exit: 0 every step passed, 1 a step failed or timed out, 2 no GPU visible.
# Usage: run.sh [STEP...]   (default: all steps, in the order above)
set -uo pipefail
case "$0" in */*) cd "${0%/*}" || exit 1 ;; esac
BUNDLE=$(pwd)
OUT_DIR=${OUT:-$BUNDLE}
mkdir -p "$OUT_DIR"
RESULTS="$OUT_DIR/gpu_results.md"
LOGS="$OUT_DIR/gpu_logs"
mkdir -p "$LOGS"
DEADLINE=$((SECONDS + ${KVD_CHECK_SECONDS:-480}))
failed=0

note() { printf '%s\n' "$@" >>"$RESULTS"; }
say() { printf '==> %s\n' "$*" >&2; }

# step NAME LIMIT CMD...: runs CMD with a time limit (never past the deadline), its output in
# gpu_logs/NAME.log, and a section in the results with the status and the output's last lines
# (the whole output with FULL=1).
step() {
    local name=$1 limit=$2
    shift 2
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -le 5 ]; then
        note "" "## $name" "" "**not run**: the 8-minute budget is spent."
        failed=1
        return 1
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    say "$name (limit ${limit}s)"
    local t0=$SECONDS rc=0
    if declare -F "$1" >/dev/null; then
        # A function of this script: timeout runs programs, so in a fresh bash that has it.
        timeout -k 5 "$limit" "$BASH" -c '"$@"' "$name" "$@" >"$LOGS/$name.log" 2>&1 || rc=$?
    else
        timeout -k 5 "$limit" "$@" >"$LOGS/$name.log" 2>&1 || rc=$?
    fi
    local took=$((SECONDS - t0)) status=passed
    if [ "$name" = probe ] && [ "$rc" = 2 ]; then
        status="no GPU visible"
    elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        status="**TIMED OUT** after ${limit}s"
    elif [ "$rc" != 0 ]; then
        status="**FAILED** (exit $rc)"
    fi
    note "" "## $name: $status (${took}s)" "" '```'
    if [ "${FULL:-0}" = 1 ]; then cat "$LOGS/$name.log" >>"$RESULTS"; else tail -n 40 "$LOGS/$name.log" >>"$RESULTS"; fi
    note '```'
    say "$name: $status (${took}s)"
    [ "$rc" = 0 ] || failed=1
    return "$rc"
}

ldso() {
    local l
    for l in /lib64/ld-linux-x86-64.so.2 /lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 /lib/ld-linux-aarch64.so.1; do
        [ -x "$l" ] && { echo "$l"; return 0; }
    done
    return 1
}

load_check() {
    local l bad=0 n=0
    l=$(ldso) || { echo "no dynamic loader found"; return 1; }
    while read -r b; do
        n=$((n + 1))
        if ! out=$("$l" --list "$b" 2>&1) || [[ $out == *"not found"* ]]; then
            echo "$b: a library does not resolve:"
            echo "$out"
            bad=1
        else
            echo "$b: ok"
        fi
    done <bins.txt
    [ "$n" -gt 0 ] || { echo "bins.txt lists no binaries"; return 1; }
    return "$bad"
}

gpu_tests() {
    local n=0 bad=0 t
    while read -r t; do
        [ -n "$t" ] || continue
        n=$((n + 1))
        if [ ! -x "$t" ]; then
            echo "$t: listed in tests.txt but missing from the bundle"
            bad=1
            continue
        fi
        echo "### $t"
        TEST_TMPDIR=$(mktemp -d) KVD_EXPECT_GPU=1 "./$t" 2>&1 | tail -n 30
        [ "${PIPESTATUS[0]}" = 0 ] || { echo "$t FAILED"; bad=1; }
    done < tests.txt
    if [ "$n" = 0 ]; then
        echo "tests.txt lists no tests: nothing was checked"
        return 1
    fi
    echo "$n test binaries, $([ "$bad" = 0 ] && echo all passed || echo some FAILED)"
    return "$bad"
}

# kvd on one GPU backend; `kvctl selftest isolation` must pass (it writes and reads blocks
# through the backend, never through a device address from the CPU).
selftest_on() {
    local backend=$1 dir rc=0
    dir=$(mktemp -d /tmp/kvd-check-XXXXXX)
    ./daemon/kvd --socket="$dir/kvd.sock" --backend="$backend" --pool-memory=256M \
        --segment-bytes=32M --log-level=warn &
    local pid=$!
    for _ in $(seq 100); do
        [ -S "$dir/admin.sock" ] && break
        kill -0 "$pid" 2>/dev/null || { echo "kvd --backend=$backend exited at start"; rm -rf "$dir"; return 1; }
        sleep 0.1
    done
    ./kvctl/kvctl --socket="$dir/admin.sock" info || rc=1
    ./kvctl/kvctl --socket="$dir/admin.sock" selftest isolation || rc=1
    kill -TERM "$pid"
    wait "$pid" || rc=1
    rm -rf "$dir"
    return "$rc"
}

selftests() {
    local rc=0
    echo "### cuda-vmm"; selftest_on cuda-vmm || rc=1
    echo "### cuda-ipc"; selftest_on cuda-ipc || rc=1
    return "$rc"
}

export -f ldso load_check gpu_tests selftest_on selftests

extra_checks() {
    local c rc=0 n=0
    for c in checks.d/*; do
        [ -x "$c" ] || continue
        n=$((n + 1))
        step "check $(basename "$c")" 120 "$c" || rc=1
    done
    [ "$n" -gt 0 ] || note "" "(no extra checks in checks.d/)"
    return "$rc"
}

{
    echo "# GPU device check"
    echo
    echo "Bundle of $(cat BUILT 2>/dev/null || echo 'an unknown build'); run $(date -u +%FT%TZ) on $(uname -n)."
} >>"$RESULTS"

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(load probe tests selftest zerocopy tiers kernels extra)
for s in "${steps[@]}"; do
    case "$s" in
        load) step load 30 load_check ;;
        probe)
            FULL=1 step probe 60 ./tests/gpu/gpu_probe
            rc=$?
            if [ "$rc" = 2 ]; then
                note "" "No GPU visible: nothing else was run."
                say "no GPU visible: $(tail -n 1 "$LOGS/probe.log")"
                exit 2
            fi
            ;;
        tests) step tests 150 gpu_tests ;;
        selftest) step selftest 60 selftests ;;
        zerocopy) FULL=1 step zerocopy 90 env OUT= ./tests/gpu/zero_copy_bench ;;
        tiers) FULL=1 step tiers 45 env OUT= ./tests/gpu/tiers_copy_bench ;;
        kernels) FULL=1 step kernels 90 ./kernels/kvk_bench ;;
        extra) extra_checks || failed=1 ;;
        *) echo "unknown step: $s" >&2; exit 1 ;;
    esac
done
note "" "Result: $([ "$failed" = 0 ] && echo 'every step passed' || echo 'some steps FAILED') ($SECONDS s)."
say "results in $RESULTS"
exit "$failed"
