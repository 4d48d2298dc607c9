"""The binding's lower-tier calls (docs/TIERS.md) against a real kvd with tier 1: a prefix
pushed out of the pool comes back through Pool.fetch with its values, Pool.lookup_tiers reports
the run below T0, Sequence.prefill fetches by itself, and Pool.lookup_remote sees what another
daemon put in a real redis-server."""

import socket
import subprocess
import time

import pytest

import kvclient

SHAPE = dict(layers=2, kv_heads=2, head_dim=8, tokens_per_block=4, dtype="fp16")


def _publish(p, toks, fill):
    h = p.hash_tokens(toks)
    deadline = time.monotonic() + 5
    while True:  # blocks being copied down are leased until the copy lands: retry ENOSPC
        try:
            b = p.allocate(len(h))
            break
        except kvclient.KvdNoSpace:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    for i in range(len(b)):
        for layer in range(p.layout.layers):
            p.k(b[i], layer)[:] = fill + i
            p.v(b[i], layer)[:] = -(fill + i)
    canon = p.commit(b, h)
    p.release(canon)
    return h


def _tiers(kvd_factory):
    # 256-byte blocks, 64 a segment: a 2-segment pool that 40 chains of 8 blocks overflow.
    return kvd_factory(pool_memory="40K", segment_bytes="16K", tier1_memory="4M",
                       tier_write="write-through", fetch_min_tokens="4")


def _settle(kvd):
    """Waits for the daemon's copies in flight (a block being copied down is leased: neither
    evictable nor in tier 1 yet)."""
    for _ in range(2000):
        if kvd.admin("stats")["tiers"]["jobs_inflight"] == 0:
            return
        time.sleep(0.005)
    raise AssertionError("copies still in flight")


def _flood(kvd, p, n=40):
    for k in range(n):
        _publish(p, list(range(100000 * (k + 1), 100000 * (k + 1) + 32)), fill=7)
    _settle(kvd)


def test_fetch_brings_back_an_evicted_prefix(kvd_factory):
    d = _tiers(kvd_factory)
    with d.connect() as c:
        assert c.has_tiers
        p = c.attach("tiers-py", **SHAPE)
        toks = list(range(32))
        h = _publish(p, toks, fill=1)
        _flood(d, p)
        t0, th = p.lookup_tiers(h)
        n0 = len(t0)
        p.release(t0)
        assert n0 < 8 and n0 + th["fetchable"] == 8 and th["t1"] > 0, th
        got, info = p.fetch(h)
        assert info["status"] == "done" and len(got) == 8, info
        assert info["t0_hits"] == n0 and info["promoted"] == 8 - n0 and info["failure"] is None
        for i in range(8):
            assert p.k(got[i], 1)[0, 0, 0] == 1 + i and p.v(got[i], 0)[0, 0, 0] == -(1 + i)
        p.release(got)
        # Too short to be worth it: the caller recomputes.
        _flood(d, p)
        got, info = p.fetch(h, min_tokens=10 ** 6)
        assert info["status"] == "short" and len(got) == info["t0_hits"] < 8, info
        p.release(got)
        assert c.stat("session.refs_held") == 0


def test_sequence_prefill_fetches(kvd_factory):
    d = _tiers(kvd_factory)
    with d.connect() as c:
        p = c.attach("tiers-seq", **SHAPE)
        toks = list(range(32))
        _publish(p, toks, fill=3)
        _flood(d, p)
        s = p.sequence(max_tokens=64)
        cached = s.prefill(toks + [5])
        assert cached == 32 and s.promoted >= 1
        for i in range(8):
            assert p.k(s.block(i), 0)[0, 0, 0] == 3 + i
        s.release()


def test_no_tiers_fetch_is_a_lookup(kvd):
    with kvd.connect() as c:
        assert not c.has_tiers
        p = c.attach("tiers-none", **SHAPE)
        h = _publish(p, list(range(16)), fill=2)
        got, info = p.fetch(h)
        assert info["status"] == "done" and len(got) == 4 and info["promoted"] == 0
        p.release(got)


def test_lossy_tiers_pool(kvd_factory):
    d = kvd_factory(pool_memory="40K", segment_bytes="16K", tier1_memory="4M",
                    tier_write="write-through", fetch_min_tokens="4", tier_lossy_format="int8")
    with d.connect() as c:
        p = c.attach("tiers-lossy", lossy_tiers=True, **SHAPE)
        q = c.attach("tiers-lossy", **SHAPE)
        assert p.id != q.id  # the flag is part of the pool's identity
        h = _publish(p, list(range(32)), fill=1)
        _settle(d)
        d.admin("evict all")
        got, info = p.fetch(h)
        assert info["status"] == "done" and info["promoted"] == 8, info
        for i in range(8):
            # one value per block (fill + i): exact after int8 (it is the group's absmax)
            assert p.k(got[i], 1)[0, 0, 0] == 1 + i
        p.release(got)
        got, info = q.fetch(h)
        assert len(got) == 0 and info["lower_run"] == 0


def test_batch_fetch(kvd_factory):
    d = _tiers(kvd_factory)
    with d.connect() as c:
        p = c.attach("tiers-batch", **SHAPE)
        h = _publish(p, list(range(32)), fill=4)
        _flood(d, p)
        b = c.batch()
        f = b.fetch(p, h)
        ping = b.ping(b"x")
        b.run()
        got, info = f.result()
        assert info["status"] == "done" and len(got) == 8, info
        assert ping.status == 0
        for i in range(8):
            assert p.k(got[i], 0)[0, 0, 0] == 4 + i
        p.release(got)


def _redis_server():
    """A redis-server on a free loopback port (no persistence); returns (process, "host:port")."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(500):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, "127.0.0.1:%d" % port
        except OSError:
            time.sleep(0.01)
    proc.kill()
    raise AssertionError("redis-server did not start")


def test_lookup_remote_sees_another_nodes_prefix(kvd_factory):
    """Two daemons on one redis-server: B's lookup_remote says Redis holds the 8 blocks A
    published; fetch then brings A's bytes; a daemon without a remote tier says ENOTSUP."""
    proc, addr = _redis_server()
    try:
        opts = dict(pool_memory="40K", segment_bytes="16K", tier1_memory="4M",
                    fetch_min_tokens="4", remote_redis=addr)
        a = kvd_factory(tier_write="write-through", **opts)
        b = kvd_factory(**opts)
        with a.connect() as ca, b.connect() as cb:
            assert cb.has_remote and cb.has_tiers
            pa = ca.attach("tiers-remote", **SHAPE)
            pb = cb.attach("tiers-remote", **SHAPE)
            h = _publish(pa, list(range(32)), fill=5)
            for _ in range(500):
                t0, th, rh = pb.lookup_remote(h)
                pb.release(t0)
                if rh["blocks"] == 8:
                    break
                time.sleep(0.02)
            assert len(t0) == 0 and th["fetchable"] == 0 and rh == {"blocks": 8, "failure": None}
            got, info = pb.fetch(h)
            assert info["status"] == "done" and len(got) == 8, info
            for i in range(8):
                assert pb.k(got[i], 1)[0, 0, 0] == 5 + i
            pb.release(got)
            assert cb.stat("session.refs_held") == 0
        with kvd_factory(pool_memory="40K", segment_bytes="16K", tier1_memory="4M").connect() as c:
            assert not c.has_remote
            p = c.attach("tiers-remote", **SHAPE)
            with pytest.raises(kvclient.KvdNotSupported):
                p.lookup_remote(h)
    finally:
        proc.kill()
        proc.wait()
