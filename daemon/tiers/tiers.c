/* kvd_tiers: demotion, promotion and their copy jobs (see tiers.h).
 *
 * Per pool a tier_pool holds the entry store (daemon/tiers/store.h) and the T2 file. A job is
 * one block's move in one direction; its work function touches only what the job owns or what
 * a lease or a busy count keeps alive (T0 runs of a leased or WRITING block, the bytes of a busy
 * T1 entry, one slot of the file), and its completion, on the loop thread, applies the result.
 * A T0 block's bytes are gathered into (or scattered from) one contiguous image: for
 * BLOCK_MAJOR its one run; for LAYER_MAJOR each (layer, K|V) run followed by its scales, in
 * layer order, K before V (the order verify-blocks sums them in). A GPU pool's runs are device
 * addresses: t0_gather / t0_scatter move them with the backend's driver copies instead of memcpy.
 */
#include "daemon/tiers/tiers.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <xxhash.h>

#include "common/kv_layout.h"
#include "common/kv_log.h"
#include "common/kv_util.h"
#include "daemon/tenancy/tenant.h"
#include "daemon/tiers/codec.h"
#include "daemon/tiers/disk.h"
#include "daemon/tiers/pinned.h"
#include "daemon/tiers/remote.h"
#include "daemon/tiers/rledger.h"
#include "daemon/tiers/rwatch.h"
#include "daemon/tiers/store.h"
#include "kernels/kvk.h"

enum {
    TS_T1_BYTES, /* rows of one Prometheus family stay adjacent (daemon/ops/metrics.c) */
    TS_T2_BYTES,
    TS_T1_BLOCKS,
    TS_T2_BLOCKS,
    TS_T1_CAP,
    TS_T2_CAP,
    TS_HITS_T1,
    TS_HITS_T2,
    TS_DEMOTE_T1,
    TS_DEMOTE_T2,
    TS_DIRTY_DROPS,
    TS_DROPS_T1,
    TS_DROPS_T2,
    TS_PROMOTE_T1,
    TS_PROMOTE_T2,
    TS_FETCHES,
    TS_FETCH_SHORT,
    TS_FETCH_SHARED,
    TS_ALLOC_WAITS,
    TS_CORRUPT_T2,
    TS_WERR_T2,
    TS_COPY_BYTES_DOWN1,
    TS_COPY_NS_DOWN1,
    TS_COPY_BYTES_DOWN2,
    TS_COPY_NS_DOWN2,
    TS_COPY_BYTES_UP1,
    TS_COPY_NS_UP1,
    TS_COPY_BYTES_UP2,
    TS_COPY_NS_UP2,
    TS_SPAN_DOWN1,
    TS_SPAN_DOWN2,
    TS_SPAN_UP1,
    TS_SPAN_UP2,
    TS_JOBS,
    TS_REMOTE_PUTS_INFLIGHT,
    TS_REMOTE_STATE, /* the remote tier's (kvd_remote_stats) */
    TS_REMOTE_PUTS,
    TS_REMOTE_PUT_BYTES,
    TS_REMOTE_PUT_ERRORS,
    TS_REMOTE_PUT_DROPS,
    TS_REMOTE_GETS,
    TS_REMOTE_HITS,
    TS_REMOTE_MISSES,
    TS_REMOTE_BAD,
    TS_REMOTE_ERRORS,
    TS_REMOTE_RECONNECTS,
    TS_REMOTE_REDIRECTS,
    TS_REMOTE_PROMOTED,
    TS_REMOTE_DIRECT,
    TS_REMOTE_PROBES,
    TS_REMOTE_PROBE_HITS,
    TS_REMOTE_DELS_PENDING,
    TS_REMOTE_PUT_SKIPS,
    TS_REMOTE_DIRTY_DROPS,
    TS_QUOTA_DROPS,
    TS_RWATCH_NODES,
    TS_RWATCH_UNCONFIGURED,
    TS_RWATCH_EXPIRED,
    TS_RWATCH_EVICTED,
    TS_RWATCH_REPORTED,
    TS_RWATCH_GAPS,
    TS_RWATCH_CHECKS,
    TS_RWATCH_CHANGES,
    TS_RWATCH_LEDGER,
    TS_RWATCH_LEDGER_LOST,
    TS_RWATCH_RECONCILES,
    TS_RWATCH_RECONCILED,
    TS_RWATCH_RECONCILE_ERRORS,
    TS_T1_PINNED,
    TS_PIN_FALLBACKS,
    TS_T2_ZERO_COPY,
    TS_COUNT
};

static const kv_stat_desc tier_stats[TS_COUNT] = {
    [TS_T1_BYTES] = {"tier1_bytes", "gauge", "bytes", "bytes of blocks held in tier 1",
                     "kvd_tier_bytes", "Bytes held per lower tier.", "tier", "1"},
    [TS_T1_BLOCKS] = {"tier1_blocks", "gauge", "blocks", "blocks held in tier 1", "kvd_tier_blocks",
                      "Blocks held per lower tier.", "tier", "1"},
    [TS_T1_CAP] = {"tier1_capacity", "gauge", "bytes", "tier-1 budget (tier1-memory)", NULL, NULL,
                   NULL, NULL},
    [TS_T2_BYTES] = {"tier2_bytes", "gauge", "bytes", "bytes of tier-2 slots in use",
                     "kvd_tier_bytes", NULL, "tier", "2"},
    [TS_T2_BLOCKS] = {"tier2_blocks", "gauge", "blocks", "blocks held in tier 2", "kvd_tier_blocks",
                      NULL, "tier", "2"},
    [TS_T2_CAP] = {"tier2_capacity", "gauge", "bytes", "tier-2 budget (tier2-bytes; 0 when off)",
                   NULL, NULL, NULL, NULL},
    [TS_HITS_T1] = {"tier_hits_t1", "counter", "blocks",
                    "Lookup/Fetch positions past the T0 hits found in tier 1",
                    "kvd_tier_hits_total", "Prefix positions found below T0, per tier.", "tier",
                    "1"},
    [TS_HITS_T2] = {"tier_hits_t2", "counter", "blocks",
                    "positions past the T0 hits found only in tier 2", "kvd_tier_hits_total", NULL,
                    "tier", "2"},
    [TS_DEMOTE_T1] = {"demotions_t1", "counter", "blocks", "block copies that landed in tier 1",
                      "kvd_tier_demotions_total", "Block copies that landed in a lower tier.",
                      "tier", "1"},
    [TS_DEMOTE_T2] = {"demotions_t2", "counter", "blocks", "block records written to tier 2",
                      "kvd_tier_demotions_total", NULL, "tier", "2"},
    [TS_DIRTY_DROPS] = {"dirty_drops", "counter", "blocks",
                        "T0 evictions of blocks no lower tier had a copy of (lost)",
                        "kvd_tier_dirty_drops_total", "T0 evictions without a lower-tier copy.",
                        NULL, NULL},
    [TS_DROPS_T1] = {"drops_t1", "counter", "blocks", "blocks that left tier 1 for room",
                     "kvd_tier_drops_total", "Blocks a lower tier let go for room.", "tier", "1"},
    [TS_DROPS_T2] = {"drops_t2", "counter", "blocks", "blocks that left tier 2 for room",
                     "kvd_tier_drops_total", NULL, "tier", "2"},
    [TS_PROMOTE_T1] = {"promotions_t1", "counter", "blocks", "blocks a Fetch copied up from tier 1",
                       "kvd_tier_promotions_total", "Blocks a Fetch copied up into T0.", "tier",
                       "1"},
    [TS_PROMOTE_T2] = {"promotions_t2", "counter", "blocks", "blocks a Fetch copied up from tier 2",
                       "kvd_tier_promotions_total", NULL, "tier", "2"},
    [TS_FETCHES] = {"fetches", "counter", "requests", "Fetch requests that copied something",
                    "kvd_tier_fetches_total", "Fetch requests that copied something.", NULL, NULL},
    [TS_FETCH_SHORT] = {"fetches_short", "counter", "requests",
                        "Fetch requests whose lower-tier run was under fetch-min-tokens", NULL,
                        NULL, NULL, NULL},
    [TS_FETCH_SHARED] = {"fetch_shared", "counter", "blocks",
                         "Fetch positions served by another fetch's copy in flight", NULL, NULL,
                         NULL, NULL},
    [TS_ALLOC_WAITS] = {"alloc_waits", "counter", "requests",
                        "Allocate waits for copies down to give leased blocks back (instead of "
                        "ENOSPC)",
                        "kvd_tier_alloc_waits_total",
                        "Allocates that waited for copies to lower tiers instead of failing.", NULL,
                        NULL},
    [TS_CORRUPT_T2] = {"corrupt_t2", "counter", "blocks",
                       "tier-2 records that failed a check (never served; dropped)",
                       "kvd_tier_corrupt_total", "Lower-tier copies that failed a check.", NULL,
                       NULL},
    [TS_WERR_T2] = {"write_errors_t2", "counter", "blocks",
                    "tier-2 writes that failed (disk full, unwritable)",
                    "kvd_tier_write_errors_total", "Tier-2 writes that failed.", NULL, NULL},
    [TS_COPY_BYTES_DOWN1] = {"copy_bytes_down_t1", "counter", "bytes",
                             "block bytes copied from T0 into tier 1", NULL, NULL, NULL, NULL},
    [TS_COPY_NS_DOWN1] = {"copy_ns_down_t1", "counter", "ns",
                          "copy-thread time of those copies (encoding included)", NULL, NULL, NULL,
                          NULL},
    [TS_COPY_BYTES_DOWN2] = {"copy_bytes_down_t2", "counter", "bytes",
                             "record bytes written to tier 2", NULL, NULL, NULL, NULL},
    [TS_COPY_NS_DOWN2] = {"copy_ns_down_t2", "counter", "ns", "copy-thread time of those writes",
                          NULL, NULL, NULL, NULL},
    [TS_COPY_BYTES_UP1] = {"copy_bytes_up_t1", "counter", "bytes",
                           "block bytes a Fetch copied up from tier 1", NULL, NULL, NULL, NULL},
    [TS_COPY_NS_UP1] = {"copy_ns_up_t1", "counter", "ns", "copy-thread time of those copies", NULL,
                        NULL, NULL, NULL},
    [TS_COPY_BYTES_UP2] = {"copy_bytes_up_t2", "counter", "bytes",
                           "block bytes a Fetch read up from tier 2", NULL, NULL, NULL, NULL},
    [TS_COPY_NS_UP2] = {"copy_ns_up_t2", "counter", "ns", "copy-thread time of those reads", NULL,
                        NULL, NULL, NULL},
    [TS_SPAN_DOWN1] = {"copy_busy_ns_down_t1", "counter", "ns",
                       "wall time while a copy into tier 1 was in flight (bytes / this: throughput "
                       "of the copy threads together)",
                       NULL, NULL, NULL, NULL},
    [TS_SPAN_DOWN2] = {"copy_busy_ns_down_t2", "counter", "ns",
                       "wall time while a write to tier 2 was in flight", NULL, NULL, NULL, NULL},
    [TS_SPAN_UP1] = {"copy_busy_ns_up_t1", "counter", "ns",
                     "wall time while a copy up from tier 1 was in flight", NULL, NULL, NULL, NULL},
    [TS_SPAN_UP2] = {"copy_busy_ns_up_t2", "counter", "ns",
                     "wall time while a read up from tier 2 was in flight", NULL, NULL, NULL, NULL},
    [TS_JOBS] = {"jobs_inflight", "gauge", "jobs", "copy jobs in flight", NULL, NULL, NULL, NULL},
    [TS_REMOTE_PUTS_INFLIGHT] = {"remote_puts_inflight", "gauge", "blocks",
                                 "writes to the remote tier queued or in flight (their T1 entries "
                                 "held busy)",
                                 NULL, NULL, NULL, NULL},
    [TS_REMOTE_STATE] = {"remote_state", "gauge", "state",
                         "remote tier: 0 off, 1 up (a node answers), 2 down", "kvd_remote_state",
                         "Remote tier state: 0 off, 1 up, 2 down.", NULL, NULL},
    [TS_REMOTE_PUTS] = {"remote_puts", "counter", "blocks", "blocks written to the remote tier",
                        "kvd_remote_puts_total", "Blocks written to the remote tier.", NULL, NULL},
    [TS_REMOTE_PUT_BYTES] = {"remote_put_bytes", "counter", "bytes",
                             "value bytes written to the remote tier", NULL, NULL, NULL, NULL},
    [TS_REMOTE_PUT_ERRORS] = {"remote_put_errors", "counter", "blocks",
                              "remote writes that failed (Redis full: OOM, timeout, down)",
                              "kvd_remote_put_errors_total", "Remote writes that failed.", NULL,
                              NULL},
    [TS_REMOTE_PUT_DROPS] = {"remote_put_drops", "counter", "blocks",
                             "remote writes not even queued (remote-queue-bytes full)", NULL, NULL,
                             NULL, NULL},
    [TS_REMOTE_GETS] = {"remote_gets", "counter", "blocks",
                        "keys Fetches asked the remote tier for", NULL, NULL, NULL, NULL},
    [TS_REMOTE_HITS] = {"remote_hits", "counter", "blocks",
                        "of them, values that passed every check", "kvd_remote_hits_total",
                        "Remote values found and checked.", NULL, NULL},
    [TS_REMOTE_MISSES] = {"remote_misses", "counter", "blocks",
                          "of them, missing keys (never written, expired, evicted by Redis)", NULL,
                          NULL, NULL, NULL},
    [TS_REMOTE_BAD] = {"remote_bad", "counter", "blocks",
                       "remote values that failed a check (never served)", "kvd_remote_bad_total",
                       "Remote values that failed a check.", NULL, NULL},
    [TS_REMOTE_ERRORS] = {"remote_errors", "counter", "errors",
                          "remote tier errors: timeouts, connections lost or refused, Redis errors",
                          "kvd_remote_errors_total", "Remote tier errors.", NULL, NULL},
    [TS_REMOTE_RECONNECTS] = {"remote_reconnects", "counter", "connections",
                              "connections to a node made again after it failed", NULL, NULL, NULL,
                              NULL},
    [TS_REMOTE_REDIRECTS] = {"remote_redirects", "counter", "requests",
                             "Redis Cluster MOVED and ASK redirections followed", NULL, NULL, NULL,
                             NULL},
    [TS_REMOTE_PROMOTED] = {"remote_promoted", "counter", "blocks",
                            "remote values a Fetch put into tier 1 on their way to T0", NULL, NULL,
                            NULL, NULL},
    [TS_QUOTA_DROPS] =
        {"tier_quota_drops", "counter", "blocks",
         "lower-tier blocks a tenant's tier-max, tier-max-bytes or tier-total-bytes pushed out",
         NULL, NULL, NULL, NULL},
    [TS_REMOTE_DIRECT] = {"remote_direct", "counter", "blocks",
                          "remote values a Fetch read from the socket straight into T0 blocks",
                          NULL, NULL, NULL, NULL},
    [TS_REMOTE_PROBES] = {"remote_probes", "counter", "blocks",
                          "keys asked about without reading them: by Lookups (Lookup.remote) and "
                          "by the remote watch's reconciliation after a gap",
                          NULL, NULL, NULL, NULL},
    [TS_REMOTE_PROBE_HITS] = {"remote_probe_hits", "counter", "blocks",
                              "of them, keys Redis held a value for", NULL, NULL, NULL, NULL},
    [TS_REMOTE_DELS_PENDING] = {"remote_dels_pending", "gauge", "keys",
                                "deletes of quarantined blocks' values Redis has not answered yet "
                                "(tried again every 0.5 s; until then this node treats the key as "
                                "a miss)",
                                NULL, NULL, NULL, NULL},
    [TS_REMOTE_PUT_SKIPS] = {"remote_put_skips", "counter", "blocks",
                             "blocks not written to Redis again on their way down: read from "
                             "there straight into T0 (remote-ttl-s 0)",
                             NULL, NULL, NULL, NULL},
    [TS_REMOTE_DIRTY_DROPS] = {"remote_dirty_drops", "counter", "blocks",
                               "remote-write write-back: blocks that left tier 1 before their "
                               "write to Redis was done (a burst that outran the writes, or "
                               "Redis down or full)",
                               "kvd_remote_dirty_drops_total",
                               "Blocks that left tier 1 before their write-back to Redis.", NULL,
                               NULL},
    [TS_RWATCH_NODES] = {"remote_watch_nodes", "gauge", "nodes",
                         "Redis nodes whose expiries and evictions kvd listens to (remote-watch)",
                         "kvd_remote_watch_nodes",
                         "Redis nodes whose expiries and evictions kvd listens to.", NULL, NULL},
    [TS_RWATCH_UNCONFIGURED] = {"remote_watch_unconfigured", "gauge", "nodes",
                                "of the nodes asked, those whose notify-keyspace-events lacks "
                                "Exe: the values Redis drops there go unreported",
                                "kvd_remote_watch_unconfigured",
                                "Redis nodes whose drops go unreported (notify-keyspace-events).",
                                NULL, NULL},
    [TS_RWATCH_EXPIRED] = {"remote_watch_expired", "counter", "keys",
                           "keys Redis said it expired (any key of the node)", NULL, NULL, NULL,
                           NULL},
    [TS_RWATCH_EVICTED] = {"remote_watch_evicted", "counter", "keys",
                           "keys Redis said its maxmemory policy evicted (any key of the node)",
                           NULL, NULL, NULL, NULL},
    [TS_RWATCH_REPORTED] = {"remote_watch_reported", "counter", "blocks",
                            "of them, values of this node's pools: BlockRemoved on REMOTE, and "
                            "a block read from that value is written to Redis again on its way "
                            "down",
                            "kvd_remote_watch_reported_total",
                            "Remote values of this node's pools Redis expired or evicted.", NULL,
                            NULL},
    [TS_RWATCH_GAPS] = {"remote_watch_gaps", "counter", "gaps",
                        "times subscriptions that were up were lost (a master killed, a failover, "
                        "a connection closed), counted once until every master is subscribed "
                        "again: Redis's drops in between were not heard, so REMOTE entries a "
                        "router holds may be stale",
                        "kvd_remote_watch_gaps_total",
                        "Times the remote watch lost subscriptions that were up.", NULL, NULL},
    [TS_RWATCH_CHECKS] = {"remote_watch_checks", "counter", "checks",
                          "checks of the cluster's masters (CLUSTER SLOTS asked of a watched "
                          "node every remote-watch-refresh-s) answered",
                          NULL, NULL, NULL, NULL},
    [TS_RWATCH_CHANGES] = {"remote_watch_changes", "counter", "checks",
                           "of them, those that found the masters changed (a master added, "
                           "slots moved to a node that had none): the watch subscribed again "
                           "on the new set (a gap)",
                           NULL, NULL, NULL, NULL},
    [TS_RWATCH_LEDGER] = {"remote_watch_ledger", "gauge", "blocks",
                          "values this node announced on REMOTE and remembers, to ask Redis "
                          "about after a gap (remote-watch-ledger)",
                          "kvd_remote_watch_ledger_entries",
                          "Values announced on REMOTE that a reconciliation would ask about.", NULL,
                          NULL},
    [TS_RWATCH_LEDGER_LOST] = {"remote_watch_ledger_lost", "counter", "blocks",
                               "of them, forgotten for room: Redis dropping one in a later gap "
                               "goes unreported",
                               NULL, NULL, NULL, NULL},
    [TS_RWATCH_RECONCILES] = {"remote_watch_reconciles", "counter", "passes",
                              "reconciliations done: each time every Redis node is subscribed "
                              "(after a gap, and the first time) and every "
                              "remote-watch-reconcile-s, every value in the ledger asked "
                              "about (one pipelined STRLEN per node and 256 keys)",
                              NULL, NULL, NULL, NULL},
    [TS_RWATCH_RECONCILED] =
        {"remote_watch_reconciled", "counter", "blocks",
         "values a reconciliation found gone from Redis: BlockRemoved on "
         "REMOTE, as for a drop heard",
         "kvd_remote_watch_reconciled_total",
         "Remote values found gone unheard (after a gap in the watch, or by a periodic pass).",
         NULL, NULL},
    [TS_RWATCH_RECONCILE_ERRORS] = {"remote_watch_reconcile_errors", "counter", "requests",
                                    "reconciliation requests Redis did not answer in time (asked "
                                    "again a second later; the pass is given up after three "
                                    "tries)",
                                    NULL, NULL, NULL, NULL},
    [TS_T1_PINNED] = {"tier1_pinned_bytes", "gauge", "bytes",
                      "page-locked host memory held for GPU pools' tier-1 blocks (in use, "
                      "recycled, and freed but not yet given back to the driver)",
                      "kvd_tier1_pinned_bytes", "Page-locked host memory of GPU pools' tier 1.",
                      NULL, NULL},
    [TS_PIN_FALLBACKS] = {"tier1_pinned_fallbacks", "counter", "buffers",
                          "GPU pools' tier-1 buffers the driver would not page-lock (malloc'd "
                          "instead: their copies go through the driver's staging buffers)",
                          "kvd_tier1_pinned_fallbacks_total",
                          "GPU pools' tier-1 buffers that could not be page-locked.", NULL, NULL},
    [TS_T2_ZERO_COPY] = {"tier2_zero_copy", "counter", "blocks",
                         "T2 writes and reads whose block went between the disk and T0 with no "
                         "copy (a host pool's raw blocks in one piece, a format 2 file)",
                         "kvd_tier2_zero_copy_total",
                         "T2 transfers that moved a block with no copy.", NULL, NULL},
};

typedef struct tier_pool tier_pool;

/* T1 buffers of one size given back by dropped entries, reused by the next copies so a copy
 * writes into memory whose pages are already there (a fresh malloc of a block faults every
 * page in and has the kernel zero it: several times the copy itself). Loop thread only. */
#define NBUFCLASS 8
typedef struct bufclass {
    uint64_t size; /* bytes of each buffer; 0: class unused */
    int pinned;    /* its buffers are page-locked (kvd_pinned's) */
    uint8_t **v;   /* [cap] buffers */
    uint32_t n, cap;
} bufclass;

struct kvd_tiers {
    uv_loop_t *loop;
    kvd_registry *reg;
    const kvd_config *cfg;
    uint64_t cap[2];           /* budgets: tier1-memory, tier2-bytes (0: tier off) */
    uint64_t used[2];          /* bytes in use over all pools (T1: entry bytes; T2: slots) */
    uint64_t reserved1;        /* T1 bytes of copies in flight */
    uint64_t cached1;          /* T1 bytes of recycled buffers kept for the next copies */
    bufclass bc[NBUFCLASS];    /* those buffers, by size and page-locking */
    kvd_pinned *pinned;        /* the page-locked T1 buffers (GPU pools); pinned.h */
    uint32_t busy[4];          /* copies in flight per kind (span_kind) */
    uint64_t busy_since[4];    /* when the kind's current busy period began (ns) */
    kvd_tier_format format;    /* tier-format */
    int write_through;         /* tier-write */
    int remote_back;           /* remote-write write-back */
    uint32_t rputs;            /* remote writes queued or in flight (entries held busy) */
    int any_remote_back;       /* some pool is (or was made) write-back: windows to keep */
    uint64_t rput_pause_until; /* write-back writes none ahead before this (uv_now ms): one
                                  failed, so Redis is down or refusing (no storm of retries) */
    int zero_copy;             /* host pools' T2 without copies (tier2-zero-copy) */
    uint64_t seq;              /* next T2 record sequence number */
    uint32_t jobs;             /* in flight over all pools */
    uint64_t c[TS_COUNT];      /* counters (the gauges are computed) */
    kvd_fetch *fetches;        /* fetches in flight */
    char t2_error[640];        /* the last T2 error ("" none) */
    uint64_t t2_error_ms;      /* when it was logged (rate limit) */
    kvd_remote *remote;        /* the remote tier (remote-redis), or NULL */
    kvd_rwatch *rwatch;        /* its keyspace notifications (remote-watch), or NULL */
    kvd_rledger *ledger;       /* the values announced on REMOTE (remote-watch-ledger), or NULL */
    struct reconcile *rc;      /* the reconciliation against it, with ledger */
    struct tdrain *drain;      /* write-back's writes at a stop (kvd_tiers_drain), or NULL */
    char node_name[64];        /* node-name, or the host name (remote-uid-tenants node) */
    struct rfetch *rfetches;   /* Fetches waiting for the remote tier */
    kvd_tiers_event_fn ev_fn;  /* KV events of the tiers (kvd_tiers_set_event_hook) */
    kvd_tiers_digest_fn dg_fn; /* digests of blocks going down (kvd_tiers_set_digest_fn) */
    void *dg_arg;
    void *ev_arg;
    struct room_wait *waits; /* Allocates waiting for copies to free T0 blocks (FIFO) */
};

/* An Allocate that met ENOSPC while copies held some of its pool's blocks (kvd_tiers_wait_room). */
typedef struct room_wait {
    uint32_t pool_id;
    kvd_tiers_room_fn fn;
    void *arg;
    struct room_wait *next;
} room_wait;

