/* kvd_metrics: the Prometheus endpoint (see metrics.h). The exposition is rendered from the
 * admin `stats` object by one table of metric families, so /metrics and `kvctl stats` cannot
 * disagree; naming follows Prometheus conventions (counters end in _total, units in names). */
#include "daemon/ops/metrics.h"

#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/kv_log.h"
#include "common/kv_version.h"
#include "daemon/ops/admin_cmds.h"

#define METRICS_DEADLINE_MS 2000 /* the loop must answer within this, or 503 */

/* ---- rendering ------------------------------------------------------------------------- */

typedef struct metric_row {
    const char *family;  /* metric name */
    const char *type;    /* counter | gauge */
    const char *help;    /* HELP line (first row of a family only) */
    const char *section; /* "daemon", "pools" or "tenants" in the stats object */
    const char *key;     /* field of the stats object */
    const char *label;   /* extra label name, or NULL */
    const char *value;   /* its value */
} metric_row;

static const metric_row rows[] = {
    {"kvd_sessions", "gauge", "Open client connections.", "daemon", "sessions", NULL, NULL},
    {"kvd_pools", "gauge", "Pools (model, layout, domain) in use.", "daemon", "pools", NULL, NULL},
    {"kvd_pool_memory_limit_bytes", "gauge", "Segment memory all pools may use (pool-memory).",
     "daemon", "pool_memory_bytes", NULL, NULL},
    {"kvd_pool_memory_used_bytes", "gauge", "Segment memory the pools hold.", "daemon",
     "pool_memory_used_bytes", NULL, NULL},
    {"kvd_index_entries", "gauge", "Blocks in the prefix index.", "daemon", "index_entries", NULL,
     NULL},
    {"kvd_index_capacity_entries", "gauge", "Slots of the prefix index.", "daemon",
     "index_capacity", NULL, NULL},
    {"kvd_draining", "gauge", "1 while draining (new sessions refused).", "daemon", "draining",
     NULL, NULL},
    {"kvd_uptime_seconds", "gauge", "Seconds since kvd started.", "daemon", "uptime_seconds", NULL,
     NULL},
    {"kvd_events_total", "counter", "Evictions and refusals recorded in the admin event ring.",
     "daemon", "events_evict", "kind", "evict"},
    {"kvd_events_total", "counter", NULL, "daemon", "events_refuse", "kind", "refuse"},

    {"kvd_pool_blocks", "gauge", "Blocks of the pool by lifecycle state.", "pools", "blocks_free",
     "state", "free"},
    {"kvd_pool_blocks", "gauge", NULL, "pools", "blocks_writing", "state", "writing"},
    {"kvd_pool_blocks", "gauge", NULL, "pools", "blocks_committed", "state", "committed"},
    {"kvd_pool_blocks", "gauge", NULL, "pools", "blocks_cached", "state", "cached"},
    {"kvd_pool_capacity_blocks", "gauge", "Blocks in the pool's segments.", "pools", "blocks_total",
     NULL, NULL},
    {"kvd_pool_pinned_blocks", "gauge", "Pinned blocks of the pool.", "pools", "blocks_pinned",
     NULL, NULL},
    {"kvd_pool_segments", "gauge", "Segments (shared memory objects) of the pool.", "pools",
     "segments", NULL, NULL},
    {"kvd_pool_memory_bytes", "gauge", "Segment memory of the pool.", "pools", "bytes", NULL, NULL},
    {"kvd_pool_lookups_total", "counter", "Lookup requests on the pool.", "pools", "queries", NULL,
     NULL},
    {"kvd_pool_lookup_blocks_total", "counter",
     "Blocks asked in Lookup requests (the hit rate's denominator).", "pools", "query_blocks", NULL,
     NULL},
    {"kvd_pool_hit_blocks_total", "counter", "Blocks Lookup found cached.", "pools", "hit_blocks",
     NULL, NULL},
    {"kvd_pool_hit_tokens_total", "counter", "Tokens of the blocks Lookup found cached.", "pools",
     "hit_tokens", NULL, NULL},
    {"kvd_pool_commits_total", "counter", "Blocks committed.", "pools", "commits", NULL, NULL},
    {"kvd_pool_duplicate_commits_total", "counter",
     "Commits of a block another worker had committed already.", "pools", "commits_duplicate", NULL,
     NULL},
    {"kvd_pool_evictions_total", "counter", "Cached blocks evicted, by reason.", "pools",
     "evictions_capacity", "reason", "capacity"},
    {"kvd_pool_evictions_total", "counter", NULL, "pools", "evictions_admin", "reason", "admin"},
    {"kvd_pool_evictions_total", "counter", NULL, "pools", "evictions_shrink", "reason", "shrink"},

    {"kvd_tenant_sessions", "gauge", "Open sessions of the tenant.", "tenants", "sessions", NULL,
     NULL},
    {"kvd_tenant_lookups_total", "counter", "Lookup requests of the tenant.", "tenants", "queries",
     NULL, NULL},
    {"kvd_tenant_lookup_blocks_total", "counter", "Blocks the tenant asked in Lookup requests.",
     "tenants", "query_blocks", NULL, NULL},
    {"kvd_tenant_hit_blocks_total", "counter", "Blocks the tenant's Lookups found cached.",
     "tenants", "hit_blocks", NULL, NULL},
    {"kvd_tenant_hit_tokens_total", "counter", "Tokens of the blocks the tenant's Lookups found.",
     "tenants", "hit_tokens", NULL, NULL},
    {"kvd_tenant_commits_total", "counter", "Blocks the tenant committed.", "tenants", "commits",
     NULL, NULL},
    {"kvd_tenant_evictions_total", "counter",
     "Evictions the tenant's allocations caused (capacity) or an operator made of its blocks.",
     "tenants", "evictions_capacity", "reason", "capacity"},
    {"kvd_tenant_evictions_total", "counter", NULL, "tenants", "evictions_admin", "reason",
     "admin"},
    {"kvd_tenant_evictions_total", "counter", NULL, "tenants", "evictions_shrink", "reason",
     "shrink"},
    {"kvd_tenant_refusals_total", "counter",
     "Requests of the tenant refused (quota, space, "
     "permission, draining).",
     "tenants", "refusals", NULL, NULL},
    {"kvd_tenant_blocks", "gauge", "Blocks of the tenant by state, over all pools.", "tenants",
     "blocks_held", "state", "held"},
    {"kvd_tenant_blocks", "gauge", NULL, "tenants", "blocks_cached", "state", "cached"},
    {"kvd_tenant_blocks", "gauge", NULL, "tenants", "blocks_pinned", "state", "pinned"},
};

