/* kvd_rpc: the request handlers, one per request type of PROTOCOL.md §6, behind one table.
 *
 * A handler takes the request, the session it came on and what the layers below give it (the
 * registry, the live options), checks in PROTOCOL.md §7's order before it changes anything,
 * and returns a reply: the encoded frame (its reply body or an Error), the fds to send with it,
 * and whether the connection closes after it. It never sees a socket: the connection layer
 * (daemon/net) decodes requests, calls kvd_rpc_handle and queues what comes back. Loop thread.
 */
#ifndef KVD_RPC_H
#define KVD_RPC_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_arena.h"
#include "common/kv_err.h"
#include "daemon/config/config.h"
#include "daemon/registry/registry.h"
#include "daemon/session/session.h"
#include "daemon/kvevents/kvevents.h"
#include "daemon/tiers/tiers.h"
#include "proto/kvd.pb-c.h"

/* The connection layer's counters a Stats reply reports (daemon.sessions, .buffer_bytes,
 * .conns_paused): kept by daemon/net, read here. */
typedef struct kvd_conn_counts {
    uint32_t conns;        /* open connections */
    uint64_t buffer_bytes; /* input capacity + unsent reply bytes over all connections */
    uint32_t paused;       /* connections not read because of max-buffer-bytes */
} kvd_conn_counts;

/* What a reply sent later (a Fetch's, when its copies are done) needs from the connection layer:
 * the session by id (NULL once it closed) and a way to queue the reply on its connection.
 * Lives as long as the server. */
struct kvd_reply_s;
typedef struct kvd_rpc_later {
    kvd_session *(*find)(void *arg, uint64_t session_id);
    void (*send)(void *arg, uint64_t session_id, const struct kvd_reply_s *r);
    void *arg;
} kvd_rpc_later;

/* What one request may use besides its session. */
typedef struct kvd_rpc_ctx {
    kvd_registry *reg;     /* pools, budget, tenants, events */
    const kvd_config *cfg; /* the live options (limits are read per request) */
    uint64_t boot_epoch;   /* this daemon run's */
    int draining;          /* admin `drain`: a Hello is refused with EDRAINING */
    kv_arena *arena; /* the request's scratch and its reply; reset after the reply is queued */
    const kvd_conn_counts *conns; /* for Stats */
    /* Where a reply without fds may be encoded in place (the connection's output queue): room
     * for len bytes that will be sent as the next reply, or NULL (then the reply goes to the
     * arena). May be NULL. */
    uint8_t *(*reserve)(void *arg, size_t len);
    void *reserve_arg;
    kvd_tiers *tiers;           /* the lower tiers (NULL: none) */
    kvd_kvevents *kvevents;     /* KV-event publishers (NULL: none) */
    const kvd_rpc_later *later; /* for replies sent later (NULL: Fetch replies at once) */
} kvd_rpc_ctx;

/* A reply, valid until the arena is reset. */
typedef struct kvd_reply_s {
    const uint8_t *frame; /* header and body; NULL when encoding failed (out of memory) */
    size_t len;           /* bytes of frame */
    const int *fds;       /* sent with the frame's first byte (the caller dups them) */
    uint32_t nfds;        /* entries of fds */
    int *tmp_fds;         /* fds made for this reply (read-only reopens): the caller closes them
                             once it has dup'ed fds */
    uint32_t ntmp;        /* entries of tmp_fds */
    kv_err code;          /* KV_OK, or the code of the Error it carries */
    int queued;           /* the frame was encoded in place through ctx->reserve (frame NULL) */
    const char *why;      /* the Error's message (NULL for KV_OK), for the caller's log */
    int close_after;      /* Goodbye: close the connection once the reply is written */
    int deferred;         /* no reply now: it comes through kvd_rpc_later (a Fetch in flight) */
} kvd_reply;

/* Handles one decoded request of session sess: the envelope checks (epoch, Hello first),
 * dispatch, and the reply or an Error. Counts the request and, for an Error, the session's
 * errors and the event ring's refusals. */
void kvd_rpc_handle(const kvd_rpc_ctx *ctx, kvd_session *sess, const Kvd__Envelope *req,
                    kvd_reply *out);

/* An Error reply for request id (frames the connection layer could not decode, timeouts). sess
 * may be NULL (a connection refused before it had one). */
void kvd_rpc_error(const kvd_rpc_ctx *ctx, kvd_session *sess, uint64_t id, kv_err code,
                   const char *msg, kvd_reply *out);

/* A session closed: the registry gets its pools back (freeing idle empty ones) and its tenant's
 * session count drops. Call after kvd_session_fini's releases, i.e. instead of it. */
void kvd_rpc_session_close(const kvd_rpc_ctx *ctx, kvd_session *sess);

#endif
