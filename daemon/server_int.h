/* kvd server internals shared by server.c (connections, I/O) and handlers.c (one function per
 * request). Not an interface for other modules. Loop thread only.
 */
#ifndef KVD_SERVER_INT_H
#define KVD_SERVER_INT_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "common/kv_arena.h"
#include "common/kv_layout.h"
#include "daemon/backend_cuda.h"
#include "daemon/backend_host.h"
#include "daemon/config.h"
#include "daemon/events.h"
#include "daemon/index.h"
#include "daemon/pool.h"
#include "daemon/server.h"
#include "daemon/session.h"
#include "daemon/tenant.h"
#include "daemon/validate.h"
#include "proto/kvd.pb-c.h"

#define KVD_MAX_FDS_PER_FRAME 200        /* segments (fds) per reply */
#define KVD_MAX_BLOCKS_PER_SEGMENT 65536 /* caps metadata per segment for tiny blocks */
#define KVD_ERRMSG 256                   /* bytes of an Error message */

/* A run of encoded replies waiting to be written: replies without fds are appended to the
 * queue's last chunk, so the replies to one read leave in one sendmsg with no malloc each. A
 * reply with fds starts a chunk of its own (its fds ride with its first byte). */
typedef struct kvd_out_frame {
    struct kvd_out_frame *next; /* queue link */
    uint8_t *buf;               /* whole frames back to back, headers included */
    size_t len, off;            /* bytes and bytes already written */
    size_t cap;                 /* bytes allocated for buf */
    uint32_t nreplies;          /* replies in buf (flow control counts them until all sent) */
    int *fds;                   /* dup'd fds sent with the first byte; closed once sent */
    uint32_t nfds;              /* entries of fds still owned */
} kvd_out_frame;

typedef struct kvd_conn {
    kvd_server *srv;                    /* owner */
    uv_poll_t poll;                     /* readiness of fd; freed in its close callback */
    int fd;                             /* the client socket, non-blocking */
    int events;                         /* events the poll watches now */
    int closing;                        /* uv_close called */
    int close_after_flush;              /* close once the output queue is empty */
    kvd_session sess;                   /* identity and references */
    uint8_t *in;                        /* input buffer */
    size_t in_off, in_len, in_cap;      /* consumed offset, filled bytes, capacity */
    kvd_out_frame *out_head, *out_tail; /* output queue */
    size_t out_frames, out_bytes;       /* queued replies not fully written, unsent bytes */
    kvd_out_frame *out_spare;           /* a written chunk kept for reuse, or NULL */
    uint32_t features;                  /* Hello.features & what kvd has (KV_FEATURE_*) */
    size_t charged;                     /* in_cap + out_bytes as counted in srv->buf_bytes */
    int paused;                         /* not read: over max-buffer-bytes, large backlog */
    uint64_t partial_since;             /* loop ms since an incomplete frame waits; 0: none */
    struct kvd_conn *prev, *next;       /* the server's connection list */
} kvd_conn;

/* One pool the server keeps: key (model_id, layout shape, domain) -> kvd_pool. */
typedef struct kvd_srv_pool {
    uint32_t pool_id;                           /* > 0 */
    char model_id[KVD_MAX_MODEL_ID + 1];        /* NUL-terminated */
    kv_layout layout;                           /* shape (derived fields filled) */
    uint32_t domain;                            /* the owner tenant's private domain (tenant id) */
    uint64_t segment_bytes;                     /* bytes of one segment's memory */
    uint64_t seg_cost;                          /* what a new segment costs the budget: its
                                                   memory and its block records */
    kv_hash128 seed;                            /* hash_seed sent to clients */
    kvd_pool *pool;                             /* owned */
    uint32_t links[KVD_MAX_DOMAINS_PER_TENANT]; /* private pool: pool ids of the same model in
                                                   the tenant's other domains, lookup order */
    uint32_t nlinks;                            /* used entries of links */
    uint32_t commons_id;                        /* pool id of the same model's commons; 0 none */
    uint32_t creator;                           /* tenant whose attach created it (max-pools) */
    uint32_t nsessions;                         /* sessions that attached it (or it as a link) */
} kvd_srv_pool;

