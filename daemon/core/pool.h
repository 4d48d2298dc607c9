/* kvd_pool: the blocks of one (model, layout, domain), their lifecycle, and their eviction.
 *
 * Blocks live in segments (memory from a kvd_backend); block id = segment * blocks_per_segment
 * + slot, so a client maps each segment once and finds any block by arithmetic. Lifecycle:
 *   FREE -> WRITING (leased to one session) -> COMMITTED (immutable, hashed, indexed,
 *   refcount >= 1) -> CACHED (refcount 0, indexed, evictable) -> FREE.
 * The generation of a block is bumped every time it returns to FREE, so a handle (id, gen) from
 * before a reuse is refused with KV_ESTALE. Metadata is one 64-byte record per block in an array
 * beside the segments; free and eviction lists are intrusive links in those records, so
 * allocate, free, lookup-hit and release are O(1) per block.
 *
 * Eviction takes only CACHED, unpinned blocks, in the order of the pool's policy: LRU with the
 * tail of a prefix first (vLLM's baseline: blocks released together enter in reverse order),
 * S3-FIFO (small probationary FIFO + main FIFO with reinsertion, ghost of recent evictions), or
 * PREFIX_LRU: LRU, tail first, except that a block which is the prefix of two or more cached
 * continuations (a branch point of the prefix tree, or an ancestor of one) gets one more round
 * per reuse (at most 3) when it reaches the head. A system prompt or few-shot preamble shared
 * by many requests outlives bursts of one-off text; a conversation's own history has no
 * branches and keeps LRU's order. It matched or beat LRU on all four traces of bench/RESULTS.md
 * (core section). ADAPTIVE and the S3-FIFO here evict only leaves of the cached prefix tree: a
 * block that a committed or cached block names as its parent waits on an inner list until its
 * last child goes (then it is next in its queue), and goes earlier only when every leaf left is
 * pinned or referenced, so no cached block sits behind a hole in its prefix. ADAPTIVE is
 * PREFIX_LRU on those leaves: LRU over the leaves, and a shared leaf (a branch point or an
 * ancestor of one) that was reused, or committed again while the ghost of recent evictions
 * remembered it, gets one more round per reuse (at most 3) when it is the oldest; the shared
 * ancestors waiting above it as inner blocks spend that round with it, so a shared chain lives
 * as long as its most reused block, not one round per block in turn. On the traces of
 * bench/RESULTS.md (core section) it is 0.999-1.124x LRU and at or above every other policy on
 * 16 of 24 rows. Its leaf order can instead take never-reused leaves first
 * (kvd_pool_set_leaf_order), which frequency-friendly workloads want; set dueling (duel.h: the
 * daemon's `evict-duel`, and the trace replay) switches between the two. Every policy is
 * O(1) amortized per block.
 * Tenants under their guaranteed share of cached blocks are skipped while other candidates exist
 * (each protected block once: it waits on its tenant's aside list; O(1) amortized per block
 * plus O(tenants with a guarantee) per eviction).
 *
 * The pool does not know sessions' reference lists: the caller (the server's session table)
 * checks that a session holds the references it releases. Loop thread only; no locks.
 */
#ifndef KVD_POOL_H
#define KVD_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"
#include "common/kv_hash.h"
#include "common/kv_layout.h"
#include "common/kv_stat.h"
#include "daemon/core/backend.h"
#include "daemon/core/index.h"

#define KVD_NO_BLOCK UINT32_MAX /* "no parent" and list terminator */
#define KVD_MAX_TENANTS 4096    /* tenant ids are 0..KVD_MAX_TENANTS-1 */
#define KVD_MAX_SEGMENTS 4096   /* segments per pool */
/* A LAYER_MAJOR pool on a backend with segment_alloc_parts makes each segment of one allocation
 * per section (and the scales) while they fit one reply's fds with room to spare (models of up
 * to 99 layers); deeper models get whole segments, whose sections clients map at offsets. */
