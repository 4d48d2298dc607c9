/* kvd_remote: the remote tier's Redis client (remote.h has the contract). */
#include "daemon/tiers/remote.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

#include "common/kv_log.h"

#define MAX_NODES 64
#define LOOKUPS_MAX 16 /* host name lookups waiting for DNS at once, over all nodes */
#define NSLOTS 16384
#define PUT_BATCH 64
#define BACKOFF_MIN_MS 100
#define UNDEL_MAX 1024     /* deletes that failed, kept to be tried again */
#define UNDEL_RETRY_MS 500 /* how often they are tried again */

enum { OP_PUT = 1, OP_GET = 2, OP_DEL = 3, OP_PROBE = 4 };

typedef struct op {
    int kind;
    struct op *next;
    kv_err rc;
    /* put, del */
    const char *key;
    char *owned_key; /* del: its own copy */
    kvd_remote_meta meta;
    uint8_t tail[KVD_REMOTE_TAIL]; /* put: meta.tail points here */
    const uint8_t *payload;
    size_t plen;
    kvd_remote_put_done put_done;
    /* get */
    const char *const *keys;
    const kvd_remote_meta *want;
    const kvd_remote_dst *dst; /* NULL or [n] */
    size_t n;
    kvd_remote_val *vals;
    kvd_remote_get_done get_done;
    /* probe (keys, n as a get's) */
    uint8_t *present;
    kvd_remote_probe_done probe_done;
    uint64_t deadline; /* get: ms by which it is answered (one timeout for all its work) */
    void *arg;
} op;

/* A host name's lookup, run by a thread of its own (blocking getaddrinfo) so that the remote
 * thread can stop waiting for it. Shared by the node and the lookup thread, freed by whichever
 * lets go last: a lookup that runs past its time stays with its node and is looked at again at
 * the node's next connect. (Not glibc's getaddrinfo_a: its helper threads are made inside libc,
 * where ThreadSanitizer cannot see them, and crash a TSan build.) */
typedef struct resolve {
    pthread_mutex_t mu;
    pthread_cond_t cv;    /* signalled when done (CLOCK_MONOTONIC) */
    int refs;             /* the node's and the lookup thread's */
    int done;             /* rc and res are the answer */
    int rc;               /* getaddrinfo's */
    struct addrinfo *res; /* its addresses when rc is 0 */
    char name[256];       /* the host name (nodes move when the cluster map shrinks) */
} resolve;

typedef struct node {
    char host[256];
    int port;
    resolve *res; /* a lookup of host still running, or NULL */
    redisContext *c;
    uint64_t down_until; /* ms; 0: may try now */
    uint32_t fails;
    /* ms spent in lookups and connects a request's deadline cut short since the node last
     * connected: once it reaches remote-timeout-ms the node is marked down as a full timeout
     * would have (so a dead node still backs off when every request finds it late). */
    uint64_t cut_ms;
    /* The get path's own read buffer (read_get_reply): bytes of c's socket not yet parsed. */
    uint8_t *rb;
    size_t rb_pos, rb_len;
    /* ms by which the get path's reads must be done (0: none): SO_RCVTIMEO bounds each read,
     * not a value that trickles in a few bytes at a time. */
    uint64_t rdl;
} node;

struct kvd_remote {
    uv_loop_t *loop;
    uv_async_t async;
    int async_open;
    pthread_t th;
    int th_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop;
    op *gets, **gets_tail; /* queued gets (FIFO) */
    op *puts, **puts_tail; /* queued puts (FIFO) */
    op *done, **done_tail; /* finished, for the loop */
    uint64_t dels_queued;  /* DELs in puts: gets wait until they have run */
    uint64_t queued_bytes;
    uint64_t queue_cap;
    char *password;
    uint64_t timeout_ms, ttl_s, backoff_max_ms;
    /* The thread's own (no lock): */
    node nodes[MAX_NODES];
    int nnodes, nseeds;
    int cluster;      /* slot map in use */
    int need_refresh; /* read CLUSTER SLOTS again before the next request */
    int probed;       /* single vs cluster decided */
    int16_t *slots;   /* [NSLOTS] node index, -1 unknown */
    /* Deletes that failed (node down, timeout), tried again every UNDEL_RETRY_MS until they land;
     * until then a get or probe of their key is a miss. */
    op *undel;
    size_t nundel;
    uint64_t undel_at; /* ms: when to try them again */
    /* Lookups that nodes a new slot map forgot left running (a DNS server that does not
     * answer holds each for its resolver's timeouts): a node of the same name met again waits
     * for one of these instead of starting another thread. */
    resolve *idle[LOOKUPS_MAX];
    int nidle;
    /* Shared (under mu): */
    kvd_remote_stats st;
};

/* ---- the reply reader ---------------------------------------------------------------------
 * libhiredis copies each bulk string out of its read buffer into a malloc'd buffer of its own
 * (its createString). A value of ours is rearranged during that copy: the payload first, then
 * the digest tail if the value has one, the header behind them, so a value that passes its checks
 * is handed on (T1 adopts the buffer) without the 256 KiB memmove a header in front would cost.
 * Only top-level strings that start with the magic are rearranged, marked by integer = TAIL_MARK (a
 * string reply's integer is otherwise 0); every other reply (CLUSTER SLOTS, errors, foreign values)
 * is libhiredis's own. */
#define TAIL_MARK 0x4b56445254 /* "KVDRT" */

static redisReplyObjectFunctions g_default_fns, g_fns;
static pthread_once_t g_fns_once = PTHREAD_ONCE_INIT;

static void *create_string(const redisReadTask *task, char *str, size_t len) {
    if (task->parent != NULL || task->type != REDIS_REPLY_STRING || len < KVD_REMOTE_HEADER ||
        memcmp(str, "KVDR", 4) != 0) {
        return g_default_fns.createString(task, str, len);
    }
    redisReply *rep = calloc(1, sizeof(*rep)); /* freed by freeReplyObject, as its own */
    char *buf = malloc(len + 1);
    if (rep == NULL || buf == NULL) {
        free(rep);
        free(buf);
        return NULL; /* libhiredis reports out of memory */
    }
    size_t body = len - KVD_REMOTE_HEADER;
    if ((str[7] & KVD_REMOTE_F_TAIL) && body >= KVD_REMOTE_TAIL) {
        /* payload | tail | header */
        size_t pl = body - KVD_REMOTE_TAIL;
        memcpy(buf, str + KVD_REMOTE_HEADER + KVD_REMOTE_TAIL, pl);
        memcpy(buf + pl, str + KVD_REMOTE_HEADER, KVD_REMOTE_TAIL);
    } else {
        memcpy(buf, str + KVD_REMOTE_HEADER, body); /* payload | header */
    }
    memcpy(buf + body, str, KVD_REMOTE_HEADER);
    buf[len] = '\0';
    rep->type = REDIS_REPLY_STRING;
    rep->str = buf;
    rep->len = len;
    rep->integer = TAIL_MARK;
    return rep;
}

static void fns_init(void) {
    redisReader *rd = redisReaderCreate();
    if (rd != NULL) {
        g_default_fns = *rd->fn;
        redisReaderFree(rd);
    }
    g_fns = g_default_fns;
    if (g_default_fns.createString != NULL) {
        g_fns.createString = create_string;
    }
}

static uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* ---- CRC16 (XMODEM), the Cluster's key hash ---------------------------------------------- */

static uint16_t crc16(const char *buf, size_t len) {
    uint16_t crc = 0;
    for (size_t i = 0; i < len; i++) {
        crc ^= (uint16_t)((uint8_t)buf[i] << 8);
        for (int b = 0; b < 8; b++) {
            crc = (crc & 0x8000) ? (uint16_t)((crc << 1) ^ 0x1021) : (uint16_t)(crc << 1);
        }
    }
    return crc;
}

uint32_t kvd_remote_slot(const char *key, size_t len) {
    /* Redis Cluster's rule: a non-empty {tag} hashes alone. */
    const char *open = memchr(key, '{', len);
    if (open != NULL) {
        size_t o = (size_t)(open - key);
        const char *close = memchr(open + 1, '}', len - o - 1);
        if (close != NULL && close > open + 1) {
            return crc16(open + 1, (size_t)(close - open - 1)) & (NSLOTS - 1);
        }
    }
    return crc16(key, len) & (NSLOTS - 1);
}

/* ---- stats (the lock) ---------------------------------------------------------------------- */

static void note_error(kvd_remote *r, const char *fmt, const char *a, int port, const char *b) {
    pthread_mutex_lock(&r->mu);
    r->st.errors++;
    snprintf(r->st.last_error, sizeof(r->st.last_error), fmt, a, port, b);
    pthread_mutex_unlock(&r->mu);
}

static void count(kvd_remote *r, uint64_t *field, uint64_t v) {
    pthread_mutex_lock(&r->mu);
    *field += v;
    pthread_mutex_unlock(&r->mu);
}

static int any_up(const kvd_remote *r);

/* Whether key waits in the deletes that failed (thread). */
static int undel_has(const kvd_remote *r, const char *key) {
    for (const struct op *o = r->undel; o != NULL; o = o->next) {
        if (strcmp(o->key, key) == 0) {
            return 1;
        }
    }
    return 0;
}

/* ---- nodes ------------------------------------------------------------------------------- */

/* Closes nd's connection (its unread replies and buffered bytes with it). */
static void node_close(node *nd) {
    if (nd->c != NULL) {
        redisFree(nd->c);
        nd->c = NULL;
    }
    nd->rb_pos = nd->rb_len = 0; /* the closed connection's bytes */
}

static void node_fail(kvd_remote *r, node *nd, const char *why) {
    note_error(r, "%s:%d: %s", nd->host, nd->port, why);
    node_close(nd);
    uint64_t back = BACKOFF_MIN_MS; /* doubled per failure in a row, up to backoff_max_ms */
    for (uint32_t i = 0; i < nd->fails && back < r->backoff_max_ms; i++) {
        back *= 2;
    }
    nd->down_until = now_ms() + (back < r->backoff_max_ms ? back : r->backoff_max_ms);
    nd->fails++;
    if (r->cluster) {
        r->need_refresh = 1; /* a failover may have moved its slots */
    }
}

/* The connection's send and receive timeout. */
static void set_timeout(redisContext *c, uint64_t ms) {
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)(ms % 1000) * 1000};
    (void)redisSetTimeout(c, tv);
}

