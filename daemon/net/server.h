/* kvd_server: the client socket, its connections and their byte streams.
 *
 * Listens on the socket (`socket`, default under $XDG_RUNTIME_DIR or /tmp/kvd-UID), accepts
 * within max-connections, reads frames (max-frame-bytes, frame-timeout-ms), decodes requests,
 * hands each to the handlers (daemon/proto/rpc.h) and queues the encoded reply they return,
 * with its fds, in a per-connection output queue written as the socket takes it. Flow control:
 * a connection is not read while it has max-inflight unsent replies; above max-buffer-bytes over
 * all connections the largest backlogs are paused; past max-output-bytes a connection that does
 * not read is closed. A closed connection's session is released through the handlers, whatever
 * the reason. It knows the registry only to hand it to the handlers, and the backend's kind for
 * the cuda-ipc shutdown wait. Loop thread only, except where noted.
 */
#ifndef KVD_SERVER_H
#define KVD_SERVER_H

#include <stdint.h>

#include <uv.h>

#include "common/kv_err.h"
#include "daemon/config/config.h"
#include "daemon/proto/rpc.h"
#include "daemon/registry/registry.h"
#include "daemon/session/session.h"

typedef struct kvd_server kvd_server;

typedef struct kvd_server_deps {
    const kvd_config *cfg;         /* the daemon's live options (read at each use) */
    uv_loop_t *loop;               /* the one loop */
    kvd_registry *reg;             /* pools for the handlers */
    uint64_t boot_epoch;           /* this run's, non-zero */
    void (*on_stopped)(void *arg); /* called once when the server has stopped (after the
                                      cuda-ipc wait); may be NULL */
    void *on_stopped_arg;
    kvd_tiers *tiers;       /* the lower tiers for the handlers; NULL: none */
    kvd_kvevents *kvevents; /* KV-event publishers for the handlers; NULL: none */
} kvd_server_deps;

/* KV_ENOMEM. */
kv_err kvd_server_alloc(const kvd_server_deps *d, kvd_server **out);

/* Binds and listens on the socket (creating its directory; a stale socket file nobody answers
 * on is replaced, a live one is KV_EEXIST), starts the frame-timeout sweep. KV_ESYS, KV_EPERM
 * (someone else's socket directory), KV_EINVAL (path too long). */
kv_err kvd_server_start(kvd_server *s);

/* Stops accepting, unlinks the socket, writes what each connection has queued as far as its
 * socket takes it, and closes every connection (releasing sessions). A cuda-ipc daemon with
 * sessions open first waits up to shutdown-grace-ms for them to close (docs/GPU.md). Calls
 * on_stopped when done. Idempotent. */
void kvd_server_stop(kvd_server *s);

/* After the loop ran every close callback. Accepts NULL. */
void kvd_server_free(kvd_server *s);

const char *kvd_server_socket_path(const kvd_server *s);

/* 1 while the socket accepts (admin `ready`: also not draining). */
int kvd_server_listening(const kvd_server *s);

/* Admin `drain`: a new Hello gets KV_EDRAINING while on. */
int kvd_server_draining(const kvd_server *s);
void kvd_server_set_draining(kvd_server *s, int on);

/* Connections, buffer bytes and paused connections now (live; do not keep across the loop). */
const kvd_conn_counts *kvd_server_counts(const kvd_server *s);

/* fn(arg, session) for each open connection's session (admin `sessions`). fn must not close
 * connections. */
void kvd_server_each_session(const kvd_server *s, void (*fn)(void *arg, const kvd_session *sess),
                             void *arg);

/* A session id no connection has (the isolation self-test's in-process sessions). */
uint64_t kvd_server_take_session_id(kvd_server *s);

#endif
