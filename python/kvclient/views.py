"""Zero-copy views of pool memory: numpy arrays and DLPack capsules over the mapped segments.

A KVView names a tensor in a pool's mapping (an address, a shape and an element type) and
holds the pool's _Mapping, so the memory stays mapped while the view, any numpy array made
from it (its base chain ends in a _Region holding the mapping) or any DLPack capsule or
consumer tensor made from it (the DLManagedTensor's context holds it) is alive. Every method
of a view raises KvdDetached once its pool was detached; arrays made before stay readable.

Element types: fp16 and fp32 are numpy's float16/float32; int8 is int8 (with float32 scales);
bf16 and fp8_e4m3 have no numpy type and come as raw uint16 / uint8 of the same bytes (DLPack
still says bfloat16 for bf16, so torch.from_dlpack gives torch.bfloat16; fp8 goes out as
uint8: view it as torch.float8_e4m3fn). view.raw() is the same bytes as unsigned integers.

DLPack: __dlpack__ returns a legacy (unversioned) "dltensor" capsule of a DLManagedTensor built
with ctypes, which holds the view's mapping until the consumer deletes the tensor or the
capsule dies unconsumed (see reap() for how that is noticed without running Python code in a
deleter or destructor). Host pools
give kDLCPU, GPU pools kDLCUDA with the CUDA ordinal the driver reports for the address.
"""

import ctypes
import sys
import threading

from ctypes import (CFUNCTYPE, POINTER, Structure, c_char_p, c_int, c_int32, c_int64, c_uint8,
                    c_uint16, c_uint64, c_void_p)

import numpy as np

from ._lib import lib
from .errors import KvdDetached, KvdInvalid, KvdNotSupported

__all__ = ["KVView", "DLPACK_DEVICE_CPU", "DLPACK_DEVICE_CUDA"]

DLPACK_DEVICE_CPU = 1   # kDLCPU
DLPACK_DEVICE_CUDA = 2  # kDLCUDA

_KDL_INT, _KDL_UINT, _KDL_FLOAT, _KDL_BFLOAT = 0, 1, 2, 4

# dtype name -> (numpy dtype of numpy(), DLPack (code, bits))
_TYPES = {
    "fp16": (np.dtype(np.float16), (_KDL_FLOAT, 16)),
    "fp32": (np.dtype(np.float32), (_KDL_FLOAT, 32)),
    "bf16": (np.dtype(np.uint16), (_KDL_BFLOAT, 16)),
    "fp8_e4m3": (np.dtype(np.uint8), (_KDL_UINT, 8)),
    "int8": (np.dtype(np.int8), (_KDL_INT, 8)),
    "scale": (np.dtype(np.float32), (_KDL_FLOAT, 32)),
}
_RAW = {1: (np.dtype(np.uint8), (_KDL_UINT, 8)), 2: (np.dtype(np.uint16), (_KDL_UINT, 16)),
        4: (np.dtype(np.uint32), (_KDL_UINT, 32))}


# ---- DLPack structures (dlpack.h, ABI of DLPack 0.x / the unversioned DLManagedTensor) -----


