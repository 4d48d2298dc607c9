/* kvk: the KV kernels' plain C ABI. No CUDA types appear here, so C code links these whether or
 * not the build had nvcc; each GPU kernel has a CPU reference twin with the same arguments.
 *
 * Every kernel addresses KV memory through one affine descriptor, kvk_cache: the element data of
 * (block b, section s) starts at data + b * block_stride + s * section_stride, where section
 * s = layer * 2 + (KV_K | KV_V), and holds [tokens_per_block][num_kv_heads][head_dim] elements.
 * That one shape covers a kvd segment in either arrangement of common/kv_layout.h
 * (kvk_cache_from_segment) and an engine's own per-layer K and V tensors (vLLM, FlashInfer NHD).
 * The 8-bit dtypes (fp8-e4m3, int8) carry float32 scales per (block, section, head) at
 * scales + b * scale_block_stride + s * scale_section_stride + head * 4; a stored element q means
 * the value q * scale.
 *
 * Naming: kvk_<op>_cpu runs on the calling thread over host memory and is the reference ("twin")
 * of kvk_<op>_cuda, which takes device addresses (cudaMalloc, pinned host memory mapped with
 * UVA, or CUDA VMM) and a cudaStream_t passed as void * (NULL: the legacy default stream), and
 * only enqueues work. Launchers return KV_ENOGPU when the binary was built without CUDA or no
 * device is usable, KV_EINVAL for arguments checked on the host (a null array, a shape, an
 * address or stride not aligned to its element: a misaligned device access would kill the
 * caller's whole context), KV_ENOTSUP for a shape the GPU kernel does not handle (the message
 * says which), and KV_EINTERNAL when the CUDA runtime fails. A CUDA error an earlier call left
 * pending is reported as such ("not launched: an earlier CUDA call had failed") and cleared,
 * never blamed on the launch.
 * kvk_last_error() then says why. Device-resident index arrays cannot be checked on the host:
 * GPU kernels skip entries out of range instead of touching memory outside the caller's cache.
 *
 * Thread: all functions may be called from any thread; none keeps state except the
 * thread-local error message and the CPU kernels' thread count and instruction set (below).
 *
 * CPU kernels: each kvk_<op>_cpu runs vectorised (AVX2+FMA+F16C, or AVX-512F where present,
 * chosen at run time from CPUID) unless the environment variable KVK_SIMD=scalar (or avx2) caps
 * it, and then runs the scalar reference code, which is also what a CPU without AVX2 runs.
 * Attention runs on kvk_threads() threads (KVK_THREADS in the environment, default 1), split over
 * (request, KV head); the results do not depend on the thread count.
 */
#ifndef KVK_H
#define KVK_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"
#include "common/kv_layout.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Reports how many CUDA devices this process can use (0 when none, when the driver is missing,
 * or when the build had no nvcc) and writes a one-line reason into why (always NUL-terminated).
 * Never fails and never aborts; safe to call on a machine without a GPU. Any thread. */
int kvk_gpu_probe(char *why, size_t why_len);

/* 1 when this binary contains compiled CUDA kernels, else 0. */
int kvk_built_with_cuda(void);

/* ---- Errors ---------------------------------------------------------------------------------- */

/* The calling thread's message for the last kvk call that failed ("" when none). Static
 * thread-local storage; valid until the thread's next failing kvk call. */
const char *kvk_last_error(void);

/* ---- CPU kernels: instruction set and threads ----------------------------------------------- */

/* "avx512", "avx2" or "scalar": what the CPU kernels use in this process (CPUID, capped by the
 * environment variable KVK_SIMD=scalar|avx2|avx512 read at the first call). Any thread. */
const char *kvk_simd_name(void);

/* Sets how many threads the CPU attention and quantize kernels use (1 .. KVK_MAX_THREADS; the
 * calling thread is one of them, the others are started on first use and kept). The default is
 * KVK_THREADS from the environment, else 1. Waits for a kernel call running on the pool to
 * finish. Outputs are bitwise the same for every count: each (request, KV head) is computed by
 * one thread in a fixed order. A kernel called while another call holds the pool runs on its
 * calling thread alone. KV_EINVAL for n out of range; KV_ENOMEM / KV_EINTERNAL when a thread
 * cannot be started (the count is then unchanged). Any thread. */
#define KVK_MAX_THREADS 64
kv_err kvk_set_threads(uint32_t n);

/* The current thread count (>= 1). Any thread. */
uint32_t kvk_threads(void);

