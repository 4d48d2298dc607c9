/* kvd_daemon: the parts of the daemon and their order (daemon/app/daemon.h). */
#include "daemon/app/daemon.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "common/kv_log.h"
#include "common/kv_util.h"
#include "daemon/mem/backend_cuda.h"
#include "daemon/mem/backend_host.h"
#include "daemon/kvevents/kvevents.h"
#include "daemon/tiers/tiers.h"
#include "daemon/ops/admin.h"
#include "daemon/ops/metrics.h"
#include "daemon/tenancy/tenant.h"

struct kvd_daemon {
    kvd_config cfg;              /* the live options (admin `config set` changes runtime ones) */
    uv_loop_t *loop;             /* the one loop */
    uint64_t boot_epoch;         /* random, non-zero */
    kvd_tenants *tenants;        /* peer credentials -> tenant */
    kvd_backend_host_ctx host;   /* host backend options */
    kvd_backend_sel sel;         /* the backend chosen at alloc */
    int sel_open;                /* sel holds a backend to close */
    kvd_registry reg;            /* pools, budget, quotas, events */
    int reg_open;                /* reg initialised */
    kvd_server *srv;             /* the client socket and its connections */
    kvd_tiers *tiers;            /* lower tiers of the pools (T1 host memory, T2 disk) */
    kvd_kvevents *kvevents;      /* KV-event publishers (vLLM's format), NULL: none */
    kvd_ops ops;                 /* what the admin and metrics see */
    uv_signal_t sigterm, sigint; /* stop on SIGTERM/SIGINT */
    int signals_active;          /* signal handles initialised and not closed */
    uv_async_t stop_async;       /* kvd_daemon_stop_async */
    int async_active;            /* stop_async initialised and not closed */
    uv_check_t duel_check;       /* evict-duel: runs a waiting Lookup after each loop turn */
    uv_idle_t duel_idle;         /* active while Lookups wait: the loop polls without blocking */
    int duel_active;             /* duel_check and duel_idle initialised and not closed */
};

static uint64_t loop_clock(void *arg) {
    return uv_now(arg);
}

/* The tiers wrote what they had to at the stop (or had nothing to): the rest goes. */
static void on_tiers_drained(void *arg) {
    kvd_daemon *d = arg;
    if (d->duel_active) {
        d->duel_active = 0;
        uv_close((uv_handle_t *)&d->duel_check, NULL);
        uv_close((uv_handle_t *)&d->duel_idle, NULL);
    }
    kvd_metrics_stop(&d->ops);
    kvd_admin_stop(&d->ops);
    kvd_kvevents_close(d->kvevents);
    kvd_tiers_close(d->tiers);
    if (d->signals_active) {
        d->signals_active = 0;
        uv_close((uv_handle_t *)&d->sigterm, NULL);
        uv_close((uv_handle_t *)&d->sigint, NULL);
    }
    if (d->async_active) {
        d->async_active = 0;
        uv_close((uv_handle_t *)&d->stop_async, NULL);
    }
}

/* The server stopped (after any cuda-ipc wait): remote-write write-back's unwritten tier-1
 * blocks go to Redis first (kvd_tiers_drain, at most remote-drain-s), then the rest. */
static void on_server_stopped(void *arg) {
    kvd_daemon *d = arg;
    if (!kvd_tiers_drain(d->tiers, on_tiers_drained, d)) {
        on_tiers_drained(d);
    }
}

static kv_err backend_open(kvd_daemon *d) {
    char why[512];
    kv_err rc = kvd_backend_select(d->cfg.backend, (int)d->cfg.device, NULL, &d->host, &d->sel, why,
                                   sizeof(why));
    if (rc != KV_OK) {
        KV_LOG(ERROR, "KVD-BACKEND", "%s", why);
        return rc;
    }
    d->sel_open = 1;
    /* `kvctl info` shows the backend in use, not "auto". */
    snprintf(d->cfg.backend, sizeof(d->cfg.backend), "%s", d->sel.ops->name);
    KV_LOG(INFO, "KVD-BACKEND", "%s", d->sel.reason);
    if (d->sel.ops == &kvd_backend_host && !d->cfg.hugepages) {
        char thp[32];
        kv_shmem_thp_mode(thp, sizeof(thp));
        if (strcmp(thp, "unknown") == 0) {
            KV_LOG(INFO, "KVD-THP",
                   "host segments use the kernel's default pages: it shows no shmem huge-page "
                   "mode (/sys/kernel/mm/transparent_hugepage/shmem_enabled)");
        } else if (!kv_shmem_thp_huge(thp)) {
            KV_LOG(INFO, "KVD-THP",
                   "host segments use 4 KiB pages: the kernel's shmem huge pages are `%s` "
                   "(/sys/kernel/mm/transparent_hugepage/shmem_enabled); `advise` gives pool "
                   "memory 2 MiB pages (docs/ARCHITECTURE.md, Huge pages)",
                   thp);
        } else {
            KV_LOG(INFO, "KVD-THP", "host segments ask for 2 MiB pages (shmem THP `%s`)", thp);
        }
    }
    return KV_OK;
}

