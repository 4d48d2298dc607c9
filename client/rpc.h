/* rpc: libkvclient's requests and the session they run in.
 *
 * This module encodes every request into a batch (client/conn.h), completes every reply
 * (kvc__op_complete, the completion function kvc_conn_open installs in the connection), keeps
 * the session (Hello on open and on reconnect, the epoch check) and defines the public request
 * calls of kvclient.h (kvc_conn_open/close/reconnect, kvc_lookup ... kvc_stats, kvc_batch_*).
 * Replies change pool records (client/map.h): geometry and links at attach, segments mapped,
 * need_map when a reply announces segments this client lacks. The public pool calls are
 * client/pool.c's, on top of this.
 * Threads: the connection's (see kvclient.h).
 */
#ifndef KVC_RPC_H
#define KVC_RPC_H

#include <stddef.h>
#include <stdint.h>

#include "client/conn.h"

/* Handles the reply envelope env for op and returns the op's status (a kvc__complete_fn).
 * fds[0..nfds) are the fds the frame carried, in fd_index order (borrowed: the caller closes
 * them). An Error reply gives its code; a reply of the wrong type or one that contradicts the
 * request is KV_EPROTO ("malformed reply"), with the last error set. */
kv_err kvc__op_complete(kvc_conn *c, kvc__op *op, const Kvd__Envelope *env, const int *fds,
                        size_t nfds);

/* Before a call: KV_ESTATE while a batch is in flight; reconnects (new Hello) if the previous
 * call broke the connection, KV_EEPOCH when the daemon restarted meanwhile. */
kv_err kvc__rpc_ready(kvc_conn *c);

/* Sends AttachPool for p (on p->conn, synchronously) and completes it into p: geometry, links
 * (linked pool records, not yet mapped), the first segments; sets p->need_map when more follow.
 * Returns the transport's or the request's error; p is then only fit for kvc__pool_destroy. */
kv_err kvc__rpc_attach(kvc_pool *p, const char *model_id, const kv_layout *layout);

/* When p->need_map is set: fetches (MapSegments, synchronously) and maps every live segment from
 * p's first hole on, then clears it. KV_OK when nothing was needed. */
kv_err kvc__rpc_map_new(kvc_pool *p);

/* Fetches and maps every segment of p with index >= from (MapSegments until a short reply).
 * need_map stays set when it fails. */
kv_err kvc__rpc_map_from(kvc_pool *p, uint32_t from);

/* DetachPool for p (best effort: nothing to do when its session is gone). */
kv_err kvc__rpc_detach(kvc_pool *p);

#endif
