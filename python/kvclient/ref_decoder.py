"""A tiny numpy decoder-only transformer with seeded random weights, and a plain in-memory
cache shaped like Hugging Face's DynamicCache: the reference that KvdCache is checked against
(same tokens, close logits) and the workload of the cache benchmark.

The model: token embedding, `layers` pre-norm blocks (RMSNorm, grouped-query attention with
RoPE, a SiLU MLP), a final norm and an untied output projection; greedy decoding. Arithmetic
is float64 and the cache stores K/V in `cache_dtype`, so a cache that gives back exactly what
was stored gives exactly the same logits.
"""

import numpy as np

__all__ = ["RefDecoder", "PlainCache"]


class PlainCache:
    """HF DynamicCache in numpy: per layer, K and V [batch, kv_heads, seq, head_dim] grown by
    concatenation on every update."""

    def __init__(self, dtype=np.float32):
        self.dtype = np.dtype(dtype)
        self.keys, self.values = [], []

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        k = np.asarray(key_states, dtype=self.dtype)
        v = np.asarray(value_states, dtype=self.dtype)
        if layer_idx == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer_idx] = np.concatenate([self.keys[layer_idx], k], axis=-2)
            self.values[layer_idx] = np.concatenate([self.values[layer_idx], v], axis=-2)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx=0):
        return self.keys[layer_idx].shape[-2] if layer_idx < len(self.keys) else 0

    def crop(self, max_length):
        n = self.get_seq_length()
        if max_length < 0:
            max_length = n + max_length
        for i in range(len(self.keys)):
            self.keys[i] = self.keys[i][..., :max_length, :]
            self.values[i] = self.values[i][..., :max_length, :]

    def reset(self):
        self.keys, self.values = [], []

    def append_tokens(self, token_ids):  # the KvdCache interface; nothing to do here
        pass


def _rms(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w


class RefDecoder:
    """RefDecoder(vocab=97, layers=3, heads=4, kv_heads=2, head_dim=16, seed=0, rope=True)."""

    def __init__(self, vocab=97, layers=3, heads=4, kv_heads=2, head_dim=16, seed=0, rope=True,
                 mlp=64):
        assert heads % kv_heads == 0
        self.vocab, self.layers, self.heads, self.kv_heads = vocab, layers, heads, kv_heads
        self.head_dim, self.rope = head_dim, rope
        d = self.d_model = heads * head_dim
        rng = np.random.default_rng(seed)

        def w(*shape):
            return rng.standard_normal(shape) / np.sqrt(shape[0])
        self.embed = rng.standard_normal((vocab, d))
        self.blocks = []
        for _ in range(layers):
            self.blocks.append(dict(
                n1=1 + 0.1 * rng.standard_normal(d), wq=w(d, heads * head_dim),
                wk=w(d, kv_heads * head_dim), wv=w(d, kv_heads * head_dim),
                wo=w(heads * head_dim, d), n2=1 + 0.1 * rng.standard_normal(d),
                w1=w(d, mlp), w2=w(mlp, d)))
        self.norm = 1 + 0.1 * rng.standard_normal(d)
        self.out = w(d, vocab)

    def _rope(self, x, pos):
        # x [b, h, s, dim], pos [s]: rotate pairs (i, i + dim/2) by pos * theta_i.
        half = self.head_dim // 2
        inv = 1.0 / (10000.0 ** (np.arange(half) / half))
        ang = pos[:, None] * inv[None, :]
        cos, sin = np.cos(ang), np.sin(ang)
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    def forward(self, token_ids, cache, start):
        """Logits [b, s, vocab] of token_ids [b, s] at positions start.., through cache."""
        ids = np.asarray(token_ids)
        b, s = ids.shape
        x = self.embed[ids]
        pos = np.arange(start, start + s, dtype=np.float64)
        rep = self.heads // self.kv_heads
        for li, blk in enumerate(self.blocks):
            h = _rms(x, blk["n1"])
            q = (h @ blk["wq"]).reshape(b, s, self.heads, self.head_dim).transpose(0, 2, 1, 3)
            k = (h @ blk["wk"]).reshape(b, s, self.kv_heads, self.head_dim).transpose(0, 2, 1, 3)
            v = (h @ blk["wv"]).reshape(b, s, self.kv_heads, self.head_dim).transpose(0, 2, 1, 3)
            if self.rope:
                q, k = self._rope(q, pos), self._rope(k, pos)
            keys, values = cache.update(k, v, li)
            keys = np.asarray(keys, dtype=np.float64)
            values = np.asarray(values, dtype=np.float64)
            t = keys.shape[2]
            keys = np.repeat(keys, rep, axis=1)  # GQA: each KV head serves `rep` query heads
            values = np.repeat(values, rep, axis=1)
            att = q @ keys.transpose(0, 1, 3, 2) / np.sqrt(self.head_dim)
            mask = np.arange(t)[None, :] > (start + np.arange(s))[:, None]
            att = np.where(mask, -np.inf, att)
            att = np.exp(att - att.max(axis=-1, keepdims=True))
            att /= att.sum(axis=-1, keepdims=True)
            o = (att @ values).transpose(0, 2, 1, 3).reshape(b, s, self.heads * self.head_dim)
            x = x + o @ blk["wo"]
            h = _rms(x, blk["n2"])
            u = h @ blk["w1"]
            x = x + (u / (1 + np.exp(-u))) @ blk["w2"]
        return _rms(x, self.norm) @ self.out

    def generate(self, prompt, n_new, cache, n_cached=0):
        """Greedy: runs prompt[n_cached:] (the cache already holds the first n_cached tokens)
        and n_new decode steps. Returns (new tokens, logits of every step [n_new, vocab])."""
        prompt = [int(t) for t in prompt]
        logits = self.forward(np.array([prompt[n_cached:]]), cache, n_cached)[:, -1]
        out, all_logits = [], []
        pos = len(prompt)
        for step in range(n_new):
            tok = int(np.argmax(logits[0]))
            out.append(tok)
            all_logits.append(logits[0])
            if step == n_new - 1:
                break
            cache.append_tokens([tok])
            logits = self.forward(np.array([[tok]]), cache, pos)[:, -1]
            pos += 1
        return out, np.array(all_logits)
