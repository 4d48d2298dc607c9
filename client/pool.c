/* pool: libkvclient's public pool calls: attach and detach, the accessors, block addresses
 * and block hashing.
 *
 * The pool record and its mappings are client/map.h's, the AttachPool and MapSegments round
 * trips client/rpc.h's; this module puts them together. An attached pool gets the GPU segment
 * mapper (client/gpu_map.h), and the linked pools its attach makes (a tenant's groups and the
 * commons) inherit it. Linked pools are owned by the attached pool that linked them and freed
 * with it; every address function works on them.
 */
#include <stdlib.h>
#include <string.h>

#include "client/conn.h"
#include "client/diag.h"
#include "client/gpu_map.h"
#include "client/map.h"
#include "client/rpc.h"
#include "common/kv_vllm_hash.h"

kv_err kvc_pool_attach(kvc_conn *c, const char *model_id, const kv_layout *layout, kvc_pool **out) {
    return kvc_pool_attach_ex(c, model_id, layout, 0, out);
}

kv_err kvc_pool_attach_ex(kvc_conn *c, const char *model_id, const kv_layout *layout,
                          uint32_t flags, kvc_pool **out) {
    kv_err err = kvc__rpc_ready(c);
    if (err != KV_OK && err != KV_EEPOCH) {
        return err;
    }
    if (model_id == NULL || model_id[0] == '\0' || strlen(model_id) > 128 || layout == NULL) {
        return kvc__fail(&c->diag, KV_EINVAL,
                         "attach needs a model id of 1..128 bytes and a layout");
    }
    const char *why =
        kv_layout_check_msg(layout->num_layers, layout->num_kv_heads, layout->head_dim,
                            layout->tokens_per_block, layout->dtype, layout->arrangement);
    if (why != NULL) {
        return kvc__fail(&c->diag, KV_EINVAL, "bad layout: %s", why);
    }
    kvc_pool *p = calloc(1, sizeof(*p));
    if (p == NULL) {
        return kvc__fail(&c->diag, KV_ENOMEM, "out of memory for a pool");
    }
    if (flags & ~(uint32_t)(KVC_ATTACH_LOSSY_TIERS | KVC_ATTACH_SUMMARIES)) {
        free(p);
        return kvc__fail(&c->diag, KV_EINVAL, "unknown attach flags 0x%x", flags);
    }
    p->conn = c;
    p->diag = &c->diag;
    p->gpu_ops = &kvc__gpu_mapper;
    p->attach_flags = flags;
    err = kvc__rpc_attach(p, model_id, layout);
    if (err != KV_OK) {
        kvc__pool_destroy(p); /* not on the connection's list yet */
        return err;
    }
    p->next = c->pools;
    c->pools = p;
    for (uint32_t i = 0; i < p->nlinked; i++) {
        p->linked[i]->next = c->pools;
        c->pools = p->linked[i];
    }
    if (p->need_map) {
        err = kvc__rpc_map_new(p);
        if (err != KV_OK) {
            kvc__pool_destroy(p);
            return err;
        }
    }
    /* The linked pools' segments: MapSegments{pool_id, 0} each (PROTOCOL.md AttachPool). The
     * commons comes read-only and is mapped PROT_READ. */
    for (uint32_t i = 0; i < p->nlinked; i++) {
        err = kvc__rpc_map_from(p->linked[i], 0);
        if (err != KV_OK) {
            kvc__pool_destroy(p);
            return err;
        }
    }
    kvc__log(&c->diag, KVC_LOG_INFO, "KVC-POOL-ATTACH",
             "pool %u: %u segments mapped, %u blocks each, %u linked pools", p->pool_id, p->nsegs,
             p->blocks_per_segment, p->nlinked);
    *out = p;
    return KV_OK;
}

void kvc_pool_detach(kvc_pool *p) {
    if (p == NULL || p->owner != NULL) {
        return; /* a linked pool goes with the pool that linked it */
    }
    kv_err err = kvc__rpc_detach(p);
    if (err != KV_OK) {
        kvc__log(p->diag, KVC_LOG_WARN, "KVC-POOL-DETACH",
                 "pool %u: DetachPool failed (%s): its references stay until the session ends",
                 p->pool_id, kv_err_name(err));
    }
    kvc__pool_destroy(p);
}

