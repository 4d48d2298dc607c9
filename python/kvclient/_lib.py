"""ctypes declarations of libkvclient: the structures of client/include/kvclient.h and the
prototype of every function the package calls.

The library is found, in this order, at $KVCLIENT_LIBRARY (a path), through
ctypes.util.find_library("kvclient"), as "libkvclient.so.1" / "libkvclient.so" on the
loader path, and where deploy/install.sh put it beside this package (_install.LIBDIR). Structure layouts are checked against the C compiler by tests/test_layout.py.
"""

import ctypes
import ctypes.util
import os

from ctypes import (CFUNCTYPE, POINTER, Structure, c_char_p, c_float, c_int, c_int32, c_int64,
                    c_size_t, c_uint8, c_uint32, c_uint64, c_void_p)


class KvcBlock(Structure):
    """kvc_block: a pool-local block id and the generation it was issued at."""
    _fields_ = [("id", c_uint32), ("gen", c_uint32)]


class KvHash128(Structure):
    """kv_hash128: a 128-bit block hash (lo = digest bytes 0..7 little-endian)."""
    _fields_ = [("lo", c_uint64), ("hi", c_uint64)]


class KvLayout(Structure):
    """kv_layout: six shape fields, then the fields kv_layout_init derives."""
    _fields_ = [("num_layers", c_uint32), ("num_kv_heads", c_uint32), ("head_dim", c_uint32),
                ("tokens_per_block", c_uint32), ("dtype", c_int), ("arrangement", c_int),
                ("elem_bytes", c_uint32), ("token_bytes", c_uint64),
                ("kv_block_bytes", c_uint64), ("data_bytes", c_uint64),
                ("scale_bytes", c_uint64), ("block_bytes", c_uint64)]


LOG_FN = CFUNCTYPE(None, c_void_p, c_int, c_char_p, c_char_p)
STAT_FN = CFUNCTYPE(None, c_void_p, c_char_p, c_uint64)


class KvcOptions(Structure):
    """kvc_options (kvc_options_init fills the defaults)."""
    _fields_ = [("socket_path", c_char_p), ("client_name", c_char_p), ("token", c_void_p),
                ("token_len", c_size_t), ("log", LOG_FN), ("log_arg", c_void_p),
                ("log_level", c_int), ("timeout_ms", c_int)]


class KvcCommitEntry(Structure):
    """kvc_commit_entry: a written block, its chain hash and its parent's id."""
    _fields_ = [("block", KvcBlock), ("hash", KvHash128), ("parent", c_uint32)]


class KvcTierHits(Structure):
    """kvc_tier_hits: how far a prefix continues below T0 (docs/TIERS.md)."""
    _fields_ = [("fetchable", c_uint32), ("t1", c_uint32), ("t2", c_uint32)]


class KvcRemoteHits(Structure):
    """kvc_remote_hits: what the remote tier holds past the local run."""
    _fields_ = [("blocks", c_uint32), ("failure", c_int)]


class KvcFetchResult(Structure):
    """kvc_fetch_result: what a fetch did."""
    _fields_ = [("nblocks", c_size_t), ("t0_hits", c_uint32), ("promoted", c_uint32),
                ("lower_run", c_uint32), ("status", c_int), ("failure", c_int)]


NO_PARENT = 0xFFFFFFFF  # KVC_NO_PARENT
FETCH_DONE, FETCH_SHORT, FETCH_PARTIAL = 0, 1, 2  # KVC_FETCH_*

# The sizes the C compiler gives (x86-64 and aarch64 Linux); test_layout.py checks them.
EXPECTED_SIZES = {"kvc_block": 8, "kv_hash128": 16, "kv_layout": 72, "kvc_options": 56,
                  "kvc_commit_entry": 32, "kvc_tier_hits": 12, "kvc_fetch_result": 32}