static void resolve_rele(resolve *q) {
    if (q == NULL) {
        return;
    }
    pthread_mutex_lock(&q->mu);
    int last = --q->refs == 0;
    pthread_mutex_unlock(&q->mu);
    if (last) {
        if (q->res != NULL) {
            freeaddrinfo(q->res);
        }
        pthread_cond_destroy(&q->cv);
        pthread_mutex_destroy(&q->mu);
        free(q);
    }
}

static void *resolve_main(void *arg) {
    resolve *q = arg;
    struct addrinfo hints;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    struct addrinfo *res = NULL;
    int rc = getaddrinfo(q->name, NULL, &hints, &res);
    pthread_mutex_lock(&q->mu);
    q->rc = rc;
    q->res = rc == 0 ? res : NULL;
    q->done = 1;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    resolve_rele(q);
    return NULL;
}

static int resolve_done(resolve *q) {
    pthread_mutex_lock(&q->mu);
    int d = q->done;
    pthread_mutex_unlock(&q->mu);
    return d;
}

static void resolve_ref(resolve *q) {
    pthread_mutex_lock(&q->mu);
    q->refs++;
    pthread_mutex_unlock(&q->mu);
}

/* Starts looking name up; NULL when no thread or memory could be had. */
static resolve *resolve_start(const char *name) {
    resolve *q = calloc(1, sizeof(*q));
    if (q == NULL) {
        return NULL;
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&q->cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&q->mu, NULL);
    snprintf(q->name, sizeof(q->name), "%s", name);
    q->refs = 2;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    pthread_t th;
    int rc = pthread_create(&th, &at, resolve_main, q);
    pthread_attr_destroy(&at);
    if (rc != 0) {
        q->refs = 1;
        resolve_rele(q);
        return NULL;
    }
    return q;
}

/* Lets go of the lookups forgotten nodes left behind once they have ended. */
static void lookups_sweep(kvd_remote *r) {
    int n = 0;
    for (int k = 0; k < r->nidle; k++) {
        if (resolve_done(r->idle[k])) {
            resolve_rele(r->idle[k]);
        } else {
            r->idle[n++] = r->idle[k];
        }
    }
    r->nidle = n;
}

/* A lookup of name for a node to wait for: one already running or answered for the name
 * (another node's: a Cluster's masters often share a host name; or one a forgotten node left
 * behind), else a new one; NULL (why) when LOOKUPS_MAX lookups are still waiting for an answer or
 * no thread could be had. So a DNS server that does not answer costs one thread per name, not
 * one per slot map that names it again. */
static resolve *lookup_for(kvd_remote *r, const char *name, char *why, size_t wlen) {
    lookups_sweep(r);
    int waiting = r->nidle; /* the idle ones are all running, each once there */
    for (int i = 0; i < r->nnodes; i++) {
        resolve *q = r->nodes[i].res;
        if (q == NULL || resolve_done(q)) {
            continue; /* an answer another node has not used yet is not shared: it may be old */
        }
        if (strcmp(q->name, name) == 0) {
            resolve_ref(q);
            return q;
        }
        /* Counted once: not when an earlier node or the idle list holds the same lookup. */
        int seen = 0;
        for (int j = 0; j < i && !seen; j++) {
            seen = r->nodes[j].res == q;
        }
        for (int k = 0; k < r->nidle && !seen; k++) {
            seen = r->idle[k] == q;
        }
        waiting += !seen;
    }
    for (int k = 0; k < r->nidle; k++) {
        if (strcmp(r->idle[k]->name, name) == 0) {
            resolve *q = r->idle[k];
            r->idle[k] = r->idle[--r->nidle];
            return q; /* the list's reference is the node's now */
        }
    }
    if (waiting >= LOOKUPS_MAX) {
        snprintf(why, wlen, "resolving %s: %d host name lookups are still waiting for DNS", name,
                 waiting);
        return NULL;
    }
    resolve *q = resolve_start(name);
    if (q == NULL) {
        snprintf(why, wlen, "resolving %s: no thread for the lookup", name);
    }
    return q;
}

/* A forgotten node's lookup: kept (once) while it runs, so that the name met again waits for it. */
static void lookup_forget(kvd_remote *r, resolve *q) {
    if (q == NULL) {
        return;
    }
    for (int k = 0; k < r->nidle; k++) {
        if (r->idle[k] == q) {
            resolve_rele(q); /* kept already (another node of the name was forgotten before) */
            return;
        }
    }
    if (!resolve_done(q) && r->nidle < LOOKUPS_MAX) {
        r->idle[r->nidle++] = q;
        return;
    }
    resolve_rele(q);
}

#define NODE_ADDRS 4 /* addresses of a name tried in turn (localhost: ::1, then 127.0.0.1) */
typedef char node_addr_str[256]; /* a numeric address (a literal host fits: it is one) */

/* The numeric addresses to connect nd to, in out[0..*n): a literal as it is, a host name as a
 * lookup thread finds it, waiting at most wait_ms for it (remote-timeout-ms, or less where a
 * request's deadline is nearer: by_deadline). hiredis's own connect would
 * call getaddrinfo, which waits on the resolver's timeouts (seconds a try, several tries) where a
 * DNS server does not answer: this thread would miss every deadline meanwhile. The name is
 * looked up again at every connect (a failover may move it). 0, or -1 with why (wlen bytes). */
static int node_addr(kvd_remote *r, node *nd, uint64_t wait_ms, int by_deadline, node_addr_str *out,
                     int *n, char *why, size_t wlen) {
    unsigned char bin[sizeof(struct in6_addr)];
    *n = 0;
    if (inet_pton(AF_INET, nd->host, bin) == 1 || inet_pton(AF_INET6, nd->host, bin) == 1) {
        snprintf(out[0], sizeof(out[0]), "%s", nd->host);
        *n = 1;
        return 0;
    }
    if (nd->res == NULL && (nd->res = lookup_for(r, nd->host, why, wlen)) == NULL) {
        return -1;
    }
    resolve *q = nd->res;
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += (time_t)(wait_ms / 1000);
    until.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&q->mu);
    int w = 0;
    while (!q->done && w != ETIMEDOUT) {
        w = pthread_cond_timedwait(&q->cv, &q->mu, &until);
    }
    int done = q->done, rc = q->rc;
    pthread_mutex_unlock(&q->mu);
    if (!done) {
        snprintf(why, wlen, "resolving %s: no answer within %llu ms (%s)", nd->host,
                 (unsigned long long)wait_ms,
                 by_deadline ? "what the request had left" : "remote-timeout-ms");
        return -1; /* the lookup goes on; the next connect looks at it again */
    }
    /* Done: the lookup thread writes nothing more, so its answer is read without the lock. */
    for (const struct addrinfo *ai = q->res; ai != NULL && *n < NODE_ADDRS; ai = ai->ai_next) {
        if (getnameinfo(ai->ai_addr, ai->ai_addrlen, out[*n], sizeof(out[*n]), NULL, 0,
                        NI_NUMERICHOST) == 0) {
            ++*n;
        }
    }
    int ok = *n > 0;
    if (!ok) {
        snprintf(why, wlen, "resolving %s: %s", nd->host,
                 rc != 0 ? gai_strerror(rc) : "no address");
    }
    resolve_rele(q);
    nd->res = NULL;
    return ok ? 0 : -1;
}

/* A failed lookup or connect of nd that began at `since`: marks the node down (node_fail), but
 * not while the request's deadline cut it short (by_deadline: it was the request's time that ran
 * out, not the node) and such cut attempts have not yet added up to one remote-timeout-ms. */
static void node_fail_cut(kvd_remote *r, node *nd, const char *why, int by_deadline,
                          uint64_t since) {
    uint64_t t = now_ms();
    if (by_deadline) {
        nd->cut_ms += t > since ? t - since : 0;
        if (nd->cut_ms < r->timeout_ms) {
            note_error(r, "%s:%d: %s", nd->host, nd->port, why);
            return;
        }
    }
    nd->cut_ms = 0;
    node_fail(r, nd, why);
}

/* A connected context for nd, or NULL (down, or the connect failed now). deadline (ms, 0: none):
 * a name's lookup and the connect wait at most what is left of it when that is under
 * remote-timeout-ms (the connection, once made, keeps remote-timeout-ms for its commands). */
static redisContext *node_ctx_by(kvd_remote *r, node *nd, uint64_t deadline) {
    if (nd->c != NULL) {
        return nd->c;
    }
    uint64_t now = now_ms();
    if (nd->down_until != 0 && now < nd->down_until) {
        return NULL;
    }
    uint64_t wait_ms = r->timeout_ms;
    int by_deadline = deadline != 0 && (deadline <= now || deadline - now < wait_ms);
    if (by_deadline) {
        wait_ms = deadline > now ? deadline - now : 1;
    }
    node_addr_str addr[NODE_ADDRS];
    char unresolved[512];
    int naddr = 0;
    if (node_addr(r, nd, wait_ms, by_deadline, addr, &naddr, unresolved, sizeof(unresolved)) != 0) {
        node_fail_cut(r, nd, unresolved, by_deadline, now);
        return NULL;
    }
    redisContext *c = NULL;
    for (int k = 0; k < naddr && (c == NULL || c->err); k++) {
        /* Each address waits what is left (the request's deadline, or one timeout). */
        uint64_t t = now_ms(), left = r->timeout_ms;
        if (by_deadline) {
            left = deadline > t ? deadline - t : 0;
        }
        if (left == 0) {
            break;
        }
        struct timeval ctv = {(time_t)(left / 1000), (suseconds_t)(left % 1000) * 1000};
        if (c != NULL) {
            redisFree(c); /* the name's next address (a refused one answers at once) */
        }
        c = redisConnectWithTimeout(addr[k], nd->port, ctv);
    }
    struct timeval tv = {(time_t)(r->timeout_ms / 1000),
                         (suseconds_t)(r->timeout_ms % 1000) * 1000};
    if (c == NULL || c->err) {
        const char *why = c != NULL                  ? c->errstr
                          : by_deadline && naddr > 0 ? "the request's deadline passed first"
                                                     : "out of memory";
        char buf[160];
        snprintf(buf, sizeof(buf), "connect: %s", why);
        if (c != NULL) {
            redisFree(c);
        }
        node_fail_cut(r, nd, buf, by_deadline, now);
        return NULL;
    }
    redisSetTimeout(c, tv);
    pthread_once(&g_fns_once, fns_init);
    c->reader->fn = &g_fns;
    if (r->password[0] != '\0') {
        redisReply *rep = redisCommand(c, "AUTH %s", r->password);
        int ok = rep != NULL && rep->type == REDIS_REPLY_STATUS;
        char buf[128];
        snprintf(buf, sizeof(buf), "AUTH refused: %s",
                 rep != NULL && rep->type == REDIS_REPLY_ERROR ? rep->str : "no reply");
        if (rep != NULL) {
            freeReplyObject(rep);
        }
        if (!ok) {
            redisFree(c);
            node_fail(r, nd, buf);
            return NULL;
        }
    }
    if (nd->fails > 0) {
        count(r, &r->st.reconnects, 1);
    }
    nd->cut_ms = 0;
    nd->c = c;
    nd->down_until = 0; /* fails is reset by a command that succeeds: a paused Redis accepts
                           connections and answers nothing, and must not reset the backoff */
    return c;
}

