#!/usr/bin/env python3
"""Trains the example engine's small byte-level model and writes a llama2.c checkpoint.

No weights can be downloaded where kvd is built, and Zipage / IceCache need a model whose
attention has real structure (a random one attends almost uniformly). This script trains one
here, on text that every Debian system ships: the licence texts of base-files
(/usr/share/common-licenses). Tokens are bytes (vocab 256), so no tokenizer is needed.

The architecture is exactly examples/engine/model.c's (llama2.c: RMSNorm eps 1e-5, RoPE on
consecutive pairs with theta 10000, grouped-query attention, SwiGLU, shared classifier), so the
C engine computes the same logits as this script up to float rounding.

Corpus rule (compress_bench.py uses the same rule for its held-out text): every regular file of
the corpus directory, sorted by name, identical contents once; the first 90% of each file's bytes
train, the last 10% are held out.

Needs python3-torch (developer machine only; CI never runs this). Deterministic for a seed on
one machine and thread count. Usage:
  train_model.py [--out examples/engine/models/lic.bin] [--steps 800] [--seed 1234]
The committed checkpoint is this script's output with its defaults (36 minutes on one core of
the development machine; held-out 2.07 bits per byte).
"""
import argparse
import hashlib
import math
import os
import struct
import sys
import time

CORPUS = "/usr/share/common-licenses"


def corpus(directory):
    """(train bytes, held-out bytes) by the rule in the module comment."""
    seen = set()
    train, held = bytearray(), bytearray()
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        digest = hashlib.sha256(data).digest()
        if digest in seen or not data:
            continue
        seen.add(digest)
        cut = len(data) * 9 // 10
        train += data[:cut]
        held += data[cut:]
    return bytes(train), bytes(held)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", default=CORPUS)
    ap.add_argument("--out", default="examples/engine/models/lic.bin")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=256, help="training context (tokens)")
    ap.add_argument("--seq-len", type=int, default=4096, help="seq_len in the header")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    train, held = corpus(args.corpus)
    print(f"corpus: {len(train)} train bytes, {len(held)} held-out bytes", flush=True)
    data = torch.tensor(list(train), dtype=torch.long)
    hdata = torch.tensor(list(held), dtype=torch.long)

    d, hd, L, H, KH = args.dim, args.hidden, args.layers, args.heads, args.kv_heads
    hs = d // H
    kvd = KH * hs
    V = 256

    def param(*shape, std):
        return torch.nn.Parameter(torch.randn(*shape) * std)

    P = {
        "tok": param(V, d, std=0.02),
        "rms_att": torch.nn.Parameter(torch.ones(L, d)),
        "wq": param(L, d, d, std=d ** -0.5),
        "wk": param(L, kvd, d, std=d ** -0.5),
        "wv": param(L, kvd, d, std=d ** -0.5),
        "wo": param(L, d, d, std=d ** -0.5 / math.sqrt(2 * L)),
        "rms_ffn": torch.nn.Parameter(torch.ones(L, d)),
        "w1": param(L, hd, d, std=d ** -0.5),
        "w2": param(L, d, hd, std=hd ** -0.5 / math.sqrt(2 * L)),
        "w3": param(L, hd, d, std=d ** -0.5),
        "rms_final": torch.nn.Parameter(torch.ones(d)),
    }
    i = torch.arange(0, hs, 2, dtype=torch.float32)
    freq = 1.0 / torch.pow(10000.0, i / hs)

    def rope(x, T):  # x [B, T, heads, hs]: rotate pairs (2j, 2j+1) by pos * freq[j]
        ang = torch.arange(T, dtype=torch.float32)[:, None] * freq[None, :]
        c, s = torch.cos(ang)[None, :, None, :], torch.sin(ang)[None, :, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    def forward(tokens):
        B, T = tokens.shape
        x = P["tok"][tokens]
        for l in range(L):
            h = rms(x, P["rms_att"][l])
            q = (h @ P["wq"][l].T).view(B, T, H, hs)
            k = (h @ P["wk"][l].T).view(B, T, KH, hs)
            v = (h @ P["wv"][l].T).view(B, T, KH, hs)
            q, k = rope(q, T), rope(k, T)
            k = k.repeat_interleave(H // KH, dim=2)
            v = v.repeat_interleave(H // KH, dim=2)
            att = (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)) / math.sqrt(hs)
            mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
            att = att.masked_fill(mask, float("-inf")).softmax(-1)
            o = (att @ v.transpose(1, 2)).transpose(1, 2).reshape(B, T, d)
            x = x + o @ P["wo"][l].T
            h = rms(x, P["rms_ffn"][l])
            x = x + (F.silu(h @ P["w1"][l].T) * (h @ P["w3"][l].T)) @ P["w2"][l].T
        return rms(x, P["rms_final"]) @ P["tok"].T

    opt = torch.optim.AdamW(P.values(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    T = args.ctx
    t0 = time.time()
    for step in range(args.steps):
        warm = min(1.0, (step + 1) / 100)
        lr = args.lr * warm * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = max(lr, args.lr * 0.02)
        starts = torch.randint(0, len(data) - T - 1, (args.batch,), generator=gen)
        xb = torch.stack([data[s:s + T] for s in starts])
        yb = torch.stack([data[s + 1:s + T + 1] for s in starts])
        loss = F.cross_entropy(forward(xb).reshape(-1, V), yb.reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(P.values(), 1.0)
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step}/{args.steps} loss {loss.item():.3f} "
                  f"({time.time() - t0:.0f} s)", flush=True)
    with torch.no_grad():
        n = (len(hdata) - 1) // T * T
        xs = hdata[:n].view(-1, T)
        ys = hdata[1:n + 1].view(-1, T)
        tot = 0.0
        for j in range(0, xs.shape[0], 8):
            tot += F.cross_entropy(forward(xs[j:j + 8]).reshape(-1, V), ys[j:j + 8].reshape(-1),
                                   reduction="sum").item()
        print(f"held-out: {tot / n / math.log(2):.3f} bits/byte, perplexity "
              f"{math.exp(tot / n):.2f} over {n} bytes (context {T})", flush=True)

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".tmp", "wb") as f:
        f.write(struct.pack("7i", d, hd, L, H, KH, V, args.seq_len))  # positive vocab: shared cls
        for name in ("tok", "rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w2", "w3",
                     "rms_final"):
            f.write(P[name].detach().contiguous().numpy().astype("<f4").tobytes())
    os.replace(args.out + ".tmp", args.out)
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes), seed {args.seed}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
