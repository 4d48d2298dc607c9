"""Lower tiers (PROTOCOL.md §6 Fetch, docs/TIERS.md) against a real kvd: blocks evicted from a
pool come back from tier 1 (host memory) and tier 2 (files) with their bytes intact, in every
stored format; a restart finds tier 2 again; a corrupt or unwritable tier 2 is never served and
never stops the daemon; another tenant never hits a block of someone else's tiers; a client that
dies with a Fetch in flight leaks nothing."""

import os
import time

import pytest

import kvdwire as kw
from conftest import (allocate_blocks as allocate, token_chain as prefix, UID_A,
                      UID_B, Child, new_dir, run_kvd_expecting_refusal, wait_until)
from kvdwire import pb

# 2 layers x 2 heads x 8 dims x 16 tokens fp16: 2048-byte blocks. segment-bytes 64K: 32 blocks
# a segment; pool-memory 160K holds 2 segments (64 blocks) once metadata is counted.
LAYOUT = kw.Layout(2, 2, 8, 16, pb.FP16, pb.LAYER_MAJOR)
T = LAYOUT.tokens_per_block
SMALL = {"pool_memory": "160K", "segment_bytes": "64K"}


def _tiers(**extra):
    o = dict(SMALL)
    o.update({"tier1_memory": "4M", "fetch_min_tokens": "16"})
    o.update(extra)
    return o


def _t2_only(**extra):
    """(t2 directory, options) of a daemon with T2 only (T1 off), write-through, in a directory
    that outlives the daemon (restart tests)."""
    t2dir = os.path.join(new_dir(), "t2")
    opts = dict(SMALL)
    opts.update({"tier1_memory": "0", "tier2_path": t2dir, "tier2_bytes": "64M",
                 "tier_write": "write-through", "fetch_min_tokens": "16"})
    opts.update(extra)
    return t2dir, opts


def _t2_file(t2dir):
    """The one pool file under t2dir (one domain directory, one file)."""
    dom = os.path.join(t2dir, os.listdir(t2dir)[0])
    return os.path.join(dom, os.listdir(dom)[0])


def connect(d):
    return d.connect(features=kw.FEATURE_PACKED | kw.FEATURE_TIERS)


def write_commit_release(conn, pool, hashes, pats):
    """Allocates, writes, commits and releases one chain (so its blocks are cached)."""
    blocks = allocate(conn, pool, len(hashes))
    for (bid, _), p in zip(blocks, pats):
        pool.write_block(bid, p)
    entries, parent = [], kw.NO_PARENT
    for b, h in zip(blocks, hashes):
        entries.append((b, h, parent))
        parent = b[0]
    canon = conn.commit(pool.pool_id, entries)
    conn.release(pool.pool_id, canon)
    return canon


def patterns(pool, hashes):
    return [kw.block_pattern(pool.layout, kw.hash_hex(h)) for h in hashes]


def tier_stats(d):
    return d.admin_result("stats")["tiers"]


def flood(conn, pool, chains, nblocks, base):
    """Commits `chains` chains of nblocks each (different tokens) to push older blocks out."""
    for k in range(chains):
        hs = prefix(pool, nblocks, base + k * 100000)
        write_commit_release(conn, pool, hs, patterns(pool, hs))


def fetch_all(conn, pool, hashes):
    r = conn.fetch(pool.pool_id, hashes)
    pool.follow(r)
    return r, kw.reply_blocks(r)


def check_bytes(pool, blocks, pats):
    for (bid, _), p in zip(blocks, pats):
        assert pool.read_block(bid) == p, "block %d: bytes differ after the round trip" % bid


def settle(d, key="jobs_inflight"):
    wait_until(lambda: tier_stats(d)[key] == 0, timeout=10)


@pytest.mark.parametrize("fmt", ["raw", "lz4", "zstd"])
@pytest.mark.parametrize("write", ["write-through", "write-back"])
def test_demote_promote_round_trip_t1(kvd_factory, fmt, write):
    """A chain evicted from T0 comes back from T1 with every byte as written."""
    d = kvd_factory(**_tiers(tier_format=fmt, tier_write=write, tier_clean_ahead="16"))
    c = connect(d)
    assert c.hello_reply.features & kw.FEATURE_TIERS
    pool = c.attach("m-t1", LAYOUT)
    hs = prefix(pool, 8, 1)
    pats = patterns(pool, hs)
    write_commit_release(c, pool, hs, pats)
    settle(d)
    # Push the chain out of T0 a little at a time, so write-back's copies keep ahead.
    for k in range(12):
        flood(c, pool, 1, 8, 10 + k * 1000)
        settle(d)
    r = c.lookup(pool.pool_id, hs)
    pool.follow(r)
    t0 = kw.reply_blocks(r)
    c.release(pool.pool_id, t0)
    assert len(t0) < 8, "the flood should have evicted part of the chain from T0"
    assert len(t0) + r.tier_fetchable == 8 and r.tier1_hits > 0, r
    fr, blocks = fetch_all(c, pool, hs)
    assert fr.status == pb.FETCH_DONE, fr
    assert len(blocks) == 8 and fr.t0_hits == len(t0), fr
    assert fr.promoted >= 1
    check_bytes(pool, blocks, pats)
    st = tier_stats(d)
    assert st["promotions_t1"] >= fr.promoted and st["demotions_t1"] > 0, st
    assert st["dirty_drops"] == 0 or write == "write-back", st
    # The promoted blocks are ordinary hits now.
    c.release(pool.pool_id, blocks)
    assert len(kw.reply_blocks(c.lookup(pool.pool_id, hs))) == 8


@pytest.mark.parametrize("fmt", ["raw", "zstd"])
def test_t2_round_trip_and_restart(kvd_factory, fmt):
    """With T1 off, evicted blocks go to a T2 file; after the daemon is killed and restarted on
    the same directory, a Fetch brings them back from T2 (new boot epoch, same bytes)."""
    t2dir, opts = _t2_only(tier_format=fmt)
    d = kvd_factory(**opts)
    c = connect(d)
    pool = c.attach("m-t2", LAYOUT)
    hs = prefix(pool, 6, 7)
    pats = patterns(pool, hs)
    write_commit_release(c, pool, hs, pats)
    settle(d)
    st = tier_stats(d)
    assert st["demotions_t2"] >= 6 and st["tier2_blocks"] >= 6, st
    doms = os.listdir(t2dir)
    assert len(doms) == 1 and os.stat(os.path.join(t2dir, doms[0])).st_mode & 0o777 == 0o700
    d.kill()  # SIGKILL: what a crash leaves must be enough
    d2 = kvd_factory(**opts)
    c2 = connect(d2)
    assert c2.hello_reply.boot_epoch != c.hello_reply.boot_epoch
    pool2 = c2.attach("m-t2", LAYOUT)
    r = c2.lookup(pool2.pool_id, hs)
    assert kw.reply_blocks(r) == [] and r.tier_fetchable == 6 and r.tier2_hits == 6, r
    fr, blocks = fetch_all(c2, pool2, hs)
    assert fr.status == pb.FETCH_DONE and len(blocks) == 6 and fr.promoted == 6, fr
    check_bytes(pool2, blocks, pats)
    assert tier_stats(d2)["promotions_t2"] == 6


# Block-major, 8 KiB blocks: each block is one page-aligned piece of the pool's memory.
LAYOUT_BM = kw.Layout(2, 2, 32, 16, pb.FP16, pb.BLOCK_MAJOR)
# Layer-major, 4 KiB pieces (16 tokens x 2 heads x 64 dims fp16): 16 KiB blocks in 4 pieces,
# each whole pages.
LAYOUT_LM4K = kw.Layout(2, 2, 64, 16, pb.FP16, pb.LAYER_MAJOR)


def _uring_usable():
    """Whether a process here may make an io_uring, as kvd's copy threads do for the zero-copy
    path (a kernel without it, io_uring_disabled, or a seccomp profile refuse it)."""
    if os.environ.get("KVD_TIER2_URING") == "off":
        return False
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
    fd = libc.syscall(425, 1, params)  # io_uring_setup(1 entry)
    if fd < 0:
        return False
    os.close(fd)
    return True


