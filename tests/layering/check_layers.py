#!/usr/bin/env python3
"""check_layers: no file circles and no upward edges between kvd's production C files.

Builds a directed graph between production source files (daemon/, client/, common/, kernels/,
kvctl/ by default; tests excluded) from two kinds of evidence:

  include  A -> B when A has `#include "B"` (resolved as the compiler would: the including
           file's folder, then the repository root, then the [include_path] folders);
  symbol   A -> B when an undefined symbol (nm type U) of an object compiled from A is defined
           (T/D/B/R, also G/S/C, weak V/W as a last resort) by an object compiled from B. The
           objects are the ones Bazel left under bazel-bin/<pkg>/_objs/<target>/<rel>.pic.o
           (or .o), plus bazel/cuda.bzl's nvcc objects bazel-bin/<pkg>/<target>_<rel>.o.

A header x.h and its implementation x.c (same folder, same stem) are one node, a "module"
(a private x_int.h joins it too),
named by the .c path (by the .h path when there is no .c). Four checks, each one "test":

  circles           no strongly connected component of more than one module (Tarjan);
  layers            no edge from a lower layer of layers.conf to a higher one, none into
                    another stack's layer, none from production into test-only code;
  unassigned_files  every production file belongs to a layer;
  missing_objects   every production compile unit has an object (so the symbol graph is whole).

Standard library and binutils nm only. See README.md beside this file and layers.conf.
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import time

SRC_EXTS = (".c", ".cc", ".cpp", ".cu")
HDR_EXTS = (".h", ".hh", ".hpp", ".cuh")
DEFAULT_ROOTS = ["daemon/", "client/", "common/", "kernels/", "kvctl/"]
DEFAULT_INCLUDE_PATH = ["client/include/"]
TEST_DIR_NAMES = {"testing", "testdata", "fuzz"}
TEST_SUFFIXES = tuple("_test" + e for e in SRC_EXTS + HDR_EXTS)
EXCLUDED_TOP = ("tests/", "bench/", "examples/")
STRONG_DEFS = set("TDBRGSC")  # nm -P types of a definition that wins
WEAK_DEFS = set("VWui")  # used only when no strong definition exists
USE_TYPES = set("Uwv")  # undefined, weak undefined
MAX_SYMS_SHOWN = 5

CHECKS = ("circles", "layers", "unassigned_files", "missing_objects")

# Comments out, strings kept (an include's name is a string literal), line numbers kept.
_TOKENS = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|/\*.*?\*/|//[^\n]*', re.S)
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*(?:"([^"\n]+)"|<([^>\n]+)>)', re.M)


def strip_comments(text):
    def repl(m):
        s = m.group(0)
        return "\n" * s.count("\n") if s.startswith("/") else s

    return _TOKENS.sub(repl, text)


# ---- layers.conf ------------------------------------------------------------------------------


class Conf:
    """layers.conf, parsed. Errors are collected, not raised: they fail the layers check."""

    def __init__(self):
        self.layers = []  # [(name, [entry, ...], lineno)] bottom up
        self.testonly = []  # [(entry, lineno)]
        self.allow = []  # [(from, to, reason, lineno)]
        self.roots = []  # ["daemon/", ...]
        self.include_path = []  # ["client/include/", ...]
        self.either = []  # [([file, ...], lineno)]: one of them has an object
        self.errors = []  # ["layers.conf:12: ..."]
        self.path = ""


def norm_entry(entry, root):
    """A conf path, repo-relative."""
    entry = entry.strip()
    while entry.startswith("./"):
        entry = entry[2:]
    return entry


def entry_matches(entry, path):
    """Length of the match of a conf entry on a repo-relative path, 0 when it does not match.

    `dir/` matches every file below it; `dir/x.c` the file itself; `dir/x` (no extension) the
    module dir/x.c + dir/x.h and, should dir/x/ be a folder, every file below it.
    """
    if entry.endswith("/"):
        return len(entry) if path.startswith(entry) else 0
    if path == entry or os.path.splitext(path)[0] == entry or path.startswith(entry + "/"):
        return len(entry)
    return 0


def parse_conf(path, root):
    conf = Conf()
    conf.path = path
    rel = os.path.relpath(path, root) if path.startswith(root) else path
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        conf.errors.append("%s: cannot read: %s" % (rel, e.strerror))
        conf.roots = list(DEFAULT_ROOTS)
        conf.include_path = list(DEFAULT_INCLUDE_PATH)
        return conf
    section = "layers"
    seen_sections = set()
    names = set()
    for n, raw in enumerate(lines, 1):
        where = "%s:%d" % (rel, n)
        body, _, comment = raw.partition("#")
        body = body.strip()
        if not body:
            continue
        m = re.fullmatch(r"\[([a-z_]+)\]", body)
        if m:
            section = m.group(1)
            if section not in ("layers", "testonly", "allow", "roots", "include_path", "either"):
                conf.errors.append("%s: unknown section [%s]" % (where, section))
            seen_sections.add(section)
            continue
        if section == "layers":
            name, colon, rest = body.partition(":")
            name = name.strip()
            if not colon or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)?", name):
                conf.errors.append(
                    "%s: expected `LAYER_NAME: path-prefix ...`, got %r" % (where, raw))
                continue
            if name in names:
                conf.errors.append("%s: layer %s listed twice" % (where, name))
                continue
            names.add(name)
            entries = [norm_entry(e, root) for e in rest.split()]
            if not entries:
                conf.errors.append("%s: layer %s has no paths" % (where, name))
            conf.layers.append((name, entries, n))
        elif section == "testonly":
            for e in body.split():
                conf.testonly.append((norm_entry(e, root), n))
        elif section == "allow":
            m = re.fullmatch(r"(\S+)\s*->\s*(\S+)", body)
            if not m:
                conf.errors.append("%s: expected `from -> to  # reason`, got %r" % (where, raw))
                continue
            if not comment.strip():
                conf.errors.append("%s: an allowed edge needs a reason after `#`" % where)
                continue
            conf.allow.append(
                (norm_entry(m.group(1), root), norm_entry(m.group(2), root), comment.strip(), n)
            )
        elif section == "roots":
            conf.roots.extend(norm_entry(e, root).rstrip("/") + "/" for e in body.split())
        elif section == "include_path":
            conf.include_path.extend(norm_entry(e, root).rstrip("/") + "/" for e in body.split())
        elif section == "either":
            group = [norm_entry(e, root) for e in body.replace("|", " ").split()]
            if len(group) < 2:
                conf.errors.append("%s: an [either] line names two or more files" % where)
                continue
            conf.either.append((group, n))
    if "roots" not in seen_sections:
        conf.roots = list(DEFAULT_ROOTS)
    if "include_path" not in seen_sections:
        conf.include_path = list(DEFAULT_INCLUDE_PATH)
    if not conf.layers:
        conf.errors.append("%s: no layers listed" % rel)
    return conf


# ---- files ------------------------------------------------------------------------------------


def is_code(name):
    return name.endswith(SRC_EXTS + HDR_EXTS)


def scan_files(root, conf):
    """(production files, test-only files) under the roots, repo-relative, sorted."""
    prod, test = [], []
    for r in conf.roots:
        top = os.path.join(root, r)
        if not os.path.isdir(top):
            continue
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames.sort()
            reldir = os.path.relpath(dirpath, root).replace(os.sep, "/")
            in_test_dir = any(p in TEST_DIR_NAMES for p in reldir.split("/"))
            for fn in sorted(filenames):
                if not is_code(fn):
                    continue
                path = fn if reldir == "." else reldir + "/" + fn
                if (
                    in_test_dir
                    or fn.endswith(TEST_SUFFIXES)
                    or path.startswith(EXCLUDED_TOP)
                    or any(entry_matches(e, path) for e, _ in conf.testonly)
                ):
                    test.append(path)
                else:
                    prod.append(path)
    return sorted(set(prod)), sorted(set(test))


def module_map(prod):
    """file -> module: x.h joins x.c/x.cc/x.cpp/x.cu of the same folder, and so does x_int.h
    (a module's private header, shared by its own sources and its white-box tests)."""
    prodset = set(prod)
    mod = {}
    for p in prod:
        stem, ext = os.path.splitext(p)
        mod[p] = p
        if ext in HDR_EXTS:
            stems = [stem]
            if stem.endswith("_int"):
                stems.append(stem[: -len("_int")])
            for st in stems:
                hit = next((st + se for se in SRC_EXTS if st + se in prodset), None)
                if hit is not None:
                    mod[p] = hit
                    break
    return mod


def resolve_include(root, including, name, angle, include_path):
    cands = []
    if not angle:
        cands.append(os.path.join(os.path.dirname(including), name))
        cands.append(name)
    cands.extend(d + name for d in include_path)
    for c in cands:
        c = os.path.normpath(c).replace(os.sep, "/")
        if c.startswith("../"):
            continue
        if os.path.isfile(os.path.join(root, c)):
            return c
    return None


def scan_includes(root, files, include_path):
    """[(from, to or None, lineno, spelled)] for every #include of each file."""
    out = []
    for f in files:
        try:
            with open(os.path.join(root, f), encoding="utf-8", errors="replace") as fh:
                text = strip_comments(fh.read())
        except OSError:
            continue
        for m in _INCLUDE.finditer(text):
            name = m.group(1) or m.group(2)
            angle = m.group(1) is None
            lineno = text.count("\n", 0, m.start()) + 1
            spelled = '"%s"' % name if not angle else "<%s>" % name
            out.append((f, resolve_include(root, f, name, angle, include_path), lineno, spelled))
    return out


# ---- objects ----------------------------------------------------------------------------------


def obj_stem(fn):
    for suf in (".pic.o", ".o"):
        if fn.endswith(suf):
            return fn[: -len(suf)], suf
    return None, None


def find_objects(root, binroot, conf, srcset):
    """([(object path, source, target label)], [unmapped object paths]).

    srcset: every compile unit under the roots (production and test), so an object maps back
    to its source whatever it is; the caller keeps the production ones.
    """
    found = {}  # (pkg, target, rel) -> (path, suffix)
    unmapped = []
    cu_by_pkgdir = collections.defaultdict(list)
    for s in srcset:
        if s.endswith(".cu"):
            cu_by_pkgdir[os.path.dirname(s)].append(s)
    for r in conf.roots:
        top = os.path.join(binroot, r)
        if not os.path.isdir(top):
            continue
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if not d.endswith(".runfiles"))
            relbin = os.path.relpath(dirpath, binroot).replace(os.sep, "/")
            parts = relbin.split("/")
            if "_objs" in parts:
                i = parts.index("_objs")
                pkg = "/".join(parts[:i])
                below = parts[i + 1 :]
                for fn in filenames:
                    stem, suf = obj_stem(fn)
                    if stem is None:
                        continue
                    rest = below + [stem]
                    hit = None
                    # Target names may hold slashes (testdata/libfakecuda.so): try each split,
                    # the longest relative path first.
                    for k in range(1, len(rest)):
                        target = "/".join(rest[:k])
                        rel = "/".join(rest[k:])
                        for ext in SRC_EXTS:
                            src = (pkg + "/" if pkg else "") + rel + ext
                            if src in srcset:
                                hit = (pkg, target, rel, src)
                                break
                        if hit:
                            break
                    path = os.path.join(dirpath, fn)
                    if hit is None:
                        unmapped.append(path)
                        continue
                    key = hit
                    old = found.get(key)
                    if old is None or (suf == ".pic.o" and old[1] != ".pic.o"):
                        found[key] = (path, suf)
            else:
                # bazel/cuda.bzl: nvcc writes <pkg>/<target>_<rel with / -> _>.o
                pkg = relbin if relbin != "." else ""
                for fn in filenames:
                    if not fn.endswith(".o") or fn.endswith(".pic.o"):
                        continue
                    for src in cu_by_pkgdir.get(pkg, ()):
                        rel = src[len(pkg) + 1 :] if pkg else src
                        suffix = "_" + rel.replace("/", "_")[: -len(".cu")] + ".o"
                        if fn.endswith(suffix) and len(fn) > len(suffix):
                            target = fn[: -len(suffix)]
                            found[(pkg, target, rel, src)] = (os.path.join(dirpath, fn), ".o")
                            break
    # Bazel never deletes outputs: objects of a target renamed or removed since stay behind
    # with old symbols. Keep only targets whose name is still a string in the package's BUILD.
    build_text = {}

    def target_in_build(pkg, target):
        if pkg not in build_text:
            text = None
            for b in ("BUILD.bazel", "BUILD"):
                try:
                    with open(os.path.join(root, pkg, b), encoding="utf-8") as f:
                        text = f.read()
                    break
                except OSError:
                    pass
            build_text[pkg] = text
        text = build_text[pkg]
        return text is None or ('"%s"' % target) in text

    objs, stale = [], []
    for (pkg, target, rel, src), (p, _) in found.items():
        if target_in_build(pkg, target):
            objs.append((p, src, "//%s:%s" % (pkg, target)))
        else:
            stale.append(p)
    return sorted(objs), sorted(unmapped), sorted(stale)