struct tier_pool {
    kvd_tiers *t;
    uint32_t pool_id;
    kvd_tstore st;
    kvd_disk *disk;         /* NULL: no T2 for this pool */
    uint64_t slot_bytes;    /* T2 slot size */
    uint64_t block_bytes;   /* layout.block_bytes */
    kv_layout layout;       /* the pool's layout (a copy: copy threads read it) */
    kvd_tier_format format; /* how this pool's blocks are stored below T0 */
    int write_through;      /* admin `tiers pool=ID write=`: 1/0; -1: the daemon's tier-write */
    int64_t min_hits;       /* admin `tiers ... min-hits=`; -1: tier-min-hits */
    int64_t clean_ahead;    /* admin `tiers ... clean-ahead=`; -1: tier-clean-ahead */
    int remote_back;        /* admin `tiers ... remote-write=`: 1 write-back, 0 write-through;
                               -1: the daemon's remote-write */
    uint32_t jobs;          /* in flight for this pool */
    uint32_t cleaning;      /* write-back copies in flight */
    uint32_t leased;        /* T0 blocks copies down hold leased (neither free nor evictable) */
    int gone;               /* the pool was freed: free this when jobs reach 0 */
    kv_hash128 layout_key;  /* model, layout and flags: remote values of other pools never match */
    uint32_t domain_id;     /* the pool's domain (KV events) */
    char domain[KVD_TENANT_NAME_MAX + 24]; /* the domain's name in remote keys */
    int no_remote; /* a uid-N tenant's pool under remote-uid-tenants off: no remote tier */
    /* Hashes read from Redis straight into T0 (the direct path), direct-mapped by the hash's
     * low bits (a newer one overwrites, so some are forgotten): when such a block goes down to
     * T1, Redis has its value already and it is not written again (remote-ttl-s 0 only: with a
     * TTL the write refreshes it). NULL until the first direct read. */
    kv_hash128 *from_remote;
    /* GPU pools: the backend whose driver copies move T0 bytes (its copy_* entries, any thread),
     * and its context; NULL for pools in host memory the daemon maps (memcpy). */
    const kvd_backend_ops *dev;
    void *dev_ctx;
    /* Raw T1 buffers of this pool are page-locked (a GPU pool whose backend has host_alloc). */
    int pin;
};

#define FROM_REMOTE_SLOTS 4096u /* 64 KiB a pool that read from Redis */

typedef enum job_kind {
    J_DOWN1 = 1,   /* T0 block (leased) -> T1 bytes */
    J_DOWN2 = 2,   /* T1 bytes (entry busy) or T0 block (leased) -> T2 slot */
    J_UP = 3,      /* T1 bytes or T2 slot (entry busy) -> T0 block (WRITING) */
    J_CLEAR2 = 4,  /* zero a T2 slot (a quarantined record) */
    J_PREFAULT = 5 /* make T1 buffers of a block's size and touch their pages (ahead of use) */
} job_kind;

typedef kvd_disk_piece run; /* a piece of a block's bytes: {p, n} */

typedef struct job {
    uv_work_t work;
    tier_pool *tp;
    job_kind kind;
    uint32_t entry;    /* store entry (KVD_TNONE for J_CLEAR2) */
    kvd_block_ref ref; /* the T0 block (DOWN from T0, UP) */
    int from_t0;       /* DOWN2: source is the T0 block, not T1 bytes */
    int cold;          /* DOWN1/DOWN2 from T0: a write-back copy (unlease cold) */
    int src_tier;      /* UP: 1 or 2 */
    int stream2;       /* UP from T2: a raw record of the whole block (streamed into T0) */
    run *runs;         /* T0 block image runs */
    uint32_t nruns;
    uint64_t block_bytes;
    const uint8_t *src1; /* T1 bytes (DOWN2 from T1, UP from T1) */
    uint64_t len1;
    uint8_t fmt1;
    kvd_tier_format format; /* DOWN: the format asked */
    kvd_disk *disk;
    uint64_t slot;
    kvd_disk_rec rec; /* DOWN2: what to write; UP from T2: what was read */
    /* results */
    kv_err rc;
    int sys_errno;
    int t0_failed; /* DOWN2 from T0: the copy out of T0 failed (a GPU pool's driver copy), not T2 */
    uint8_t *out;  /* DOWN1: encoded bytes (malloc'd, or page-locked for a pinning pool) */
    uint32_t pin_fallbacks; /* DOWN1, PREFAULT: buffers made with malloc where page-locked
                               ones were wanted */
    int zero_copy; /* DOWN2, UP from T2: the block went between the disk and T0 with no copy */
    uint64_t out_len;
    uint8_t out_fmt;
    uint64_t ns;
    kvd_fetch *f; /* UP: the fetch */
    uint32_t pos; /* UP: its position */
} job;

/* One position of a fetch's run. */
typedef struct fpos {
    kv_hash128 hash;
    kvd_block_ref ref; /* T0 block: held (kind T0), WRITING (UP) or, after a wait, held */
    uint32_t entry;    /* store entry (UP) */
    uint8_t kind;      /* P_T0, P_UP, P_WAIT */
    uint8_t ok;        /* UP: the copy landed */
    uint8_t have;      /* ref is a reference the fetch owns */
    uint8_t tier;      /* UP: the source tier (3: the remote tier, read in directly) */
    uint8_t direct;    /* UP: the bytes came in with ref (a remote value read into it) */
    uint8_t has_tail;  /* direct: the value carried the digest's tail */
    uint8_t tail[KVD_REMOTE_TAIL];
} fpos;

enum { P_T0 = 1, P_UP = 2, P_WAIT = 3 };

struct kvd_fetch {
    kvd_tiers *t;
    tier_pool *tp;
    uint64_t session;
    uint32_t tenant;
    uint32_t parent_id;
    uint32_t n;
    fpos *pos;
    uint32_t pending; /* own copies and awaited fetches not done */
    kvd_fetch_done done;
    void *arg;
    int orphan;
    int detached; /* the session detached the pool meanwhile */
    kv_err code;
    uint32_t failed;
    kvd_fetch *next;     /* t->fetches */
    kvd_fetch **waiters; /* fetches waiting for this one */
    uint32_t nwaiters, waiters_cap;
};

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- block images ------------------------------------------------------------------------ */

/* The runs of block id's bytes in the daemon's own mapping (NULL when the pool's memory is not
 * host memory the daemon may touch, or the segment is gone). */
static run *block_runs(const kvd_pool *pool, uint32_t id, uint32_t *nruns) {
    const kvd_pool_config *pc = kvd_pool_config_get(pool);
    const kv_layout *l = &pc->layout;
    uint32_t bps = pc->blocks_per_segment;
    const kvd_segment_mem *m = kvd_pool_segment(pool, id / bps);
    if (m == NULL || m->base == NULL) {
        return NULL;
    }
    uint32_t b = id % bps;
    uint8_t *base = m->base;
    if (l->arrangement == KV_BLOCK_MAJOR) {
        run *r = malloc(sizeof(*r));
        if (r != NULL) {
            r->p = base + kv_layout_offset(l, bps, b, 0, KV_K, 0, 0);
            r->n = l->block_bytes;
            *nruns = 1;
        }
        return r;
    }
    uint32_t per = l->scale_bytes != 0 ? 4 : 2;
    run *r = malloc(sizeof(*r) * (size_t)l->num_layers * per);
    if (r == NULL) {
        return NULL;
    }
    uint32_t k = 0;
    for (uint32_t layer = 0; layer < l->num_layers; layer++) {
        for (int kv = KV_K; kv <= KV_V; kv++) {
            r[k].p = base + kv_layout_offset(l, bps, b, layer, kv, 0, 0);
            r[k++].n = l->kv_block_bytes;
            if (l->scale_bytes != 0) {
                r[k].p = base + kv_layout_scale_offset(l, bps, b, layer, kv, 0);
                r[k++].n = (uint64_t)l->num_kv_heads * sizeof(float);
            }
        }
    }
    *nruns = k;
    return r;
}

static void gather(const run *r, uint32_t n, uint8_t *dst) {
    for (uint32_t i = 0; i < n; i++) {
        memcpy(dst, r[i].p, r[i].n);
        dst += r[i].n;
    }
}

/* gather for a destination nobody reads soon (a T1 buffer): streamed stores (kvk_copy_stream),
 * which keep the copy from reading every line of the buffer for ownership first. Not for a
 * scratch image a codec or checksum reads next: that one stays in the caches. */
static void gather_stream(const run *r, uint32_t n, uint8_t *dst) {
    for (uint32_t i = 0; i < n; i++) {
        kvk_copy_stream(dst, r[i].p, r[i].n);
        dst += r[i].n;
    }
}

static void scatter(const run *r, uint32_t n, const uint8_t *src) {
    for (uint32_t i = 0; i < n; i++) {
        memcpy(r[i].p, src, r[i].n);
        src += r[i].n;
    }
}

/* The T0 side of a copy for any pool: a GPU pool's runs are device addresses no host load may
 * touch, so its bytes move with the backend's driver copies (synchronized before it returns:
 * dst holds the block then); a host pool's with gather (streamed: gather_stream). Any thread. */
static kv_err t0_gather(const tier_pool *tp, const run *r, uint32_t n, uint8_t *dst, int streamed) {
    if (tp->dev == NULL) {
        if (streamed) {
            gather_stream(r, n, dst);
        } else {
            gather(r, n, dst);
        }
        return KV_OK;
    }
    /* The runs' copies are queued on this thread's stream, then waited for at once (into
     * page-locked T1 memory they land asynchronously; the caller reads dst next). */
    for (uint32_t i = 0; i < n; i++) {
        kv_err rc = tp->dev->copy_to_host(tp->dev_ctx, dst, r[i].p, r[i].n);
        if (rc != KV_OK) {
            (void)tp->dev->copy_sync(tp->dev_ctx); /* none may still be writing into dst */
            return rc;
        }
        dst += r[i].n;
    }
    return tp->dev->copy_sync(tp->dev_ctx);
}

/* scatter for any pool; a GPU pool's copies are synchronized before it returns, so the block's
 * bytes are in device memory when the completion commits it. */
static kv_err t0_scatter(const tier_pool *tp, const run *r, uint32_t n, const uint8_t *src) {
    if (tp->dev == NULL) {
        scatter(r, n, src);
        return KV_OK;
    }
    for (uint32_t i = 0; i < n; i++) {
        kv_err rc = tp->dev->copy_to_device(tp->dev_ctx, r[i].p, src, r[i].n);
        if (rc != KV_OK) {
            /* Runs copied before may still be landing: the block must not be freed (and handed
             * to another writer) under them. */
            (void)tp->dev->copy_sync(tp->dev_ctx);
            return rc;
        }
        src += r[i].n;
    }
    return tp->dev->copy_sync(tp->dev_ctx);
}

/* A range of a block image, [off, off + n), moved out of (fill) or into (sink) the T0 block's
 * runs: the streamed T2 transfers hand the image over in chunks (kvd_disk_write_stream /
 * read_stream). A GPU pool's pieces are driver copies on this thread's stream: the fill waits
 * for them (the disk reads dst next); the sink leaves them in flight (its source is pageable
 * scratch the driver stages at the call) and the job synchronizes once at the end. */
typedef struct t0_range {
    const tier_pool *tp;
    const run *r;
    uint32_t n;
} t0_range;

/* Moves [off, off + n) of the block image between host memory at h and the runs: into the
 * block (to_t0) or out of it. A GPU pool's pieces are queued on this thread's stream. */
static kv_err t0_range_move(const t0_range *x, uint8_t *h, uint64_t off, uint64_t n, int to_t0) {
    const kvd_backend_ops *dev = x->tp->dev;
    uint64_t base = 0;
    for (uint32_t i = 0; i < x->n && n > 0; i++) {
        const run *ri = &x->r[i];
        if (off < base + ri->n) {
            uint64_t at = off - base, k = ri->n - at < n ? ri->n - at : n;
            kv_err rc = KV_OK;
            if (dev == NULL) {
                memcpy(to_t0 ? ri->p + at : h, to_t0 ? h : ri->p + at, k);
            } else if (to_t0) {
                rc = dev->copy_to_device(x->tp->dev_ctx, ri->p + at, h, k);
            } else {
                rc = dev->copy_to_host(x->tp->dev_ctx, h, ri->p + at, k);
            }
            if (rc != KV_OK) {
                return rc;
            }
            h += k;
            off += k;
            n -= k;
        }
        base += ri->n;
    }
    return n > 0 ? KV_ECORRUPT : KV_OK; /* past the block's end */
}

static kv_err t0_fill(void *arg, uint8_t *dst, uint64_t off, uint64_t n) {
    const t0_range *x = arg;
    kv_err rc = t0_range_move(x, dst, off, n, 0);
    if (x->tp->dev != NULL) {
        kv_err s = x->tp->dev->copy_sync(x->tp->dev_ctx); /* the disk reads dst next */
        rc = rc == KV_OK ? s : rc;
    }
    return rc == KV_ECORRUPT ? KV_EINTERNAL : rc; /* past the block: the caller's length */
}

/* A record longer than the block is not this block (KV_ECORRUPT); the job synchronizes a GPU
 * pool's copies before it reports back. */
static kv_err t0_sink(void *arg, const uint8_t *src, uint64_t off, uint64_t n) {
    return t0_range_move(arg, (uint8_t *)(uintptr_t)src, off, n, 1);
}

/* ---- the work functions (copy threads: only the job's own data) --------------------------- */

#define COPY_NICE 10 /* copy threads' nice value (the loop thread keeps the daemon's) */

/* Each copy thread keeps its scratch (a block image, an aligned disk slot) for the next job:
 * a buffer malloc'd per job faults its pages in every time. They live as long as the thread:
 * libuv's pool threads live until its exit-time cleanup joins them, and a thread-specific key's
 * destructor frees them then (else every exit would leak them). */
static __thread uint8_t *tls_img, *tls_slot;
static __thread uint64_t tls_img_cap, tls_slot_cap;
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *unused) {
    (void)unused;
    free(tls_img);
    free(tls_slot);
    tls_img = tls_slot = NULL;
    tls_img_cap = tls_slot_cap = 0;
}

static void scratch_key_make(void) {
    (void)pthread_key_create(&scratch_key, scratch_free);
}

/* Arms the thread's exit-time free (a key's destructor runs only where its value is set). */
static void scratch_arm(void) {
    (void)pthread_once(&scratch_once, scratch_key_make);
    (void)pthread_setspecific(scratch_key, &scratch_key);
}

static uint8_t *scratch_img(uint64_t n) {
    if (tls_img_cap < n) {
        scratch_arm();
        free(tls_img);
        tls_img = kv_alloc_huge(n); /* reused by every job of the thread: huge pages pay */
        tls_img_cap = tls_img != NULL ? n : 0;
    }
    return tls_img;
}

static uint8_t *scratch_slot(uint64_t n) {
    if (tls_slot_cap < n) {
        scratch_arm();
        free(tls_slot);
        /* 4096-aligned for O_DIRECT; from 2 MiB on in huge pages, so that each transfer pins
         * one page where it pinned 512 (on a VM that shadows page tables, what bounds a disk
         * loop: 1.4-1.7 GB/s from 4 KiB pages, 4.4-5.0 from 2 MiB ones, the same disk). */
        tls_slot = kv_alloc_huge(n);
        tls_slot_cap = tls_slot != NULL ? n : 0;
    }
    return tls_slot;
}

/* A raw T1 buffer of a host pool: from 2 MiB on, 2 MiB-aligned and asking for transparent huge
 * pages (kv_alloc_huge: honoured in the kernel's `madvise` mode too), so its first touch faults
 * once a 2 MiB instead of 512 times; else malloc. free() takes either. Any thread. */
#define HUGE_BYTES (2ull << 20)
static uint8_t *raw_t1_alloc(uint64_t n) {
    if (n >= HUGE_BYTES) {
        uint8_t *p = kv_alloc_huge(n);
        if (p != NULL) {
            return p;
        }
    }
    return malloc(n);
}

/* A raw T1 buffer for a pinning pool's job: page-locked, or malloc'd (and counted) when the
 * driver has none to give. Copy threads. */
static uint8_t *t1_buffer(job *j, uint64_t n) {
    uint8_t *b = kvd_pinned_alloc(j->tp->t->pinned, j->tp->dev, j->tp->dev_ctx, n);
    if (b == NULL) {
        b = malloc(n);
        j->pin_fallbacks += b != NULL;
    }
    return b;
}

static void work(uv_work_t *w) {
    job *j = w->data;
    kvd_pinned_reap(j->tp->t->pinned); /* page-locked buffers let go since: back to the driver */
    static __thread int niced;
    if (!niced) {
        /* Copy threads yield to the loop thread: it dispatches their jobs and runs their
         * completions, and with more copy threads than cores it otherwise waited whole time
         * slices between them (measured: 48 jobs' dispatch and completions spread over 24-34
         * ms instead of 9-11 in the same run; the copies themselves take the same time). */
        niced = 1;
        (void)setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), COPY_NICE);
    }
    uint64_t t0 = now_ns();
    j->rc = KV_OK;
    switch (j->kind) {
        case J_DOWN1: {
            /* Raw: one gather straight into the entry's buffer. Compressed: the image (the
             * block itself when it is one run), then the codec writes the stored form. */
            size_t cap = kvd_codec_bound(j->format, j->block_bytes);
            if (j->out == NULL && j->format == KVD_TF_RAW && j->tp->pin) {
                j->out = t1_buffer(j, j->block_bytes);
            } else if (j->out == NULL) {
                j->out = j->format == KVD_TF_RAW ? raw_t1_alloc(j->block_bytes) : malloc(cap);
            }
            if (j->out == NULL) {
                j->rc = KV_ENOMEM;
                break;
            }
            if (j->format == KVD_TF_RAW) {
                j->rc = t0_gather(j->tp, j->runs, j->nruns, j->out, 1);
                j->out_len = j->block_bytes;
                j->out_fmt = KVD_TF_RAW;
                break;
            }
            const uint8_t *src = j->runs[0].p;
            if (kvd_tier_format_lossy(j->format)) {
                if (j->nruns > 1 || j->tp->dev != NULL) {
                    uint8_t *img = scratch_img(j->block_bytes);
                    if (img == NULL) {
                        j->rc = KV_ENOMEM;
                        break;
                    }
                    if ((j->rc = t0_gather(j->tp, j->runs, j->nruns, img, 0)) != KV_OK) {
                        break;
                    }
                    src = img;
                }
                j->rc = kvd_codec_quantize(j->format, &j->tp->layout, src, j->out);
                j->out_len = kvd_codec_quantized_bytes(j->format, &j->tp->layout);
                j->out_fmt = (uint8_t)j->format;
                break;
            }
            if (j->nruns > 1 || j->tp->dev != NULL) {
                uint8_t *img = scratch_img(j->block_bytes);
                if (img == NULL) {
                    j->rc = KV_ENOMEM;
                    break;
                }
                if ((j->rc = t0_gather(j->tp, j->runs, j->nruns, img, 0)) != KV_OK) {
                    break;
                }
                src = img;
            }
            size_t len = 0;
            kvd_tier_format used = KVD_TF_RAW;
            j->rc = kvd_codec_encode(j->format, src, j->block_bytes, j->out, cap, &len, &used);
            j->out_len = len;
            j->out_fmt = (uint8_t)used;
            if (j->rc == KV_OK && len < cap) {
                uint8_t *shrunk = realloc(j->out, len > 0 ? len : 1);
                if (shrunk != NULL) {
                    j->out = shrunk;
                }
            }
            break;
        }
        case J_DOWN2: {
            uint64_t sb = kvd_disk_slot_bytes(j->disk);
            uint8_t *buf = scratch_slot(sb);
            if (buf == NULL) {
                j->rc = KV_ENOMEM;
                break;
            }
            /* The digest tail goes with the record when it fits beside the payload. */
            if (j->rec.has_tail &&
                !kvd_disk_fits(j->disk,
                               j->from_t0 ? kvd_codec_bound(j->format, j->block_bytes) : j->len1,
                               1)) {
                j->rec.has_tail = 0;
            }
            uint8_t *payload = buf + kvd_disk_payload_off(j->disk, &j->rec);
            if (j->from_t0 && j->format == KVD_TF_RAW && j->tp->dev == NULL &&
                j->tp->t->zero_copy) {
                /* Raw host memory: the block's pages go to the disk from T0 (one piece, or a
                 * layer-major block's pieces in one vectored transfer a group). */
                j->rec.len = (uint32_t)j->block_bytes;
                j->rec.format = KVD_TF_RAW;
                j->rc = kvd_disk_write_fromv(j->disk, j->slot, &j->rec, j->runs, j->nruns, buf,
                                             &j->sys_errno, &j->zero_copy);
                break;
            }
            if (j->from_t0 && j->format == KVD_TF_RAW) {
                /* Raw: gathered chunk by chunk while the disk writes the chunks before. */
                t0_range x = {j->tp, j->runs, j->nruns};
                int fill_failed = 0;
                j->rec.len = (uint32_t)j->block_bytes;
                j->rec.format = KVD_TF_RAW;
                j->rc = kvd_disk_write_stream(j->disk, j->slot, &j->rec, t0_fill, &x, buf,
                                              &j->sys_errno, &fill_failed);
                j->t0_failed = fill_failed;
                break;
            }
            if (j->from_t0) {
                size_t cap = kvd_codec_bound(j->format, j->block_bytes);
                uint8_t *img = j->format == KVD_TF_RAW ? payload : scratch_img(j->block_bytes);
                uint8_t *enc = j->format == KVD_TF_RAW ? payload : malloc(cap);
                if (img == NULL || enc == NULL) {
                    j->rc = KV_ENOMEM;
                } else if ((j->rc = t0_gather(j->tp, j->runs, j->nruns, img, 0)) != KV_OK) {
                    j->t0_failed = 1;
                } else {
                    /* raw: straight into the slot */
                    size_t len = 0;
                    kvd_tier_format used = KVD_TF_RAW;
                    if (j->format == KVD_TF_RAW) {
                        len = j->block_bytes;
                    } else if (kvd_tier_format_lossy(j->format)) {
                        j->rc = kvd_codec_quantize(j->format, &j->tp->layout, img, payload);
                        len = kvd_codec_quantized_bytes(j->format, &j->tp->layout);
                        used = j->format;
                    } else {
                        j->rc =
                            kvd_codec_encode(j->format, img, j->block_bytes, enc, cap, &len, &used);
                        if (j->rc == KV_OK && !kvd_disk_fits(j->disk, len, (int)j->rec.has_tail)) {
                            j->rc = KV_EINTERNAL;
                        }
                        if (j->rc == KV_OK) {
                            memcpy(payload, enc, len);
                        }
                    }
                    j->rec.len = (uint32_t)len;
                    j->rec.format = (uint32_t)used;
                }
                if (enc != payload) {
                    free(enc);
                }
            } else {
                memcpy(payload, j->src1, j->len1);
                j->rec.len = (uint32_t)j->len1;
                j->rec.format = j->fmt1;
            }
            if (j->rc == KV_OK) {
                j->rc = kvd_disk_write(j->disk, j->slot, &j->rec, payload, buf, &j->sys_errno);
            }
            break;
        }
        case J_UP: {
            const uint8_t *src = j->src1;
            uint64_t len = j->len1;
            uint8_t fmt = j->fmt1;
            uint8_t *buf = NULL;
            if (j->src_tier == 2 && j->stream2) {
                /* A raw record: scattered chunk by chunk while the disk reads the chunks after;
                 * the payload checksum is checked at the end (a bad one fails the job, and the
                 * block, WRITING, is never committed). */
                buf = scratch_slot(kvd_disk_slot_bytes(j->disk));
                if (buf == NULL) {
                    j->rc = KV_ENOMEM;
                    break;
                }
                kv_hash128 want = j->rec.hash;
                t0_range x = {j->tp, j->runs, j->nruns};
                if (j->tp->dev == NULL && j->tp->t->zero_copy) {
                    /* Host memory: the pages land in T0's pieces from the disk. */
                    j->rc = kvd_disk_read_intov(j->disk, j->slot, &want, &j->rec, j->runs, j->nruns,
                                                j->block_bytes, buf, &j->zero_copy);
                } else {
                    j->rc =
                        kvd_disk_read_stream(j->disk, j->slot, &want, &j->rec, buf, t0_sink, &x);
                }
                if (j->rc == KV_OK &&
                    (j->rec.format != KVD_TF_RAW || j->rec.len != j->block_bytes)) {
                    j->rc = KV_ECORRUPT; /* not the record the store knew */
                }
                if (j->tp->dev != NULL) {
                    kv_err s = j->tp->dev->copy_sync(j->tp->dev_ctx); /* nothing lands later */
                    j->rc = j->rc == KV_OK ? s : j->rc;
                }
                break;
            }
            if (j->src_tier == 2) {
                buf = scratch_slot(kvd_disk_slot_bytes(j->disk));
                if (buf == NULL) {
                    j->rc = KV_ENOMEM;
                    break;
                }
                kv_hash128 want = j->rec.hash;
                j->rc = kvd_disk_read(j->disk, j->slot, &want, &j->rec, buf);
                src = buf + kvd_disk_payload_off(j->disk, &j->rec);
                len = j->rec.len;
                fmt = (uint8_t)j->rec.format;
            }
            if (j->rc == KV_OK) {
                if (fmt == KVD_TF_RAW && len == j->block_bytes) {
                    j->rc = t0_scatter(j->tp, j->runs, j->nruns, src);
                } else {
                    uint8_t *img = scratch_img(j->block_bytes);
                    if (img == NULL) {
                        j->rc = KV_ENOMEM;
                    } else if (kvd_tier_format_lossy((kvd_tier_format)fmt)) {
                        j->rc = kvd_codec_dequantize((kvd_tier_format)fmt, &j->tp->layout, src, len,
                                                     img);
                        if (j->rc == KV_OK) {
                            j->rc = t0_scatter(j->tp, j->runs, j->nruns, img);
                        }
                    } else {
                        j->rc =
                            kvd_codec_decode((kvd_tier_format)fmt, src, len, img, j->block_bytes);
                        if (j->rc == KV_OK) {
                            j->rc = t0_scatter(j->tp, j->runs, j->nruns, img);
                        }
                    }
                }
            }
            break;
        }
        case J_PREFAULT: {
            /* j->runs is scratch here: nruns buffers' pointers (run.p), each block_bytes. */
            for (uint32_t k = 0; k < j->nruns; k++) {
                j->runs[k].p =
                    j->tp->pin ? t1_buffer(j, j->block_bytes) : raw_t1_alloc(j->block_bytes);
                if (j->runs[k].p != NULL) {
                    memset(j->runs[k].p, 0, j->block_bytes); /* the pages fault in now */
                }
            }
            break;
        }
        case J_CLEAR2: {
            uint8_t *buf = scratch_slot(kvd_disk_slot_bytes(j->disk));
            j->rc = buf == NULL ? KV_ENOMEM : kvd_disk_clear(j->disk, j->slot, buf);
            break;
        }
    }
    j->ns = now_ns() - t0;
}