#define KVD_SEGMENT_PARTS_MAX 199

typedef struct kvd_pool kvd_pool;

typedef enum kvd_block_state {
    KVD_BLOCK_FREE = 0,
    KVD_BLOCK_WRITING = 1,
    KVD_BLOCK_COMMITTED = 2,
    KVD_BLOCK_CACHED = 3,
} kvd_block_state;

typedef enum kvd_evict_policy {
    KVD_EVICT_LRU = 1,        /* vLLM's order: least recently used, tail of a prefix first */
    KVD_EVICT_S3FIFO = 2,     /* S3-FIFO (Yang et al., SOSP 2023) */
    KVD_EVICT_PREFIX_LRU = 3, /* LRU, tail first; shared prefixes get a round per reuse */
    KVD_EVICT_ADAPTIVE = 4,   /* PREFIX_LRU's order on the leaves of the prefix tree only */
} kvd_evict_policy;

/* The one table of policy names, as `evict-policy` spells them: "lru", "s3fifo", "prefix-lru",
 * "adaptive".
 * name: "?" for a value not in the table. parse: KV_EINVAL for an unknown name. */
const char *kvd_evict_policy_name(kvd_evict_policy p);
kv_err kvd_evict_policy_parse(const char *name, kvd_evict_policy *out);

typedef enum kvd_evict_reason {
    KVD_EVICT_CAPACITY = 0, /* an allocation needed the block */
    KVD_EVICT_ADMIN = 1,    /* an operator asked (kvctl evict) */
    KVD_EVICT_SHRINK = 2,   /* freeing a segment */
    KVD_EVICT_REASONS = 3,
} kvd_evict_reason;

/* A handle as clients hold it: pool-local id and the generation it was issued at. */
typedef struct kvd_block_ref {
    uint32_t id;
    uint32_t gen;
} kvd_block_ref;

typedef struct kvd_pool_config {
    uint32_t pool_id;            /* index namespace; unique among live pools */
    uint32_t domain;             /* the domain whose blocks this pool holds (for stats) */
    kv_layout layout;            /* initialised with kv_layout_init */
    uint32_t blocks_per_segment; /* >= 1 */
    uint32_t max_segments;       /* 1..KVD_MAX_SEGMENTS; allocate grows up to this */
    kvd_evict_policy policy;
} kvd_pool_config;

/* What kvd_pool_block_info reports (a copy; the record itself stays private). */
typedef struct kvd_block_info {
    kvd_block_state state;
    uint32_t gen;
    uint32_t refcount;
    uint32_t tenant;        /* who allocated it (charged for it) */
    uint64_t owner_session; /* WRITING: the session that may commit it */
    kv_hash128 hash;        /* COMMITTED/CACHED */
    uint32_t parent;        /* KVD_NO_BLOCK for the first block of a prefix */
    uint32_t hits;          /* lookups that returned it (saturating) */
    int pinned;             /* pinned and retention not expired */
    uint32_t pin_tenant;    /* pinned: the tenant its pin is charged to */
    int is_private;         /* WRITING and private (never committed) */
} kvd_block_info;

/* Per-tenant accounting for quotas (held = WRITING blocks + references on committed blocks). */
typedef struct kvd_tenant_usage {
    uint64_t held;   /* references held by the tenant's sessions, WRITING blocks included */
    uint64_t cached; /* CACHED blocks the tenant allocated */
    uint64_t pinned; /* unexpired pins charged to the tenant (on COMMITTED or CACHED blocks) */
} kvd_tenant_usage;

/* Receives one named counter or gauge; the admin socket, kvctl and Prometheus print these. */
typedef void (*kvd_stat_sink)(void *arg, const char *name, uint64_t value);

/* Creates a pool with no segments (the first allocate grows it). The pool borrows idx and the
 * backend; both must outlive it. KV_EINVAL for a bad config. */
