/* kvd_tiers: the tiers below each pool. T0 is the pool's own memory; T1 is host memory the
 * daemon owns (`tier1-memory` over all pools); T2 is one file per pool on a local disk
 * (`tier2-path`, `tier2-bytes`), which survives a restart. A cached block the pool evicts is
 * not lost when a lower tier holds a copy of it; a Lookup reports how far the prefix continues
 * in the lower tiers and a Fetch brings that run back into T0.
 *
 * Copies never run on the loop thread: every byte move is a job on libuv's thread pool
 * (uv_queue_work) whose completion comes back on the loop thread, which alone owns every pool,
 * entry and count. Ownership rule (docs/ARCHITECTURE.md, "Tiers"): while a job reads a T0
 * block, the block carries a tier lease (kvd_pool_lease: nothing can evict or reuse it); while
 * a job writes a T0 block, the block is WRITING, leased to the tiers' own session
 * (KVD_TIERS_SESSION), so a client's death or Release cannot free it; while a job reads or
 * writes a lower-tier entry, the entry is busy and no eviction takes it. Nothing a job touches
 * is freed before its completion runs.
 *
 * Write-back (the default): when a pool's free blocks drop below `tier-clean-ahead`, the next
 * victims of its eviction order are copied down ahead of eviction (then returned, cold, to the
 * head of their queue); an eviction of a block with a copy is a demotion, of one without a drop
 * (counted: dirty drops, e.g. a burst that outran the copies). Write-through: every committed
 * block is copied down at once. Selective (`tier-min-hits`): only blocks Lookups found that
 * often go down. A block that lands in T1 is written on to T2 at once (when there is a T2), so
 * that T1 makes room without waiting for the disk; only the last tier drops.
 *
 * Remote tier (remote-redis, kvd_remote): below T1 and T2, shared by every node that names the
 * same Redis: each block landing in T1 is also written there (the entry is busy while the remote
 * thread reads its bytes), and a Fetch asks it for the blocks past the local run (above).
 * Formats (kvd_codec): lossless raw, lz4, zstd (`tier-format`); lossy int8 / fp8 for pools whose
 * layout asked (KVD_POOL_LOSSY_TIERS, `tier-lossy-format`).
 * GPU pools (cuda-vmm, cuda-ipc): T0 is device memory, so the copy threads move its bytes with
 * the backend's driver copies (kvd_backend_ops copy_to_host / copy_to_device / copy_sync: async
 * on each copy thread's own stream, which the thread waits for before the job reports back), a
 * raw pool's T1 buffers are page-locked (host_alloc; daemon/tiers/pinned.h) and the remote
 * tier's direct path is off (values land in T1 first).
 * Loop thread only.
 */
#ifndef KVD_TIERS_H
#define KVD_TIERS_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "common/kv_err.h"
#include "common/kv_hash.h"
#include "daemon/config/config.h"
#include "daemon/core/pool.h"
#include "daemon/registry/registry.h"

#define KVD_TIERS_SESSION UINT64_MAX /* the session id of blocks a Fetch is filling */

typedef struct kvd_tiers kvd_tiers;
typedef struct kvd_fetch kvd_fetch;

/* Makes the tiers of the daemon: nothing when tier1-memory is 0 and tier2-path is empty (then
 * every call below is a cheap no-op). Registers the registry's pool_gone hook. KV_ENOMEM; KV_ESYS
 * when tier2-path cannot be made (msg says why). */
kv_err kvd_tiers_alloc(uv_loop_t *loop, kvd_registry *reg, const kvd_config *cfg, kvd_tiers **out,
                       char *msg, size_t msglen);

/* Frees every pool's tier state (T1 memory, T2 files closed; they stay on disk). Call after the
 * loop ran dry (no job in flight), after kvd_registry_fini. Accepts NULL. */
void kvd_tiers_free(kvd_tiers *t);

/* 1 when any lower tier is configured. */
int kvd_tiers_on(const kvd_tiers *t);

