/* kvk_cache: the cache descriptor, argument checks shared with the CUDA launchers, and the CPU
 * twins of copy_blocks and reshape_and_cache (the latter vectorised through kvk__ops(), with the
 * scalar loop kept as kvk__reshape_ref).
 *
 * Every block's (section) run of [tokens][heads][dim] elements is contiguous in both kvd
 * arrangements and in engines' own tensors, so copy_blocks is a list of contiguous chunk copies;
 * conversion between arrangements is nothing but different strides on the two sides.
 */
#include <stdio.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "kernels/kvk_dtype.h"
#include "kernels/kvk_internal.h"

kv_err kvk_cache_from_segment(const kv_layout *l, uintptr_t base, uint32_t nblocks,
                              kvk_cache *out) {
    if (l == NULL || out == NULL || nblocks == 0 || kvk_dtype_bytes(l->dtype) == 0) {
        return kvk__fail(KV_EINVAL, "cache_from_segment: null layout, no blocks or bad dtype");
    }
    kvk_cache c = {
        .num_blocks = nblocks,
        .num_sections = l->num_layers * 2,
        .tokens_per_block = l->tokens_per_block,
        .num_kv_heads = l->num_kv_heads,
        .head_dim = l->head_dim,
        .dtype = l->dtype,
    };
    int64_t scale_head_bytes = (int64_t)l->num_kv_heads * (int64_t)sizeof(float);
    /* Formulas of common/kv_layout.h; kvk_cache_test checks them against kv_layout_offset. */
    if (l->arrangement == KV_LAYER_MAJOR) {
        c.data = base;
        c.block_stride = (int64_t)l->kv_block_bytes;
        c.section_stride = (int64_t)l->kv_block_bytes * nblocks;
        if (l->scale_bytes != 0) {
            c.scales = base + (uintptr_t)((uint64_t)nblocks * l->data_bytes);
            c.scale_block_stride = scale_head_bytes;
            c.scale_section_stride = scale_head_bytes * nblocks;
        }
    } else if (l->arrangement == KV_BLOCK_MAJOR) {
        c.data = base;
        c.block_stride = (int64_t)l->block_bytes;
        c.section_stride = (int64_t)l->kv_block_bytes;
        if (l->scale_bytes != 0) {
            c.scales = base + (uintptr_t)l->data_bytes;
            c.scale_block_stride = (int64_t)l->block_bytes;
            c.scale_section_stride = scale_head_bytes;
        }
    } else {
        return kvk__fail(KV_EINVAL, "cache_from_segment: unknown arrangement %d",
                         (int)l->arrangement);
    }
    *out = c;
    return KV_OK;
}

kv_err kvk__check_cache(const kvk_cache *c, const char *what) {
    if (c == NULL) {
        return kvk__fail(KV_EINVAL, "%s: null cache", what);
    }
    if (kvk_dtype_bytes(c->dtype) == 0) {
        return kvk__fail(KV_EINVAL, "%s: unknown cache dtype %d", what, (int)c->dtype);
    }
    if (c->num_blocks == 0 || c->num_sections == 0 || c->tokens_per_block == 0 ||
        c->num_kv_heads == 0 || c->head_dim == 0 || c->data == 0) {
        return kvk__fail(KV_EINVAL, "%s: cache with a zero dimension or null data", what);
    }
    if (kvk__is_scaled(c->dtype) && c->scales == 0) {
        return kvk__fail(KV_EINVAL, "%s: 8-bit cache without scales", what);
    }
    return KV_OK;
}

kv_err kvk__check_copy(const kvk_cache *src, const kvk_cache *dst) {
    kv_err rc = kvk__check_cache(src, "copy_blocks src");
    if (rc != KV_OK) {
        return rc;
    }
    rc = kvk__check_cache(dst, "copy_blocks dst");
    if (rc != KV_OK) {
        return rc;
    }
    if (src->num_sections != dst->num_sections || src->tokens_per_block != dst->tokens_per_block ||
        src->num_kv_heads != dst->num_kv_heads || src->head_dim != dst->head_dim ||
        src->dtype != dst->dtype) {
        return kvk__fail(KV_EINVAL, "copy_blocks: src and dst differ in shape or dtype");
    }
    return KV_OK;
}

/* Tier copies are streams: the destination is not read again soon, and a copy larger than the
 * caches pays for every written line twice with ordinary stores (the line is read for ownership,
 * then written back). Above this many bytes in one call, copy_blocks writes with non-temporal
 * stores, as glibc's memcpy itself does for large copies; below it, the destination stays in
 * cache for a reader that follows. */
#define STREAM_MIN_BYTES (4u << 20)

#if defined(__SSE2__)
/* The SSE2 form of simd_copy_nt (kvk_simd_body.h), for CPUs without AVX2 or KVK_SIMD=scalar:
 * 16-byte aligned non-temporal stores, four interleaved quarters of 64-byte steps. */
