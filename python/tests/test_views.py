"""Zero-copy views: numpy arrays and DLPack capsules over the mapped pool memory, dtypes, and
the lifetime rules (a view keeps the mapping; a detached pool raises, never segfaults)."""

import ctypes
import gc
import os

import numpy as np
import pytest

import kvclient
from kvclient import K, V, views
from kvclient._lib import lib

from conftest import run_python, wait_until

SHAPE = dict(layers=3, kv_heads=2, head_dim=8, tokens_per_block=4)


def _addr(a):
    return a.__array_interface__["data"][0]


def test_block_views_are_the_pool_memory(conn, model_id):
    p = conn.attach(model_id, dtype="fp16", **SHAPE)
    b = p.allocate(3)
    bid = b[1][0]
    for layer in range(3):
        for kv in (K, V):
            a = p.block_view(b[1], layer, kv).numpy()
            assert a.shape == (4, 2, 8) and a.dtype == np.float16 and a.flags.writeable
            # LAYER_MAJOR: through the layer tensor (the segment's pages, mapped in place)
            assert _addr(a) == (lib.kvc_pool_layer_base(p._ptr, layer, kv) +
                                bid * p.layout.kv_block_bytes)
            a[2, 1] = np.arange(8) + 10 * layer + kv
    # the same bytes through the layer tensor and through kvc_pool_addr
    lk = p.layer(2, V)
    assert lk.shape == (p.mapped_blocks, 4, 2, 8)
    assert list(lk[bid, 2, 1]) == list(np.arange(8) + 21)
    for layer in range(3):  # and through the segment mapping (kvc_pool_addr): same pages
        for kv in (K, V):
            raw = (ctypes.c_uint16 * 8).from_address(
                lib.kvc_pool_addr(p._ptr, bid, layer, kv, 2, 1))
            assert list(np.frombuffer(raw, dtype=np.float16)) == list(
                np.arange(8.0) + 10 * layer + kv)
    lk[bid, 0, 0, 0] = 5
    assert p.v(b[1], 2)[0, 0, 0] == 5
    assert np.shares_memory(lk, p.layer(2, V))
    p.release(b)


def test_write_in_one_process_read_in_another(conn, model_id):
    p = conn.attach(model_id, dtype="fp32", **SHAPE)
    toks = list(range(1000, 1012))
    h = p.hash_tokens(toks)
    b = p.allocate(len(h))
    rng = np.random.default_rng(5)
    data = rng.standard_normal((len(h), 3, 2, 4, 2, 8)).astype(np.float32)
    for i in range(len(h)):
        for layer in range(3):
            p.k(b[i], layer)[...] = data[i, layer, K]  # numpy writes straight into the pool
            p.v(b[i], layer)[...] = data[i, layer, V]
    canon = p.commit(b, h)
    p.release(canon)
    out = run_python(r"""
import sys, numpy as np, kvclient
c = kvclient.Connection(sys.argv[1])
p = c.attach(sys.argv[2], layers=3, kv_heads=2, head_dim=8, tokens_per_block=4, dtype="fp32")
hits = p.lookup(p.hash_tokens(list(range(1000, 1012))))
arr = np.stack([np.stack([np.stack([p.k(hits[i], l), p.v(hits[i], l)]) for l in range(3)])
                for i in range(len(hits))])
import io
buf = io.BytesIO()  # np.save straight to a pipe needs a seekable file on some platforms
np.save(buf, arr)
np.save(buf, np.array(hits.ids))
sys.stdout.buffer.write(buf.getvalue())
""", conn_sock(conn), model_id)
    import io
    got = np.load(io.BytesIO(out))
    assert got.shape == (3, 3, 2, 4, 2, 8)
    assert np.array_equal(got, data)  # bit for bit: the other process read our bytes


def conn_sock(conn):
    return conn._sock_for_tests


@pytest.fixture(autouse=True)
def _remember_socket(kvd, monkeypatch):
    monkeypatch.setattr(kvclient.Connection, "_sock_for_tests", kvd.sock, raising=False)


@pytest.mark.parametrize("dtype,np_dtype,dl", [
    ("fp16", np.float16, (2, 16)), ("fp32", np.float32, (2, 32)), ("bf16", np.uint16, (4, 16)),
    ("fp8_e4m3", np.uint8, (1, 8)), ("int8", np.int8, (0, 8))])
def test_dtypes(conn, model_id, dtype, np_dtype, dl):
    p = conn.attach(model_id, dtype=dtype, **SHAPE)
    b = p.allocate(1)
    v = p.block_view(b[0], 1, K)
    assert v.dtype == dtype and v.np_dtype == np.dtype(np_dtype) and v._dl == dl
    a = v.numpy()
    assert a.dtype == np.dtype(np_dtype) and a.shape == (4, 2, 8)
    assert a.nbytes == p.layout.kv_block_bytes
    r = v.raw().numpy()
    assert r.dtype.kind == "u" and r.dtype.itemsize == a.dtype.itemsize and _addr(r) == _addr(a)
    if p.layout.scale_bytes:
        sc = p.scales(b[0], 1, K)
        assert sc.dtype == np.float32 and sc.shape == (2,)
        sc[:] = [0.5, 2.0]
        assert _addr(sc) == lib.kvc_pool_scale_addr(p._ptr, b[0][0], 1, K, 0)
        assert list(p.scales(b[0], 1, K)) == [0.5, 2.0]
    else:
        with pytest.raises(kvclient.KvdNotSupported):
            p.scales(b[0], 1, K)
    p.release(b)


