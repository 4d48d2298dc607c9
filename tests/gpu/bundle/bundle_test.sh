#!/usr/bin/env bash
# bundle_test: the GPU check bundle works on a bare machine, shown here without a GPU.
#  1. make_bundle.sh packs this build's GPU tests and tools (from the runfiles);
#  2. ldd of every bundle binary names nothing outside the bundle but the C/C++ runtime;
#  3. the bundle's gpu_probe, over the test driver (daemon/fake_cuda.c), reports the VMM round
#     trip and says whether a non-zero map offset is accepted (FAKE_CUDA_NO_MAP_OFFSET=1 refuses);
#     and run.sh's selftest step passes over it (kvd on cuda-vmm and cuda-ipc, kvctl selftest);
#  4. in a chroot holding only the bundle, bash and the few tools run.sh uses, the C/C++ runtime
#     and a dummy libcuda.so.1 (cuInit: CUDA_ERROR_NO_DEVICE) — none of the project's Debian
#     libraries — run.sh's load step passes (every library resolves from the bundle) and the probe
#     says "no GPU visible": exit 2, not a missing library. Needs root (chroot); skipped otherwise.
set -uo pipefail
R="${TEST_SRCDIR}/${TEST_WORKSPACE}"
T="${TEST_TMPDIR:-$(mktemp -d)}"
passed=0
failed=0
ok() { echo "[       OK ] $1"; passed=$((passed + 1)); }
bad() { echo "[  FAILED  ] $1"; failed=$((failed + 1)); }
finish() {
    echo "[==========] $((passed + failed)) test(s) run."
    echo "[  PASSED  ] $passed test(s)."
    [ "$failed" = 0 ] || echo "[  FAILED  ] $failed test(s), listed above."
    [ "$failed" = 0 ]
    exit $?
}

TESTS="kernels/cuda_test kernels/probe_test tests/gpu/gpu_share_test"
TOOLS="daemon/kvd kvctl/kvctl tests/gpu/gpu_probe tests/gpu/zero_copy_bench tests/gpu/tiers_copy_bench kernels/kvk_bench"
B="$T/bundle"

# 1. Pack.
if bash "$R/tests/gpu/bundle/make_bundle.sh" "$R" "$B" "$TESTS" "$TOOLS" "bundle_test"; then
    ok "make_bundle packs $(wc -l <"$B/bins.txt") binaries"
else
    bad "make_bundle failed"
    finish
fi

