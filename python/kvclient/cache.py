"""KvdCache: a Hugging Face-shaped KV cache (Cache.update(key_states, value_states, layer_idx))
whose K/V live in kvd blocks, so a prefix one process computed is reused by the others.

One kvc_seq per batch row holds the row's tokens and block table. The engine tells the cache
which tokens it is about to run (for_prompt for the prompt, append_tokens for each decode or
draft step: block hashes need the token ids, which update() does not get), then each layer's
update() writes the new K/V in place into the row's blocks (layer tensors of a LAYER_MAJOR
pool, numpy [blocks, tokens_per_block, kv_heads, head_dim]) and returns the layer's K and V
over the whole sequence as [batch, kv_heads, seq, head_dim]: a zero-copy view of the blocks
when a row's blocks are consecutive ids (batch 1), else a gathered copy. A block is committed
(published for every process) once it is full and every layer has written it.

Rows are kept at one length (transformers pads them). fp16 and fp32 pools only (numpy has no
bf16/fp8 arithmetic). Not thread-safe: one forward pass at a time, as HF caches.
"""

import numpy as np

from .client import Pool, Connection, append_many
from .errors import KvdDetached, KvdInvalid, KvdNotSupported, KvdState

__all__ = ["KvdCache"]


class KvdCache:
    """KvdCache(pool, batch_size=1, max_tokens=4096, extra=None): an empty cache on a
    LAYER_MAJOR fp16/fp32 pool. See for_prompt for prefix reuse."""

    is_compileable = False

    def __init__(self, pool, batch_size=1, max_tokens=4096, extra=None):
        if not isinstance(pool, Pool):
            raise TypeError("KvdCache needs a kvclient.Pool")
        lay = pool.layout
        if lay.dtype not in ("fp16", "fp32"):
            raise KvdNotSupported(None, "KvdCache stores fp16 or fp32 K/V; the pool is %s"
                                  % lay.dtype)
        if lay.arrangement != "layer_major":
            raise KvdNotSupported(None, "KvdCache needs a layer_major pool (layer tensors)")
        if pool.is_device:
            raise KvdNotSupported(None, "KvdCache keeps numpy K/V: a host pool is needed")
        self.pool = pool
        self._state = pool._state
        self.layout = lay
        self.num_layers = lay.layers
        self.batch_size = int(batch_size)
        self.max_tokens = int(max_tokens)
        self._tpb = lay.tokens_per_block
        self._heads, self._dim = lay.kv_heads, lay.head_dim
        self._seqs = [pool.sequence(max_tokens, extra) for _ in range(self.batch_size)]
        self._len = 0                            # tokens every row's sequence holds
        self._written = [0] * self.num_layers    # tokens whose K/V each layer has written
        self._committed = 0                      # leading blocks committed in every row
        self._ids = [None] * self.batch_size     # per row: int32 block ids of the table
        self._first = [0] * self.batch_size      # per row: first id when ids are consecutive,
        self._contig = [False] * self.batch_size  # and whether they are
        self._k = self._v = None                 # per layer: the layer tensors (numpy)
        self._nmapped = 0

    # ---- construction with prefix reuse

    @classmethod
    def for_prompt(cls, pool, token_ids, max_tokens=4096, extra=None, model_id=None,
                   **layout):
        """A cache for prompt token_ids (1-D: one row; 2-D: a batch of equal-length rows)
        already holding the longest cached prefix. Returns (cache, n_cached): the engine runs
        the model on token_ids[..., n_cached:] next. pool may be a Connection, with model_id
        and the layout keywords of Connection.attach. n_cached is the same for every row (the
        shortest row's hit; the others give the rest of theirs back)."""
        if isinstance(pool, Connection):
            pool = pool.attach(model_id, **layout)
        rows = np.asarray(token_ids, dtype=np.int64)
        single = rows.ndim == 1
        if single:
            rows = rows[None]
        if rows.ndim != 2 or rows.shape[1] < 1:
            raise KvdInvalid(None, "token_ids: one or more rows of at least one token")
        cache = cls(pool, rows.shape[0], max_tokens, extra)
        rows = rows.astype(np.uint32)
        n = rows.shape[1]
        cached = [s.prefill(rows[i]) for i, s in enumerate(cache._seqs)]
        c = min(cached)
        for i, s in enumerate(cache._seqs):
            if cached[i] > c:  # keep every row at the common length of valid K/V
                s.rewind(c)
                s.append(rows[i, c:])
        cache._len = n
        cache._written = [c] * cache.num_layers
        cache._committed = c // cache._tpb
        cache._refresh()
        return cache, c

    # ---- tokens

    def append_tokens(self, token_ids):
        """Announces the next tokens of every row (decode or draft tokens) before the forward
        pass that computes their K/V: [batch, m] (or a flat list for batch 1). One round
        trip only when a row needs a new block (one for the whole batch)."""
        self._check()
        rows = np.asarray(token_ids, dtype=np.uint32)
        if rows.ndim == 1:
            rows = rows[None]
        if rows.shape[0] != self.batch_size:
            raise KvdInvalid(None, "append_tokens: %d rows for a batch of %d"
                             % (rows.shape[0], self.batch_size))
        m = rows.shape[1]
        before = self._len
        if self.batch_size == 1:
            self._seqs[0].append(rows[0])
        else:
            errs = append_many(self._seqs, list(rows))
            bad = [e for e in errs if e is not None]
            if bad:
                for s, e in zip(self._seqs, errs):  # keep the rows in step
                    if e is None:
                        s.rewind(before)
                raise bad[0]
        self._len = before + m
        if (self._len + self._tpb - 1) // self._tpb != (before + self._tpb - 1) // self._tpb:
            self._refresh()

    # ---- the Cache interface

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        """Writes K/V of the next key_states.shape[2] tokens of layer layer_idx (numpy
        [batch, kv_heads, new, head_dim]) into the blocks and returns (keys, values) of the
        layer over the whole sequence, [batch, kv_heads, seq, head_dim]."""
        if self._state.detached:
            raise KvdDetached()
        start = self._written[layer_idx]
        new = key_states.shape[2]
        end = start + new
        if end > self._len:
            raise KvdState(None, "update of tokens [%d, %d) in layer %d: only %d tokens "
                           "announced (append_tokens first)" % (start, end, layer_idx, self._len))
        kl, vl = self._k[layer_idx], self._v[layer_idx]
        tpb = self._tpb
        if new == 1:
            b, o = divmod(start, tpb)
            for r in range(self.batch_size):
                bid = self._ids[r][b]
                kl[bid, o] = key_states[r, :, 0]
                vl[bid, o] = value_states[r, :, 0]
        else:
            for r in range(self.batch_size):
                ids = self._ids[r]
                t = start
                while t < end:
                    b, o = divmod(t, tpb)
                    m = min(tpb - o, end - t)
                    s = t - start
                    kl[ids[b], o:o + m] = key_states[r, :, s:s + m].transpose(1, 0, 2)
                    vl[ids[b], o:o + m] = value_states[r, :, s:s + m].transpose(1, 0, 2)
                    t += m
        self._written[layer_idx] = end
        if layer_idx == self.num_layers - 1:
            full = min(self._written) // tpb
            if full > self._committed:
                self._commit(full)
        return self._gather(kl, end, 0), self._gather(vl, end, 1)

    def _gather(self, tensor, end, which):
        tpb = self._tpb
        nb = (end + tpb - 1) // tpb
        if self.batch_size == 1:
            if self._contig[0]:
                i0 = self._first[0]
                flat = tensor[i0:i0 + nb].reshape(nb * tpb, self._heads, self._dim)
            else:
                flat = tensor[self._ids[0][:nb]].reshape(nb * tpb, self._heads, self._dim)
            return flat[:end].transpose(1, 0, 2)[None]
        out = np.empty((self.batch_size, self._heads, end, self._dim), dtype=tensor.dtype)
        for r in range(self.batch_size):
            rows = tensor[self._ids[r][:nb]].reshape(nb * tpb, self._heads, self._dim)
            out[r] = rows[:end].transpose(1, 0, 2)
        return out

    def get_seq_length(self, layer_idx=0):
        """Tokens whose K/V layer layer_idx holds."""
        return self._written[layer_idx]

    def get_max_cache_shape(self):
        return self.max_tokens

    def get_max_length(self):
        return self.max_tokens

    def __len__(self):
        return self.num_layers

    def crop(self, max_length):
        """Keeps the first max_length tokens (negative: drops -max_length from the end): the
        speculative rollback, through kvc_seq_rewind. A cut inside a committed block keeps
        the cut block's first tokens (they are copied into the fresh block Rewind gives)."""
        self._check()
        cur = self._len
        if max_length < 0:
            max_length = cur + max_length
        n = max(0, int(max_length))
        if n >= cur:
            return
        tpb = self._tpb
        cb, off = divmod(n, tpb)
        saved = None
        if off and cb < self._committed:
            # kvc_seq_rewind gives a committed block back and allocates a fresh one in its
            # place; keep its first `off` tokens of every layer to write them there.
            saved = [[(self._k[l][ids[cb], :off].copy(), self._v[l][ids[cb], :off].copy())
                      for l in range(self.num_layers)] for ids in self._ids]
        for s in self._seqs:
            s.rewind(n)
        self._len = n
        self._written = [min(w, n) for w in self._written]
        self._committed = min(self._committed, cb)
        self._refresh()
        if saved is not None:
            for r, ids in enumerate(self._ids):
                for l in range(self.num_layers):
                    self._k[l][ids[cb], :off] = saved[r][l][0]
                    self._v[l][ids[cb], :off] = saved[r][l][1]

    def reset(self):
        """Drops every token (all blocks go back; committed ones stay cached for others)."""
        self._check()
        for s in self._seqs:
            s.release()
        self._len = 0
        self._written = [0] * self.num_layers
        self._committed = 0
        self._refresh()

    def commit(self):
        """Commits every full block all layers have written (update does it by itself)."""
        self._check()
        full = min(self._written) // self._tpb
        if full > self._committed:
            self._commit(full)

    def close(self):
        """Frees the sequences (their blocks go back; committed blocks stay cached)."""
        for s in self._seqs:
            s.free()
        self._seqs = []
        self._k = self._v = None

    @property
    def sequences(self):
        """The rows' kvclient.Sequence objects (export_csr, export_slots, ...)."""
        return list(self._seqs)

    @property
    def committed_tokens(self):
        return self._committed * self._tpb

    # ---- internals

    def _check(self):
        if self._state.detached:
            raise KvdDetached()

    def _commit(self, full):
        for s in self._seqs:
            s.commit(full * self._tpb)
        self._committed = full
        self._refresh()  # a commit may swap a block for the daemon's copy of the same bytes

    def _refresh(self):
        """Reloads each row's block ids, and the layer tensors when a block lies past them."""
        top = -1
        for r, s in enumerate(self._seqs):
            ids = s.block_ids()
            self._ids[r] = ids
            if len(ids):
                top = max(top, int(ids.max()))
                first = int(ids[0])
                self._first[r] = first
                self._contig[r] = bool(int(ids[-1]) - first == len(ids) - 1 and
                                       (len(ids) < 2 or np.all(np.diff(ids) == 1)))
            else:
                self._contig[r] = True
                self._first[r] = 0
        if self._k is None or top >= self._nmapped:
            p = self.pool
            self._k = [p.layer(l, 0) for l in range(self.num_layers)]
            self._v = [p.layer(l, 1) for l in range(self.num_layers)]
            self._nmapped = self._k[0].shape[0]

    def __repr__(self):
        return "<kvclient.KvdCache batch %d, %d tokens, %d committed>" % (
            self.batch_size, self._len, self.committed_tokens)
