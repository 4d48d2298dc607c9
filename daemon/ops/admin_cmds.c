/* kvd admin commands: the ONE table that drives dispatch, `help` and docs/ADMIN.md, and the
 * command functions. Every function runs on the loop thread and reads the server's state
 * directly; results are jansson objects that admin.c serialises as one line. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/kv_hash.h"
#include "common/kv_log.h"
#include "common/kv_util.h"
#include "common/kv_version.h"
#include "daemon/ops/admin_cmds.h"
#include "daemon/registry/reqtrace.h"

#include "daemon/tenancy/quota.h"
#include "daemon/ops/selftest.h"
#include "common/kv_wire.h"
#include "daemon/proto/validate.h"

#define FAIL(rc, ...)                                                                              \
    do {                                                                                           \
        snprintf(msg, KVD_ADMIN_MSG, __VA_ARGS__);                                                 \
        return (rc);                                                                               \
    } while (0)

/* ---- helpers --------------------------------------------------------------------------- */

/* A counter or size as JSON: an integer, or past a JSON integer's range (2^63 and up: an option
 * such as pool-memory set to its maximum) a number with a fraction, never a negative one. */
static json_t *u64(uint64_t v) {
    return v <= (uint64_t)INT64_MAX ? json_integer((json_int_t)v) : json_real((double)v);
}

/* A JSON string of s that always exists: bytes that are not UTF-8 (which jansson refuses, and a
 * refused string used to drop its whole row from stats, pools, sessions and the metrics) become
 * U+FFFD. The daemon refuses such names at the door; this keeps any that slip through visible. */
static json_t *text(const char *s) {
    if (s == NULL) {
        return json_string("");
    }
    size_t n = strlen(s);
    if (kv_utf8_prefix(s, n) == n) {
        return json_stringn(s, n);
    }
    char *buf = malloc(n * 3 + 1);
    if (buf == NULL) {
        return json_string("?");
    }
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        size_t ok = kv_utf8_prefix(s + i, n - i);
        memcpy(buf + o, s + i, ok);
        o += ok;
        i += ok;
        if (i < n) {
            memcpy(buf + o, "\xef\xbf\xbd", 3); /* U+FFFD */
            o += 3;
            i++;
        }
    }
    json_t *j = json_stringn(buf, o);
    free(buf);
    return j;
}

static json_t *hash_json(kv_hash128 h) {
    char hex[33];
    kv_hash_hex(h, hex);
    return json_string(hex);
}

/* Parses a decimal argument value. */
static int parse_num(const char *s, uint64_t *out) {
    const char *end;
    uint64_t v;
    if (kv_parse_u64(s, &end, &v) != 0 || *end != '\0') {
        return -1;
    }
    *out = v;
    return 0;
}

/* If arg is "key=value", returns value; else NULL. */
static const char *kv_arg(const char *arg, const char *key) {
    size_t n = strlen(key);
    return strncmp(arg, key, n) == 0 && arg[n] == '=' ? arg + n + 1 : NULL;
}

static kv_err tenant_by_name(const kvd_ops *s, const char *name, uint32_t *out) {
    return kvd_tenants_find(s->reg->tenants, name, out);
}

/* The pool with this id, its clock advanced (an admin pin or evict must see expired pins gone
 * and set expiry from now); NULL when unknown. */
static kvd_reg_pool *pool_by_id(kvd_ops *s, uint64_t id) {
    return id <= UINT32_MAX ? kvd_registry_pool(s->reg, (uint32_t)id) : NULL;
}

static void add_hit_rate(json_t *o, uint64_t hits, uint64_t asked) {
    json_object_set_new(o, "hit_rate",
                        json_pack("{s:f, s:o, s:o, s:s}", "value",
                                  asked > 0 ? (double)hits / (double)asked : 0.0, "hit_blocks",
                                  u64(hits), "query_blocks", u64(asked), "denominator",
                                  "blocks asked in Lookup requests (query_blocks)"));
}

static void pool_sink(void *arg, const char *name, uint64_t value) {
    json_object_set_new((json_t *)arg, name, u64(value));
}

static uint64_t get_u64(const json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    return json_is_integer(v) ? (uint64_t)json_integer_value(v) : 0;
}

/* ---- stats ----------------------------------------------------------------------------- */

/* The daemon section of `stats` (and of the metrics): ONE table, values in its order. */
enum {
    DS_SESSIONS,
    DS_POOLS,
    DS_POOL_MEMORY_BYTES,
    DS_POOL_MEMORY_USED_BYTES,
    DS_INDEX_ENTRIES,
    DS_INDEX_CAPACITY,
    DS_DRAINING,
    DS_UPTIME_SECONDS,
    DS_EVENTS_EVICT,
    DS_EVENTS_REFUSE,
    DS_COUNT
};

static const kv_stat_desc daemon_stats[DS_COUNT] = {
    [DS_SESSIONS] = {"sessions", "gauge", "connections", "open client connections", "kvd_sessions",
                     "Open client connections.", NULL, NULL},
    [DS_POOLS] = {"pools", "gauge", "pools", "pools (model, layout, domain) in use", "kvd_pools",
                  "Pools (model, layout, domain) in use.", NULL, NULL},
    [DS_POOL_MEMORY_BYTES] = {"pool_memory_bytes", "gauge", "bytes", "the budget (pool-memory)",
                              "kvd_pool_memory_limit_bytes",
                              "Memory all pools may use (pool-memory).", NULL, NULL},
    [DS_POOL_MEMORY_USED_BYTES] = {"pool_memory_used_bytes", "gauge", "bytes",
                                   "what the budget counts: resident segment memory and every "
                                   "pool's metadata",
                                   "kvd_pool_memory_used_bytes",
                                   "Memory the pools hold (segments and metadata).", NULL, NULL},
    [DS_INDEX_ENTRIES] = {"index_entries", "gauge", "blocks", "blocks in the prefix index",
                          "kvd_index_entries", "Blocks in the prefix index.", NULL, NULL},
    [DS_INDEX_CAPACITY] = {"index_capacity", "gauge", "slots", "slots of the prefix index",
                           "kvd_index_capacity_entries", "Slots of the prefix index.", NULL, NULL},
    [DS_DRAINING] = {"draining", "gauge", "bool", "true while draining (new sessions refused)",
                     "kvd_draining", "1 while draining (new sessions refused).", NULL, NULL},
    [DS_UPTIME_SECONDS] = {"uptime_seconds", "gauge", "seconds", "seconds since kvd started",
                           "kvd_uptime_seconds", "Seconds since kvd started.", NULL, NULL},
    [DS_EVENTS_EVICT] = {"events_evict", "counter", "events",
                         "evictions recorded in the event ring (admin events)", "kvd_events_total",
                         "Evictions and refusals recorded in the admin event ring.", "kind",
                         "evict"},
    [DS_EVENTS_REFUSE] = {"events_refuse", "counter", "events",
                          "refusals recorded in the event ring", "kvd_events_total", NULL, "kind",
                          "refuse"},
};

/* A tenant's row of `stats`: ONE table, values in its order. */
enum {
    TS_SESSIONS,
    TS_QUERIES,
    TS_QUERY_BLOCKS,
    TS_HIT_BLOCKS,
    TS_HIT_TOKENS,
    TS_COMMITS,
    TS_EVICTIONS_CAPACITY,
    TS_EVICTIONS_ADMIN,
    TS_EVICTIONS_SHRINK,
    TS_REFUSALS,
    TS_BLOCKS_HELD,
    TS_BLOCKS_CACHED,
    TS_BLOCKS_PINNED,
    TS_COUNT
};

static const kv_stat_desc tenant_stats[TS_COUNT] = {
    [TS_SESSIONS] = {"sessions", "gauge", "sessions", "open sessions of the tenant",
                     "kvd_tenant_sessions", "Open sessions of the tenant.", NULL, NULL},
    [TS_QUERIES] = {"queries", "counter", "requests", "Lookup requests of the tenant",
                    "kvd_tenant_lookups_total", "Lookup requests of the tenant.", NULL, NULL},
    [TS_QUERY_BLOCKS] = {"query_blocks", "counter", "blocks",
                         "blocks the tenant asked in Lookup requests",
                         "kvd_tenant_lookup_blocks_total",
                         "Blocks the tenant asked in Lookup requests.", NULL, NULL},
    [TS_HIT_BLOCKS] = {"hit_blocks", "counter", "blocks", "blocks the tenant's Lookups found",
                       "kvd_tenant_hit_blocks_total", "Blocks the tenant's Lookups found cached.",
                       NULL, NULL},
    [TS_HIT_TOKENS] = {"hit_tokens", "counter", "tokens",
                       "tokens of the blocks the tenant's Lookups found",
                       "kvd_tenant_hit_tokens_total",
                       "Tokens of the blocks the tenant's Lookups found.", NULL, NULL},
    [TS_COMMITS] = {"commits", "counter", "blocks", "blocks the tenant committed",
                    "kvd_tenant_commits_total", "Blocks the tenant committed.", NULL, NULL},
    [TS_EVICTIONS_CAPACITY] = {"evictions_capacity", "counter", "blocks",
                               "evictions the tenant's allocations caused",
                               "kvd_tenant_evictions_total",
                               "Evictions the tenant's allocations caused (capacity) or an "
                               "operator made of its blocks.",
                               "reason", "capacity"},
    [TS_EVICTIONS_ADMIN] = {"evictions_admin", "counter", "blocks",
                            "the tenant's blocks an operator evicted", "kvd_tenant_evictions_total",
                            NULL, "reason", "admin"},
    [TS_EVICTIONS_SHRINK] = {"evictions_shrink", "counter", "blocks",
                             "the tenant's blocks evicted with a parked segment",
                             "kvd_tenant_evictions_total", NULL, "reason", "shrink"},
    [TS_REFUSALS] = {"refusals", "counter", "requests",
                     "requests of the tenant refused (quota, space, permission, draining)",
                     "kvd_tenant_refusals_total",
                     "Requests of the tenant refused (quota, space, permission, draining).", NULL,
                     NULL},
    [TS_BLOCKS_HELD] = {"blocks_held", "gauge", "blocks",
                        "blocks the tenant holds (WRITING and referenced), over all pools",
                        "kvd_tenant_blocks", "Blocks of the tenant by state, over all pools.",
                        "state", "held"},
    [TS_BLOCKS_CACHED] = {"blocks_cached", "gauge", "blocks", "the tenant's cached blocks",
                          "kvd_tenant_blocks", NULL, "state", "cached"},
    [TS_BLOCKS_PINNED] = {"blocks_pinned", "gauge", "blocks", "pins charged to the tenant",
                          "kvd_tenant_blocks", NULL, "state", "pinned"},
};