/* 1 when a remote tier is configured (remote-redis, remote-fetch-max > 0): HelloReply's
 * KV_FEATURE_REMOTE. */
int kvd_tiers_remote_any(const kvd_tiers *t);

/* Gives pool p its lower tiers (once; later calls do nothing): its T1 entries, and its T2 file
 * `<tier2-path>/<domain>/<model>-<layout>.t2`, whose records found by a scan become T2 entries
 * (what survived a restart). domain: the pool's domain name. A pool that cannot have tiers (no
 * host mapping, T2 unusable) is logged once and keeps working without them (or with T1 only).
 * KV_ENOMEM. */
kv_err kvd_tiers_attach(kvd_tiers *t, kvd_reg_pool *p, const char *domain);

/* Write-through: a block was just committed in p (a new canonical block): start its copy down.
 * Write-back: nothing. full: the Commit's 32-byte vLLM digest of it (hash-mode vllm), or NULL:
 * its last 16 bytes go with the copies (tier-2 records, remote values). */
void kvd_tiers_committed(kvd_tiers *t, kvd_reg_pool *p, kvd_block_ref blk, const uint8_t *full);

/* Write-back: after an Allocate in p, keep the next victims copied down while free blocks are
 * few. Cheap when there is room. */
void kvd_tiers_pressure(kvd_tiers *t, kvd_reg_pool *p);

/* How far a prefix continues below T0: hashes[0..n) is the part after the T0 hits; out gets the
 * length of the leading run whose every block is in T0, T1 or T2 (`fetchable`) and how many of
 * them are in T1 (`t1`) and only in T2 (`t2`). Counts the lower-tier hits. */
typedef struct kvd_tier_run {
    uint32_t fetchable;
    uint32_t t1;
    uint32_t t2;
} kvd_tier_run;
void kvd_tiers_probe(kvd_tiers *t, kvd_reg_pool *p, const kv_hash128 *hashes, size_t n,
                     kvd_tier_run *out);
/* The same, counted as no lookup (admin prefix-score, a router's question). */
void kvd_tiers_probe_quiet(kvd_tiers *t, kvd_reg_pool *p, const kv_hash128 *hashes, size_t n,
                           kvd_tier_run *out);

/* A Fetch's outcome, given to its callback. refs[0..nok) are the run's blocks in T0, in prefix
 * order, each with one reference charged to the fetch's tenant and owned by the fetch: the
 * callback takes them (records them in its session's ledger; returns 1) or leaves them (returns
 * 0: the session is gone; the tiers release them). */
typedef struct kvd_fetch_result {
    uint32_t pool_id;          /* the pool */
    uint64_t session;          /* who asked */
    const kvd_block_ref *refs; /* [nok] */
    uint32_t nok;              /* blocks now in T0 for the caller, from the run's start */
    uint32_t promoted;         /* of them, copied up from T1 or T2 by this fetch */
    uint32_t shared;           /* of them, copied up by another fetch this one waited for */
    uint32_t failed;           /* lower-tier copies that failed a check (the run ends there) */
    kv_err code;               /* KV_OK, or why the run ends early (KV_ECORRUPT, KV_ESYS) */
    int orphan;                /* the session closed while the fetch was in flight */
    int detached;              /* the session detached the pool meanwhile (refs: leave them) */
    int short_run;             /* nothing copied: the run (Redis had none of it) is under
                                  min_tokens; answer as FETCH_SHORT */
} kvd_fetch_result;
typedef int (*kvd_fetch_done)(void *arg, const kvd_fetch_result *r);

/* Brings the run of hashes[0..n) (the prefix after the T0 hits, whose last hit is block
 * parent_id, or KVD_NO_BLOCK when there is none) into T0 for session (tenant pays for the
 * blocks): the run's leading blocks found in T0, T1 or T2 (as kvd_tiers_probe counts it). Blocks
 * still in T0 are held at once; for the others T0 blocks are allocated (kvd_registry_allocate:
 * quota and memory rules as Allocate) and filled by copy jobs; a block another fetch is already
 * bringing up is waited for, not copied twice. done runs exactly once on the loop thread, after
 * this call returns, when the bytes are in place (or at once, from the loop, when there was
 * nothing to copy) — unless this call fails: KV_ENOSPC, KV_EQUOTA (msg says why: nothing held),
 * KV_ENOMEM. *nrun gets the run's length (0: done runs with nok 0). */
