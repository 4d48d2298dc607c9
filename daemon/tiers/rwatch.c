/* kvd_rwatch: keyspace notifications of the remote tier's Redis nodes (see rwatch.h).
 *
 * One discovery connection at a time (to the seeds in turn) reads the masters from CLUSTER
 * SLOTS, or takes its own node where cluster support is off, and goes; then one subscriber
 * connection per node asks for its notify-keyspace-events (to say when drops go unheard) and
 * subscribes. Any failure, or a deadline, tears everything down and starts again after a
 * backoff: the set of nodes is small and a failover changes it anyway. While every node is
 * subscribed, a check connection asks one of them for CLUSTER SLOTS every refresh_ms (the
 * nodes in turn) and goes; when the masters it names are not the ones watched (a master added,
 * slots moved to a node that had none), everything starts again the same way.
 *
 * libhiredis frees a context itself after its connect callback reports an error and after its
 * disconnect callback; this file forgets a context in those callbacks and frees one only from a
 * timer or from close, never from inside one of libhiredis's callbacks.
 */
#include "daemon/tiers/rwatch.h"

#include <arpa/inet.h>
#include <hiredis/async.h>
#include <hiredis/hiredis.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_log.h"
#include "daemon/tiers/remote.h"

#define RW_MAX_NODES KVD_REMOTE_SEEDS_MAX
#define RW_BACKOFF_MIN_MS 100
#define RW_HOST_MAX KVD_REMOTE_HOST_MAX

typedef struct rw_node {
    kvd_rwatch *w;
    redisAsyncContext *ac; /* NULL when it has none */
    char host[RW_HOST_MAX];
    int port;
    int self_named; /* host is the name of the node asked (CLUSTER SLOTS gave it no address) */
    int subscribed; /* both channels confirmed */
} rw_node;

struct kvd_rwatch {
    uv_loop_t *loop;
    kvd_rwatch_fn fn;
    void *arg;
    kvd_rwatch_up_fn up_fn; /* every node subscribed (kvd_rwatch_set_up_fn), or NULL */
    void *up_arg;
    char *password;
    uint64_t timeout_ms;
    /* The configured seeds, then every node a CLUSTER SLOTS named (masters and replicas), so a
     * discovery still finds the cluster when the seeds given are the nodes that went. */
    char seed_host[2 * RW_MAX_NODES][RW_HOST_MAX];
    int seed_port[2 * RW_MAX_NODES];
    int nseeds;              /* of them, configured */
    int nknown;              /* all of them */
    int seed_at;             /* the one the next discovery asks */
    int asked;               /* the one the current discovery asks */
    redisAsyncContext *disc; /* the discovery connection, NULL when none */
    redisAsyncContext *chk;  /* the check connection, NULL when none */
    char chk_host[RW_HOST_MAX];
    int chk_port;
    int chk_busy;       /* a check is under way (its name resolved, or its connection open) */
    uint32_t chk_gen;   /* bumped when a check is abandoned: its late resolution is dropped */
    unsigned chk_at;    /* the node the next check asks */
    uint64_t chk_sig;   /* the changed set of masters the last check saw, 0: none */
    int standalone;     /* the discovery found one server (cluster support off): no checks */
    uv_timer_t refresh; /* checks, every refresh_ms (when set) */
    uint64_t refresh_ms;
    rw_node nodes[RW_MAX_NODES];
    int nnodes;
    uv_timer_t restart;  /* backoff before the next discovery */
    uv_timer_t deadline; /* the current discovery and subscriptions must be done by then */
    uint64_t backoff_ms, backoff_max_ms;
    int gap_open; /* a subscription that was up was lost and not every node is back */
    int restart_pending;
    int tearing;  /* teardown runs: the disconnect callbacks it causes restart nothing */
    uint32_t gen; /* bumped by each teardown: a name resolved for an older round is dropped */
    int closing;
    kvd_rwatch_stats st;
};

static void rw_schedule_restart(kvd_rwatch *w, const char *why);

/* ---- teardown and restart ------------------------------------------------------------------ */

/* A subscription that was up is lost: a gap (drops unheard) opens, unless one is open already;
 * it closes when every node is subscribed again. */
static void gap_opens(kvd_rwatch *w) {
    if (!w->gap_open && !w->closing) {
        w->gap_open = 1;
        w->st.gaps++;
    }
}

