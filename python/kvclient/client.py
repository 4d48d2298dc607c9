"""Connections, pools, block calls, batches and sequences: thin objects over libkvclient.

Every call is one libkvclient call (and, for the block calls, one round trip to kvd); a failing
call raises the KvdError subclass of its kv_err code with kvd's message. Inputs and outputs
are ctypes buffers wrapped in small classes (Hashes, Blocks) so that a hot loop allocates
nothing but its result; `.numpy()` on them is a zero-copy numpy view.

Ownership and lifetime (docs/PYTHON.md, "Lifetime"): a Pool's memory stays mapped while any
view, numpy array or DLPack capsule made from it is alive. Pool.detach() and
Connection.close() end the Python objects at once (their calls then raise KvdDetached), and the
C library's kvc_pool_detach / kvc_conn_close run when the last of those references is gone.
Releases triggered by the garbage collector never interrupt a call or an unfinished batch: they
run at once when the connection is idle, else right after the call in progress.

Threads: calls on one connection are serialised by a lock, so a Connection and what it made
may be shared by threads (one call at a time, as libkvclient requires); mapped memory may be
used from any thread.
"""

import ctypes
import threading
import weakref

from ctypes import byref, c_int32, c_size_t, c_uint32, c_uint64, c_void_p

import numpy as np

from . import _lib
from ._lib import KvcBlock, KvcCommitEntry, KvHash128, KvLayout, KvcOptions, lib
from .errors import KvdDetached, KvdError, error_class, raise_for
from .views import reap as _reap

__all__ = ["Connection", "Pool", "Layout", "Hashes", "Blocks", "Batch", "BatchRequest",
           "Sequence", "append_many", "export_csr", "export_csr_pool", "export_table",
           "DTYPES", "ARRANGEMENTS", "K", "V", "NO_PARENT", "default_socket_path",
           "BLOCK_DTYPE", "HASH_DTYPE"]

K, V = 0, 1
NO_PARENT = _lib.NO_PARENT
DTYPES = {"fp16": 1, "bf16": 2, "fp32": 3, "fp8_e4m3": 4, "int8": 5}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
ARRANGEMENTS = {"layer_major": 1, "block_major": 2}
ARRANGEMENT_NAMES = {v: k for k, v in ARRANGEMENTS.items()}
ELEM_BYTES = {1: 2, 2: 2, 3: 4, 4: 1, 5: 1}
BLOCK_DTYPE = np.dtype([("id", "<u4"), ("gen", "<u4")])  # same bytes as kvc_block
HASH_DTYPE = np.dtype([("lo", "<u8"), ("hi", "<u8")])    # same bytes as kv_hash128
_KV_ENOTSUP = 18

_BLOCK_SIZE = ctypes.sizeof(KvcBlock)
_HASH_SIZE = ctypes.sizeof(KvHash128)


def default_socket_path():
    """kvc_default_socket_path: $KVD_SOCKET, $XDG_RUNTIME_DIR/kvd/kvd.sock or
    /tmp/kvd-$UID/kvd.sock."""
    buf = ctypes.create_string_buffer(4096)
    rc = lib.kvc_default_socket_path(buf, len(buf))
    if rc:
        raise_for(rc, "default_socket_path")
    return buf.value.decode()


def _u32_tokens(tokens):
    """(ctypes-compatible pointer, count, keepalive) for a token sequence as uint32."""
    if isinstance(tokens, np.ndarray):
        a = np.ascontiguousarray(tokens, dtype=np.uint32)
        return a.ctypes.data, a.size, a
    n = len(tokens)
    a = (c_uint32 * n)(*tokens)
    return a, n, a


def _raw(data):
    """(pointer, length) of a bytes-like extra key (None/b"" for none)."""
    if not data:
        return None, 0
    if isinstance(data, str):
        data = data.encode()
    data = bytes(data)
    return data, len(data)


# ---- Connection ---------------------------------------------------------------------------


class _ConnHandle:
    """Owns the kvc_conn *: closed when the Connection is closed and nothing maps its pools
    (pools and sequences hold this object). Also the lock that serialises calls, and the
    queue of C frees deferred while a call or a batch was in progress."""

    __slots__ = ("ptr", "lock", "deferred", "batch_inflight", "inflight", "__weakref__")

    def __init__(self, ptr):
        self.ptr = ptr
        self.lock = threading.Lock()
        self.deferred = []
        self.batch_inflight = False
        self.inflight = None  # the kvc_batch pointer sent and not waited for

    def free_batch(self, ptr):
        """A Batch's finalizer. One sent and never waited for is the batch in flight: nobody can
        wait for it now, so the connection is no longer held for it; freeing it breaks the
        connection (libkvclient: its replies would confuse the next call, which reconnects).
        Without this every later call met KvdState and every deferred free waited forever."""
        if self.inflight == ptr:
            self.inflight = None
            self.batch_inflight = False
        self.free_later(lib.kvc_batch_free, ptr)

    def run_deferred(self):
        """Runs queued frees; the caller holds the lock and no batch is in flight."""
        while self.deferred:
            fn, arg = self.deferred.pop(0)
            fn(arg)

    def free_later(self, fn, arg):
        """fn(arg) now if the connection is idle, else after the current call or batch. Called
        from finalizers (any thread, any moment): never blocks."""
        if self.lock.acquire(False):
            try:
                if self.batch_inflight:
                    self.deferred.append((fn, arg))
                else:
                    self.run_deferred()
                    fn(arg)
            finally:
                self.lock.release()
        else:
            self.deferred.append((fn, arg))

    def exit_call(self):
        """After a call: run what finalizers queued meanwhile (the lock is still held)."""
        if self.deferred and not self.batch_inflight:
            self.run_deferred()


def _close_conn(ptr):
    lib.kvc_conn_close(ptr)