kv_err kvd_pool_alloc(const kvd_pool_config *cfg, kvd_index *idx, const kvd_backend_ops *be,
                      void *be_ctx, kvd_pool **out);

/* Removes the pool's entries from the index, frees every segment and the pool. Accepts NULL.
 * Any outstanding handles become invalid; the caller has dropped its sessions' references. */
void kvd_pool_free(kvd_pool *pool);

const kvd_pool_config *kvd_pool_config_get(const kvd_pool *pool);

/* Adds one segment (all its blocks FREE). KV_ENOSPC at max_segments resident segments; backend
 * errors pass through. *seg gets the new segment's index. */
kv_err kvd_pool_grow(kvd_pool *pool, uint32_t *seg);

/* Evicts the CACHED blocks of the highest-numbered segment that holds no WRITING or referenced
 * block (or is parked), and frees it. Segment 0 is never freed (it lives as long as the pool).
 * KV_ENOENT when every other segment has a live block. *seg gets its index. */
kv_err kvd_pool_shrink(kvd_pool *pool, uint32_t *seg);

/* Changes the segment limit (the server's memory budget moves between pools). Existing segments
 * above the limit stay until shrink frees them. */
void kvd_pool_set_max_segments(kvd_pool *pool, uint32_t max_segments);

/* Number of segment slots in use (the highest live index + 1) and one segment's memory (NULL
 * for a slot that was freed by shrink or never grown). */
uint32_t kvd_pool_segment_slots(const kvd_pool *pool);
const kvd_segment_mem *kvd_pool_segment(const kvd_pool *pool, uint32_t seg);

/* Which segment of the pool's life occupies slot seg: a number > 0, different for every segment
 * grown (a slot freed by shrink and grown again gets a new one); 0 for an empty slot. What a
 * session was sent is recorded by serial, so a regrown slot counts as never sent. O(1). */
uint32_t kvd_pool_segment_serial(const kvd_pool *pool, uint32_t seg);

/* How many times a segment was grown into a slot below the highest live one (only after a
 * shrink); a session's "every slot below k was sent" hint is rechecked when it changes. O(1). */
uint32_t kvd_pool_slot_reuses(const kvd_pool *pool);

/* ---- parking: memory moves between pools ----
 * A parked segment keeps its slot, its memory object and every mapping of it (clients map a
 * segment once and keep it), but its physical memory went back to the system through the
 * backend's segment_discard and its blocks are FREE yet not allocatable (on no list, in no
 * index). Parked segments do not count against max_segments; allocate unparks the pool's own
 * parked segments before it grows new ones. */

/* A pool's best segment to park: one whose blocks are all FREE or CACHED unpinned, none of them a
 * cached block of a tenant at or under its guaranteed share (parking for another pool never
 * takes a guarantee), fewest CACHED first, then the one used least recently. */
typedef struct kvd_park_candidate {
    uint32_t seg;         /* the segment */
    uint32_t cached;      /* its CACHED blocks (parking evicts them) */
    uint64_t last_access; /* pool ms of the newest access to any of its blocks */
    uint32_t parkable;    /* segments of the pool that could be parked now */
} kvd_park_candidate;

/* Finds the segment kvd_pool_park would best take. KV_ENOTSUP when the backend has no
 * segment_discard, KV_ENOENT when no segment can be parked now. With several tenants with a
 * guarantee, while any is at or under its share no segment holding a cached block of one of them
 * is taken (conservative: exact with one). O(segments + tenants with a guarantee), from counts
 * each segment keeps. */
kv_err kvd_pool_park_candidate(const kvd_pool *pool, kvd_park_candidate *out);

/* Parks segment seg: evicts its CACHED blocks (counted as evictions_shrink), takes its FREE blocks
 * off the free list and discards its memory. KV_ENOTSUP without segment_discard, KV_ENOENT for a
 * freed or unknown slot, KV_EEXIST when already parked, KV_ESTATE when a block is WRITING,
 * referenced or pinned; a backend error passes through (the blocks stay FREE and usable then). */