/* ---- Cache descriptor ------------------------------------------------------------------------ */

typedef struct kvk_cache {
    uintptr_t data;               /* address of (block 0, section 0) element data */
    int64_t block_stride;         /* bytes from block b's data to block b+1's, same section */
    int64_t section_stride;       /* bytes from section s's data to section s+1's, same block */
    uintptr_t scales;             /* address of (block 0, section 0) scales; 0 unless 8-bit */
    int64_t scale_block_stride;   /* bytes from block b's scales to block b+1's */
    int64_t scale_section_stride; /* bytes from section s's scales to section s+1's */
    uint32_t num_blocks;          /* valid block ids: 0 .. num_blocks-1 */
    uint32_t num_sections;        /* 2 * layers (K and V of each layer) */
    uint32_t tokens_per_block;    /* tokens in one block (FlashInfer: page_size) */
    uint32_t num_kv_heads;        /* KV heads */
    uint32_t head_dim;            /* elements per head */
    kv_dtype dtype;               /* element type */
} kvk_cache;

/* Describes a segment of nblocks blocks of layout l whose first byte is at base (host or device
 * address). Uses only l's public fields and the formulas documented in common/kv_layout.h.
 * KV_EINVAL when l's arrangement or dtype is unknown or nblocks is 0. Writes *out on success. */
kv_err kvk_cache_from_segment(const kv_layout *l, uintptr_t base, uint32_t nblocks, kvk_cache *out);

/* Bytes of one element of d (fp8 and int8: 1); 0 for an unknown dtype. */
uint32_t kvk_dtype_bytes(kv_dtype d);

/* ---- copy_blocks ----------------------------------------------------------------------------- */

/* For i in 0..n-1 copies every section (all layers, K and V) of block src_blocks[i] of src into
 * block dst_blocks[i] of dst, scales included. src and dst must agree in num_sections,
 * tokens_per_block, num_kv_heads, head_dim and dtype; their strides may differ, which is how
 * layer-major and block-major segments convert into each other. The blocks copied must not
 * overlap the blocks written. KV_EINVAL on a shape mismatch or a block id out of range (nothing is
 * copied then). Arrays are borrowed. */
kv_err kvk_copy_blocks_cpu(const kvk_cache *src, const kvk_cache *dst, const int32_t *src_blocks,
                           const int32_t *dst_blocks, uint32_t n);

/* memcpy of n bytes between host buffers that do not overlap, for a destination that is not
 * read again soon (a tier's copy of a block): non-temporal stores (no read for ownership, no
 * cache lines evicted for it) in four interleaved streams, AVX2 where the CPU has it (KVK_SIMD
 * applies), SSE2 otherwise; fenced before it returns. Under KVK_STREAM_MIN bytes it is memcpy.
 * copy_blocks uses the same copy for calls of 4 MiB or more. */
#define KVK_STREAM_MIN 4096u
void kvk_copy_stream(void *dst, const void *src, size_t n);

/* GPU twin: one launch for all n blocks. src_blocks and dst_blocks are device arrays; a pair
 * with an id out of range is skipped. src or dst data may be pinned host memory (UVA), which
 * makes this a host<->device tier move. */
kv_err kvk_copy_blocks_cuda(const kvk_cache *src, const kvk_cache *dst, const int32_t *src_blocks,
                            const int32_t *dst_blocks, uint32_t n, void *stream);

/* ---- reshape_and_cache ----------------------------------------------------------------------- */

typedef struct kvk_tokens {
    const void *k;        /* new keys [ntokens] rows, each [num_kv_heads][head_dim] */
    const void *v;        /* new values, same shape */
    int64_t row_stride;   /* bytes between consecutive tokens' rows in k and v */
    kv_dtype dtype;       /* fp16, bf16 or fp32 */
    const float *k_scale; /* 8-bit caches: [num_kv_heads] scales to quantize K with; else NULL */
    const float *v_scale; /* 8-bit caches: same for V */
} kvk_tokens;

/* Writes token i's K and V into layer `layer` of cache at slot slot_mapping[i] (block =
 * slot / tokens_per_block, token in block = slot % tokens_per_block), converting to the cache's
 * dtype (round to nearest even; fp8-e4m3 saturates to +-448). A negative slot skips the token
 * (vLLM's padding convention). For 8-bit caches each element is stored as
 * round(x / scale) with the caller's per-head scale, and that scale is written to the block's
 * scale slot; a caller must use the same scales for every token of a block (engines use fixed
 * calibrated per-layer scales). KV_EINVAL for a bad dtype, a missing scale, a layer or slot out of
 * range (nothing written then). */