p = c_void_p  # opaque kvc_conn *, kvc_pool *, kvc_batch *, kvc_seq *
_E = c_int    # kv_err
_PROTOS = {
    "kvc_options_init": (None, [POINTER(KvcOptions)]),
    "kvc_default_socket_path": (_E, [c_char_p, c_size_t]),
    "kvc_conn_open": (_E, [POINTER(KvcOptions), POINTER(c_void_p)]),
    "kvc_conn_close": (None, [p]),
    "kvc_conn_reconnect": (_E, [p]),
    "kvc_last_error": (c_char_p, [p]),
    "kvc_err_name": (c_char_p, [c_int]),
    "kvc_strerror": (c_char_p, [c_int]),
    "kvc_conn_session_id": (c_uint64, [p]),
    "kvc_conn_tenant": (c_char_p, [p]),
    "kvc_conn_boot_epoch": (c_uint64, [p]),
    "kvc_conn_fd": (c_int, [p]),
    "kvc_ping": (_E, [p, c_void_p, c_size_t]),
    "kvc_stats": (_E, [p, c_uint32, STAT_FN, c_void_p]),
    "kvc_stat_get": (_E, [p, c_uint32, c_char_p, POINTER(c_uint64)]),
    "kvc_pool_attach": (_E, [p, c_char_p, POINTER(KvLayout), POINTER(c_void_p)]),
    "kvc_pool_attach_ex": (_E, [p, c_char_p, POINTER(KvLayout), c_uint32, POINTER(c_void_p)]),
    "kvc_pool_detach": (None, [p]),
    "kvc_pool_id": (c_uint32, [p]),
    "kvc_pool_layout": (POINTER(KvLayout), [p]),
    "kvc_pool_blocks_per_segment": (c_uint32, [p]),
    "kvc_pool_max_segments": (c_uint32, [p]),
    "kvc_pool_max_blocks": (c_uint64, [p]),
    "kvc_pool_layout_conflict": (c_int, [p]),
    "kvc_pool_segments": (c_uint32, [p]),
    "kvc_pool_stale": (c_int, [p]),
    "kvc_pool_segment_base": (c_void_p, [p, c_uint32, POINTER(c_uint32)]),
    "kvc_pool_layer_base": (c_void_p, [p, c_uint32, c_int]),
    "kvc_pool_addr": (c_void_p, [p, c_uint32, c_uint32, c_int, c_uint32, c_uint32]),
    "kvc_pool_scale_addr": (c_void_p, [p, c_uint32, c_uint32, c_int, c_uint32]),
    "kvc_pool_copy_blocks": (_E, [p, c_void_p, c_void_p, c_size_t]),
    "kvc_pool_block_read_only": (c_int, [p, c_uint32]),
    "kvc_pool_nlinked": (c_uint32, [p]),
    "kvc_pool_linked": (c_void_p, [p, c_uint32]),
    "kvc_pool_owner": (c_void_p, [p]),
    "kvc_pool_find": (c_void_p, [p, c_uint32]),
    "kvc_pool_domain": (c_char_p, [p]),
    "kvc_pool_read_only": (c_int, [p]),
    "kvc_pool_device": (c_int, [p]),
    "kvc_pool_hash_seed": (KvHash128, [p]),
    "kvc_pool_hash_algo": (c_int, [p]),
    "kvc_pool_hash_tokens": (_E, [p, c_void_p, c_size_t, c_void_p, c_size_t, c_void_p,
                                  c_size_t, POINTER(c_size_t)]),
    "kvc_pool_hash_next": (_E, [p, KvHash128, c_void_p, c_size_t, c_void_p,
                                POINTER(KvHash128)]),
    "kvc_pool_vllm_none_hash": (_E, [p, c_void_p]),
    "kvc_pool_vllm_hash_tokens": (_E, [p, c_void_p, c_size_t, c_void_p, c_size_t, c_void_p,
                                       c_size_t, POINTER(c_size_t)]),
    "kvc_pool_vllm_hash_next": (_E, [p, c_void_p, c_void_p, c_size_t, c_void_p, c_void_p]),
    "kvc_lookup": (_E, [p, c_void_p, c_size_t, c_void_p, POINTER(c_size_t)]),
    "kvc_lookup_tiers": (_E, [p, c_void_p, c_size_t, c_void_p, POINTER(c_size_t),
                              POINTER(KvcTierHits)]),
    "kvc_fetch": (_E, [p, c_void_p, c_size_t, c_uint32, c_void_p, POINTER(KvcFetchResult)]),
    "kvc_conn_has_tiers": (c_int, [p]),
    "kvc_conn_has_remote": (c_int, [p]),
    "kvc_lookup_remote": (_E, [p, c_void_p, c_size_t, c_void_p, POINTER(c_size_t),
                               POINTER(KvcTierHits), POINTER(KvcRemoteHits)]),
    "kvc_conn_has_private": (c_int, [p]),
    "kvc_allocate_private": (_E, [p, c_uint32, c_void_p]),
    "kvc_unshare": (_E, [p, c_void_p, c_size_t]),
    "kvc_summaries": (_E, [p, c_void_p, c_size_t, c_void_p, c_void_p]),
    "kvc_seq_set_block_budget": (_E, [p, c_size_t]),
    "kvc_seq_block_budget": (c_size_t, [p]),
    "kvc_seq_compact": (_E, [p, c_void_p, c_size_t, c_void_p, c_size_t]),
    "kvc_seq_adopt": (_E, [p, c_void_p, c_size_t, c_size_t, c_void_p, c_size_t]),
    "kvc_seq_compressed": (c_int, [p]),
    "kvc_seq_position": (c_size_t, [p]),
    "kvc_seq_promoted": (c_size_t, [p]),
    "kvc_lookup_domains": (_E, [p, c_void_p, c_size_t, c_void_p, c_void_p, POINTER(c_size_t)]),
    "kvc_allocate": (_E, [p, c_uint32, c_void_p]),
    "kvc_commit": (_E, [p, c_void_p, c_size_t, c_void_p]),
    "kvc_commit_ex": (_E, [p, c_void_p, c_size_t, c_void_p, c_void_p, c_void_p, c_void_p]),
    "kvc_batch_commit_ex": (_E, [p, p, c_void_p, c_size_t, c_void_p, c_void_p, c_void_p,
                                 c_void_p, POINTER(c_size_t)]),
    "kvc_release": (_E, [p, c_void_p, c_size_t]),
    "kvc_release_deferred": (_E, [p, c_void_p, c_size_t]),
    "kvc_flush": (_E, [p]),
    "kvc_conn_deferred_pending": (c_size_t, [p]),
    "kvc_conn_deferred_failures": (c_uint64, [p]),
    "kvc_rewind": (_E, [p, c_void_p, c_size_t]),
    "kvc_pin": (_E, [p, c_void_p, c_size_t, c_uint64, c_uint8, c_int]),
    "kvc_release_multi": (_E, [c_void_p, c_void_p, c_size_t]),
    "kvc_rewind_multi": (_E, [c_void_p, c_void_p, c_size_t]),
    "kvc_pin_multi": (_E, [c_void_p, c_void_p, c_size_t, c_uint64, c_uint8, c_int]),
    "kvc_batch_alloc": (_E, [p, POINTER(c_void_p)]),
    "kvc_batch_free": (None, [p]),
    "kvc_batch_reset": (None, [p]),
    "kvc_batch_count": (c_size_t, [p]),
    "kvc_batch_ping": (_E, [p, c_void_p, c_size_t, c_void_p]),
    "kvc_batch_fetch": (_E, [p, p, c_void_p, c_size_t, c_uint32, c_void_p,
                             POINTER(KvcFetchResult), c_void_p]),
    "kvc_batch_lookup": (_E, [p, p, c_void_p, c_size_t, c_void_p, c_void_p, c_void_p]),
    "kvc_batch_lookup_domains": (_E, [p, p, c_void_p, c_size_t, c_void_p, c_void_p, c_void_p,
                                      c_void_p]),
    "kvc_batch_allocate": (_E, [p, p, c_uint32, c_void_p, c_void_p]),
    "kvc_batch_commit": (_E, [p, p, c_void_p, c_size_t, c_void_p, c_void_p]),
    "kvc_batch_release": (_E, [p, p, c_void_p, c_size_t, c_void_p]),
    "kvc_batch_lookup_many": (
        _E,
        [p, p, c_void_p, c_void_p, c_void_p, c_void_p, c_size_t, c_void_p],
    ),
    "kvc_batch_release_many": (_E, [p, p, c_void_p, c_void_p, c_size_t, c_void_p]),
    "kvc_batch_rewind": (_E, [p, p, c_void_p, c_size_t, c_void_p]),
    "kvc_batch_send": (_E, [p]),
    "kvc_batch_wait": (_E, [p]),
    "kvc_batch_run": (_E, [p]),
    "kvc_batch_first_error": (_E, [p, POINTER(c_size_t)]),
    "kvc_batch_status": (_E, [p, c_size_t]),
    "kvc_seq_alloc": (_E, [p, c_size_t, c_void_p, c_size_t, POINTER(c_void_p)]),
    "kvc_seq_set_search_domains": (None, [p, c_int]),
    "kvc_seq_free": (None, [p]),
    "kvc_seq_prefill": (_E, [p, c_void_p, c_size_t, POINTER(c_size_t)]),
    "kvc_seq_append": (_E, [p, c_void_p, c_size_t]),
    "kvc_seq_commit": (_E, [p, c_size_t, POINTER(c_size_t)]),
    "kvc_seq_rewind": (_E, [p, c_size_t, POINTER(c_size_t)]),
    "kvc_seq_release": (_E, [p]),
    "kvc_seq_reserve": (_E, [p, c_size_t]),
    "kvc_seq_set_lookahead": (_E, [p, c_size_t]),
    "kvc_seq_capacity": (c_size_t, [p]),
    "kvc_seq_append_many": (_E, [c_void_p, c_size_t, c_void_p, c_void_p, c_void_p]),
    "kvc_seq_fork": (_E, [p, POINTER(c_void_p), c_void_p, c_void_p, c_size_t,
                          POINTER(c_size_t)]),
    "kvc_seq_length": (c_size_t, [p]),
    "kvc_seq_nblocks": (c_size_t, [p]),
    "kvc_seq_ncommitted": (c_size_t, [p]),
    "kvc_seq_block": (KvcBlock, [p, c_size_t]),
    "kvc_seq_block_pool": (c_void_p, [p, c_size_t]),
    "kvc_seq_mixed": (c_int, [p]),
    "kvc_seq_export_csr": (_E, [c_void_p, c_size_t, c_void_p, c_size_t, c_void_p, c_size_t,
                                c_void_p, c_size_t, POINTER(c_size_t)]),
    "kvc_seq_export_csr_pool": (_E, [c_void_p, c_size_t, p, c_void_p, c_size_t, c_void_p,
                                     c_size_t, c_void_p, c_size_t, POINTER(c_size_t)]),
    "kvc_seq_export_slots": (_E, [p, c_size_t, c_size_t, c_void_p, c_size_t]),
    "kvc_seq_export_table": (_E, [c_void_p, c_size_t, c_void_p, c_size_t, c_int32,
                                  POINTER(c_size_t)]),
}


