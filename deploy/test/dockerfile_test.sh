#!/usr/bin/env bash
# dockerfile_test: the image's runtime stage installs every package that owns a shared library kvd,
# kvctl or libkvclient loads (readelf NEEDED -> ldconfig -> dpkg -S, as make_deb.sh maps them),
# and its build stage the -dev package of each (the image once lacked ZMQ, msgpack, CBOR, hiredis
# and liburing: it could neither build nor run). No docker needed.
# Usage: dockerfile_test.sh DOCKERFILE KVD KVCTL LIBKVCLIENT
set -euo pipefail
dockerfile=$1
shift
fail() { echo "dockerfile_test: FAIL: $*" >&2; exit 1; }
command -v dpkg >/dev/null || { echo "dockerfile_test: no dpkg here: skipped"; exit 0; }
runtime=$(awk '/^FROM .*bookworm-slim/ {s = 1} s' "$dockerfile")
build=$(awk '/^FROM / && n++ {exit} {print}' "$dockerfile")
cache=$(ldconfig -p)
libs=$(for b in "$@"; do readelf -d "$b" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p'; done | sort -u)
n=0
for l in $libs; do
    case "$l" in
        libc.so.* | libm.so.* | ld-linux* | libpthread.so.* | libdl.so.* | librt.so.*) continue ;;
        # A sanitizer build (./dev asan, tsan) links its runtime; the image's opt build does not.
        libasan.so.* | libubsan.so.* | libtsan.so.* | liblsan.so.* | libstdc++.so.* | libgcc_s.so.*) continue ;;
    esac
    path=$(awk -v l="$l" '$1 == l && !p {print $NF; p = 1}' <<<"$cache")
    [ -n "$path" ] || fail "cannot find $l"
    real=$(readlink -f "$path")
    p=$(dpkg -S "$real" 2>/dev/null || dpkg -S "$path" 2>/dev/null || true)
    p=${p%%:*}
    [ -n "$p" ] || fail "no package owns $path"
    grep -qw -- "$p" <<<"$runtime" || fail "the runtime stage does not install $p (for $l)"
    n=$((n + 1))
done
[ "$n" -ge 5 ] || fail "only $n libraries checked: readelf found too few"
for dev in libuv1-dev libprotobuf-c-dev libzmq3-dev libmsgpack-dev libcbor-dev libhiredis-dev \
           liburing-dev libjansson-dev libmicrohttpd-dev libzstd-dev liblz4-dev libxxhash-dev libmd-dev; do
    grep -qw -- "$dev" <<<"$build" || fail "the build stage does not install $dev"
done
echo "dockerfile_test: ok ($n libraries)"
