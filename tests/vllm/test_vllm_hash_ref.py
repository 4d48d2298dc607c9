"""Keeps the Python reference (vllm_hash_ref.py) and the literal vectors in sync.

The same hex is written in common/kv_vllm_hash_test.c and in docs/HASH.md ("vLLM mode"), so a
change to the reference that moves a digest fails here, and a typo in the copied hex fails there.
Run: pytest-3 tests/vllm (Debian python3-pytest, python3-cbor2).
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vllm_hash_ref as ref  # noqa: E402

# id -> (digest hex, u64 form), as in common/kv_vllm_hash_test.c.
WANT = {
    "N0": ("4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e", 17921330210090130494),
    "N1": ("dfa66c9da4dad0601316e0b63a2909b4068e72830385ddbd16e0c980c76c9e12", 1648539018556382738),
    "C0": ("202da172482d928bbc42ab25b0151e2b895f13f41002e27b2ceabcfae6d332ea", 3236607068019569386),
    "C1": ("4a0a393805c6d2f0ed831000d41bb65980336c4c04895d5e26470bbec927f5bf", 2758186210834249151),
    "E1": ("299bba42a4abf75c4002c66cf42b9bff3bdcf5452cdc6826e01a1ca3ec1218ea", 16148250904256190698),
    "E2": ("7c8449dc50d644bae8a0f8a1f60e3ca033cc3c923fab2cd1cece5b1e27f0fce9", 14901948402092801257),
    "E3": ("5d346543b40b63ce19d23c35f4c212d0caf9d23b954e1b5aead9f5289fa795fb", 16922826629647406587),
    "E4": ("2a2bf3872739de2df68837a677fd9b69b4f15070f743b0c5e3b5e103a83a4f31", 16408268223217815345),
    "W1": ("e67563b12b7a302bb7911742d9726f71223631f0750a3abe1bf5d64a1bc94f21", 2014752022100266785),
    "W2": ("39532d759036eca7efd7a6e039e216836a50436ef6b04f2f261c9e2f453fb3ec", 2746243798651614188),
    "X1": ("162f742a0a76cfe60ad43f8a53bf42366139d1895b1f6eb1bff16ed00b25de27", 13830957770450787879),
    "L1": ("3f6ccd25fb997691ca4a0827cca6734935e587296ec13d126579131f51ebaee9", 7311896495252025065),
}

# The CBOR input of vector X1, byte for byte as docs/HASH.md explains it.
X1_INPUT = (
    "83"  # array(3)
    "5820"  # bytes(32): the parent
    "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
    "84"  # array(4): the tokens
    "01"  # 1
    "1818"  # 24
    "1903e8"  # 1000
    "1a00011170"  # 70000
    "81"  # array(1): extra_keys
    "66" + "6c6f72612d61"  # text(6) "lora-a"
)


def test_vectors_match_literals():
    got = {vid: h for vid, _, _, _, h in ref.vectors()}
    assert set(got) == set(WANT)
    for vid, (hexd, u64) in WANT.items():
        assert got[vid].hex() == hexd, vid
        assert ref.to_u64(got[vid]) == u64, vid


def test_none_hash_is_sha256_of_cbor_text():
    import hashlib

    assert ref.none_hash("0") == hashlib.sha256(bytes([0x61, 0x30])).digest()


def test_x1_input_bytes():
    n0 = ref.none_hash("0")
    assert ref.block_input(n0, ref.TOKENS_EXAMPLE, ("lora-a",)).hex() == X1_INPUT


def test_empty_extra_is_null():
    n0 = ref.none_hash("0")
    data = ref.block_input(n0, (1, 2), ())
    assert data[-1] == 0xF6
    assert ref.hash_block(n0, (1, 2), ()) == ref.hash_block(n0, (1, 2), None)


def test_chain_drops_partial_block_and_links():
    n0 = ref.none_hash("0")
    toks = list(range(1, 41))
    chain = ref.hash_chain(n0, toks, 16, ("k",))
    assert len(chain) == 2
    assert chain[0] == ref.hash_block(n0, toks[:16], ("k",))
    assert chain[1] == ref.hash_block(chain[0], toks[16:32], ("k",))


def test_key_is_first_16_bytes_little_endian():
    h = bytes(range(32))
    lo, hi = ref.to_key(h)
    assert lo == 0x0706050403020100
    assert hi == 0x0F0E0D0C0B0A0908
    assert ref.to_u64(h) == 0x18191A1B1C1D1E1F


def test_parent_must_be_32_bytes():
    with pytest.raises(AssertionError):
        ref.block_input(b"\0" * 16, (1,))
