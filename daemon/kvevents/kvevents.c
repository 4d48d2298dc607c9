/* kvd_kvevents: vLLM-format KV events over ZMQ (kvevents.h has the contract). */
#include "daemon/kvevents/kvevents.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <msgpack.h>
#include <zmq.h>

#include "common/kv_log.h"

#define MAX_PUBS (KVD_MAX_EVENT_LINES + 1)
#define NO_PUB 0xFFu

/* One batch kept for replay. */
typedef struct kept {
    uint64_t seq;
    uint8_t *data; /* payload (malloc'd) */
    size_t len;
} kept;

typedef struct pub {
    struct kvd_kvevents *e;
    void *sock;   /* PUB */
    void *router; /* ROUTER for replays, or NULL */
    uv_poll_t poll;
    int polling; /* poll initialised (closed at close) */
    char topic[128];
    char endpoint[256];
    int token_ids;
    int hash_bytes;
    uint64_t seq;          /* of the next batch */
    msgpack_sbuffer evbuf; /* events of the batch being built */
    msgpack_packer pk;
    uint32_t nev;   /* events in evbuf */
    kept *ring;     /* [cap] */
    size_t cap;     /* batches kept at most */
    size_t head, n; /* oldest kept, count */
    size_t bytes;   /* payload bytes kept */
} pub;

/* A remembered vllm digest: (pool, key) -> its last 16 bytes. Open addressing, linear probing,
 * deletion by backward shift. */
typedef struct tail_ent {
    kv_hash128 key;
    uint32_t pool_id; /* 0: empty slot */
    uint8_t tail[16];
} tail_ent;

enum {
    KS_PUBLISHERS,
    KS_BATCHES,
    KS_EVENTS,
    KS_SEND_DROPS,
    KS_GAPS,
    KS_REPLAYS,
    KS_REPLAY_BAD,
    KS_DIGESTS,
    KS_COUNT
};

static const kv_stat_desc ks_stats[KS_COUNT] = {
    [KS_PUBLISHERS] = {"kv_events_publishers", "gauge", "publishers",
                       "KV-event publishers (ZMQ PUB endpoints)", NULL, NULL, NULL, NULL},
    [KS_BATCHES] = {"kv_events_batches", "counter", "batches", "KV-event batches published",
                    "kvd_kv_events_batches_total", "KV-event batches published.", NULL, NULL},
    [KS_EVENTS] = {"kv_events_events", "counter", "events",
                   "KV events (BlockStored, BlockRemoved, AllBlocksCleared) published",
                   "kvd_kv_events_total", "KV events published.", NULL, NULL},
    [KS_SEND_DROPS] = {"kv_events_send_drops", "counter", "batches",
                       "batches ZMQ refused at once (high-water mark): subscribers miss them "
                       "until they replay",
                       "kvd_kv_events_send_drops_total", "KV-event batches ZMQ refused.", NULL,
                       NULL},
    [KS_GAPS] = {"kv_events_gaps", "counter", "events",
                 "events not published for want of memory (a router's view is stale until the "
                 "block goes)",
                 NULL, NULL, NULL, NULL},
    [KS_REPLAYS] = {"kv_events_replays", "counter", "requests", "replay requests answered", NULL,
                    NULL, NULL, NULL},
    [KS_REPLAY_BAD] = {"kv_events_replay_bad", "counter", "requests",
                       "malformed replay requests (ignored)", NULL, NULL, NULL, NULL},
    [KS_DIGESTS] = {"kv_events_digests", "gauge", "blocks",
                    "vllm digests remembered for blocks still in T0", NULL, NULL, NULL, NULL},
};

struct kvd_kvevents {
    uv_loop_t *loop;
    void *ctx; /* ZMQ context */
    pub pubs[MAX_PUBS];
    uint32_t npubs;
    uint8_t by_tenant[KVD_MAX_TENANTS]; /* private domain -> publisher, NO_PUB none */
    uint8_t by_group[KVD_MAX_GROUPS];
    uint8_t commons;
    uint8_t dflt; /* the options' publisher, NO_PUB none */
    const char *medium;
    uv_check_t check; /* flush-ms 0: flushes the batches of one loop iteration */
    uv_timer_t timer; /* flush-ms > 0: flushes that long after a batch's first event */
    uint64_t flush_ms;
    int check_open, check_on, closed;
    tail_ent *tails;
    size_t tcap, tn; /* slots (a power of two), used */
    uint64_t c[KS_COUNT];
};

