"""KvdCache: the Hugging Face Cache shape over kvd blocks, checked against a plain in-memory
cache with the numpy reference decoder, and prefix reuse by a second process."""

import numpy as np
import pytest

import kvclient
from kvclient import KvdCache
from kvclient.ref_decoder import PlainCache, RefDecoder

from conftest import run_python

MODEL = dict(vocab=97, layers=3, heads=4, kv_heads=2, head_dim=16, seed=7)
PROMPT = [int(t) for t in np.random.default_rng(3).integers(0, 97, size=37)]


def _pool(conn, model_id, dtype="fp32", tpb=8, layers=3, kv_heads=2, head_dim=16):
    return conn.attach(model_id, layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                       tokens_per_block=tpb, dtype=dtype)


def test_update_shapes_lengths_and_views(conn, model_id):
    p = _pool(conn, model_id, tpb=4, layers=2)
    cache, cached = KvdCache.for_prompt(p, list(range(10)))
    assert cached == 0 and cache.get_seq_length() == 0
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 2, 10, 16)).astype(np.float32)
    v = rng.standard_normal((1, 2, 10, 16)).astype(np.float32)
    for layer in range(2):
        keys, values = cache.update(k + layer, v - layer, layer)
        assert keys.shape == (1, 2, 10, 16) and values.shape == (1, 2, 10, 16)
        assert np.array_equal(keys, k + layer) and np.array_equal(values, v - layer)
    assert cache.get_seq_length() == 10 and cache.get_seq_length(1) == 10
    assert cache.committed_tokens == 8  # two full blocks, all layers written
    with pytest.raises(kvclient.KvdState):
        cache.update(k[:, :, :1], v[:, :, :1], 0)  # not announced
    cache.append_tokens([10])
    k1 = rng.standard_normal((1, 2, 1, 16)).astype(np.float32)
    keys, values = cache.update(k1, k1, 0)
    assert keys.shape == (1, 2, 11, 16) and np.array_equal(keys[:, :, 10:], k1)
    assert np.array_equal(keys[:, :, :10], k)
    # the returned keys are the pool's bytes (a view when the blocks are consecutive)
    if cache._contig[0]:
        assert np.shares_memory(keys, p.layer(0, 0))
    assert cache.get_seq_length(0) == 11 and cache.get_seq_length(1) == 10
    cache.update(k1, k1, 1)
    cache.reset()
    assert cache.get_seq_length() == 0
    cache.close()


def test_kvdcache_generates_what_the_plain_cache_generates(conn, model_id):
    model = RefDecoder(**MODEL)
    ref_tokens, ref_logits = model.generate(PROMPT, 20, PlainCache(np.float32))
    p = _pool(conn, model_id)
    cache, cached = KvdCache.for_prompt(p, PROMPT)
    assert cached == 0
    tokens, logits = model.generate(PROMPT, 20, cache)
    assert tokens == ref_tokens
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=1e-9)
    assert cache.get_seq_length() == len(PROMPT) + 19
    assert cache.committed_tokens == (len(PROMPT) + 19) // 8 * 8
    cache.close()


def test_fp16_pool_matches_an_fp16_plain_cache(conn, model_id):
    model = RefDecoder(**MODEL)
    ref_tokens, ref_logits = model.generate(PROMPT, 12, PlainCache(np.float16))
    cache, _ = KvdCache.for_prompt(_pool(conn, model_id, dtype="fp16"), PROMPT)
    tokens, logits = model.generate(PROMPT, 12, cache)
    assert tokens == ref_tokens
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=1e-9)


_CHILD = r"""
import sys, json, numpy as np, kvclient
from kvclient import KvdCache
from kvclient.ref_decoder import RefDecoder
sock, model_id, prompt, model, n = (sys.argv[1], sys.argv[2], json.loads(sys.argv[3]),
                                    json.loads(sys.argv[4]), int(sys.argv[5]))
with kvclient.Connection(sock, client_name="second-process") as c:
    cache, cached = KvdCache.for_prompt(c, prompt, model_id=model_id, layers=model["layers"],
                                        kv_heads=model["kv_heads"], head_dim=model["head_dim"],
                                        tokens_per_block=8, dtype="fp32")
    tokens, logits = RefDecoder(**model).generate(prompt, n, cache, cached)
    print(json.dumps({"cached": cached, "tokens": tokens, "logits": logits.tolist()}))
"""