#define NROWS (sizeof(rows) / sizeof(rows[0]))

/* Writes a label value with the exposition format's escapes (\\, \", \n). */
static void put_label(FILE *out, const char *v) {
    for (; *v != '\0'; v++) {
        if (*v == '\\') {
            fputs("\\\\", out);
        } else if (*v == '"') {
            fputs("\\\"", out);
        } else if (*v == '\n') {
            fputs("\\n", out);
        } else {
            fputc(*v, out);
        }
    }
}

static void put_labels(FILE *out, const char *section, const json_t *obj, const metric_row *r) {
    int first = 1;
    if (strcmp(section, "daemon") == 0 && r->label == NULL) {
        return;
    }
    fputc('{', out);
    if (strcmp(section, "pools") == 0) {
        fprintf(out, "pool=\"%lld\",model=\"",
                (long long)json_integer_value(json_object_get(obj, "id")));
        put_label(out, json_string_value(json_object_get(obj, "model")));
        fputs("\",domain=\"", out);
        put_label(out, json_string_value(json_object_get(obj, "domain")));
        fputc('"', out);
        first = 0;
    } else if (strcmp(section, "tenants") == 0) {
        fputs("tenant=\"", out);
        put_label(out, json_string_value(json_object_get(obj, "name")));
        fputc('"', out);
        first = 0;
    }
    if (r->label != NULL) {
        fprintf(out, "%s%s=\"%s\"", first ? "" : ",", r->label, r->value);
        first = 0;
    }
    fputc('}', out);
}

static double value_of(const json_t *v) {
    if (json_is_integer(v)) {
        return (double)json_integer_value(v);
    }
    if (json_is_boolean(v)) {
        return json_is_true(v) ? 1.0 : 0.0;
    }
    return json_number_value(v);
}

kv_err kvd_metrics_render(const json_t *st, const char *version, FILE *out) {
    const json_t *daemon = json_object_get(st, "daemon");
    const json_t *pools = json_object_get(st, "pools");
    const json_t *tenants = json_object_get(st, "tenants");
    if (!json_is_object(daemon) || !json_is_array(pools) || !json_is_array(tenants)) {
        return KV_EINVAL;
    }
    fputs("# HELP kvd_build_info kvd version; the value is always 1.\n"
          "# TYPE kvd_build_info gauge\nkvd_build_info{version=\"",
          out);
    put_label(out, version);
    fputs("\"} 1\n", out);
    for (size_t i = 0; i < NROWS;) {
        size_t end = i;
        while (end < NROWS && strcmp(rows[end].family, rows[i].family) == 0) {
            end++;
        }
        const char *sec = rows[i].section;
        const json_t *objs = strcmp(sec, "daemon") == 0 ? NULL : json_object_get(st, sec);
        size_t nobj = objs == NULL ? 1 : json_array_size(objs);
        if (nobj > 0) {
            fprintf(out, "# HELP %s %s\n# TYPE %s %s\n", rows[i].family, rows[i].help,
                    rows[i].family, rows[i].type);
            for (size_t k = 0; k < nobj; k++) {
                const json_t *o = objs == NULL ? daemon : json_array_get(objs, k);
                for (size_t r = i; r < end; r++) {
                    fputs(rows[r].family, out);
                    put_labels(out, sec, o, &rows[r]);
                    fprintf(out, " %.17g\n", value_of(json_object_get(o, rows[r].key)));
                }
            }
        }
        i = end;
    }
    return KV_OK;
}

