"""KV events in vLLM's wire format, and vLLM-compatible block hashes, against a real kvd.

A router that understands vLLM's KV events (ZMQ PUB, msgpack batches, a ROUTER socket for
replay) should be able to follow kvd the way it follows a vLLM engine. Each test starts its own
daemon (conftest.py) with a publisher on free loopback ports and reads it with real pyzmq SUB /
DEALER sockets; every frame is decoded with msgpack (raw=False) and checked by hand against
vLLM's schema (vllm/distributed/kv_events.py: array_like tagged structs), since msgspec is not
available here. Block hashes come from the independent reference tests/vllm/vllm_hash_ref.py
(vllm mode) or from kvdwire's hash_chain (xxh3 mode), never from kvd's code.

What it checks:
- vllm mode: AttachPoolReply has hash_algo 3, NONE_HASH = sha256(cbor2("0")) and its key as
  hash_seed; a committed chain is one BlockStored per run of chained entries, with vLLM's u64
  hashes (or the 32-byte digests with hash-form bytes), parent None for a chain's first block,
  token_ids [] unless token ids are on (then every block's tokens concatenated), block_size,
  medium "CPU", lora fields None; the next commit's parent is the u64 of its parent block;
- admin evict and capacity eviction publish BlockRemoved naming exactly the blocks that left;
- a duplicate commit publishes nothing;
- frames are [topic, seq (8 bytes big-endian, per publisher from 0), payload]; seq 0 is
  [ts, [["AllBlocksCleared"]], 0]; a DEALER replay returns every buffered batch from the asked
  seq on, byte for byte what the PUB sent, then the end marker; a malformed replay request gets
  no answer and the next good one is served;
- hash_full / token_ids that do not fit, or a vllm commit without hash_full, are EINVAL and
  publish nothing, and the daemon keeps serving;
- xxh3 mode: events carry kvd's own 128-bit hashes (int form: the key's last 8 bytes, big-endian);
- tenants-file `events` lines give each domain its own publisher: a tenant's blocks appear on
  its endpoint only, and the option publisher carries the domains no line names;
- a Fetch that brings blocks back into T0 from a lower tier publishes them on T0's medium as a
  chain (the remote tier's REMOTE events are in test_remote.py); a block the daemon promotes
  into the commons is a BlockStored on the commons' publisher, its eviction a BlockRemoved;
- bad event options are refused at start.
"""

import os
import socket
import struct
import subprocess
import sys
import time
from collections import namedtuple

import msgpack
import pytest
import zmq

import kvdwire as kw
from conftest import new_dir, run_kvd_expecting_refusal, shard_owns_port, wait_until
from kvdwire import pb

sys.path.insert(0, os.path.join(kw.REPO_ROOT, "tests", "vllm"))
import vllm_hash_ref as ref  # noqa: E402  (independent vLLM hash reference)

# The daemon options of the one option-configured publisher (daemon/config/config.c; the
# conftest turns the underscores into dashes: --kv-events-endpoint=...).
OPT_ENDPOINT = "kv_events_endpoint"
OPT_REPLAY = "kv_events_replay"
OPT_TOPIC = "kv_events_topic"
OPT_TOKEN_IDS = "kv_events_token_ids"
OPT_HASH_FORM = "kv_events_hash_form"
OPT_BUFFER = "kv_events_buffer"
OPT_FLUSH = "kv_events_flush_ms"

LAYOUT = kw.Layout(2, 2, 8, 16, pb.FP16, pb.LAYER_MAJOR)
T = LAYOUT.tokens_per_block
SEED = "0"  # PYTHONHASHSEED of the vLLM side
HASH_ALGO_VLLM = 3
END_SEQ = b"\xff" * 8  # vLLM's END_SEQ: (-1).to_bytes(8, "big", signed=True)
MEDIUM = "CPU"  # the tests use host pools
WAIT = 5.0  # seconds to wait for a batch that must come
QUIET = 0.5  # seconds of silence that stand for "no answer"
SETTLE = 0.3  # ZMQ slow joiner: a SUB's subscription needs a moment to reach the PUB
U64 = 1 << 64


# ---------------------------------------------------------------------------------------------
# vLLM's event structs as plain tuples (field order = msgspec array_like encoding order)

BlockStored = namedtuple("BlockStored", "block_hashes parent_block_hash token_ids block_size "
                                        "lora_id medium lora_name")
BlockRemoved = namedtuple("BlockRemoved", "block_hashes medium")
AllBlocksCleared = namedtuple("AllBlocksCleared", "")
# vLLM's later, defaulted BlockStored fields (kv_events.py); a decoder accepts them if present.
STORED_OPTIONAL = ("extra_keys", "group_idx", "kv_cache_spec_kind",
                   "kv_cache_spec_sliding_window")

Batch = namedtuple("Batch", "seq topic payload ts events rank")


def stored(hashes, parent=None, tokens=(), block_size=T, medium=MEDIUM):
    """The BlockStored the tests expect (lora_id and lora_name None: kvd has no LoRA)."""
    return BlockStored(list(hashes), parent, list(tokens), block_size, None, medium, None)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


class Schema:
    """How one publisher names blocks: 'int' (vLLM's u64) or 'bytes' of hash_len bytes."""

    def __init__(self, form="int", hash_len=32):
        assert form in ("int", "bytes")
        self.form, self.hash_len = form, hash_len

    def check_hash(self, h, where):
        if self.form == "int":
            assert _is_int(h) and 0 <= h < U64, (
                "%s: %r is not an unsigned 64-bit int (hash-form int)" % (where, h))
        else:
            assert isinstance(h, bytes) and len(h) == self.hash_len, (
                "%s: %r is not %d bytes of msgpack bin (hash-form bytes)"
                % (where, h, self.hash_len))


MAP_FIELDS = {"BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size",
                               "lora_id", "medium", "lora_name"],
              "BlockRemoved": ["block_hashes", "medium"], "AllBlocksCleared": []}


def decode_event(ev, schema, where):
    """One KVCacheEvent: a msgpack array [tag, fields...] (msgspec array_like + tag=True), or
    with kv-events-format map a map {"type": tag, field: value...} (vLLM's newer schema)."""
    if isinstance(ev, dict):
        keys = list(ev)
        assert keys and keys[0] == "type", "%s: a map event starts with \"type\": %r" % (
            where, ev)
        fields = MAP_FIELDS.get(ev["type"])
        assert fields is not None, "%s: unknown type %r" % (where, ev)
        assert keys[1:] == fields, "%s: fields %r, vLLM's are %r" % (where, keys[1:], fields)
        ev = [ev["type"]] + [ev[k] for k in fields]
    assert isinstance(ev, list) and ev and isinstance(ev[0], str), (
        "%s: an event must be an array [tag, ...] (vLLM array_like tagged struct), got %r"
        % (where, ev))
    tag, f = ev[0], ev[1:]
    where = "%s %s" % (where, tag)
    if tag == "BlockStored":
        # vLLM requires the first 7 fields; later defaulted ones may follow (the contract: none).
        assert len(f) >= 7, "%s: %d fields, vLLM needs 7: %r" % (where, len(f), ev)
        assert len(f) == 7, "%s: trailing fields %r beyond the 7 of the contract" % (where, f[7:])
        hashes, parent, tokens, bs, lora_id, medium, lora_name = f[:7]
        assert isinstance(hashes, list) and hashes, "%s: block_hashes %r" % (where, hashes)
        for h in hashes:
            schema.check_hash(h, where + " block_hashes")
        if parent is not None:
            schema.check_hash(parent, where + " parent_block_hash")
        assert isinstance(tokens, list) and all(_is_int(t) and 0 <= t < 1 << 32 for t in tokens), (
            "%s: token_ids %r" % (where, tokens))
        assert _is_int(bs) and bs > 0, "%s: block_size %r" % (where, bs)
        assert lora_id is None or _is_int(lora_id), "%s: lora_id %r" % (where, lora_id)
        assert medium is None or isinstance(medium, str), "%s: medium %r" % (where, medium)
        assert lora_name is None or isinstance(lora_name, str), (
            "%s: lora_name %r" % (where, lora_name))
        return BlockStored(hashes, parent, tokens, bs, lora_id, medium, lora_name)
    if tag == "BlockRemoved":
        assert len(f) >= 2, "%s: %d fields, vLLM needs 2: %r" % (where, len(f), ev)
        assert len(f) == 2, "%s: trailing fields %r beyond the 2 of the contract" % (where, f[2:])
        hashes, medium = f
        assert isinstance(hashes, list) and hashes, "%s: block_hashes %r" % (where, hashes)
        for h in hashes:
            schema.check_hash(h, where + " block_hashes")
        assert medium is None or isinstance(medium, str), "%s: medium %r" % (where, medium)
        return BlockRemoved(hashes, medium)
    if tag == "AllBlocksCleared":
        assert not f, "%s: has fields %r" % (where, f)
        return AllBlocksCleared()
    raise AssertionError("%s: unknown event tag (vLLM knows BlockStored, BlockRemoved, "
                         "AllBlocksCleared): %r" % (where, ev))