/* A pool's eviction duel (evict-duel; daemon/core/duel.h): ONE table, values in its order. */
enum {
    DU_SAMPLED,
    DU_SKIPPED,
    DU_DROPPED,
    DU_QUEUED,
    DU_SWITCHES,
    DU_UNREUSED_FIRST,
    DU_MINI_BLOCKS,
    DU_BYTES,
    DU_COUNT
};

static const kv_stat_desc duel_stats[DU_COUNT] = {
    [DU_SAMPLED] = {"sampled", "counter", "requests",
                    "Lookups that also ran through both miniature pools (one in two is picked)",
                    "kvd_pool_duel_sampled_total",
                    "Lookups that also ran through the pool's two miniature pools.", NULL, NULL},
    [DU_SKIPPED] = {"skipped", "counter", "requests",
                    "picked Lookups left out: longer than half a mini, or a mini out of memory",
                    "kvd_pool_duel_skipped_total",
                    "Picked Lookups left out of the miniature pools.", NULL, NULL},
    [DU_DROPPED] = {"dropped", "counter", "requests",
                    "picked Lookups dropped: the queue was full (the loop runs one a turn)",
                    "kvd_pool_duel_dropped_total",
                    "Picked Lookups dropped because the queue was full.", NULL, NULL},
    [DU_QUEUED] = {"queued", "gauge", "requests",
                   "picked Lookups waiting (the loop runs one a turn)", "kvd_pool_duel_queued",
                   "Picked Lookups waiting for the loop.", NULL, NULL},
    [DU_SWITCHES] = {"switches", "counter", "changes", "times the pool's leaf order changed",
                     "kvd_pool_duel_switches_total", "Times the pool's leaf order changed.", NULL,
                     NULL},
    [DU_UNREUSED_FIRST] = {"unreused_first", "gauge", "bool",
                           "true while the pool evicts never-reused leaves first (false: by age)",
                           "kvd_pool_duel_unreused_first",
                           "1 while the pool evicts never-reused leaves first.", NULL, NULL},
    [DU_MINI_BLOCKS] = {"mini_blocks", "gauge", "blocks",
                        "capacity of each miniature pool (half the pool's, as it may grow)",
                        "kvd_pool_duel_mini_blocks", "Capacity of each miniature pool.", NULL,
                        NULL},
    [DU_BYTES] = {"bytes", "gauge", "bytes",
                  "memory of both miniature pools (outside pool-memory, like the index)",
                  "kvd_pool_duel_memory_bytes", "Memory of the pool's miniature pools.", NULL,
                  NULL},
};

static void duel_values(const kvd_duel *d, uint64_t *v) {
    kvd_duel_stats st;
    kvd_duel_stats_get(d, &st);
    v[DU_SAMPLED] = st.sampled;
    v[DU_SKIPPED] = st.skipped;
    v[DU_DROPPED] = st.dropped;
    v[DU_QUEUED] = st.queued;
    v[DU_SWITCHES] = st.switches;
    v[DU_UNREUSED_FIRST] = st.order == KVD_LEAF_ORDER_UNREUSED_FIRST;
    v[DU_MINI_BLOCKS] = st.mini_blocks;
    v[DU_BYTES] = st.bytes;
}

const kv_stat_desc *kvd_admin_duel_stats(size_t *n) {
    *n = DU_COUNT;
    return duel_stats;
}

const kv_stat_desc *kvd_admin_daemon_stats(size_t *n) {
    *n = DS_COUNT;
    return daemon_stats;
}

const kv_stat_desc *kvd_admin_tenant_stats(size_t *n) {
    *n = TS_COUNT;
    return tenant_stats;
}

/* Sets the table's fields on o from v (booleans as JSON true/false). */
static void put_stats(json_t *o, const kv_stat_desc *d, const uint64_t *v, size_t n) {
    for (size_t i = 0; i < n; i++) {
        json_object_set_new(o, d[i].name,
                            strcmp(d[i].unit, "bool") == 0 ? json_boolean(v[i] != 0) : u64(v[i]));
    }
}

json_t *kvd_admin_stats(kvd_ops *s) {
    json_t *pools = json_array();
    json_t *duels = json_array(); /* pools with an eviction duel */
    for (uint32_t i = 0; i < s->reg->npools; i++) {
        kvd_reg_pool *p = &s->reg->pools[i];
        char dom[KVD_TENANT_NAME_MAX + 8];
        json_t *o = json_pack(
            "{s:i, s:o, s:o, s:i}", "id", (int)p->pool_id, "model", text(p->model_id), "domain",
            text(kvd_tenants_domain_name(s->reg->tenants, p->domain, dom, sizeof(dom))),
            "tokens_per_block", (int)p->layout.tokens_per_block);
        kvd_pool_stats(p->pool, pool_sink, o);
        add_hit_rate(o, get_u64(o, "hit_blocks"), get_u64(o, "query_blocks"));
        json_array_append_new(pools, o);
        if (p->duel != NULL) {
            uint64_t dv[DU_COUNT];
            duel_values(p->duel, dv);
            json_t *d =
                json_pack("{s:i, s:o, s:o}", "id", (int)p->pool_id, "model", text(p->model_id),
                          "domain", json_incref(json_object_get(o, "domain")));
            put_stats(d, duel_stats, dv, DU_COUNT);
            json_array_append_new(duels, d);
        }
    }
    json_t *tenants = json_array();
    uint32_t nt = kvd_tenants_count(s->reg->tenants);
    for (uint32_t t = 0; t < nt && t < KVD_MAX_TENANTS; t++) {
        const kvd_tenant_counters *tc = kvd_events_tenant(&s->reg->events, t);
        kvd_tenant_usage u = {0, 0, 0};
        for (uint32_t i = 0; i < s->reg->npools; i++) {
            kvd_tenant_usage pu = kvd_pool_tenant_usage(s->reg->pools[i].pool, t);
            u.held += pu.held;
            u.cached += pu.cached;
            u.pinned += pu.pinned;
        }
        uint64_t v[TS_COUNT];
        v[TS_SESSIONS] = kvd_registry_sessions(s->reg, t);
        v[TS_QUERIES] = tc->queries;
        v[TS_QUERY_BLOCKS] = tc->query_blocks;
        v[TS_HIT_BLOCKS] = tc->hit_blocks;
        v[TS_HIT_TOKENS] = tc->hit_tokens;
        v[TS_COMMITS] = tc->commits;
        v[TS_EVICTIONS_CAPACITY] = tc->evictions[KVD_EVICT_CAPACITY];
        v[TS_EVICTIONS_ADMIN] = tc->evictions[KVD_EVICT_ADMIN];
        v[TS_EVICTIONS_SHRINK] = tc->evictions[KVD_EVICT_SHRINK];
        v[TS_REFUSALS] = tc->refusals;
        v[TS_BLOCKS_HELD] = u.held;
        v[TS_BLOCKS_CACHED] = u.cached;
        v[TS_BLOCKS_PINNED] = u.pinned;
        json_t *o = json_pack("{s:i, s:o}", "id", (int)t, "name",
                              text(kvd_tenants_name(s->reg->tenants, t)));
        put_stats(o, tenant_stats, v, TS_COUNT);
        add_hit_rate(o, tc->hit_blocks, tc->query_blocks);
        json_array_append_new(tenants, o);
    }
    uint64_t v[DS_COUNT];
    v[DS_SESSIONS] = kvd_server_counts(s->srv)->conns;
    v[DS_POOLS] = s->reg->npools;
    v[DS_POOL_MEMORY_BYTES] = s->cfg->pool_memory;
    v[DS_POOL_MEMORY_USED_BYTES] = kvd_registry_budget_used(s->reg);
    v[DS_INDEX_ENTRIES] = kvd_index_count(s->reg->index);
    v[DS_INDEX_CAPACITY] = kvd_index_capacity(s->reg->index);
    v[DS_DRAINING] = (uint64_t)kvd_server_draining(s->srv);
    v[DS_UPTIME_SECONDS] = (uv_now(s->loop) - s->start_loop_ms) / 1000;
    v[DS_EVENTS_EVICT] = s->reg->events.pushed[KVD_EVENT_EVICT];
    v[DS_EVENTS_REFUSE] = s->reg->events.pushed[KVD_EVENT_REFUSE];
    json_t *daemon = json_object();
    put_stats(daemon, daemon_stats, v, DS_COUNT);
    /* The lower tiers over all pools (daemon/tiers; zeros and "off" without them). */
    json_t *tiers = json_object();
    kvd_tiers_stats(s->tiers, pool_sink, tiers);
    char state[1024];
    json_object_set_new(tiers, "state", text(kvd_tiers_state(s->tiers, state, sizeof(state))));
    /* KV events (daemon/kvevents; zeros without publishers). */
    json_t *kvev = json_object();
    kvd_kvevents_stats(s->kvevents, pool_sink, kvev);
    return json_pack("{s:o, s:o, s:o, s:o, s:o, s:o}", "daemon", daemon, "pools", pools, "duel",
                     duels, "tenants", tenants, "tiers", tiers, "kv_events", kvev);
}

/* ---- commands -------------------------------------------------------------------------- */

