/* kvd_metrics: Prometheus text exposition on an optional HTTP port (metrics-port; off by
 * default; binds metrics-address, 127.0.0.1 unless configured). Paths: /metrics (the numbers of
 * admin `stats`, rendered from the same object), /healthz (200 when the loop thread answers),
 * /readyz (200 when listening and not draining).
 *
 * libmicrohttpd serves HTTP on its own thread. That thread never touches kvd state: it posts the
 * request to the loop thread (uv_async) and waits on a condition variable for the rendered
 * answer, with a deadline, so a stuck loop shows as a failing /healthz instead of a hang.
 */
#ifndef KVD_METRICS_H
#define KVD_METRICS_H

#include <stdint.h>
#include <stdio.h>

#include <jansson.h>

#include "common/kv_err.h"
#include "daemon/ops/ops.h"

typedef struct kvd_metrics kvd_metrics;

/* Starts the HTTP endpoint when metrics-port is not 0. KV_ESYS when the port cannot be bound
 * (logged). Loop thread, from kvd_server_start. */
kv_err kvd_metrics_start(kvd_ops *o);

/* Stops the HTTP thread (joins it) and closes the async handle. Idempotent; loop thread. */
void kvd_metrics_stop(kvd_ops *o);

/* Frees the state after the loop closed its handles. Accepts a server without metrics. */
void kvd_metrics_free(kvd_ops *o);

/* Writes the Prometheus text exposition (format 0.0.4) of a `stats` object (kvd_admin_stats)
 * plus build info. Pure function of its input; any thread. KV_EINVAL when st lacks a part. */
kv_err kvd_metrics_render(const json_t *st, const char *version, FILE *out);

#endif
