/* kvk_quant: CPU twins of quantize_blocks and dequantize_blocks (fp16/bf16/fp32 <-> int8 or
 * fp8-e4m3 with one float32 scale per (group, head)).
 *
 * A group is `tokens` consecutive tokens, so the same code gives per-(token, head) scales
 * (tokens = 1) and the per-(block, head) scales of kvd's 8-bit layouts (tokens = block size).
 * The vector path (kvk__ops()) converts through float32 rows and runs groups on kvk_threads()
 * threads; it is byte-exact against the scalar loops kept as kvk__quantize_ref / _dequantize_ref.
 */
#include <math.h>
#include <string.h>

#include "kernels/kvk_dtype.h"
#include "kernels/kvk_internal.h"

kv_err kvk__check_quant(kv_dtype wide, kv_dtype narrow, uint64_t n, uint32_t tokens, uint32_t heads,
                        uint32_t dim, int quant) {
    if (!kvk__is_wide(wide) || !kvk__is_scaled(narrow)) {
        return kvk__fail(KV_EINVAL, "%s: dtypes must be fp16/bf16/fp32 and int8/fp8_e4m3",
                         quant ? "quantize_blocks" : "dequantize_blocks");
    }
    if (tokens == 0 || heads == 0 || dim == 0) {
        return kvk__fail(KV_EINVAL, "%s: zero tokens, heads or dim",
                         quant ? "quantize_blocks" : "dequantize_blocks");
    }
    (void)n;
    return KV_OK;
}

/* One call of the vector path; a task is one group (disjoint outputs, so any thread). */
typedef struct quant_run {
    const kvk__simd_ops *ops;
    int quant;     /* 1: wide -> narrow, 0: narrow -> wide */
    kv_dtype wdt;  /* wide dtype */
    void *wide;    /* quant: source (read only); dequant: destination */
    kv_dtype ndt;  /* narrow dtype */
    void *narrow;  /* quant: destination; dequant: source */
    float *scales; /* [n][heads] */
    uint32_t tokens, heads, dim;
} quant_run;

static void quant_group(void *ctx, uint64_t g, uint32_t worker) {
    enum { CHUNK = 512 };
    const quant_run *x = ctx;
    (void)worker;
    uint64_t token_elems = (uint64_t)x->heads * x->dim;
    uint32_t wb = kvk_elem_bytes(x->wdt);
    float *sc = x->scales + g * x->heads;
    for (uint32_t h = 0; h < x->heads; h++) {
        if (x->quant) {
            float absmax = 0.0f, buf[CHUNK];
            for (uint32_t t = 0; t < x->tokens; t++) {
                uint64_t e = (g * x->tokens + t) * token_elems + (uint64_t)h * x->dim;
                for (uint32_t d = 0; d < x->dim; d += CHUNK) {
                    uint32_t m = x->dim - d < CHUNK ? x->dim - d : CHUNK;
                    x->ops->to_f32(x->wdt, (const char *)x->wide + (e + d) * wb, m, 1.0f, buf);
                    float a = x->ops->absmax(buf, m);
                    absmax = a > absmax ? a : absmax;
                }
            }
            float qmax = x->ndt == KV_DTYPE_INT8 ? KVK_INT8_MAX : KVK_FP8_E4M3_MAX;
            sc[h] = absmax > 0.0f ? absmax / qmax : 1.0f;
        }
        for (uint32_t t = 0; t < x->tokens; t++) {
            uint64_t e = (g * x->tokens + t) * token_elems + (uint64_t)h * x->dim;
            if (x->quant) {
                kvk__convert(x->ops, x->wdt, (const char *)x->wide + e * wb, 1.0f, x->ndt,
                             (char *)x->narrow + e, x->dim, sc[h]);
            } else {
                kvk__convert(x->ops, x->ndt, (const char *)x->narrow + e, sc[h], x->wdt,
                             (char *)x->wide + e * wb, x->dim, 1.0f);
            }
        }
    }
}