kv_err kvd_tiers_fetch(kvd_tiers *t, kvd_reg_pool *p, uint64_t session, uint32_t tenant,
                       const kv_hash128 *hashes, size_t n, size_t n_more, uint64_t min_tokens,
                       uint32_t parent_id, kvd_fetch_done done, void *arg, uint32_t *nrun,
                       char *msg);

/* The remote tier (remote-redis): n_more above is how many hashes follow hashes[0..n) (the rest
 * of the prefix, past the local tiers' run). With a remote tier and n_more > 0 the fetch first
 * asks Redis for up to remote-fetch-max of them (on the remote thread); the leading run of
 * values that pass every check lands in T1 and the fetch then runs over hashes[0..n + run) as
 * above (done sees the longer run; *nrun is n); when Redis had none of them and the local run
 * is under min_tokens tokens, nothing is copied (done sees short_run). A fetch that cannot start
 * then (ENOSPC, the pool gone) reaches done with nok 0 and the code. kvd_tiers_remote_on: 1 when
 * Fetches of pool p ask the remote tier (a Lookup only when it asks: kvd_tiers_remote_probe). */
int kvd_tiers_remote_on(const kvd_tiers *t, const kvd_reg_pool *p);

/* A Lookup's question to the remote tier (Lookup.remote): hashes[0..n) follow the local tiers'
 * run of pool p (at most remote-fetch-max of them are asked, as a Fetch would). done(arg, rc,
 * run) runs once on the loop thread, after this call returns, with the length of the leading
 * run of keys Redis holds (kvd_remote_probe: a value is there; it is not read, so a Fetch may
 * still find one bad) and rc: KV_OK, KV_ESYS (a node down or the time spent: the run may be
 * short), KV_ECLOSED (the daemon stops), KV_ENOMEM (run 0). Unless this call fails: KV_ENOTSUP (no
 * remote tier for p), KV_EBUSY (the remote thread stops), KV_ENOMEM. Nothing of p is held
 * meanwhile. */
typedef void (*kvd_tiers_rprobe_fn)(void *arg, kv_err rc, uint32_t run);
kv_err kvd_tiers_remote_probe(kvd_tiers *t, kvd_reg_pool *p, const kv_hash128 *hashes, size_t n,
                              kvd_tiers_rprobe_fn done, void *arg);

/* Copies down lease the T0 blocks they read (neither free nor evictable until the copy lands),
 * so an Allocate in a nearly full pool can meet ENOSPC that the copies in flight will end.
 * kvd_tiers_leased: how many of pool p's blocks copies hold now. kvd_tiers_wait_room: fn(arg,
 * KV_OK) runs on the loop thread when one of them is given back (waits run in the order they
 * came; fn may wait again), fn(arg, KV_ENOENT) when the pool goes, fn(arg, KV_ECLOSED) at
 * kvd_tiers_close; KV_ENOENT at once (fn never runs) when no copy holds a block of p.
 * kvd_tiers_room_waited: 1 while some Allocate waits on p (a new one queues behind it). */
typedef void (*kvd_tiers_room_fn)(void *arg, kv_err rc);
uint32_t kvd_tiers_leased(const kvd_tiers *t, const kvd_reg_pool *p);
kv_err kvd_tiers_wait_room(kvd_tiers *t, const kvd_reg_pool *p, kvd_tiers_room_fn fn, void *arg);
int kvd_tiers_room_waited(const kvd_tiers *t, const kvd_reg_pool *p);

