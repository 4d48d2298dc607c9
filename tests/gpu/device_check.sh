#!/usr/bin/env bash
# tests/gpu/device_check.sh — on a GPU machine: builds and runs every requires-gpu test and the
# kernel benchmarks (kernels/kvk_bench.c) within 5 minutes, and writes the results to
# $OUT/gpu_results.md when $OUT is set (else to ./gpu_results.md).
#
# Uses Bazel when it is installed; otherwise builds the same sources directly with nvcc and cc
# (a bare GPU machine often has the CUDA toolkit but no Bazel; KVD_NO_BAZEL=1 forces that path).
# Needs libcmocka for the tests.
#
# With Bazel this includes //tests/gpu:gpu_share_test (a real kvd exports cuda-vmm and cuda-ipc
# pools; writer and reader processes share blocks through them) and, as its own step after the
# benchmarks, //tests/gpu:zero_copy_bench (decode attention over a kvd cuda-vmm pool's layer
# tensors vs the same blocks in memory the process allocated itself: asserts equal data and
# outputs, appends its timings to the results). The no-Bazel path builds only the kernels: the
# kvd-backed tests need the daemon's dependencies (libuv, protobuf-c), so run them with Bazel.
# Without a visible GPU (nvidia-smi lists none and there is no /dev/nvidia0) it says so, runs
# nothing and exits 2 at once; with KVD_DRY_BUILD=1 it builds everything first (a dry run of the
# build; minutes on a small machine).
set -uo pipefail
cd "$(dirname "$0")/../.."
START=$(date +%s)
RESULTS="${OUT:-.}/gpu_results.md"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
rc=0

section() { printf '\n## %s\n\n' "$*" >>"$RESULTS"; }
log() { printf '==> %s\n' "$*" >&2; }

{
    echo "# GPU device check"
    echo
    echo "Commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
         "$(git diff --quiet 2>/dev/null || echo '(with local changes)'), $(date -u +%FT%TZ)"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | head -3
    echo '```'
} >"$RESULTS"

HAVE_GPU=1
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && ! [ -e /dev/nvidia0 ]; then
    HAVE_GPU=0
    printf '\nNo GPU visible on this machine (nvidia-smi lists none, no /dev/nvidia0): nothing run.\n' | tee -a "$RESULTS" >&2
    if [ "${KVD_DRY_BUILD:-0}" != 1 ]; then
        exit 2
    fi
fi

if ! [ -x "$NVCC" ]; then
    echo "no nvcc found: cannot build the CUDA kernels" | tee -a "$RESULTS"
    exit 1
fi