kv_err kvk_reshape_and_cache_cpu(const kvk_cache *cache, uint32_t layer, const kvk_tokens *t,
                                 const int64_t *slot_mapping, uint32_t ntokens);

/* GPU twin: t->k, t->v, the scales and slot_mapping are device addresses; out-of-range slots are
 * skipped. */
kv_err kvk_reshape_and_cache_cuda(const kvk_cache *cache, uint32_t layer, const kvk_tokens *t,
                                  const int64_t *slot_mapping, uint32_t ntokens, void *stream);

/* ---- paged_decode_attention ------------------------------------------------------------------ */

typedef struct kvk_page_table {
    const int32_t *indptr;        /* [batch+1]: request i owns indices[indptr[i]..indptr[i+1]) */
    const int32_t *indices;       /* block ids of each request's pages, in token order */
    const int32_t *last_page_len; /* [batch]: tokens in each request's last page, 1..page_size */
    uint32_t batch;               /* requests */
} kvk_page_table;

typedef struct kvk_decode_args {
    const void *q;         /* [batch][num_qo_heads][head_dim] one query token per request */
    void *out;             /* [batch][num_qo_heads][head_dim] attention output */
    float *lse;            /* [batch][num_qo_heads] natural log-sum-exp of scaled scores, or NULL */
    kv_dtype qo_dtype;     /* dtype of q and out: fp16, bf16 or fp32 */
    uint32_t num_qo_heads; /* multiple of the cache's num_kv_heads (GQA group = qo / kv) */
    float sm_scale;        /* score = sm_scale * dot(q, k); usually 1 / sqrt(head_dim) */
} kvk_decode_args;

/* Decode attention of each request's one query token over its pages of layer `layer` (FlashInfer's
 * CSR page table, see docs/KERNELS.md). Query head h reads KV head h / (num_qo_heads /
 * num_kv_heads). Accumulates in float32. A request with no pages writes zeros and lse = -inf.
 * KV_EINVAL for bad shapes or dtypes, a non-monotonic indptr, a last_page_len out of 1..page_size,
 * or a page id out of range (outputs undefined then). */
kv_err kvk_paged_decode_attention_cpu(const kvk_cache *cache, uint32_t layer,
                                      const kvk_page_table *pt, const kvk_decode_args *a);

/* ---- paged prefill attention (CPU) ----------------------------------------------------------- */

typedef struct kvk_prefill_args {
    const int32_t *qo_indptr; /* [batch+1]: request i's query rows are qo_indptr[i]..[i+1] */
    const void *q;            /* [rows][num_qo_heads][head_dim], rows = qo_indptr[batch] */
    void *out;                /* [rows][num_qo_heads][head_dim] */
    float *lse;               /* [rows][num_qo_heads] natural log-sum-exp, or NULL */
    kv_dtype qo_dtype;        /* fp16, bf16 or fp32 */
    uint32_t num_qo_heads;    /* multiple of the cache's num_kv_heads */
    float sm_scale;           /* score = sm_scale * dot(q, k) */
    int causal; /* 1: row j of a request with n rows and len tokens sees tokens 0 .. len - n + j
                   (FlashInfer's bottom-right causal mask); 0: every row sees all len tokens */
} kvk_prefill_args;

/* Attention of several query rows per request (prefill, or speculative verification) over the
 * request's pages, as FlashInfer's BatchPrefillWithPagedKVCache: the page table is the same CSR
 * as decode's, and each K/V row is read once for all query rows and heads of a task. A row that
 * sees no token writes zeros and lse = -inf. Same errors as decode, plus KV_EINVAL for a null or
 * decreasing qo_indptr. CPU only (no GPU kernel yet). */
kv_err kvk_paged_prefill_attention_cpu(const kvk_cache *cache, uint32_t layer,
                                       const kvk_page_table *pt, const kvk_prefill_args *a);

/* Bytes of float workspace with which kvk_paged_decode_attention_cuda can split each request's
 * pages into up to max_splits chunks (split-K) merged by log-sum-exp. */
size_t kvk_paged_decode_attention_workspace_bytes(uint32_t batch, uint32_t num_qo_heads,
                                                  uint32_t head_dim, uint32_t max_splits);