static redisContext *node_ctx(kvd_remote *r, node *nd) {
    return node_ctx_by(r, nd, 0);
}

static int node_find_or_add(kvd_remote *r, const char *host, int port) {
    for (int i = 0; i < r->nnodes; i++) {
        if (r->nodes[i].port == port && strcmp(r->nodes[i].host, host) == 0) {
            return i;
        }
    }
    if (r->nnodes == MAX_NODES) {
        return -1;
    }
    node *nd = &r->nodes[r->nnodes];
    memset(nd, 0, sizeof(*nd));
    snprintf(nd->host, sizeof(nd->host), "%s", host);
    nd->port = port;
    return r->nnodes++;
}

/* Reads CLUSTER SLOTS from the first node that answers: the slot map (cluster mode), or the
 * answer that this is one server (cluster support disabled). 0 when some node answered. */
/* Reads the slot map from the first node that gives it (or learns there is no cluster).
 * deadline (ms, 0: none): no node is asked after it, and one asked late waits only what is
 * left. 0 when done, -1 when no node answered. */
/* After a new slot map: the nodes neither a seed nor a master of it are forgotten (their
 * connections closed), so that nodes that left (failed over, moved, a pod's new address) do not
 * pile up until no new one fits (MAX_NODES). Between requests only: indices change. */
static void prune_nodes(kvd_remote *r) {
    uint8_t used[MAX_NODES] = {0};
    int16_t map[MAX_NODES];
    for (int i = 0; i < r->nseeds; i++) {
        used[i] = 1;
    }
    for (int sl = 0; sl < NSLOTS; sl++) {
        if (r->slots[sl] >= 0) {
            used[r->slots[sl]] = 1;
        }
    }
    int n = 0;
    for (int i = 0; i < r->nnodes; i++) {
        if (!used[i]) {
            if (r->nodes[i].c != NULL) {
                redisFree(r->nodes[i].c);
            }
            free(r->nodes[i].rb);
            lookup_forget(r, r->nodes[i].res);
            map[i] = -1;
            continue;
        }
        if (n != i) {
            r->nodes[n] = r->nodes[i];
        }
        map[i] = (int16_t)n++;
    }
    for (int sl = 0; sl < NSLOTS; sl++) {
        if (r->slots[sl] >= 0) {
            r->slots[sl] = map[r->slots[sl]];
        }
    }
    r->nnodes = n;
}

static int refresh(kvd_remote *r, uint64_t deadline) {
    for (int i = 0; i < r->nnodes; i++) {
        node *nd = &r->nodes[i];
        uint64_t now = now_ms();
        if (deadline != 0 && now >= deadline) {
            return -1;
        }
        redisContext *c = node_ctx_by(r, nd, deadline);
        if (c == NULL) {
            continue;
        }
        now = now_ms();
        if (deadline != 0 && now >= deadline) {
            return -1;
        }
        int shortened = deadline != 0 && deadline - now < r->timeout_ms;
        if (shortened) {
            set_timeout(c, deadline - now);
        }
        redisReply *rep = redisCommand(c, "CLUSTER SLOTS");
        if (shortened && nd->c != NULL) {
            set_timeout(c, r->timeout_ms);
        }
        if (rep == NULL) {
            node_fail(r, nd, c->errstr[0] != '\0' ? c->errstr : "CLUSTER SLOTS: no reply");
            continue;
        }
        if (rep->type == REDIS_REPLY_ERROR && strstr(rep->str, "cluster support disabled")) {
            /* "ERR This instance has cluster support disabled": one server. */
            freeReplyObject(rep);
            r->cluster = 0;
            r->probed = 1;
            r->need_refresh = 0;
            return 0;
        }
        if (rep->type == REDIS_REPLY_ERROR) { /* LOADING, NOAUTH, ...: ask again later */
            note_error(r, "%s:%d: CLUSTER SLOTS: %s", nd->host, nd->port, rep->str);
            freeReplyObject(rep);
            continue;
        }
        if (rep->type == REDIS_REPLY_ARRAY) {
            for (int s = 0; s < NSLOTS; s++) {
                r->slots[s] = -1;
            }
            for (size_t k = 0; k < rep->elements; k++) {
                redisReply *e = rep->element[k];
                if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
                    e->element[0]->type != REDIS_REPLY_INTEGER ||
                    e->element[1]->type != REDIS_REPLY_INTEGER ||
                    e->element[2]->type != REDIS_REPLY_ARRAY || e->element[2]->elements < 2 ||
                    e->element[2]->element[0]->type != REDIS_REPLY_STRING ||
                    e->element[2]->element[1]->type != REDIS_REPLY_INTEGER) {
                    continue;
                }
                long long lo = e->element[0]->integer, hi = e->element[1]->integer;
                if (lo < 0 || hi < lo || hi >= NSLOTS) {
                    continue;
                }
                redisReply *m = e->element[2];
                const char *host = m->element[0]->str;
                int port = (int)m->element[1]->integer;
                int ni =
                    node_find_or_add(r, host != NULL && host[0] != '\0' ? host : nd->host, port);
                for (long long s = lo; s <= hi && s < NSLOTS && ni >= 0; s++) {
                    r->slots[s] = (int16_t)ni;
                }
            }
            r->cluster = 1;
            r->probed = 1;
            r->need_refresh = 0;
            freeReplyObject(rep);
            prune_nodes(r);
            pthread_mutex_lock(&r->mu);
            r->st.cluster = 1;
            r->st.nnodes = r->nnodes;
            pthread_mutex_unlock(&r->mu);
            return 0;
        }
        freeReplyObject(rep);
    }
    return -1;
}

/* The node a key goes to: the slot's master in cluster mode, else the first seed that is not
 * down. -1: none. */
static int node_of(kvd_remote *r, const char *key) {
    if (r->cluster) {
        int s = r->slots[kvd_remote_slot(key, strlen(key))];
        return s >= 0 ? s : 0;
    }
    for (int i = 0; i < r->nseeds; i++) {
        if (r->nodes[i].c != NULL || r->nodes[i].down_until == 0 ||
            now_ms() >= r->nodes[i].down_until) {
            return i;
        }
    }
    return -1;
}

/* "MOVED 3999 127.0.0.1:6381" / "ASK ...": the node it names (added if new), or -1. here: the
 * host of the node that answered, which an empty host names ("MOVED 3999 :6381": Redis 7's
 * cluster-preferred-endpoint-type unknown-endpoint), as CLUSTER SLOTS's empty host does. */
static int redirect_target(kvd_remote *r, const char *here, const char *err, int *ask,
                           uint32_t *slot) {
    *ask = strncmp(err, "ASK ", 4) == 0;
    if (!*ask && strncmp(err, "MOVED ", 6) != 0) {
        return -1;
    }
    const char *p = strchr(err, ' ');
    char *end;
    unsigned long s = strtoul(p + 1, &end, 10);
    if (*end != ' ' || s >= NSLOTS) {
        return -1;
    }
    const char *hp = end + 1;
    const char *colon = strrchr(hp, ':');
    if (colon == NULL || colon - hp >= 256) {
        return -1;
    }
    char host[256];
    if (colon == hp) {
        snprintf(host, sizeof(host), "%s", here);
    } else {
        memcpy(host, hp, (size_t)(colon - hp));
        host[colon - hp] = '\0';
    }
    *slot = (uint32_t)s;
    return node_find_or_add(r, host, atoi(colon + 1));
}

/* ---- values ------------------------------------------------------------------------------ */

static void put_u64le(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) {
        p[i] = (uint8_t)(v >> (8 * i));
    }
}

static uint64_t get_u64le(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) {
        v = (v << 8) | p[i];
    }
    return v;
}

/* XXH3-64 of a body: the tail (NULL: none), then the payload. */
static uint64_t body_sum(const uint8_t *tail, const uint8_t *payload, size_t plen) {
    if (tail == NULL) {
        return XXH3_64bits(payload, plen);
    }
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    XXH3_64bits_update(&st, tail, KVD_REMOTE_TAIL);
    XXH3_64bits_update(&st, payload, plen);
    return XXH3_64bits_digest(&st);
}

/* The same over a tail and a payload in runs. */
static uint64_t body_sum_iov(const uint8_t *tail, const struct iovec *iov, int niov) {
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    if (tail != NULL) {
        XXH3_64bits_update(&st, tail, KVD_REMOTE_TAIL);
    }
    for (int i = 0; i < niov; i++) {
        XXH3_64bits_update(&st, iov[i].iov_base, iov[i].iov_len);
    }
    return XXH3_64bits_digest(&st);
}

static void make_header(uint8_t h[KVD_REMOTE_HEADER], const kvd_remote_meta *m,
                        const uint8_t *payload, size_t plen) {
    memcpy(h, "KVDR", 4);
    h[4] = KVD_REMOTE_VERSION & 0xff;
    h[5] = KVD_REMOTE_VERSION >> 8;
    h[6] = m->format;
    h[7] = m->tail != NULL ? KVD_REMOTE_F_TAIL : 0;
    put_u64le(h + 8, m->layout_key.lo);
    put_u64le(h + 16, m->layout_key.hi);
    put_u64le(h + 24, m->hash.lo);
    put_u64le(h + 32, m->hash.hi);
    put_u64le(h + 40, plen + (m->tail != NULL ? KVD_REMOTE_TAIL : 0));
    put_u64le(h + 48, body_sum(m->tail, payload, plen));
}

