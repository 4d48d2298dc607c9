/* kvd_server's internals: connections and their buffers. Private to daemon/net (server.c) and
 * its white-box tests. Loop thread only.
 */
#ifndef KVD_SERVER_INT_H
#define KVD_SERVER_INT_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "common/kv_arena.h"
#include "daemon/net/server.h"
#include "daemon/session/session.h"

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
    size_t charged;                     /* in_cap + out_bytes as counted in srv->buf_bytes */
    int paused;                         /* not read: over max-buffer-bytes, large backlog */
    uint64_t partial_since;             /* loop ms since an incomplete frame waits; 0: none */
    int later;                          /* a deferred reply was queued: later_check writes it */
    struct kvd_conn *prev, *next;       /* the server's connection list */
} kvd_conn;

struct kvd_server {
    const kvd_config *cfg;      /* the daemon's live options */
    uv_loop_t *loop;            /* the one loop */
    kvd_registry *reg;          /* for the handlers */
    uint64_t boot_epoch;        /* random, non-zero */
    void (*on_stopped)(void *); /* told when stopped */
    void *on_stopped_arg;
    char sock_path[108];      /* sun_path in use */
    int listen_fd;            /* -1 before start */
    uv_poll_t listen_poll;    /* accept readiness */
    int listen_active;        /* listen_poll initialised and not closed */
    uv_timer_t frame_timer;   /* sweeps connections for frames not completed in time */
    int timer_active;         /* frame_timer initialised and not closed */
    uv_check_t later_check;   /* the loop iteration's end: deferred replies queued in it go out */
    int later_active;         /* later_check initialised and not closed */
    uv_timer_t linger_timer;  /* cuda-ipc stop: waits for sessions (shutdown-grace-ms) */
    int linger_active;        /* linger_timer initialised and not closed */
    int lingering;            /* kvd_server_stop is waiting for sessions to close */
    uint64_t linger_start;    /* loop ms it began */
    int stopping;             /* stopped, or stopping now */
    int bound;                /* socket file is ours to unlink */
    int draining;             /* admin `drain`: a new Hello gets KV_EDRAINING */
    uint64_t next_session_id; /* next session id */
    kvd_conn *conns;          /* open connections */
    kvd_conn_counts counts;   /* connections, buffer bytes, paused (Stats, admin) */
    uint64_t log_window_ms;   /* start of the protocol-error log window */
    uint32_t log_in_window;   /* protocol errors logged in the window */
    uint64_t log_suppressed;  /* protocol errors not logged since the last one */
    kv_arena req_arena;       /* the request being handled is unpacked here; reset after it */
    kvd_tiers *tiers;         /* lower tiers (NULL: none) */
    kvd_kvevents *kvevents;   /* KV-event publishers (NULL: none) */
    kvd_rpc_later later;      /* how a Fetch's reply finds its connection later */
};

#endif
