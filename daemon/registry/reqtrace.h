/* kvd_reqtrace: a request trace of this daemon's own traffic, for replaying eviction policies
 * against Belady's optimum on it (core_bench --trace-file; daemon/testing/evict_trace.h has the
 * format). Admin `trace start path=P [max-bytes=N]` starts one, `trace stop` ends it.
 *
 * One line per Lookup and per Fetch: the request's block hashes in prefix order, 32 hex digits
 * each. A block is named by its pool and hash: the pool id is folded into the hash's low half
 * (lo ^ pool_id * 0x9E3779B97F4A7C15), so equal names are the same block of the same pool and two
 * pools' blocks never meet, as in kvd. Hashes only: no token, no tenant name (the file is the
 * operator's, mode 0600, created new). Writing stops for good once max-bytes is reached (`full`).
 * Loop thread only; buffered (1 MiB), flushed at stop.
 */
#ifndef KVD_REQTRACE_H
#define KVD_REQTRACE_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"
#include "common/kv_hash.h"

typedef struct kvd_reqtrace kvd_reqtrace;

typedef struct kvd_reqtrace_stats {
    char path[512];
    uint64_t requests; /* lines written */
    uint64_t bytes;    /* bytes written (the header included) */
    uint64_t max_bytes;
    int full; /* max-bytes reached: nothing more is written */
} kvd_reqtrace_stats;

/* Creates path (it must not exist: O_EXCL, 0600) and writes its header. KV_EINVAL (max_bytes 0),
 * KV_ESYS (msg names errno's reason), KV_ENOMEM. */
kv_err kvd_reqtrace_start(const char *path, uint64_t max_bytes, kvd_reqtrace **out, char *msg,
                          size_t len);

/* Appends one request of pool pool_id: hashes h[0..n) (n > 0). */
void kvd_reqtrace_record(kvd_reqtrace *t, uint32_t pool_id, const kv_hash128 *h, size_t n);

void kvd_reqtrace_stats_get(const kvd_reqtrace *t, kvd_reqtrace_stats *out);

/* Flushes, closes and frees (stats, if out is not NULL, as at the end). Accepts NULL. KV_ESYS when
 * the flush or close failed (a disk that filled up). */
kv_err kvd_reqtrace_stop(kvd_reqtrace *t, kvd_reqtrace_stats *out);

#endif
