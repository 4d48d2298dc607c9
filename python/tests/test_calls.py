"""Connection, pool and block calls, batches and sequences against a real kvd."""

import numpy as np
import pytest

import kvclient
from kvclient import K, V

SHAPE = dict(layers=2, kv_heads=2, head_dim=8, tokens_per_block=4, dtype="fp16")


def lib_device(pool):
    return kvclient._lib_handle.kvc_pool_device(pool._ptr)


def test_connection_options_and_identity(kvd):
    logs = []
    with kvclient.Connection(kvd.sock, client_name="pyclient-7", timeout_ms=5000,
                             log=lambda lvl, mid, msg: logs.append((lvl, mid, msg)),
                             log_level=3) as c:
        assert c.session_id > 0 and c.boot_epoch != 0
        assert c.tenant.startswith("uid-")
        assert c.fd >= 0
        c.ping(b"hello")
        names = [s["client"] for s in kvd.admin("sessions")["sessions"]]
        assert "pyclient-7" in names, names
        st = c.stats()
        assert st["session.id"] == c.session_id
        assert c.stat("session.id") == c.session_id
        with pytest.raises(kvclient.KvdNotFound):
            c.stat("no.such.stat")
    assert c.closed


def test_default_socket_path_follows_kvd_socket(monkeypatch):
    monkeypatch.setenv("KVD_SOCKET", "/tmp/some/kvd.sock")
    assert kvclient.default_socket_path() == "/tmp/some/kvd.sock"


def test_attach_reports_the_layout(conn, model_id):
    p = conn.attach(model_id, **SHAPE)
    lay = p.layout
    assert (lay.layers, lay.kv_heads, lay.head_dim, lay.tokens_per_block) == (2, 2, 8, 4)
    assert lay.dtype == "fp16" and lay.arrangement == "layer_major"
    assert lay.kv_block_bytes == 4 * 2 * 8 * 2 and lay.block_bytes == 2 * 2 * 128
    assert lay == kvclient.Layout(2, 2, 8, 4, "fp16")
    assert p.id > 0 and p.blocks_per_segment > 0 and p.max_blocks >= p.blocks_per_segment
    assert p.segments >= 1 and not p.stale and not p.read_only and not p.is_device
    assert lib_device(p) == -1  # kvc_pool_device: host memory
    assert p.linked == [] and p.find(p.id) is p and p.owner is p
    assert not p.layout_conflict
    assert conn.stats(p)["pool.id"] == p.id
    with pytest.raises(ValueError):
        kvclient.Layout(1, 1, 8, 4, "fp64")


def test_hash_chain_matches_hash_next(conn, model_id):
    p = conn.attach(model_id, **SHAPE)
    toks = list(range(100, 117))  # 4 full blocks and one token
    h = p.hash_tokens(toks)
    assert len(h) == 4
    parent = p.hash_seed
    for i in range(4):
        parent = p.hash_next(parent, toks[4 * i:4 * i + 4])
        assert parent == h[i]
    assert len(p.hash_tokens(np.array(toks, dtype=np.uint32))) == 4
    assert p.hash_tokens(toks, extra=b"lora-1")[0] != h[0]
    hn = h.numpy()
    assert hn.dtype == kvclient.HASH_DTYPE and (int(hn[1]["lo"]), int(hn[1]["hi"])) == h[1]
    assert kvclient.Hashes.from_numpy(hn)[3] == h[3]
    assert len(h.hex(0)) == 32


def _publish(p, toks, fill=None):
    """Allocates, fills and commits the blocks of toks; returns (hashes, canonical)."""
    h = p.hash_tokens(toks)
    b = p.allocate(len(h))
    if fill is not None:
        for i in range(len(b)):
            for layer in range(p.layout.layers):
                p.k(b[i], layer)[:] = fill + i
                p.v(b[i], layer)[:] = -(fill + i)
    return h, p.commit(b, h)


def test_lookup_allocate_commit_release(conn, model_id):
    p = conn.attach(model_id, **SHAPE)
    toks = list(range(32))
    h = p.hash_tokens(toks)
    assert len(p.lookup(h)) == 0
    h, canon = _publish(p, toks, fill=1)
    assert len(canon) == 8 and canon.pool is p
    assert conn.stats(p)["pool.blocks_committed"] == 8
    p.release(canon)
    hits = p.lookup(h)
    assert len(hits) == 8 and list(hits.ids) == list(canon.ids)
    assert p.k(hits[2], 1)[0, 0, 0] == 3 and p.v(hits[2], 1)[0, 0, 0] == -3
    half = p.lookup(h[:3])
    assert len(half) == 3
    p.release(half)
    # a different tail: only the shared prefix hits
    other = p.hash_tokens(toks[:8] + [999] * 24)
    got = p.lookup(other)
    assert len(got) == 2
    p.release(got)
    out = kvclient.Blocks(8)
    assert p.lookup(h, out=out) is out and len(out) == 8
    p.release(out)
    p.release(hits)
    assert conn.stat("session.refs_held") == 0


