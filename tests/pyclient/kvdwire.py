"""kvdwire: an independent Python client of the kvd wire protocol, version 1.

Written from proto/PROTOCOL.md, proto/kvd.proto, docs/HASH.md, docs/TENANCY.md and the comments of
common/kv_layout.h alone (no daemon or libkvclient source), so that it tests whether the written
specification is enough to talk to kvd. It provides:

- protobuf bindings, generated at import time by protoc into a temporary directory (``pb``);
- framing (4-byte little-endian length + Envelope) and SCM_RIGHTS fds kept in a FIFO (§2, §2.2);
- ``Conn``: one session with a method per request, pipelining (``send``/``recv``), raw frames;
- ``Pool``: an attached pool with its own mmap of every HOST_MEMFD segment it was sent;
- ``Layout``: the byte position of every element of a block inside a segment (kv_layout.h);
- the block-hash chain (§9, docs/HASH.md);
- ``KvdError``: an Error reply as an exception with ``code`` and ``message``.
"""

import atexit
import hashlib
import importlib
import mmap
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile

import xxhash

# The repository root (or, under Bazel, the runfiles tree's workspace directory, which holds
# proto/kvd.proto as well); $KVDWIRE_PROTO_DIR overrides where kvd.proto is read from.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROTO_DIR = os.environ.get("KVDWIRE_PROTO_DIR") or os.path.join(REPO_ROOT, "proto")

MAX_FDS_PER_FRAME = 200  # §2.2
PAGE = 4096
NO_PARENT = 0xFFFFFFFF  # Commit parent of a prefix's first block (§6 Commit)
FEATURE_PACKED = 1  # §6 Packed lists (KV_FEATURE_PACKED)
FEATURE_TIERS = 2  # §6 Fetch: LookupReply tier fields, FetchReply out of order (KV_FEATURE_TIERS)
FEATURE_PACKED_COMMIT = 16  # §6 Packed lists: Commit.entries_packed, CommitReply.canonical_packed
REPLY_SLACK = 64  # replies may be max_frame_bytes + 64 long (§2)


def _generate_pb2():
    """Runs protoc on proto/kvd.proto into a temporary directory and imports kvd_pb2."""
    out = tempfile.mkdtemp(prefix="kvd_pb2_")
    atexit.register(shutil.rmtree, out, True)
    subprocess.run(["protoc", "--proto_path=" + PROTO_DIR, "--python_out=" + out, "kvd.proto"],
                   check=True)
    sys.path.insert(0, out)
    try:
        return importlib.import_module("kvd_pb2")
    finally:
        sys.path.remove(out)


pb = _generate_pb2()

# Error code numbers (kv_err.h / kvd.ErrorCode), also as module constants: kvdwire.ENOENT, ...
globals().update(pb.ErrorCode.items())
ERR_NAMES = {num: name for name, num in pb.ErrorCode.items()}

# Request body field name -> reply body field name (§6).
REPLY_OF = {
    "hello": "hello_reply", "attach_pool": "attach_pool_reply", "lookup": "lookup_reply",
    "allocate": "allocate_reply", "commit": "commit_reply", "release": "release_reply",
    "rewind": "rewind_reply", "pin": "pin_reply", "stats": "stats_reply", "ping": "pong",
    "fetch": "fetch_reply",
    "unshare": "unshare_reply", "summaries": "summaries_reply",
    "goodbye": "goodbye_reply", "map_segments": "map_segments_reply",
    "detach_pool": "detach_pool_reply",
}
FD_KINDS = (pb.HOST_MEMFD, pb.CUDA_VMM)  # segment kinds whose fd travels (§2.2)


class KvdError(Exception):
    """An Error reply (or a client-side failure named with a kv_err code)."""

    def __init__(self, code, message, req_id=None):
        super().__init__("%s (%d): %s" % (ERR_NAMES.get(code, "UNKNOWN"), code, message))
        self.code = code
        self.message = message
        self.req_id = req_id

    @property
    def name(self):
        return ERR_NAMES.get(self.code, "UNKNOWN")


class ProtocolViolation(AssertionError):
    """The daemon sent something the specification does not allow."""


