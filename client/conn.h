/* conn: libkvclient's internal view of a connection, a pool and a pending request.
 *
 * One kvc_conn owns a non-blocking Unix socket, an input buffer that frames are decoded from,
 * the FIFO of file descriptors received with SCM_RIGHTS, and the list of attached pools. The
 * I/O engine (kvc__conn_exchange) writes a run of encoded requests and reads replies with
 * poll(), matching each reply to its request by envelope id, so synchronous calls are a batch
 * of one. Internal names are kvc__*; nothing here is exported (-fvisibility=hidden).
 * Threads: whatever thread owns the connection (see kvclient.h).
 */
#ifndef KVC_CONN_H
#define KVC_CONN_H

#include <stddef.h>
#include <stdint.h>

#include "client/include/kvclient.h"
#include "proto/kvd.pb-c.h"

#define KVC__FDQ_CAP 512    /* received fds not yet claimed by a frame */
#define KVC__REPLY_SLACK 64 /* replies may exceed max_frame_bytes by this much */

/* One mapped segment of a pool. */
typedef struct kvc__segment {
    uint8_t *base;    /* whole-segment mapping, NULL when not mapped */
    uint64_t bytes;   /* mapped length */
    uint32_t nblocks; /* blocks in the segment */
    int read_only;    /* mapped PROT_READ */
} kvc__segment;

struct kvc_pool {
    kvc_conn *conn;                /* owning connection */
    kvc_pool *next;                /* conn's list of pools */
    uint32_t pool_id;              /* daemon's id */
    kv_layout layout;              /* derived fields filled by kv_layout_init */
    uint32_t blocks_per_segment;   /* from AttachPoolReply */
    uint32_t max_segments;         /* capacity of segs[] and of the layer ranges */
    uint32_t nsegs;                /* highest mapped index + 1 (slots below may be unmapped) */
    kvc__segment *segs;            /* [max_segments] */
    uint8_t **layer_base;          /* LAYER_MAJOR: [num_layers * 2] reserved ranges, else NULL */
    uint64_t layer_range_bytes;    /* bytes reserved per (layer, kv) range */
    kv_hash128 seed;               /* hash chain seed */
    int hash_algo;                 /* kv_hash_algo */
    uint64_t epoch;                /* boot epoch it was attached under */
    uint64_t session;              /* session it was attached in; its references die with it */
    int need_map;                  /* a reply announced segments we lack, or handed us a block in
                                      one: MapSegments from our first unmapped slot */
    struct kvc__gpu_pool *gpu;     /* GPU pools: device mappings (client/gpu_map.h); else NULL */
    kvc_pool *owner;               /* linked pool: the attached pool that linked it; else NULL */
    kvc_pool **linked;             /* attached pool: its linked pools in lookup order, or NULL */
    uint32_t nlinked;              /* entries of linked */
    int read_only;                 /* the session may only read this pool (the commons) */
    char domain[136];              /* "group:NAME", "commons", or the tenant (private pool) */
    unsigned char device_uuid[16]; /* GPU pools: the UUID of kvd's GPU (AttachPoolReply) */
    int has_device_uuid;           /* device_uuid was sent */
};

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
} kvc__op_kind;

/* One request in flight: where its frame is, and where its reply's outputs go. */
typedef struct kvc__op {
    uint64_t id;         /* envelope id */
    kvc__op_kind kind;   /* expected reply */
    size_t frame_off;    /* offset of its frame in the batch's output buffer */
    size_t frame_len;    /* bytes of its frame */
    int sent;            /* frame fully written */
    int done;            /* reply handled */
    kv_err status;       /* result once done */
    kvc_pool *pool;      /* pool the request is about, or NULL */
    size_t count;        /* list length sent (hashes, blocks, entries) */
    void *out;           /* caller's output array (kvc_block[], ...) */
    size_t *nout;        /* lookup: hit count */
    kvc_pool **pools;    /* lookup with search_domains: the pool of each hit, else NULL */
    const void *expect;  /* ping: payload to compare */
    size_t expect_len;   /* ping: payload bytes */
    uint64_t nonce;      /* ping nonce */
    kvc_stat_fn stat_fn; /* stats callback */
    void *stat_arg;      /* its argument */
} kvc__op;

/* A queue of encoded requests (also the engine of every synchronous call). */
struct kvc_batch {
    kvc_conn *conn; /* owning connection */
    kvc__op *ops;   /* queued requests */
    size_t nops;    /* queued */
    size_t cap;     /* capacity of ops */
    uint8_t *obuf;  /* encoded frames back to back */
    size_t olen;    /* bytes in obuf */
    size_t ocap;    /* capacity of obuf */
    size_t osent;   /* bytes of obuf written to the socket */
    size_t nsent;   /* ops whose frames are fully written */
    size_t nwait;   /* ops sent and not done */
    int in_flight;  /* sent and not yet waited for */
};