def decode_batch(seq, topic, payload, schema, where="batch"):
    """A KVEventBatch payload: msgpack array [ts (float), [events...], data_parallel_rank]."""
    where = "%s seq %d" % (where, seq)
    try:
        obj = msgpack.unpackb(payload, raw=False)
    except Exception as e:  # ExtraData, UnicodeDecodeError (a str that should be bin), ...
        raise AssertionError("%s: payload is not one msgpack object (%r): %s"
                             % (where, e, payload[:64].hex())) from None
    assert isinstance(obj, list), (
        "%s: EventBatch is array_like: expected a msgpack array, got %r" % (where, type(obj)))
    assert len(obj) == 3, "%s: expected [ts, events, data_parallel_rank], got %r" % (where, obj)
    ts, events, rank = obj
    assert isinstance(ts, float), "%s: ts %r is not a msgpack float" % (where, ts)
    assert abs(ts - time.time()) < 3600, "%s: ts %r is not time.time() seconds" % (where, ts)
    assert isinstance(events, list), "%s: events %r is not an array" % (where, events)
    assert rank == 0 and _is_int(rank), "%s: data_parallel_rank %r, expected 0" % (where, rank)
    evs = [decode_event(e, schema, "%s event %d" % (where, i)) for i, e in enumerate(events)]
    return Batch(seq, topic, payload, ts, evs, rank)


def check_first_batch(b):
    assert b.events == [AllBlocksCleared()], (
        "seq 0 must be the start-up [ts, [[\"AllBlocksCleared\"]], 0], got %r" % (b.events,))


# ---------------------------------------------------------------------------------------------
# Sockets

def free_ports(n):
    """n distinct free TCP ports on 127.0.0.1 that this shard owns (held open together while
    chosen)."""
    socks = []
    try:
        while len(socks) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            if shard_owns_port(s.getsockname()[1]):
                socks.append(s)
            else:
                s.close()
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tcp_endpoints(n):
    return ["tcp://127.0.0.1:%d" % p for p in free_ports(n)]


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


class Sub:
    """A SUB on one publisher. Checks every frame it reads (3 frames, the topic, seqs
    contiguous, seq 0 is AllBlocksCleared) and keeps every batch in `batches`."""

    def __init__(self, ctx, endpoint, topic=b"", schema=None, name="SUB"):
        self.endpoint, self.topic, self.name = endpoint, topic, name
        self.schema = schema or Schema()
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.batches = []
        time.sleep(SETTLE)

    def close(self):
        self.sock.close(0)

    def recv(self, timeout):
        """The next batch, or None after timeout seconds."""
        if not self.sock.poll(max(0, int(timeout * 1000))):
            return None
        frames = self.sock.recv_multipart()
        where = "%s %s" % (self.name, self.endpoint)
        assert len(frames) == 3, "%s: expected [topic, seq, payload], got %d frames: %r" % (
            where, len(frames), frames)
        topic, seq8, payload = frames
        assert topic == self.topic, "%s: topic frame %r, expected %r" % (where, topic, self.topic)
        assert len(seq8) == 8, "%s: seq frame %r is not 8 bytes" % (where, seq8)
        seq = int.from_bytes(seq8, "big")
        if self.batches:
            assert seq == self.batches[-1].seq + 1, "%s: seq %d after %d (a gap or reorder)" % (
                where, seq, self.batches[-1].seq)
        b = decode_batch(seq, topic, payload, self.schema, where)
        if seq == 0:
            check_first_batch(b)
        self.batches.append(b)
        return b

    def next_batch(self, what, timeout=WAIT):
        """The next batch other than the start-up seq 0 (which a SUB usually misses)."""
        deadline = time.monotonic() + timeout
        while True:
            b = self.recv(deadline - time.monotonic())
            if b is None:
                pytest.fail("%s: no KV-event batch on %s within %.1f s (waiting for %s; "
                            "received: %r)" % (self.name, self.endpoint, timeout, what,
                                               [(x.seq, x.events) for x in self.batches]))
            if b.seq != 0:
                return b

    def stored(self, medium=None, start=0):
        """The hashes BlockStored events of the batches read (from batch `start` on) named, on
        `medium` (None: any)."""
        return {h for b in self.batches[start:] for e in b.events
                if isinstance(e, BlockStored) and medium in (None, e.medium)
                for h in e.block_hashes}

    def until(self, what, pred, timeout=WAIT):
        """Reads batches until pred(batch) holds; returns the batches read (seq 0 left out)."""
        got = []
        deadline = time.monotonic() + timeout
        while True:
            b = self.recv(deadline - time.monotonic())
            if b is None:
                pytest.fail("%s: %s did not come on %s within %.1f s (received: %r)"
                            % (self.name, what, self.endpoint, timeout,
                               [(x.seq, x.events) for x in got]))
            if b.seq == 0:
                continue
            got.append(b)
            if pred(b):
                return got


def replay(ctx, endpoint, start, timeout=WAIT):
    """A DEALER replay from seq `start`: [(seq, payload)] up to the end marker (checked)."""
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(endpoint)
    try:
        d.send_multipart([b"", start.to_bytes(8, "big")])
        return read_replay(d, endpoint, timeout)
    finally:
        d.close(0)


def read_replay(d, endpoint, timeout=WAIT):
    out = []
    deadline = time.monotonic() + timeout
    while True:
        if not d.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            pytest.fail("replay on %s: no end marker within %.1f s (got seqs %r)"
                        % (endpoint, timeout, [s for s, _ in out]))
        frames = d.recv_multipart()
        assert len(frames) == 3 and frames[0] == b"" and len(frames[1]) == 8, (
            "replay on %s: expected [b'', seq8, payload], got %r" % (endpoint, frames))
        if frames[1] == END_SEQ:
            assert frames[2] == b"", "replay end marker with a payload: %r" % frames
            return out
        out.append((int.from_bytes(frames[1], "big"), frames[2]))


# ---------------------------------------------------------------------------------------------
# Pools, commits, hashes

def key_of(digest):
    """kvd's 128-bit key of a vLLM digest: (lo, hi) = bytes 0..7, 8..15, little-endian."""
    return struct.unpack("<QQ", digest[:16])


def key_bytes(h):
    """A (lo, hi) key as the 16 bytes lo LE || hi LE."""
    return struct.pack("<QQ", *h)


def vllm_form(digest, schema):
    return ref.to_u64(digest) if schema.form == "int" else digest


def xxh3_form(h, schema):
    return int.from_bytes(key_bytes(h)[8:], "big") if schema.form == "int" else key_bytes(h)


def allocate(conn, pool, count):
    r = conn.allocate(pool.pool_id, count)
    pool.follow(r)
    blocks = kw.reply_blocks(r)
    assert len(blocks) == count
    return blocks


_FULL = object()  # entry(): hash_full = the digest itself


def entry(block, digest, parent=kw.NO_PARENT, hash_full=_FULL, token_ids=None, key=None,
          parent_full=None):
    """A vllm-pool CommitEntry: hash = key of digest (or `key`), hash_full (None: left out),
    token_ids (None: left out), parent_hash_full (None: left out)."""
    lo, hi = key_of(digest) if key is None else key
    e = pb.CommitEntry(block=pb.BlockRef(id=block[0], gen=block[1]),
                       hash=pb.Hash128(lo=lo, hi=hi), parent=parent)
    hf = digest if hash_full is _FULL else hash_full
    if hf is not None:
        e.hash_full = hf
    if token_ids is not None:
        e.token_ids.extend(token_ids)
    if parent_full is not None:
        e.parent_hash_full = parent_full
    return e


def commit_entries(conn, pool, entries, packed=False):
    """Commits pb.CommitEntry messages, as entries or (packed) in the packed form."""
    m = (kw.packed_commit(pool.pool_id, entries) if packed
         else pb.Commit(pool_id=pool.pool_id, entries=entries))
    r, _ = conn.call("commit", m)
    pool.follow(r)
    return kw.reply_canonical(r)