/* Checks a value's parts against what the caller expects; fills v (a good payload becomes
 * v->data: the caller gives it up; a bad one stays the caller's). h: its 56-byte header; body:
 * the bytes after the header; tail: the 16 bytes that open the body when the header says so
 * (else NULL); payload[0..plen): the rest, or with payload NULL in v's destination, iov[0..niov)
 * (v->direct). */
static void check_parts(const uint8_t *h, const uint8_t *tail, uint8_t *payload, size_t plen,
                        const struct iovec *iov, int niov, size_t body, const kvd_remote_meta *want,
                        kvd_remote_val *v) {
    int flagged = (h[7] & KVD_REMOTE_F_TAIL) != 0;
    const char *why = NULL;
    if (memcmp(h, "KVDR", 4) != 0) {
        why = "not a kvd value (magic)";
    } else if ((h[4] | h[5] << 8) != KVD_REMOTE_VERSION) {
        why = "another value version";
    } else if ((h[7] & ~KVD_REMOTE_F_TAIL) != 0) {
        why = "unknown flags";
    } else if (get_u64le(h + 8) != want->layout_key.lo ||
               get_u64le(h + 16) != want->layout_key.hi) {
        why = "another model or layout";
    } else if (get_u64le(h + 24) != want->hash.lo || get_u64le(h + 32) != want->hash.hi) {
        why = "another block's hash";
    } else if (get_u64le(h + 40) != body || flagged != (tail != NULL)) {
        why = "payload length differs";
    } else if (get_u64le(h + 48) !=
               (payload != NULL ? body_sum(tail, payload, plen) : body_sum_iov(tail, iov, niov))) {
        why = "checksum differs";
    }
    if (why != NULL) {
        v->status = KVD_REMOTE_BAD;
        v->why = why;
        return;
    }
    v->format = h[6];
    v->has_tail = tail != NULL;
    if (tail != NULL) {
        memcpy(v->tail, tail, KVD_REMOTE_TAIL);
    }
    v->data = payload;
    v->direct = payload == NULL;
    v->len = plen;
    v->off = 0;
    v->status = KVD_REMOTE_HIT;
}

/* A value libhiredis read (create_string rearranged it: payload, tail, header). */
static void check_value(redisReply *rep, const kvd_remote_meta *want, kvd_remote_val *v) {
    uint8_t *d = (uint8_t *)rep->str;
    size_t n = rep->len;
    if (n < KVD_REMOTE_HEADER || rep->integer != TAIL_MARK) {
        v->status = KVD_REMOTE_BAD;
        v->why = n < KVD_REMOTE_HEADER ? "shorter than the header" : "not a kvd value (magic)";
        return;
    }
    const uint8_t *h = d + n - KVD_REMOTE_HEADER;
    size_t body = n - KVD_REMOTE_HEADER;
    int tail = (h[7] & KVD_REMOTE_F_TAIL) && body >= KVD_REMOTE_TAIL;
    size_t plen = tail ? body - KVD_REMOTE_TAIL : body;
    check_parts(h, tail ? d + plen : NULL, d, plen, NULL, 0, body, want, v);
    if (v->status == KVD_REMOTE_HIT) {
        rep->str = NULL; /* the payload's buffer now (the bytes behind it are not read) */
    }
}

/* ---- the get path's own reader --------------------------------------------------------------
 * libhiredis reads a reply 16 KiB at a time into its buffer, appends that to its reader's buffer
 * and copies the value out again: two copies of every byte after the kernel's. A get pipeline's
 * replies (bulk strings, nil, or errors) are read here instead, straight from the socket: the
 * header and tail into small buffers, the payload into the buffer that becomes the T1 entry.
 * Only while libhiredis's reader holds no byte of the connection (always, between requests:
 * every reply it read was consumed), and the buffer here is empty again at the end of each
 * pipeline (else the connection is closed). */
#define RB_CAP (64u << 10)
#define VALUE_MAX ((size_t)1 << 30) /* larger than any block: not read into memory */

static int rb_fill(node *nd) {
    if (nd->rb == NULL && (nd->rb = malloc(RB_CAP)) == NULL) {
        return -1;
    }
    if (nd->rb_pos > 0) {
        memmove(nd->rb, nd->rb + nd->rb_pos, nd->rb_len - nd->rb_pos);
        nd->rb_len -= nd->rb_pos;
        nd->rb_pos = 0;
    }
    if (nd->rb_len == RB_CAP) {
        return -1; /* a line longer than the buffer: not a GET reply */
    }
    if (nd->rdl != 0 && now_ms() >= nd->rdl) {
        return -1; /* the request's time is spent */
    }
    ssize_t k;
    do {
        k = read(nd->c->fd, nd->rb + nd->rb_len, RB_CAP - nd->rb_len);
    } while (k < 0 && errno == EINTR);
    if (k <= 0) {
        return -1; /* closed, or the timeout (SO_RCVTIMEO) passed */
    }
    nd->rb_len += (size_t)k;
    return 0;
}

/* The next line without its CRLF into line[cap]. */
static int rb_line(node *nd, char *line, size_t cap) {
    for (;;) {
        const uint8_t *p = nd->rb + nd->rb_pos;
        size_t avail = nd->rb_len - nd->rb_pos;
        const uint8_t *nl = avail > 0 ? memchr(p, '\n', avail) : NULL;
        if (nl != NULL) {
            size_t n = (size_t)(nl - p);
            if (n == 0 || p[n - 1] != '\r' || n - 1 >= cap) {
                return -1;
            }
            memcpy(line, p, n - 1);
            line[n - 1] = '\0';
            nd->rb_pos += n + 1;
            return 0;
        }
        if (rb_fill(nd) != 0) {
            return -1;
        }
    }
}

/* Exactly n bytes into dst (NULL: dropped): the buffer's first, then the socket's straight in. */
static int rb_read(node *nd, uint8_t *dst, size_t n) {
    for (;;) {
        size_t avail = nd->rb_len - nd->rb_pos;
        size_t take = avail < n ? avail : n;
        if (take > 0 && dst != NULL) {
            memcpy(dst, nd->rb + nd->rb_pos, take);
            dst += take;
        }
        nd->rb_pos += take;
        n -= take;
        if (n == 0) {
            return 0;
        }
        if (dst == NULL || n < 4096) {
            if (rb_fill(nd) != 0) {
                return -1;
            }
            continue;
        }
        if (nd->rdl != 0 && now_ms() >= nd->rdl) {
            return -1; /* the request's time is spent */
        }
        ssize_t k;
        do {
            k = read(nd->c->fd, dst, n);
        } while (k < 0 && errno == EINTR);
        if (k <= 0) {
            return -1;
        }
        dst += k;
        n -= (size_t)k;
    }
}

/* Exactly the bytes of iov[0..niov) from the buffer and the socket, in order. */
static int rb_readv(node *nd, const struct iovec *iov, int niov) {
    for (int i = 0; i < niov; i++) {
        if (rb_read(nd, iov[i].iov_base, iov[i].iov_len) != 0) {
            return -1;
        }
    }
    return 0;
}

/* One reply of a get pipeline: 0 read (v filled: a hit, a miss, a bad value; or *to set: a
 * redirection to send it again to), 1 an error reply (noted in errbuf), -1 the connection
 * failed or said something that is no GET reply. */
static int note_redirect_err(kvd_remote *r, const node *nd, const char *err, int *to, uint8_t *ask);

static int read_get_reply(kvd_remote *r, node *nd, const kvd_remote_meta *want,
                          const kvd_remote_dst *dst, kvd_remote_val *v, int *to, uint8_t *ask,
                          char *errbuf, size_t errlen) {
    char line[512];
    if (rb_line(nd, line, sizeof(line)) != 0) {
        return -1;
    }
    if (line[0] == '-') {
        if (note_redirect_err(r, nd, line + 1, to, ask)) {
            return 0;
        }
        snprintf(errbuf, errlen, "%.200s", line + 1);
        return 1;
    }
    if (line[0] != '$') {
        return -1;
    }
    char *end;
    errno = 0;
    long long n = strtoll(line + 1, &end, 10);
    if (*end != '\0' || errno != 0 || n < -1) {
        return -1;
    }
    if (n == -1) {
        return 0; /* no such key: a miss */
    }
    size_t len = (size_t)n;
    uint8_t h[KVD_REMOTE_HEADER], tb[KVD_REMOTE_TAIL], crlf[2];
    if (len < KVD_REMOTE_HEADER || len - KVD_REMOTE_HEADER > VALUE_MAX) {
        v->status = KVD_REMOTE_BAD;
        v->why = len < KVD_REMOTE_HEADER ? "shorter than the header" : "longer than any block";
        return rb_read(nd, NULL, len) == 0 && rb_read(nd, crlf, 2) == 0 && crlf[0] == '\r' &&
                       crlf[1] == '\n'
                   ? 0
                   : -1;
    }
    if (rb_read(nd, h, KVD_REMOTE_HEADER) != 0) {
        return -1;
    }
    size_t body = len - KVD_REMOTE_HEADER;
    int tail = (h[7] & KVD_REMOTE_F_TAIL) && body >= KVD_REMOTE_TAIL;
    if (tail && rb_read(nd, tb, KVD_REMOTE_TAIL) != 0) {
        return -1;
    }
    size_t plen = tail ? body - KVD_REMOTE_TAIL : body;
    if (dst != NULL && dst->iov != NULL && h[6] == dst->format && plen == dst->bytes) {
        /* The direct path: into the caller's block (the check reads it there, cache-warm). */
        if (rb_readv(nd, dst->iov, dst->niov) != 0 || rb_read(nd, crlf, 2) != 0 ||
            crlf[0] != '\r' || crlf[1] != '\n') {
            return -1;
        }
        check_parts(h, tail ? tb : NULL, NULL, plen, dst->iov, dst->niov, body, want, v);
        return 0;
    }
    uint8_t *payload = malloc(plen > 0 ? plen : 1);
    if (rb_read(nd, payload, plen) != 0 || rb_read(nd, crlf, 2) != 0 || crlf[0] != '\r' ||
        crlf[1] != '\n') {
        free(payload);
        return -1;
    }
    if (payload == NULL) {
        return 0; /* no memory for it: a miss (its bytes were read past) */
    }
    check_parts(h, tail ? tb : NULL, payload, plen, NULL, 0, body, want, v);
    if (v->status != KVD_REMOTE_HIT) {
        free(payload);
    }
    return 0;
}

