"""The binding's calls for Zipage and IceCache (docs/ZIPAGE.md, docs/ICECACHE.md) against a real
kvd: private blocks are never committed and go back like any lease; Unshare works on a block the
session alone holds and is refused on a shared one; a sequence under a block budget refuses to
grow, is compacted into private blocks and then publishes nothing; page summaries of a pool
attached with summaries=True equal the keys' min, max and mean."""

import numpy as np
import pytest

import kvclient

SHAPE = dict(layers=2, kv_heads=2, head_dim=8, tokens_per_block=4, dtype="fp32")


def _fill(p, blocks, base):
    for i in range(len(blocks)):
        for layer in range(p.layout.layers):
            p.k(blocks[i], layer)[:] = np.arange(np.prod(p.k(blocks[i], layer).shape),
                                                 dtype=np.float32).reshape(
                                                     p.k(blocks[i], layer).shape) + base + i
            p.v(blocks[i], layer)[:] = -(base + i)


def test_private_blocks_and_unshare(conn, kvd):
    assert conn.has_private
    p = conn.attach("py-private", **SHAPE)
    priv = p.allocate_private(2)
    h = p.hash_tokens(list(range(8)))
    with pytest.raises(kvclient.KvdPermission):
        p.commit(priv, h)
    p.release(priv)
    b = p.allocate(2)
    _fill(p, b, 10)
    canon = p.commit(b, h)
    with conn2(kvd) as other:
        q = other.attach("py-private", **SHAPE)
        hits = q.lookup(h)
        assert len(hits) == 2
        with pytest.raises(kvclient.KvdBusy):
            p.unshare(canon[1:])  # another session holds it
        q.release(hits)
    p.unshare(canon[1:])
    again = p.lookup(h)
    assert len(again) == 1  # the unshared block left the index
    p.release(again)
    p.release(canon)


def conn2(kvd):
    return kvd.connect()


def test_budget_and_compact(conn):
    p = conn.attach("py-zip", **SHAPE)
    s = kvclient.Sequence(p, 64)
    s.set_block_budget(3)
    assert s.block_budget == 3
    s.prefill(list(range(12)))
    with pytest.raises(kvclient.KvdQuotaExceeded):
        s.append([99])
    kept = [0, 1, 5, 9, 10, 11]
    fresh = p.allocate_private(2)
    for i, slot in enumerate(kept):
        src, dst = s.block(slot // 4), fresh[i // 4]
        for layer in range(p.layout.layers):
            p.k(dst, layer)[i % 4] = p.k(src, layer)[slot % 4]
            p.v(dst, layer)[i % 4] = p.v(src, layer)[slot % 4]
    s.compact(kept, fresh)
    assert s.compressed and len(s) == 6 and s.position == 12 and s.nblocks == 2
    s.append([12, 13, 14])
    assert s.commit() == 0  # a compressed sequence publishes nothing
    assert s.position == 15
    s.release()
    assert not s.compressed


def test_summaries(conn):
    p = conn.attach("py-sum", summaries=True, **SHAPE)
    h = p.hash_tokens(list(range(8)))
    b = p.allocate(2)
    _fill(p, b, 3)
    keys = [[p.k(b[i], layer).copy() for layer in range(2)] for i in range(2)]
    canon = p.commit(b, h)
    summ, found = p.summaries(h)
    assert list(found) == [True, True]
    for i in range(2):
        for layer in range(2):
            k = keys[i][layer]  # [tokens][heads][dim]
            np.testing.assert_array_equal(summ[i, layer, :, 0], k.min(axis=0))
            np.testing.assert_array_equal(summ[i, layer, :, 1], k.max(axis=0))
            np.testing.assert_allclose(summ[i, layer, :, 2], k.mean(axis=0), rtol=1e-6)
    _, found = p.summaries(p.hash_tokens(list(range(100, 104))))
    assert list(found) == [False]
    plain = conn.attach("py-sum", **SHAPE)
    with pytest.raises(kvclient.KvdNotSupported):
        plain.summaries(h)
    p.release(canon)