def toks(nblocks, base):
    return list(range(base, base + nblocks * T))


def vllm_commit(conn, pool, tokens, parent_digest=None, parent_block=kw.NO_PARENT,
                send_tokens=False, packed=False):
    """Allocates, writes and commits the full blocks of `tokens` as one chain continuing
    parent_digest (NONE_HASH if None) at parent_block (packed: in the packed form); returns
    (canonical blocks, digests)."""
    first = ref.none_hash(SEED) if parent_digest is None else parent_digest
    digests = ref.hash_chain(first, tokens, T)
    blocks = allocate(conn, pool, len(digests))
    entries = chain_entries(pool, blocks, digests, parent_block, tokens if send_tokens else None)
    return commit_entries(conn, pool, entries, packed), digests


def chain_entries(pool, blocks, digests, parent=kw.NO_PARENT, tokens=None):
    """Writes each digest's pattern into its block and returns the chain's CommitEntries, each
    the parent of the next (with the blocks' token ids from `tokens` when given)."""
    entries = []
    for i, (b, dg) in enumerate(zip(blocks, digests)):
        pool.write_block(b[0], kw.block_pattern(pool.layout, dg.hex()))
        ids = tokens[i * T:(i + 1) * T] if tokens is not None else None
        entries.append(entry(b, dg, parent, token_ids=ids))
        parent = b[0]
    return entries


def xxh3_commit(conn, pool, tokens, parent_hash=None, parent_block=kw.NO_PARENT):
    """As vllm_commit for an xxh3 pool (kvdwire's hash chain); returns (canonical, hashes)."""
    hashes = kw.hash_chain(pool.hash_seed if parent_hash is None else parent_hash, tokens, T,
                           b"", pool.hash_algo)
    blocks = allocate(conn, pool, len(hashes))
    entries, parent = [], parent_block
    for b, h in zip(blocks, hashes):
        pool.write_block(b[0], kw.block_pattern(pool.layout, kw.hash_hex(h)))
        entries.append((b, h, parent))
        parent = b[0]
    return conn.commit(pool.pool_id, entries), hashes


def start(kvd_factory, vllm=True, replay_ep=True, **opts):
    """A daemon with a publisher on free ports (d.pub, d.replay); vllm: hash-mode vllm. Each loop
    iteration's events are one batch (flush-ms 0) unless a test asks for the default window."""
    pub, rep = tcp_endpoints(2)
    o = {OPT_ENDPOINT: pub, OPT_FLUSH: "0"}
    if replay_ep:
        o[OPT_REPLAY] = rep
    if vllm:
        o.update(hash_mode="vllm", vllm_hash_seed=SEED)
    o.update(opts)
    d = kvd_factory(**o)
    d.pub, d.replay = pub, rep if replay_ep else None
    return d


def expect_error(code, fn, *args, contains=None):
    with pytest.raises(kw.KvdError) as e:
        fn(*args)
    assert e.value.name == kw.ERR_NAMES[code], str(e.value)
    assert e.value.message.strip(), "%s without a message" % e.value.name
    if contains is not None:
        assert contains in e.value.message, e.value.message
    return e.value


def pool_stat(conn, pool, name):
    return conn.stats(pool.pool_id)["pool." + name]


def removed_hashes(batches):
    """The hashes all BlockRemoved events of batches name; fails on any other event."""
    out = []
    for b in batches:
        for ev in b.events:
            assert isinstance(ev, BlockRemoved), "seq %d: expected only BlockRemoved, got %r" % (
                b.seq, ev)
            assert ev.medium == MEDIUM, "BlockRemoved medium %r, expected %r" % (ev.medium,
                                                                                 MEDIUM)
            out += ev.block_hashes
    return out


def chain_parents(events):
    """{hash: its parent} of BlockStored events: a run's first block's parent is the event's
    parent_block_hash, each next one's the block before it."""
    parents = {}
    for e in events:
        prev = e.parent_block_hash
        for h in e.block_hashes:
            parents[h] = prev
            prev = h
    return parents


# ---------------------------------------------------------------------------------------------
# vllm mode: hashes and BlockStored

@pytest.mark.parametrize("thread", ["on", "off"])
def test_vllm_attach_and_block_stored_chain(kvd_factory, zctx, thread):
    """AttachPoolReply of a vllm pool; a 4-block chain is one BlockStored with vLLM's u64
    hashes, parent None, no token ids; a 2-block extension names the chain's last block as its
    parent; Lookup finds the blocks under the digests' 128-bit keys. The same with the events on
    a thread of their own and on the loop thread (kv-events-thread; the log says which)."""
    d = start(kvd_factory, kv_events_thread=thread, log_level="info")
    assert ("on a thread of their own" if thread == "on" else "on the loop thread") in \
        d.read_log(), d.read_log()[-2000:]
    sub = Sub(zctx, d.pub)
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    r = pool.attach_reply
    none = ref.none_hash(SEED)
    assert r.hash_algo == HASH_ALGO_VLLM, r
    assert r.none_hash == none, "none_hash %s, vLLM's NONE_HASH for seed %r is %s" % (
        r.none_hash.hex(), SEED, none.hex())
    assert (r.hash_seed.lo, r.hash_seed.hi) == key_of(none), "hash_seed is not NONE_HASH's key"

    tokens = toks(4, 1)
    canon, chain = vllm_commit(c, pool, tokens)
    b = sub.next_batch("the 4-block chain's BlockStored")
    assert b.topic == b""
    assert b.events == [stored([ref.to_u64(h) for h in chain])], (
        "one commit of a 4-block chain: one BlockStored, vLLM u64 hashes, parent None")

    hits = kw.reply_blocks(c.lookup(pool.pool_id, [key_of(h) for h in chain]))
    assert hits == canon, "Lookup by the digests' keys"
    c.release(pool.pool_id, hits)

    more = toks(2, 1000)
    _, ext = vllm_commit(c, pool, more, parent_digest=chain[3], parent_block=canon[3][0])
    assert ext == ref.hash_chain(none, tokens + more, T)[4:]
    b = sub.next_batch("the extension's BlockStored")
    assert b.events == [stored([ref.to_u64(h) for h in ext], parent=ref.to_u64(chain[3]))], (
        "the extension's parent_block_hash is the u64 of the chain's last block")


def test_vllm_token_ids_on(kvd_factory, zctx):
    """With token ids on, token_ids is every committed block's tokens concatenated (one
    cache_full_blocks call in vLLM); topic frames carry the configured topic."""
    d = start(kvd_factory, **{OPT_TOKEN_IDS: "1", OPT_TOPIC: "kv-events"})
    sub = Sub(zctx, d.pub, topic=b"kv-events")
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    tokens = toks(3, 7)
    canon, chain = vllm_commit(c, pool, tokens, send_tokens=True)
    b = sub.next_batch("BlockStored with token ids")
    assert b.topic == b"kv-events"
    assert b.events == [stored([ref.to_u64(h) for h in chain], tokens=tokens)]
    # every msgpack width of a uint32: fixint, uint 8, uint 16, uint 32, and their edges
    more = [4294967295, 0, 65536, 127, 128, 255, 256, 65535] + list(range(100, 100 + T - 8))
    _, ext = vllm_commit(c, pool, more, parent_digest=chain[2], parent_block=canon[2][0],
                         send_tokens=True)
    b = sub.next_batch("the extension's BlockStored")
    assert b.events == [stored([ref.to_u64(ext[0])], parent=ref.to_u64(chain[2]), tokens=more)]


