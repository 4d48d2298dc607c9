#!/usr/bin/env bash
# kvctl_test: kvctl against a real kvd. A command on the admin socket answers; pointed at the
# client socket (a common mistake) kvctl says which socket it reached and exits 4 (PROTO) at
# once; a missing socket exits 3 (CONNECT); a kvd error exits 1 with the error's code.
set -euo pipefail
cd "${TEST_SRCDIR:-.}/${TEST_WORKSPACE:-kvd}"
dir=$(mktemp -d "${TMPDIR:-/tmp}/kvctl-XXXXXX")
kvd_pid=
cleanup() {
    if [ -n "$kvd_pid" ]; then kill "$kvd_pid" 2>/dev/null || true; wait "$kvd_pid" 2>/dev/null || true; fi
    rm -rf "$dir"
}
trap cleanup EXIT
fail() { echo "kvctl_test: FAIL: $*" >&2; exit 1; }

daemon/kvd --backend=host --socket="$dir/kvd.sock" --pool-memory=16M >"$dir/kvd.log" 2>&1 &
kvd_pid=$!
for _ in $(seq 100); do [ -S "$dir/admin.sock" ] && break; sleep 0.05; done
[ -S "$dir/admin.sock" ] || fail "kvd did not start: $(cat "$dir/kvd.log")"

kvctl/kvctl --socket="$dir/admin.sock" --json info >"$dir/info" || fail "info on the admin socket"
grep -q '"boot_epoch"' "$dir/info" || fail "info reply: $(cat "$dir/info")"

rc=0
timeout 5 kvctl/kvctl --socket="$dir/kvd.sock" info 2>"$dir/err" || rc=$?
[ "$rc" = 4 ] || fail "client socket: exit $rc, want 4: $(cat "$dir/err")"
grep -q "client socket" "$dir/err" || fail "client socket message: $(cat "$dir/err")"

rc=0
kvctl/kvctl --socket="$dir/none.sock" info 2>"$dir/err" || rc=$?
[ "$rc" = 3 ] || fail "missing socket: exit $rc, want 3"

rc=0
kvctl/kvctl --socket="$dir/admin.sock" unpin 0123456789abcdef0123456789abcdef 2>"$dir/err" >"$dir/out" || rc=$?
[ "$rc" = 1 ] || fail "unknown hash: exit $rc, want 1"
grep -q ENOENT "$dir/err" "$dir/out" || fail "unknown hash message: $(cat "$dir/err" "$dir/out")"
# A blank command is a usage error at once (kvd answers nothing to an empty line: kvctl waited
# for ever); a socket path longer than a Unix socket's is named as too long (it was cut short).
rc=0
timeout 5 kvctl/kvctl --socket="$dir/admin.sock" " " 2>"$dir/err" || rc=$?
[ "$rc" = 2 ] || fail "blank command: exit $rc, want 2"
rc=0
long="/$(printf 'a%.0s' $(seq 1 200))/admin.sock"
kvctl/kvctl --socket="$long" info 2>"$dir/err" || rc=$?
[ "$rc" = 3 ] || fail "long path: exit $rc, want 3"
grep -q "too long" "$dir/err" || fail "long path message: $(cat "$dir/err")"
echo "kvctl_test: ok"