static void rw_teardown(kvd_rwatch *w) {
    w->tearing = 1;
    if (w->disc != NULL) {
        redisAsyncContext *ac = w->disc;
        w->disc = NULL;
        redisAsyncFree(ac);
    }
    if (w->chk != NULL) {
        redisAsyncContext *ac = w->chk;
        w->chk = NULL;
        redisAsyncFree(ac);
    }
    w->chk_busy = 0;
    w->chk_sig = 0;
    for (int i = 0; i < w->nnodes; i++) {
        if (w->nodes[i].ac != NULL) {
            redisAsyncContext *ac = w->nodes[i].ac;
            w->nodes[i].ac = NULL;
            redisAsyncFree(ac);
        }
    }
    if (w->st.nodes > 0) {
        gap_opens(w); /* subscriptions that were up go with the teardown */
    }
    w->nnodes = 0;
    w->st.nodes = 0;
    w->gen++;
    w->tearing = 0;
    uv_timer_stop(&w->deadline);
}

static void rw_start_discovery(kvd_rwatch *w);

static void on_restart(uv_timer_t *t) {
    kvd_rwatch *w = t->data;
    w->restart_pending = 0;
    if (w->closing) {
        return;
    }
    rw_teardown(w);
    rw_start_discovery(w);
}

static void on_deadline(uv_timer_t *t) {
    kvd_rwatch *w = t->data;
    rw_schedule_restart(w, "not subscribed in time");
}

static void rw_schedule_restart(kvd_rwatch *w, const char *why) {
    if (w->closing || w->tearing || w->restart_pending) {
        return;
    }
    KV_LOG(INFO, "KVD-REMOTE-WATCH", "remote watch: %s; asking the seeds again in %llu ms", why,
           (unsigned long long)w->backoff_ms);
    w->restart_pending = 1;
    uv_timer_stop(&w->deadline);
    uv_timer_start(&w->restart, on_restart, w->backoff_ms, 0);
    w->backoff_ms = w->backoff_ms * 2 > w->backoff_max_ms ? w->backoff_max_ms : w->backoff_ms * 2;
}

/* ---- libhiredis on the loop ------------------------------------------------------------------
 * libhiredis's event hooks on a uv_poll of the context's socket: ours, not Debian's adapter
 * (hiredis/adapters/libuv.h of libhiredis 0.14), which returns when the poll reports an error:
 * libuv reports a connection reset (RST) that way, so libhiredis never read the error, never
 * disconnected, and the watch stayed "up" on a dead subscriber. Here an error lets libhiredis
 * read and write what it waits for, which finds the error and disconnects. */
typedef struct rw_ev {
    redisAsyncContext *ac; /* NULL once libhiredis let go (cleanup) */
    uv_poll_t poll;
    int events;
} rw_ev;

static void rw_ev_set(rw_ev *p, int ev);

static void rw_ev_poll(uv_poll_t *h, int status, int events) {
    rw_ev *p = h->data;
    int ev = status < 0 ? p->events : events;
    if (p->ac != NULL && (ev & UV_READABLE)) {
        redisAsyncHandleRead(p->ac); /* (may free the context: cleanup clears p->ac) */
    }
    if (p->ac != NULL && (ev & UV_WRITABLE)) {
        redisAsyncHandleWrite(p->ac);
    }
    if (status < 0 && p->ac != NULL) {
        /* libuv stopped the poll on the error; the context lives on: watch its socket again. */
        int want = p->events;
        p->events = 0;
        rw_ev_set(p, want);
    }
}

static void rw_ev_set(rw_ev *p, int ev) {
    if (ev == p->events || p->ac == NULL) {
        return;
    }
    p->events = ev;
    if (ev != 0) {
        uv_poll_start(&p->poll, ev, rw_ev_poll);
    } else {
        uv_poll_stop(&p->poll);
    }
}

static void rw_ev_add_read(void *d) {
    rw_ev *p = d;
    rw_ev_set(p, p->events | UV_READABLE);
}

static void rw_ev_del_read(void *d) {
    rw_ev *p = d;
    rw_ev_set(p, p->events & ~UV_READABLE);
}

static void rw_ev_add_write(void *d) {
    rw_ev *p = d;
    rw_ev_set(p, p->events | UV_WRITABLE);
}

static void rw_ev_del_write(void *d) {
    rw_ev *p = d;
    rw_ev_set(p, p->events & ~UV_WRITABLE);
}

static void rw_ev_closed(uv_handle_t *h) {
    free(h->data);
}

static void rw_ev_cleanup(void *d) {
    rw_ev *p = d;
    p->ac = NULL;
    uv_close((uv_handle_t *)&p->poll, rw_ev_closed);
}

