#!/usr/bin/env bash
# demo.sh: three workers share a prompt prefix through one kvd (run by `./dev demo` after the
# build). Worker A computes and commits a long prompt; B and C send the same prefix with their
# own suffixes, get the prefix as hits, verify its bytes in the shared memory and compute only
# their suffix. Exits non-zero if any worker fails; kvd is stopped on every exit path.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${KVD_BIN_DIR:-bazel-bin}  # where Bazel put the binaries
KVD=$BIN/daemon/kvd
WORKER=$BIN/examples/demo_worker
for b in "$KVD" "$WORKER"; do
    [ -x "$b" ] || { echo "demo: $b is not built (run ./dev demo)" >&2; exit 1; }
done

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvd-demo.XXXXXX")
kvd_pid=""
cleanup() {
    if [ -n "$kvd_pid" ] && kill -0 "$kvd_pid" 2>/dev/null; then
        kill -TERM "$kvd_pid" 2>/dev/null || true
        wait "$kvd_pid" 2>/dev/null || true
    fi
    rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

backend=host  # pinned: on a GPU machine `auto` would give device memory the CPU cannot touch
gpu=0
if [ "${1:-}" = --gpu ]; then
    backend=cuda-vmm
    gpu=1
fi
sock="$tmp/kvd.sock"
"$KVD" --socket="$sock" --log-level=warn --backend="$backend" &
kvd_pid=$!
for _ in $(seq 1 100); do
    [ -S "$sock" ] && break
    kill -0 "$kvd_pid" 2>/dev/null || { echo "demo: kvd exited during start" >&2; exit 1; }
    sleep 0.1
done
[ -S "$sock" ] || { echo "demo: kvd did not create $sock" >&2; exit 1; }
echo "kvd running (pid $kvd_pid) on $sock, backend $backend"

PREFIX=512   # 32 blocks of 16 tokens shared by all three workers
SUFFIX=100
"$WORKER" --socket "$sock" --name A --prefix $PREFIX --suffix $SUFFIX --suffix-seed 1 \
    --expect-hit-blocks 0 --gpu $gpu
"$WORKER" --socket "$sock" --name B --prefix $PREFIX --suffix $SUFFIX --suffix-seed 2 \
    --expect-hit-blocks $((PREFIX / 16)) --gpu $gpu
"$WORKER" --socket "$sock" --name C --prefix $PREFIX --suffix $SUFFIX --suffix-seed 3 \
    --expect-hit-blocks $((PREFIX / 16)) --gpu $gpu

kill -TERM "$kvd_pid"
wait "$kvd_pid" || { echo "demo: kvd exited with an error" >&2; exit 1; }
kvd_pid=""
echo "demo passed: B and C reused A's $((PREFIX / 16))-block prefix and every shared byte matched"
