#!/usr/bin/env bash
# Runs the kvclient Python binding's suite (python/tests) against a real kvd:
#   bash python/run_tests.sh [KVD_BIN [LIBKVCLIENT]] [pytest args...]
# KVD_BIN defaults to $KVD_BIN, else bazel-bin/daemon/kvd under the repository root;
# LIBKVCLIENT to $KVCLIENT_LIBRARY, else bazel-bin/client/shared/libkvclient.so. Under Bazel
# (python/BUILD, sh_test) both come as paths relative to the runfiles directory the test runs in.
# Needs Debian's python3, python3-numpy and python3-pytest (torch is used when importable).
# Daemon sockets live under a short directory in /tmp (not $TEST_TMPDIR / $TMPDIR: too long
# for sun_path under Bazel); it is removed afterwards. The last line printed is pytest's
# summary line.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
abs() {
    case "$1" in
        /*) printf '%s\n' "$1" ;;
        *) printf '%s\n' "$PWD/$1" ;;  # relative to where we were started (the runfiles root)
    esac
}
# An argument starting with "-" ends the paths: `run_tests.sh -k cache` uses the defaults.
bin="${KVD_BIN:-$root/bazel-bin/daemon/kvd}"
lib="${KVCLIENT_LIBRARY:-$root/bazel-bin/client/shared/libkvclient.so}"
if (( $# )) && [[ "$1" != -* ]]; then bin="$1"; shift; fi
if (( $# )) && [[ "$1" != -* ]]; then lib="$1"; shift; fi
export KVD_BIN="$(abs "$bin")"
export KVCLIENT_LIBRARY="$(abs "$lib")"
export PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"

if [[ ! -x "$KVD_BIN" ]]; then
    echo "run_tests.sh: no kvd binary at $KVD_BIN" >&2
    exit 2
fi
if [[ ! -f "$KVCLIENT_LIBRARY" ]]; then
    echo "run_tests.sh: no libkvclient at $KVCLIENT_LIBRARY" >&2
    exit 2
fi
missing=()
for mod in numpy:python3-numpy pytest:python3-pytest; do
    /usr/bin/python3 -c "import ${mod%%:*}" 2>/dev/null || missing+=("${mod##*:}")
done
if (( ${#missing[@]} )); then
    echo "run_tests.sh: missing Debian packages: ${missing[*]} (apt-get install them)" >&2
    exit 2
fi

base="$(mktemp -d /tmp/kvcpy.XXXXXX)"
export KVCLIENT_TEST_BASE="$base"
cleanup() { rm -rf "$base"; }
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

# A sanitizer build of the library (./dev asan, ./dev tsan) needs its runtime loaded first:
# preload it into python3 (which is not instrumented; its own allocations at exit are not leaks
# of ours, so leak checking is off there).
san=$(readelf -d "$KVCLIENT_LIBRARY" 2>/dev/null | sed -n 's/.*NEEDED.*\[\(lib[at]san\.so[.0-9]*\)\].*/\1/p' || true)
san=${san%%$'\n'*}
if [[ -n "$san" ]]; then
    rt=$(gcc -print-file-name="$san")
    export LD_PRELOAD="$rt${LD_PRELOAD:+:$LD_PRELOAD}"
    export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
    echo "run_tests.sh: sanitizer build of libkvclient: python3 runs with LD_PRELOAD=$rt" >&2
fi

cd "$here/tests"
rc=0
/usr/bin/python3 -m pytest -q -p no:cacheprovider "$here/tests" "$@" || rc=$?
exit "$rc"