def run_nm(paths):
    """{path: [(symbol, type)]} of external symbols; raises FileNotFoundError without nm."""
    syms = {p: [] for p in paths}
    errors = []
    for i in range(0, len(paths), 200):
        chunk = paths[i : i + 200]
        res = subprocess.run(
            ["nm", "-P", "-A", "-g"] + chunk,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            universal_newlines=True,
        )
        if res.stderr.strip():
            errors.extend(res.stderr.strip().splitlines())
        for line in res.stdout.splitlines():
            fpath, sep, rest = line.partition(": ")
            if not sep or fpath not in syms:
                continue
            fields = rest.split()
            if len(fields) >= 2:
                syms[fpath].append((fields[0], fields[1]))
    return syms, errors


def symbol_edges(objs, syms):
    """([(from src, to src, symbol)], [(from src, target, symbol, [candidate srcs])])."""
    strong = collections.defaultdict(lambda: collections.defaultdict(set))  # sym -> src -> {tgt}
    weak = collections.defaultdict(lambda: collections.defaultdict(set))
    for path, src, target in objs:
        for name, typ in syms.get(path, ()):
            if typ in STRONG_DEFS:
                strong[name][src].add(target)
            elif typ in WEAK_DEFS:
                weak[name][src].add(target)
    edges, ambiguous = set(), set()
    for path, src, target in objs:
        for name, typ in syms.get(path, ()):
            if typ not in USE_TYPES:
                continue
            defs = strong.get(name) or weak.get(name)
            if not defs:
                continue  # libc, libuv, protobuf-c, ...
            cands = sorted(defs)
            if len(cands) > 1:
                same = [s for s in cands if target in defs[s]]
                if len(same) == 1:
                    cands = same
                else:
                    ambiguous.add((src, target, name, tuple(cands)))
                    continue
            if cands[0] != src:
                edges.add((src, cands[0], name))
    return sorted(edges), sorted(ambiguous)