static int rw_attach(redisAsyncContext *ac, uv_loop_t *loop) {
    if (ac->ev.data != NULL) {
        return REDIS_ERR;
    }
    rw_ev *p = calloc(1, sizeof(*p));
    if (p == NULL) {
        return REDIS_ERR;
    }
    if (uv_poll_init(loop, &p->poll, ac->c.fd) != 0) {
        free(p);
        return REDIS_ERR;
    }
    p->poll.data = p;
    p->ac = ac;
    ac->ev.data = p;
    ac->ev.addRead = rw_ev_add_read;
    ac->ev.delRead = rw_ev_del_read;
    ac->ev.addWrite = rw_ev_add_write;
    ac->ev.delWrite = rw_ev_del_write;
    ac->ev.cleanup = rw_ev_cleanup;
    return REDIS_OK;
}

/* A new context to host:port on the loop, NULL (logged) when libhiredis cannot make one. */
static redisAsyncContext *rw_connect(kvd_rwatch *w, const char *host, int port, void *data,
                                     redisConnectCallback *on_conn,
                                     redisDisconnectCallback *on_disc) {
    redisAsyncContext *ac = redisAsyncConnect(host, port);
    if (ac == NULL || ac->err) {
        KV_LOG(DEBUG, "KVD-REMOTE-WATCH", "remote watch: %s:%d: %s", host, port,
               ac != NULL ? ac->errstr : "out of memory");
        if (ac != NULL) {
            redisAsyncFree(ac);
        }
        return NULL;
    }
    if (rw_attach(ac, w->loop) != REDIS_OK) {
        redisAsyncFree(ac);
        return NULL;
    }
    ac->data = data;
    redisAsyncSetConnectCallback(ac, on_conn);
    redisAsyncSetDisconnectCallback(ac, on_disc);
    if (w->password[0] != '\0') {
        redisAsyncCommand(ac, NULL, NULL, "AUTH %s", w->password);
    }
    return ac;
}

/* ---- names -----------------------------------------------------------------------------------
 * A host name is resolved on libuv's thread pool (uv_getaddrinfo), never on the loop thread:
 * libhiredis's connect would call getaddrinfo right there. An address is used as it is. */

static void rw_open_at(kvd_rwatch *w, int node, const char *addr, int port);

#define RW_DISCOVERY (-1) /* rw_open's node: the discovery connection */
#define RW_CHECK (-2)     /* the check connection */

typedef struct rw_resolve {
    uv_getaddrinfo_t req;
    kvd_rwatch *w;
    uint32_t gen;     /* w->gen when it was asked */
    uint32_t chk_gen; /* w->chk_gen when it was asked (RW_CHECK) */
    int node;         /* the node it is for, or RW_DISCOVERY, RW_CHECK */
    int port;
} rw_resolve;

static int is_address(const char *host) {
    unsigned char buf[sizeof(struct in6_addr)];
    return inet_pton(AF_INET, host, buf) == 1 || inet_pton(AF_INET6, host, buf) == 1;
}

static void on_resolved(uv_getaddrinfo_t *req, int status, struct addrinfo *res) {
    rw_resolve *r = req->data;
    kvd_rwatch *w = r->w;
    char addr[INET6_ADDRSTRLEN] = "";
    /* The first IPv4 address, else the first one (the remote tier's own connect, through
     * libhiredis, tries the system's order; a server bound to 127.0.0.1 only is common). */
    const struct addrinfo *pick = NULL;
    for (const struct addrinfo *ai = status == 0 ? res : NULL; ai != NULL; ai = ai->ai_next) {
        if (ai->ai_family == AF_INET || (pick == NULL && ai->ai_family == AF_INET6)) {
            pick = ai;
            if (ai->ai_family == AF_INET) {
                break;
            }
        }
    }
    if (pick != NULL) {
        const void *a = pick->ai_family == AF_INET6
                            ? (const void *)&((struct sockaddr_in6 *)pick->ai_addr)->sin6_addr
                            : (const void *)&((struct sockaddr_in *)pick->ai_addr)->sin_addr;
        if (inet_ntop(pick->ai_family, a, addr, sizeof(addr)) == NULL) {
            addr[0] = '\0';
        }
    }
    if (res != NULL) {
        uv_freeaddrinfo(res);
    }
    if (r->node == RW_CHECK && (r->chk_gen != w->chk_gen || !w->chk_busy)) {
        /* an abandoned check's name: dropped */
    } else if (!w->closing && r->gen == w->gen) {
        if (addr[0] == '\0' && r->node == RW_CHECK) {
            KV_LOG(DEBUG, "KVD-REMOTE-WATCH", "remote watch: check: cannot resolve a name: %s",
                   status != 0 ? uv_strerror(status) : "no address");
            w->chk_busy = 0;
        } else if (addr[0] == '\0') {
            KV_LOG(WARN, "KVD-REMOTE-WATCH", "remote watch: cannot resolve a %s's name: %s",
                   r->node < 0 ? "seed" : "node", status != 0 ? uv_strerror(status) : "no address");
            rw_schedule_restart(w, "a name did not resolve");
        } else {
            rw_open_at(w, r->node, addr, r->port);
        }
    }
    free(r);
}

