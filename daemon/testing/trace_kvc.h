/* kvd_trace_replay_kvc: an eviction trace (evict_trace.h) replayed through a real kvd over
 * libkvclient, as the in-process kvd_trace_replay replays it against a pool: each request looks
 * up its prefix, allocates and commits the rest (each block's parent the one before) and
 * releases everything, one call at a time. For tests and bench/core_bench: with a pool of the
 * same capacity, kvd's hits are the in-process replay's (tests/integration/evict_replay_test).
 */
#ifndef KVD_TRACE_KVC_H
#define KVD_TRACE_KVC_H

#include "daemon/testing/evict_trace.h"
#include "kvclient.h"

/* Replays t through pool; *out gets blocks asked and hit (duplicates: commits whose canonical
 * block was another). The first libkvclient error ends it and is returned. */
kv_err kvd_trace_replay_kvc(kvc_pool *pool, const kvd_trace *t, kvd_trace_result *out);

#endif