class Connection:
    """A connection to kvd (kvc_conn_open): one session with its own references.

    Connection(socket_path=None, client_name=None, timeout_ms=None, token=None, log=None,
    log_level=None). socket_path None: kvc_default_socket_path(). timeout_ms: the longest wait
    for the daemon per call (< 0 forever; libkvclient's default 30000). log: a callable
    log(level, id, message) receiving libkvclient's log lines (levels 0 error .. 3 debug), at
    or below log_level (default 1, warn). Raises KvdSystem when no daemon listens there.
    Use as a context manager, or call close()."""

    def __init__(self, socket_path=None, client_name=None, timeout_ms=None, token=None,
                 log=None, log_level=None):
        o = KvcOptions()
        lib.kvc_options_init(byref(o))
        self._keep = []  # option strings must stay alive during kvc_conn_open (it copies them)
        if socket_path is not None:
            o.socket_path = str(socket_path).encode()
        if client_name is not None:
            o.client_name = str(client_name).encode()
        if timeout_ms is not None:
            o.timeout_ms = int(timeout_ms)
        if token is not None:
            t = bytes(token)
            self._keep.append(t)
            o.token = ctypes.cast(ctypes.c_char_p(t), c_void_p)
            o.token_len = len(t)
        self._log_cb = None
        if log is not None:
            def _log(arg, level, mid, msg):
                try:
                    log(level, (mid or b"").decode(errors="replace"),
                        (msg or b"").decode(errors="replace"))
                except Exception:  # a callback must not raise into C
                    pass
            self._log_cb = _lib.LOG_FN(_log)  # kept alive as long as the connection
            o.log = self._log_cb
        if log_level is not None:
            o.log_level = int(log_level)
        out = c_void_p()
        rc = lib.kvc_conn_open(byref(o), byref(out))
        self._keep = None
        if rc:
            raise_for(rc, "connect")
        self._h = _ConnHandle(out.value)
        self._fin = weakref.finalize(self._h, _close_conn, out.value)
        self._pools = weakref.WeakSet()
        self.closed = False

    # context manager
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _handle(self):
        if self.closed:
            raise KvdDetached("connection")
        return self._h

    def close(self):
        """Ends the Python connection: every pool of it is detached (Pool.detach). The socket
        closes, and the daemon releases the session's references, once no view, array or
        capsule of its pools is left. Idempotent."""
        if self.closed:
            return
        for p in list(self._pools):
            p.detach()
        self.closed = True
        _reap()
        h, self._h = self._h, None
        del h  # the finalizer closes it when pools' mappings are gone too

    @property
    def session_id(self):
        return lib.kvc_conn_session_id(self._handle().ptr)

    @property
    def tenant(self):
        return (lib.kvc_conn_tenant(self._handle().ptr) or b"").decode()

    @property
    def boot_epoch(self):
        return lib.kvc_conn_boot_epoch(self._handle().ptr)

    @property
    def has_tiers(self):
        """True when the daemon keeps evicted blocks in lower tiers (docs/TIERS.md)."""
        return bool(lib.kvc_conn_has_tiers(self._handle().ptr))

    @property
    def has_remote(self):
        """True when the daemon has a remote tier (remote-redis; docs/TIERS.md)."""
        return bool(lib.kvc_conn_has_remote(self._handle().ptr))

    @property
    def has_private(self):
        """True when the daemon has private blocks and Unshare (docs/ZIPAGE.md)."""
        return bool(lib.kvc_conn_has_private(self._handle().ptr))

    @property
    def fd(self):
        """The socket descriptor (for poll); -1 while disconnected."""
        return lib.kvc_conn_fd(self._handle().ptr)

    def ping(self, payload=b""):
        """One round trip (Ping/Pong)."""
        _reap()
        h = self._handle()
        data, n = _raw(payload)
        with h.lock:
            rc = lib.kvc_ping(h.ptr, data, n)
            h.exit_call()
        if rc:
            raise_for(rc, "ping")

    def flush(self):
        """Sends the deferred releases (Pool.release(..., deferred=True)) now and waits for
        them; raises the first refusal of one since the last flush."""
        h = self._handle()
        with h.lock:
            rc = lib.kvc_flush(h.ptr)
            h.exit_call()
        if rc:
            raise_for(rc, "flush")

    @property
    def deferred_pending(self):
        """Deferred releases queued and not sent yet."""
        h = self._handle()
        with h.lock:
            return lib.kvc_conn_deferred_pending(h.ptr)

    @property
    def deferred_failures(self):
        """Deferred releases the daemon refused, all told."""
        return lib.kvc_conn_deferred_failures(self._handle().ptr)

    def reconnect(self):
        """Reconnects and says Hello again (the old session is gone). KvdEpoch when kvd
        restarted: detach the pools and attach them again."""
        h = self._handle()
        with h.lock:
            rc = lib.kvc_conn_reconnect(h.ptr)
            h.exit_call()
        if rc:
            raise_for(rc, "reconnect")

    def stats(self, pool_id=0):
        """The daemon's counters as a dict name -> int: session and daemon counters, plus
        pool pool_id's when it is not 0 (a Pool works too)."""
        if isinstance(pool_id, Pool):
            pool_id = pool_id.id
        _reap()
        h = self._handle()
        out = {}

        def fn(arg, name, value):
            out[name.decode()] = value
        cb = _lib.STAT_FN(fn)
        with h.lock:
            rc = lib.kvc_stats(h.ptr, int(pool_id), cb, None)
            h.exit_call()
        if rc:
            raise_for(rc, "stats")
        return out

    def stat(self, name, pool_id=0):
        """One statistic; KvdNotFound when the daemon does not report it."""
        if isinstance(pool_id, Pool):
            pool_id = pool_id.id
        _reap()
        h = self._handle()
        v = c_uint64()
        with h.lock:
            rc = lib.kvc_stat_get(h.ptr, int(pool_id), name.encode(), byref(v))
            h.exit_call()
        if rc:
            raise_for(rc, "stat " + name)
        return v.value

    def attach(self, model_id, layers=None, kv_heads=None, head_dim=None, tokens_per_block=16,
               dtype="fp16", arrangement="layer_major", layout=None, lossy_tiers=False,
               summaries=False):
        """Attaches the pool of (model_id, shape) and maps all of its memory (kvc_pool_attach).
        Give the shape as keywords or as layout=Layout(...). dtype: "fp16", "bf16", "fp32",
        "fp8_e4m3", "int8"; arrangement: "layer_major" or "block_major". lossy_tiers: the
        daemon's lower tiers may keep this pool's blocks quantized (kvc_pool_attach_ex,
        KVC_ATTACH_LOSSY_TIERS; another pool than the same shape without it). summaries: kvd
        keeps a page summary of every committed block (KVC_ATTACH_SUMMARIES; Pool.summaries,
        docs/ICECACHE.md); part of the pool's identity too."""
        h = self._handle()
        if layout is None:
            layout = Layout(layers, kv_heads, head_dim, tokens_per_block, dtype, arrangement)
        c_layout = layout._c()
        out = c_void_p()
        with h.lock:
            flags = (1 if lossy_tiers else 0) | (2 if summaries else 0)
            rc = lib.kvc_pool_attach_ex(h.ptr, str(model_id).encode(), byref(c_layout), flags,
                                        byref(out))
            h.exit_call()
        if rc:
            raise_for(rc, "attach " + str(model_id))
        mapping = _Mapping(h, out.value)
        pool = Pool(self, mapping, _PoolState(), out.value)
        self._pools.add(pool)
        return pool

    def batch(self):
        """A new Batch of pipelined requests on this connection."""
        return Batch(self)

    def __repr__(self):
        if self.closed:
            return "<kvclient.Connection closed>"
        return "<kvclient.Connection session %d tenant %r>" % (self.session_id, self.tenant)


# ---- Layout -------------------------------------------------------------------------------


class Layout:
    """A pool's KV shape (kv_layout): layers, kv_heads, head_dim, tokens_per_block, dtype
    (name), arrangement (name); the pool's layout (Pool.layout) also has the derived byte
    sizes elem_bytes, token_bytes, kv_block_bytes, data_bytes, scale_bytes, block_bytes."""

    __slots__ = ("layers", "kv_heads", "head_dim", "tokens_per_block", "dtype", "arrangement",
                 "elem_bytes", "token_bytes", "kv_block_bytes", "data_bytes", "scale_bytes",
                 "block_bytes")

    def __init__(self, layers, kv_heads, head_dim, tokens_per_block=16, dtype="fp16",
                 arrangement="layer_major"):
        if dtype not in DTYPES:
            raise ValueError("dtype %r: one of %s" % (dtype, ", ".join(DTYPES)))
        if arrangement not in ARRANGEMENTS:
            raise ValueError("arrangement %r: one of %s" % (arrangement, ", ".join(ARRANGEMENTS)))
        self.layers, self.kv_heads, self.head_dim = int(layers), int(kv_heads), int(head_dim)
        self.tokens_per_block = int(tokens_per_block)
        self.dtype, self.arrangement = dtype, arrangement
        self.elem_bytes = ELEM_BYTES[DTYPES[dtype]]
        self.token_bytes = self.kv_heads * self.head_dim * self.elem_bytes
        self.kv_block_bytes = self.tokens_per_block * self.token_bytes
        self.data_bytes = 2 * self.layers * self.kv_block_bytes
        self.scale_bytes = 2 * self.layers * self.kv_heads * 4 if self.elem_bytes == 1 else 0
        self.block_bytes = self.data_bytes + self.scale_bytes

    def _c(self):
        return KvLayout(num_layers=self.layers, num_kv_heads=self.kv_heads,
                        head_dim=self.head_dim, tokens_per_block=self.tokens_per_block,
                        dtype=DTYPES[self.dtype], arrangement=ARRANGEMENTS[self.arrangement])

    @classmethod
    def _from_c(cls, c):
        self = cls.__new__(cls)
        self.layers, self.kv_heads, self.head_dim = c.num_layers, c.num_kv_heads, c.head_dim
        self.tokens_per_block = c.tokens_per_block
        self.dtype = DTYPE_NAMES.get(c.dtype, "unknown")
        self.arrangement = ARRANGEMENT_NAMES.get(c.arrangement, "unknown")
        self.elem_bytes, self.token_bytes = c.elem_bytes, c.token_bytes
        self.kv_block_bytes, self.data_bytes = c.kv_block_bytes, c.data_bytes
        self.scale_bytes, self.block_bytes = c.scale_bytes, c.block_bytes
        return self

    def __eq__(self, other):
        return isinstance(other, Layout) and all(
            getattr(self, f) == getattr(other, f) for f in self.__slots__[:6])

    def __repr__(self):
        return ("Layout(layers=%d, kv_heads=%d, head_dim=%d, tokens_per_block=%d, dtype=%r, "
                "arrangement=%r)" % (self.layers, self.kv_heads, self.head_dim,
                                     self.tokens_per_block, self.dtype, self.arrangement))


# ---- Hashes and blocks --------------------------------------------------------------------