/* Opens the discovery connection (RW_DISCOVERY), the check connection (RW_CHECK) or node's
 * subscriber to host:port. */
static void rw_open(kvd_rwatch *w, int node, const char *host, int port) {
    if (is_address(host)) {
        rw_open_at(w, node, host, port);
        return;
    }
    rw_resolve *r = calloc(1, sizeof(*r));
    char ps[8];
    snprintf(ps, sizeof(ps), "%d", port);
    struct addrinfo hints;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    if (r == NULL) {
        if (node == RW_CHECK) {
            w->chk_busy = 0; /* a check that cannot be made is no failure of the watch */
        } else {
            rw_schedule_restart(w, "out of memory");
        }
        return;
    }
    r->w = w;
    r->gen = w->gen;
    r->chk_gen = w->chk_gen;
    r->node = node;
    r->port = port;
    r->req.data = r;
    if (uv_getaddrinfo(w->loop, &r->req, on_resolved, host, ps, &hints) != 0) {
        free(r);
        if (node == RW_CHECK) {
            w->chk_busy = 0;
        } else {
            rw_schedule_restart(w, "cannot resolve a name");
        }
    }
}

/* ---- subscribers ---------------------------------------------------------------------------- */

static void node_connected(const redisAsyncContext *ac, int status) {
    rw_node *n = ac->data;
    if (status != REDIS_OK && n->ac == ac) {
        n->ac = NULL; /* libhiredis frees it */
        KV_LOG(DEBUG, "KVD-REMOTE-WATCH", "remote watch: %s:%d: %s", n->host, n->port, ac->errstr);
        rw_schedule_restart(n->w, "a node's connection failed");
    }
}

static void node_disconnected(const redisAsyncContext *ac, int status) {
    (void)status;
    rw_node *n = ac->data;
    if (n->ac != ac) {
        return; /* torn down */
    }
    n->ac = NULL;
    if (n->subscribed) {
        n->subscribed = 0;
        n->w->st.nodes--;
        gap_opens(n->w);
    }
    rw_schedule_restart(n->w, "a node's connection closed");
}

static int has_flag(const char *flags, char f) {
    return strchr(flags, f) != NULL;
}

static void node_config(redisAsyncContext *ac, void *reply, void *priv) {
    rw_node *n = priv;
    redisReply *r = reply;
    if (r == NULL || n->ac != ac) {
        return;
    }
    const char *flags = NULL;
    if (r->type == REDIS_REPLY_ARRAY && r->elements == 2 &&
        r->element[1]->type == REDIS_REPLY_STRING) {
        flags = r->element[1]->str;
    }
    if (flags != NULL && has_flag(flags, 'E') &&
        (has_flag(flags, 'A') || (has_flag(flags, 'x') && has_flag(flags, 'e')))) {
        return;
    }
    n->w->st.unconfigured++;
    if (flags != NULL) {
        KV_LOG(WARN, "KVD-REMOTE-WATCH",
               "remote watch: %s:%d has notify-keyspace-events '%s': the values Redis expires or "
               "evicts there are not reported (BlockRemoved on REMOTE); set it to include 'Exe' "
               "(kvd never changes a server's configuration)",
               n->host, n->port, flags);
    } else {
        KV_LOG(WARN, "KVD-REMOTE-WATCH",
               "remote watch: %s:%d: CONFIG GET notify-keyspace-events failed (%s); its drops are "
               "reported only if the server sends them",
               n->host, n->port, r->type == REDIS_REPLY_ERROR ? r->str : "unexpected reply");
    }
}

static int all_subscribed(const kvd_rwatch *w) {
    for (int i = 0; i < w->nnodes; i++) {
        if (!w->nodes[i].subscribed) {
            return 0;
        }
    }
    return w->nnodes > 0;
}

