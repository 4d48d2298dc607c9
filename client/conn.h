/* conn: libkvclient's transport: the socket, framing, the SCM_RIGHTS fd FIFO, batches of encoded
 * requests and the I/O engine that sends them and matches replies.
 *
 * One kvc_conn owns a Unix socket, an input buffer that frames are decoded from (into a
 * per-connection arena, common/kv_arena.h), and the FIFO of file descriptors received with
 * SCM_RIGHTS. The engine (kvc__exchange) writes a run of encoded requests (MSG_DONTWAIT, poll()
 * while the socket is full) and reads replies (a blocking recvmsg in slices bounded by the
 * socket's receive timeout once everything is written), matching each reply to its request by
 * envelope id, so synchronous calls are a batch of one. What a reply means is not this module's
 * business: each one goes to the completion function the layer above installed when it made the
 * connection (kvc__conn_alloc), which is how the request layer (client/rpc.h) sits on top without
 * conn calling up into it. Internal names are kvc__*; nothing here is exported
 * (-fvisibility=hidden). Threads: whatever thread owns the connection (see kvclient.h).
 */
#ifndef KVC_CONN_H
#define KVC_CONN_H

#include <stddef.h>
#include <stdint.h>

#include "client/diag.h"
#include "client/include/kvclient.h"
#include "common/kv_arena.h"
#include "proto/kvd.pb-c.h"

#define KVC__FDQ_CAP 512    /* received fds not yet claimed by a frame */
#define KVC__REPLY_SLACK 64 /* replies may exceed max_frame_bytes by this much */

/* Request kinds, named for the reply they expect. */
typedef enum kvc__op_kind {
    KVC__OP_HELLO = 1,
    KVC__OP_ATTACH,
    KVC__OP_MAP,
    KVC__OP_LOOKUP,
    KVC__OP_ALLOCATE,
    KVC__OP_COMMIT,
    KVC__OP_RELEASE,
    KVC__OP_REWIND,
    KVC__OP_PIN,
    KVC__OP_STATS,
    KVC__OP_PING,
    KVC__OP_GOODBYE,
    KVC__OP_DETACH,
    KVC__OP_FETCH,
    KVC__OP_UNSHARE,
    KVC__OP_SUMMARIES,
} kvc__op_kind;

/* One request in flight: where its frame is, and where its reply's outputs go. The engine uses
 * the fields up to status; the rest belong to the layer that queued the op (client/rpc.c), and
 * conn neither reads nor writes them (pools are opaque here). */
typedef struct kvc__op {
    uint64_t id;             /* envelope id */
    kvc__op_kind kind;       /* expected reply */
    size_t frame_off;        /* offset of its frame in the batch's output buffer */
    size_t frame_len;        /* bytes of its frame */
    int sent;                /* frame fully written */
    int done;                /* reply handled */
    kv_err status;           /* result once done */
    kvc_pool *pool;          /* pool the request is about, or NULL */
    size_t count;            /* list length sent (hashes, blocks, entries) */
    void *out;               /* caller's output array (kvc_block[], ...) */
    size_t *nout;            /* lookup: hit count; map: segments in the reply */
    kvc_pool **pools;        /* lookup with search_domains: the pool of each hit, else NULL */
    const void *expect;      /* ping: payload to compare */
    size_t expect_len;       /* ping: payload bytes */
    uint64_t nonce;          /* ping nonce */
    kvc_stat_fn stat_fn;     /* stats callback */
    void *stat_arg;          /* its argument */
    void *aux;               /* lookup: kvc_tier_hits * or NULL; fetch: kvc_fetch_result * */
    int aux_fetch;           /* aux is a kvc_fetch_result (a fetch, maybe sent as a Lookup) */
    kvc_remote_hits *remote; /* lookup with Lookup.remote: its answer, else NULL */
} kvc__op;

/* Handles the reply envelope env (unpacked into the connection's arena: valid during the call
 * only) for op and returns the op's status. fds[0..nfds) are the fds the frame carried, in
 * fd_index order (borrowed: the engine closes them afterwards). Installed by the layer that
 * makes the connection (kvc__op_complete of client/rpc.h). */
typedef kv_err (*kvc__complete_fn)(kvc_conn *c, kvc__op *op, const Kvd__Envelope *env,
                                   const int *fds, size_t nfds);