def test_deferred_release_rides_with_the_next_call(conn, model_id):
    p = conn.attach(model_id, **SHAPE)
    h, canon = _publish(p, list(range(300, 316)))
    p.release(canon, deferred=True)
    assert conn.deferred_pending == 1
    hits = p.lookup(h)  # carries the Release, ahead of the Lookup
    assert conn.deferred_pending == 0 and len(hits) == 4
    assert conn.stat("session.refs_held") == 4
    p.release(hits, deferred=True)
    assert conn.stat("session.refs_held") == 0  # the Stats call carried it
    p.release(hits[:1], deferred=True)  # no longer held: refused, but the ping succeeds
    conn.ping()
    assert conn.deferred_failures == 1
    with pytest.raises(kvclient.KvdPermission, match="deferred"):
        conn.flush()
    conn.flush()  # reported once


def test_commit_of_a_duplicate_returns_the_cached_block(conn, model_id):
    p = conn.attach(model_id, **SHAPE)
    toks = list(range(8))
    h, first = _publish(p, toks)
    b = p.allocate(2)
    canon = p.commit(b, h)
    assert list(canon.ids) == list(first.ids) and list(b.ids) != list(first.ids)
    p.release(canon)
    p.release(first)


def test_rewind_pin_and_multi(conn, model_id):
    p = conn.attach(model_id, **SHAPE)
    b = p.allocate(3)
    p.rewind(b)
    assert conn.stats(p)["pool.rewinds"] >= 1
    h, canon = _publish(p, list(range(200, 212)))
    p.pin(canon, retention_ms=60000, priority=5)
    assert conn.stats(p)["pool.blocks_pinned"] == 3
    kvclient.pin_multi([p] * 3, canon, unpin=True)
    assert conn.stats(p)["pool.blocks_pinned"] == 0
    hits, where = p.lookup_domains(h)
    assert len(hits) == 3 and where == [p, p, p]
    kvclient.release_multi(where, hits)
    kvclient.rewind_multi([p] * 3, canon)
    assert conn.stat("session.refs_held") == 0


def test_copy_blocks(conn, model_id):
    p = conn.attach(model_id, **SHAPE)
    b = p.allocate(2)
    p.k(b[0], 1)[:] = 7
    p.v(b[0], 0)[:] = 8
    p.copy_blocks([b[0][0]], [b[1][0]])
    assert np.all(p.k(b[1], 1) == 7) and np.all(p.v(b[1], 0) == 8)
    with pytest.raises(kvclient.KvdInvalid):
        p.copy_blocks([10 ** 7], [b[1][0]])
    p.release(b)


def test_batch_lookups_and_releases(conn, model_id):
    p = conn.attach(model_id, **SHAPE)
    prompts = [[i] * 4 + list(range(12)) for i in range(6)]
    hashes = [p.hash_tokens(t) for t in prompts]
    for h in hashes[:4]:
        p.release(_publish_h(p, h))
    b = conn.batch()
    reqs = [b.lookup(p, h) for h in hashes]
    assert len(b) == 6
    b.run()
    hits = [r.result() for r in reqs]
    assert [len(x) for x in hits] == [4, 4, 4, 4, 0, 0]
    b.reset()
    rel = [b.release(p, x) for x in hits]
    bad = b.release(p, kvclient.Blocks.of([(10 ** 6, 0)]))
    b.send()
    b.wait()
    assert all(r.error is None for r in rel)
    assert isinstance(bad.error, kvclient.KvdNotFound)
    with pytest.raises(kvclient.KvdNotFound):
        bad.result()
    b.reset()
    a = b.allocate(p, 2)
    pg = b.ping(b"x")
    b.run()
    blocks = a.result()
    assert len(blocks) == 2 and pg.error is None
    b.reset()
    hh = p.hash_tokens([5] * 8)
    cm = b.commit(p, blocks, hh)
    b.run()
    canon = cm.result()
    b.reset()
    b.rewind(p, canon)
    b.run()
    b.free()
    assert conn.stat("session.refs_held") == 0


def _publish_h(p, h):
    return p.commit(p.allocate(len(h)), h)


def test_sequence_cycle(conn, model_id):
    p = conn.attach(model_id, **SHAPE)
    prompt = list(range(10))
    s = p.sequence(64)
    assert s.prefill(prompt) == 0
    assert len(s) == 10 and s.nblocks == 3 and s.ncommitted == 0
    ids = s.block_ids()
    assert len(ids) == 3 and s.block(0)[0] == ids[0] and s.block_pool(0) is p
    assert s.commit() == 2 and s.ncommitted == 2
    s.append([10, 11])
    assert len(s) == 12 and s.commit(12) == 1
    s.append([12])
    slots = s.export_slots(10, 13)
    assert list(slots) == [int(s.block_ids()[2]) * 4 + 2, int(s.block_ids()[2]) * 4 + 3,
                           int(s.block_ids()[3]) * 4]
    assert s.rewind(11) == 8  # inside committed block 2: it is given back, K/V from 8
    assert len(s) == 11 and s.ncommitted == 2
    s.release()
    assert len(s) == 0
    # a second sequence finds the committed prefix
    s2 = p.sequence(64)
    assert s2.prefill(prompt + [77]) == 8
    indptr, indices, last = kvclient.export_csr([s2])
    assert list(indptr) == [0, 3] and list(last) == [3] and len(indices) == 3
    table, used = kvclient.export_table([s2], 8)
    assert used == 3 and list(table[0, :3]) == list(indices) and table[0, 3] == -1
    ip2, ix2, l2 = kvclient.export_csr_pool([s2], p)
    assert list(ix2) == list(indices)
    s2.reserve(40)
    assert s2.capacity >= 40
    s2.set_lookahead(4)
    child, src, dst = s2.fork()
    assert len(child) == len(s2) and len(src) == len(dst) == 1  # the partial last block
    p.copy_blocks(src, dst)
    child.free()
    s2.free()
    s.free()
    assert conn.stat("session.refs_held") == 0