static void node_message(redisAsyncContext *ac, void *reply, void *priv) {
    rw_node *n = priv;
    redisReply *r = reply;
    kvd_rwatch *w = n->w;
    if (r == NULL || n->ac != ac || w->closing) {
        return;
    }
    if (r->type != REDIS_REPLY_ARRAY || r->elements != 3 ||
        r->element[0]->type != REDIS_REPLY_STRING) {
        if (r->type == REDIS_REPLY_ERROR) {
            KV_LOG(WARN, "KVD-REMOTE-WATCH", "remote watch: %s:%d refused SUBSCRIBE: %s", n->host,
                   n->port, r->str);
        }
        return;
    }
    const char *kind = r->element[0]->str;
    if (strcmp(kind, "subscribe") == 0) {
        if (r->element[2]->type == REDIS_REPLY_INTEGER && r->element[2]->integer == 2 &&
            !n->subscribed) {
            n->subscribed = 1;
            w->st.nodes++;
            if (all_subscribed(w)) {
                w->gap_open = 0;
                uv_timer_stop(&w->deadline);
                w->backoff_ms = RW_BACKOFF_MIN_MS;
                KV_LOG(INFO, "KVD-REMOTE-WATCH",
                       "remote watch: subscribed to expiries and evictions on %d node(s)%s",
                       w->nnodes,
                       w->st.unconfigured > 0 ? " (some not configured to send them)" : "");
                if (w->up_fn != NULL) {
                    w->up_fn(w->up_arg);
                }
            }
        }
        return;
    }
    if (strcmp(kind, "message") != 0 || r->element[1]->type != REDIS_REPLY_STRING ||
        r->element[2]->type != REDIS_REPLY_STRING) {
        return;
    }
    size_t cl = r->element[1]->len;
    int evicted = cl >= 7 && memcmp(r->element[1]->str + cl - 7, "evicted", 7) == 0;
    if (evicted) {
        w->st.evicted++;
    } else {
        w->st.expired++;
    }
    w->fn(w->arg, r->element[2]->str, r->element[2]->len, evicted);
}

int kvd_rwatch_up(const kvd_rwatch *w) {
    return all_subscribed(w);
}

void kvd_rwatch_set_up_fn(kvd_rwatch *w, kvd_rwatch_up_fn fn, void *arg) {
    w->up_fn = fn;
    w->up_arg = arg;
}

static void rw_start_nodes(kvd_rwatch *w) {
    for (int i = 0; i < w->nnodes; i++) {
        w->nodes[i].w = w;
        w->nodes[i].subscribed = 0;
        rw_open(w, i, w->nodes[i].host, w->nodes[i].port);
    }
}

/* ---- discovery ------------------------------------------------------------------------------ */

static void disc_connected(const redisAsyncContext *ac, int status) {
    kvd_rwatch *w = ac->data;
    if (status != REDIS_OK && w->disc == ac) {
        w->disc = NULL; /* libhiredis frees it */
        rw_schedule_restart(w, "no seed answered");
    }
}

static void disc_disconnected(const redisAsyncContext *ac, int status) {
    (void)status;
    kvd_rwatch *w = ac->data;
    if (w->disc == ac) {
        w->disc = NULL;
        rw_schedule_restart(w, "the seed closed the connection");
    }
}

static int rw_add_node(kvd_rwatch *w, const char *host, int port) {
    for (int i = 0; i < w->nnodes; i++) {
        if (w->nodes[i].port == port && strcmp(w->nodes[i].host, host) == 0) {
            return 0;
        }
    }
    if (w->nnodes == RW_MAX_NODES || strlen(host) >= RW_HOST_MAX) {
        return -1;
    }
    rw_node *n = &w->nodes[w->nnodes++];
    memset(n, 0, sizeof(*n));
    memcpy(n->host, host, strlen(host) + 1); /* shorter than RW_HOST_MAX: checked above */
    n->port = port;
    return 0;
}

/* Remembers host:port as a node to ask in later discoveries. */
static void rw_learn(kvd_rwatch *w, const char *host, int port) {
    for (int i = 0; i < w->nknown; i++) {
        if (w->seed_port[i] == port && strcmp(w->seed_host[i], host) == 0) {
            return;
        }
    }
    if (w->nknown < 2 * RW_MAX_NODES && strlen(host) < RW_HOST_MAX) {
        snprintf(w->seed_host[w->nknown], RW_HOST_MAX, "%s", host);
        w->seed_port[w->nknown++] = port;
    }
}

