"""The binding on a daemon in hash-mode vllm (docs/HASH.md, vLLM mode): the pool's vLLM digests
equal the independent Python reference (tests/vllm/vllm_hash_ref.py: cbor2 + hashlib), its
keys are their first 16 bytes, a commit without the digests is refused (EINVAL) and one with
them is found again; a Sequence does it all by itself."""

import os
import sys

import pytest

import kvclient

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "tests", "vllm"))
vref = pytest.importorskip("vllm_hash_ref")  # needs python3-cbor2

SHAPE = dict(layers=2, kv_heads=2, head_dim=8, tokens_per_block=4, dtype="fp16")


def _key(d):
    return (int.from_bytes(d[:8], "little"), int.from_bytes(d[8:16], "little"))


def test_vllm_pool_hashes_like_the_reference(kvd_factory):
    d = kvd_factory(hash_mode="vllm", vllm_hash_seed="0")
    with d.connect() as c:
        p = c.attach("vllm-py", **SHAPE)
        assert p.hash_algo == 3
        none = vref.none_hash("0")
        assert p.vllm_none_hash() == none
        assert p.hash_seed == _key(none)
        toks = list(range(1, 13))
        digests = p.vllm_hash_tokens(toks)
        assert digests == vref.hash_chain(none, toks, 4)
        assert p.vllm_hash_next(digests[0], toks[4:8]) == digests[1]
        assert p.vllm_hash_next(None, toks[:4]) == digests[0]
        keys = p.hash_tokens(toks)
        assert [tuple(k) for k in keys] == [_key(x) for x in digests]
        with pytest.raises(kvclient.KvdError):
            p.hash_next(keys[0], toks[4:8])  # a key cannot be extended (ENOTSUP)
        assert p.vllm_hash_tokens(toks, extra=b"lora-a") == vref.hash_chain(
            none, toks, 4, ("lora-a",))

        b = p.allocate(3)
        with pytest.raises(kvclient.KvdError) as e:
            p.commit(b, keys)  # no digests: EINVAL
        assert "hash_full" in str(e.value)
        canon = p.commit(b, keys, digests=digests, tokens=toks)
        hit = p.lookup(keys)
        assert len(hit) == 3
        p.release(hit)
        p.release(canon)
        with pytest.raises(ValueError):
            p.commit(p.allocate(1), keys[:1], digests=[b"x" * 31])
        # A batch commit takes the digests as well.
        more = list(range(100, 108))
        dg2 = p.vllm_hash_tokens(more)
        k2 = p.hash_tokens(more)
        b2 = p.allocate(2)
        bt = c.batch()
        req = bt.commit(p, b2, k2, digests=dg2)
        bt.run()
        assert len(req.result()) == 2
        bt.free()


def test_vllm_sequence(kvd_factory):
    d = kvd_factory(hash_mode="vllm", vllm_hash_seed="1234")
    with d.connect() as c:
        p = c.attach("vllm-seq-py", **SHAPE)
        toks = list(range(500, 521))
        s = p.sequence(64, extra=b"lora-a")
        s.prefill(toks)
        s.commit()
        s2 = p.sequence(64, extra=b"lora-a")
        assert s2.prefill(toks) == 20  # 5 full blocks before the last token
        digests = vref.hash_chain(vref.none_hash("1234"), toks, 4, ("lora-a",))
        keys = p.hash_tokens(toks, extra=b"lora-a")
        assert [tuple(k) for k in keys] == [_key(x) for x in digests]
        hit = p.lookup(keys)
        assert len(hit) == 5
        p.release(hit)
        s2.free()
        s.free()
