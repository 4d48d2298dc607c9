#!/usr/bin/env bash
# install_test: kvd as an engine outside this tree would get it.
#   1. deploy/install.sh lays the files out in a staging root (prefix /usr, as the .deb does);
#   2. examples/consumer/consumer.c is built with plain cc and `pkg-config kvclient` against that
#      root only (shared, then static with `pkg-config --static`); one process writes a prefix
#      through its mapping and commits, a second one hits it and checks every byte, against a
#      real kvd (the installed binary);
#   3. the installed Python binding imports and finds the installed library by itself;
#   4. man renders the installed pages; the unit names the installed binaries;
#   5. deploy/make_deb.sh builds the .deb; its control fields and contents are checked and, where
#      lintian is installed, it passes with only the overrides docs/PACKAGING.md justifies.
# Args: the key=value artifacts of install.sh. Sanitizer builds (ASan/TSan objects need their
# runtime) check only the layout.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
declare -A f=()
for a in "$@"; do f[${a%%=*}]=$(readlink -f "${a#*=}"); done
args=()
for k in kvd kvctl so a h kvd.8 kvctl.1; do args+=("$k=${f[$k]}"); done
pass=0 fail=0
ok() { pass=$((pass + 1)); echo "[       OK ] $1"; }
bad() { fail=$((fail + 1)); echo "[  FAILED  ] $1"; }
finish() {
    echo "[==========] $((pass + fail)) test(s) run."
    echo "[  PASSED  ] $pass test(s)."
    [ "$fail" = 0 ] || { echo "[  FAILED  ] $fail test(s)."; exit 1; }
    exit 0
}
base=$(mktemp -d /tmp/kvdinst.XXXXXX)
chmod 0755 "$base"
kvd_pid=""
cleanup() { [ -n "$kvd_pid" ] && kill "$kvd_pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$base"; }
trap cleanup EXIT
R=$base/root
multiarch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
L=$R/usr/lib/$multiarch

# 1. layout
if bash "$here/install.sh" --destdir="$R" --prefix=/usr "${args[@]}" >"$base/install.log" 2>&1; then
    missing=""
    for p in usr/bin/kvd usr/bin/kvctl usr/include/kvclient.h lib/systemd/system/kvd.service \
             etc/kvd/kvd.conf usr/share/man/man8/kvd.8.gz usr/share/man/man1/kvctl.1.gz \
             usr/lib/$multiarch/libkvclient.so.1.0.0 usr/lib/$multiarch/libkvclient.so.1 \
             usr/lib/$multiarch/libkvclient.so usr/lib/$multiarch/libkvclient.a \
             usr/lib/$multiarch/pkgconfig/kvclient.pc; do
        [ -e "$R/$p" ] || missing+=" $p"
    done
    [ -z "$missing" ] && ok "install layout" || bad "install layout: missing$missing"
else
    cat "$base/install.log"; bad "install.sh failed"; finish
fi
if nm -D "${f[so]}" 2>/dev/null >"$base/so.syms"; grep -qE " U __(asan|tsan|ubsan)_" "$base/so.syms"; then
    echo "sanitizer build: the installed objects need the sanitizer runtime; only the layout is checked"
    finish
fi

# 2. a C engine built outside the tree
export PKG_CONFIG_SYSROOT_DIR=$R PKG_CONFIG_LIBDIR=$L/pkgconfig:/usr/lib/$multiarch/pkgconfig:/usr/share/pkgconfig
src=$base/src
mkdir -p "$src"
cp "$here/../examples/consumer/consumer.c" "$src/"   # nothing of the tree beside it
if [ "$(pkg-config --modversion kvclient)" = "$(sed -n 's/^#define KV_VERSION "\(.*\)"/\1/p' "$here/../common/kv_version.h")" ] &&
    cc -std=c11 -Wall -Wextra -Werror -o "$src/consumer" "$src/consumer.c" $(pkg-config --cflags --libs kvclient) 2>"$base/cc.log" &&
    cc -std=c11 -Wall -Wextra -Werror -o "$src/consumer_static" "$src/consumer.c" $(pkg-config --cflags kvclient) \
        "$L/libkvclient.a" $(pkg-config --static --libs-only-l kvclient | sed 's/-lkvclient//') 2>>"$base/cc.log"; then
    ok "cc + pkg-config (shared and static)"
else
    cat "$base/cc.log"; bad "cc + pkg-config"; finish
fi
# (here-strings, not pipes into grep -q: under pipefail a producer's SIGPIPE would fail a check)
if grep -q 'NEEDED.*libkvclient\.so\.1\]' <<<"$(readelf -d "$src/consumer")" &&
    ! grep -q 'libkvclient' <<<"$(readelf -d "$src/consumer_static")" &&
    [ -z "$(nm "$src/consumer_static" | awk '$2 ~ /^[TDB]$/ && $3 ~ /^(kv_|kvd__)/')" ]; then
    ok "links libkvclient.so.1; the static link brings no kv_*/kvd__* symbol"
else
    bad "link result"
fi
sock=$base/run/kvd.sock
"$R/usr/bin/kvd" --socket="$sock" --admin-socket="$base/run/admin.sock" --pool-memory=64M --segment-bytes=4M \
    --log-level=warn 2>"$base/kvd.log" &
