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

/* The layout of a replay pool: 4 KiB blocks (1 layer, 1 head x 64 dims, 16 tokens, fp16,
 * block-major), whose K and V halves make kvd take an even number of blocks a segment. */
kv_layout kvd_trace_kvc_layout(void);

/* kvd's --segment-bytes and --pool-memory flags (into seg and mem, 64 bytes each) for one pool
 * of exactly cap (even) such blocks: one segment, and pool-memory short of a second. */
void kvd_trace_kvc_flags(uint32_t cap, char seg[64], char mem[64]);

/* Replays t through pool; *out gets blocks asked and hit (duplicates: commits whose canonical
 * block was another). The first libkvclient error ends it and is returned. */
kv_err kvd_trace_replay_kvc(kvc_pool *pool, const kvd_trace *t, kvd_trace_result *out);

#endif