@pytest.mark.parametrize("direct", ["true", "false"])
def test_t2_zero_copy_round_trip(kvd_factory, direct):
    """A host pool's raw blocks go to a T2 file (format 2) and come back with no copy
    (tier2_zero_copy counts each write and read), O_DIRECT on or off, and the bytes survive a
    restart: a block-major pool's (one piece a block) and a layer-major pool's whose pieces are
    whole pages (one vectored transfer); a layer-major pool of 512-byte pieces beside them goes
    the copying way. Without io_uring every transfer copies (same bytes)."""
    uring = _uring_usable()
    # on: whatever the page size (auto takes the copying way where T0 is in 4 KiB pages)
    t2dir, opts = _t2_only(tier2_direct=direct, pool_memory="512K", tier2_zero_copy="on")
    d = kvd_factory(**opts)
    c = connect(d)
    chains = []
    for model, lay, n, zc in (("m-zc", LAYOUT_BM, 6, 6), ("m-zc-lm4k", LAYOUT_LM4K, 4, 4),
                              ("m-zc-lm", LAYOUT, 4, 0)):
        pool = c.attach(model, lay)
        hs = prefix(pool, n, 11 + len(chains))
        pats = patterns(pool, hs)
        write_commit_release(c, pool, hs, pats)
        settle(d)
        chains.append((model, lay, hs, pats, zc if uring else 0))
        st = tier_stats(d)
        want = sum(z for _, _, _, _, z in chains)
        assert st["demotions_t2"] == sum(len(x[2]) for x in chains), st
        assert st["tier2_zero_copy"] == want, (model, st)
    d.kill()
    d2 = kvd_factory(**opts)
    c2 = connect(d2)
    want = 0
    for model, lay, hs, pats, zc in chains:
        pool2 = c2.attach(model, lay)
        fr, blocks = fetch_all(c2, pool2, hs)
        assert fr.status == pb.FETCH_DONE and len(blocks) == len(hs) and fr.promoted == len(hs), fr
        check_bytes(pool2, blocks, pats)
        want += zc
        assert tier_stats(d2)["tier2_zero_copy"] == want, (model, tier_stats(d2))