/* ---- HTTP thread <-> loop thread ------------------------------------------------------- */

typedef enum page { PAGE_METRICS = 1, PAGE_HEALTHZ = 2, PAGE_READYZ = 3 } page;

struct kvd_metrics {
    kvd_ops *ops;           /* what it reports */
    struct MHD_Daemon *mhd; /* the HTTP server (its own thread) */
    uv_async_t async;       /* wakes the loop for a request */
    int async_active;       /* async initialised and not closed */
    uint16_t port;          /* bound port */
    pthread_mutex_t mu;     /* guards the fields below */
    pthread_cond_t cv;      /* signalled when answered or no longer pending */
    int pending;            /* a request waits for the loop */
    int answered;           /* the loop filled result */
    int abandoned;          /* the HTTP side gave up on the pending request */
    int stopping;           /* no more requests */
    page want;              /* what the pending request asks */
    char *result;           /* body (malloc'd), handed to the HTTP side */
    size_t result_len;      /* bytes of result */
    unsigned status;        /* HTTP status of result */
};

/* Loop thread: renders what the HTTP thread asked for. */
static void on_async(uv_async_t *h) {
    kvd_metrics *m = h->data;
    pthread_mutex_lock(&m->mu);
    int pending = m->pending && !m->answered;
    page want = m->want;
    pthread_mutex_unlock(&m->mu);
    if (!pending) {
        return;
    }
    char *buf = NULL;
    size_t len = 0;
    unsigned status = 200;
    FILE *f = open_memstream(&buf, &len);
    if (f == NULL) {
        status = 500;
    } else if (want == PAGE_METRICS) {
        json_t *st = kvd_admin_stats(m->ops);
        if (st == NULL || kvd_metrics_render(st, KV_VERSION, f) != KV_OK) {
            status = 500;
        }
        json_decref(st);
    } else if (want == PAGE_HEALTHZ) {
        fputs("ok: loop answering\n", f);
    } else if (kvd_ops_ready(m->ops)) {
        fputs("ready\n", f);
    } else {
        status = 503;
        fprintf(f, "not ready: %s\n",
                kvd_server_draining(m->ops->srv) ? "draining" : "not listening");
    }
    if (f != NULL) {
        fclose(f);
    }
    pthread_mutex_lock(&m->mu);
    if (m->abandoned) {
        m->abandoned = 0;
        m->pending = 0;
        free(buf);
    } else {
        m->result = buf;
        m->result_len = buf != NULL ? len : 0;
        m->status = status;
        m->answered = 1;
    }
    pthread_cond_broadcast(&m->cv);
    pthread_mutex_unlock(&m->mu);
}