class Hashes:
    """n block hashes (kv_hash128) in a ctypes buffer. .numpy() is a zero-copy HASH_DTYPE
    view; h[i] is (lo, hi); h[a:b] a Hashes sharing the buffer."""

    __slots__ = ("_buf", "_addr", "n", "_cvp")

    def __init__(self, n, buf=None, addr=None):
        if buf is None:
            buf = (KvHash128 * max(int(n), 1))()
            addr = ctypes.addressof(buf)
        self._buf, self._addr, self.n, self._cvp = buf, addr, int(n), None

    def _cv(self):
        if self._cvp is None:
            self._cvp = c_void_p(self._addr)
        return self._cvp

    @classmethod
    def from_numpy(cls, arr):
        """Hashes copied from a HASH_DTYPE array (or uint64 [n, 2] of lo, hi)."""
        a = np.ascontiguousarray(arr)
        if a.dtype != HASH_DTYPE:
            a = np.ascontiguousarray(a, dtype=np.uint64).reshape(-1, 2)
        h = cls(len(a))
        ctypes.memmove(h._addr, a.ctypes.data, len(a) * _HASH_SIZE)
        return h

    def numpy(self):
        return np.frombuffer((ctypes.c_char * (self.n * _HASH_SIZE)).from_address(self._addr),
                             dtype=HASH_DTYPE) if self.n else np.empty(0, HASH_DTYPE)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            a, b, step = i.indices(self.n)
            if step != 1:
                raise ValueError("Hashes slices must be contiguous")
            return Hashes(max(b - a, 0), self._buf, self._addr + a * _HASH_SIZE)
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        h = KvHash128.from_address(self._addr + i * _HASH_SIZE)
        return (h.lo, h.hi)

    def hex(self, i):
        """Hash i as docs/HASH.md prints it (32 hex digits, digest bytes in order)."""
        lo, hi = self[i]
        return (lo.to_bytes(8, "little") + hi.to_bytes(8, "little")).hex()

    def __repr__(self):
        return "<kvclient.Hashes %d>" % self.n


class Blocks:
    """n block handles (kvc_block) of one pool in a ctypes buffer. .ids is a zero-copy uint32
    view of their ids, .numpy() a BLOCK_DTYPE view; b[i] is (id, gen); b[a:b] shares the
    buffer. The pool they belong to is .pool (None for blocks of several pools)."""

    __slots__ = ("_buf", "_addr", "n", "cap", "pool", "_cvp")

    def __init__(self, cap, pool=None, buf=None, addr=None, n=0):
        if buf is None:
            buf = (KvcBlock * max(int(cap), 1))()
            addr = ctypes.addressof(buf)
        self._buf, self._addr, self.cap, self.n, self.pool = buf, addr, int(cap), int(n), pool
        self._cvp = None

    def _cv(self):
        if self._cvp is None:
            self._cvp = c_void_p(self._addr)
        return self._cvp

    @classmethod
    def from_numpy(cls, arr, pool=None):
        """Blocks copied from a BLOCK_DTYPE array (or uint32 [n, 2] of id, gen)."""
        a = np.ascontiguousarray(arr)
        if a.dtype != BLOCK_DTYPE:
            a = np.ascontiguousarray(a, dtype=np.uint32).reshape(-1, 2)
        b = cls(len(a), pool, n=len(a))
        ctypes.memmove(b._addr, a.ctypes.data, len(a) * _BLOCK_SIZE)
        return b

    @classmethod
    def of(cls, handles, pool=None):
        """Blocks from (id, gen) pairs."""
        handles = list(handles)
        b = cls(len(handles), pool, n=len(handles))
        for i, (bid, gen) in enumerate(handles):
            b._buf[i].id, b._buf[i].gen = bid, gen
        return b

    def numpy(self):
        return np.frombuffer((ctypes.c_char * (self.n * _BLOCK_SIZE)).from_address(self._addr),
                             dtype=BLOCK_DTYPE) if self.n else np.empty(0, BLOCK_DTYPE)

    @property
    def ids(self):
        return self.numpy()["id"]

    def __len__(self):
        return self.n

    def __iter__(self):
        for i in range(self.n):
            yield self[i]

    def __getitem__(self, i):
        if isinstance(i, slice):
            a, b, step = i.indices(self.n)
            if step != 1:
                raise ValueError("Blocks slices must be contiguous")
            m = max(b - a, 0)
            return Blocks(m, self.pool, self._buf, self._addr + a * _BLOCK_SIZE, m)
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        b = KvcBlock.from_address(self._addr + i * _BLOCK_SIZE)
        return (b.id, b.gen)

    def __repr__(self):
        return "<kvclient.Blocks %s>" % ([b for b in self][:8] + (["..."] if self.n > 8 else []))


def _blocks_arg(blocks):
    """(address, n) of blocks given as Blocks, a BLOCK_DTYPE array or (id, gen) pairs."""
    if isinstance(blocks, Blocks):
        return blocks._addr, blocks.n, blocks
    if isinstance(blocks, np.ndarray):
        b = Blocks.from_numpy(blocks)
    else:
        b = Blocks.of(blocks)
    return b._addr, b.n, b


def _commit_extras(n, tpb, digests, parent_digest, tokens):
    """kvc_commit_ex's extra arguments for n blocks of tpb tokens, checked: (digests buffer,
    parent digest buffer, token pointer, what keeps the tokens alive); None where not given."""
    full = pfull = tok = keep = None
    if digests is not None:
        if len(digests) != n or any(len(d) != 32 for d in digests):
            raise ValueError("digests: one 32-byte digest per block")
        full = ctypes.create_string_buffer(b"".join(digests), 32 * max(n, 1))
    if parent_digest is not None:
        if len(parent_digest) != 32:
            raise ValueError("parent_digest has 32 bytes")
        pfull = ctypes.create_string_buffer(bytes(parent_digest), 32)
    if tokens is not None:
        tok, tn, keep = _u32_tokens(tokens)
        if tn != n * tpb:
            raise ValueError("tokens: %d ids for %d blocks of %d" % (tn, n, tpb))
    return full, pfull, tok, keep


def _hashes_arg(hashes):
    if isinstance(hashes, Hashes):
        return hashes
    return Hashes.from_numpy(hashes)


# ---- Pool ---------------------------------------------------------------------------------


class _PoolState:
    """What a pool and everything made from it share: whether the Python pool is detached
    (views check it), and the live sequences (released at detach)."""

    __slots__ = ("detached", "seqs")

    def __init__(self):
        self.detached = False
        self.seqs = weakref.WeakSet()


class _Mapping:
    """Owns the C pool (kvc_pool *, with its mappings): kvc_pool_detach runs when the last
    object holding this one is gone: the Pool until detach(), every view, numpy array,
    DLPack capsule and Sequence made from it. Holds the connection handle, so the connection
    stays open as long as a mapping needs it."""

    __slots__ = ("handle", "ptr", "_fin", "__weakref__")

    def __init__(self, handle, ptr):
        self.handle, self.ptr = handle, ptr
        self._fin = weakref.finalize(self, handle.free_later, lib.kvc_pool_detach, ptr)


