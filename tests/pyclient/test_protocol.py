"""Conformance tests of a real kvd against proto/PROTOCOL.md, using the kvdwire client.

Every test starts its own daemon (conftest.py: host backend, 8 MiB pool memory, 256 KiB
segments unless a test asks otherwise). Section numbers (§) are those of PROTOCOL.md. Tests that
show the daemon disagreeing with the spec are marked xfail(strict=True) with the finding, so the
suite passes while the finding stands and fails loudly (XPASS) once it is fixed (none at present:
the findings of the first runs were fixed in the daemon or settled in the spec).
"""

import contextlib
import errno
import json
import math
import mmap
import os
import select
import shutil
import socket
import stat
import struct
import subprocess
import threading
import time

import pytest

import kvdwire as kw
from conftest import (UID_A, UID_B, Child, kvd_binary, run_kvd_expecting_refusal,
                      signal_ready, wait_until, world_traversable)
from kvdwire import pb

LAYOUT = kw.Layout(2, 2, 8, 16, pb.FP16, pb.LAYER_MAJOR)  # 2048-byte blocks, 128 per segment
T = LAYOUT.tokens_per_block
PAGE = kw.PAGE
ME = os.geteuid()

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not world_traversable(os.environ.get("KVDPY_BASE") or "/tmp"),
    reason="needs root to setuid children, and a socket directory other uids can reach")

# The memory budget (§6 AttachPool, "Pools") counts resident segment memory and pool metadata:
# 64 bytes per block of every live segment (parked ones too) and "a few KiB per pool". A
# segment of LAYOUT (128 blocks at the conftest's 256 KiB segment-bytes) therefore costs
# SEG_COST, and budgets leave POOL_META per pool for the per-pool part (assumed at most 16 KiB;
# see the report: "a few KiB" is not a number).
SEG_BLOCKS = 128
SEG_COST = LAYOUT.segment_bytes(SEG_BLOCKS) + 64 * SEG_BLOCKS
POOL_META = 16 * 1024


def budget(segments, pools=1):
    """pool-memory for `segments` LAYOUT segments over `pools` pools, and not one more."""
    return str(segments * SEG_COST + pools * POOL_META)


@contextlib.contextmanager
def kvd_error(code):
    """Expects an Error reply with `code` and a non-empty message (§7)."""
    with pytest.raises(kw.KvdError) as info:
        yield info
    assert info.value.name == kw.ERR_NAMES[code], str(info.value)
    assert info.value.message.strip(), "empty Error.message"


def toks(nblocks, base=0, tpb=T):
    return list(range(base, base + nblocks * tpb))


def check_blocks(pool, blocks):
    """Every block handed out must lie in a segment this session was sent."""
    for bid, _ in blocks:
        pool.where(bid)


def allocate(conn, pool, count):
    """Allocate, fetching new segments as the reply says; returns [(id, gen)]."""
    r = conn.allocate(pool.pool_id, count)
    pool.follow(r)
    blocks = kw.reply_blocks(r)
    assert len(blocks) == count
    check_blocks(pool, blocks)
    return blocks


def lookup(conn, pool, hashes, **kw_):
    r = conn.lookup(pool.pool_id, hashes, **kw_)
    pool.follow(r)
    blocks = kw.reply_blocks(r)
    check_blocks(pool, blocks)
    return blocks


def write_commit(conn, pool, nblocks, base=0, extra=b""):
    """Allocates nblocks, writes a pattern per block, commits the chain of tokens
    base..base+nblocks*T; returns (canonical blocks, hashes, patterns)."""
    blocks = allocate(conn, pool, nblocks)
    hashes = kw.hash_chain(pool.hash_seed, toks(nblocks, base, pool.layout.tokens_per_block),
                           pool.layout.tokens_per_block, extra, pool.hash_algo)
    pats = [kw.block_pattern(pool.layout, kw.hash_hex(h)) for h in hashes]
    for (bid, _), pat in zip(blocks, pats):
        pool.write_block(bid, pat)
    entries, parent = [], kw.NO_PARENT
    for b, h in zip(blocks, hashes):
        entries.append((b, h, parent))
        parent = b[0]
    canon = conn.commit(pool.pool_id, entries)
    return canon, hashes, pats


def unused_id(total, blocks):
    """A block id of the pool (below blocks_total) that none of `blocks` has (§4: a client may
    assume no order of ids)."""
    used = {b for b, _ in blocks}
    return next(i for i in range(total) if i not in used)


def pool_stats(conn, pool):
    s = conn.stats(pool.pool_id)
    return {k[5:]: v for k, v in s.items() if k.startswith("pool.")}


def all_back(st):
    """No block of the pool is WRITING or referenced (COMMITTED)."""
    return (st["blocks_writing"] == 0 and st["blocks_committed"] == 0
            and st["blocks_free"] + st["blocks_cached"] + st.get("blocks_parked", 0)
            == st["blocks_total"])


def _seed(model, lay):
    """§9: the version 1 seed, XXH3-128 of model_id || le32 of the six shape fields."""
    data = model.encode() + struct.pack("<6I", *_shape_fields(lay.to_pb()))
    v = kw.xxhash.xxh3_128_intdigest(data)
    return v & kw.MASK64, v >> 64


def _shape_fields(m):
    return (m.num_layers, m.num_kv_heads, m.head_dim, m.tokens_per_block, m.dtype, m.arrangement)


# =============================================================================================
# Block hash (§9, docs/HASH.md)

VECTORS = [  # (name, algo, parent, extra, tokens, hex)
    ("1", 1, "zero", b"", range(1, 17), "e8abdae47543823695223d748af9dd05"),
    ("2", 1, "zero", b"lora:7", range(1, 17), "ccc3edce67c8baae5f13f39a39535c51"),
    ("3", 1, "zero", b"", [42], "fcf2b13a5d3b0fc5d994780ecb3def98"),
    ("4a", 1, "zero", b"", range(1000, 1016), "f8d6f8989e27a6f707fb4fd28b71c193"),
    ("4b", 1, "4a", b"", range(1016, 1032), "44b9cc41652e844d4df58caa7aac6346"),
    ("4c", 1, "4b", b"", range(1032, 1048), "9e9240a4c422f9818d1749a4d66a66e6"),
    ("5", 1, "S", b"", range(1, 17), "b07cc11d348412a1bc480b1af43a2e12"),
    ("6", 2, "S", b"lora:7", range(1, 17), "b6b02640e78f713516e08ae1a98c5def"),
    ("7", 1, "zero", b"", [], "2a8ac7e44ef93d74202329e27c5ce410"),
]
SEED_S = (0x0123456789abcdef, 0xfedcba9876543210)


def test_hash_vectors():
    """All 9 vectors of docs/HASH.md, from this module's own encoding of the chain input."""
    done = {}
    for name, algo, parent, extra, tokens, want in VECTORS:
        p = {"zero": (0, 0), "S": SEED_S}.get(parent) or done[parent]
        done[name] = kw.hash_block(p, list(tokens), extra, algo)
        assert kw.hash_hex(done[name]) == want, "vector " + name
    chain = kw.hash_chain((0, 0), list(range(1000, 1048)), 16)
    assert [kw.hash_hex(h) for h in chain] == [v[5] for v in VECTORS[3:6]]


def test_hash_input_examples():
    """The two byte-for-byte input examples and the hex example of docs/HASH.md."""
    assert kw.hash_input((0, 0), b"", [42]).hex() == \
        "0000000000000000000000000000000000000000010000002a000000"
    assert kw.hash_input(SEED_S, b"lora:7", [1, 2]).hex() == (
        "efcdab89674523011032547698badcfe060000006c6f72613a37020000000100000002000000")
    assert kw.hash_hex(SEED_S) == "efcdab89674523011032547698badcfe"
    assert len(kw.hash_input((0, 0), b"", list(range(16)))) == 88


def test_hash_seed_derivation(kvd):
    """§9: version 1 seeds are XXH3-128 of model_id || le32 shape fields; the same seed in
    every session; hash_algo 1."""
    c, other = kvd.connect(), kvd.connect()
    for model, lay in (("m", LAYOUT), ("other", kw.Layout(3, 1, 4, 3, pb.INT8, pb.BLOCK_MAJOR))):
        p = c.attach(model, lay)
        assert p.hash_seed == _seed(model, lay) == other.attach(model, lay).hash_seed
        assert p.hash_algo == 1
    with pytest.raises(kw.KvdError):
        kw.hash_block((0, 0), [1], extra=b"x" * 257)  # extra is at most 256 bytes


# =============================================================================================
# Handshake (§3, §4, §6 Hello)

def test_hello_reply(kvd_factory):
    """HelloReply: session id, tenant, domains, epoch, version, the configured limits, features."""
    d = kvd_factory(max_frame_bytes="65536", max_inflight="8", max_blocks_per_request="100")
    c = d.connect(hello=False)
    rid = c.send("hello", pb.Hello(protocol_version=1, client_name="t", features=1))
    env, _ = c.recv_frame()
    assert env.id == rid and env.WhichOneof("body") == "hello_reply"
    r = env.hello_reply
    assert r.session_id > 0
    assert r.tenant == "uid-%d" % os.geteuid()
    assert list(r.domains) == [r.tenant]
    assert r.boot_epoch != 0 and env.boot_epoch == r.boot_epoch
    assert r.protocol_version == 1
    assert (r.max_frame_bytes, r.max_inflight, r.max_blocks_per_request) == (65536, 8, 100)
    assert r.features & kw.FEATURE_PACKED
    assert d.admin_result("info")["boot_epoch"] == "%016x" % r.boot_epoch
    ids = {r.session_id} | {d.connect().hello_reply.session_id for _ in range(3)}
    assert len(ids) == 4, "session ids must be unique"


def test_hello_defaults(kvd):
    """§11 defaults as HelloReply reports them."""
    r = kvd.connect().hello_reply
    assert (r.max_frame_bytes, r.max_inflight, r.max_blocks_per_request) == (1048576, 64, 4096)


def test_bad_version_keeps_session_new(kvd):
    """EVERSION for versions 0 and 2 with the request's id; the session stays NEW (other
    requests are EPROTO) and a later Hello with version 1 succeeds."""
    c = kvd.connect(hello=False)
    for v in (0, 2, 0xFFFFFFFF):
        with kvd_error(kw.EVERSION) as e:
            c.hello(version=v)
        assert e.value.req_id == c.next_id - 1
    with kvd_error(kw.EPROTO):
        c.ping()
    assert c.hello().protocol_version == 1
    assert c.ping(nonce=5).nonce == 5


def test_requests_before_hello(kvd):
    """§3: every other request before Hello is EPROTO with its id; the connection stays."""
    c = kvd.connect(hello=False)
    for body in ("attach_pool", "lookup", "allocate", "commit", "release", "rewind", "pin",
                 "stats", "ping", "goodbye", "map_segments"):
        rid = c.send(body)
        with kvd_error(kw.EPROTO) as e:
            c.recv()
        assert e.value.req_id == rid, body
    c.hello()
    assert c.ping(nonce=9).nonce == 9


def test_second_hello(kvd):
    """§3: a second Hello is ESTATE; the session keeps working under its first identity."""
    c = kvd.connect()
    sid = c.hello_reply.session_id
    with kvd_error(kw.ESTATE):
        c.hello()
    assert c.stats()["session.id"] == sid


def test_hello_field_limits(kvd):
    """client_name at most 64 bytes, token at most 256 (EINVAL), an unknown token EAUTH;
    unknown feature bits are ignored."""
    kvd.connect(name="n" * 64)
    with kvd_error(kw.EINVAL):
        kvd.connect(name="n" * 65)
    with kvd_error(kw.EINVAL):
        kvd.connect(token=b"t" * 257)
    with kvd_error(kw.EAUTH):
        kvd.connect(token=b"t" * 32)
    c = kvd.connect(features=0xFFFFFFFE)  # everything but PACKED
    pool = c.attach("m", LAYOUT)
    r = c.allocate(pool.pool_id, 2)
    assert len(r.blocks) == 2 and not r.blocks_packed
    c = kvd.connect(features=0xFFFFFFFF)
    r = c.allocate(c.attach("m", LAYOUT).pool_id, 2)
    assert len(r.blocks_packed) == 16 and not r.blocks


def test_boot_epoch(kvd):
    """§4: a non-zero envelope epoch that differs is EEPOCH, before everything (Hello too);
    0 and the right epoch are accepted; every reply, errors with id 0 included, carries it."""
    c = kvd.connect(hello=False)
    with kvd_error(kw.EEPOCH):
        c.call("hello", pb.Hello(protocol_version=1), epoch=0x1234)
    r = c.hello()
    with kvd_error(kw.EEPOCH):
        c.call("ping", pb.Ping(), epoch=r.boot_epoch ^ 1)
    with kvd_error(kw.EEPOCH):  # checked before the body: even a malformed Allocate
        c.call("allocate", pb.Allocate(pool_id=12345, count=0), epoch=r.boot_epoch ^ 1)
    c.call("ping", pb.Ping(nonce=1), epoch=0)
    c.call("ping", pb.Ping(nonce=1), epoch=r.boot_epoch)
    c.send_raw(c.frame(b"\xff"))
    env, _ = c.recv_frame()
    assert env.id == 0 and env.boot_epoch == r.boot_epoch and env.error.code == kw.EPROTO


def test_goodbye_closes(kvd):
    """§3: Goodbye gets GoodbyeReply, then the daemon closes; held blocks are freed. Requests
    pipelined before it (in the same write) are answered first; requests pipelined after it
    are not handled and get no reply: a Commit sent after the Goodbye commits nothing (the
    block was freed with the session, not cached), an AttachPool after it makes no pool."""
    o = kvd.connect()
    po = o.attach("m", LAYOUT)  # keeps the pool alive after c leaves
    c = kvd.connect()
    pool = c.attach("m", LAYOUT)
    blocks = allocate(c, pool, 5)
    h = kw.hash_block(pool.hash_seed, toks(1))
    commit = pb.Commit(pool_id=pool.pool_id)
    commit.entries.add(block=pb.BlockRef(id=blocks[0][0], gen=blocks[0][1]),
                       hash=pb.Hash128(lo=h[0], hi=h[1]), parent=kw.NO_PARENT)
    before = [c.envelope("ping", pb.Ping(nonce=1)),
              c.envelope("allocate", pb.Allocate(pool_id=pool.pool_id, count=1))]
    bye = c.envelope("goodbye", pb.Goodbye())
    after = [c.envelope("ping", pb.Ping(nonce=2)), c.envelope("commit", commit),
             c.envelope("attach_pool", pb.AttachPool(model_id="after-bye",
                                                     layout=LAYOUT.to_pb()))]
    c.send_raw(b"".join(c.frame(e.SerializeToString()) for e in before + [bye] + after))
    assert c.recv(before[0].id)[1].nonce == 1
    assert c.recv(before[1].id)[0] == "allocate_reply"
    assert c.recv(bye.id)[0] == "goodbye_reply"
    with kvd_error(kw.ECLOSED):
        c.recv()
    assert wait_until(lambda: o.stats()["daemon.sessions"] == 1)
    assert pool_stats(o, po)["blocks_writing"] == 0 and all_back(pool_stats(o, po))
    assert lookup(o, po, [h]) == []  # the Commit after Goodbye was not handled
    assert [p["model"] for p in kvd.admin_result("pools")["pools"]] == ["m"]


def test_max_connections_ebusy(kvd_factory):
    """§5: connections beyond max-connections get one Error{EBUSY} with id 0, then close."""
    d = kvd_factory(max_connections="2")
    a, b = d.connect(), d.connect()
    x = kw.Conn(d.sock)
    env, _ = x.recv_frame()
    assert (env.id, env.error.code) == (0, kw.EBUSY)
    with kvd_error(kw.ECLOSED):
        x.recv_frame()
    b.close()
    assert wait_until(lambda: d.admin_result("stats")["daemon"]["sessions"] == 1)
    d.connect()
    assert a.ping(nonce=1).nonce == 1


def _try_hello(d):
    try:
        d.connect()
        return True
    except kw.KvdError:
        return False


def test_max_sessions_equota(kvd_factory):
    """§6 Hello: a tenant at max-sessions gets EQUOTA naming the limit."""
    d = kvd_factory(tenants="quota default max-sessions=2\n")
    a, b = d.connect(), d.connect()
    with kvd_error(kw.EQUOTA) as e:
        d.connect()
    assert "max-sessions" in e.value.message
    assert b.ping(nonce=1).nonce == 1
    a.close()
    assert wait_until(lambda: _try_hello(d))


# =============================================================================================
# Data path: attach, allocate, write, commit, another process reads (§6)

SHAPES = [
    kw.Layout(2, 2, 8, 16, pb.FP16, pb.LAYER_MAJOR),
    kw.Layout(3, 2, 8, 4, pb.BF16, pb.BLOCK_MAJOR),
    kw.Layout(2, 3, 4, 5, pb.INT8, pb.LAYER_MAJOR),
    kw.Layout(2, 3, 4, 5, pb.FP8_E4M3, pb.BLOCK_MAJOR),
    kw.Layout(1, 1, 3, 2, pb.FP32, pb.LAYER_MAJOR),
]


def _shape_id(lay):
    return "%dx%dx%dx%d-%s-%s" % (lay.num_layers, lay.num_kv_heads, lay.head_dim,
                                  lay.tokens_per_block, pb.DType.Name(lay.dtype),
                                  pb.Arrangement.Name(lay.arrangement))