/* ---- requests on the thread -------------------------------------------------------------- */

/* One GET (or SET) sent alone to node ni, following one redirection. Returns the reply (caller
 * frees) or NULL (failed: counted). deadline (ms, 0: none): a node's lookup and connect keep to
 * it (node_ctx_by). */
static redisReply *command_one(kvd_remote *r, int ni, int argc, const char **argv,
                               const size_t *lens, uint64_t deadline) {
    for (int tries = 0; tries < 3 && ni >= 0; tries++) {
        node *nd = &r->nodes[ni];
        redisContext *c = node_ctx_by(r, nd, deadline);
        if (c == NULL) {
            return NULL;
        }
        redisReply *rep = redisCommandArgv(c, argc, argv, lens);
        if (rep == NULL) {
            node_fail(r, nd, c->errstr[0] != '\0' ? c->errstr : "no reply");
            return NULL;
        }
        int ask;
        uint32_t slot;
        int to = rep->type == REDIS_REPLY_ERROR
                     ? redirect_target(r, nd->host, rep->str, &ask, &slot)
                     : -1;
        if (to < 0) {
            return rep;
        }
        freeReplyObject(rep);
        count(r, &r->st.redirects, 1);
        if (!ask) {
            r->slots[slot] = (int16_t)to;
            r->need_refresh = 1;
        } else {
            redisContext *tc = node_ctx_by(r, &r->nodes[to], deadline);
            redisReply *a = tc != NULL ? redisCommand(tc, "ASKING") : NULL;
            if (a != NULL) {
                freeReplyObject(a);
            }
        }
        ni = to;
    }
    return NULL;
}

/* A command sent alone where a redirection said: after ASKING for an ASK. */
static redisReply *command_at(kvd_remote *r, int to, int ask, int argc, const char **argv,
                              const size_t *lens, uint64_t deadline) {
    if (!ask) {
        return command_one(r, to, argc, argv, lens, deadline);
    }
    node *nd = &r->nodes[to];
    redisContext *c = node_ctx_by(r, nd, deadline);
    if (c == NULL) {
        return NULL;
    }
    redisAppendCommand(c, "ASKING");
    redisAppendCommandArgv(c, argc, argv, lens);
    void *a = NULL, *rep = NULL;
    if (redisGetReply(c, &a) != REDIS_OK || redisGetReply(c, &rep) != REDIS_OK) {
        if (a != NULL) {
            freeReplyObject(a);
        }
        node_fail(r, nd, c->errstr[0] != '\0' ? c->errstr : "no reply");
        return NULL;
    }
    freeReplyObject(a);
    count(r, &r->st.redirects, 1);
    return rep;
}

/* A redirection in a pipelined reply: where to send the key again once the pipeline is read
 * (a command sent now on the same connection would read the next pipelined reply). */
static int note_redirect_err(kvd_remote *r, const node *nd, const char *err, int *to,
                             uint8_t *ask) {
    int a;
    uint32_t slot;
    int t = redirect_target(r, nd->host, err, &a, &slot);
    if (t < 0) {
        return 0;
    }
    if (!a) {
        r->slots[slot] = (int16_t)t;
        r->need_refresh = 1;
        count(r, &r->st.redirects, 1);
    }
    *to = t;
    *ask = (uint8_t)a;
    return 1;
}

/* The same, for a reply libhiredis read. */
static int note_redirect(kvd_remote *r, const node *nd, redisReply *rep, int *to, uint8_t *ask) {
    return rep->type == REDIS_REPLY_ERROR && note_redirect_err(r, nd, rep->str, to, ask);
}

/* Where each key of a get or a probe goes: dest[i] its node (-1: every node is down), and
 * where a redirection sent it (rto[i] >= 0; rask[i] 1 for an ASK) to be sent again once its
 * node's pipeline is read (a command sent at once on that connection would read the next
 * pipelined reply). */
typedef struct route {
    int *dest;
    int *rto;
    uint8_t *rask;
} route;

static void route_free(route *rt) {
    free(rt->dest);
    free(rt->rto);
    free(rt->rask);
}

/* Routes o's keys (o->rc KV_ESYS when a key has no node up). -1 (o->rc KV_ENOMEM) for want of
 * memory. */
static int route_init(kvd_remote *r, op *o, route *rt) {
    size_t n = o->n > 0 ? o->n : 1;
    rt->dest = malloc(n * sizeof(int));
    rt->rto = malloc(n * sizeof(int));
    rt->rask = calloc(n, 1);
    if (rt->dest == NULL || rt->rto == NULL || rt->rask == NULL) {
        route_free(rt);
        o->rc = KV_ENOMEM;
        return -1;
    }
    for (size_t i = 0; i < o->n; i++) {
        rt->rto[i] = -1;
        rt->dest[i] = node_of(r, o->keys[i]);
        if (rt->dest[i] < 0) {
            o->rc = KV_ESYS; /* every node is down: its keys are misses */
        }
    }
    return 0;
}

/* Appends `cmd KEY` for each of node ni's keys to its connection: the context, or NULL when
 * the node has no key or none of its keys is asked (o->rc KV_ESYS: no connection, or the op's
 * one timeout is spent). *shortened: the node's timeout was cut to what is left of the op's
 * (pipeline_end puts it back). */
static redisContext *pipeline_begin(kvd_remote *r, op *o, const route *rt, int ni, const char *cmd,
                                    int *shortened) {
    size_t cnt = 0;
    for (size_t i = 0; i < o->n; i++) {
        cnt += rt->dest[i] == ni;
    }
    if (cnt == 0) {
        return NULL;
    }
    uint64_t now = now_ms();
    redisContext *c = now < o->deadline ? node_ctx_by(r, &r->nodes[ni], o->deadline) : NULL;
    now = now_ms();
    if (c == NULL || now >= o->deadline) {
        o->rc = KV_ESYS;
        return NULL;
    }
    *shortened = o->deadline - now < r->timeout_ms;
    if (*shortened) {
        set_timeout(c, o->deadline - now);
    }
    for (size_t i = 0; i < o->n; i++) {
        if (rt->dest[i] == ni) {
            const char *argv[2] = {cmd, o->keys[i]};
            size_t lens[2] = {strlen(cmd), strlen(o->keys[i])};
            redisAppendCommandArgv(c, 2, argv, lens);
        }
    }
    return c;
}

static void pipeline_end(kvd_remote *r, int ni, redisContext *c, int shortened) {
    if (shortened && r->nodes[ni].c != NULL) {
        set_timeout(c, r->timeout_ms);
    }
}

/* A read of node nd's pipelined replies for o failed (the pipeline began at since). When less than
 * half of remote-timeout-ms was left of o's deadline then (the request's other nodes took the
 * rest), the deadline may be what cut it: the connection goes (its replies are unread), but the
 * node is marked down only once such cuts add up to remote-timeout-ms (node_fail_cut), as for a
 * connect the deadline cut short, so that one slow node of a request does not put the next one's
 * node in backoff. Otherwise the node failed. */
static void read_failed(kvd_remote *r, const op *o, node *nd, const char *why, uint64_t since) {
    uint64_t left = o->deadline > since ? o->deadline - since : 0;
    if (left * 2 >= r->timeout_ms) {
        node_fail(r, nd, why);
        return;
    }
    char buf[256];
    snprintf(buf, sizeof(buf), "%s (the request's time ran out)", why); /* (why may be c's) */
    node_close(nd);
    node_fail_cut(r, nd, buf, 1, since);
}

/* What a get or a probe makes of one key's reply (not a redirection). */
typedef void (*reply_fn)(kvd_remote *r, op *o, size_t i, const node *nd, redisReply *rep);

/* Reads node ni's pipelined replies with libhiredis's reader, in key order: fn for each, a
 * redirection noted in rt for resend_redirected. A node that fails: its keys not read are
 * misses (o->rc KV_ESYS). */
static void pipeline_read(kvd_remote *r, op *o, route *rt, int ni, redisContext *c, reply_fn fn,
                          uint64_t since) {
    node *nd = &r->nodes[ni];
    for (size_t i = 0; i < o->n; i++) {
        if (rt->dest[i] != ni) {
            continue;
        }
        void *vrep = NULL;
        if (nd->c == NULL || redisGetReply(c, &vrep) != REDIS_OK) {
            if (nd->c != NULL) {
                read_failed(r, o, nd, c->errstr[0] != '\0' ? c->errstr : "no reply", since);
            }
            o->rc = KV_ESYS;
            continue;
        }
        redisReply *rep = vrep;
        nd->fails = 0; /* it answers */
        if (!note_redirect(r, nd, rep, &rt->rto[i], &rt->rask[i])) {
            fn(r, o, i, nd, rep);
        }
        freeReplyObject(rep);
    }
}

/* Sends `cmd KEY` again, one key at a time, where a redirection said (within the op's one
 * timeout: past it the key is a miss, o->rc KV_ESYS). */
static void resend_redirected(kvd_remote *r, op *o, const route *rt, const char *cmd, reply_fn fn) {
    for (size_t i = 0; i < o->n; i++) {
        if (rt->rto[i] < 0) {
            continue;
        }
        if (now_ms() >= o->deadline) {
            o->rc = KV_ESYS;
            continue;
        }
        const char *argv[2] = {cmd, o->keys[i]};
        size_t lens[2] = {strlen(cmd), strlen(o->keys[i])};
        redisReply *rep = command_at(r, rt->rto[i], rt->rask[i], 2, argv, lens, o->deadline);
        if (rep == NULL) {
            o->rc = KV_ESYS;
            continue;
        }
        fn(r, o, i, &r->nodes[rt->rto[i]], rep);
        freeReplyObject(rep);
    }
}

/* A get's reply through libhiredis: a value is checked; an error (TRYAGAIN, CLUSTERDOWN, one
 * redirection too many, ...) makes the key a miss. */
static void get_reply(kvd_remote *r, op *o, size_t i, const node *nd, redisReply *rep) {
    if (rep->type == REDIS_REPLY_STRING) {
        check_value(rep, &o->want[i], &o->vals[i]);
    } else if (rep->type == REDIS_REPLY_ERROR) {
        note_error(r, "%s:%d: GET: %s", nd->host, nd->port, rep->str);
        o->rc = KV_ESYS;
    }
}