kv_err kvd_daemon_alloc(const kvd_config *cfg, uv_loop_t *loop, kvd_daemon **out) {
    char why[256];
    if (kvd_config_check(cfg, why, sizeof(why)) != KV_OK) {
        KV_LOG(ERROR, "KVD-START", "%s", why);
        return KV_EINVAL;
    }
    kvd_daemon *d = calloc(1, sizeof(*d));
    if (d == NULL) {
        return KV_ENOMEM;
    }
    d->cfg = *cfg;
    d->loop = loop;
    d->host.hugepages = cfg->hugepages;
    kv_err rc = KV_OK;
    while (d->boot_epoch == 0) {
        if (getrandom(&d->boot_epoch, sizeof(d->boot_epoch), 0) != sizeof(d->boot_epoch)) {
            KV_LOG(ERROR, "KVD-START", "getrandom: %s", strerror(errno));
            rc = KV_ESYS;
            goto fail;
        }
    }
    rc = kvd_tenants_alloc(&d->tenants);
    if (rc != KV_OK) {
        goto fail;
    }
    if (cfg->tenants_file[0] != '\0') {
        char err[512];
        rc = kvd_tenants_load(d->tenants, cfg->tenants_file, err, sizeof(err));
        if (rc != KV_OK) {
            KV_LOG(ERROR, "KVD-TENANTS", "tenants-file: %s", err);
            goto fail;
        }
    }
    rc = backend_open(d);
    if (rc != KV_OK) {
        goto fail;
    }
    kvd_registry_deps rd = {&d->cfg, d->tenants, &d->sel, loop_clock, loop};
    rc = kvd_registry_init(&d->reg, &rd);
    if (rc != KV_OK) {
        KV_LOG(ERROR, "KVD-START", "prefix index of %llu entries: %s",
               (unsigned long long)cfg->index_entries, kv_strerror(rc));
        goto fail;
    }
    d->reg_open = 1;
    char terr[512] = "";
    rc = kvd_tiers_alloc(loop, &d->reg, &d->cfg, &d->tiers, terr, sizeof(terr));
    if (rc != KV_OK) {
        KV_LOG(ERROR, "KVD-START", "tiers: %s", terr[0] != '\0' ? terr : kv_strerror(rc));
        goto fail;
    }
    char eerr[512] = "";
    rc = kvd_kvevents_alloc(loop, &d->cfg, d->tenants, d->sel.cuda != NULL ? "GPU" : "CPU",
                            &d->kvevents, eerr, sizeof(eerr));
    if (rc != KV_OK) {
        KV_LOG(ERROR, "KVD-START", "%s", eerr[0] != '\0' ? eerr : kv_strerror(rc));
        goto fail;
    }
    if (d->kvevents != NULL) {
        kvd_tiers_set_event_hook(d->tiers, kvd_kvevents_tier_change, d->kvevents);
        kvd_tiers_set_digest_fn(d->tiers, kvd_kvevents_digest_tail, d->kvevents);
    }
    kvd_server_deps sd = {&d->cfg,           loop, &d->reg,  d->boot_epoch,
                          on_server_stopped, d,    d->tiers, d->kvevents};
    rc = kvd_server_alloc(&sd, &d->srv);
    if (rc != KV_OK) {
        goto fail;
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    d->ops.cfg = &d->cfg;
    d->ops.loop = loop;
    d->ops.reg = &d->reg;
    d->ops.srv = d->srv;
    d->ops.tiers = d->tiers;
    d->ops.kvevents = d->kvevents;
    d->ops.boot_epoch = d->boot_epoch;
    d->ops.start_unix_ms = (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
    d->ops.start_loop_ms = uv_now(loop);
    *out = d;
    return KV_OK;
fail:
    kvd_daemon_free(d);
    return rc;
}

static void on_signal(uv_signal_t *h, int signum) {
    kvd_daemon *d = h->data;
    KV_LOG(INFO, "KVD-STOP", "signal %d: stopping", signum);
    kvd_daemon_stop(d);
}

static void on_stop_async(uv_async_t *h) {
    kvd_daemon_stop(h->data);
}

/* evict-duel: after each turn of the loop (its I/O callbacks ran and their replies were written),
 * one waiting Lookup goes through its pool's duel; while more wait, the idle handle keeps the next
 * poll from blocking, so an otherwise idle loop drains them one per turn and a busy one spends
 * one request's worth a turn (the rest wait, and past the queue's bound are dropped). */
static void on_duel_idle(uv_idle_t *h) {
    (void)h;
}

static void on_duel_check(uv_check_t *h) {
    kvd_daemon *d = h->data;
    if (d->reg.duel_pending > 0 && kvd_registry_duel_step(&d->reg, 1) > 0) {
        uv_idle_start(&d->duel_idle, on_duel_idle);
    } else {
        uv_idle_stop(&d->duel_idle);
    }
}

kv_err kvd_daemon_start(kvd_daemon *d, int handle_signals) {
    if (uv_async_init(d->loop, &d->stop_async, on_stop_async) != 0) {
        return KV_ESYS;
    }
    d->stop_async.data = d;
    d->async_active = 1;
    uv_check_init(d->loop, &d->duel_check);
    uv_idle_init(d->loop, &d->duel_idle);
    d->duel_check.data = d->duel_idle.data = d;
    d->duel_active = 1;
    uv_check_start(&d->duel_check, on_duel_check);
    uv_unref((uv_handle_t *)&d->duel_check); /* neither keeps the loop alive on its own */
    uv_unref((uv_handle_t *)&d->duel_idle);
    if (handle_signals) {
        uv_signal_init(d->loop, &d->sigterm);
        uv_signal_init(d->loop, &d->sigint);
        d->sigterm.data = d->sigint.data = d;
        d->signals_active = 1;
        uv_signal_start(&d->sigterm, on_signal, SIGTERM);
        uv_signal_start(&d->sigint, on_signal, SIGINT);
    }
    kv_err rc = kvd_server_start(d->srv);
    if (rc == KV_OK) {
        /* After the client socket is ours: a second daemon started by mistake stops at it and
         * never takes the first one's event endpoints (a second ipc bind would). */
        char eerr[512] = "";
        rc = kvd_kvevents_start(d->kvevents, eerr, sizeof(eerr));
        if (rc != KV_OK) {
            KV_LOG(ERROR, "KVD-START", "%s", eerr);
        }
    }
    if (rc == KV_OK) {
        rc = kvd_admin_start(&d->ops); /* beside the client socket by default */
    }
    if (rc == KV_OK) {
        rc = kvd_metrics_start(&d->ops);
    }
    return rc;
}

void kvd_daemon_stop(kvd_daemon *d) {
    kvd_server_stop(d->srv); /* on_server_stopped does the rest, now or after the wait */
}

void kvd_daemon_stop_async(kvd_daemon *d) {
    uv_async_send(&d->stop_async);
}

void kvd_daemon_free(kvd_daemon *d) {
    if (d == NULL) {
        return;
    }
    kvd_metrics_free(&d->ops);
    kvd_admin_free(&d->ops);
    kvd_server_free(d->srv);
    if (d->reg_open) {
        kvd_registry_fini(&d->reg); /* every pool, before the backend goes */
    }
    kvd_tiers_free(d->tiers); /* after the pools: the loop ran dry, no copy is in flight */
    kvd_kvevents_free(d->kvevents);
    if (d->sel_open) {
        kvd_backend_sel_fini(&d->sel);
    }
    kvd_tenants_free(d->tenants);
    free(d);
}

const char *kvd_daemon_socket_path(const kvd_daemon *d) {
    return kvd_server_socket_path(d->srv);
}

uint64_t kvd_daemon_boot_epoch(const kvd_daemon *d) {
    return d->boot_epoch;
}

kvd_ops *kvd_daemon_ops(kvd_daemon *d) {
    return &d->ops;
}

kvd_registry *kvd_daemon_registry(kvd_daemon *d) {
    return &d->reg;
}

const kvd_config *kvd_daemon_config(const kvd_daemon *d) {
    return &d->cfg;
}
