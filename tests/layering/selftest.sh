#!/usr/bin/env bash
# Self-test of check_layers.py: a throwaway tree in a temp folder whose files form a circle
# (one edge of it visible only to nm), a layer violation, an unassigned file and a compile unit
# without an object, laid out as Bazel would (bazel-bin/pkg/_objs/<target>/<file>.pic.o). The
# checker must fail it for exactly those reasons, then pass the fixed tree.
# Usage: bash tests/layering/selftest.sh   (needs python3, cc, nm; no Bazel)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
checker="$here/check_layers.py"
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fails=0
out="$T/out.txt"

check() { # check EXPECTED_RC ARGS...: runs the checker on the temp tree, output in $out
    local want=$1 rc=0
    shift
    python3 "$checker" --root "$T" --bin "$T/bazel-bin" "$@" >"$out" 2>&1 || rc=$?
    if [ "$rc" != "$want" ]; then
        echo "FAIL: check_layers $* exited $rc, expected $want"
        sed 's/^/    /' "$out"
        fails=$((fails + 1))
    fi
}
has() { # has REGEX WHY: the last output matches
    if ! grep -qE -- "$1" "$out"; then
        echo "FAIL: $2: no line matches /$1/"
        sed 's/^/    /' "$out"
        fails=$((fails + 1))
    fi
}
hasnt() {
    if grep -qE -- "$1" "$out"; then
        echo "FAIL: $2: a line matches /$1/"
        grep -E -- "$1" "$out" | sed 's/^/    /'
        fails=$((fails + 1))
    fi
}
obj() { # obj SRC TARGET: compiles pkg/SRC.c to bazel-bin/pkg/_objs/TARGET/SRC.pic.o
    mkdir -p "$T/bazel-bin/pkg/_objs/$2"
    cc -c -fPIC -I"$T" "$T/pkg/$1.c" -o "$T/bazel-bin/pkg/_objs/$2/$1.pic.o"
}

mkdir -p "$T/pkg" "$T/tests/layering" "$T/pkg/testing"
cat >"$T/tests/layering/layers.conf" <<'EOF'
# bottom up
low: pkg/a pkg/b pkg/d pkg/d_alt pkg/e pkg/f
high: pkg/c
[roots]
pkg/
EOF
for m in a b c d; do
    printf 'int %s_fn(void);\n' "$m" >"$T/pkg/$m.h"
done
# a (low) -> b by include and call; a -> c (high): the layer violation.
cat >"$T/pkg/a.c" <<'EOF'
#include "pkg/a.h"
#include "pkg/b.h"
#include "pkg/c.h"
/* #include "pkg/stray.h" is a comment, not an edge */
int a_fn(void) { return b_fn() + c_fn(); }
EOF
# b -> a by a call only (a local prototype, no include): only nm sees it. The bare name
# resolves against the including file's folder.
cat >"$T/pkg/b.c" <<'EOF'
#include "b.h"
int a_fn(void);
int b_fn(void) { return a_fn() - 1; }
EOF
# c uses d_fn, defined by d.c (target t, as c) and by d_alt.c (target t2): same target wins.
cat >"$T/pkg/c.c" <<'EOF'
#include "pkg/c.h"
#include "pkg/d.h"
int c_fn(void) { return d_fn(); }
EOF
echo 'int d_fn(void) { return 4; }' >"$T/pkg/d.c"
echo 'int d_fn(void) { return 5; }' >"$T/pkg/d_alt.c"
# e (target "sub/lib.so", a name with a slash) uses d_fn too: two candidates, neither in its
# target, so the edge is skipped and --verbose says so.
printf '#include "pkg/d.h"\nint e_fn(void) { return d_fn(); }\n' >"$T/pkg/e.c"
echo 'int f_fn(void) { return 6; }' >"$T/pkg/f.c"      # never compiled: missing object
echo '#define STRAY 1' >"$T/pkg/stray.h"                 # in no layer: unassigned
echo 'int t_fn(void) { return 7; }' >"$T/pkg/testing/t.c" # test code: ignored
echo 'int g_fn(void) { return 8; }' >"$T/pkg/g_test.c"    # test code: ignored

# The targets Bazel knows; objects of any other target are stale leftovers.
printf 'cc_library(name = "t")\ncc_library(name = "t2")\ncc_library(name = "sub/lib.so")\n' >"$T/pkg/BUILD"

obj a t
obj b t
obj c t
obj d t
obj d_alt t2
obj e sub/lib.so
# A stale object of a target since removed from BUILD, from an older b.c that called c_fn:
# its edge b -> c (an upward one) must not count.
mkdir -p "$T/bazel-bin/pkg/_objs/old"
echo 'int c_fn(void); int b_fn(void) { return c_fn(); }' |
    cc -x c -c -fPIC - -o "$T/bazel-bin/pkg/_objs/old/b.pic.o"

# ---- no objects at all: build first
check 1 --bin "$T/nothing"
has '^\[  FAILED  \] missing_objects: no objects under .*: build first' "no objects"