kv_err kvd_pool_park(kvd_pool *pool, uint32_t seg);

/* Makes a parked segment's blocks allocatable again (their pages fault in fresh, zeroed, or are
 * taken back first by the backend's segment_restore). KV_ENOENT when seg is not parked,
 * KV_ENOSPC when the pool is at max_segments resident ones, segment_restore's error (KV_ENOMEM:
 * the segment stays parked). */
kv_err kvd_pool_unpark(kvd_pool *pool, uint32_t seg);

/* 1 when seg is a parked segment, else 0. */
int kvd_pool_segment_parked(const kvd_pool *pool, uint32_t seg);

/* Live segments that are not parked (what counts against max_segments and memory budgets). */
uint32_t kvd_pool_resident_segments(const kvd_pool *pool);

/* 1 when a block is WRITING, COMMITTED or CACHED (the pool holds something), else 0. O(1). */
int kvd_pool_in_use(const kvd_pool *pool);

/* Live segments that are parked (their memory went back; their block records stay). O(1). */
uint32_t kvd_pool_parked_segments(const kvd_pool *pool);

/* Segments allocate could add now (its own parked ones first, then new ones) under
 * max_segments and the slot limit. O(1). */
uint32_t kvd_pool_growable_segments(const kvd_pool *pool);

/* Bytes of the resident segments' memory (parked ones cost nothing), kept as a running count so
 * the daemon's memory budget is O(pools), not O(segments), per Allocate. O(1). */
uint64_t kvd_pool_resident_bytes(const kvd_pool *pool);

/* Block counts by state, O(1): what allocate's room-making decides on (the same numbers as
 * kvd_pool_stats' blocks_* counters, without walking the counter names). */
typedef struct kvd_pool_counts {
    uint64_t free;      /* allocatable now (parked blocks are not) */
    uint64_t cached;    /* CACHED */
    uint64_t pinned;    /* pinned (COMMITTED or CACHED) */
    uint64_t evictable; /* CACHED and unpinned: what allocation may evict */
} kvd_pool_counts;
kvd_pool_counts kvd_pool_counts_get(const kvd_pool *pool);

/* Blocks evicted so far for one reason (kvd_pool_stats' evictions_<reason>), O(1); 0 for an
 * unknown reason. */
uint64_t kvd_pool_evictions(const kvd_pool *pool, kvd_evict_reason reason);

/* Leases n blocks as WRITING to session, charged to tenant. All or nothing: takes FREE blocks,
 * then grows, then evicts CACHED blocks; KV_ENOSPC when fewer than n can be had, decided before
 * anything changes (nothing grows, nothing is evicted or leased then). Growing unparks the
 * pool's own parked segments first. Writes out[0..n). */
kv_err kvd_pool_allocate(kvd_pool *pool, uint32_t n, uint64_t session, uint32_t tenant,
                         kvd_block_ref *out);

/* Commits a WRITING block leased to session: full, verified data with its chain hash and the
 * id of its parent block (KVD_NO_BLOCK for the first). If (pool, hash) is already indexed (two
 * workers computed the same block), the existing block gets the caller's reference, this one
 * is freed, and *canonical names the existing one; otherwise *canonical = blk.
 * Errors: KV_ENOENT bad id, KV_ESTALE generation, KV_ESTATE not WRITING, KV_EPERM another
 * session's lease. */
kv_err kvd_pool_commit(kvd_pool *pool, uint64_t session, kvd_block_ref blk, kv_hash128 hash,
                       uint32_t parent, kvd_block_ref *canonical);

/* Looks up the longest cached prefix of hashes[0..n): returns in *nhit how many leading ones
 * are indexed and writes their handles to out[0..*nhit), each with a new reference charged to
 * tenant (so none can be evicted while the caller uses it). Counts the query and its hits. */
kv_err kvd_pool_lookup(kvd_pool *pool, uint32_t tenant, const kv_hash128 *hashes, size_t n,
                       kvd_block_ref *out, size_t *nhit);

