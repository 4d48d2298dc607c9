/* kvk_base: what every CPU kernel file uses and nothing else provides: the thread's last error
 * and the dtype predicates. The bottom of kernels/ (it uses no other kernel file), so the
 * dispatch (kvk_cpu.c), the vector bodies and the twins never call each other in a circle. */
#include <stdarg.h>
#include <stdio.h>

#include "kernels/kvk_dtype.h"
#include "kernels/kvk_internal.h"

static _Thread_local char last_error[256];

const char *kvk_last_error(void) {
    return last_error;
}

kv_err kvk__fail(kv_err code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof(last_error), fmt, ap);
    va_end(ap);
    return code;
}

uint32_t kvk_dtype_bytes(kv_dtype d) {
    return kvk_elem_bytes(d);
}

int kvk__is_wide(kv_dtype d) {
    return d == KV_DTYPE_FP16 || d == KV_DTYPE_BF16 || d == KV_DTYPE_FP32;
}

int kvk__is_scaled(kv_dtype d) {
    return d == KV_DTYPE_FP8_E4M3 || d == KV_DTYPE_INT8;
}