/* ---- vllm digests ------------------------------------------------------------------------- */

static size_t tail_slot(const kvd_kvevents *e, uint32_t pool_id, kv_hash128 k) {
    uint64_t h = (k.lo ^ (k.hi * 0x9E3779B97F4A7C15ull)) + pool_id * 0xC2B2AE3D27D4EB4Full;
    return (size_t)(h ^ (h >> 29)) & (e->tcap - 1);
}

static tail_ent *tail_find(kvd_kvevents *e, uint32_t pool_id, kv_hash128 k) {
    if (e->tcap == 0) {
        return NULL;
    }
    for (size_t i = tail_slot(e, pool_id, k);; i = (i + 1) & (e->tcap - 1)) {
        tail_ent *t = &e->tails[i];
        if (t->pool_id == 0) {
            return NULL;
        }
        if (t->pool_id == pool_id && kv_hash_eq(t->key, k)) {
            return t;
        }
    }
}

static int tail_grow(kvd_kvevents *e) {
    size_t ncap = e->tcap == 0 ? 1024 : e->tcap * 2;
    tail_ent *nt = calloc(ncap, sizeof(*nt));
    if (nt == NULL) {
        return -1;
    }
    tail_ent *old = e->tails;
    size_t ocap = e->tcap;
    e->tails = nt;
    e->tcap = ncap;
    for (size_t i = 0; i < ocap; i++) {
        if (old[i].pool_id != 0) {
            size_t j = tail_slot(e, old[i].pool_id, old[i].key);
            while (nt[j].pool_id != 0) {
                j = (j + 1) & (ncap - 1);
            }
            nt[j] = old[i];
        }
    }
    free(old);
    return 0;
}

static int tail_put(kvd_kvevents *e, uint32_t pool_id, kv_hash128 k, const uint8_t *full) {
    tail_ent *t = tail_find(e, pool_id, k);
    if (t == NULL) {
        if ((e->tn + 1) * 2 > e->tcap && tail_grow(e) != 0) {
            return -1;
        }
        size_t i = tail_slot(e, pool_id, k);
        while (e->tails[i].pool_id != 0) {
            i = (i + 1) & (e->tcap - 1);
        }
        t = &e->tails[i];
        t->pool_id = pool_id;
        t->key = k;
        e->tn++;
    }
    memcpy(t->tail, full + 16, 16);
    return 0;
}

static void tail_del(kvd_kvevents *e, tail_ent *t) {
    size_t i = (size_t)(t - e->tails);
    e->tails[i].pool_id = 0;
    e->tn--;
    /* Backward shift: move up every later entry of the run whose home is not between. */
    for (size_t j = (i + 1) & (e->tcap - 1); e->tails[j].pool_id != 0;
         j = (j + 1) & (e->tcap - 1)) {
        size_t home = tail_slot(e, e->tails[j].pool_id, e->tails[j].key);
        int between = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (!between) {
            e->tails[i] = e->tails[j];
            e->tails[j].pool_id = 0;
            i = j;
        }
    }
}

/* ---- encoding ---------------------------------------------------------------------------- */

static void put_u64le(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) {
        p[i] = (uint8_t)(v >> (8 * i));
    }
}

/* Packs one block's name: the digest bytes (32 for vllm, 16 for a key) or vLLM's int form (the
 * digest's last 8 bytes, big-endian). full: 32 bytes or NULL. */
static void pack_hash(pub *b, kv_hash128 key, const uint8_t *full) {
    uint8_t d[32];
    size_t n = 16;
    put_u64le(d, key.lo);
    put_u64le(d + 8, key.hi);
    if (full != NULL) {
        memcpy(d, full, 32);
        n = 32;
    }
    if (b->hash_bytes) {
        msgpack_pack_bin(&b->pk, n);
        msgpack_pack_bin_body(&b->pk, d, n);
        return;
    }
    uint64_t v = 0;
    for (size_t i = n - 8; i < n; i++) {
        v = (v << 8) | d[i];
    }
    msgpack_pack_uint64(&b->pk, v);
}