/* ---- loop-thread helpers ------------------------------------------------------------------ */

static void after_work(uv_work_t *w, int status);

static void tier_pool_free(tier_pool *tp) {
    kvd_tstore_fini(&tp->st);
    kvd_disk_close(tp->disk);
    free(tp->from_remote);
    free(tp);
}

static kvd_pool *pool_of(tier_pool *tp) {
    if (tp->gone) {
        return NULL;
    }
    const kvd_reg_pool *rp = kvd_registry_peek(tp->t->reg, tp->pool_id);
    return rp != NULL ? rp->pool : NULL;
}

static job *job_new(tier_pool *tp, job_kind kind) {
    job *j = calloc(1, sizeof(*j));
    if (j != NULL) {
        j->tp = tp;
        j->kind = kind;
        j->entry = KVD_TNONE;
        j->work.data = j;
        j->block_bytes = tp->block_bytes;
        j->disk = tp->disk;
        j->format = tp->format;
    }
    return j;
}

/* Which busy period a job counts in (copy_busy_ns_*), or -1. */
static int span_kind(const job *j) {
    switch (j->kind) {
        case J_DOWN1:
            return 0;
        case J_DOWN2:
            return 1;
        case J_UP:
            return j->src_tier == 1 ? 2 : 3;
        default:
            return -1;
    }
}

static kv_err job_start(job *j) {
    int rc = uv_queue_work(j->tp->t->loop, &j->work, work, after_work);
    if (rc != 0) {
        return KV_ESYS;
    }
    kvd_tiers *t = j->tp->t;
    int k = span_kind(j);
    if (k >= 0 && t->busy[k]++ == 0) {
        t->busy_since[k] = now_ns();
    }
    j->tp->jobs++;
    t->jobs++;
    return KV_OK;
}

/* ---- recycled T1 buffers ---------------------------------------------------------------- */

/* Frees T1 bytes of any kind: a page-locked buffer goes back to its driver (from a copy thread),
 * any other to free(). Every path that lets T1 bytes go ends here or in the stores' free1. */
static void t1_free(kvd_tiers *t, uint8_t *b) {
    if (!kvd_pinned_free(t->pinned, b)) {
        free(b);
    }
}

static void store_free1(void *arg, uint8_t *b) {
    t1_free(arg, b);
}

/* A recycled buffer of size bytes, page-locked or not as asked; NULL when there is none. A
 * pool that wants page-locked ones takes a malloc'd one when that is all there is (the driver
 * may have refused it page-locked memory: it must not malloc afresh at every copy then); a
 * host pool never takes a page-locked one. */
static uint8_t *buf_take(kvd_tiers *t, uint64_t size, int pinned) {
    for (int pass = 0; pass < (pinned ? 2 : 1); pass++) {
        for (int k = 0; k < NBUFCLASS; k++) {
            bufclass *c = &t->bc[k];
            if (c->size == size && c->pinned == (pass == 0 ? pinned : 0) && c->n > 0) {
                t->cached1 -= size;
                return c->v[--c->n];
            }
        }
    }
    return NULL;
}

/* Frees one recycled buffer (the largest class first); 0 when there is none. */
static int buf_shed(kvd_tiers *t) {
    int best = -1;
    for (int k = 0; k < NBUFCLASS; k++) {
        if (t->bc[k].n > 0 && (best < 0 || t->bc[k].size > t->bc[best].size)) {
            best = k;
        }
    }
    if (best < 0) {
        return 0;
    }
    bufclass *c = &t->bc[best];
    t1_free(t, c->v[--c->n]);
    t->cached1 -= c->size;
    return 1;
}

/* Keeps buffer b (size bytes, no longer an entry's) for the next copy of that size and kind
 * (page-locked or not), when the budget has room for it; else frees it. */
static void buf_give(kvd_tiers *t, uint8_t *b, uint64_t size) {
    int pinned = kvd_pinned_is(t->pinned, b);
    if (t->used[0] + t->reserved1 + t->cached1 + size <= t->cap[0]) {
        bufclass *c = NULL;
        for (int k = 0; k < NBUFCLASS && c == NULL; k++) {
            if (t->bc[k].size == size && t->bc[k].pinned == pinned) {
                c = &t->bc[k];
            }
        }
        for (int k = 0; k < NBUFCLASS && c == NULL; k++) {
            if (t->bc[k].n == 0) {
                t->bc[k].size = size; /* an empty class takes the new size and kind */
                t->bc[k].pinned = pinned;
                c = &t->bc[k];
            }
        }
        if (c != NULL && c->n == c->cap) {
            uint32_t nc = c->cap == 0 ? 16 : c->cap * 2;
            uint8_t **nv = realloc(c->v, sizeof(*nv) * nc);
            if (nv != NULL) {
                c->v = nv;
                c->cap = nc;
            }
        }
        if (c != NULL && c->n < c->cap) {
            c->v[c->n++] = b;
            t->cached1 += size;
            return;
        }
    }
    t1_free(t, b);
}

static void t2_fail(kvd_tiers *t, tier_pool *tp, const char *what, int err) {
    snprintf(t->t2_error, sizeof(t->t2_error), "pool %u: %s: %s", tp->pool_id, what,
             err != 0 ? strerror(err) : "failed");
    uint64_t ms = now_ns() / 1000000;
    if (t->t2_error_ms == 0 || ms - t->t2_error_ms >= 10000) {
        t->t2_error_ms = ms;
        KV_LOG(WARN, "KVD-TIER2-IO", "%s (kvd keeps serving from the tiers above)", t->t2_error);
    }
}

/* Drops entry i from tier (a budget's victim or a failed copy), keeping t->used true. A T1
 * buffer goes to the recycled ones. */
static void entry_drop(tier_pool *tp, uint32_t i, int tier) {
    kvd_tiers *t = tp->t;
    if (tier == 1) {
        uint64_t len = kvd_tstore_at(&tp->st, i)->len1;
        uint8_t *b = kvd_tstore_take1(&tp->st, i);
        t->used[0] -= len;
        if (tp->format == KVD_TF_RAW && len == tp->block_bytes) {
            buf_give(t, b, len); /* the next raw copy of this block size reuses it */
        } else {
            t1_free(t, b);
        }
        return;
    }
    uint64_t before = tp->st.bytes[tier - 1];
    kvd_tstore_drop(&tp->st, i, tier, tp->slot_bytes);
    t->used[tier - 1] -= before - tp->st.bytes[tier - 1];
}

static void start_down2_from_t1(tier_pool *tp, uint32_t i);

/* ---- tenants in the lower tiers (quota tier-max, tier-guarantee; docs/TIERS.md) ------------ */

static const kvd_quota *quota_of(const kvd_tiers *t, uint32_t tenant) {
    return tenant < KVD_MAX_TENANTS ? kvd_tenants_quota(t->reg->tenants, tenant) : NULL;
}

/* Bytes charged to tenant in tp's tier: its T1 entries as stored, a T2 slot each. */
static uint64_t owned_bytes(const tier_pool *tp, uint32_t tenant, int tier) {
    return tier == 1 ? kvd_tstore_owned_bytes1(&tp->st, tenant)
                     : kvd_tstore_owned(&tp->st, tenant, 2) * tp->slot_bytes;
}

/* How far tenant is over its guarantees in tp's tier, in bytes: 0 while it is at or under its
 * tier-guarantee (blocks) or its tier-guarantee-bytes, else the smaller excess (blocks over
 * tier-guarantee counted at the tenant's mean entry size there); all its bytes without either. */
static uint64_t over_guarantee(const tier_pool *tp, uint32_t tenant, int tier) {
    const kvd_quota *q = quota_of(tp->t, tenant);
    uint64_t c = kvd_tstore_owned(&tp->st, tenant, tier), b = owned_bytes(tp, tenant, tier);
    if (c == 0) {
        return 0;
    }
    uint64_t ex = b;
    if (q != NULL && q->tier_guarantee != 0) {
        if (c <= q->tier_guarantee) {
            return 0;
        }
        uint64_t e = (c - q->tier_guarantee) * (b / c);
        ex = e < ex ? e : ex;
    }
    if (q != NULL && q->tier_guarantee_bytes != 0) {
        if (b <= q->tier_guarantee_bytes) {
            return 0;
        }
        uint64_t e = b - q->tier_guarantee_bytes;
        ex = e < ex ? e : ex;
    }
    return ex > 0 ? ex : 1;
}

/* Whether entry v of tp's tier may go to make room for tenant `for` (UINT32_MAX: nobody's):
 * an entry of nobody or of `for` itself always, another tenant's only while that tenant is
 * over its guarantees there (tier-guarantee, tier-guarantee-bytes). */
static int evictable_for(const tier_pool *tp, int tier, uint32_t v, uint32_t for_tenant) {
    uint32_t o = kvd_tstore_owner(&tp->st, v);
    if (o == UINT32_MAX || o == for_tenant) {
        return 1;
    }
    return over_guarantee(tp, o, tier) > 0;
}

#define VICTIM_WALK 64 /* unowned entries looked for past the protected oldest, at most */

/* The entry of tp's tier to evict for tenant `for`: the oldest when it may go (always, without
 * guarantees); else the oldest of the tenant furthest over its guarantee, else `for`'s own
 * oldest, else an unowned one among the next VICTIM_WALK; KVD_TNONE when all are protected. */
static uint32_t victim_in(const tier_pool *tp, int tier, uint32_t for_tenant) {
    uint32_t v = kvd_tstore_oldest(&tp->st, tier);
    if (v == KVD_TNONE || evictable_for(tp, tier, v, for_tenant)) {
        return v;
    }
    uint32_t best = UINT32_MAX;
    uint64_t over = 0;
    for (uint32_t k = 0; k < tp->st.nown; k++) {
        const kvd_towner *o = &tp->st.own[k];
        uint64_t ex = o->tenant != for_tenant ? over_guarantee(tp, o->tenant, tier) : 0;
        if (ex > over && kvd_tstore_oldest_of(&tp->st, o->tenant, tier) != KVD_TNONE) {
            best = o->tenant;
            over = ex;
        }
    }
    if (best == UINT32_MAX && for_tenant != UINT32_MAX &&
        kvd_tstore_oldest_of(&tp->st, for_tenant, tier) != KVD_TNONE) {
        best = for_tenant;
    }
    if (best != UINT32_MAX) {
        return kvd_tstore_oldest_of(&tp->st, best, tier);
    }
    int t = tier - 1, n = 0;
    for (uint32_t i = tp->st.head[t]; i != KVD_TNONE && n < VICTIM_WALK; i = tp->st.e[i].next[t]) {
        if (tp->st.e[i].busy == 0 && kvd_tstore_owner(&tp->st, i) == UINT32_MAX) {
            return i;
        }
        n++;
    }
    return KVD_TNONE;
}

/* A pool's fair share of tier's budget: the budget over the pools with tiers. */
static uint64_t fair_share(const kvd_tiers *t, int tier) {
    uint32_t npools = 0;
    for (uint32_t i = 0; i < t->reg->npools; i++) {
        npools += t->reg->pools[i].tiers != NULL;
    }
    return npools > 0 ? t->cap[tier - 1] / npools : t->cap[tier - 1];
}

/* The entry a full tier gives up for pool tp: tp's own oldest while tp holds more than its fair
 * share of the tier (the budget over the pools with tiers), else the oldest of the pool furthest
 * over its share, so that one pool's flood cannot keep the others out (each pool is guaranteed
 * its share); tp's own oldest when no pool is over (victim_in picks inside the pool). 0 when
 * there is none. */
static int pick_victim(tier_pool *tp, int tier, uint32_t for_tenant, tier_pool **vtp, uint32_t *v) {
    kvd_tiers *t = tp->t;
    uint64_t share = fair_share(t, tier);
    if (tp->st.bytes[tier - 1] <= share) {
        tier_pool *best = NULL;
        uint64_t over = 0;
        for (uint32_t i = 0; i < t->reg->npools; i++) {
            tier_pool *o = t->reg->pools[i].tiers;
            if (o != NULL && o != tp && o->st.bytes[tier - 1] > share &&
                o->st.bytes[tier - 1] - share > over &&
                kvd_tstore_oldest(&o->st, tier) != KVD_TNONE) {
                best = o;
                over = o->st.bytes[tier - 1] - share;
            }
        }
        if (best != NULL && (*v = victim_in(best, tier, for_tenant)) != KVD_TNONE) {
            *vtp = best;
            return 1;
        }
    }
    *vtp = tp;
    *v = victim_in(tp, tier, for_tenant);
    return *v != KVD_TNONE;
}

static int remote_writes(const tier_pool *tp);
static int remote_back(const tier_pool *tp);
static void remote_clean_ahead_one(tier_pool *tp);
static void remote_clean_ahead_victims(tier_pool *tp);

/* Drops the victim pick_victim chose, counted as a drop when no lower tier keeps it. A T1
 * victim that remote-write write-back had not written yet is a remote dirty drop; the pool's
 * next victims are then written ahead (remote_clean_ahead_one). */
static void drop_victim(tier_pool *vtp, int tier, uint32_t v) {
    kvd_tiers *t = vtp->t;
    int last = tier == 2 || !kvd_tstore_in(&vtp->st, v, 2);
    int dirty =
        tier == 1 && remote_back(vtp) && remote_writes(vtp) && !kvd_tstore_at(&vtp->st, v)->inr;
    entry_drop(vtp, v, tier);
    if (last) {
        t->c[tier == 1 ? TS_DROPS_T1 : TS_DROPS_T2]++;
    }
    if (dirty) {
        t->c[TS_REMOTE_DIRTY_DROPS]++;
    }
    if (tier == 1) {
        remote_clean_ahead_one(vtp);
    }
}

/* Makes room in tier for `need` more bytes by evicting entries (pick_victim); 1 when the room
 * is there. A T1 victim without a T2 copy gets none now: T1 is the last tier for it. */
static int make_room(tier_pool *tp, int tier, uint64_t need, uint32_t for_tenant) {
    kvd_tiers *t = tp->t;
    for (;;) {
        uint64_t extra = tier == 1 ? t->reserved1 + t->cached1 : 0;
        if (t->used[tier - 1] + extra + need <= t->cap[tier - 1]) {
            break;
        }
        if (tier == 1 && buf_shed(t)) {
            continue; /* recycled buffers go before entries */
        }
        tier_pool *vtp;
        uint32_t v;
        if (!pick_victim(tp, tier, for_tenant, &vtp, &v)) {
            return 0;
        }
        drop_victim(vtp, tier, v);
    }
    return 1;
}

/* Whether tenant (quota q) would be past its tier-max or tier-max-bytes in tp's tier with
 * `blocks` more blocks of `bytes` more bytes. */
static int tier_over(const tier_pool *tp, const kvd_quota *q, uint32_t tenant, int tier,
                     uint64_t blocks, uint64_t bytes) {
    return (q->tier_max != 0 && kvd_tstore_owned(&tp->st, tenant, tier) + blocks > q->tier_max) ||
           (q->tier_max_bytes != 0 && owned_bytes(tp, tenant, tier) + bytes > q->tier_max_bytes);
}

/* Whether a block of `bytes` is alone past tenant's tier-max-bytes or tier-total-bytes (it can
 * never stay). */
static int tier_past_bytes(const tier_pool *tp, uint32_t tenant, uint64_t bytes) {
    const kvd_quota *q = quota_of(tp->t, tenant);
    return q != NULL && ((q->tier_max_bytes != 0 && bytes > q->tier_max_bytes) ||
                         (q->tier_total_bytes != 0 && bytes > q->tier_total_bytes));
}

/* Bytes charged to tenant in tier over all pools (what tier-total-bytes limits). O(pools). */
static uint64_t total_bytes(const kvd_tiers *t, uint32_t tenant, int tier) {
    uint64_t b = 0;
    for (uint32_t k = 0; k < t->reg->npools; k++) {
        const tier_pool *tp = t->reg->pools[k].tiers;
        if (tp != NULL && !tp->gone) {
            b += owned_bytes(tp, tenant, tier);
        }
    }
    return b;
}

/* The entry tenant gives up for its tier-total-bytes: its oldest (not busy) in the pool where it
 * holds the most bytes in tier, leaving entry `keep` of pool keep_tp alone (an entry that just
 * landed; KVD_TNONE: none). 0 when it has none to give. */
static int total_victim(kvd_tiers *t, uint32_t tenant, int tier, const tier_pool *keep_tp,
                        uint32_t keep, tier_pool **vtp, uint32_t *v) {
    uint64_t most = 0;
    *vtp = NULL;
    for (uint32_t k = 0; k < t->reg->npools; k++) {
        tier_pool *tp = t->reg->pools[k].tiers;
        if (tp == NULL || tp->gone) {
            continue;
        }
        uint64_t b = owned_bytes(tp, tenant, tier);
        uint32_t o = kvd_tstore_oldest_of(&tp->st, tenant, tier);
        if (b > most && o != KVD_TNONE && !(tp == keep_tp && o == keep)) {
            most = b;
            *vtp = tp;
            *v = o;
        }
    }
    return *vtp != NULL;
}

/* Tenant (quota q) back under its tier-total-bytes in tier with `need` more bytes, its oldest
 * in its biggest pool first (keep_tp / keep: an entry that stays); 0 when it has nothing left
 * to give. */
static int total_trim(kvd_tiers *t, const kvd_quota *q, uint32_t tenant, int tier, uint64_t need,
                      const tier_pool *keep_tp, uint32_t keep) {
    if (q == NULL || q->tier_total_bytes == 0) {
        return 1;
    }
    while (total_bytes(t, tenant, tier) + need > q->tier_total_bytes) {
        tier_pool *vtp;
        uint32_t v;
        if (!total_victim(t, tenant, tier, keep_tp, keep, &vtp, &v)) {
            return 0;
        }
        drop_victim(vtp, tier, v);
        t->c[TS_QUOTA_DROPS]++;
    }
    return 1;
}

/* Tenant (an entry's owner) is to have one more block of `need` bytes in tp's tier (0: not known
 * before the copy, a compressed or quantized one): while that would pass its tier-max or
 * tier-max-bytes there, its own oldest goes first. 0 when the block cannot go down: none of them
 * can go (all busy), or need alone is past tier-max-bytes. */
static int tier_admit(tier_pool *tp, int tier, uint32_t tenant, uint64_t need) {
    const kvd_quota *q = quota_of(tp->t, tenant);
    if (q == NULL || (q->tier_max == 0 && q->tier_max_bytes == 0 && q->tier_total_bytes == 0)) {
        return 1;
    }
    if (tier_past_bytes(tp, tenant, need)) {
        return 0;
    }
    while (tier_over(tp, q, tenant, tier, 1, need > 0 ? need : 1)) {
        uint32_t v = kvd_tstore_oldest_of(&tp->st, tenant, tier);
        if (v == KVD_TNONE) {
            return 0;
        }
        drop_victim(tp, tier, v);
        tp->t->c[TS_QUOTA_DROPS]++;
    }
    return total_trim(tp->t, q, tenant, tier, need > 0 ? need : 1, NULL, KVD_TNONE);
}

/* After entry i landed in tp's tier: its owner back to its tier-max and tier-max-bytes (copies
 * that were in flight together may have passed them), its oldest first, and to its
 * tier-total-bytes (total_trim); i itself stays. A block alone past tier-max-bytes or
 * tier-total-bytes (the limit lowered while it was copied) goes instead, and nothing
 * else, unless a copy still reads it (then the next admission trims it): 0 is returned when it
 * went (the entry may be freed). */
static int tier_trim(tier_pool *tp, int tier, uint32_t i) {
    uint32_t tenant = kvd_tstore_owner(&tp->st, i);
    const kvd_quota *q = quota_of(tp->t, tenant);
    if (q == NULL) {
        return 1;
    }
    const kvd_tentry *e = kvd_tstore_at(&tp->st, i);
    uint64_t own = tier == 1 ? e->len1 : tp->slot_bytes;
    if (tier_past_bytes(tp, tenant, own) && e->busy == 0) {
        drop_victim(tp, tier, i);
        tp->t->c[TS_QUOTA_DROPS]++;
        return 0;
    }
    while (tier_over(tp, q, tenant, tier, 0, 0)) {
        uint32_t v = kvd_tstore_oldest_of(&tp->st, tenant, tier);
        if (v == KVD_TNONE || v == i) {
            break;
        }
        drop_victim(tp, tier, v);
        tp->t->c[TS_QUOTA_DROPS]++;
    }
    (void)total_trim(tp->t, q, tenant, tier, 0, tp, i);
    return 1;
}

static void doomed_finish(tier_pool *tp, uint32_t i);

/* Runs the waits of pool_id (every pool: UINT32_MAX) with rc, in the order they came; a wait
 * that waits again (from its callback) goes to the back for the next wake-up. */
static void room_wake(kvd_tiers *t, uint32_t pool_id, kv_err rc) {
    room_wait *mine = NULL, **mt = &mine;
    for (room_wait **pp = &t->waits; *pp != NULL;) {
        room_wait *w = *pp;
        if (pool_id == UINT32_MAX || w->pool_id == pool_id) {
            *pp = w->next;
            w->next = NULL;
            *mt = w;
            mt = &w->next;
        } else {
            pp = &w->next;
        }
    }
    while (mine != NULL) {
        room_wait *w = mine;
        mine = w->next;
        kvd_tiers_room_fn fn = w->fn;
        void *arg = w->arg;
        free(w);
        fn(arg, rc);
    }
}

/* A copy down gave its T0 block's lease back. The caller wakes the Allocates waiting for one
 * (room_wake) once its own state is whole: their retries run then (evictions, copies down
 * started, replies), and would meet a half-updated entry. */
static void unleased(tier_pool *tp) {
    KV_ASSERT(tp->leased > 0);
    tp->leased--;
}

/* Tells the KV events hook (kvd_tiers_set_event_hook) that hash entered or left tier. */
static void tier_event(tier_pool *tp, kv_hash128 hash, const kv_hash128 *parent,
                       const uint8_t *tail, int tier, int present) {
    if (tp->t->ev_fn != NULL && !tp->gone) {
        tp->t->ev_fn(tp->t->ev_arg, tp->pool_id, tp->domain_id, tp->layout.tokens_per_block, hash,
                     parent, tail, tier, present);
    }
}

/* Entry i's digest tail from the digest hook, when it has none yet. */
static void learn_tail(tier_pool *tp, uint32_t i) {
    kvd_tentry *e = kvd_tstore_at(&tp->st, i);
    if (!e->has_tail && tp->t->dg_fn != NULL &&
        tp->t->dg_fn(tp->t->dg_arg, tp->domain_id, e->hash, e->tail)) {
        e->has_tail = 1;
    }
}

/* ---- the remote tier (remote-redis) ------------------------------------------------------ */

/* PREFIX:DOMAIN:LAYOUT:HASH: the domain is the pool's, named by the daemon from the proven
 * identity, so two tenants never meet in Redis; the layout key keeps models and shapes apart. */
static void remote_key(const tier_pool *tp, kv_hash128 h, char *buf, size_t len) {
    char lk[33], hh[33];
    kv_hash_hex(tp->layout_key, lk);
    kv_hash_hex(h, hh);
    snprintf(buf, len, "%s:%s:%s:%s", tp->t->cfg->remote_key_prefix, tp->domain, lk, hh);
}

/* Remembers that h's value came from Redis into T0 (from_remote). */
static void from_remote_note(tier_pool *tp, kv_hash128 h) {
    if (tp->t->cfg->remote_ttl_s != 0) {
        return;
    }
    if (tp->from_remote == NULL) {
        tp->from_remote = calloc(FROM_REMOTE_SLOTS, sizeof(*tp->from_remote));
        if (tp->from_remote == NULL) {
            return; /* then every such block is written again, as before */
        }
    }
    tp->from_remote[h.lo & (FROM_REMOTE_SLOTS - 1)] = h;
}

/* 1 when h was noted (and forgets it: the next copy down writes again); 0 otherwise. */
static int from_remote_take(tier_pool *tp, kv_hash128 h) {
    kv_hash128 *s =
        tp->from_remote != NULL ? &tp->from_remote[h.lo & (FROM_REMOTE_SLOTS - 1)] : NULL;
    if (s == NULL || !kv_hash_eq(*s, h) || (h.lo == 0 && h.hi == 0)) {
        return 0;
    }
    *s = (kv_hash128){0, 0};
    return 1;
}