static void copy_nt_sse2(char *to, const char *from, size_t n) {
    size_t head = (16 - ((uintptr_t)to & 15)) & 15;
    head = head < n ? head : n;
    memcpy(to, from, head);
    to += head;
    from += head;
    n -= head;
    size_t q = n / 256 * 64;
    for (size_t o = 0; o < q; o += 64) {
        for (int k = 0; k < 4; k++) {
            const char *f = from + (size_t)k * q + o;
            char *t = to + (size_t)k * q + o;
            __builtin_prefetch(f + 512);
            __m128i a = _mm_loadu_si128((const __m128i *)f);
            __m128i b = _mm_loadu_si128((const __m128i *)(f + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(f + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(f + 48));
            _mm_stream_si128((__m128i *)t, a);
            _mm_stream_si128((__m128i *)(t + 16), b);
            _mm_stream_si128((__m128i *)(t + 32), c);
            _mm_stream_si128((__m128i *)(t + 48), d);
        }
    }
    memcpy(to + 4 * q, from + 4 * q, n - 4 * q);
}
#endif

void kvk__copy_nt(const kvk__simd_ops *ops, void *to, const void *from, size_t n) {
    if (ops != NULL) {
        ops->copy_nt(to, from, n);
        return;
    }
#if defined(__SSE2__)
    copy_nt_sse2(to, from, n);
#else
    memcpy(to, from, n);
#endif
}

void kvk__copy_fence(void) {
#if defined(__SSE2__)
    _mm_sfence(); /* the streamed stores are visible before the caller reads or hands off */
#endif
}

void kvk_copy_stream(void *dst, const void *src, size_t n) {
    if (n < KVK_STREAM_MIN) {
        memcpy(dst, src, n);
        return;
    }
    kvk__copy_nt(kvk__ops(), dst, src, n);
    kvk__copy_fence();
}

kv_err kvk_copy_blocks_cpu(const kvk_cache *src, const kvk_cache *dst, const int32_t *src_blocks,
                           const int32_t *dst_blocks, uint32_t n) {
    kv_err rc = kvk__check_copy(src, dst);
    if (rc != KV_OK) {
        return rc;
    }
    if (n > 0 && (src_blocks == NULL || dst_blocks == NULL)) {
        return kvk__fail(KV_EINVAL, "copy_blocks: null block list");
    }
    /* Check every id first so a bad list copies nothing. */
    for (uint32_t i = 0; i < n; i++) {
        if (src_blocks[i] < 0 || (uint32_t)src_blocks[i] >= src->num_blocks || dst_blocks[i] < 0 ||
            (uint32_t)dst_blocks[i] >= dst->num_blocks) {
            return kvk__fail(KV_EINVAL, "copy_blocks: pair %u (%d -> %d) out of range", i,
                             src_blocks[i], dst_blocks[i]);
        }
    }
    size_t chunk = (size_t)src->tokens_per_block * src->num_kv_heads * src->head_dim *
                   kvk_dtype_bytes(src->dtype);
    size_t scale_chunk = (size_t)src->num_kv_heads * sizeof(float);
    int scaled = kvk__is_scaled(src->dtype);
    int stream = (uint64_t)n * src->num_sections * chunk >= STREAM_MIN_BYTES;
    const kvk__simd_ops *ops = stream ? kvk__ops() : NULL;
    for (uint32_t i = 0; i < n; i++) {
        for (uint32_t s = 0; s < src->num_sections; s++) {
            const char *from = (const char *)src->data + src_blocks[i] * src->block_stride +
                               (int64_t)s * src->section_stride;
            char *to = (char *)dst->data + dst_blocks[i] * dst->block_stride +
                       (int64_t)s * dst->section_stride;
            if (stream) {
                kvk__copy_nt(ops, to, from, chunk);
            } else {
                memcpy(to, from, chunk);
            }
            if (scaled) {
                from = (const char *)src->scales + src_blocks[i] * src->scale_block_stride +
                       (int64_t)s * src->scale_section_stride;
                to = (char *)dst->scales + dst_blocks[i] * dst->scale_block_stride +
                     (int64_t)s * dst->scale_section_stride;
                memcpy(to, from, scale_chunk);
            }
        }
    }
    if (stream) {
        kvk__copy_fence();
    }
    return KV_OK;
}

kv_err kvk__check_reshape(const kvk_cache *c, uint32_t layer, const kvk_tokens *t) {
    kv_err rc = kvk__check_cache(c, "reshape_and_cache");
    if (rc != KV_OK) {
        return rc;
    }
    if (t == NULL || t->k == NULL || t->v == NULL || !kvk__is_wide(t->dtype)) {
        return kvk__fail(KV_EINVAL, "reshape_and_cache: null tokens or dtype not fp16/bf16/fp32");
    }
    if ((uint64_t)layer * 2 + 1 >= c->num_sections) {
        return kvk__fail(KV_EINVAL, "reshape_and_cache: layer %u out of range", layer);
    }
    if (kvk__is_scaled(c->dtype) && (t->k_scale == NULL || t->v_scale == NULL)) {
        return kvk__fail(KV_EINVAL, "reshape_and_cache: 8-bit cache needs k_scale and v_scale");
    }
    return KV_OK;
}

kv_err kvk_reshape_and_cache_cpu(const kvk_cache *cache, uint32_t layer, const kvk_tokens *t,
                                 const int64_t *slot_mapping, uint32_t ntokens) {
    kv_err rc = kvk__check_reshape(cache, layer, t);
    if (rc != KV_OK) {
        return rc;
    }
    if (ntokens > 0 && slot_mapping == NULL) {
        return kvk__fail(KV_EINVAL, "reshape_and_cache: null slot mapping");
    }
    uint64_t nslots = (uint64_t)cache->num_blocks * cache->tokens_per_block;
    for (uint32_t i = 0; i < ntokens; i++) {
        if (slot_mapping[i] >= 0 && (uint64_t)slot_mapping[i] >= nslots) {
            return kvk__fail(KV_EINVAL, "reshape_and_cache: slot %lld of token %u out of range",
                             (long long)slot_mapping[i], i);
        }
    }
    const kvk__simd_ops *ops = kvk__ops();
    if (ops == NULL) {
        kvk__reshape_ref(cache, layer, t, slot_mapping, ntokens);
        return KV_OK;
    }
    uint32_t heads = cache->num_kv_heads;
    uint32_t dim = cache->head_dim;
    uint32_t eb = kvk_dtype_bytes(cache->dtype), tb = kvk_dtype_bytes(t->dtype);
    int scaled = kvk__is_scaled(cache->dtype);
    for (uint32_t i = 0; i < ntokens; i++) {
        if (slot_mapping[i] < 0) {
            continue;
        }
        int64_t block = slot_mapping[i] / cache->tokens_per_block;
        int64_t off = slot_mapping[i] % cache->tokens_per_block;
        for (int kv = 0; kv < 2; kv++) {
            const char *src = (const char *)(kv == KV_K ? t->k : t->v) + (int64_t)i * t->row_stride;
            uint32_t section = layer * 2 + (uint32_t)kv;
            char *dst = (char *)cache->data + block * cache->block_stride +
                        (int64_t)section * cache->section_stride +
                        off * (int64_t)((uint64_t)heads * dim * eb);
            const float *scale = kv == KV_K ? t->k_scale : t->v_scale;
            for (uint32_t h = 0; h < heads; h++) {
                float div = 1.0f;
                if (scaled) {
                    float *slot =
                        (float *)((char *)cache->scales + block * cache->scale_block_stride +
                                  (int64_t)section * cache->scale_section_stride) +
                        h;
                    *slot = scale[h];
                    div = scale[h];
                }
                kvk__convert(ops, t->dtype, src + (uint64_t)h * dim * tb, 1.0f, cache->dtype,
                             dst + (uint64_t)h * dim * eb, dim, div);
            }
        }
    }
    return KV_OK;
}

void kvk__reshape_ref(const kvk_cache *cache, uint32_t layer, const kvk_tokens *t,
                      const int64_t *slot_mapping, uint32_t ntokens) {
    uint32_t heads = cache->num_kv_heads;
    uint32_t dim = cache->head_dim;
    uint64_t token_elems = (uint64_t)heads * dim;
    uint32_t eb = kvk_dtype_bytes(cache->dtype);
    int scaled = kvk__is_scaled(cache->dtype);
    for (uint32_t i = 0; i < ntokens; i++) {
        if (slot_mapping[i] < 0) {
            continue;
        }
        int64_t block = slot_mapping[i] / cache->tokens_per_block;
        int64_t off = slot_mapping[i] % cache->tokens_per_block;
        for (int kv = 0; kv < 2; kv++) {
            const void *src = (const char *)(kv == KV_K ? t->k : t->v) + (int64_t)i * t->row_stride;
            uint32_t section = layer * 2 + (uint32_t)kv;
            char *dst = (char *)cache->data + block * cache->block_stride +
                        (int64_t)section * cache->section_stride +
                        off * (int64_t)(token_elems * eb);
            const float *scale = kv == KV_K ? t->k_scale : t->v_scale;
            for (uint32_t h = 0; h < heads; h++) {
                float inv = 1.0f;
                if (scaled) {
                    float *slot =
                        (float *)((char *)cache->scales + block * cache->scale_block_stride +
                                  (int64_t)section * cache->scale_section_stride) +
                        h;
                    *slot = scale[h];
                    inv = scale[h];
                }
                for (uint32_t d = 0; d < dim; d++) {
                    uint64_t e = (uint64_t)h * dim + d;
                    float x = kvk_load_f32(t->dtype, src, e);
                    /* Divide (not multiply by a reciprocal) so the GPU twin rounds alike. */
                    kvk_store_f32(cache->dtype, dst, e, scaled ? x / inv : x);
                }
            }
        }
    }
}