static void do_get(kvd_remote *r, op *o) {
    o->vals = calloc(o->n > 0 ? o->n : 1, sizeof(*o->vals));
    route rt;
    if (o->vals == NULL) {
        o->rc = KV_ENOMEM;
        return;
    }
    /* One timeout for the whole get, however many nodes its keys are on: a node asked late
     * gets what is left of it, and none is asked once it is spent (its keys are misses). */
    if (route_init(r, o, &rt) != 0) {
        return;
    }
    /* One pipeline per node: append every key of the node, then read the replies. */
    for (int ni = 0; ni < r->nnodes; ni++) {
        int shortened = 0;
        redisContext *c = pipeline_begin(r, o, &rt, ni, "GET", &shortened);
        uint64_t since = now_ms();
        if (c == NULL) {
            continue;
        }
        node *nd = &r->nodes[ni];
        if (c->reader->len == c->reader->pos && nd->rb_len == nd->rb_pos) {
            /* The replies are read here, not by libhiredis (read_get_reply), within the get's
             * one timeout. */
            nd->rdl = o->deadline;
            int wdone = 0, failed = 0;
            while (!wdone && !failed) {
                failed = redisBufferWrite(c, &wdone) != REDIS_OK;
            }
            for (size_t i = 0; i < o->n && !failed; i++) {
                if (rt.dest[i] != ni) {
                    continue;
                }
                char eb[256];
                int got = read_get_reply(r, nd, &o->want[i], o->dst != NULL ? &o->dst[i] : NULL,
                                         &o->vals[i], &rt.rto[i], &rt.rask[i], eb, sizeof(eb));
                if (got < 0) {
                    failed = 1;
                } else if (got == 1) {
                    note_error(r, "%s:%d: GET: %s", nd->host, nd->port, eb);
                    o->rc = KV_ESYS;
                }
            }
            nd->rdl = 0;
            if (!failed && nd->rb_len != nd->rb_pos) {
                failed = 1; /* bytes past the last reply: the connection is out of step */
            }
            if (failed) {
                read_failed(r, o, nd,
                            c->errstr[0] != '\0' ? c->errstr : "GET: no reply (or not one)", since);
                o->rc = KV_ESYS; /* the keys not read are misses */
            } else {
                nd->fails = 0; /* it answers */
            }
        } else {
            pipeline_read(r, o, &rt, ni, c, get_reply, since);
        }
        pipeline_end(r, ni, c, shortened);
    }
    resend_redirected(r, o, &rt, "GET", get_reply);
    route_free(&rt);
    for (size_t i = 0; r->undel != NULL && i < o->n; i++) {
        if (o->vals[i].status == KVD_REMOTE_HIT && undel_has(r, o->keys[i])) {
            free(o->vals[i].data); /* a value to be deleted is never served */
            o->vals[i] = (kvd_remote_val){0};
        }
    }
    uint64_t hits = 0, misses = 0, bad = 0;
    for (size_t i = 0; i < o->n; i++) {
        hits += o->vals[i].status == KVD_REMOTE_HIT;
        bad += o->vals[i].status == KVD_REMOTE_BAD;
        misses += o->vals[i].status == KVD_REMOTE_MISS;
    }
    pthread_mutex_lock(&r->mu);
    r->st.state = any_up(r) ? 1 : 2; /* with the counts: a reader sees them agree */
    r->st.gets += o->n;
    r->st.hits += hits;
    r->st.misses += misses;
    r->st.bad += bad;
    pthread_mutex_unlock(&r->mu);
}

/* A probe's reply: the key is there when its value is longer than a header; an error makes it
 * not there (o->rc KV_ESYS). */
static void probe_reply(kvd_remote *r, op *o, size_t i, const node *nd, redisReply *rep) {
    if (rep->type == REDIS_REPLY_ERROR) {
        note_error(r, "%s:%d: STRLEN: %s", nd->host, nd->port, rep->str);
        o->rc = KV_ESYS;
    }
    o->present[i] = rep->type == REDIS_REPLY_INTEGER && rep->integer > (long long)KVD_REMOTE_HEADER;
}

/* A probe: STRLEN of every key, one pipeline per node (libhiredis reads the replies), then the
 * keys a node redirected, one by one. */
static void do_probe(kvd_remote *r, op *o) {
    size_t n = o->n > 0 ? o->n : 1;
    if (o->present == NULL) {
        o->present = calloc(n, 1);
    } else {
        memset(o->present, 0, n); /* the second try, after a failover */
    }
    route rt;
    if (o->present == NULL) {
        o->rc = KV_ENOMEM;
        return;
    }
    if (route_init(r, o, &rt) != 0) {
        return;
    }
    for (int ni = 0; ni < r->nnodes; ni++) {
        int shortened = 0;
        redisContext *c = pipeline_begin(r, o, &rt, ni, "STRLEN", &shortened);
        uint64_t since = now_ms();
        if (c != NULL) {
            pipeline_read(r, o, &rt, ni, c, probe_reply, since);
            pipeline_end(r, ni, c, shortened);
        }
    }
    resend_redirected(r, o, &rt, "STRLEN", probe_reply);
    route_free(&rt);
    for (size_t i = 0; r->undel != NULL && i < o->n; i++) {
        if (o->present[i] && undel_has(r, o->keys[i])) {
            o->present[i] = 0;
        }
    }
}

/* Bytes of a put's value: header, tail, payload. */
static size_t value_len(const op *o) {
    return KVD_REMOTE_HEADER + (o->meta.tail != NULL ? KVD_REMOTE_TAIL : 0) + o->plen;
}

static void do_puts(kvd_remote *r, op **ops, size_t n) {
    uint8_t(*hdr)[KVD_REMOTE_HEADER] = malloc((n > 0 ? n : 1) * KVD_REMOTE_HEADER);
    uint8_t **vals = calloc(n > 0 ? n : 1, sizeof(*vals));
    int *dest = calloc(n > 0 ? n : 1, sizeof(int));
    int *rto = malloc((n > 0 ? n : 1) * sizeof(int));
    uint8_t *rask = calloc(n > 0 ? n : 1, 1);
    if (hdr == NULL || vals == NULL || dest == NULL || rto == NULL || rask == NULL) {
        free(rto);
        free(rask);
        for (size_t i = 0; i < n; i++) {
            ops[i]->rc = KV_ENOMEM;
        }
        free(hdr);
        free(vals);
        free(dest);
        return;
    }
    char ttl[24];
    snprintf(ttl, sizeof(ttl), "%llu", (unsigned long long)r->ttl_s);
    for (size_t i = 0; i < n; i++) {
        rto[i] = -1;
    }
    for (size_t i = 0; i < n; i++) {
        op *o = ops[i];
        make_header(hdr[i], &o->meta, o->payload, o->plen);
        size_t tl = o->meta.tail != NULL ? KVD_REMOTE_TAIL : 0;
        vals[i] = malloc(value_len(o));
        if (vals[i] != NULL) {
            memcpy(vals[i], hdr[i], KVD_REMOTE_HEADER);
            if (tl != 0) {
                memcpy(vals[i] + KVD_REMOTE_HEADER, o->meta.tail, tl);
            }
            memcpy(vals[i] + KVD_REMOTE_HEADER + tl, o->payload, o->plen);
        }
        dest[i] = node_of(r, o->key);
        o->rc = vals[i] != NULL ? KV_OK : KV_ENOMEM;
    }
    for (int ni = 0; ni < r->nnodes; ni++) {
        size_t cnt = 0;
        for (size_t i = 0; i < n; i++) {
            cnt += dest[i] == ni && ops[i]->rc == KV_OK;
        }
        if (cnt == 0) {
            continue;
        }
        redisContext *c = node_ctx(r, &r->nodes[ni]);
        for (size_t i = 0; i < n && c != NULL; i++) {
            if (dest[i] != ni || ops[i]->rc != KV_OK) {
                continue;
            }
            const char *argv[5] = {"SET", ops[i]->key, (const char *)vals[i], "EX", ttl};
            size_t lens[5] = {3, strlen(ops[i]->key), value_len(ops[i]), 2, strlen(ttl)};
            redisAppendCommandArgv(c, r->ttl_s > 0 ? 5 : 3, argv, lens);
        }
        for (size_t i = 0; i < n; i++) {
            if (dest[i] != ni || ops[i]->rc != KV_OK) {
                continue;
            }
            void *vrep = NULL;
            if (c == NULL || r->nodes[ni].c == NULL || redisGetReply(c, &vrep) != REDIS_OK) {
                if (c != NULL && r->nodes[ni].c != NULL) {
                    node_fail(r, &r->nodes[ni], c->errstr[0] != '\0' ? c->errstr : "no reply");
                }
                ops[i]->rc = KV_ESYS;
                continue;
            }
            redisReply *rep = vrep;
            r->nodes[ni].fails = 0; /* it answers */
            if (note_redirect(r, &r->nodes[ni], rep, &rto[i], &rask[i])) {
                freeReplyObject(rep); /* sent again below, once this pipeline is read */
                continue;
            }
            if (rep->type == REDIS_REPLY_ERROR) {
                /* "OOM command not allowed when used memory > 'maxmemory'": full. */
                ops[i]->rc = strncmp(rep->str, "OOM", 3) == 0 ? KV_EQUOTA : KV_ESYS;
                note_error(r, "%s:%d: SET: %s", r->nodes[ni].host, r->nodes[ni].port, rep->str);
            }
            freeReplyObject(rep);
        }
        if (c == NULL) {
            for (size_t i = 0; i < n; i++) {
                if (dest[i] == ni && ops[i]->rc == KV_OK) {
                    ops[i]->rc = KV_ESYS;
                }
            }
        }
    }
    for (size_t i = 0; i < n; i++) {
        if (rto[i] < 0 || ops[i]->rc != KV_OK) {
            continue;
        }
        const char *argv[5] = {"SET", ops[i]->key, (const char *)vals[i], "EX", ttl};
        size_t lens[5] = {3, strlen(ops[i]->key), value_len(ops[i]), 2, strlen(ttl)};
        redisReply *rep = command_at(r, rto[i], rask[i], r->ttl_s > 0 ? 5 : 3, argv, lens, 0);
        if (rep == NULL || rep->type == REDIS_REPLY_ERROR) {
            ops[i]->rc = rep != NULL && strncmp(rep->str, "OOM", 3) == 0 ? KV_EQUOTA : KV_ESYS;
        }
        if (rep != NULL) {
            freeReplyObject(rep);
        }
    }
    free(rto);
    free(rask);
    uint64_t ok = 0, bytes = 0, errs = 0;
    for (size_t i = 0; i < n; i++) {
        if (dest[i] < 0 && ops[i]->rc == KV_OK) {
            ops[i]->rc = KV_ESYS; /* no node to send it to */
        }
        ok += ops[i]->rc == KV_OK;
        bytes += ops[i]->rc == KV_OK ? value_len(ops[i]) : 0;
        errs += ops[i]->rc != KV_OK;
        free(vals[i]);
    }
    free(hdr);
    free(vals);
    free(dest);
    pthread_mutex_lock(&r->mu);
    r->st.state = any_up(r) ? 1 : 2; /* with the counts: a reader sees them agree */
    r->st.puts += ok;
    r->st.put_bytes += bytes;
    r->st.put_errors += errs;
    pthread_mutex_unlock(&r->mu);
}

