/* kvd_quota: limits live in the tenant table (tenant.c); this module parses and reports them by
 * name. The registry applies changes (daemon/registry/registry.h). */
#include "daemon/tenancy/quota.h"

#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_log.h"
#include "common/kv_util.h"

/* The one list of limits: parsing, reports and KVD_QUOTA_NAMES follow it (quota_test checks
 * that the names string lists exactly these). */
static const struct {
    const char *name; /* as the tenants file and `quota set` spell it */
    size_t off;       /* its field in kvd_quota */
    int size;         /* takes a size suffix (kv_parse_size) */
} fields[] = {
    {"max-held", offsetof(kvd_quota, max_held), 0},
    {"guarantee", offsetof(kvd_quota, guarantee), 0},
    {"max-pinned", offsetof(kvd_quota, max_pinned), 0},
    {"max-sessions", offsetof(kvd_quota, max_sessions), 0},
    {"max-pools", offsetof(kvd_quota, max_pools), 0},
    {"tier-max", offsetof(kvd_quota, tier_max), 0},
    {"tier-guarantee", offsetof(kvd_quota, tier_guarantee), 0},
    {"tier-max-bytes", offsetof(kvd_quota, tier_max_bytes), 1},
    {"tier-guarantee-bytes", offsetof(kvd_quota, tier_guarantee_bytes), 1},
    {"tier-total-bytes", offsetof(kvd_quota, tier_total_bytes), 1},
};

#define NFIELDS (sizeof(fields) / sizeof(fields[0]))

kv_err kvd_quota_parse_field(kvd_quota *q, const char *name, const char *value) {
    for (size_t i = 0; i < NFIELDS; i++) {
        if (strcmp(name, fields[i].name) == 0) {
            const char *end;
            uint64_t v;
            if (fields[i].size ? kv_parse_size(value, &v) != 0
                               : kv_parse_u64(value, &end, &v) != 0 || *end != '\0') {
                return KV_EINVAL;
            }
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
