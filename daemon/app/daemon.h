/* kvd_daemon: the whole daemon, assembled. Owns the live options, the tenants, the memory
 * backend, the registry of pools, the client socket's server, the admin socket and the metrics
 * endpoint, and their start and stop order:
 *   alloc: options checked, boot epoch, tenants file, backend chosen (logged), registry, server;
 *   start: client socket, admin socket, metrics endpoint, signals (optional);
 *   stop:  the server stops (a cuda-ipc daemon first waits for its sessions), then the admin
 *          socket and the metrics endpoint; the loop then runs out;
 *   free:  after uv_run returned: everything, pools and backend last.
 * main.c runs one; the in-process tests run one each on a loop of their own. Loop thread only,
 * except kvd_daemon_stop_async.
 */
#ifndef KVD_DAEMON_H
#define KVD_DAEMON_H

#include <stdint.h>

#include <uv.h>

#include "common/kv_err.h"
#include "daemon/config/config.h"
#include "daemon/net/server.h"
#include "daemon/ops/ops.h"
#include "daemon/registry/registry.h"

typedef struct kvd_daemon kvd_daemon;

/* Checks cfg (KV_EINVAL, logged), copies it, loads the tenants file, chooses the backend (an
 * explicit GPU backend that cannot be had: KV_ENOGPU, logged) and makes the registry and the
 * server. */
kv_err kvd_daemon_alloc(const kvd_config *cfg, uv_loop_t *loop, kvd_daemon **out);

/* Binds the client socket, the admin socket and the metrics port; with handle_signals stops on
 * SIGTERM/SIGINT. On failure call kvd_daemon_stop, run the loop, then kvd_daemon_free. */
kv_err kvd_daemon_start(kvd_daemon *d, int handle_signals);

/* Stops everything; the loop returns once every handle closed. Idempotent. */
void kvd_daemon_stop(kvd_daemon *d);

/* kvd_daemon_stop from any thread (tests). */
void kvd_daemon_stop_async(kvd_daemon *d);

/* After uv_run returned. Accepts NULL. */
void kvd_daemon_free(kvd_daemon *d);

const char *kvd_daemon_socket_path(const kvd_daemon *d);
uint64_t kvd_daemon_boot_epoch(const kvd_daemon *d);

/* The parts, for the operator's tools and white-box tests. */
kvd_ops *kvd_daemon_ops(kvd_daemon *d);
kvd_registry *kvd_daemon_registry(kvd_daemon *d);
const kvd_config *kvd_daemon_config(const kvd_daemon *d);

#endif