typedef struct rw_addr {
    char host[RW_HOST_MAX];
    int port;
    int self_named; /* CLUSTER SLOTS gave no address: host is the name of the node asked */
} rw_addr;

/* The masters a CLUSTER SLOTS reply names (host empty: the node asked, host:port), at most max
 * (more are left out), each once; every node it names is learnt for later discoveries. Returns
 * their count; 1 (the node asked) where cluster support is off (*standalone set); -1 for another
 * reply (an error: logged at level). */
static int slots_masters(kvd_rwatch *w, const redisReply *r, const char *host, int port,
                         rw_addr *out, int max, int *standalone, kv_log_level level) {
    *standalone = 0;
    if (r->type == REDIS_REPLY_ERROR && strstr(r->str, "cluster support disabled") != NULL) {
        snprintf(out[0].host, RW_HOST_MAX, "%s", host);
        out[0].port = port;
        out[0].self_named = 1;
        *standalone = 1;
        return 1;
    }
    if (r->type != REDIS_REPLY_ARRAY) {
        if (level <= kv_log_threshold) {
            kv_log_emit(level, "KVD-REMOTE-WATCH", "remote watch: %s:%d: CLUSTER SLOTS: %s", host,
                        port, r->type == REDIS_REPLY_ERROR ? r->str : "unexpected reply");
        }
        return -1;
    }
    int n = 0;
    for (size_t i = 0; i < r->elements; i++) {
        const redisReply *range = r->element[i];
        if (range->type != REDIS_REPLY_ARRAY || range->elements < 3 ||
            range->element[2]->type != REDIS_REPLY_ARRAY || range->element[2]->elements < 2 ||
            range->element[2]->element[0]->type != REDIS_REPLY_STRING ||
            range->element[2]->element[1]->type != REDIS_REPLY_INTEGER) {
            continue;
        }
        /* An empty host is the node we asked (Redis does not know its own address). */
        const char *mh = range->element[2]->element[0]->str;
        int self = mh[0] == '\0';
        mh = self ? host : mh;
        int mp = (int)range->element[2]->element[1]->integer;
        int seen = 0;
        for (int k = 0; k < n && !seen; k++) {
            seen = out[k].port == mp && strcmp(out[k].host, mh) == 0;
        }
        if (!seen && n < max && strlen(mh) < RW_HOST_MAX) {
            snprintf(out[n].host, RW_HOST_MAX, "%s", mh);
            out[n].self_named = self;
            out[n++].port = mp;
        }
        for (size_t k = 2; k < range->elements; k++) {
            const redisReply *nd = range->element[k];
            if (nd->type == REDIS_REPLY_ARRAY && nd->elements >= 2 &&
                nd->element[0]->type == REDIS_REPLY_STRING &&
                nd->element[1]->type == REDIS_REPLY_INTEGER) {
                rw_learn(w, nd->element[0]->str[0] != '\0' ? nd->element[0]->str : host,
                         (int)nd->element[1]->integer);
            }
        }
    }
    return n;
}

static void disc_slots(redisAsyncContext *ac, void *reply, void *priv) {
    kvd_rwatch *w = priv;
    redisReply *r = reply;
    if (r == NULL || w->disc != ac || w->closing) {
        return;
    }
    rw_addr m[RW_MAX_NODES];
    int n = slots_masters(w, r, w->seed_host[w->asked], w->seed_port[w->asked], m, RW_MAX_NODES,
                          &w->standalone, KV_LOG_WARN);
    w->nnodes = 0;
    for (int i = 0; i < n; i++) {
        if (rw_add_node(w, m[i].host, m[i].port) == 0) {
            w->nodes[w->nnodes - 1].self_named = m[i].self_named;
        }
    }
    /* The discovery connection is done: it goes after this callback (libhiredis). */
    w->disc = NULL;
    redisAsyncDisconnect(ac);
    if (w->nnodes == 0) {
        rw_schedule_restart(w, "no master found");
        return;
    }
    rw_start_nodes(w);
}

/* ---- checks: has the set of masters changed? ----------------------------------------------- */

static void chk_connected(const redisAsyncContext *ac, int status) {
    kvd_rwatch *w = ac->data;
    if (status != REDIS_OK && w->chk == ac) {
        w->chk = NULL; /* libhiredis frees it; the next check asks another node */
        w->chk_busy = 0;
        KV_LOG(DEBUG, "KVD-REMOTE-WATCH", "remote watch: check: %s", ac->errstr);
    }
}

