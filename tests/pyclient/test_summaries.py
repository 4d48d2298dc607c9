"""Page summaries (IceCache, docs/ICECACHE.md) against a real kvd: a pool attached with
Layout.summaries gets, per committed block, the per-channel min, max and mean of its keys for
every (layer, KV head), computed by the daemon from the bytes; the summary survives demotion to
the lower tiers and promotion back unchanged; another tenant's pool never shows it; a pool
without the flag refuses the request."""

import os
import struct

import numpy as np
import pytest

import kvdwire as kw
from conftest import UID_A, UID_B, Child, wait_until
from kvdwire import pb

LAYOUT = kw.Layout(2, 2, 8, 16, pb.FP16, pb.LAYER_MAJOR)
T = LAYOUT.tokens_per_block
SMALL = {"pool_memory": "160K", "segment_bytes": "64K"}


def attach(conn, model, summaries=True):
    lp = LAYOUT.to_pb()
    lp.summaries = summaries
    r, fds = conn.call("attach_pool", pb.AttachPool(model_id=model, layout=lp))
    pool = conn.pools[r.pool_id] = kw.Pool(conn, r.pool_id, kw.Layout.from_pb(r.layout),
                                           r.blocks_per_segment)
    pool.hash_seed = (r.hash_seed.lo, r.hash_seed.hi)
    pool.hash_algo = r.hash_algo
    pool.add_segments(r.segments, fds)
    assert r.layout.summaries == summaries
    pool.attach_reply = r
    return pool


def keys_image(seed):
    """A block image ([layers][K,V][tokens][heads][dim] fp16) and its K part."""
    rng = np.random.default_rng(seed)
    kv = rng.uniform(-2, 2, size=(LAYOUT.num_layers, 2, T, LAYOUT.num_kv_heads,
                                  LAYOUT.head_dim)).astype(np.float16)
    return kv.tobytes(), kv[:, 0].astype(np.float32)


def expected(k):
    """[layers][heads][3][dim]: min, max, mean over tokens (float32 sums in token order)."""
    out = np.zeros((LAYOUT.num_layers, LAYOUT.num_kv_heads, 3, LAYOUT.head_dim), np.float32)
    for l in range(LAYOUT.num_layers):
        for h in range(LAYOUT.num_kv_heads):
            x = k[l, :, h, :]
            out[l, h, 0] = x.min(axis=0)
            out[l, h, 1] = x.max(axis=0)
            s = np.zeros(LAYOUT.head_dim, np.float32)
            for t in range(T):
                s = np.float32(s + x[t])
            out[l, h, 2] = s / np.float32(T)
    return out


def summaries(conn, pool, hashes):
    r, _ = conn.call("summaries", pb.Summaries(pool_id=pool.pool_id,
                                               hashes_packed=kw.pack_hashes(hashes)))
    res = []
    for b in r.summaries:
        res.append(np.frombuffer(b, np.float32).reshape(
            LAYOUT.num_layers, LAYOUT.num_kv_heads, 3, LAYOUT.head_dim) if b else None)
    return res


def commit_chain(conn, pool, n, base):
    toks = list(range(base, base + n * T))
    hashes = kw.hash_chain(pool.hash_seed, toks, T, b"", pool.hash_algo)
    r = conn.allocate(pool.pool_id, n)
    pool.follow(r)
    blocks = kw.reply_blocks(r)
    keys, entries, parent = [], [], kw.NO_PARENT
    for i, (b, h) in enumerate(zip(blocks, hashes)):
        img, k = keys_image(base * 1000 + i)
        pool.write_block(b[0], img)
        keys.append(k)
        entries.append((b, h, parent))
        parent = b[0]
    canon = conn.commit(pool.pool_id, entries)
    return canon, hashes, keys


def test_summaries_of_committed_blocks(kvd):
    c = kvd.connect()
    pool = attach(c, "m-sum")
    canon, hashes, keys = commit_chain(c, pool, 3, 1)
    got = summaries(c, pool, hashes + [(5, 6)])
    for g, k in zip(got[:3], keys):
        assert g is not None
        np.testing.assert_array_equal(g, expected(k))
    assert got[3] is None  # a hash no block has
    # A client's writes after the commit do not change what kvd keeps (it summarised the
    # committed bytes), and a pool attached without the flag refuses.
    plain = attach(c, "m-sum-plain", summaries=False)
    with pytest.raises(kw.KvdError) as e:
        summaries(c, plain, hashes)
    assert e.value.name == "ENOTSUP" and "Layout.summaries" in e.value.message


