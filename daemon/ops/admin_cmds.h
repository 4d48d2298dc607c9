/* kvd_admin_cmds: the admin commands, as ONE table that drives dispatch, `help` and
 * docs/ADMIN.md, and the command line they run from (a line of the admin socket, or a test's
 * string). Replies are JSON objects: {"ok":true,"result":...} or
 * {"ok":false,"error":{"code":"ENOENT","errno":4,"message":"..."}}. Loop thread only.
 */
#ifndef KVD_ADMIN_CMDS_H
#define KVD_ADMIN_CMDS_H

#include <stdio.h>

#include <jansson.h>

#include "common/kv_err.h"
#include "common/kv_stat.h"
#include "daemon/ops/ops.h"

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
    kv_err (*run)(kvd_ops *o, int argc, char **argv, json_t **out, char *msg);
} kvd_admin_cmd;

/* The table; *n gets its length. Static storage; any thread. */
const kvd_admin_cmd *kvd_admin_cmds(size_t *n);

/* Runs one command line and returns the reply object (a new reference; never NULL except on
 * out of memory). What an admin connection does per line; tests call it directly. */
json_t *kvd_admin_execute(kvd_ops *o, const char *line);

/* An error reply object for code and msg; bytes of msg that are not printable ASCII become '?'
 * when jansson refuses the message. */
json_t *kvd_admin_error(kv_err code, const char *msg);

/* The tables of the `stats` sections besides the pools' (kvd_pool_stat_descs): the daemon's and
 * a tenant's (common/kv_stat.h). Static storage. */
const kv_stat_desc *kvd_admin_daemon_stats(size_t *n);
const kv_stat_desc *kvd_admin_tenant_stats(size_t *n);
/* A pool's eviction duel (the `duel` section of `stats`: one row per pool that has one). */
const kv_stat_desc *kvd_admin_duel_stats(size_t *n);

/* The `stats` result: daemon, pools and tenants sections (what the metrics endpoint renders). */
json_t *kvd_admin_stats(kvd_ops *o);

/* Whether kvd is ready for workers: listening and not draining (admin `ready`, /readyz). */
int kvd_ops_ready(const kvd_ops *o);

/* Writes docs/ADMIN.md: every command of the table with its synopsis and paragraph, and kvctl's
 * exit codes (kvd --print-admin-doc). */
void kvd_admin_write_doc(FILE *f);

#endif