def test_block_major_pools_have_block_views_only(conn, model_id):
    p = conn.attach(model_id, dtype="fp16", arrangement="block_major", **SHAPE)
    b = p.allocate(2)
    a = p.k(b[1], 2)
    a[:] = 3
    assert _addr(a) == lib.kvc_pool_addr(p._ptr, b[1][0], 2, K, 0, 0)
    assert np.all(p.k(b[1], 2) == 3)
    with pytest.raises(kvclient.KvdNotSupported):
        p.layer_view(0, K)
    p.release(b)


def test_view_arguments_are_checked(conn, model_id):
    p = conn.attach(model_id, dtype="fp16", **SHAPE)
    with pytest.raises(kvclient.KvdInvalid):
        p.block_view(0, 3, K)
    with pytest.raises(kvclient.KvdInvalid):
        p.block_view(10 ** 7, 0, K)
    with pytest.raises(kvclient.KvdInvalid):
        p.block_view(0, 0, 2)


class _Recorder:
    """Forwards the DLPack protocol and records what the consumer passed."""

    def __init__(self, view):
        self.view, self.calls = view, []

    def __dlpack__(self, *args, **kw):
        self.calls.append((args, kw))
        return self.view.__dlpack__(*args, **kw)

    def __dlpack_device__(self):
        return self.view.__dlpack_device__()


def test_numpy_from_dlpack_is_zero_copy(conn, model_id):
    p = conn.attach(model_id, dtype="fp32", **SHAPE)
    b = p.allocate(2)
    v = p.block_view(b[1], 2, V)
    v.numpy()[:] = np.arange(64, dtype=np.float32).reshape(4, 2, 8)
    assert v.__dlpack_device__() == (views.DLPACK_DEVICE_CPU, 0)
    rec = _Recorder(v)
    before = views.live_dlpack_tensors()
    a = np.from_dlpack(rec)
    assert rec.calls, "numpy did not call __dlpack__"
    assert a.shape == (4, 2, 8) and a.dtype == np.float32
    assert _addr(a) == v.address and np.array_equal(a, v.numpy())
    v.numpy()[3, 1, 7] = -1  # written through the pool, seen through the DLPack array
    assert a[3, 1, 7] == -1
    assert views.live_dlpack_tensors() == before + 1
    del a
    gc.collect()
    assert views.live_dlpack_tensors() == before  # numpy called our deleter
    # an unconsumed capsule is reaped once nothing references it
    cap = v.__dlpack__()
    assert views.live_dlpack_tensors() == before + 1
    del cap
    assert views.live_dlpack_tensors() == before
    # keyword forms of the newer protocol
    cap = v.__dlpack__(stream=None, max_version=(1, 0), dl_device=(1, 0), copy=False)
    del cap
    with pytest.raises(BufferError):
        v.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        v.__dlpack__(dl_device=(2, 0))
    # bf16 has no numpy type: numpy refuses it, its raw() view is taken
    pb = conn.attach(model_id + "b", dtype="bf16", **SHAPE)
    bb = pb.allocate(1)
    vb = pb.block_view(bb[0], 0, K)
    with pytest.raises((TypeError, BufferError, ValueError, RuntimeError)) as ei:
        np.from_dlpack(vb)
    assert not isinstance(ei.value, SystemError)  # numpy's own error, not lost in a callback
    assert views.live_dlpack_tensors() == before  # the refused capsule was reaped
    r = np.from_dlpack(vb.raw())
    assert r.dtype == np.uint16 and _addr(r) == vb.address
    del r
    pb.release(bb)
    p.release(b)


def test_layer_view_dlpack(conn, model_id):
    p = conn.attach(model_id, dtype="fp16", **SHAPE)
    lv = p.layer_view(1, K)
    a = np.from_dlpack(lv)
    assert a.shape == (p.mapped_blocks, 4, 2, 8) and _addr(a) == lv.address
    assert lv.address == lib.kvc_pool_layer_base(p._ptr, 1, K)


def test_torch_from_dlpack(conn, model_id):
    torch = pytest.importorskip("torch")
    p = conn.attach(model_id, dtype="bf16", **SHAPE)
    b = p.allocate(1)
    t = torch.from_dlpack(p.block_view(b[0], 0, K))
    assert t.dtype == torch.bfloat16 and tuple(t.shape) == (4, 2, 8)
    t.fill_(1.5)
    assert np.all(p.k(b[0], 0) == 0x3FC0)  # bf16 1.5, written by torch into the pool
    del t
    p.release(b)