/* Told whenever a block of a pool enters (present 1) or leaves (0) a tier (KV events:
 * daemon/kvevents): tier 0 when a Fetch commits a block it brought up into T0 (present only: T0
 * departures are the pool's drop hook), 1 and 2 for the lower tiers' copies, 3 for the remote
 * tier (a write Redis acknowledged; the DEL of a quarantined block). parent: the block's parent
 * hash where the tier knows it, else NULL; tail: the block's digest tail where the tier has it
 * (kvd_tiers_set_digest_fn, or a remote value that carried it), else NULL. One hook; fn NULL
 * clears it. Loop thread. */
typedef void (*kvd_tiers_event_fn)(void *arg, uint32_t pool_id, uint32_t domain,
                                   uint32_t block_size, kv_hash128 hash, const kv_hash128 *parent,
                                   const uint8_t *tail, int tier, int present);
void kvd_tiers_set_event_hook(kvd_tiers *t, kvd_tiers_event_fn fn, void *arg);

/* Hash-mode vllm: where a block's 32-byte digest can be had when it goes down from T0 (the KV
 * events' record of it), so the tier keeps its last 16 bytes (tail; the first 16 are the hash)
 * and writes them into its remote value: a node that fetches it from Redis can then name it to
 * routers too. fn returns 1 and fills tail when it knows the digest. fn NULL clears it. */
typedef int (*kvd_tiers_digest_fn)(void *arg, uint32_t domain, kv_hash128 hash, uint8_t tail[16]);
void kvd_tiers_set_digest_fn(kvd_tiers *t, kvd_tiers_digest_fn fn, void *arg);

/* A reconciliation pass of the remote watch now (admin `remote-watch reconcile`; docs/TIERS.md):
 * KV_OK with *queued 0 (started) or 1 (a pass runs: another follows it); KV_ESTATE with msg when
 * there is no remote watch or no ledger, or the watch is not subscribed on every node (a pass
 * starts by itself when it is). *ledger: the values the pass asks about. */
kv_err kvd_tiers_reconcile_now(kvd_tiers *t, int *queued, uint64_t *ledger, char *msg,
                               size_t msglen);

/* At stop, once the server took its last request and before kvd_tiers_close: under remote-write
 * write-back, writes to Redis the blocks tier 1 holds that Redis lacks (oldest first per pool;
 * at most remote-drain-s seconds; a progress line at the start and the end), then runs
 * done(arg) on the loop thread: 1 is returned. 0 (done never runs) when there is nothing to
 * write: no remote tier, write-through, remote-drain-s 0, or every T1 block is in Redis. Once. */
typedef void (*kvd_tiers_drained_fn)(void *arg);
int kvd_tiers_drain(kvd_tiers *t, kvd_tiers_drained_fn done, void *arg);

/* At stop, before the loop runs dry: stops the remote tier's thread (waiting for its request in
 * flight, at most about remote-timeout-ms) and completes what it had queued. */
void kvd_tiers_close(kvd_tiers *t);

/* Counts a Fetch refused as SHORT (its run under fetch-min-tokens). */
void kvd_tiers_count_short(kvd_tiers *t);

/* A session detached pool_id: its fetches in flight there finish without it (done sees
 * detached; their blocks become cached). */
void kvd_tiers_pool_detached(kvd_tiers *t, uint64_t session, uint32_t pool_id);

/* A session closed: its fetches in flight finish without it (their blocks become cached). */
void kvd_tiers_session_gone(kvd_tiers *t, uint64_t session);

/* Copy jobs in flight (the daemon's stop waits for 0). */
uint32_t kvd_tiers_inflight(const kvd_tiers *t);

/* The tiers' counters over all pools through sink: tier1_bytes, tier1_blocks, tier1_capacity,
 * tier2_bytes, tier2_blocks, tier2_capacity, tier_hits_t1, tier_hits_t2, demotions_t1,
 * demotions_t2, dirty_drops, drops_t1, drops_t2, promotions_t1, promotions_t2, fetches,
 * fetches_short, fetch_shared, corrupt_t2, write_errors_t2, copy_bytes_down_t1/_t2,
 * copy_ns_down_t1/_t2, copy_bytes_up_t1/_t2, copy_ns_up_t1/_t2 (bytes moved and copy-thread
 * time per direction and tier: their ratio is the copy bandwidth), jobs_inflight
 * (kvd_tiers_stat_descs has the table). */