# ---- graph ------------------------------------------------------------------------------------


def tarjan(nodes, succ):
    """Strongly connected components, iterative (no recursion limit on long chains)."""
    index, low, onstack, stack, sccs = {}, {}, set(), [], []
    counter = 0
    for v0 in nodes:
        if v0 in index:
            continue
        index[v0] = low[v0] = counter
        counter += 1
        stack.append(v0)
        onstack.add(v0)
        work = [(v0, iter(succ.get(v0, ())))]
        while work:
            v, it = work[-1]
            pushed = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    onstack.add(w)
                    work.append((w, iter(succ.get(w, ()))))
                    pushed = True
                    break
                if w in onstack:
                    low[v] = min(low[v], index[w])
            if pushed:
                continue
            work.pop()
            if work:
                u = work[-1][0]
                low[u] = min(low[u], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    onstack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                sccs.append(sorted(comp))
    return sccs


def shortest_cycle(start, members, succ):
    """One shortest cycle through start inside the component, as a list of modules."""
    prev = {start: None}
    queue = collections.deque([start])
    while queue:
        v = queue.popleft()
        for w in succ.get(v, ()):
            if w not in members:
                continue
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return [start]


class Edge:
    """Why one file (or module) depends on another."""

    def __init__(self):
        self.includes = []  # ["daemon/admin.c:16 #include \"daemon/server_int.h\""]
        self.symbols = set()

    def merge(self, other):
        self.includes.extend(other.includes)
        self.symbols |= other.symbols

    def why(self):
        parts = list(self.includes)
        if self.symbols:
            syms = sorted(self.symbols)
            more = len(syms) - MAX_SYMS_SHOWN
            s = ", ".join(syms[:MAX_SYMS_SHOWN])
            if more > 0:
                s += " (+%d more)" % more
            parts.append("uses " + s)
        return "; ".join(parts)


# ---- main -------------------------------------------------------------------------------------


def main(argv):
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(
        description="kvd layering check: no circles between production C files, no upward "
        "edges between the layers of layers.conf."
    )
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(here)),
                    help="repository root (default: two levels above this script)")
    ap.add_argument("--bin", help="Bazel output tree with _objs (default: ROOT/bazel-bin)")
    ap.add_argument("--conf", help="layers file (default: ROOT/tests/layering/layers.conf)")
    ap.add_argument("--includes-only", action="store_true",
                    help="use #include edges only; skip nm and the missing_objects check")
    ap.add_argument("--verbose", action="store_true",
                    help="also print every edge, skipped symbols, unresolved includes")
    ap.add_argument("--dot", metavar="FILE", help="write the module graph as Graphviz dot")
    args = ap.parse_args(argv)

    t0 = time.monotonic()
    root = os.path.abspath(args.root)
    binroot = os.path.abspath(args.bin) if args.bin else os.path.join(root, "bazel-bin")
    confpath = args.conf or os.path.join(root, "tests", "layering", "layers.conf")
    conf = parse_conf(os.path.abspath(confpath), root)
    verbose = args.verbose

    def note(msg):
        print("note: " + msg)

    prod, testfiles = scan_files(root, conf)
    prodset, testset = set(prod), set(testfiles)
    mod = module_map(prod)
    modules = sorted(set(mod.values()))

    # file -> layer index (None: unassigned)
    layer_of = {}
    used_entries = set()
    for p in prod:
        best, best_len = None, 0
        for i, (_, entries, _) in enumerate(conf.layers):
            for e in entries:
                n = entry_matches(e, p)
                if n > best_len:
                    best, best_len, best_e = i, n, e
        layer_of[p] = best
        if best is not None:
            used_entries.add((best, best_e))

    def layer_name(i):
        return conf.layers[i][0] if i is not None else "unassigned"

    def stack_of(i):
        name = conf.layers[i][0]
        return name.split(".", 1)[0] if "." in name else None

    # ---- edges between files
    fedges = collections.defaultdict(Edge)  # (from, to) -> Edge
    test_uses = []  # (from, to, why): production code reaching test-only code
    unresolved = []
    for frm, to, lineno, spelled in scan_includes(root, prod, conf.include_path):
        why = "%s:%d #include %s" % (frm, lineno, spelled)
        if to is None:
            if not spelled.startswith("<"):  # <...> not found in the tree: a system header
                unresolved.append(why)
        elif to in prodset:
            if mod[to] != mod[frm]:
                fedges[(frm, to)].includes.append(why)
        elif to in testset:
            test_uses.append((frm, to, why))

    objects_problem = None  # a line that fails missing_objects
    missing = []
    objs, unmapped, stale_objs, ambiguous, nm_errors = [], [], [], [], []
    if not args.includes_only:
        allsrc = {f for f in prod + testfiles if f.endswith(SRC_EXTS)}
        allobjs, unmapped, stale_objs = find_objects(root, binroot, conf, allsrc)
        objs = [o for o in allobjs if o[1] in prodset]
        if not allobjs and not stale_objs:
            objects_problem = "no objects under %s: build first" % binroot
        else:
            try:
                syms, nm_errors = run_nm([o[0] for o in objs])
            except FileNotFoundError:
                syms = {}
                objects_problem = "nm not found: install binutils"
            sedges, ambiguous = symbol_edges(objs, syms)
            for frm, to, name in sedges:
                if mod[frm] != mod[to]:
                    fedges[(frm, to)].symbols.add(name)
            have = {o[1] for o in objs}
            exempt = set()
            for group, _ in conf.either:
                members = [p for p in prod if any(entry_matches(e, p) for e in group)]
                exempt.update(members)
                if members and not any(m in have for m in members):
                    missing.append("none of %s has an object" % " | ".join(members))
            for p in prod:
                if p.endswith(SRC_EXTS) and p not in have and p not in exempt:
                    missing.append(p)

    # ---- allowed edges
    allow_used = set()
    for key in list(fedges):
        frm, to = key
        for k, (a, b, reason, n) in enumerate(conf.allow):
            if (entry_matches(a, frm) or a == mod[frm]) and (entry_matches(b, to) or b == mod[to]):
                allow_used.add(k)
                if verbose:
                    note("allowed by layers.conf:%d (%s): %s -> %s" % (n, reason, frm, to))
                del fedges[key]
                break

    # ---- module graph
    medges = collections.defaultdict(Edge)
    for (frm, to), e in fedges.items():
        medges[(mod[frm], mod[to])].merge(e)
    succ = collections.defaultdict(list)
    for a, b in sorted(medges):
        succ[a].append(b)

    results = {}
    print(
        "check_layers: %d production files in %d modules, %d edges between modules "
        "(%d file edges: %d include, %d symbol), %s"
        % (
            len(prod), len(modules), len(medges), len(fedges),
            sum(1 for e in fedges.values() if e.includes),
            sum(1 for e in fedges.values() if e.symbols),
            "includes only" if args.includes_only
            else "%d objects under %s" % (len(objs), os.path.relpath(binroot, root)
                                          if binroot.startswith(root) else binroot),
        )
    )
    for e in conf.errors:
        print("error: " + e)
    stale = []
    for i, (name, entries, n) in enumerate(conf.layers):
        for e in entries:
            if (i, e) not in used_entries:
                stale.append("layers.conf:%d: %s entry %s matches no production file%s" % (
                    n, name, e, "" if not any(entry_matches(e, p) for p in prod)
                    else " of its own (a longer entry wins)"))
    for e, n in conf.testonly:
        if not any(entry_matches(e, t) for t in testfiles):
            stale.append("layers.conf:%d: [testonly] %s matches no file" % (n, e))
    for k, (a, b, reason, n) in enumerate(conf.allow):
        if k not in allow_used:
            stale.append("layers.conf:%d: [allow] %s -> %s is not needed any more" % (n, a, b))
    if verbose:
        for s in stale:
            note(s)
    elif stale:
        note("%d layers.conf entr%s match nothing (--verbose lists them)"
             % (len(stale), "y does" if len(stale) == 1 else "ies"))
    if objects_problem and not args.includes_only:
        note("symbol edges are missing: circles and layers were checked on includes only")

    if verbose:
        for i, (name, _, _) in enumerate(conf.layers):
            files = [p for p in prod if layer_of[p] == i]
            print("layer %d %s (%d files): %s" % (i, name, len(files), " ".join(files)))
        for (a, b), e in sorted(medges.items()):
            print("edge %s -> %s: %s" % (a, b, e.why()))
        for why in unresolved:
            print("unresolved (outside the tree or generated): " + why)
        for src, target, name, cands in ambiguous:
            print("skipped symbol %s used by %s (%s): defined by %s, none in the same target"
                  % (name, src, target, ", ".join(cands)))
        for p in unmapped:
            print("object without a source (stale?): " + os.path.relpath(p, binroot))
        for p in stale_objs:
            print("stale object, its target is no longer in BUILD: " + os.path.relpath(p, binroot))
        for line in nm_errors:
            print("nm: " + line)

    def run_check(name, fn):
        print("[ RUN      ] " + name)
        failed_msg = fn()
        if failed_msg:
            print("[  FAILED  ] %s: %s" % (name, failed_msg))
        else:
            print("[       OK ] " + name)
        results[name] = not failed_msg

    # ---- circles
    sccs = [c for c in tarjan(modules, succ) if len(c) > 1]
    sccs.sort(key=lambda c: (-len(c), c))
    in_circle = {}
    for k, comp in enumerate(sccs):
        for m in comp:
            in_circle[m] = k

    def check_circles():
        for k, comp in enumerate(sccs, 1):
            members = set(comp)
            inner = [(a, b) for (a, b) in sorted(medges) if a in members and b in members]
            print("circle %d: %d modules, %d edges between them: %s"
                  % (k, len(comp), len(inner), " ".join(comp)))
            print("  for example: " + " -> ".join(shortest_cycle(comp[0], members, succ)))
            for a, b in inner:
                print("  %s -> %s: %s" % (a, b, medges[(a, b)].why()))
        if sccs:
            return "%d circle(s) covering %d modules" % (len(sccs), sum(len(c) for c in sccs))
        return None

    # ---- layers
    def check_layers():
        bad = collections.defaultdict(Edge)  # (from module, to module) -> Edge
        kind = {}
        for (frm, to), e in sorted(fedges.items()):
            la, lb = layer_of[frm], layer_of[to]
            if la is None or lb is None:
                continue
            if lb > la:
                k = "up from %s to %s" % (layer_name(la), layer_name(lb))
            elif stack_of(lb) is not None and stack_of(lb) != stack_of(la):
                k = "across from %s to %s" % (layer_name(la), layer_name(lb))
            else:
                continue
            bad[(mod[frm], mod[to])].merge(e)
            kind.setdefault((mod[frm], mod[to]), k)
        for (a, b), e in sorted(bad.items()):
            print("layer violation: %s -> %s (%s): %s" % (a, b, kind[(a, b)], e.why()))
        for frm, to, why in test_uses:
            print("layer violation: %s uses test-only %s: %s" % (frm, to, why))
        n = len(bad) + len(test_uses) + len(conf.errors)
        if n:
            parts = []
            if bad:
                parts.append("%d module edge(s) against the layer order" % len(bad))
            if test_uses:
                parts.append("%d include(s) of test-only code" % len(test_uses))
            if conf.errors:
                parts.append("%d error(s) in %s" % (len(conf.errors), os.path.basename(conf.path)))
            return ", ".join(parts)
        return None

    # ---- unassigned
    def check_unassigned():
        un = [p for p in prod if layer_of[p] is None]
        for p in un:
            print("unassigned: %s matches no layer of layers.conf" % p)
        return "%d production file(s) in no layer" % len(un) if un else None

    # ---- missing objects
    def check_missing():
        if objects_problem:
            print(objects_problem)
            return objects_problem
        for m in missing:
            print("missing object: %s (not built, or in no BUILD target)" % m)
        return "%d compile unit(s) without an object" % len(missing) if missing else None

    run_check("circles", check_circles)
    run_check("layers", check_layers)
    run_check("unassigned_files", check_unassigned)
    if args.includes_only:
        print("[  SKIPPED ] missing_objects: --includes-only")
    else:
        run_check("missing_objects", check_missing)

    if args.dot:
        write_dot(args.dot, modules, medges, mod, layer_of, conf, in_circle, fedges)

    ran = len(results)
    passed = sum(1 for v in results.values() if v)
    failed = ran - passed
    print("check_layers: %.2f s" % (time.monotonic() - t0))
    print("[==========] %d test(s) run." % ran)
    print("[  PASSED  ] %d test(s)." % passed)
    if failed:
        print("[  FAILED  ] %d test(s), listed above." % failed)
    return 1 if failed else 0


