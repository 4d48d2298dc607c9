/* kvk_cuda without CUDA: the build machine had no nvcc (or --config=nocuda). Every launcher and
 * device helper answers KV_ENOGPU with the message "built without CUDA", so callers fall back to
 * the CPU twins.
 */
#include "kernels/kvk_internal.h"

#define NO_CUDA(op) kvk__fail(KV_ENOGPU, "%s: built without CUDA", op)

kv_err kvk_copy_blocks_cuda(const kvk_cache *src, const kvk_cache *dst, const int32_t *src_blocks,
                            const int32_t *dst_blocks, uint32_t n, void *stream) {
    (void)src, (void)dst, (void)src_blocks, (void)dst_blocks, (void)n, (void)stream;
    return NO_CUDA("copy_blocks");
}

kv_err kvk_reshape_and_cache_cuda(const kvk_cache *cache, uint32_t layer, const kvk_tokens *t,
                                  const int64_t *slot_mapping, uint32_t ntokens, void *stream) {
    (void)cache, (void)layer, (void)t, (void)slot_mapping, (void)ntokens, (void)stream;
    return NO_CUDA("reshape_and_cache");
}

kv_err kvk_paged_decode_attention_cuda(const kvk_cache *cache, uint32_t layer,
                                       const kvk_page_table *pt, const kvk_decode_args *a,
                                       void *workspace, size_t workspace_bytes, void *stream) {
    (void)cache, (void)layer, (void)pt, (void)a, (void)workspace, (void)workspace_bytes;
    (void)stream;
    return NO_CUDA("paged_decode_attention");
}

kv_err kvk_merge_states_cuda(kv_dtype dtype, const void *const *v, const float *const *s,
                             uint32_t num_states, uint64_t rows, uint32_t head_dim, void *out,
                             float *s_out, void *stream) {
    (void)dtype, (void)v, (void)s, (void)num_states, (void)rows, (void)head_dim, (void)out;
    (void)s_out, (void)stream;
    return NO_CUDA("merge_states");
}

kv_err kvk_quantize_blocks_cuda(kv_dtype src_dtype, const void *src, kv_dtype dst_dtype, void *dst,
                                float *scales, uint64_t n, uint32_t tokens, uint32_t heads,
                                uint32_t dim, void *stream) {
    (void)src_dtype, (void)src, (void)dst_dtype, (void)dst, (void)scales, (void)n, (void)tokens;
    (void)heads, (void)dim, (void)stream;
    return NO_CUDA("quantize_blocks");
}

kv_err kvk_dequantize_blocks_cuda(kv_dtype src_dtype, const void *src, const float *scales,
                                  kv_dtype dst_dtype, void *dst, uint64_t n, uint32_t tokens,
                                  uint32_t heads, uint32_t dim, void *stream) {
    (void)src_dtype, (void)src, (void)scales, (void)dst_dtype, (void)dst, (void)n, (void)tokens;
    (void)heads, (void)dim, (void)stream;
    return NO_CUDA("dequantize_blocks");
}

kv_err kvk_dev_alloc(size_t bytes, void **out) {
    (void)bytes, (void)out;
    return NO_CUDA("dev_alloc");
}

void kvk_dev_free(void *p) {
    (void)p;
}

kv_err kvk_host_alloc_pinned(size_t bytes, void **out) {
    (void)bytes, (void)out;
    return NO_CUDA("host_alloc_pinned");
}

void kvk_host_free_pinned(void *p) {
    (void)p;
}

kv_err kvk_dev_memcpy(void *dst, const void *src, size_t bytes, kvk_copy_kind kind) {
    (void)dst, (void)src, (void)bytes, (void)kind;
    return NO_CUDA("dev_memcpy");
}

kv_err kvk_dev_memcpy_async(void *dst, const void *src, size_t bytes, kvk_copy_kind kind,
                            void *stream) {
    (void)dst, (void)src, (void)bytes, (void)kind, (void)stream;
    return NO_CUDA("dev_memcpy_async");
}

kv_err kvk_dev_sync(void) {
    return NO_CUDA("dev_sync");
}

kv_err kvk_timer_start(void *stream) {
    (void)stream;
    return NO_CUDA("timer_start");
}

kv_err kvk_timer_stop(void *stream, float *ms) {
    (void)stream, (void)ms;
    return NO_CUDA("timer_stop");
}

kv_err kvk_dev_info(int *num_sms, double *peak_gbps, char *name, size_t name_len) {
    (void)num_sms, (void)peak_gbps, (void)name, (void)name_len;
    return NO_CUDA("dev_info");
}

size_t kvk_token_scores_workspace_bytes(uint32_t nq, uint32_t num_qo_heads) {
    return (size_t)nq * num_qo_heads * 2 * sizeof(float);
}

kv_err kvk_token_scores_cuda(const kvk_cache *cache, uint32_t layer, const int32_t *pages,
                             uint32_t ntokens, const kvk_score_args *a, float *scores,
                             void *workspace, size_t workspace_bytes, void *stream) {
    (void)cache, (void)layer, (void)pages, (void)ntokens, (void)a, (void)scores;
    (void)workspace, (void)workspace_bytes, (void)stream;
    return NO_CUDA("token_scores");
}

kv_err kvk_compact_tokens_cuda(const kvk_cache *src, const kvk_cache *dst, const int64_t *src_slots,
                               uint32_t nkept, const int32_t *dst_blocks, void *stream) {
    (void)src, (void)dst, (void)src_slots, (void)nkept, (void)dst_blocks, (void)stream;
    return NO_CUDA("compact_tokens");
}

kv_err kvk_page_summaries_cuda(const kvk_cache *cache, const int32_t *blocks, const uint32_t *ntok,
                               uint32_t n, float *out, void *stream) {
    (void)cache, (void)blocks, (void)ntok, (void)n, (void)out, (void)stream;
    return NO_CUDA("page_summaries");
}

kv_err kvk_page_select_cuda(const kvk_select_args *a, int32_t *out, float *score, void *stream) {
    (void)a, (void)out, (void)score, (void)stream;
    return NO_CUDA("page_select");
}
