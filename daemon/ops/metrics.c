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
#include "daemon/tiers/tiers.h"
#include "common/kv_version.h"
#include "daemon/core/pool.h"
#include "daemon/ops/admin_cmds.h"

#define METRICS_DEADLINE_MS 2000 /* the loop must answer within this, or 503 */

/* ---- rendering ------------------------------------------------------------------------- */

/* The exported families come from the stats tables (common/kv_stat.h): the daemon's and a
 * tenant's (daemon/ops/admin_cmds.h) and a pool's (daemon/core/pool.h). Rows of one family are
 * adjacent in their table; the first carries the family's HELP. */
typedef struct section {
    const char *name; /* "daemon", "pools", "duel", "tenants", "tiers" or "kv_events" */
    const kv_stat_desc *(*table)(size_t *n); /* its table */
} section;

static const section sections[] = {
    {"daemon", kvd_admin_daemon_stats}, {"pools", kvd_pool_stat_descs},
    {"duel", kvd_admin_duel_stats},     {"tenants", kvd_admin_tenant_stats},
    {"tiers", kvd_tiers_stat_descs},    {"kv_events", kvd_kvevents_stat_descs},
};

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

static void put_labels(FILE *out, const char *section, const json_t *obj, const kv_stat_desc *r) {
    int first = 1;
    if ((strcmp(section, "daemon") == 0 || strcmp(section, "tiers") == 0 ||
         strcmp(section, "kv_events") == 0) &&
        r->label == NULL) {
        return;
    }
    fputc('{', out);
    if (strcmp(section, "pools") == 0 || strcmp(section, "duel") == 0) {
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
        fprintf(out, "%s%s=\"%s\"", first ? "" : ",", r->label, r->label_value);
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
    for (size_t q = 0; q < sizeof(sections) / sizeof(sections[0]); q++) {
        size_t nrows;
        const kv_stat_desc *rows = sections[q].table(&nrows);
        const char *sec = sections[q].name;
        /* daemon, tiers and kv_events are one object each; pools and tenants arrays of them. */
        int single = strcmp(sec, "daemon") == 0 || strcmp(sec, "tiers") == 0 ||
                     strcmp(sec, "kv_events") == 0;
        const json_t *one = strcmp(sec, "daemon") == 0 ? daemon : json_object_get(st, sec);
        const json_t *objs = single ? NULL : json_object_get(st, sec);
        size_t nobj = single ? (one != NULL ? 1 : 0) : json_array_size(objs);
        for (size_t i = 0; i < nrows;) {
            size_t end = i + 1;
            while (rows[i].family != NULL && end < nrows && rows[end].family != NULL &&
                   strcmp(rows[end].family, rows[i].family) == 0) {
                end++;
            }
            if (rows[i].family != NULL && nobj > 0) {
                fprintf(out, "# HELP %s %s\n# TYPE %s %s\n", rows[i].family,
                        rows[i].family_help != NULL ? rows[i].family_help : rows[i].help,
                        rows[i].family, rows[i].type);
                for (size_t k = 0; k < nobj; k++) {
                    const json_t *o = objs == NULL ? one : json_array_get(objs, k);
                    for (size_t r = i; r < end; r++) {
                        fputs(rows[r].family, out);
                        put_labels(out, sec, o, &rows[r]);
                        fprintf(out, " %.17g\n", value_of(json_object_get(o, rows[r].name)));
                    }
                }
            }
            i = end;
        }
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
    /* epoll or poll (MHD_USE_AUTO), not select(): the daemon holds an fd per segment and per
     * client, and select() refuses every connection whose socket number passes 1023 (health
     * probes failing once the cache fills). At most 16 connections a peer address, so that one
     * peer holding connections open cannot keep the probes out. */
    m->mhd =
        MHD_start_daemon(MHD_USE_AUTO_INTERNAL_THREAD, (uint16_t)s->cfg->metrics_port, NULL, NULL,
                         on_request, m, MHD_OPTION_SOCK_ADDR, &sin, MHD_OPTION_CONNECTION_LIMIT,
                         (unsigned)64, MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)16,
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
