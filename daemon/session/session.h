/* kvd_session: one client connection's identity and everything it holds.
 *
 * Per attached pool the session keeps a table block id -> (gen, count) of the references it
 * holds, WRITING leases included (a lease counts as one reference). The server checks every
 * Release, Commit and Pin against it (a block the session does not hold is KV_EPERM), and when
 * the connection closes for any reason kvd_session_release_all drops every reference and frees
 * every WRITING block, so nothing a dead client held stays held. Loop thread only.
 */
#ifndef KVD_SESSION_H
#define KVD_SESSION_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/kv_err.h"
#include "daemon/core/pool.h"

/* References of one session on one pool: an open-addressing table keyed by block id. */
typedef struct kvd_refs {
    uint32_t *ids;    /* key per slot; KVD_NO_BLOCK = empty */
    uint32_t *gens;   /* generation of the held block per slot */
    uint32_t *counts; /* references per slot (>= 1 when used) */
    uint32_t cap;     /* slots, a power of two (0 before the first add) */
    uint32_t used;    /* distinct blocks held */
    uint64_t total;   /* references held (sum of counts) */
} kvd_refs;

/* Caller's storage; zeroed memory is an empty table too. */
void kvd_refs_init(kvd_refs *r);
void kvd_refs_fini(kvd_refs *r);

/* Adds n references on block id at generation gen. KV_ENOMEM (table unchanged). */
kv_err kvd_refs_add(kvd_refs *r, uint32_t id, uint32_t gen, uint32_t n);

/* References held on id (0 if none); *gen (when not NULL) gets its generation if held. */
uint32_t kvd_refs_count(const kvd_refs *r, uint32_t id, uint32_t *gen);

/* Drops n references on id. KV_EPERM when fewer than n are held (table unchanged). */
kv_err kvd_refs_sub(kvd_refs *r, uint32_t id, uint32_t n);

/* Calls fn for every held block with its generation and count (order unspecified). The table
 * must not change during the walk. */
void kvd_refs_each(const kvd_refs *r,
                   void (*fn)(void *arg, uint32_t id, uint32_t gen, uint32_t count), void *arg);

#define KVD_NO_SEGMENT UINT32_MAX /* "no segment": every live segment was sent */

/* One pool a session attached. What the session was sent is recorded per segment slot (the
 * serial of the segment sent there, kvd_pool_segment_serial), never as a high-water mark: a
 * client may ask MapSegments from any index, and a mark set by such a reply would claim slots
 * below it that were never sent (the hole that let a worker publish stale bytes). */
typedef struct kvd_session_pool {
    uint32_t pool_id;     /* the pool's id */
    kvd_pool *pool;       /* borrowed from the server's pool table */
    uint32_t *sent;       /* [nsent] serial of the segment sent per slot; 0 = none */
    uint32_t nsent;       /* entries of sent (grows with the pool's slots) */
    uint32_t hole;        /* every live slot below it was sent (hint, see hole_reuses) */
    uint32_t hole_reuses; /* kvd_pool_slot_reuses when hole was computed */
    kvd_refs refs;        /* references this session holds in the pool */
    uint64_t serial;      /* which attach this is (kvd_session.attaches): a reply that waited
                             knows whether the pool was detached and attached again meanwhile */
} kvd_session_pool;

/* Makes room to record segment slots [0, slots) of sp: called before a reply is queued, so that
 * kvd_session_pool_mark_sent cannot fail after it. KV_ENOMEM (nothing changed). */
kv_err kvd_session_pool_reserve(kvd_session_pool *sp, uint32_t slots);

/* Records that the segment now in slot seg (< the reserved slots) was sent to the session. */
void kvd_session_pool_mark_sent(kvd_session_pool *sp, uint32_t seg);

/* 1 when the segment now in slot seg was sent to the session, else 0. */
int kvd_session_pool_was_sent(const kvd_session_pool *sp, uint32_t seg);