/* Takes one more reference on a COMMITTED or CACHED block, charged to tenant. */
kv_err kvd_pool_hold(kvd_pool *pool, uint32_t tenant, kvd_block_ref blk);

/* kvd_pool_hold of the block indexed under h, whose handle goes to *out: the daemon's own way
 * from a hash to a held block (commons promotion), counted as no query and no hit. KV_ENOENT
 * when h is not indexed here. */
kv_err kvd_pool_hold_hash(kvd_pool *pool, uint32_t tenant, kv_hash128 h, kvd_block_ref *out);

/* ---- what the tiers (daemon/tiers) and KV events (daemon/kvevents) use ----
 * A drop hook is told of every indexed block that leaves the pool: an eviction (reason
 * KVD_EVICT_CAPACITY, _ADMIN or _SHRINK; parking counts as _SHRINK) just before its record is
 * freed, a quarantine (KVD_DROP_QUARANTINE, a CACHED or COMMITTED block whose bytes changed)
 * and an Unshare (KVD_DROP_UNSHARE: the block is a private one now; its bytes had the hash),
 * with the block's chain hash and, for an eviction, its parent's as a hint (zero when it has
 * none or the parent record holds no committed block; a reused record may name another block);
 * zero for a quarantine or an unshare. A pool has one hook per slot (KVD_DROP_HOOK_TIERS,
 * KVD_DROP_HOOK_EVENTS), called in slot order; fn NULL clears a slot.
 * A hook must not call back into the pool. Freeing the pool tells it nothing. */
#define KVD_DROP_QUARANTINE 100
#define KVD_DROP_UNSHARE 101
#define KVD_DROP_HOOK_TIERS 0
#define KVD_DROP_HOOK_EVENTS 1
#define KVD_DROP_HOOKS 2
typedef void (*kvd_pool_drop_fn)(void *arg, kvd_pool *pool, kv_hash128 hash, kv_hash128 parent,
                                 int reason);
void kvd_pool_set_drop_hook(kvd_pool *pool, int slot, kvd_pool_drop_fn fn, void *arg);

/* A tier lease: one reference on a COMMITTED or CACHED block, charged to no tenant and counted
 * as no access (its age and reuse count stay), so a copy thread may read the block's bytes
 * while nothing can evict or reuse it. One lease per block at a time. KV_ENOENT/KV_ESTALE bad
 * handle, KV_ESTATE a FREE, WRITING or quarantined block, KV_EBUSY when it is leased already or
 * at the reference limit. */
kv_err kvd_pool_lease(kvd_pool *pool, kvd_block_ref blk);

/* Drops the block's tier lease. When it was the last reference the block becomes CACHED; with
 * cold, it re-enters its eviction queue where its age puts it (before younger blocks and, among
 * blocks of its age, before its parents) and it and its segment keep their ages, as if the copy
 * never happened, instead of entering as the newest. KV_ESTATE when the block holds no lease. */
kv_err kvd_pool_unlease(kvd_pool *pool, kvd_block_ref blk, int cold);

/* 1 when h is indexed in the pool (COMMITTED or CACHED), else 0. Takes no reference and counts
 * nothing. O(1). */
int kvd_pool_has(const kvd_pool *pool, kv_hash128 h);

/* Takes a COMMITTED or CACHED block whose bytes are known to have changed since its commit
 * (verify-blocks) out of the index: no Lookup finds it again and a new commit of its hash makes
 * a fresh block. A CACHED one is freed at once (not counted as an eviction); a COMMITTED one
 * stays readable by whoever holds it and is freed, not cached, at its last release. Counted
 * in `quarantines`. Again on a quarantined block: KV_OK, nothing changes. KV_ENOENT,
 * KV_ESTALE for a bad handle, KV_ESTATE for a FREE or WRITING block. */
kv_err kvd_pool_quarantine(kvd_pool *pool, kvd_block_ref blk);