uint32_t kvc_pool_nlinked(const kvc_pool *p) {
    return p->nlinked;
}

kvc_pool *kvc_pool_linked(const kvc_pool *p, uint32_t i) {
    return i < p->nlinked ? p->linked[i] : NULL;
}

kvc_pool *kvc_pool_owner(const kvc_pool *p) {
    return kvc__pool_owner(p);
}

kvc_pool *kvc_pool_find(const kvc_pool *p, uint32_t pool_id) {
    return kvc__pool_find(p, pool_id);
}

const char *kvc_pool_domain(const kvc_pool *p) {
    return p->domain;
}

int kvc_pool_read_only(const kvc_pool *p) {
    return p->read_only;
}

uint32_t kvc_pool_id(const kvc_pool *p) {
    return p->pool_id;
}

const kv_layout *kvc_pool_layout(const kvc_pool *p) {
    return &p->layout;
}

uint32_t kvc_pool_blocks_per_segment(const kvc_pool *p) {
    return p->blocks_per_segment;
}

uint32_t kvc_pool_max_segments(const kvc_pool *p) {
    /* What the layer tensors span: fewer than the slots where only the attach-time budget's
     * address space could be reserved (segments past them are reached by kvc_pool_addr). */
    uint32_t n = kvc__pool_layer_segments(p);
    return n > 0 && n < p->max_segments ? n : p->max_segments;
}

uint64_t kvc_pool_max_blocks(const kvc_pool *p) {
    return (uint64_t)p->budget_segments * p->blocks_per_segment;
}

int kvc_pool_layout_conflict(const kvc_pool *p) {
    return p->layout_conflict;
}

uint32_t kvc_pool_segments(const kvc_pool *p) {
    return p->nsegs;
}

int kvc_pool_stale(const kvc_pool *p) {
    return kvc__pool_stale(p);
}

void *kvc_pool_segment_base(const kvc_pool *p, uint32_t seg, uint32_t *nblocks) {
    if (seg >= p->nsegs || p->segs[seg].base == NULL) {
        return NULL;
    }
    if (nblocks != NULL) {
        *nblocks = p->segs[seg].nblocks;
    }
    return p->segs[seg].base;
}

void *kvc_pool_layer_base(const kvc_pool *p, uint32_t layer, int kv) {
    if (p->layer_base == NULL || p->layers_off || layer >= p->layout.num_layers ||
        (kv != KV_K && kv != KV_V)) {
        return NULL;
    }
    return p->layer_base[layer * 2 + (uint32_t)kv];
}

void *kvc_pool_addr(const kvc_pool *p, uint32_t block, uint32_t layer, int kv, uint32_t token,
                    uint32_t head) {
    const kv_layout *l = &p->layout;
    uint32_t slot;
    const kvc__segment *s = kvc__pool_block_seg(p, block, &slot);
    if (s == NULL || layer >= l->num_layers || (kv != KV_K && kv != KV_V) ||
        token >= l->tokens_per_block || head >= l->num_kv_heads) {
        return NULL;
    }
    return s->base + kv_layout_offset(l, s->nblocks, slot, layer, kv, token, head);
}

float *kvc_pool_scale_addr(const kvc_pool *p, uint32_t block, uint32_t layer, int kv,
                           uint32_t head) {
    const kv_layout *l = &p->layout;
    uint32_t slot;
    const kvc__segment *s = kvc__pool_block_seg(p, block, &slot);
    if (s == NULL || l->scale_bytes == 0 || layer >= l->num_layers || (kv != KV_K && kv != KV_V) ||
        head >= l->num_kv_heads) {
        return NULL;
    }
    return (float *)(void *)(s->base +
                             kv_layout_scale_offset(l, s->nblocks, slot, layer, kv, head));
}