class Pool:
    """An attached pool (or one of its linked pools): the block calls, hashing, and views of
    its memory. Made by Connection.attach; linked pools come from .linked."""

    def __init__(self, conn, mapping, state, ptr, owner=None):
        self._conn, self._mapping, self._state, self._ptr = conn, mapping, state, ptr
        self._cvp = c_void_p(ptr)  # for the lean batch loops (no argument conversion)
        self._h = mapping.handle
        self.owner = owner if owner is not None else self
        self.id = lib.kvc_pool_id(ptr)
        self.layout = Layout._from_c(lib.kvc_pool_layout(ptr).contents)
        self.blocks_per_segment = lib.kvc_pool_blocks_per_segment(ptr)
        self.max_segments = lib.kvc_pool_max_segments(ptr)
        self.max_blocks = lib.kvc_pool_max_blocks(ptr)
        self.layout_conflict = bool(lib.kvc_pool_layout_conflict(ptr))
        self.read_only = bool(lib.kvc_pool_read_only(ptr))
        self.domain = (lib.kvc_pool_domain(ptr) or b"").decode()
        self.hash_algo = lib.kvc_pool_hash_algo(ptr)
        seed = lib.kvc_pool_hash_seed(ptr)
        self.hash_seed = (seed.lo, seed.hi)
        dev = lib.kvc_pool_device(ptr)  # -1: host memory, else the CUDA device ordinal
        self.is_device = dev >= 0
        self._device_id = dev if dev >= 0 else None
        self._layer_views = {}  # (layer, kv) -> (nblocks, ndarray)
        self._linked = None
        self._tpb = self.layout.tokens_per_block
        self._views = None

    # -- state

    def _p(self):
        if self._state.detached:
            raise KvdDetached()
        return self._ptr

    def _pcv(self):
        if self._state.detached:
            raise KvdDetached()
        return self._cvp

    @property
    def detached(self):
        return self._state.detached

    def detach(self):
        """Ends the pool in Python: its calls, its linked pools' and its views' methods raise
        KvdDetached from now on and its sequences are released. The C pool is detached (kvd
        releases every reference the session holds in it, the memory is unmapped) once no view,
        numpy array, DLPack capsule or Sequence of it is left; arrays made before stay readable
        until then. A linked pool's detach() does nothing (its owner's detaches it).
        Idempotent."""
        if self.owner is not self or self._state.detached:
            return
        for s in list(self._state.seqs):
            s._release_quiet()
        for s in list(self._state.seqs):
            s._mapping = None  # a released sequence needs no mapping (C: an empty shell)
        self._state.detached = True
        self._mapping = self._h = None
        self._layer_views = {}
        _reap()
        if self._linked:
            for lp in self._linked:
                lp._mapping = lp._h = None
                lp._layer_views = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.detach()

    @property
    def segments(self):
        """Segment slots mapped so far."""
        return lib.kvc_pool_segments(self._p())

    @property
    def mapped_blocks(self):
        """Blocks addressable now: segments * blocks_per_segment."""
        return lib.kvc_pool_segments(self._p()) * self.blocks_per_segment

    @property
    def stale(self):
        """True once the session the pool was attached in has ended (detach, attach again)."""
        return bool(lib.kvc_pool_stale(self._p()))

    @property
    def linked(self):
        """The linked pools (groups, then the commons), as Pool objects."""
        p = self._p()
        if self._linked is None:
            self._linked = [Pool(self._conn, self._mapping, self._state,
                                 lib.kvc_pool_linked(p, i), owner=self)
                            for i in range(lib.kvc_pool_nlinked(p))]
        return list(self._linked)

    def find(self, pool_id):
        """The pool with daemon id pool_id among the owner and its linked pools, or None."""
        for q in [self.owner] + self.owner.linked:
            if q.id == pool_id:
                return q
        return None

    def _by_ptr(self, ptr):
        for q in [self.owner] + self.owner.linked:
            if q._ptr == ptr:
                return q
        return None

    def block_read_only(self, block_id):
        return bool(lib.kvc_pool_block_read_only(self._p(), int(block_id)))

    # -- hashing

    def hash_tokens(self, tokens, extra=None, out=None):
        """Hashes the full blocks of tokens with the pool's seed: a Hashes of
        len(tokens) // tokens_per_block. extra (bytes) is mixed into every block."""
        p = self._p()
        ptr, n, keep = _u32_tokens(tokens)
        nfull = n // self._tpb
        if out is None:
            out = Hashes(nfull)
        nout = c_size_t()
        e, elen = _raw(extra)
        rc = lib.kvc_pool_hash_tokens(p, e, elen, ptr, n, out._addr, out.n, byref(nout))
        if rc:
            raise_for(rc, "hash_tokens")
        out.n = nout.value
        return out

    def hash_next(self, parent, tokens, extra=None):
        """The hash of one more block (tokens_per_block tokens) after parent ((lo, hi); the
        pool's hash_seed for the first)."""
        p = self._p()
        ptr, n, keep = _u32_tokens(tokens)
        if n != self._tpb:
            raise ValueError("hash_next takes one block of %d tokens, not %d" % (self._tpb, n))
        e, elen = _raw(extra)
        out = KvHash128()
        rc = lib.kvc_pool_hash_next(p, KvHash128(*parent), e, elen, ptr, byref(out))
        if rc:
            raise_for(rc, "hash_next")
        return (out.lo, out.hi)

    # -- vLLM's sha256_cbor hashes (a daemon with hash-mode vllm: hash_algo 3, docs/HASH.md)

    def vllm_none_hash(self):
        """vLLM's NONE_HASH (32 bytes), the parent of a chain's first block."""
        out = ctypes.create_string_buffer(32)
        rc = lib.kvc_pool_vllm_none_hash(self._p(), out)
        if rc:
            raise_for(rc, "vllm_none_hash")
        return out.raw

    def vllm_hash_tokens(self, tokens, extra=None):
        """The 32-byte vLLM digests of the full blocks of tokens (a list of bytes); hash_tokens
        gives their keys (the first 16 bytes). extra: one text key (a LoRA name, a cache salt)."""
        p = self._p()
        ptr, n, keep = _u32_tokens(tokens)
        nfull = n // self._tpb
        out = ctypes.create_string_buffer(32 * max(nfull, 1))
        nout = c_size_t()
        e, elen = _raw(extra)
        rc = lib.kvc_pool_vllm_hash_tokens(p, e, elen, ptr, n, out, nfull, byref(nout))
        if rc:
            raise_for(rc, "vllm_hash_tokens")
        return [out.raw[32 * i:32 * i + 32] for i in range(nout.value)]

    def vllm_hash_next(self, parent, tokens, extra=None):
        """The vLLM digest of one more block after parent (32 bytes; None for the first)."""
        p = self._p()
        ptr, n, keep = _u32_tokens(tokens)
        if n != self._tpb:
            raise ValueError("vllm_hash_next takes one block of %d tokens, not %d"
                             % (self._tpb, n))
        if parent is not None and len(parent) != 32:
            raise ValueError("a vLLM digest has 32 bytes, not %d" % len(parent))
        e, elen = _raw(extra)
        out = ctypes.create_string_buffer(32)
        rc = lib.kvc_pool_vllm_hash_next(p, parent, e, elen, ptr, out)
        if rc:
            raise_for(rc, "vllm_hash_next")
        return out.raw

    # -- synchronous block calls (one round trip each)

    def lookup(self, hashes, out=None):
        """The longest cached prefix of hashes: Blocks of the hits, each referenced by this
        session (release them). out: a Blocks with room for len(hashes) to reuse."""
        p = self._p()
        if not isinstance(hashes, Hashes):
            hashes = _hashes_arg(hashes)
        n = hashes.n
        if out is None:
            out = Blocks(n, self)
        elif out.cap < n:
            raise ValueError("out has room for %d blocks, lookup of %d" % (out.cap, n))
        nhit = c_size_t()
        h = self._h
        with h.lock:
            rc = lib.kvc_lookup(p, hashes._addr, n, out._addr, byref(nhit))
            if h.deferred:
                h.exit_call()
        if rc:
            raise_for(rc, "lookup")
        out.n = nhit.value
        out.pool = self
        return out

    def lookup_tiers(self, hashes):
        """kvc_lookup_tiers: lookup() plus how far the prefix continues below T0. Returns
        (Blocks, {"fetchable": n, "t1": n, "t2": n})."""
        out, tiers, _ = self._lookup_below(hashes, remote=False)
        return out, tiers

    def lookup_remote(self, hashes):
        """kvc_lookup_remote: lookup_tiers() plus how far the prefix goes on in the daemon's
        remote tier (the call waits for Redis). Returns (Blocks, tiers, {"blocks": n,
        "failure": an error name, or None when Redis answered})."""
        out, tiers, rh = self._lookup_below(hashes, remote=True)
        failure = error_class(rh.failure).__name__ if rh.failure else None
        return out, tiers, {"blocks": rh.blocks, "failure": failure}

    def _lookup_below(self, hashes, remote):
        p = self._p()
        hashes = _hashes_arg(hashes) if not isinstance(hashes, Hashes) else hashes
        n = hashes.n
        out = Blocks(n, self)
        nhit = c_size_t()
        th = _lib.KvcTierHits()
        rh = _lib.KvcRemoteHits()
        h = self._h
        with h.lock:
            if remote:
                rc = lib.kvc_lookup_remote(p, hashes._addr, n, out._addr, byref(nhit), byref(th),
                                           byref(rh))
            else:
                rc = lib.kvc_lookup_tiers(p, hashes._addr, n, out._addr, byref(nhit), byref(th))
            if h.deferred:
                h.exit_call()
        if rc:
            raise_for(rc, "lookup_remote" if remote else "lookup_tiers")
        out.n = nhit.value
        out.pool = self
        return out, {"fetchable": th.fetchable, "t1": th.t1, "t2": th.t2}, rh

    def fetch(self, hashes, min_tokens=0):
        """kvc_fetch: the prefix in T0 after bringing its blocks up from the lower tiers (when
        their run reaches min_tokens; 0: the daemon's fetch-min-tokens). Returns (Blocks, info)
        with info's keys t0_hits, promoted, lower_run, status ("done", "short", "partial") and
        failure (an error name, or None)."""
        p = self._p()
        hashes = _hashes_arg(hashes) if not isinstance(hashes, Hashes) else hashes
        n = hashes.n
        out = Blocks(n, self)
        fr = _lib.KvcFetchResult()
        h = self._h
        with h.lock:
            rc = lib.kvc_fetch(p, hashes._addr, n, min_tokens, out._addr, byref(fr))
            if h.deferred:
                h.exit_call()
        if rc:
            raise_for(rc, "fetch")
        out.n = fr.nblocks
        out.pool = self
        return out, _fetch_info(fr)

    def lookup_domains(self, hashes):
        """kvc_lookup_domains: the longest prefix over this pool, its groups and the commons.
        Returns (Blocks, pools): pools[i] is the Pool block i lives in; release with
        release_multi(pools, blocks)."""
        p = self._p()
        hashes = _hashes_arg(hashes)
        n = hashes.n
        out = Blocks(n)
        pools = (c_void_p * max(n, 1))()
        nhit = c_size_t()
        h = self._h
        with h.lock:
            rc = lib.kvc_lookup_domains(p, hashes._addr, n, out._addr, pools, byref(nhit))
            h.exit_call()
        if rc:
            raise_for(rc, "lookup_domains")
        out.n = nhit.value
        where = [self._by_ptr(pools[i]) for i in range(out.n)]
        if len(set(map(id, where))) == 1 and where:
            out.pool = where[0]
        return out, where

    def _allocate(self, fn, name, count):
        p = self._p()
        out = Blocks(count, self)
        h = self._h
        with h.lock:
            rc = fn(p, int(count), out._addr)
            h.exit_call()
        if rc:
            raise_for(rc, name)
        out.n = int(count)
        return out

    def allocate(self, count):
        """Leases count WRITING blocks (all or none; KvdNoSpace when the pool cannot)."""
        return self._allocate(lib.kvc_allocate, "allocate", count)

    def allocate_private(self, count):
        """Leases count private blocks: WRITING blocks that can never be committed (compressed
        KV, docs/ZIPAGE.md); released like any lease."""
        return self._allocate(lib.kvc_allocate_private, "allocate_private", count)

    def unshare(self, blocks):
        """Turns committed blocks this session alone holds back into private ones it may write
        (KvdBusy when anyone else could read one: copy it into a fresh block instead)."""
        self._refcall(lib.kvc_unshare, "unshare", blocks)

    def summaries(self, hashes):
        """Page summaries (a pool attached with summaries=True) of the blocks of hashes, in T0
        or a lower tier: (array [n][layers][kv_heads][3][head_dim] float32 of per-channel key
        min, max and mean, found [n] bool). Rows of hashes not found are zeros."""
        p = self._p()
        hashes = _hashes_arg(hashes)
        n = hashes.n
        lay = self.layout
        out = np.zeros((max(n, 1), lay.layers, lay.kv_heads, 3, lay.head_dim), np.float32)
        found = np.zeros(max(n, 1), np.uint8)
        h = self._h
        with h.lock:
            rc = lib.kvc_summaries(p, hashes._addr, n, out.ctypes.data, found.ctypes.data)
            if h.deferred:
                h.exit_call()
        if rc:
            raise_for(rc, "summaries")
        return out[:n], found[:n].astype(bool)

    def commit(self, blocks, hashes, parent=NO_PARENT, parents=None, digests=None,
               parent_digest=None, tokens=None):
        """Commits written, full blocks with their chain hashes: each becomes immutable and
        indexed. parents: one parent id per block; default: a chain (block i's parent is
        block i-1, the first one's `parent`). Returns the canonical Blocks: the same ones, or
        already cached blocks with the same hashes (use those from now on).
        For the daemon's KV events (kvc_commit_ex, docs/EVENTS.md): digests, the blocks' 32-byte
        vLLM digests (required by a hash-mode vllm daemon); parent_digest, the first block's
        parent digest when that block is in another pool; tokens, the blocks' token ids
        (len(blocks) * tokens_per_block), which BlockStored carries where the operator opted
        in."""
        p = self._p()
        addr, n, keep = _blocks_arg(blocks)
        hashes = _hashes_arg(hashes)
        if hashes.n != n:
            raise ValueError("commit of %d blocks with %d hashes" % (n, hashes.n))
        entries = (KvcCommitEntry * max(n, 1))()
        src_b = (KvcBlock * max(n, 1)).from_address(addr)
        src_h = (KvHash128 * max(n, 1)).from_address(hashes._addr)
        for i in range(n):
            e = entries[i]
            e.block = src_b[i]
            e.hash = src_h[i]
            if parents is not None:
                e.parent = int(parents[i])
            else:
                e.parent = int(parent) if i == 0 else src_b[i - 1].id
        canon = Blocks(n, self)
        full, pfull, tok, tkeep = _commit_extras(n, self._tpb, digests, parent_digest, tokens)
        h = self._h
        with h.lock:
            if full is None and pfull is None and tok is None:
                rc = lib.kvc_commit(p, entries, n, canon._addr)
            else:
                rc = lib.kvc_commit_ex(p, entries, n, full, pfull, tok, canon._addr)
            h.exit_call()
        if rc:
            raise_for(rc, "commit")
        canon.n = n
        return canon

    def _refcall(self, fn, name, blocks, *extra):
        p = self._p()
        addr, n, keep = _blocks_arg(blocks)
        h = self._h
        with h.lock:
            rc = fn(p, addr, n, *extra)
            if h.deferred:
                h.exit_call()
        if rc:
            raise_for(rc, name)

    def release(self, blocks, deferred=False):
        """Drops the session's references on blocks (WRITING ones are freed). Never write into
        a block after releasing it. deferred=True queues the Release to go out ahead of the
        connection's next call, with no round trip of its own (kvc_release_deferred; refusals
        come back from Connection.flush)."""
        fn = lib.kvc_release_deferred if deferred else lib.kvc_release
        self._refcall(fn, "release", blocks)

    def rewind(self, blocks):
        """Release of blocks past a sequence's accepted length (counted apart: pool.rewinds)."""
        self._refcall(lib.kvc_rewind, "rewind", blocks)

    def pin(self, blocks, retention_ms=0, priority=0, unpin=False):
        """Pins committed blocks against eviction for retention_ms (priority 0..255), or
        unpins them."""
        self._refcall(lib.kvc_pin, "pin", blocks, int(retention_ms), int(priority),
                      1 if unpin else 0)

    def copy_blocks(self, src, dst):
        """Copies every byte of blocks src[i] to dst[i] (host pools; KvdNotSupported on GPU)."""
        p = self._p()
        s = np.ascontiguousarray(src, dtype=np.int32)
        d = np.ascontiguousarray(dst, dtype=np.int32)
        if s.shape != d.shape:
            raise ValueError("copy_blocks: src and dst differ in length")
        rc = lib.kvc_pool_copy_blocks(p, s.ctypes.data, d.ctypes.data, s.size)
        if rc:
            raise_for(rc, "copy_blocks")

    # -- sequences

    def sequence(self, max_tokens, extra=None, search_domains=False):
        """A new Sequence on this pool holding up to max_tokens tokens (kvc_seq_alloc); extra
        (bytes, e.g. a LoRA id) is mixed into every block hash."""
        return Sequence(self, max_tokens, extra, search_domains)

    # -- views (kvclient.views)

    def block_view(self, block, layer, kv):
        """A KVView of block's K (kv=0) or V (kv=1) of layer: [tokens_per_block, kv_heads,
        head_dim], zero-copy."""
        from .views import block_view
        return block_view(self, block, layer, kv)

    def layer_view(self, layer, kv):
        """LAYER_MAJOR pools: a KVView of layer's whole K or V tensor over the blocks mapped
        now: [mapped_blocks, tokens_per_block, kv_heads, head_dim], zero-copy."""
        from .views import layer_view
        return layer_view(self, layer, kv)

    def scales_view(self, block, layer, kv):
        """8-bit dtypes: a KVView of the float32 scales [kv_heads] of (block, layer, K|V)."""
        from .views import scales_view
        return scales_view(self, block, layer, kv)

    def k(self, block, layer):
        """numpy array of block's K in layer (zero-copy; see block_view)."""
        return self.block_view(block, layer, K).numpy()

    def v(self, block, layer):
        """numpy array of block's V in layer (zero-copy; see block_view)."""
        return self.block_view(block, layer, V).numpy()

    def scales(self, block, layer, kv):
        """numpy float32 array of the scales of (block, layer, K|V) (zero-copy)."""
        return self.scales_view(block, layer, kv).numpy()

    def layer(self, layer, kv):
        """numpy array of layer's K or V tensor over the mapped blocks (zero-copy)."""
        return self.layer_view(layer, kv).numpy()

    def __repr__(self):
        return "<kvclient.Pool %s%s %r %s>" % (
            "" if not self._state.detached else "detached ",
            getattr(self, "id", "?"), getattr(self, "domain", ""), getattr(self, "layout", ""))