def test_packed_commit_publishes_what_the_repeated_form_does(kvd_factory, zctx):
    """§6 Packed lists: a Commit sent as entries_packed, with hash_full_packed and
    token_ids_packed, publishes the BlockStored the repeated form does (digests, parent, token
    ids of every msgpack width); parent_hash_full names the parent of a chain from elsewhere; a
    client that asked (Hello.features PACKED_COMMIT) reads canonical_packed."""
    d = start(kvd_factory, **{OPT_TOKEN_IDS: "1"})
    sub = Sub(zctx, d.pub)
    c = d.connect(features=kw.FEATURE_PACKED | kw.FEATURE_PACKED_COMMIT)
    assert c.hello_reply.features & kw.FEATURE_PACKED_COMMIT
    pool = c.attach("m", LAYOUT)
    tokens = toks(3, 7)
    canon, chain = vllm_commit(c, pool, tokens, send_tokens=True, packed=True)
    assert sub.next_batch("BlockStored").events == [
        stored([ref.to_u64(h) for h in chain], tokens=tokens)]
    more = [4294967295, 0, 65536, 127, 128, 255, 256, 65535] + list(range(100, 100 + T - 8))
    _, ext = vllm_commit(c, pool, more, parent_digest=chain[2], parent_block=canon[2][0],
                         send_tokens=True, packed=True)
    assert sub.next_batch("the extension").events == [
        stored([ref.to_u64(ext[0])], parent=ref.to_u64(chain[2]), tokens=more)]
    nxt = ref.hash_chain(ext[0], toks(1, 5000), T)
    b = allocate(c, pool, 1)[0]
    pool.write_block(b[0], kw.block_pattern(pool.layout, nxt[0].hex()))
    commit_entries(c, pool, [entry(b, nxt[0], kw.NO_PARENT, parent_full=ext[0])], packed=True)
    assert sub.next_batch("a parent only the client names").events == [
        stored([ref.to_u64(nxt[0])], parent=ref.to_u64(ext[0]))]
    # hash-mode vllm needs the digests: without hash_full_packed the request is EINVAL.
    b = allocate(c, pool, 1)[0]
    expect_error(pb.EINVAL, commit_entries, c, pool, [entry(b, nxt[0], hash_full=None)],
                 True, contains="hash_full")


def test_vllm_hash_form_bytes(kvd_factory, zctx):
    """hash-form bytes: block and parent hashes are the whole 32-byte digests (msgpack bin)."""
    d = start(kvd_factory, **{OPT_HASH_FORM: "bytes"})
    sub = Sub(zctx, d.pub, schema=Schema("bytes", 32))
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    canon, chain = vllm_commit(c, pool, toks(2, 3))
    assert sub.next_batch("BlockStored").events == [stored(chain)]
    _, ext = vllm_commit(c, pool, toks(1, 500), parent_digest=chain[1], parent_block=canon[1][0])
    assert sub.next_batch("the extension's BlockStored").events == [stored(ext, parent=chain[1])]


# ---------------------------------------------------------------------------------------------
# BlockRemoved

def collect_removed(sub, expected, what):
    """Reads batches until their BlockRemoved events named every hash of `expected`; checks
    they named nothing else, no hash twice, and carried no other event."""
    want = set(expected)
    names = []

    def done(b):
        names.extend(removed_hashes([b]))
        return want <= set(names)

    sub.until(what, done)
    assert len(names) == len(set(names)), "a hash removed twice: %r" % names
    assert set(names) == want, "BlockRemoved named %r, expected exactly %r" % (names, want)


def test_admin_evict_publishes_block_removed(kvd_factory, zctx):
    """admin `evict pool=ID` of released (CACHED) blocks: BlockRemoved naming exactly them."""
    d = start(kvd_factory)
    sub = Sub(zctx, d.pub)
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    canon, chain = vllm_commit(c, pool, toks(4, 1))
    sub.next_batch("BlockStored")
    c.release(pool.pool_id, canon)
    res = d.admin_result("evict pool=%d" % pool.pool_id)
    assert res["evicted"] == 4, res
    collect_removed(sub, [ref.to_u64(h) for h in chain], "BlockRemoved after admin evict")
    assert kw.reply_blocks(c.lookup(pool.pool_id, [key_of(h) for h in chain])) == []


def test_capacity_eviction_publishes_block_removed(kvd_factory, zctx):
    """Allocations that need room evict CACHED blocks: each one is published as removed."""
    d = start(kvd_factory, pool_memory="2M")
    sub = Sub(zctx, d.pub)
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    canon, chain = vllm_commit(c, pool, toks(4, 1))
    sub.next_batch("BlockStored")
    c.release(pool.pool_id, canon)
    # Hold ever more fresh blocks until the pool had to evict all 4 cached ones.
    chunk, held = 32, 0
    while pool_stat(c, pool, "evictions_capacity") < 4:
        assert held < 100000, "no capacity eviction after %d blocks" % held
        try:
            c.allocate(pool.pool_id, chunk)  # segments not mapped: nothing is written
            held += chunk
        except kw.KvdError as e:
            assert e.code in (kw.ENOSPC, kw.EQUOTA), str(e)
            assert chunk > 1, "pool full with %d evictions: %s" % (
                pool_stat(c, pool, "evictions_capacity"), e)
            chunk = 1
    assert pool_stat(c, pool, "evictions_capacity") == 4
    collect_removed(sub, [ref.to_u64(h) for h in chain], "BlockRemoved after capacity eviction")


@pytest.mark.parametrize("thread", ["on", "off"])
def test_pipelined_commit_release_evict_keep_their_order(kvd_factory, zctx, thread):
    """A Commit, the Release of its blocks and an Allocate that must evict them, in one write
    (one loop iteration, where kvd records the events and runs them after the replies): the
    stream says BlockStored for the chain before BlockRemoved for it, each once."""
    d = start(kvd_factory, pool_memory="2M", kv_events_thread=thread)
    sub = Sub(zctx, d.pub)
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    # Hold every block but 4, so the pipelined Allocate finds nothing free but the chain.
    held, chunk = [], 32
    while True:
        try:
            held += allocate(c, pool, chunk)
        except kw.KvdError as e:
            assert e.code in (kw.ENOSPC, kw.EQUOTA), str(e)
            if chunk == 1:
                break
            chunk = 1
    assert len(held) > 4
    c.release(pool.pool_id, held[:4])  # never committed: back to free
    tokens = toks(4, 7000)
    digests = ref.hash_chain(ref.none_hash(SEED), tokens, T)
    blocks = allocate(c, pool, 4)
    entries = chain_entries(pool, blocks, digests)
    envs = [c.envelope("commit", pb.Commit(pool_id=pool.pool_id, entries=entries), None),
            c.envelope("release", c.blocks_msg("Release", pool.pool_id, blocks), None),
            c.envelope("allocate", pb.Allocate(pool_id=pool.pool_id, count=4), None)]
    c.send_raw(b"".join(c.frame(e.SerializeToString()) for e in envs))
    for e in envs:
        which, reply, _ = c.recv(e.id)
        if which == "allocate_reply":
            pool.follow(reply)
            assert len(kw.reply_blocks(reply)) == 4
    assert pool_stat(c, pool, "evictions_capacity") == 4
    names = [ref.to_u64(dg) for dg in digests]
    seen = []  # ("s" | "r", hash) in stream order

    def done(b):
        for ev in b.events:
            kind = ("s" if isinstance(ev, BlockStored) else
                    "r" if isinstance(ev, BlockRemoved) else None)
            assert kind is not None, "unexpected event %r" % (ev,)
            seen.extend((kind, h) for h in ev.block_hashes)
        return all(("r", h) in seen for h in names)

    sub.until("BlockStored then BlockRemoved of the pipelined chain", done)
    for h in names:
        assert seen.count(("s", h)) == 1 and seen.count(("r", h)) == 1, seen
        assert seen.index(("s", h)) < seen.index(("r", h)), "removed before stored: %r" % seen


def test_admin_evict_is_one_block_removed(kvd_factory, zctx):
    """Removals in a row on one medium share one BlockRemoved (vLLM's event lists its blocks):
    an admin evict of 5 cached blocks is a single event naming the 5, in both formats."""
    for fmt in ("array", "map"):
        d = start(kvd_factory, kv_events_format=fmt)
        sub = Sub(zctx, d.pub, schema=Schema())
        c = d.connect()
        pool = c.attach("m", LAYOUT)
        canon, chain = vllm_commit(c, pool, toks(5, 1))
        sub.next_batch("BlockStored")
        c.release(pool.pool_id, canon)
        assert d.admin_result("evict pool=%d" % pool.pool_id)["evicted"] == 5
        b = sub.next_batch("BlockRemoved")
        assert len(b.events) == 1 and isinstance(b.events[0], BlockRemoved), b.events
        assert sorted(b.events[0].block_hashes) == sorted(ref.to_u64(h) for h in chain), b
        assert b.events[0].medium == MEDIUM
        sub.close()


# ---------------------------------------------------------------------------------------------
# Duplicates