/* ---- private blocks (Zipage's compressed KV: held for a sequence's life, never indexed) ----
 * A private block is a WRITING block that can never be committed (kvd_pool_commit: KV_EPERM);
 * it counts in blocks_writing and in the tenant's held blocks, and Release (or the session's
 * end) frees it like any WRITING block. */

/* Marks a WRITING block leased to session private. KV_ESTATE not WRITING, KV_EPERM another
 * session's lease; again on a private block: KV_OK. */
kv_err kvd_pool_make_private(kvd_pool *pool, uint64_t session, kvd_block_ref blk);

/* Whether kvd_pool_unshare would take blk, without changing anything: KV_OK, or the error and
 * in *why a static phrase saying why not ("is shared: other sessions hold it", ...). The caller
 * checks that the one reference is its own. */
kv_err kvd_pool_unshare_check(const kvd_pool *pool, kvd_block_ref blk, const char **why);

/* Turns a COMMITTED block whose one reference the caller's session holds back into a private
 * WRITING block of session, charged to tenant: it leaves the index (a Lookup cannot find it
 * again), so the session may write it. Refused when anyone else could read it: KV_EBUSY for a
 * second reference (another session, or a tier copy running), a pin, or committed children;
 * KV_ESTATE for a block not COMMITTED or quarantined; KV_ENOENT/KV_ESTALE a bad handle. */
kv_err kvd_pool_unshare(kvd_pool *pool, uint64_t session, uint32_t tenant, kvd_block_ref blk);

/* Drops one reference on each of blks[0..n) (a sequence's blocks, in prefix order), charged
 * back to tenant. Validates all first; on error nothing changes. A WRITING block is freed (it
 * must be session's lease: KV_EPERM otherwise). A COMMITTED block at refcount 0 becomes CACHED;
 * blocks released together enter the eviction order tail-first. */
kv_err kvd_pool_release(kvd_pool *pool, uint64_t session, uint32_t tenant,
                        const kvd_block_ref *blks, size_t n);

#define KVD_PIN_OWNER                                                                              \
    UINT32_MAX /* kvd_pool_pin: charge the pin to the block's allocating tenant                    \
                */

/* Pins a COMMITTED or CACHED block: it is not evicted before now_ms + retention_ms. A higher
 * priority pin survives explicit eviction of lower ones. Pinning again extends; by another
 * tenant, for at least as long as the pin has left, the pin is charged to that tenant from then
 * on. A new pin is
 * charged as pinned to `tenant`, the tenant whose
 * max-pinned it uses (the pinning session's; KVD_PIN_OWNER: the block's allocator, for an
 * operator's pin). An expired pin stops counting at the next clock step, referenced or not.
 * KV_EINVAL for a bad tenant. */
kv_err kvd_pool_pin(kvd_pool *pool, kvd_block_ref blk, uint64_t retention_ms, uint8_t priority,
                    uint32_t tenant);
kv_err kvd_pool_unpin(kvd_pool *pool, kvd_block_ref blk);

/* The pool's clock in milliseconds (monotonic). It moves only when told: the registry sets it
 * before each request names the pool (kvd_registry_pool), when a session closes, and before
 * admin pin and evict. Pins expire against it and blocks record their last access with it. */
void kvd_pool_set_now(kvd_pool *pool, uint64_t now_ms);

/* How ADAPTIVE chooses between the oldest leaf of its recency side (never reused since it
 * entered) and that of its frequency side: by age (AGE, the default: LRU over the leaves), or
 * the recency side's first while it has one (UNREUSED_FIRST: S3-FIFO's small queue without its
 * bound, which frequency-friendly workloads such as few-shot prompts over shared examples want
 * and recency-ranked ones such as chat do not). Set per pool at any time (the order of the
 * lists is the same under both); other policies ignore it. Set dueling (duel.h) switches it. */