void kvd_tiers_stats(const kvd_tiers *t, kvd_stat_sink sink, void *arg);
const kv_stat_desc *kvd_tiers_stat_descs(size_t *n);

/* What is charged to tenant in the lower tiers, summed over the pools (what tier-total-bytes
 * limits; its tier-max, tier-max-bytes and the guarantees count per pool): blocks and bytes
 * ([0] tier 1, [1] tier 2; bytes as tier-max-bytes counts them). Zeros without tiers. */
typedef struct kvd_tier_usage {
    uint64_t blocks[2];
    uint64_t bytes[2];
} kvd_tier_usage;
void kvd_tiers_tenant_usage(const kvd_tiers *t, uint32_t tenant, kvd_tier_usage *out);

/* One pool's lower tiers through sink (admin `pools`): tier1_blocks, tier1_bytes, tier2_blocks,
 * tier2_bytes (all 0 for a pool without tiers), and format (the kvd_tier_format its blocks are
 * stored in, as a number; 0 raw). */
void kvd_tiers_pool_stats(const kvd_reg_pool *p, kvd_stat_sink sink, void *arg);

/* For admin `selftest isolation` (loop thread, synchronous, not the copy path): copies block
 * blk of pool p (its hash) into p's tier 1 at once, giving p T1-only tiers if it has none (no
 * T2 file for a self-test pool). KV_ENOTSUP when tier 1 is off, KV_ENOMEM. */
/* The page summary a lower tier of pool p keeps with the block of hash (summaries pools), or
 * NULL when no tier holds it (or none with a summary). Loop thread. */
const float *kvd_tiers_summary(const kvd_tiers *t, const kvd_reg_pool *p, kv_hash128 hash);

kv_err kvd_tiers_selftest_put(kvd_tiers *t, kvd_reg_pool *p, kvd_block_ref blk, kv_hash128 hash);

/* The path pool p's T2 file has (or would have) for domain; "" when tier 2 is off. */
void kvd_tiers_t2_file(const kvd_tiers *t, const kvd_reg_pool *p, const char *domain, char *buf,
                       size_t len);

/* A pool's tier policy as it is in force: the daemon's options, or what admin `tiers pool=ID`
 * set for this pool (own = 1). KV_ENOENT for a pool without tiers. */
typedef struct kvd_tier_policy {
    int write_through;    /* 1: write-through, 0: write-back */
    uint64_t min_hits;    /* selective: lookups a block needs to go down (write-back) */
    uint64_t clean_ahead; /* write-back: victims kept copied ahead */
    const char *format;   /* how its blocks are stored below T0 (kvd_tier_format_name) */
    int has_t2;           /* it has a tier-2 file */
    int remote_back;      /* remote-write: 1 write-back, 0 write-through */
    int own;              /* some setting is the pool's own */
} kvd_tier_policy;
kv_err kvd_tiers_pool_policy(kvd_tiers *t, const kvd_reg_pool *p, kvd_tier_policy *out);

/* Sets one of a pool's own tier settings (admin `tiers pool=ID NAME=VALUE`): write
 * (write-back | write-through), remote-write (the same: when its blocks go to the remote tier;
 * it applies from the next T1 landing or eviction on), min-hits, clean-ahead; VALUE `default` goes
 * back to the daemon's option. Runtime only (a pool made again starts with the options). KV_ENOENT
 * for a pool without tiers, KV_EINVAL for a bad name or value (msg says why). */
kv_err kvd_tiers_pool_set(kvd_tiers *t, kvd_reg_pool *p, const char *name, const char *value,
                          char *msg, size_t len);

/* One line on the state of the lower tiers for admin (`tiers`): "off", or what is configured and
 * the last T2 error ("ok" when none). */
const char *kvd_tiers_state(const kvd_tiers *t, char *buf, size_t len);

#endif