kv_err kvc_pool_copy_blocks(kvc_pool *p, const int32_t *src, const int32_t *dst, size_t n) {
    if (p->gpu != NULL) {
        return kvc__fail(p->diag, KV_ENOTSUP,
                         "pool %u is in GPU memory: copy its blocks on the device (the engine's "
                         "copy kernel, e.g. kernels/kvk.h kvk_copy_blocks_cuda)",
                         p->pool_id);
    }
    const kv_layout *l = &p->layout;
    for (size_t i = 0; i < n; i++) {
        uint32_t a = (uint32_t)src[i], b = (uint32_t)dst[i];
        if (src[i] < 0 || dst[i] < 0 || kvc_pool_addr(p, a, 0, KV_K, 0, 0) == NULL ||
            kvc_pool_addr(p, b, 0, KV_K, 0, 0) == NULL) {
            return kvc__fail(p->diag, KV_EINVAL, "copy %zu: block %d -> %d: not a mapped block", i,
                             src[i], dst[i]);
        }
        if (kvc_pool_block_read_only(p, b)) {
            return kvc__fail(p->diag, KV_EPERM, "copy %zu: block %d is read-only here", i, dst[i]);
        }
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t a = (uint32_t)src[i], b = (uint32_t)dst[i];
        for (uint32_t layer = 0; layer < l->num_layers; layer++) {
            for (int kv = KV_K; kv <= KV_V; kv++) {
                memcpy(kvc_pool_addr(p, b, layer, kv, 0, 0), kvc_pool_addr(p, a, layer, kv, 0, 0),
                       l->kv_block_bytes);
                if (l->scale_bytes != 0) {
                    memcpy(kvc_pool_scale_addr(p, b, layer, kv, 0),
                           kvc_pool_scale_addr(p, a, layer, kv, 0),
                           l->num_kv_heads * sizeof(float));
                }
            }
        }
    }
    return KV_OK;
}

int kvc_pool_device(const kvc_pool *p) {
    return p->gpu != NULL && p->gpu_ops != NULL ? p->gpu_ops->device(p) : -1;
}

int kvc_pool_block_read_only(const kvc_pool *p, uint32_t block) {
    uint32_t slot;
    const kvc__segment *s = kvc__pool_block_seg(p, block, &slot);
    return s != NULL && s->read_only;
}

kv_hash128 kvc_pool_hash_seed(const kvc_pool *p) {
    return p->seed;
}

int kvc_pool_hash_algo(const kvc_pool *p) {
    return p->hash_algo;
}

/* A vLLM pool's extra keys from kvd's extra bytes: none, or one text key (a LoRA name or a cache
 * salt) of at most KV_VLLM_MAX_KEY_BYTES. */
static kv_err vllm_key(const void *extra, size_t extra_len, char *buf, const char **keys,
                       size_t *nkeys) {
    *nkeys = 0;
    if (extra_len == 0) {
        return KV_OK;
    }
    if (extra == NULL || extra_len > KV_VLLM_MAX_KEY_BYTES || memchr(extra, 0, extra_len) != NULL) {
        return KV_EINVAL;
    }
    memcpy(buf, extra, extra_len);
    buf[extra_len] = '\0';
    keys[0] = buf;
    *nkeys = 1;
    return KV_OK;
}

static kv_err not_vllm(const kvc_pool *p) {
    return kvc__fail(p->diag, KV_ENOTSUP, "pool %u does not hash with vLLM's sha256_cbor",
                     p->pool_id);
}

kv_err kvc_pool_vllm_none_hash(const kvc_pool *p, uint8_t out[32]) {
    if (p->hash_algo != KV_HASH_VLLM) {
        return not_vllm(p);
    }
    memcpy(out, p->none_hash, 32);
    return KV_OK;
}