# ---------------------------------------------------------------------------------------------
# Block hash (PROTOCOL.md §9, docs/HASH.md)

MASK64 = (1 << 64) - 1
HASH_XXH3_128 = 1
HASH_SHA256_128 = 2


def hash_input(parent, extra, tokens):
    """The bytes one block hashes: le64 lo, le64 hi, le32 len(extra), extra, le32 n, le32 tokens."""
    lo, hi = parent
    if len(extra) > 256:
        raise KvdError(pb.EINVAL, "extra longer than 256 bytes")
    return (struct.pack("<QQI", lo, hi, len(extra)) + bytes(extra)
            + struct.pack("<I%dI" % len(tokens), len(tokens), *tokens))


def hash_block(parent, tokens, extra=b"", algo=HASH_XXH3_128):
    """One block's hash as (lo, hi) from its parent hash (lo, hi) (the seed for block 0)."""
    data = hash_input(parent, extra, tokens)
    if algo == HASH_XXH3_128:
        v = xxhash.xxh3_128_intdigest(data)
        return v & MASK64, v >> 64
    if algo == HASH_SHA256_128:
        return struct.unpack("<QQ", hashlib.sha256(data).digest()[:16])
    raise KvdError(pb.ENOTSUP, "hash_algo %d" % algo)