# 2. ldd: only the runtime outside the bundle; every project library inside it.
runtime='^(linux-vdso\.so\.1|libc\.so\.6|libm\.so\.6|libstdc\+\+\.so\.6|libgcc_s\.so\.1|ld-linux-x86-64\.so\.2|libdl\.so\.2|libpthread\.so\.0|librt\.so\.1)$'
outside=""
while read -r rel; do
    while read -r name path; do
        [[ $name =~ $runtime ]] && continue
        [[ $(realpath -m "$path") == "$(realpath -m "$B")"/lib/* ]] || outside+="$rel: $name => $path; "
    done < <(env -u LD_LIBRARY_PATH ldd "$B/$rel" | awk '/=>/ {print $1, $3}')
done <"$B/bins.txt"
if [ -z "$outside" ] && [ -e "$B/lib/libuv.so.1" ] && [ -e "$B/lib/libcmocka.so.0" ]; then
    ok "ldd: nothing outside the bundle but the C/C++ runtime ($(ls "$B/lib" | tr '\n' ' '))"
else
    bad "ldd: outside the bundle: ${outside:-none}; lib/ holds: $(ls "$B/lib" | tr '\n' ' ')"
fi
bytes=$(du -sb "$B" | awk '{print $1}')
if [ "$bytes" -le $((64 << 20)) ]; then ok "bundle is $((bytes >> 20)) MiB (<= 64)"; else bad "bundle is $((bytes >> 20)) MiB"; fi

# 3. The probe over the test driver.
FAKE="$R/daemon/testing/libfakecuda.so"
out=$(KV_CUDA_LIBRARY="$FAKE" "$B/tests/gpu/gpu_probe" 2>&1)
rc=$?
if [ "$rc" = 0 ] && [[ $out == *"read through the imported handle | ok"* ]] &&
    [[ $out == *"non-zero offset | accepted; reads the second granule"* ]] &&
    [[ $out == *"minimum 2048 KiB"* ]]; then
    ok "gpu_probe on the test driver: round trip, granularity, offsets accepted"
else
    bad "gpu_probe on the test driver (exit $rc): $out"
fi
out=$(FAKE_CUDA_NO_MAP_OFFSET=1 KV_CUDA_LIBRARY="$FAKE" "$B/tests/gpu/gpu_probe" 2>&1)
rc=$?
if [ "$rc" = 0 ] && [[ $out == *"non-zero offset | refused"* ]]; then
    ok "gpu_probe: a driver that refuses non-zero offsets is reported, not failed"
else
    bad "gpu_probe with FAKE_CUDA_NO_MAP_OFFSET=1 (exit $rc): $out"
fi
out=$(KV_CUDA_LIBRARY="$T/no-such-libcuda.so" "$B/tests/gpu/gpu_probe" 2>&1)
rc=$?
if [ "$rc" = 2 ] && [[ $out == "No GPU visible: "*"not found"* ]]; then
    ok "gpu_probe without a driver: no GPU visible, exit 2"
else
    bad "gpu_probe without a driver (exit $rc): $out"
fi

# run.sh's selftest step over the test driver: kvd on cuda-vmm and cuda-ipc, kvctl selftest.
rm -rf "$T/out"
if KV_CUDA_LIBRARY="$FAKE" OUT="$T/out" bash "$B/run.sh" selftest >"$T/selftest.log" 2>&1 &&
    grep -q "## selftest: passed" "$T/out/gpu_results.md" &&
    [ "$(grep -c '^passed  *yes' "$T/out/gpu_logs/selftest.log")" = 2 ]; then
    ok "run.sh selftest on the test driver: kvctl selftest isolation passes on cuda-vmm and cuda-ipc"
else
    bad "run.sh selftest on the test driver: $(cat "$T/selftest.log" "$T/out/gpu_results.md" 2>/dev/null)"
fi

# 4. The chroot.
if grep -qE 'lib(t|a)san' <<<"$(ldd "$B/daemon/kvd")"; then  # not a pipe: SIGPIPE under pipefail
    echo "skipping the chroot check: a sanitizer build (its runtime is no part of a bundle)"
    finish
fi
if [ "$(id -u)" != 0 ] || ! command -v chroot >/dev/null; then
    echo "skipping the chroot check: it needs root"
    finish
fi
C="$T/root"
rm -rf "$C"
mkdir -p "$C/lib/x86_64-linux-gnu" "$C/lib64" "$C/bin" "$C/usr/bin" "$C/tmp" "$C/out" "$C/dev"
if ! mknod -m 666 "$C/dev/null" c 1 3 2>/dev/null; then
    echo "skipping the chroot check: cannot make a device node here"
    finish
fi
cp -a "$B" "$C/bundle"
copy_prog() {
    local p
    p=$(command -v "$1") || return 1
    cp -L "$p" "$C/bin/$1"
    ldd "$p" | awk '/=>/ {print $3}' | while read -r l; do cp -L "$l" "$C/lib/x86_64-linux-gnu/"; done
}
for tool in bash env mkdir cat date uname timeout tail; do
    copy_prog "$tool" || { bad "no $tool here"; finish; }
done
cp -L /lib64/ld-linux-x86-64.so.2 "$C/lib64/"
# The C/C++ runtime the bundle leaves out (every glibc system has it: libpthread, libdl and
# librt are glibc's too, and libraries such as libzmq still name them).
for l in libc.so.6 libm.so.6 libstdc++.so.6 libgcc_s.so.1 libpthread.so.0 libdl.so.2 librt.so.1; do
    cp -L "/lib/x86_64-linux-gnu/$l" "$C/lib/x86_64-linux-gnu/"
done
cp -L "$R/tests/gpu/bundle/libdummycuda.so" "$C/lib/x86_64-linux-gnu/libcuda.so.1"
cp "$C/bin/env" "$C/usr/bin/env"
# What the chroot holds besides the bundle: no library of the project's packages.
leaked=$(ls "$C/lib/x86_64-linux-gnu" | grep -E '^lib(uv|protobuf-c|cmocka|jansson|microhttpd|gnutls|crypto|xxhash)\.' || true)
if [ -n "$leaked" ]; then
    bad "the chroot holds project libraries outside the bundle: $leaked"
fi
out=$(chroot "$C" /bin/bash -c 'cd /bundle && OUT=/out PATH=/bin ./run.sh' 2>&1)
rc=$?
if [ "$rc" = 2 ] && [[ $out == *"no GPU visible: No GPU visible: cuInit failed: CUDA_ERROR_NO_DEVICE"* ]] &&
    grep -q "## load: passed" "$C/out/gpu_results.md" && grep -q "## probe: no GPU visible" "$C/out/gpu_results.md" &&
    grep -q "No GPU visible: nothing else was run." "$C/out/gpu_results.md"; then
    ok "run.sh in a bare chroot: libraries resolve from the bundle, no GPU visible, exit 2"
else
    bad "run.sh in a bare chroot (exit $rc): $out"
fi
echo "--- the chroot's gpu_results.md:"
cat "$C/out/gpu_results.md" 2>/dev/null
finish
