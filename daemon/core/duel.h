/* kvd_duel: set dueling for an ADAPTIVE pool's leaf order (pool.h, kvd_pool_set_leaf_order), as
 * CPU caches choose between insertion policies (DIP/DRRIP).
 *
 * A hash of each request's last block picks one request in KVD_DUEL_SAMPLE. A picked request also
 * runs through two miniature ADAPTIVE pools of the pool's capacity / KVD_DUEL_SAMPLE blocks
 * (metadata and a few bytes a block: they hold no KV bytes), one with leaf order AGE and one
 * UNREUSED_FIRST: each looks the request's prefix up, allocates and commits the rest, and releases
 * it, as a client of the pool would. Their hits are summed with a decay of 1 / KVD_DUEL_DECAY per
 * picked request, and the pool takes the never-reused leaves first while the second's sum
 * exceeds the first's by KVD_DUEL_MARGIN (AGE otherwise, and before anything is known).
 *
 * A request longer than the mini's capacity / KVD_DUEL_MIN_REQS is not fed (a mini that holds
 * fewer than two such requests sees little but shared system prompts; counted as skipped), and
 * the minis are not trusted until KVD_DUEL_DECAY picked requests in a row fit: meanwhile the
 * pool evicts by age (without this a 4000-request chat trace lost 6% of its hits through kvd).
 * The minis follow the pool's capacity: each mini segment is a pool segment
 * / KVD_DUEL_SAMPLE (a pool of one-block segments: minis of one-block segments, half as many),
 * and they may have as many segments as the pool has resident plus may still add (its segment
 * limit, which the registry sets from pool-memory at each Allocate; parked segments count as
 * ones it may add); when that falls, the minis give back their trailing segments, evicting what
 * those held, and new minis (after a failure) start with no score.
 *
 * A picked request is queued (its hashes copied) by kvd_duel_observe and run through the minis
 * later by kvd_duel_step, so the caller chooses when the work is done: the daemon (option
 * `evict-duel`) queues at Lookup and runs one waiting request after each turn of its loop, once
 * the turn's replies are written (the registry's kvd_registry_duel_step, from a check handle;
 * an idle handle keeps the loop turning while some wait). A picked request that finds
 * KVD_DUEL_QUEUE requests or KVD_DUEL_QUEUE_BLOCKS blocks waiting is dropped (counted; also when
 * there is no memory for its copy; one longer than KVD_DUEL_QUEUE_BLOCKS is skipped): a loop
 * that takes in more picked requests a turn than one spends a request's worth a turn on them
 * and its minis see a thinner stream than the pool. The trace replay
 * (daemon/testing/evict_trace.h, kvd_trace_replay_duel) steps after every request. Cost: two
 * mini lookups, allocations, commits and releases for each picked request (about 23 ns a block
 * and mini on the bench machine); memory about the pool's own block records again
 * (kvd_duel_stats.bytes). Loop thread only, like the pool.
 */
#ifndef KVD_DUEL_H
#define KVD_DUEL_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"
#include "common/kv_hash.h"
#include "daemon/core/pool.h"

#define KVD_DUEL_SAMPLE 2
#define KVD_DUEL_DECAY 500.0
#define KVD_DUEL_MARGIN 0.05
#define KVD_DUEL_MIN_REQS 2
#define KVD_DUEL_QUEUE 64            /* picked requests waiting at most */
#define KVD_DUEL_QUEUE_BLOCKS 65536u /* their blocks at most */

typedef struct kvd_duel kvd_duel;

typedef struct kvd_duel_stats {
    uint64_t sampled;     /* picked requests fed to both minis */
    uint64_t skipped;     /* picked requests too long for the minis (or a mini failed) */
    uint64_t dropped;     /* picked requests that found the queue full (or no memory) */
    uint64_t queued;      /* picked requests waiting now */
    uint64_t switches;    /* times the chosen leaf order changed */
    kvd_leaf_order order; /* the order chosen now */
    double score[2];      /* decayed hits: [0] AGE mini, [1] UNREUSED_FIRST mini */
    uint64_t mini_blocks; /* capacity of one mini now, in blocks */
    uint64_t bytes;       /* memory both minis hold (records, index, their few segment bytes) */
} kvd_duel_stats;

/* A duel with no minis yet (they are made on the first picked request). KV_ENOMEM. */
kv_err kvd_duel_alloc(kvd_duel **out);

/* Frees d and its minis; accepts NULL. */
void kvd_duel_free(kvd_duel *d);

/* One request of n block hashes (prefix order) at time now (the pool's clock, ms): when its last
 * hash is picked, queues a copy (or drops it when the queue is full). KV_OK, also when the
 * request is not picked or is dropped; KV_ENOMEM (not queued, counted as dropped); KV_EINVAL for
 * n > 0 with h NULL. */
kv_err kvd_duel_observe(kvd_duel *d, const kv_hash128 *h, size_t n, uint64_t now);

/* Picked requests waiting for kvd_duel_step. */
size_t kvd_duel_pending(const kvd_duel *d);

/* Runs the oldest waiting request through both minis (fitted to pool's capacity now) and sets
 * pool's leaf order by their scores; nothing of pool changes but its leaf order. KV_OK, also
 * with nothing waiting or when the request is skipped; an error when a mini cannot be made or
 * take the request (KV_ENOMEM growing one, or the pool's own errors: counted as skipped; both
 * minis start again empty; the pool keeps its order; the next request tries again). */
kv_err kvd_duel_step(kvd_duel *d, kvd_pool *pool);

/* 1 when the request whose last block hash is last is one of the picked requests. */
int kvd_duel_picks(kv_hash128 last);

void kvd_duel_stats_get(const kvd_duel *d, kvd_duel_stats *out);

/* kvd_pool_check of both minis (KV_OK when they are not made yet). */
kv_err kvd_duel_check(const kvd_duel *d);

#endif