static kv_err cmd_help(kvd_ops *s, int argc, char **argv, json_t **out, char *msg) {
    (void)s, (void)argc, (void)argv, (void)msg;
    size_t n;
    const kvd_admin_cmd *cmds = kvd_admin_cmds(&n);
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++) {
        json_array_append_new(a, json_pack("{s:s, s:s, s:s}", "command", cmds[i].name, "args",
                                           cmds[i].args, "summary", cmds[i].summary));
    }
    *out = json_pack("{s:o}", "commands", a);
    return KV_OK;
}

static kv_err no_args(int argc, char *msg) {
    if (argc != 0) {
        FAIL(KV_EINVAL, "this command takes no arguments");
    }
    return KV_OK;
}

static kv_err cmd_info(kvd_ops *s, int argc, char **argv, json_t **out, char *msg) {
    (void)argv;
    kv_err rc = no_args(argc, msg);
    if (rc != KV_OK) {
        return rc;
    }
    char epoch[17];
    snprintf(epoch, sizeof(epoch), "%016" PRIx64, s->boot_epoch);
    size_t n;
    const kvd_config_option *opts = kvd_config_options(&n);
    json_t *cfg = json_object();
    for (size_t i = 0; i < n; i++) {
        char v[KVD_CONFIG_PATH_MAX];
        kvd_config_format(s->cfg, &opts[i], v, sizeof(v));
        json_object_set_new(cfg, opts[i].name, json_string(v));
    }
    char thp[32];
    *out = json_pack(
        "{s:s, s:s, s:o, s:o, s:i, s:i, s:s, s:s, s:s, s:b, s:b, s:o, s:s, s:o}", "version",
        KV_VERSION, "boot_epoch", epoch, "start_unix_ms", u64(s->start_unix_ms), "uptime_seconds",
        u64((uv_now(s->loop) - s->start_loop_ms) / 1000), "pid", (int)getpid(), "uid",
        (int)geteuid(), "backend", s->cfg->backend, "socket", kvd_server_socket_path(s->srv),
        "admin_socket", s->admin_path, "draining", kvd_server_draining(s->srv), "ready",
        kvd_ops_ready(s), "metrics_port", u64(s->metrics_port), "shmem_thp",
        kv_shmem_thp_mode(thp, sizeof(thp)), "config", cfg);
    return KV_OK;
}

static kv_err cmd_stats(kvd_ops *s, int argc, char **argv, json_t **out, char *msg) {
    (void)argv;
    kv_err rc = no_args(argc, msg);
    if (rc != KV_OK) {
        return rc;
    }
    *out = kvd_admin_stats(s);
    return *out != NULL ? KV_OK : KV_ENOMEM;
}

static kv_err cmd_pools(kvd_ops *s, int argc, char **argv, json_t **out, char *msg) {
    (void)argv;
    kv_err rc = no_args(argc, msg);
    if (rc != KV_OK) {
        return rc;
    }
    json_t *a = json_array();
    for (uint32_t i = 0; i < s->reg->npools; i++) {
        kvd_reg_pool *p = &s->reg->pools[i];
        const kvd_pool_config *pc = kvd_pool_config_get(p->pool);
        char dom[KVD_TENANT_NAME_MAX + 8];
        json_t *o = json_pack(
            "{s:i, s:o, s:o, s:{s:i, s:i, s:i, s:i, s:s, s:s, s:o}, s:i, s:i, s:o, s:s}", "id",
            (int)p->pool_id, "model", text(p->model_id), "domain",
            text(kvd_tenants_domain_name(s->reg->tenants, p->domain, dom, sizeof(dom))), "layout",
            "layers", (int)p->layout.num_layers, "kv_heads", (int)p->layout.num_kv_heads,
            "head_dim", (int)p->layout.head_dim, "tokens_per_block",
            (int)p->layout.tokens_per_block, "dtype", kv_dtype_name(p->layout.dtype), "arrangement",
            kv_arrangement_name(p->layout.arrangement), "block_bytes", u64(p->layout.block_bytes),
            "blocks_per_segment", (int)pc->blocks_per_segment, "max_segments",
            (int)pc->max_segments, "segment_bytes", u64(p->segment_bytes), "policy",
            kvd_evict_policy_name(pc->policy));
        kvd_pool_stats(p->pool, pool_sink, o);
        json_t *lt = json_object(); /* this pool's lower tiers (docs/TIERS.md) */
        kvd_tiers_pool_stats(p, pool_sink, lt);
        json_object_set_new(lt, "lossy", json_boolean((p->flags & KVD_POOL_LOSSY_TIERS) != 0));
        json_object_set_new(o, "tiers", lt);
        json_t *du = json_null(); /* its eviction duel (evict-duel), null without one */
        if (p->duel != NULL) {
            uint64_t dv[DU_COUNT];
            duel_values(p->duel, dv);
            du = json_object();
            put_stats(du, duel_stats, dv, DU_COUNT);
        }
        json_object_set_new(o, "duel", du);
        json_array_append_new(a, o);
    }
    *out = json_pack("{s:o}", "pools", a);
    return KV_OK;
}

static kv_err cmd_tenants(kvd_ops *s, int argc, char **argv, json_t **out, char *msg) {
    (void)argv;
    kv_err rc = no_args(argc, msg);
    if (rc != KV_OK) {
        return rc;
    }
    json_t *st = kvd_admin_stats(s);
    if (st == NULL) {
        return KV_ENOMEM;
    }
    *out = json_pack("{s:O}", "tenants", json_object_get(st, "tenants"));
    json_decref(st);
    return KV_OK;
}

typedef struct session_rows {
    const kvd_ops *s;
    json_t *a;
} session_rows;

static void session_row(void *arg, const kvd_session *c) {
    session_rows *r = arg;
    json_array_append_new(
        r->a,
        json_pack("{s:o, s:i, s:i, s:i, s:o, s:o, s:o, s:i, s:o, s:o}", "id", u64(c->id), "pid",
                  (int)c->pid, "uid", (int)c->uid, "gid", (int)c->gid, "tenant",
                  c->hello ? text(kvd_tenants_name(r->s->reg->tenants, c->tenant)) : json_null(),
                  "client", text(c->name), "blocks_held", u64(kvd_session_refs_held(c)), "pools",
                  (int)c->npools, "requests", u64(c->requests), "errors", u64(c->errors)));
}

static kv_err cmd_sessions(kvd_ops *s, int argc, char **argv, json_t **out, char *msg) {
    (void)argv;
    kv_err rc = no_args(argc, msg);
    if (rc != KV_OK) {
        return rc;
    }
    session_rows rows = {s, json_array()};
    kvd_server_each_session(s->srv, session_row, &rows);
    *out = json_pack("{s:o}", "sessions", rows.a);
    return KV_OK;
}

/* -- prefixes: the forest of committed blocks (parent links), top roots by hits -- */

typedef struct prefix_forest {
    const kvd_pool *pool; /* the pool walked */
    uint32_t n;           /* ids 0..n */
    uint32_t *first;      /* first child of id, KVD_NO_BLOCK for none */
    uint32_t *sibling;    /* next sibling of id */
    uint32_t *hits;       /* hits of id */
    uint32_t *size;       /* blocks in the subtree of id */
    uint32_t *depth;      /* longest chain from id down, in blocks */
    kv_hash128 *hash;     /* hash of id */
} prefix_forest;

static json_t *prefix_node(const prefix_forest *f, uint32_t id, unsigned levels) {
    /* Collapse a chain of single children into one node of `blocks` blocks. */
    uint32_t run = 1, last = id;
    while (f->first[last] != KVD_NO_BLOCK && f->sibling[f->first[last]] == KVD_NO_BLOCK) {
        last = f->first[last];
        run++;
    }
    json_t *o = json_pack("{s:i, s:o, s:i, s:i, s:i, s:i}", "block", (int)id, "hash",
                          hash_json(f->hash[id]), "hits", (int)f->hits[id], "blocks", (int)run,
                          "size", (int)f->size[id], "depth", (int)f->depth[id]);
    json_t *kids = json_array();
    unsigned shown = 0, more = 0;
    for (uint32_t k = f->first[last]; k != KVD_NO_BLOCK; k = f->sibling[k]) {
        if (levels > 1 && shown < 8) {
            json_array_append_new(kids, prefix_node(f, k, levels - 1));
            shown++;
        } else {
            more++;
        }
    }
    json_object_set_new(o, "children", kids);
    json_object_set_new(o, "more_children", json_integer(more));
    return o;
}

static int cmp_hits_desc(const void *a, const void *b, void *arg) {
    const uint32_t *h = arg;
    uint32_t x = h[*(const uint32_t *)a], y = h[*(const uint32_t *)b];
    return x < y ? 1 : x > y ? -1 : 0;
}