#define RPUT_PAUSE_MS 100 /* after a failed write, write-back writes none ahead this long */

typedef struct rput {
    tier_pool *tp;
    uint32_t entry;
    int drain; /* written by kvd_tiers_drain */
    char key[256];
} rput;

static void drain_put_done(kvd_tiers *t, kv_err rc, int mine, int back);

/* An entry the remote tier held busy is free again: what a finished copy job would do. */
static void remote_release(tier_pool *tp, uint32_t i) {
    kvd_tentry *e = kvd_tstore_at(&tp->st, i);
    e->busy--;
    if (e->busy > 0) {
        return;
    }
    if (e->doomed) {
        doomed_finish(tp, i);
    } else if (e->t1 == NULL && !e->in2 && e->pending == 0) {
        kvd_tstore_forget(&tp->st, i);
    }
}

static void on_remote_put(void *arg, kv_err rc) {
    rput *q = arg; /* rc is counted by kvd_remote */
    tier_pool *tp = q->tp;
    kvd_tiers *t = tp->t;
    int drain = q->drain, back = remote_back(tp);
    tp->jobs--;
    t->rputs--;
    if (!tp->gone) {
        kvd_tentry *e = kvd_tstore_at(&tp->st, q->entry);
        if (rc != KV_OK) {
            tp->t->rput_pause_until = uv_now(tp->t->loop) + RPUT_PAUSE_MS;
        }
        if (rc == KV_OK && !e->doomed) {
            e->inr = 1;
            tier_event(tp, e->hash, NULL, e->has_tail ? e->tail : NULL, 3, 1); /* any node
                                                                                  can fetch it */
            if (tp->t->ledger != NULL) {
                kvd_rledger_add(tp->t->ledger, tp->pool_id, e->hash);
            }
        }
        remote_release(tp, q->entry);
    } else if (tp->jobs == 0) {
        tier_pool_free(tp);
    }
    free(q);
    drain_put_done(t, rc, drain, back);
}

/* Whether tp's blocks go to the remote tier at all. */
static int remote_writes(const tier_pool *tp) {
    return tp->t->remote != NULL && !tp->no_remote && !tp->gone;
}

/* Whether tp writes to the remote tier under write-back (its own remote-write, else the
 * daemon's). */
static int remote_back(const tier_pool *tp) {
    return tp->remote_back >= 0 ? tp->remote_back : tp->t->remote_back;
}

/* Writes entry i's T1 bytes to the remote tier (they are immutable while it is busy, so the
 * remote thread reads them in place). 0 when the remote tier took no more (its queue is full or
 * every node is down: counted there as a drop); 1 otherwise (written, or nothing to write). */
static int start_remote_put(tier_pool *tp, uint32_t i, int drain) {
    kvd_tiers *t = tp->t;
    kvd_tentry *e = kvd_tstore_at(&tp->st, i);
    if (!remote_writes(tp) || e->t1 == NULL || e->doomed) {
        return 1;
    }
    rput *q = malloc(sizeof(*q));
    if (q == NULL) {
        return 0;
    }
    q->tp = tp;
    q->entry = i;
    q->drain = drain;
    remote_key(tp, e->hash, q->key, sizeof(q->key));
    kvd_remote_meta m = {tp->layout_key, e->hash, e->fmt1, e->has_tail ? e->tail : NULL};
    if (kvd_remote_put(t->remote, q->key, &m, e->t1, e->len1, on_remote_put, q) != KV_OK) {
        free(q); /* counted as a drop */
        return 0;
    }
    e->busy++;
    tp->jobs++;
    t->rputs++;
    return 1;
}

/* Entry i just landed in T1. A block read from Redis straight into T0 (from_remote) is not
 * written again: Redis has its value. Otherwise remote-write write-through writes it now;
 * write-back leaves it to remote_clean_ahead_victims. */
static void remote_landed(tier_pool *tp, uint32_t i) {
    kvd_tiers *t = tp->t;
    kvd_tentry *e = kvd_tstore_at(&tp->st, i);
    if (!remote_writes(tp) || e->t1 == NULL || e->doomed) {
        return;
    }
    if (from_remote_take(tp, e->hash)) {
        e->inr = 1;
        t->c[TS_REMOTE_PUT_SKIPS]++; /* Redis has this value: it came from there */
    } else if (!remote_back(tp)) {
        (void)start_remote_put(tp, i, 0);
    }
    remote_clean_ahead_victims(tp);
}

/* After a landing in tp's T1: the pools whose entries T1 gives up next keep their windows
 * written: tp and every pool over its fair share of T1 (pick_victim takes from those), so an
 * idle write-back pool's blocks are written before another pool's landings push them out. */
static void remote_clean_ahead_victims(tier_pool *tp) {
    kvd_tiers *t = tp->t;
    if (!t->any_remote_back) {
        return;
    }
    remote_clean_ahead_one(tp);
    uint64_t share = fair_share(t, 1);
    for (uint32_t k = 0; k < t->reg->npools; k++) {
        tier_pool *o = t->reg->pools[k].tiers;
        if (o != NULL && o != tp && o->st.bytes[0] > share) {
            remote_clean_ahead_one(o);
        }
    }
}

/* remote-write write-back: while tier 1 is within tier-clean-ahead blocks (the pool's) of full,
 * the pool's oldest tier-clean-ahead T1 entries (the next it gives up, in its LRU order) are
 * kept written to Redis, each held busy while it is written (eviction passes it meanwhile), so
 * that what leaves T1 is in Redis. A walk stops at the first write the remote tier does not
 * take (its queue is full, Redis is down); after a write that failed, none is started for
 * RPUT_PAUSE_MS (the entries stay unwritten: if T1 gives them up meanwhile, they are counted as
 * dirty drops). */
static void remote_clean_ahead_one(tier_pool *tp) {
    kvd_tiers *t = tp->t;
    if (!remote_back(tp) || !remote_writes(tp) || t->cap[0] == 0 ||
        uv_now(t->loop) < t->rput_pause_until) {
        return;
    }
    uint64_t ahead = tp->clean_ahead >= 0 ? (uint64_t)tp->clean_ahead : t->cfg->tier_clean_ahead;
    /* (Recycled buffers, cached1, are not counted: make_room sheds them before any entry.) */
    uint64_t held = t->used[0] + t->reserved1;
    if (held + ahead * tp->block_bytes < t->cap[0]) {
        return;
    }
    uint64_t n = 0;
    for (uint32_t i = tp->st.head[0]; i != KVD_TNONE && n < ahead; n++) {
        kvd_tentry *e = kvd_tstore_at(&tp->st, i);
        uint32_t next = e->next[0];
        if (!e->inr && e->busy == 0 && !e->doomed && e->t1 != NULL && !start_remote_put(tp, i, 0)) {
            t->rput_pause_until = uv_now(t->loop) + RPUT_PAUSE_MS;
            return;
        }
        i = next;
    }
}

/* ---- at stop: write-back's unwritten T1 blocks go to Redis (kvd_tiers_drain) ------------- *
 *
 * The server took its last request, so nothing new is committed. A list of (pool, hash) of every
 * T1 entry Redis lacks is taken (oldest first per pool) and written DRAIN_WINDOW at a time; an
 * entry gone or written meanwhile is passed. Blocks that landed in T1 after the list was taken
 * (copies that were in flight) get one more list when the first is done. The drain ends when the
 * lists are done, at the first write that fails (Redis down or refusing: the rest would fail
 * too), or after remote-drain-s; its writes still out then end at kvd_tiers_close. */

#define DRAIN_WINDOW 32 /* writes of a drain in flight at most */

typedef struct drain_item {
    uint32_t pool_id;
    kv_hash128 hash;
} drain_item;

typedef struct tdrain {
    kvd_tiers *t;
    kvd_tiers_drained_fn done;
    void *arg;
    drain_item *items;
    size_t n, next;
    int rounds;   /* lists taken */
    int failed;   /* a write failed: no more are started */
    int finished; /* the drain ended (done runs from the timer's close callback) */
    uint32_t inflight;
    uint64_t first, written, errors; /* first: the blocks of the first list */
    uint64_t start_ms;
    const char *why; /* why it ended early, or NULL */
    uv_timer_t timer;
} tdrain;

static int drain_wants(const tier_pool *tp, const kvd_tentry *e) {
    return e->t1 != NULL && !e->inr && !e->doomed && remote_writes(tp) && remote_back(tp);
}

/* The T1 entries of write-back pools that Redis lacks, oldest first per pool: their number,
 * the first cap of them named in out (NULL: only counted). */
static size_t drain_scan(const kvd_tiers *t, drain_item *out, size_t cap) {
    size_t n = 0;
    for (uint32_t k = 0; k < t->reg->npools; k++) {
        const tier_pool *tp = t->reg->pools[k].tiers;
        for (uint32_t i = tp != NULL ? tp->st.head[0] : KVD_TNONE; i != KVD_TNONE;
             i = tp->st.e[i].next[0]) {
            if (drain_wants(tp, &tp->st.e[i])) {
                if (n < cap) {
                    out[n] = (drain_item){tp->pool_id, tp->st.e[i].hash};
                }
                n++;
            }
        }
    }
    return n;
}

/* Takes the list of the T1 entries Redis lacks; their number. */
static size_t drain_list(tdrain *d) {
    size_t n = drain_scan(d->t, NULL, 0);
    drain_item *v = n > 0 ? malloc(n * sizeof(*v)) : NULL;
    n = v != NULL ? drain_scan(d->t, v, n) : 0; /* (no memory: nothing listed is written) */
    free(d->items);
    d->items = v;
    d->n = n;
    d->next = 0;
    if (d->rounds++ == 0) {
        d->first = n;
    }
    return n;
}

/* The timer is closed: the stop goes on, in a loop turn of its own (not inside the remote
 * tier's completion that ended the drain, which kvd_tiers_close would close under it). */
static void on_drain_closed(uv_handle_t *h) {
    tdrain *d = h->data;
    d->done(d->arg);
}

static void drain_finish(tdrain *d, const char *why) {
    if (d->finished) {
        return;
    }
    d->finished = 1;
    /* Left: counted now (entries written ahead meanwhile, or gone, are not left); writes still
     * out may yet land. */
    uint64_t left = drain_scan(d->t, NULL, 0);
    kv_log_level lv = left > 0 || d->errors > 0 ? KV_LOG_WARN : KV_LOG_INFO;
    if (lv <= kv_log_threshold) {
        kv_log_emit(lv, "KVD-REMOTE",
                    "stop: wrote %llu tier-1 blocks Redis lacked in %llu ms (%llu listed at the "
                    "start; %llu failed, %llu left unwritten%s%s)",
                    (unsigned long long)d->written,
                    (unsigned long long)(uv_now(d->t->loop) - d->start_ms),
                    (unsigned long long)d->first, (unsigned long long)d->errors,
                    (unsigned long long)left, why != NULL ? ": " : "", why != NULL ? why : "");
    }
    uv_timer_stop(&d->timer);
    uv_close((uv_handle_t *)&d->timer, on_drain_closed);
}

static void drain_step(tdrain *d) {
    kvd_tiers *t = d->t;
    while (!d->finished && !d->failed && d->inflight < DRAIN_WINDOW) {
        if (d->next == d->n) {
            if (d->inflight > 0 || d->rounds >= 2 || drain_list(d) == 0) {
                break;
            }
            continue;
        }
        drain_item it = d->items[d->next];
        kvd_reg_pool *p = kvd_registry_pool(t->reg, it.pool_id);
        tier_pool *tp = p != NULL ? p->tiers : NULL;
        uint32_t i = tp != NULL ? kvd_tstore_find(&tp->st, it.hash) : KVD_TNONE;
        kvd_tentry *e = i != KVD_TNONE ? kvd_tstore_at(&tp->st, i) : NULL;
        if (e == NULL || !drain_wants(tp, e) || e->busy > 0) {
            d->next++; /* gone, written, or being written (a write ahead) */
            continue;
        }
        if (!start_remote_put(tp, i, 1)) {
            if (t->rputs == 0) {
                d->failed = 1; /* every node down, or no memory: nothing will take it */
                d->why = "Redis took no more";
            }
            break; /* the queue is full (of these or of writes ahead): a completion goes on */
        }
        d->next++;
        d->inflight++;
    }
    /* Done when its own writes and the writes ahead it passed (busy entries) are back: the
     * stop cancels what is still queued. */
    if (!d->finished && d->inflight == 0 && t->rputs == 0 && (d->failed || d->next == d->n)) {
        drain_finish(d, d->why);
    }
}

/* A remote write ended (mine: one of the drain's; back: a write-back pool's). A write-back
 * pool's write that fails ends the drain: Redis is down, full or refusing, and the rest would
 * fail too (a write-through pool's failure, in a cluster maybe another node's, does not). */
static void drain_put_done(kvd_tiers *t, kv_err rc, int mine, int back) {
    tdrain *d = t->drain;
    if (d == NULL || d->finished) {
        return;
    }
    if (mine) {
        d->inflight--;
        d->written += rc == KV_OK;
        d->errors += rc != KV_OK;
    }
    if (rc != KV_OK && back) {
        d->failed = 1;
        d->why = "Redis took no more";
    }
    drain_step(d);
}

static void on_drain_timer(uv_timer_t *h) {
    tdrain *d = h->data;
    drain_finish(d, "remote-drain-s is up");
}

int kvd_tiers_drain(kvd_tiers *t, kvd_tiers_drained_fn done, void *arg) {
    if (t == NULL || t->remote == NULL || t->cfg->remote_drain_s == 0 || t->drain != NULL) {
        return 0;
    }
    tdrain *d = calloc(1, sizeof(*d));
    if (d == NULL) {
        return 0;
    }
    d->t = t;
    d->done = done;
    d->arg = arg;
    t->drain = d;
    if (drain_list(d) == 0 || uv_timer_init(t->loop, &d->timer) != 0) {
        d->finished = 1; /* nothing to write (or no timer: nothing is started) */
        return 0;
    }
    d->timer.data = d;
    d->start_ms = uv_now(t->loop);
    uv_timer_start(&d->timer, on_drain_timer, t->cfg->remote_drain_s * 1000, 0);
    KV_LOG(INFO, "KVD-REMOTE",
           "stop: writing the %llu tier-1 blocks Redis lacks (remote-write write-back; at most "
           "%llu s, remote-drain-s)",
           (unsigned long long)d->n, (unsigned long long)t->cfg->remote_drain_s);
    drain_step(d);
    return 1;
}

/* Starts writing entry i's T1 bytes to T2 (when the pool has a T2 and it lacks the copy). */
static void start_down2_from_t1(tier_pool *tp, uint32_t i) {
    kvd_tentry *e = kvd_tstore_at(&tp->st, i);
    if (tp->disk == NULL || e->in2 || (e->pending & KVD_TPEND_T2) || e->t1 == NULL || e->doomed) {
        return;
    }
    uint32_t owner = kvd_tstore_owner(&tp->st, i);
    if (!tier_admit(tp, 2, owner, tp->slot_bytes) || !make_room(tp, 2, tp->slot_bytes, owner)) {
        return;
    }
    job *j = job_new(tp, J_DOWN2);
    uint64_t slot;
    if (j == NULL || kvd_tstore_slot2(&tp->st, &slot) != KV_OK) {
        free(j);
        return;
    }
    e = kvd_tstore_at(&tp->st, i);
    j->entry = i;
    j->slot = slot;
    j->src1 = e->t1;
    j->len1 = e->len1;
    j->fmt1 = e->fmt1;
    j->rec.hash = e->hash;
    j->rec.parent = e->parent;
    j->rec.seq = tp->t->seq++;
    if (e->has_tail) {
        j->rec.has_tail = 1;
        memcpy(j->rec.tail, e->tail, KVD_DISK_TAIL);
    }
    tp->t->used[1] += tp->slot_bytes; /* reserved now, so concurrent writes fit the budget */
    if (job_start(j) != KV_OK) {
        tp->t->used[1] -= tp->slot_bytes;
        kvd_tstore_slot2_back(&tp->st, slot);
        free(j);
        return;
    }
    e->busy++;
    e->pending |= KVD_TPEND_T2;
}

/* Starts copying T0 block ref (hash, parent; charged to tenant) down: to T1 when there is one,
 * else to T2. cold: a write-back copy. */
static void start_down(tier_pool *tp, kvd_pool *pool, kvd_block_ref ref, kv_hash128 hash,
                       kv_hash128 parent, int cold, const uint8_t *tail, uint32_t tenant) {
    kvd_tiers *t = tp->t;
    uint32_t i = kvd_tstore_find(&tp->st, hash);
    if (i != KVD_TNONE) {
        kvd_tentry *e = kvd_tstore_at(&tp->st, i);
        if (e->t1 != NULL || e->in2 || e->pending != 0 || e->doomed) {
            return; /* already down, or on its way */
        }
    }
    int to1 = t->cap[0] > 0;
    /* The bytes the copy will take there, where known before it runs (a compressed block's
     * are not: the copy's landing trims the tenant to its tier-max-bytes then). */
    uint64_t need = !to1                        ? tp->slot_bytes
                    : tp->format == KVD_TF_RAW  ? tp->block_bytes
                    : tp->format >= KVD_TF_INT8 ? kvd_codec_quantized_bytes(tp->format, &tp->layout)
                                                : 0;
    if ((!to1 && tp->disk == NULL) || !tier_admit(tp, to1 ? 1 : 2, tenant, need)) {
        return;
    }
    /* A raw copy into T1 writes into a recycled buffer of the block's size when there is one,
     * or one that an eviction of this pool's oldest T1 entry just gave back. */
    uint8_t *buf = NULL;
    if (to1 && tp->format == KVD_TF_RAW) {
        buf = buf_take(t, tp->block_bytes, tp->pin);
        while (buf == NULL &&
               t->used[0] + t->reserved1 + t->cached1 + tp->block_bytes > t->cap[0]) {
            tier_pool *vtp;
            uint32_t v;
            if (!pick_victim(tp, 1, tenant, &vtp, &v)) {
                break;
            }
            drop_victim(vtp, 1, v);
            buf = buf_take(t, tp->block_bytes, tp->pin);
            if (buf == NULL) {
                buf_shed(t); /* a victim of another size: its buffer is room, not a buffer */
            }
        }
    }
    if (buf == NULL && (to1 ? !make_room(tp, 1, tp->block_bytes, tenant)
                            : !make_room(tp, 2, tp->slot_bytes, tenant))) {
        return;
    }
    uint32_t nruns = 0;
    run *runs = block_runs(pool, ref.id, &nruns);
    job *j = runs != NULL ? job_new(tp, to1 ? J_DOWN1 : J_DOWN2) : NULL;
    if (j == NULL || kvd_tstore_get(&tp->st, hash, parent, &i) != KV_OK) {
        free(runs);
        free(j);
        if (buf != NULL) {
            buf_give(t, buf, tp->block_bytes);
        }
        return;
    }
    (void)kvd_tstore_own(&tp->st, i, tenant); /* no memory for it: charged to nobody */
    kvd_tentry *te0 = kvd_tstore_at(&tp->st, i);
    if (tail != NULL && !te0->has_tail) {
        memcpy(te0->tail, tail, sizeof(te0->tail)); /* the Commit's own digest */
        te0->has_tail = 1;
    }
    learn_tail(tp, i); /* else the events' record of it, while T0 holds it */
    if (kvd_pool_lease(pool, ref) != KV_OK) {
        if (kvd_tstore_at(&tp->st, i)->pending == 0 && !kvd_tstore_in(&tp->st, i, 1) &&
            !kvd_tstore_in(&tp->st, i, 2)) {
            kvd_tstore_forget(&tp->st, i);
        }
        free(runs);
        free(j);
        if (buf != NULL) {
            buf_give(t, buf, tp->block_bytes);
        }
        return;
    }
    tp->leased++;
    kvd_reg_pool *rp = kvd_registry_pool(t->reg, tp->pool_id);
    kvd_tentry *se = kvd_tstore_at(&tp->st, i);
    const float *sum =
        rp != NULL && (rp->flags & KVD_POOL_SUMMARIES) ? kvd_summaries_get(&rp->summ, ref) : NULL;
    if (sum != NULL && se->summ == NULL) {
        /* The summary goes down with the block (a failed copy forgets the entry, and it). */
        se->summ = malloc(rp->summ.per * sizeof(float));
        if (se->summ != NULL) {
            memcpy(se->summ, sum, rp->summ.per * sizeof(float));
        }
    }
    j->out = buf; /* NULL: the copy thread allocates */
    j->entry = i;
    j->ref = ref;
    j->runs = runs;
    j->nruns = nruns;
    j->cold = cold;
    j->from_t0 = !to1;
    if (!to1) {
        uint64_t slot;
        (void)kvd_tstore_slot2(&tp->st, &slot);
        j->slot = slot;
        j->rec.hash = hash;
        j->rec.parent = parent;
        j->rec.seq = t->seq++;
        const kvd_tentry *te = kvd_tstore_at(&tp->st, i);
        if (te->has_tail) {
            j->rec.has_tail = 1;
            memcpy(j->rec.tail, te->tail, KVD_DISK_TAIL);
        }
        t->used[1] += tp->slot_bytes;
    } else {
        t->reserved1 += tp->block_bytes;
    }
    if (job_start(j) != KV_OK) {
        if (to1) {
            t->reserved1 -= tp->block_bytes;
        } else {
            t->used[1] -= tp->slot_bytes;
            kvd_tstore_slot2_back(&tp->st, j->slot);
        }
        (void)kvd_pool_unlease(pool, ref, cold);
        unleased(tp);
        kvd_tentry *e = kvd_tstore_at(&tp->st, i);
        if (e->pending == 0 && e->t1 == NULL && !e->in2) {
            kvd_tstore_forget(&tp->st, i);
        }
        if (j->out != NULL) {
            buf_give(t, j->out, tp->block_bytes);
        }
        free(runs);
        free(j);
        if (t->waits != NULL) {
            room_wake(t, tp->pool_id, KV_OK); /* once the entry is whole (as after_work) */
        }
        return;
    }
    kvd_tstore_at(&tp->st, i)->pending |= to1 ? KVD_TPEND_T1 : KVD_TPEND_T2;
    if (cold) {
        tp->cleaning++;
    }
}

/* Zeroes T2 slot `slot` (a record that must not come back at a restart), then gives it back. */
static void start_clear(tier_pool *tp, uint64_t slot) {
    job *j = tp->disk != NULL ? job_new(tp, J_CLEAR2) : NULL;
    if (j != NULL) {
        j->slot = slot;
        if (job_start(j) == KV_OK) {
            return;
        }
        free(j);
    }
    KV_LOG(WARN, "KVD-TIER2-CLEAR",
           "pool %u: tier-2 slot %llu of a quarantined block could not be cleared; a restart may "
           "find it (its bytes are those of the quarantined block's commit)",
           tp->pool_id, (unsigned long long)slot);
    kvd_tstore_slot2_back(&tp->st, slot);
}

/* A quarantined entry (doomed) leaves every tier once no job uses it: its T1 bytes freed, its
 * T2 record zeroed, the entry forgotten. Called when it is doomed and after each job on it. */
static void doomed_finish(tier_pool *tp, uint32_t i) {
    kvd_tentry *e = kvd_tstore_at(&tp->st, i);
    if (!e->used || !e->doomed || e->busy != 0 || e->pending != 0) {
        return;
    }
    if (e->t1 != NULL) {
        entry_drop(tp, i, 1);
        e = kvd_tstore_at(&tp->st, i);
        if (!e->used) {
            return;
        }
    }
    if (e->in2) {
        /* Out of the store at once; the slot goes back only once it is zeroed. */
        uint64_t slot = kvd_tstore_unlink2(&tp->st, i, tp->slot_bytes);
        tp->t->used[1] -= tp->slot_bytes;
        start_clear(tp, slot);
        return;
    }
    kvd_tstore_forget(&tp->st, i);
}

static void fetch_finish(kvd_fetch *f);

/* ---- completions (loop thread) ------------------------------------------------------------- */