/* The lowest live segment slot of the pool that was not sent to the session, or KVD_NO_SEGMENT.
 * Amortized O(1) (a hint that only moves forward while slots are not reused). */
uint32_t kvd_session_pool_first_unsent(kvd_session_pool *sp);

/* Forgets what was sent (a repeated AttachPool sends everything again). */
void kvd_session_pool_forget_sent(kvd_session_pool *sp);

typedef struct kvd_session {
    uint64_t id; /* > 0, unique per daemon run */
    pid_t pid;   /* peer credentials at accept (SO_PEERCRED) */
    uid_t uid;
    gid_t gid;
    uint32_t tenant;         /* tenant id (valid once hello) */
    int hello;               /* 1 after a successful Hello */
    uint32_t features;       /* Hello.features & what kvd has (KV_FEATURE_*): reply forms */
    char name[65];           /* Hello.client_name */
    kvd_session_pool *pools; /* attached pools */
    uint32_t npools, cap;    /* used and allocated entries of pools */
    uint64_t requests;       /* requests handled */
    uint64_t errors;         /* Error replies sent */
    uint32_t fetches;  /* Fetches, waiting Allocates and Lookups waiting for the remote tier whose
                          reply is still to come (max-inflight caps them) */
    uint64_t attaches; /* pools attached so far (kvd_session_pool.serial) */
} kvd_session;

/* Caller's storage. */
void kvd_session_init(kvd_session *s, uint64_t id, pid_t pid, uid_t uid, gid_t gid);

/* Releases everything (kvd_session_release_all) and frees the tables; accepts zeroed memory. */
void kvd_session_fini(kvd_session *s);

/* The session's entry for pool_id, or NULL when it did not attach it. */
kvd_session_pool *kvd_session_find_pool(kvd_session *s, uint32_t pool_id);

/* Adds an entry for pool (returns the existing one if attached). KV_ENOMEM. */
kv_err kvd_session_add_pool(kvd_session *s, uint32_t pool_id, kvd_pool *pool,
                            kvd_session_pool **out);

/* Drops every reference in every pool (frees WRITING blocks) and empties the tables. Returns
 * the number of references dropped. */
uint64_t kvd_session_release_all(kvd_session *s);

/* The session stops using pool_id (DetachPool): every reference it holds there is released and
 * the pool leaves the session's list (pointers to its entries are void). Returns the references
 * released; 0 for a pool the session does not have. */
uint64_t kvd_session_drop_pool(kvd_session *s, uint32_t pool_id);

/* Records n references the pool just gave this session (Allocate, Lookup, Commit's canonical
 * blocks) in sp's ledger. Pool refcount and ledger move together: when the ledger cannot grow
 * (KV_ENOMEM), the entries recorded by this call are taken back and the pool references are
 * released, so the caller has nothing to undo. */
kv_err kvd_session_hold(kvd_session *s, kvd_session_pool *sp, const kvd_block_ref *refs, size_t n);

/* Undoes kvd_session_hold for refs[0..n): one reference each, from the ledger and the pool. */
void kvd_session_unhold(kvd_session *s, kvd_session_pool *sp, const kvd_block_ref *refs, size_t n);

/* The same for references of a reply not sent yet, which the client may have released meanwhile
 * (a Release takes any reference the ledger counts, a held reply's included): each one the ledger
 * still counts at its generation goes back; the others are gone already (and their block id may
 * be held again, at a newer generation: that reference stays). */
void kvd_session_unhold_held(kvd_session *s, kvd_session_pool *sp, const kvd_block_ref *refs,
                             size_t n);

/* A Commit's block `from` was a duplicate and the pool gave this session a reference on the
 * canonical block `to` instead: moves the ledger's reference. KV_ENOMEM: the ledger could not
 * record `to`; its pool reference is released, and `from`'s entry is gone either way. */
kv_err kvd_session_move_ref(kvd_session *s, kvd_session_pool *sp, uint32_t from, kvd_block_ref to);

/* References held over all pools. */
uint64_t kvd_session_refs_held(const kvd_session *s);

#endif