def _expected_bps(lay, segment_bytes):
    """§6 AttachPool: floor(segment-bytes / block_bytes) (at most 65536), rounded down to a
    multiple of m, but at least m, where m is the smallest count that makes m * kv_block_bytes
    a multiple of the page size (host backend)."""
    m = PAGE // math.gcd(lay.kv_block_bytes, PAGE)
    n = min(segment_bytes // lay.block_bytes, 65536) // m * m
    return max(n, m)


@pytest.mark.parametrize("lay", SHAPES + [kw.Layout(5, 3, 12, 7, pb.FP8_E4M3, pb.LAYER_MAJOR),
                                          kw.Layout(8, 8, 128, 16, pb.BF16, pb.BLOCK_MAJOR)],
                         ids=_shape_id)
def test_attach_reply_shape(kvd, lay):
    """AttachPoolReply: block_bytes, blocks_per_segment (page-aligned sections), segment bytes,
    kind, at least one segment, pool id > 0, max_segments > 0, no linked pools."""
    c = kvd.connect()
    pool = c.attach("shape", lay)
    r = pool.attach_reply
    assert r.pool_id > 0
    assert r.layout.block_bytes == lay.block_bytes
    assert _shape_fields(r.layout) == _shape_fields(lay.to_pb())
    assert r.blocks_per_segment * lay.kv_block_bytes % PAGE == 0
    assert r.blocks_per_segment == _expected_bps(lay, 256 * 1024)
    assert len(r.segments) >= 1 and r.max_segments > 0 and not r.linked
    for i, s in enumerate(r.segments):
        assert (s.index, s.nblocks, s.kind, s.read_only) == (i, r.blocks_per_segment,
                                                            pb.HOST_MEMFD, False)
        assert s.bytes == lay.segment_bytes(s.nblocks)


def _reader(ready_w, sock, model, lay, hashes, pats):
    """Child: attach, look up the hashes, read every block through its own mapping."""
    c = kw.Conn(sock)
    c.hello(name="reader")
    pool = c.attach(model, lay)
    blocks = lookup(c, pool, hashes)
    got = [pool.read_block(b) == p for (b, _), p in zip(blocks, pats)]
    return len(blocks), got, os.getpid()


@pytest.mark.parametrize("lay", SHAPES, ids=_shape_id)
def test_second_process_reads_committed_bytes(kvd, lay):
    """Write through our mmap, commit, and a second process finds the same hashes and reads
    the same bytes through its own mapping of the segments it was sent."""
    c = kvd.connect()
    pool = c.attach("shared-model", lay)
    allocate(c, pool, 3)  # so the blocks under test are not at slot 0
    canon, hashes, pats = write_commit(c, pool, 6, base=100)
    n, got, _ = Child(_reader, kvd.sock, "shared-model", lay, hashes, pats).result()
    assert n == 6 and all(got)


def test_second_model_with_linked_pools(kvd_factory):
    """A tenant in a group, with the commons: each AttachPool records three pools in the
    session (private, group, commons). The second model's attach grows the session's pool table
    while it records them; the reply is sent from the table as it is after (it was sent from the
    entry before the table moved: kvd wrote into freed memory and the second model's private
    pool never recorded its segment, so its Allocate met ESTATE)."""
    d = kvd_factory(tenants="tenant alice uid=%d\ngroup g members=alice\ncommons\n"
                    % os.geteuid())
    c = d.connect()
    pools = [c.attach("m-link-%d" % k, LAYOUT) for k in range(3)]
    for pool in pools:
        (b,) = allocate(c, pool, 1)
        pool.write_block(b[0], b"x" * LAYOUT.block_bytes)
        c.release(pool.pool_id, [b])
    assert c.ping(nonce=9).nonce == 9 and d.alive()


@needs_root
@pytest.mark.parametrize("lay", SHAPES, ids=_shape_id)
def test_layout_matches_daemon_commons_copy(kvd_factory, lay):
    """Checks this client's element offsets against the daemon's: two tenants commit the same
    block (written through our offsets, at slot != 0) so kvd copies it run by run into the
    commons (docs/TENANCY.md); a third tenant reads the commons copy through our offsets and
    gets the same bytes, and zeros everywhere else in the segment. Also: commons segments are
    read-only fds (mode 0400, no O_RDWR reopen, mmap PROT_WRITE fails with EACCES), the hit
    announces the commons segments in linked_segments, and Allocate/Commit/Pin in the commons
    are EPERM. The first writer stays connected until the second committed (see
    test_commons_count_survives_idle_commons_pool for why)."""
    d = kvd_factory(tenants="tenant alice uid=%d\ntenant bob uid=%d\ncommons min-tenants=2\n"
                    % (UID_A, UID_B))
    hashes = kw.hash_chain(_seed("cm", lay), toks(2, 7, lay.tokens_per_block),
                           lay.tokens_per_block)
    pats = [kw.block_pattern(lay, kw.hash_hex(h)) for h in hashes]

    def writer(ready_w, skip, hold):
        c = kw.Conn(d.sock)
        c.hello()
        pool = c.attach("cm", lay)
        allocate(c, pool, skip)
        blocks = allocate(c, pool, 2)
        for (bid, _), p in zip(blocks, pats):
            pool.write_block(bid, p)
        c.commit(pool.pool_id, [(blocks[0], hashes[0], kw.NO_PARENT),
                                (blocks[1], hashes[1], blocks[0][0])])
        if hold:
            signal_ready(ready_w, c.hello_reply.tenant)
            time.sleep(30)
        return c.hello_reply.tenant

    def reader(ready_w):
        c = kw.Conn(d.sock)
        r = c.hello()
        pool = c.attach("cm", lay)
        linked = list(pool.attach_reply.linked)
        assert [(x.domain, x.read_only) for x in linked] == [("commons", True)], linked
        assert list(r.domains) == [r.tenant, "commons"]
        assert lookup(c, pool, hashes) == []  # private pool only: no hit
        rep = c.lookup(pool.pool_id, hashes, search_domains=True)
        blocks = kw.reply_blocks(rep)
        assert list(rep.pool_ids) == [linked[0].pool_id] * len(blocks), rep
        assert [(n.pool_id, n.first_index) for n in rep.linked_segments] == \
            [(linked[0].pool_id, 0)], rep
        commons = c.linked_pool(pool, linked[0])
        assert all(s.read_only for s, _ in commons.segments.values())
        same = [commons.read_block(b) == p for (b, _), p in zip(blocks, pats)]
        same.append(_zero_outside(commons, [b for b, _ in blocks]))
        # the fd is read-only: a writable shared mapping must fail with EACCES
        fds_ok = _commons_fd_read_only(c, linked[0].pool_id)
        errs = []
        for body, msg in (("allocate", pb.Allocate(pool_id=commons.pool_id, count=1)),
                          ("pin", pb.Pin(pool_id=commons.pool_id, blocks=kw._refs(blocks[:1]))),
                          ("commit", pb.Commit(pool_id=commons.pool_id))):
            try:
                c.call(body, msg)
                errs.append((body, "OK"))
            except kw.KvdError as e:
                errs.append((body, e.name))
        c.release(commons.pool_id, blocks)
        return len(blocks), same, fds_ok, errs

    first = Child(writer, 3, True, uid=UID_A)
    try:
        assert first.wait_ready() == "alice"
        assert Child(writer, 5, False, uid=UID_B).result() == "bob"
        n, same, fds_ok, errs = Child(reader, uid=UID_B + 1).result()
    finally:
        first.kill()
    assert n == 2 and all(same), (n, same)
    assert fds_ok == "EACCES"
    assert errs == [("allocate", "EPERM"), ("pin", "EPERM"), ("commit", "EPERM")]


def _zero_outside(pool, block_ids):
    """True if every byte of the pool's mapped segments outside the runs of block_ids is 0
    (the daemon copied nothing to where this client's layout does not put those blocks)."""
    for index, (seg, m) in pool.segments.items():
        data = bytearray(m[:])
        for bid in block_ids:
            if bid // pool.bps == index:
                for off, n in pool.layout.block_runs(seg.nblocks, bid % pool.bps):
                    data[off:off + n] = bytes(n)
        if any(data):
            return False
    return True


def _commons_fd_read_only(conn, pool_id):
    """docs/TENANCY.md: a commons fd is a read-only file description of a 0400 memfd, so a
    writable shared mapping fails (EACCES) and so does reopening it O_RDWR (non-root).
    Returns the errno name of the mmap attempt, or what went wrong."""
    r, fds = conn.map_segments(pool_id, 0)
    fd = fds[r.segments[0].fd_index]
    try:
        if os.fstat(fd).st_mode & 0o777 != 0o400:
            return "mode %o" % (os.fstat(fd).st_mode & 0o777)
        try:
            os.close(os.open("/proc/self/fd/%d" % fd, os.O_RDWR))
            return "reopened O_RDWR"
        except PermissionError:
            pass
        mmap.mmap(fd, r.segments[0].bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return "mapped writable"
    except OSError as e:
        return errno.errorcode[e.errno]
    finally:
        for fd in fds:
            os.close(fd)


def test_lookup_longest_prefix_and_references(kvd):
    """Lookup returns the longest cached leading run and takes one reference per block;
    a WRITING (uncommitted) block is not a hit."""
    c = kvd.connect()
    pool = c.attach("m", LAYOUT)
    canon, hashes, _ = write_commit(c, pool, 4)
    c.release(pool.pool_id, canon)
    other = (12345, 678)
    assert lookup(c, pool, hashes) == canon
    assert lookup(c, pool, hashes[:2] + [other] + hashes[3:]) == canon[:2]
    assert lookup(c, pool, [other] + hashes[1:]) == []
    assert pool_stats(c, pool)["session_refs"] == 6
    assert c.stats()["session.refs_held"] == 6
    c.release(pool.pool_id, canon + canon[:2])
    assert pool_stats(c, pool)["session_refs"] == 0
    w = allocate(c, pool, 1)
    h = kw.hash_block(hashes[-1], toks(1, 999))
    assert lookup(c, pool, hashes + [h]) == canon  # h is not committed
    c.commit(pool.pool_id, [(w[0], h, canon[-1][0])])
    assert lookup(c, pool, hashes + [h]) == canon + w
    c.release(pool.pool_id, canon + canon + w + w)
    assert pool_stats(c, pool)["session_refs"] == 0


def test_commit_duplicate_returns_canonical(kvd):
    """Commit of a hash another session committed first: the existing block is canonical,
    the reference moves to it and our own block is freed; its bytes are the first writer's."""
    a, b = kvd.connect(), kvd.connect()
    pa, pb_ = a.attach("m", LAYOUT), b.attach("m", LAYOUT)
    assert pa.pool_id == pb_.pool_id
    canon_a, hashes, pats = write_commit(a, pa, 3)
    before = pool_stats(b, pb_)
    mine = allocate(b, pb_, 3)
    canon_b = b.commit(pb_.pool_id, [(mine[0], hashes[0], kw.NO_PARENT),
                                     (mine[1], hashes[1], mine[0][0]),
                                     (mine[2], kw.hash_block(hashes[1], toks(1, 5000)),
                                      mine[1][0])])
    assert canon_b[:2] == canon_a[:2]
    assert canon_b[2] == mine[2]
    st = pool_stats(b, pb_)
    assert st["commits_duplicate"] - before["commits_duplicate"] == 2
    assert st["blocks_free"] == before["blocks_free"] - 1
    assert st["session_refs"] == 3
    assert [pb_.read_block(x) for x, _ in canon_b[:2]] == pats[:2]
    b.release(pb_.pool_id, canon_b)
    assert pool_stats(b, pb_)["session_refs"] == 0


def test_commit_parent_rewritten_to_canonical(kvd):
    """§6 Commit: a parent naming a block committed earlier in the same request is rewritten
    to that entry's canonical id (seen in the admin `prefixes` tree)."""
    a, b = kvd.connect(), kvd.connect()
    pa, pb_ = a.attach("m", LAYOUT), b.attach("m", LAYOUT)
    canon_a, hashes, _ = write_commit(a, pa, 1)
    mine = allocate(b, pb_, 2)
    h1 = kw.hash_block(hashes[0], toks(1, 77))
    canon = b.commit(pb_.pool_id, [(mine[0], hashes[0], kw.NO_PARENT),
                                   (mine[1], h1, mine[0][0])])
    assert canon == [canon_a[0], mine[1]]
    tree = kvd.admin_result("prefixes pool=%d levels=4" % pa.pool_id)["pools"][0]
    assert tree["prefixes"] == 1, tree
    root = tree["top"][0]
    assert root["block"] == canon_a[0][0] and root["size"] == 2, tree


def test_release_rewind_and_writing_blocks(kvd):
    """Release / Rewind drop one reference per listing; a WRITING block released is freed;
    listing a block k times drops k references; both list forms. A freed block the session no
    longer holds is EPERM (§4: not held at all, whatever the gen), not ESTALE."""
    c = kvd.connect()
    pool = c.attach("m", LAYOUT)
    st0 = pool_stats(c, pool)
    w = allocate(c, pool, 4)
    c.rewind(pool.pool_id, w[:2], packed=True)
    c.release(pool.pool_id, w[2:], packed=False)
    st = pool_stats(c, pool)
    assert st["blocks_free"] == st0["blocks_free"] and st["blocks_writing"] == 0
    canon, hashes, _ = write_commit(c, pool, 2)
    lookup(c, pool, hashes)  # second reference on each
    c.release(pool.pool_id, [canon[0], canon[0]], packed=True)
    c.rewind(pool.pool_id, [canon[1], canon[1]], packed=False)
    st = pool_stats(c, pool)
    assert st["session_refs"] == 0 and st["blocks_cached"] == 2
    for blocks in (w[:1], [(w[0][0], w[0][1] ^ 1)], [(w[1][0], 0)]):
        with kvd_error(kw.EPERM):  # freed: no longer held, whatever the gen
            c.release(pool.pool_id, blocks)


def test_packed_and_repeated_forms_agree(kvd):
    """§6 Packed lists: the daemon accepts both request forms from every session; packed
    replies only to sessions that set the feature bit, BlockRefs to the others."""
    packed, plain = kvd.connect(features=1), kvd.connect(features=0)
    pp, pr = packed.attach("m", LAYOUT), plain.attach("m", LAYOUT)
    canon, hashes, _ = write_commit(packed, pp, 3)
    packed.release(pp.pool_id, canon)
    for form in (True, False):
        r = packed.lookup(pp.pool_id, hashes, packed=form)
        assert not r.blocks and kw.unpack_blocks(r.blocks_packed) == canon
        r = plain.lookup(pr.pool_id, hashes, packed=form)
        assert not r.blocks_packed and [(b.id, b.gen) for b in r.blocks] == canon
    r = plain.allocate(pr.pool_id, 2)
    assert len(r.blocks) == 2 and not r.blocks_packed
    packed.release(pp.pool_id, canon, packed=False)
    packed.rewind(pp.pool_id, canon, packed=True)
    plain.release(pr.pool_id, canon + canon, packed=True)
    plain.release(pr.pool_id, [(b.id, b.gen) for b in r.blocks], packed=True)
    assert pool_stats(plain, pr)["session_refs"] == 0


def _vllm_free_entries(pool, blocks, hashes):
    entries, parent = [], kw.NO_PARENT
    for b, h in zip(blocks, hashes):
        entries.append((b, h, parent))
        parent = b[0]
    return entries


def test_packed_commit_forms_agree(kvd):
    """§6 Packed lists: Commit.entries_packed commits what the repeated form does; the daemon
    takes it from every session and says so (HelloReply.features PACKED_COMMIT); replies are
    canonical_packed only to a session that set the bit, BlockRefs to others (naming the
    same canonical blocks), whichever form the request came in."""
    pc = kvd.connect(features=kw.FEATURE_PACKED | kw.FEATURE_PACKED_COMMIT)
    plain = kvd.connect(features=kw.FEATURE_PACKED)
    assert pc.hello_reply.features & kw.FEATURE_PACKED_COMMIT
    assert plain.hello_reply.features & kw.FEATURE_PACKED_COMMIT
    pp, pr = pc.attach("m", LAYOUT), plain.attach("m", LAYOUT)
    T = LAYOUT.tokens_per_block
    hashes = kw.hash_chain(pp.hash_seed, toks(3, 900, T), T, b"", pp.hash_algo)
    blocks = allocate(pc, pp, 3)
    pats = [kw.block_pattern(LAYOUT, kw.hash_hex(h)) for h in hashes]
    for (bid, _), pat in zip(blocks, pats):
        pp.write_block(bid, pat)
    r = pc.commit_reply(pp.pool_id, _vllm_free_entries(pp, blocks, hashes), packed=True)
    assert not r.canonical and kw.unpack_blocks(r.canonical_packed) == blocks
    hits = lookup(plain, pr, hashes)
    assert hits == blocks
    assert [pr.read_block(b) for b, _ in hits] == pats
    plain.release(pr.pool_id, hits)
    # The same chain from the other session, packed: its blocks are duplicates.
    mine = allocate(plain, pr, 3)
    r = plain.commit_reply(pr.pool_id, _vllm_free_entries(pr, mine, hashes), packed=True)
    assert not r.canonical_packed and [(b.id, b.gen) for b in r.canonical] == blocks
    plain.release(pr.pool_id, blocks)
    # A repeated-form request from the session that set the bit: a packed reply.
    more = kw.hash_chain(hashes[-1], toks(1, 5000, T), T, b"", pp.hash_algo)
    b = allocate(pc, pp, 1)
    r = pc.commit_reply(pp.pool_id, [(b[0], more[0], blocks[-1][0])])
    assert not r.canonical and kw.unpack_blocks(r.canonical_packed) == b
    pc.release(pp.pool_id, blocks + b)
    assert pool_stats(pc, pp)["session_refs"] == 0


def test_packed_commit_errors(kvd):
    """§6 Packed lists: entries_packed of a length that is not whole 28-byte records, both forms
    at once, hash_full_packed or token_ids_packed not one record per entry, a companion field
    without entries_packed: EPROTO with the request's id; a digest an xxh3 daemon has no use for
    is EINVAL; nothing is committed, the connection is kept."""
    c = kvd.connect(features=kw.FEATURE_PACKED | kw.FEATURE_PACKED_COMMIT)
    pool = c.attach("m", LAYOUT)
    P = pool.pool_id
    w = allocate(c, pool, 2)
    ents = [pb.CommitEntry(block=pb.BlockRef(id=b, gen=g), hash=pb.Hash128(lo=7 + i, hi=9),
                           parent=kw.NO_PARENT if i == 0 else w[0][0])
            for i, (b, g) in enumerate(w)]
    good = kw.pack_commit(ents)
    T = LAYOUT.tokens_per_block
    bad = [pb.Commit(pool_id=P, entries_packed=good[:n]) for n in (1, 27, 29, 55)]
    bad += [pb.Commit(pool_id=P, entries_packed=good, entries=ents[:1]),
            pb.Commit(pool_id=P, entries_packed=good, hash_full_packed=b"\1" * 32),
            pb.Commit(pool_id=P, entries_packed=good, token_ids_packed=b"\0" * (8 * T - 4)),
            pb.Commit(pool_id=P, hash_full_packed=b"\1" * 64),
            pb.Commit(pool_id=P, token_ids_packed=b"\0" * 8 * T),
            pb.Commit(pool_id=P, parent_hash_full=b"\1" * 32)]
    for msg in bad:
        rid = c.send("commit", msg)
        with kvd_error(kw.EPROTO) as e:
            c.recv()
        assert e.value.req_id == rid and e.value.message
    with kvd_error(kw.EINVAL) as e:
        c.call("commit", pb.Commit(pool_id=P, entries_packed=good, hash_full_packed=b"\1" * 64))
    assert "hash-mode vllm" in e.value.message
    st = pool_stats(c, pool)
    assert st["blocks_writing"] == 2 and st["blocks_committed"] == 0
    r, _ = c.call("commit", pb.Commit(pool_id=P, entries_packed=good))
    assert kw.unpack_blocks(r.canonical_packed) == w


def test_pin_rules(kvd_factory):
    """§6 Pin: only held, committed blocks (EPERM / ESTATE); retention <= 7 days and priority
    <= 255 (EINVAL); a pinned cached block is not evicted (Allocate is ENOSPC with the count
    that could be had), unpin ignores retention and priority and makes it evictable."""
    d = kvd_factory(pool_memory=budget(1))
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    P = pool.pool_id
    canon, hashes, _ = write_commit(c, pool, 2)
    w = allocate(c, pool, 1)
    with kvd_error(kw.ESTATE):
        c.pin(P, w)
    with kvd_error(kw.EINVAL):
        c.pin(P, canon[:1], retention_ms=604800001)
    with kvd_error(kw.EINVAL):
        c.pin(P, canon[:1], priority=256)
    c.pin(P, canon[:1], retention_ms=604800000, priority=255)
    assert pool_stats(c, pool)["blocks_pinned"] == 1
    c.release(P, canon + w)
    with kvd_error(kw.EPERM):  # no longer held
        c.pin(P, canon[:1])
    total = pool_stats(c, pool)["blocks_total"]
    with kvd_error(kw.ENOSPC) as e:
        c.allocate(P, total)
    assert "asked %d blocks" % total in e.value.message
    got = allocate(c, pool, total - 1)  # evicts the unpinned cached block, not the pinned one
    assert lookup(c, pool, hashes[:1]) == canon[:1]
    c.release(P, got)
    c.pin(P, canon[:1], unpin=True, retention_ms=10 ** 15, priority=10 ** 6)
    c.release(P, canon[:1])
    assert pool_stats(c, pool)["blocks_pinned"] == 0
    allocate(c, pool, total)


def test_max_held_quota(kvd_factory):
    """docs/TENANCY.md max-held: Allocate beyond it is EQUOTA naming max-held; Lookup returns
    at most the hits the limit leaves (a shorter prefix)."""
    d = kvd_factory(tenants="quota default max-held=10\n")
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    canon, hashes, _ = write_commit(c, pool, 8)
    with kvd_error(kw.EQUOTA) as e:
        c.allocate(pool.pool_id, 3)
    assert "max-held" in e.value.message
    assert len(lookup(c, pool, hashes)) == 2


def test_allocate_enospc_is_all_or_nothing(kvd_factory):
    """§6 Allocate: 'all or nothing': with the budget spent (one segment), asking more than
    free + evictable blocks is ENOSPC naming both counts, and evicts nothing, leases nothing."""
    d = kvd_factory(pool_memory=budget(1))
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    canon, hashes, _ = write_commit(c, pool, 4)
    c.release(pool.pool_id, canon)
    allocate(c, pool, 100)
    before = pool_stats(c, pool)
    with kvd_error(kw.ENOSPC) as e:
        c.allocate(pool.pool_id, 30)
    assert "asked 30 blocks, 28 could be had" in e.value.message
    assert pool_stats(c, pool) == before
    assert lookup(c, pool, hashes) == canon


def test_max_pinned_quota(kvd_factory):
    """docs/TENANCY.md max-pinned: Pin beyond it is EQUOTA naming max-pinned (nothing pinned);
    pinning a pinned block again costs nothing; unpin frees the quota."""
    d = kvd_factory(tenants="quota default max-pinned=1\n")
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    canon, _, _ = write_commit(c, pool, 2)
    with kvd_error(kw.EQUOTA) as e:
        c.pin(pool.pool_id, canon)
    assert "max-pinned" in e.value.message
    assert pool_stats(c, pool)["blocks_pinned"] == 0
    c.pin(pool.pool_id, canon[:1])
    c.pin(pool.pool_id, canon[:1])
    with kvd_error(kw.EQUOTA):
        c.pin(pool.pool_id, canon[1:])
    c.pin(pool.pool_id, canon[:1], unpin=True)
    c.pin(pool.pool_id, canon[1:])
    assert pool_stats(c, pool)["blocks_pinned"] == 1


def test_pin_retention_expires(kvd_factory):
    """§6 Pin: the pin keeps a cached block only for retention_ms; then it is evictable."""
    d = kvd_factory(pool_memory=budget(1))
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    canon, hashes, _ = write_commit(c, pool, 1)
    c.pin(pool.pool_id, canon, retention_ms=600)  # long enough not to expire under load
    c.release(pool.pool_id, canon)
    total = pool_stats(c, pool)["blocks_total"]
    with kvd_error(kw.ENOSPC):
        c.allocate(pool.pool_id, total)
    time.sleep(0.8)
    assert len(allocate(c, pool, total)) == total


def test_eviction_tail_first_and_generations(kvd_factory):
    """§6 Release: blocks released together are evicted tail first; §4: a block's gen
    changes when it returns to FREE, so an old handle of a block the session holds again (at
    its new gen) is ESTALE."""
    d = kvd_factory(pool_memory=budget(1))
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    P = pool.pool_id
    canon, hashes, _ = write_commit(c, pool, 4)
    c.release(P, canon)
    free = pool_stats(c, pool)["blocks_free"]
    got = allocate(c, pool, free + 1)  # evicts one cached block: the tail
    hit = lookup(c, pool, hashes)
    assert hit == canon[:3]
    assert canon[3][0] in [x for x, _ in got]
    assert dict(got)[canon[3][0]] != canon[3][1]
    with kvd_error(kw.ESTALE):
        c.release(P, canon[3:])
    c.release(P, hit)
    got += allocate(c, pool, 1)
    assert lookup(c, pool, hashes) == canon[:2]
    c.release(P, got[:1])
    again = allocate(c, pool, 1)
    assert again[0][0] == got[0][0] and again[0][1] != got[0][1]


def test_attach_enospc(kvd_factory):
    """§6 AttachPool: ENOSPC when a new pool's first segment does not fit and no pool has an
    idle segment; once one is idle its memory moves to the new pool (the parked segment keeps
    its metadata in the budget, §6 "Pools")."""
    d = kvd_factory(pool_memory=budget(1, pools=2))
    c = d.connect()
    pool = c.attach("a", LAYOUT)
    held = allocate(c, pool, pool.bps)
    with kvd_error(kw.ENOSPC) as e:
        c.attach("b", LAYOUT)
    assert "pool-memory" in e.value.message, e.value.message
    assert c.stats()["daemon.pools"] == 1  # a refused attach makes no pool
    c.release(pool.pool_id, held)
    other = c.attach("b", LAYOUT)
    assert len(other.segments) == 1
    st = pool_stats(c, pool)
    assert (st["segments_parked"], st["blocks_parked"], st["bytes"]) == (1, pool.bps, 0), st
    assert st["blocks_total"] == pool.bps and st["blocks_free"] == 0


# =============================================================================================
# Tenants (§8, docs/TENANCY.md)

@needs_root
def test_two_uids_are_two_tenants(kvd):
    """Two uids are two tenants: different pools for the same model, the same seed, zero
    cross hits for the same hashes, and the other tenant's pool id is ENOENT for every
    request while its block ids inside one's own pool are EPERM (TENANCY.md: 'any other pool
    id is ENOENT, and inside its pools every block it does not hold is EPERM')."""

    def tenant_a(ready_w):
        c = kw.Conn(kvd.sock)
        c.hello()
        pool = c.attach("m", LAYOUT)
        canon, hashes, pats = write_commit(c, pool, 4)
        w = allocate(c, pool, 2)
        signal_ready(ready_w, (pool.pool_id, canon, w))
        time.sleep(30)  # hold everything until killed

    def tenant_b(ready_w, a_pool, a_blocks, hashes):
        c = kw.Conn(kvd.sock)
        r = c.hello()
        pool = c.attach("m", LAYOUT)
        out = {"tenant": r.tenant, "domains": list(r.domains), "pool": pool.pool_id,
               "seed": pool.hash_seed, "hits": len(lookup(c, pool, hashes)),
               "hits_domains": len(kw.reply_blocks(c.lookup(pool.pool_id, hashes,
                                                             search_domains=True)))}
        P, refs = a_pool, kw._refs(a_blocks[:1])
        entry = pb.CommitEntry(block=refs[0], hash=pb.Hash128(lo=1, hi=2), parent=kw.NO_PARENT)
        requests = {
            "lookup": pb.Lookup(pool_id=P, hashes=[pb.Hash128(lo=h[0], hi=h[1]) for h in hashes]),
            "allocate": pb.Allocate(pool_id=P, count=1),
            "commit": pb.Commit(pool_id=P, entries=[entry]),
            "release": pb.Release(pool_id=P, blocks=refs),
            "rewind": pb.Rewind(pool_id=P, blocks=refs),
            "pin": pb.Pin(pool_id=P, blocks=refs),
            "stats": pb.Stats(pool_id=P),
            "map_segments": pb.MapSegments(pool_id=P),
        }
        out["foreign_pool"] = {}
        for body, msg in requests.items():
            try:
                c.call(body, msg)
                out["foreign_pool"][body] = "OK"
            except kw.KvdError as e:
                out["foreign_pool"][body] = e.name
        own = pool.pool_id
        out["foreign_blocks"] = {}
        for body, msg in {
                "commit": pb.Commit(pool_id=own, entries=[entry]),
                "release": pb.Release(pool_id=own, blocks=refs),
                "rewind": pb.Rewind(pool_id=own, blocks=refs),
                "pin": pb.Pin(pool_id=own, blocks=refs)}.items():
            try:
                c.call(body, msg)
                out["foreign_blocks"][body] = "OK"
            except kw.KvdError as e:
                out["foreign_blocks"][body] = e.name
        return out

    # A's hashes: same model and shape, so the same seed (checked below)
    seed = _seed("m", LAYOUT)
    hashes = kw.hash_chain(seed, toks(4), T)
    a = Child(tenant_a, uid=UID_A)
    a_pool_id, a_canon, a_writing = a.wait_ready()
    a_sess = [s for s in kvd.admin_result("sessions")["sessions"] if s["uid"] == UID_A]
    assert len(a_sess) == 1 and a_sess[0]["tenant"] == "uid-%d" % UID_A
    assert a_sess[0]["pid"] == a.pid and a_sess[0]["blocks_held"] == 6
    a_pool = [p for p in kvd.admin_result("pools")["pools"] if p["domain"] == "uid-%d" % UID_A]
    assert [p["id"] for p in a_pool] == [a_pool_id]
    a_blocks = a_canon[:2] + a_writing[:1]  # committed and WRITING blocks A holds
    b = Child(tenant_b, a_pool_id, a_blocks, hashes, uid=UID_B).result()
    a.kill()
    assert b["tenant"] == "uid-%d" % UID_B and b["domains"] == [b["tenant"]]
    assert b["pool"] != a_pool_id and b["seed"] == seed
    assert b["hits"] == 0 and b["hits_domains"] == 0
    assert b["foreign_pool"] == {k: "ENOENT" for k in b["foreign_pool"]}
    assert b["foreign_blocks"] == {k: "EPERM" for k in b["foreign_blocks"]}
    res = kvd.admin_result("selftest isolation")
    assert res["passed"] is True, res


@needs_root
def test_tokens_and_groups(kvd_factory):
    """§6 Hello / docs/TENANCY.md: a token selects its tenant only for admitted uids (else
    EAUTH; trailing whitespace of the token file is cut), a token tenant is never reached
    without the token, groups appear in domains and in linked, and a group member's commit is
    a search_domains hit for the other member, with pool_ids naming the group pool."""
    token = b"secret-token-0123456789"
    d = kvd_factory(files={"podA.token": token + b"\n"},
                    tenants="tenant podA token-file={dir}/podA.token uid=%d\n"
                            "tenant podB uid=%d\n"
                            "group rag members=podA,podB\n" % (UID_A, UID_B))
    with kvd_error(kw.EAUTH):  # root is not in podA's uid list
        d.connect(token=token)

    def member(ready_w, use_token, commit):
        c = kw.Conn(d.sock)
        r = c.hello(token=token if use_token else b"")
        pool = c.attach("g", LAYOUT)
        linked = [(x.domain, x.read_only) for x in pool.attach_reply.linked]
        out = {"tenant": r.tenant, "domains": list(r.domains), "linked": linked}
        if commit:
            group = c.linked_pool(pool, pool.attach_reply.linked[0])
            write_commit(c, group, 2)
            out["group_pool"] = group.pool_id
        else:
            hashes = kw.hash_chain(pool.hash_seed, toks(2), T)
            rep = c.lookup(pool.pool_id, hashes, search_domains=True)
            out["hits"] = len(kw.reply_blocks(rep))
            out["pool_ids"] = list(rep.pool_ids)
        return out

    a = Child(member, True, True, uid=UID_A).result()
    assert a["tenant"] == "podA"
    assert a["domains"] == ["podA", "group:rag"]
    assert a["linked"] == [("group:rag", False)]
    plain = Child(member, False, False, uid=UID_A).result()
    assert plain["tenant"] == "uid-%d" % UID_A and plain["hits"] == 0
    assert plain["domains"] == [plain["tenant"]]
    b = Child(member, False, False, uid=UID_B).result()
    assert b["tenant"] == "podB" and b["domains"] == ["podB", "group:rag"]
    assert b["hits"] == 2 and b["pool_ids"] == [a["group_pool"]] * 2
    with pytest.raises(AssertionError, match="EAUTH"):
        Child(member, True, False, uid=UID_B).result()  # podA's token from podB's uid


def test_admin_sizes_past_int64_are_not_negative(kvd_factory):
    """pool-memory at its maximum (2^64 - 1) is shown as that number, not -1 (a JSON integer
    is signed: admin wrote the value cast)."""
    d = kvd_factory(pool_memory=str(2 ** 64 - 1))
    v = d.admin_result("stats")["daemon"]["pool_memory_bytes"]
    assert v > 0 and abs(v - 2 ** 64) < 2 ** 20, v


def test_kvd_started_with_stdio_closed():
    """kvd started with fds 0-2 closed holds them with /dev/null, so that no segment memfd takes
    one (log lines would be written into KV memory, and such a segment's fd was never
    closed), and serves."""
    from conftest import daemon_args, new_dir
    tmp = new_dir()

    def close_stdio():
        for fd in (0, 1, 2):
            os.close(fd)
    proc = subprocess.Popen(daemon_args(kvd_binary(), tmp, {}), preexec_fn=close_stdio,
                            close_fds=True)
    try:
        sock = os.path.join(tmp, "run", "kvd.sock")
        deadline = time.monotonic() + 10
        while True:  # (the socket file exists from bind, connects succeed from listen)
            try:
                c = kw.Conn(sock)
                break
            except OSError:
                assert time.monotonic() < deadline, "kvd did not listen"
                time.sleep(0.05)
        c.hello()
        pool = c.attach("m-stdio", LAYOUT)
        assert len(pool.segments) >= 1
        for fd in (0, 1, 2):
            assert os.readlink("/proc/%d/fd/%d" % (proc.pid, fd)) == "/dev/null"
        c.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)


def test_kvd_refuses_admin_socket_on_the_client_socket():
    """admin-socket equal to socket: refused at start, naming both (the admin socket replaced
    the client socket, and `ready` still said yes)."""
    rc, out = run_kvd_expecting_refusal({"socket": "{dir}/run/kvd.sock",
                                         "admin_socket": "{dir}/run/kvd.sock"})
    assert rc not in (None, 0), out
    assert "admin-socket and socket" in out, out


def test_admin_group_may_connect(kvd_factory):
    """With admin-group set the admin socket is group-readable and -writable, so that the
    group's members can connect (it kept mode 0600: they got EACCES before the credential
    check that would admit them)."""
    d = kvd_factory(admin_group=str(os.getgid()))
    st = os.stat(d.admin_sock)
    assert st.st_gid == os.getgid() and stat.S_IMODE(st.st_mode) == 0o660, oct(st.st_mode)
    assert d.admin_result("stats")["daemon"]["sessions"] >= 0


@needs_root
def test_admin_socket_refuses_other_uids(kvd_factory):
    """docs/ADMIN.md: with a world-writable admin socket, a peer that is not root, kvd's uid
    or in admin-group gets one EPERM error line."""
    d = kvd_factory(admin_socket_mode="0666")

    def peer(ready_w):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(d.admin_sock)
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
        return data

    line = json.loads(Child(peer, uid=UID_A).result())
    assert line["ok"] is False and line["error"]["code"] == "EPERM"
    assert line["error"]["errno"] == kw.EPERM


# =============================================================================================
# Crashes: everything a dead client held comes back (§3)

def _hold_writing(ready_w, sock, n):
    c = kw.Conn(sock)
    c.hello(name="writer")
    pool = c.attach("m", LAYOUT)
    blocks = allocate(c, pool, n)
    for bid, _ in blocks[: n // 2]:  # mid-write
        pool.write_block(bid, kw.block_pattern(LAYOUT, bid))
    signal_ready(ready_w)
    time.sleep(30)


def _hold_refs(ready_w, sock, hashes):
    c = kw.Conn(sock)
    c.hello(name="looker")
    pool = c.attach("m", LAYOUT)
    lookup(c, pool, hashes)
    lookup(c, pool, hashes)
    for _ in range(50):  # and more lookups in flight, never read
        c.send("lookup", c.lookup_msg(pool.pool_id, hashes))
    signal_ready(ready_w)
    time.sleep(30)


def test_sigkill_mid_write_frees_leases(kvd):
    """A child holding WRITING leases over several segments is SIGKILLed; every block comes
    back (pool stats, admin sessions and tenants)."""
    c = kvd.connect()
    pool = c.attach("m", LAYOUT)
    child = Child(_hold_writing, kvd.sock, 300)
    child.wait_ready()
    assert pool_stats(c, pool)["blocks_writing"] == 300
    child.kill()
    assert wait_until(lambda: all_back(pool_stats(c, pool))), pool_stats(c, pool)
    assert wait_until(lambda: not [s for s in kvd.admin_result("sessions")["sessions"]
                                   if s["pid"] == child.pid])
    t = kvd.admin_result("tenants")["tenants"]
    assert sum(x["blocks_held"] for x in t) == 0, t
    assert len(allocate(c, pool, 300)) == 300


def test_sigkill_mid_lookup_drops_references(kvd):
    """A child holding references from Lookups (and with Lookups still queued) is SIGKILLed;
    its references are dropped: the blocks are CACHED again and evictable."""
    c = kvd.connect()
    pool = c.attach("m", LAYOUT)
    canon, hashes, _ = write_commit(c, pool, 8)
    c.release(pool.pool_id, canon)
    child = Child(_hold_refs, kvd.sock, hashes)
    child.wait_ready()
    assert pool_stats(c, pool)["blocks_committed"] == 8
    child.kill()
    assert wait_until(lambda: all_back(pool_stats(c, pool))), pool_stats(c, pool)
    st = pool_stats(c, pool)
    assert st["blocks_cached"] == 8
    t = kvd.admin_result("tenants")["tenants"]
    assert sum(x["blocks_held"] for x in t) == 0, t


def test_half_frame_then_die(kvd):
    """A client that sends half a frame and dies (close, and SIGKILL of a child) leaves the
    daemon serving and nothing held."""
    c = kvd.connect()
    pool = c.attach("m", LAYOUT)
    frame = c.frame(c.envelope("allocate", pb.Allocate(pool_id=pool.pool_id, count=1))
                    .SerializeToString())
    for cut in (1, 3, 4, len(frame) - 1):
        x = kvd.connect()
        x.attach("m", LAYOUT)
        allocate(x, x.pools[pool.pool_id], 2)
        x.send_raw(frame[:cut])
        x.sock.close()

    def half(ready_w):
        x = kw.Conn(kvd.sock)
        x.hello()
        allocate(x, x.attach("m", LAYOUT), 3)
        x.send_raw(struct.pack("<I", 1000) + b"\x08")
        signal_ready(ready_w)
        time.sleep(30)

    child = Child(half)
    child.wait_ready()
    assert c.ping(nonce=2).nonce == 2  # served while another client sits on half a frame
    child.kill()
    assert wait_until(lambda: all_back(pool_stats(c, pool))), pool_stats(c, pool)
    assert wait_until(lambda: kvd.admin_result("stats")["daemon"]["sessions"] == 1)
    assert c.ping(nonce=3).nonce == 3


# =============================================================================================
# Pipelining and flow control (§5)

def test_pipelined_replies_in_order(kvd):
    """Hundreds of mixed requests written at once are answered one each, in order, errors in
    their places."""
    c = kvd.connect()
    pool = c.attach("m", LAYOUT)
    canon, hashes, _ = write_commit(c, pool, 2)
    plan, data = [], b""
    for i in range(600):
        kind = i % 6
        if kind == 0:
            env = c.envelope("ping", pb.Ping(nonce=i, payload=b"p%d" % i))
            want = "pong"
        elif kind == 1:
            env = c.envelope("lookup", c.lookup_msg(pool.pool_id, hashes))
            want = "lookup_reply"
        elif kind == 2:
            env = c.envelope("allocate", pb.Allocate(pool_id=pool.pool_id, count=0))
            want = kw.EINVAL
        elif kind == 3:
            env = c.envelope("stats", pb.Stats())
            want = "stats_reply"
        elif kind == 4:
            env = c.envelope("release", c.blocks_msg("Release", pool.pool_id, canon))
            want = "release_reply"
        else:
            env = c.envelope("stats", pb.Stats(pool_id=999))
            want = kw.ENOENT
        plan.append((env.id, want, i))
        data += c.frame(env.SerializeToString())
    c.send_raw(data)
    for rid, want, i in plan:
        env, _ = c.recv_frame()
        assert env.id == rid
        which = env.WhichOneof("body")
        if isinstance(want, int):
            assert which == "error" and env.error.code == want
        else:
            assert which == want, env
            if which == "pong":
                assert env.pong.nonce == i and env.pong.payload == b"p%d" % i
    assert pool_stats(c, pool)["session_refs"] == 2


def test_flow_control_max_inflight(kvd_factory):
    """§5: with max-inflight=2 a client may still pipeline hundreds of requests: nothing is
    refused, all are answered in order as it reads."""
    d = kvd_factory(max_inflight="2")
    c = d.connect()
    assert c.hello_reply.max_inflight == 2
    envs = [c.envelope("ping", pb.Ping(nonce=i, payload=b"x" * 1000)) for i in range(400)]
    data = b"".join(c.frame(e.SerializeToString()) for e in envs)
    # write from a thread: the daemon stops reading while 2 replies are unread (§5)
    writer = threading.Thread(target=c.send_raw, args=(data,))
    writer.start()
    for i, e in enumerate(envs):
        _, pong, _ = c.recv(e.id)
        assert pong.nonce == i
    writer.join()
    assert c.stats()["session.errors"] == 0


def test_slow_reader_is_dropped(kvd_factory):
    """§5: a client that never reads is closed once its queued output exceeds
    max-output-bytes; its references are released and other clients are served."""
    d = kvd_factory(max_output_bytes="256K")
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    slow = d.connect()
    allocate(slow, slow.attach("m", LAYOUT), 10)
    slow.sock.settimeout(5)
    payload = b"z" * 60000
    closed = False
    try:
        for i in range(2000):
            slow.send("ping", pb.Ping(nonce=i, payload=payload))
    except (kw.KvdError, OSError):
        closed = True
    assert closed, "daemon kept a client that never reads"
    assert wait_until(lambda: all_back(pool_stats(c, pool))), pool_stats(c, pool)
    assert c.ping(nonce=1).nonce == 1


# =============================================================================================
# Segments (§2.2, §6 AttachPool / MapSegments / new_segments_from)

def test_pool_grows_while_other_session_holds_old_segments(kvd):
    """A pool grows by segments; an older session learns of them through new_segments_from
    (Allocate and Lookup), fetches them with MapSegments and reads the other's bytes there.
    A re-attach returns the same pool id and every segment again."""
    old, grower = kvd.connect(), kvd.connect()
    po = old.attach("m", LAYOUT)
    allocate(old, po, 10)
    assert sorted(po.segments) == [0]
    pg = grower.attach("m", LAYOUT)
    bps = pg.bps
    canon, hashes, pats = write_commit(grower, pg, 3 * bps)  # now 4 segments
    assert len(pg.segments) == 4
    r = old.lookup(po.pool_id, hashes)
    assert r.new_segments_from == 1
    blocks = kw.reply_blocks(r)
    assert len(blocks) == 3 * bps
    with pytest.raises(kw.ProtocolViolation):
        po.where(blocks[-1][0])  # not yet sent to us
    got = po.map_segments(r.new_segments_from)
    assert got == [1, 2, 3]
    assert all(po.read_block(b) == p for (b, _), p in zip(blocks, pats))
    r = old.lookup(po.pool_id, hashes[:1])
    assert r.new_segments_from == 0  # nothing new
    old.release(po.pool_id, kw.reply_blocks(r) + blocks)
    more = grower.allocate(pg.pool_id, bps)
    assert more.new_segments_from == 4
    r = old.allocate(po.pool_id, 2 * bps)  # needs a sixth segment: we lack 4 and 5
    assert r.new_segments_from == 4
    po.follow(r)
    check_blocks(po, kw.reply_blocks(r))
    st = pool_stats(old, po)
    n = st["segments"]
    assert n >= 6 and st["bytes"] == n * LAYOUT.segment_bytes(bps)
    r2, fds = old.call("attach_pool", pb.AttachPool(model_id="m", layout=LAYOUT.to_pb()))
    assert r2.pool_id == po.pool_id and [s.index for s in r2.segments] == list(range(n))
    assert len(fds) == n and len(set(fds)) == n
    for fd in fds:
        os.close(fd)


def test_map_segments_over_200(kvd_factory):
    """§2.2: replies name at most 200 segments (fds); the rest come from MapSegments from the
    last index + 1; pipelined fd-carrying replies split the fd FIFO correctly, and no
    control message is truncated with room for 200 fds."""
    lay = kw.Layout(1, 1, 2048, 1, pb.FP16, pb.LAYER_MAJOR)  # 8 KiB blocks, page sections
    d = kvd_factory(segment_bytes="8K", pool_memory="4M")
    g = d.connect()
    pg = g.attach("m", lay)
    assert pg.bps == 1
    allocate(g, pg, 250)
    assert sorted(pg.segments) == list(range(250))
    c = d.connect()
    r, fds = c.call("attach_pool", pb.AttachPool(model_id="m", layout=lay.to_pb()))
    assert [s.index for s in r.segments] == list(range(200)) and len(fds) == 200
    assert sorted(s.fd_index for s in r.segments) == list(range(200))
    for fd in fds:
        os.close(fd)
    rids = [c.send("map_segments", pb.MapSegments(pool_id=r.pool_id, first_index=i))
            for i in (0, 200, 249, 250, 1000)]
    rids.append(c.send("ping", pb.Ping(nonce=7)))
    want = [200, 50, 1, 0, 0]
    for rid, n in zip(rids, want):
        _, rep, fds = c.recv(rid)
        assert len(rep.segments) == n and len(fds) == n
        inodes = set()
        for s in rep.segments:
            st = os.fstat(fds[s.fd_index])
            assert st.st_size == s.bytes
            inodes.add(st.st_ino)
        assert len(inodes) == n
        for fd in fds:
            os.close(fd)
    assert c.recv(rids[-1])[1].nonce == 7
    assert not c.fds and not c.ctrunc
    # the fd of segment k is segment k: compare with the grower's mapping
    p = c.attach("m", lay)
    assert sorted(p.segments) == list(range(250))
    pg.write_block(137, b"\x5a" * lay.block_bytes)
    assert p.read_block(137) == b"\x5a" * lay.block_bytes


def test_commit_canonical_in_unsent_segment(kvd):
    """'Segments a reply hands out': CommitReply.new_segments_from announces the segment of a
    canonical duplicate the session was never sent. A knows segment 0; B grows the pool and
    commits hash h in segment 1; A commits h and gets B's block, announced, with B's bytes."""
    a, b = kvd.connect(), kvd.connect()
    pa, pb_ = a.attach("m", LAYOUT), b.attach("m", LAYOUT)
    mine = allocate(a, pa, 1)
    theirs = allocate(b, pb_, pb_.bps + 1)[-1]
    assert theirs[0] // pb_.bps == 1
    h = kw.hash_block(pa.hash_seed, toks(1))
    pat = kw.block_pattern(LAYOUT, "theirs")
    pb_.write_block(theirs[0], pat)
    b.commit(pb_.pool_id, [(theirs, h, kw.NO_PARENT)])
    reply = a.commit_reply(pa.pool_id, [(mine[0], h, kw.NO_PARENT)])
    assert [(c.id, c.gen) for c in reply.canonical] == [theirs]
    assert reply.new_segments_from == 1
    pa.follow(reply)
    assert pa.read_block(theirs[0]) == pat
    assert a.commit_reply(pa.pool_id, []).new_segments_from == 0


def test_segment_hole_is_announced_again(kvd):
    """'Segments a reply hands out': the daemon records each segment it sent (not a high-water
    mark): a client that maps from a higher index keeps its hole, and every reply that hands
    out blocks announces the lowest missing segment until it is mapped."""
    old, grower = kvd.connect(), kvd.connect()
    po, pg = old.attach("m", LAYOUT), grower.attach("m", LAYOUT)
    canon, hashes, pats = write_commit(grower, pg, 3 * pg.bps + 1)  # segments 0..3
    assert sorted(pg.segments) == [0, 1, 2, 3]
    r, fds = old.map_segments(po.pool_id, 2)
    po.add_segments(r.segments, fds)
    assert sorted(po.segments) == [0, 2, 3]
    for _ in range(2):
        rep = old.lookup(po.pool_id, hashes)
        assert rep.new_segments_from == 1
        assert old.allocate(po.pool_id, 1).new_segments_from == 1
    po.follow(rep)
    assert sorted(po.segments) == [0, 1, 2, 3]
    assert old.lookup(po.pool_id, hashes[:1]).new_segments_from == 0
    blocks = kw.reply_blocks(rep)
    assert all(po.read_block(x) == p for (x, _), p in zip(blocks, pats))


def test_linked_pool_needs_map_segments_first(kvd_factory):
    """'Segments a reply hands out': until a linked pool's segment 0 was sent (MapSegments),
    Allocate, Lookup and Commit naming it are ESTATE, while Release, Rewind, Pin and Stats
    work; Lookup{search_domains} announces the linked pool's missing segments in
    linked_segments (first_index 0 is valid); hits there carry pool_ids of the group pool."""
    d = kvd_factory(tenants="tenant me uid=%d\ntenant peer uid=%d\ngroup g members=me,peer\n"
                    % (ME, UID_A))
    x, y = d.connect(), d.connect()
    px = x.attach("m", LAYOUT)
    assert list(x.hello_reply.domains) == ["me", "group:g"]
    (link,) = px.attach_reply.linked
    assert (link.domain, link.read_only, link.blocks_per_segment) == ("group:g", False, px.bps)
    G = link.pool_id
    entry = pb.CommitEntry(block=pb.BlockRef(id=0, gen=0), hash=pb.Hash128(lo=1, hi=1),
                           parent=kw.NO_PARENT)
    for body, msg in (("allocate", pb.Allocate(pool_id=G, count=1)),
                      ("lookup", pb.Lookup(pool_id=G)),
                      ("commit", pb.Commit(pool_id=G, entries=[entry]))):
        with kvd_error(kw.ESTATE):
            x.call(body, msg)
    x.release(G, [])
    x.rewind(G, [])
    x.pin(G, [])
    assert x.stats(G)["pool.id"] == G
    rep = x.lookup(px.pool_id, [(1, 1)], search_domains=True)
    assert [(n.pool_id, n.first_index) for n in rep.linked_segments] == [(G, 0)]
    rep = x.lookup(px.pool_id, [(1, 1)])
    assert not rep.linked_segments and not rep.pool_ids
    # x maps the group pool (segment 0); y then grows it into a second segment and commits
    # there; x finds y's blocks with search_domains and is told of segment 1
    gx = x.linked_pool(px, link)
    assert sorted(gx.segments) == [0]
    py = y.attach("m", LAYOUT)
    gy = y.linked_pool(py, py.attach_reply.linked[0])
    allocate(y, gy, gy.bps - 1)
    canon, hashes, pats = write_commit(y, gy, 3)
    assert {b // gy.bps for b, _ in canon} == {0, 1}
    rep = x.lookup(px.pool_id, hashes, search_domains=True)
    blocks = kw.reply_blocks(rep)
    assert blocks == canon and list(rep.pool_ids) == [G] * 3
    assert [(n.pool_id, n.first_index) for n in rep.linked_segments] == [(G, 1)]
    px.follow(rep)
    assert [gx.read_block(b) for b, _ in blocks] == pats
    allocate(x, gx, 1)  # allowed now
    x.release(G, blocks)


def test_segments_are_sealed(kvd):
    """§2.2: host segment fds are sealed against growing and shrinking (and sealing)."""
    import fcntl
    c = kvd.connect()
    pool = c.attach("m", LAYOUT)
    r, fds = c.map_segments(pool.pool_id, 0)
    try:
        fd = fds[r.segments[0].fd_index]
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        assert seals & want == want
        with pytest.raises(OSError):
            os.ftruncate(fd, 4096)
        assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC  # MSG_CMSG_CLOEXEC
    finally:
        for fd in fds:
            os.close(fd)


def test_daemon_fd_count_stable(kvd):
    """Segment fds the daemon sends (AttachPool, MapSegments, sessions that come and go) are
    not leaked in the daemon."""
    fd_dir = "/proc/%d/fd" % kvd.proc.pid
    c = kvd.connect()
    pool = c.attach("m", LAYOUT)
    allocate(c, pool, 3 * pool.bps)
    before = len(os.listdir(fd_dir))
    for _ in range(50):
        r, fds = c.map_segments(pool.pool_id, 0)
        for fd in fds:
            os.close(fd)
        c.attach("m", LAYOUT)
        x = kvd.connect()
        x.attach("m", LAYOUT)
        x.close()
    c.ping()
    assert wait_until(lambda: len(os.listdir(fd_dir)) <= before), len(os.listdir(fd_dir))


def identity_holds(st):
    """§6 Block states: blocks_total = free + writing + committed + cached + parked."""
    return st["blocks_total"] == (st["blocks_free"] + st["blocks_writing"] + st["blocks_committed"]
                                  + st["blocks_cached"] + st["blocks_parked"])


def test_parked_segments_keep_mappings_and_slots(kvd_factory):
    """§6 Allocate / Block states: memory moves between pools by parking idle segments; the
    cached blocks there are evicted (evictions_shrink), parked blocks count in blocks_total and
    blocks_parked (not blocks_free) and are not allocatable, parked memory reads as zeros
    through the mappings, which stay valid; max_segments never drops below the pool's segment
    slots; the pool can take its memory back later (same memfds). The identity holds
    throughout. Budget: A's 4 segments and 48 KiB, so B's attach and 2 more segments park 3."""
    d = kvd_factory(pool_memory=str(4 * SEG_COST + 48 * 1024))
    a = d.connect()
    pa = a.attach("a", LAYOUT)
    canon, hashes, pats = write_commit(a, pa, 4 * pa.bps)
    a.release(pa.pool_id, canon)
    st = pool_stats(a, pa)
    assert identity_holds(st) and st["blocks_cached"] == 4 * pa.bps, st
    b = d.connect()
    pb_ = b.attach("b", LAYOUT)
    bb = allocate(b, pb_, 3 * pb_.bps)
    st = pool_stats(a, pa)
    assert (st["segments"], st["segments_parked"], st["blocks_parked"]) == (4, 3, 3 * pa.bps), st
    assert st["evictions_shrink"] == 3 * pa.bps and st["blocks_free"] == 0, st
    assert st["bytes"] == LAYOUT.segment_bytes(pa.bps) and identity_holds(st), st
    assert identity_holds(pool_stats(b, pb_))
    parked = [i for i, (_, m) in pa.segments.items() if not any(m[:])]
    assert len(parked) == 3, "parked memory must read as zeros (3 segments): %s" % parked
    r, fds = a.call("attach_pool", pb.AttachPool(model_id="a", layout=LAYOUT.to_pb()))
    for fd in fds:
        os.close(fd)
    assert r.max_segments >= 4 and [s.index for s in r.segments] == [0, 1, 2, 3]
    with kvd_error(kw.ENOSPC) as e:  # parked FREE blocks are not allocatable
        a.allocate(pa.pool_id, pa.bps + 1)
    assert "asked %d blocks, %d could be had" % (pa.bps + 1, pa.bps) in e.value.message
    b.release(pb_.pool_id, bb)
    again, _, pats2 = write_commit(a, pa, 4 * pa.bps, base=10 ** 6)
    st = pool_stats(a, pa)
    assert (st["segments_parked"], st["blocks_parked"]) == (0, 0) and identity_holds(st), st
    st = pool_stats(b, pb_)
    assert st["segments_parked"] == 3 and identity_holds(st), st
    r, fds = b.call("attach_pool", pb.AttachPool(model_id="b", layout=LAYOUT.to_pb()))
    for fd in fds:
        os.close(fd)
    assert r.max_segments >= 3, r.max_segments  # never below its slots, never 0
    a2 = d.connect()
    p2 = a2.attach("a", LAYOUT)
    assert all(p2.read_block(x) == p for (x, _), p in zip(again, pats2))
    assert all(pa.read_block(x) == p for (x, _), p in zip(again, pats2))


# =============================================================================================
# Malformed input (§2, §6, §7): each gets its error and the daemon keeps serving

def _reply_bodies():
    return [f.name for f in pb.Envelope.DESCRIPTOR.oneofs_by_name["body"].fields
            if f.name.endswith("_reply") or f.name in ("pong", "error")]


def raw_reply(conn, body):
    """Sends one frame with the given Envelope bytes; returns (id, body name, error code)."""
    conn.send_raw(conn.frame(body))
    env, fds = conn.recv_frame()
    for fd in fds:
        os.close(fd)
    which = env.WhichOneof("body")
    if which == "error":
        assert env.error.message.strip(), "empty Error.message"
    return env.id, which, env.error.code if which == "error" else None


# An Envelope member this protocol version does not have: the next free oneof number (a
# newer client's request type), as an empty message: field 34, wire type 2, length 0.
UNKNOWN_BODY = b"\x92\x02\x00"


def test_malformed_frames(kvd):
    """§2: undecodable bodies are EPROTO with id 0; an envelope without a body is EPROTO with
    its id (L = 0 is such an envelope, id 0); a body of a type this version does not have is
    ENOTSUP with its id; reply types as requests are EPROTO with their id; the connection is
    kept after each. Unknown fields next to a body are ignored, a request dribbled one byte
    per write is served, an exactly max_frame_bytes frame is accepted."""
    c = kvd.connect()
    for raw, want in ((b"\xff\xff\xff", (0, kw.EPROTO)), (b"\x08", (0, kw.EPROTO)),
                      (b"\x0a\x05ab", (0, kw.EPROTO)), (b"", (0, kw.EPROTO)),
                      (pb.Envelope(id=7).SerializeToString(), (7, kw.EPROTO)),
                      (pb.Envelope(id=8, boot_epoch=c.epoch).SerializeToString(), (8, kw.EPROTO)),
                      (pb.Envelope(id=9, boot_epoch=c.epoch).SerializeToString() + UNKNOWN_BODY,
                       (9, kw.ENOTSUP)),
                      (pb.Envelope(id=0).SerializeToString() + UNKNOWN_BODY, (0, kw.ENOTSUP))):
        rid, which, code = raw_reply(c, raw)
        assert (rid, which, code) == (want[0], "error", want[1]), raw
        assert c.ping(nonce=3).nonce == 3  # kept, in sync
    for body in _reply_bodies():
        rid = c.send(body)
        with kvd_error(kw.EPROTO) as e:
            c.recv()
        assert e.value.req_id == rid, body
    env = c.envelope("ping", pb.Ping(nonce=11))
    c.send_raw(c.frame(env.SerializeToString() + b"\xf8\x06\x01"))  # unknown field 111
    assert c.recv(env.id)[1].nonce == 11
    env = c.envelope("ping", pb.Ping(nonce=12))
    for byte in c.frame(env.SerializeToString()):
        c.send_raw(bytes([byte]))
    assert c.recv(env.id)[1].nonce == 12
    # a frame of exactly max_frame_bytes, padded with an unknown field
    env = c.envelope("ping", pb.Ping(nonce=13))
    body = env.SerializeToString()
    pad = c.max_frame_bytes - len(body) - 2 - 3  # tag 0xfa06 (field 111, LEN) + 3-byte varint
    unknown = b"\xfa\x06" + _varint(pad) + b"u" * pad
    assert len(body + unknown) == c.max_frame_bytes
    c.send_raw(c.frame(body + unknown))
    assert c.recv(env.id)[1].nonce == 13
    assert c.ping(nonce=14).nonce == 14


def _varint(n):
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def test_oversize_frame_closes(kvd):
    """§2: L > max_frame_bytes gets one ETOOBIG with id 0, then the connection closes; other
    sessions are unaffected and the dead one's blocks come back."""
    other = kvd.connect()
    po = other.attach("m", LAYOUT)
    c = kvd.connect()
    allocate(c, c.attach("m", LAYOUT), 7)
    c.send_raw(struct.pack("<I", c.max_frame_bytes + 1) + b"\0" * 100)
    env, _ = c.recv_frame()
    assert (env.id, env.error.code) == (0, kw.ETOOBIG)
    with kvd_error(kw.ECLOSED):
        c.recv_frame()
    assert wait_until(lambda: all_back(pool_stats(other, po)))
    x = kvd.connect()
    x.send_raw(struct.pack("<I", 0xFFFFFFFF))
    env, _ = x.recv_frame()
    assert (env.id, env.error.code) == (0, kw.ETOOBIG)
    assert other.ping(nonce=2).nonce == 2


def test_packed_list_errors(kvd):
    """§6 Packed lists: a packed field of bad length, or both forms, is EPROTO with the
    request's id, nothing changed, connection kept; for Lookup, Release and Rewind."""
    c = kvd.connect()
    pool = c.attach("m", LAYOUT)
    P = pool.pool_id
    w = allocate(c, pool, 2)
    ref = [pb.BlockRef(id=w[0][0], gen=w[0][1])]
    h = [pb.Hash128(lo=1, hi=2)]
    bad = [("lookup", pb.Lookup(pool_id=P, hashes_packed=b"\0" * n)) for n in (1, 15, 17, 31)]
    bad.append(("lookup", pb.Lookup(pool_id=P, hashes_packed=b"\0" * 16, hashes=h)))
    for body, cls in (("release", pb.Release), ("rewind", pb.Rewind)):
        bad += [(body, cls(pool_id=P, blocks_packed=kw.pack_blocks(w)[:n])) for n in (1, 7, 9, 15)]
        bad.append((body, cls(pool_id=P, blocks_packed=kw.pack_blocks(w[:1]), blocks=ref)))
    for body, msg in bad:
        rid = c.send(body, msg)
        with kvd_error(kw.EPROTO) as e:
            c.recv()
        assert e.value.req_id == rid
    st = pool_stats(c, pool)
    assert st["session_refs"] == 2 and st["blocks_writing"] == 2 and st["queries"] == 0


def test_list_limits_etoobig(kvd_factory):
    """§6: every list longer than max_blocks_per_request is ETOOBIG, in both forms; exactly
    the limit is fine; Allocate count above it is ETOOBIG and 0 is EINVAL; a Ping payload
    longer than max_frame_bytes - 64 is ETOOBIG."""
    d = kvd_factory(max_blocks_per_request="16")
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    P = pool.pool_id
    w = allocate(c, pool, 16)
    hs = [(i, i) for i in range(17)]
    entry = ((0, 0), (1, 1), kw.NO_PARENT)
    for form in (True, False):
        with kvd_error(kw.ETOOBIG):
            c.lookup(P, hs, packed=form)
        with kvd_error(kw.ETOOBIG):
            c.release(P, w + w[:1], packed=form)
        with kvd_error(kw.ETOOBIG):
            c.rewind(P, w + w[:1], packed=form)
        assert lookup(c, pool, hs[:16], packed=form) == []
    with kvd_error(kw.ETOOBIG):
        c.pin(P, w + w[:1])
    with kvd_error(kw.ETOOBIG):
        c.commit(P, [entry] * 17)
    with kvd_error(kw.ETOOBIG):
        c.allocate(P, 17)
    with kvd_error(kw.EINVAL):
        c.allocate(P, 0)
    assert pool_stats(c, pool)["session_refs"] == 16
    c.release(P, w)
    allocate(c, pool, 16)
    limit = c.max_frame_bytes - 64
    assert len(c.ping(payload=b"q" * limit).payload) == limit
    with kvd_error(kw.ETOOBIG):
        c.ping(payload=b"q" * (limit + 1))


def test_wrong_ids_and_generations(kvd):
    """Unknown pool: ENOENT; block id out of range: ENOENT; wrong gen: ESTALE — for Commit,
    Release, Rewind and Pin; all or nothing: an error in the last entry changes nothing."""
    c = kvd.connect()
    pool = c.attach("m", LAYOUT)
    P = pool.pool_id
    canon, hashes, _ = write_commit(c, pool, 2)
    w = allocate(c, pool, 2)
    total = pool_stats(c, pool)["blocks_total"]
    far = (total + 5, 0)
    stale = (canon[0][0], canon[0][1] ^ 1)
    stale_w = (w[0][0], w[0][1] ^ 1)
    h = kw.hash_block(hashes[-1], toks(1, 4000))
    for name, fn in (("release", c.release), ("rewind", c.rewind),
                     ("pin", lambda p, b: c.pin(p, b))):
        with kvd_error(kw.ENOENT):
            fn(999, canon[:1])
        with kvd_error(kw.ENOENT):
            fn(P, [canon[0], far])
        with kvd_error(kw.ESTALE):
            fn(P, [canon[0], stale])
    with kvd_error(kw.ENOENT):
        c.commit(999, [(w[0], h, kw.NO_PARENT)])
    with kvd_error(kw.ENOENT):
        c.commit(P, [(w[0], h, kw.NO_PARENT), (far, h, kw.NO_PARENT)])
    with kvd_error(kw.ESTALE):
        c.commit(P, [(w[0], h, kw.NO_PARENT), (stale_w, h, kw.NO_PARENT)])
    st = pool_stats(c, pool)
    assert (st["session_refs"], st["blocks_writing"], st["blocks_committed"],
            st["blocks_pinned"]) == (4, 2, 2, 0)
    assert lookup(c, pool, hashes + [h]) == canon  # h was never committed


def test_commit_parent_rules(kvd):
    """§6 Commit: a valid parent is NO_PARENT, an earlier entry of the same request, or a
    COMMITTED block of this pool the session holds; every other parent is EINVAL (out of range,
    the entry's own block, a FREE block, a WRITING block (the session's own or another's), a
    CACHED block nobody holds, another session's committed block, a later entry), and an error
    reply means nothing was committed (the entries before the bad one are still WRITING)."""
    a, b = kvd.connect(), kvd.connect()
    pa, pb_ = a.attach("m", LAYOUT), b.attach("m", LAYOUT)
    P = pa.pool_id
    canon, hashes, _ = write_commit(a, pa, 2)  # held COMMITTED
    cached, _, _ = write_commit(a, pa, 1, base=7000)
    a.release(P, cached)  # CACHED, held by nobody
    theirs, _, _ = write_commit(b, pb_, 1, base=8000)  # b's COMMITTED
    their_w = allocate(b, pb_, 1)  # b's WRITING
    w = allocate(a, pa, 3)
    total = pool_stats(a, pa)["blocks_total"]
    free_id = unused_id(total, canon + cached + theirs + their_w + w)
    h = [kw.hash_block(hashes[-1], toks(1, 4000 + i)) for i in range(3)]
    ok0 = (w[0], h[0], canon[-1][0])  # a valid first entry (held committed parent)
    bad = {
        "out of range": [ok0, (w[1], h[1], total + 100)],
        "itself": [ok0, (w[1], h[1], w[1][0])],
        "free block": [ok0, (w[1], h[1], free_id)],
        "own writing block": [ok0, (w[1], h[1], w[2][0])],
        "later entry": [ok0, (w[1], h[1], w[2][0]), (w[2], h[2], kw.NO_PARENT)],
        "other's writing block": [ok0, (w[1], h[1], their_w[0][0])],
        "cached block not held": [ok0, (w[1], h[1], cached[0][0])],
        "other's committed block": [ok0, (w[1], h[1], theirs[0][0])],
    }
    for what, entries in bad.items():
        with kvd_error(kw.EINVAL) as e:
            a.commit(P, entries)
        assert "parent" in e.value.message, (what, e.value.message)
        st = pool_stats(a, pa)
        assert (st["blocks_writing"], st["session_refs"]) == (4, 5), (what, st)  # b's too
    assert lookup(b, pb_, [h[0]]) == []  # nothing was committed
    # the valid forms
    got = a.commit(P, [ok0, (w[1], h[1], w[0][0]), (w[2], h[2], kw.NO_PARENT)])
    assert got == w
    assert lookup(b, pb_, hashes + h[:2]) == canon + w[:2]


def test_commit_state_errors(kvd):
    """Commit twice (ESTATE), listed twice in one request (ESTATE), another session's WRITING
    block (EPERM), a never-allocated free block (EPERM), release too many (EPERM), another
    session's blocks for Release/Rewind/Pin (EPERM)."""
    a, b = kvd.connect(), kvd.connect()
    pa = a.attach("m", LAYOUT)
    b.attach("m", LAYOUT)
    P = pa.pool_id
    canon, hashes, _ = write_commit(a, pa, 2)
    h = kw.hash_block(hashes[-1], toks(1, 4000))
    with kvd_error(kw.ESTATE):
        a.commit(P, [(canon[0], hashes[0], kw.NO_PARENT)])
    w = allocate(a, pa, 1)
    with kvd_error(kw.ESTATE):
        a.commit(P, [(w[0], h, canon[-1][0]), (w[0], h, canon[-1][0])])
    with kvd_error(kw.EPERM):
        b.commit(P, [(w[0], h, canon[-1][0])])
    free_id = unused_id(pool_stats(a, pa)["blocks_total"], canon + w)
    with kvd_error(kw.EPERM):
        b.commit(P, [((free_id, 0), h, kw.NO_PARENT)])
    with kvd_error(kw.EPERM):
        a.release(P, [canon[0], canon[0]])
    for fn in (b.release, b.rewind, lambda p, x: b.pin(p, x)):
        with kvd_error(kw.EPERM):
            fn(P, canon[:1])
        with kvd_error(kw.EPERM):
            fn(P, w)
    assert pool_stats(a, pa)["session_refs"] == 3
    assert a.commit(P, [(w[0], h, canon[-1][0])]) == w


def test_client_fds_are_ignored(kvd):
    """§2.2: fds a client sends are closed by the daemon and ignored."""
    c = kvd.connect()
    r, w = os.pipe()
    env = c.envelope("ping", pb.Ping(nonce=4))
    c.sock.sendmsg([c.frame(env.SerializeToString())],
                   [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", w))])
    os.close(w)
    assert c.recv(env.id)[1].nonce == 4
    assert os.read(r, 1) == b""  # the daemon's copy of the write end is closed
    os.close(r)


def test_attach_errors(kvd):
    """§6 AttachPool: model_id 1..128 bytes, a missing or invalid shape is EINVAL with a
    message naming the field; attaching twice gives the same pool."""
    c = kvd.connect()
    with kvd_error(kw.EINVAL):
        c.attach("", LAYOUT)
    with kvd_error(kw.EINVAL):
        c.attach("x" * 129, LAYOUT)
    assert c.attach("x" * 128, LAYOUT).pool_id > 0
    for field, value in (("num_layers", 0), ("num_layers", 1025), ("num_kv_heads", 0),
                         ("num_kv_heads", 1025), ("head_dim", 0), ("head_dim", 4097),
                         ("tokens_per_block", 0), ("tokens_per_block", 1025), ("dtype", 0),
                         ("dtype", 6), ("arrangement", 0), ("arrangement", 3)):
        lay = LAYOUT.to_pb()
        setattr(lay, field, value)
        with kvd_error(kw.EINVAL) as e:
            c.call("attach_pool", pb.AttachPool(model_id="bad", layout=lay))
        assert field in e.value.message, (field, e.value.message)
    lay = kw.Layout(1, 1, 6, 1, pb.INT8, pb.LAYER_MAJOR).to_pb()
    with kvd_error(kw.EINVAL) as e:
        c.call("attach_pool", pb.AttachPool(model_id="bad", layout=lay))
    assert "head_dim" in e.value.message
    with kvd_error(kw.EINVAL):
        c.call("attach_pool", pb.AttachPool(model_id="bad"))
    p1 = c.attach("same", LAYOUT).pool_id
    assert c.attach("same", LAYOUT).pool_id == p1
    assert c.attach("same", kw.Layout(2, 2, 8, 16, pb.FP16, pb.BLOCK_MAJOR)).pool_id != p1


def test_stats_names(kvd):
    """§6 Stats: the documented names exist; pool counters with a pool id; ENOENT for a pool
    not attached by this session; daemon.pool_memory_used counts resident segment memory and
    pool metadata (64 bytes per block of every live segment, plus a few KiB per pool)."""
    c = kvd.connect()
    s = c.stats()
    for n in ("daemon.sessions", "daemon.pools", "daemon.pool_memory_bytes",
              "daemon.pool_memory_used", "daemon.buffer_bytes", "daemon.conns_paused",
              "session.id", "session.requests", "session.errors",
              "session.pools_attached", "session.refs_held"):
        assert n in s, n
    assert not [n for n in s if n.startswith("pool.")]
    assert s["daemon.pool_memory_bytes"] == 8 << 20
    pool = c.attach("m", LAYOUT)
    s = c.stats(pool.pool_id)
    for n in ("id", "blocks_total", "blocks_free", "blocks_writing", "blocks_committed",
              "blocks_cached", "blocks_pinned", "blocks_parked", "segments", "segments_parked",
              "bytes", "queries", "query_blocks", "hit_blocks", "hit_tokens", "commits",
              "commits_duplicate", "evictions_capacity", "evictions_admin", "evictions_shrink",
              "session_refs"):
        assert "pool." + n in s, n
    assert s["pool.id"] == pool.pool_id and s["session.pools_attached"] == 1
    allocate(c, pool, 2 * pool.bps + 1)  # three segments
    s = c.stats(pool.pool_id)
    resident = s["pool.bytes"]
    assert resident == 3 * LAYOUT.segment_bytes(pool.bps)
    meta = s["daemon.pool_memory_used"] - resident
    assert 64 * s["pool.blocks_total"] <= meta <= 64 * s["pool.blocks_total"] + POOL_META, s
    other = kvd.connect()
    with kvd_error(kw.ENOENT):
        other.stats(pool.pool_id)
    with kvd_error(kw.ENOENT):
        other.map_segments(pool.pool_id, 0)
    with kvd_error(kw.ENOENT):
        other.lookup(pool.pool_id, [])


# =============================================================================================
# Allocate: all or nothing, ENOSPC (§6 Allocate)

def test_enospc_message_with_pinned_block(kvd_factory):
    """§6 Allocate: ENOSPC's message is 'asked N blocks, M could be had'; with one of the
    pool's blocks pinned (and cached) and the budget spent, M is total - 1."""
    d = kvd_factory(pool_memory=budget(1))
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    canon, _, _ = write_commit(c, pool, 1)
    c.pin(pool.pool_id, canon, retention_ms=600000)
    c.release(pool.pool_id, canon)
    total = pool_stats(c, pool)["blocks_total"]
    with kvd_error(kw.ENOSPC) as e:
        c.allocate(pool.pool_id, total)
    assert "asked %d blocks, %d could be had" % (total, total - 1) in e.value.message, \
        e.value.message


def test_enospc_when_growing_changes_nothing(kvd_factory):
    """§6 Allocate: 'a refused Allocate grows, parks and evicts nothing'. With a budget of 3
    segments (384 blocks) and a fresh 1-segment pool, Allocate{600} is ENOSPC naming 384 as
    what could be had; the pool still has its 1 segment."""
    d = kvd_factory(pool_memory=budget(3))
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    used = c.stats()["daemon.pool_memory_used"]
    with kvd_error(kw.ENOSPC) as e:
        c.allocate(pool.pool_id, 600)
    assert "asked 600 blocks, %d could be had" % (3 * pool.bps) in e.value.message, \
        e.value.message
    st = pool_stats(c, pool)
    assert (st["segments"], st["blocks_total"], st["blocks_writing"]) == (1, pool.bps, 0), st
    assert c.stats()["daemon.pool_memory_used"] == used
    assert len(allocate(c, pool, 3 * pool.bps)) == 3 * pool.bps


def test_enospc_does_not_evict_other_pools(kvd_factory):
    """§6 Allocate: a refused Allocate parks nothing: pool A caches 128 blocks in its only
    (idle) segment; pool C holds 2 segments WRITING and asks 300 more blocks, which the budget
    (3 segments) cannot give even with A's segment; ENOSPC, and A's 128 blocks are still
    hits, its segment not parked."""
    d = kvd_factory(pool_memory=budget(3, pools=2))
    a, c = d.connect(), d.connect()
    pa = a.attach("a", LAYOUT)
    canon, hashes, _ = write_commit(a, pa, pa.bps)
    a.release(pa.pool_id, canon)
    pc = c.attach("c", LAYOUT)
    allocate(c, pc, 2 * pc.bps)
    with kvd_error(kw.ENOSPC):
        c.allocate(pc.pool_id, 300)
    st = pool_stats(a, pa)
    assert (st["segments_parked"], st["evictions_shrink"]) == (0, 0), st
    assert len(lookup(a, pa, hashes)) == len(hashes)


# =============================================================================================
# Request decoding (§2): strings, bodies, types

def _ld(field, payload):
    """One length-delimited protobuf field (for hand-made, non-UTF-8 string fields)."""
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


BAD_STRINGS = {
    "nul": b"ab\x00cd",
    "nul-last": b"abcd\x00",
    "invalid-byte": b"bad\xff\xfename",
    "overlong-nul": b"a\xc0\x80b",  # modified-UTF-8 NUL: not UTF-8
    "surrogate": b"a\xed\xa0\x80b",  # an encoded UTF-16 surrogate: not UTF-8
    "truncated": b"ab\xe2\x82",
}


def _hello_frame(req_id, name_bytes, epoch=0):
    body = b"\x08\x01" + _ld(2, name_bytes)  # Hello{protocol_version 1, client_name}
    env = _varint(1 << 3) + _varint(req_id)
    if epoch:
        env += b"\x11" + struct.pack("<Q", epoch)
    return env + _ld(10, body)


def _attach_frame(req_id, model_bytes, epoch=0):
    body = _ld(1, model_bytes) + _ld(2, LAYOUT.to_pb().SerializeToString())
    env = _varint(1 << 3) + _varint(req_id)
    if epoch:
        env += b"\x11" + struct.pack("<Q", epoch)
    return env + _ld(12, body)


@pytest.mark.parametrize("bad", sorted(BAD_STRINGS), ids=str)
def test_string_fields_must_be_utf8_without_nul(kvd, bad):
    """§2 / §7: Hello.client_name or AttachPool.model_id that is not UTF-8 or holds a NUL byte
    is EINVAL with the request's id, naming the field; the frame is skipped and the connection
    kept: a refused Hello leaves the session NEW (a good Hello then works), a refused attach
    makes no pool."""
    data = BAD_STRINGS[bad]
    c = kvd.connect(hello=False)
    c.send_raw(c.frame(_hello_frame(21, data)))
    with kvd_error(kw.EINVAL) as e:
        c.recv()
    assert e.value.req_id == 21 and "client_name" in e.value.message, str(e.value)
    with kvd_error(kw.EPROTO):  # still NEW
        c.ping()
    c.hello()
    c.send_raw(c.frame(_attach_frame(22, data, c.epoch)))
    with kvd_error(kw.EINVAL) as e:
        c.recv()
    assert e.value.req_id == 22 and "model_id" in e.value.message, str(e.value)
    assert c.stats()["daemon.pools"] == 0
    assert c.ping(nonce=5).nonce == 5


def test_string_fields_utf8_limits_are_bytes(kvd):
    """§6: client_name is at most 64 bytes and model_id 1..128 bytes (bytes, not characters);
    multi-byte UTF-8 is accepted; different model ids are different pools with their own
    seeds (§9)."""
    kvd.connect(name="é" * 32)
    with kvd_error(kw.EINVAL):
        kvd.connect(name="é" * 32 + "a")
    c = kvd.connect()
    p1 = c.attach("€" * 42 + "ab", LAYOUT)  # 128 bytes
    assert p1.hash_seed == _seed("€" * 42 + "ab", LAYOUT)
    with kvd_error(kw.EINVAL):
        c.attach("€" * 43, LAYOUT)  # 129 bytes
    p2 = c.attach("€" * 42 + "ac", LAYOUT)
    assert p1.pool_id != p2.pool_id and p1.hash_seed != p2.hash_seed


def test_no_body_and_unknown_type_keep_session_state(kvd):
    """§2: an envelope without a body is EPROTO with its id and an unknown request type is
    ENOTSUP with its id, also on a NEW session (which stays NEW: Hello still works after);
    §10: a newer client can fall back after ENOTSUP."""
    c = kvd.connect(hello=False)
    assert raw_reply(c, pb.Envelope(id=31).SerializeToString()) == (31, "error", kw.EPROTO)
    rid, which, code = raw_reply(c, pb.Envelope(id=32).SerializeToString() + UNKNOWN_BODY)
    assert (rid, which) == (32, "error")
    # §2 says ENOTSUP; §3 says any request before Hello is EPROTO: either names the request
    assert code in (kw.ENOTSUP, kw.EPROTO), code
    c.hello()
    assert raw_reply(c, pb.Envelope(id=33, boot_epoch=c.epoch).SerializeToString()
                     + UNKNOWN_BODY) == (33, "error", kw.ENOTSUP)
    assert c.stats()["session.errors"] >= 1
    assert c.ping(nonce=6).nonce == 6


@pytest.mark.parametrize("case", ["no-body", "unknown-type", "bad-model-id", "bad-client-name"])
def test_eepoch_before_decoding_faults(kvd, case):
    """§4: a request whose envelope boot_epoch is non-zero and differs is EEPOCH, 'checked
    before everything else, Hello included'; §7 'Which error' 1: EEPOCH before everything.
    So these envelopes with epoch 5 must all be EEPOCH (with their id): no body, an unknown
    body type, AttachPool with a NUL in model_id, Hello with a non-UTF-8 client_name."""
    c = kvd.connect(hello=case != "bad-client-name")
    bad_epoch = 5 if c.epoch != 5 else 6
    frames = {
        "no-body": pb.Envelope(id=41, boot_epoch=bad_epoch).SerializeToString(),
        "unknown-type": pb.Envelope(id=41, boot_epoch=bad_epoch).SerializeToString()
        + UNKNOWN_BODY,
        "bad-model-id": _attach_frame(41, b"m\x00x", bad_epoch),
        "bad-client-name": _hello_frame(41, b"n\xff", bad_epoch),
    }
    assert raw_reply(c, frames[case]) == (41, "error", kw.EEPOCH)


@pytest.mark.parametrize("guarantee", [128, 1, 0])
def test_parking_keeps_guarantee(kvd_factory, guarantee):
    """§6 Allocate / TENANCY.md: parking never takes a segment holding a cached block of a
    tenant at or under its guarantee in that pool. Tenant ta caches 128 blocks (its only,
    idle segment); tenant tb needs a second segment the budget has only if ta's is parked:
    with guarantee 128 (ta at it) tb gets ENOSPC and ta keeps its blocks; with guarantee 1
    (ta above it) or none, ta's segment is parked and tb gets its blocks."""
    quota = "quota ta guarantee=%d\n" % guarantee if guarantee else ""
    d = kvd_factory(files=TOKENS, pool_memory=budget(2, pools=2),
                    tenants=_token_tenants().replace("group g members=ta,tb\n", "") + quota)
    a = d.connect(token=TOKENS["a.tok"])
    pa = a.attach("m", LAYOUT)
    canon, hashes, _ = write_commit(a, pa, SEG_BLOCKS)
    a.release(pa.pool_id, canon)
    b = d.connect(token=TOKENS["b.tok"])
    pb_ = b.attach("m", LAYOUT)
    assert pb_.pool_id != pa.pool_id
    if guarantee == SEG_BLOCKS:
        with kvd_error(kw.ENOSPC):
            b.allocate(pb_.pool_id, SEG_BLOCKS + 1)
        st = pool_stats(a, pa)
        assert (st["segments_parked"], st["blocks_cached"]) == (0, SEG_BLOCKS), st
        assert lookup(a, pa, hashes) == canon
    else:
        assert len(allocate(b, pb_, SEG_BLOCKS + 1)) == SEG_BLOCKS + 1
        st = pool_stats(a, pa)
        assert (st["segments_parked"], st["blocks_cached"]) == (1, 0), st


# =============================================================================================
# Frame size limits and reply size (§2, §11)

@pytest.mark.parametrize("opts", [
    {"max_frame_bytes": "65535", "max_blocks_per_request": "16"},
    {"max_frame_bytes": "65536"},  # default 4096 blocks need 98304
    {"max_frame_bytes": "98303"},
    {"max_frame_bytes": "65536", "max_blocks_per_request": "2049"},
    {"max_blocks_per_request": "63489"},  # the default 1 MiB holds 63488
    {"max_blocks_per_request": "1048576"},
], ids=lambda o: ",".join("%s=%s" % kv for kv in sorted(o.items())))
def test_kvd_refuses_frame_limits_replies_would_not_fit(opts):
    """§2: max-frame-bytes must be at least 65536 and at least 16 * max-blocks-per-request +
    32768, else kvd refuses to start (exits non-zero)."""
    rc, out = run_kvd_expecting_refusal(opts)
    assert rc is not None and rc != 0, "kvd started with %s: %s" % (opts, out[-500:])


@pytest.mark.parametrize("opts", [
    {"max_frame_bytes": "65536", "max_blocks_per_request": "2048"},
    {"max_frame_bytes": "98304"},
    {"max_blocks_per_request": "63488"},
], ids=lambda o: ",".join("%s=%s" % kv for kv in sorted(o.items())))
def test_kvd_accepts_frame_limits_at_the_bound(kvd_factory, opts):
    """§2: the least settings that fit start, and HelloReply states them."""
    d = kvd_factory(**opts)
    r = d.connect().hello_reply
    assert r.max_frame_bytes == int(opts.get("max_frame_bytes", 1 << 20))
    assert r.max_blocks_per_request == int(opts.get("max_blocks_per_request", 4096))


def test_config_set_refuses_limits_replies_would_not_fit(kvd):
    """§2: 'config set refuses' a max-blocks-per-request that the running max-frame-bytes
    cannot hold; the value stays; one that fits is taken and new sessions see it (§11)."""
    r = kvd.admin("config set max-blocks-per-request 63489")
    assert not r["ok"], r
    assert kvd.admin_result("config get max-blocks-per-request")["value"] == "4096"
    assert kvd.connect().hello_reply.max_blocks_per_request == 4096
    kvd.admin_result("config set max-blocks-per-request 63488")
    assert kvd.connect().hello_reply.max_blocks_per_request == 63488


def test_lowered_list_limit_applies_to_open_sessions(kvd):
    """§11: a limit lowered at run time applies to sessions that said Hello before: a list
    longer than the new max-blocks-per-request is ETOOBIG with a message naming the limit;
    within it works; a new session's HelloReply states it."""
    c = kvd.connect()
    pool = c.attach("m", LAYOUT)
    assert c.hello_reply.max_blocks_per_request == 4096
    kvd.admin_result("config set max-blocks-per-request 8")
    for fn in (lambda: c.allocate(pool.pool_id, 9),
               lambda: c.lookup(pool.pool_id, [(1, 1)] * 9),
               lambda: c.release(pool.pool_id, [(0, 0)] * 9)):
        with kvd_error(kw.ETOOBIG) as e:
            fn()
        assert "8" in e.value.message, e.value.message
    assert len(allocate(c, pool, 8)) == 8
    assert kvd.connect().hello_reply.max_blocks_per_request == 8


def _reply_length(conn, req_id):
    """Reads the next reply (which must answer req_id); returns (its L, body name, body, fds)."""
    while len(conn.buf) < 4:
        assert conn._fill(), "connection closed"
    length = struct.unpack_from("<I", conn.buf)[0]
    which, body, fds = conn.recv(req_id)
    return length, which, body, fds


def test_reply_frames_within_max_frame_bytes(kvd_factory):
    """§2: replies are at most max_frame_bytes + 64 bytes, also at the least settings
    (max-frame-bytes 65536, max-blocks-per-request 2048): an AllocateReply and a Lookup
    (search_domains, so with pool_ids) naming 2048 blocks as BlockRefs, an AttachPoolReply and
    a MapSegmentsReply with 200 segments, a Pong with the longest payload and the largest
    nonce and id, Stats of a pool."""
    d = kvd_factory(max_frame_bytes="65536", max_blocks_per_request="2048",
                    segment_bytes="8K", pool_memory="16M",
                    tenants="tenant me uid=%d\ngroup g members=me\n" % ME)
    c = d.connect(features=0)
    c.max_frame_bytes = 1 << 30  # measure here instead of refusing in recv_frame
    limit = 65536 + kw.REPLY_SLACK
    pool = c.attach("m", LAYOUT)
    assert pool.attach_reply.linked
    lengths = {}
    rid = c.send("allocate", pb.Allocate(pool_id=pool.pool_id, count=2048))
    lengths["allocate"], _, rep, _ = _reply_length(c, rid)
    pool.follow(rep)
    blocks = kw.reply_blocks(rep)
    assert len(blocks) == 2048 and len(pool.segments) >= 201
    hashes = kw.hash_chain(pool.hash_seed, toks(2048), T)
    for i in range(0, 2048, 512):  # a 2048-entry Commit does not fit a 65536-byte request
        c.commit(pool.pool_id, [(b, h, kw.NO_PARENT)
                                for b, h in zip(blocks[i:i + 512], hashes[i:i + 512])])
    rid = c.send("lookup", c.lookup_msg(pool.pool_id, hashes, search_domains=True,
                                        packed=False))
    lengths["lookup"], _, rep, _ = _reply_length(c, rid)
    assert len(rep.blocks) == 2048 and list(rep.pool_ids) == [pool.pool_id] * 2048
    rid = c.send("attach_pool", pb.AttachPool(model_id="m", layout=LAYOUT.to_pb()))
    lengths["attach"], _, rep, fds = _reply_length(c, rid)
    assert len(rep.segments) == 200
    for fd in fds:
        os.close(fd)
    rid = c.send("map_segments", pb.MapSegments(pool_id=pool.pool_id))
    lengths["map_segments"], _, rep, fds = _reply_length(c, rid)
    assert len(rep.segments) == 200
    for fd in fds:
        os.close(fd)
    payload = b"p" * (65536 - 64)
    rid = c.send("ping", pb.Ping(nonce=2 ** 64 - 1, payload=payload), req_id=2 ** 64 - 1)
    lengths["pong"], _, rep, _ = _reply_length(c, rid)
    assert rep.payload == payload
    rid = c.send("stats", pb.Stats(pool_id=pool.pool_id))
    lengths["stats"], _, _, _ = _reply_length(c, rid)
    assert max(lengths.values()) <= limit, lengths


# =============================================================================================
# Frame completion timeout (§2)

@pytest.mark.parametrize("cut", ["first-byte", "header", "header+1", "all-but-one"])
def test_frame_timeout_closes_incomplete_frame(kvd_factory, cut):
    """§2: once the first byte of a request frame arrived, the frame must complete within
    frame-timeout-ms, else Error{ETIMEDOUT} with id 0 and the connection closes (§3: its
    leases are freed); other sessions are served meanwhile."""
    d = kvd_factory(frame_timeout_ms="200")
    o = d.connect()
    po = o.attach("m", LAYOUT)
    c = d.connect()
    allocate(c, c.attach("m", LAYOUT), 3)
    frame = c.frame(c.envelope("ping", pb.Ping(nonce=1, payload=b"x" * 20)).SerializeToString())
    n = {"first-byte": 1, "header": 4, "header+1": 5, "all-but-one": len(frame) - 1}[cut]
    t0 = time.monotonic()
    c.send_raw(frame[:n])
    assert o.ping(nonce=2).nonce == 2
    env, _ = c.recv_frame()
    elapsed = time.monotonic() - t0
    assert (env.id, env.WhichOneof("body"), env.error.code) == (0, "error", kw.ETIMEDOUT), env
    assert env.error.message.strip()
    assert elapsed >= 0.19, elapsed
    with kvd_error(kw.ECLOSED):
        c.recv_frame()
    assert wait_until(lambda: all_back(pool_stats(o, po))), pool_stats(o, po)


def test_frame_timeout_counts_from_the_first_byte(kvd_factory):
    """§2: the limit is for the whole frame from its first byte: a frame dribbled one byte per
    60 ms (longer in all than frame-timeout-ms 300, though bytes keep coming) gets ETIMEDOUT;
    a frame completed in two parts within the limit is served."""
    d = kvd_factory(frame_timeout_ms="300")
    c = d.connect()
    env = c.envelope("ping", pb.Ping(nonce=7, payload=b"y" * 4))
    frame = c.frame(env.SerializeToString())
    c.send_raw(frame[:5])
    time.sleep(0.05)
    c.send_raw(frame[5:])
    assert c.recv(env.id)[1].nonce == 7
    frame = c.frame(c.envelope("ping", pb.Ping(nonce=8, payload=b"z" * 30)).SerializeToString())
    t0 = time.monotonic()
    for byte in frame[:-1]:
        readable, _, _ = select.select([c.sock], [], [], 0.06)
        if readable:
            break
        try:
            c.send_raw(bytes([byte]))
        except kw.KvdError:
            break
    env, _ = c.recv_frame()
    assert (env.id, env.error.code) == (0, kw.ETIMEDOUT), env
    assert time.monotonic() - t0 < 60 * len(frame) / 1000, "timed out only at the end"


def test_frame_timeout_spares_idle_connections(kvd_factory):
    """§2: 'A connection that sends nothing is never timed out (an idle worker holding leases
    is normal)': idle for 3 x frame-timeout-ms, before and after Hello, with leases held."""
    d = kvd_factory(frame_timeout_ms="200")
    new = d.connect(hello=False)
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    blocks = allocate(c, pool, 4)
    time.sleep(0.6)
    assert c.ping(nonce=1).nonce == 1
    assert pool_stats(c, pool)["blocks_writing"] == 4
    new.hello()
    c.release(pool.pool_id, blocks)


def test_frame_timeout_is_runtime(kvd_factory):
    """§11: frame-timeout-ms is runtime; 0 = no limit: with it set to 0 a half frame waits
    3 x the old limit and is then served; set back, a half frame times out."""
    d = kvd_factory(frame_timeout_ms="200")
    d.admin_result("config set frame-timeout-ms 0")
    c = d.connect()
    env = c.envelope("ping", pb.Ping(nonce=3))
    frame = c.frame(env.SerializeToString())
    c.send_raw(frame[:3])
    time.sleep(0.6)
    c.send_raw(frame[3:])
    assert c.recv(env.id)[1].nonce == 3
    d.admin_result("config set frame-timeout-ms 200")
    c.send_raw(frame[:3])
    env, _ = c.recv_frame()
    assert (env.id, env.error.code) == (0, kw.ETIMEDOUT)


def test_frame_timeout_not_charged_for_flow_control(kvd_factory):
    """§5: with max-inflight replies unread the daemon stops reading; 'Nothing is refused;
    the client just waits' and may pipeline any number of requests. §2's timer is for a frame
    whose first byte 'arrived'; a client that wrote every frame at once and reads its replies
    slowly (one per 1.5 x frame-timeout-ms) must get every reply, not ETIMEDOUT: the daemon's
    own pause cannot be the client's fault. (kvd: after 5 pongs, 'a request frame stayed
    incomplete for 495 ms (11020 bytes of it arrived); frame-timeout-ms is 300: closing'.)"""
    d = kvd_factory(frame_timeout_ms="300", max_inflight="2")
    c = d.connect()
    envs = [c.envelope("ping", pb.Ping(nonce=i, payload=b"x" * 60000)) for i in range(10)]
    data = b"".join(c.frame(e.SerializeToString()) for e in envs)
    writer = threading.Thread(target=_send_ignoring_close, args=(c, data))
    writer.start()
    try:
        for i, e in enumerate(envs):
            time.sleep(0.45)
            env, _ = c.recv_frame()
            assert (env.id, env.WhichOneof("body")) == (e.id, "pong"), \
                "reply %d: %s" % (i, env)
    finally:
        writer.join()


def _send_ignoring_close(conn, data):
    try:
        conn.send_raw(data)
    except (kw.KvdError, OSError):
        pass


# =============================================================================================
# Holding and generations (§4, §7)

def test_not_held_is_eperm_whatever_gen(kvd):
    """§4: a request naming a block the session does not hold at all is EPERM whatever the
    gen (Release, Rewind, Pin, Commit): another session's COMMITTED and WRITING blocks with
    their gen and another, a FREE block with gen 0 and a random gen, a CACHED block nobody
    holds; ESTALE only for a block the session holds at another gen."""
    a, b = kvd.connect(), kvd.connect()
    pa, pb_ = a.attach("m", LAYOUT), b.attach("m", LAYOUT)
    P = pa.pool_id
    theirs, hashes, _ = write_commit(b, pb_, 1)
    their_w = allocate(b, pb_, 1)
    cached, _, _ = write_commit(b, pb_, 1, base=500)
    b.release(P, cached)
    mine, _, _ = write_commit(a, pa, 1, base=900)
    my_w = allocate(a, pa, 1)
    free_id = unused_id(pool_stats(a, pa)["blocks_total"],
                        theirs + their_w + cached + mine + my_w)
    not_held = [theirs[0], (theirs[0][0], theirs[0][1] ^ 1), their_w[0],
                (their_w[0][0], their_w[0][1] ^ 0x5a5a), (free_id, 0), (free_id, 0x7fff1234),
                cached[0], (cached[0][0], cached[0][1] ^ 3)]
    h = kw.hash_block(hashes[0], toks(1, 3000))
    for blk in not_held:
        for name, fn in (("release", lambda: a.release(P, [blk])),
                         ("rewind", lambda: a.rewind(P, [blk])),
                         ("pin", lambda: a.pin(P, [blk])),
                         ("commit", lambda: a.commit(P, [(blk, h, kw.NO_PARENT)]))):
            with kvd_error(kw.EPERM) as e:
                fn()
            assert e.value.message, (name, blk)
    for blk in ((mine[0][0], mine[0][1] ^ 1), (my_w[0][0], my_w[0][1] ^ 1)):
        for fn in (lambda: a.release(P, [blk]), lambda: a.rewind(P, [blk]),
                   lambda: a.pin(P, [blk]), lambda: a.commit(P, [(blk, h, kw.NO_PARENT)])):
            with kvd_error(kw.ESTALE):
                fn()
    st = pool_stats(a, pa)
    assert (st["session_refs"], st["blocks_writing"], st["blocks_pinned"]) == (2, 2, 0), st


# =============================================================================================
# Which error (§7): a request with several faults gets the first in the documented order

def _err(conn, body, msg, **kw_):
    try:
        conn.call(body, msg, **kw_)
        return "OK"
    except kw.KvdError as e:
        return e.name


def _refs(blocks):
    return [pb.BlockRef(id=i, gen=g) for i, g in blocks]


def test_which_error_envelope_and_pool_first(kvd_factory):
    """§7 'Which error' 1-2: EEPOCH before 'hello first' (EPROTO); ENOENT for the pool before
    any fault of the request's own fields."""
    d = kvd_factory(max_blocks_per_request="8")
    x = d.connect(hello=False)
    assert _err(x, "allocate", pb.Allocate(pool_id=999, count=0), epoch=0x77) == "EEPOCH"
    assert _err(x, "allocate", pb.Allocate(pool_id=999, count=0), epoch=0) == "EPROTO"
    assert _err(x, "hello", pb.Hello(protocol_version=2), epoch=0x77) == "EEPOCH"
    assert _err(x, "hello", pb.Hello(protocol_version=1, client_name="n" * 65),
                epoch=0x77) == "EEPOCH"
    c = d.connect()
    assert _err(c, "hello", pb.Hello(protocol_version=1), epoch=0x77) == "EEPOCH"  # not ESTATE
    assert _err(c, "hello", pb.Hello(protocol_version=1)) == "ESTATE"
    R = _refs([(0, 0)] * 9)
    for body, msg in (("allocate", pb.Allocate(pool_id=999, count=0)),
                      ("allocate", pb.Allocate(pool_id=999, count=9)),
                      ("lookup", pb.Lookup(pool_id=999, hashes_packed=b"\0" * 15)),
                      ("lookup", pb.Lookup(pool_id=999, hashes=[pb.Hash128()] * 9)),
                      ("release", pb.Release(pool_id=999, blocks=R)),
                      ("rewind", pb.Rewind(pool_id=999, blocks=R[:1], blocks_packed=b"\0" * 8)),
                      ("pin", pb.Pin(pool_id=999, retention_ms=10 ** 12, priority=999)),
                      ("pin", pb.Pin(pool_id=999, blocks=R)),
                      ("commit", pb.Commit(pool_id=999, entries=[pb.CommitEntry()] * 9)),
                      ("stats", pb.Stats(pool_id=999)),
                      ("map_segments", pb.MapSegments(pool_id=999))):
        assert _err(c, body, msg) == "ENOENT", (body, msg)


def test_which_error_fields_then_pool_kind(kvd_factory):
    """§7 'Which error' 3-4: the request's own fields (EINVAL, ETOOBIG, in field order) come
    before the pool's kind; of the kind, EPERM (read-only commons) before ESTATE (a linked
    pool whose segments were never fetched)."""
    d = kvd_factory(max_blocks_per_request="8",
                    tenants="tenant me uid=%d\ntenant peer uid=%d\ngroup g members=me,peer\n"
                            "commons min-tenants=2\n" % (ME, UID_A))
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    links = {x.domain: x.pool_id for x in pool.attach_reply.linked}
    G, CM, P = links["group:g"], links["commons"], pool.pool_id
    R9 = _refs([(0, 0)] * 9)
    cases = [
        # commons, never fetched: fields first, then EPERM (not ESTATE)
        ("allocate", pb.Allocate(pool_id=CM, count=0), "EINVAL"),
        ("allocate", pb.Allocate(pool_id=CM, count=9), "ETOOBIG"),
        ("allocate", pb.Allocate(pool_id=CM, count=1), "EPERM"),
        ("commit", pb.Commit(pool_id=CM, entries=[pb.CommitEntry()] * 9), "ETOOBIG"),
        ("commit", pb.Commit(pool_id=CM), "EPERM"),
        ("pin", pb.Pin(pool_id=CM, retention_ms=10 ** 12), "EINVAL"),
        ("pin", pb.Pin(pool_id=CM, priority=256), "EINVAL"),
        ("pin", pb.Pin(pool_id=CM, blocks=R9), "ETOOBIG"),
        ("pin", pb.Pin(pool_id=CM), "EPERM"),
        ("lookup", pb.Lookup(pool_id=CM, hashes=[pb.Hash128()] * 9), "ETOOBIG"),
        ("lookup", pb.Lookup(pool_id=CM, hashes_packed=b"\0" * 17), "EPROTO"),
        ("lookup", pb.Lookup(pool_id=CM), "ESTATE"),
        # group, never fetched: fields first, then ESTATE
        ("allocate", pb.Allocate(pool_id=G, count=0), "EINVAL"),
        ("allocate", pb.Allocate(pool_id=G, count=9), "ETOOBIG"),
        ("allocate", pb.Allocate(pool_id=G, count=1), "ESTATE"),
        ("lookup", pb.Lookup(pool_id=G, hashes_packed=b"\0" * 16 * 9), "ETOOBIG"),
        ("lookup", pb.Lookup(pool_id=G, hashes_packed=b"\0" * 15), "EPROTO"),
        ("lookup", pb.Lookup(pool_id=G), "ESTATE"),
        ("commit", pb.Commit(pool_id=G), "ESTATE"),
        # own pool, fields in field order: Pin.blocks (2) before retention_ms (3) and priority
        ("pin", pb.Pin(pool_id=P, blocks=R9, retention_ms=10 ** 12), "ETOOBIG"),
        ("pin", pb.Pin(pool_id=P, blocks=R9, priority=256), "ETOOBIG"),
        ("pin", pb.Pin(pool_id=P, retention_ms=10 ** 12, priority=256), "EINVAL"),
    ]
    got = [(body, msg, _err(c, body, msg)) for body, msg, _ in cases]
    assert [g[2] for g in got] == [want for _, _, want in cases], \
        [(b, w, g) for (b, _, w), (_, _, g) in zip(cases, got) if w != g]


@pytest.mark.parametrize("body", ["lookup", "release", "rewind", "commit"])
def test_which_error_toobig_before_malformed_packed(kvd_factory, body):
    """§7 'Which error' 3: 'the request's own fields, in field order: EINVAL, ETOOBIG, EPROTO
    (malformed packed lists)'. A repeated list of 9 entries at max-blocks-per-request 8
    (field 2) together with a packed field (field 4 / 3) that is malformed (bad length) or
    merely present is ETOOBIG by either reading (field order, or code order); kvd says
    EPROTO ('hashes_packed of 15 bytes: not a multiple of 16, or sent together with
    hashes')."""
    d = kvd_factory(max_blocks_per_request="8")
    c = d.connect()
    P = c.attach("m", LAYOUT).pool_id
    if body == "lookup":
        msgs = [pb.Lookup(pool_id=P, hashes=[pb.Hash128()] * 9, hashes_packed=b"\0" * n)
                for n in (15, 16)]
    elif body == "commit":
        e = pb.CommitEntry(block=pb.BlockRef(), hash=pb.Hash128())
        msgs = [pb.Commit(pool_id=P, entries=[e] * 9, entries_packed=b"\0" * n) for n in (27, 28)]
    else:
        cls = pb.Release if body == "release" else pb.Rewind
        msgs = [cls(pool_id=P, blocks=_refs([(0, 0)] * 9), blocks_packed=b"\0" * n)
                for n in (7, 8)]
    assert [_err(c, body, m) for m in msgs] == ["ETOOBIG", "ETOOBIG"]


def test_which_error_entries_in_list_order(kvd):
    """§7 'Which error' 5: entries in list order; for one entry ENOENT (no such block), EPERM
    (not held at all), ESTALE (held at another gen), EPERM (held fewer times than listed so
    far), ESTATE (wrong state), EINVAL (Commit parent). Nothing changes on any error."""
    a, b = kvd.connect(), kvd.connect()
    pa, pb_ = a.attach("m", LAYOUT), b.attach("m", LAYOUT)
    P = pa.pool_id
    canon, hashes, _ = write_commit(a, pa, 3)
    w = allocate(a, pa, 2)
    theirs, _, _ = write_commit(b, pb_, 1, base=5000)
    far = (pool_stats(a, pa)["blocks_total"] + 3, 0)
    stale = (canon[0][0], canon[0][1] ^ 1)
    other = theirs[0]
    rel = {
        "not held, no such": ([other, far], "EPERM"),
        "no such, not held": ([far, other], "ENOENT"),
        "stale, not held": ([stale, other], "ESTALE"),
        "not held, stale": ([other, stale], "EPERM"),
        "held once listed twice, stale": ([canon[1], canon[1], stale], "EPERM"),
        "held once, stale, again": ([canon[1], stale, canon[1]], "ESTALE"),
        "stale, twice": ([stale, canon[1], canon[1]], "ESTALE"),
    }
    for what, (blocks, want) in rel.items():
        for body, cls in (("release", pb.Release), ("rewind", pb.Rewind)):
            assert _err(a, body, cls(pool_id=P, blocks=_refs(blocks))) == want, (body, what)
    pins = {
        "committed, writing": ([canon[0], w[0]], "ESTATE"),
        "writing, not held": ([w[0], other], "ESTATE"),
        "not held, writing": ([other, w[0]], "EPERM"),
        "stale, writing": ([stale, w[0]], "ESTALE"),
        "no such, stale": ([far, stale], "ENOENT"),
    }
    for what, (blocks, want) in pins.items():
        assert _err(a, "pin", pb.Pin(pool_id=P, blocks=_refs(blocks), retention_ms=1000)) \
            == want, ("pin", what)
    h = [kw.hash_block(hashes[-1], toks(1, 9000 + i)) for i in range(3)]
    NP = kw.NO_PARENT
    commits = {
        "bad parent, no such block": ([(w[0], h[0], w[0][0]), (far, h[1], NP)], "EINVAL"),
        "no such block, bad parent": ([(far, h[1], NP), (w[0], h[0], w[0][0])], "ENOENT"),
        "committed block with bad parent": ([(canon[0], h[0], w[0][0])], "ESTATE"),
        "not held with bad parent": ([(other, h[0], other[0])], "EPERM"),
        "stale with bad parent": ([((w[0][0], w[0][1] ^ 1), h[0], w[0][0])], "ESTALE"),
        "listed twice, then bad parent": ([(w[0], h[0], NP), (w[0], h[1], w[0][0])], "ESTATE"),
        "bad parent, then listed twice": ([(w[1], h[0], w[1][0]), (w[0], h[1], NP),
                                           (w[0], h[2], NP)], "EINVAL"),
    }
    for what, (entries, want) in commits.items():
        m = pb.Commit(pool_id=P)
        for (bid, gen), (lo, hi), parent in entries:
            m.entries.add(block=pb.BlockRef(id=bid, gen=gen), hash=pb.Hash128(lo=lo, hi=hi),
                          parent=parent)
        assert _err(a, "commit", m) == want, ("commit", what)
    st = pool_stats(a, pa)
    assert (st["session_refs"], st["blocks_writing"], st["blocks_pinned"]) == (5, 2, 0), st
    assert lookup(b, pb_, [h[0]]) == []


def test_which_error_limits_last(kvd_factory):
    """§7 'Which error' 5-6: entry faults before the tenant's limits, EQUOTA before ENOSPC;
    nothing changes."""
    d = kvd_factory(pool_memory=budget(1), tenants="quota default max-held=200 max-pinned=1\n")
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    P = pool.pool_id
    canon, _, _ = write_commit(c, pool, 2)
    w = allocate(c, pool, 1)
    o = d.connect()
    theirs, _, _ = write_commit(o, o.attach("m", LAYOUT), 1, base=700)
    assert _err(c, "allocate", pb.Allocate(pool_id=P, count=250)) == "EQUOTA"  # and ENOSPC
    assert _err(c, "pin", pb.Pin(pool_id=P, blocks=_refs(canon + w), retention_ms=9)) == "ESTATE"
    assert _err(c, "pin", pb.Pin(pool_id=P, blocks=_refs(canon + theirs),
                                 retention_ms=9)) == "EPERM"
    assert _err(c, "pin", pb.Pin(pool_id=P, blocks=_refs(canon), retention_ms=9)) == "EQUOTA"
    st = pool_stats(c, pool)
    assert (st["blocks_pinned"], st["blocks_writing"], st["session_refs"]) == (0, 1, 3), st
    with kvd_error(kw.ENOSPC):  # within the quota (4 + 150 <= 200), beyond the budget
        c.allocate(P, 150)


# =============================================================================================
# Pin (§6 Pin, docs/TENANCY.md max-pinned)

def _evictable_all(conn, pool):
    """True if Allocate can take every block of the one-segment pool (nothing pinned or
    held); the blocks are released again."""
    total = pool_stats(conn, pool)["blocks_total"]
    try:
        got = conn.allocate(pool.pool_id, total)
    except kw.KvdError as e:
        assert e.code == kw.ENOSPC, str(e)
        return False
    conn.release(pool.pool_id, kw.reply_blocks(got))
    return True


def test_pin_again_extends_retention(kvd_factory):
    """§6 Pin: pinning a pinned block again keeps the later of the two retentions: 150 ms then
    10 min, and 10 min then 150 ms, both still pin the block 400 ms later; unpinned it goes."""
    d = kvd_factory(pool_memory=budget(1))
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    for base, (first, second) in enumerate(((150, 600000), (600000, 150))):
        blk, hashes, _ = write_commit(c, pool, 1, base=base * 100)
        c.pin(pool.pool_id, blk, retention_ms=first, priority=1)
        c.pin(pool.pool_id, blk, retention_ms=second, priority=9)
        c.release(pool.pool_id, blk)
        time.sleep(0.4)
        assert not _evictable_all(c, pool), (first, second)
        assert lookup(c, pool, hashes) == blk
        c.pin(pool.pool_id, blk, unpin=True)
        c.release(pool.pool_id, blk)
        assert _evictable_all(c, pool), (first, second)


def test_pin_retention_zero_and_unpin_of_unpinned(kvd_factory):
    """§6 Pin: retention_ms = 0 pins nothing (the block stays evictable) and removes nothing
    (a pinned block stays pinned); unpinning a block that is not pinned succeeds."""
    d = kvd_factory(pool_memory=budget(1))
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    P = pool.pool_id
    blk, hashes, _ = write_commit(c, pool, 2)
    c.pin(P, blk[:1], retention_ms=0)
    c.pin(P, blk[1:], unpin=True)
    assert pool_stats(c, pool)["blocks_pinned"] == 0
    c.pin(P, blk[1:], retention_ms=600000)
    c.pin(P, blk[1:], retention_ms=0)
    c.release(P, blk)
    with kvd_error(kw.ENOSPC) as e:
        c.allocate(P, pool.bps)
    assert "could be had" in e.value.message and "%d could" % (pool.bps - 1) in e.value.message


def test_pin_listed_twice_costs_one_unit(kvd_factory):
    """§6 Pin: 'a block listed twice is pinned once' and a block has at most one pin costing
    one unit of max-pinned: with max-pinned=1, Pin{[X, X]} succeeds."""
    d = kvd_factory(tenants="quota default max-pinned=1\n")
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    blk, _, _ = write_commit(c, pool, 2)
    c.pin(pool.pool_id, [blk[0], blk[0]], retention_ms=60000)
    assert pool_stats(c, pool)["blocks_pinned"] == 1
    with kvd_error(kw.EQUOTA):
        c.pin(pool.pool_id, blk[1:], retention_ms=60000)


def test_pin_retention_zero_costs_no_quota(kvd_factory):
    """§6 Pin: 'retention_ms = 0 pins nothing (and removes nothing)', so it cannot exceed
    max-pinned: with max-pinned=1 used by block X, Pin{Y, retention 0} succeeds and X stays
    the one pin."""
    d = kvd_factory(tenants="quota default max-pinned=1\n")
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    blk, _, _ = write_commit(c, pool, 2)
    c.pin(pool.pool_id, blk[:1], retention_ms=60000)
    c.pin(pool.pool_id, blk[1:], retention_ms=0)
    assert pool_stats(c, pool)["blocks_pinned"] == 1


def test_expired_pin_stops_counting_while_held(kvd_factory):
    """§6 Pin / TENANCY.md: an expired pin stops counting against max-pinned at once, also
    while the block is referenced."""
    d = kvd_factory(tenants="quota default max-pinned=1\n")
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    blk, _, _ = write_commit(c, pool, 2)  # both held all along
    c.pin(pool.pool_id, blk[:1], retention_ms=1000)
    with kvd_error(kw.EQUOTA) as e:
        c.pin(pool.pool_id, blk[1:], retention_ms=60000)
    assert "max-pinned" in e.value.message
    time.sleep(1.2)
    c.pin(pool.pool_id, blk[1:], retention_ms=60000)


TOKENS = {"a.tok": b"token-of-tenant-a-0123456789", "b.tok": b"token-of-tenant-b-0123456789"}


def _token_tenants(extra=""):
    """Two token tenants ta and tb of this test's own uid (no root needed), in group g."""
    return ("tenant ta uid=%d token-file={dir}/a.tok\ntenant tb uid=%d token-file={dir}/b.tok\n"
            "group g members=ta,tb\n" % (ME, ME)) + extra


def test_pin_charged_to_pinning_tenant(kvd_factory):
    """§6 Pin / TENANCY.md: a pin is charged to the max-pinned of the tenant whose session set
    it, not of the tenant that allocated the block: tb pins ta's block in their group pool;
    ta can still pin one block of its own, tb cannot pin a second."""
    d = kvd_factory(files=TOKENS, tenants=_token_tenants("quota default max-pinned=1\n"))
    a, b = d.connect(token=TOKENS["a.tok"]), d.connect(token=TOKENS["b.tok"])
    assert (a.hello_reply.tenant, b.hello_reply.tenant) == ("ta", "tb")
    pa, pb_ = a.attach("m", LAYOUT), b.attach("m", LAYOUT)
    ga = a.linked_pool(pa, pa.attach_reply.linked[0])
    gb = b.linked_pool(pb_, pb_.attach_reply.linked[0])
    assert ga.pool_id == gb.pool_id
    canon, hashes, _ = write_commit(a, ga, 3)
    hb = lookup(b, gb, hashes)
    assert hb == canon
    b.pin(gb.pool_id, hb[:1], retention_ms=60000)
    a.pin(ga.pool_id, canon[1:2], retention_ms=60000)
    with kvd_error(kw.EQUOTA):
        b.pin(gb.pool_id, hb[2:3], retention_ms=60000)
    with kvd_error(kw.EQUOTA):
        a.pin(ga.pool_id, canon[2:3], retention_ms=60000)
    assert d.admin_result("quota get ta")["usage"]["pinned"] == 1
    assert d.admin_result("quota get tb")["usage"]["pinned"] == 1


# =============================================================================================
# Pool lifetime and max-pools (§6 AttachPool "Pools", docs/TENANCY.md)

def test_unused_empty_pool_is_freed(kvd):
    """§6 'Pools': a pool no session uses and that holds nothing is freed when its last session
    closes (its memory goes back); one holding CACHED blocks lives on; a pool emptied later
    (admin evict) is freed before a new pool is made; pool ids are never reused."""
    o = kvd.connect()
    x = kvd.connect()
    tmp = x.attach("tmp", LAYOUT)
    allocate(x, tmp, 3)  # WRITING, freed with the session
    keep = x.attach("keep", LAYOUT)
    canon, hashes, _ = write_commit(x, keep, 2)
    assert o.stats()["daemon.pools"] == 2
    x.goodbye()
    assert wait_until(lambda: o.stats()["daemon.pools"] == 1), o.stats()
    assert [p["model"] for p in kvd.admin_result("pools")["pools"]] == ["keep"]
    used = o.stats()["daemon.pool_memory_used"]
    assert LAYOUT.segment_bytes(SEG_BLOCKS) <= used <= SEG_COST + POOL_META, used
    kvd.admin_result("evict all")
    y = kvd.connect()
    again = y.attach("tmp", LAYOUT)
    assert again.pool_id not in (tmp.pool_id, keep.pool_id)
    assert [p["model"] for p in kvd.admin_result("pools")["pools"]] == ["tmp"]
    assert y.attach("keep", LAYOUT).pool_id not in (tmp.pool_id, keep.pool_id, again.pool_id)


def test_max_pools(kvd_factory):
    """§6 AttachPool: with max-pools pools in use, attaching a new one is ENOSPC (joining an
    existing one works); idle empty pools are freed to make room; a pool with cached blocks
    counts; max-pools is runtime (§11)."""
    d = kvd_factory(max_pools="2")
    a, b = d.connect(), d.connect()
    a.attach("a", LAYOUT)
    pb_ = b.attach("b", LAYOUT)
    with kvd_error(kw.ENOSPC) as e:
        d.connect().attach("c", LAYOUT)
    assert "max-pools" in e.value.message, e.value.message
    assert d.connect().attach("a", LAYOUT).pool_id  # an existing pool
    write_commit(b, pb_, 1)
    b.close()  # "b" keeps a cached block: still counts
    time.sleep(0.05)
    with kvd_error(kw.ENOSPC):
        d.connect().attach("c", LAYOUT)
    d.admin_result("config set max-pools 3")
    c = d.connect()
    c.attach("c", LAYOUT)
    d.admin_result("config set max-pools 1")
    with kvd_error(kw.ENOSPC):
        c.attach("d", LAYOUT)


def test_max_pools_quota(kvd_factory):
    """docs/TENANCY.md max-pools: a tenant whose attaches made max-pools live pools gets
    EQUOTA naming max-pools for one more (other tenants are not affected); joining its existing
    pool works; once its pools are freed (unused and empty) it can attach again."""
    d = kvd_factory(files=TOKENS, tenants=_token_tenants().replace("group g members=ta,tb\n", "")
                    + "quota default max-pools=1\n")
    a = d.connect(token=TOKENS["a.tok"])
    a.attach("x", kw.Layout(1, 1, 8, 16, pb.FP16, pb.BLOCK_MAJOR))
    with kvd_error(kw.EQUOTA) as e:
        a.attach("y", LAYOUT)
    assert "max-pools" in e.value.message, e.value.message
    a2 = d.connect(token=TOKENS["a.tok"])
    a2.attach("x", kw.Layout(1, 1, 8, 16, pb.FP16, pb.BLOCK_MAJOR))
    b = d.connect(token=TOKENS["b.tok"])
    b.attach("z", LAYOUT)
    a.close()
    a2.close()
    a3 = d.connect(token=TOKENS["a.tok"])
    assert wait_until(lambda: _attaches(a3, "y"))


def _attaches(conn, model):
    try:
        conn.attach(model, LAYOUT)
        return True
    except kw.KvdError as e:
        assert e.code == kw.EQUOTA, str(e)
        return False


@pytest.mark.parametrize("limit", ["daemon", "quota"])
def test_max_pools_does_not_drop_linked_pools(kvd_factory, limit):
    """§6 AttachPool: linked is 'the same model's pools in the tenant's other domains'; a
    tenant with a group and the commons attaching a new model either gets all of them (one per
    domain after its private one, HelloReply.domains order) or an error (ENOSPC / EQUOTA), not
    a pool cut off from its group and the commons. kvd, max-pools=2: linked = [group:g] only;
    quota max-pools=1: linked = []."""
    tenants = "tenant me uid=%d\ngroup g members=me\ncommons\n" % ME
    if limit == "daemon":
        d = kvd_factory(max_pools="2", tenants=tenants)
    else:
        d = kvd_factory(tenants=tenants + "quota default max-pools=1\n")
    c = d.connect()
    assert list(c.hello_reply.domains) == ["me", "group:g", "commons"]
    try:
        pool = c.attach("m", LAYOUT)
    except kw.KvdError as e:
        assert e.code in (kw.ENOSPC, kw.EQUOTA), str(e)
        return
    assert [x.domain for x in pool.attach_reply.linked] == ["group:g", "commons"]


# =============================================================================================
# Commons promotion (docs/TENANCY.md, §8)

def _commit_as(d, token, model, hashes, hold=False):
    c = d.connect(token=token)
    pool = c.attach(model, LAYOUT)
    blocks = allocate(c, pool, len(hashes))
    for (bid, _), h in zip(blocks, hashes):
        pool.write_block(bid, kw.block_pattern(LAYOUT, kw.hash_hex(h)))
    parent, entries = kw.NO_PARENT, []
    for b, h in zip(blocks, hashes):
        entries.append((b, h, parent))
        parent = b[0]
    c.commit(pool.pool_id, entries)
    if not hold:
        c.goodbye()
    return c


def _commons_hits(d, model, hashes):
    c = d.connect()  # tenant uid-<ME>: neither ta nor tb
    pool = c.attach(model, LAYOUT)
    rep = c.lookup(pool.pool_id, hashes, search_domains=True)
    return len(kw.reply_blocks(rep))


def test_commons_promotion_with_token_tenants(kvd_factory):
    """docs/TENANCY.md: once min-tenants=2 distinct tenants committed a block hash in their own
    domains, a third tenant hits it through the commons (the first committer stays connected
    while the second commits)."""
    d = kvd_factory(files=TOKENS, tenants=_token_tenants().replace("group g members=ta,tb\n", "")
                    + "commons min-tenants=2\n")
    hashes = kw.hash_chain(_seed("cm", LAYOUT), toks(2, 11), T)
    first = _commit_as(d, TOKENS["a.tok"], "cm", hashes, hold=True)
    _commit_as(d, TOKENS["b.tok"], "cm", hashes)
    assert _commons_hits(d, "cm", hashes) == 2
    first.close()


def test_commons_count_survives_idle_commons_pool(kvd_factory):
    """docs/TENANCY.md: 'A prefix block enters the commons only after k distinct tenants ...
    have committed the same block hash in their own domains'. Tenant ta commits and leaves;
    the commons pool, empty and unused, is freed (§6 'Pools'); tb commits the same hashes and
    leaves: that is 2 distinct tenants, so a third tenant must hit the commons. kvd: no hit
    (each attach makes a new commons pool, and the count is keyed by commons pool)."""
    d = kvd_factory(files=TOKENS, tenants=_token_tenants().replace("group g members=ta,tb\n", "")
                    + "commons min-tenants=2\n")
    hashes = kw.hash_chain(_seed("cm", LAYOUT), toks(2, 11), T)
    _commit_as(d, TOKENS["a.tok"], "cm", hashes)
    _commit_as(d, TOKENS["b.tok"], "cm", hashes)
    assert _commons_hits(d, "cm", hashes) == 2


# =============================================================================================
# Lookup details (§6 Lookup)

def test_lookup_repeated_hash_gives_a_reference_each(kvd):
    """§6 Lookup: [h, h, h] hitting one block gives that block three times and three
    references, each released separately."""
    c = kvd.connect()
    pool = c.attach("m", LAYOUT)
    canon, hashes, _ = write_commit(c, pool, 1)
    c.release(pool.pool_id, canon)
    got = lookup(c, pool, hashes * 3)
    assert got == canon * 3
    st = pool_stats(c, pool)
    assert (st["session_refs"], st["blocks_committed"]) == (3, 1)
    c.release(pool.pool_id, got[:1])
    assert pool_stats(c, pool)["session_refs"] == 2
    c.release(pool.pool_id, got[1:])
    st = pool_stats(c, pool)
    assert (st["session_refs"], st["blocks_cached"]) == (0, 1)
    with kvd_error(kw.EPERM):
        c.release(pool.pool_id, canon)


def test_blocks_per_segment_cap(kvd_factory):
    """§6 AttachPool: blocks_per_segment is floor(segment-bytes / block_bytes) capped at 65536,
    rounded down to a multiple of m (here 2048 and 1024)."""
    d = kvd_factory(segment_bytes="1M", pool_memory="16M")
    c = d.connect()
    for lay in (kw.Layout(1, 1, 1, 1, pb.FP16, pb.BLOCK_MAJOR),
                kw.Layout(1, 1, 2, 1, pb.FP16, pb.LAYER_MAJOR)):
        r = c.attach("cap", lay).attach_reply
        assert r.blocks_per_segment == 65536, _shape_id(lay)
        assert [s.bytes for s in r.segments] == [lay.segment_bytes(65536)]
        assert identity_holds(pool_stats(c, c.pools[r.pool_id]))


# =============================================================================================
# Socket (§1)

def _mode(path):
    return os.stat(path).st_mode & 0o7777


def test_socket_directory_created_with_mode(kvd_factory):
    """§1: a socket directory that does not exist is created with socket-dir-mode (default
    0700); the socket file gets socket-mode (default 0600); admin.sock lands beside it."""
    d = kvd_factory(socket_dir_mode=None, socket_mode=None)
    assert _mode(os.path.dirname(d.sock)) == 0o700
    assert stat.S_ISSOCK(os.stat(d.sock).st_mode) and _mode(d.sock) == 0o600
    d2 = kvd_factory(socket_dir_mode="0751", socket_mode="0640")
    assert (_mode(os.path.dirname(d2.sock)), _mode(d2.sock)) == (0o751, 0o640)
    assert d2.connect().ping(nonce=1).nonce == 1


def test_socket_existing_directory_is_kept(kvd_factory):
    """§1: an existing socket directory is used as it is: its mode is not changed."""
    def setup(tmp):
        os.mkdir(os.path.join(tmp, "ex"))
        os.chmod(os.path.join(tmp, "ex"), 0o750)
    d = kvd_factory(setup=setup, socket="{dir}/ex/kvd.sock", admin_socket="{dir}/ex/admin.sock",
                    socket_dir_mode="0700")
    assert _mode(os.path.dirname(d.sock)) == 0o750
    assert d.connect().ping(nonce=1).nonce == 1


def test_socket_directory_parents_not_created():
    """§1: the daemon creates the socket's directory one level only, not its parents: with
    two missing levels it does not start."""
    rc, out = run_kvd_expecting_refusal({"socket": "{dir}/a/b/kvd.sock",
                                         "admin_socket": "{dir}/admin.sock"})
    assert rc is not None and rc != 0, out[-500:]


@needs_root
def test_default_socket_directory_must_be_ours(kvd_factory):
    """§1: for the default path ($XDG_RUNTIME_DIR/kvd/kvd.sock) an existing directory must
    belong to the daemon's uid, else kvd does not start; a missing one is created 0700, with
    admin.sock beside the socket."""
    def foreign(tmp):
        os.makedirs(os.path.join(tmp, "xdg", "kvd"))
        os.chown(os.path.join(tmp, "xdg", "kvd"), UID_A, UID_A)
    opts = {"socket": None, "admin_socket": None, "socket_dir_mode": None}
    env = dict(os.environ, XDG_RUNTIME_DIR="{dir}/xdg")
    rc, out = run_kvd_expecting_refusal(opts, setup=foreign, env=env)
    assert rc is not None and rc != 0, out[-500:]
    d = kvd_factory(setup=lambda tmp: os.mkdir(os.path.join(tmp, "xdg")), env=env, **opts)
    assert d.sock == os.path.join(d.dir, "xdg", "kvd", "kvd.sock")
    assert _mode(os.path.dirname(d.sock)) == 0o700
    assert stat.S_ISSOCK(os.stat(os.path.join(d.dir, "xdg", "kvd", "admin.sock")).st_mode)
    assert d.connect().ping(nonce=1).nonce == 1


# =============================================================================================
# Options (§11)

def test_help_marks_runtime_options():
    """§11: max-pools and frame-timeout-ms are runtime (its table says so), and options marked
    runtime in `kvd --help` can be changed while kvd runs; so --help marks them."""
    out = subprocess.run([kvd_binary(), "--help"], capture_output=True, text=True,
                         timeout=10).stdout
    blocks = {}
    for line in out.splitlines():
        if line.startswith("  --"):
            name = line.split("=")[0].strip()[2:]
            blocks[name] = line
        elif blocks and line.startswith("      "):
            blocks[name] += line
    assert "max-pools" in blocks and "frame-timeout-ms" in blocks, sorted(blocks)
    assert "runtime" in blocks["max-pools"].lower(), blocks["max-pools"]
    assert "runtime" in blocks["frame-timeout-ms"].lower(), blocks["frame-timeout-ms"]


# =============================================================================================
# Admin side notes of the first runs (docs/ADMIN.md)

def test_admin_peer_that_leaves_before_its_replies(kvd):
    """An admin client that sends 50 commands and closes without reading: kvd's writes meet a
    closed socket (EPIPE) and kvd keeps serving (SIGPIPE ended the daemon, nothing logged)."""
    for _ in range(3):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(kvd.admin_sock)
        s.sendall(b"help\n" * 50)
        s.close()
    time.sleep(0.3)
    assert kvd.alive()
    assert kvd.admin_result("stats")["daemon"]["sessions"] >= 0
    c = kw.Conn(kvd.sock)
    c.hello()
    assert c.ping(nonce=3).nonce == 3


def test_admin_evict_dry_run_max_is_bounded(kvd):
    """evict --dry-run with a max whose list would not fit memory (its size used to wrap: a
    small buffer and the dry run wrote past it): EINVAL naming the limit, kvd serves on."""
    r = kvd.admin("evict --dry-run all max=2305843009213693953")
    assert not r["ok"] and "at most 1000000" in r["error"]["message"], r
    assert kvd.admin_result("evict --dry-run all max=5")["dry_run"] is True
    assert kvd.alive()


def test_health_probe_with_fds_past_1023(kvd_factory):
    """/healthz answers while kvd holds more than 1024 descriptors (1100 client connections):
    the metrics server polled with select(), which refused every connection whose socket
    number passed 1023, so health probes failed once a daemon's cache filled its fds."""
    import resource
    import urllib.request
    from test_kv_events import free_ports
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1300:
        pytest.skip("needs 1300 open files (hard limit %d)" % hard)
    if soft != resource.RLIM_INFINITY and soft < 1300:  # (kvd inherits it)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    (port,) = free_ports(1)
    d = kvd_factory(metrics_port=str(port), max_connections="2000")
    conns = []
    try:
        for _ in range(1100):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(d.sock)
            conns.append(c)
        # kvd accepts them all (its fds 1024 and up are in use): a Ping on the last one is
        # answered only after kvd has accepted every connection before it.
        c = kw.Conn(d.sock)
        c.hello()
        assert c.ping(nonce=4).nonce == 4
        conns.append(c.sock)
        with urllib.request.urlopen("http://127.0.0.1:%d/healthz" % port, timeout=10) as r:
            assert r.status == 200
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as r:
            assert r.status == 200 and b"kvd_" in r.read()
    finally:
        for c in conns:
            c.close()
    assert d.alive()


def test_admin_names_the_commons_domain(kvd_factory):
    """`stats` and `pools` name a commons pool's domain `commons` (it read '?')."""
    d = kvd_factory(tenants="tenant me uid=%d\ncommons\n" % ME)
    c = d.connect()
    c.attach("m", LAYOUT)
    doms = sorted(p["domain"] for p in d.admin_result("stats")["pools"])
    assert doms == ["commons", "me"], doms
    pools = d.admin_result("pools")["pools"]
    assert sorted(p["domain"] for p in pools) == ["commons", "me"]


def test_admin_names_every_policy(kvd_factory):
    """`pools` names the prefix-lru policy as the option spells it (it read 'lru')."""
    d = kvd_factory(evict_policy="prefix-lru")
    c = d.connect()
    c.attach("m", LAYOUT)
    pools = d.admin_result("pools")["pools"]
    assert {p["policy"] for p in pools} == {"prefix-lru"}, pools


def test_admin_socket_in_a_missing_directory_is_named(tmp_path):
    """An admin-socket whose directory does not exist: kvd exits 1 and says so (libuv's bind
    error read 'permission denied')."""
    sock_dir = tmp_path / "run"
    sock_dir.mkdir(mode=0o700)
    r = subprocess.run([kvd_binary(), "--socket=%s" % (sock_dir / "kvd.sock"),
                        "--admin-socket=%s" % (tmp_path / "missing" / "admin.sock"),
                        "--backend=host", "--pool-memory=8M", "--segment-bytes=256K",
                        "--index-entries=16K"],
                       capture_output=True, text=True, timeout=20)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "does not exist" in r.stderr and "missing" in r.stderr, r.stderr


def test_admin_pin_counts_from_now_on_an_idle_pool(kvd):
    """docs/ADMIN.md `pin ... retention=MS`: the retention counts from the pin. The pool's clock
    only moves with requests, and an admin pin on a pool idle longer than the retention used to
    count from the pool's last request: the pin had expired when it was set, and the next
    request swept it (blocks_pinned 0 at once)."""
    import time
    c = kvd.connect()
    pool = c.attach("m", LAYOUT)
    canon, hashes, _ = write_commit(c, pool, 1)
    c.release(pool.pool_id, canon)
    time.sleep(1.5)  # the pool idles; its clock stays at the release
    kvd.admin_result("pin %s pool=%d retention=1000" % (kw.hash_hex(hashes[0]), pool.pool_id))
    assert pool_stats(c, pool)["blocks_pinned"] == 1  # this request moves the clock to now


def test_refusal_event_names_the_pool(kvd_factory):
    """docs/ADMIN.md `events`: a refusal of a request that names a pool records that pool
    (it used to record pool 0 for every refusal)."""
    d = kvd_factory(pool_memory=budget(1))
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    with kvd_error(kw.ENOSPC):
        c.allocate(pool.pool_id, 1000)
    ev = d.admin_result("events kind=refuse")["events"]
    assert ev and ev[-1]["reason"] == "ENOSPC"
    assert ev[-1]["pool"] == pool.pool_id


def test_admin_pin_by_hash_prefix(kvd):
    """docs/ADMIN.md `pin HASH`: a unique prefix of at least 6 hex digits names the block;
    a shorter or ambiguous one is refused with a message."""
    c = kvd.connect()
    pool = c.attach("m", LAYOUT)
    canon, hashes, _ = write_commit(c, pool, 2)
    full = kw.hash_hex(hashes[0])
    r = kvd.admin_result("pin %s pool=%d" % (full[:8], pool.pool_id))
    assert r["block"] == canon[0][0]
    r = kvd.admin("pin %s pool=%d" % (full[:4], pool.pool_id))
    assert not r["ok"] and "6" in r["error"]["message"]
    assert pool_stats(c, pool)["blocks_pinned"] == 1


def test_detach_pool_gives_back_the_session_s_blocks(kvd):
    """PROTOCOL.md DetachPool: the session's leases and references in the pool are released
    (released counts them), the pool is no longer the session's (ENOENT on reuse), and a
    second session's view is unchanged; attaching again works."""
    a, b = kvd.connect(), kvd.connect()
    pa = a.attach("m", LAYOUT)
    pb_ = b.attach("m", LAYOUT)
    canon, hashes, _ = write_commit(a, pa, 2)
    allocate(a, pa, 3)
    assert pool_stats(b, pb_)["blocks_writing"] == 3
    r = a.detach(pa.pool_id)
    assert r.released == 5
    st = pool_stats(b, pb_)
    assert st["blocks_writing"] == 0
    assert lookup(b, pb_, hashes) == canon  # the cached blocks stay cached
    with kvd_error(kw.ENOENT):
        a.allocate(pa.pool_id, 1)
    with kvd_error(kw.ENOENT):
        a.detach(pa.pool_id)
    again = a.attach("m", LAYOUT)
    assert again.pool_id == pa.pool_id
    allocate(a, again, 1)


def test_attach_with_another_layout_is_flagged(kvd_factory):
    """PROTOCOL.md AttachPoolReply.layout_conflict: a model id attached with two layouts gets
    two pools that share nothing; the second reply says so and kvd logs KVD-POOL-LAYOUT.
    With strict-layouts the second attach is EINVAL instead."""
    d = kvd_factory()
    c = d.connect()
    first = c.attach("m", LAYOUT)
    assert not first.attach_reply.layout_conflict
    other = kw.Layout(2, 4, 8, 16, pb.FP16, pb.LAYER_MAJOR)
    second = c.attach("m", other)
    assert second.attach_reply.layout_conflict
    assert second.pool_id != first.pool_id
    assert "KVD-POOL-LAYOUT" in d.read_log()
    s = kvd_factory(strict_layouts="true")
    c = s.connect()
    c.attach("m", LAYOUT)
    with kvd_error(kw.EINVAL) as e:
        c.attach("m", other)
    assert "strict-layouts" in e.value.message


def test_binary_client_on_admin_socket_is_told(kvd):
    """docs/ADMIN.md: a worker pointed at the admin socket gets one error line naming the
    client socket at once, not a silent wait for a newline."""
    import socket
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(kvd.admin_sock)
    s.sendall(b"\x10\x00\x00\x00" + b"\x08" * 16)  # a length-prefixed frame
    data = b""
    while not data.endswith(b"\n"):
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    s.close()
    r = json.loads(data)
    assert not r["ok"] and r["error"]["code"] == "EPROTO"
    assert "client socket" in r["error"]["message"]


def test_admin_trace_records_lookups(kvd_factory):
    """admin `trace start path=P` writes one line per Lookup and Fetch: the request's hashes in
    prefix order as 32 hex digits, the pool id folded into the low half so two pools' blocks
    never meet; `trace stop` closes it with the counts; max-bytes stops the writing (full); a
    second start is EBUSY, a stop without one ESTATE, an existing path ESYS; nothing leaks into
    the file but hashes."""
    d = kvd_factory()
    path = os.path.join(d.dir, "req.trace")
    r = d.admin_result("trace start path=%s" % path)
    assert r["active"] is True and r["requests"] == 0, r
    assert not d.admin("trace start path=%s.2" % path)["ok"]  # EBUSY
    a = d.connect()
    pa = a.attach("m", LAYOUT)
    pb_ = a.attach("m2", LAYOUT)
    canon, hashes, pats = write_commit(a, pa, 3)
    a.release(pa.pool_id, canon)
    for k in (3, 2):
        a.release(pa.pool_id, lookup(a, pa, hashes[:k]))
    a.release(pb_.pool_id, lookup(a, pb_, hashes[:2]))  # another pool, the same hashes
    r = d.admin_result("trace")
    assert r["active"] and r["requests"] == 3, r
    r = d.admin_result("trace stop")
    assert r["active"] is False and r["requests"] == 3 and not r["full"], r
    assert os.stat(path).st_mode & 0o777 == 0o600
    lines = [l.split() for l in open(path) if l.strip() and not l.startswith("#")]
    assert [len(l) for l in lines] == [3, 2, 2], lines
    for l in lines:
        for w in l:
            assert len(w) == 32 and all(ch in "0123456789abcdef" for ch in w), w

    def name(pool_id, h):
        lo = (h[0] ^ (pool_id * 0x9E3779B97F4A7C15)) & ((1 << 64) - 1)
        return struct.pack("<QQ", lo, h[1]).hex()
    assert lines[0] == [name(pa.pool_id, h) for h in hashes[:3]]
    assert lines[1] == lines[0][:2]
    assert lines[2] == [name(pb_.pool_id, h) for h in hashes[:2]] and lines[2] != lines[1]
    assert not d.admin("trace stop")["ok"]  # ESTATE: none running
    assert not d.admin("trace start path=%s" % path)["ok"]  # exists: never overwritten
    # max-bytes: a request that would pass it is not written, nor anything after it.
    small = path + ".small"
    r = d.admin_result("trace start path=%s max-bytes=300" % small)
    at, written, full = r["bytes"], 0, False  # the header's bytes
    for k in (1, 3, 1, 1):
        a.release(pa.pool_id, lookup(a, pa, hashes[:k]))
        if not full and at + 33 * k > 300:
            full = True
        elif not full:
            at, written = at + 33 * k, written + 1
    r = d.admin_result("trace stop")
    assert full and r["full"] and r["requests"] == written and r["bytes"] == at, (r, written, at)
    assert os.path.getsize(small) == at
    assert d.alive()


def test_verify_blocks_catches_a_write_after_release(kvd_factory):
    """kvd --help verify-blocks: a worker that writes into a block after releasing it changes
    what others read as a hit. With the option, the next Lookup ends before that block, the
    block leaves the index (quarantines 1, KVD-VERIFY logged), and a fresh commit of its hash is
    a new block that later lookups find. Without it the change is served (the case it catches)."""
    for verify in (False, True):
        d = kvd_factory(verify_blocks="true" if verify else "false")
        a, b = d.connect(), d.connect()
        pa = a.attach("m", LAYOUT)
        pb_ = b.attach("m", LAYOUT)
        canon, hashes, pats = write_commit(a, pa, 3)
        a.release(pa.pool_id, canon)
        bad = bytearray(pats[1])
        bad[0] ^= 0xFF
        pa.write_block(canon[1][0], bytes(bad))  # the bug: a write after Release
        hits = lookup(b, pb_, hashes)
        st = pool_stats(b, pb_)
        if not verify:
            assert hits == canon  # served as it is: nothing checks
            assert st["quarantines"] == 0 and st["verified"] == 0
            continue
        assert hits == canon[:1]
        assert st["quarantines"] == 1 and st["verified"] == 2
        assert st["blocks_writing"] == 0 and st["session_refs"] == 1
        assert "KVD-VERIFY" in d.read_log()
        # b recomputes block 1: a new block, not a duplicate of the quarantined one
        nb = allocate(b, pb_, 1)
        pb_.write_block(nb[0][0], pats[1])
        got = b.commit(pb_.pool_id, [(nb[0], hashes[1], canon[0][0])])
        assert got == nb
        b.release(pb_.pool_id, hits + got)
        again = lookup(b, pb_, hashes)
        assert again == [canon[0], nb[0], canon[2]]
        assert pool_stats(b, pb_)["quarantines"] == 1


def _duel_picks(lo):
    """daemon/core/duel.h: a Lookup feeds the pool's minis when its last hash's low half says so."""
    return ((lo * 0x9E3779B97F4A7C15) & (2**64 - 1)) >> 40 & 1 == 0


def _duel_chain(name):
    """4 hashes named by `name` whose last one is picked (every request feeds the minis)."""
    hs = [(name * 64 + i + 1, 0xD0E1) for i in range(3)]
    k = name * 64 + 4
    while not _duel_picks(k):
        k += 1
    return hs + [(k, 0xD0E1)]


def _duel_request(c, pool, hashes):
    """What an engine does per request: Lookup its prefix, allocate and commit the rest, release."""
    P = pool.pool_id
    hit = lookup(c, pool, hashes)
    got = allocate(c, pool, len(hashes) - len(hit)) if len(hit) < len(hashes) else []
    entries, parent = [], hit[-1][0] if hit else kw.NO_PARENT
    for b, h in zip(got, hashes[len(hit):]):
        entries.append((b, h, parent))
        parent = b[0]
    canon = c.commit(P, entries) if entries else []
    c.release(P, hit + canon)


def test_evict_duel_picks_the_leaf_order(kvd_factory):
    """evict-duel (docs/ADMIN.md, duel[]): a working set asked twice a round between scans of
    one-off chains (96 blocks a round against minis of 64) makes the pool take never-reused
    leaves first; stats and pools report it. With evict-duel=false a pool has no duel."""
    d = kvd_factory(pool_memory=budget(1))
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    fresh = 1000
    for _ in range(40):
        for _ in range(2):
            for w in range(8):
                _duel_request(c, pool, _duel_chain(w))
        for _ in range(16):
            _duel_request(c, pool, _duel_chain(fresh))
            fresh += 1
    deadline = time.monotonic() + 10
    while True:  # the loop runs waiting Lookups in its spare time: none is left for long
        (du,) = d.admin_result("stats")["duel"]
        if du["queued"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert du["id"] == pool.pool_id and du["model"] == "m", du
    assert du["sampled"] == 40 * 32 and du["skipped"] == du["dropped"] == du["queued"] == 0, du
    assert du["unreused_first"] is True and du["switches"] == 1, du
    assert du["mini_blocks"] == pool.bps // 2 and du["bytes"] > 0, du
    (p,) = d.admin_result("pools")["pools"]
    assert p["duel"]["unreused_first"] is True and p["duel"]["sampled"] == du["sampled"], p
    # kvctl (beside kvd: bazel-bin, or the test's runfiles) shows it in its tables.
    kvctl = os.path.join(os.path.dirname(os.path.dirname(kvd_binary())), "kvctl", "kvctl")
    if os.access(kvctl, os.X_OK):
        out = subprocess.run([kvctl, "--socket=" + d.admin_sock, "stats"], capture_output=True,
                             text=True, timeout=10)
        assert out.returncode == 0, out.stderr
        table = out.stdout.split("eviction duel\n", 1)[1].split("\n\n", 1)[0].splitlines()
        assert table[0].split()[:3] == ["POOL", "MODEL", "UNREUSED"], table
        assert table[1].split()[:4] == [str(pool.pool_id), "m", "yes", "1"], table
    off = kvd_factory(pool_memory=budget(1), evict_duel="false")
    c2 = off.connect()
    c2.attach("m", LAYOUT)
    assert off.admin_result("stats")["duel"] == []
    assert off.admin_result("pools")["pools"][0]["duel"] is None