static void after_work(uv_work_t *w, int status) {
    (void)status; /* uv_cancel is never called: every job ran */
    job *j = w->data;
    tier_pool *tp = j->tp;
    kvd_tiers *t = tp->t;
    kvd_pool *pool = pool_of(tp);
    uint32_t pool_id = tp->pool_id;
    int wake = 0; /* a lease came back: waiting Allocates are retried at the end */
    tp->jobs--;
    t->jobs--;
    int kind = span_kind(j);
    if (kind >= 0 && --t->busy[kind] == 0) {
        t->c[TS_SPAN_DOWN1 + kind] += now_ns() - t->busy_since[kind];
    }
    if (tp->gone && j->kind != J_UP) {
        /* The pool was freed (only copies that hold no T0 block can outlive it): give the
         * reservations back and forget the result. */
        if (j->kind == J_DOWN1) {
            t->reserved1 -= tp->block_bytes;
        } else if (j->kind == J_DOWN2) {
            t->used[1] -= tp->slot_bytes;
        } else if (j->kind == J_PREFAULT) {
            t->reserved1 -= (uint64_t)j->nruns * j->block_bytes;
            for (uint32_t k = 0; k < j->nruns; k++) {
                t1_free(t, j->runs[k].p);
            }
        }
        t->c[TS_PIN_FALLBACKS] += j->pin_fallbacks;
        t->c[TS_T2_ZERO_COPY] += j->zero_copy;
        t1_free(t, j->out);
        free(j->runs);
        free(j);
        if (tp->jobs == 0) {
            tier_pool_free(tp);
        }
        return;
    }
    kvd_tentry *e = j->entry != KVD_TNONE ? kvd_tstore_at(&tp->st, j->entry) : NULL;
    switch (j->kind) {
        case J_DOWN1: {
            t->reserved1 -= tp->block_bytes;
            if (j->cold) {
                tp->cleaning--;
            }
            if (pool != NULL) {
                (void)kvd_pool_unlease(pool, j->ref, j->cold);
            }
            unleased(tp);
            wake = 1;
            e->pending &= (uint8_t)~KVD_TPEND_T1;
            uint32_t owner = kvd_tstore_owner(&tp->st, j->entry);
            if (j->rc == KV_OK && !e->doomed && e->t1 == NULL &&
                tier_past_bytes(tp, owner, j->out_len)) {
                /* Compressed worse than the owner's whole tier-max-bytes: not kept (and nothing
                 * of anyone's made room for it); the next landing or Fetch finds no T1 copy. */
                t->c[TS_QUOTA_DROPS]++;
                if (!e->in2 && e->pending == 0 && e->busy == 0) {
                    kvd_tstore_forget(&tp->st, j->entry);
                }
            } else if (j->rc == KV_OK && !e->doomed && e->t1 == NULL &&
                       make_room(tp, 1, j->out_len, owner)) {
                kvd_tstore_set1(&tp->st, j->entry, j->out, j->out_len, j->out_fmt);
                t->used[0] += j->out_len;
                t->c[TS_DEMOTE_T1]++;
                t->c[TS_COPY_BYTES_DOWN1] += tp->block_bytes;
                t->c[TS_COPY_NS_DOWN1] += j->ns;
                j->out = NULL;
                if (tier_trim(tp, 1, j->entry)) {
                    start_down2_from_t1(tp, j->entry);
                    remote_landed(tp, j->entry);
                }
            } else if (e->doomed) {
                doomed_finish(tp, j->entry);
            } else if (e->t1 == NULL && !e->in2 && e->pending == 0 && e->busy == 0) {
                kvd_tstore_forget(&tp->st, j->entry);
            }
            break;
        }
        case J_DOWN2: {
            if (j->from_t0) {
                if (j->cold) {
                    tp->cleaning--;
                }
                if (pool != NULL) {
                    (void)kvd_pool_unlease(pool, j->ref, j->cold);
                }
                unleased(tp);
                wake = 1;
            } else {
                e->busy--;
            }
            e->pending &= (uint8_t)~KVD_TPEND_T2;
            t->used[1] -= tp->slot_bytes; /* the reservation; set2 counts it again */
            if (j->rc == KV_OK && !e->doomed && !e->in2) {
                kvd_tstore_set2(&tp->st, j->entry, j->slot, j->rec.len, (uint8_t)j->rec.format,
                                j->rec.seq, tp->slot_bytes);
                t->used[1] += tp->slot_bytes;
                t->c[TS_DEMOTE_T2]++;
                t->c[TS_COPY_BYTES_DOWN2] += j->rec.len;
                t->c[TS_COPY_NS_DOWN2] += j->ns;
                if (!tier_trim(tp, 2, j->entry)) {
                    break; /* it went again (the entry may be freed) */
                }
            } else {
                if (j->rc != KV_OK) {
                    if (!j->t0_failed) { /* a device copy's failure is logged by the backend */
                        t->c[TS_WERR_T2]++;
                        t2_fail(t, tp, "tier-2 write", j->sys_errno);
                    }
                    kvd_tstore_slot2_back(&tp->st, j->slot);
                } else {
                    /* Quarantined while it was written: the record must not come back. */
                    start_clear(tp, j->slot);
                }
                if (e->doomed) {
                    doomed_finish(tp, j->entry);
                } else if (e->t1 == NULL && !e->in2 && e->pending == 0 && e->busy == 0) {
                    kvd_tstore_forget(&tp->st, j->entry);
                }
                break;
            }
            if (e->doomed) {
                doomed_finish(tp, j->entry);
            }
            break;
        }
        case J_UP: {
            e->busy--;
            fpos *p = &j->f->pos[j->pos];
            if (j->rc == KV_OK && e->doomed) {
                j->rc = KV_ECORRUPT; /* quarantined while it came up: not served */
            }
            if (j->rc == KV_OK) {
                p->ok = 1;
                t->c[j->src_tier == 1 ? TS_PROMOTE_T1 : TS_PROMOTE_T2]++;
                t->c[j->src_tier == 1 ? TS_COPY_BYTES_UP1 : TS_COPY_BYTES_UP2] += tp->block_bytes;
                t->c[j->src_tier == 1 ? TS_COPY_NS_UP1 : TS_COPY_NS_UP2] += j->ns;
            } else {
                j->f->failed++;
                j->f->code = j->rc == KV_ECORRUPT ? KV_ECORRUPT : j->rc;
                if (j->src_tier == 1 && j->rc == KV_ECORRUPT && !e->doomed && e->busy == 0 &&
                    e->t1 != NULL) {
                    /* Bytes that do not decode (a remote value that passed its header): gone. */
                    t->c[TS_REMOTE_BAD]++;
                    entry_drop(tp, j->entry, 1);
                    e = kvd_tstore_at(&tp->st, j->entry);
                }
                if (j->src_tier == 2 && j->rc == KV_ECORRUPT && !e->doomed) {
                    /* Only a failed check drops the record; ENOMEM or an I/O error does not
                     * say the bytes are bad. */
                    t->c[TS_CORRUPT_T2]++;
                    KV_LOG(WARN, "KVD-TIER2-CORRUPT",
                           "pool %u: tier-2 slot %llu failed its check: dropped, not served",
                           tp->pool_id, (unsigned long long)j->slot);
                    if (e->busy == 0 && e->in2) {
                        entry_drop(tp, j->entry, 2);
                    }
                }
            }
            if (e->used && e->doomed) {
                doomed_finish(tp, j->entry);
            }
            kvd_fetch *f = j->f;
            if (--f->pending == 0) {
                fetch_finish(f);
            }
            break;
        }
        case J_CLEAR2:
            if (j->rc != KV_OK) {
                t2_fail(t, tp, "tier-2 clear", 0);
            }
            kvd_tstore_slot2_back(&tp->st, j->slot);
            break;
        case J_PREFAULT:
            t->reserved1 -= (uint64_t)j->nruns * j->block_bytes;
            for (uint32_t k = 0; k < j->nruns; k++) {
                if (j->runs[k].p != NULL) {
                    buf_give(t, j->runs[k].p, j->block_bytes);
                }
            }
            break;
    }
    t->c[TS_PIN_FALLBACKS] += j->pin_fallbacks;
    t->c[TS_T2_ZERO_COPY] += j->zero_copy;
    t1_free(t, j->out);
    free(j->runs);
    free(j);
    if (tp->gone && tp->jobs == 0) {
        tier_pool_free(tp);
    }
    /* Last: a retried Allocate may evict and start copies down, which grow the entry store
     * (moving the entries this completion updated above) and pick among the blocks it
     * just made cached. */
    if (wake && t->waits != NULL) {
        room_wake(t, pool_id, KV_OK);
    }
}

/* ---- the pool's drop hook ------------------------------------------------------------------ */

static void on_drop(void *arg, kvd_pool *pool, kv_hash128 hash, kv_hash128 parent, int reason) {
    (void)pool;
    (void)parent;
    tier_pool *tp = arg;
    kvd_tiers *t = tp->t;
    uint32_t i = kvd_tstore_find(&tp->st, hash);
    if (reason == KVD_DROP_UNSHARE) {
        return; /* the copy below had these bytes under this hash: it stays valid */
    }
    if (reason == KVD_DROP_QUARANTINE && t->remote != NULL && !tp->no_remote) {
        /* Its bytes changed after commit: no node may be served them from Redis either. */
        (void)from_remote_take(tp, hash); /* a block committed again is written again */
        char key[256];
        remote_key(tp, hash, key, sizeof(key));
        if (kvd_remote_del(t->remote, key) == KV_OK) {
            const kvd_tentry *qe = i != KVD_TNONE ? kvd_tstore_at(&tp->st, i) : NULL;
            tier_event(tp, hash, NULL, qe != NULL && qe->has_tail ? qe->tail : NULL, 3, 0);
            if (t->ledger != NULL) {
                (void)kvd_rledger_remove(t->ledger, tp->pool_id, hash);
            }
        }
    }
    if (reason == KVD_DROP_QUARANTINE) {
        if (i == KVD_TNONE) {
            return;
        }
        kvd_tstore_at(&tp->st, i)->doomed = 1;
        doomed_finish(tp, i); /* or the last job's completion does */
        return;
    }
    if (i != KVD_TNONE && (kvd_tstore_in(&tp->st, i, 1) || kvd_tstore_in(&tp->st, i, 2))) {
        return; /* a demotion: the copy below stays findable */
    }
    if (t->cap[0] > 0 || tp->disk != NULL) {
        t->c[TS_DIRTY_DROPS]++;
    }
}

/* The value of hash in tp's pool is gone from Redis: BlockRemoved on REMOTE, out of the ledger,
 * and a block read from it is no longer taken for one Redis holds (from_remote): it is written
 * again on its way down. */
static void remote_gone(tier_pool *tp, kv_hash128 hash) {
    (void)from_remote_take(tp, hash);
    if (tp->t->ledger != NULL) {
        (void)kvd_rledger_remove(tp->t->ledger, tp->pool_id, hash);
    }
    uint32_t e = kvd_tstore_find(&tp->st, hash);
    kvd_tentry *te = e != KVD_TNONE ? kvd_tstore_at(&tp->st, e) : NULL;
    if (te != NULL) {
        te->inr = 0; /* write-back writes it again before T1 gives it up */
    }
    tier_event(tp, hash, NULL, te != NULL && te->has_tail ? te->tail : NULL, 3, 0);
}

/* remote-watch: Redis dropped key (expired, or evicted by its maxmemory policy). A key of one of
 * this node's pools (PREFIX:DOMAIN:LAYOUT:HASH, remote_key) is gone (remote_gone); other keys
 * are ignored. */
static void on_remote_dropped(void *arg, const char *key, size_t len, int evicted) {
    (void)evicted;
    kvd_tiers *t = arg;
    const char *prefix = t->cfg->remote_key_prefix;
    size_t pl = strlen(prefix);
    /* PREFIX ':' DOMAIN ':' 32 hex ':' 32 hex */
    if (len < pl + 1 + 1 + 1 + 32 + 1 + 32 || len >= 512 || memcmp(key, prefix, pl) != 0 ||
        key[pl] != ':' || key[len - 33] != ':' || key[len - 66] != ':') {
        return;
    }
    char lk[33], hh[33], dom[512];
    memcpy(lk, key + len - 65, 32);
    lk[32] = '\0';
    memcpy(hh, key + len - 32, 32);
    hh[32] = '\0';
    size_t dl = len - 66 - (pl + 1);
    memcpy(dom, key + pl + 1, dl);
    dom[dl] = '\0';
    kv_hash128 layout_key, hash;
    if (kv_hash_parse(lk, &layout_key) != KV_OK || kv_hash_parse(hh, &hash) != KV_OK) {
        return;
    }
    for (uint32_t i = 0; i < t->reg->npools; i++) {
        tier_pool *tp = t->reg->pools[i].tiers;
        if (tp == NULL || tp->gone || tp->no_remote || !kv_hash_eq(tp->layout_key, layout_key) ||
            strcmp(tp->domain, dom) != 0) {
            continue;
        }
        remote_gone(tp, hash);
        t->c[TS_RWATCH_REPORTED]++;
    }
}

/* ---- reconciliation after a gap in the watch (remote-watch-ledger) --------------------------
 *
 * Redis keeps no backlog of keyspace notifications, so drops while a subscription is being
 * made again go unheard. When every node is subscribed again, the loop thread walks the ledger
 * (the values this node announced on REMOTE) in batches of RC_BATCH, asks Redis whether each is
 * still there (kvd_remote_probe: one pipelined STRLEN per node, on the remote thread) and
 * announces BlockRemoved for each that is gone, unless the ledger entry was announced again
 * since it was asked about (its stamp moved). One batch is out at a time; a batch Redis does
 * not answer is asked again a second later; a gap that closes during a pass starts another
 * once it is done. Besides, a pass starts every remote-watch-reconcile-s while the watch is up
 * and none runs: drops that made no notification (a DEL or FLUSHALL by another client, a node
 * without Exe) are found that way. */

#define RC_BATCH 256
#define RC_KEY 256
#define RC_RETRY_MS 1000

typedef struct reconcile {
    kvd_tiers *t;
    int running;           /* a pass is on */
    int again;             /* another pass after it (a gap closed, the admin asked) */
    const char *again_why; /* why, for the log */
    int closed;            /* kvd_tiers_close ran: nothing more starts */
    size_t cursor;         /* the next ledger slot to look at */
    size_t at;             /* where the batch out began (asked again from there on failure) */
    int tries;             /* failed tries of the batch at `at` */
    int timer_on;          /* retry and period initialised (closed at close) */
    uint64_t start_ns;     /* the pass began */
    uint64_t asked, gone;
    uv_timer_t retry;
    uv_timer_t period; /* periodic passes (remote-watch-reconcile-s), when set */
    uint64_t period_ms;
    size_t n;
    kvd_rledger_ent ents[RC_BATCH];
    const char *keys[RC_BATCH];
    char kbuf[RC_BATCH][RC_KEY];
} reconcile;

static tier_pool *tier_pool_of(kvd_tiers *t, uint32_t pool_id) {
    kvd_reg_pool *p = kvd_registry_pool(t->reg, pool_id);
    tier_pool *tp = p != NULL ? p->tiers : NULL;
    return tp != NULL && !tp->gone && !tp->no_remote ? tp : NULL;
}

static void rc_next(reconcile *rc);

/* A pass from the ledger's first slot (why: what started it, for the log). */
static void rc_start(reconcile *rc, const char *why) {
    KV_LOG(INFO, "KVD-REMOTE-WATCH",
           "remote watch: %s: asking Redis about the %zu values this node announced on REMOTE", why,
           kvd_rledger_count(rc->t->ledger));
    rc->running = 1;
    rc->cursor = 0;
    rc->tries = 0;
    rc->asked = rc->gone = 0;
    rc->start_ns = now_ns();
    rc_next(rc);
}

/* The pass ended (done or given up): the next one starts now if one was asked for during it. */
static void rc_end(reconcile *rc) {
    rc->running = 0;
    rc->tries = 0;
    if (rc->again) {
        rc->again = 0;
        rc_start(rc, rc->again_why);
    }
}

/* A pass for why: started now, or (1 returned) after the one running. */
static int rc_ask(reconcile *rc, const char *why) {
    if (rc->running) {
        rc->again = 1;
        rc->again_why = why;
        return 1;
    }
    rc_start(rc, why);
    return 0;
}

static void rc_finish(reconcile *rc) {
    rc->t->c[TS_RWATCH_RECONCILES]++;
    KV_LOG(INFO, "KVD-REMOTE-WATCH",
           "remote watch: reconciled: %llu values asked about, %llu gone from Redis "
           "(BlockRemoved on REMOTE), %.1f ms",
           (unsigned long long)rc->asked, (unsigned long long)rc->gone,
           (double)(now_ns() - rc->start_ns) / 1e6);
    rc_end(rc);
}

/* The retry timer runs only while no batch is out (rc_failed starts it instead of a send). */
static void on_rc_retry(uv_timer_t *h) {
    reconcile *rc = h->data;
    if (!rc->closed && rc->running) {
        rc_next(rc);
    }
}

#define RC_TRIES 3

static void rc_failed(reconcile *rc, kv_err e) {
    rc->t->c[TS_RWATCH_RECONCILE_ERRORS]++;
    if (++rc->tries >= RC_TRIES) {
        /* Redis keeps failing (a node down: the watch loses it too, and the gap that makes
         * closes when it is back, which starts a pass again). */
        KV_LOG(WARN, "KVD-REMOTE-WATCH",
               "remote watch: reconciliation given up after %d failed tries of one batch (%s); "
               "%llu values asked about, %llu found gone; the next gap in the watch or "
               "periodic pass starts another",
               RC_TRIES, kv_strerror(e), (unsigned long long)rc->asked,
               (unsigned long long)rc->gone);
        rc_end(rc);
        return;
    }
    if (rc->t->c[TS_RWATCH_RECONCILE_ERRORS] == 1 ||
        (rc->t->c[TS_RWATCH_RECONCILE_ERRORS] & 63) == 0) {
        KV_LOG(WARN, "KVD-REMOTE-WATCH",
               "remote watch: reconciling: Redis did not answer (%s); asking again "
               "in %d ms",
               kv_strerror(e), RC_RETRY_MS);
    }
    rc->cursor = rc->at;
    uv_timer_start(&rc->retry, on_rc_retry, RC_RETRY_MS, 0);
}

static void on_rc_probe(void *arg, kv_err e, const uint8_t *present, size_t n) {
    reconcile *rc = arg;
    kvd_tiers *t = rc->t;
    if (e == KV_ECLOSED || rc->closed) {
        rc->running = 0;
        return;
    }
    if (e != KV_OK || n != rc->n) {
        rc_failed(rc, e != KV_OK ? e : KV_ESYS);
        return;
    }
    rc->tries = 0;
    for (size_t i = 0; i < n; i++) {
        rc->asked++;
        const kvd_rledger_ent *en = &rc->ents[i];
        if (present[i] || !kvd_rledger_remove_if(t->ledger, en->pool_id, en->hash, en->stamp)) {
            continue; /* there, or announced again since it was asked about */
        }
        tier_pool *tp = tier_pool_of(t, en->pool_id);
        if (tp != NULL) {
            remote_gone(tp, en->hash);
            rc->gone++;
            t->c[TS_RWATCH_RECONCILED]++;
        }
    }
    rc_next(rc);
}

/* Sends the next batch of the pass, or ends it. */
static void rc_next(reconcile *rc) {
    kvd_tiers *t = rc->t;
    size_t slots = kvd_rledger_slots(t->ledger);
    while (rc->cursor < slots) {
        rc->at = rc->cursor;
        size_t got = kvd_rledger_scan(t->ledger, &rc->cursor, rc->ents, RC_BATCH);
        size_t m = 0;
        for (size_t i = 0; i < got; i++) {
            tier_pool *tp = tier_pool_of(t, rc->ents[i].pool_id);
            if (tp == NULL) { /* its pool is gone (pool ids are never reused) */
                (void)kvd_rledger_remove(t->ledger, rc->ents[i].pool_id, rc->ents[i].hash);
                continue;
            }
            rc->ents[m] = rc->ents[i];
            remote_key(tp, rc->ents[m].hash, rc->kbuf[m], RC_KEY);
            rc->keys[m] = rc->kbuf[m];
            m++;
        }
        if (m == 0) {
            continue;
        }
        rc->n = m;
        kv_err e = kvd_remote_probe(t->remote, rc->keys, m, on_rc_probe, rc);
        if (e != KV_OK) {
            rc_failed(rc, e);
        }
        return;
    }
    rc_finish(rc);
}

/* Every node of the watch is subscribed (after a gap, or the first time: values announced
 * before the first subscription may have gone unheard too): reconcile. */
static void on_watch_up(void *arg) {
    kvd_tiers *t = arg;
    reconcile *rc = t->rc;
    if (rc == NULL || rc->closed || kvd_rledger_count(t->ledger) == 0) {
        return;
    }
    (void)rc_ask(rc,
                 rc->running ? "a gap closed during the last pass" : "subscribed on every node");
}

/* remote-watch-reconcile-s passed: a pass unless one runs or the watch is not up (its up
 * callback starts one when it is). */
static void on_rc_period(uv_timer_t *h) {
    reconcile *rc = h->data;
    kvd_tiers *t = rc->t;
    if (rc->closed || rc->running || !kvd_rwatch_up(t->rwatch) ||
        kvd_rledger_count(t->ledger) == 0) {
        return;
    }
    rc_start(rc, "periodic pass (remote-watch-reconcile-s)");
}

kv_err kvd_tiers_reconcile_now(kvd_tiers *t, int *queued, uint64_t *ledger, char *msg,
                               size_t msglen) {
    *queued = 0;
    *ledger = 0;
    if (t == NULL || t->rwatch == NULL) {
        snprintf(msg, msglen, "no remote watch (remote-redis with remote-watch true)");
        return KV_ESTATE;
    }
    reconcile *rc = t->rc;
    if (rc == NULL) {
        snprintf(msg, msglen, "no ledger to reconcile (remote-watch-ledger 0)");
        return KV_ESTATE;
    }
    if (rc->closed) {
        snprintf(msg, msglen, "kvd is stopping");
        return KV_ESTATE;
    }
    *ledger = kvd_rledger_count(t->ledger);
    if (!kvd_rwatch_up(t->rwatch)) {
        snprintf(msg, msglen,
                 "the remote watch is not subscribed on every node now (see remote_watch_nodes); "
                 "a pass starts by itself when it is");
        return KV_ESTATE;
    }
    *queued = rc_ask(rc, "asked by the admin (remote-watch reconcile)");
    return KV_OK;
}

/* The ledger and the reconciliation's state (before the watch starts: nothing to undo on the
 * loop when this fails). */
static kv_err reconcile_alloc(kvd_tiers *t, const kvd_config *cfg, char *msg, size_t msglen) {
    if (cfg->remote_watch_ledger == 0) {
        return KV_OK;
    }
    kv_err e = kvd_rledger_alloc(cfg->remote_watch_ledger, &t->ledger);
    reconcile *rc = e == KV_OK ? calloc(1, sizeof(*rc)) : NULL;
    if (rc == NULL) {
        kvd_rledger_free(t->ledger);
        t->ledger = NULL;
        snprintf(msg, msglen, "remote-watch-ledger %llu: out of memory",
                 (unsigned long long)cfg->remote_watch_ledger);
        return KV_ENOMEM;
    }
    rc->t = t;
    rc->period_ms = cfg->remote_watch_reconcile_s * 1000;
    t->rc = rc;
    return KV_OK;
}

/* The watch runs: its up callback starts passes. */
static void reconcile_start(kvd_tiers *t) {
    if (t->rc == NULL) {
        return;
    }
    uv_timer_init(t->loop, &t->rc->retry);
    uv_timer_init(t->loop, &t->rc->period);
    t->rc->retry.data = t->rc->period.data = t->rc;
    t->rc->timer_on = 1;
    if (t->rc->period_ms > 0) {
        uv_timer_start(&t->rc->period, on_rc_period, t->rc->period_ms, t->rc->period_ms);
    }
    kvd_rwatch_set_up_fn(t->rwatch, on_watch_up, t);
}

/* ---- the interface ------------------------------------------------------------------------- */

static void on_pool_gone(void *arg, kvd_reg_pool *p) {
    (void)arg;
    tier_pool *tp = p->tiers;
    if (tp == NULL) {
        return;
    }
    p->tiers = NULL;
    kvd_pool_set_drop_hook(p->pool, KVD_DROP_HOOK_TIERS, NULL, NULL);
    tp->gone = 1;
    room_wake(tp->t, tp->pool_id, KV_ENOENT);
    kvd_tiers *t = tp->t;
    t->used[0] -= tp->st.bytes[0];
    t->used[1] -= tp->st.bytes[1];
    if (tp->jobs == 0) {
        tier_pool_free(tp);
    }
}

/* An idle pool with no T0 block stays while its lower tiers hold blocks (their entries are its
 * cache) or copies are in flight. */
static int on_pool_keep(void *arg, const kvd_reg_pool *p) {
    (void)arg;
    const tier_pool *tp = p->tiers;
    return tp != NULL && (tp->st.n > 0 || tp->jobs > 0);
}