def test_duplicate_commit_publishes_nothing(kvd_factory, zctx):
    """A second session committing the same chain gets the first session's canonical blocks
    and no BlockStored: the next batch is the one of a later, different commit."""
    d = start(kvd_factory)
    sub = Sub(zctx, d.pub)
    a, b = d.connect(), d.connect()
    pa, pb_ = a.attach("m", LAYOUT), b.attach("m", LAYOUT)
    assert pa.pool_id == pb_.pool_id
    tokens = toks(4, 1)
    canon, chain = vllm_commit(a, pa, tokens)
    assert sub.next_batch("BlockStored").events == [stored([ref.to_u64(h) for h in chain])]
    canon_b, chain_b = vllm_commit(b, pb_, tokens)
    assert chain_b == chain and canon_b == canon, "the duplicate's canonical blocks"
    assert pool_stat(b, pb_, "commits_duplicate") == 4
    # A sentinel: different tokens, so a new block. Its batch must be the next one.
    _, sentinel = vllm_commit(b, pb_, toks(1, 9000))
    nxt = sub.next_batch("the sentinel's BlockStored")
    assert nxt.events == [stored([ref.to_u64(sentinel[0])])], (
        "the duplicate commit published something: %r" % (nxt.events,))


# ---------------------------------------------------------------------------------------------
# Replay

@pytest.mark.parametrize("thread", ["on", "off"])
def test_replay(kvd_factory, zctx, thread):
    """DEALER replay: every buffered batch from seq 0 in order (0 is AllBlocksCleared), the same
    bytes the PUB sent, seqs contiguous, then the end marker; from a later seq only the rest;
    from beyond the last only the end marker; malformed requests get no answer."""
    d = start(kvd_factory, kv_events_thread=thread)
    sub = Sub(zctx, d.pub)
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    chains = []
    for k in range(2):
        chains.append(vllm_commit(c, pool, toks(2, 100 * k + 1))[1])
        sub.next_batch("BlockStored %d" % k)
    sub.close()
    for k in range(2, 4):  # nobody listens: only the replay buffer has these
        chains.append(vllm_commit(c, pool, toks(2, 100 * k + 1))[1])
    schema = Schema()

    def batches_settled():
        return len(replay(zctx, d.replay, 0)) == 5

    assert wait_until(batches_settled, timeout=WAIT), "replay never held 5 batches: %r" % (
        [s for s, _ in replay(zctx, d.replay, 0)],)
    got = replay(zctx, d.replay, 0)
    assert [s for s, _ in got] == list(range(5)), "replay from 0: seqs"
    decoded = [decode_batch(s, b"", p, schema, "replay") for s, p in got]
    check_first_batch(decoded[0])
    for k, b in enumerate(decoded[1:]):
        assert b.events == [stored([ref.to_u64(h) for h in chains[k]])], "replayed batch %d" % k
    for b in sub.batches:  # what the SUB saw, byte for byte
        assert got[b.seq][1] == b.payload, "seq %d: replay differs from the PUB" % b.seq

    assert replay(zctx, d.replay, 3) == got[3:], "replay from 3"
    assert replay(zctx, d.replay, 5) == [], "replay from beyond the last: just the end marker"
    assert replay(zctx, d.replay, U64 - 2) == []

    # Malformed requests (the ROUTER sees other than [id, b"", seq8]) get no answer ...
    dealer = zctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(d.replay)
    zero = (0).to_bytes(8, "big")
    dealer.send_multipart([b"", zero, b"junk"])  # 4 frames
    dealer.send_multipart([zero])  # 2 frames, no delimiter
    dealer.send_multipart([b""])  # 2 frames, no seq
    dealer.send_multipart([b"", zero, b"", zero])  # 5 frames
    # ... and the daemon keeps serving: a good request from beyond the last seq is answered
    # with just the end marker (an answer to a malformed one would start with seq 0 first).
    dealer.send_multipart([b"", (5).to_bytes(8, "big")])
    assert read_replay(dealer, d.replay) == [], "malformed replay requests were answered"
    assert not dealer.poll(int(QUIET * 1000)), "unexpected frames: %r" % (
        dealer.recv_multipart(),)
    dealer.send_multipart([b"", zero])
    assert read_replay(dealer, d.replay) == got
    dealer.close(0)
    assert d.alive()

    # vLLM's example subscriber uses REQ: it gets the first reply frame (here: the end marker).
    req = zctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(d.replay)
    req.send((5).to_bytes(8, "big"))
    assert req.poll(int(WAIT * 1000)), "REQ replay got no answer"
    assert req.recv_multipart() == [END_SEQ, b""]
    req.close(0)

    # What an operator sees: admin stats kv_events (the same table drives the metrics).
    ev = d.admin_result("stats")["kv_events"]
    assert ev["kv_events_publishers"] == 1
    assert ev["kv_events_batches"] >= len(got), ev
    assert ev["kv_events_replays"] >= 3 and ev["kv_events_replay_bad"] == 4, ev
    assert ev["kv_events_blocks"] > 0, ev


def test_long_replays_go_out_in_pieces(kvd_factory, zctx):
    """A replay of more batches than kvd sends per loop wake-up (256) goes on at the next
    wake-ups and arrives whole and in order (a replay was sent in one go, the whole ring on the
    loop thread: a request could stall the loop for as long as the ring took); 40 requests at
    once, more than kvd answers at a time (16), each end with the end marker (a full replay, or
    at once the end marker alone: ask again), and the loop serves meanwhile."""
    d = start(kvd_factory)
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    for k in range(600):
        vllm_commit(c, pool, toks(1, 10 * k + 1))
    assert wait_until(lambda: len(replay(zctx, d.replay, 0)) >= 601, timeout=WAIT)
    got = replay(zctx, d.replay, 0)
    assert [s for s, _ in got] == list(range(len(got))), "one replay: every seq, in order"
    dealers = []
    for _ in range(40):
        q = zctx.socket(zmq.DEALER)
        q.setsockopt(zmq.LINGER, 0)
        q.connect(d.replay)
        dealers.append(q)
    for q in dealers:
        q.send_multipart([b"", (0).to_bytes(8, "big")])
    assert c.ping(nonce=8).nonce == 8
    whole = 0
    for q in dealers:
        r = read_replay(q, d.replay)
        assert [s for s, _ in r] in ([], [s for s, _ in got][:len(r)]), len(r)
        whole += len(r) >= len(got)
        q.close(0)
    assert whole >= 16, whole
    assert d.admin_result("stats")["kv_events"]["kv_events_replay_bad"] == 0


def test_replay_buffer_keeps_the_latest_batches(kvd_factory, zctx):
    """kv-events-buffer=N keeps the last N batches (vLLM's buffer_steps deque): a replay from 0
    starts at the oldest one kept."""
    d = start(kvd_factory, **{OPT_BUFFER: "3"})
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    for k in range(4):  # seq 1..4
        vllm_commit(c, pool, toks(1, 100 * k + 1))
    assert wait_until(lambda: [s for s, _ in replay(zctx, d.replay, 0)] == [2, 3, 4],
                      timeout=WAIT), [s for s, _ in replay(zctx, d.replay, 0)]


@pytest.mark.parametrize("thread", ["on", "off"])
def test_flush_window_coalesces_commits(kvd_factory, zctx, thread):
    """kv-events-flush-ms > 0 (the default is 1): the Commits of one window go out as one batch
    (one send on a busy Commit path), each still its own BlockStored, in order; an admin `stats`
    in the window (which has the records so far run first, for kv_events_blocks) does not end
    the batch early."""
    d = start(kvd_factory, kv_events_thread=thread, **{OPT_FLUSH: "400"})
    sub = Sub(zctx, d.pub)
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    chains = []
    for k in range(3):
        chains.append(vllm_commit(c, pool, toks(2, 1000 * k + 1))[1])
        assert d.admin_result("stats")["kv_events"]["kv_events_blocks"] == 2 * (k + 1)
    b = sub.next_batch("the window's batch")
    assert b.events == [stored([ref.to_u64(h) for h in ch]) for ch in chains], (
        "3 commits within one 400 ms window: one batch of 3 BlockStored in commit order")