static kv_err pool_prefixes(kvd_reg_pool *sp, size_t top, unsigned levels, json_t **out) {
    const kvd_pool *pool = sp->pool;
    prefix_forest f;
    memset(&f, 0, sizeof(f));
    f.pool = pool;
    f.n = kvd_pool_segment_slots(pool) * kvd_pool_config_get(pool)->blocks_per_segment;
    size_t cnt = f.n > 0 ? f.n : 1;
    f.first = malloc(cnt * sizeof(uint32_t));
    f.sibling = malloc(cnt * sizeof(uint32_t));
    f.hits = calloc(cnt, sizeof(uint32_t));
    f.size = calloc(cnt, sizeof(uint32_t));
    f.depth = calloc(cnt, sizeof(uint32_t));
    f.hash = calloc(cnt, sizeof(kv_hash128));
    uint32_t *parent = malloc(cnt * sizeof(uint32_t));
    uint32_t *roots = malloc(cnt * sizeof(uint32_t));
    uint32_t *order = malloc(cnt * sizeof(uint32_t));
    uint8_t *live = calloc(cnt, 1);
    kv_err rc = KV_ENOMEM;
    if (f.first == NULL || f.sibling == NULL || f.hits == NULL || f.size == NULL ||
        f.depth == NULL || f.hash == NULL || parent == NULL || roots == NULL || order == NULL ||
        live == NULL) {
        goto cleanup;
    }
    for (uint32_t i = 0; i < f.n; i++) {
        f.first[i] = f.sibling[i] = parent[i] = KVD_NO_BLOCK;
        kvd_block_info bi;
        if (kvd_pool_block_info(pool, i, &bi) == KV_OK &&
            (bi.state == KVD_BLOCK_COMMITTED || bi.state == KVD_BLOCK_CACHED)) {
            live[i] = 1;
            f.hits[i] = bi.hits;
            f.hash[i] = bi.hash;
            parent[i] = bi.parent;
        }
    }
    uint32_t nroots = 0;
    for (uint32_t i = 0; i < f.n; i++) {
        if (!live[i]) {
            continue;
        }
        uint32_t p = parent[i];
        if (p != KVD_NO_BLOCK && p < f.n && live[p] && p != i) {
            f.sibling[i] = f.first[p];
            f.first[p] = i;
        } else {
            roots[nroots++] = i; /* first block of a prefix (or its parent was evicted) */
        }
    }
    /* Post-order by an explicit stack (prefix chains can be thousands of blocks deep). */
    uint32_t norder = 0;
    for (uint32_t r = 0; r < nroots; r++) {
        uint32_t top_of = norder;
        order[norder++] = roots[r];
        for (uint32_t k = top_of; k < norder; k++) {
            for (uint32_t c = f.first[order[k]]; c != KVD_NO_BLOCK; c = f.sibling[c]) {
                if (norder < f.n) {
                    order[norder++] = c;
                }
            }
        }
    }
    /* BFS order: children come after parents, so a reverse walk sees children first. */
    for (uint32_t k = norder; k-- > 0;) {
        uint32_t id = order[k];
        uint32_t size = 1, depth = 0;
        for (uint32_t c = f.first[id]; c != KVD_NO_BLOCK; c = f.sibling[c]) {
            size += f.size[c];
            depth = f.depth[c] > depth ? f.depth[c] : depth;
        }
        f.size[id] = size;
        f.depth[id] = depth + 1;
    }
    qsort_r(roots, nroots, sizeof(uint32_t), cmp_hits_desc, f.hits);
    json_t *a = json_array();
    for (uint32_t r = 0; r < nroots && r < top; r++) {
        json_array_append_new(a, prefix_node(&f, roots[r], levels));
    }
    *out = json_pack("{s:i, s:o, s:i, s:o}", "pool", (int)sp->pool_id, "model", text(sp->model_id),
                     "prefixes", (int)nroots, "top", a);
    rc = KV_OK;
cleanup:
    free(f.first);
    free(f.sibling);
    free(f.hits);
    free(f.size);
    free(f.depth);
    free(f.hash);
    free(parent);
    free(roots);
    free(order);
    free(live);
    return rc;
}

static kv_err cmd_prefixes(kvd_ops *s, int argc, char **argv, json_t **out, char *msg) {
    uint64_t pool = 0, top = 10, levels = 4;
    for (int i = 0; i < argc; i++) {
        const char *v;
        if ((v = kv_arg(argv[i], "pool")) != NULL && parse_num(v, &pool) == 0) {
            continue;
        }
        if ((v = kv_arg(argv[i], "top")) != NULL && parse_num(v, &top) == 0 && top > 0) {
            continue;
        }
        if ((v = kv_arg(argv[i], "levels")) != NULL && parse_num(v, &levels) == 0 && levels > 0 &&
            levels <= 16) {
            continue;
        }
        FAIL(KV_EINVAL, "bad argument '%.64s' (pool=ID top=N levels=1..16)", argv[i]);
    }
    if (pool != 0 && pool_by_id(s, pool) == NULL) {
        FAIL(KV_ENOENT, "no pool %" PRIu64 " (see pools)", pool);
    }
    json_t *a = json_array();
    for (uint32_t i = 0; i < s->reg->npools; i++) {
        if (pool != 0 && s->reg->pools[i].pool_id != pool) {
            continue;
        }
        json_t *o;
        kv_err rc = pool_prefixes(&s->reg->pools[i], top, (unsigned)levels, &o);
        if (rc != KV_OK) {
            json_decref(a);
            FAIL(rc, "no memory to walk pool %u", s->reg->pools[i].pool_id);
        }
        json_array_append_new(a, o);
    }
    *out = json_pack("{s:o}", "pools", a);
    return KV_OK;
}

/* -- evict -- */

#define EVICT_DRY_MAX 1000000u /* blocks a dry run lists at most (one JSON object each) */

static kv_err cmd_evict(kvd_ops *s, int argc, char **argv, json_t **out, char *msg) {
    int dry = 0, all = 0;
    int64_t tenant = -1;
    uint64_t pool = 0, max = 0;
    for (int i = 0; i < argc; i++) {
        const char *v;
        if (strcmp(argv[i], "--dry-run") == 0) {
            dry = 1;
        } else if (strcmp(argv[i], "all") == 0) {
            all = 1;
        } else if ((v = kv_arg(argv[i], "tenant")) != NULL) {
            uint32_t t;
            if (tenant_by_name(s, v, &t) != KV_OK) {
                FAIL(KV_ENOENT, "no tenant '%.64s' (see tenants)", v);
            }
            tenant = t;
        } else if ((v = kv_arg(argv[i], "pool")) != NULL && parse_num(v, &pool) == 0 && pool > 0) {
            if (pool_by_id(s, pool) == NULL) {
                FAIL(KV_ENOENT, "no pool %" PRIu64 " (see pools)", pool);
            }
        } else if ((v = kv_arg(argv[i], "max")) != NULL && parse_num(v, &max) == 0 && max > 0) {
        } else {
            FAIL(KV_EINVAL, "bad argument '%.64s' (--dry-run, all, tenant=NAME, pool=ID, max=N)",
                 argv[i]);
        }
    }
    if (!all && tenant < 0 && pool == 0) {
        FAIL(KV_EINVAL, "say what to evict: all, tenant=NAME or pool=ID (and --dry-run to look)");
    }
    if (dry && max > EVICT_DRY_MAX) {
        FAIL(KV_EINVAL, "--dry-run lists at most %u blocks (max=%llu)", EVICT_DRY_MAX,
             (unsigned long long)max);
    }
    size_t limit = max > 0 ? (size_t)max : (dry ? 1000 : SIZE_MAX);
    json_t *pools = json_array();
    uint64_t total = 0;
    for (uint32_t i = 0; i < s->reg->npools && total < limit; i++) {
        kvd_reg_pool *sp = &s->reg->pools[i];
        if (pool != 0 && sp->pool_id != pool) {
            continue;
        }
        kvd_pool_set_now(sp->pool, kvd_registry_now(s->reg)); /* expired pins protect nothing */
        size_t want = limit - (size_t)total;
        kvd_block_ref *refs = NULL;
        if (dry) {
            refs = calloc(want, sizeof(*refs));
            if (refs == NULL) {
                json_decref(pools);
                FAIL(KV_ENOMEM, "no memory for %zu blocks", want);
            }
        }
        size_t n = 0;
        kv_err rc = kvd_pool_evict(sp->pool, want, tenant, KVD_EVICT_ADMIN, dry, refs, &n);
        if (rc != KV_OK) {
            free(refs);
            json_decref(pools);
            FAIL(rc, "evict in pool %u: %s", sp->pool_id, kv_strerror(rc));
        }
        const char *policy = kvd_evict_policy_name(kvd_pool_config_get(sp->pool)->policy);
        json_t *o = json_pack("{s:i, s:o, s:s}", "pool", (int)sp->pool_id, "blocks", u64(n),
                              "policy", policy);
        if (dry) {
            json_t *blocks = json_array();
            for (size_t k = 0; k < n; k++) {
                kvd_block_info bi;
                if (kvd_pool_block_info(sp->pool, refs[k].id, &bi) != KV_OK) {
                    continue;
                }
                char why[128];
                snprintf(why, sizeof(why),
                         "cached (refcount 0), unpinned; position %zu in %s eviction order", k + 1,
                         policy);
                json_array_append_new(
                    blocks, json_pack("{s:i, s:o, s:s, s:i, s:s}", "block", (int)refs[k].id, "hash",
                                      hash_json(bi.hash), "tenant",
                                      kvd_tenants_name(s->reg->tenants, bi.tenant), "hits",
                                      (int)bi.hits, "why", why));
            }
            json_object_set_new(o, "would_evict", blocks);
        } else if (n > 0) {
            if (tenant >= 0) {
                kvd_events_tenant(&s->reg->events, (uint32_t)tenant)->evictions[KVD_EVICT_ADMIN] +=
                    n;
            }
            kvd_events_push(&s->reg->events, KVD_EVENT_EVICT, sp->pool_id, tenant, n, KV_OK,
                            "admin", "admin evict (%s%s) in pool %u evicted %zu cached blocks",
                            tenant >= 0 ? "tenant " : "all",
                            tenant >= 0 ? kvd_tenants_name(s->reg->tenants, (uint32_t)tenant) : "",
                            sp->pool_id, n);
        }
        free(refs);
        total += n;
        json_array_append_new(pools, o);
    }
    if (!dry) {
        KV_LOG(INFO, "KVD-ADMIN-EVICT", "admin evict: %" PRIu64 " cached blocks evicted", total);
    }
    *out = json_pack("{s:b, s:o, s:o}", "dry_run", dry, dry ? "would_evict" : "evicted", u64(total),
                     "pools", pools);
    return KV_OK;
}

/* -- pin / unpin -- */

/* Finds the committed or cached block with hash in pool `pool` (0: any pool). */
/* Finds the committed or cached block whose hash is hex, or starts with hex (a unique prefix of
 * at least 6 hex digits, as kvctl prefixes prints 12), in pool `pool` (0: any pool). */