def _block_id(block):
    if isinstance(block, (tuple, list)):
        return int(block[0])
    if isinstance(block, KvcBlock):
        return block.id
    return int(block)


# ---- multi-pool reference calls -----------------------------------------------------------


def _multi(fn, name, pools, blocks, *extra):
    pools = list(pools)
    addr, n, keep = _blocks_arg(blocks)
    if len(pools) != n:
        raise ValueError("%s: %d pools for %d blocks" % (name, len(pools), n))
    if n == 0:
        return
    ptrs = (c_void_p * n)(*[q._p() for q in pools])
    h = pools[0]._h
    with h.lock:
        rc = fn(ptrs, addr, n, *extra)
        h.exit_call()
    if rc:
        raise_for(rc, name)


def release_multi(pools, blocks):
    """Release of blocks[i] in pools[i] (pools of one connection), one round trip."""
    _multi(lib.kvc_release_multi, "release_multi", pools, blocks)


def rewind_multi(pools, blocks):
    _multi(lib.kvc_rewind_multi, "rewind_multi", pools, blocks)


def pin_multi(pools, blocks, retention_ms=0, priority=0, unpin=False):
    _multi(lib.kvc_pin_multi, "pin_multi", pools, blocks, int(retention_ms), int(priority),
           1 if unpin else 0)