static void chk_disconnected(const redisAsyncContext *ac, int status) {
    (void)status;
    kvd_rwatch *w = ac->data;
    if (w->chk == ac) {
        w->chk = NULL;
        w->chk_busy = 0;
    }
}

/* One master of a reply is a watched node: the same port, and the same host unless one side is
 * named after the node asked (the address Redis gave it elsewhere may be spelt otherwise). */
static int watched(const kvd_rwatch *w, const rw_addr *m) {
    for (int k = 0; k < w->nnodes; k++) {
        const rw_node *n = &w->nodes[k];
        if (n->port == m->port &&
            (n->self_named || m->self_named || strcmp(n->host, m->host) == 0)) {
            return 1;
        }
    }
    return 0;
}

static void chk_slots(redisAsyncContext *ac, void *reply, void *priv) {
    kvd_rwatch *w = priv;
    redisReply *r = reply;
    if (r == NULL || w->chk != ac || w->closing) {
        return;
    }
    rw_addr m[RW_MAX_NODES];
    int standalone;
    int n =
        slots_masters(w, r, w->chk_host, w->chk_port, m, RW_MAX_NODES, &standalone, KV_LOG_DEBUG);
    w->chk = NULL;
    w->chk_busy = 0;
    redisAsyncDisconnect(ac);
    if (n <= 0 || !all_subscribed(w)) {
        return; /* no answer to compare (an error reply), or a restart under way */
    }
    w->st.checks++;
    int same = n == w->nnodes;
    /* FNV-1a over the masters in the reply's order: port, and host unless self-named (its
     * spelling depends on the node asked). */
    uint64_t sig = 1469598103934665603ull;
    for (int i = 0; i < n; i++) {
        same = same && watched(w, &m[i]);
        sig = (sig ^ (uint64_t)m[i].port) * 1099511628211ull;
        for (const char *c = m[i].self_named ? "" : m[i].host; *c != '\0'; c++) {
            sig = (sig ^ (uint8_t)*c) * 1099511628211ull;
        }
    }
    if (same) {
        w->chk_sig = 0;
        return;
    }
    /* During a reshard or a failover the nodes' views differ for a while: the watch starts
     * again when two checks in a row (of different nodes, where there are several) saw the same
     * new set. */
    if (w->chk_sig != sig) {
        w->chk_sig = sig;
        KV_LOG(DEBUG, "KVD-REMOTE-WATCH",
               "remote watch: %s:%d names %d masters, not the %d watched; checking again",
               w->chk_host, w->chk_port, n, w->nnodes);
        return;
    }
    KV_LOG(INFO, "KVD-REMOTE-WATCH",
           "remote watch: the cluster's masters changed (%d now, %d watched)", n, w->nnodes);
    w->st.changes++;
    w->chk_sig = 0;
    w->backoff_ms = RW_BACKOFF_MIN_MS;
    rw_schedule_restart(w, "the cluster's masters changed");
}

/* Every refresh_ms: a check, when every node is subscribed and nothing else is under way. A
 * check still under way from the last tick (a node that accepted and never answered, a name
 * that never resolved) is abandoned first. */
static void on_refresh(uv_timer_t *t) {
    kvd_rwatch *w = t->data;
    if (w->chk_busy) {
        if (w->chk != NULL) {
            redisAsyncContext *ac = w->chk;
            w->chk = NULL;
            redisAsyncFree(ac); /* from a timer: not inside one of libhiredis's callbacks */
        }
        w->chk_busy = 0;
        w->chk_gen++;
        KV_LOG(DEBUG, "KVD-REMOTE-WATCH", "remote watch: check of %s:%d unanswered: abandoned",
               w->chk_host, w->chk_port);
        return;
    }
    if (w->closing || w->standalone || w->disc != NULL || w->restart_pending ||
        !all_subscribed(w)) {
        return;
    }
    rw_node *n = &w->nodes[w->chk_at++ % (unsigned)w->nnodes];
    snprintf(w->chk_host, sizeof(w->chk_host), "%s", n->host);
    w->chk_port = n->port;
    w->chk_busy = 1;
    rw_open(w, RW_CHECK, w->chk_host, w->chk_port);
}

static void rw_start_discovery(kvd_rwatch *w) {
    w->st.discoveries++;
    w->st.unconfigured = 0;
    int s = w->seed_at;
    w->asked = s;
    w->seed_at = (w->seed_at + 1) % w->nknown;
    uv_timer_start(&w->deadline, on_deadline, 5 * w->timeout_ms, 0);
    rw_open(w, RW_DISCOVERY, w->seed_host[s], w->seed_port[s]);
}

