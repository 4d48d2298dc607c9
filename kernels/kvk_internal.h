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

/* 1 for fp16, bf16, fp32 (the dtypes of activations: q, out, new K/V). */
int kvk__is_wide(kv_dtype d);

/* 1 for the 8-bit dtypes that carry scales. */
int kvk__is_scaled(kv_dtype d);

#ifdef __cplusplus
}
#endif

#endif