def _shmem_thp():
    try:
        line = open("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read()
    except OSError:
        return "unknown"
    return line[line.find("[") + 1:line.find("]")] if "[" in line else "unknown"


@pytest.mark.parametrize("mode", ["off", "auto"])
def test_t2_zero_copy_off_and_auto(kvd_factory, mode):
    """tier2-zero-copy off: a host pool's raw blocks go to T2 and back through the copying way
    (tier2_zero_copy stays 0) with the same bytes, across a restart. auto: the zero-copy way
    exactly where T0 is in huge pages (the kernel's shmem THP mode grants them), as the tiers'
    state line says."""
    huge = _shmem_thp() in ("advise", "within_size", "always", "force")
    zc = mode == "auto" and huge and _uring_usable()
    t2dir, opts = _t2_only(tier2_zero_copy=mode)
    d = kvd_factory(**opts)
    state = d.admin_result("tiers")["state"]
    assert ("zero-copy on" if mode == "auto" and huge else "zero-copy off") in state, state
    c = connect(d)
    pool = c.attach("m-zc-" + mode, LAYOUT_BM)
    hs = prefix(pool, 6, 41)
    pats = patterns(pool, hs)
    write_commit_release(c, pool, hs, pats)
    settle(d)
    st = tier_stats(d)
    assert st["demotions_t2"] == len(hs), st
    assert st["tier2_zero_copy"] == (len(hs) if zc else 0), st
    d.kill()
    d2 = kvd_factory(**opts)
    c2 = connect(d2)
    pool2 = c2.attach("m-zc-" + mode, LAYOUT_BM)
    fr, blocks = fetch_all(c2, pool2, hs)
    assert fr.status == pb.FETCH_DONE and len(blocks) == len(hs) and fr.promoted == len(hs), fr
    check_bytes(pool2, blocks, pats)
    assert tier_stats(d2)["tier2_zero_copy"] == (len(hs) if zc else 0), tier_stats(d2)


def test_t2_corrupt_record_never_served(kvd_factory):
    """A T2 record whose bytes changed on disk fails its check: the Fetch returns the run up to
    it (FETCH_PARTIAL, ECORRUPT), the record is dropped and counted, and the daemon serves on."""
    t2dir, opts = _t2_only(tier2_direct="false")
    d = kvd_factory(**opts)
    c = connect(d)
    pool = c.attach("m-bad", LAYOUT)
    hs = prefix(pool, 4, 3)
    pats = patterns(pool, hs)
    write_commit_release(c, pool, hs, pats)
    settle(d)
    d.kill()
    path = _t2_file(t2dir)
    # Find the record of block 2 (its payload holds pats[2]) and flip one payload byte.
    data = bytearray(open(path, "rb").read())
    at = data.find(pats[2][:64])
    assert at > 0
    data[at + 100] ^= 0xFF
    open(path, "wb").write(bytes(data))
    d2 = kvd_factory(**opts)
    c2 = connect(d2)
    pool2 = c2.attach("m-bad", LAYOUT)
    fr, blocks = fetch_all(c2, pool2, hs)
    assert fr.status == pb.FETCH_PARTIAL and fr.failure == pb.ECORRUPT, fr
    assert len(blocks) == 2, fr
    check_bytes(pool2, blocks, pats[:2])
    st = tier_stats(d2)
    assert st["corrupt_t2"] == 1, st
    c2.release(pool2.pool_id, blocks)
    # The bad record is gone: the run now ends before it without a copy.
    r = c2.lookup(pool2.pool_id, hs)
    assert len(kw.reply_blocks(r)) == 2 and r.tier_fetchable == 0, r
    assert c2.ping().nonce == 0


def test_t2_unusable_keeps_serving(kvd_factory):
    """A tier2-path kvd cannot make its domain directory under (a regular file): tier 2 is off
    for the pool, the admin state says why, and the pool works as a single tier."""
    def setup(tmp):
        open(os.path.join(tmp, "t2"), "w").close()

    opts = dict(SMALL)
    opts.update({"tier1_memory": "0", "tier2_path": "{dir}/t2", "tier2_bytes": "64M",
                 "tier_write": "write-through"})
    d = kvd_factory(setup=setup, **opts)
    c = connect(d)
    pool = c.attach("m-ro", LAYOUT)
    hs = prefix(pool, 3, 1)
    write_commit_release(c, pool, hs, patterns(pool, hs))
    assert len(kw.reply_blocks(c.lookup(pool.pool_id, hs))) == 3
    st = tier_stats(d)
    assert "Not a directory" in st["state"] and st["tier2_blocks"] == 0, st


def test_t2_disk_full_keeps_serving(kvd_factory):
    """tier2-bytes smaller than one slot: nothing can go down, the pool keeps serving from T0,
    and the evictions count as dirty drops."""
    opts = dict(SMALL)
    opts.update({"tier1_memory": "0", "tier2_path": "{dir}/t2", "tier2_bytes": "1K",
                 "tier_write": "write-through"})
    d = kvd_factory(**opts)
    c = connect(d)
    pool = c.attach("m-full", LAYOUT)
    flood(c, pool, 12, 8, 1)
    st = tier_stats(d)
    assert st["tier2_blocks"] == 0 and st["dirty_drops"] > 0, st
    hs = prefix(pool, 2, 99)
    write_commit_release(c, pool, hs, patterns(pool, hs))
    assert len(kw.reply_blocks(c.lookup(pool.pool_id, hs))) == 2


def test_fetch_short_is_not_fetched(kvd_factory):
    """A lower-tier run under fetch-min-tokens is not copied: FETCH_SHORT, only T0 hits."""
    d = kvd_factory(**_tiers(tier_write="write-through", fetch_min_tokens="256"))
    c = connect(d)
    pool = c.attach("m-short", LAYOUT)
    hs = prefix(pool, 4, 5)
    write_commit_release(c, pool, hs, patterns(pool, hs))
    settle(d)
    flood(c, pool, 12, 8, 50)
    fr, blocks = fetch_all(c, pool, hs)
    assert fr.status == pb.FETCH_SHORT and fr.promoted == 0, fr
    assert len(blocks) == fr.t0_hits < 4 and "min_tokens" in fr.message
    # The request's own min_tokens overrides the daemon's.
    c.release(pool.pool_id, blocks)
    fr = c.fetch(pool.pool_id, hs, min_tokens=16)
    assert fr.status == pb.FETCH_DONE and len(kw.reply_blocks(fr)) == 4, fr


def _chain_pushed_down(d, c, pool, key, flood_base):
    """An 8-block chain written, copied down, then partly pushed out of T0 by 12 other chains:
    (its hashes, its patterns, the blocks T0 still holds). A Fetch of it copies up from T1."""
    hs = prefix(pool, 8, key)
    pats = patterns(pool, hs)
    write_commit_release(c, pool, hs, pats)
    settle(d)
    flood(c, pool, 12, 8, flood_base)
    r = c.lookup(pool.pool_id, hs)
    n0 = len(kw.reply_blocks(r))
    c.release(pool.pool_id, kw.reply_blocks(r))
    assert n0 < 8
    return hs, pats, n0


def test_concurrent_fetches_share_one_copy(kvd_factory):
    """Two Fetches of one evicted chain pipelined back to back: both get all blocks, and the
    copies up are made once (the second waits for the first's)."""
    d = kvd_factory(**_tiers(tier_write="write-through"))
    c = connect(d)
    pool = c.attach("m-share", LAYOUT)
    hs, pats, n0 = _chain_pushed_down(d, c, pool, 2, 70)
    a = c.send("fetch", c.fetch_msg(pool.pool_id, hs))
    b = c.send("fetch", c.fetch_msg(pool.pool_id, hs))
    p = c.send("ping", pb.Ping(nonce=5))
    got = {}
    for _ in range(3):
        which, body, _ = c.recv()
        got[body.DESCRIPTOR.name] = got.get(body.DESCRIPTOR.name, []) + [body]
    assert len(got["FetchReply"]) == 2 and len(got["Pong"]) == 1
    for fr in got["FetchReply"]:
        pool.follow(fr)
        assert fr.status == pb.FETCH_DONE and len(kw.reply_blocks(fr)) == 8, fr
        check_bytes(pool, kw.reply_blocks(fr), pats)
    st = tier_stats(d)
    assert st["promotions_t1"] == 8 - n0, st  # each block copied up once
    del a, b, p


def test_deferred_reply_among_pipelined_requests(kvd_factory):
    """A Fetch whose reply waits for its copies up, followed in the same write by 30 Pings, with
    max-inflight 1: the Pings are answered in order while the Fetch waits (a deferred reply
    holds no place in flow control), and its reply, written at the end of the loop iteration in
    which its copies landed (server.c on_later_check), comes with every byte; the connection
    goes on serving."""
    d = kvd_factory(max_inflight="1", **_tiers(tier_write="write-through"))
    c = connect(d)
    pool = c.attach("m-later", LAYOUT)
    hs, pats, _ = _chain_pushed_down(d, c, pool, 3, 90)
    fenv = c.envelope("fetch", c.fetch_msg(pool.pool_id, hs))
    pings = [c.envelope("ping", pb.Ping(nonce=i)) for i in range(30)]
    c.send_raw(b"".join(c.frame(e.SerializeToString()) for e in [fenv] + pings))
    fr, nonces = None, []
    for _ in range(31):
        env, _ = c.recv_frame()  # (the socket times out: a stall fails here)
        if env.id == fenv.id:
            fr = env.fetch_reply
        else:
            nonces.append(env.pong.nonce)
    assert nonces == list(range(30))
    pool.follow(fr)
    assert fr.status == pb.FETCH_DONE and len(kw.reply_blocks(fr)) == 8, fr
    check_bytes(pool, kw.reply_blocks(fr), pats)
    assert c.ping(nonce=99).nonce == 99


def test_fetch_client_dies_mid_flight_leaks_nothing(kvd_factory):
    """A client that sends a Fetch and exits at once: the fetched blocks end up cached (no
    reference, no WRITING block left), and the next client hits them in T0."""
    d = kvd_factory(**_tiers(tier_write="write-through"))
    c = connect(d)
    pool = c.attach("m-die", LAYOUT)
    hs = prefix(pool, 8, 4)
    pats = patterns(pool, hs)
    write_commit_release(c, pool, hs, pats)
    settle(d)
    flood(c, pool, 12, 8, 90)

    def dier(ready_w):
        k = kw.Conn(d.sock)
        k.hello(features=kw.FEATURE_PACKED | kw.FEATURE_TIERS)
        p = k.attach("m-die", LAYOUT)
        k.send("fetch", k.fetch_msg(p.pool_id, hs))
        return 1  # the process exits with the Fetch unanswered: its connection closes

    Child(dier).result()
    settle(d)

    def back():
        s = c.stats(pool.pool_id)
        return s["pool.blocks_writing"] == 0 and s["pool.blocks_committed"] == 0

    wait_until(back, timeout=10)
    r = c.lookup(pool.pool_id, hs)
    pool.follow(r)
    blocks = kw.reply_blocks(r)
    assert len(blocks) == 8
    check_bytes(pool, blocks, pats)


def test_tiers_isolated_between_tenants(kvd_factory):
    """Tenant B never sees tenant A's demoted blocks: B's Lookup reports no lower-tier run and
    B's Fetch copies nothing, for the same model, layout and tokens."""
    d = kvd_factory(tenants="tenant alice uid=%d\ntenant bob uid=%d\n" % (UID_A, UID_B),
                    **_tiers(tier_write="write-through", tier2_path="{dir}/t2",
                             tier2_bytes="64M"))
    if os.geteuid() != 0:
        pytest.skip("needs root to run children as other uids")

    def alice(ready_w, look):
        k = kw.Conn(d.sock)
        k.hello(features=kw.FEATURE_PACKED | kw.FEATURE_TIERS)
        p = k.attach("m-iso", LAYOUT)
        hs = prefix(p, 4, 1)
        if not look:
            write_commit_release(k, p, hs, patterns(p, hs))
            return 0
        r = k.lookup(p.pool_id, hs)
        return len(kw.reply_blocks(r)), r.tier_fetchable

    Child(alice, False, uid=UID_A).result()
    settle(d)
    assert d.admin_result("evict all")["evicted"] >= 4
    assert Child(alice, True, uid=UID_A).result() == (0, 4)

    def bob(ready_w):
        k = kw.Conn(d.sock)
        k.hello(features=kw.FEATURE_PACKED | kw.FEATURE_TIERS)
        p = k.attach("m-iso", LAYOUT)
        hs = prefix(p, 4, 1)
        r = k.lookup(p.pool_id, hs)
        fr = k.fetch(p.pool_id, hs, min_tokens=16)
        return len(kw.reply_blocks(r)), r.tier_fetchable, fr.promoted, len(kw.reply_blocks(fr))

    assert Child(bob, uid=UID_B).result() == (0, 0, 0, 0)


def test_old_client_sees_t0_only(kvd_factory):
    """A client that did not ask for FEATURE_TIERS gets Lookup replies without tier fields."""
    d = kvd_factory(**_tiers(tier_write="write-through"))
    c = d.connect()  # features = PACKED only
    pool = c.attach("m-old", LAYOUT)
    hs = prefix(pool, 4, 8)
    write_commit_release(c, pool, hs, patterns(pool, hs))
    settle(d)
    flood(c, pool, 12, 8, 300)
    r = c.lookup(pool.pool_id, hs)
    assert r.tier_fetchable == 0 and r.tier1_hits == 0


def test_t1_outlives_the_sessions(kvd_factory):
    """A pool whose T0 is empty and that no session uses stays while its tier 1 holds blocks
    (they are its cache): the next session's Fetch finds them."""
    d = kvd_factory(**_tiers(tier_write="write-through"))
    c = connect(d)
    pool = c.attach("m-outlive", LAYOUT)
    hs = prefix(pool, 4, 11)
    pats = patterns(pool, hs)
    write_commit_release(c, pool, hs, pats)
    settle(d)
    c.close()
    assert d.admin_result("evict all")["evicted"] >= 4
    c2 = connect(d)
    pool2 = c2.attach("m-outlive", LAYOUT)
    fr, blocks = fetch_all(c2, pool2, hs)
    assert fr.status == pb.FETCH_DONE and fr.promoted == 4, fr
    check_bytes(pool2, blocks, pats)


def test_selftest_isolation_covers_tiers(kvd_factory):
    """admin `selftest isolation` on a tiered daemon checks tier 1 and tier 2 too."""
    d = kvd_factory(**_tiers(tier2_path=os.path.join(new_dir(), "t2"), tier2_bytes="64M"))
    r = d.admin_result("selftest isolation")
    assert r["passed"], r
    lines = "\n".join(r["checks"])
    assert "tier 1: selftest:a's evicted blocks are found below T0 by a (2 of 2)" in lines, lines
    assert "tier 1: selftest:b's pool finds none of them (0 of 2 below T0)" in lines, lines
    assert "tier 2: each domain has its own directory and file" in lines, lines
    # The self-test's pools are gone again, and it made no tier-2 file.
    assert tier_stats(d)["tier1_blocks"] == 0


def test_sigterm_with_fetch_in_flight(kvd_factory):
    """kvd stopped (SIGTERM) while Fetches of large blocks are copying: it exits 0 (the copies
    finish or are dropped before the memory goes), and a restart on the same tier-2 files serves
    only intact records."""
    big = kw.Layout(16, 8, 128, 16, pb.FP16, pb.BLOCK_MAJOR)  # 1 MiB blocks
    t2dir = os.path.join(new_dir(), "t2")
    opts = {"pool_memory": "64M", "segment_bytes": "8M", "tier1_memory": "0",
            "tier2_path": t2dir, "tier2_bytes": "256M", "tier_write": "write-through",
            "fetch_min_tokens": "16", "tier2_direct": "false"}
    d = kvd_factory(**opts)
    c = connect(d)
    pool = c.attach("m-term", big)
    hs = prefix(pool, 24, 3)
    pats = [kw.block_pattern(big, kw.hash_hex(h)) for h in hs]
    write_commit_release(c, pool, hs, pats)
    settle(d)
    d.admin_result("evict all")
    for _ in range(3):
        c.send("fetch", c.fetch_msg(pool.pool_id, hs))
    time.sleep(0.002)
    d.proc.send_signal(15)
    assert d.proc.wait(timeout=20) == 0, d.read_log()[-2000:]
    d.killed = True
    d2 = kvd_factory(**opts)
    c2 = connect(d2)
    pool2 = c2.attach("m-term", big)
    fr, blocks = fetch_all(c2, pool2, hs)
    assert fr.status == pb.FETCH_DONE and len(blocks) == 24, fr
    check_bytes(pool2, blocks, pats)


def _fp16_pattern(lay, key):
    """block_bytes of fp16 values in [-4, 4) from key (a quantization test needs numbers)."""
    import numpy as np
    rng = np.random.default_rng(abs(hash(key)) % (1 << 32))
    return (rng.random(lay.block_bytes // 2, dtype=np.float32) * 8 - 4).astype(np.float16)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_lossy_tiers_round_trip_within_bound(kvd_factory, fmt):
    """A pool whose layout asked for lossy tiers gets its blocks back quantized: every element
    within the format's step of its (layer, K|V, head) group; a client of the same model and
    shape that did not ask has another pool and never sees them."""
    import numpy as np
    d = kvd_factory(**_tiers(tier_write="write-through", tier_lossy_format=fmt))
    c = connect(d)
    pool = c.attach("m-lossy", LAYOUT, lossy_tiers=True)
    assert pool.attach_reply.layout.lossy_tiers
    hs = prefix(pool, 6, 21)
    vals = [_fp16_pattern(LAYOUT, kw.hash_hex(h)) for h in hs]
    write_commit_release(c, pool, hs, [v.tobytes() for v in vals])
    settle(d)
    assert d.admin_result("evict all")["evicted"] >= 6
    st = tier_stats(d)
    assert st["tier1_bytes"] < 6 * LAYOUT.block_bytes, st  # stored smaller than the blocks
    fr, blocks = fetch_all(c, pool, hs)
    assert fr.status == pb.FETCH_DONE and fr.promoted == 6, fr
    t, h, dim = LAYOUT.tokens_per_block, LAYOUT.num_kv_heads, LAYOUT.head_dim
    qmax = 127.0 if fmt == "int8" else 448.0
    for (bid, _), v in zip(blocks, vals):
        got = np.frombuffer(pool.read_block(bid), dtype=np.float16).astype(np.float32)
        want = v.astype(np.float32)
        assert not np.array_equal(got, want) or fmt == "fp8"  # lossy, yet close:
        # block_runs order: per layer K then V, each [tokens][heads][dim]
        g = want.reshape(LAYOUT.num_layers * 2, t, h, dim)
        gg = got.reshape(g.shape)
        amax = np.abs(g).max(axis=(1, 3), keepdims=True)
        step = amax / qmax
        bound = (step / 2 if fmt == "int8" else np.abs(g) / 16 + step) + np.abs(g) / 1024 + 1e-6
        assert (np.abs(g - gg) <= bound).all(), float(np.abs(g - gg).max())
    c.release(pool.pool_id, blocks)
    # The same model and shape without the flag: another pool, nothing of the lossy one.
    c2 = connect(d)
    plain = c2.attach("m-lossy", LAYOUT)
    assert plain.pool_id != pool.pool_id and not plain.attach_reply.layout.lossy_tiers
    r = c2.lookup(plain.pool_id, hs)
    assert kw.reply_blocks(r) == [] and r.tier_fetchable == 0, r


def test_admin_pools_show_each_pool_tiers(kvd_factory):
    """admin `pools` gives each pool's lower-tier blocks and bytes and its storage format."""
    d = kvd_factory(**_tiers(tier_write="write-through", tier_format="zstd"))
    c = connect(d)
    pool = c.attach("m-adminp", LAYOUT)
    lossy = c.attach("m-adminp", LAYOUT, lossy_tiers=True)
    hs = prefix(pool, 3, 5)
    write_commit_release(c, pool, hs, patterns(pool, hs))
    settle(d)
    by_id = {p["id"]: p["tiers"] for p in d.admin_result("pools")["pools"]}
    assert by_id[pool.pool_id]["tier1_blocks"] == 3 and by_id[pool.pool_id]["format"] == 2
    assert by_id[pool.pool_id]["lossy"] is False
    assert by_id[lossy.pool_id]["lossy"] is True and by_id[lossy.pool_id]["format"] == 3


def test_tier1_fair_share_between_pools(kvd_factory):
    """One pool filling tier 1 cannot keep another out: the second pool's blocks land in T1 by
    taking the first pool's oldest entries while it is over its share (budget / pools)."""
    d = kvd_factory(pool_memory="1M", segment_bytes="64K", tier1_memory=str(64 * 2048),
                    tier_write="write-through", fetch_min_tokens="16")
    c = connect(d)
    a = c.attach("m-fair-a", LAYOUT)
    b = c.attach("m-fair-b", LAYOUT)
    for k in range(25):  # 200 blocks through a T1 of 64
        hs = prefix(a, 8, 1000 * (k + 1))
        write_commit_release(c, a, hs, patterns(a, hs))
        settle(d)
    tiers = {p["id"]: p["tiers"] for p in d.admin_result("pools")["pools"]}
    assert tiers[a.pool_id]["tier1_blocks"] >= 60, tiers
    hs = prefix(b, 10, 7)
    write_commit_release(c, b, hs, patterns(b, hs))
    settle(d)
    tiers = {p["id"]: p["tiers"] for p in d.admin_result("pools")["pools"]}
    assert tiers[b.pool_id]["tier1_blocks"] == 10, tiers
    assert tiers[a.pool_id]["tier1_blocks"] <= 54, tiers


def test_admin_tiers_per_pool_policy(kvd_factory):
    """admin `tiers pool=ID write=write-through` gives one pool its own write mode (its commits
    go down at once) while the other keeps the daemon's write-back; `default` undoes it; bad
    settings and unknown pools are refused."""
    d = kvd_factory(**_tiers(tier_write="write-back"))
    c = connect(d)
    a = c.attach("m-pol-a", LAYOUT)
    b = c.attach("m-pol-b", LAYOUT)
    r = d.admin_result("tiers pool=%d write=write-through" % a.pool_id)
    assert r["pools"][0]["write"] == "write-through" and r["pools"][0]["own_settings"] is True
    for p, base in ((a, 1), (b, 2)):
        hs = prefix(p, 3, base)
        write_commit_release(c, p, hs, patterns(p, hs))
    settle(d)
    tiers = {p["pool"]: p for p in d.admin_result("tiers")["pools"]}
    assert tiers[a.pool_id]["tier1_blocks"] == 3, tiers  # written through
    assert tiers[b.pool_id]["tier1_blocks"] == 0, tiers  # write-back: nothing under pressure
    assert tiers[b.pool_id]["write"] == "write-back" and not tiers[b.pool_id]["own_settings"]
    r = d.admin_result("tiers pool=%d write=default min-hits=2" % a.pool_id)
    assert r["pools"][0]["write"] == "write-back" and r["pools"][0]["min_hits"] == 2
    for bad in ("tiers pool=%d write=sideways" % a.pool_id, "tiers pool=%d speed=9" % a.pool_id,
                "tiers pool=%d clean-ahead=0" % a.pool_id, "tiers write=write-back",
                "tiers pool=999"):
        assert not d.admin(bad)["ok"], bad


def test_tenants_file_tiers_lines(kvd_factory):
    """`tiers` lines of the tenants file give the pools they match their own policy when the
    pool is made: the first matching line wins (model m-rule-a: write-through, its commits go
    down at once; any other model of tenant `me`: clean-ahead 7, still write-back); admin shows
    them as the pool's own settings, and `default` still goes back to the daemon's option."""
    me = os.geteuid()
    tenants = ("tenant me uid=%d\n"
               "tiers model=m-rule-a domains=me write=write-through min-hits=0\n"
               "tiers domains=me clean-ahead=7\n"
               "tiers model=m-rule-a clean-ahead=9\n" % me)
    d = kvd_factory(tenants=tenants, **_tiers(tier_write="write-back"))
    c = connect(d)
    a = c.attach("m-rule-a", LAYOUT)
    b = c.attach("m-rule-b", LAYOUT)
    for p, base in ((a, 1), (b, 2)):
        hs = prefix(p, 3, base)
        write_commit_release(c, p, hs, patterns(p, hs))
    settle(d)
    tiers = {p["pool"]: p for p in d.admin_result("tiers")["pools"]}
    ta, tb = tiers[a.pool_id], tiers[b.pool_id]
    assert ta["write"] == "write-through" and ta["min_hits"] == 0 and ta["own_settings"], ta
    assert ta["tier1_blocks"] == 3, ta  # written through
    assert tb["write"] == "write-back" and tb["clean_ahead"] == 7 and tb["own_settings"], tb
    assert tb["tier1_blocks"] == 0, tb
    r = d.admin_result("tiers pool=%d write=default" % a.pool_id)
    assert r["pools"][0]["write"] == "write-back", r


BAD_TIERS_LINES = {
    "no_setting": ("tiers model=m\n", "at least one setting"),
    "bad_write": ("tiers write=sideways\n", "bad value 'sideways' for write"),
    "unknown_domain": ("tiers domains=nosuch write=write-back\n", "domain 'nosuch'"),
    "zero_clean_ahead": ("tiers clean-ahead=0\n", "bad value '0' for clean-ahead"),
    "unknown_key": ("tiers speed=9\n", "unknown 'speed'"),
    "twice": ("tiers min-hits=1 min-hits=2\n", "min-hits given twice"),
}


@pytest.mark.parametrize("case", sorted(BAD_TIERS_LINES))
def test_bad_tiers_line_is_refused(case):
    """A bad `tiers` line stops kvd at start, naming the line and what is wrong."""
    text, contains = BAD_TIERS_LINES[case]

    def setup(tmp):
        with open(os.path.join(tmp, "tenants"), "w") as f:
            f.write(text)
    rc, out = run_kvd_expecting_refusal({"tenants_file": "{dir}/tenants", "tier1_memory": "4M"},
                                        setup=setup)
    assert rc not in (None, 0), "kvd served with %r: %s" % (text, out)
    assert contains in out and "tenants:1" in out, out


BIG = kw.Layout(32, 8, 128, 16, pb.FP16, pb.BLOCK_MAJOR)  # 2 MiB blocks: copies take a while


def _wait_daemon(kvd_factory):
    """A daemon whose pool of BIG blocks is one 16-block segment, write-through to T1."""
    return kvd_factory(pool_memory="40M", segment_bytes="32M", tier1_memory="256M",
                       tier_write="write-through", fetch_min_tokens="16")


def _blocks_total(d, c, pool):
    """The pool's blocks once its first segment is there (an Allocate of 1 makes it; released)."""
    r = c.allocate(pool.pool_id, 1)
    pool.follow(r)
    c.release(pool.pool_id, kw.reply_blocks(r))
    return [p for p in d.admin_result("pools")["pools"] if p["id"] == pool.pool_id][0][
        "blocks_total"]


def _commit_all(c, pool, blocks, base):
    hs = prefix(pool, len(blocks), base)
    entries, parent = [], kw.NO_PARENT
    for b, h in zip(blocks, hs):
        entries.append((b, h, parent))
        parent = b[0]
    return c.commit(pool.pool_id, entries)


def test_allocate_waits_for_copies_down(kvd_factory):
    """write-through in a full pool: the blocks whose copies down are in flight are leased
    (neither free nor evictable), so an Allocate of the whole pool right after a burst of
    commits used to meet ENOSPC until the copies landed (tests retried it). Now it waits for
    them and gets its blocks: 8 rounds of Allocate(all) + Commit + Release, no retry, every
    Allocate answered with the blocks; alloc_waits counts the ones that waited."""
    d = _wait_daemon(kvd_factory)
    c = connect(d)
    pool = c.attach("m-wait", BIG)
    n = _blocks_total(d, c, pool)
    assert n >= 8, n
    for k in range(8):
        r = c.allocate(pool.pool_id, n)  # no retry: ENOSPC here is the bug
        pool.follow(r)
        blocks = kw.reply_blocks(r)
        assert len(blocks) == n
        canon = _commit_all(c, pool, blocks, 1000 * (k + 1))
        c.release(pool.pool_id, canon)
    st = tier_stats(d)
    assert st["alloc_waits"] >= 1, st  # at least one of them met the copies in flight
    assert st["demotions_t1"] >= 8 * n - n, st
    # A waiting Allocate is retried once the landing copy's block is in T1: it evicts blocks
    # with a copy below (it ran before the landing was recorded, counting the block dirty).
    assert st["dirty_drops"] == 0, st
    assert d.alive()


def test_allocate_waiting_in_a_pool_detached_and_attached_again(kvd_factory):
    """An Allocate in a group pool that waits for copies down, then, pipelined behind it,
    DetachPool of that pool and an AttachPool that links it again (nothing of it sent to the
    session yet): the waiting Allocate answers ESTATE when room comes, not blocks of an attach
    it was not made in (kvd handed out blocks in segments the session was never sent, or
    aborted on that check in a debug build). Fresh sessions, 6 rounds."""
    d = kvd_factory(pool_memory="80M", segment_bytes="32M", tier1_memory="256M",
                    tier_write="write-through", fetch_min_tokens="16",
                    tenants="tenant alice uid=%d\ngroup g members=alice\n" % os.geteuid())
    # One segment for the private pool (a block held in it: not idle, not parked) and one for
    # the group's: an Allocate that meets leased blocks waits instead of growing a segment.
    c0 = connect(d)
    p0 = c0.attach("m-wait-g", BIG)
    allocate(c0, p0, 1)
    waited = 0
    for k in range(6):
        c = connect(d)
        pool = c.attach("m-wait-g", BIG)
        (link,) = list(pool.attach_reply.linked)
        g = c.linked_pool(pool, link)
        n = _blocks_total(d, c, g)
        r = c.allocate(g.pool_id, n)
        g.follow(r)
        canon = _commit_all(c, g, kw.reply_blocks(r), 9000 * (k + 1))
        c.release(g.pool_id, canon)
        aid = c.send("allocate", pb.Allocate(pool_id=g.pool_id, count=n))
        did = c.send("detach_pool", pb.DetachPool(pool_id=g.pool_id))
        tid = c.send("attach_pool", pb.AttachPool(model_id="m-wait-g", layout=BIG.to_pb()))
        got = {}
        while len(got) < 3:
            env, fds = c.recv_frame()
            for fd in fds:
                os.close(fd)
            got[env.id] = env
        assert got[did].WhichOneof("body") == "detach_pool_reply", got[did]
        assert got[tid].WhichOneof("body") == "attach_pool_reply", got[tid]
        a = got[aid]
        if a.WhichOneof("body") == "error":  # it waited: the pool's attach changed meanwhile
            assert a.error.code == pb.ESTATE and "detached" in a.error.message, a
            waited += 1
        else:
            assert a.WhichOneof("body") == "allocate_reply", a
        c.close()
    assert waited >= 1, "no Allocate waited for the copies in 6 rounds"
    assert d.alive()


def test_waiting_allocate_gives_up_when_copies_end(kvd_factory):
    """The pool full of blocks the session itself holds: an Allocate right after their commit
    (whose copies may still be in flight: then it waits for them) gets ENOSPC within seconds,
    and kvd keeps serving."""
    d = _wait_daemon(kvd_factory)
    c = connect(d)
    pool = c.attach("m-wait-full", BIG)
    n = _blocks_total(d, c, pool)
    r = c.allocate(pool.pool_id, n)
    pool.follow(r)
    held = kw.reply_blocks(r)
    _commit_all(c, pool, held, 5000)  # the session keeps holding all of them
    t = time.monotonic()
    with pytest.raises(kw.KvdError) as e:
        c.allocate(pool.pool_id, 1)
    assert e.value.code == pb.ENOSPC, e.value
    assert time.monotonic() - t < 5.0
    assert c.ping(nonce=3).nonce == 3


def test_session_dies_while_its_allocate_waits(kvd_factory):
    """A session that closes while its Allocate waits for copies: kvd drops the wait, loses
    no block (the pool's blocks are all free or cached again) and keeps serving."""
    d = _wait_daemon(kvd_factory)
    c = connect(d)
    pool = c.attach("m-wait-die", BIG)
    n = _blocks_total(d, c, pool)
    for k in range(4):
        c2 = connect(d)
        p2 = c2.attach("m-wait-die", BIG)
        r = c2.allocate(p2.pool_id, n)
        p2.follow(r)
        canon = _commit_all(c2, p2, kw.reply_blocks(r), 7000 * (k + 1))
        c2.release(p2.pool_id, canon)
        c2.send("allocate", pb.Allocate(pool_id=p2.pool_id, count=n))
        c2.close()  # gone before (or while) the Allocate waits
    settle(d)
    assert wait_until(lambda: [p for p in d.admin_result("pools")["pools"]
                               if p["id"] == pool.pool_id][0]["blocks_writing"] == 0)
    r = c.allocate(pool.pool_id, n)
    pool.follow(r)
    assert len(kw.reply_blocks(r)) == n
    assert d.alive()


def test_t2_file_truncated_under_the_daemon(kvd_factory):
    """The tier-2 file cut short while kvd runs (a disk that lost data): every record past the
    cut fails its read, is dropped and counted, the Fetch ends before it, and kvd keeps serving
    and writing."""
    t2dir, opts = _t2_only(tier2_direct="false")
    d = kvd_factory(**opts)
    c = connect(d)
    pool = c.attach("m-trunc", LAYOUT)
    hs = prefix(pool, 5, 13)
    pats = patterns(pool, hs)
    write_commit_release(c, pool, hs, pats)
    settle(d)
    path = _t2_file(t2dir)
    os.truncate(path, 4096)  # the header only: every slot is gone
    assert d.admin_result("evict all")["evicted"] >= 5
    fr, blocks = fetch_all(c, pool, hs)
    assert fr.status == pb.FETCH_PARTIAL and fr.failure == pb.ECORRUPT and blocks == [], fr
    st = tier_stats(d)
    assert st["corrupt_t2"] >= 1, st
    # Still serving, and tier 2 takes new blocks again.
    hs2 = prefix(pool, 3, 77)
    pats2 = patterns(pool, hs2)
    write_commit_release(c, pool, hs2, pats2)
    settle(d)
    assert d.admin_result("evict all")["evicted"] >= 3
    fr, blocks = fetch_all(c, pool, hs2)
    assert fr.status == pb.FETCH_DONE and len(blocks) == 3, fr
    check_bytes(pool, blocks, pats2)


def test_lossy_tiny_layout_stays_lossless(kvd_factory):
    """A block so small that its scales would outweigh its elements is stored losslessly even
    in a pool that asked for lossy tiers (nothing overruns its buffer)."""
    tiny = kw.Layout(1, 1, 1, 1, pb.FP16, pb.LAYER_MAJOR)  # 4-byte blocks
    d = kvd_factory(**_tiers(tier_write="write-through", fetch_min_tokens="1",
                             segment_bytes="4K"))
    c = connect(d)
    pool = c.attach("m-tiny", tiny, lossy_tiers=True)
    hs = kw.hash_chain(pool.hash_seed, list(range(6)), 1, b"", pool.hash_algo)
    pats = [kw.block_pattern(tiny, kw.hash_hex(h)) for h in hs]
    write_commit_release(c, pool, hs, pats)
    settle(d)
    fmt = {p["id"]: p["tiers"]["format"] for p in d.admin_result("pools")["pools"]}
    assert fmt[pool.pool_id] == 0, fmt  # raw
    assert d.admin_result("evict all")["evicted"] >= 6
    fr, blocks = fetch_all(c, pool, hs)
    assert fr.status == pb.FETCH_DONE and len(blocks) == 6, fr
    check_bytes(pool, blocks, pats)


def test_detach_with_fetch_in_flight(kvd_factory):
    """DetachPool while the pool's Fetch is copying: the Fetch is still answered (its FetchReply
    if it finished first, else Error ESTATE), the session holds nothing after, and the daemon
    serves on."""
    big = kw.Layout(16, 8, 128, 16, pb.FP16, pb.BLOCK_MAJOR)  # 1 MiB blocks
    d = kvd_factory(pool_memory="64M", segment_bytes="8M", tier1_memory="64M",
                    tier_write="write-through", fetch_min_tokens="16")
    c = connect(d)
    pool = c.attach("m-detach", big)
    hs = prefix(pool, 16, 9)
    pats = [kw.block_pattern(big, kw.hash_hex(h)) for h in hs]
    write_commit_release(c, pool, hs, pats)
    settle(d)
    d.admin_result("evict all")
    fid = c.send("fetch", c.fetch_msg(pool.pool_id, hs))
    did = c.send("detach_pool", pb.DetachPool(pool_id=pool.pool_id))
    seen = {}
    for _ in range(2):
        try:
            env, _fds = c.recv_frame()
        except kw.KvdError as e:  # pragma: no cover (recv_frame raises only on EOF)
            raise AssertionError(e)
        seen[env.id] = env
    assert set(seen) == {fid, did}
    f = seen[fid]
    assert f.WhichOneof("body") in ("fetch_reply", "error"), f
    if f.WhichOneof("body") == "error":
        assert f.error.code == pb.ESTATE, f
    assert seen[did].WhichOneof("body") == "detach_pool_reply"
    settle(d)
    assert c.stats()["session.refs_held"] == 0
    assert c.ping().nonce == 0


def test_fetch_respects_max_held(kvd_factory):
    """A tenant's max-held caps what a Fetch brings up, as it caps a Lookup's hits."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a child as another uid")
    d = kvd_factory(tenants="tenant alice uid=%d\nquota alice max-held=5\n" % UID_A,
                    **_tiers(tier_write="write-through"))

    def alice(ready_w):
        k = kw.Conn(d.sock)
        k.hello(features=kw.FEATURE_PACKED | kw.FEATURE_TIERS)
        p = k.attach("m-quota", LAYOUT)
        hs = prefix(p, 4, 1)
        write_commit_release(k, p, hs, patterns(p, hs))
        hs2 = prefix(p, 4, 500)
        write_commit_release(k, p, hs2, patterns(p, hs2))
        for _ in range(500):
            if k.stats()["tiers.jobs_inflight"] == 0:
                break
            time.sleep(0.01)
        return kw.hash_hex(hs[0])

    Child(alice, uid=UID_A).result()
    assert d.admin_result("evict all")["evicted"] >= 8

    def alice2(ready_w):
        k = kw.Conn(d.sock)
        k.hello(features=kw.FEATURE_PACKED | kw.FEATURE_TIERS)
        p = k.attach("m-quota", LAYOUT)
        held = [kw.reply_blocks(k.fetch(p.pool_id, prefix(p, 4, 500), min_tokens=16))]
        fr = k.fetch(p.pool_id, prefix(p, 4, 1), min_tokens=16)
        return len(held[0]), len(kw.reply_blocks(fr)), k.stats()["session.refs_held"]

    first, second, refs = Child(alice2, uid=UID_A).result()
    assert first == 4 and second == 1 and refs == 5, (first, second, refs)


def test_t2_restart_reuses_bad_slots(kvd_factory):
    """After a restart, a slot whose record failed its check is reused before the file grows
    (a file with bad or empty slots does not grow at every restart)."""
    t2dir, opts = _t2_only(tier2_direct="false")
    d = kvd_factory(**opts)
    c = connect(d)
    pool = c.attach("m-holes", LAYOUT)
    hs = prefix(pool, 4, 31)
    write_commit_release(c, pool, hs, patterns(pool, hs))
    settle(d)
    d.kill()
    path = _t2_file(t2dir)
    size = os.path.getsize(path)  # 4 slots, or more: the file grows ahead of its writes
    with open(path, "rb") as f:
        slot = int.from_bytes(f.read(24)[16:24], "little")  # the file header's slot_bytes
    assert size >= 4096 + 4 * slot
    with open(path, "r+b") as f:  # slot 1's record header: its checksum fails at the scan
        f.seek(4096 + slot + 10)
        b = f.read(1)
        f.seek(4096 + slot + 10)
        f.write(bytes([b[0] ^ 0xFF]))
    d2 = kvd_factory(**opts)
    c2 = connect(d2)
    pool2 = c2.attach("m-holes", LAYOUT)
    hs2 = prefix(pool2, 1, 900)
    write_commit_release(c2, pool2, hs2, patterns(pool2, hs2))
    settle(d2)
    assert tier_stats(d2)["tier2_blocks"] == 4  # 3 survivors + the new one
    assert os.path.getsize(path) == size
    with open(path, "rb") as f:  # the new record went into the bad slot
        f.seek(4096 + slot + 10)
        assert f.read(1) != bytes([b[0] ^ 0xFF])


def test_prefix_score(kvd_factory):
    """Admin prefix-score (a router's question): per tier how many leading blocks of a prefix
    the node holds, without counting a lookup; a hash nobody has ends the prefix."""
    d = kvd_factory(**_tiers(tier_write="write-through"))
    c = connect(d)
    pool = c.attach("m-score", LAYOUT)
    hs = prefix(pool, 6, 3)
    write_commit_release(c, pool, hs, patterns(pool, hs))
    settle(d)
    hexes = " ".join(kw.hash_hex(h) for h in hs)
    queries = c.stats(pool.pool_id)["pool.queries"]
    r = d.admin_result("prefix-score pool=%d %s" % (pool.pool_id, hexes))
    assert (r["t0"], r["below"], r["prefix"], r["asked"]) == (6, 0, 6, 6)
    assert d.admin_result("evict all")["evicted"] >= 6
    r = d.admin_result("prefix-score pool=%d %s" % (pool.pool_id, hexes))
    assert (r["t0"], r["below"], r["t1"], r["prefix"]) == (0, 6, 6, 6)
    # A hash nobody has, third: the prefix ends before it.
    other = kw.hash_hex(prefix(pool, 1, 999)[0])
    mixed = " ".join([kw.hash_hex(hs[0]), kw.hash_hex(hs[1]), other, kw.hash_hex(hs[3])])
    r = d.admin_result("prefix-score pool=%d %s" % (pool.pool_id, mixed))
    assert r["prefix"] == 2
    assert c.stats(pool.pool_id)["pool.queries"] == queries  # no lookup counted
    for bad in ("prefix-score pool=%d zz" % pool.pool_id, "prefix-score pool=99999 " + other,
                "prefix-score pool=%d" % pool.pool_id):
        r = d.admin(bad)
        assert not r["ok"], r


def _quota_usage(d, tenant):
    return d.admin_result("quota get %s" % tenant)["usage"]


def test_tier_max_keeps_a_tenants_newest(kvd_factory):
    """quota tier-max=4: a tenant's blocks coming down past 4 in a pool's tier 1 take the place
    of its own oldest there (tier_quota_drops counts them; age in a tier counts from arrival,
    and the 10 copies run on 4 threads); the 4 left come back with their bytes; `quota get`
    shows the usage; set live to 0 (no limit), the tenant's tier 1 grows again."""
    d = kvd_factory(tenants="quota default tier-max=4\n", **_tiers(tier_write="write-through"))
    c = connect(d)
    pool = c.attach("m-tmax", LAYOUT)
    hs = prefix(pool, 10, 21)
    pats = patterns(pool, hs)
    write_commit_release(c, pool, hs, pats)
    settle(d)
    st = tier_stats(d)
    assert st["tier1_blocks"] == 4 and st["tier_quota_drops"] == 6, st
    tenant = "uid-%d" % os.geteuid()
    assert _quota_usage(d, tenant)["tier1"] == 4
    assert d.admin_result("quota get %s" % tenant)["quota"]["tier-max"] == 4
    # T0 evicted: exactly four of the blocks are found below it, each with its bytes.
    assert d.admin_result("evict all")["evicted"] >= 10
    kept = [i for i in range(10) if c.lookup(pool.pool_id, [hs[i]]).tier1_hits == 1]
    assert len(kept) == 4, kept
    for i in kept:
        fr, blocks = fetch_all(c, pool, [hs[i]])
        assert len(blocks) == 1 and fr.promoted == 1, fr
        check_bytes(pool, blocks, [pats[i]])
        c.release(pool.pool_id, blocks)
    d.admin_result("quota set default tier-max 0")
    hs2 = prefix(pool, 10, 22)
    write_commit_release(c, pool, hs2, patterns(pool, hs2))
    settle(d)
    assert tier_stats(d)["tier1_blocks"] == 14, tier_stats(d)
    assert _quota_usage(d, tenant)["tier1"] == 14


def _group_writer(d, model):
    """A Child function: a member of group `team` writes n blocks (32 a request) into the group
    pool of `model`, chains from base."""
    def member(ready_w, n, base):
        k = kw.Conn(d.sock)
        k.hello(features=kw.FEATURE_PACKED | kw.FEATURE_TIERS)
        mine = k.attach(model, LAYOUT)
        group = k.linked_pool(mine, mine.attach_reply.linked[0])
        for part in range(0, n, 32):
            hs = prefix(group, min(32, n - part), base + part * 1000)
            write_commit_release(k, group, hs, patterns(group, hs))
        return 0
    return member


def test_tier_guarantee_holds_in_a_group_pool(kvd_factory):
    """Two tenants write one group pool whose tier 1 holds 32 blocks: alice's 8 blocks stay in
    tier 1 under her tier-guarantee=8 while bob's 64 come down through it (his own oldest make
    the room); with the guarantee set to 0 live, bob's next 64 push hers out (LRU again)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run children as other uids")
    d = kvd_factory(tenants="tenant alice uid=%d\ntenant bob uid=%d\n"
                            "group team members=alice,bob\nquota alice tier-guarantee=8\n"
                            % (UID_A, UID_B),
                    **_tiers(tier_write="write-through", tier1_memory="64K"))
    member = _group_writer(d, "m-tg")

    Child(member, 8, 1, uid=UID_A).result()
    settle(d)
    assert _quota_usage(d, "alice")["tier1"] == 8
    Child(member, 64, 2, uid=UID_B).result()
    settle(d)
    assert _quota_usage(d, "alice")["tier1"] == 8, tier_stats(d)
    assert _quota_usage(d, "bob")["tier1"] == 24, tier_stats(d)  # the rest of the 32
    d.admin_result("quota set alice tier-guarantee 0")
    Child(member, 64, 3, uid=UID_B).result()
    settle(d)
    assert _quota_usage(d, "alice")["tier1"] == 0, tier_stats(d)
    assert _quota_usage(d, "bob")["tier1"] == 32, tier_stats(d)


def test_tier_guarantee_bytes_holds_in_a_group_pool(kvd_factory):
    """The guarantee in bytes: alice's tier-guarantee-bytes of 8 blocks' bytes keeps her 8
    blocks in the group pool's tier 1 (32 blocks) while bob's 64 come down; at 4 blocks' bytes
    (set live) bob's next 64 push her down to 4, not to 0."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run children as other uids")
    bb = LAYOUT.block_bytes
    d = kvd_factory(tenants="tenant alice uid=%d\ntenant bob uid=%d\n"
                            "group team members=alice,bob\nquota alice tier-guarantee-bytes=%d\n"
                            % (UID_A, UID_B, 8 * bb),
                    **_tiers(tier_write="write-through", tier1_memory="64K"))
    member = _group_writer(d, "m-tgb")

    assert d.admin_result("quota get alice")["quota"]["tier-guarantee-bytes"] == 8 * bb
    Child(member, 8, 11, uid=UID_A).result()
    settle(d)
    assert _quota_usage(d, "alice")["tier1"] == 8
    Child(member, 64, 12, uid=UID_B).result()
    settle(d)
    assert _quota_usage(d, "alice")["tier1"] == 8, tier_stats(d)
    assert _quota_usage(d, "bob")["tier1"] == 24, tier_stats(d)
    d.admin_result("quota set alice tier-guarantee-bytes %d" % (4 * bb))
    Child(member, 64, 13, uid=UID_B).result()
    settle(d)
    assert _quota_usage(d, "alice")["tier1"] == 4, tier_stats(d)
    assert _quota_usage(d, "bob")["tier1"] == 28, tier_stats(d)


def test_tier_total_bytes_over_a_tenants_pools(kvd_factory):
    """quota tier-total-bytes counts a tenant's tier-1 bytes over all of its pools: with room
    for 6 blocks, 5 blocks in one model's pool and 5 in another's leave 6 in all (4 pushed out,
    counted), where the per-pool limits (tier-max-bytes of 5 blocks) alone keep all 10; the
    blocks left come back with their bytes. Set to 0 live, a third pool's 4 blocks come down
    beside the 6."""
    bb = LAYOUT.block_bytes
    d = kvd_factory(tenants="quota default tier-total-bytes=%d tier-max-bytes=%d\n"
                    % (6 * bb, 5 * bb), **_tiers(tier_write="write-through"))
    c = connect(d)
    tenant = "uid-%d" % os.geteuid()
    assert d.admin_result("quota get %s" % tenant)["quota"]["tier-total-bytes"] == 6 * bb
    pa, pb_ = c.attach("m-tot-a", LAYOUT), c.attach("m-tot-b", LAYOUT)
    assert pa.pool_id != pb_.pool_id
    ha, hb = prefix(pa, 5, 41), prefix(pb_, 5, 42)
    pat_a, pat_b = patterns(pa, ha), patterns(pb_, hb)
    write_commit_release(c, pa, ha, pat_a)
    settle(d)
    assert _quota_usage(d, tenant)["tier1"] == 5
    write_commit_release(c, pb_, hb, pat_b)
    settle(d)
    st, u = tier_stats(d), _quota_usage(d, tenant)
    assert u["tier1"] == 6 and u["tier1_bytes"] == 6 * bb, u
    assert st["tier_quota_drops"] == 4, st
    assert d.admin_result("evict all")["evicted"] >= 10
    kept = 0
    for pool, hs, pats in ((pa, ha, pat_a), (pb_, hb, pat_b)):
        for i in range(5):
            if c.lookup(pool.pool_id, [hs[i]]).tier1_hits == 1:
                fr, blocks = fetch_all(c, pool, [hs[i]])
                assert len(blocks) == 1, fr
                check_bytes(pool, blocks, [pats[i]])
                c.release(pool.pool_id, blocks)
                kept += 1
    assert kept == 6, kept
    d.admin_result("quota set default tier-total-bytes 0")
    pc = c.attach("m-tot-c", LAYOUT)
    hc = prefix(pc, 4, 43)
    write_commit_release(c, pc, hc, patterns(pc, hc))
    settle(d)
    assert _quota_usage(d, tenant)["tier1"] == 10, tier_stats(d)


def test_tier_max_bytes_counts_what_tier_1_stores(kvd_factory):
    """quota tier-max-bytes=5K in an lz4 tier 1 counts bytes as stored: 10 incompressible blocks
    (kept raw, 2048 bytes each) leave the newest 2 (8 pushed out, counted); then 10 blocks of
    zeros, a few dozen bytes each compressed, all fit beside them, where a block count of 2
    would keep 2. `quota get` reports the bytes; the zero blocks come back as zeros. With the
    limit set live under one raw block, the tenant's next incompressible block goes (after the
    tenant is brought under the new limit) and the zero blocks stay."""
    d = kvd_factory(tenants="quota default tier-max-bytes=5K\n",
                    **_tiers(tier_write="write-through", tier_format="lz4"))
    c = connect(d)
    pool = c.attach("m-tmaxb", LAYOUT)
    tenant = "uid-%d" % os.geteuid()
    assert d.admin_result("quota get %s" % tenant)["quota"]["tier-max-bytes"] == 5120
    hs = prefix(pool, 10, 24)
    write_commit_release(c, pool, hs, patterns(pool, hs))
    settle(d)
    st, u = tier_stats(d), _quota_usage(d, tenant)
    assert st["tier1_blocks"] == 2 and st["tier_quota_drops"] == 8, st
    assert u["tier1"] == 2 and u["tier1_bytes"] == 2 * LAYOUT.block_bytes, u
    zs = prefix(pool, 10, 25)
    zeros = [bytes(LAYOUT.block_bytes)] * 10
    write_commit_release(c, pool, zs, zeros)
    settle(d)
    st, u = tier_stats(d), _quota_usage(d, tenant)
    assert st["tier1_blocks"] == 12 and st["tier_quota_drops"] == 8, st
    zbytes = u["tier1_bytes"] - 2 * LAYOUT.block_bytes
    assert 0 < zbytes <= 5120 - 2 * LAYOUT.block_bytes, u
    assert d.admin_result("evict all")["evicted"] >= 20
    fr, blocks = fetch_all(c, pool, zs)
    assert len(blocks) == 10 and fr.promoted == 10, fr
    check_bytes(pool, blocks, zeros)
    c.release(pool.pool_id, blocks)
    d.admin_result("quota set default tier-max-bytes 1K")
    assert zbytes < 1024
    hs3 = prefix(pool, 1, 26)
    write_commit_release(c, pool, hs3, patterns(pool, hs3))
    settle(d)
    st, u = tier_stats(d), _quota_usage(d, tenant)
    # The 2 raw blocks made room (the tenant was past 1K), the new one was past it alone.
    assert st["tier_quota_drops"] == 8 + 2 + 1, st
    assert u["tier1"] == 10 and u["tier1_bytes"] == zbytes, u
    d.admin_result("evict all")
    assert c.lookup(pool.pool_id, zs).tier1_hits == 10


def test_tier_max_bytes_counts_slots_in_tier_2(kvd_factory):
    """In tier 2 (T1 off) a record takes one slot whatever its payload: tier-max-bytes of 3.5
    slots keeps 3 of 10 blocks, the rest counted."""
    _, opts = _t2_only()
    d = kvd_factory(**opts)
    c = connect(d)
    pool = c.attach("m-tmaxb2", LAYOUT)
    hs = prefix(pool, 1, 27)
    write_commit_release(c, pool, hs, patterns(pool, hs))
    settle(d)
    tenant = "uid-%d" % os.geteuid()
    u = _quota_usage(d, tenant)
    assert u["tier2"] == 1, u
    slot = u["tier2_bytes"]
    assert slot >= LAYOUT.block_bytes and slot % 4096 == 0, u
    d.admin_result("quota set default tier-max-bytes %d" % (slot * 7 // 2))
    hs = prefix(pool, 10, 28)
    write_commit_release(c, pool, hs, patterns(pool, hs))
    settle(d)
    st, u = tier_stats(d), _quota_usage(d, tenant)
    assert u["tier2"] == 3 and u["tier2_bytes"] == 3 * slot, u
    assert st["tier_quota_drops"] == 8, st  # the first block and 7 of the 10
    # Under one slot: a block is not written at all (its size is known before the copy), and
    # nothing of the tenant's goes for it.
    d.admin_result("quota set default tier-max-bytes %d" % (slot - 1))
    hs = prefix(pool, 1, 29)
    write_commit_release(c, pool, hs, patterns(pool, hs))
    settle(d)
    after = tier_stats(d)
    assert after["demotions_t2"] == st["demotions_t2"], after
    assert after["tier_quota_drops"] == 8 and _quota_usage(d, tenant)["tier2"] == 3, after


def test_tier_max_holds_in_tier_2(kvd_factory):
    """The same limit in tier 2 (T1 off): 10 blocks down, 4 records kept, 6 counted."""
    _, opts = _t2_only()
    d = kvd_factory(tenants="quota default tier-max=4\n", **opts)
    c = connect(d)
    pool = c.attach("m-tmax2", LAYOUT)
    hs = prefix(pool, 10, 23)
    write_commit_release(c, pool, hs, patterns(pool, hs))
    settle(d)
    st = tier_stats(d)
    assert st["tier2_blocks"] == 4 and st["tier_quota_drops"] == 6, st
    assert _quota_usage(d, "uid-%d" % os.geteuid())["tier2"] == 4