__all__ += ["release_multi", "rewind_multi", "pin_multi"]


_INDEX_OBJS = []
_UNSET = (1 << 64) - 1  # a hit count no reply writes (SIZE_MAX)


def _indices(n):
    """c_size_t objects 0..n-1 (kept: the lean loops pass them without conversion)."""
    while len(_INDEX_OBJS) < n:
        _INDEX_OBJS.append(c_size_t(len(_INDEX_OBJS)))
    return _INDEX_OBJS[:n]


# ---- Batch --------------------------------------------------------------------------------


def _fetch_info(fr):
    """A kvc_fetch_result as Pool.fetch's info dict."""
    status = {_lib.FETCH_DONE: "done", _lib.FETCH_SHORT: "short",
              _lib.FETCH_PARTIAL: "partial"}.get(fr.status, str(fr.status))
    failure = error_class(fr.failure).__name__ if fr.failure else None
    return {"t0_hits": fr.t0_hits, "promoted": fr.promoted, "lower_run": fr.lower_run,
            "status": status, "failure": failure}


class BatchRequest:
    """One queued request of a Batch: .index, and after wait() .status (kv_err),
    .error (the KvdError or None) and .result() (its output, raising its error)."""

    __slots__ = ("batch", "index", "kind", "out", "nhit", "pools", "pool", "_keep")

    def __init__(self, batch, kind, out=None, nhit=None, pool=None, keep=None):
        self.batch, self.kind, self.out, self.nhit, self.pool = batch, kind, out, nhit, pool
        self._keep = keep
        self.index = None
        self.pools = None

    @property
    def status(self):
        return lib.kvc_batch_status(self.batch._ptr, self.index)

    @property
    def error(self):
        st = lib.kvc_batch_status(self.batch._ptr, self.index)
        if st == 0:
            return None
        return error_class(st)(st, None, "batch " + self.kind)

    def result(self):
        """lookup: the hit Blocks; allocate/commit: the Blocks; others: None. Raises the
        request's own error."""
        st = lib.kvc_batch_status(self.batch._ptr, self.index)
        if st:
            raise error_class(st)(st, None, "batch " + self.kind)
        if self.kind == "fetch":
            fr = self.nhit
            self.out.n = fr.nblocks
            return self.out, _fetch_info(fr)
        if self.kind in ("lookup", "lookup_domains"):
            self.out.n = self.nhit.value
            if self.kind == "lookup_domains":
                return self.out, [self.pool._by_ptr(self.pools[i]) for i in range(self.out.n)]
            return self.out
        return self.out