/* The remote tier: its seeds, the AUTH password from its file, its thread. */
static kv_err remote_open(kvd_tiers *t, const kvd_config *cfg, char *msg, size_t msglen) {
    if (cfg->tier1_memory == 0) {
        snprintf(msg, msglen,
                 "remote-redis needs tier1-memory: values go to Redis from tier 1 and come "
                 "back through it");
        return KV_EINVAL;
    }
    char pw[512] = "";
    if (cfg->remote_password_file[0] != '\0') {
        FILE *f = fopen(cfg->remote_password_file, "r");
        size_t n = f != NULL ? fread(pw, 1, sizeof(pw) - 1, f) : 0;
        int err = f == NULL ? errno : 0;
        if (f != NULL) {
            fclose(f);
        }
        if (f == NULL || n == 0) {
            snprintf(msg, msglen, "remote-password-file %s: %s", cfg->remote_password_file,
                     f == NULL ? strerror(err) : "empty");
            return KV_ESYS;
        }
        pw[n] = '\0';
        while (n > 0 &&
               (pw[n - 1] == '\n' || pw[n - 1] == '\r' || pw[n - 1] == ' ' || pw[n - 1] == '\t')) {
            pw[--n] = '\0';
        }
    }
    /* Queued puts keep their T1 entries busy: at most a quarter of tier 1 waits on Redis. */
    uint64_t qb = cfg->remote_queue_bytes < cfg->tier1_memory / 4 ? cfg->remote_queue_bytes
                                                                  : cfg->tier1_memory / 4;
    kvd_remote_cfg rc = {cfg->remote_redis, pw, cfg->remote_timeout_ms, cfg->remote_backoff_max_ms,
                         cfg->remote_ttl_s, qb};
    kv_err e = kvd_remote_alloc(t->loop, &rc, &t->remote, msg, msglen);
    if (e == KV_OK && cfg->remote_watch) {
        kvd_rwatch_cfg wc = {cfg->remote_redis, pw, cfg->remote_timeout_ms,
                             cfg->remote_backoff_max_ms, cfg->remote_watch_refresh_s * 1000};
        e = reconcile_alloc(t, cfg, msg, msglen);
        if (e == KV_OK) {
            e = kvd_rwatch_alloc(t->loop, &wc, on_remote_dropped, t, &t->rwatch, msg, msglen);
        }
        if (e == KV_OK) {
            reconcile_start(t);
        }
    }
    memset(pw, 0, sizeof(pw));
    if (e != KV_OK) {
        if (t->remote != NULL) {
            kvd_remote_close(t->remote); /* the thread never started: closes the handle */
            t->remote = NULL;            /* (its memory is left: a start that fails exits) */
        }
        return e;
    }
    KV_LOG(INFO, "KVD-REMOTE",
           "remote tier: redis %s, %s, key prefix %s, ttl %llu s, timeout %llu ms%s; uid-N "
           "tenants %s%s%s",
           cfg->remote_redis, cfg->remote_write, cfg->remote_key_prefix,
           (unsigned long long)cfg->remote_ttl_s, (unsigned long long)cfg->remote_timeout_ms,
           cfg->remote_password_file[0] != '\0' ? ", AUTH from the password file" : "",
           cfg->remote_uid_tenants, strcmp(cfg->remote_uid_tenants, "node") == 0 ? " as " : "",
           strcmp(cfg->remote_uid_tenants, "node") == 0 ? t->node_name : "");
    return KV_OK;
}

void kvd_tiers_close(kvd_tiers *t) {
    if (t != NULL) {
        room_wake(t, UINT32_MAX, KV_ECLOSED);
    }
    if (t != NULL && t->remote != NULL) {
        kvd_remote_close(t->remote); /* its last callbacks run here */
    }
    if (t != NULL) {
        kvd_rwatch_close(t->rwatch);
    }
    if (t != NULL && t->rc != NULL && !t->rc->closed) {
        t->rc->closed = 1;
        if (t->rc->timer_on) {
            uv_close((uv_handle_t *)&t->rc->retry, NULL);
            uv_close((uv_handle_t *)&t->rc->period, NULL);
        }
    }
}

uint32_t kvd_tiers_leased(const kvd_tiers *t, const kvd_reg_pool *p) {
    return t != NULL && p->tiers != NULL ? ((const tier_pool *)p->tiers)->leased : 0;
}

int kvd_tiers_room_waited(const kvd_tiers *t, const kvd_reg_pool *p) {
    for (const room_wait *w = t != NULL ? t->waits : NULL; w != NULL; w = w->next) {
        if (w->pool_id == p->pool_id) {
            return 1;
        }
    }
    return 0;
}

kv_err kvd_tiers_wait_room(kvd_tiers *t, const kvd_reg_pool *p, kvd_tiers_room_fn fn, void *arg) {
    if (kvd_tiers_leased(t, p) == 0) {
        return KV_ENOENT; /* nothing would wake it */
    }
    room_wait *w = calloc(1, sizeof(*w));
    if (w == NULL) {
        return KV_ENOMEM;
    }
    w->pool_id = p->pool_id;
    w->fn = fn;
    w->arg = arg;
    t->c[TS_ALLOC_WAITS]++;
    room_wait **pp = &t->waits;
    while (*pp != NULL) {
        pp = &(*pp)->next;
    }
    *pp = w;
    return KV_OK;
}

/* node-name, else the host name with every character outside [A-Za-z0-9._-] made '_' (a key's
 * parts are ':'-separated), else "node". */
static void node_name_init(kvd_tiers *t) {
    if (t->cfg->node_name[0] != '\0') {
        snprintf(t->node_name, sizeof(t->node_name), "%s", t->cfg->node_name);
        return;
    }
    char h[256] = "";
    if (gethostname(h, sizeof(h) - 1) != 0 || h[0] == '\0') {
        snprintf(h, sizeof(h), "node");
    }
    h[sizeof(t->node_name) - 1] = '\0';
    for (char *c = h; *c != '\0'; c++) {
        if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
              *c == '.' || *c == '_' || *c == '-')) {
            *c = '_';
        }
    }
    memcpy(t->node_name, h, sizeof(t->node_name)); /* h is NUL-ended within that size */
}

kv_err kvd_tiers_alloc(uv_loop_t *loop, kvd_registry *reg, const kvd_config *cfg, kvd_tiers **out,
                       char *msg, size_t msglen) {
    kvd_tiers *t = calloc(1, sizeof(*t));
    if (t == NULL) {
        return KV_ENOMEM;
    }
    t->loop = loop;
    t->reg = reg;
    t->cfg = cfg;
    node_name_init(t);
    t->cap[0] = cfg->tier1_memory;
    t->cap[1] = cfg->tier2_path[0] != '\0' ? cfg->tier2_bytes : 0;
    t->seq = 1;
    t->pinned = kvd_pinned_new();
    if (t->pinned == NULL) {
        free(t);
        return KV_ENOMEM;
    }
    if (kvd_tier_format_parse(cfg->tier_format, &t->format) != KV_OK) {
        t->format = KVD_TF_RAW;
    }
    t->write_through = strcmp(cfg->tier_write, "write-through") == 0;
    t->remote_back = strcmp(cfg->remote_write, "write-back") == 0;
    t->any_remote_back = t->remote_back;
    char thp[32];
    kv_shmem_thp_mode(thp, sizeof(thp));
    /* Zero-copy pins T0's pages for each transfer: one a 2 MiB page, or 512 small ones, which on
     * a VM that shadows page tables cost more than copying the block into a huge-page buffer
     * (bench `disk`, process 3: copying 1.7-1.9x the zero-copy rate from 4 KiB pages). */
    int t0_huge = cfg->hugepages || kv_shmem_thp_huge(thp);
    t->zero_copy = strcmp(cfg->tier2_zero_copy, "on") == 0 ||
                   (strcmp(cfg->tier2_zero_copy, "auto") == 0 && t0_huge);
    if (t->cap[1] > 0 && mkdir(cfg->tier2_path, 0700) != 0 && errno != EEXIST) {
        if (msg != NULL) {
            snprintf(msg, msglen, "tier2-path %s: %s", cfg->tier2_path, strerror(errno));
        }
        kvd_pinned_destroy(t->pinned);
        free(t);
        return KV_ESYS;
    }
    if (cfg->remote_redis[0] != '\0') {
        kv_err rrc = remote_open(t, cfg, msg, msglen);
        if (rrc != KV_OK) {
            kvd_pinned_destroy(t->pinned);
            free(t);
            return rrc;
        }
    }
    reg->pool_gone = on_pool_gone;
    reg->pool_keep = on_pool_keep;
    reg->pool_gone_arg = t;
    if (kvd_tiers_on(t)) {
        KV_LOG(INFO, "KVD-TIERS",
               "tiers: T1 %llu bytes, T2 %s (%llu bytes), format %s, %s, clean-ahead %llu, "
               "fetch-min-tokens %llu, host pools' T2 zero-copy %s (tier2-zero-copy %s, shmem "
               "THP %s)",
               (unsigned long long)t->cap[0], t->cap[1] > 0 ? cfg->tier2_path : "off",
               (unsigned long long)t->cap[1], kvd_tier_format_name(t->format), cfg->tier_write,
               (unsigned long long)cfg->tier_clean_ahead, (unsigned long long)cfg->fetch_min_tokens,
               t->zero_copy ? "on" : "off", cfg->tier2_zero_copy, thp);
    }
    *out = t;
    return KV_OK;
}

void kvd_tiers_free(kvd_tiers *t) {
    if (t == NULL) {
        return;
    }
    KV_ASSERT(t->jobs == 0);
    while (buf_shed(t)) {
    }
    for (int k = 0; k < NBUFCLASS; k++) {
        free(t->bc[k].v);
    }
    while (t->fetches != NULL) {
        kvd_fetch *f = t->fetches;
        t->fetches = f->next;
        free(f->pos);
        free(f->waiters);
        free(f);
    }
    kvd_remote_free(t->remote);
    kvd_rwatch_free(t->rwatch);
    free(t->rc);
    if (t->drain != NULL) {
        KV_ASSERT(t->drain->finished); /* (and its timer's close callback ran: the loop ended) */
        free(t->drain->items);
        free(t->drain);
    }
    kvd_rledger_free(t->ledger);
    kvd_pinned_destroy(t->pinned);
    free(t);
}

int kvd_tiers_on(const kvd_tiers *t) {
    return t != NULL && (t->cap[0] > 0 || t->cap[1] > 0);
}

int kvd_tiers_remote_any(const kvd_tiers *t) {
    return t != NULL && t->remote != NULL && t->cfg->remote_fetch_max > 0;
}

uint32_t kvd_tiers_inflight(const kvd_tiers *t) {
    return t != NULL ? t->jobs : 0;
}

/* A file name part from s: [A-Za-z0-9._-] kept, anything else as %XX. */
static void name_part(const char *s, char *out, size_t len) {
    size_t k = 0;
    for (; *s != '\0' && k + 4 < len; s++) {
        unsigned char ch = (unsigned char)*s;
        if ((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
            ch == '.' || ch == '_' || ch == '-') {
            if (!(k == 0 && ch == '.')) {
                out[k++] = (char)ch;
                continue;
            }
        }
        k += (size_t)snprintf(out + k, len - k, "%%%02X", ch);
    }
    out[k] = '\0';
}

typedef struct scan_ctx {
    tier_pool *tp;
    uint64_t found, dup;
} scan_ctx;

static void on_scan(void *arg, uint64_t slot, const kvd_disk_rec *rec) {
    scan_ctx *sc = arg;
    tier_pool *tp = sc->tp;
    uint32_t i;
    if (kvd_tstore_get(&tp->st, rec->hash, rec->parent, &i) != KV_OK) {
        return;
    }
    kvd_tentry *e = kvd_tstore_at(&tp->st, i);
    if (e->in2) {
        /* The same block twice (a rewrite after a crash): the newest record wins. */
        sc->dup++;
        if (e->seq >= rec->seq) {
            kvd_tstore_slot2_back(&tp->st, slot);
            return;
        }
        entry_drop(tp, i, 2);
        if (kvd_tstore_get(&tp->st, rec->hash, rec->parent, &i) != KV_OK) {
            return;
        }
    }
    kvd_tentry *ne = kvd_tstore_at(&tp->st, i);
    if (rec->has_tail && !ne->has_tail) {
        memcpy(ne->tail, rec->tail, sizeof(ne->tail)); /* before set2 tells the events */
        ne->has_tail = 1;
    }
    kvd_tstore_set2(&tp->st, i, slot, rec->len, (uint8_t)rec->format, rec->seq, tp->slot_bytes);
    tp->t->used[1] += tp->slot_bytes;
    if (rec->seq >= tp->t->seq) {
        tp->t->seq = rec->seq + 1;
    }
    sc->found++;
}

/* Where pool p's T2 file is: `<tier2-path>/<domain part>` and `<model part>-<shape>.t2`. File
 * names stay under NAME_MAX: a long model id or domain is cut and keeps a hash of the whole (the
 * file's header holds the whole key and is checked at open). */
static void t2_location(const kvd_tiers *t, const kvd_reg_pool *p, const char *domain, char *dir,
                        size_t dirlen, char *name, size_t namelen) {
    char dpart[2 * KVD_DISK_KEY_MAX], mpart[2 * KVD_DISK_KEY_MAX];
    name_part(domain, dpart, 100);
    if (strlen(dpart) >= 95) {
        snprintf(dpart + 80, sizeof(dpart) - 80, "-%016llx",
                 (unsigned long long)XXH64(domain, strlen(domain), 0));
    }
    name_part(p->model_id, mpart, 120);
    if (strlen(mpart) >= 115) {
        snprintf(mpart + 100, sizeof(mpart) - 100, "-%016llx",
                 (unsigned long long)XXH64(p->model_id, strlen(p->model_id), 0));
    }
    snprintf(dir, dirlen, "%s/%s", t->cfg->tier2_path, dpart);
    /* Every flag of the pool's key in the name: pools that differ only by one are other pools,
     * and two pools on one file would each hand out its slots (each overwriting the other's). */
    snprintf(name, namelen, "%s-%ux%ux%ux%u-%s-%s%s.t2%s", mpart, p->layout.num_layers,
             p->layout.num_kv_heads, p->layout.head_dim, p->layout.tokens_per_block,
             kv_dtype_name(p->layout.dtype), kv_arrangement_name(p->layout.arrangement),
             (p->flags & KVD_POOL_SUMMARIES) ? "-summaries" : "",
             (p->flags & KVD_POOL_LOSSY_TIERS) ? ".lossy" : "");
}

static kv_err attach(kvd_tiers *t, kvd_reg_pool *p, const char *domain, int with_t2);

/* Raw T1: a pool's first copies would each fault in a fresh block buffer (and hold up the loop
 * thread's own allocations meanwhile), so a job makes some ahead: up to 64 MiB or an eighth of
 * the budget, within what the budget has free; they wait, touched, among the recycled buffers
 * (shed first when the budget is needed). */
static void prefault(tier_pool *tp) {
    kvd_tiers *t = tp->t;
    if (t->cap[0] == 0 || tp->format != KVD_TF_RAW || tp->block_bytes == 0) {
        return;
    }
    uint64_t want = t->cap[0] / 8 < (64ull << 20) ? t->cap[0] / 8 : (64ull << 20);
    uint64_t used = t->used[0] + t->reserved1 + t->cached1;
    uint64_t room = used < t->cap[0] ? t->cap[0] - used : 0;
    want = want < room ? want : room;
    uint64_t n = want / tp->block_bytes;
    if (n == 0) {
        return;
    }
    n = n > 1024 ? 1024 : n;
    job *j = job_new(tp, J_PREFAULT);
    run *bufs = calloc(n, sizeof(*bufs));
    if (j == NULL || bufs == NULL) {
        free(j);
        free(bufs);
        return;
    }
    j->runs = bufs; /* freed with the job; the buffers go to the recycled ones */
    j->nruns = (uint32_t)n;
    t->reserved1 += n * tp->block_bytes;
    if (job_start(j) != KV_OK) {
        t->reserved1 -= n * tp->block_bytes;
        free(bufs);
        free(j);
    }
}

kv_err kvd_tiers_attach(kvd_tiers *t, kvd_reg_pool *p, const char *domain) {
    return attach(t, p, domain, 1);
}

static void on_tier_change(void *arg, const kvd_tentry *e, int tier, int present) {
    tier_pool *tp = arg;
    int has_parent = e->parent.lo != 0 || e->parent.hi != 0;
    tier_event(tp, e->hash, has_parent ? &e->parent : NULL, e->has_tail ? e->tail : NULL, tier,
               present);
}

void kvd_tiers_set_event_hook(kvd_tiers *t, kvd_tiers_event_fn fn, void *arg) {
    if (t != NULL) {
        t->ev_fn = fn;
        t->ev_arg = arg;
    }
}

void kvd_tiers_set_digest_fn(kvd_tiers *t, kvd_tiers_digest_fn fn, void *arg) {
    if (t != NULL) {
        t->dg_fn = fn;
        t->dg_arg = arg;
    }
}

static kv_err attach(kvd_tiers *t, kvd_reg_pool *p, const char *domain, int with_t2) {
    if (!kvd_tiers_on(t) || p->tiers != NULL) {
        return KV_OK;
    }
    const kvd_backend_ops *be = t->reg->be;
    int dev = be->segment_read != NULL; /* T0 is device memory no host load may touch */
    if (dev && (be->copy_to_host == NULL || be->copy_to_device == NULL || be->copy_sync == NULL)) {
        static int logged;
        if (!logged) {
            logged = 1;
            KV_LOG(WARN, "KVD-TIERS-GPU",
                   "backend %s cannot copy blocks to host memory: pools stay single-tier",
                   be->name);
        }
        return KV_OK;
    }
    tier_pool *tp = calloc(1, sizeof(*tp));
    if (tp == NULL) {
        return KV_ENOMEM;
    }
    tp->t = t;
    if (dev) {
        tp->dev = be;
        tp->dev_ctx = t->reg->be_ctx;
    }
    tp->pool_id = p->pool_id;
    tp->block_bytes = p->layout.block_bytes;
    tp->layout = p->layout;
    tp->format = t->format;
    tp->write_through = tp->min_hits = tp->clean_ahead = tp->remote_back = -1;
    /* The tenants file's `tiers` line for this model and domain, if any: as if an operator had
     * said `tiers pool=ID ...` at once (kept each time the pool is made again). */
    const kvd_tiers_line *rule = kvd_tenants_tiers_rule(t->reg->tenants, p->model_id, p->domain);
    if (rule != NULL) {
        tp->write_through = rule->write_through;
        tp->min_hits = rule->min_hits;
        tp->clean_ahead = rule->clean_ahead;
        tp->remote_back = rule->remote_back;
        t->any_remote_back |= rule->remote_back == 1;
        KV_LOG(INFO, "KVD-TIERS-RULE", "pool %u (model %s, domain %s): tiers line %u applies",
               p->pool_id, p->model_id, domain, rule->lineno);
    }
    /* A peer without a tenants-file line is tenant uid-N, named by a number that means a person
     * only on its own machine: remote-uid-tenants says whether the nodes sharing the Redis agree
     * on it (shared), or each node's uid-N is its own (node: the key carries node-name), or such
     * tenants stay off the remote tier (off). */
    int uid_tenant = strncmp(domain, "uid-", 4) == 0;
    if (uid_tenant && strcmp(t->cfg->remote_uid_tenants, "node") == 0) {
        snprintf(tp->domain, sizeof(tp->domain), "%s@%s", domain, t->node_name);
    } else {
        snprintf(tp->domain, sizeof(tp->domain), "%s", domain);
    }
    tp->no_remote = uid_tenant && strcmp(t->cfg->remote_uid_tenants, "off") == 0;
    {
        /* The remote tier's layout key: model, shape and flags (not the hash seed, which
         * hash-mode vllm makes the same for every model). */
        uint8_t kb[KV_WIRE_MAX_MODEL_ID + 32];
        size_t kn = strlen(p->model_id);
        memcpy(kb, p->model_id, kn);
        uint32_t f[7] = {p->layout.num_layers,
                         p->layout.num_kv_heads,
                         p->layout.head_dim,
                         p->layout.tokens_per_block,
                         (uint32_t)p->layout.dtype,
                         (uint32_t)p->layout.arrangement,
                         p->flags};
        for (int i = 0; i < 7; i++) {
            for (int b = 0; b < 4; b++) {
                kb[kn++] = (uint8_t)(f[i] >> (8 * b));
            }
        }
        XXH128_hash_t lk = XXH3_128bits(kb, kn);
        tp->layout_key = (kv_hash128){lk.low64, lk.high64};
    }
    kvd_tier_format lossy;
    size_t qb = 0;
    if ((p->flags & KVD_POOL_LOSSY_TIERS) &&
        kvd_tier_format_parse(t->cfg->tier_lossy_format, &lossy) == KV_OK &&
        (qb = kvd_codec_quantized_bytes(lossy, &p->layout)) > 0 && qb <= p->layout.block_bytes) {
        /* (A tiny block's scales can outweigh its elements: such a pool stays lossless, so a
         * stored block never needs more room than the block itself.) */
        tp->format = lossy; /* the pool's layout asked: every client of it accepts this */
    }
    kvd_tstore_init(&tp->st);
    tp->domain_id = p->domain;
    tp->st.on_tier = on_tier_change;
    tp->st.on_tier_arg = tp;
    tp->st.free1 = store_free1;
    tp->st.free1_arg = t;
    /* A GPU pool's raw T1 blocks live in page-locked memory: the driver's copies into and out
     * of them are DMA at the link's rate, asynchronous on each copy thread's stream. */
    tp->pin = tp->dev != NULL && tp->dev->host_alloc != NULL && tp->dev->host_free != NULL &&
              tp->format == KVD_TF_RAW;
    if (t->cap[1] > 0 && with_t2) {
        char dir[KVD_CONFIG_PATH_MAX + 600], name[700], msg[512];
        t2_location(t, p, domain, dir, sizeof(dir), name, sizeof(name));
        kvd_disk_key key;
        memset(&key, 0, sizeof(key));
        snprintf(key.model, sizeof(key.model), "%s", p->model_id);
        snprintf(key.domain, sizeof(key.domain), "%s", domain);
        key.layout = p->layout;
        key.seed = p->seed;
        kv_err rc = kvd_disk_open(dir, name, &key, t->cfg->tier2_direct ? KVD_DISK_DIRECT : 0u,
                                  &tp->disk, msg, sizeof(msg));
        if (rc != KV_OK) {
            tp->disk = NULL;
            snprintf(t->t2_error, sizeof(t->t2_error), "pool %u: %s", p->pool_id, msg);
            KV_LOG(WARN, "KVD-TIER2-OPEN", "pool %u: no tier 2: %s", p->pool_id, msg);
        } else {
            tp->slot_bytes = kvd_disk_slot_bytes(tp->disk);
            /* The file grows ahead of its writes, as far as tier2-bytes allows one pool, by
             * steps of 64 MiB or 1/32 of tier2-bytes, whichever is less: what a pool's file
             * holds past its slots in use, beyond the budget. */
            uint64_t pmax =
                t->cap[1] > UINT64_MAX - KVD_DISK_ALIGN ? UINT64_MAX : KVD_DISK_ALIGN + t->cap[1];
            uint64_t pstep = t->cap[1] / 32 < (64ull << 20) ? t->cap[1] / 32 : (64ull << 20);
            kvd_disk_preallocate(tp->disk, pmax, pstep);
            scan_ctx sc = {tp, 0, 0};
            uint64_t bad = 0;
            uint64_t t0 = now_ns();
            rc = kvd_disk_scan(tp->disk, on_scan, &sc, &bad);
            if (rc != KV_OK) {
                KV_LOG(WARN, "KVD-TIER2-SCAN", "pool %u: scan of %s/%s failed: %s", p->pool_id, dir,
                       name, kv_strerror(rc));
            }
            if (sc.found > 0 || bad > 0) {
                KV_LOG(INFO, "KVD-TIER2-SCAN",
                       "pool %u: %llu blocks back from tier 2 (%s/%s; %llu bad records skipped, "
                       "%llu duplicates) in %.1f ms%s",
                       p->pool_id, (unsigned long long)sc.found, dir, name, (unsigned long long)bad,
                       (unsigned long long)sc.dup, (double)(now_ns() - t0) / 1e6,
                       kvd_disk_direct(tp->disk) ? ", O_DIRECT" : "");
            }
            /* Slots of the file that hold no record (empty, bad, an older duplicate already
             * given back) are reused before the file grows. */
            uint64_t nslots = kvd_disk_slots(tp->disk);
            uint8_t *taken = nslots > 0 ? calloc((size_t)(nslots + 7) / 8, 1) : NULL;
            if (taken != NULL) {
                for (uint32_t i = 0; i < tp->st.cap; i++) {
                    const kvd_tentry *e = &tp->st.e[i];
                    if (e->used && e->in2 && e->slot2 < nslots) {
                        taken[e->slot2 / 8] |= (uint8_t)(1u << (e->slot2 % 8));
                    }
                }
                for (uint64_t k = 0; k < tp->st.nfree2; k++) {
                    uint64_t sl = tp->st.free2[k];
                    if (sl < nslots) {
                        taken[sl / 8] |= (uint8_t)(1u << (sl % 8)); /* on the list already */
                    }
                }
                /* Highest first: the list gives the last one back first, so the lowest
                 * slots (bad records, then the file's preallocated tail) fill first. */
                for (uint64_t sl = nslots; sl-- > 0;) {
                    if (!(taken[sl / 8] & (1u << (sl % 8)))) {
                        kvd_tstore_slot2_back(&tp->st, sl);
                    }
                }
                free(taken);
            }
            /* Over the budget after a restart with a smaller tier2-bytes: the oldest go. */
            (void)make_room(tp, 2, 0, UINT32_MAX);
        }
    }
    p->tiers = tp;
    kvd_pool_set_drop_hook(p->pool, KVD_DROP_HOOK_TIERS, on_drop, tp);
    prefault(tp);
    return KV_OK;
}

/* The chain hash of block bi's parent, recorded with its lower-tier copy (zero for a first
 * block or a parent no longer committed). */
static kv_hash128 parent_hash(const kvd_pool *pool, const kvd_block_info *bi) {
    kvd_block_info pi;
    if (bi->parent != KVD_NO_BLOCK && kvd_pool_block_info(pool, bi->parent, &pi) == KV_OK &&
        (pi.state == KVD_BLOCK_COMMITTED || pi.state == KVD_BLOCK_CACHED)) {
        return pi.hash;
    }
    return (kv_hash128){0, 0};
}

void kvd_tiers_committed(kvd_tiers *t, kvd_reg_pool *p, kvd_block_ref blk, const uint8_t *full) {
    tier_pool *tp = p->tiers;
    if (tp == NULL || !(tp->write_through >= 0 ? tp->write_through : t->write_through)) {
        return;
    }
    kvd_block_info bi;
    if (kvd_pool_block_info(p->pool, blk.id, &bi) != KV_OK || bi.gen != blk.gen) {
        return;
    }
    start_down(tp, p->pool, blk, bi.hash, parent_hash(p->pool, &bi), 0,
               full != NULL ? full + 16 : NULL, bi.tenant);
}

void kvd_tiers_pressure(kvd_tiers *t, kvd_reg_pool *p) {
    tier_pool *tp = p->tiers;
    if (tp == NULL || (tp->write_through >= 0 ? tp->write_through : t->write_through)) {
        return;
    }
    uint64_t ahead = tp->clean_ahead >= 0 ? (uint64_t)tp->clean_ahead : t->cfg->tier_clean_ahead;
    kvd_pool_counts pc = kvd_pool_counts_get(p->pool);
    if (pc.free >= ahead || pc.evictable == 0) {
        return;
    }
    /* At most half of what is evictable is leased at once, so a copy ahead never makes an
     * Allocate that could have evicted fail. */
    uint64_t want = ahead < pc.evictable / 2 ? ahead : pc.evictable / 2;
    if (want <= tp->cleaning) {
        return;
    }
    size_t look = (size_t)(want - tp->cleaning) * 2 + 8;
    if (look > 1024) {
        look = 1024;
    }
    kvd_block_ref refs[1024];
    size_t n = 0;
    if (kvd_pool_evict(p->pool, look, -1, KVD_EVICT_CAPACITY, 1, refs, &n) != KV_OK) {
        return;
    }
    for (size_t k = 0; k < n && tp->cleaning < want; k++) {
        kvd_block_info bi;
        if (kvd_pool_block_info(p->pool, refs[k].id, &bi) != KV_OK) {
            continue;
        }
        if (bi.hits < (tp->min_hits >= 0 ? (uint64_t)tp->min_hits : t->cfg->tier_min_hits)) {
            continue; /* selective: not reused often enough to be worth a copy */
        }
        uint32_t i = kvd_tstore_find(&tp->st, bi.hash);
        if (i != KVD_TNONE) {
            continue; /* down already, or on its way */
        }
        start_down(tp, p->pool, refs[k], bi.hash, parent_hash(p->pool, &bi), 1, NULL, bi.tenant);
    }
}

/* Whether block h can be part of a fetch's run: in T1 or T2 (*tier: 1 or 2), or in T0 (0). */
static int fetchable(tier_pool *tp, kvd_reg_pool *p, kv_hash128 h, int *tier) {
    uint32_t i = kvd_tstore_find(&tp->st, h);
    int ok = i != KVD_TNONE && !kvd_tstore_at(&tp->st, i)->doomed;
    int in1 = ok && kvd_tstore_in(&tp->st, i, 1);
    int in2 = ok && kvd_tstore_in(&tp->st, i, 2);
    if (tier != NULL) {
        *tier = in1 ? 1 : in2 ? 2 : 0;
    }
    return in1 || in2 || kvd_pool_has(p->pool, h);
}

static void probe(kvd_tiers *t, kvd_reg_pool *p, const kv_hash128 *hashes, size_t n,
                  kvd_tier_run *out, int count) {
    memset(out, 0, sizeof(*out));
    tier_pool *tp = p->tiers;
    if (tp == NULL) {
        return;
    }
    for (size_t k = 0; k < n; k++) {
        int tier = 0;
        if (!fetchable(tp, p, hashes[k], &tier)) {
            break;
        }
        out->t1 += tier == 1;
        out->t2 += tier == 2;
        out->fetchable++;
    }
    if (count) {
        t->c[TS_HITS_T1] += out->t1;
        t->c[TS_HITS_T2] += out->t2;
    }
}

void kvd_tiers_probe(kvd_tiers *t, kvd_reg_pool *p, const kv_hash128 *hashes, size_t n,
                     kvd_tier_run *out) {
    probe(t, p, hashes, n, out, 1);
}

void kvd_tiers_probe_quiet(kvd_tiers *t, kvd_reg_pool *p, const kv_hash128 *hashes, size_t n,
                           kvd_tier_run *out) {
    probe(t, p, hashes, n, out, 0);
}

/* The fetch in flight bringing hash h up, and which of its positions, or NULL. */
static kvd_fetch *inflight_up(kvd_tiers *t, const tier_pool *tp, kv_hash128 h, uint32_t *pos) {
    for (kvd_fetch *f = t->fetches; f != NULL; f = f->next) {
        if (f->tp != tp || f->pending == 0) {
            continue;
        }
        for (uint32_t k = 0; k < f->n; k++) {
            if (f->pos[k].kind == P_UP && f->pos[k].hash.lo == h.lo && f->pos[k].hash.hi == h.hi) {
                *pos = k;
                return f;
            }
        }
    }
    return NULL;
}

static kv_err add_waiter(kvd_fetch *f, kvd_fetch *w) {
    for (uint32_t k = 0; k < f->nwaiters; k++) {
        if (f->waiters[k] == w) {
            return KV_EEXIST;
        }
    }
    if (f->nwaiters == f->waiters_cap) {
        uint32_t nc = f->waiters_cap == 0 ? 4 : f->waiters_cap * 2;
        kvd_fetch **nw = realloc(f->waiters, sizeof(*nw) * nc);
        if (nw == NULL) {
            return KV_ENOMEM;
        }
        f->waiters = nw;
        f->waiters_cap = nc;
    }
    f->waiters[f->nwaiters++] = w;
    return KV_OK;
}

static void fetch_unlink(kvd_fetch *f) {
    for (kvd_fetch **pp = &f->t->fetches; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == f) {
            *pp = f->next;
            return;
        }
    }
}