static kv_err find_hash(kvd_ops *s, const char *hex, uint64_t pool, kvd_reg_pool **sp_out,
                        kvd_block_ref *ref, char *msg) {
    size_t len = strlen(hex);
    if (len < 6 || len > 32 || strspn(hex, "0123456789abcdefABCDEF") != len) {
        FAIL(KV_EINVAL,
             "'%.64s' is not a block hash (32 hex digits, or a unique prefix of at least 6, as "
             "prefixes prints)",
             hex);
    }
    char want[33];
    for (size_t i = 0; i <= len; i++) {
        want[i] = (char)(hex[i] >= 'A' && hex[i] <= 'F' ? hex[i] - 'A' + 'a' : hex[i]);
    }
    size_t matches = 0;
    for (uint32_t i = 0; i < s->reg->npools; i++) {
        kvd_reg_pool *sp = &s->reg->pools[i];
        if (pool != 0 && sp->pool_id != pool) {
            continue;
        }
        /* A pin's expiry counts from now, not from the pool's last request. */
        kvd_pool_set_now(sp->pool, kvd_registry_now(s->reg));
        uint32_t n =
            kvd_pool_segment_slots(sp->pool) * kvd_pool_config_get(sp->pool)->blocks_per_segment;
        for (uint32_t id = 0; id < n; id++) {
            kvd_block_info bi;
            char bh[33];
            if (kvd_pool_block_info(sp->pool, id, &bi) != KV_OK ||
                (bi.state != KVD_BLOCK_COMMITTED && bi.state != KVD_BLOCK_CACHED)) {
                continue;
            }
            kv_hash_hex(bi.hash, bh);
            if (strncmp(bh, want, len) == 0) {
                if (matches++ == 0) {
                    *sp_out = sp;
                    ref->id = id;
                    ref->gen = bi.gen;
                }
            }
        }
    }
    if (matches > 1) {
        FAIL(KV_EINVAL, "hash prefix %s matches %zu blocks; give more digits (or pool=ID)", hex,
             matches);
    }
    if (matches == 0) {
        FAIL(KV_ENOENT, "no cached block with hash %s%s%s", hex, len < 32 ? "..." : "",
             pool != 0 ? " in that pool" : "");
    }
    return KV_OK;
}

static kv_err cmd_pin(kvd_ops *s, int argc, char **argv, json_t **out, char *msg) {
    if (argc < 1) {
        FAIL(KV_EINVAL, "usage: pin HASH [pool=ID] [retention=MS] [priority=0..255]");
    }
    uint64_t pool = 0, retention = 3600000, prio = 0;
    for (int i = 1; i < argc; i++) {
        const char *v;
        if (((v = kv_arg(argv[i], "pool")) != NULL && parse_num(v, &pool) == 0) ||
            ((v = kv_arg(argv[i], "retention")) != NULL && parse_num(v, &retention) == 0) ||
            ((v = kv_arg(argv[i], "priority")) != NULL && parse_num(v, &prio) == 0 &&
             prio <= 255)) {
            continue;
        }
        FAIL(KV_EINVAL, "bad argument '%.64s' (pool=ID retention=MS priority=0..255)", argv[i]);
    }
    kvd_reg_pool *sp;
    kvd_block_ref ref;
    kv_err rc = find_hash(s, argv[0], pool, &sp, &ref, msg);
    if (rc != KV_OK) {
        return rc;
    }
    rc = kvd_pool_pin(sp->pool, ref, retention, (uint8_t)prio, KVD_PIN_OWNER);
    if (rc != KV_OK) {
        FAIL(rc, "pin block %u of pool %u: %s", ref.id, sp->pool_id, kv_strerror(rc));
    }
    *out = json_pack("{s:i, s:i, s:o, s:i}", "pool", (int)sp->pool_id, "block", (int)ref.id,
                     "retention_ms", u64(retention), "priority", (int)prio);
    return KV_OK;
}

static kv_err cmd_unpin(kvd_ops *s, int argc, char **argv, json_t **out, char *msg) {
    uint64_t pool = 0;
    if (argc < 1 || argc > 2 ||
        (argc == 2 &&
         (kv_arg(argv[1], "pool") == NULL || parse_num(kv_arg(argv[1], "pool"), &pool) != 0))) {
        FAIL(KV_EINVAL, "usage: unpin HASH [pool=ID]");
    }
    kvd_reg_pool *sp;
    kvd_block_ref ref;
    kv_err rc = find_hash(s, argv[0], pool, &sp, &ref, msg);
    if (rc != KV_OK) {
        return rc;
    }
    rc = kvd_pool_unpin(sp->pool, ref);
    if (rc != KV_OK) {
        FAIL(rc, "unpin block %u of pool %u: %s", ref.id, sp->pool_id, kv_strerror(rc));
    }
    *out = json_pack("{s:i, s:i}", "pool", (int)sp->pool_id, "block", (int)ref.id);
    return KV_OK;
}

/* -- quota -- */

static void quota_sink(void *arg, const char *name, uint64_t value) {
    json_object_set_new((json_t *)arg, name, u64(value));
}

static kv_err quota_one(kvd_ops *s, const char *tenant, json_t **out, char *msg) {
    kvd_quota q;
    kv_err rc = kvd_registry_quota_get(s->reg, tenant, &q);
    if (rc != KV_OK) {
        FAIL(rc, "no tenant '%.64s' (see tenants)", tenant);
    }
    json_t *limits = json_object();
    kvd_quota_report(&q, quota_sink, limits);
    json_t *usage = json_object();
    uint32_t id;
    if (strcmp(tenant, "default") != 0) {
        (void)kvd_registry_quota_usage(s->reg, tenant, quota_sink, usage);
    }
    if (strcmp(tenant, "default") != 0 && kvd_tenants_find(s->reg->tenants, tenant, &id) == KV_OK) {
        kvd_tier_usage u;
        kvd_tiers_tenant_usage(s->tiers, id, &u);
        quota_sink(usage, "tier1", u.blocks[0]);
        quota_sink(usage, "tier2", u.blocks[1]);
        quota_sink(usage, "tier1_bytes", u.bytes[0]);
        quota_sink(usage, "tier2_bytes", u.bytes[1]);
    }
    *out = json_pack("{s:s, s:o, s:o}", "tenant", tenant, "quota", limits, "usage", usage);
    return KV_OK;
}

static kv_err cmd_quota_get(kvd_ops *s, int argc, char **argv, json_t **out, char *msg) {
    if (argc == 1) {
        return quota_one(s, argv[0], out, msg);
    }
    if (argc != 0) {
        FAIL(KV_EINVAL, "usage: quota get [TENANT]");
    }
    json_t *a = json_array();
    json_t *o;
    if (quota_one(s, "default", &o, msg) == KV_OK) {
        json_array_append_new(a, o);
    }
    uint32_t n = kvd_tenants_count(s->reg->tenants);
    for (uint32_t t = 0; t < n; t++) {
        if (quota_one(s, kvd_tenants_name(s->reg->tenants, t), &o, msg) == KV_OK) {
            json_array_append_new(a, o);
        }
    }
    *out = json_pack("{s:o}", "quotas", a);
    return KV_OK;
}

static kv_err cmd_quota_set(kvd_ops *s, int argc, char **argv, json_t **out, char *msg) {
    if (argc != 3) {
        FAIL(KV_EINVAL, "usage: quota set TENANT NAME VALUE (NAME: %s)", KVD_QUOTA_NAMES);
    }
    char err[KVD_ADMIN_MSG];
    err[0] = '\0';
    kv_err rc = kvd_registry_quota_set_field(s->reg, argv[0], argv[1], argv[2], err, sizeof(err));
    if (rc != KV_OK) {
        FAIL(rc, "%s", err[0] != '\0' ? err : kv_strerror(rc));
    }
    KV_LOG(INFO, "KVD-ADMIN-QUOTA", "quota of %s: %s = %s", argv[0], argv[1], argv[2]);
    return quota_one(s, argv[0], out, msg);
}

/* -- config, log -- */

static json_t *option_json(const kvd_config *c, const kvd_config_option *o) {
    char v[KVD_CONFIG_PATH_MAX];
    kvd_config_format(c, o, v, sizeof(v));
    return json_pack("{s:s, s:s, s:s, s:b, s:s}", "name", o->name, "value", v, "default", o->def,
                     "runtime", o->runtime, "description", o->description);
}

static kv_err cmd_config_get(kvd_ops *s, int argc, char **argv, json_t **out, char *msg) {
    if (argc == 1) {
        const kvd_config_option *o = kvd_config_find(argv[0]);
        if (o == NULL) {
            FAIL(KV_ENOENT, "unknown option '%.64s' (config get lists them)", argv[0]);
        }
        *out = option_json(s->cfg, o);
        return KV_OK;
    }
    if (argc != 0) {
        FAIL(KV_EINVAL, "usage: config get [NAME]");
    }
    size_t n;
    const kvd_config_option *opts = kvd_config_options(&n);
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++) {
        json_array_append_new(a, option_json(s->cfg, &opts[i]));
    }
    *out = json_pack("{s:o}", "options", a);
    return KV_OK;
}

static kv_err cmd_config_set(kvd_ops *s, int argc, char **argv, json_t **out, char *msg) {
    if (argc != 2) {
        FAIL(KV_EINVAL, "usage: config set NAME VALUE");
    }
    const kvd_config_option *o = kvd_config_find(argv[0]);
    if (o == NULL) {
        FAIL(KV_ENOENT, "unknown option '%.64s' (config get lists them)", argv[0]);
    }
    if (!o->runtime) {
        FAIL(KV_ENOTSUP, "%s is not runtime-settable; restart kvd with --%s=%.64s", o->name,
             o->name, argv[1]);
    }
    char err[KVD_ADMIN_MSG];
    kvd_config next = *s->cfg;
    kv_err rc = kvd_config_set(&next, o->name, argv[1], err, sizeof(err));
    if (rc == KV_OK) {
        rc = kvd_config_check(&next, err, sizeof(err));
    }
    if (rc != KV_OK) {
        FAIL(rc, "%s", err);
    }
    *s->cfg = next; /* the live copy every layer reads */
    kv_log_threshold = s->cfg->log_level;
    KV_LOG(INFO, "KVD-ADMIN-CONFIG", "config set %s = %s", o->name, argv[1]);
    *out = option_json(s->cfg, o);
    return KV_OK;
}

