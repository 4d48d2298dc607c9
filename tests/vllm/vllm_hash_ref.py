#!/usr/bin/python3
"""Independent reference for vLLM's "sha256_cbor" block hashes (vLLM v0.10.2+, the bytes era).

Written from vLLM's documented behaviour (vllm/v1/core/kv_cache_utils.py, vllm/utils/hashing.py)
with only cbor2 (Debian python3-cbor2) and hashlib; it does not import kvd's code, so it can
check common/kv_vllm_hash.c:

    sha256_cbor(x) = sha256(cbor2.dumps(x, canonical=True)).digest()       # all 32 bytes
    NONE_HASH      = sha256_cbor(PYTHONHASHSEED)                           # the env *string*
    block hash     = sha256_cbor((parent, tuple(token_ids), extra_keys))   # extra_keys: None or tuple
    published int  = int.from_bytes(digest, "big") & (2**64 - 1)           # KV events' default form

Run as a script it prints the test vectors as the Markdown table of docs/HASH.md ("vLLM mode");
tests/vllm/test_vllm_hash_ref.py checks the same vectors against literal hex, and
common/kv_vllm_hash_test.c checks the C code against that hex.
"""

import hashlib

import cbor2

HASH_BYTES = 32


def sha256_cbor(obj) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def none_hash(seed: str) -> bytes:
    """Block 0's parent when vLLM runs with PYTHONHASHSEED=seed."""
    return sha256_cbor(seed)


def _extra(extra_keys):
    # vLLM passes None when a block has no extra keys, never an empty tuple.
    if extra_keys is None or len(extra_keys) == 0:
        return None
    return tuple(extra_keys)


def block_input(parent: bytes, tokens, extra_keys=None) -> bytes:
    """The CBOR bytes that are hashed for one block."""
    assert isinstance(parent, bytes) and len(parent) == HASH_BYTES
    return cbor2.dumps((parent, tuple(tokens), _extra(extra_keys)), canonical=True)


def hash_block(parent: bytes, tokens, extra_keys=None) -> bytes:
    return hashlib.sha256(block_input(parent, tokens, extra_keys)).digest()


def hash_chain(none: bytes, tokens, block_size: int, extra_keys=None) -> list:
    """Hashes of the full blocks of tokens, the same extra keys on every block."""
    out = []
    parent = none
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start : start + block_size], extra_keys)
        out.append(parent)
    return out


def to_u64(h: bytes) -> int:
    """The 64-bit form vLLM publishes in KV events by default: the last 8 bytes, big-endian."""
    return int.from_bytes(h, "big") & ((1 << 64) - 1)


def to_key(h: bytes) -> tuple:
    """kvd's 128-bit index key (lo, hi): digest bytes 0..7 and 8..15, each little-endian."""
    return int.from_bytes(h[0:8], "little"), int.from_bytes(h[8:16], "little")


# The ones the tables and tests share. Each entry: (id, description, digest function).
EXTRA_MAX = tuple(chr(ord("a") + i) * 256 for i in range(8))  # 8 keys of 256 bytes
TOKENS_WIDE = (70000, 4294967295, 23, 24)
TOKENS_ALL_HEADS = (0, 23, 24, 255, 256, 65535, 65536, 4294967295)
TOKENS_EXAMPLE = (1, 24, 1000, 70000)
TOKENS_300 = tuple(range(100000, 100300))


def vectors():
    """Yields (id, parent, extra, tokens, digest) rows; parents are named for the table."""
    n0 = none_hash("0")
    yield ("N0", "-", "-", 'NONE_HASH, seed "0"', n0)
    yield ("N1", "-", "-", 'NONE_HASH, seed "1234"', none_hash("1234"))
    chain = hash_chain(n0, list(range(1, 33)), 16)
    yield ("C0", "N0", "none", "1..16", chain[0])
    yield ("C1", "C0", "none", "17..32", chain[1])
    seq = tuple(range(1, 17))
    yield ("E1", "N0", '("lora-a",)', "1..16", hash_block(n0, seq, ("lora-a",)))
    yield ("E2", "N0", '("lora-a", "salt")', "1..16", hash_block(n0, seq, ("lora-a", "salt")))
    yield ("E3", "N0", '("café-ü",) (8 bytes)', "1..16", hash_block(n0, seq, ("café-ü",)))
    yield ("E4", "N0", "8 keys: 256 x `a` .. 256 x `h`", "1..16", hash_block(n0, seq, EXTRA_MAX))
    yield ("W1", "N0", "none", ", ".join(map(str, TOKENS_WIDE)), hash_block(n0, TOKENS_WIDE))
    yield (
        "W2",
        "N0",
        "none",
        ", ".join(map(str, TOKENS_ALL_HEADS)),
        hash_block(n0, TOKENS_ALL_HEADS),
    )
    yield (
        "X1",
        "N0",
        '("lora-a",)',
        ", ".join(map(str, TOKENS_EXAMPLE)),
        hash_block(n0, TOKENS_EXAMPLE, ("lora-a",)),
    )
    yield ("L1", "N0", "none", "100000..100299 (300 tokens)", hash_block(n0, TOKENS_300))


def markdown_table() -> str:
    lines = [
        "| # | parent | extra_keys | tokens | digest (hex, 32 bytes) | u64 form |",
        "|---|---|---|---|---|---|",
    ]
    for vid, parent, extra, tokens, h in vectors():
        lines.append(
            "| %s | %s | %s | %s | `%s` | %d |" % (vid, parent, extra, tokens, h.hex(), to_u64(h))
        )
    return "\n".join(lines)


def _example() -> str:
    n0 = none_hash("0")
    data = block_input(n0, TOKENS_EXAMPLE, ("lora-a",))
    return "X1 input (%d bytes): %s" % (len(data), data.hex())


if __name__ == "__main__":
    print(markdown_table())
    print()
    print(_example())