/* Whether any node answers (for the state). */
static int any_up(const kvd_remote *r) {
    for (int i = 0; i < r->nnodes; i++) {
        if (r->nodes[i].c != NULL) {
            return 1;
        }
    }
    return 0;
}

static void finish(kvd_remote *r, op *o) {
    o->next = NULL;
    pthread_mutex_lock(&r->mu);
    *r->done_tail = o;
    r->done_tail = &o->next;
    if (o->kind == OP_PUT) {
        r->queued_bytes -= o->plen;
    }
    pthread_mutex_unlock(&r->mu);
}

/* The stats' copy of how many failed deletes wait (the thread's nundel). */
static void set_dels_pending(kvd_remote *r) {
    pthread_mutex_lock(&r->mu);
    r->st.dels_pending = r->nundel;
    pthread_mutex_unlock(&r->mu);
}

/* DEL of o's key: 1 when Redis answered it (the key is gone now, or never was there). */
static int del_one(kvd_remote *r, op *o) {
    const char *argv[2] = {"DEL", o->key};
    size_t lens[2] = {3, strlen(o->key)};
    int ni = node_of(r, o->key);
    redisReply *rep = ni >= 0 ? command_one(r, ni, 2, argv, lens, 0) : NULL;
    int ok = rep != NULL && rep->type == REDIS_REPLY_INTEGER;
    if (rep != NULL) {
        freeReplyObject(rep);
    }
    return ok;
}

/* A delete that did not land: kept, to be tried again (the oldest is given up, with a warning,
 * when UNDEL_MAX wait). */
static void undel_keep(kvd_remote *r, op *o) {
    if (r->nundel == UNDEL_MAX) {
        op *old = r->undel;
        r->undel = old->next;
        r->nundel--;
        KV_LOG(WARN, "KVD-REMOTE-DEL",
               "remote tier: gave up deleting %s (a quarantined block's value): %d other deletes "
               "wait for Redis; another node may still be served it",
               old->key, UNDEL_MAX);
        old->rc = KV_ESYS;
        finish(r, old);
    }
    op **tail = &r->undel;
    while (*tail != NULL) {
        tail = &(*tail)->next;
    }
    o->next = NULL;
    *tail = o;
    if (r->nundel++ == 0) {
        r->undel_at = now_ms() + UNDEL_RETRY_MS;
    }
    set_dels_pending(r);
}

/* The deletes that failed, tried again in order; those that land are done. */
static void undel_retry(kvd_remote *r) {
    op **at = &r->undel;
    while (*at != NULL) {
        op *o = *at;
        if (del_one(r, o)) {
            *at = o->next;
            r->nundel--;
            set_dels_pending(r);
            o->rc = KV_OK;
            finish(r, o);
        } else {
            at = &o->next;
        }
    }
    r->undel_at = now_ms() + UNDEL_RETRY_MS;
}

/* A batch of puts and deletes, in queue order: each delete runs after the puts queued before it
 * have been answered (a put retried after a failover included), so a quarantined block's value
 * written just before cannot outlive its DEL. */
static void run_puts(kvd_remote *r, op **batch, size_t nb) {
    for (size_t s = 0; s < nb;) {
        size_t e = s;
        while (e < nb && batch[e]->kind != OP_DEL) {
            e++;
        }
        op **ps = batch + s;
        size_t np = e - s;
        do_puts(r, ps, np);
        op *again[PUT_BATCH];
        size_t na = 0;
        for (size_t i = 0; i < np; i++) {
            if (ps[i]->rc == KV_ESYS && r->cluster) {
                again[na++] = ps[i];
            }
        }
        if (na > 0 && r->need_refresh && refresh(r, 0) == 0) {
            /* Counted as errors the first time: uncount what the second try lands. */
            pthread_mutex_lock(&r->mu);
            r->st.put_errors -= na;
            pthread_mutex_unlock(&r->mu);
            do_puts(r, again, na);
        }
        for (size_t i = 0; i < np; i++) {
            finish(r, ps[i]);
        }
        if (e < nb) { /* the delete */
            op *d = batch[e++];
            if (del_one(r, d)) {
                d->rc = KV_OK;
                finish(r, d);
            } else {
                undel_keep(r, d);
            }
        }
        s = e;
    }
}

static void *thread_main(void *arg) {
    kvd_remote *r = arg;
    /* libhiredis writes with write(): a connection Redis closed must give EPIPE here, not a
     * SIGPIPE that ends the daemon. */
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, NULL);
    /* Connect at once, so that the state says up or down before the first request. */
    (void)refresh(r, 0);
    pthread_mutex_lock(&r->mu);
    r->st.state = any_up(r) ? 1 : 2;
    pthread_mutex_unlock(&r->mu);
    for (;;) {
        pthread_mutex_lock(&r->mu);
        while (!r->stop && r->gets == NULL && r->puts == NULL) {
            if (r->undel == NULL) {
                pthread_cond_wait(&r->cv, &r->mu);
                continue;
            }
            uint64_t now = now_ms();
            if (now >= r->undel_at) {
                break; /* the failed deletes' turn */
            }
            struct timespec until;
            clock_gettime(CLOCK_MONOTONIC, &until);
            uint64_t ns = (uint64_t)until.tv_nsec + (r->undel_at - now) * 1000000u;
            until.tv_sec += (time_t)(ns / 1000000000u);
            until.tv_nsec = (long)(ns % 1000000000u);
            (void)pthread_cond_timedwait(&r->cv, &r->mu, &until);
        }
        if (r->stop) {
            pthread_mutex_unlock(&r->mu);
            break;
        }
        /* Gets first (a Fetch waits for them), but not past a delete queued before them: it
         * runs first, so that no get is served a value a delete was queued for. */
        op *g = r->dels_queued == 0 ? r->gets : NULL;
        op *batch[PUT_BATCH];
        size_t nb = 0;
        if (g != NULL) {
            r->gets = g->next;
            if (r->gets == NULL) {
                r->gets_tail = &r->gets;
            }
        } else {
            while (r->puts != NULL && nb < PUT_BATCH) {
                r->dels_queued -= r->puts->kind == OP_DEL;
                batch[nb++] = r->puts;
                r->puts = r->puts->next;
            }
            if (r->puts == NULL) {
                r->puts_tail = &r->puts;
            }
        }
        pthread_mutex_unlock(&r->mu);
        if (r->undel != NULL && now_ms() >= r->undel_at) {
            if (!r->probed || r->need_refresh) {
                (void)refresh(r, 0);
            }
            undel_retry(r);
        }
        if (g == NULL && nb == 0) {
            uv_async_send(&r->async); /* the deletes that landed */
            continue;
        }
        if (g != NULL) {
            g->deadline = now_ms() + r->timeout_ms;
        }
        if (!r->probed || r->need_refresh) {
            (void)refresh(r, g != NULL ? g->deadline : 0);
        }
        if (g != NULL && g->kind == OP_PROBE) {
            do_probe(r, g);
            if (g->rc == KV_ESYS && r->cluster && r->need_refresh && now_ms() < g->deadline &&
                refresh(r, g->deadline) == 0) {
                g->rc = KV_OK; /* a master failed: once more over the new map */
                do_probe(r, g);
            }
            uint64_t found = 0;
            for (size_t i = 0; g->present != NULL && i < g->n; i++) {
                found += g->present[i];
            }
            pthread_mutex_lock(&r->mu);
            r->st.probes += g->n;
            r->st.probe_hits += found;
            pthread_mutex_unlock(&r->mu);
            finish(r, g);
        } else if (g != NULL) {
            do_get(r, g);
            if (g->rc == KV_ESYS && r->cluster && r->need_refresh && now_ms() < g->deadline &&
                refresh(r, g->deadline) == 0) {
                /* A master failed: once more over the new map (a replica took its slots); the
                 * first try's counts are taken back, so each key is counted once. */
                uint64_t h1 = 0, b1 = 0, m1 = 0;
                for (size_t i = 0; i < g->n; i++) {
                    h1 += g->vals[i].status == KVD_REMOTE_HIT;
                    b1 += g->vals[i].status == KVD_REMOTE_BAD;
                    m1 += g->vals[i].status == KVD_REMOTE_MISS;
                    free(g->vals[i].data);
                }
                pthread_mutex_lock(&r->mu);
                r->st.gets -= g->n;
                r->st.hits -= h1;
                r->st.bad -= b1;
                r->st.misses -= m1;
                pthread_mutex_unlock(&r->mu);
                free(g->vals);
                g->vals = NULL;
                g->rc = KV_OK;
                do_get(r, g);
            }
            finish(r, g);
        } else {
            run_puts(r, batch, nb);
        }
        pthread_mutex_lock(&r->mu);
        r->st.state = any_up(r) ? 1 : 2;
        pthread_mutex_unlock(&r->mu);
        uv_async_send(&r->async);
    }
    for (int i = 0; i < r->nnodes; i++) {
        if (r->nodes[i].c != NULL) {
            redisFree(r->nodes[i].c);
            r->nodes[i].c = NULL;
        }
        free(r->nodes[i].rb);
        r->nodes[i].rb = NULL;
        resolve_rele(r->nodes[i].res);
        r->nodes[i].res = NULL;
    }
    for (int k = 0; k < r->nidle; k++) {
        resolve_rele(r->idle[k]);
    }
    r->nidle = 0;
    if (r->nundel > 0) {
        KV_LOG(WARN, "KVD-REMOTE-DEL",
               "remote tier: stopping with %zu deletes of quarantined blocks' values not done "
               "(Redis did not answer them); another node may still be served those values",
               r->nundel);
    }
    while (r->undel != NULL) {
        op *o = r->undel;
        r->undel = o->next;
        o->rc = KV_ECLOSED;
        finish(r, o);
    }
    r->nundel = 0;
    return NULL;
}