@pytest.mark.parametrize("thread", ["on", "off"])
def test_flush_window_ends_on_time(kvd_factory, zctx, thread):
    """The window's end (a timerfd, armed at the window's first record) sends the batch of an
    idle loop: not before kv-events-flush-ms, and well before a second has passed; a later
    Commit opens a window of its own (the timer is armed again) and its batch is the next."""
    d = start(kvd_factory, kv_events_thread=thread, **{OPT_FLUSH: "300"})
    sub = Sub(zctx, d.pub)
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    for k in range(2):
        t0 = time.monotonic()
        chain = vllm_commit(c, pool, toks(1, 500 * k + 7))[1]
        b = sub.recv(5.0)
        waited = time.monotonic() - t0
        assert b is not None, "the window's batch never came"
        assert b.events == [stored([ref.to_u64(h) for h in chain])], b.events
        assert 0.25 <= waited < 1.5, (
            f"window {k}: batch {waited:.3f} s after the Commit's reply (window 0.3 s)")


# ---------------------------------------------------------------------------------------------
# Bad input

BAD_COMMITS = {
    "hash_full_31_bytes": dict(hash_full=lambda dg: dg[:31]),
    "hash_full_33_bytes": dict(hash_full=lambda dg: dg + b"\0"),
    "hash_full_not_the_key": dict(hash_full=lambda dg: bytes([dg[0] ^ 1]) + dg[1:]),
    "hash_full_missing": dict(hash_full=lambda dg: None),
    "token_ids_short": dict(token_ids=lambda tk: tk[:-1]),
    "token_ids_long": dict(token_ids=lambda tk: tk + [0]),
}


@pytest.mark.parametrize("case", sorted(BAD_COMMITS))
def test_vllm_bad_commit_is_einval(kvd_factory, zctx, case):
    """A vllm-pool entry whose hash_full is not the 32-byte digest of its hash, or is missing,
    or whose token_ids are not tokens_per_block ids, is EINVAL with a message and publishes
    nothing; the same session's good commit of the same block works afterwards."""
    d = start(kvd_factory, **{OPT_TOKEN_IDS: "1"})
    sub = Sub(zctx, d.pub)
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    tokens = toks(1, 42)
    dg = ref.hash_chain(ref.none_hash(SEED), tokens, T)[0]
    blk = allocate(c, pool, 1)[0]
    bad = BAD_COMMITS[case]
    kwargs = {"token_ids": tokens}
    if "hash_full" in bad:
        kwargs["hash_full"] = bad["hash_full"](dg)
    if "token_ids" in bad:
        kwargs["token_ids"] = bad["token_ids"](tokens)
    expect_error(pb.EINVAL, commit_entries, c, pool, [entry(blk, dg, **kwargs)])
    c.ping()
    assert kw.reply_blocks(c.lookup(pool.pool_id, [key_of(dg)])) == [], "bad entry was indexed"
    assert commit_entries(c, pool, [entry(blk, dg, token_ids=tokens)]) == [blk]
    assert sub.next_batch("the good commit's BlockStored").events == [
        stored([ref.to_u64(dg)], tokens=tokens)], (
        "the next batch must be the good commit's BlockStored (a refused commit publishes nothing)")


def test_vllm_bad_entry_in_a_chain(kvd_factory, zctx):
    """A bad hash_full in the middle of a chain is EINVAL for the whole request (PROTOCOL.md
    Commit: an error reply means nothing was committed): nothing is indexed or published, and
    the same blocks then commit as one chain with one BlockStored."""
    d = start(kvd_factory)
    sub = Sub(zctx, d.pub)
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    chain = ref.hash_chain(ref.none_hash(SEED), toks(3, 5), T)
    blocks = allocate(c, pool, 3)

    def entries(bad):
        return [entry(blocks[0], chain[0]),
                entry(blocks[1], chain[1], blocks[0][0],
                      hash_full=chain[1][:31] if bad else chain[1]),
                entry(blocks[2], chain[2], blocks[1][0])]

    expect_error(pb.EINVAL, commit_entries, c, pool, entries(True))
    other = d.connect()
    po = other.attach("m", LAYOUT)
    assert kw.reply_blocks(other.lookup(po.pool_id, [key_of(h) for h in chain])) == [], (
        "a refused Commit indexed some of its entries")
    assert commit_entries(c, pool, entries(False)) == blocks
    assert sub.next_batch("the good commit's BlockStored").events == [
        stored([ref.to_u64(h) for h in chain])], (
        "the next batch must be the good commit's BlockStored (a refused commit publishes nothing)")


# ---------------------------------------------------------------------------------------------
# xxh3 mode

@pytest.mark.parametrize("form", ["int", "bytes"])
def test_xxh3_mode_events(kvd_factory, zctx, form):
    """Default hash mode with events on: hashes are kvd's 128-bit keys, as the last 8 bytes of
    lo LE || hi LE read big-endian (int) or those 16 bytes (bytes); parents likewise; admin evict
    publishes BlockRemoved in the same form."""
    d = start(kvd_factory, vllm=False, **{OPT_HASH_FORM: form})
    schema = Schema(form, 16)
    sub = Sub(zctx, d.pub, schema=schema)
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    assert pool.hash_algo == kw.HASH_XXH3_128 and pool.attach_reply.none_hash == b""
    canon, hs = xxh3_commit(c, pool, toks(3, 1))
    assert sub.next_batch("BlockStored").events == [stored([xxh3_form(h, schema) for h in hs])]
    ext_canon, ext = xxh3_commit(c, pool, toks(1, 900), parent_hash=hs[2],
                                 parent_block=canon[2][0])
    assert sub.next_batch("the extension's BlockStored").events == [
        stored([xxh3_form(ext[0], schema)], parent=xxh3_form(hs[2], schema))]
    c.release(pool.pool_id, canon + ext_canon)
    assert d.admin_result("evict pool=%d" % pool.pool_id)["evicted"] == 4
    collect_removed(sub, [xxh3_form(h, schema) for h in hs + ext], "BlockRemoved")


# ---------------------------------------------------------------------------------------------
# Per-domain publishers (tenants file `events` lines)

TOKENS = {"a.tok": b"token-of-tenant-a-0123456789", "b.tok": b"token-of-tenant-b-0123456789"}


def test_per_domain_publishers(kvd_factory, zctx):
    """Two token tenants (this test's own uid, no root needed) with an `events` line each, and
    the option publisher for the rest (a token-less session's tenant uid-N): each tenant's
    blocks appear on its own endpoint only, with that line's topic, hash form and token ids, and
    each publisher counts its own seqs from 0."""
    me = os.geteuid()
    pub_a, pub_b, rep_b = tcp_endpoints(3)
    tenants = ("tenant ta uid=%d token-file={dir}/a.tok\n"
               "tenant tb uid=%d token-file={dir}/b.tok\n"
               "events endpoint=%s domains=ta\n"
               "events endpoint=%s replay=%s topic=tb token-ids=on hash-form=bytes domains=tb\n"
               % (me, me, pub_a, pub_b, rep_b))
    d = start(kvd_factory, files=TOKENS, tenants=tenants)
    subs = {"ta": Sub(zctx, pub_a, name="SUB ta"),
            "tb": Sub(zctx, pub_b, topic=b"tb", schema=Schema("bytes", 32), name="SUB tb"),
            "other": Sub(zctx, d.pub, name="SUB option publisher")}
    conns = {"ta": d.connect(token=TOKENS["a.tok"]), "tb": d.connect(token=TOKENS["b.tok"]),
             "other": d.connect()}
    assert conns["ta"].hello_reply.tenant == "ta" and conns["tb"].hello_reply.tenant == "tb"
    assert conns["other"].hello_reply.tenant == "uid-%d" % me
    pools = {n: c.attach("m", LAYOUT) for n, c in conns.items()}

    def form(n, dg):
        return dg if n == "tb" else ref.to_u64(dg)

    # Round 1: each commits a chain (different tokens per tenant); round 2: each a sentinel.
    # A block published on the wrong endpoint would come there before that endpoint's sentinel.
    bases = {"ta": 1, "tb": 10001, "other": 20001}
    chains, sentinels = {}, {}
    for n in subs:
        chains[n] = vllm_commit(conns[n], pools[n], toks(2, bases[n]), send_tokens=True)[1]
    for n in subs:
        sentinels[n] = vllm_commit(conns[n], pools[n], toks(1, bases[n] + 5000),
                                   send_tokens=True)[1]
    for n, sub in subs.items():
        want = form(n, sentinels[n][0])
        got = sub.until("%s's sentinel" % n,
                        lambda b: any(want in getattr(e, "block_hashes", ()) for e in b.events))
        tok = (lambda k: k) if n == "tb" else (lambda k: [])
        events = [e for b in got for e in b.events]
        assert events == [stored([form(n, h) for h in chains[n]], tokens=tok(toks(2, bases[n]))),
                          stored([want], tokens=tok(toks(1, bases[n] + 5000)))], (
            "%s's endpoint carried other domains' blocks (or lost its own)" % n)
        assert got[0].seq == 1, "%s: each publisher counts its own seqs from 0" % n
    rb = replay(zctx, rep_b, 0)
    assert [s for s, _ in rb] == [0, 1, 2], "tb's replay: its own batches only"
    check_first_batch(decode_batch(0, b"tb", rb[0][1], Schema("bytes", 32), "tb replay"))