static kv_err cmd_log_level(kvd_ops *s, int argc, char **argv, json_t **out, char *msg) {
    if (argc == 1) {
        kv_log_level l;
        if (kv_log_level_parse(argv[0], &l) != 0) {
            FAIL(KV_EINVAL, "'%.64s' is not error, warn, info or debug", argv[0]);
        }
        s->cfg->log_level = l;
        kv_log_threshold = l;
        KV_LOG(INFO, "KVD-ADMIN-LOG", "log level set to %s", kv_log_level_name(l));
    } else if (argc != 0) {
        FAIL(KV_EINVAL, "usage: log level [error|warn|info|debug]");
    }
    *out = json_pack("{s:s}", "level", kv_log_level_name(kv_log_threshold));
    return KV_OK;
}

/* -- events -- */

static kv_err cmd_events(kvd_ops *s, int argc, char **argv, json_t **out, char *msg) {
    uint64_t want = 50;
    int kind = 0;
    for (int i = 0; i < argc; i++) {
        const char *v;
        if (parse_num(argv[i], &want) == 0) {
            continue;
        }
        if ((v = kv_arg(argv[i], "kind")) != NULL &&
            (strcmp(v, "evict") == 0 || strcmp(v, "refuse") == 0)) {
            kind = strcmp(v, "evict") == 0 ? KVD_EVENT_EVICT : KVD_EVENT_REFUSE;
            continue;
        }
        FAIL(KV_EINVAL, "bad argument '%.64s' (events [N] [kind=evict|refuse])", argv[i]);
    }
    size_t n = kvd_events_count(&s->reg->events);
    /* Newest last; walk back from the newest to find the first one shown. */
    size_t first = n, taken = 0;
    while (first > 0 && taken < want) {
        first--;
        if (kind == 0 || (int)kvd_events_at(&s->reg->events, first)->kind == kind) {
            taken++;
        }
    }
    json_t *a = json_array();
    for (size_t i = first; i < n; i++) {
        const kvd_event *e = kvd_events_at(&s->reg->events, i);
        if (kind != 0 && (int)e->kind != kind) {
            continue;
        }
        json_array_append_new(
            a, json_pack("{s:o, s:o, s:s, s:s, s:i, s:o, s:o, s:s}", "seq", u64(e->seq), "unix_ms",
                         u64(e->unix_ms), "kind", e->kind == KVD_EVENT_EVICT ? "evict" : "refuse",
                         "reason", e->reason, "pool", (int)e->pool_id, "tenant",
                         e->tenant >= 0
                             ? json_string(kvd_tenants_name(s->reg->tenants, (uint32_t)e->tenant))
                             : json_null(),
                         "count", u64(e->count), "detail", e->detail));
    }
    *out = json_pack("{s:o, s:o}", "events", a, "dropped",
                     u64(s->reg->events.next_seq - 1 - kvd_events_count(&s->reg->events)));
    return KV_OK;
}

/* -- tiers -- */

/* One pool's tier policy and contents as JSON (the pool has tiers). */
static json_t *tier_pool_json(kvd_ops *s, kvd_reg_pool *p) {
    kvd_tier_policy pol;
    if (kvd_tiers_pool_policy(s->tiers, p, &pol) != KV_OK) {
        return NULL;
    }
    json_t *o =
        json_pack("{s:i, s:o, s:s, s:s, s:o, s:o, s:s, s:b, s:b}", "pool", (int)p->pool_id, "model",
                  text(p->model_id), "write", pol.write_through ? "write-through" : "write-back",
                  "remote_write", pol.remote_back ? "write-back" : "write-through", "min_hits",
                  u64(pol.min_hits), "clean_ahead", u64(pol.clean_ahead), "format", pol.format,
                  "tier2", pol.has_t2, "own_settings", pol.own);
    kvd_tiers_pool_stats(p, pool_sink, o);
    return o;
}

static kv_err cmd_tiers(kvd_ops *s, int argc, char **argv, json_t **out, char *msg) {
    uint64_t pool = 0;
    int nset = 0;
    for (int i = 0; i < argc; i++) {
        const char *v = kv_arg(argv[i], "pool");
        if (v != NULL) {
            if (parse_num(v, &pool) != 0 || pool_by_id(s, pool) == NULL) {
                FAIL(KV_ENOENT, "no pool '%.32s' (see pools)", v);
            }
        } else if (strchr(argv[i], '=') != NULL) {
            nset++;
        } else {
            FAIL(KV_EINVAL,
                 "bad argument '%.64s' (pool=ID, write=, remote-write=, min-hits=, clean-ahead=)",
                 argv[i]);
        }
    }
    if (nset > 0 && pool == 0) {
        FAIL(KV_EINVAL, "settings need pool=ID (the daemon-wide ones are options: config set)");
    }
    if (nset > 0) {
        kvd_reg_pool *p = pool_by_id(s, pool);
        /* All or nothing: check every setting on a scratch copy first is overkill for four
         * fields; they are applied in order and the first bad one stops (earlier ones stay,
         * the message says which failed). */
        for (int i = 0; i < argc; i++) {
            if (kv_arg(argv[i], "pool") != NULL) {
                continue;
            }
            char name[32];
            const char *eq = strchr(argv[i], '=');
            size_t n =
                (size_t)(eq - argv[i]) < sizeof(name) ? (size_t)(eq - argv[i]) : sizeof(name) - 1;
            memcpy(name, argv[i], n);
            name[n] = '\0';
            kv_err rc = kvd_tiers_pool_set(s->tiers, p, name, eq + 1, msg, KV_ERRMSG);
            if (rc != KV_OK) {
                return rc;
            }
        }
    }
    char state[1024];
    json_t *pools = json_array();
    for (uint32_t i = 0; i < s->reg->npools; i++) {
        kvd_reg_pool *p = &s->reg->pools[i];
        if (pool != 0 && p->pool_id != pool) {
            continue;
        }
        json_t *o = tier_pool_json(s, p);
        if (o != NULL) {
            json_array_append_new(pools, o);
        }
    }
    *out = json_pack("{s:s, s:o}", "state", kvd_tiers_state(s->tiers, state, sizeof(state)),
                     "pools", pools);
    return KV_OK;
}

/* -- remote-watch reconcile: a reconciliation pass now (daemon/tiers/tiers.h) -- */

static kv_err cmd_reconcile(kvd_ops *s, int argc, char **argv, json_t **out, char *msg) {
    (void)argv;
    if (argc != 0) {
        FAIL(KV_EINVAL, "remote-watch reconcile takes no argument");
    }
    int queued;
    uint64_t ledger;
    kv_err rc = kvd_tiers_reconcile_now(s->tiers, &queued, &ledger, msg, KVD_ADMIN_MSG);
    if (rc != KV_OK) {
        return rc;
    }
    *out = json_pack("{s:s, s:o}", "pass", queued ? "queued" : "started", "ledger", u64(ledger));
    return KV_OK;
}

/* -- trace: a request trace of this daemon's traffic (daemon/registry/reqtrace.h) -- */

static json_t *trace_json(const kvd_reqtrace_stats *st, int active) {
    return json_pack("{s:b, s:o, s:o, s:o, s:o, s:b}", "active", active, "path", text(st->path),
                     "requests", u64(st->requests), "bytes", u64(st->bytes), "max_bytes",
                     u64(st->max_bytes), "full", st->full);
}

static kv_err cmd_trace(kvd_ops *s, int argc, char **argv, json_t **out, char *msg) {
    kvd_reqtrace_stats st;
    if (argc == 0) {
        kvd_reqtrace_stats_get(s->reg->reqtrace, &st);
        *out = trace_json(&st, s->reg->reqtrace != NULL);
        return KV_OK;
    }
    if (strcmp(argv[0], "stop") == 0 && argc == 1) {
        if (s->reg->reqtrace == NULL) {
            FAIL(KV_ESTATE, "no trace is running (trace start path=PATH)");
        }
        kv_err rc = kvd_reqtrace_stop(s->reg->reqtrace, &st);
        s->reg->reqtrace = NULL;
        if (rc != KV_OK) {
            FAIL(rc, "trace %.180s: writing it failed (disk full?)", st.path);
        }
        *out = trace_json(&st, 0);
        return KV_OK;
    }
    if (strcmp(argv[0], "start") != 0) {
        FAIL(KV_EINVAL, "trace: start path=PATH [max-bytes=N], stop, or nothing (the state)");
    }
    const char *path = NULL;
    uint64_t max = 1ull << 30;
    for (int i = 1; i < argc; i++) {
        const char *v;
        if ((v = kv_arg(argv[i], "path")) != NULL) {
            path = v;
        } else if ((v = kv_arg(argv[i], "max-bytes")) != NULL) {
            if (parse_num(v, &max) != 0 || max == 0) {
                FAIL(KV_EINVAL, "trace: max-bytes '%.32s' is not a positive number", v);
            }
        } else {
            FAIL(KV_EINVAL, "trace start: unknown '%.64s' (path=PATH [max-bytes=N])", argv[i]);
        }
    }
    if (path == NULL) {
        FAIL(KV_EINVAL, "trace start needs path=PATH (a file that does not exist yet)");
    }
    if (s->reg->reqtrace != NULL) {
        kvd_reqtrace_stats_get(s->reg->reqtrace, &st);
        FAIL(KV_EBUSY, "a trace is running already (%.180s): trace stop first", st.path);
    }
    kv_err rc = kvd_reqtrace_start(path, max, &s->reg->reqtrace, msg, KVD_ADMIN_MSG);
    if (rc != KV_OK) {
        return rc;
    }
    kvd_reqtrace_stats_get(s->reg->reqtrace, &st);
    *out = trace_json(&st, 1);
    return KV_OK;
}

/* -- prefix-score: what a router asks a node -- */