/* A queue of encoded requests (also the engine of every synchronous call). */
struct kvc_batch {
    kvc_conn *conn;                /* owning connection */
    kvc__op *ops;                  /* queued requests */
    size_t nops;                   /* queued */
    size_t cap;                    /* capacity of ops */
    uint8_t *obuf;                 /* encoded frames back to back */
    size_t olen;                   /* bytes in obuf */
    size_t ocap;                   /* capacity of obuf */
    size_t osent;                  /* bytes of obuf written to the socket */
    size_t nsent;                  /* ops whose frames are fully written */
    size_t nwait;                  /* ops sent and not done */
    int in_flight;                 /* sent and not yet waited for */
    struct kvc_batch *prev, *next; /* the connection's batches (orphaned when it closes) */
};

struct kvc_conn {
    kvc__diag diag;            /* log callback and last error; pools point here */
    kvc__complete_fn complete; /* handles every reply (set by kvc__conn_alloc's caller) */
    int fd;                    /* socket, -1 when disconnected */
    char path[108];            /* socket path */
    char name[65];             /* client_name */
    uint8_t *token;            /* copy of the token, or NULL */
    size_t token_len;          /* its bytes */
    int timeout_ms;            /* per call; < 0 forever */
    uint64_t session_id;       /* from HelloReply */
    char tenant[128];          /* from HelloReply */
    uint64_t epoch;            /* boot epoch from HelloReply; 0 before */
    uint32_t max_frame;        /* daemon's max_frame_bytes */
    uint32_t max_inflight;     /* daemon's max_inflight */
    uint32_t max_blocks;       /* daemon's max_blocks_per_request */
    uint32_t features;         /* HelloReply.features: KV_FEATURE_* the daemon takes */
    uint64_t next_id;          /* next envelope id */
    int broken;                /* transport failed: reconnect before the next call */
    uint8_t *rbuf;             /* received bytes not yet decoded */
    size_t rlen;               /* bytes in rbuf */
    size_t rcap;               /* capacity of rbuf */
    int fdq[KVC__FDQ_CAP];     /* received fds, FIFO */
    size_t fdq_head;           /* index of the oldest */
    size_t fdq_len;            /* fds queued */
    kvc_pool *pools;           /* attached pools (opaque here: client/map.h links them) */
    kvc_batch *batches;        /* its batches (kvc__batch_init links them) */
    kvc_batch *active;         /* batch sent and not yet waited for */
    kvc_batch *later;          /* kvc_release_deferred's Releases not yet sent, or NULL */
    uint64_t later_dial;       /* dials when they were queued (an older dial: drop them) */
    uint64_t dials;            /* sockets connected so far */
    kv_err later_err;          /* first deferred Release the daemon refused since kvc_flush */
    uint64_t later_failed;     /* deferred Releases refused, all told */
    char later_msg[160];       /* later_err's message */
    kv_arena arena;            /* one reply at a time is unpacked into it */
};

/* Makes a disconnected connection from opts (NULL: kvc_options_init's defaults) whose replies
 * go to complete. KV_ETOOBIG when the socket path does not fit (logged through opts->log),
 * KV_ENOMEM. *out gets it on success; free with kvc__conn_free. */
kv_err kvc__conn_alloc(const kvc_options *opts, kvc__complete_fn complete, kvc_conn **out);

/* Closes the socket and frees c and its buffers; accepts NULL. Whatever the layers above hang
 * off c (pools) must be gone first. */
void kvc__conn_free(kvc_conn *c);

/* Connects the socket to c->path (blocking connect; then a receive timeout of RECV_SLICE_MS for the
 * blocking waits, and MSG_DONTWAIT on every other send and recv) and clears broken. KV_ESYS with
 * the last error set when that fails. Hello is the caller's. */
kv_err kvc__conn_dial(kvc_conn *c);

/* Marks the connection broken (closes the socket, drops queued fds and input). */
void kvc__conn_break(kvc_conn *c);

/* Appends an op with the envelope env (id and epoch assigned here; Hello goes with epoch 0) to
 * b. KV_ETOOBIG when the frame is larger than the daemon accepts, KV_ESTATE when b was sent and
 * not waited for, KV_ENOMEM. *op gets the new op (valid until the next add). */
kv_err kvc__batch_add(kvc_batch *b, kvc__op_kind kind, Kvd__Envelope *env, kvc__op **op);

/* Initialises / finalises a batch living in caller storage (synchronous calls). Finalising a
 * batch that was sent and not waited for breaks the connection (its replies would confuse the
 * next call). fini accepts NULL. */
void kvc__batch_init(kvc_batch *b, kvc_conn *c);
void kvc__batch_fini(kvc_batch *b);

/* Sends the unsent ops of b and, with wait, reads until every op is done, handing each reply to
 * c->complete. Transport errors break the connection and are returned (every op not done gets
 * that status); op statuses hold per-request results. */
kv_err kvc__exchange(kvc_batch *b, int wait);

#endif