def test_commons_promotion_is_published(kvd_factory, zctx):
    """`commons min-tenants=2` and an events line for the commons: once the second tenant
    commits a chain the first one did, the daemon copies it into the commons, and the commons'
    publisher says BlockStored for it, chained as in the commons (the first block's parent None,
    the next one's the first); its eviction from the commons is a BlockRemoved there. The
    tenants' own blocks stay on the option publisher."""
    me = os.geteuid()
    pub_c, = tcp_endpoints(1)
    tenants = ("tenant ta uid=%d token-file={dir}/a.tok\n"
               "tenant tb uid=%d token-file={dir}/b.tok\n"
               "commons min-tenants=2\n"
               "events endpoint=%s domains=commons\n" % (me, me, pub_c))
    d = start(kvd_factory, files=TOKENS, tenants=tenants)
    sub = Sub(zctx, pub_c, name="SUB commons")
    own = Sub(zctx, d.pub, name="SUB option publisher")
    ca, cb = d.connect(token=TOKENS["a.tok"]), d.connect(token=TOKENS["b.tok"])
    pa, pb_ = ca.attach("m", LAYOUT), cb.attach("m", LAYOUT)
    canon_a, chain = vllm_commit(ca, pa, toks(2, 1))
    canon_b, chain_b = vllm_commit(cb, pb_, toks(2, 1))
    assert chain_b == chain
    want = [ref.to_u64(h) for h in chain]
    got = sub.until("the commons' BlockStored", lambda b: set(want) <= sub.stored())
    events = [e for b in got for e in b.events if isinstance(e, BlockStored)]
    assert chain_parents(events) == {want[0]: None, want[1]: want[0]}, events
    assert all(e.medium == MEDIUM for e in events), events
    # The tenants' pools publish on the option publisher: the chain once (counted per
    # publisher), never the commons' copy.
    got = own.until("the tenants' chain", lambda b: any(
        isinstance(e, BlockStored) for e in b.events))
    assert [e for b in got for e in b.events] == [stored(want)], got
    # Out of the commons: BlockRemoved on its publisher.
    ca.release(pa.pool_id, canon_a)
    cb.release(pb_.pool_id, canon_b)
    com = [p for p in d.admin_result("pools")["pools"] if p["domain"] == "commons"]
    assert len(com) == 1, com
    assert d.admin_result("evict pool=%d" % com[0]["id"])["evicted"] == 2
    sub.until("the commons' BlockRemoved", lambda b: set(want) <= {
        h for b2 in sub.batches for e in b2.events if isinstance(e, BlockRemoved)
        for h in e.block_hashes})


# ---------------------------------------------------------------------------------------------
# One publisher, many pools; parents

def test_one_publisher_counts_pools(kvd_factory, zctx):
    """Two models' pools on one publisher hold the same vLLM digests (same tokens, same
    NONE_HASH): the router hears BlockStored once and BlockRemoved only when the last pool
    lets the block go; kv_events_blocks counts what is advertised."""
    d = start(kvd_factory)
    sub = Sub(zctx, d.pub)
    c = d.connect()
    p1, p2 = c.attach("m1", LAYOUT), c.attach("m2", LAYOUT)
    can1, chain = vllm_commit(c, p1, toks(3, 1))
    assert sub.next_batch("m1's chain").events == [stored([ref.to_u64(h) for h in chain])]
    can2, chain2 = vllm_commit(c, p2, toks(3, 1))
    assert chain2 == chain
    _, sent = vllm_commit(c, p2, toks(1, 9000))  # a sentinel: the batch after must be its own
    assert sub.next_batch("the sentinel").events == [stored([ref.to_u64(sent[0])])], (
        "m2's identical chain was advertised again")
    assert d.admin_result("stats")["kv_events"]["kv_events_blocks"] == 4
    c.release(p1.pool_id, can1)
    assert d.admin_result("evict pool=%d" % p1.pool_id)["evicted"] == 3
    c.release(p2.pool_id, can2)
    assert d.admin_result("evict pool=%d" % p2.pool_id)["evicted"] >= 3
    got = sub.until("BlockRemoved of the chain", lambda b: any(
        isinstance(e, BlockRemoved) and ref.to_u64(chain[0]) in e.block_hashes
        for e in b.events))
    removed = [h for b in got for e in b.events if isinstance(e, BlockRemoved)
               for h in e.block_hashes]
    assert sorted(removed) == sorted(ref.to_u64(h) for h in chain), (
        "each hash removed once, after the second pool's eviction: %r" % removed)
    assert d.admin_result("stats")["kv_events"]["kv_events_blocks"] == 1  # the held sentinel


def test_parent_after_duplicates_and_from_the_client(kvd_factory, zctx):
    """A Commit whose first entries are duplicates publishes the new tail with the last
    duplicate's digest as its parent; a chain whose parent is in no pool of the request names
    it through parent_hash_full."""
    d = start(kvd_factory)
    sub = Sub(zctx, d.pub)
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    tokens = toks(4, 1)
    _, chain = vllm_commit(c, pool, tokens[:2 * T])
    sub.next_batch("the first 2 blocks")
    c2 = d.connect()
    p2 = c2.attach("m", LAYOUT)
    full = ref.hash_chain(ref.none_hash(SEED), tokens, T)
    blocks = allocate(c2, p2, 4)
    commit_entries(c2, p2, chain_entries(p2, blocks, full))
    assert sub.next_batch("the new tail").events == [
        stored([ref.to_u64(h) for h in full[2:]], parent=ref.to_u64(full[1]))]
    more = toks(1, 5000)
    nxt = ref.hash_chain(full[3], more, T)
    b = allocate(c2, p2, 1)[0]
    p2.write_block(b[0], kw.block_pattern(p2.layout, nxt[0].hex()))
    commit_entries(c2, p2, [entry(b, nxt[0], kw.NO_PARENT, parent_full=full[3])])
    assert sub.next_batch("a block whose parent only the client names").events == [
        stored([ref.to_u64(nxt[0])], parent=ref.to_u64(full[3]))]
    e = expect_error(pb.EINVAL, commit_entries, c2, p2,
                     [entry(allocate(c2, p2, 1)[0], nxt[0], parent_full=full[3][:31])],
                     contains="parent_hash_full")
    assert e.message


def test_map_format(kvd_factory, zctx):
    """kv-events-format map: vLLM's newer schema, maps with "type" first, same fields."""
    d = start(kvd_factory, kv_events_format="map")
    sub = Sub(zctx, d.pub)
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    canon, chain = vllm_commit(c, pool, toks(2, 1))
    assert sub.next_batch("BlockStored").events == [stored([ref.to_u64(h) for h in chain])]
    c.release(pool.pool_id, canon)
    d.admin_result("evict pool=%d" % pool.pool_id)
    collect_removed(sub, [ref.to_u64(h) for h in chain], "map BlockRemoved")
    raw = replay(zctx, d.replay, 0)
    first = msgpack.unpackb(raw[0][1], raw=False)
    assert first[1] == [{"type": "AllBlocksCleared"}], first


