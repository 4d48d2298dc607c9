/* kvd_admin: the admin socket. A Unix stream socket separate from the client socket, with a
 * line protocol that works by hand (`socat - UNIX-CONNECT:admin.sock`): one command per line,
 * one reply per line, each reply a JSON object: {"ok":true,"result":...} or
 * {"ok":false,"error":{"code":"ENOENT","errno":4,"message":"..."}}.
 *
 * Access: the socket file gets admin-socket-mode (and admin-group as its group when set), and
 * every peer is checked again by SO_PEERCRED/SO_PEERGROUPS at accept: root, kvd's own uid, or a
 * member of admin-group; anyone else gets one EPERM error line and is closed.
 *
 * Commands come from ONE table (admin_cmds.c) that drives dispatch, `help` and docs/ADMIN.md.
 * Everything runs on the loop thread: a command sees the same state as the request handlers,
 * without locks. JSON is built with jansson (escaping done by the library).
 */
#ifndef KVD_ADMIN_H
#define KVD_ADMIN_H

#include <stdio.h>

#include <jansson.h>

#include "common/kv_err.h"

typedef struct kvd_server kvd_server;
typedef struct kvd_admin kvd_admin;

#define KVD_ADMIN_LINE_MAX 4096 /* longest command line; longer gets ETOOBIG and a close */
#define KVD_ADMIN_MSG 256       /* bytes of an error message */

/* One admin command: a row of the table. */
typedef struct kvd_admin_cmd {
    const char *name;    /* one or two words: "stats", "config set" */
    const char *args;    /* argument synopsis for help and docs ("" for none) */
    const char *summary; /* one line */
    const char *doc;     /* a paragraph for docs/ADMIN.md: reply fields, errors */
    /* Runs the command with the words after the name. On success stores the result in *out
     * (a new reference). On error writes msg (KVD_ADMIN_MSG bytes). Loop thread. */
    kv_err (*run)(kvd_server *s, int argc, char **argv, json_t **out, char *msg);
} kvd_admin_cmd;

/* The table; *n gets its length. Static storage; any thread. */
const kvd_admin_cmd *kvd_admin_cmds(size_t *n);

/* Binds the admin socket (admin-socket, or admin.sock beside the client socket) and starts
 * accepting. KV_ESYS / KV_EINVAL / KV_EEXIST (logged). Loop thread, from kvd_server_start. */
kv_err kvd_admin_start(kvd_server *s);

/* Stops accepting and closes every admin connection (handles close asynchronously). Idempotent;
 * loop thread, from kvd_server_stop. */
void kvd_admin_stop(kvd_server *s);

/* Frees the admin state after the loop has closed its handles. Accepts a server without one. */
void kvd_admin_free(kvd_server *s);

/* The admin socket path in use (after start); "" when not started. */
const char *kvd_admin_socket_path(const kvd_server *s);

/* Runs one command line and returns the reply object (a new reference; never NULL except on
 * out of memory). What a connection does per line; tests call it directly. Loop thread. */
json_t *kvd_admin_execute(kvd_server *s, const char *line);

/* The `stats` result: daemon, per pool and per tenant counters. The metrics endpoint renders
 * these same numbers. NULL on out of memory. Loop thread. */
json_t *kvd_admin_stats(kvd_server *s);

/* Whether kvd is ready for workers: listening, not draining, not stopping. */
int kvd_admin_ready(const kvd_server *s);

/* Writes docs/ADMIN.md (generated from the table; admin_doc_test compares). Any thread. */
void kvd_admin_write_doc(FILE *f);

#endif