def test_append_many_reports_each_sequence(conn, model_id):
    p = conn.attach(model_id, **SHAPE)
    seqs = [p.sequence(8) for _ in range(3)]
    for i, s in enumerate(seqs):
        s.prefill([i, i + 1, i + 2])
    errs = kvclient.append_many(seqs, [[1], [1, 2, 3, 4, 5, 6], [1, 2]])
    assert errs[0] is None and errs[2] is None
    assert isinstance(errs[1], kvclient.KvdTooBig)
    assert [len(s) for s in seqs] == [4, 3, 5]
    for s in seqs:
        s.free()


def test_batch_lean_paths(conn, model_id):
    p = conn.attach(model_id, **SHAPE)
    h = p.hash_tokens(list(range(300, 316)))
    p.release(_publish_h(p, h))
    outs = [kvclient.Blocks(4) for _ in range(5)]
    b = conn.batch()
    idx = b.lookup_many(p, h, outs)
    assert list(idx) == [0, 1, 2, 3, 4]
    b.run()
    b.check()
    assert all(len(o) == 4 and o.pool is p for o in outs)
    b.reset()
    b.release_many(p, outs)
    b.release_many(p, [kvclient.Blocks.of([(10 ** 6, 0)])])
    b.run()
    with pytest.raises(kvclient.KvdNotFound) as ei:
        b.check()
    assert "request 5" in str(ei.value)
    assert conn.stat("session.refs_held") == 0
    with pytest.raises(ValueError):
        b.lookup_many(p, h, [kvclient.Blocks(2)])
    # All or none: the second list is longer than a request may be, so neither is queued.
    b.reset()
    big = p.hash_tokens(list(range(p.layout.tokens_per_block * (p.max_blocks + 1))))
    assert len(big) == p.max_blocks + 1
    with pytest.raises(kvclient.KvdError):
        b.lookup_many(p, [h, big], [kvclient.Blocks(4), kvclient.Blocks(len(big))])
    assert len(b) == 0
    assert list(b.lookup_many(p, [h], [kvclient.Blocks(4)])) == [0]


def test_daemon_restart_is_kvd_epoch(kvd_factory, model_id):
    import os
    import tempfile
    from conftest import base_dir
    run = tempfile.mkdtemp(prefix="r", dir=base_dir())
    sock = os.path.join(run, "kvd.sock")
    opts = dict(socket=sock, admin_socket=os.path.join(run, "admin.sock"))
    d1 = kvd_factory(**opts)
    c = kvclient.Connection(sock, timeout_ms=5000)
    p = c.attach(model_id, **SHAPE)
    epoch = c.boot_epoch
    d1.kill()
    kvd_factory(**opts)
    with pytest.raises((kvclient.KvdEpoch, kvclient.KvdClosed)) as ei:
        p.allocate(1)
    if isinstance(ei.value, kvclient.KvdClosed):  # the broken connection, seen first
        with pytest.raises(kvclient.KvdEpoch):
            p.allocate(1)
    assert p.stale
    p.detach()
    p2 = c.attach(model_id, **SHAPE)  # the connection itself reconnected
    assert c.boot_epoch != epoch and len(p2.allocate(1)) == 1
    c.close()


def test_threads_share_a_connection(conn, model_id):
    import threading
    p = conn.attach(model_id, **SHAPE)
    h = p.hash_tokens(list(range(400, 432)))
    p.release(_publish_h(p, h))
    errors = []

    def work():
        try:
            out = kvclient.Blocks(8)
            for _ in range(200):
                hits = p.lookup(h, out)
                assert len(hits) == 8
                p.release(hits)
        except Exception as e:  # reported below
            errors.append(e)
    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    assert conn.stat("session.refs_held") == 0


def test_batch_dropped_while_in_flight(conn):
    """A batch sent and dropped before wait() (collected): the connection is not held for it
    any more. The next call may find the connection broken (its replies were never read), and
    reconnect() brings it back (every call raised KvdState for good before, reconnect too)."""
    import gc
    b = conn.batch()
    b.ping(b"y")
    b.send()
    del b
    gc.collect()
    try:
        conn.ping()
    except kvclient.KvdClosed:
        pass
    conn.reconnect()
    conn.ping()