/* GPU twin: one CTA per (request, KV head, split) handling the whole GQA group. All pointers in
 * pt and a are device addresses. workspace (device, may be NULL) enables split-K when it holds
 * at least kvk_paged_decode_attention_workspace_bytes(..., 2); splits are chosen to fill the
 * device. The workspace is scratch of the launch until it completed: two launches that may run at
 * once (on two streams) need a workspace each, or they overwrite each other's partial states;
 * device. Page ids out of range are skipped. KV_ENOTSUP for head_dim other than 64, 128, 256
 * (fp32 caches: 64, 128). */
kv_err kvk_paged_decode_attention_cuda(const kvk_cache *cache, uint32_t layer,
                                       const kvk_page_table *pt, const kvk_decode_args *a,
                                       void *workspace, size_t workspace_bytes, void *stream);

/* ---- merge_states ---------------------------------------------------------------------------- */

#define KVK_MAX_MERGE_STATES 16

/* Merges num_states partial attention states over disjoint KV sets into one (cascade / shared
 * prefix attention): state j is v[j] [rows][head_dim] (dtype) with s[j] [rows] float32 natural
 * log-sum-exp; out = sum_j exp(s[j] - S) v[j], S = log sum_j exp(s[j]). A state with s = -inf
 * counts as empty; when all are empty out is 0 and S is -inf. rows is usually tokens * heads.
 * s_out may be NULL; out may alias v[0] and s_out may alias s[0] (the GPU twin then writes the
 * merged lse after the merge, in a second launch). KV_EINVAL for num_states outside
 * 1..KVK_MAX_MERGE_STATES or an unsupported dtype. */
kv_err kvk_merge_states_cpu(kv_dtype dtype, const void *const *v, const float *const *s,
                            uint32_t num_states, uint64_t rows, uint32_t head_dim, void *out,
                            float *s_out);

/* GPU twin; the arrays v and s are host arrays of device addresses. */
kv_err kvk_merge_states_cuda(kv_dtype dtype, const void *const *v, const float *const *s,
                             uint32_t num_states, uint64_t rows, uint32_t head_dim, void *out,
                             float *s_out, void *stream);

/* ---- quantize_blocks / dequantize_blocks ----------------------------------------------------- */

/* Quantizes n groups of [tokens][heads][dim] elements (src_dtype fp16, bf16 or fp32) into
 * dst_dtype int8 or fp8-e4m3, with one float32 scale per (group, head): scales [n][heads].
 * scale = absmax / qmax (qmax 127 for int8, 448 for fp8; 1 when the absmax is 0); int8 stores
 * clamp(rint(x / scale), -127, 127), fp8 stores x / scale rounded to nearest even. tokens = 1
 * gives a scale per (token, head); tokens = tokens_per_block quantizes a layer-major section's
 * blocks. Non-finite inputs give unspecified (but in-bounds) results. KV_EINVAL for bad dtypes
 * or a zero dimension. */
kv_err kvk_quantize_blocks_cpu(kv_dtype src_dtype, const void *src, kv_dtype dst_dtype, void *dst,
                               float *scales, uint64_t n, uint32_t tokens, uint32_t heads,
                               uint32_t dim);
kv_err kvk_quantize_blocks_cuda(kv_dtype src_dtype, const void *src, kv_dtype dst_dtype, void *dst,
                                float *scales, uint64_t n, uint32_t tokens, uint32_t heads,
                                uint32_t dim, void *stream);

/* The inverse: dst = src * scale, converted to dst_dtype (fp16, bf16 or fp32). */
kv_err kvk_dequantize_blocks_cpu(kv_dtype src_dtype, const void *src, const float *scales,
                                 kv_dtype dst_dtype, void *dst, uint64_t n, uint32_t tokens,
                                 uint32_t heads, uint32_t dim);
kv_err kvk_dequantize_blocks_cuda(kv_dtype src_dtype, const void *src, const float *scales,
                                  kv_dtype dst_dtype, void *dst, uint64_t n, uint32_t tokens,
                                  uint32_t heads, uint32_t dim, void *stream);

/* ---- Zipage: token scores and compaction (docs/ZIPAGE.md) ------------------------------------ */

typedef struct kvk_score_args {
    const void *q;         /* [nq][num_qo_heads][head_dim] the sequence's last queries (RoPE'd) */
    kv_dtype q_dtype;      /* fp16, bf16 or fp32 */
    uint32_t nq;           /* queries (Zipage keeps the last 16), 1..KVK_SCORE_MAX_Q */
    uint32_t num_qo_heads; /* multiple of the cache's num_kv_heads */
    float sm_scale;        /* score = sm_scale * dot(q, k) */
    int causal; /* 1: query j sees tokens 0 .. ntokens - nq + j (the queries are the last nq
                   tokens' own, as in prefill's bottom-right mask); 0: every query sees all */
} kvk_score_args;