static kv_err cmd_prefix_score(kvd_ops *s, int argc, char **argv, json_t **out, char *msg) {
    uint64_t pool = 0;
    size_t n = 0;
    kv_hash128 *h = calloc((size_t)(argc > 0 ? argc : 1), sizeof(*h));
    if (h == NULL) {
        FAIL(KV_ENOMEM, "no memory for %d hashes", argc);
    }
    for (int i = 0; i < argc; i++) {
        const char *v = kv_arg(argv[i], "pool");
        if (v != NULL) {
            if (parse_num(v, &pool) != 0 || pool_by_id(s, pool) == NULL) {
                free(h);
                FAIL(KV_ENOENT, "no pool '%.32s' (see pools)", v);
            }
        } else if (kv_hash_parse(argv[i], &h[n]) == KV_OK) {
            n++;
        } else {
            free(h);
            FAIL(KV_EINVAL, "bad argument '%.64s' (pool=ID, then block hashes as 32 hex digits)",
                 argv[i]);
        }
    }
    if (pool == 0 || n == 0) {
        free(h);
        FAIL(KV_EINVAL, "prefix-score needs pool=ID and at least one block hash");
    }
    kvd_reg_pool *p = pool_by_id(s, pool);
    size_t t0 = 0;
    while (t0 < n && kvd_pool_has(p->pool, h[t0])) {
        t0++;
    }
    kvd_tier_run below;
    kvd_tiers_probe_quiet(s->tiers, p, h + t0, n - t0, &below);
    free(h);
    *out = json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I}", "pool", (json_int_t)pool, "asked",
                     (json_int_t)n, "t0", (json_int_t)t0, "below", (json_int_t)below.fetchable,
                     "t1", (json_int_t)below.t1, "t2", (json_int_t)below.t2, "prefix",
                     (json_int_t)(t0 + below.fetchable));
    return KV_OK;
}

/* -- selftest, drain, ready -- */

static kv_err cmd_selftest_isolation(kvd_ops *s, int argc, char **argv, json_t **out, char *msg) {
    (void)argv;
    kv_err rc = no_args(argc, msg);
    if (rc != KV_OK) {
        return rc;
    }
    char report[8192];
    report[0] = '\0';
    rc = kvd_selftest_isolation(s, report, sizeof(report));
    json_t *checks = json_array();
    char *save = NULL;
    for (char *l = strtok_r(report, "\n", &save); l != NULL; l = strtok_r(NULL, "\n", &save)) {
        json_array_append_new(checks, json_string(l));
    }
    if (rc != KV_OK) {
        const char *first_fail = "";
        for (size_t i = 0; i < json_array_size(checks); i++) {
            const char *l = json_string_value(json_array_get(checks, i));
            if (strncmp(l, "FAIL", 4) == 0) {
                first_fail = l;
                break;
            }
        }
        json_decref(checks);
        FAIL(rc, "selftest isolation: %s%s%.180s", kv_strerror(rc), first_fail[0] ? ": " : "",
             first_fail);
    }
    *out = json_pack("{s:b, s:o}", "passed", 1, "checks", checks);
    return KV_OK;
}

static kv_err cmd_drain(kvd_ops *s, int argc, char **argv, json_t **out, char *msg) {
    if (argc == 1 && strcmp(argv[0], "off") == 0) {
        kvd_server_set_draining(s->srv, 0);
    } else if (argc == 0) {
        kvd_server_set_draining(s->srv, 1);
    } else {
        FAIL(KV_EINVAL, "usage: drain [off]");
    }
    int draining = kvd_server_draining(s->srv);
    KV_LOG(INFO, "KVD-ADMIN-DRAIN", "%s",
           draining ? "draining: new sessions are refused" : "drain cancelled: accepting sessions");
    uint64_t open = 0;
    uint32_t nt = kvd_tenants_count(s->reg->tenants);
    for (uint32_t t = 0; t < nt && t < KVD_MAX_TENANTS; t++) {
        open += kvd_registry_sessions(s->reg, t);
    }
    *out = json_pack("{s:b, s:i}", "draining", draining, "sessions", (int)open);
    return KV_OK;
}

static kv_err cmd_ready(kvd_ops *s, int argc, char **argv, json_t **out, char *msg) {
    (void)argv;
    kv_err rc = no_args(argc, msg);
    if (rc != KV_OK) {
        return rc;
    }
    if (kvd_server_draining(s->srv)) {
        FAIL(KV_EDRAINING, "not ready: draining");
    }
    if (!kvd_ops_ready(s)) {
        FAIL(KV_ECLOSED, "not ready: not listening (stopping)");
    }
    *out = json_pack("{s:b}", "ready", 1);
    return KV_OK;
}

/* ---- the table ------------------------------------------------------------------------- */