def test_second_process_reuses_the_prefix(conn, kvd, model_id):
    import json
    model = RefDecoder(**MODEL)
    cache, cached = KvdCache.for_prompt(_pool(conn, model_id), PROMPT)
    tokens, logits = model.generate(PROMPT, 10, cache)
    out = json.loads(run_python(_CHILD, kvd.sock, model_id, json.dumps(PROMPT),
                                json.dumps(MODEL), 10))
    assert out["cached"] == (len(PROMPT) - 1) // 8 * 8 and out["cached"] > 0
    assert out["tokens"] == tokens
    np.testing.assert_allclose(np.array(out["logits"]), logits, rtol=1e-6, atol=1e-6)
    # a longer prompt sharing the prefix reuses the decoded blocks too
    longer = PROMPT + tokens[:-1]
    out = json.loads(run_python(_CHILD, kvd.sock, model_id, json.dumps(longer),
                                json.dumps(MODEL), 3))
    assert out["cached"] > (len(PROMPT) - 1) // 8 * 8
    cache.close()


def test_crop_is_a_speculative_rollback(conn, model_id):
    model = RefDecoder(**MODEL)
    p = _pool(conn, model_id)
    cache, _ = KvdCache.for_prompt(p, PROMPT)
    plain = PlainCache(np.float32)
    model.forward(np.array([PROMPT]), cache, 0)
    model.forward(np.array([PROMPT]), plain, 0)
    n = len(PROMPT)
    assert cache.committed_tokens == 32
    # draft 6 tokens (they complete block 4: tokens 32..39), verify, keep 2
    drafts = [5, 6, 7, 8, 9, 10]
    cache.append_tokens(drafts)
    model.forward(np.array([drafts]), cache, n)
    model.forward(np.array([drafts]), plain, n)
    assert cache.committed_tokens == 40
    cache.crop(n + 2)
    plain.crop(n + 2)
    assert cache.get_seq_length() == n + 2 == len(cache.sequences[0])
    # the cut fell inside committed block 4: its first tokens were kept in a fresh block
    assert cache.committed_tokens == 32
    nxt = [11]
    cache.append_tokens(nxt)
    a = model.forward(np.array([nxt]), cache, n + 2)
    b = model.forward(np.array([nxt]), plain, n + 2)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-9)
    cache.crop(-3)
    plain.crop(-3)
    assert cache.get_seq_length() == n
    cache.append_tokens([12])
    a = model.forward(np.array([[12]]), cache, n)
    b = model.forward(np.array([[12]]), plain, n)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-9)
    cache.crop(100)  # longer than the cache: nothing
    assert cache.get_seq_length() == n + 1


def test_batch_rows_are_sequences(conn, model_id):
    model = RefDecoder(**MODEL)
    p = _pool(conn, model_id)
    rows = np.array([PROMPT[:24], PROMPT[5:29]])
    # row 0's prefix is cached already: for_prompt keeps both rows at the common length
    c0, _ = KvdCache.for_prompt(p, rows[0])
    model.forward(rows[:1], c0, 0)
    cache, cached = KvdCache.for_prompt(p, rows)
    assert cached == 0 and cache.batch_size == 2
    plain = PlainCache(np.float32)
    a = model.forward(rows, cache, 0)
    b = model.forward(rows, plain, 0)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-9)
    for step in range(10):
        nxt = np.argmax(a[:, -1], axis=-1)[:, None]
        cache.append_tokens(nxt)
        a = model.forward(nxt, cache, 24 + step)
        b = model.forward(nxt, plain, 24 + step)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-9)
    assert len(cache.sequences) == 2 and all(len(s) == 34 for s in cache.sequences)
    indptr, indices, last = kvclient.export_csr(cache.sequences)
    assert list(indptr) == [0, 5, 10] and list(last) == [2, 2]
    c0.close()
    cache.close()


def test_cache_raises_after_detach(conn, model_id):
    p = _pool(conn, model_id)
    cache, _ = KvdCache.for_prompt(p, PROMPT)
    p.detach()
    k = np.zeros((1, 2, 1, 16), np.float32)
    with pytest.raises(kvclient.KvdDetached):
        cache.update(k, k, 0)
    with pytest.raises(kvclient.KvdDetached):
        cache.append_tokens([1])


def test_unsupported_pools_are_refused(conn, model_id):
    with pytest.raises(kvclient.KvdNotSupported):
        KvdCache(_pool(conn, model_id, dtype="bf16"))
    p = conn.attach(model_id + "bm", layers=1, kv_heads=1, head_dim=8, tokens_per_block=4,
                    arrangement="block_major")
    with pytest.raises(kvclient.KvdNotSupported):
        KvdCache(p)