static enum MHD_Result respond(struct MHD_Connection *conn, unsigned status, char *body, size_t len,
                               const char *type) {
    struct MHD_Response *r = MHD_create_response_from_buffer(
        len, body, body != NULL ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
    if (r == NULL) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    enum MHD_Result ret = MHD_queue_response(conn, status, r);
    MHD_destroy_response(r);
    return ret;
}

static char *text_copy(const char *s, size_t *len) {
    *len = strlen(s);
    return strdup(s);
}

/* HTTP thread. Touches only the handoff fields, under mu. */
static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload,
                                  size_t *upload_size, void **req_cls) {
    (void)version, (void)upload, (void)upload_size, (void)req_cls;
    kvd_metrics *m = cls;
    const char *plain = "text/plain; charset=utf-8";
    size_t len;
    if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0) {
        char *b = text_copy("only GET\n", &len);
        return respond(conn, MHD_HTTP_METHOD_NOT_ALLOWED, b, len, plain);
    }
    page want;
    if (strcmp(url, "/metrics") == 0) {
        want = PAGE_METRICS;
    } else if (strcmp(url, "/healthz") == 0) {
        want = PAGE_HEALTHZ;
    } else if (strcmp(url, "/readyz") == 0) {
        want = PAGE_READYZ;
    } else {
        char *b = text_copy("not found: /metrics, /healthz, /readyz\n", &len);
        return respond(conn, MHD_HTTP_NOT_FOUND, b, len, plain);
    }
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += METRICS_DEADLINE_MS / 1000;
    pthread_mutex_lock(&m->mu);
    int timed_out = 0;
    while (m->pending && !m->stopping && !timed_out) {
        timed_out = pthread_cond_timedwait(&m->cv, &m->mu, &deadline) == ETIMEDOUT;
    }
    if (m->stopping || timed_out) {
        pthread_mutex_unlock(&m->mu);
        char *b = text_copy("kvd loop not answering\n", &len);
        return respond(conn, MHD_HTTP_SERVICE_UNAVAILABLE, b, len, plain);
    }
    m->pending = 1;
    m->answered = 0;
    m->want = want;
    uv_async_send(&m->async);
    while (!m->answered && !m->stopping && !timed_out) {
        timed_out = pthread_cond_timedwait(&m->cv, &m->mu, &deadline) == ETIMEDOUT;
    }
    if (!m->answered) {
        /* The loop may still answer later; it frees what it made then. */
        m->abandoned = 1;
        pthread_mutex_unlock(&m->mu);
        char *b = text_copy("kvd loop not answering\n", &len);
        return respond(conn, MHD_HTTP_SERVICE_UNAVAILABLE, b, len, plain);
    }
    char *body = m->result;
    len = m->result_len;
    unsigned status = m->status;
    m->result = NULL;
    m->answered = 0;
    m->pending = 0;
    pthread_cond_broadcast(&m->cv);
    pthread_mutex_unlock(&m->mu);
    if (body == NULL) {
        body = text_copy("render failed\n", &len);
        status = 500;
    }
    return respond(conn, status, body, len,
                   want == PAGE_METRICS ? "text/plain; version=0.0.4; charset=utf-8" : plain);
}

kv_err kvd_metrics_start(kvd_ops *s) {
    if (s->cfg->metrics_port == 0) {
        return KV_OK;
    }
    struct sockaddr_in sin;
    memset(&sin, 0, sizeof(sin));
    sin.sin_family = AF_INET;
    sin.sin_port = htons((uint16_t)s->cfg->metrics_port);
    if (inet_pton(AF_INET, s->cfg->metrics_address, &sin.sin_addr) != 1) {
        KV_LOG(ERROR, "KVD-METRICS", "metrics-address '%s' is not an IPv4 address",
               s->cfg->metrics_address);
        return KV_EINVAL;
    }
    kvd_metrics *m = calloc(1, sizeof(*m));
    if (m == NULL) {
        return KV_ENOMEM;
    }
    m->ops = s;
    pthread_mutex_init(&m->mu, NULL);
    pthread_cond_init(&m->cv, NULL);
    s->metrics = m;
    if (uv_async_init(s->loop, &m->async, on_async) != 0) {
        return KV_ESYS;
    }
    m->async.data = m;
    m->async_active = 1;
    m->mhd = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD, (uint16_t)s->cfg->metrics_port, NULL,
                              NULL, on_request, m, MHD_OPTION_SOCK_ADDR, &sin,
                              MHD_OPTION_CONNECTION_LIMIT, (unsigned)64,
                              MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)10, MHD_OPTION_END);
    if (m->mhd == NULL) {
        KV_LOG(ERROR, "KVD-METRICS", "cannot serve metrics on %s:%llu (port in use?)",
               s->cfg->metrics_address, (unsigned long long)s->cfg->metrics_port);
        return KV_ESYS;
    }
    m->port = (uint16_t)s->cfg->metrics_port;
    s->metrics_port = m->port;
    KV_LOG(INFO, "KVD-METRICS", "metrics on http://%s:%u/metrics", s->cfg->metrics_address,
           (unsigned)m->port);
    return KV_OK;
}

void kvd_metrics_stop(kvd_ops *s) {
    kvd_metrics *m = s->metrics;
    if (m == NULL) {
        return;
    }
    pthread_mutex_lock(&m->mu);
    m->stopping = 1;
    pthread_cond_broadcast(&m->cv);
    pthread_mutex_unlock(&m->mu);
    if (m->mhd != NULL) {
        MHD_stop_daemon(m->mhd); /* joins the HTTP thread; it no longer waits on us */
        m->mhd = NULL;
    }
    if (m->async_active) {
        m->async_active = 0;
        uv_close((uv_handle_t *)&m->async, NULL);
    }
}

void kvd_metrics_free(kvd_ops *s) {
    kvd_metrics *m = s->metrics;
    if (m == NULL) {
        return;
    }
    KV_ASSERT(m->mhd == NULL && !m->async_active);
    free(m->result);
    pthread_mutex_destroy(&m->mu);
    pthread_cond_destroy(&m->cv);
    free(m);
    s->metrics = NULL;
}
