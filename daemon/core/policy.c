/* The eviction policies' names (daemon/core/pool.h): the one table, read by the config check,
 * the registry and the admin commands. No dependencies beyond the header's enum. */
#include <string.h>

#include "daemon/core/pool.h"

static const struct {
    kvd_evict_policy policy;
    const char *name;
} policy_names[] = {
    {KVD_EVICT_LRU, "lru"},
    {KVD_EVICT_S3FIFO, "s3fifo"},
    {KVD_EVICT_PREFIX_LRU, "prefix-lru"},
    {KVD_EVICT_ADAPTIVE, "adaptive"},
};

const char *kvd_evict_policy_name(kvd_evict_policy p) {
    for (size_t i = 0; i < sizeof(policy_names) / sizeof(policy_names[0]); i++) {
        if (policy_names[i].policy == p) {
            return policy_names[i].name;
        }
    }
    return "?";
}

kv_err kvd_evict_policy_parse(const char *name, kvd_evict_policy *out) {
    for (size_t i = 0; i < sizeof(policy_names) / sizeof(policy_names[0]); i++) {
        if (strcmp(policy_names[i].name, name) == 0) {
            *out = policy_names[i].policy;
            return KV_OK;
        }
    }
    return KV_EINVAL;
}
