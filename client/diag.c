/* diag: formatting into the log callback and the last-error buffer. Lines longer than 1023
 * bytes are cut; the last error keeps KVC__ERR_BYTES - 1. */
#include "client/diag.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

void kvc__log(const kvc__diag *d, int level, const char *id, const char *fmt, ...) {
    if (d == NULL || d->log == NULL || level > d->log_level) {
        return;
    }
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    d->log(d->log_arg, level, id, buf);
}

/* The calling thread's last failure, whatever call failed (kvc_last_error(NULL)). */
static __thread char thread_err[KVC__ERR_BYTES];

kv_err kvc__fail(kvc__diag *d, kv_err err, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(thread_err, sizeof(thread_err), fmt, ap);
    va_end(ap);
    if (d != NULL) {
        memcpy(d->err, thread_err, sizeof(d->err));
    }
    return err;
}

const char *kvc__thread_error(void) {
    return thread_err;
}