/* Every copy of f landed (or failed) and every fetch it waited for finished: commit what came
 * up, hand the run to the caller, release the rest, then wake f's waiters. */
static void fetch_finish(kvd_fetch *f) {
    kvd_tiers *t = f->t;
    tier_pool *tp = f->tp;
    kvd_pool *pool = pool_of(tp);
    kvd_block_ref *run = calloc(f->n > 0 ? f->n : 1, sizeof(*run));
    uint32_t nok = 0, promoted = 0, shared = 0;
    int chain = run != NULL;
    uint32_t parent = f->parent_id;
    for (uint32_t k = 0; k < f->n && pool != NULL; k++) {
        fpos *p = &f->pos[k];
        if (p->kind == P_UP) {
            if (p->ok) {
                kvd_block_ref canon;
                kv_err rc =
                    kvd_pool_commit(pool, KVD_TIERS_SESSION, p->ref, p->hash, parent, &canon);
                if (rc == KV_OK) {
                    int fresh = canon.id == p->ref.id; /* not a duplicate of a block in T0 */
                    p->ref = canon;
                    p->have = 1;
                    kvd_reg_pool *rp = kvd_registry_pool(t->reg, tp->pool_id);
                    if (fresh && t->cfg->verify_blocks && rp != NULL) {
                        kvd_registry_verify_commit(t->reg, rp, canon);
                    }
                    uint32_t i = kvd_tstore_find(&tp->st, p->hash);
                    if (fresh && rp != NULL && (rp->flags & KVD_POOL_SUMMARIES)) {
                        /* The summary that went down with it; computed again from the bytes
                         * only for a record a restart found (its entry has none). */
                        const float *sum = i != KVD_TNONE && !(rp->flags & KVD_POOL_LOSSY_TIERS)
                                               ? kvd_tstore_at(&tp->st, i)->summ
                                               : NULL; /* lossy: of the bytes that came up */
                        (void)kvd_summaries_set(&rp->summ, t->reg->be, t->reg->be_ctx, pool, canon,
                                                sum);
                    }
                    if (i != KVD_TNONE) {
                        kvd_tstore_touch(&tp->st, i);
                        if (t->cfg->remote_ttl_s != 0) {
                            /* It stays longer now: its value may expire before T1 gives it
                             * up, so write-back writes it again then (refreshing the TTL). */
                            kvd_tstore_at(&tp->st, i)->inr = 0;
                        }
                    }
                    if (fresh) {
                        /* In T0 again: routers hear of it on T0's medium, with its parent when
                         * T0 holds that (the chain's previous block, or the client's parent
                         * block, whose hash the tier recorded). */
                        const kv_hash128 *ph = NULL;
                        if (parent != KVD_NO_BLOCK && k > 0) {
                            ph = &f->pos[k - 1].hash;
                        } else if (parent != KVD_NO_BLOCK && i != KVD_TNONE) {
                            const kvd_tentry *te = kvd_tstore_at(&tp->st, i);
                            ph = te->parent.lo != 0 || te->parent.hi != 0 ? &te->parent : NULL;
                        }
                        const kvd_tentry *te = i != KVD_TNONE ? kvd_tstore_at(&tp->st, i) : NULL;
                        const uint8_t *tail = te != NULL && te->has_tail ? te->tail
                                              : p->has_tail              ? p->tail
                                                                         : NULL;
                        tier_event(tp, p->hash, ph, tail, 0, 1);
                    }
                } else {
                    (void)kvd_pool_release(pool, KVD_TIERS_SESSION, f->tenant, &p->ref, 1);
                    p->have = 0;
                }
            } else {
                (void)kvd_pool_release(pool, KVD_TIERS_SESSION, f->tenant, &p->ref, 1);
                p->have = 0;
            }
        } else if (p->kind == P_WAIT) {
            p->have = kvd_pool_hold_hash(pool, f->tenant, p->hash, &p->ref) == KV_OK;
        }
        if (!p->have) {
            chain = 0;
            parent = KVD_NO_BLOCK; /* the next block's parent is not in T0 */
            continue;
        }
        parent = p->ref.id;
        if (chain) {
            run[nok++] = p->ref;
            promoted += p->kind == P_UP;
            shared += p->kind == P_WAIT;
            p->have = 0; /* the run owns it now */
        }
    }
    t->c[TS_FETCH_SHARED] += shared;
    kvd_fetch_result r = {tp->pool_id, f->session,  run,       pool != NULL ? nok : 0,
                          promoted,    shared,      f->failed, f->code,
                          f->orphan,   f->detached, 0};
    int taken = f->done(f->arg, &r);
    if (pool != NULL) {
        if (!taken && nok > 0) {
            (void)kvd_pool_release(pool, KVD_TIERS_SESSION, f->tenant, run, nok);
        }
        /* Blocks past a break in the run: cached for whoever comes next. */
        for (uint32_t k = 0; k < f->n; k++) {
            if (f->pos[k].have) {
                (void)kvd_pool_release(pool, KVD_TIERS_SESSION, f->tenant, &f->pos[k].ref, 1);
            }
        }
    }
    free(run);
    fetch_unlink(f);
    tp->jobs--;
    for (uint32_t k = 0; k < f->nwaiters; k++) {
        kvd_fetch *w = f->waiters[k];
        if (--w->pending == 0) {
            fetch_finish(w);
        }
    }
    free(f->waiters);
    free(f->pos);
    free(f);
    if (tp->gone && tp->jobs == 0) {
        tier_pool_free(tp);
    }
}

/* A fetch with nothing to copy finishes from the loop (its callback never runs inside
 * kvd_tiers_fetch, as the async contract says). */
static void on_idle_finish(uv_work_t *w) {
    (void)w;
}

static void after_idle_finish(uv_work_t *w, int status) {
    (void)status;
    kvd_fetch *f = w->data;
    free(w);
    f->t->jobs--;
    if (--f->pending == 0) {
        fetch_finish(f);
    }
}

/* A Fetch waiting for the remote tier: what it needs to start once Redis answered. */
typedef struct rfetch {
    kvd_tiers *t;
    tier_pool *tp;
    struct rfetch *next; /* t->rfetches */
    int orphan;          /* the session closed meanwhile */
    int detached;        /* the session detached the pool meanwhile */
    int short_run;       /* nothing came from Redis and the local run is under min_tokens */
    uint64_t min_tokens;
    uint64_t session;
    uint32_t tenant;
    uint32_t parent_id;
    kvd_fetch_done done;
    void *arg;
    size_t n;              /* local run: hashes[0..n) */
    size_t k;              /* asked of Redis: hashes[n..n+k) */
    kv_hash128 *hashes;    /* [n + k] */
    char (*keys)[256];     /* [k] */
    const char **keyp;     /* [k] */
    kvd_remote_meta *want; /* [k] */
    /* The direct path: T0 blocks allocated before the get, which the remote thread reads the
     * values into (NULL: none, every value comes through T1). */
    struct rdirect *d;   /* [k] */
    kvd_remote_dst *dst; /* [k] */
    struct iovec *iov;   /* [k * nruns]: the blocks' runs */
} rfetch;

/* One direct destination's state. */
enum { D_EMPTY = 1, D_FILLED = 2, D_TAKEN = 3 }; /* 0: no block */
typedef struct rdirect {
    kvd_block_ref ref;
    uint8_t state;
    uint8_t has_tail;
    uint8_t tail[KVD_REMOTE_TAIL];
} rdirect;

static kv_err fetch_start(kvd_tiers *t, kvd_reg_pool *p, uint64_t session, uint32_t tenant,
                          const kv_hash128 *hashes, size_t n, uint32_t parent_id,
                          kvd_fetch_done done, void *arg, uint32_t *nrun, char *msg, rfetch *rf);

/* The direct blocks the fetch did not take go back (free: never committed). p: the pool, or
 * NULL when it is gone (its blocks with it). */
static void rfetch_release_direct(rfetch *rf, kvd_reg_pool *p) {
    if (rf->d == NULL) {
        return;
    }
    for (size_t i = 0; i < rf->k; i++) {
        if (p != NULL && (rf->d[i].state == D_EMPTY || rf->d[i].state == D_FILLED)) {
            (void)kvd_pool_release(p->pool, KVD_TIERS_SESSION, rf->tenant, &rf->d[i].ref, 1);
        }
        rf->d[i].state = 0;
    }
}

static void rfetch_free(rfetch *rf) {
    for (rfetch **pp = &rf->t->rfetches; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == rf) {
            *pp = rf->next;
            break;
        }
    }
    free(rf->hashes);
    free(rf->keys);
    free(rf->keyp);
    free(rf->want);
    free(rf->d);
    free(rf->dst);
    free(rf->iov);
    free(rf);
}

/* Answers a fetch that cannot start: no block, the reason in code. */
static void fetch_fail(rfetch *rf, kv_err code) {
    kvd_fetch_result r = {rf->tp->pool_id, rf->session,  NULL,         0, 0, 0, 0, code,
                          rf->orphan,      rf->detached, rf->short_run};
    (void)rf->done(rf->arg, &r);
}

/* Which formats a value may come in for this pool: lossless always, lossy only where the
 * pool's layout asked for lossy tiers (its blocks are stored so locally too). */
static int format_ok(const tier_pool *tp, uint8_t f) {
    if (f == KVD_TF_RAW || f == KVD_TF_LZ4 || f == KVD_TF_ZSTD) {
        return 1;
    }
    return (f == KVD_TF_INT8 || f == KVD_TF_FP8) && kvd_tier_format_lossy(tp->format);
}

/* The entries of a Fetch's local run that are in T1 or T2, held busy (eviction never takes a busy
 * entry) while the values from Redis land in T1, whose room must not be made of the run they
 * extend, until fetch_start has taken the run up. Their indices into *nh (malloc'd; NULL with
 * *nh 0 when none or for want of memory: nothing held). */
static uint32_t *run_hold(tier_pool *tp, const kv_hash128 *hashes, size_t n, size_t *nh) {
    *nh = 0;
    uint32_t *ix = n > 0 ? malloc(sizeof(*ix) * n) : NULL;
    for (size_t i = 0; ix != NULL && i < n; i++) {
        uint32_t e = kvd_tstore_find(&tp->st, hashes[i]);
        if (e != KVD_TNONE && (kvd_tstore_in(&tp->st, e, 1) || kvd_tstore_in(&tp->st, e, 2))) {
            kvd_tstore_at(&tp->st, e)->busy++;
            ix[(*nh)++] = e;
        }
    }
    return ix;
}

static void run_unhold(tier_pool *tp, uint32_t *ix, size_t nh) {
    for (size_t i = 0; i < nh; i++) {
        remote_release(tp, ix[i]); /* (quarantined meanwhile: it goes now) */
    }
    free(ix);
}

static void on_remote_get(void *arg, kv_err rc, kvd_remote_val *vals, size_t nv) {
    (void)rc; /* a failed node's keys are misses */
    rfetch *rf = arg;
    tier_pool *tp = rf->tp;
    kvd_tiers *t = rf->t;
    tp->jobs--;
    kvd_reg_pool *p = tp->gone ? NULL : kvd_registry_pool(t->reg, tp->pool_id);
    if (p == NULL) {
        rfetch_release_direct(rf, NULL);
        fetch_fail(rf, KV_ENOENT);
        if (tp->gone && tp->jobs == 0) {
            tier_pool_free(tp);
        }
        rfetch_free(rf);
        return;
    }
    /* The leading run of good values: those read straight into their T0 blocks are in place;
     * the others go into T1, from where the fetch copies them up as any T1 hit (on the copy
     * threads). The run ends at the first miss or bad value. */
    size_t nheld = 0;
    uint32_t *held = run_hold(tp, rf->hashes, rf->n, &nheld);
    size_t got = 0;
    for (size_t i = 0; i < nv && i < rf->k; i++) {
        kvd_remote_val *v = &vals[i];
        kv_hash128 h = rf->hashes[rf->n + i];
        if (v->status != KVD_REMOTE_HIT) {
            break;
        }
        if (v->direct && rf->d != NULL && rf->d[i].state == D_EMPTY) {
            rdirect *d = &rf->d[i];
            d->state = D_FILLED;
            d->has_tail = (uint8_t)v->has_tail;
            memcpy(d->tail, v->tail, sizeof(d->tail));
            from_remote_note(tp, h);
            t->c[TS_REMOTE_DIRECT]++;
            got++;
            continue;
        }
        uint64_t qb = kvd_tier_format_lossy((kvd_tier_format)v->format)
                          ? kvd_codec_quantized_bytes((kvd_tier_format)v->format, &tp->layout)
                          : 0;
        int len_ok = v->format == KVD_TF_RAW                             ? v->len == tp->block_bytes
                     : kvd_tier_format_lossy((kvd_tier_format)v->format) ? v->len == qb
                                                                         : v->len < tp->block_bytes;
        if (!len_ok && format_ok(tp, v->format)) {
            t->c[TS_REMOTE_BAD]++;
            KV_LOG(WARN, "KVD-REMOTE",
                   "pool %u: a remote value of %zu bytes cannot be a block of this pool in "
                   "format %u: not served",
                   tp->pool_id, v->len, v->format);
            break;
        }
        if (!format_ok(tp, v->format)) {
            t->c[TS_REMOTE_BAD]++;
            KV_LOG(WARN, "KVD-REMOTE",
                   "pool %u: a remote value in format %u, which this pool "
                   "does not store: not served",
                   tp->pool_id, v->format);
            break;
        }
        uint32_t ei = kvd_tstore_find(&tp->st, h);
        if (ei != KVD_TNONE && (kvd_tstore_in(&tp->st, ei, 1) || kvd_tstore_in(&tp->st, ei, 2))) {
            got++; /* came down locally meanwhile */
            continue;
        }
        if (ei != KVD_TNONE && kvd_tstore_at(&tp->st, ei)->pending != 0) {
            break; /* a copy into T1 is landing: the next Fetch finds it */
        }
        if (!tier_admit(tp, 1, rf->tenant, v->len) || !make_room(tp, 1, v->len, rf->tenant)) {
            break;
        }
        kv_hash128 parent = i > 0 || rf->n > 0 ? rf->hashes[rf->n + i - 1] : (kv_hash128){0, 0};
        if (v->off != 0 || kvd_tstore_get(&tp->st, h, parent, &ei) != KV_OK) {
            break;
        }
        (void)kvd_tstore_own(&tp->st, ei, rf->tenant);
        kvd_tentry *ne = kvd_tstore_at(&tp->st, ei);
        if (v->has_tail && !ne->has_tail) {
            memcpy(ne->tail, v->tail, sizeof(ne->tail)); /* before set1 tells the events */
            ne->has_tail = 1;
        }
        ne->inr = t->cfg->remote_ttl_s == 0; /* with a TTL, write-back writes it again */
        kvd_tstore_set1(&tp->st, ei, v->data, v->len, v->format); /* the value's buffer */
        v->data = NULL;
        t->used[0] += v->len;
        t->c[TS_REMOTE_PROMOTED]++;
        got++;
    }
    if (got == 0 && (rf->orphan || rf->n * tp->layout.tokens_per_block < rf->min_tokens)) {
        /* Redis had nothing and the local run is not worth a copy (fetch-min-tokens), or the
         * session is gone (its local run stays where it is): answered without copying (the
         * client recomputes). A session gone with values come in: the fetch goes on, and what
         * it brings into T0 is left cached, as for a session that closes while its copies run. */
        rf->short_run = !rf->orphan;
        if (rf->short_run) {
            kvd_tiers_count_short(t);
        }
        run_unhold(tp, held, nheld);
        rfetch_release_direct(rf, p);
        fetch_fail(rf, KV_OK);
        rfetch_free(rf);
        return;
    }
    /* The blocks of misses, bad values and what follows them go back before the fetch
     * allocates its own (the tenant is charged for none of them then). */
    for (size_t i = 0; rf->d != NULL && i < rf->k; i++) {
        if (rf->d[i].state == D_EMPTY || (i >= got && rf->d[i].state == D_FILLED)) {
            (void)kvd_pool_release(p->pool, KVD_TIERS_SESSION, rf->tenant, &rf->d[i].ref, 1);
            rf->d[i].state = 0;
        }
    }
    uint32_t nrun = 0, pool_id = p->pool_id;
    char msg[KV_ERRMSG];
    msg[0] = '\0';
    kv_err src = fetch_start(t, p, rf->session, rf->tenant, rf->hashes, rf->n + got, rf->parent_id,
                             rf->done, rf->arg, &nrun, msg, rf);
    run_unhold(tp, held, nheld); /* (fetch_start's copies hold what they use themselves) */
    /* What the fetch did not take (it releases what it took); the pool looked up again: the
     * fetch may have finished, and its reply run, meanwhile. */
    rfetch_release_direct(rf, kvd_registry_pool(t->reg, pool_id));
    if (src != KV_OK) {
        fetch_fail(rf, src);
    }
    rfetch_free(rf);
}

/* The direct path: T0 blocks for every key asked of Redis, allocated now (quota and memory
 * rules as any Allocate; the evictions are the ones the client's own Allocate for these blocks
 * would make after a miss), so that the remote thread reads each raw value straight into its
 * block: no T1 landing and no copy up. Where they cannot be had (no room or quota, memory the
 * daemon does not map) every value comes through T1 as before. */
/* No direct path for rf after all: its blocks go back, every value comes through T1. */
static void direct_off(rfetch *rf, kvd_reg_pool *p) {
    rfetch_release_direct(rf, p);
    free(rf->d);
    free(rf->dst);
    free(rf->iov);
    rf->d = NULL;
    rf->dst = NULL;
    rf->iov = NULL;
}

static void direct_prepare(kvd_tiers *t, kvd_reg_pool *p, rfetch *rf) {
    if (rf->tp->dev != NULL) {
        return; /* GPU memory: socket reads cannot fill it; values come through T1 */
    }
    size_t k = rf->k;
    kvd_block_ref *blocks = malloc(sizeof(*blocks) * (k + rf->n));
    rf->d = calloc(k, sizeof(*rf->d));
    rf->dst = calloc(k, sizeof(*rf->dst));
    char amsg[KV_ERRMSG];
    /* The local run's blocks that are in T0 are held while the allocation evicts, so that it
     * takes none of them (the fetch holds them again itself). */
    kvd_block_ref *held = blocks != NULL ? blocks + k : NULL;
    uint32_t nheld = 0;
    for (size_t i = 0; held != NULL && i < rf->n; i++) {
        if (kvd_pool_hold_hash(p->pool, rf->tenant, rf->hashes[i], &held[nheld]) == KV_OK) {
            nheld++;
        }
    }
    kv_err arc = blocks == NULL || rf->d == NULL || rf->dst == NULL
                     ? KV_ENOMEM
                     : kvd_registry_allocate(t->reg, p, (uint32_t)k, KVD_TIERS_SESSION, rf->tenant,
                                             blocks, amsg);
    if (nheld > 0) {
        (void)kvd_pool_release(p->pool, KVD_TIERS_SESSION, rf->tenant, held, nheld);
    }
    if (arc != KV_OK) {
        free(blocks);
        direct_off(rf, p); /* no block was taken */
        return;
    }
    for (size_t i = 0; i < k; i++) {
        rf->d[i].ref = blocks[i];
        rf->d[i].state = D_EMPTY;
    }
    free(blocks);
    kvd_tiers_pressure(t, p); /* the blocks took free ones, as an Allocate does */
    for (size_t i = 0; i < k; i++) {
        uint32_t nruns = 0;
        run *runs = block_runs(p->pool, rf->d[i].ref.id, &nruns);
        if (runs != NULL && rf->iov == NULL) {
            rf->iov = malloc(sizeof(*rf->iov) * k * nruns);
        }
        if (runs == NULL || rf->iov == NULL) {
            free(runs);
            direct_off(rf, p); /* not memory the daemon maps */
            return;
        }
        struct iovec *iov = rf->iov + i * nruns;
        for (uint32_t r = 0; r < nruns; r++) {
            iov[r].iov_base = runs[r].p;
            iov[r].iov_len = runs[r].n;
        }
        free(runs);
        rf->dst[i] = (kvd_remote_dst){iov, (int)nruns, rf->tp->block_bytes, KVD_TF_RAW};
    }
}

