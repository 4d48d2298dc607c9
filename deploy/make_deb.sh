#!/usr/bin/env bash
# deploy/make_deb.sh OUTDIR ARTIFACTS...: builds kvd_<version>-1_<arch>.deb with dpkg-deb.
# ARTIFACTS are deploy/install.sh's key=value arguments (kvd=, kvctl=, so=, a=, h=, kvd.8=,
# kvctl.1=). The tree is install.sh --prefix=/usr into a staging root, plus DEBIAN/ from
# deploy/deb/ (maintainer scripts: kvd user and kvd-admin group, systemd unit enable/start,
# ldconfig trigger; /etc/kvd/kvd.conf a conffile), the copyright and changelog, and the lintian
# overrides docs/PACKAGING.md justifies. Depends are the Debian packages that own the shared
# libraries the binaries load (dpkg -S). Prints the .deb's path last.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out=$1; shift
mkdir -p "$out"
out="$(cd "$out" && pwd)"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
chmod 0755 "$stage"
bash "$here/install.sh" --destdir="$stage" --prefix=/usr "$@" >"$stage.log" || { cat "$stage.log" >&2; exit 1; }
rm -f "$stage.log"
# Debian ships stripped objects (debug info belongs in a -dbgsym package, not built here).
strip --strip-unneeded --remove-section=.comment --remove-section=.note "$stage/usr/bin/kvd" "$stage/usr/bin/kvctl" \
    "$stage"/usr/lib/*/libkvclient.so.*.*
strip --strip-debug "$stage"/usr/lib/*/libkvclient.a
version=$(sed -n 's/^#define KV_VERSION "\(.*\)"/\1/p' "$here/../common/kv_version.h")
arch=$(dpkg --print-architecture)
maintainer=${KVD_DEB_MAINTAINER:-kvd developers <kvd@localhost>}

doc="$stage/usr/share/doc/kvd"
install -D -m 0644 "$here/deb/copyright" "$doc/copyright"
sed -e "s/@VERSION@/$version/" -e "s/^ -- [^>]*>/ -- $maintainer/" "$here/deb/changelog" | gzip -9n >"$doc/changelog.Debian.gz"
chmod 0644 "$doc/changelog.Debian.gz"
install -D -m 0644 "$here/deb/lintian-overrides" "$stage/usr/share/lintian/overrides/kvd"

# Shared libraries the binaries need -> the packages that own them.
libs=$(for b in "$stage/usr/bin/kvd" "$stage/usr/bin/kvctl" "$stage"/usr/lib/*/libkvclient.so.*.*; do
           readelf -d "$b" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p'
       done | sort -u)
pkgs=()
for l in $libs; do
    # awk reads all of its input (no early exit: under pipefail ldconfig's SIGPIPE would end us)
    cache=$(ldconfig -p)
    path=$(awk -v l="$l" '$1 == l && /x86-64|'"$arch"'/ && !p {print $NF; p = 1}' <<<"$cache")
    [ -n "$path" ] || path=$(awk -v l="$l" '$1 == l && !p {print $NF; p = 1}' <<<"$cache")
    [ -n "$path" ] || { echo "make_deb.sh: cannot find $l" >&2; exit 1; }
    real=$(readlink -f "$path")
    p=$(dpkg -S "$real" 2>/dev/null || dpkg -S "$path" 2>/dev/null || dpkg -S "/usr$path" 2>/dev/null || true)
    p=${p%%:*}
    [ -n "$p" ] || { echo "make_deb.sh: no package owns $path" >&2; exit 1; }
    pkgs+=("$p")
done
depends=$(printf '%s\n' "${pkgs[@]}" | sort -u | paste -sd, | sed 's/,/, /g')
size=$(du -sk --exclude=DEBIAN "$stage" | cut -f1)

mkdir -p "$stage/DEBIAN"
sed -e "s/@VERSION@/$version/" -e "s/@ARCH@/$arch/" -e "s/@SIZE@/$size/" \
    -e "s/@DEPENDS@/$depends/" -e "s/^Maintainer: .*/Maintainer: $maintainer/" \
    "$here/deb/control.in" >"$stage/DEBIAN/control"
install -m 0644 "$here/deb/conffiles" "$here/deb/triggers" "$stage/DEBIAN/"
echo "libkvclient 1 kvd (>= $version)" >"$stage/DEBIAN/shlibs"
chmod 0644 "$stage/DEBIAN/shlibs"
install -m 0755 "$here/deb/postinst" "$here/deb/prerm" "$here/deb/postrm" "$stage/DEBIAN/"
(cd "$stage" && find . -type f ! -path './DEBIAN/*' ! -path './etc/*' -printf '%P\0' | sort -z \
    | xargs -0 md5sum) >"$stage/DEBIAN/md5sums"
chmod 0644 "$stage/DEBIAN/md5sums"
deb="$out/kvd_${version}-1_${arch}.deb"
dpkg-deb --root-owner-group -Zxz --build "$stage" "$deb" >/dev/null
echo "$deb"
