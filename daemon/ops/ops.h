/* kvd_ops: what the operator's tools (the admin socket and its commands, the metrics endpoint,
 * the isolation self-test) work on. The daemon's assembly (daemon/app) fills it; the tools read
 * the layers below through it and never see the assembly. Loop thread only.
 */
#ifndef KVD_OPS_H
#define KVD_OPS_H

#include <stdint.h>

#include <uv.h>

#include "daemon/config/config.h"
#include "daemon/net/server.h"
#include "daemon/kvevents/kvevents.h"
#include "daemon/registry/registry.h"

typedef struct kvd_ops {
    kvd_config *cfg;             /* the daemon's live options: `config set` writes runtime ones */
    uv_loop_t *loop;             /* the one loop */
    kvd_registry *reg;           /* pools, tenants, quotas, events */
    kvd_server *srv;             /* connections, sessions, draining */
    kvd_tiers *tiers;            /* the pools' lower tiers (stats; NULL: none) */
    kvd_kvevents *kvevents;      /* KV-event publishers (stats; NULL: none) */
    uint64_t boot_epoch;         /* this run's */
    uint64_t start_unix_ms;      /* wall clock at start */
    uint64_t start_loop_ms;      /* loop clock at start (uptime base) */
    char admin_path[108];        /* the admin socket in use ("" before the admin starts) */
    uint16_t metrics_port;       /* the metrics endpoint's port (0: off) */
    struct kvd_admin *admin;     /* the admin socket (daemon/ops/admin.h); NULL before start */
    struct kvd_metrics *metrics; /* the metrics endpoint (daemon/ops/metrics.h); NULL when off */
} kvd_ops;

#endif