/* ---- the loop side ----------------------------------------------------------------------- */

static void run_done(op *o) {
    if (o->kind == OP_DEL) {
        free(o->owned_key);
    } else if (o->kind == OP_PUT) {
        o->put_done(o->arg, o->rc);
    } else if (o->kind == OP_PROBE) {
        kv_err rc = o->present == NULL && o->rc == KV_OK ? KV_ENOMEM : o->rc;
        o->probe_done(o->arg, rc, o->present, o->present != NULL ? o->n : 0);
        free(o->present);
    } else {
        o->get_done(o->arg, o->rc, o->vals, o->vals != NULL ? o->n : 0);
        for (size_t i = 0; o->vals != NULL && i < o->n; i++) {
            free(o->vals[i].data);
        }
        free(o->vals);
    }
    free(o);
}

static void on_async(uv_async_t *h) {
    kvd_remote *r = h->data;
    pthread_mutex_lock(&r->mu);
    op *list = r->done;
    r->done = NULL;
    r->done_tail = &r->done;
    pthread_mutex_unlock(&r->mu);
    while (list != NULL) {
        op *next = list->next;
        run_done(list);
        list = next;
    }
}

kv_err kvd_remote_parse_seeds(const char *seeds, kvd_remote_seed *out, int *n, char *msg,
                              size_t len) {
    char buf[1024];
    snprintf(buf, sizeof(buf), "%s", seeds != NULL ? seeds : "");
    char *save = NULL;
    *n = 0;
    for (char *s = strtok_r(buf, ",", &save); s != NULL; s = strtok_r(NULL, ",", &save)) {
        char *colon = strrchr(s, ':');
        char *end = NULL;
        long port = colon != NULL ? strtol(colon + 1, &end, 10) : 0;
        if (colon == NULL || colon == s || colon - s >= KVD_REMOTE_HOST_MAX || *end != '\0' ||
            port < 1 || port > 65535 || *n == KVD_REMOTE_SEEDS_MAX) {
            snprintf(msg, len, "remote-redis: '%s' is not HOST:PORT (seeds: HOST:PORT,...)", s);
            return KV_EINVAL;
        }
        *colon = '\0';
        snprintf(out[*n].host, sizeof(out[*n].host), "%s", s);
        out[*n].port = (int)port;
        (*n)++;
    }
    if (*n == 0) {
        snprintf(msg, len, "remote-redis: no HOST:PORT given");
        return KV_EINVAL;
    }
    return KV_OK;
}

kv_err kvd_remote_alloc(uv_loop_t *loop, const kvd_remote_cfg *cfg, kvd_remote **out, char *msg,
                        size_t len) {
    kvd_remote *r = calloc(1, sizeof(*r));
    if (r == NULL) {
        return KV_ENOMEM;
    }
    r->slots = malloc(NSLOTS * sizeof(*r->slots));
    r->password = strdup(cfg->password != NULL ? cfg->password : "");
    if (r->slots == NULL || r->password == NULL) {
        free(r->slots);
        free(r->password);
        free(r);
        return KV_ENOMEM;
    }
    for (int s = 0; s < NSLOTS; s++) {
        r->slots[s] = -1;
    }
    kvd_remote_seed *seeds = malloc(KVD_REMOTE_SEEDS_MAX * sizeof(*seeds));
    int nseeds = 0;
    kv_err perr =
        seeds == NULL ? KV_ENOMEM : kvd_remote_parse_seeds(cfg->seeds, seeds, &nseeds, msg, len);
    if (perr != KV_OK) {
        free(seeds);
        free(r->slots);
        free(r->password);
        free(r);
        return perr;
    }
    for (int i = 0; i < nseeds; i++) {
        (void)node_find_or_add(r, seeds[i].host, seeds[i].port);
    }
    free(seeds);
    r->nseeds = r->nnodes;
    r->loop = loop;
    r->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : 200;
    r->backoff_max_ms = cfg->backoff_max_ms > 0 ? cfg->backoff_max_ms : 5000;
    r->ttl_s = cfg->ttl_s;
    r->queue_cap = cfg->queue_bytes;
    r->gets_tail = &r->gets;
    r->puts_tail = &r->puts;
    r->done_tail = &r->done;
    r->st.state = 2;
    r->st.nnodes = r->nnodes;
    pthread_mutex_init(&r->mu, NULL);
    pthread_condattr_t ca; /* timed waits (the failed deletes' retries) on the monotonic clock */
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&r->cv, &ca);
    pthread_condattr_destroy(&ca);
    uv_async_init(loop, &r->async, on_async);
    r->async.data = r;
    r->async_open = 1;
    if (pthread_create(&r->th, NULL, thread_main, r) != 0) {
        snprintf(msg, len, "remote tier: cannot start its thread");
        uv_close((uv_handle_t *)&r->async, NULL);
        r->async_open = 0;
        *out = r; /* freed by the caller after the loop closed the handle */
        return KV_ESYS;
    }
    r->th_started = 1;
    *out = r;
    return KV_OK;
}

/* Queues a made op at the tail of its queue (gets, or puts and deletes) and wakes the thread;
 * KV_EBUSY (nothing queued, the op is the caller's) at stop or, for a put, past queue_cap. */
static kv_err enqueue(kvd_remote *r, op *o) {
    pthread_mutex_lock(&r->mu);
    if (r->stop || (o->kind == OP_PUT && r->queued_bytes + o->plen > r->queue_cap)) {
        r->st.put_drops += o->kind == OP_PUT;
        pthread_mutex_unlock(&r->mu);
        return KV_EBUSY;
    }
    op ***tail = o->kind == OP_GET || o->kind == OP_PROBE ? &r->gets_tail : &r->puts_tail;
    **tail = o;
    *tail = &o->next;
    r->queued_bytes += o->kind == OP_PUT ? o->plen : 0;
    r->dels_queued += o->kind == OP_DEL;
    pthread_mutex_unlock(&r->mu);
    /* After the unlock: signalled under it, the woken thread blocks at once on the mutex the
     * loop still holds and must be woken a second time (two more context switches a request;
     * seen in a scheduler trace of Lookup.remote). r outlives the call (freed by the loop). */
    pthread_cond_signal(&r->cv);
    return KV_OK;
}

kv_err kvd_remote_put(kvd_remote *r, const char *key, const kvd_remote_meta *meta,
                      const uint8_t *payload, size_t plen, kvd_remote_put_done done, void *arg) {
    op *o = calloc(1, sizeof(*o));
    if (o == NULL) {
        return KV_ENOMEM;
    }
    o->kind = OP_PUT;
    o->key = key;
    o->meta = *meta;
    if (meta->tail != NULL) {
        memcpy(o->tail, meta->tail, KVD_REMOTE_TAIL); /* the caller's copy may move */
        o->meta.tail = o->tail;
    }
    o->payload = payload;
    o->plen = plen;
    o->put_done = done;
    o->arg = arg;
    kv_err rc = enqueue(r, o);
    if (rc != KV_OK) {
        free(o);
    }
    return rc;
}

kv_err kvd_remote_del(kvd_remote *r, const char *key) {
    op *o = calloc(1, sizeof(*o));
    char *k = strdup(key);
    if (o == NULL || k == NULL) {
        free(o);
        free(k);
        return KV_ENOMEM;
    }
    o->kind = OP_DEL;
    o->owned_key = k;
    o->key = k;
    /* Behind the puts queued before it: a put of the same key in flight goes first. */
    kv_err rc = enqueue(r, o);
    if (rc != KV_OK) {
        free(k);
        free(o);
    }
    return rc;
}

/* Queues a copy of *o (a get or a probe, made on the caller's stack): KV_ENOMEM, or what
 * enqueue says. */
static kv_err enqueue_copy(kvd_remote *r, const op *o) {
    op *c = malloc(sizeof(*c));
    if (c == NULL) {
        return KV_ENOMEM;
    }
    *c = *o;
    kv_err rc = enqueue(r, c);
    if (rc != KV_OK) {
        free(c);
    }
    return rc;
}

kv_err kvd_remote_get(kvd_remote *r, const char *const *keys, const kvd_remote_meta *want,
                      const kvd_remote_dst *dst, size_t n, kvd_remote_get_done done, void *arg) {
    op o = {.kind = OP_GET,
            .keys = keys,
            .want = want,
            .dst = dst,
            .n = n,
            .get_done = done,
            .arg = arg};
    return enqueue_copy(r, &o);
}

kv_err kvd_remote_probe(kvd_remote *r, const char *const *keys, size_t n,
                        kvd_remote_probe_done done, void *arg) {
    op o = {.kind = OP_PROBE, .keys = keys, .n = n, .probe_done = done, .arg = arg};
    return enqueue_copy(r, &o);
}

void kvd_remote_get_stats(kvd_remote *r, kvd_remote_stats *out) {
    pthread_mutex_lock(&r->mu);
    *out = r->st;
    pthread_mutex_unlock(&r->mu);
}

void kvd_remote_close(kvd_remote *r) {
    if (r == NULL || !r->async_open) {
        return;
    }
    pthread_mutex_lock(&r->mu);
    r->stop = 1;
    pthread_cond_signal(&r->cv);
    pthread_mutex_unlock(&r->mu);
    if (r->th_started) {
        pthread_join(r->th, NULL);
        r->th_started = 0;
    }
    on_async(&r->async); /* what finished before the stop */
    /* What never ran: cancelled. */
    op *lists[2] = {r->gets, r->puts};
    r->gets = r->puts = NULL;
    r->gets_tail = &r->gets;
    r->puts_tail = &r->puts;
    for (int k = 0; k < 2; k++) {
        for (op *o = lists[k]; o != NULL;) {
            op *next = o->next;
            o->rc = KV_ECLOSED;
            run_done(o);
            o = next;
        }
    }
    uv_close((uv_handle_t *)&r->async, NULL);
    r->async_open = 0;
}

void kvd_remote_free(kvd_remote *r) {
    if (r == NULL) {
        return;
    }
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r->slots);
    free(r->password);
    free(r);
}