class DLDevice(Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(Structure):
    _fields_ = [("data", c_void_p), ("device", DLDevice), ("ndim", c_int32),
                ("dtype", DLDataType), ("shape", POINTER(c_int64)),
                ("strides", POINTER(c_int64)), ("byte_offset", c_uint64)]


_DELETER = CFUNCTYPE(None, c_void_p)


class DLManagedTensor(Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", _DELETER)]


# Managed tensors handed out and not yet reaped: address -> [box, capsule, shape, strides,
# mapping]. The entry is what keeps the mapping alive for a consumer.
#
# No Python code runs when a consumer deletes a tensor or when a capsule dies: a ctypes callback
# called while an exception is pending (a consumer refusing the tensor drops the capsule with
# its error set; an array dying during unwinding calls the deleter) replaces that exception by
# a SystemError. So the deleter is libc's sigemptyset, which zeroes the first 128 bytes of the
# box (DLTensor.data becomes NULL: "deleted"), the capsule has no destructor and is referenced
# by the entry, and reap() (run by __dlpack__ and by the connection and pool calls that end
# things) drops entries whose tensor was deleted or whose capsule nobody else references and no
# consumer took (still named "dltensor", per the DLPack rule).
_LIVE = {}
_LIVE_LOCK = threading.Lock()
_libc = ctypes.CDLL(None)
_deleter = ctypes.cast(_libc.sigemptyset, _DELETER)
_SIGSET_BYTES = 128  # glibc and musl sigset_t; the box has room for it


class _ManagedBox(Structure):
    _fields_ = [("m", DLManagedTensor), ("room", c_uint8 * (2 * _SIGSET_BYTES))]


_CAPSULE_NAME = b"dltensor"
_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [c_void_p, c_char_p, c_void_p]
_api.PyCapsule_IsValid.restype = c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, c_char_p]


def reap():
    """Drops the references of tensors consumers deleted and of capsules left unconsumed.
    Returns how many are still live."""
    if not _LIVE:
        return 0
    with _LIVE_LOCK:
        for ptr in list(_LIVE):
            e = _LIVE[ptr]
            if e[1] is not None and sys.getrefcount(e[1]) <= 2:  # the entry's own reference
                if _api.PyCapsule_IsValid(e[1], _CAPSULE_NAME):
                    del _LIVE[ptr]  # nobody took it: the tensor dies with the capsule
                    continue
                e[1] = None  # consumed: the consumer owns it and will call the deleter
            if not e[0].m.dl_tensor.data:
                del _LIVE[ptr]  # the deleter ran
        return len(_LIVE)


def live_dlpack_tensors():
    """Managed tensors handed out through __dlpack__ and still referenced (for tests)."""
    return reap()


# ---- CUDA ordinal of a device address ---------------------------------------------------

_cuda = None
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9


def _cuda_ordinal(addr):
    """The CUDA device ordinal of a device address (cuPointerGetAttribute), else 0."""
    global _cuda
    if _cuda is None:
        try:
            _cuda = ctypes.CDLL("libcuda.so.1")
            _cuda.cuInit(0)
        except OSError:
            _cuda = False
    if not _cuda:
        return 0
    ordinal = c_int(0)
    rc = _cuda.cuPointerGetAttribute(ctypes.byref(ordinal), _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                     c_uint64(addr))
    return ordinal.value if rc == 0 else 0


# ---- numpy arrays over mapped memory ------------------------------------------------------


class _Region:
    """What a numpy array over pool memory has as its base: the array interface of the bytes
    and the mapping that must outlive them."""

    __slots__ = ("__array_interface__", "mapping")

    def __init__(self, addr, shape, dtype, readonly, mapping):
        self.mapping = mapping
        self.__array_interface__ = {"version": 3, "shape": tuple(shape), "typestr": dtype.str,
                                    "data": (addr, bool(readonly)), "strides": None}


class KVView:
    """A tensor of pool memory: .shape, .dtype (kvd's name: "fp16", ..., or "scale"),
    .np_dtype, .address, .nbytes, .readonly, .is_device, .device ("cpu" / "cuda:N").
    numpy() is an ndarray over the bytes (host pools), raw() the same bytes as unsigned ints,
    and __dlpack__/__dlpack_device__ hand it to torch/cupy/numpy.from_dlpack without a copy."""

    __slots__ = ("_state", "_mapping", "address", "shape", "dtype", "np_dtype", "_dl",
                 "readonly", "is_device", "_device_id", "__weakref__")

    def __init__(self, pool, addr, shape, dtype, np_dtype=None, dl=None):
        self._state = pool._state
        self._mapping = pool._mapping
        self.address = addr
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        base_np, base_dl = _TYPES[dtype]
        self.np_dtype = base_np if np_dtype is None else np_dtype
        self._dl = base_dl if dl is None else dl
        self.readonly = pool.read_only
        self.is_device = pool.is_device
        self._device_id = pool._device_id

    def _check(self):
        if self._state.detached:
            raise KvdDetached()

    @property
    def nbytes(self):
        n = self.np_dtype.itemsize
        for s in self.shape:
            n *= s
        return n

    @property
    def device(self):
        self._check()
        return "cuda:%d" % self._ordinal() if self.is_device else "cpu"

    def _ordinal(self):
        if self._device_id is None:
            self._device_id = _cuda_ordinal(self.address)
        return self._device_id

    def numpy(self):
        """An ndarray over the bytes, no copy (read-only for read-only pools). KvdDetached
        after the pool's detach; KvdNotSupported for GPU memory (use DLPack)."""
        self._check()
        if self.is_device:
            raise KvdNotSupported(None, "GPU pool memory has no numpy view: use DLPack "
                                  "(torch.from_dlpack / cupy.from_dlpack)")
        return np.asarray(_Region(self.address, self.shape, self.np_dtype, self.readonly,
                                  self._mapping))

    def __array__(self, dtype=None, copy=None):
        a = self.numpy()
        if dtype is not None and np.dtype(dtype) != a.dtype:
            if copy is False:
                raise ValueError("kvclient views convert dtype only with a copy")
            return a.astype(dtype)
        return a

    def raw(self):
        """The same bytes as unsigned integers of the element size (uint8/uint16/uint32), for
        numpy.from_dlpack of bf16 or fp8 views."""
        self._check()
        np_dt, dl = _RAW[self.np_dtype.itemsize]
        v = KVView.__new__(KVView)
        v._state, v._mapping, v.address, v.shape = self._state, self._mapping, self.address, \
            self.shape
        v.dtype, v.np_dtype, v._dl = self.dtype, np_dt, dl
        v.readonly, v.is_device, v._device_id = self.readonly, self.is_device, self._device_id
        return v

    def release(self):
        """Drops the view's hold on the mapping now (arrays and capsules keep their own)."""
        self._mapping = None
        self._state = _DETACHED

    def __dlpack_device__(self):
        self._check()
        if self.is_device:
            return (DLPACK_DEVICE_CUDA, self._ordinal())
        return (DLPACK_DEVICE_CPU, 0)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None, **kw):
        """A "dltensor" capsule of the view (legacy DLManagedTensor, which every consumer
        takes when the producer offers no versioned one). stream is accepted and ignored: the
        library has no pending work on the memory (the engine orders its own writes). copy=True
        is refused (BufferError): a view is never copied."""
        self._check()
        if copy:
            raise BufferError("kvclient views export their memory in place (copy=True refused)")
        dev = self.__dlpack_device__()
        if dl_device is not None and tuple(dl_device) != dev:
            raise BufferError("view is on device %s, %s asked" % (dev, tuple(dl_device)))
        reap()
        ndim = len(self.shape)
        box = _ManagedBox()
        m = box.m
        shape = (c_int64 * max(ndim, 1))(*self.shape)
        strides = (c_int64 * max(ndim, 1))()
        step = 1
        for i in range(ndim - 1, -1, -1):  # compact row-major, in elements
            strides[i] = step
            step *= self.shape[i]
        t = m.dl_tensor
        t.data = self.address
        t.device = DLDevice(dev[0], dev[1])
        t.ndim = ndim
        t.dtype = DLDataType(self._dl[0], self._dl[1], 1)
        t.shape = ctypes.cast(shape, POINTER(c_int64))
        t.strides = ctypes.cast(strides, POINTER(c_int64))
        t.byte_offset = 0
        m.deleter = _deleter
        ptr = ctypes.addressof(m)
        m.manager_ctx = ptr
        cap = _api.PyCapsule_New(ptr, _CAPSULE_NAME, None)
        with _LIVE_LOCK:
            _LIVE[ptr] = [box, cap, shape, strides, self._mapping]
        return cap

    def __repr__(self):
        where = "detached" if self._state.detached else (
            "cuda" if self.is_device else "cpu")
        return "<kvclient.KVView %s %s %s at 0x%x>" % (self.dtype, list(self.shape), where,
                                                        self.address)


