#!/usr/bin/env bash
# symbols_test: libkvclient as installed exports exactly the functions the installed kvclient.h
# declares. Args: libkvclient.so libkvclient.a public/kvclient.h kvclient.syms
#  - the shared library's defined dynamic symbols (version KVCLIENT_1) == the header's KVC_EXTERN
#    functions, its soname is libkvclient.so.1 and it needs no C++ runtime and no libcrypto;
#  - the static archive holds one object whose global definitions are the same list (no kv_*,
#    no kvd__* from protobuf-c's generated code);
#  - the installed header compiles alone (C99 -pedantic, C++), and declares no kv_* function.
set -euo pipefail
so=$1 ar=$2 hdr=$3 syms=$4
fail=0 pass=0
check() { # name, command...
    local name=$1; shift
    if "$@"; then pass=$((pass + 1)); echo "[       OK ] $name"; else fail=$((fail + 1)); echo "[  FAILED  ] $name"; fi
}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
sort -u "$syms" >"$tmp/want"

exported() {
    nm -D --defined-only "$so" | awk '$2 ~ /[TDBRW]/ {print $3}' | grep -v '^KVCLIENT_1$' \
        | sed 's/@.*//' | sort -u >"$tmp/so"
    if ! diff -u "$tmp/want" "$tmp/so"; then
        echo "exported symbols differ from the header's KVC_EXTERN list (- header, + library)"; return 1
    fi
    # every export is versioned KVCLIENT_1
    [ "$(objdump -T "$so" | grep -c ' KVCLIENT_1 ' )" -ge "$(wc -l <"$tmp/want")" ] \
        || { echo "not every export carries version KVCLIENT_1"; return 1; }
}
soname() {
    grep -q 'SONAME.*\[libkvclient\.so\.1\]' <<<"$(readelf -d "$so")" || { readelf -d "$so" | grep SONAME; echo "soname is not libkvclient.so.1"; return 1; }
}
needed() {
    local n; n=$(readelf -d "$so" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p')
    echo "NEEDED: $(echo $n)"
    if grep -qE 'libstdc\+\+|libcrypto|libssl' <<<"$n"; then echo "needs a C++ runtime or libcrypto"; return 1; fi
}
archive() {
    local members; members=$(ar t "$ar")
    [ "$(wc -l <<<"$members")" = 1 ] || { echo "archive members: $members"; return 1; }
    nm -g --defined-only "$ar" | awk 'NF == 3 {print $3}' | sort -u >"$tmp/ar"
    diff -u "$tmp/want" "$tmp/ar" || { echo "archive global symbols differ (- header, + archive)"; return 1; }
}
header_alone() {
    cp "$hdr" "$tmp/kvclient.h"
    printf '#include "kvclient.h"\nint main(void) { const kvc_layout *l = 0; (void)l; return (int)KV_OK; }\n' >"$tmp/t.c"
    cc -std=c99 -Wall -Wextra -Werror -pedantic -fsyntax-only -I"$tmp" "$tmp/t.c" &&
        c++ -x c++ -Wall -Wextra -Werror -fsyntax-only -I"$tmp" "$tmp/t.c"
}
no_internal_decls() {
    if grep -nE '^(const )?[a-z_]+[ *]+kv_[a-z_0-9]+\(' "$hdr"; then echo "declares kv_* functions"; return 1; fi
    if grep -n '#include "' "$hdr"; then echo "includes project headers"; return 1; fi
}
check exported exported
check soname soname
check needed needed
check archive archive
check header_alone header_alone
check no_internal_decls no_internal_decls
echo "[==========] $((pass + fail)) test(s) run."
echo "[  PASSED  ] $pass test(s)."
[ "$fail" = 0 ] || { echo "[  FAILED  ] $fail test(s)."; exit 1; }
