/* kvd_admin: the admin socket. A Unix stream socket separate from the client socket, with a
 * line protocol that works by hand (`socat - UNIX-CONNECT:admin.sock`): one command per line,
 * one reply per line, each reply a JSON object: {"ok":true,"result":...} or
 * {"ok":false,"error":{"code":"ENOENT","errno":4,"message":"..."}}.
 *
 * Access: the socket file gets admin-socket-mode (and admin-group as its group when set), and
 * every peer is checked again by SO_PEERCRED/SO_PEERGROUPS at accept: root, kvd's own uid, or a
 * member of admin-group; anyone else gets one EPERM error line and is closed.
 *
 * Commands come from ONE table (daemon/ops/admin_cmds.h) that drives dispatch, `help` and
 * docs/ADMIN.md. Everything runs on the loop thread: a command sees the same state as the
 * request handlers, without locks. JSON is built with jansson (escaping done by the library).
 */
#ifndef KVD_ADMIN_H
#define KVD_ADMIN_H

#include "common/kv_err.h"
#include "daemon/ops/ops.h"

typedef struct kvd_admin kvd_admin;

/* Binds the admin socket (admin-socket, or admin.sock beside the client socket) and starts
 * accepting; fills o->admin and o->admin_path. KV_ESYS / KV_EINVAL / KV_EEXIST / KV_ENOENT (a
 * missing directory) (logged). Loop thread, after the client socket is bound. */
kv_err kvd_admin_start(kvd_ops *o);

/* Stops accepting and closes every admin connection (handles close asynchronously). Idempotent;
 * loop thread. */
void kvd_admin_stop(kvd_ops *o);

/* Frees the admin state after the loop has closed its handles. Accepts ops without one. */
void kvd_admin_free(kvd_ops *o);

#endif