struct kvc_conn {
    int fd;                /* socket, -1 when disconnected */
    char path[108];        /* socket path */
    char name[65];         /* client_name */
    uint8_t *token;        /* copy of the token, or NULL */
    size_t token_len;      /* its bytes */
    kvc_log_fn log;        /* application's log callback */
    void *log_arg;         /* its argument */
    int log_level;         /* threshold */
    int timeout_ms;        /* per call; < 0 forever */
    uint64_t session_id;   /* from HelloReply */
    char tenant[128];      /* from HelloReply */
    uint64_t epoch;        /* boot epoch from HelloReply; 0 before */
    uint32_t max_frame;    /* daemon's max_frame_bytes */
    uint32_t max_inflight; /* daemon's max_inflight */
    uint32_t max_blocks;   /* daemon's max_blocks_per_request */
    uint32_t features;     /* HelloReply.features: KV_FEATURE_* the daemon takes */
    uint64_t next_id;      /* next envelope id */
    int broken;            /* transport failed: reconnect before the next call */
    uint8_t *rbuf;         /* received bytes not yet decoded */
    size_t rlen;           /* bytes in rbuf */
    size_t rcap;           /* capacity of rbuf */
    int fdq[KVC__FDQ_CAP]; /* received fds, FIFO */
    size_t fdq_head;       /* index of the oldest */
    size_t fdq_len;        /* fds queued */
    kvc_pool *pools;       /* attached pools */
    kvc_batch *active;     /* batch sent and not yet waited for */
    uint8_t *arena;        /* bump allocator for unpacking one reply */
    size_t arena_cap;      /* its bytes */
    size_t arena_used;     /* bytes handed out for the current reply */
    void **spill;          /* allocations that did not fit, freed with the arena */
    size_t nspill;         /* entries in spill */
    size_t spill_cap;      /* capacity of spill */
    char err[512];         /* last error message */
};

/* Logs through the application's callback when level is enabled. */
void kvc__log(const kvc_conn *c, int level, const char *id, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Records err's message for kvc_last_error and returns err (for `return kvc__fail(...)`). */
kv_err kvc__fail(kvc_conn *c, kv_err err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Reconnects if the previous call broke the connection; KV_EEPOCH when the daemon changed. */
kv_err kvc__conn_ready(kvc_conn *c);

/* Marks the connection broken (closes the socket, drops queued fds and input). */
void kvc__conn_break(kvc_conn *c);

/* Appends an op with the envelope env (id assigned here) to b. KV_ETOOBIG when the frame is
 * larger than the daemon accepts, KV_ENOMEM. *op gets the new op (valid until the next add). */
kv_err kvc__batch_add(kvc_batch *b, kvc__op_kind kind, Kvd__Envelope *env, kvc__op **op);

/* Initialises / finalises a batch living in caller storage (synchronous calls). */
void kvc__batch_init(kvc_batch *b, kvc_conn *c);
void kvc__batch_fini(kvc_batch *b);

/* Sends the unsent ops of b and, with wait, reads until every op is done. Transport errors
 * break the connection and are returned; op statuses hold per-request results. */
kv_err kvc__exchange(kvc_batch *b, int wait);

/* Handles the reply envelope env for op (rpc.c) and returns the op's status. fds[0..nfds) are
 * the fds the frame carried, in fd_index order (borrowed: the caller closes them). */
kv_err kvc__op_complete(kvc_conn *c, kvc__op *op, const Kvd__Envelope *env, const int *fds,
                        size_t nfds);

/* Maps the segments of a reply (AttachPoolReply or MapSegmentsReply) into p; fds[0..nfds) are
 * the frame's fds (borrowed). KV_EPROTO for an fd_index out of range or a bad segment. */
kv_err kvc__pool_map_reply(kvc_pool *p, Kvd__Segment *const *segs, size_t nsegs, const int *fds,
                           size_t nfds);

/* Maps one segment from fd (borrowed) at index seg with nblocks blocks of bytes bytes. Pure
 * mapping arithmetic, testable with a local memfd. */
kv_err kvc__pool_map_segment(kvc_pool *p, uint32_t seg, int fd, uint64_t bytes, uint32_t nblocks,
                             int read_only);

/* Sets up a pool object's geometry and reserves its layer ranges (no daemon involved). */
kv_err kvc__pool_init_geometry(kvc_pool *p, const kv_layout *layout, uint32_t blocks_per_segment,
                               uint32_t max_segments);

/* Unmaps everything and frees p's arrays (not p itself). */
void kvc__pool_unmap(kvc_pool *p);

/* The lowest segment slot of p that is not mapped (p->nsegs when every slot below it is). A
 * client asks MapSegments from here, never from the slot it happens to need: asking from a
 * higher slot would leave the hole unmapped (PROTOCOL.md §6, Segments a reply hands out). */
uint32_t kvc__pool_first_hole(const kvc_pool *p);

/* When p->need_map is set: fetches (MapSegments, synchronously) and maps every live segment from
 * p's first hole on, then clears it. KV_OK when nothing was needed. */
kv_err kvc__pool_map_new(kvc_pool *p);

/* Fetches and maps every segment of p with index >= from (MapSegments until a short reply). */
kv_err kvc__pool_map_from(kvc_pool *p, uint32_t from);

/* 1 when block's segment of p is mapped and holds the block. */
int kvc__pool_block_mapped(const kvc_pool *p, uint32_t block);

/* Frees p and its linked pools (unmapped, taken off the connection's list). Accepts NULL. */
void kvc__pool_destroy(kvc_pool *p);

#endif