class Batch:
    """Pipelined requests on one connection (kvc_batch): queue with lookup/allocate/commit/
    release/rewind/ping (each returns a BatchRequest), then run() (or send() ... wait()), then
    read each request's result(). Buffers given when queuing stay referenced by the request.
    reset() forgets the queue. While a batch is sent and not waited for, no other call may use
    the connection (libkvclient's rule; garbage-collector frees wait for the batch)."""

    def __init__(self, conn):
        self._h = conn._handle()
        out = c_void_p()
        rc = lib.kvc_batch_alloc(self._h.ptr, byref(out))
        if rc:
            raise_for(rc, "batch")
        self._ptr = out.value
        self._cv = c_void_p(out.value)
        self._fin = weakref.finalize(self, self._h.free_batch, out.value)
        self._reqs = []
        self._fixups = []  # (outs, c_size_t array of their hit counts) of lookup_many
        self._idx = c_size_t()

    def _queued(self, rc, req, name):
        if rc:
            raise_for(rc, "batch " + name)
        req.index = self._idx.value
        self._reqs.append(req)
        return req

    def ping(self, payload=b""):
        data, n = _raw(payload)
        req = BatchRequest(self, "ping", keep=data)
        return self._queued(lib.kvc_batch_ping(self._ptr, data, n, byref(self._idx)), req, "ping")

    def lookup(self, pool, hashes, out=None):
        """Queues a lookup of hashes in pool; result(): the hit Blocks (out if given)."""
        p = pool._p()
        if not isinstance(hashes, Hashes):
            hashes = _hashes_arg(hashes)
        n = hashes.n
        if out is None:
            out = Blocks(n, pool)
        elif out.cap < n:
            raise ValueError("out has room for %d blocks, lookup of %d" % (out.cap, n))
        nhit = c_size_t()
        req = BatchRequest(self, "lookup", out, nhit, pool, hashes)
        rc = lib.kvc_batch_lookup(self._ptr, p, hashes._addr, n, out._addr,
                                  ctypes.addressof(nhit), ctypes.addressof(self._idx))
        if rc:
            raise_for(rc, "batch lookup")
        req.index = self._idx.value
        self._reqs.append(req)
        return req

    def fetch(self, pool, hashes, min_tokens=0):
        """Queues a fetch (kvc_batch_fetch); result(): (Blocks, info) as Pool.fetch. Its reply
        may come after later requests' replies; wait() collects them all."""
        p = pool._p()
        hashes = _hashes_arg(hashes) if not isinstance(hashes, Hashes) else hashes
        n = hashes.n
        out = Blocks(n, pool)
        fr = _lib.KvcFetchResult()
        req = BatchRequest(self, "fetch", out, fr, pool, hashes)
        rc = lib.kvc_batch_fetch(self._ptr, p, hashes._addr, n, min_tokens, out._addr, byref(fr),
                                 ctypes.addressof(self._idx))
        return self._queued(rc, req, "fetch")

    def lookup_many(self, pool, hashes, outs):
        """Queues one lookup per Blocks in outs, of hashes (one Hashes for all, or a list of
        one per out). The lean path for many requests: one C call for all of them
        (kvc_batch_lookup_many), no BatchRequest objects; returns the range of their indices;
        after run()/wait() each out holds its hits (none when its request failed: check()
        raises the first failure). All or none are queued."""
        pcv = pool._pcv()
        n = len(outs)
        if isinstance(hashes, Hashes):
            if n and min(o.cap for o in outs) < hashes.n:
                raise ValueError("an out has less room than the %d hashes" % hashes.n)
            hp = (c_void_p * max(n, 1))(*([hashes._addr] * n))
            ns = (c_size_t * max(n, 1))(*([hashes.n] * n))
        else:
            if len(hashes) != n:
                raise ValueError("lookup_many: %d hash lists for %d outputs" % (len(hashes), n))
            for h, o in zip(hashes, outs):
                if o.cap < h.n:
                    raise ValueError("out has room for %d blocks, lookup of %d" % (o.cap, h.n))
            hp = (c_void_p * max(n, 1))(*[h._addr for h in hashes])
            ns = (c_size_t * max(n, 1))(*[h.n for h in hashes])
        # Hit counts start at a value no reply writes: outputs are written only on success,
        # so check() finds failed lookups without asking each request's status.
        nh = (c_size_t * max(n, 1))(*([_UNSET] * max(n, 1)))
        op = (c_void_p * max(n, 1))(*[o._addr for o in outs])
        first = c_size_t(0)
        rc = lib.kvc_batch_lookup_many(self._cv, pcv, hp, ns, op, nh, n, byref(first))
        if rc:
            raise_for(rc, "batch lookup")
        for o in outs:
            o.pool = pool
            o.n = 0
        first = first.value
        self._fixups.append(("lookup", first, outs, nh, (hashes, ns)))
        return range(first, first + n)

    def release_many(self, pool, blocks_list):
        """Queues one release per Blocks in blocks_list (lean, like lookup_many: one C call,
        all or none); returns the range of their indices."""
        pcv = pool._pcv()
        n = len(blocks_list)
        bp = (c_void_p * max(n, 1))(*[b._addr for b in blocks_list])
        ns = (c_size_t * max(n, 1))(*[b.n for b in blocks_list])
        first = c_size_t(0)
        rc = lib.kvc_batch_release_many(self._cv, pcv, bp, ns, n, byref(first))
        if rc:
            raise_for(rc, "batch release")
        first = first.value
        self._fixups.append(("release", first, None, n, (blocks_list,)))
        return range(first, first + n)

    def check(self):
        """After run()/wait(): raises the KvdError of the first request that failed."""
        idx = c_size_t(0)
        rc = lib.kvc_batch_first_error(self._ptr, ctypes.byref(idx))  # one call for all
        if rc:
            raise error_class(rc)(rc, None, "batch request %d" % idx.value)

    def _fix(self):
        for r in self._reqs:
            if r.kind == "fetch":
                r.out.n = r.nhit.nblocks
            elif r.nhit is not None:
                r.out.n = r.nhit.value
        for kind, first, outs, nh, _ in self._fixups:
            if kind == "lookup":
                for o, v in zip(outs, nh):
                    o.n = 0 if v == _UNSET else v

    def lookup_domains(self, pool, hashes):
        p = pool._p()
        hashes = _hashes_arg(hashes)
        n = hashes.n
        out = Blocks(n)
        nhit = c_size_t()
        req = BatchRequest(self, "lookup_domains", out, nhit, pool, hashes)
        req.pools = (c_void_p * max(n, 1))()
        rc = lib.kvc_batch_lookup_domains(self._ptr, p, hashes._addr, n, out._addr, req.pools,
                                          byref(nhit), byref(self._idx))
        return self._queued(rc, req, "lookup_domains")

    def allocate(self, pool, count):
        out = Blocks(count, pool, n=count)
        req = BatchRequest(self, "allocate", out, pool=pool)
        rc = lib.kvc_batch_allocate(self._ptr, pool._p(), int(count), out._addr,
                                    byref(self._idx))
        return self._queued(rc, req, "allocate")

    def commit(self, pool, blocks, hashes, parent=NO_PARENT, digests=None, parent_digest=None,
               tokens=None):
        """Queues a Commit (Pool.commit's arguments; digests, parent_digest and tokens as
        there: kvc_batch_commit_ex)."""
        addr, n, keep = _blocks_arg(blocks)
        hashes = _hashes_arg(hashes)
        if hashes.n != n:
            raise ValueError("commit of %d blocks with %d hashes" % (n, hashes.n))
        entries = (KvcCommitEntry * max(n, 1))()
        src_b = (KvcBlock * max(n, 1)).from_address(addr)
        src_h = (KvHash128 * max(n, 1)).from_address(hashes._addr)
        for i in range(n):
            entries[i].block = src_b[i]
            entries[i].hash = src_h[i]
            entries[i].parent = int(parent) if i == 0 else src_b[i - 1].id
        canon = Blocks(n, pool, n=n)
        req = BatchRequest(self, "commit", canon, pool=pool, keep=(entries, keep))
        if digests is None and parent_digest is None and tokens is None:
            rc = lib.kvc_batch_commit(self._ptr, pool._p(), entries, n, canon._addr,
                                      byref(self._idx))
            return self._queued(rc, req, "commit")
        full, pfull, tok, tkeep = _commit_extras(n, pool.layout.tokens_per_block, digests,
                                                 parent_digest, tokens)
        rc = lib.kvc_batch_commit_ex(self._ptr, pool._p(), entries, n, full, pfull, tok,
                                     canon._addr, byref(self._idx))
        del tkeep  # encoded at once (kvc_batch_commit_ex)
        return self._queued(rc, req, "commit")

    def release(self, pool, blocks):
        addr, n, keep = _blocks_arg(blocks)
        req = BatchRequest(self, "release", pool=pool, keep=keep)
        rc = lib.kvc_batch_release(self._ptr, pool._p(), addr, n, ctypes.addressof(self._idx))
        if rc:
            raise_for(rc, "batch release")
        req.index = self._idx.value
        self._reqs.append(req)
        return req

    def rewind(self, pool, blocks):
        addr, n, keep = _blocks_arg(blocks)
        req = BatchRequest(self, "rewind", pool=pool, keep=keep)
        rc = lib.kvc_batch_rewind(self._ptr, pool._p(), addr, n, byref(self._idx))
        return self._queued(rc, req, "rewind")

    def send(self):
        """Writes every queued request (kvc_batch_send); call wait() before any other call on
        the connection."""
        h = self._h
        with h.lock:
            rc = lib.kvc_batch_send(self._ptr)
            if rc == 0:
                h.batch_inflight = True
                h.inflight = self._ptr
        if rc:
            raise_for(rc, "batch send")

    def wait(self):
        """Collects every reply (kvc_batch_wait). Raises on a transport error; per-request
        errors are in each request's status/result()."""
        h = self._h
        with h.lock:
            rc = lib.kvc_batch_wait(self._ptr)
            h.batch_inflight = False
            h.inflight = None
            h.exit_call()
        if rc:
            raise_for(rc, "batch wait")
        self._fix()

    def run(self):
        """send() then wait()."""
        h = self._h
        with h.lock:
            rc = lib.kvc_batch_run(self._ptr)
            if h.deferred:
                h.exit_call()
        if rc:
            raise_for(rc, "batch run")
        self._fix()

    def reset(self):
        """Forgets every queued request (after wait, or before send)."""
        lib.kvc_batch_reset(self._ptr)
        self._reqs = []
        self._fixups = []

    def __len__(self):
        return lib.kvc_batch_count(self._ptr)

    @property
    def requests(self):
        return list(self._reqs)

    def free(self):
        """Frees the C batch now (else the garbage collector does)."""
        self._fin()


# ---- Sequence -----------------------------------------------------------------------------


def _free_seq(ptr):
    lib.kvc_seq_free(ptr)


