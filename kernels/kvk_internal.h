/* kvk_internal: helpers shared by the CPU twins and the CUDA launchers (not part of the ABI).
 * Argument checks live here so both sides refuse exactly the same calls.
 */
#ifndef KVK_INTERNAL_H
#define KVK_INTERNAL_H

#include <stdarg.h>

#include "kernels/kvk.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Records a formatted message as the calling thread's kvk_last_error() and returns code. */
kv_err kvk__fail(kv_err code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* KV_OK when c has a known dtype, non-zero shape, and scales where the dtype needs them; else
 * records why and returns KV_EINVAL. */
kv_err kvk__check_cache(const kvk_cache *c, const char *what);

/* Checks that src and dst can exchange blocks (same shape and dtype). */
kv_err kvk__check_copy(const kvk_cache *src, const kvk_cache *dst);

/* Checks a reshape_and_cache call's host-side arguments. */
kv_err kvk__check_reshape(const kvk_cache *c, uint32_t layer, const kvk_tokens *t);

/* Checks a decode attention call's host-side arguments (not the device page table). */
kv_err kvk__check_decode(const kvk_cache *c, uint32_t layer, const kvk_page_table *pt,
                         const kvk_decode_args *a);

/* Checks quantize (quant = 1) or dequantize (quant = 0) dtypes and dimensions. */
kv_err kvk__check_quant(kv_dtype wide, kv_dtype narrow, uint64_t n, uint32_t tokens, uint32_t heads,
                        uint32_t dim, int quant);

/* Checks a compact_tokens call's host-side arguments (not the device lists). */
kv_err kvk__check_compact(const kvk_cache *src, const kvk_cache *dst, const void *src_slots,
                          uint32_t nkept, const void *dst_blocks);

/* Checks a token_scores call's host-side arguments (not the device page list). */
kv_err kvk__check_scores(const kvk_cache *c, uint32_t layer, const void *pages, uint32_t ntokens,
                         const kvk_score_args *a, const void *scores);

/* Checks a page_summaries call's host-side arguments. */
kv_err kvk__check_summaries(const kvk_cache *c, const void *blocks, uint32_t n, const void *out);

/* Checks a page_select call's host-side arguments. */
kv_err kvk__check_select(const kvk_select_args *a, const void *out);

/* 1 for fp16, bf16, fp32 (the dtypes of activations: q, out, new K/V). */
int kvk__is_wide(kv_dtype d);

/* 1 for the 8-bit dtypes that carry scales. */
int kvk__is_scaled(kv_dtype d);

/* ---- Reference twins --------------------------------------------------------------------------
 * The scalar code each public kvk_<op>_cpu runs when no vector unit is used (KVK_SIMD=scalar or a
 * CPU without AVX2+FMA+F16C). Arguments are checked by the public function first; these are what
 * the vectorised kernels are compared against (kvk_simd_test). Calling thread only. */
kv_err kvk__decode_ref(const kvk_cache *c, uint32_t layer, const kvk_page_table *pt,
                       const kvk_decode_args *a);
kv_err kvk__prefill_ref(const kvk_cache *c, uint32_t layer, const kvk_page_table *pt,
                        const kvk_prefill_args *a);
void kvk__reshape_ref(const kvk_cache *c, uint32_t layer, const kvk_tokens *t,
                      const int64_t *slot_mapping, uint32_t ntokens);
void kvk__quantize_ref(kv_dtype src_dtype, const void *src, kv_dtype dst_dtype, void *dst,
                       float *scales, uint64_t n, uint32_t tokens, uint32_t heads, uint32_t dim);
void kvk__dequantize_ref(kv_dtype src_dtype, const void *src, const float *scales,
                         kv_dtype dst_dtype, void *dst, uint64_t n, uint32_t tokens, uint32_t heads,
                         uint32_t dim);

/* ---- Vector kernels and their dispatch ----------------------------------------------------- */

enum {
    KVK__SIMD_SCALAR = 0, /* the reference twins */
    KVK__SIMD_AVX2 = 1,   /* AVX2 + FMA + F16C */
    KVK__SIMD_AVX512 = 2, /* AVX-512F on top of those */
};

/* Query vectors one attention task handles at most (its scratch holds their accumulators). */
#define KVK__ATTN_QMAX 64
/* Tokens one step of the tiled attention loop converts and scores at once. */
#define KVK__ATTN_TILE 8
/* Query vectors per KV head up to which a task converts K and V in registers, not into scratch
 * (when head_dim is a multiple of 16), and may cover several KV heads. */
#define KVK__ATTN_DIRECT_NQ 8

/* One attention call, as the vector kernels see it (decode is prefill with one row per request). */
typedef struct kvk__attn_job {
    const kvk_cache *c;
    uint32_t layer;
    const kvk_page_table *pt;
    const int32_t *qo_indptr; /* [batch+1] query rows of each request; NULL: one row each */
    const void *q;            /* [rows][num_qo_heads][head_dim] */
    void *out;                /* same shape */
    float *lse;               /* [rows][num_qo_heads] or NULL */
    kv_dtype qo_dtype;        /* fp16, bf16, fp32 */
    uint32_t num_qo_heads;    /* multiple of the cache's kv heads */
    uint32_t group;           /* num_qo_heads / num_kv_heads */
    uint32_t dimp;            /* head_dim rounded up to 16: rows of the float scratch */
    float q_mul;              /* sm_scale * log2(e): scores are kept in base 2 */
    int causal;               /* row j of n sees tokens 0 .. len - n + j */
} kvk__attn_job;

/* One task: query vectors qi0 .. qi0 + nq - 1 of (request, kv head h) for the nheads KV heads
 * h = kv_head .. kv_head + nheads - 1, where query vector qi is row qi / group of the request and
 * query head h * group + qi % group. nheads * nq <= KVK__ATTN_QMAX. */
typedef struct kvk__attn_task {
    uint32_t req;
    uint32_t kv_head;
    uint32_t qi0;
    uint32_t nq;
    uint32_t nheads; /* 1, or more where nq <= KVK__ATTN_DIRECT_NQ and head_dim % 16 == 0 */
} kvk__attn_task;

/* Floats of scratch one worker needs for a task of job j (64-byte aligned by the caller). */
size_t kvk__attn_scratch_floats(const kvk__attn_job *j);

/* The kernels of one instruction set; every table entry is byte-exact against the twins except
 * attend, whose float sums run in another order (tolerances in docs/KERNELS.md). */
typedef struct kvk__simd_ops {
    const char *name;
    /* dst[i] = element i of src (dtype d; 8-bit: the code) * mul, i < n; mul == 1 multiplies
     * nothing. */
    void (*to_f32)(kv_dtype d, const void *src, uint64_t n, float mul, float *dst);
    /* element i of dst (dtype d) = src[i] / div rounded as kvk_store_f32 does; div == 1 divides
     * nothing (so fp32 NaN payloads pass unchanged). */
    void (*from_f32)(kv_dtype d, const float *src, uint64_t n, float div, void *dst);
    /* max |src[i]| (NaN ignored as fmaxf-free comparisons do in the twin: x > m). */
    float (*absmax)(const float *src, uint64_t n);
    /* Runs one attention task with scratch of kvk__attn_scratch_floats floats. */
    void (*attend)(const kvk__attn_job *j, const kvk__attn_task *t, float *scratch);
    /* memcpy of n bytes (not overlapping) with non-temporal stores, unfenced: kvk__copy_nt. */
    void (*copy_nt)(void *to, const void *from, size_t n);
} kvk__simd_ops;

extern const kvk__simd_ops kvk__simd_avx2;
extern const kvk__simd_ops kvk__simd_avx512;

/* The table calls use now (NULL: the scalar twins). Chosen once from CPUID and KVK_SIMD. */
const kvk__simd_ops *kvk__ops(void);

/* Tests: use level (KVK__SIMD_*) from now on, capped at what the CPU has; returns the level set. */
int kvk__simd_force(int level);

/* dst (dtype dd) = src (dtype sd) * mul / div, element by element through float32, n elements,
 * rounding exactly as kvk_load_f32 / kvk_store_f32 (div == 1: no division). */
void kvk__convert(const kvk__simd_ops *ops, kv_dtype sd, const void *src, float mul, kv_dtype dd,
                  void *dst, uint64_t n, float div);

/* memcpy of n bytes between buffers that do not overlap, for bytes that are not read again
 * soon (tier copies): the stores bypass the caches (non-temporal), so a copy larger than the
 * caches writes each line once instead of reading it for ownership first, and the bytes move in
 * four interleaved streams (the quarters of the copy, a few cache lines of each in turn), which
 * keeps more lines in flight from wherever the source lies than one front does. Unfenced: the
 * caller issues kvk__copy_fence() before anything else may read the destination or learn that
 * the copy is done. ops: kvk__ops() (NULL: the SSE2 or plain fallback). */
void kvk__copy_nt(const kvk__simd_ops *ops, void *to, const void *from, size_t n);
void kvk__copy_fence(void);

/* Workers a call starting now may use: kvk_threads(). Size per-worker scratch with it and pass
 * it to kvk__parallel_for (the count may change in between). */
uint32_t kvk__workers(void);

/* Runs fn(ctx, task, worker) for task 0 .. ntasks - 1 on up to max_workers threads of the pool
 * (the caller is worker 0; worker < max_workers). Each task runs exactly once, on one thread;
 * which thread runs which task varies, so results must not depend on it. When another call holds
 * the pool, everything runs on the caller. */
void kvk__parallel_for(uint64_t ntasks, uint32_t max_workers,
                       void (*fn)(void *ctx, uint64_t task, uint32_t worker), void *ctx);

#ifdef __cplusplus
}
#endif

#endif