kvd_pid=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
export LD_LIBRARY_PATH=$L
if "$src/consumer" "$sock" write 7 && "$src/consumer" "$sock" read 7 && "$src/consumer_static" "$sock" read 7 &&
    "$src/consumer_static" "$sock" write 8 && "$src/consumer" "$sock" read 8; then
    ok "two processes share a prefix through the installed library (shared and static)"
else
    cat "$base/kvd.log"; bad "consumer against kvd"
fi
if ! "$src/consumer" "$sock" read 9 2>"$base/miss.log" && grep -q 'expected 4 cached blocks, got 0' "$base/miss.log"; then
    ok "a prompt nobody wrote is a miss"
else
    cat "$base/miss.log"; bad "miss"
fi
"$R/usr/bin/kvctl" --socket="$base/run/admin.sock" info >/dev/null && ok "installed kvctl talks to installed kvd" || bad "kvctl info"
unset LD_LIBRARY_PATH

# 3. Python binding from the installed tree, library found without LD_LIBRARY_PATH
py=$R/usr/lib/python3/dist-packages
if [ -d "$py/kvclient" ]; then
    # The prefix the C consumer wrote (seed 7), read zero-copy through numpy views.
    if out=$(cd "$base" && PYTHONPATH=$py /usr/bin/python3 -c '
import sys, numpy as np, kvclient
c = kvclient.Connection(sys.argv[1], client_name="install-test")
p = c.attach("consumer-model", layers=2, kv_heads=2, head_dim=64, tokens_per_block=16, dtype="fp16")
seed = 7
hits = p.lookup(p.hash_tokens([seed * 100000 + i for i in range(64)]))
assert len(hits) == 4, len(hits)
t, h, d = np.meshgrid(np.arange(16), np.arange(2), np.arange(64), indexing="ij")
for b in range(4):
    for l in range(2):
        for kv, view in ((0, p.k), (1, p.v)):
            want = (seed * 7919 + b * 1009 + l * 101 + kv * 53 + t * 17 + h * 5 + d) % 65536
            got = view(hits[b], l).view(np.uint16)
            assert np.array_equal(got, want.astype(np.uint16)), (b, l, kv)
p.release(hits)
print(kvclient.library_path)
' "$sock" 2>&1) && grep -q "^$L/libkvclient.so.1" <<<"$out"; then
        ok "installed Python binding finds the installed library and reads the C writer's bytes"
    else
        echo "$out"; bad "installed Python binding"
    fi
else
    bad "no Python binding installed"
fi

# 4. man pages and unit
if grep -q -- '--pool-memory' <<<"$(MANWIDTH=80 man -l "$R/usr/share/man/man8/kvd.8.gz" 2>/dev/null)" &&
    grep -q 'EXIT STATUS' <<<"$(MANWIDTH=80 man -l "$R/usr/share/man/man1/kvctl.1.gz" 2>/dev/null)"; then
    ok "man renders kvd(8) and kvctl(1)"
else
    bad "man pages"
fi
unit=$R/lib/systemd/system/kvd.service
if grep -q '^ExecStart=/usr/bin/kvd --config=/etc/kvd/kvd.conf ' "$unit" && grep -q '^ExecStop=/usr/bin/kvctl ' "$unit"; then
    ok "unit runs the installed binaries"
else
    bad "unit paths"
fi
if command -v systemd-analyze >/dev/null; then
    # systemd's own check of the unit, with the binaries it names at their staged paths.
    sed "s|/usr/bin/|$R/usr/bin/|g" "$unit" >"$base/kvd.service"
    if v=$(timeout 60 systemd-analyze verify --man=no "$base/kvd.service" 2>&1) && [ -z "$v" ]; then
        ok "systemd-analyze verify kvd.service"
    else
        echo "$v"; bad "systemd-analyze verify"
    fi
fi

# 5. the Debian package
if deb=$(bash "$here/make_deb.sh" "$base/deb" "${args[@]}" 2>"$base/deb.log" | tail -1) && [ -f "$deb" ]; then
    ctl=$(dpkg-deb -f "$deb" Package Version Depends)
    list=$(dpkg-deb -c "$deb")
    if grep -q '^Package: kvd$' <<<"$ctl" && grep -q 'libuv1' <<<"$ctl" && ! grep -q 'libssl\|libstdc' <<<"$ctl" &&
        grep -q './usr/bin/kvd$' <<<"$list" && grep -q './lib/systemd/system/kvd.service$' <<<"$list" &&
        grep -q 'libkvclient.so.1 -> libkvclient.so.1.0.0' <<<"$list" && [ "$(dpkg-deb -f "$deb" Architecture)" = "$(dpkg --print-architecture)" ]; then
        ok "dpkg-deb builds $(basename "$deb")"
    else
        echo "$ctl"; bad "deb fields/contents"
    fi
    if command -v lintian >/dev/null; then
        lrc=0
        tags=$(lintian --pedantic "$deb" 2>&1) || lrc=$?
        tags=$(grep -v 'root privileges' <<<"$tags" || true)
        if [ "$lrc" = 0 ] && [ -z "$tags" ]; then
            ok "lintian --pedantic: no tag beyond the justified overrides"
        else
            echo "$tags"; bad "lintian"
        fi
    else
        echo "lintian not installed: the package is not linted"
    fi
else
    cat "$base/deb.log"; bad "make_deb.sh"
fi
finish
