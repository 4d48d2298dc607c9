"""kvclient: Python binding of libkvclient, the client library of kvd (the KV-cache daemon).

ctypes over the installed shared library (libkvclient.so.1; $KVCLIENT_LIBRARY overrides the
lookup), no compiled extension. docs/PYTHON.md is the guide:

    import kvclient
    with kvclient.Connection(client_name="worker-0") as conn:
        pool = conn.attach("llama-3-8b", layers=32, kv_heads=8, head_dim=128, dtype="fp16")
        hashes = pool.hash_tokens(prompt)
        hits = pool.lookup(hashes)            # the cached prefix, referenced for us
        k0 = pool.k(hits[0], layer=0)         # numpy [tokens_per_block, kv_heads, head_dim]
        pool.release(hits)

Every failing call raises a KvdError subclass (kvclient.errors) with kvd's message.
"""

from ._lib import lib as _lib_handle  # raises ImportError naming what was tried
from .errors import *  # noqa: F401,F403
from .errors import KvdError, KvdDetached, error_class
from .client import (ARRANGEMENTS, BLOCK_DTYPE, DTYPES, HASH_DTYPE, K, NO_PARENT, V, Batch,
                     BatchRequest, Blocks, Connection, Hashes, Layout, Pool, Sequence,
                     append_many, default_socket_path, export_csr, export_csr_pool,
                     export_table, pin_multi, release_multi, rewind_multi)
from .views import KVView, live_dlpack_tensors
from .views import reap as reap_dlpack
from .cache import KvdCache

library_path = _lib_handle.kvclient_path

__version__ = "1.0.0"