kv_err kvk_quantize_blocks_cpu(kv_dtype src_dtype, const void *src, kv_dtype dst_dtype, void *dst,
                               float *scales, uint64_t n, uint32_t tokens, uint32_t heads,
                               uint32_t dim) {
    kv_err rc = kvk__check_quant(src_dtype, dst_dtype, n, tokens, heads, dim, 1);
    if (rc != KV_OK) {
        return rc;
    }
    if (n > 0 && (src == NULL || dst == NULL || scales == NULL)) {
        return kvk__fail(KV_EINVAL, "quantize_blocks: null array");
    }
    const kvk__simd_ops *ops = kvk__ops();
    if (ops == NULL) {
        kvk__quantize_ref(src_dtype, src, dst_dtype, dst, scales, n, tokens, heads, dim);
        return KV_OK;
    }
    quant_run x = {ops, 1, src_dtype, (void *)src, dst_dtype, dst, scales, tokens, heads, dim};
    kvk__parallel_for(n, kvk__workers(), quant_group, &x);
    return KV_OK;
}

void kvk__quantize_ref(kv_dtype src_dtype, const void *src, kv_dtype dst_dtype, void *dst,
                       float *scales, uint64_t n, uint32_t tokens, uint32_t heads, uint32_t dim) {
    float qmax = dst_dtype == KV_DTYPE_INT8 ? KVK_INT8_MAX : KVK_FP8_E4M3_MAX;
    uint64_t token_elems = (uint64_t)heads * dim;
    for (uint64_t g = 0; g < n; g++) {
        uint64_t base = g * tokens * token_elems;
        for (uint32_t h = 0; h < heads; h++) {
            float absmax = 0.0f;
            for (uint32_t t = 0; t < tokens; t++) {
                for (uint32_t d = 0; d < dim; d++) {
                    float x = fabsf(kvk_load_f32(src_dtype, src,
                                                 base + t * token_elems + (uint64_t)h * dim + d));
                    absmax = x > absmax ? x : absmax;
                }
            }
            float scale = absmax > 0.0f ? absmax / qmax : 1.0f;
            scales[g * heads + h] = scale;
            for (uint32_t t = 0; t < tokens; t++) {
                for (uint32_t d = 0; d < dim; d++) {
                    uint64_t e = base + t * token_elems + (uint64_t)h * dim + d;
                    kvk_store_f32(dst_dtype, dst, e, kvk_load_f32(src_dtype, src, e) / scale);
                }
            }
        }
    }
}

kv_err kvk_dequantize_blocks_cpu(kv_dtype src_dtype, const void *src, const float *scales,
                                 kv_dtype dst_dtype, void *dst, uint64_t n, uint32_t tokens,
                                 uint32_t heads, uint32_t dim) {
    kv_err rc = kvk__check_quant(dst_dtype, src_dtype, n, tokens, heads, dim, 0);
    if (rc != KV_OK) {
        return rc;
    }
    if (n > 0 && (src == NULL || dst == NULL || scales == NULL)) {
        return kvk__fail(KV_EINVAL, "dequantize_blocks: null array");
    }
    const kvk__simd_ops *ops = kvk__ops();
    if (ops == NULL) {
        kvk__dequantize_ref(src_dtype, src, scales, dst_dtype, dst, n, tokens, heads, dim);
        return KV_OK;
    }
    quant_run x = {ops,    0,     dst_dtype, dst, src_dtype, (void *)src, (float *)scales,
                   tokens, heads, dim};
    kvk__parallel_for(n, kvk__workers(), quant_group, &x);
    return KV_OK;
}

void kvk__dequantize_ref(kv_dtype src_dtype, const void *src, const float *scales,
                         kv_dtype dst_dtype, void *dst, uint64_t n, uint32_t tokens, uint32_t heads,
                         uint32_t dim) {
    uint64_t token_elems = (uint64_t)heads * dim;
    for (uint64_t g = 0; g < n; g++) {
        for (uint32_t t = 0; t < tokens; t++) {
            for (uint32_t h = 0; h < heads; h++) {
                float scale = scales[g * heads + h];
                for (uint32_t d = 0; d < dim; d++) {
                    uint64_t e = (g * tokens + t) * token_elems + (uint64_t)h * dim + d;
                    kvk_store_f32(dst_dtype, dst, e, kvk_load_f32(src_dtype, src, e) * scale);
                }
            }
        }
    }
}
