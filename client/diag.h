/* diag: libkvclient's diagnostics: log lines through the application's callback and the text of
 * the last error (kvc_last_error).
 *
 * A kvc__diag is embedded in its connection (kvc_conn.diag) and every pool points to its
 * connection's, so code below the connection (segment mapping, GPU mapping) reports errors and
 * logs without knowing what a connection is. The library never writes to stderr.
 * Threads: the owning connection's (see kvclient.h).
 */
#ifndef KVC_DIAG_H
#define KVC_DIAG_H

#include "client/include/kvclient.h"

#define KVC__ERR_BYTES 512 /* room for the last error message, NUL included */

typedef struct kvc__diag {
    kvc_log_fn log;           /* application's log callback, or NULL */
    void *log_arg;            /* its argument */
    int log_level;            /* lines with level <= this are logged */
    char err[KVC__ERR_BYTES]; /* last error message ("" before the first) */
} kvc__diag;

/* Logs one line through d's callback when level is enabled. d may be NULL (nothing logged). */
void kvc__log(const kvc__diag *d, int level, const char *id, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Records the message for kvc_last_error: in d (may be NULL: a call without a connection) and
 * as the calling thread's last error. Returns err (for `return kvc__fail(...)`). Every failing
 * public call goes through here, so kvc_last_error is never stale. */
kv_err kvc__fail(kvc__diag *d, kv_err err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The calling thread's last failure ("" before any). */
const char *kvc__thread_error(void);

#endif