def test_second_daemon_keeps_off_the_endpoints(kvd_factory, zctx, tmp_path):
    """A second kvd started on the same socket stops at it before it binds any event endpoint:
    the first one's subscribers keep receiving (ZMQ would let an ipc path be taken)."""
    ep = "ipc://%s/ev" % tmp_path
    d = kvd_factory(**{OPT_ENDPOINT: ep, OPT_FLUSH: "0", "hash_mode": "vllm",
                       "vllm_hash_seed": SEED})
    sub = Sub(zctx, ep)
    argv = [os.environ["KVD_BIN"], "--backend=host", "--socket=%s" % d.sock,
            "--kv-events-endpoint=%s" % ep, "--log-level=warn"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    assert p.returncode != 0, "a second kvd served on a live socket: %s" % p.stderr
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    _, chain = vllm_commit(c, pool, toks(1, 1))
    assert sub.next_batch("after the second daemon gave up").events == [
        stored([ref.to_u64(chain[0])])]


@pytest.mark.parametrize("thread", ["on", "off"])
def test_lower_tiers_publish_their_media(kvd_factory, zctx, thread):
    """Tier copies are events too: tier 2 as medium DISK (BlockStored without parent or tokens,
    as vLLM's offloading connector reports copies); a host pool's tier 1 is the same medium as
    its T0 (CPU): no second BlockStored for it, and no BlockRemoved while tier 1 still holds
    the block after T0 let it go."""
    d = start(kvd_factory, kv_events_thread=thread, tier1_memory="8M", tier2_path="{dir}/t2",
              tier2_bytes="64M", tier_write="write-through")
    sub = Sub(zctx, d.pub)
    c = d.connect()
    pool = c.attach("m", LAYOUT)
    canon, chain = vllm_commit(c, pool, toks(2, 1))
    want = {ref.to_u64(h) for h in chain}
    got = sub.until("the DISK copies", lambda b: want <= {
        h for b2 in sub.batches for e in b2.events if isinstance(e, BlockStored)
        and e.medium == "DISK" for h in e.block_hashes})
    events = [e for b in got for e in b.events]
    cpu = [e for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM]
    disk = [e for e in events if isinstance(e, BlockStored) and e.medium == "DISK"]
    assert cpu == [stored([ref.to_u64(h) for h in chain])], events
    assert sorted(h for e in disk for h in e.block_hashes) == sorted(want), events
    for e in disk:
        assert e.parent_block_hash is None and e.token_ids == [], e
    c.release(pool.pool_id, canon)
    assert d.admin_result("evict pool=%d" % pool.pool_id)["evicted"] == 2
    _, sent = vllm_commit(c, pool, toks(1, 7000))  # a sentinel after the eviction
    b = sub.until("the sentinel", lambda b: any(
        ref.to_u64(sent[0]) in getattr(e, "block_hashes", ()) for e in b.events))
    removed = [e for x in b for e in x.events if isinstance(e, BlockRemoved)]
    assert not removed, "T0 let go, tier 1 (also CPU memory) holds them: %r" % removed


def test_t2_records_keep_the_vllm_name_across_a_restart(kvd_factory, zctx):
    """hash-mode vllm: a tier-2 record carries the digest's last 16 bytes, so after a restart
    (SIGKILL) the blocks the scan finds in T2 are published on DISK with vLLM's hashes (no gap),
    and a Fetch of them publishes the chain on T0's medium."""
    t2 = os.path.join(new_dir(), "t2")
    opts = dict(tier1_memory="0", tier2_path=t2, tier2_bytes="64M", tier_write="write-through",
                fetch_min_tokens="0")
    d = start(kvd_factory, **opts)
    sub = Sub(zctx, d.pub)
    c = d.connect(features=kw.FEATURE_PACKED | kw.FEATURE_TIERS)
    pool = c.attach("m", LAYOUT)
    canon, chain = vllm_commit(c, pool, toks(3, 11))
    want = [ref.to_u64(h) for h in chain]
    sub.until("the DISK copies", lambda b: set(want) <= sub.stored("DISK"))
    d.kill()
    sub.close()

    d2 = start(kvd_factory, **opts)
    sub2 = Sub(zctx, d2.pub)
    c2 = d2.connect(features=kw.FEATURE_PACKED | kw.FEATURE_TIERS)
    pool2 = c2.attach("m", LAYOUT)  # the first attach scans the tier-2 file
    got = sub2.until("DISK after the restart", lambda b: set(want) <= sub2.stored("DISK"))
    assert d2.admin_result("stats")["kv_events"]["kv_events_gaps"] == 0
    r = c2.fetch(pool2.pool_id, [key_of(h) for h in chain])
    pool2.follow(r)
    assert len(kw.reply_blocks(r)) == 3, r
    n0 = len(sub2.batches)
    sub2.until("the fetched chain", lambda b: set(want) <= sub2.stored(MEDIUM, n0))
    assert d2.admin_result("stats")["kv_events"]["kv_events_gaps"] == 0
    del got


def test_fetch_into_t0_publishes_the_chain(kvd_factory, zctx):
    """A Fetch that brings blocks back into T0 from a lower tier publishes them on T0's medium
    as a chain (each one's parent the previous block, the first's None), after the BlockRemoved
    that told the router T0 had let them go; a second Fetch of blocks T0 holds says nothing."""
    d = start(kvd_factory, tier1_memory="0", tier2_path="{dir}/t2", tier2_bytes="64M",
              tier_write="write-through", fetch_min_tokens="0")
    sub = Sub(zctx, d.pub)
    c = d.connect(features=kw.FEATURE_PACKED | kw.FEATURE_TIERS)
    pool = c.attach("m", LAYOUT)
    canon, chain = vllm_commit(c, pool, toks(3, 1))
    want = [ref.to_u64(h) for h in chain]
    sub.until("the DISK copies", lambda b: set(want) <= sub.stored("DISK"))
    c.release(pool.pool_id, canon)
    assert d.admin_result("evict pool=%d" % pool.pool_id)["evicted"] == 3
    got = sub.until("the BlockRemoved of T0", lambda b: set(want) <= {
        h for b2 in sub.batches for e in b2.events if isinstance(e, BlockRemoved)
        and e.medium == MEDIUM for h in e.block_hashes})
    n0 = len(sub.batches)

    r = c.fetch(pool.pool_id, [key_of(h) for h in chain])
    pool.follow(r)
    blocks = kw.reply_blocks(r)
    assert len(blocks) == 3, r
    got = sub.until("the fetched chain on %s" % MEDIUM, lambda b: set(want) <= sub.stored(MEDIUM, n0))
    stored_ev = [e for b in got for e in b.events
                 if isinstance(e, BlockStored) and e.medium == MEDIUM]
    order = [h for e in stored_ev for h in e.block_hashes]
    assert order == want, stored_ev
    # one event per block or per run: parents along the chain
    assert chain_parents(stored_ev) == {want[0]: None, want[1]: want[0], want[2]: want[1]}, (
        stored_ev)
    for e in stored_ev:
        assert e.token_ids == [] and e.block_size == T, e
    st = d.admin_result("stats")["kv_events"]
    assert st["kv_events_gaps"] == 0, st

    # Held in T0 now: fetching again publishes nothing (a sentinel commit marks the end).
    c.release(pool.pool_id, blocks)
    r = c.fetch(pool.pool_id, [key_of(h) for h in chain])
    pool.follow(r)
    assert len(kw.reply_blocks(r)) == 3
    c.release(pool.pool_id, kw.reply_blocks(r))
    n1 = len(sub.batches)
    _, sent = vllm_commit(c, pool, toks(1, 9000))
    sub.until("the sentinel", lambda b: any(
        ref.to_u64(sent[0]) in getattr(e, "block_hashes", ()) for e in b.events))
    again = [e for b in sub.batches[n1:] for e in b.events if isinstance(e, BlockStored)
             and set(e.block_hashes) & set(want) and e.medium == MEDIUM]
    assert not again, again


# ---------------------------------------------------------------------------------------------
# Configuration refused

BAD_CONFIGS = {
    "hash_mode": ({"hash_mode": "md5"}, "hash-mode"),
    "format": ({OPT_ENDPOINT: "{free}", "kv_events_format": "json"}, "kv-events-format"),
    "same_endpoint": ({OPT_ENDPOINT: "{free}", OPT_REPLAY: "{free}"}, "both the PUB and"),
    "hash_form": ({OPT_ENDPOINT: "{free}", OPT_HASH_FORM: "hex"}, "hash-form"),
    "thread": ({OPT_ENDPOINT: "{free}", "kv_events_thread": "maybe"}, "kv-events-thread"),
    "events_line_domain": ({"tenants_file": "{dir}/tenants"}, "nosuchtenant"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_event_config_is_refused(case):
    """A bad hash mode, hash form or `events` line (an unknown domain) stops kvd at start,
    naming what is wrong."""
    opts, contains = BAD_CONFIGS[case]
    free = tcp_endpoints(1)[0]
    opts = {k: v.replace("{free}", free) for k, v in opts.items()}

    def setup(tmp):
        with open(os.path.join(tmp, "tenants"), "w") as f:
            f.write("events endpoint=%s domains=nosuchtenant\n" % free)
    rc, out = run_kvd_expecting_refusal(opts, setup=setup)
    assert rc not in (None, 0), "kvd served with %r: %s" % (opts, out)
    assert contains in out, out
