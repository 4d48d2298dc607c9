#!/usr/bin/env python3
"""python_bench: the cost of the kvclient Python binding, against baselines measured in the
same run (issue 18):

  (a) Lookup+Release of a cached 128-block prefix, one synchronous call each: the binding's
      time per iteration vs the C client doing the same loop (bench/python_c_baseline.c, same
      library, same daemon, same pool). Target: within 2x.
  (b) the same batched: a kvc_batch of 32 lookups, then one of their 32 releases, every status
      checked. Target: within 1.2x.
  (c) KvdCache.update of one decode step (all layers; 8 layers, 8 KV heads, head_dim 128, fp16,
      1024-token context growing by 64 steps) vs a plain in-memory numpy cache that
      concatenates (HF DynamicCache). Target: within 1.5x. Two rows: a sequence whose blocks are
      consecutive ids (update returns a zero-copy view) and one whose blocks interleave with
      another sequence's (update gathers them), plus the cost of append_tokens per step.

Runs are interleaved (C, Python, C, Python, ...; plain, kvd, ...) REPS times; each row gives
the median ratio and its min-max spread. Prints a markdown table. Starts its own kvd.

  python3 bench/python_bench.py KVD_BIN LIBKVCLIENT C_BASELINE_BIN [--reps 7] [--quick]
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

NBLK, TPB, NBATCH = 128, 16, 32


def start_kvd(binary, tmp):
    sock = os.path.join(tmp, "kvd.sock")
    log = open(os.path.join(tmp, "kvd.log"), "wb")
    proc = subprocess.Popen([binary, "--backend=host", "--socket=" + sock,
                             "--admin-socket=" + os.path.join(tmp, "admin.sock"),
                             "--pool-memory=1G", "--segment-bytes=16M", "--log-level=warn",
                             "--index-entries=64K"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    import kvclient
    deadline = time.monotonic() + 15
    while True:
        if proc.poll() is not None:
            sys.exit("python_bench: kvd exited with %s (log in %s)" % (proc.returncode, tmp))
        try:
            kvclient.Connection(sock).close()
            return proc, sock
        except kvclient.KvdError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def c_run(binary, env, sock, model, mode, iters):
    out = subprocess.run([binary, sock, model, mode, str(iters)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return float(out.split()[1])


def py_single(pool, hashes, out, iters):
    lookup, release = pool.lookup, pool.release
    warm = iters // 10 + 1
    for i in range(warm + iters):
        if i == warm:
            t0 = time.perf_counter_ns()
        release(lookup(hashes, out))
    return (time.perf_counter_ns() - t0) / iters


def py_batch(conn, pool, hashes, outs, iters):
    b = conn.batch()
    warm = iters // 10 + 1
    for i in range(warm + iters):
        if i == warm:
            t0 = time.perf_counter_ns()
        b.reset()
        b.lookup_many(pool, hashes, outs)
        b.run()
        b.check()  # every request's status, as the C loop checks them
        b.reset()
        b.release_many(pool, outs)
        b.run()
        b.check()
    return (time.perf_counter_ns() - t0) / iters


# ---- (c) decode step ----------------------------------------------------------------------

LAYERS, HEADS, DIM, CTX, STEPS = 8, 8, 128, 1024, 64


def decode_plain(np, rng_seed):
    from kvclient.ref_decoder import PlainCache
    rng = np.random.default_rng(rng_seed)
    cache = PlainCache(np.float16)
    for layer in range(LAYERS):
        k = rng.standard_normal((1, HEADS, CTX, DIM)).astype(np.float16)
        cache.update(k, k, layer)
    steps = [rng.standard_normal((1, HEADS, 1, DIM)).astype(np.float16) for _ in range(STEPS)]
    t = 0
    for s in steps:
        t0 = time.perf_counter_ns()
        for layer in range(LAYERS):
            cache.update(s, s, layer)
        t += time.perf_counter_ns() - t0
    return t / STEPS


def _kvd_caches(np, kvclient, pool, rng, fragmented):
    """A KvdCache holding CTX tokens of K/V; fragmented: its blocks interleave with another
    cache's (ids not consecutive)."""
    prompt = rng.integers(0, 1 << 30, size=CTX + STEPS + 1).tolist()
    if not fragmented:
        cache, _ = kvclient.KvdCache.for_prompt(pool, prompt[:CTX], max_tokens=4096)
        other = None
    else:
        cache, _ = kvclient.KvdCache.for_prompt(pool, prompt[:TPB], max_tokens=4096)
        other, _ = kvclient.KvdCache.for_prompt(pool, [t + 1 for t in prompt[:TPB]],
                                                max_tokens=4096)
        for i in range(TPB, CTX, TPB):
            cache.append_tokens(prompt[i:i + TPB])
            other.append_tokens([t + 1 for t in prompt[i:i + TPB]])
        assert not cache._contig[0]
    for layer in range(LAYERS):
        k = rng.standard_normal((1, HEADS, CTX, DIM)).astype(np.float16)
        cache.update(k, k, layer)
    return cache, other, prompt


def decode_kvd(np, kvclient, pool, rng_seed, fragmented):
    rng = np.random.default_rng(rng_seed)
    cache, other, prompt = _kvd_caches(np, kvclient, pool, rng, fragmented)
    steps = [rng.standard_normal((1, HEADS, 1, DIM)).astype(np.float16) for _ in range(STEPS)]
    t_upd = t_app = 0
    for i, s in enumerate(steps):
        t0 = time.perf_counter_ns()
        cache.append_tokens([prompt[CTX + i]])
        t1 = time.perf_counter_ns()
        for layer in range(LAYERS):
            cache.update(s, s, layer)
        t_upd += time.perf_counter_ns() - t1
        t_app += t1 - t0
    contig = cache._contig[0]
    cache.close()
    if other is not None:
        other.close()
    return t_upd / STEPS, t_app / STEPS, contig