typedef enum kvd_leaf_order {
    KVD_LEAF_ORDER_AGE = 0,
    KVD_LEAF_ORDER_UNREUSED_FIRST = 1,
} kvd_leaf_order;
void kvd_pool_set_leaf_order(kvd_pool *pool, kvd_leaf_order order);
kvd_leaf_order kvd_pool_leaf_order(const kvd_pool *pool);

/* Evicts up to max CACHED unpinned blocks (of tenant, or any when tenant < 0) in policy order,
 * counting them under reason; *nevicted gets the count. With dry_run nothing changes and
 * out (if not NULL, capacity max) receives the blocks that would go. */
kv_err kvd_pool_evict(kvd_pool *pool, size_t max, int64_t tenant, kvd_evict_reason reason,
                      int dry_run, kvd_block_ref *out, size_t *nevicted);

/* Guaranteed share: while tenant has at most `blocks` CACHED blocks here, capacity eviction
 * skips them unless nothing else is evictable. 0 (default) means no guarantee. */
void kvd_pool_set_guarantee(kvd_pool *pool, uint32_t tenant, uint64_t blocks);

/* Copies one block's metadata. KV_ENOENT for an id out of range or in a freed segment. */
kv_err kvd_pool_block_info(const kvd_pool *pool, uint32_t id, kvd_block_info *out);

/* Validates a handle: KV_ENOENT bad id, KV_ESTALE wrong generation. */
kv_err kvd_pool_check_ref(const kvd_pool *pool, kvd_block_ref blk);

/* Per-tenant usage in this pool (zeros for a tenant never seen). */
kvd_tenant_usage kvd_pool_tenant_usage(const kvd_pool *pool, uint32_t tenant);

/* Reports every counter: blocks_total, blocks_free, blocks_writing, blocks_committed,
 * blocks_cached, blocks_pinned, blocks_parked, segments, segments_parked, bytes (resident segments
 * only: parked ones cost no memory), queries, query_blocks, hit_blocks, hit_tokens,
 * commits, commits_duplicate, rewinds, evictions_capacity, evictions_admin, evictions_shrink,
 * verified, quarantines (kvd_pool_stat_descs has the whole table). */
void kvd_pool_stats(const kvd_pool *pool, kvd_stat_sink sink, void *arg);

/* Counts blocks a Rewind gave back (released like Release; counted apart for speculative
 * decoding's rejected drafts). */
void kvd_pool_count_rewind(kvd_pool *pool, uint64_t blocks);

/* Counts Lookup hits whose bytes were checked (verify-blocks). */
void kvd_pool_count_verified(kvd_pool *pool, uint64_t blocks);

/* The table of what kvd_pool_stats reports, in its order (common/kv_stat.h): names, units,
 * help and Prometheus families. Static storage. */
const kv_stat_desc *kvd_pool_stat_descs(size_t *n);

/* Bytes of the pool's own metadata: its record, per-slot and per-tenant arrays (sized to the
 * slots and tenants it has met), the ghost of the leaf policies (S3-FIFO, ADAPTIVE: 8 bytes a
 * slot, a power of two >= blocks) and the block records of its live segments
 * (parked ones keep theirs). What the daemon's memory budget counts beside segment memory. O(1). */
uint64_t kvd_pool_meta_bytes(const kvd_pool *pool);

/* An upper bound of kvd_pool_meta_bytes of a pool that has one segment's slots and met a few
 * tenants, without its block records: what a new pool costs besides its first segment. */
#define KVD_POOL_META_BASE 4096

/* Bytes of metadata per block (the record; at most 64). */
size_t kvd_pool_meta_bytes_per_block(void);

/* Walks every block and list and checks the invariants (counts by state add up, refcounts,
 * list membership, index entries point back, parked blocks FREE on no list and unindexed).
 * KV_EINTERNAL with a log line on a violation. For tests and `kvctl selftest`; O(blocks). */
kv_err kvd_pool_check(const kvd_pool *pool);

#endif
