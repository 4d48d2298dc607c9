"""Private blocks and Unshare (PROTOCOL.md §6, docs/ZIPAGE.md) against a real kvd: a private
block is never committed, counts in max-held and goes back when its session dies; Unshare turns
a committed block its one holder holds back into a private one, and is refused on every block
someone else could read (another session's reference, a pin, committed children), so a shared
block is never given a write lease."""

import os

import pytest

import kvdwire as kw
from conftest import Child, wait_until
from kvdwire import pb

LAYOUT = kw.Layout(2, 2, 8, 16, pb.FP16, pb.LAYER_MAJOR)
T = LAYOUT.tokens_per_block


def expect(code, fn, *args, contains=None):
    with pytest.raises(kw.KvdError) as e:
        fn(*args)
    assert e.value.name == kw.ERR_NAMES[code], str(e.value)
    assert e.value.message.strip()
    if contains is not None:
        assert contains in e.value.message, e.value.message
    return e.value


def allocate(conn, pool, count, private=False):
    r, _ = conn.call("allocate", pb.Allocate(pool_id=pool.pool_id, count=count,
                                             private_blocks=private))
    pool.follow(r)
    return kw.reply_blocks(r)


def unshare(conn, pool, blocks):
    return conn.call("unshare", pb.Unshare(pool_id=pool.pool_id,
                                           blocks=[pb.BlockRef(id=i, gen=g) for i, g in blocks]))


def commit_chain(conn, pool, nblocks, base):
    """Allocates, writes and commits one chain; returns (canonical blocks, hashes, patterns)."""
    toks = list(range(base, base + nblocks * T))
    hashes = kw.hash_chain(pool.hash_seed, toks, T, b"", pool.hash_algo)
    blocks = allocate(conn, pool, nblocks)
    pats = [kw.block_pattern(pool.layout, kw.hash_hex(h)) for h in hashes]
    entries, parent = [], kw.NO_PARENT
    for b, h, p in zip(blocks, hashes, pats):
        pool.write_block(b[0], p)
        entries.append((b, h, parent))
        parent = b[0]
    return conn.commit(pool.pool_id, entries), hashes, pats


def pool_stats(conn, pool):
    return {k[5:]: v for k, v in conn.stats(pool.pool_id).items() if k.startswith("pool.")}


def test_hello_offers_private(kvd):
    c = kvd.connect(hello=False)
    r, _ = c.call("hello", pb.Hello(protocol_version=1, client_name="p", features=1))
    assert r.features & 4, "HelloReply.features PRIVATE"


def test_private_block_is_never_committed(kvd):
    c = kvd.connect()
    pool = c.attach("m", LAYOUT)
    blocks = allocate(c, pool, 3, private=True)
    s = pool_stats(c, pool)
    assert s["blocks_private"] == 3 and s["blocks_writing"] == 3
    h = kw.hash_chain(pool.hash_seed, list(range(T)), T, b"", pool.hash_algo)[0]
    e = expect(pb.EPERM, c.commit, pool.pool_id, [(blocks[0], h, kw.NO_PARENT)],
               contains="private")
    assert "never committed" in e.message
    # Nothing was committed: the hash is not indexed.
    assert kw.reply_blocks(c.lookup(pool.pool_id, [h])) == []
    c.release(pool.pool_id, blocks)
    s = pool_stats(c, pool)
    assert s["blocks_private"] == 0 and s["blocks_writing"] == 0


def test_private_blocks_count_in_max_held(kvd_factory):
    d = kvd_factory(tenants="quota default max-held=6\n")
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    allocate(c, pool, 4, private=True)
    expect(pb.EQUOTA, allocate, c, pool, 3, True, contains="max-held")
    allocate(c, pool, 2)


def test_unshare_own_block(kvd):
    """The one holder turns its committed block back into a private one: the hash leaves the
    index (no other session finds it), the block is WRITING + private, its bytes stay."""
    a = kvd.connect()
    pool = a.attach("m", LAYOUT)
    canon, hashes, pats = commit_chain(a, pool, 2, 0)
    unshare(a, pool, canon[1:])
    s = pool_stats(a, pool)
    assert s["blocks_private"] == 1 and s["unshares"] == 1 and s["blocks_committed"] == 1
    b = kvd.connect()
    pb_ = b.attach("m", LAYOUT)
    hits = kw.reply_blocks(b.lookup(pb_.pool_id, hashes))
    assert len(hits) == 1, "the unshared block must not be found"
    assert pool.read_block(canon[1][0]) == pats[1]
    expect(pb.EPERM, a.commit, pool.pool_id, [(canon[1], hashes[1], canon[0][0])],
           contains="private")
    a.release(pool.pool_id, canon)
    b.release(pb_.pool_id, hits)
    s = pool_stats(a, pool)
    assert s["blocks_private"] == 0 and s["blocks_writing"] == 0


