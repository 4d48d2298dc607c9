/* kvd_events: what operators see of the daemon's decisions: a ring of the last evictions and
 * refusals with their reason (admin `events`), and per-tenant counters (admin `stats`,
 * Prometheus) that the request handlers feed.
 *
 * The ring is fixed-size and overwrites its oldest entry, so feeding it never fails and never
 * allocates on the request path. Counters are plain integers indexed by tenant id. Loop thread
 * only; no locks.
 */
#ifndef KVD_EVENTS_H
#define KVD_EVENTS_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"
#include "daemon/core/pool.h"

#define KVD_EVENTS_DEFAULT 1024 /* ring entries kvd keeps */
#define KVD_EVENT_DETAIL 160    /* bytes of an event's detail sentence */

typedef enum kvd_event_kind {
    KVD_EVENT_EVICT = 1,  /* blocks left the cache (capacity, admin, shrink) */
    KVD_EVENT_REFUSE = 2, /* a request or connection was refused (error code says why) */
} kvd_event_kind;

typedef struct kvd_event {
    uint64_t seq;                  /* 1, 2, ... per daemon run */
    uint64_t unix_ms;              /* wall-clock time it happened */
    kvd_event_kind kind;           /* evict or refuse */
    uint32_t pool_id;              /* 0 when no pool is involved */
    int64_t tenant;                /* tenant id, -1 for none */
    uint64_t count;                /* blocks evicted (evict) or 1 (refuse) */
    kv_err code;                   /* refuse: the error sent; evict: KV_OK */
    char reason[24];               /* evict: capacity|admin|shrink; refuse: error name */
    char detail[KVD_EVENT_DETAIL]; /* one sentence */
} kvd_event;

/* Per-tenant counters (monotonic since start). */
typedef struct kvd_tenant_counters {
    uint64_t queries;                      /* Lookup requests */
    uint64_t query_blocks;                 /* hashes asked in them */
    uint64_t hit_blocks;                   /* blocks found */
    uint64_t hit_tokens;                   /* tokens of those blocks */
    uint64_t commits;                      /* blocks committed */
    uint64_t evictions[KVD_EVICT_REASONS]; /* evictions its requests caused, by reason */
    uint64_t refusals;                     /* error replies of the refusal kind */
} kvd_tenant_counters;

typedef struct kvd_events {
    kvd_event *ring;              /* cap entries */
    uint32_t cap;                 /* ring size */
    uint64_t next_seq;            /* seq of the next event (events pushed = next_seq - 1) */
    uint64_t pushed[3];           /* events pushed by kind (index = kvd_event_kind) */
    kvd_tenant_counters *tenants; /* KVD_MAX_TENANTS entries */
} kvd_events;

/* Caller's storage: a ring of cap (>= 1) entries and zeroed counters. KV_ENOMEM / KV_EINVAL. */
kv_err kvd_events_init(kvd_events *e, uint32_t cap);

/* Frees what init allocated; accepts zeroed memory. */
void kvd_events_fini(kvd_events *e);

/* Appends an event (overwriting the oldest when full). tenant < 0 for none; detail is a printf
 * format. Never fails. */
void kvd_events_push(kvd_events *e, kvd_event_kind kind, uint32_t pool_id, int64_t tenant,
                     uint64_t count, kv_err code, const char *reason, const char *fmt, ...)
    __attribute__((format(printf, 8, 9)));

/* Events retained (at most cap) and the i-th oldest of them (0 = oldest retained). */
size_t kvd_events_count(const kvd_events *e);
const kvd_event *kvd_events_at(const kvd_events *e, size_t i);

/* The counters of tenant (KV_ASSERT: tenant < KVD_MAX_TENANTS). */
kvd_tenant_counters *kvd_events_tenant(kvd_events *e, uint32_t tenant);

/* Whether an error reply with code counts as a refusal (ENOSPC, EQUOTA, EPERM, EDRAINING, EBUSY,
 * EAUTH, ETOOBIG): what an operator looks for when a worker is turned away. */
int kvd_events_is_refusal(kv_err code);

/* After an operation on pool that may have evicted: compares the pool's counter for reason with
 * `before` (kvd_pool_evictions taken earlier) and, when blocks went, pushes one evict
 * event naming `what` and charges them to tenant's counters (tenant < 0: none). */
void kvd_events_note_evictions(kvd_events *e, const kvd_pool *pool, int64_t tenant,
                               kvd_evict_reason reason, uint64_t before, const char *what);

/* Name of an eviction reason: capacity, admin, shrink. */
const char *kvd_evict_reason_name(kvd_evict_reason r);

#endif