def _candidates():
    env = os.environ.get("KVCLIENT_LIBRARY")
    if env:
        yield "$KVCLIENT_LIBRARY=" + env, env
        return  # an explicit path is never second-guessed
    found = ctypes.util.find_library("kvclient")
    if found:
        yield "find_library('kvclient') -> " + found, found
    else:
        yield "find_library('kvclient') (found nothing)", None
    for name in ("libkvclient.so.1", "libkvclient.so"):
        yield name + " on the loader path", name
    # Where deploy/install.sh put the library beside this package (relative to this folder).
    try:
        from . import _install
    except ImportError:
        return
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.normpath(os.path.join(here, _install.LIBDIR, "libkvclient.so.1"))
    yield "the installed " + path, path


def _loaded_path(name):
    """The file the loader mapped for libkvclient (from /proc/self/maps), else name."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(None, 5)[-1]
                if os.path.basename(path).startswith("libkvclient.so"):
                    return path
    except OSError:
        pass
    return name


def load():
    """Loads libkvclient and declares its prototypes; ImportError naming every place tried."""
    tried = []
    for what, name in _candidates():
        if name is None:
            tried.append(what)
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            tried.append("%s: %s" % (what, e))
            continue
        missing = [fn for fn in _PROTOS if not hasattr(lib, fn)]
        if missing:
            tried.append("%s: not libkvclient (no %s)" % (what, missing[0]))
            continue
        for fn, (res, args) in _PROTOS.items():
            f = getattr(lib, fn)
            f.restype = res
            f.argtypes = args
        lib.kvclient_path = _loaded_path(name)
        return lib
    raise ImportError("kvclient: cannot load libkvclient; tried:\n  " + "\n  ".join(tried) +
                      "\nInstall it (./dev install, or the kvd .deb) or set KVCLIENT_LIBRARY to "
                      "the path of libkvclient.so.")


lib = load()
