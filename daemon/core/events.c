/* kvd_events: the event ring and per-tenant counters (see events.h). */
#include "daemon/core/events.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/kv_log.h"

kv_err kvd_events_init(kvd_events *e, uint32_t cap) {
    memset(e, 0, sizeof(*e));
    if (cap == 0) {
        return KV_EINVAL;
    }
    e->ring = calloc(cap, sizeof(*e->ring));
    e->tenants = calloc(KVD_MAX_TENANTS, sizeof(*e->tenants));
    if (e->ring == NULL || e->tenants == NULL) {
        free(e->ring);
        free(e->tenants);
        memset(e, 0, sizeof(*e));
        return KV_ENOMEM;
    }
    e->cap = cap;
    e->next_seq = 1;
    return KV_OK;
}

void kvd_events_fini(kvd_events *e) {
    if (e == NULL) {
        return;
    }
    free(e->ring);
    free(e->tenants);
    memset(e, 0, sizeof(*e));
}

void kvd_events_push(kvd_events *e, kvd_event_kind kind, uint32_t pool_id, int64_t tenant,
                     uint64_t count, kv_err code, const char *reason, const char *fmt, ...) {
    if (e->ring == NULL) {
        return;
    }
    kvd_event *ev = &e->ring[(e->next_seq - 1) % e->cap];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ev->seq = e->next_seq++;
    ev->unix_ms = (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
    ev->kind = kind;
    ev->pool_id = pool_id;
    ev->tenant = tenant;
    ev->count = count;
    ev->code = code;
    snprintf(ev->reason, sizeof(ev->reason), "%s", reason);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ev->detail, sizeof(ev->detail), fmt, ap);
    va_end(ap);
    if ((unsigned)kind < 3) {
        e->pushed[kind]++;
    }
}

size_t kvd_events_count(const kvd_events *e) {
    uint64_t n = e->next_seq > 0 ? e->next_seq - 1 : 0;
    return n < e->cap ? (size_t)n : e->cap;
}

const kvd_event *kvd_events_at(const kvd_events *e, size_t i) {
    size_t n = kvd_events_count(e);
    KV_ASSERT(i < n);
    uint64_t first = e->next_seq - n; /* seq of the oldest retained */
    return &e->ring[(first - 1 + i) % e->cap];
}

kvd_tenant_counters *kvd_events_tenant(kvd_events *e, uint32_t tenant) {
    KV_ASSERT(tenant < KVD_MAX_TENANTS && e->tenants != NULL);
    return &e->tenants[tenant];
}

int kvd_events_is_refusal(kv_err code) {
    switch (code) {
        case KV_ENOSPC:
        case KV_EQUOTA:
        case KV_EPERM:
        case KV_EDRAINING:
        case KV_EBUSY:
        case KV_EAUTH:
        case KV_ETOOBIG:
            return 1;
        default:
            return 0;
    }
}

const char *kvd_evict_reason_name(kvd_evict_reason r) {
    switch (r) {
        case KVD_EVICT_CAPACITY:
            return "capacity";
        case KVD_EVICT_ADMIN:
            return "admin";
        case KVD_EVICT_SHRINK:
            return "shrink";
        default:
            return "unknown";
    }
}

void kvd_events_note_evictions(kvd_events *e, const kvd_pool *pool, int64_t tenant,
                               kvd_evict_reason reason, uint64_t before, const char *what) {
    uint64_t after = kvd_pool_evictions(pool, reason);
    if (after <= before) {
        return;
    }
    uint64_t n = after - before;
    uint32_t pool_id = kvd_pool_config_get(pool)->pool_id;
    if (tenant >= 0 && tenant < KVD_MAX_TENANTS && e->tenants != NULL) {
        e->tenants[tenant].evictions[reason] += n;
    }
    kvd_events_push(e, KVD_EVENT_EVICT, pool_id, tenant, n, KV_OK, kvd_evict_reason_name(reason),
                    "%s in pool %u evicted %llu cached block%s (%s)", what, pool_id,
                    (unsigned long long)n, n == 1 ? "" : "s", kvd_evict_reason_name(reason));
}
