#!/usr/bin/env bash
# deploy/install.sh: installs kvd as a system package would lay it out. Used by `./dev install`,
# `./dev deb` (deploy/make_deb.sh) and deploy/install_test.
#
#   install.sh [--destdir=DIR] [--prefix=PREFIX] kvd=FILE kvctl=FILE so=FILE a=FILE h=FILE \
#              kvd.8=FILE kvctl.1=FILE
#
# The key=value arguments name the built files (bazel-bin paths; the installed header is
# client's public/kvclient.h, generated). Everything else comes from the source tree beside this
# script. PREFIX defaults to /usr/local; DESTDIR (staging root, as for packaging) to none.
#   PREFIX/bin/kvd, kvctl
#   LIBDIR/libkvclient.so.1.0.0 (soname libkvclient.so.1), libkvclient.so.1, libkvclient.so,
#   LIBDIR/libkvclient.a, LIBDIR/pkgconfig/kvclient.pc        LIBDIR: PREFIX/lib, or
#                                                          /usr/lib/<multiarch> for PREFIX=/usr
#   PREFIX/include/kvclient.h
#   UNITDIR/kvd.service      /lib/systemd/system for /usr, else PREFIX/lib/systemd/system
#   SYSCONFDIR/kvd/kvd.conf  /etc for /usr and /usr/local, else PREFIX/etc; never overwritten
#   PREFIX/share/man/man8/kvd.8.gz, man1/kvctl.1.gz, PREFIX/share/doc/kvd/*.md
#   PYDIR/kvclient/          the Python binding: /usr/lib/python3/dist-packages for /usr,
#                            PREFIX/lib/python3.X/dist-packages otherwise (Debian's python3 path)
# The Python binding finds the library by its soname through the loader, and else in LIBDIR
# (written into kvclient/_install.py relative to the package, so a staged tree works too). Prints what it installed, one line per file.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
destdir="" prefix=/usr/local
declare -A f=()
for a in "$@"; do
    case "$a" in
        --destdir=*) destdir=${a#--destdir=} ;;
        --prefix=*) prefix=${a#--prefix=} ;;
        *=*) f[${a%%=*}]=${a#*=} ;;
        *) echo "install.sh: unexpected argument '$a'" >&2; exit 2 ;;
    esac
done
for k in kvd kvctl so a h kvd.8 kvctl.1; do
    [ -n "${f[$k]:-}" ] || { echo "install.sh: missing $k=FILE" >&2; exit 2; }
    [ -f "${f[$k]}" ] || { echo "install.sh: $k=${f[$k]}: no such file" >&2; exit 2; }
done
case "$prefix" in /*) ;; *) echo "install.sh: --prefix must be absolute" >&2; exit 2 ;; esac
prefix=${prefix%/}
[ -n "$prefix" ] || prefix=/

version=$(sed -n 's/^#define KV_VERSION "\(.*\)"/\1/p' "$root/common/kv_version.h")
[ -n "$version" ] || { echo "install.sh: no KV_VERSION in common/kv_version.h" >&2; exit 1; }
multiarch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
pyver=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo 3)
if [ "$prefix" = /usr ]; then
    libdir=/usr/lib/$multiarch unitdir=/lib/systemd/system sysconfdir=/etc
    pydir=/usr/lib/python3/dist-packages
else
    libdir=$prefix/lib unitdir=$prefix/lib/systemd/system pydir=$prefix/lib/python$pyver/dist-packages
    if [ "$prefix" = /usr/local ]; then sysconfdir=/etc; else sysconfdir=$prefix/etc; fi
fi
D=$destdir

put() { # mode src dst
    install -D -m "$1" "$2" "$D$3"
    echo "  $3"
}
link() { # target name
    mkdir -p "$(dirname "$D$2")"
    ln -sfn "$1" "$D$2"
    echo "  $2 -> $1"
}
gz() { # mode src dst (.gz added)
    mkdir -p "$(dirname "$D$3")"
    gzip -9nc "$2" >"$D$3.gz"
    chmod "$1" "$D$3.gz"
    echo "  $3.gz"
}

echo "installing kvd $version into ${D:+$D (staging) }$prefix"
put 0755 "${f[kvd]}" "$prefix/bin/kvd"
put 0755 "${f[kvctl]}" "$prefix/bin/kvctl"
# The library's ABI version (soname libkvclient.so.1, symbol version KVCLIENT_1), not kvd's.
put 0644 "${f[so]}" "$libdir/libkvclient.so.1.0.0"
link "libkvclient.so.1.0.0" "$libdir/libkvclient.so.1"
link "libkvclient.so.1" "$libdir/libkvclient.so"
put 0644 "${f[a]}" "$libdir/libkvclient.a"
put 0644 "${f[h]}" "$prefix/include/kvclient.h"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
sed -e "s|@PREFIX@|$prefix|g" -e "s|@LIBDIR@|$libdir|g" -e "s|@VERSION@|$version|g" \
    "$root/deploy/kvclient.pc.in" >"$tmp/kvclient.pc"
put 0644 "$tmp/kvclient.pc" "$libdir/pkgconfig/kvclient.pc"

# The unit names /usr/local/bin and /etc/kvd; rewritten for this prefix.
sed -e "s|/usr/local/bin/|$prefix/bin/|g" -e "s|/etc/kvd/|$sysconfdir/kvd/|g" \
    -e "s|file:///usr/local/share/doc/kvd/|file://$prefix/share/doc/kvd/|g" \
    "$root/deploy/kvd.service" >"$tmp/kvd.service"
put 0644 "$tmp/kvd.service" "$unitdir/kvd.service"
if [ -e "$D$sysconfdir/kvd/kvd.conf" ]; then
    echo "  $sysconfdir/kvd/kvd.conf kept (exists)"
else
    put 0644 "$root/deploy/kvd.conf" "$sysconfdir/kvd/kvd.conf"
fi

gz 0644 "${f[kvd.8]}" "$prefix/share/man/man8/kvd.8"
gz 0644 "${f[kvctl.1]}" "$prefix/share/man/man1/kvctl.1"
for doc in README.md docs/ADMIN.md docs/CLIENT.md docs/PYTHON.md docs/TENANCY.md proto/PROTOCOL.md; do
    [ -f "$root/$doc" ] && put 0644 "$root/$doc" "$prefix/share/doc/kvd/$(basename "$doc")"
done

if [ -d "$root/python/kvclient" ]; then
    for py in "$root"/python/kvclient/*.py; do
        put 0644 "$py" "$pydir/kvclient/$(basename "$py")"
    done
    # LIBDIR relative to the package folder, so a staged or relocated tree finds its own library.
    rel=$(realpath -m --relative-to="$pydir/kvclient" "$libdir")
    printf '# Written by deploy/install.sh: where this installation put libkvclient, relative to\n# this folder (%s).\nLIBDIR = %s\n' \
        "$libdir" "'$rel'" >"$tmp/_install.py"
    put 0644 "$tmp/_install.py" "$pydir/kvclient/_install.py"
fi
echo "installed kvd $version"