static const kvd_admin_cmd cmds[] = {
    {"help", "", "list the commands",
     "Result: `commands`, one object per command with `command`, "
     "`args` and `summary` (the same table this document is generated from).",
     cmd_help},
    {"info", "", "version, boot epoch, uptime, backend, sockets, readiness, every option's value",
     "Result: `version`, `boot_epoch` (16 hex digits; clients see it in every reply), "
     "`start_unix_ms`, `uptime_seconds`, `pid`, `uid`, `backend`, `socket`, `admin_socket`, "
     "`draining`, `ready`, `metrics_port` (0: off), `shmem_thp` (the kernel's shmem huge-page "
     "mode: `advise`, `within_size` or `always` let host pools' segments use 2 MiB pages; "
     "docs/ARCHITECTURE.md, Huge pages) and `config` (option name -> current value as text).",
     cmd_info},
    {"stats", "", "counters per pool and per tenant (the numbers /metrics exports)",
     "Result: `daemon` (sessions, pools, pool_memory_bytes, pool_memory_used_bytes, "
     "index_entries, index_capacity, draining, uptime_seconds, events_evict, events_refuse), "
     "`pools` (per pool: id, model, domain, tokens_per_block, and every pool counter: "
     "blocks_total, blocks_free, blocks_writing, blocks_committed, blocks_cached, blocks_pinned, "
     "segments, bytes, queries, query_blocks, hit_blocks, hit_tokens, commits, commits_duplicate, "
     "evictions_capacity, evictions_admin, evictions_shrink), `duel` (per pool with an eviction "
     "duel, evict-duel: id, model, domain and its counters, Statistics below), `tiers`, "
     "`kv_events` and `tenants` (per tenant: id, name, "
     "sessions, queries, query_blocks, hit_blocks, hit_tokens, commits, evictions_capacity / "
     "evictions_admin / evictions_shrink (evictions its requests caused, or an operator evicted "
     "of it), refusals, blocks_held, blocks_cached, blocks_pinned). Every `hit_rate` is an object "
     "{value, hit_blocks, query_blocks, denominator}: the rate is hit blocks over the blocks "
     "asked in Lookup requests.",
     cmd_stats},
    {"pools", "", "pools: model, domain, layout, segments, policy",
     "Result: `pools`, per pool: id, model, domain, layout (layers, kv_heads, head_dim, "
     "tokens_per_block, dtype, arrangement, block_bytes), blocks_per_segment, max_segments, "
     "segment_bytes, policy, the pool counters as in `stats`, and `tiers`: its lower tiers "
     "(tier1_blocks, tier1_bytes, tier2_blocks, tier2_bytes, format: 0 raw, 1 lz4, 2 zstd, "
     "3 int8, 4 fp8; lossy: whether its layout asked for lossy tiers), and `duel`: its eviction "
     "duel's counters as `stats` has them, null without one.",
     cmd_pools},
    {"tenants", "", "tenants with their sessions, counters and blocks by state",
     "Result: `tenants`, the same objects as `stats` returns under `tenants`.", cmd_tenants},
    {"sessions", "", "open client sessions: pid, uid, tenant, blocks held, requests",
     "Result: `sessions`, per connection: id, pid, uid, gid, tenant (null before Hello), client "
     "(Hello.client_name), blocks_held (references, leases included), pools (attached), "
     "requests, errors.",
     cmd_sessions},
    {"prefixes", "[pool=ID] [top=N] [levels=L]", "the top cached prefixes by hits, as a tree",
     "Walks the committed and cached blocks of each pool (or pool=ID) and links them by parent. "
     "Result: `pools`, each with `prefixes` (number of roots) and `top`: the N (default 10) roots "
     "with most hits. A node is {block, hash, hits, blocks, size, depth, children, "
     "more_children}: `blocks` is the length of the chain that node stands for (single-child "
     "chains are collapsed), `size` the blocks in its subtree, `depth` the longest chain below "
     "it; children are shown for L (default 4) levels, at most 8 per node. O(blocks).",
     cmd_prefixes},
    {"evict", "[--dry-run] all|tenant=NAME|pool=ID [max=N]",
     "evict cached blocks now, or show what would go and why",
     "Evicts CACHED, unpinned blocks in each pool's policy order (reason `admin` in the "
     "counters and events). A scope is required: `all`, `tenant=NAME` (blocks that tenant "
     "allocated) and/or `pool=ID`. With `--dry-run` nothing changes: the result lists, per pool, "
     "`would_evict` blocks (block, hash, tenant, hits, why), at most max=N (default 1000, "
     "at most 1000000). "
     "Result: `dry_run`, `evicted` or `would_evict` (total), `pools` (pool, blocks, policy).",
     cmd_evict},
    {"pin", "HASH [pool=ID] [retention=MS] [priority=P]", "pin a cached prefix block by its hash",
     "HASH is the 32 hex digits `prefixes` reports, or a unique prefix of at least 6 of them "
     "(kvctl prints 12; an ambiguous prefix is EINVAL). The block is not evicted before retention "
     "(default 3600000 ms) ends; priority 0..255 (default 0). ENOENT when no pool caches the "
     "hash. Result: pool, block, retention_ms, priority.",
     cmd_pin},
    {"unpin", "HASH [pool=ID]", "remove a pin", "Result: pool, block. ENOENT for an unknown hash.",
     cmd_unpin},
    {"quota get", "[TENANT]", "a tenant's quota and usage (all tenants without TENANT)",
     "Result: {tenant, quota: {max-held, guarantee, max-pinned, max-sessions, max-pools, "
     "tier-max, tier-guarantee, tier-max-bytes, tier-guarantee-bytes, tier-total-bytes}, usage: "
     "{sessions, held, cached, pinned, tier1, "
     "tier2, tier1_bytes, tier2_bytes}}, or "
     "`quotas`, a list of those (the `default` entry first). 0 means unlimited.",
     cmd_quota_get},
    {"quota set", "TENANT NAME VALUE", "change one limit of a tenant's quota, live",
     "NAME is one of " KVD_QUOTA_NAMES "; TENANT `default` changes the "
     "default. Applies at once (guarantees are pushed into every pool). Result: as `quota get "
     "TENANT`.",
     cmd_quota_set},
    {"config get", "[NAME]", "options with value, default and whether runtime-settable",
     "Result: one option {name, value, default, runtime, description} or `options`, all of "
     "them.",
     cmd_config_get},
    {"config set", "NAME VALUE", "change a runtime-settable option, live",
     "Only options whose `runtime` is true (marked [runtime] in deploy/kvd.conf); others are "
     "ENOTSUP with the flag to restart with. EINVAL for a bad value. Result: the option as "
     "`config get NAME`.",
     cmd_config_set},
    {"log level", "[error|warn|info|debug]", "show or set the log level",
     "Result: `level` (after the change).", cmd_log_level},
    {"events", "[N] [kind=evict|refuse]", "the last N (default 50) evictions and refusals",
     "Result: `events` oldest first, each {seq, unix_ms, kind, reason, pool, tenant, count, "
     "detail}, and `dropped` (events older than the ring, option `events`). Evictions: reason "
     "capacity (an allocation needed room), admin, shrink. Refusals: reason is the error code "
     "sent (ENOSPC, EQUOTA, EPERM, EDRAINING, EBUSY, EAUTH, ETOOBIG).",
     cmd_events},
    {"tiers",
     "[pool=ID] [write=write-back|write-through|default] "
     "[remote-write=write-back|write-through|default] [min-hits=N|default] "
     "[clean-ahead=N|default]",
     "the lower tiers: state, and each pool's tier policy and contents; set a pool's own",
     "Shows what is configured (`state`, with the last tier-2 error) and, per pool with tiers, "
     "its policy in force (write, remote_write, min_hits, clean_ahead, format, tier2, "
     "own_settings) and its tier1/tier2 blocks and bytes. With pool=ID and settings, that pool "
     "gets its own write mode, remote write mode, selective min-hits or clean-ahead (runtime "
     "only; `default` goes back to the daemon's option). ENOENT for an unknown pool or one without "
     "tiers, EINVAL for a bad "
     "setting. docs/TIERS.md.",
     cmd_tiers},
    {"remote-watch reconcile", "",
     "ask Redis now which values this node announced on REMOTE are gone (BlockRemoved for them)",
     "A reconciliation pass of the remote watch, as after a gap or every "
     "remote-watch-reconcile-s (docs/TIERS.md): every value in the ledger is asked about and "
     "each one Redis no longer holds is published as BlockRemoved on REMOTE (after a FLUSHALL, "
     "say). Returns at once; the log and remote_watch_reconciles / remote_watch_reconciled say "
     "when it is done and what it found. Result: pass (started, or queued behind the one "
     "running), ledger (values to ask about). ESTATE without remote-watch or its ledger, or "
     "while the watch is not subscribed on every node.",
     cmd_reconcile},
    {"trace", "[start path=PATH [max-bytes=N] | stop]",
     "record this daemon's requests as a trace file (eviction policies against Belady on it)",
     "start: creates PATH (it must not exist; mode 0600) and from then on writes one line per "
     "Lookup and Fetch: the request's block hashes in prefix order, 32 hex digits each, the pool "
     "id folded into each so two pools' blocks never meet (no tokens, no tenant names). Stops "
     "writing once max-bytes (default 1 GiB) is reached (full). stop: flushes and closes it. "
     "Without arguments: the state. Result: active, path, requests, bytes, max_bytes, full. "
     "Replay it with `core_bench --trace-file PATH` (every policy and Belady's optimum on it). "
     "EBUSY when one runs already, ESTATE for stop without one, ESYS when PATH cannot be made.",
     cmd_trace},
    {"prefix-score", "pool=ID HASH...",
     "how many leading blocks of a prefix this node holds, per tier (a router's question)",
     "HASH: the prefix's block hashes in order, 32 hex digits each (kvctl's form, docs/HASH.md). "
     "Result: pool, asked, t0 (leading blocks in the pool's own memory), below (how far the "
     "prefix goes on after them in the lower tiers), t1 and t2 (of those, blocks in tier 1 and "
     "in tier 2 only), prefix (t0 + below: what a Fetch of the prefix would return). Takes no "
     "reference and counts no lookup. ENOENT for an unknown pool, EINVAL for a bad hash.",
     cmd_prefix_score},
    {"selftest isolation", "", "check that no tenant can reach another tenant's blocks",
     "Makes two throwaway tenants and proves on the live pools, index and session code that a "
     "block committed in one domain is a hit for the same domain only and that the other tenant "
     "cannot reach its pool; with lower tiers, that the block copied into tier 1 and evicted is "
     "found below T0 by its domain only, and that each domain's tier-2 file is its own. Result: "
     "passed, checks (one line per check). EINTERNAL when "
     "isolation is broken (message names the first failing check); ENOSPC/EQUOTA/ESYS when it "
     "could not run.",
     cmd_selftest_isolation},
    {"drain", "[off]", "stop accepting new sessions (rolling restarts); `off` undoes",
     "Open sessions keep working; a new Hello gets EDRAINING, /readyz and `ready` fail. Result: "
     "draining, sessions (open).",
     cmd_drain},
    {"ready", "", "succeed only when kvd takes new sessions (for probes)",
     "EDRAINING while draining, ECLOSED while stopping. Result: {ready: true}.", cmd_ready},
};

const kvd_admin_cmd *kvd_admin_cmds(size_t *n) {
    *n = sizeof(cmds) / sizeof(cmds[0]);
    return cmds;
}

/* ---- the command line ---- */

json_t *kvd_admin_error(kv_err code, const char *msg) {
    json_t *r = json_pack("{s:b, s:{s:s, s:i, s:s}}", "ok", 0, "error", "code", kv_err_name(code),
                          "errno", (int)code, "message", msg);
    if (r != NULL) {
        return r;
    }
    /* Messages quote the peer's words, which need not be UTF-8, and jansson refuses strings
     * that are not (tests/fuzz/crashes/admin): send the message with every byte outside
     * printable ASCII replaced, so the peer still gets its error line. */
    char clean[KVD_ADMIN_MSG];
    size_t i = 0;
    for (; msg[i] != '\0' && i + 1 < sizeof(clean); i++) {
        unsigned char ch = (unsigned char)msg[i];
        clean[i] = (ch >= 0x20 && ch < 0x7f) ? (char)ch : '?';
    }
    clean[i] = '\0';
    return json_pack("{s:b, s:{s:s, s:i, s:s}}", "ok", 0, "error", "code", kv_err_name(code),
                     "errno", (int)code, "message", clean);
}

json_t *kvd_admin_execute(kvd_ops *s, const char *line) {
    char copy[KVD_ADMIN_LINE_MAX];
    char msg[KVD_ADMIN_MSG];
    if (strlen(line) >= sizeof(copy)) {
        snprintf(msg, sizeof(msg), "command line longer than %d bytes", KVD_ADMIN_LINE_MAX - 1);
        return kvd_admin_error(KV_ETOOBIG, msg);
    }
    snprintf(copy, sizeof(copy), "%s", line);
    char *argv[64];
    int argc = 0;
    char *save = NULL;
    for (char *t = strtok_r(copy, " \t\r\n", &save); t != NULL;
         t = strtok_r(NULL, " \t\r\n", &save)) {
        if (argc == (int)(sizeof(argv) / sizeof(argv[0]))) {
            return kvd_admin_error(KV_ETOOBIG, "more than 64 words in one command");
        }
        argv[argc++] = t;
    }
    if (argc == 0) {
        return kvd_admin_error(KV_EINVAL, "empty command (try help)");
    }
    size_t n;
    const kvd_admin_cmd *cmds = kvd_admin_cmds(&n);
    const kvd_admin_cmd *cmd = NULL;
    int words = 0;
    /* Two-word names ("config set") first, so they win over a one-word prefix. */
    if (argc >= 2) {
        char two[128];
        snprintf(two, sizeof(two), "%s %s", argv[0], argv[1]);
        for (size_t i = 0; i < n && cmd == NULL; i++) {
            if (strcmp(cmds[i].name, two) == 0) {
                cmd = &cmds[i];
                words = 2;
            }
        }
    }
    for (size_t i = 0; i < n && cmd == NULL; i++) {
        if (strcmp(cmds[i].name, argv[0]) == 0) {
            cmd = &cmds[i];
            words = 1;
        }
    }
    if (cmd == NULL) {
        int family = 0;
        for (size_t i = 0; i < n; i++) {
            size_t l = strlen(argv[0]);
            if (strncmp(cmds[i].name, argv[0], l) == 0 && cmds[i].name[l] == ' ') {
                family = 1;
            }
        }
        snprintf(msg, sizeof(msg),
                 family ? "'%.64s' needs a subcommand (try help)"
                        : "unknown command '%.64s' (try help)",
                 argv[0]);
        return kvd_admin_error(KV_ENOENT, msg);
    }
    json_t *result = NULL;
    msg[0] = '\0';
    kv_err rc = cmd->run(s, argc - words, argv + words, &result, msg);
    if (rc != KV_OK) {
        if (msg[0] == '\0') {
            snprintf(msg, sizeof(msg), "%s", kv_strerror(rc));
        }
        return kvd_admin_error(rc, msg);
    }
    json_t *reply = json_object();
    if (reply == NULL) {
        json_decref(result);
        return NULL;
    }
    json_object_set_new(reply, "ok", json_true());
    json_object_set_new(reply, "result", result != NULL ? result : json_object());
    return reply;
}

int kvd_ops_ready(const kvd_ops *s) {
    return kvd_server_listening(s->srv) && !kvd_server_draining(s->srv);
}
