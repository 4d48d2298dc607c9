/* kvd_trace: seeded synthetic request traces for eviction tests and benchmarks, a driver that
 * replays them against a real pool, and Belady's offline optimum on the same trace.
 *
 * A trace is a list of requests; each request is the list of its blocks' keys in prefix order.
 * Keys stand for chain hashes (kvd_trace_hash), so a key is one block in one prefix context.
 * Four shapes: multi-turn chat (a fixed set of open conversations re-send their growing
 * history, chosen by recency rank), chat sessions in time (Poisson arrivals, heavy-tailed turn
 * counts and return gaps), shared system prompts (Zipf-popular prompts followed by mostly
 * one-off user text, some follow-ups) and few-shot prompts (a task instruction, examples drawn
 * from a shared pool, a one-off query). Test and bench support only; single thread.
 */
#ifndef KVD_EVICT_TRACE_H
#define KVD_EVICT_TRACE_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"
#include "common/kv_hash.h"
#include "daemon/core/pool.h"

typedef enum kvd_trace_kind {
    KVD_TRACE_CHAT = 1,      /* multi-turn chat */
    KVD_TRACE_SYSPROMPT = 2, /* shared system prompts + one-off questions */
    KVD_TRACE_SESSIONS = 3,  /* chat sessions in time: heavy-tailed turns and return gaps */
    KVD_TRACE_FEWSHOT = 4,   /* task instruction + examples from a shared pool + query */
    KVD_TRACE_AGENT = 5,     /* agentic tool loops: forks, heavy-tailed tool results */
    KVD_TRACE_RAG = 6,       /* shared document chunks in per-query order, follow-ups */
    KVD_TRACE_PARALLEL = 7,  /* parallel samples, beams, best-of-n winners coming back */
    KVD_TRACE_SHIFT = 8,     /* prompts + chat whose popular set is redrawn in phases */
} kvd_trace_kind;

typedef struct kvd_trace {
    uint32_t nreq;    /* requests */
    uint32_t *off;    /* request r's keys are keys[off[r] .. off[r+1]) */
    uint32_t *keys;   /* block keys, all < nkeys */
    uint32_t nkeys;   /* distinct keys */
    uint32_t max_len; /* longest request, in blocks */
} kvd_trace;

/* Generates nreq requests of the given kind from seed (same seed, same trace). KV_EINVAL for an
 * unknown kind or nreq 0, KV_ENOMEM. Free with kvd_trace_fini. */
kv_err kvd_trace_gen(kvd_trace_kind kind, uint64_t seed, uint32_t nreq, kvd_trace *out);

/* Trace files (a user's production trace, or one kvd recorded itself: admin `trace start
 * path=P`, daemon/registry/reqtrace.h, which names each block by its pool and hash): text, one
 * request per line, the request's block chain hashes in prefix order as hex strings (32 hex
 * digits for kvd's 128-bit hashes; any length is accepted, compared exactly, case-insensitive)
 * separated by spaces or tabs. Blank lines and anything from a '#' to the end of a line are
 * ignored. Hashes are chain hashes, so equal strings are the same block in the same prefix
 * context. Example, two requests sharing their first block:
 *   # kvd trace
 *   9a0c...31f2 44be...07aa
 *   9a0c...31f2 0d13...e9c1 77f0...5b02
 * load: KV_ENOENT when the file cannot be opened, KV_EINVAL for a non-hex word or a file with no
 * request, KV_ENOMEM. Keys are numbered in order of first appearance. save: writes t in this
 * format (kvd_trace_hash of each key); KV_ESYS. */
kv_err kvd_trace_load(const char *path, kvd_trace *out);
kv_err kvd_trace_save(const kvd_trace *t, const char *path);

/* Frees a trace's arrays; accepts a zeroed one. */
void kvd_trace_fini(kvd_trace *t);

/* The chain hash that stands for key. */
kv_hash128 kvd_trace_hash(uint32_t key);

typedef struct kvd_trace_result {
    uint64_t query_blocks; /* blocks asked for by lookups */
    uint64_t hit_blocks;   /* leading blocks found */
    uint64_t duplicates;   /* commits that found the block already indexed */
} kvd_trace_result;

/* Replays t against a fresh pool of capacity_blocks blocks (>= t->max_len) with policy: each
 * request looks up its prefix, allocates and commits the rest, releases everything. Checks every
 * lookup result's hash and, every check_every requests (0: never), kvd_pool_check. KV_EINTERNAL
 * on any wrong result; KV_EINVAL if capacity is below the longest request. */
kv_err kvd_trace_replay(const kvd_trace *t, kvd_evict_policy policy, uint32_t capacity_blocks,
                        uint32_t check_every, kvd_trace_result *out);

/* ADAPTIVE with set dueling (daemon/core/duel.h: the code the daemon runs with `evict-duel`):
 * one request in KVD_DUEL_SAMPLE also runs through two miniature ADAPTIVE pools of capacity /
 * KVD_DUEL_SAMPLE blocks, one per leaf order, and the pool takes the order of the one with more
 * recent hits; a request too long for the minis sends the pool back to its order by age for a
 * while (duel.h). Requests are fed and stepped one by one, so the replay does what kvd does with
 * a client that waits for each reply. Same results and errors as kvd_trace_replay. */
kv_err kvd_trace_replay_duel(const kvd_trace *t, uint32_t capacity_blocks, uint32_t check_every,
                             kvd_trace_result *out);

/* Belady's MIN on the same trace and capacity (evict the cached block used farthest in the
 * future, never one of the current request's), counting prefix hits as replay does. */
kv_err kvd_trace_belady(const kvd_trace *t, uint32_t capacity_blocks, kvd_trace_result *out);

#endif