static void pack_str(msgpack_packer *pk, const char *s) {
    size_t n = strlen(s);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

/* The packed digest of (pool, key): its remembered tail, when known. */
static const uint8_t *full_of(kvd_kvevents *e, uint32_t pool_id, kv_hash128 key, uint8_t buf[32]) {
    tail_ent *t = tail_find(e, pool_id, key);
    if (t == NULL) {
        return NULL;
    }
    put_u64le(buf, key.lo);
    put_u64le(buf + 8, key.hi);
    memcpy(buf + 16, t->tail, 16);
    return buf;
}

/* ---- publishing -------------------------------------------------------------------------- */

static void keep(pub *b, uint64_t seq, const uint8_t *data, size_t len) {
    uint8_t *copy = malloc(len > 0 ? len : 1);
    if (copy == NULL) {
        return; /* not replayable; the live subscribers have it */
    }
    memcpy(copy, data, len);
    while (b->n > 0 && (b->n == b->cap || b->bytes + len > KVD_KVEVENTS_RING_BYTES)) {
        kept *old = &b->ring[b->head];
        b->bytes -= old->len;
        free(old->data);
        old->data = NULL;
        b->head = (b->head + 1) % b->cap;
        b->n--;
    }
    kept *k = &b->ring[(b->head + b->n) % b->cap];
    k->seq = seq;
    k->data = copy;
    k->len = len;
    b->n++;
    b->bytes += len;
}

static void seq_bytes(uint64_t seq, uint8_t out[8]) {
    for (int i = 0; i < 8; i++) {
        out[i] = (uint8_t)(seq >> (56 - 8 * i));
    }
}

static void flush_pub(kvd_kvevents *e, pub *b) {
    if (b->nev == 0) {
        return;
    }
    msgpack_sbuffer out;
    msgpack_sbuffer_init(&out);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &out, msgpack_sbuffer_write);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    msgpack_pack_array(&pk, 3);
    msgpack_pack_double(&pk, (double)ts.tv_sec + (double)ts.tv_nsec / 1e9);
    msgpack_pack_array(&pk, b->nev);
    msgpack_sbuffer_write(&out, b->evbuf.data, b->evbuf.size);
    msgpack_pack_uint32(&pk, 0); /* data_parallel_rank */
    uint64_t seq = b->seq++;
    uint8_t sb[8];
    seq_bytes(seq, sb);
    int ok = out.data != NULL &&
             zmq_send(b->sock, b->topic, strlen(b->topic), ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0 &&
             zmq_send(b->sock, sb, 8, ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0 &&
             zmq_send(b->sock, out.data, out.size, ZMQ_DONTWAIT) >= 0;
    if (!ok) {
        e->c[KS_SEND_DROPS]++;
    }
    if (out.data != NULL) {
        keep(b, seq, (const uint8_t *)out.data, out.size);
    }
    e->c[KS_BATCHES]++;
    e->c[KS_EVENTS] += b->nev;
    msgpack_sbuffer_destroy(&out);
    msgpack_sbuffer_clear(&b->evbuf);
    b->nev = 0;
}

static void flush_all(kvd_kvevents *e) {
    for (uint32_t i = 0; i < e->npubs; i++) {
        flush_pub(e, &e->pubs[i]);
    }
    e->check_on = 0;
}

static void on_check(uv_check_t *h) {
    kvd_kvevents *e = h->data;
    uv_check_stop(&e->check);
    flush_all(e);
}

static void on_timer(uv_timer_t *h) {
    flush_all(h->data);
}

/* Arms the flush of the batches being built: at the end of this loop iteration, or flush-ms
 * after this first event (one batch then carries every event of that window: fewer sends and
 * I/O-thread wake-ups on a busy Commit path). */
static void arm(kvd_kvevents *e) {
    if (e->check_on || !e->check_open || e->closed) {
        return;
    }
    if (e->flush_ms > 0) {
        uv_timer_start(&e->timer, on_timer, e->flush_ms, 0);
    } else {
        uv_check_start(&e->check, on_check);
    }
    e->check_on = 1;
}

static void queued(kvd_kvevents *e, pub *b) {
    b->nev++;
    arm(e);
}

static pub *pub_of(const kvd_kvevents *e, uint32_t domain) {
    uint8_t i;
    if (domain == KVD_DOMAIN_COMMONS) {
        i = e->commons;
    } else if (domain >= KVD_DOMAIN_GROUP0) {
        uint32_t g = domain - KVD_DOMAIN_GROUP0;
        i = g < KVD_MAX_GROUPS ? e->by_group[g] : NO_PUB;
    } else {
        i = domain < KVD_MAX_TENANTS ? e->by_tenant[domain] : NO_PUB;
    }
    if (i == NO_PUB) {
        i = e->dflt;
    }
    return i == NO_PUB ? NULL : (pub *)&e->pubs[i];
}

int kvd_kvevents_publishes(const kvd_kvevents *e, const kvd_reg_pool *p) {
    return e != NULL && pub_of(e, p->domain) != NULL;
}

void kvd_kvevents_stored(kvd_kvevents *e, const kvd_reg_pool *p, const kvd_kvevent_block *blk,
                         size_t n, const kv_hash128 *parent) {
    if (e == NULL || n == 0 || e->closed) {
        return;
    }
    pub *b = pub_of(e, p->domain);
    if (b == NULL) {
        return;
    }
    for (size_t i = 0; i < n; i++) {
        if (blk[i].full != NULL && tail_put(e, p->pool_id, blk[i].key, blk[i].full) != 0) {
            e->c[KS_GAPS]++;
        }
    }
    msgpack_packer *pk = &b->pk;
    msgpack_pack_array(pk, 8);
    pack_str(pk, "BlockStored");
    msgpack_pack_array(pk, n);
    for (size_t i = 0; i < n; i++) {
        pack_hash(b, blk[i].key, blk[i].full);
    }
    uint8_t pbuf[32];
    if (parent == NULL) {
        msgpack_pack_nil(pk);
    } else {
        pack_hash(b, *parent, full_of(e, p->pool_id, *parent, pbuf));
    }
    uint32_t tpb = p->layout.tokens_per_block;
    int with_tokens = b->token_ids;
    for (size_t i = 0; i < n && with_tokens; i++) {
        with_tokens = blk[i].tokens != NULL;
    }
    msgpack_pack_array(pk, with_tokens ? n * tpb : 0);
    for (size_t i = 0; i < n && with_tokens; i++) {
        for (uint32_t t = 0; t < tpb; t++) {
            msgpack_pack_uint32(pk, blk[i].tokens[t]);
        }
    }
    msgpack_pack_uint32(pk, tpb);
    msgpack_pack_nil(pk); /* lora_id */
    pack_str(pk, e->medium);
    msgpack_pack_nil(pk); /* lora_name */
    queued(e, b);
}

/* The pool's drop hook (KVD_DROP_HOOK_EVENTS): the block left T0. */
static void on_drop(void *arg, kvd_pool *pool, kv_hash128 hash, kv_hash128 parent, int reason) {
    (void)parent;
    (void)reason;
    kvd_kvevents *e = arg;
    if (e->closed) {
        return;
    }
    const kvd_pool_config *pc = kvd_pool_config_get(pool);
    pub *b = pub_of(e, pc->domain);
    if (b == NULL) {
        return;
    }
    uint8_t fbuf[32];
    const uint8_t *full = full_of(e, pc->pool_id, hash, fbuf);
    msgpack_packer *pk = &b->pk;
    msgpack_pack_array(pk, 3);
    pack_str(pk, "BlockRemoved");
    msgpack_pack_array(pk, 1);
    pack_hash(b, hash, full);
    pack_str(pk, e->medium);
    queued(e, b);
    if (full != NULL) {
        tail_del(e, tail_find(e, pc->pool_id, hash));
    }
}

void kvd_kvevents_attach(kvd_kvevents *e, kvd_reg_pool *p) {
    if (e == NULL || pub_of(e, p->domain) == NULL) {
        return;
    }
    kvd_pool_set_drop_hook(p->pool, KVD_DROP_HOOK_EVENTS, on_drop, e);
}

/* ---- replay ------------------------------------------------------------------------------ */

static void replay_one(kvd_kvevents *e, pub *b) {
    zmq_msg_t parts[4];
    int nparts = 0, more = 1;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, b->router, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            break;
        }
        more = zmq_msg_more(&m);
        if (nparts < 4) {
            parts[nparts++] = m;
        } else {
            zmq_msg_close(&m);
            nparts = 5; /* too many: bad */
        }
        if (nparts == 5) {
            while (more) { /* drain the rest of it */
                zmq_msg_init(&m);
                if (zmq_msg_recv(&m, b->router, ZMQ_DONTWAIT) < 0) {
                    zmq_msg_close(&m);
                    break;
                }
                more = zmq_msg_more(&m);
                zmq_msg_close(&m);
            }
        }
    }
    int good = nparts == 3 && zmq_msg_size(&parts[1]) == 0 && zmq_msg_size(&parts[2]) == 8;
    if (!good) {
        e->c[KS_REPLAY_BAD]++;
        KV_LOG(WARN, "KVD-EVENTS",
               "%s: malformed replay request (%d frames; expected "
               "[identity, empty, 8-byte start seq])",
               b->endpoint, nparts > 4 ? 4 : nparts);
    } else {
        const uint8_t *s = zmq_msg_data(&parts[2]);
        uint64_t start = 0;
        for (int i = 0; i < 8; i++) {
            start = (start << 8) | s[i];
        }
        const void *id = zmq_msg_data(&parts[0]);
        size_t idlen = zmq_msg_size(&parts[0]);
        for (size_t i = 0; i < b->n; i++) {
            const kept *k = &b->ring[(b->head + i) % b->cap];
            if (k->seq < start) {
                continue;
            }
            uint8_t sb[8];
            seq_bytes(k->seq, sb);
            zmq_send(b->router, id, idlen, ZMQ_SNDMORE | ZMQ_DONTWAIT);
            zmq_send(b->router, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
            zmq_send(b->router, sb, 8, ZMQ_SNDMORE | ZMQ_DONTWAIT);
            zmq_send(b->router, k->data, k->len, ZMQ_DONTWAIT);
        }
        static const uint8_t end[8] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
        zmq_send(b->router, id, idlen, ZMQ_SNDMORE | ZMQ_DONTWAIT);
        zmq_send(b->router, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
        zmq_send(b->router, end, 8, ZMQ_SNDMORE | ZMQ_DONTWAIT);
        zmq_send(b->router, "", 0, ZMQ_DONTWAIT);
        e->c[KS_REPLAYS]++;
    }
    for (int i = 0; i < (nparts > 4 ? 4 : nparts); i++) {
        zmq_msg_close(&parts[i]);
    }
}

static void on_router(uv_poll_t *h, int status, int events) {
    (void)status;
    (void)events;
    pub *b = h->data;
    /* ZMQ_FD signals edges: read every queued request, then look again. */
    for (;;) {
        int zev = 0;
        size_t zl = sizeof(zev);
        if (zmq_getsockopt(b->router, ZMQ_EVENTS, &zev, &zl) != 0 || !(zev & ZMQ_POLLIN)) {
            return;
        }
        replay_one(b->e, b);
    }
}

/* ---- lifetime ---------------------------------------------------------------------------- */

static kv_err open_pub(kvd_kvevents *e, const char *endpoint, const char *replay, const char *topic,
                       int token_ids, int hash_bytes, uint64_t buffer, char *msg, size_t len) {
    pub *b = &e->pubs[e->npubs];
    memset(b, 0, sizeof(*b));
    b->e = e;
    snprintf(b->endpoint, sizeof(b->endpoint), "%s", endpoint);
    snprintf(b->topic, sizeof(b->topic), "%s", topic);
    b->token_ids = token_ids;
    b->hash_bytes = hash_bytes;
    b->cap = buffer;
    b->ring = calloc(buffer, sizeof(kept));
    if (b->ring == NULL) {
        return KV_ENOMEM;
    }
    msgpack_sbuffer_init(&b->evbuf);
    msgpack_packer_init(&b->pk, &b->evbuf, msgpack_sbuffer_write);
    e->npubs++; /* from here close frees it */
    int hwm = 100000, linger = 0;
    b->sock = zmq_socket(e->ctx, ZMQ_PUB);
    if (b->sock == NULL) {
        snprintf(msg, len, "kv events: zmq_socket: %s", zmq_strerror(zmq_errno()));
        return KV_ESYS;
    }
    zmq_setsockopt(b->sock, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(b->sock, ZMQ_LINGER, &linger, sizeof(linger));
    if (zmq_bind(b->sock, endpoint) != 0) {
        snprintf(msg, len, "kv events: cannot bind %s: %s", endpoint, zmq_strerror(zmq_errno()));
        return KV_ESYS;
    }
    if (replay[0] != '\0') {
        b->router = zmq_socket(e->ctx, ZMQ_ROUTER);
        if (b->router == NULL) {
            snprintf(msg, len, "kv events: zmq_socket: %s", zmq_strerror(zmq_errno()));
            return KV_ESYS;
        }
        /* Room for a whole replay of the ring (4 frames a batch) per peer. */
        int rhwm = buffer * 4 + 8 > 1u << 30 ? 1 << 30 : (int)(buffer * 4 + 8);
        zmq_setsockopt(b->router, ZMQ_SNDHWM, &rhwm, sizeof(rhwm));
        zmq_setsockopt(b->router, ZMQ_LINGER, &linger, sizeof(linger));
        if (zmq_bind(b->router, replay) != 0) {
            snprintf(msg, len, "kv events: cannot bind replay %s: %s", replay,
                     zmq_strerror(zmq_errno()));
            return KV_ESYS;
        }
    }
    /* seq 0: whatever a router knew of this node's previous run is gone. */
    msgpack_pack_array(&b->pk, 1);
    pack_str(&b->pk, "AllBlocksCleared");
    queued(e, b);
    KV_LOG(INFO, "KVD-EVENTS", "publishing KV events on %s%s%s (token ids %s, hashes as %s)",
           endpoint, replay[0] != '\0' ? ", replays on " : "", replay, token_ids ? "on" : "off",
           hash_bytes ? "bytes" : "int");
    return KV_OK;
}

static void close_sockets(kvd_kvevents *e) {
    for (uint32_t i = 0; i < e->npubs; i++) {
        pub *b = &e->pubs[i];
        if (b->router != NULL) {
            zmq_close(b->router);
            b->router = NULL;
        }
        if (b->sock != NULL) {
            zmq_close(b->sock);
            b->sock = NULL;
        }
    }
}

kv_err kvd_kvevents_alloc(uv_loop_t *loop, const kvd_config *cfg, const kvd_tenants *tenants,
                          const char *medium_t0, kvd_kvevents **out, char *msg, size_t len) {
    *out = NULL;
    const kvd_events_line *lines;
    uint32_t nl = kvd_tenants_event_lines(tenants, &lines);
    if (nl == 0 && cfg->kv_events_endpoint[0] == '\0') {
        return KV_OK;
    }
    kvd_kvevents *e = calloc(1, sizeof(*e));
    if (e == NULL) {
        return KV_ENOMEM;
    }
    e->loop = loop;
    e->medium = medium_t0;
    memset(e->by_tenant, NO_PUB, sizeof(e->by_tenant));
    memset(e->by_group, NO_PUB, sizeof(e->by_group));
    e->commons = e->dflt = NO_PUB;
    e->ctx = zmq_ctx_new();
    kv_err rc = e->ctx != NULL ? KV_OK : KV_ESYS;
    if (rc != KV_OK) {
        snprintf(msg, len, "kv events: zmq_ctx_new failed");
    }
    for (uint32_t i = 0; i < nl && rc == KV_OK; i++) {
        const kvd_events_line *l = &lines[i];
        rc = open_pub(e, l->endpoint, l->replay, l->topic, l->token_ids, l->hash_bytes, l->buffer,
                      msg, len);
        for (uint32_t j = 0; j < l->ndomains && rc == KV_OK; j++) {
            uint32_t d = l->domains[j];
            if (d == KVD_DOMAIN_COMMONS) {
                e->commons = (uint8_t)i;
            } else if (d >= KVD_DOMAIN_GROUP0) {
                e->by_group[d - KVD_DOMAIN_GROUP0] = (uint8_t)i;
            } else {
                e->by_tenant[d] = (uint8_t)i;
            }
        }
    }
    if (rc == KV_OK && cfg->kv_events_endpoint[0] != '\0') {
        e->dflt = (uint8_t)e->npubs;
        rc = open_pub(e, cfg->kv_events_endpoint, cfg->kv_events_replay, cfg->kv_events_topic,
                      cfg->kv_events_token_ids, strcmp(cfg->kv_events_hash_form, "bytes") == 0,
                      cfg->kv_events_buffer, msg, len);
    }
    if (rc != KV_OK) {
        close_sockets(e); /* no loop handle was made yet: free at once */
        kvd_kvevents_free(e);
        return rc;
    }
    /* The loop's handles last, once every socket is bound. */
    for (uint32_t i = 0; i < e->npubs; i++) {
        pub *b = &e->pubs[i];
        int fd;
        size_t fl = sizeof(fd);
        if (b->router == NULL) {
            continue;
        }
        if (zmq_getsockopt(b->router, ZMQ_FD, &fd, &fl) != 0 ||
            uv_poll_init(loop, &b->poll, fd) != 0) {
            KV_LOG(WARN, "KVD-EVENTS", "%s: cannot watch the replay socket; no replays",
                   b->endpoint);
            zmq_close(b->router);
            b->router = NULL;
            continue;
        }
        b->poll.data = b;
        b->polling = 1;
        uv_poll_start(&b->poll, UV_READABLE, on_router);
    }
    uv_check_init(loop, &e->check);
    uv_timer_init(loop, &e->timer);
    e->check.data = e;
    e->timer.data = e;
    e->check_open = 1;
    e->flush_ms = cfg->kv_events_flush_ms;
    /* The AllBlocksCleared batches go alone, at the first loop iteration, whatever flush-ms. */
    uv_check_start(&e->check, on_check);
    e->check_on = 1;
    e->c[KS_PUBLISHERS] = e->npubs;
    *out = e;
    return KV_OK;
}

void kvd_kvevents_close(kvd_kvevents *e) {
    if (e == NULL || e->closed) {
        return;
    }
    for (uint32_t i = 0; i < e->npubs; i++) {
        flush_pub(e, &e->pubs[i]);
    }
    e->closed = 1;
    for (uint32_t i = 0; i < e->npubs; i++) {
        pub *b = &e->pubs[i];
        if (b->polling) {
            uv_poll_stop(&b->poll);
            uv_close((uv_handle_t *)&b->poll, NULL);
        }
    }
    close_sockets(e);
    if (e->check_open) {
        uv_close((uv_handle_t *)&e->check, NULL);
        uv_close((uv_handle_t *)&e->timer, NULL);
    }
}

void kvd_kvevents_free(kvd_kvevents *e) {
    if (e == NULL) {
        return;
    }
    for (uint32_t i = 0; i < e->npubs; i++) {
        pub *b = &e->pubs[i];
        for (size_t k = 0; k < b->n; k++) {
            free(b->ring[(b->head + k) % b->cap].data);
        }
        free(b->ring);
        msgpack_sbuffer_destroy(&b->evbuf);
    }
    if (e->ctx != NULL) {
        zmq_ctx_term(e->ctx);
    }
    free(e->tails);
    free(e);
}

void kvd_kvevents_stats(const kvd_kvevents *e, kvd_stat_sink sink, void *arg) {
    for (int i = 0; i < KS_COUNT; i++) {
        uint64_t v = e == NULL ? 0 : e->c[i];
        if (i == KS_DIGESTS && e != NULL) {
            v = e->tn;
        }
        sink(arg, ks_stats[i].name, v);
    }
}

const kv_stat_desc *kvd_kvevents_stat_descs(size_t *n) {
    *n = KS_COUNT;
    return ks_stats;
}