#define KVK_SCORE_MAX_Q 256

/* Attention each cached token gets from a sequence's last queries, for token-level eviction:
 * for every query j and query head h, the softmax over the tokens it sees of
 * sm_scale * dot(q[j][h], k[t]) (query head h reads KV head h / (num_qo_heads / num_kv_heads)),
 * averaged over the nq * num_qo_heads (query, head) pairs and ADDED to scores[t] for t <
 * ntokens (so a caller sums layers by calling once per layer). The sequence's token t lives in
 * page pages[t / tokens_per_block] at offset t % tokens_per_block of layer `layer`. Float32
 * throughout; 8-bit keys are scaled. KV_EINVAL for bad shapes or dtypes, nq out of range,
 * ntokens 0, or a page id out of range. */
kv_err kvk_token_scores_cpu(const kvk_cache *cache, uint32_t layer, const int32_t *pages,
                            uint32_t ntokens, const kvk_score_args *a, float *scores);

/* GPU twin: pages, a->q and scores are device addresses. Workspace: device memory of
 * kvk_token_scores_workspace_bytes(nq, num_qo_heads) bytes (two passes: each (query, head)'s
 * max and sum, then one thread per token sums its probabilities in (query, head) order, so
 * results are deterministic; they match the twin up to float summation order). */
size_t kvk_token_scores_workspace_bytes(uint32_t nq, uint32_t num_qo_heads);
kv_err kvk_token_scores_cuda(const kvk_cache *cache, uint32_t layer, const int32_t *pages,
                             uint32_t ntokens, const kvk_score_args *a, float *scores,
                             void *workspace, size_t workspace_bytes, void *stream);

/* Gathers the kept token rows of one sequence into fresh blocks, every section (all layers, K
 * and V): kept token i (i < nkept) is read at slot src_slots[i] of src (block = slot /
 * tokens_per_block) and written at offset i % tokens_per_block of block dst_blocks[i /
 * tokens_per_block] of dst, so the fresh blocks hold the kept tokens densely in list order
 * (slots after the last kept token of the last block are left as they were). src and dst may be
 * one cache; no dst block may be a block any src slot reads. 8-bit caches: each fresh block's
 * scale per (section, head) is that of the block its first token comes from; a token from a
 * block with another scale is requantized (x * s_src / s_dst, rounded, saturated), a token with
 * the same scale is copied bit for bit (engines with fixed calibrated scales copy everything
 * exactly). KV_EINVAL on a shape mismatch or an id out of range (nothing is written then). */
kv_err kvk_compact_tokens_cpu(const kvk_cache *src, const kvk_cache *dst, const int64_t *src_slots,
                              uint32_t nkept, const int32_t *dst_blocks);

/* GPU twin: src_slots and dst_blocks are device arrays; out-of-range entries are skipped. */
kv_err kvk_compact_tokens_cuda(const kvk_cache *src, const kvk_cache *dst, const int64_t *src_slots,
                               uint32_t nkept, const int32_t *dst_blocks, void *stream);

/* ---- IceCache: page summaries and top-k page selection (docs/ICECACHE.md) ------------------- */

/* Floats of one block's summary: [layers][kv_heads][3][head_dim] (per channel, the keys' min,
 * max and mean over the block's tokens). */
#define KVK_SUMMARY_PARTS 3
#define KVK_SUMMARY_FLOATS(layers, heads, dim)                                                     \
    ((size_t)(layers) * (heads)*KVK_SUMMARY_PARTS * (dim))

/* For i < n: the summary of block blocks[i] of cache (its first ntok[i] tokens, all of them when
 * ntok is NULL; 0 tokens give min = +inf, max = -inf, mean = 0) into out + i *
 * KVK_SUMMARY_FLOATS: per (layer, KV head, channel) the min, the max and the mean (a float sum
 * in token order, divided by the count) over those tokens of the dequantized key.
 * KV_EINVAL for a bad cache, a block id out of range or a token count above tokens_per_block. */
kv_err kvk_page_summaries_cpu(const kvk_cache *cache, const int32_t *blocks, const uint32_t *ntok,
                              uint32_t n, float *out);