int kvd_tiers_remote_on(const kvd_tiers *t, const kvd_reg_pool *p) {
    return kvd_tiers_remote_any(t) && p->tiers != NULL && !((const tier_pool *)p->tiers)->no_remote;
}

/* A Lookup's remote probe in flight: its keys (borrowed by the remote thread) and whom to tell. */
typedef struct rprobe {
    kvd_tiers_rprobe_fn done;
    void *arg;
    char (*keys)[256]; /* [n] */
    const char **keyp; /* [n] */
} rprobe;

static void on_remote_probe(void *arg, kv_err rc, const uint8_t *present, size_t n) {
    rprobe *q = arg;
    uint32_t run = 0;
    while (run < n && present[run]) {
        run++;
    }
    q->done(q->arg, rc, run);
    free(q->keys);
    free(q->keyp);
    free(q);
}

kv_err kvd_tiers_remote_probe(kvd_tiers *t, kvd_reg_pool *p, const kv_hash128 *hashes, size_t n,
                              kvd_tiers_rprobe_fn done, void *arg) {
    if (!kvd_tiers_remote_on(t, p)) {
        return KV_ENOTSUP;
    }
    size_t k = n < t->cfg->remote_fetch_max ? n : (size_t)t->cfg->remote_fetch_max;
    rprobe *q = calloc(1, sizeof(*q));
    if (q != NULL) {
        q->keys = malloc(sizeof(*q->keys) * (k > 0 ? k : 1));
        q->keyp = malloc(sizeof(*q->keyp) * (k > 0 ? k : 1));
    }
    if (q == NULL || q->keys == NULL || q->keyp == NULL) {
        if (q != NULL) {
            free(q->keys);
            free(q->keyp);
            free(q);
        }
        return KV_ENOMEM;
    }
    q->done = done;
    q->arg = arg;
    for (size_t i = 0; i < k; i++) {
        remote_key(p->tiers, hashes[i], q->keys[i], sizeof(q->keys[i]));
        q->keyp[i] = q->keys[i];
    }
    kv_err rc = kvd_remote_probe(t->remote, q->keyp, k, on_remote_probe, q);
    if (rc != KV_OK) {
        free(q->keys);
        free(q->keyp);
        free(q);
    }
    return rc;
}

kv_err kvd_tiers_fetch(kvd_tiers *t, kvd_reg_pool *p, uint64_t session, uint32_t tenant,
                       const kv_hash128 *hashes, size_t n, size_t n_more, uint64_t min_tokens,
                       uint32_t parent_id, kvd_fetch_done done, void *arg, uint32_t *nrun,
                       char *msg) {
    tier_pool *tp = p->tiers;
    if (tp == NULL || !kvd_tiers_remote_on(t, p) || n_more == 0) {
        return fetch_start(t, p, session, tenant, hashes, n, parent_id, done, arg, nrun, msg, NULL);
    }
    size_t k = n_more < t->cfg->remote_fetch_max ? n_more : (size_t)t->cfg->remote_fetch_max;
    rfetch *rf = calloc(1, sizeof(*rf));
    if (rf != NULL) {
        rf->hashes = malloc(sizeof(*rf->hashes) * (n + k));
        rf->keys = malloc(sizeof(*rf->keys) * k);
        rf->keyp = malloc(sizeof(*rf->keyp) * k);
        rf->want = malloc(sizeof(*rf->want) * k);
    }
    if (rf == NULL || rf->hashes == NULL || rf->keys == NULL || rf->keyp == NULL ||
        rf->want == NULL) {
        if (rf != NULL) {
            rfetch_free(rf);
        }
        return fetch_start(t, p, session, tenant, hashes, n, parent_id, done, arg, nrun, msg, NULL);
    }
    rf->t = t;
    rf->tp = tp;
    rf->session = session;
    rf->tenant = tenant;
    rf->parent_id = parent_id;
    rf->done = done;
    rf->arg = arg;
    rf->n = n;
    rf->k = k;
    rf->min_tokens = min_tokens;
    memcpy(rf->hashes, hashes, sizeof(*hashes) * (n + k));
    for (size_t i = 0; i < k; i++) {
        remote_key(tp, hashes[n + i], rf->keys[i], sizeof(rf->keys[i]));
        rf->keyp[i] = rf->keys[i];
        rf->want[i] = (kvd_remote_meta){tp->layout_key, hashes[n + i], 0, NULL};
    }
    direct_prepare(t, p, rf);
    if (kvd_remote_get(t->remote, rf->keyp, rf->want, rf->dst, k, on_remote_get, rf) != KV_OK) {
        rfetch_release_direct(rf, p);
        rfetch_free(rf);
        return fetch_start(t, p, session, tenant, hashes, n, parent_id, done, arg, nrun, msg, NULL);
    }
    tp->jobs++; /* the pool's tier state outlives the wait */
    rf->next = t->rfetches;
    t->rfetches = rf;
    *nrun = (uint32_t)n;
    return KV_OK;
}

/* Whether hash h of rf's prefix position k came in directly (its bytes in a T0 block). */
static rdirect *direct_at(rfetch *rf, size_t k) {
    if (rf == NULL || rf->d == NULL || k < rf->n || k - rf->n >= rf->k) {
        return NULL;
    }
    rdirect *d = &rf->d[k - rf->n];
    return d->state == D_FILLED ? d : NULL;
}

static kv_err fetch_start(kvd_tiers *t, kvd_reg_pool *p, uint64_t session, uint32_t tenant,
                          const kv_hash128 *hashes, size_t n, uint32_t parent_id,
                          kvd_fetch_done done, void *arg, uint32_t *nrun, char *msg, rfetch *rf) {
    tier_pool *tp = p->tiers;
    if (tp == NULL) {
        snprintf(msg, KV_ERRMSG, "pool %u has no lower tiers", p->pool_id);
        return KV_ENOENT;
    }
    /* The run: the leading blocks in some tier (as the caller's probe counted them), or in T0
     * blocks of their own (read in directly from the remote tier). */
    uint32_t m = 0;
    while (m < n && (direct_at(rf, m) != NULL || fetchable(tp, p, hashes[m], NULL))) {
        m++;
    }
    kvd_fetch *f = calloc(1, sizeof(*f));
    fpos *pos = calloc(m > 0 ? m : 1, sizeof(*pos));
    if (f == NULL || pos == NULL) {
        free(f);
        free(pos);
        return KV_ENOMEM;
    }
    f->t = t;
    f->tp = tp;
    f->session = session;
    f->tenant = tenant;
    f->parent_id = parent_id;
    f->n = m;
    f->pos = pos;
    f->done = done;
    f->arg = arg;
    f->code = KV_OK;
    f->detached = rf != NULL && rf->detached; /* what happened while Redis was asked */
    f->orphan = rf != NULL && rf->orphan;
    /* Plan: in T0 now -> hold at once (an allocation below could evict it otherwise); being
     * brought up by another fetch -> wait for it; else copy up. */
    uint32_t nup = 0, ndirect = 0;
    kv_err rc = KV_OK;
    for (uint32_t k = 0; k < m; k++) {
        fpos *q = &pos[k];
        q->hash = hashes[k];
        uint32_t wpos;
        kvd_fetch *other = inflight_up(t, tp, hashes[k], &wpos);
        if (kvd_pool_hold_hash(p->pool, tenant, hashes[k], &q->ref) == KV_OK) {
            q->kind = P_T0;
            q->have = 1;
        } else if (other != NULL) {
            q->kind = P_WAIT;
            kv_err wrc = add_waiter(other, f);
            if (wrc == KV_OK) {
                f->pending++;
            } else if (wrc != KV_EEXIST) {
                rc = wrc;
                break;
            }
        } else if (direct_at(rf, k) != NULL) {
            rdirect *d = direct_at(rf, k);
            q->kind = P_UP;
            q->direct = 1;
            q->ok = 1;
            q->have = 1; /* the fetch's now: it commits or releases it */
            q->ref = d->ref;
            q->entry = KVD_TNONE;
            q->tier = 3;
            q->has_tail = d->has_tail;
            memcpy(q->tail, d->tail, sizeof(q->tail));
            d->state = D_TAKEN;
            ndirect++;
        } else {
            q->entry = kvd_tstore_find(&tp->st, hashes[k]);
            if (q->entry == KVD_TNONE ||
                (!kvd_tstore_in(&tp->st, q->entry, 1) && !kvd_tstore_in(&tp->st, q->entry, 2))) {
                m = k; /* in T0 only and not holdable now (quota): the run ends here */
                f->n = m;
                break;
            }
            q->kind = P_UP;
            nup++;
        }
    }
    kvd_block_ref *blocks = NULL;
    if (rc == KV_OK && nup > 0) {
        blocks = malloc(sizeof(*blocks) * nup);
        rc = blocks == NULL
                 ? KV_ENOMEM
                 : kvd_registry_allocate(t->reg, p, nup, KVD_TIERS_SESSION, tenant, blocks, msg);
        if (rc != KV_OK) {
            free(blocks);
            blocks = NULL;
        }
    }
    if (rc != KV_OK) {
        /* Undo: what was held goes back; the fetches waited for forget this one. */
        for (uint32_t k = 0; k < m; k++) {
            if (pos[k].have) {
                (void)kvd_pool_release(p->pool, KVD_TIERS_SESSION, tenant, &pos[k].ref, 1);
            }
        }
        for (kvd_fetch *o = t->fetches; o != NULL; o = o->next) {
            for (uint32_t k = 0; k < o->nwaiters; k++) {
                if (o->waiters[k] == f) {
                    o->waiters[k] = o->waiters[--o->nwaiters];
                    break;
                }
            }
        }
        free(pos);
        free(f);
        return rc;
    }
    f->next = t->fetches;
    t->fetches = f;
    if (tp != NULL) {
        tp->jobs++; /* the pool (and this state) outlives the fetch (on_pool_keep) */
    }
    uint32_t b = 0;
    for (uint32_t k = 0; k < m; k++) {
        fpos *q = &pos[k];
        if (q->kind != P_UP || q->direct) {
            continue;
        }
        q->ref = blocks[b++];
        q->have = 1; /* the WRITING lease */
        kvd_tentry *e = kvd_tstore_at(&tp->st, q->entry);
        uint32_t nruns = 0;
        run *runs = block_runs(p->pool, q->ref.id, &nruns);
        job *j = runs != NULL ? job_new(tp, J_UP) : NULL;
        if (j == NULL) {
            free(runs);
            f->failed++;
            f->code = KV_ENOMEM;
            continue; /* q->ok stays 0: the run ends here, its block is freed at the finish */
        }
        j->entry = q->entry;
        j->ref = q->ref;
        j->runs = runs;
        j->nruns = nruns;
        j->f = f;
        j->pos = k;
        if (e->t1 != NULL) {
            j->src_tier = 1;
            j->src1 = e->t1;
            j->len1 = e->len1;
            j->fmt1 = e->fmt1;
        } else {
            j->src_tier = 2;
            j->slot = e->slot2;
            j->rec.hash = e->hash;
            j->stream2 = e->fmt2 == KVD_TF_RAW && e->len2 == tp->block_bytes;
        }
        q->tier = (uint8_t)j->src_tier;
        if (job_start(j) != KV_OK) {
            free(runs);
            free(j);
            f->failed++;
            f->code = KV_ESYS;
            continue;
        }
        e->busy++;
        f->pending++;
    }
    free(blocks);
    if (nup > 0 || ndirect > 0) {
        t->c[TS_FETCHES]++;
        kvd_tiers_pressure(t, p); /* the fetch's blocks took free ones, as an Allocate does */
    }
    if (f->pending == 0 && rf != NULL) {
        /* Nothing to copy (the remote values came in directly) and called from the remote
         * tier's completion, not from kvd_tiers_fetch: finish now. */
        *nrun = m;
        fetch_finish(f);
        return KV_OK;
    }
    if (f->pending == 0) {
        /* Nothing in flight: finish on the loop's next turn, through the thread pool's
         * completion queue like every other job (an empty work function). */
        uv_work_t *w = calloc(1, sizeof(*w));
        if (w == NULL || uv_queue_work(t->loop, w, on_idle_finish, after_idle_finish) != 0) {
            free(w);
            /* Cannot defer: undo as if refused. */
            fetch_unlink(f);
            if (tp != NULL) {
                tp->jobs--;
            }
            for (uint32_t k = 0; k < m; k++) {
                if (pos[k].have) {
                    (void)kvd_pool_release(p->pool, KVD_TIERS_SESSION, tenant, &pos[k].ref, 1);
                }
            }
            free(pos);
            free(f);
            return KV_ENOMEM;
        }
        w->data = f;
        t->jobs++;
        f->pending = 1;
    }
    *nrun = m;
    return KV_OK;
}

void kvd_tiers_pool_detached(kvd_tiers *t, uint64_t session, uint32_t pool_id) {
    if (t == NULL) {
        return;
    }
    for (kvd_fetch *f = t->fetches; f != NULL; f = f->next) {
        if (f->session == session && f->tp != NULL && f->tp->pool_id == pool_id) {
            f->detached = 1;
        }
    }
    for (rfetch *rf = t->rfetches; rf != NULL; rf = rf->next) {
        if (rf->session == session && rf->tp->pool_id == pool_id) {
            rf->detached = 1;
        }
    }
}

void kvd_tiers_session_gone(kvd_tiers *t, uint64_t session) {
    if (t == NULL) {
        return;
    }
    for (kvd_fetch *f = t->fetches; f != NULL; f = f->next) {
        if (f->session == session) {
            f->orphan = 1;
        }
    }
    for (rfetch *rf = t->rfetches; rf != NULL; rf = rf->next) {
        if (rf->session == session) {
            rf->orphan = 1;
        }
    }
}

void kvd_tiers_count_short(kvd_tiers *t) {
    if (t != NULL) {
        t->c[TS_FETCH_SHORT]++;
    }
}

void kvd_tiers_stats(const kvd_tiers *t, kvd_stat_sink sink, void *arg) {
    uint64_t v[TS_COUNT];
    memset(v, 0, sizeof(v));
    if (t != NULL) {
        memcpy(v, t->c, sizeof(v));
        v[TS_T1_BYTES] = t->used[0];
        v[TS_T1_CAP] = t->cap[0];
        v[TS_T2_BYTES] = t->used[1];
        v[TS_T2_CAP] = t->cap[1];
        uint64_t b1 = 0, b2 = 0;
        for (uint32_t i = 0; i < t->reg->npools; i++) {
            const tier_pool *tp = t->reg->pools[i].tiers;
            if (tp != NULL) {
                b1 += tp->st.count[0];
                b2 += tp->st.count[1];
            }
        }
        v[TS_T1_BLOCKS] = b1;
        v[TS_T2_BLOCKS] = b2;
        v[TS_JOBS] = t->jobs;
        v[TS_REMOTE_PUTS_INFLIGHT] = t->rputs;
        if (t->remote != NULL) {
            kvd_remote_stats rs;
            kvd_remote_get_stats(t->remote, &rs);
            v[TS_REMOTE_STATE] = rs.state;
            v[TS_REMOTE_PUTS] = rs.puts;
            v[TS_REMOTE_PUT_BYTES] = rs.put_bytes;
            v[TS_REMOTE_PUT_ERRORS] = rs.put_errors;
            v[TS_REMOTE_PUT_DROPS] = rs.put_drops;
            v[TS_REMOTE_GETS] = rs.gets;
            v[TS_REMOTE_HITS] = rs.hits;
            v[TS_REMOTE_MISSES] = rs.misses;
            v[TS_REMOTE_BAD] = rs.bad + t->c[TS_REMOTE_BAD];
            v[TS_REMOTE_ERRORS] = rs.errors;
            v[TS_REMOTE_RECONNECTS] = rs.reconnects;
            v[TS_REMOTE_REDIRECTS] = rs.redirects;
            v[TS_REMOTE_PROBES] = rs.probes;
            v[TS_REMOTE_PROBE_HITS] = rs.probe_hits;
            v[TS_REMOTE_DELS_PENDING] = rs.dels_pending;
        }
        if (t->rwatch != NULL) {
            kvd_rwatch_stats ws;
            kvd_rwatch_get_stats(t->rwatch, &ws);
            v[TS_RWATCH_NODES] = ws.nodes;
            v[TS_RWATCH_UNCONFIGURED] = ws.unconfigured;
            v[TS_RWATCH_EXPIRED] = ws.expired;
            v[TS_RWATCH_EVICTED] = ws.evicted;
            v[TS_RWATCH_GAPS] = ws.gaps;
            v[TS_RWATCH_CHECKS] = ws.checks;
            v[TS_RWATCH_CHANGES] = ws.changes;
        }
        if (t->ledger != NULL) {
            v[TS_RWATCH_LEDGER] = kvd_rledger_count(t->ledger);
            v[TS_RWATCH_LEDGER_LOST] = kvd_rledger_lost(t->ledger);
        }
    }
    v[TS_T1_PINNED] = t != NULL ? kvd_pinned_bytes(t->pinned) : 0;
    for (int i = 0; i < TS_COUNT; i++) {
        sink(arg, tier_stats[i].name, v[i]);
    }
}

const kv_stat_desc *kvd_tiers_stat_descs(size_t *n) {
    *n = TS_COUNT;
    return tier_stats;
}

const char *kvd_tiers_state(const kvd_tiers *t, char *buf, size_t len) {
    if (!kvd_tiers_on(t)) {
        snprintf(buf, len, "off");
        return buf;
    }
    int n =
        snprintf(buf, len, "T1 %llu bytes, T2 %s, format %s, %s, zero-copy %s; last T2 error: %s",
                 (unsigned long long)t->cap[0], t->cap[1] > 0 ? t->cfg->tier2_path : "off",
                 kvd_tier_format_name(t->format), t->cfg->tier_write, t->zero_copy ? "on" : "off",
                 t->t2_error[0] != '\0' ? t->t2_error : "none");
    if (n < 0 || (size_t)n >= len) {
        return buf;
    }
    if (t->remote == NULL) {
        snprintf(buf + n, len - (size_t)n, "; remote off");
        return buf;
    }
    kvd_remote_stats rs;
    kvd_remote_get_stats(t->remote, &rs);
    snprintf(buf + n, len - (size_t)n,
             "; remote redis %s (%s): %s%s, %d nodes; last remote error: %s", t->cfg->remote_redis,
             t->cfg->remote_write, rs.state == 1 ? "up" : "down", rs.cluster ? " (cluster)" : "",
             rs.nnodes, rs.last_error[0] != '\0' ? rs.last_error : "none");
    return buf;
}

void kvd_tiers_t2_file(const kvd_tiers *t, const kvd_reg_pool *p, const char *domain, char *buf,
                       size_t len) {
    if (t == NULL || t->cap[1] == 0) {
        snprintf(buf, len, "%s", "");
        return;
    }
    char dir[KVD_CONFIG_PATH_MAX + 600], name[700];
    t2_location(t, p, domain, dir, sizeof(dir), name, sizeof(name));
    snprintf(buf, len, "%s/%s", dir, name);
}

kv_err kvd_tiers_selftest_put(kvd_tiers *t, kvd_reg_pool *p, kvd_block_ref blk, kv_hash128 hash) {
    if (t == NULL || t->cap[0] == 0) {
        return KV_ENOTSUP;
    }
    kv_err rc = attach(t, p, "selftest", 0);
    tier_pool *tp = p->tiers;
    if (rc != KV_OK || tp == NULL) {
        return rc != KV_OK ? rc : KV_ENOTSUP;
    }
    uint32_t nruns = 0;
    run *runs = block_runs(p->pool, blk.id, &nruns);
    uint8_t *b = malloc(tp->block_bytes);
    uint32_t i;
    if (runs == NULL || b == NULL ||
        kvd_tstore_get(&tp->st, hash, (kv_hash128){0, 0}, &i) != KV_OK) {
        free(runs);
        free(b);
        return KV_ENOMEM;
    }
    kv_err grc = t0_gather(tp, runs, nruns, b, 0);
    free(runs);
    if (grc != KV_OK) {
        free(b);
        kvd_tentry *e = kvd_tstore_at(&tp->st, i);
        if (e->t1 == NULL && !e->in2 && e->pending == 0 && e->busy == 0) {
            kvd_tstore_forget(&tp->st, i);
        }
        return grc;
    }
    if (kvd_tstore_in(&tp->st, i, 1)) {
        free(b);
        return KV_OK;
    }
    kvd_tstore_set1(&tp->st, i, b, tp->block_bytes, KVD_TF_RAW);
    t->used[0] += tp->block_bytes;
    return KV_OK;
}

void kvd_tiers_tenant_usage(const kvd_tiers *t, uint32_t tenant, kvd_tier_usage *out) {
    memset(out, 0, sizeof(*out));
    for (uint32_t i = 0; t != NULL && i < t->reg->npools; i++) {
        const tier_pool *tp = t->reg->pools[i].tiers;
        for (int tier = 1; tp != NULL && tier <= 2; tier++) {
            out->blocks[tier - 1] += kvd_tstore_owned(&tp->st, tenant, tier);
            out->bytes[tier - 1] += owned_bytes(tp, tenant, tier);
        }
    }
}

void kvd_tiers_pool_stats(const kvd_reg_pool *p, kvd_stat_sink sink, void *arg) {
    const tier_pool *tp = p->tiers;
    sink(arg, "tier1_blocks", tp != NULL ? tp->st.count[0] : 0);
    sink(arg, "tier1_bytes", tp != NULL ? tp->st.bytes[0] : 0);
    sink(arg, "tier2_blocks", tp != NULL ? tp->st.count[1] : 0);
    sink(arg, "tier2_bytes", tp != NULL ? tp->st.bytes[1] : 0);
    sink(arg, "format", tp != NULL ? (uint64_t)tp->format : 0);
}

kv_err kvd_tiers_pool_policy(kvd_tiers *t, const kvd_reg_pool *p, kvd_tier_policy *out) {
    tier_pool *tp = p->tiers;
    if (t == NULL || tp == NULL) {
        return KV_ENOENT;
    }
    out->write_through = tp->write_through >= 0 ? tp->write_through : t->write_through;
    out->min_hits = tp->min_hits >= 0 ? (uint64_t)tp->min_hits : t->cfg->tier_min_hits;
    out->clean_ahead = tp->clean_ahead >= 0 ? (uint64_t)tp->clean_ahead : t->cfg->tier_clean_ahead;
    out->format = kvd_tier_format_name(tp->format);
    out->has_t2 = tp->disk != NULL;
    out->remote_back = remote_back(tp);
    out->own =
        tp->write_through >= 0 || tp->min_hits >= 0 || tp->clean_ahead >= 0 || tp->remote_back >= 0;
    return KV_OK;
}

/* A write mode setting: 1 write-back, 0 write-through, -1 default, -2 none of them. */
static int write_mode_arg(const char *v) {
    return strcmp(v, "write-back") == 0      ? 1
           : strcmp(v, "write-through") == 0 ? 0
           : strcmp(v, "default") == 0       ? -1
                                             : -2;
}

kv_err kvd_tiers_pool_set(kvd_tiers *t, kvd_reg_pool *p, const char *name, const char *value,
                          char *msg, size_t len) {
    tier_pool *tp = p->tiers;
    if (t == NULL || tp == NULL) {
        snprintf(msg, len, "pool %u has no lower tiers", p->pool_id);
        return KV_ENOENT;
    }
    char *end = NULL;
    int remote = strcmp(name, "remote-write") == 0;
    if (remote || strcmp(name, "write") == 0) {
        int m = write_mode_arg(value);
        if (m == -2) {
            snprintf(msg, len, "%s: '%.32s' is not write-back, write-through or default", name,
                     value);
            return KV_EINVAL;
        }
        if (!remote) {
            tp->write_through = m < 0 ? -1 : !m;
            return KV_OK;
        }
        if (t->remote == NULL) {
            snprintf(msg, len, "remote-write: there is no remote tier (remote-redis)");
            return KV_EINVAL;
        }
        tp->remote_back = m;
        t->any_remote_back |= m == 1;
        return KV_OK;
    }
    int64_t *field = strcmp(name, "min-hits") == 0      ? &tp->min_hits
                     : strcmp(name, "clean-ahead") == 0 ? &tp->clean_ahead
                                                        : NULL;
    if (field == NULL) {
        snprintf(msg, len, "'%.32s' is not write, remote-write, min-hits or clean-ahead", name);
        return KV_EINVAL;
    }
    if (strcmp(value, "default") == 0) {
        *field = -1;
        return KV_OK;
    }
    unsigned long long v = strtoull(value, &end, 10);
    if (value[0] == '\0' || *end != '\0' || v > (1u << 20) ||
        (field == &tp->clean_ahead && v == 0)) {
        snprintf(msg, len, "%s: '%.32s' is not a number in range (or default)", name, value);
        return KV_EINVAL;
    }
    *field = (int64_t)v;
    return KV_OK;
}

const float *kvd_tiers_summary(const kvd_tiers *t, const kvd_reg_pool *p, kv_hash128 hash) {
    (void)t;
    const tier_pool *tp = p->tiers;
    if (tp == NULL) {
        return NULL;
    }
    uint32_t i = kvd_tstore_find(&tp->st, hash);
    if (i == KVD_TNONE) {
        return NULL;
    }
    const kvd_tentry *e = &tp->st.e[i];
    return e->doomed || (e->t1 == NULL && !e->in2) ? NULL : e->summ;
}