def write_dot(path, modules, medges, mod, layer_of, conf, in_circle, fedges):
    def q(s):
        return '"%s"' % s.replace("\\", "\\\\").replace('"', '\\"')

    layer_mod = {}
    for m in modules:
        layer_mod[m] = layer_of.get(m)
    upward = set()
    for (frm, to) in fedges:
        la, lb = layer_of.get(frm), layer_of.get(to)
        if la is not None and lb is not None and lb > la:
            upward.add((mod[frm], mod[to]))
    lines = ["digraph kvd_modules {", "  rankdir=BT;", "  node [shape=box, fontsize=10];"]
    for i, (name, _, _) in enumerate(conf.layers):
        members = [m for m in modules if layer_mod[m] == i]
        if not members:
            continue
        lines.append("  subgraph %s {" % q("cluster_%d" % i))
        lines.append("    label=%s;" % q("%d %s" % (i, name)))
        for m in members:
            attrs = ", color=red" if m in in_circle else ""
            lines.append("    %s [label=%s%s];" % (q(m), q(os.path.basename(m)), attrs))
        lines.append("  }")
    for m in modules:
        if layer_mod[m] is None:
            lines.append("  %s [style=dashed%s];" % (q(m), ", color=red" if m in in_circle else ""))
    for (a, b), e in sorted(medges.items()):
        attrs = ["tooltip=%s" % q(e.why())]
        if a in in_circle and in_circle.get(a) == in_circle.get(b):
            attrs.append("color=red")
        elif (a, b) in upward:
            attrs.append("color=orange")
        if not e.includes:
            attrs.append("style=dashed")  # symbol only: no include says it
        lines.append("  %s -> %s [%s];" % (q(a), q(b), ", ".join(attrs)))
    lines.append("}")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