if [ "${KVD_NO_BAZEL:-0}" != 1 ] && command -v bazel >/dev/null; then
    log "building with Bazel"
    BZ=(bazel --output_base="$WORK/bazel")
    # zero_copy_bench runs as its own step below, not among the tests.
    tests=$("${BZ[@]}" query 'attr(tags, "requires-gpu", tests(//...)) except //tests/gpu:zero_copy_bench' 2>/dev/null)
    "${BZ[@]}" build -c opt --symlink_prefix=/ //kernels:kvk_bench //tests/gpu:zero_copy_bench $tests >"$WORK/build.log" 2>&1 \
        || { section "Build failed"; echo '```' >>"$RESULTS"; tail -40 "$WORK/build.log" >>"$RESULTS"; echo '```' >>"$RESULTS"; exit 1; }
    BIN=$("${BZ[@]}" info -c opt bazel-bin 2>/dev/null)
    TEST_BINS=()
    for t in $tests; do
        p=${t#//}
        TEST_BINS+=("$BIN/${p/://}")
    done
    BENCH="$BIN/kernels/kvk_bench"
    ZERO_COPY="$BIN/tests/gpu/zero_copy_bench"
else
    log "no Bazel: building directly with nvcc and cc"
    GENCODE="-gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90"
    CFLAGS="-std=c11 -D_GNU_SOURCE -O2 -g -Wall -Wextra -I. -DKV_HAVE_CUDA=1"
    CUDA_LIB=$(dirname "$(readlink -f "$NVCC")")/../lib64
    [ -e "$CUDA_LIB/libcudart_static.a" ] || CUDA_LIB=$(dirname "$(readlink -f "$NVCC")")/../targets/x86_64-linux/lib
    objs=()
    for cu in kernels/kvk_cuda.cu kernels/kvk_probe.cu; do
        o="$WORK/$(basename "$cu" .cu).o"
        "$NVCC" -O3 -std=c++17 $GENCODE -Xcompiler=-fPIC -I. -c "$cu" -o "$o" || exit 1
        objs+=("$o")
    done
    for c in common/kv_err.c common/kv_log.c common/kv_layout.c kernels/kvk_cache.c \
             kernels/kvk_attn.c kernels/kvk_quant.c; do
        o="$WORK/$(basename "$c" .c).o"
        cc $CFLAGS -c "$c" -o "$o" || exit 1
        objs+=("$o")
    done
    LIBS="-L$CUDA_LIB -lcudart_static -lstdc++ -ldl -lpthread -lrt -lm"
    cc $CFLAGS kernels/kvk_cuda_test.c "${objs[@]}" -lcmocka $LIBS -o "$WORK/cuda_test" || exit 1
    cc $CFLAGS kernels/kvk_probe_test.c "${objs[@]}" -lcmocka $LIBS -o "$WORK/probe_test" || exit 1
    cc $CFLAGS kernels/kvk_bench.c "${objs[@]}" $LIBS -o "$WORK/kvk_bench" || exit 1
    TEST_BINS=("$WORK/probe_test" "$WORK/cuda_test")
    BENCH="$WORK/kvk_bench"
    ZERO_COPY=""
fi
log "built in $(( $(date +%s) - START )) s"
if [ "$HAVE_GPU" = 0 ]; then
    echo "Built in $(( $(date +%s) - START )) s (KVD_DRY_BUILD=1); no GPU, so no test, benchmark or zero-copy check ran." >>"$RESULTS"
    cat "$RESULTS"
    exit 2
fi

section "requires-gpu tests"
echo '```' >>"$RESULTS"
for t in "${TEST_BINS[@]}"; do
    log "running $t"
    # Tests that start kvd (tests/gpu) find it relative to their runfiles tree.
    dir=.
    [ -d "$t.runfiles/kvd" ] && dir="$t.runfiles/kvd"
    if (cd "$dir" && KVD_EXPECT_GPU=1 timeout 150 "$t") >"$WORK/t.log" 2>&1; then
        echo "PASS $(basename "$t")" >>"$RESULTS"
    else
        rc=1
        echo "FAIL $(basename "$t")" >>"$RESULTS"
    fi
    grep -E '^\[ *(PASSED|FAILED|SKIPPED|  ERROR) *\]|ERROR|skipping|kvk_gpu_probe' "$WORK/t.log" | head -40 >>"$RESULTS"
done
echo '```' >>"$RESULTS"

log "running the benchmarks"
echo >>"$RESULTS"
if ! timeout 120 "$BENCH" >>"$RESULTS" 2>"$WORK/bench.err"; then
    rc=1
    section "Benchmark failed"
    cat "$WORK/bench.err" >>"$RESULTS"
fi

# The zero-copy check appends its own section to $OUT/gpu_results.md (this file), so it gets
# OUT = the results' folder; it finds kvd in its runfiles tree.
if [ -n "$ZERO_COPY" ]; then
    log "running the zero-copy check"
    RESULTS_DIR=$(cd "$(dirname "$RESULTS")" && pwd)
    if ! (cd "$ZERO_COPY.runfiles/kvd" && OUT="$RESULTS_DIR" KVD_EXPECT_GPU=1 timeout 90 "$ZERO_COPY") \
            >"$WORK/zc.log" 2>&1; then
        rc=1
        section "Zero-copy check failed"
        echo '```' >>"$RESULTS"
        tail -40 "$WORK/zc.log" >>"$RESULTS"
        echo '```' >>"$RESULTS"
    fi
else
    section "Zero-copy check"
    echo "Not run: it starts kvd, which only the Bazel build makes (install Bazel, or run with it)." >>"$RESULTS"
fi
echo "Total wall time: $(( $(date +%s) - START )) s" >>"$RESULTS"
cat "$RESULTS"
exit $rc