def test_summaries_reply_fits_a_frame(kvd_factory):
    """More summaries than one reply frame can hold: ETOOBIG saying how many fit."""
    d = kvd_factory(max_frame_bytes="65536", max_blocks_per_request="1024")
    c = d.connect()
    pool = attach(c, "m-sum-frame")
    per = LAYOUT.num_layers * LAYOUT.num_kv_heads * 3 * LAYOUT.head_dim * 4
    fit = (65536 - 65536 // 4) // per
    hashes = [(i + 1, 7) for i in range(fit + 1)]
    with pytest.raises(kw.KvdError) as e:
        summaries(c, pool, hashes)
    assert e.value.name == "ETOOBIG" and "at most %d hashes" % fit in e.value.message
    assert len(summaries(c, pool, hashes[:fit])) == fit


def test_summaries_pool_has_a_t2_file_of_its_own(kvd_factory):
    """The same model attached with and without summaries is two pools, and each has a T2 file
    of its own (they shared one, each handing out its slots: one pool's records overwrote the
    other's, and Fetches met corrupt_t2). Both pools' blocks come back from T2 intact."""
    d = kvd_factory(**dict(SMALL, tier1_memory="0", tier2_path="{dir}/t2", tier2_bytes="64M",
                           tier_write="write-through", fetch_min_tokens="16"))
    c = d.connect(features=kw.FEATURE_PACKED | kw.FEATURE_TIERS)
    pools = [attach(c, "m-sum-file", summaries=False), attach(c, "m-sum-file")]
    assert pools[0].pool_id != pools[1].pool_id
    chains = []
    for k, pool in enumerate(pools):
        canon, hashes, _ = commit_chain(c, pool, 4, 40 + k)
        c.release(pool.pool_id, canon)
        chains.append(hashes)
    assert wait_until(lambda: d.admin_result("stats")["tiers"]["jobs_inflight"] == 0,
                      timeout=10)
    files = sorted(f for _, _, fs in os.walk(os.path.join(d.dir, "t2")) for f in fs
                   if ".t2" in f)
    assert len(files) == 2 and any("-summaries" in f for f in files), files
    assert d.admin_result("evict all")["evicted"] >= 8
    for pool, hashes in zip(pools, chains):
        fr = c.fetch(pool.pool_id, hashes)
        pool.follow(fr)
        assert len(kw.reply_blocks(fr)) == 4, fr
    assert d.admin_result("stats")["tiers"]["corrupt_t2"] == 0


def test_summaries_survive_demotion_and_promotion(kvd_factory):
    d = kvd_factory(**dict(SMALL, tier1_memory="4M", tier_write="write-through",
                           fetch_min_tokens="16"))
    c = d.connect(features=kw.FEATURE_PACKED | kw.FEATURE_TIERS)
    pool = attach(c, "m-sum-t")
    canon, hashes, keys = commit_chain(c, pool, 4, 7)
    c.release(pool.pool_id, canon)
    before = summaries(c, pool, hashes)
    # Wait for the copies down, then push the blocks out of T0.
    deadline = __import__("time").monotonic() + 10
    while d.admin_result("stats")["tiers"]["jobs_inflight"] != 0:
        assert __import__("time").monotonic() < deadline
    assert d.admin_result("evict all")["evicted"] >= 4
    r = c.lookup(pool.pool_id, hashes)
    assert kw.reply_blocks(r) == [] and r.tier_fetchable == 4
    mid = summaries(c, pool, hashes)  # served from the tier entries
    for a, b in zip(before, mid):
        np.testing.assert_array_equal(a, b)
    fr = c.fetch(pool.pool_id, hashes)
    pool.follow(fr)
    assert len(kw.reply_blocks(fr)) == 4 and fr.promoted == 4
    after = summaries(c, pool, hashes)
    for a, b, k in zip(before, after, keys):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(b, expected(k))


def test_commons_blocks_have_summaries(kvd_factory):
    """A block two tenants committed enters the commons with its page summary (promotions
    committed without one: a third tenant's Summaries of the commons pool came back empty)."""
    toks = {n: ("tok-%s-0123456789abcdef0123456789" % n)[:32] for n in "abc"}
    d = kvd_factory(
        tenants="".join("tenant %s token-file={dir}/%s.token\n" % (n, n) for n in "abc") +
        "commons min-tenants=2\n",
        files={"%s.token" % n: toks[n].encode() for n in "abc"})
    keep = []
    for n in "ab":
        k = kw.Conn(d.sock)
        k.hello(token=toks[n].encode())
        p = attach(k, "m-sum-com")
        _, hashes, keys = commit_chain(k, p, 2, 5)
        keep.append(k)
    k = kw.Conn(d.sock)
    k.hello(token=toks["c"].encode())
    p = attach(k, "m-sum-com")
    (link,) = list(p.attach_reply.linked)
    k.linked_pool(p, link)  # its segments (MapSegments)
    r, _ = k.call("summaries", pb.Summaries(pool_id=link.pool_id,
                                            hashes_packed=kw.pack_hashes(hashes)))
    got = [np.frombuffer(b, np.float32).reshape(LAYOUT.num_layers, LAYOUT.num_kv_heads, 3,
                                                 LAYOUT.head_dim) if b else None
           for b in r.summaries]
    assert all(g is not None for g in got), [g is not None for g in got]
    for g, key in zip(got, keys):
        np.testing.assert_array_equal(g, expected(key))


def test_summaries_isolated_between_tenants(kvd_factory):
    d = kvd_factory(tenants="tenant alice uid=%d\ntenant bob uid=%d\n" % (UID_A, UID_B))
    if os.geteuid() != 0:
        pytest.skip("needs root to run children as other uids")

    def alice(ready_w):
        k = kw.Conn(d.sock)
        k.hello()
        p = attach(k, "m-sum-iso")
        _, hashes, _ = commit_chain(k, p, 2, 3)
        return [s is not None for s in summaries(k, p, hashes)], hashes

    seen, hashes = Child(alice, uid=UID_A).result()
    assert seen == [True, True]

    def bob(ready_w):
        k = kw.Conn(d.sock)
        k.hello()
        p = attach(k, "m-sum-iso")
        return [s is not None for s in summaries(k, p, hashes)]

    assert Child(bob, uid=UID_B).result() == [False, False]
