/* kvd_quota: limits live in the tenant table (tenant.c); this module parses them by name and
 * applies changes to the running server (guarantees into every pool a tenant can write). */
#include "daemon/quota.h"

#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_log.h"
#include "daemon/server_int.h"
#include "daemon/tenancy.h"

/* The one list of limits: parsing, reports and KVD_QUOTA_NAMES follow it (quota_test checks
 * that the names string lists exactly these). */
static const struct {
    const char *name; /* as the tenants file and `quota set` spell it */
    size_t off;       /* its field in kvd_quota */
} fields[] = {
    {"max-held", offsetof(kvd_quota, max_held)},
    {"guarantee", offsetof(kvd_quota, guarantee)},
    {"max-pinned", offsetof(kvd_quota, max_pinned)},
    {"max-sessions", offsetof(kvd_quota, max_sessions)},
    {"max-pools", offsetof(kvd_quota, max_pools)},
};

#define NFIELDS (sizeof(fields) / sizeof(fields[0]))

kv_err kvd_quota_parse_field(kvd_quota *q, const char *name, const char *value) {
    if (value == NULL || value[0] < '0' || value[0] > '9') {
        return KV_EINVAL;
    }
    errno = 0;
    char *end;
    unsigned long long v = strtoull(value, &end, 10);
    if (errno != 0 || *end != '\0') {
        return KV_EINVAL;
    }
    for (size_t i = 0; i < NFIELDS; i++) {
        if (strcmp(name, fields[i].name) == 0) {
            *(uint64_t *)(void *)((char *)q + fields[i].off) = v;
            return KV_OK;
        }
    }
    return KV_ENOENT;
}

void kvd_quota_report(const kvd_quota *q, kvd_stat_sink sink, void *arg) {
    for (size_t i = 0; i < NFIELDS; i++) {
        sink(arg, fields[i].name,
             *(const uint64_t *)(const void *)((const char *)q + fields[i].off));
    }
}

/* UINT32_MAX for "default", else the tenant's id. */
static kv_err quota_target(kvd_server *s, const char *tenant, uint32_t *id) {
    if (strcmp(tenant, "default") == 0) {
        *id = UINT32_MAX;
        return KV_OK;
    }
    return kvd_tenants_find(s->tenants, tenant, id);
}

kv_err kvd_quota_get(kvd_server *s, const char *tenant, kvd_quota *out) {
    uint32_t id;
    kv_err rc = quota_target(s, tenant, &id);
    if (rc != KV_OK) {
        return rc;
    }
    *out = *kvd_tenants_quota(s->tenants, id);
    return KV_OK;
}

kv_err kvd_quota_set(kvd_server *s, const char *tenant, const kvd_quota *q) {
    uint32_t id;
    kv_err rc = quota_target(s, tenant, &id);
    if (rc != KV_OK) {
        return rc;
    }
    kvd_tenants_set_quota(s->tenants, id, q);
    for (uint32_t i = 0; i < s->npools; i++) {
        kvd_tenancy_apply_guarantees(s, &s->pools[i]);
    }
    KV_LOG(INFO, "KVD-QUOTA",
           "quota of %s: max-held %llu, guarantee %llu, max-pinned %llu, max-sessions %llu, "
           "max-pools %llu",
           tenant, (unsigned long long)q->max_held, (unsigned long long)q->guarantee,
           (unsigned long long)q->max_pinned, (unsigned long long)q->max_sessions,
           (unsigned long long)q->max_pools);
    return KV_OK;
}

kv_err kvd_quota_set_field(kvd_server *s, const char *tenant, const char *name, const char *value,
                           char *err, size_t errlen) {
    kvd_quota q;
    kv_err rc = kvd_quota_get(s, tenant, &q);
    if (rc != KV_OK) {
        snprintf(err, errlen, "no tenant named %s", tenant);
        return rc;
    }
    rc = kvd_quota_parse_field(&q, name, value);
    if (rc == KV_ENOENT) {
        snprintf(err, errlen, "no limit named %s; limits are %s", name, KVD_QUOTA_NAMES);
        return rc;
    }
    if (rc != KV_OK) {
        snprintf(err, errlen, "%s must be a decimal number of blocks or sessions (0 = none)", name);
        return rc;
    }
    return kvd_quota_set(s, tenant, &q);
}

kv_err kvd_quota_usage(kvd_server *s, const char *tenant, kvd_stat_sink sink, void *arg) {
    uint32_t id;
    kv_err rc = kvd_tenants_find(s->tenants, tenant, &id);
    if (rc != KV_OK) {
        return rc;
    }
    kvd_tenant_usage sum = {0, 0, 0};
    for (uint32_t i = 0; i < s->npools; i++) {
        kvd_tenant_usage u = kvd_pool_tenant_usage(s->pools[i].pool, id);
        sum.held += u.held;
        sum.cached += u.cached;
        sum.pinned += u.pinned;
    }
    sink(arg, "sessions", kvd_tenancy_sessions(s, id));
    sink(arg, "held", sum.held);
    sink(arg, "cached", sum.cached);
    sink(arg, "pinned", sum.pinned);
    return KV_OK;
}