static void rw_open_at(kvd_rwatch *w, int node, const char *addr, int port) {
    if (node == RW_CHECK) {
        if (w->chk != NULL || w->disc != NULL || w->restart_pending) {
            w->chk_busy = 0; /* a discovery started while its name was resolved */
            return;
        }
        w->chk = rw_connect(w, addr, port, w, chk_connected, chk_disconnected);
        if (w->chk == NULL) {
            w->chk_busy = 0;
            return;
        }
        redisAsyncCommand(w->chk, chk_slots, w, "CLUSTER SLOTS");
        return;
    }
    if (node == RW_DISCOVERY) {
        w->disc = rw_connect(w, addr, port, w, disc_connected, disc_disconnected);
        if (w->disc == NULL) {
            rw_schedule_restart(w, "cannot connect to a seed");
            return;
        }
        redisAsyncCommand(w->disc, disc_slots, w, "CLUSTER SLOTS");
        return;
    }
    rw_node *n = &w->nodes[node];
    n->ac = rw_connect(w, addr, port, n, node_connected, node_disconnected);
    if (n->ac == NULL) {
        rw_schedule_restart(w, "cannot connect to a node");
        return;
    }
    redisAsyncCommand(n->ac, node_config, n, "CONFIG GET notify-keyspace-events");
    redisAsyncCommand(n->ac, node_message, n,
                      "SUBSCRIBE __keyevent@0__:expired __keyevent@0__:evicted");
}

/* ---- the interface -------------------------------------------------------------------------- */

kv_err kvd_rwatch_alloc(uv_loop_t *loop, const kvd_rwatch_cfg *cfg, kvd_rwatch_fn fn, void *arg,
                        kvd_rwatch **out, char *msg, size_t len) {
    kvd_rwatch *w = calloc(1, sizeof(*w));
    if (w == NULL) {
        return KV_ENOMEM;
    }
    w->password = strdup(cfg->password != NULL ? cfg->password : "");
    if (w->password == NULL) {
        free(w);
        return KV_ENOMEM;
    }
    kvd_remote_seed *seeds = malloc(KVD_REMOTE_SEEDS_MAX * sizeof(*seeds));
    kv_err perr =
        seeds == NULL ? KV_ENOMEM : kvd_remote_parse_seeds(cfg->seeds, seeds, &w->nseeds, msg, len);
    if (perr != KV_OK) {
        free(seeds);
        free(w->password);
        free(w);
        return perr;
    }
    for (int i = 0; i < w->nseeds; i++) {
        memcpy(w->seed_host[i], seeds[i].host, RW_HOST_MAX); /* NUL-ended by the parser */
        w->seed_port[i] = seeds[i].port;
    }
    free(seeds);
    w->nknown = w->nseeds;
    w->loop = loop;
    w->fn = fn;
    w->arg = arg;
    w->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : 200;
    w->backoff_ms = RW_BACKOFF_MIN_MS;
    w->backoff_max_ms = cfg->backoff_max_ms > 0 ? cfg->backoff_max_ms : 5000;
    w->refresh_ms = cfg->refresh_ms;
    uv_timer_init(loop, &w->restart);
    uv_timer_init(loop, &w->deadline);
    uv_timer_init(loop, &w->refresh);
    w->restart.data = w->deadline.data = w->refresh.data = w;
    if (w->refresh_ms > 0) {
        uv_timer_start(&w->refresh, on_refresh, w->refresh_ms, w->refresh_ms);
    }
    rw_start_discovery(w);
    *out = w;
    return KV_OK;
}

void kvd_rwatch_close(kvd_rwatch *w) {
    if (w == NULL || w->closing) {
        return;
    }
    rw_teardown(w);
    w->closing = 1;
    uv_close((uv_handle_t *)&w->restart, NULL);
    uv_close((uv_handle_t *)&w->deadline, NULL);
    uv_close((uv_handle_t *)&w->refresh, NULL);
}

void kvd_rwatch_free(kvd_rwatch *w) {
    if (w == NULL) {
        return;
    }
    free(w->password);
    free(w);
}

void kvd_rwatch_get_stats(const kvd_rwatch *w, kvd_rwatch_stats *out) {
    if (w == NULL) {
        memset(out, 0, sizeof(*out));
        return;
    }
    *out = w->st;
}