class Sequence:
    """A sequence's tokens and block table (kvc_seq): prefill/append/commit/rewind/release,
    reservations and lookahead, fork, and exports. Holds its pool's mapping alive; released
    by Pool.detach(); freed (kvc_seq_free) by free() or the garbage collector."""

    def __init__(self, pool, max_tokens, extra=None, search_domains=False):
        p = pool._p()
        e, elen = _raw(extra)
        out = c_void_p()
        h = pool._h
        rc = lib.kvc_seq_alloc(p, int(max_tokens), e, elen, byref(out))
        if rc:
            raise_for(rc, "sequence")
        self.pool = pool
        self.max_tokens = int(max_tokens)
        self._ptr = out.value
        self._h = h
        self._mapping = pool._mapping
        self._state = pool._state
        self._fin = weakref.finalize(self, h.free_later, _free_seq, out.value)
        pool._state.seqs.add(self)
        if search_domains:
            lib.kvc_seq_set_search_domains(self._ptr, 1)

    def _s(self):
        if self._state.detached:
            raise KvdDetached()
        if not self._fin.alive:
            raise KvdDetached("sequence")
        return self._ptr

    def _call(self, name, fn, *args):
        s = self._s()
        h = self._h
        with h.lock:
            rc = fn(s, *args)
            if h.deferred:
                h.exit_call()
        if rc:
            raise_for(rc, name)

    def set_search_domains(self, on):
        lib.kvc_seq_set_search_domains(self._s(), 1 if on else 0)

    def prefill(self, tokens):
        """Starts the (empty) sequence with a prompt: looks up its cached prefix (at most
        len - 1 tokens) and allocates blocks for the rest. Returns the cached token count."""
        ptr, n, keep = _u32_tokens(tokens)
        cached = c_size_t()
        self._call("prefill", lib.kvc_seq_prefill, ptr, n, byref(cached))
        return cached.value

    def append(self, tokens):
        """Appends tokens (decode or draft), allocating blocks as needed."""
        ptr, n, keep = _u32_tokens(tokens)
        self._call("append", lib.kvc_seq_append, ptr, n)

    def commit(self, n_final=None):
        """Commits every full block inside [0, n_final) (default: the length) whose K/V is
        written and final. Returns the blocks committed by this call."""
        s = self._s()
        if n_final is None:
            n_final = lib.kvc_seq_length(s)
        nc = c_size_t()
        self._call("commit", lib.kvc_seq_commit, int(n_final), byref(nc))
        return nc.value

    def rewind(self, n):
        """Truncates to n tokens. Returns the tokens whose K/V are still in the table: n, or
        the start of a committed block n fell in (recompute from there)."""
        valid = c_size_t()
        self._call("rewind", lib.kvc_seq_rewind, int(n), byref(valid))
        return valid.value

    def release(self):
        """Releases every block; the sequence is empty afterwards (it can be prefilled again)."""
        self._call("release", lib.kvc_seq_release)

    def _release_quiet(self):
        if self._fin.alive:
            try:
                self._call("release", lib.kvc_seq_release)
            except KvdError:
                pass

    def reserve(self, ntokens):
        self._call("reserve", lib.kvc_seq_reserve, int(ntokens))

    def set_lookahead(self, ntokens):
        self._call("set_lookahead", lib.kvc_seq_set_lookahead, int(ntokens))

    @property
    def capacity(self):
        return lib.kvc_seq_capacity(self._s())

    def __len__(self):
        return lib.kvc_seq_length(self._s())

    @property
    def length(self):
        return lib.kvc_seq_length(self._s())

    @property
    def nblocks(self):
        return lib.kvc_seq_nblocks(self._s())

    @property
    def ncommitted(self):
        return lib.kvc_seq_ncommitted(self._s())

    @property
    def promoted(self):
        """Blocks this sequence's prefills got from the daemon's lower tiers."""
        return lib.kvc_seq_promoted(self._s())

    def set_block_budget(self, nblocks):
        """Caps the blocks the sequence holds (0: no cap); growing past it raises
        KvdQuotaExceeded (docs/ZIPAGE.md)."""
        self._call("set_block_budget", lib.kvc_seq_set_block_budget, int(nblocks))

    @property
    def block_budget(self):
        return lib.kvc_seq_block_budget(self._s())

    def compact(self, kept_tokens, fresh):
        """Zipage's compaction: fresh (private Blocks holding the kept tokens' K/V densely,
        ceil(len(kept_tokens) / tokens_per_block) of them) becomes the table and every block
        held before goes back (shared ones are only de-referenced). From then on the sequence
        publishes nothing and its next position is .position."""
        ptr, n, keep = _u32_tokens(kept_tokens)
        addr, nf, keep2 = _blocks_arg(fresh)
        self._call("compact", lib.kvc_seq_compact, ptr, n, addr, nf)

    @property
    def compressed(self):
        return bool(lib.kvc_seq_compressed(self._s()))

    @property
    def position(self):
        """Tokens appended in all: the next token's RoPE position (length + tokens dropped)."""
        return lib.kvc_seq_position(self._s())

    @property
    def mixed(self):
        return bool(lib.kvc_seq_mixed(self._s()))

    def block(self, i):
        """Block i's handle (id, gen); (0xFFFFFFFF, 0) past the held blocks."""
        b = lib.kvc_seq_block(self._s(), int(i))
        return (b.id, b.gen)

    def block_pool(self, i):
        """The Pool block i lives in (None past the held blocks)."""
        ptr = lib.kvc_seq_block_pool(self._s(), int(i))
        return self.pool._by_ptr(ptr) if ptr else None

    def block_ids(self):
        """numpy int32 array of the table's block ids (one export call)."""
        s = self._s()
        nb = lib.kvc_seq_nblocks(s)
        table = np.empty(max(nb, 1), dtype=np.int32)
        used = c_size_t()
        arr = (c_void_p * 1)(s)
        rc = lib.kvc_seq_export_table(arr, 1, table.ctypes.data, max(nb, 1), -1, byref(used))
        if rc:
            raise_for(rc, "block_ids")
        return table[:nb]

    def export_slots(self, start, stop):
        """int64 slots (block id * tokens_per_block + offset) of tokens [start, stop)."""
        s = self._s()
        out = np.empty(max(stop - start, 1), dtype=np.int64)
        rc = lib.kvc_seq_export_slots(s, int(start), int(stop), out.ctypes.data,
                                      max(stop - start, 0))
        if rc:
            raise_for(rc, "export_slots")
        return out[:max(stop - start, 0)]

    def fork(self, max_copies=None):
        """A new Sequence sharing this one's committed blocks, and (src, dst) int32 arrays of
        the blocks to copy before use (pool.copy_blocks(src, dst) on host pools)."""
        s = self._s()
        if max_copies is None:
            max_copies = max(lib.kvc_seq_nblocks(s) - lib.kvc_seq_ncommitted(s), 1)
        src = np.empty(max_copies, dtype=np.int32)
        dst = np.empty(max_copies, dtype=np.int32)
        out = c_void_p()
        n = c_size_t()
        self._call("fork", lib.kvc_seq_fork, byref(out), src.ctypes.data, dst.ctypes.data,
                   int(max_copies), byref(n))
        child = Sequence.__new__(Sequence)
        child.pool, child.max_tokens = self.pool, self.max_tokens
        child._ptr, child._h, child._mapping, child._state = (out.value, self._h,
                                                              self._mapping, self._state)
        child._fin = weakref.finalize(child, self._h.free_later, _free_seq, out.value)
        self._state.seqs.add(child)
        return child, src[:n.value], dst[:n.value]

    def free(self):
        """Releases the blocks (best effort) and frees the C sequence now."""
        self._fin()

    def __repr__(self):
        try:
            return "<kvclient.Sequence %d tokens, %d blocks (%d committed)>" % (
                self.length, self.nblocks, self.ncommitted)
        except KvdError:
            return "<kvclient.Sequence detached>"


def _seq_array(seqs):
    seqs = list(seqs)
    return seqs, (c_void_p * max(len(seqs), 1))(*[s._s() for s in seqs])


def append_many(seqs, tokens):
    """One scheduler step: appends tokens[i] to seqs[i] for every i with one Allocate per pool.
    Returns a list with None for each sequence that grew and its KvdError for one that could
    not (KvdNoSpace: preempt it; KvdTooBig: past max_tokens) and is unchanged."""
    seqs, arr = _seq_array(seqs)
    n = len(seqs)
    if len(tokens) != n:
        raise ValueError("append_many: %d sequences, %d token lists" % (n, len(tokens)))
    if n == 0:
        return []
    keep = [_u32_tokens(t) for t in tokens]
    ptrs = (c_void_p * n)(*[ctypes.cast(k[0], c_void_p).value if not isinstance(k[0], int)
                            else k[0] for k in keep])
    counts = (c_size_t * n)(*[k[1] for k in keep])
    status = (ctypes.c_int * n)()
    h = seqs[0]._h
    with h.lock:
        lib.kvc_seq_append_many(arr, n, ptrs, counts, status)
        h.exit_call()
    return [None if status[i] == 0 else error_class(status[i])(status[i], None, "append_many")
            for i in range(n)]


def _export(name, seqs, pool=None):
    seqs, arr = _seq_array(seqs)
    n = len(seqs)
    total = sum(s.nblocks for s in seqs)
    indptr = np.zeros(n + 1, dtype=np.int32)
    indices = np.zeros(max(total, 1), dtype=np.int32)
    last = np.zeros(max(n, 1), dtype=np.int32)
    nidx = c_size_t()
    if pool is None:
        rc = lib.kvc_seq_export_csr(arr, n, indptr.ctypes.data, n + 1, indices.ctypes.data,
                                    indices.size, last.ctypes.data, last.size, byref(nidx))
    else:
        rc = lib.kvc_seq_export_csr_pool(arr, n, pool._p(), indptr.ctypes.data, n + 1,
                                         indices.ctypes.data, indices.size, last.ctypes.data,
                                         last.size, byref(nidx))
    if rc:
        raise_for(rc, name)
    return indptr, indices[:nidx.value], last[:n]


def export_csr(seqs):
    """FlashInfer's paged-KV CSR form of the sequences' tables: (indptr[n+1], indices,
    last_page_len[n]) as int32 numpy arrays. KvdNotSupported when a table mixes pools."""
    return _export("export_csr", seqs)


def export_csr_pool(seqs, pool):
    """export_csr restricted to the blocks that live in pool (one table per pool)."""
    return _export("export_csr_pool", seqs, pool)


def export_table(seqs, width, pad=-1):
    """The tables as one padded int32 array [n, width]; returns (table, longest row)."""
    seqs, arr = _seq_array(seqs)
    n = len(seqs)
    table = np.empty((max(n, 1), int(width)), dtype=np.int32)
    used = c_size_t()
    rc = lib.kvc_seq_export_table(arr, n, table.ctypes.data, int(width), int(pad), byref(used))
    if rc:
        raise_for(rc, "export_table")
    return table[:n], used.value