def stats(ratios):
    r = sorted(ratios)
    return r[len(r) // 2], r[0], r[-1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kvd")
    ap.add_argument("lib")
    ap.add_argument("c_baseline")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    a = ap.parse_args()
    os.environ["KVCLIENT_LIBRARY"] = os.path.abspath(a.lib)
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import numpy as np
    import kvclient

    tmp = tempfile.mkdtemp(prefix="pyb.", dir="/tmp")
    # The C baseline links libkvclient by its soname (or plain name): point the loader at it.
    libdir = os.path.join(tmp, "lib")
    os.mkdir(libdir)
    for name in ("libkvclient.so.1", "libkvclient.so"):
        os.symlink(os.path.abspath(a.lib), os.path.join(libdir, name))
    env = dict(os.environ, LD_LIBRARY_PATH=libdir + os.pathsep +
               os.environ.get("LD_LIBRARY_PATH", ""))
    proc, sock = start_kvd(a.kvd, tmp)
    try:
        conn = kvclient.Connection(sock, client_name="python_bench")
        model = "bench-lookup"
        pool = conn.attach(model, layers=2, kv_heads=2, head_dim=64, tokens_per_block=TPB,
                           dtype="fp16")
        tokens = [i * 7 + 3 for i in range(NBLK * TPB)]  # python_c_baseline.c's prompt
        hashes = pool.hash_tokens(tokens)
        c_run(a.c_baseline, env, sock, model, "single", 10)  # publishes the prefix
        out = kvclient.Blocks(NBLK)
        assert len(pool.lookup(hashes, out)) == NBLK
        pool.release(out)
        outs = [kvclient.Blocks(NBLK) for _ in range(NBATCH)]
        n_single = 300 if a.quick else 3000
        n_batch = 20 if a.quick else 200
        rows = []

        res = {"single": [], "batch": []}
        for _ in range(a.reps):
            c = c_run(a.c_baseline, env, sock, model, "single", n_single)
            p = py_single(pool, hashes, out, n_single)
            res["single"].append((c, p))
            c = c_run(a.c_baseline, env, sock, model, "batch", n_batch)
            p = py_batch(conn, pool, hashes, outs, n_batch)
            res["batch"].append((c, p))
        for key, label, target in (
                ("single", "Lookup+Release 128 blocks, sync (us/iter)", 2.0),
                ("batch", "32 Lookups + 32 Releases, 2 batches (us/iter)", 1.2)):
            cs = sorted(x[0] for x in res[key])
            ps = sorted(x[1] for x in res[key])
            med, lo, hi = stats([p / c for c, p in res[key]])
            rows.append((label, "C %.1f" % (cs[len(cs) // 2] / 1e3),
                         "Python %.1f" % (ps[len(ps) // 2] / 1e3), med, lo, hi, target))

        dec = {False: [], True: []}
        app = []
        for rep in range(a.reps):
            for frag in (False, True):
                # A fresh pool per run: in a fresh pool a sequence gets consecutive block ids
                # (later runs would get whatever blocks eviction frees).
                dpool = conn.attach("bench-decode-%d-%d" % (rep, frag), layers=LAYERS,
                                    kv_heads=HEADS, head_dim=DIM, tokens_per_block=TPB,
                                    dtype="fp16")
                base = decode_plain(np, rep)
                upd, ap_ns, contig = decode_kvd(np, kvclient, dpool, 1000 * rep + frag, frag)
                dpool.detach()
                if contig == frag:
                    sys.exit("python_bench: decode run %d: block ids %sconsecutive" % (
                        rep, "" if contig else "not "))
                dec[frag].append((base, upd))
                app.append(ap_ns)
        for frag, label in ((False, "KvdCache.update decode step, consecutive blocks (us)"),
                            (True, "KvdCache.update decode step, interleaved blocks (us)")):
            bs = sorted(x[0] for x in dec[frag])
            us = sorted(x[1] for x in dec[frag])
            med, lo, hi = stats([u / b for b, u in dec[frag]])
            rows.append((label, "numpy concat %.1f" % (bs[len(bs) // 2] / 1e3),
                         "kvd %.1f" % (us[len(us) // 2] / 1e3), med, lo, hi, 1.5))
        app.sort()
        print("## python (issue 18): the kvclient binding vs its baselines\n")
        print("%d interleaved repetitions; ratio = Python / baseline (lower is better).\n"
              % a.reps)
        print("| operation | baseline | binding | ratio (median) | spread (min-max) | target |")
        print("|---|---|---|---|---|---|")
        for label, b, p, med, lo, hi, target in rows:
            print("| %s | %s | %s | %.2fx | %.2f-%.2fx | <= %.1fx %s |" % (
                label, b, p, med, lo, hi, target, "met" if med <= target else "MISSED"))
        print("\nDecode rows: mean per step over %d steps from a %d-token context, the commits "
              "of filled blocks (a round trip every %d steps) included. KvdCache.append_tokens, "
              "which the engine calls once per step before the forward pass (an Allocate round "
              "trip every %d steps, new segments mapped when the pool grows), costs a mean of "
              "%.1f us per step (median of the runs).\n"
              % (STEPS, CTX, TPB, TPB, app[len(app) // 2] / 1e3))
        conn.close()
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