def _gpu_available():
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    n = ctypes.c_int(0)
    return cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(n)) == 0 and n.value > 0


@pytest.mark.skipif(not _gpu_available(), reason="no CUDA GPU")
def test_gpu_pool_exports_cuda_dlpack(kvd_factory, model_id):
    d = kvd_factory(backend="cuda-vmm")
    with d.connect() as c:
        p = c.attach(model_id, dtype="fp16", **SHAPE)
        assert p.is_device
        v = p.block_view(p.allocate(1)[0], 0, K)
        dev = v.__dlpack_device__()
        assert dev[0] == views.DLPACK_DEVICE_CUDA and dev[1] >= 0
        with pytest.raises(kvclient.KvdNotSupported):
            v.numpy()
        try:
            import torch
        except ImportError:
            cap = v.__dlpack__()
            del cap
            return
        t = torch.from_dlpack(v)
        assert t.is_cuda and t.data_ptr() == v.address


# ---- lifetime ---------------------------------------------------------------------------


def test_detach_with_live_views_defers_the_c_detach(conn, model_id):
    p = conn.attach(model_id, dtype="fp16", **SHAPE)
    b = p.allocate(1)
    v = p.block_view(b[0], 0, K)
    arr = v.numpy()
    arr[:] = 9
    layer = p.layer(0, K)
    cap = v.__dlpack__()
    dl = np.from_dlpack(p.block_view(b[0], 0, V))
    s = p.sequence(16)
    s.prefill([1, 2, 3])
    assert conn.stat("session.pools_attached") == 1
    p.detach()
    for f in (v.numpy, v.__dlpack__, v.__dlpack_device__, v.raw, lambda: v.device,
              lambda: np.asarray(v), lambda: p.layer(0, K), lambda: p.release(b),
              lambda: s.append([4])):
        with pytest.raises(kvclient.KvdDetached):
            f()
    assert s._mapping is None  # detach released the sequence: only b's block is held
    assert conn.stat("session.refs_held") == 1
    # the memory is still mapped: every array made before reads (and writes) fine
    assert np.all(arr == 9) and np.all(layer[b[0][0]] == 9)
    assert float(dl.sum()) == float(dl.sum())
    assert conn.stat("session.pools_attached") == 1  # the C pool lives on
    del v, arr
    assert conn.stat("session.pools_attached") == 1  # layer, cap and dl still hold it
    del layer, cap
    assert conn.stat("session.pools_attached") == 1  # dl holds it through the capsule
    del dl
    # the last reference is gone: kvc_pool_detach ran (no garbage collection needed)
    assert conn.stat("session.pools_attached") == 0
    assert conn.stat("session.refs_held") == 0
    del s


def test_detach_without_views_is_immediate(conn, model_id):
    p = conn.attach(model_id, dtype="fp16", **SHAPE)
    p.allocate(2)
    assert conn.stat("session.refs_held") == 2
    p.detach()
    assert conn.stat("session.pools_attached") == 0 and conn.stat("session.refs_held") == 0
    p.detach()  # idempotent


def test_close_with_live_arrays_keeps_memory_until_the_last(kvd, model_id):
    watcher = kvd.connect()
    c = kvd.connect(client_name="closing")
    p = c.attach(model_id, dtype="fp32", **SHAPE)
    b = p.allocate(1)
    arr = p.k(b[0], 1)
    arr[:] = 4.0
    sessions = lambda: len(kvd.admin("sessions")["sessions"])  # noqa: E731
    n = sessions()
    c.close()
    with pytest.raises(kvclient.KvdDetached):
        p.allocate(1)
    assert np.all(arr == 4.0)
    assert sessions() == n  # the C connection is still open: arr maps its pool
    del arr
    assert wait_until(lambda: sessions() == n - 1)
    watcher.close()


def test_gc_releases_never_interrupt_a_batch(conn, model_id):
    p = conn.attach(model_id, dtype="fp16", **SHAPE)
    h = p.hash_tokens(list(range(16)))
    p.release(p.commit(p.allocate(4), h))
    b = conn.batch()
    reqs = [b.lookup(p, h) for _ in range(8)]
    s = p.sequence(16)
    s.prefill(list(range(9)))
    b.send()
    del s  # its kvc_seq_free (a Release) must wait for the batch
    assert conn._h.deferred
    b.wait()
    assert not conn._h.deferred
    hits = [r.result() for r in reqs]
    assert all(len(x) == 4 for x in hits)
    for x in hits:
        p.release(x)
    assert conn.stat("session.refs_held") == 0


def test_many_views_and_capsules_do_not_leak(conn, model_id):
    p = conn.attach(model_id, dtype="fp16", **SHAPE)
    b = p.allocate(1)
    before = views.live_dlpack_tensors()
    for _ in range(2000):
        a = np.from_dlpack(p.block_view(b[0], 0, K))
        c = p.block_view(b[0], 1, V).__dlpack__()
        del a, c
    assert views.live_dlpack_tensors() == before
    p.release(b)