class _Detached:
    detached = True


_DETACHED = _Detached()


# ---- constructors used by Pool ----------------------------------------------------------


def _pool_ptr(pool):
    return pool._p()


def block_view(pool, block, layer, kv):
    p = _pool_ptr(pool)
    bid = block[0] if isinstance(block, (tuple, list)) else int(block)
    lay = pool.layout
    if not (0 <= layer < lay.layers) or kv not in (0, 1):
        raise KvdInvalid(None, "layer %d / kv %d out of range (%d layers)" % (layer, kv,
                                                                              lay.layers))
    shape = (lay.tokens_per_block, lay.kv_heads, lay.head_dim)
    # LAYER_MAJOR: address through the layer tensor, whose pages stay mapped in place until
    # detach (a segment's own mapping is replaced if kvd frees it and grows a new one there).
    base = lib.kvc_pool_layer_base(p, layer, kv)
    if base and 0 <= bid < lib.kvc_pool_segments(p) * pool.blocks_per_segment:
        addr = base + bid * lay.kv_block_bytes
    else:
        addr = lib.kvc_pool_addr(p, bid, layer, kv, 0, 0)
    if not addr:
        raise KvdInvalid(None, "block %d is not a mapped block of pool %d" % (bid, pool.id))
    return KVView(pool, addr, shape, lay.dtype)


def layer_view(pool, layer, kv):
    p = _pool_ptr(pool)
    lay = pool.layout
    if not (0 <= layer < lay.layers) or kv not in (0, 1):
        raise KvdInvalid(None, "layer %d / kv %d out of range (%d layers)" % (layer, kv,
                                                                              lay.layers))
    base = lib.kvc_pool_layer_base(p, layer, kv)
    if not base:
        raise KvdNotSupported(None, "pool %d has no layer tensors (%s; use block_view)" % (
            pool.id, lay.arrangement))
    nblocks = lib.kvc_pool_segments(p) * pool.blocks_per_segment
    return KVView(pool, base, (nblocks, lay.tokens_per_block, lay.kv_heads, lay.head_dim),
                  lay.dtype)


def scales_view(pool, block, layer, kv):
    p = _pool_ptr(pool)
    bid = block[0] if isinstance(block, (tuple, list)) else int(block)
    lay = pool.layout
    if lay.scale_bytes == 0:
        raise KvdNotSupported(None, "%s pools have no scales" % lay.dtype)
    addr = lib.kvc_pool_scale_addr(p, bid, int(layer), int(kv), 0)
    if not addr:
        raise KvdInvalid(None, "no scales for block %d layer %d kv %d" % (bid, layer, kv))
    return KVView(pool, addr, (lay.kv_heads,), "scale")