/* GPU twin: blocks, ntok and out are device arrays; out-of-range ids leave their summary
 * unwritten. Byte-exact with the twin (min and max are exact; the mean is summed in the same
 * order without fused operations). */
kv_err kvk_page_summaries_cuda(const kvk_cache *cache, const int32_t *blocks, const uint32_t *ntok,
                               uint32_t n, float *out, void *stream);

typedef struct kvk_select_args {
    const float *summaries; /* [npages] summaries (kvk_page_summaries layout) */
    uint32_t npages;        /* candidate pages */
    uint32_t num_layers;    /* layers of a summary */
    uint32_t layer;         /* the layer scored */
    uint32_t num_kv_heads;  /* KV heads of a summary */
    uint32_t head_dim;      /* channels */
    const float *q;         /* [num_qo_heads][head_dim] the step's query (float32) */
    uint32_t num_qo_heads;  /* multiple of num_kv_heads */
    uint32_t k;             /* pages kept per KV head (<= npages) */
    int mode;               /* KVK_SELECT_BOUND or KVK_SELECT_CENTROID */
} kvk_select_args;

#define KVK_SELECT_BOUND 0    /* score: the upper bound from min and max (Quest's) */
#define KVK_SELECT_CENTROID 1 /* score: q . mean (no bound; sharper on packed pages) */

/* Top-k pages per KV head by a score of the attention logit. KVK_SELECT_BOUND: for KV head g,
 * page p scores max over g's query heads h of sum_d max(q[h][d] * min[p][g][d], q[h][d] *
 * max[p][g][d]), which is >= q . k for every key k the page holds; KVK_SELECT_CENTROID: max over
 * h of sum_d q[h][d] * mean[p][g][d]. Both are exact when a page's keys are all equal. An empty
 * page (summarised over 0 tokens) scores -inf, a channel where q is 0 adds 0 (whatever the key,
 * infinite ones included), and a query head whose sum is NaN (inf - inf) does not count, so
 * every score is a number, +inf or -inf. out
 * [num_kv_heads][k]: each head's k best pages, in ascending page order (ties: the lower page
 * first). score (may be NULL) [num_kv_heads][npages]: the bounds. KV_EINVAL for bad shapes or
 * k > npages. */
kv_err kvk_page_select_cpu(const kvk_select_args *a, int32_t *out, float *score);

/* GPU twin: the arrays are device arrays and score is required (it is the kernel's workspace).
 * The bounds are summed in the twin's channel order without fused multiply-adds, so they, and
 * the pages chosen, equal the twin's. */
kv_err kvk_page_select_cuda(const kvk_select_args *a, int32_t *out, float *score, void *stream);

/* ---- Device memory helpers (tests, benchmarks, the example engine) --------------------------- */

typedef enum kvk_copy_kind {
    KVK_H2D = 1, /* host to device */
    KVK_D2H = 2, /* device to host */
    KVK_D2D = 3, /* device to device */
} kvk_copy_kind;

/* cudaMalloc; writes *out on success. KV_ENOGPU without CUDA, KV_ENOMEM when the device is full. */
kv_err kvk_dev_alloc(size_t bytes, void **out);
/* cudaFree; NULL is fine. */
void kvk_dev_free(void *p);
/* Pinned host memory mapped into the device's address space (cudaHostAlloc, mapped): the same
 * address works on host and device (UVA). */
kv_err kvk_host_alloc_pinned(size_t bytes, void **out);
void kvk_host_free_pinned(void *p);
/* Synchronous cudaMemcpy. */
kv_err kvk_dev_memcpy(void *dst, const void *src, size_t bytes, kvk_copy_kind kind);
/* Asynchronous cudaMemcpyAsync on stream (NULL: default stream). */
kv_err kvk_dev_memcpy_async(void *dst, const void *src, size_t bytes, kvk_copy_kind kind,
                            void *stream);
/* Waits for all work on the device; reports a failed earlier launch. */
kv_err kvk_dev_sync(void);

/* Event timing: kvk_timer_start records a start event on stream; kvk_timer_stop records the
 * stop event, waits for it and writes the elapsed milliseconds to *ms. One timer per thread. */
kv_err kvk_timer_start(void *stream);
kv_err kvk_timer_stop(void *stream, float *ms);

/* Streaming multiprocessors and peak memory bandwidth (GB/s, from the memory clock and bus width
 * the runtime reports; 0 when unknown) of the current device. */
kv_err kvk_dev_info(int *num_sms, double *peak_gbps, char *name, size_t name_len);

#ifdef __cplusplus
}
#endif

#endif