def hash_chain(seed, tokens, tokens_per_block, extra=b"", algo=HASH_XXH3_128):
    """Hashes of every full block of `tokens` (a partial last block has none)."""
    out, h = [], tuple(seed)
    for i in range(len(tokens) // tokens_per_block):
        h = hash_block(h, tokens[i * tokens_per_block:(i + 1) * tokens_per_block], extra, algo)
        out.append(h)
    return out


def hash_hex(h):
    """Text form: le64 lo || le64 hi as 32 lowercase hex digits."""
    return struct.pack("<QQ", h[0], h[1]).hex()


# ---------------------------------------------------------------------------------------------
# Layout (common/kv_layout.h comments)

ELEM_BYTES = {pb.FP16: 2, pb.BF16: 2, pb.FP32: 4, pb.FP8_E4M3: 1, pb.INT8: 1}


class Layout:
    """Where each element of a block lives inside a segment of `nblocks` blocks.

    LAYER_MAJOR: for each layer, K then V, each [nblocks][tokens][heads][dim]; for 8-bit dtypes
    float32 scales follow all element data as [layers][K,V][nblocks][heads].
    BLOCK_MAJOR: block b is one run [layers][K,V][tokens][heads][dim] then [layers][K,V][heads]
    scales, at b * block_bytes.
    """

    def __init__(self, num_layers, num_kv_heads, head_dim, tokens_per_block, dtype, arrangement):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.tokens_per_block, self.dtype, self.arrangement = tokens_per_block, dtype, arrangement
        self.elem_bytes = ELEM_BYTES[dtype]
        self.token_bytes = num_kv_heads * head_dim * self.elem_bytes
        self.kv_block_bytes = tokens_per_block * self.token_bytes
        self.data_bytes = 2 * num_layers * self.kv_block_bytes
        self.scale_bytes = 2 * num_layers * num_kv_heads * 4 if self.elem_bytes == 1 else 0
        self.block_bytes = self.data_bytes + self.scale_bytes

    @classmethod
    def from_pb(cls, m):
        return cls(m.num_layers, m.num_kv_heads, m.head_dim, m.tokens_per_block, m.dtype,
                   m.arrangement)

    def to_pb(self):
        return pb.Layout(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                         head_dim=self.head_dim, tokens_per_block=self.tokens_per_block,
                         dtype=self.dtype, arrangement=self.arrangement)

    def segment_bytes(self, nblocks):
        """Segment.bytes: nblocks * block_bytes rounded up to the page size (§6 AttachPool)."""
        return -(-nblocks * self.block_bytes // PAGE) * PAGE

    def offset(self, nblocks, block, layer, kv, token, head):
        """Byte offset of element (token, head, 0) of layer's K (kv=0) or V (kv=1) in `block`."""
        assert block < nblocks and layer < self.num_layers and kv in (0, 1)
        assert token < self.tokens_per_block and head < self.num_kv_heads
        inner = (token * self.num_kv_heads + head) * self.head_dim * self.elem_bytes
        section = layer * 2 + kv
        if self.arrangement == pb.LAYER_MAJOR:
            return (section * nblocks + block) * self.kv_block_bytes + inner
        return block * self.block_bytes + section * self.kv_block_bytes + inner

    def scale_offset(self, nblocks, block, layer, kv, head):
        """Byte offset of the float32 scale of (block, layer, kv, head) (8-bit dtypes only)."""
        assert self.scale_bytes and block < nblocks
        section = layer * 2 + kv
        if self.arrangement == pb.LAYER_MAJOR:
            return (nblocks * self.data_bytes
                    + ((section * nblocks + block) * self.num_kv_heads + head) * 4)
        return block * self.block_bytes + self.data_bytes + (section * self.num_kv_heads + head) * 4

    def block_runs(self, nblocks, block):
        """The (offset, length) runs holding all bytes of `block` in a segment, in a fixed order;
        they add up to block_bytes."""
        if self.arrangement == pb.BLOCK_MAJOR:
            return [(block * self.block_bytes, self.block_bytes)]
        runs = [(self.offset(nblocks, block, layer, kv, 0, 0), self.kv_block_bytes)
                for layer in range(self.num_layers) for kv in (0, 1)]
        if self.scale_bytes:
            runs += [(self.scale_offset(nblocks, block, layer, kv, 0), self.num_kv_heads * 4)
                     for layer in range(self.num_layers) for kv in (0, 1)]
        return runs


# ---------------------------------------------------------------------------------------------
# Packed lists (§6)

def pack_hashes(hashes):
    return b"".join(struct.pack("<QQ", lo, hi) for lo, hi in hashes)


def pack_blocks(blocks):
    return b"".join(struct.pack("<II", i, g) for i, g in blocks)


def unpack_blocks(data):
    if len(data) % 8:
        raise ProtocolViolation("blocks_packed of %d bytes is not a multiple of 8" % len(data))
    return [struct.unpack_from("<II", data, i) for i in range(0, len(data), 8)]


def pack_commit(entries):
    """Commit.entries_packed of pb.CommitEntry messages: 28 bytes each (block id, gen, hash lo,
    hash hi, parent; little-endian)."""
    return b"".join(struct.pack("<IIQQI", e.block.id, e.block.gen, e.hash.lo, e.hash.hi, e.parent)
                    for e in entries)


def packed_commit(pool_id, entries):
    """The packed form of a Commit of pb.CommitEntry messages: hash_full and token_ids of every
    entry (all or none of them), parent_hash_full of the first only."""
    m = pb.Commit(pool_id=pool_id, entries_packed=pack_commit(entries))
    if any(e.hash_full for e in entries):
        m.hash_full_packed = b"".join(e.hash_full for e in entries)
    if any(e.token_ids for e in entries):
        m.token_ids_packed = b"".join(struct.pack("<%dI" % len(e.token_ids), *e.token_ids)
                                      for e in entries)
    if entries and entries[0].parent_hash_full:
        m.parent_hash_full = entries[0].parent_hash_full
    if any(e.parent_hash_full for e in entries[1:]):
        raise ValueError("the packed form carries parent_hash_full for the first entry only")
    return m


def _either_form(reply, field):
    """(id, gen) pairs of reply's block list `field` or its packed form `field`_packed."""
    refs, packed = getattr(reply, field), getattr(reply, field + "_packed")
    if refs and packed:
        raise ProtocolViolation("reply has both %s and %s_packed" % (field, field))
    if packed:
        return unpack_blocks(packed)
    return [(b.id, b.gen) for b in refs]


def reply_canonical(reply):
    """(id, gen) pairs of a CommitReply in whichever form it came."""
    return _either_form(reply, "canonical")


def reply_blocks(reply):
    """(id, gen) pairs of a LookupReply / AllocateReply in whichever form it came."""
    return _either_form(reply, "blocks")


def _refs(blocks):
    return [pb.BlockRef(id=i, gen=g) for i, g in blocks]


# ---------------------------------------------------------------------------------------------
# Connection

class Conn:
    """One client connection: framing, fd FIFO, requests.

    Request helpers send one request and return the reply body, raising KvdError for an Error
    reply. `send`/`recv` pipeline; `send_raw`/`recv_frame` expose the wire."""

    def __init__(self, path, timeout=10.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.path = path
        self.buf = bytearray()
        self.fds = []  # FIFO of received fds, in arrival order (§2.2)
        self.next_id = 1
        self.epoch = 0  # sent in every request once known (§4)
        self.hello_reply = None
        self.packed_out = False  # daemon accepts packed requests and we choose to send them
        self.max_frame_bytes = 1 << 20
        self.pools = {}  # pool_id -> Pool
        self.ctrunc = False  # ever saw MSG_CTRUNC
        # For the §2.2 arrival check: (stream offset of the first byte of each recvmsg that
        # brought fds, fds received so far), and the number of fds handed to frames so far.
        self.rx_pos = 0
        self.fd_marks = []
        self.fds_received = 0
        self.fds_taken = 0

    # -- wire -------------------------------------------------------------------------------
    def close(self):
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        for p in self.pools.values():
            p.unmap()
        self.sock.close()

    def fileno(self):
        return self.sock.fileno()

    def send_raw(self, data):
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError) as e:
            raise KvdError(pb.ECLOSED, "connection closed by the daemon (%s)" % e)

    @staticmethod
    def frame(env_bytes):
        return struct.pack("<I", len(env_bytes)) + env_bytes

    def envelope(self, body, msg, req_id=None, epoch=None):
        env = pb.Envelope(id=self.next_id if req_id is None else req_id,
                          boot_epoch=self.epoch if epoch is None else epoch)
        if req_id is None:
            self.next_id += 1
        getattr(env, body).CopyFrom(msg)
        return env

    def send(self, body, msg=None, req_id=None, epoch=None):
        """Sends one request; returns its envelope id."""
        if msg is None:
            msg = getattr(pb, type(getattr(pb.Envelope(), body)).__name__)()
        env = self.envelope(body, msg, req_id, epoch)
        self.send_raw(self.frame(env.SerializeToString()))
        return env.id

    def _fill(self):
        """One recvmsg: appends bytes to the buffer and fds to the FIFO. False on EOF."""
        try:
            data, anc, flags, _ = self.sock.recvmsg(
                1 << 16, socket.CMSG_SPACE(MAX_FDS_PER_FRAME * 4), socket.MSG_CMSG_CLOEXEC)
        except ConnectionResetError:
            return False
        if flags & socket.MSG_CTRUNC:
            self.ctrunc = True
        start = self.rx_pos
        self.rx_pos += len(data)
        for level, typ, cdata in anc:
            if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
                n = len(cdata) // 4
                self.fds.extend(struct.unpack("<%di" % n, cdata[:n * 4]))
                self.fds_received += n
                self.fd_marks.append((start, self.fds_received))
        self.buf += data
        return bool(data)

    def _fds_by(self, pos):
        """Fds received up to and with the recvmsg that brought stream byte `pos`."""
        while len(self.fd_marks) > 1 and self.fd_marks[1][0] <= pos:
            self.fd_marks.pop(0)  # frames come in order: older marks are not needed again
        if self.fd_marks and self.fd_marks[0][0] <= pos:
            return self.fd_marks[0][1]
        return self.fds_taken  # no fds came with or before that byte (beyond those used)

    def recv_frame(self):
        """Reads one frame; returns (Envelope, fds of that frame in fd_index order)."""
        while len(self.buf) < 4 or len(self.buf) < 4 + struct.unpack_from("<I", self.buf)[0]:
            if not self._fill():
                raise KvdError(pb.ECLOSED, "connection closed by the daemon (%d bytes pending)"
                               % len(self.buf))
        n = struct.unpack_from("<I", self.buf)[0]
        start = self.rx_pos - len(self.buf)  # stream offset of this frame's first byte
        if n > self.max_frame_bytes + REPLY_SLACK:
            raise ProtocolViolation("reply frame of %d bytes" % n)
        body = bytes(self.buf[4:4 + n])
        del self.buf[:4 + n]
        env = pb.Envelope()
        env.ParseFromString(body)
        which = env.WhichOneof("body")
        segs = []
        if which == "attach_pool_reply":
            segs = env.attach_pool_reply.segments
        elif which == "map_segments_reply":
            segs = env.map_segments_reply.segments
        nfd = sum(1 for s in segs if s.kind in FD_KINDS)
        if nfd > len(self.fds):
            raise ProtocolViolation("frame names %d fds, %d arrived" % (nfd, len(self.fds)))
        if nfd and self._fds_by(start) < self.fds_taken + nfd:
            raise ProtocolViolation("the fds of a frame did not come with its first byte")
        fds, self.fds = self.fds[:nfd], self.fds[nfd:]
        self.fds_taken += nfd
        return env, fds

    def recv(self, expect_id=None):
        """Reads one reply; returns (reply body name, body, fds); raises KvdError on Error."""
        env, fds = self.recv_frame()
        if expect_id is not None and env.id != expect_id:
            raise ProtocolViolation("reply id %d, expected %d" % (env.id, expect_id))
        if self.epoch and env.boot_epoch != self.epoch:
            raise ProtocolViolation("reply epoch %x, session saw %x" % (env.boot_epoch, self.epoch))
        which = env.WhichOneof("body")
        if which == "error":
            for fd in fds:
                os.close(fd)
            raise KvdError(env.error.code, env.error.message, env.id)
        return which, getattr(env, which), fds

    def call(self, body, msg=None, **kw):
        """Sends one request and waits for its reply body (checked to be the right type)."""
        rid = self.send(body, msg, **kw)
        which, reply, fds = self.recv(rid)
        if which != REPLY_OF[body]:
            raise ProtocolViolation("%s answered with %s" % (body, which))
        return reply, fds

    # -- requests ---------------------------------------------------------------------------
    def hello(self, name="pytest", version=1, token=b"", features=FEATURE_PACKED, packed=True):
        r, _ = self.call("hello", pb.Hello(protocol_version=version, client_name=name,
                                           token=token, features=features))
        self.hello_reply = r
        self.epoch = r.boot_epoch
        self.max_frame_bytes = r.max_frame_bytes
        self.packed_out = packed and bool(r.features & FEATURE_PACKED)
        self.packed_in = bool(features & FEATURE_PACKED)
        return r

    def attach(self, model_id, layout, lossy_tiers=False):
        """AttachPool; maps every segment sent; returns the Pool. lossy_tiers: Layout's flag
        (§6 Fetch: the lower tiers may keep the pool's blocks quantized)."""
        lp = layout.to_pb()
        lp.lossy_tiers = lossy_tiers
        r, fds = self.call("attach_pool", pb.AttachPool(model_id=model_id, layout=lp))
        pool = self.pools.get(r.pool_id)
        if pool is None:
            pool = self.pools[r.pool_id] = Pool(self, r.pool_id, Layout.from_pb(r.layout),
                                                r.blocks_per_segment)
        pool.attach_reply = r
        pool.hash_seed = (r.hash_seed.lo, r.hash_seed.hi)
        pool.hash_algo = r.hash_algo
        pool.add_segments(r.segments, fds)
        if len(r.segments) == MAX_FDS_PER_FRAME:
            pool.map_segments(r.segments[-1].index + 1)
        return pool

    def linked_pool(self, pool, linked):
        """A Pool for an entry of pool's AttachPoolReply.linked, its segments fetched with
        MapSegments. Layout, seed and algo are pool's (§9: the seed is the same in every
        domain; LinkedPool carries neither)."""
        lp = self.pools.get(linked.pool_id)
        if lp is None:
            lp = self.pools[linked.pool_id] = Pool(self, linked.pool_id, pool.layout,
                                                   linked.blocks_per_segment)
            lp.read_only = linked.read_only
            lp.hash_seed, lp.hash_algo = pool.hash_seed, pool.hash_algo
            lp.map_segments(0)
        return lp

    def map_segments(self, pool_id, first_index):
        return self.call("map_segments", pb.MapSegments(pool_id=pool_id, first_index=first_index))

    def lookup_msg(self, pool_id, hashes, search_domains=False, packed=None, remote=False):
        packed = self.packed_out if packed is None else packed
        m = pb.Lookup(pool_id=pool_id, search_domains=search_domains, remote=remote)
        if packed:
            m.hashes_packed = pack_hashes(hashes)
        else:
            m.hashes.extend(pb.Hash128(lo=lo, hi=hi) for lo, hi in hashes)
        return m

    def lookup(self, pool_id, hashes, search_domains=False, packed=None, remote=False):
        """Lookup (§6); remote: also ask the remote tier (the reply may come after later
        requests' replies)."""
        r, _ = self.call("lookup", self.lookup_msg(pool_id, hashes, search_domains, packed,
                                                   remote))
        return r

    def fetch_msg(self, pool_id, hashes, min_tokens=0, packed=None):
        packed = self.packed_out if packed is None else packed
        m = pb.Fetch(pool_id=pool_id, min_tokens=min_tokens)
        if packed:
            m.hashes_packed = pack_hashes(hashes)
        else:
            m.hashes.extend(pb.Hash128(lo=lo, hi=hi) for lo, hi in hashes)
        return m

    def fetch(self, pool_id, hashes, min_tokens=0, packed=None):
        """Fetch (§6): waits for its FetchReply (which may come after later requests' replies)."""
        r, _ = self.call("fetch", self.fetch_msg(pool_id, hashes, min_tokens, packed))
        return r

    def allocate(self, pool_id, count):
        r, _ = self.call("allocate", pb.Allocate(pool_id=pool_id, count=count))
        return r

    def commit_reply(self, pool_id, entries, packed=False):
        """entries: (block (id, gen), hash (lo, hi), parent id). packed: as entries_packed
        (§6 Packed lists). Returns the CommitReply."""
        m = pb.Commit(pool_id=pool_id)
        for (bid, gen), (lo, hi), parent in entries:
            m.entries.add(block=pb.BlockRef(id=bid, gen=gen), hash=pb.Hash128(lo=lo, hi=hi),
                          parent=parent)
        if packed:
            m = packed_commit(pool_id, list(m.entries))
        return self.call("commit", m)[0]

    def commit(self, pool_id, entries, packed=False):
        """Commit; maps the segments the reply announces (for a pool this Conn knows) and
        returns the canonical (id, gen)s."""
        r = self.commit_reply(pool_id, entries, packed)
        if pool_id in self.pools:
            self.pools[pool_id].follow(r)
        return reply_canonical(r)

    def blocks_msg(self, kind, pool_id, blocks, packed=None):
        packed = self.packed_out if packed is None else packed
        m = getattr(pb, kind)(pool_id=pool_id)
        if packed:
            m.blocks_packed = pack_blocks(blocks)
        else:
            m.blocks.extend(_refs(blocks))
        return m

    def release(self, pool_id, blocks, packed=None):
        return self.call("release", self.blocks_msg("Release", pool_id, blocks, packed))[0]

    def rewind(self, pool_id, blocks, packed=None):
        return self.call("rewind", self.blocks_msg("Rewind", pool_id, blocks, packed))[0]

    def pin(self, pool_id, blocks, retention_ms=1000, priority=0, unpin=False):
        return self.call("pin", pb.Pin(pool_id=pool_id, blocks=_refs(blocks),
                                       retention_ms=retention_ms, priority=priority,
                                       unpin=unpin))[0]

    def stats(self, pool_id=0):
        r, _ = self.call("stats", pb.Stats(pool_id=pool_id))
        return {s.name: s.value for s in r.stats}

    def detach(self, pool_id):
        return self.call("detach_pool", pb.DetachPool(pool_id=pool_id))[0]

    def ping(self, nonce=0, payload=b""):
        return self.call("ping", pb.Ping(nonce=nonce, payload=payload))[0]

    def goodbye(self):
        return self.call("goodbye")[0]


class Pool:
    """An attached pool: its layout and a private MAP_SHARED mapping of each segment."""

    def __init__(self, conn, pool_id, layout, blocks_per_segment):
        self.conn, self.pool_id, self.layout = conn, pool_id, layout
        self.bps = blocks_per_segment
        self.segments = {}  # index -> (Segment message, mmap)
        self.read_only = False
        self.hash_seed = (0, 0)
        self.hash_algo = HASH_XXH3_128

    def add_segments(self, segs, fds):
        """Maps the segments of one reply with its fds (fd_index order, §2.2); closes the fds."""
        try:
            for s in segs:
                if s.kind != pb.HOST_MEMFD:
                    raise ProtocolViolation("segment kind %d from a host backend" % s.kind)
                if s.fd_index >= len(fds):
                    raise ProtocolViolation("fd_index %d of %d fds" % (s.fd_index, len(fds)))
                prot = mmap.PROT_READ | (0 if s.read_only else mmap.PROT_WRITE)
                m = mmap.mmap(fds[s.fd_index], s.bytes, mmap.MAP_SHARED, prot)
                if hasattr(mmap, "MADV_HUGEPAGE"):
                    # as libkvclient does (common/kv_util.h): 2 MiB pages where shmem THP allows
                    try:
                        m.madvise(mmap.MADV_HUGEPAGE)
                    except OSError:
                        pass  # a kernel without THP refuses the advice; the memory is the same
                old = self.segments.pop(s.index, None)
                if old:
                    old[1].close()
                self.segments[s.index] = (s, m)
        finally:
            for fd in fds:
                os.close(fd)

    def map_segments(self, first_index):
        """MapSegments from first_index on, following the 200-per-reply limit; returns indexes."""
        got = []
        while True:
            r, fds = self.conn.map_segments(self.pool_id, first_index)
            self.add_segments(r.segments, fds)
            got += [s.index for s in r.segments]
            if len(r.segments) < MAX_FDS_PER_FRAME:
                return got
            first_index = r.segments[-1].index + 1

    def lowest_unmapped(self):
        """This client's own lowest segment index it has no mapping of."""
        i = 0
        while i in self.segments:
            i += 1
        return i

    def follow(self, reply):
        """Maps what a LookupReply / AllocateReply / CommitReply announces (PROTOCOL.md
        'Segments a reply hands out'): MapSegments from our own lowest unmapped segment, never
        from the announced index, for this pool and for every linked_segments notice."""
        if reply.new_segments_from:
            self.map_segments(self.lowest_unmapped())
        for notice in getattr(reply, "linked_segments", ()):
            linked = self.conn.pools.get(notice.pool_id)
            if linked is None:
                raise ProtocolViolation("notice for pool %d, not linked" % notice.pool_id)
            linked.map_segments(linked.lowest_unmapped())

    def unmap(self):
        for _, m in self.segments.values():
            m.close()
        self.segments = {}

    def where(self, block_id):
        """(segment mmap, nblocks, slot) of a block id (§4: id = segment * bps + slot)."""
        seg, slot = divmod(block_id, self.bps)
        if seg not in self.segments:
            raise ProtocolViolation("block %d is in segment %d, never sent" % (block_id, seg))
        s, m = self.segments[seg]
        return m, s.nblocks, slot

    def write_block(self, block_id, data):
        """Writes block_bytes of data into the block's runs."""
        m, nblocks, slot = self.where(block_id)
        pos = 0
        for off, n in self.layout.block_runs(nblocks, slot):
            m[off:off + n] = data[pos:pos + n]
            pos += n
        assert pos == len(data) == self.layout.block_bytes

    def read_block(self, block_id):
        m, nblocks, slot = self.where(block_id)
        return b"".join(m[off:off + n] for off, n in self.layout.block_runs(nblocks, slot))


def block_pattern(layout, key):
    """block_bytes of deterministic bytes derived from `key` (for write / read-back checks)."""
    out = bytearray()
    i = 0
    while len(out) < layout.block_bytes:
        out += hashlib.sha256(b"%s/%d" % (str(key).encode(), i)).digest()
        i += 1
    return bytes(out[:layout.block_bytes])