# ---- the broken tree: all four checks fail, for the right reasons
check 1 --verbose --dot "$T/g.dot"
has '^circle 1: 2 modules, 2 edges between them: pkg/a.c pkg/b.c$' "circle a <-> b"
has '^  pkg/a.c -> pkg/b.c: pkg/a.c:2 #include "pkg/b.h"; uses b_fn$' "include reason"
has '^  pkg/b.c -> pkg/a.c: uses a_fn$' "symbol-only edge b -> a"
has '^\[  FAILED  \] circles: 1 circle' "circles fails"
has '^layer violation: pkg/a.c -> pkg/c.c \(up from low to high\): pkg/a.c:3 #include "pkg/c.h"; uses c_fn$' "a -> c upward"
has '^\[  FAILED  \] layers: 1 module edge' "layers fails"
has '^unassigned: pkg/stray.h ' "stray.h unassigned"
has '^\[  FAILED  \] unassigned_files: 1 ' "unassigned fails"
has '^missing object: pkg/f.c ' "f.c has no object"
has '^\[  FAILED  \] missing_objects: 1 ' "missing_objects fails"
has '^edge pkg/c.c -> pkg/d.c: pkg/c.c:2 #include "pkg/d.h"; uses d_fn$' "same-target definition preferred"
has '^skipped symbol d_fn used by pkg/e.c \(//pkg:sub/lib.so\): defined by pkg/d.c, pkg/d_alt.c' "ambiguous symbol skipped"
hasnt 'stray.h:|pkg/testing|g_test' "comments and test files are no edges"
has '^stale object, its target is no longer in BUILD: pkg/_objs/old/b.pic.o$' "stale object named"
hasnt '^edge pkg/b.c -> pkg/c.c' "stale object gives no edge"
has '^\[==========\] 4 test\(s\) run\.$' "summary: run"
has '^\[  PASSED  \] 0 test\(s\)\.$' "summary: passed"
has '^\[  FAILED  \] 4 test\(s\), listed above\.$' "summary: failed"
grep -q '"pkg/b.c" -> "pkg/a.c" \[.*color=red' "$T/g.dot" || { echo "FAIL: dot has no red circle edge"; fails=$((fails + 1)); }

# ---- includes only: the circle closes through nm's edge alone, so it is not seen
check 1 --includes-only
has '^\[       OK \] circles$' "includes-only misses the symbol edge"
has '^\[  SKIPPED \] missing_objects' "includes-only skips missing_objects"
has '^\[==========\] 3 test\(s\) run\.$' "includes-only runs 3"

# ---- an [allow] line accepts the upward edge (and must give a reason)
cp "$T/tests/layering/layers.conf" "$T/conf.orig"
printf '[allow]\npkg/a.c -> pkg/c  # reason given\n' >>"$T/tests/layering/layers.conf"
check 1
has '^\[       OK \] layers$' "allowed edge passes"
printf '[allow]\npkg/a.c -> pkg/c\n' >>"$T/conf.orig"
cp "$T/conf.orig" "$T/tests/layering/layers.conf"
check 1
has '^error: .*an allowed edge needs a reason' "allow without reason"

# ---- the fixed tree: b no longer calls a, c (high) uses a instead of a using c, stray.h is
# placed, f.c is built
cat >"$T/tests/layering/layers.conf" <<'EOF'
low: pkg/a pkg/b pkg/d pkg/d_alt pkg/e pkg/f pkg/stray.h
high: pkg/c
[roots]
pkg/
EOF
cat >"$T/pkg/a.c" <<'EOF'
#include "pkg/a.h"
#include "pkg/b.h"
int a_fn(void) { return b_fn(); }
EOF
printf '#include "b.h"\nint b_fn(void) { return 1; }\n' >"$T/pkg/b.c"
cat >"$T/pkg/c.c" <<'EOF'
#include "pkg/a.h"
#include "pkg/c.h"
#include "pkg/d.h"
int c_fn(void) { return a_fn() + d_fn(); }
EOF
obj a t
obj b t
obj c t
obj f t
# production code must not include test code
cp "$T/pkg/b.c" "$T/b.c.orig"
printf 'int t_fn(void);\n' >"$T/pkg/testing/t.h"
printf '#include "pkg/testing/t.h"\n' >>"$T/pkg/b.c"
check 1
has '^layer violation: pkg/b.c uses test-only pkg/testing/t.h: pkg/b.c:3 #include "pkg/testing/t.h"$' "include of test code"
cp "$T/b.c.orig" "$T/pkg/b.c"
check 0 --verbose
has '^edge pkg/c.c -> pkg/a.c: pkg/c.c:1 #include "pkg/a.h"; uses a_fn$' "downward edge seen"
has '^\[==========\] 4 test\(s\) run\.$' "fixed: run"
has '^\[  PASSED  \] 4 test\(s\)\.$' "fixed: passed"
hasnt 'FAILED' "fixed: nothing fails"

if [ "$fails" -gt 0 ]; then
    echo "selftest: $fails check(s) failed"
    exit 1
fi
echo "selftest: all checks passed"