struct kvd_server {
    kvd_config cfg;              /* copy of the options */
    uv_loop_t *loop;             /* the one loop */
    uint64_t boot_epoch;         /* random, non-zero */
    char sock_path[108];         /* sun_path in use */
    int listen_fd;               /* -1 before start */
    uv_poll_t listen_poll;       /* accept readiness */
    int listen_active;           /* listen_poll initialised and not closed */
    uv_signal_t sigterm, sigint; /* stop on SIGTERM/SIGINT */
    int signals_active;          /* signal handles initialised and not closed */
    uv_async_t stop_async;       /* kvd_server_stop_async */
    int async_active;            /* stop_async initialised and not closed */
    uv_timer_t frame_timer;      /* sweeps connections for frames not completed in time */
    int timer_active;            /* frame_timer initialised and not closed */
    uv_timer_t linger_timer;     /* cuda-ipc stop: waits for sessions (shutdown-grace-ms) */
    int linger_active;           /* linger_timer initialised and not closed */
    int lingering;               /* kvd_server_stop is waiting for sessions to close */
    uint64_t linger_start;       /* loop ms it began */
    int stopping;                /* kvd_server_stop ran */
    int bound;                   /* socket file is ours to unlink */
    kvd_index *index;            /* the one prefix index */
    kvd_tenants *tenants;        /* peer credentials -> tenant */
    kvd_backend_host_ctx host;   /* host backend options */
    const kvd_backend_ops *be;   /* segment memory */
    void *be_ctx;                /* be's ctx: &host or the GPU backend's (backend_sel) */
    kvd_backend_sel backend_sel; /* the backend chosen at start (daemon/server_backend.h) */
    kvd_srv_pool *pools;         /* live pools */
    uint32_t npools, pools_cap;  /* used and allocated entries */
    uint32_t next_pool_id;       /* next pool id to hand out */
    uint64_t next_session_id;    /* next session id */
    kvd_conn *conns;             /* open connections */
    uint32_t nconns;             /* entries of conns */
    uint64_t log_window_ms;      /* start of the protocol-error log window */
    uint32_t log_in_window;      /* protocol errors logged in the window */
    uint64_t log_suppressed;     /* protocol errors not logged since the last one */
    struct kvd_commons *commons; /* tenancy: commits counted toward the commons; lazy */
    kvd_events events;           /* admin: eviction/refusal ring and per-tenant counters */
    struct kvd_admin *admin;     /* admin socket (daemon/admin.h); NULL before start */
    struct kvd_metrics *metrics; /* Prometheus endpoint (daemon/metrics.h); NULL when off */
    int draining;                /* admin `drain`: a new Hello gets KV_EDRAINING */
    uint64_t start_unix_ms;      /* wall-clock time of kvd_server_alloc */
    uint64_t start_loop_ms;      /* uv_now at kvd_server_alloc (uptime base) */
    kv_arena req_arena;          /* the request being handled is unpacked here; reset after it */
    uint64_t buf_bytes;          /* input capacity + unsent output bytes over all connections */
    uint32_t npaused;            /* connections paused by max-buffer-bytes */
};

/* Queues env as a frame with fds[0..nfds) (dup'd here; the caller keeps its fds). A queue above
 * max-output-bytes marks the connection to close (the client does not read). KV_ENOMEM. */
kv_err kvd_conn_send(kvd_conn *c, const Kvd__Envelope *env, const int *fds, uint32_t nfds);

/* Scratch memory for the request being handled (the server's request arena): valid until the
 * handler returns, never freed by the caller. NULL when out of memory. Loop thread. */
void *kvd_conn_scratch(kvd_conn *c, size_t size);

/* Queues an Error reply for request id with code and a message. */
void kvd_conn_send_error(kvd_conn *c, uint64_t id, kv_err code, const char *msg);

/* Logs a protocol error of c, rate-limited, with a hex sample of the offending bytes. */
void kvd_conn_log_proto(kvd_conn *c, const char *what, const uint8_t *bytes, size_t len);

/* Handles one decoded request (envelope checks, dispatch, reply or Error). */
void kvd_handle_request(kvd_conn *c, const Kvd__Envelope *env);

/* Frees every pool (after every session is released). */
void kvd_handlers_free_pools(kvd_server *s);

/* Tenancy's access to the pool registry (handlers.c). budget_apply: sets sp's segment limit from
 * the shared budget, returns segments it may still add. pool_by_id: NULL when unknown (pointers
 * move when a pool is opened). pool_open: finds or creates (model, layout, domain); msg as the
 * handlers'. pool_close: frees a pool no session has attached (the isolation self-test's). */
uint32_t kvd_handlers_budget_apply(kvd_server *s, kvd_srv_pool *sp);
kvd_srv_pool *kvd_handlers_pool_by_id(kvd_server *s, uint32_t id);
kv_err kvd_handlers_pool_open(kvd_server *s, const char *model_id, const kv_layout *l,
                              uint32_t domain, kvd_srv_pool **out, char *msg);
void kvd_handlers_pool_close(kvd_server *s, uint32_t pool_id);

/* A session is closing: its pools lose a session, and pools no session uses that hold nothing
 * (no WRITING, COMMITTED or CACHED block) are freed. Call after the session released everything
 * (kvd_session_fini); pool_ids are the pools it had attached. */
void kvd_handlers_sessions_gone(kvd_server *s, const uint32_t *pool_ids, uint32_t n);

#endif
