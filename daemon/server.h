/* kvd_server: the serving daemon. One libuv loop thread owns every piece of state (pools,
 * index, tenants, sessions, connections); there are no locks. Sockets are non-blocking and
 * watched with uv_poll_t; the server does its own recvmsg/sendmsg so one frame can carry many
 * fds (SCM_RIGHTS on the sendmsg holding the frame's first byte, proto/PROTOCOL.md §2.2).
 * Each connection has an input buffer (at most one frame plus a read's worth) and a bounded
 * output queue of encoded frames with their fds.
 */
#ifndef KVD_SERVER_H
#define KVD_SERVER_H

#include <stdint.h>

#include <uv.h>

#include "common/kv_err.h"
#include "daemon/config.h"

typedef struct kvd_server kvd_server;

/* Creates the server's state (index, tenants file, boot epoch) on loop; listens nothing yet.
 * Copies cfg. KV_ESYS (tenants file unreadable, getrandom), KV_EINVAL (bad tenants file or
 * options), KV_ENOMEM; the reason is logged. Loop thread. */
kv_err kvd_server_alloc(const kvd_config *cfg, uv_loop_t *loop, kvd_server **out);

/* Creates the socket directory if needed, binds and listens, and starts watching. With
 * handle_signals, SIGTERM and SIGINT stop the server. Also arms an async handle so
 * kvd_server_stop_async works. KV_ESYS / KV_EEXIST (another kvd answers on the socket);
 * logged. After an error call kvd_server_stop then run the loop to close what was opened. */
kv_err kvd_server_start(kvd_server *s, int handle_signals);

/* Stops: no more accepts, flushes what each connection has queued (without blocking), closes
 * every connection (releasing every session), unlinks the socket and closes every handle, so
 * uv_run returns. Idempotent. Loop thread. */
void kvd_server_stop(kvd_server *s);

/* kvd_server_stop from any thread (uv_async_send). Only between start and stop. */
void kvd_server_stop_async(kvd_server *s);

/* Frees the pools and everything else; call after uv_run returned (handles closed). Accepts
 * NULL. */
void kvd_server_free(kvd_server *s);

/* The socket path in use (after start) and the boot epoch. */
const char *kvd_server_socket_path(const kvd_server *s);
uint64_t kvd_server_boot_epoch(const kvd_server *s);

#endif
