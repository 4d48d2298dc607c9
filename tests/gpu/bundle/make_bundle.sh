#!/usr/bin/env bash
# make_bundle.sh — packs built binaries into a GPU check bundle that runs on a bare GPU machine.
# Usage: make_bundle.sh SRC DEST "TESTS" "TOOLS" [BUILT]
#   SRC    a tree holding the binaries by their package paths (bazel-bin, or a test's runfiles)
#   DEST   the bundle folder (replaced)
#   TESTS  test binaries by path under SRC (tests.txt: run.sh runs each with KVD_EXPECT_GPU=1)
#   TOOLS  other binaries run.sh needs (kvd, kvctl, gpu_probe, benchmarks)
#   BUILT  one line saying what was built (commit, options), written to DEST/BUILT
# Every binary keeps its path (tests find kvd as daemon/kvd from the bundle's root). Each shared
# library a binary links, other than the C/C++ runtime and the driver (libcuda is loaded at run
# time), is copied into DEST/lib, and every binary and library gets a RUNPATH relative to
# $ORIGIN, so the bundle needs no Debian package where it runs. Debug info is stripped. Fails
# when a library cannot be found, when a binary would still resolve one outside the bundle, or
# when the bundle exceeds 64 MiB (what the device tool carries).
set -euo pipefail
SRC=$1
DEST=$2
TESTS=$3
TOOLS=$4
BUILT=${5:-unknown build}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MAX_BYTES=$((64 * 1024 * 1024))

# What a bare machine provides: the C and C++ runtime, the loader, the driver.
RUNTIME='^(linux-vdso\.so\.1|libc\.so\.6|libm\.so\.6|libstdc\+\+\.so\.6|libgcc_s\.so\.1|ld-linux-x86-64\.so\.2|libdl\.so\.2|libpthread\.so\.0|librt\.so\.1|libcuda\.so\.1)$'

command -v patchelf >/dev/null || { echo "make_bundle: patchelf is missing (apt-get install patchelf)" >&2; exit 1; }

rm -rf "$DEST"
mkdir -p "$DEST/lib" "$DEST/checks.d"
: >"$DEST/bins.txt"
: >"$DEST/tests.txt"

add_binary() {
    local rel=$1 list=$2
    [ -f "$SRC/$rel" ] || { echo "make_bundle: $SRC/$rel is missing" >&2; exit 1; }
    mkdir -p "$DEST/$(dirname "$rel")"
    cp -L "$SRC/$rel" "$DEST/$rel"
    chmod u+w,a+x "$DEST/$rel"
    echo "$rel" >>"$DEST/bins.txt"
    [ "$list" = test ] && echo "$rel" >>"$DEST/tests.txt"
    # Libraries, by ldd of the original (it resolves the whole tree, transitive ones too).
    local name path
    while read -r name path; do
        [[ $name =~ $RUNTIME ]] && continue
        if [ "$path" = "not" ] || [ -z "$path" ]; then
            echo "make_bundle: $rel needs $name, which is not found here" >&2
            exit 1
        fi
        [ -f "$DEST/lib/$name" ] || cp -L "$path" "$DEST/lib/$name"
    done < <(ldd "$SRC/$rel" | awk '/=>/ {print $1, $3}')
    # $ORIGIN/../lib from daemon/kvd, $ORIGIN/../../lib from tests/gpu/x.
    local up="" d
    d=$(dirname "$rel")
    while [ "$d" != . ]; do
        up="../$up"
        d=$(dirname "$d")
    done
    patchelf --set-rpath "\$ORIGIN/${up}lib" "$DEST/$rel"
}

for t in $TESTS; do add_binary "$t" test; done
for t in $TOOLS; do add_binary "$t" tool; done
for l in "$DEST"/lib/*; do
    [ -e "$l" ] || continue
    chmod u+w "$l"
    patchelf --set-rpath '$ORIGIN' "$l"
done
while read -r rel; do strip --strip-debug "$DEST/$rel"; done <"$DEST/bins.txt"
for l in "$DEST"/lib/*; do [ -e "$l" ] && strip --strip-debug "$l"; done

cp "$HERE/run.sh" "$DEST/run.sh"
chmod a+x "$DEST/run.sh"
echo "$BUILT" >"$DEST/BUILT"

# Check what a bare machine would see: nothing outside the bundle but the runtime.
bad=0
while read -r rel; do
    while read -r name path; do
        [[ $name =~ $RUNTIME ]] && continue
        case "$(realpath -m "$path")" in
            "$(realpath -m "$DEST")"/lib/*) ;;
            *) echo "make_bundle: $rel resolves $name outside the bundle ($path)" >&2; bad=1 ;;
        esac
    done < <(env -u LD_LIBRARY_PATH ldd "$DEST/$rel" | awk '/=>/ {print $1, $3}')
done <"$DEST/bins.txt"
[ "$bad" = 0 ] || exit 1

bytes=$(du -sb "$DEST" | awk '{print $1}')
if [ "$bytes" -gt "$MAX_BYTES" ]; then
    echo "make_bundle: the bundle is $((bytes >> 20)) MiB, more than the 64 MiB the device tool carries" >&2
    exit 1
fi
[ -s "$DEST/tests.txt" ] || { echo "make_bundle: no test binaries given" >&2; exit 1; }
echo "bundle: $(wc -l <"$DEST/bins.txt") binaries ($(wc -l <"$DEST/tests.txt") tests), $(ls "$DEST/lib" | wc -l) libraries, $((bytes >> 20)) MiB in $DEST"
