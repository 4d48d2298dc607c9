#!/usr/bin/env bash
# Runs the kvdwire conformance suite against a kvd binary:
#   bash tests/pyclient/run.sh [KVD_BIN] [pytest args...]
# KVD_BIN defaults to $KVD_BIN, else bazel-bin/daemon/kvd under the repository root. Under Bazel
# (tests/pyclient/BUILD, sh_test) it gets the kvd path relative to the runfiles directory it runs
# in, and proto/kvd.proto is found there too (kvdwire.REPO_ROOT, or $KVDWIRE_PROTO_DIR).
# Needs the Debian packages python3-protobuf, protobuf-compiler, python3-pytest, python3-xxhash,
# python3-zmq, python3-msgpack and python3-cbor2 (the KV-event tests).
# Tests that setuid children to other uids (tenancy) need root and are skipped otherwise.
# Daemon sockets live under a short, world-traversable directory in /tmp (not $TEST_TMPDIR /
# $TMPDIR: too long for sun_path under Bazel, and below a 0700 home that setuid children cannot
# enter); it is removed afterwards. The last line printed is pytest's summary line.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
bin="${1:-${KVD_BIN:-$root/bazel-bin/daemon/kvd}}"
(( $# )) && shift
case "$bin" in
    /*) ;;
    *) bin="$PWD/$bin" ;;  # relative to where we were started (the runfiles root under Bazel)
esac
export KVD_BIN="$bin"
export PYTHONDONTWRITEBYTECODE=1

if [[ ! -x "$KVD_BIN" ]]; then
    echo "run.sh: no kvd binary at $KVD_BIN" >&2
    exit 2
fi
if [[ -z "${KVDWIRE_PROTO_DIR:-}" && ! -f "$root/proto/kvd.proto" ]]; then
    for r in "${RUNFILES_DIR:-}" "${TEST_SRCDIR:-}"; do
        for ws in "${TEST_WORKSPACE:-_main}" _main; do
            if [[ -n "$r" && -f "$r/$ws/proto/kvd.proto" ]]; then
                export KVDWIRE_PROTO_DIR="$r/$ws/proto"
                break 2
            fi
        done
    done
fi
missing=()
command -v protoc >/dev/null || missing+=(protobuf-compiler)
for mod in google.protobuf:python3-protobuf pytest:python3-pytest xxhash:python3-xxhash \
        zmq:python3-zmq msgpack:python3-msgpack cbor2:python3-cbor2; do
    /usr/bin/python3 -c "import ${mod%%:*}" 2>/dev/null || missing+=("${mod##*:}")
done
if (( ${#missing[@]} )); then
    echo "run.sh: missing Debian packages: ${missing[*]} (apt-get install them)" >&2
    exit 2
fi

base="$(mktemp -d /tmp/kvdpy.XXXXXX)"
chmod 0755 "$base"
export KVDPY_BASE="$base"
cleanup() { rm -rf "$base"; }
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

cd "$here"
rc=0
/usr/bin/python3 -m pytest -q -p no:cacheprovider "$here" "$@" || rc=$?
exit "$rc"