kv_err kvc_pool_vllm_hash_tokens(const kvc_pool *p, const void *extra, size_t extra_len,
                                 const uint32_t *tokens, size_t ntokens, uint8_t (*full)[32],
                                 size_t max_out, size_t *nout) {
    if (p->hash_algo != KV_HASH_VLLM) {
        return not_vllm(p);
    }
    char kbuf[KV_VLLM_MAX_KEY_BYTES + 1];
    const char *keys[1];
    size_t nkeys;
    kv_err rc = vllm_key(extra, extra_len, kbuf, keys, &nkeys);
    if (rc == KV_OK) {
        rc = kv_vllm_hash_chain(p->none_hash, tokens, ntokens, p->layout.tokens_per_block, keys,
                                nkeys, full, max_out, nout);
    }
    if (rc != KV_OK) {
        return kvc__fail(p->diag, rc,
                         "vLLM-hashing %zu tokens: %s (extra: one UTF-8 key of at most %d bytes "
                         "without NUL)",
                         ntokens, kv_strerror(rc), KV_VLLM_MAX_KEY_BYTES);
    }
    return KV_OK;
}

kv_err kvc_pool_vllm_hash_next(const kvc_pool *p, const uint8_t *parent, const void *extra,
                               size_t extra_len, const uint32_t *tokens, uint8_t out[32]) {
    if (p->hash_algo != KV_HASH_VLLM) {
        return not_vllm(p);
    }
    char kbuf[KV_VLLM_MAX_KEY_BYTES + 1];
    const char *keys[1];
    size_t nkeys;
    kv_err rc = vllm_key(extra, extra_len, kbuf, keys, &nkeys);
    if (rc == KV_OK) {
        rc = kv_vllm_hash_block(parent != NULL ? parent : p->none_hash, tokens,
                                p->layout.tokens_per_block, keys, nkeys, out);
    }
    if (rc != KV_OK) {
        return kvc__fail(p->diag, rc, "vLLM-hashing a block: %s", kv_strerror(rc));
    }
    return KV_OK;
}

kv_err kvc_pool_hash_tokens(const kvc_pool *p, const void *extra, size_t extra_len,
                            const uint32_t *tokens, size_t ntokens, kv_hash128 *out, size_t max_out,
                            size_t *nout) {
    if (p->hash_algo == KV_HASH_VLLM) {
        /* The chain runs over full digests; the keys are their first 16 bytes. */
        size_t nb = ntokens / p->layout.tokens_per_block;
        nb = nb < max_out ? nb : max_out;
        uint8_t(*full)[32] = malloc((nb > 0 ? nb : 1) * 32);
        if (full == NULL) {
            return kvc__fail(p->diag, KV_ENOMEM, "no memory to hash %zu blocks", nb);
        }
        kv_err rc = kvc_pool_vllm_hash_tokens(p, extra, extra_len, tokens, ntokens, full, nb, nout);
        for (size_t i = 0; rc == KV_OK && i < *nout; i++) {
            out[i] = kv_vllm_hash_key(full[i]);
        }
        free(full);
        return rc;
    }
    kv_err rc = kv_hash_chain((kv_hash_algo)p->hash_algo, p->seed, extra, extra_len, tokens,
                              ntokens, p->layout.tokens_per_block, out, max_out, nout);
    if (rc != KV_OK) {
        return kvc__fail(p->diag, rc,
                         "hashing %zu tokens: %s (extra of at most %d bytes, room for %zu hashes "
                         "given)",
                         ntokens, kv_strerror(rc), KV_HASH_MAX_EXTRA, max_out);
    }
    return KV_OK;
}

kv_err kvc_pool_hash_next(const kvc_pool *p, kv_hash128 parent, const void *extra, size_t extra_len,
                          const uint32_t *tokens, kv_hash128 *out) {
    if (p->hash_algo == KV_HASH_VLLM) {
        return kvc__fail(p->diag, KV_ENOTSUP,
                         "pool %u hashes with vLLM's sha256_cbor, whose chain needs the parent's "
                         "32-byte digest: use kvc_pool_vllm_hash_next",
                         p->pool_id);
    }
    kv_err rc = kv_hash_block((kv_hash_algo)p->hash_algo, parent, extra, extra_len, tokens,
                              p->layout.tokens_per_block, out);
    if (rc != KV_OK) {
        return kvc__fail(p->diag, rc, "hashing a block: %s", kv_strerror(rc));
    }
    return KV_OK;
}