@pytest.mark.parametrize("policy", ["lru", "prefix-lru"])
def test_unshare_refused_on_shared_block(kvd_factory, policy):
    """A block another session holds gets no write lease: EBUSY naming why, nothing changes,
    and its bytes and index entry stay. Policies that count children also refuse a block that
    other committed blocks continue."""
    kvd = kvd_factory(evict_policy=policy)
    a = kvd.connect()
    pool = a.attach("m", LAYOUT)
    canon, hashes, pats = commit_chain(a, pool, 2, 0)
    b = kvd.connect()
    pb_ = b.attach("m", LAYOUT)
    hits = kw.reply_blocks(b.lookup(pb_.pool_id, hashes))
    assert len(hits) == 2
    before = pool_stats(a, pool)
    expect(pb.EBUSY, unshare, a, pool, canon[1:], contains="other sessions hold it")
    assert pool_stats(a, pool) == before
    # b cannot either, and a block this session does not hold at all is EPERM.
    expect(pb.EBUSY, unshare, b, pb_, hits[1:])
    b.release(pb_.pool_id, hits)
    if policy != "lru":
        # Children: block 0 has a committed child (block 1).
        expect(pb.EBUSY, unshare, a, pool, canon[:1], contains="children")
    # Pinned.
    a.pin(pool.pool_id, canon[1:], retention_ms=60000)
    expect(pb.EBUSY, unshare, a, pool, canon[1:], contains="pinned")
    a.pin(pool.pool_id, canon[1:], unpin=True)
    # Not held by the session; held twice; WRITING; listed twice.
    c = kvd.connect()
    pc = c.attach("m", LAYOUT)
    expect(pb.EPERM, unshare, c, pc, canon[1:])
    w = allocate(a, pool, 1)
    expect(pb.ESTATE, unshare, a, pool, w, contains="WRITING")
    expect(pb.ESTATE, unshare, a, pool, [canon[1], canon[1]], contains="twice")
    again = kw.reply_blocks(a.lookup(pool.pool_id, hashes))
    expect(pb.EBUSY, unshare, a, pool, again[1:], contains="held 2 times")
    a.release(pool.pool_id, again)
    # After all that, the block is intact and still found.
    assert pool.read_block(canon[1][0]) == pats[1]
    unshare(a, pool, canon[1:])
    assert pool_stats(a, pool)["unshares"] == 1


def test_session_death_frees_private_blocks(kvd):
    """A client that dies holding private blocks and a reference on a shared prefix (an
    engine killed mid-compression): the private blocks go back to FREE, the shared prefix is
    cached with its bytes unchanged, and nothing stays held."""
    a = kvd.connect()
    pool = a.attach("m", LAYOUT)
    canon, hashes, pats = commit_chain(a, pool, 3, 0)
    a.release(pool.pool_id, canon)

    def dier(ready_w):
        k = kw.Conn(kvd.sock)
        k.hello()
        p = k.attach("m", LAYOUT)
        hits = kw.reply_blocks(k.lookup(p.pool_id, hashes))
        assert len(hits) == 3
        fresh = allocate(k, p, 4, private=True)
        for i, (bid, _) in enumerate(fresh):
            p.write_block(bid, kw.block_pattern(p.layout, "junk%d" % i))
        os._exit(0)  # dies holding both

    ch = Child(dier)
    os.waitpid(ch.pid, 0)
    os.close(ch.r)
    os.close(ch.ready_r)

    def back():
        s = pool_stats(a, pool)
        return s["blocks_writing"] == 0 and s["blocks_committed"] == 0

    wait_until(back, timeout=10)
    s = pool_stats(a, pool)
    assert s["blocks_private"] == 0 and s["blocks_cached"] == 3
    hits = kw.reply_blocks(a.lookup(pool.pool_id, hashes))
    assert [pool.read_block(b) for b, _ in hits] == pats
