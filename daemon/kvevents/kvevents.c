/* kvd_kvevents: vLLM-format KV events over ZMQ (kvevents.h has the contract). */
#include "daemon/kvevents/kvevents.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#include <msgpack.h>
#include <zmq.h>

#include "common/kv_log.h"

#if defined(__SANITIZE_THREAD__)
/* ThreadSanitizer (./dev tsan): libzmq is not built with it, and a message allocated on the
 * calling thread is freed by ZMQ's I/O thread after ZMQ's own lock-free queues, which TSan
 * cannot see (it reports malloc/free inside libzmq as a race). kvd's hand-off of batch buffers
 * to ZMQ is an atomic reference count (sbuf below), which TSan does check. */
const char *__tsan_default_suppressions(void);
const char *__tsan_default_suppressions(void) {
    return "called_from_lib:libzmq.so\nrace:libzmq.so\n";
}
#endif

#define MAX_PUBS (KVD_MAX_EVENT_LINES + 1)
#define NO_PUB 0xFFu
#define LOG_EVERY_MS 10000 /* malformed replay requests: one warning per publisher this often */

/* A batch's bytes, shared by the live send, the replay buffer and replays in flight (ZMQ frees
 * its references on its own I/O thread: the count is atomic). */
typedef struct sbuf {
    atomic_int refs;
    size_t len;
    uint8_t data[];
} sbuf;

static void sbuf_unref(sbuf *b) {
    if (atomic_fetch_sub(&b->refs, 1) == 1) {
        free(b);
    }
}

static void on_zmq_free(void *data, void *hint) {
    (void)data;
    sbuf_unref(hint);
}

/* Sends b as one frame without copying; 0 when ZMQ took it. */
static int send_sbuf(void *sock, sbuf *b, int flags) {
    zmq_msg_t m;
    atomic_fetch_add(&b->refs, 1);
    if (zmq_msg_init_data(&m, b->data, b->len, on_zmq_free, b) != 0) {
        sbuf_unref(b);
        return -1;
    }
    if (zmq_msg_send(&m, sock, flags | ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&m); /* gives the reference back */
        return -1;
    }
    return 0;
}

typedef struct kept {
    uint64_t seq;
    sbuf *buf;
} kept;

/* Replays are answered a bounded number of batches per loop wake-up (the rest at the next), at
 * most REPLAY_PENDING at a time per publisher; a replay sends at most REPLAY_HWM batches and
 * then its end marker (the peer asks again from the last seq it got), and a peer's queue holds
 * REPLAY_HWM + 8 messages, so that the marker finds room; a replay that finds the queue full
 * anyway (two replays to one peer) ends there, its marker sent if it fits. */
#define REPLAY_PENDING 16
#define REPLAY_BATCHES_PER_WAKE 256
#define REPLAY_HWM 1024

typedef struct rpend {
    uint8_t id[256]; /* the peer's ROUTER identity (at most 255 bytes) */
    size_t idlen;
    uint64_t next; /* the next seq to send */
    uint32_t sent; /* batches sent */
} rpend;

typedef struct pub {
    struct kvd_kvevents *e;
    uint32_t index;
    void *sock;   /* PUB */
    void *router; /* ROUTER for replays, or NULL */
    uv_poll_t poll;
    int polling;        /* poll initialised (closed at close) */
    char endpoint[256]; /* PUB endpoint */
    char replay[256];   /* ROUTER endpoint, "" none */
    char topic[128];
    int token_ids;
    int hash_bytes;
    int map;               /* events as maps (vLLM's newer schema) */
    uint64_t seq;          /* of the next batch */
    msgpack_sbuffer evbuf; /* events of the batch being built */
    msgpack_packer pk;
    uint32_t nev; /* events in evbuf */
    /* The last event of evbuf when it is a BlockRemoved left open (rm_open): its hashes are
     * packed, their count (array16 at rm_hdr) patched as hashes join, its medium not yet. */
    int rm_open;
    const char *rm_medium;
    size_t rm_hdr, rm_end;
    uint32_t rm_count;
    kept *ring;     /* [cap] */
    size_t cap;     /* batches kept at most */
    size_t head, n; /* oldest kept, count */
    size_t bytes;   /* payload bytes kept */
    uint64_t last_warn_ms;
    rpend pend[REPLAY_PENDING]; /* replays being answered, oldest first */
    uint32_t npend;
} pub;

/* One record of the advertised-hash table. ns PUB_NS(m): (publisher index + 1, key) = refs
 * holders (a pool's tier whose medium is m) hold the key, tail the digest's last 16 bytes
 * (hash-mode vllm); the first holder is kept inline (hpool, hpm; hpool 0: none now), so the
 * usual key held by one pool is one record. ns POOL_NS(pm): (pool id, key) = pool a's tier pm
 * is a further holder, counted in its publisher's record. Open addressing, linear probing,
 * deletion by backward shift; a = 0 marks a free slot. */
typedef struct adv {
    kv_hash128 key;
    uint32_t a;
    uint8_t ns;
    uint8_t has_tail;
    uint8_t hpm;
    uint32_t refs;
    uint32_t hpool;
    uint8_t tail[16];
} adv;

enum {
    KS_PUBLISHERS,
    KS_BATCHES,
    KS_EVENTS,
    KS_SEND_ERRORS,
    KS_GAPS,
    KS_REPLAYS,
    KS_REPLAY_BAD,
    KS_BLOCKS,
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
    [KS_SEND_ERRORS] = {"kv_events_send_errors", "counter", "batches",
                        "batches ZMQ refused to queue (a PUB drops silently for a subscriber past "
                        "its high-water mark: that subscriber sees the gap and replays)",
                        NULL, NULL, NULL, NULL},
    [KS_GAPS] = {"kv_events_gaps", "counter", "events",
                 "events not published (no memory; a parent whose vLLM digest is unknown went "
                 "out as nil)",
                 NULL, NULL, NULL, NULL},
    [KS_REPLAYS] = {"kv_events_replays", "counter", "requests", "replay requests answered", NULL,
                    NULL, NULL, NULL},
    [KS_REPLAY_BAD] = {"kv_events_replay_bad", "counter", "requests",
                       "malformed replay requests (ignored)", NULL, NULL, NULL, NULL},
    [KS_BLOCKS] = {"kv_events_blocks", "gauge", "blocks",
                   "block hashes advertised now (stored and not removed), over all publishers",
                   NULL, NULL, NULL, NULL},
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
    int vllm;         /* hash-mode vllm: blocks are named by digests */
    uv_check_t check; /* the iteration's end: its records are run (on the loop thread, or
                         flush-ms 0) and, for flush-ms 0, sent */
    /* flush-ms > 0: the window's end (its batch is sent). A timerfd under a uv_poll, armed once a
     * window: a libuv timer would give every epoll_wait of the window a timeout, and a wait with
     * a timeout programs (and cancels) a kernel hrtimer on each call, which in a VM is a VM exit
     * or two per request (measured: the Commit path's loop CPU 1.33x events off with the libuv
     * timer, 1.1x with none). The libuv timer is kept only where timerfd_create failed. */
    int tfd;          /* the timerfd, or -1 */
    uv_poll_t tpoll;  /* its poll, started while the handles are */
    uv_timer_t timer; /* the fallback */
    uv_timer_t again; /* replays left for the next wake-up */
    uint64_t flush_ms;
    int handles, armed, started, closed;
    int check_on; /* check handle started */
    char *in;     /* the intake (records, in order; loop thread) */
    size_t in_len, in_cap;
    int unflushed;         /* records were run for a reader since the last flush point */
    uint64_t lc[KS_COUNT]; /* the loop thread's counters (gaps of the intake, replays) */
    /* The events thread (the thread's own below; the hand-off under mu). */
    pthread_t thread;
    int want_thread; /* kv-events-thread (auto resolved): run on a thread of their own */
    int thread_on;
    pthread_mutex_t mu;
    pthread_cond_t work_cv; /* records handed, or stop */
    pthread_cond_t done_cv; /* records drained */
    char *q;                /* (mu) records handed over, not yet taken */
    size_t q_len, q_cap;
    uint64_t handed, done;       /* (mu) hand-offs made, and drained */
    int stop;                    /* (mu) kvd_kvevents_close: drain, flush and end */
    uint64_t snap[KS_COUNT + 1]; /* (mu) the thread's counters and nblocks after its last drain */
    pthread_mutex_t ring_mu;     /* every pub's replay ring: kept by the thread, replayed by the
                                    loop */
    char *work;                  /* the thread's: the records it drains */
    size_t work_cap;
    kvd_kvevent_block *blk; /* drain scratch: one Stored record's blocks */
    size_t blk_cap;
    adv *tab;
    size_t tcap, tn;      /* slots (a power of two), used */
    uint64_t nblocks;     /* ns-2 records: hashes advertised */
    uint64_t c[KS_COUNT]; /* the events thread's counters */
};

/* ---- the advertised-hash table --------------------------------------------------------- */

/* Media: 0 T0 (GPU or CPU, the pool's memory), 1 tier 1 (CPU), 2 tier 2 (DISK). A pool's
 * record of a medium has namespace POOL_NS(m), a publisher's PUB_NS(m). */
#define NMEDIA 3
#define POOL_NS(m) ((uint8_t)(1 + 2 * (m)))
#define PUB_NS(m) ((uint8_t)(2 + 2 * (m)))

static size_t adv_slot(const kvd_kvevents *e, uint8_t ns, uint32_t a, kv_hash128 k) {
    uint64_t h =
        (k.lo ^ (k.hi * 0x9E3779B97F4A7C15ull)) + ((uint64_t)ns << 32 | a) * 0xC2B2AE3D27D4EB4Full;
    return (size_t)(h ^ (h >> 29)) & (e->tcap - 1);
}

static adv *adv_find(kvd_kvevents *e, uint8_t ns, uint32_t a, kv_hash128 k) {
    if (e->tcap == 0) {
        return NULL;
    }
    for (size_t i = adv_slot(e, ns, a, k);; i = (i + 1) & (e->tcap - 1)) {
        adv *t = &e->tab[i];
        if (t->a == 0) {
            return NULL;
        }
        if (t->a == a && t->ns == ns && kv_hash_eq(t->key, k)) {
            return t;
        }
    }
}

static int adv_grow(kvd_kvevents *e) {
    size_t ncap = e->tcap == 0 ? 1024 : e->tcap * 2;
    adv *nt = calloc(ncap, sizeof(*nt));
    if (nt == NULL) {
        return -1;
    }
    adv *old = e->tab;
    size_t ocap = e->tcap;
    e->tab = nt;
    e->tcap = ncap;
    for (size_t i = 0; i < ocap; i++) {
        if (old[i].a != 0) {
            size_t j = adv_slot(e, old[i].ns, old[i].a, old[i].key);
            while (nt[j].a != 0) {
                j = (j + 1) & (ncap - 1);
            }
            nt[j] = old[i];
        }
    }
    free(old);
    return 0;
}

/* The record of (ns, a, k), made (zeroed) when absent; NULL for want of memory. Pointers into
 * the table are valid until the next adv_get or adv_del. */
static adv *adv_get(kvd_kvevents *e, uint8_t ns, uint32_t a, kv_hash128 k) {
    /* Load at most 1/3 (48-byte records: 144-288 bytes per record held). At 1/2 the backward
     * shift of adv_del walked ~4 slots a removal (measured: 105 instructions a removal, 61 at
     * 1/3; events' share of a Commit chain's daemon instructions 20.5k instead of 22.5k). */
    if ((e->tn + 1) * 3 > e->tcap && adv_grow(e) != 0) {
        return adv_find(e, ns, a, k); /* no room for more: only one that is there */
    }
    /* One probe: the record, or the free slot that ends its run (where it goes). */
    size_t i = adv_slot(e, ns, a, k);
    for (; e->tab[i].a != 0; i = (i + 1) & (e->tcap - 1)) {
        adv *t = &e->tab[i];
        if (t->a == a && t->ns == ns && kv_hash_eq(t->key, k)) {
            return t;
        }
    }
    adv *t = &e->tab[i];
    memset(t, 0, sizeof(*t));
    t->a = a;
    t->ns = ns;
    t->key = k;
    e->tn++;
    return t;
}

static void adv_del(kvd_kvevents *e, adv *t) {
    size_t i = (size_t)(t - e->tab);
    e->tab[i].a = 0;
    e->tn--;
    /* Backward shift: move up every later entry of the run whose home is not between. */
    for (size_t j = (i + 1) & (e->tcap - 1); e->tab[j].a != 0; j = (j + 1) & (e->tcap - 1)) {
        size_t home = adv_slot(e, e->tab[j].ns, e->tab[j].a, e->tab[j].key);
        int between = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (!between) {
            e->tab[i] = e->tab[j];
            e->tab[j].a = 0;
            i = j;
        }
    }
}

/* ---- encoding ---------------------------------------------------------------------------- */

static void put_u64le(uint8_t *p, uint64_t v) {
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(p, &v, 8); /* one store (the loop below was not made one) */
#else
    for (int i = 0; i < 8; i++) {
        p[i] = (uint8_t)(v >> (8 * i));
    }
#endif
}

static void pack_str(msgpack_packer *pk, const char *s) {
    size_t n = strlen(s);
    if (n < 32) { /* fixstr, as msgpack_pack_str writes it, in one append */
        char buf[33];
        buf[0] = (char)(0xa0 | n);
        memcpy(buf + 1, s, n);
        (void)pk->callback(pk->data, buf, n + 1);
        return;
    }
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

/* Room for n more bytes at the end of a growing buffer (*data, *cap bytes, len used; doubling
 * from init): where they go, or NULL for want of memory (the buffer unchanged). */
static void *room_in(char **data, size_t *cap, size_t len, size_t n, size_t init) {
    if (*cap - len < n) {
        size_t nc = *cap != 0 ? *cap : init;
        while (nc - len < n) {
            nc *= 2;
        }
        char *d = realloc(*data, nc);
        if (d == NULL) {
            return NULL;
        }
        *data = d;
        *cap = nc;
    }
    return *data + len;
}

/* Room for n more bytes at the end of the batch being built: where they go (the caller writes
 * them and adds what it wrote to evbuf.size), or NULL for want of memory (as msgpack's
 * sbuffer_write, which grows it the same way, then writes nothing). Packing a block name
 * through msgpack's callback cost ~80 instructions a hash; writing it in place ~15. */
static uint8_t *evbuf_room(pub *b, size_t n) {
    msgpack_sbuffer *sb = &b->evbuf;
    return room_in(&sb->data, &sb->alloc, sb->size, n, MSGPACK_SBUFFER_INIT_SIZE);
}

#define HASH_MAX 34 /* bytes of one packed block name, at most (bin 8 of a 32-byte digest) */

/* Writes one block's name at p (HASH_MAX bytes of room), as msgpack: the digest bytes (full:
 * 32, else the 16 of the key; bin 8) or vLLM's int form, the digest's last 8 bytes as a
 * big-endian unsigned integer in msgpack's shortest form (as msgpack_pack_uint64 writes it).
 * Returns the bytes written. */
static size_t put_hash(const pub *b, uint8_t *p, kv_hash128 key, const uint8_t *full) {
    if (b->hash_bytes) {
        size_t n = full != NULL ? 32 : 16;
        p[0] = 0xc4;
        p[1] = (uint8_t)n;
        if (full != NULL) {
            memcpy(p + 2, full, 32);
        } else {
            put_u64le(p + 2, key.lo);
            put_u64le(p + 10, key.hi);
        }
        return n + 2;
    }
    /* The name's 8 bytes in order: the digest's bytes 24..31, or the key's hi half (its
     * little-endian bytes are the digest's bytes 8..15 of kvd's key). */
    uint8_t be[8];
    if (full != NULL) {
        memcpy(be, full + 24, 8);
    } else {
        put_u64le(be, key.hi);
    }
    uint64_t v;
    memcpy(&v, be, 8);
    v = __builtin_bswap64(v);
    if (v >> 32 != 0) {
        p[0] = 0xcf;
        memcpy(p + 1, be, 8);
        return 9;
    }
    if (v < 128) {
        p[0] = (uint8_t)v;
        return 1;
    }
    if (v < 256) {
        p[0] = 0xcc;
        p[1] = (uint8_t)v;
        return 2;
    }
    if (v < 65536) {
        p[0] = 0xcd;
        p[1] = (uint8_t)(v >> 8);
        p[2] = (uint8_t)v;
        return 3;
    }
    p[0] = 0xce;
    memcpy(p + 1, be + 4, 4);
    return 5;
}

/* Packs one block's name (put_hash) at the end of the batch. */
static void pack_hash(pub *b, kv_hash128 key, const uint8_t *full) {
    uint8_t *p = evbuf_room(b, HASH_MAX);
    if (p != NULL) {
        b->evbuf.size += put_hash(b, p, key, full);
    }
}

/* Packs the names of blk[0..n) (one room for all). */
static void pack_hashes(pub *b, const kvd_kvevent_block *blk, size_t n) {
    uint8_t *p = evbuf_room(b, n * HASH_MAX);
    if (p == NULL) {
        return;
    }
    size_t len = 0;
    for (size_t i = 0; i < n; i++) {
        len += put_hash(b, p + len, blk[i].key, blk[i].full);
    }
    b->evbuf.size += len;
}

static void close_removed(pub *b);

/* An event's head: the tag (array form) or the map with "type" first. */
static void pack_head(pub *b, const char *tag, uint32_t nfields) {
    close_removed(b); /* an open BlockRemoved before it gets its medium */
    if (b->map) {
        msgpack_pack_map(&b->pk, nfields + 1);
        pack_str(&b->pk, "type");
    } else {
        msgpack_pack_array(&b->pk, nfields + 1);
    }
    pack_str(&b->pk, tag);
}

static void pack_field(pub *b, const char *name) {
    if (b->map) {
        pack_str(&b->pk, name);
    }
}

/* ---- publishing -------------------------------------------------------------------------- */

static void keep(pub *b, uint64_t seq, sbuf *buf) {
    while (b->n > 0 && (b->n == b->cap || b->bytes + buf->len > KVD_KVEVENTS_RING_BYTES)) {
        kept *old = &b->ring[b->head];
        b->bytes -= old->buf->len;
        sbuf_unref(old->buf);
        old->buf = NULL;
        b->head = (b->head + 1) % b->cap;
        b->n--;
    }
    atomic_fetch_add(&buf->refs, 1);
    kept *k = &b->ring[(b->head + b->n) % b->cap];
    k->seq = seq;
    k->buf = buf;
    b->n++;
    b->bytes += buf->len;
}

static void seq_bytes(uint64_t seq, uint8_t out[8]) {
    for (int i = 0; i < 8; i++) {
        out[i] = (uint8_t)(seq >> (56 - 8 * i));
    }
}

static void flush_pub(kvd_kvevents *e, pub *b) {
    if (b->nev == 0 || b->sock == NULL) {
        return;
    }
    close_removed(b);
    /* The batch head is at most 1 + 9 + 5 bytes: packed into a small buffer first. */
    uint8_t head[32];
    size_t hn = 0;
    head[hn++] = 0x93; /* array of 3 */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    double t = (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
    uint64_t tb;
    memcpy(&tb, &t, sizeof(tb));
    head[hn++] = 0xcb; /* float 64, big-endian */
    for (int i = 7; i >= 0; i--) {
        head[hn++] = (uint8_t)(tb >> (8 * i));
    }
    if (b->nev < 16) {
        head[hn++] = (uint8_t)(0x90 | b->nev);
    } else if (b->nev < 65536) {
        head[hn++] = 0xdc;
        head[hn++] = (uint8_t)(b->nev >> 8);
        head[hn++] = (uint8_t)b->nev;
    } else {
        head[hn++] = 0xdd;
        for (int i = 3; i >= 0; i--) {
            head[hn++] = (uint8_t)(b->nev >> (8 * i));
        }
    }
    size_t len = hn + b->evbuf.size + 1;
    sbuf *buf = malloc(sizeof(*buf) + len);
    uint64_t seq = b->seq++;
    if (buf == NULL) {
        e->c[KS_GAPS] += b->nev; /* the sequence has a hole: subscribers replay and miss it */
    } else {
        atomic_init(&buf->refs, 1);
        buf->len = len;
        memcpy(buf->data, head, hn);
        memcpy(buf->data + hn, b->evbuf.data, b->evbuf.size);
        buf->data[len - 1] = 0x00; /* data_parallel_rank 0 */
        uint8_t sb[8];
        seq_bytes(seq, sb);
        int ok = zmq_send(b->sock, b->topic, strlen(b->topic), ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0 &&
                 zmq_send(b->sock, sb, 8, ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0 &&
                 send_sbuf(b->sock, buf, 0) == 0;
        if (!ok) {
            e->c[KS_SEND_ERRORS]++;
        }
        pthread_mutex_lock(&e->ring_mu);
        keep(b, seq, buf);
        pthread_mutex_unlock(&e->ring_mu);
        sbuf_unref(buf);
        e->c[KS_BATCHES]++;
        e->c[KS_EVENTS] += b->nev;
    }
    msgpack_sbuffer_clear(&b->evbuf);
    b->nev = 0;
}

static void flush_all(kvd_kvevents *e) {
    for (uint32_t i = 0; i < e->npubs; i++) {
        flush_pub(e, &e->pubs[i]);
    }
}

static void handoff(kvd_kvevents *e, int flush);
static void sync_thread(kvd_kvevents *e);

/* After every I/O callback of the loop iteration (so after the replies it wrote): flush-ms 0,
 * the iteration's records are run and sent as one batch (handoff); flush-ms > 0 with the events
 * on the loop thread, they are run now, in the loop's gaps between requests, and their batch
 * goes when the window ends (on_tfd). Run in one go at the window's end, a window's records
 * (~200 blocks on a busy Commit path) held up the requests that came meanwhile (measured: the
 * sync Commit path's rate 0.93x events off that way, 0.98-1.0x this way; the CPU the same). */
static void on_check(uv_check_t *h) {
    kvd_kvevents *e = h->data;
    handoff(e, e->flush_ms == 0);
    uv_check_stop(&e->check);
    e->check_on = 0;
}

static void want_check(kvd_kvevents *e) {
    if (!e->check_on && e->handles && !e->closed) {
        uv_check_start(&e->check, on_check);
        e->check_on = 1;
    }
}

static void on_timer(uv_timer_t *h) {
    kvd_kvevents *e = h->data;
    e->armed = 0;
    handoff(e, 1);
}

static void on_tfd(uv_poll_t *h, int status, int events) {
    (void)status;
    (void)events;
    kvd_kvevents *e = h->data;
    uint64_t expirations;
    if (read(e->tfd, &expirations, sizeof(expirations)) != (ssize_t)sizeof(expirations)) {
        return; /* EAGAIN: woken with no expiry to read */
    }
    e->armed = 0;
    handoff(e, 1);
}

/* flush-ms > 0: the window ends flush-ms after its first record: its batch is sent (its records
 * handed to the events thread then: one hand-off, one thread wake-up and one batch a window,
 * however many Commits the loop served meanwhile). */
static void arm(kvd_kvevents *e) {
    if (e->armed || !e->handles || e->closed || e->flush_ms == 0) {
        return;
    }
    if (e->tfd >= 0) {
        struct itimerspec its = {
            {0, 0}, {(time_t)(e->flush_ms / 1000), (long)(e->flush_ms % 1000) * 1000000L}};
        if (timerfd_settime(e->tfd, 0, &its, NULL) != 0) {
            return; /* (EINVAL is all it can say to these values) */
        }
    } else {
        uv_timer_start(&e->timer, on_timer, e->flush_ms, 0);
    }
    e->armed = 1;
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
    return e != NULL && e->started && !e->closed && pub_of(e, p->domain) != NULL;
}

void kvd_kvevents_gap(kvd_kvevents *e) {
    if (e != NULL) {
        e->lc[KS_GAPS]++;
    }
}

/* The digest of key as publisher b recorded it, into buf; NULL when it holds none. */
static const uint8_t *recorded_full(kvd_kvevents *e, pub *b, kv_hash128 key, uint8_t buf[32]) {
    adv *t = NULL;
    for (uint8_t m = 0; m < NMEDIA && (t == NULL || !t->has_tail); m++) {
        t = adv_find(e, PUB_NS(m), b->index + 1, key);
    }
    if (t == NULL || !t->has_tail) {
        return NULL;
    }
    put_u64le(buf, key.lo);
    put_u64le(buf + 8, key.hi);
    memcpy(buf + 16, t->tail, 16);
    return buf;
}

/* Token ids as msgpack_pack_uint32 writes each (the shortest of positive fixint, uint 8, 16, 32),
 * a block's worth per append instead of one library call and buffer append per token: the
 * Commit path's events cost is mostly per token when token ids are on. */
typedef struct tok_form {
    uint8_t down;   /* the id's big-endian bytes shifted down to its width */
    uint8_t up;     /* moved up past the marker byte */
    uint8_t marker; /* or'ed into the first byte */
    uint8_t bytes;  /* bytes written */
} tok_form;

/* The form of an id by its count of leading zero bits (of id | 1): positive fixint (7 bits or
 * fewer), uint 8, uint 16, uint 32. */
#define TF_FIX                                                                                     \
    { 24, 0, 0x00, 1 }
#define TF_U8                                                                                      \
    { 24, 8, 0xcc, 2 }
#define TF_U16                                                                                     \
    { 16, 8, 0xcd, 3 }
#define TF_U32                                                                                     \
    { 0, 8, 0xce, 5 }
static const tok_form tok_forms[32] = {
    TF_U32, TF_U32, TF_U32, TF_U32, TF_U32, TF_U32, TF_U32, TF_U32, TF_U32, TF_U32, TF_U32,
    TF_U32, TF_U32, TF_U32, TF_U32, TF_U32, TF_U16, TF_U16, TF_U16, TF_U16, TF_U16, TF_U16,
    TF_U16, TF_U16, TF_U8,  TF_FIX, TF_FIX, TF_FIX, TF_FIX, TF_FIX, TF_FIX, TF_FIX,
};

static void pack_tokens(msgpack_packer *pk, const uint32_t *tok, uint32_t n) {
    uint8_t buf[5 * 64 + 8]; /* 8 bytes of slack: every token is stored as 8 */
    for (uint32_t t = 0; t < n;) {
        uint32_t end = n - t > 64 ? t + 64 : n;
        size_t len = 0;
        for (; t < end; t++) {
            /* No branch per token (random ids make one a guess): the form comes from a table
             * indexed by the id's leading zeros, and is stored as one little-endian word. */
            uint32_t v = tok[t];
            const tok_form *f = &tok_forms[__builtin_clz(v | 1)];
            uint64_t w = ((uint64_t)__builtin_bswap32(v) >> f->down) << f->up | f->marker;
            memcpy(buf + len, &w, 8);
            len += f->bytes;
        }
        (void)pk->callback(pk->data, (const char *)buf, len);
    }
}

/* One BlockStored of blk[0..n), all new to the publisher. */
static void pack_stored(kvd_kvevents *e, pub *b, uint32_t tpb, const char *medium,
                        const kvd_kvevent_block *blk, size_t n, const kv_hash128 *parent,
                        const uint8_t *parent_full) {
    msgpack_packer *pk = &b->pk;
    pack_head(b, "BlockStored", 7);
    pack_field(b, "block_hashes");
    msgpack_pack_array(pk, n);
    pack_hashes(b, blk, n);
    pack_field(b, "parent_block_hash");
    uint8_t pbuf[32];
    const uint8_t *pf = parent_full;
    if (parent != NULL && pf == NULL && e->vllm) {
        pf = recorded_full(e, b, *parent, pbuf);
    }
    if (parent == NULL || (e->vllm && pf == NULL)) {
        if (parent != NULL) {
            e->c[KS_GAPS]++; /* a vLLM name cannot be made from a key */
        }
        msgpack_pack_nil(pk);
    } else {
        pack_hash(b, *parent, pf);
    }
    int with_tokens = b->token_ids;
    for (size_t i = 0; i < n && with_tokens; i++) {
        with_tokens = blk[i].tokens != NULL;
    }
    pack_field(b, "token_ids");
    msgpack_pack_array(pk, with_tokens ? n * tpb : 0);
    for (size_t i = 0; i < n && with_tokens; i++) {
        pack_tokens(pk, blk[i].tokens, tpb);
    }
    pack_field(b, "block_size");
    msgpack_pack_uint32(pk, tpb);
    pack_field(b, "lora_id");
    msgpack_pack_nil(pk);
    pack_field(b, "medium");
    pack_str(pk, medium);
    pack_field(b, "lora_name");
    msgpack_pack_nil(pk);
    b->nev++;
}

/* Pool pool_id holds key in its tier pm now, which the publisher advertises as medium m (tier 1
 * of a host pool is the same medium as its T0: CPU memory): 1 when the publisher did not hold it
 * there (it is to be advertised), 0 when it did or the pool's tier was counted already, -1 for
 * want of memory. */
static int adv_hold(kvd_kvevents *e, pub *b, uint32_t pool_id, kv_hash128 key, uint8_t pm,
                    uint8_t m, const uint8_t *full) {
    adv *pb = adv_get(e, PUB_NS(m), b->index + 1, key);
    if (pb == NULL) {
        return -1;
    }
    if (full != NULL && !pb->has_tail) {
        memcpy(pb->tail, full + 16, 16);
        pb->has_tail = 1;
    }
    if (pb->refs == 0) { /* new to the publisher on this medium */
        pb->refs = 1;
        pb->hpool = pool_id;
        pb->hpm = pm;
        e->nblocks++;
        return 1;
    }
    if ((pb->hpool == pool_id && pb->hpm == pm) || adv_find(e, POOL_NS(pm), pool_id, key) != NULL) {
        return 0; /* this pool's tier is counted already */
    }
    if (pb->hpool == 0) {
        pb->hpool = pool_id;
        pb->hpm = pm;
        pb->refs++;
        return 0;
    }
    if (adv_get(e, POOL_NS(pm), pool_id, key) == NULL) {
        return -1;
    }
    adv_find(e, PUB_NS(m), b->index + 1, key)->refs++; /* (adv_get may have moved it) */
    return 0;
}

/* Pool pool_id no longer holds key in its tier pm (medium m): 1 when the publisher's last holder
 * went (to be removed; *full then names the digest when known, in buf), else 0. */
static int adv_let_go(kvd_kvevents *e, pub *b, uint32_t pool_id, kv_hash128 key, uint8_t pm,
                      uint8_t m, uint8_t buf[32], const uint8_t **full) {
    *full = NULL;
    adv *pb = adv_find(e, PUB_NS(m), b->index + 1, key);
    if (pb == NULL) {
        return 0; /* never counted */
    }
    if (pb->hpool == pool_id && pb->hpm == pm) {
        pb->hpool = 0;
    } else {
        adv *pa = adv_find(e, POOL_NS(pm), pool_id, key);
        if (pa == NULL) {
            return 0; /* never counted */
        }
        adv_del(e, pa);
        pb = adv_find(e, PUB_NS(m), b->index + 1, key); /* (the deletion may have moved it) */
    }
    if (--pb->refs > 0) {
        return 0;
    }
    if (pb->has_tail) {
        put_u64le(buf, key.lo);
        put_u64le(buf + 8, key.hi);
        memcpy(buf + 16, pb->tail, 16);
        *full = buf;
    }
    adv_del(e, pb);
    e->nblocks--;
    if (*full == NULL && e->vllm) {
        *full = recorded_full(e, b, key, buf); /* another medium's record of the digest */
    }
    return 1;
}

/* Gives the open BlockRemoved (if any) its medium: it is whole. */
static void close_removed(pub *b) {
    if (!b->rm_open) {
        return;
    }
    b->rm_open = 0;
    pack_field(b, "medium");
    pack_str(&b->pk, b->rm_medium);
}

/* BlockRemoved of one block. Removals in a row on one medium (an Allocate's evictions) share one
 * event, as vLLM's BlockRemoved lists its blocks: the hash joins the open event (its list's
 * count is patched in place) when nothing was packed since. */
static void pack_removed(pub *b, kv_hash128 key, const uint8_t *full, const char *medium) {
    if (b->rm_open && b->evbuf.size == b->rm_end && b->rm_count < 0xffff &&
        (b->rm_medium == medium || strcmp(b->rm_medium, medium) == 0)) {
        pack_hash(b, key, full);
        b->rm_count++;
        b->evbuf.data[b->rm_hdr + 1] = (char)(b->rm_count >> 8);
        b->evbuf.data[b->rm_hdr + 2] = (char)(b->rm_count & 0xff);
        b->rm_end = b->evbuf.size;
        return;
    }
    pack_head(b, "BlockRemoved", 2);
    pack_field(b, "block_hashes");
    b->rm_hdr = b->evbuf.size;
    const char a16[3] = {(char)0xdc, 0, 1}; /* array 16: its count grows in place */
    (void)b->pk.callback(b->pk.data, a16, sizeof(a16));
    pack_hash(b, key, full);
    b->rm_open = 1;
    b->rm_medium = medium;
    b->rm_count = 1;
    b->rm_end = b->evbuf.size;
    b->nev++;
}

/* The digest of key: the publisher's record of it, else key || tail (a remote value's). */
static const uint8_t *full_of(kvd_kvevents *e, pub *b, kv_hash128 key, const uint8_t *tail,
                              uint8_t buf[32]) {
    const uint8_t *f = recorded_full(e, b, key, buf);
    if (f == NULL && tail != NULL) {
        put_u64le(buf, key.lo);
        put_u64le(buf + 8, key.hi);
        memcpy(buf + 16, tail, 16);
        f = buf;
    }
    return f;
}

int kvd_kvevents_digest_tail(void *arg, uint32_t domain, kv_hash128 hash, uint8_t tail[16]) {
    kvd_kvevents *e = arg;
    pub *b = e != NULL && e->vllm ? pub_of(e, domain) : NULL;
    if (b == NULL) {
        return 0; /* no digests recorded for this domain: nothing to run first */
    }
    sync_thread(e); /* the records so far first: the digest may be in one */
    uint8_t buf[32];
    if (recorded_full(e, b, hash, buf) == NULL) {
        return 0;
    }
    memcpy(tail, buf + 16, 16);
    return 1;
}

static void do_tier_change(kvd_kvevents *e, uint32_t pool_id, uint32_t domain, uint32_t block_size,
                           kv_hash128 hash, const kv_hash128 *parent, const uint8_t *tail, int tier,
                           int present) {
    pub *b = pub_of(e, domain);
    if (b == NULL) {
        return;
    }
    uint8_t buf[32];
    if (tier == KVD_KVEV_REMOTE) {
        /* Not counted: Redis forgets keys on its own (TTL, maxmemory) and says nothing, so a
         * count would only grow. Each write that landed is a BlockStored, each DEL a
         * BlockRemoved; a router keeps what it heard of REMOTE idempotently. */
        const uint8_t *full = e->vllm ? full_of(e, b, hash, tail, buf) : NULL;
        if (e->vllm && full == NULL) {
            e->c[KS_GAPS]++;
            return;
        }
        if (present) {
            kvd_kvevent_block one = {hash, full, NULL};
            pack_stored(e, b, block_size, "REMOTE", &one, 1, NULL, NULL);
        } else {
            pack_removed(b, hash, full, "REMOTE");
        }
        return;
    }
    /* A host pool's T0 and tier 1 are both CPU memory: one medium, counted once. */
    uint8_t pm = (uint8_t)tier;
    uint8_t m = tier == 1 && strcmp(e->medium, "CPU") == 0 ? 0 : pm;
    const char *medium = m == 0 ? e->medium : tier == 1 ? "CPU" : "DISK";
    if (!present) {
        const uint8_t *full;
        if (adv_let_go(e, b, pool_id, hash, pm, m, buf, &full) == 1) {
            if (e->vllm && full == NULL) {
                e->c[KS_GAPS]++; /* no vLLM name for it */
                return;
            }
            pack_removed(b, hash, full, medium);
        }
        return;
    }
    /* In hash-mode vllm a block is named by its digest: known while any medium of the
     * publisher records it (its T0 copy, usually), else the event cannot be made. */
    const uint8_t *full = e->vllm ? full_of(e, b, hash, tail, buf) : NULL;
    if (e->vllm && full == NULL) {
        e->c[KS_GAPS]++;
        return;
    }
    int rc = adv_hold(e, b, pool_id, hash, pm, m, full);
    if (rc < 0) {
        e->c[KS_GAPS]++;
    } else if (rc == 1) {
        /* On T0's medium (a Fetch's block, or a host pool's tier 1) with its parent where
         * known, as a Commit's; a copy on another medium as vLLM's offloading connector
         * reports its copies: no parent, no tokens. */
        kvd_kvevent_block one = {hash, full, NULL};
        pack_stored(e, b, block_size, medium, &one, 1, m == 0 ? parent : NULL, NULL);
    }
}

static void do_stored(kvd_kvevents *e, uint32_t pool_id, uint32_t domain, uint32_t tpb,
                      const kvd_kvevent_block *blk, size_t n, const kv_hash128 *parent,
                      const uint8_t *parent_full) {
    pub *b = pub_of(e, domain);
    if (b == NULL) {
        return;
    }
    /* The pool holds each block now; the publisher advertises those it did not hold: one
     * BlockStored per run of them, a block advertised already splits the chain (it is the
     * next run's parent). */
    size_t start = 0;
    int in_run = 0;
    for (size_t i = 0; i <= n; i++) {
        int fresh = 0;
        if (i < n) {
            int rc = adv_hold(e, b, pool_id, blk[i].key, 0, 0, blk[i].full);
            fresh = rc == 1;
            e->c[KS_GAPS] += rc < 0;
        }
        if (fresh && !in_run) {
            start = i;
            in_run = 1;
        } else if (!fresh && in_run) {
            pack_stored(e, b, tpb, e->medium, blk + start, i - start,
                        start == 0 ? parent : &blk[start - 1].key,
                        start == 0 ? parent_full : blk[start - 1].full);
            in_run = 0;
        }
    }
}

/* A block of pool pool_id left T0. */
static void do_drop(kvd_kvevents *e, uint32_t pool_id, uint32_t domain, kv_hash128 hash) {
    pub *b = pub_of(e, domain);
    uint8_t fbuf[32];
    const uint8_t *full;
    if (b != NULL && adv_let_go(e, b, pool_id, hash, 0, 0, fbuf, &full) == 1) {
        pack_removed(b, hash, full, e->medium);
    }
}

/* ---- the intake ------------------------------------------------------------------------------
 * The request paths only record what happened, copied (the caller's arrays are gone when it
 * returns): a Commit's blocks (key, digest, token ids when the publisher sends them), a T0 drop,
 * a tier change. When the flush window ends (the timer; flush-ms 0: the check handle, after
 * every I/O callback of the loop iteration, so after the replies it wrote) the records are run
 * in the order they came (handoff: on the events thread, or here): a Commit's or an Allocate's
 * reply does not wait for its events. A synchronous reader of the state (digest_tail, stats,
 * close) has the records so far run first. Records are 8-byte multiples in a malloc'd buffer (so
 * every struct below is aligned). */
enum { IN_STORED = 1, IN_DROP, IN_TIER, IN_FLUSH };

/* A flush point: the flush window (or, flush-ms 0, the loop iteration) ended here, so the batch
 * being built goes out (the handoff that ends a window or an iteration appends it). */
typedef struct in_flush {
    uint32_t kind, size;
} in_flush;

typedef struct in_stored {
    uint32_t kind, size; /* size: bytes of the record, blocks and token ids included */
    uint32_t pool_id, domain, tpb, n;
    uint32_t has_parent, has_parent_full;
    kv_hash128 parent;
    uint8_t parent_full[32];
} in_stored; /* then n in_block, each followed by its token ids (padded to 8) when it has them */

typedef struct in_block {
    kv_hash128 key;
    uint32_t has_full, has_tokens;
    uint8_t full[32];
} in_block;

typedef struct in_drop {
    uint32_t kind, size;
    uint32_t pool_id, domain;
    kv_hash128 hash;
} in_drop;

typedef struct in_tier {
    uint32_t kind, size;
    uint32_t pool_id, domain, block_size;
    int32_t tier, present;
    uint32_t has_parent, has_tail, pad;
    kv_hash128 hash, parent;
    uint8_t tail[16];
} in_tier;

#define IN_ALIGN(n) (((n) + 7u) & ~(size_t)7u)
#define INTAKE_KEEP (1u << 20) /* intake bytes kept between iterations, at most */
_Static_assert(sizeof(in_stored) % 8 == 0 && sizeof(in_block) % 8 == 0 &&
                   sizeof(in_drop) % 8 == 0 && sizeof(in_tier) % 8 == 0 &&
                   sizeof(in_flush) % 8 == 0,
               "intake records keep the next one 8-byte aligned");

/* Room for n more bytes of records (n a multiple of 8), or NULL for want of memory. */
static uint8_t *in_room(kvd_kvevents *e, size_t n) {
    uint8_t *r = room_in(&e->in, &e->in_cap, e->in_len, n, 16384);
    if (r == NULL) {
        return NULL;
    }
    if (e->flush_ms > 0) {
        arm(e); /* the window starts at the first event; its batch goes when it ends */
    }
    if (e->flush_ms == 0 || !e->thread_on) {
        want_check(e); /* the iteration's records run at its end (flush-ms 0: and go) */
    }
    return r;
}

static int takes(const kvd_kvevents *e, uint32_t domain) {
    return e != NULL && e->started && !e->closed && pub_of(e, domain) != NULL;
}

/* Runs the records of buf[0..len), in order (the events thread). */
static void drain(kvd_kvevents *e, const char *buf, size_t len) {
    size_t off = 0;
    while (off < len) {
        const uint8_t *r = (const uint8_t *)buf + off;
        uint32_t kind, size;
        memcpy(&kind, r, 4);
        memcpy(&size, r + 4, 4);
        if (kind == IN_FLUSH) {
            flush_all(e);
        } else if (kind == IN_DROP) {
            const in_drop *d = (const in_drop *)r;
            do_drop(e, d->pool_id, d->domain, d->hash);
        } else if (kind == IN_TIER) {
            const in_tier *t = (const in_tier *)r;
            do_tier_change(e, t->pool_id, t->domain, t->block_size, t->hash,
                           t->has_parent ? &t->parent : NULL, t->has_tail ? t->tail : NULL, t->tier,
                           t->present);
        } else {
            const in_stored *h = (const in_stored *)r;
            if (h->n > e->blk_cap) {
                kvd_kvevent_block *nb = realloc(e->blk, h->n * sizeof(*nb));
                if (nb == NULL) {
                    e->c[KS_GAPS] += h->n;
                    off += size;
                    continue;
                }
                e->blk = nb;
                e->blk_cap = h->n;
            }
            const uint8_t *q = r + sizeof(*h);
            for (uint32_t i = 0; i < h->n; i++) {
                const in_block *ib = (const in_block *)q;
                q += sizeof(*ib);
                e->blk[i].key = ib->key;
                e->blk[i].full = ib->has_full ? ib->full : NULL;
                e->blk[i].tokens = ib->has_tokens ? (const uint32_t *)q : NULL;
                q += ib->has_tokens ? IN_ALIGN((size_t)h->tpb * sizeof(uint32_t)) : 0;
            }
            do_stored(e, h->pool_id, h->domain, h->tpb, e->blk, h->n,
                      h->has_parent ? &h->parent : NULL,
                      h->has_parent_full ? h->parent_full : NULL);
        }
        off += size;
    }
}

/* ---- the events thread -----------------------------------------------------------------------
 * The loop thread records (above) and, when the flush window or (flush-ms 0) the loop iteration
 * ends, hands the records to this thread with an IN_FLUSH record after them (handoff: a pointer
 * swap under mu, or an append when the thread has not taken the previous ones yet); the thread
 * runs them in order (the advertised-hash table, the msgpack encoding: drain) and sends a batch
 * at each IN_FLUSH. So the bookkeeping and encoding no longer run on the loop thread. A reader of
 * the thread's state on the loop thread (digest_tail, stats) hands its records over and waits
 * until they are run (sync_thread): the thread then touches only the batches and the sockets
 * until the loop hands it more, which that reader is not doing. The PUB sockets are the
 * thread's once it runs (bound before it starts, closed after it ends); the replay ROUTER stays
 * on the loop thread, reading the rings under ring_mu. */

/* Blocks named by the records of buf[0..len) (what a lost hand-off costs: counted as gaps). */
static uint64_t blocks_in(const char *buf, size_t len) {
    uint64_t n = 0;
    for (size_t off = 0; off < len;) {
        uint32_t kind, size;
        memcpy(&kind, buf + off, 4);
        memcpy(&size, buf + off + 4, 4);
        n += kind == IN_STORED ? ((const in_stored *)(buf + off))->n : kind != IN_FLUSH;
        off += size;
    }
    return n;
}

/* Hands the intake to the events thread (without it: runs it here). flush: the window or the
 * loop iteration ended, so the batch ends with these records (an IN_FLUSH record marks the
 * point); a reader's hand-off (0) only has the records run, and the batch they joined goes at
 * the window's end as it would have without the reader. */
static void handoff(kvd_kvevents *e, int flush) {
    if (flush && (e->in_len > 0 || e->unflushed)) {
        uint8_t *r = room_in(&e->in, &e->in_cap, e->in_len, sizeof(in_flush), 16384);
        if (r != NULL) {
            in_flush f = {IN_FLUSH, sizeof(in_flush)};
            memcpy(r, &f, sizeof(f));
            e->in_len += sizeof(f);
            e->unflushed = 0;
        } else {
            e->unflushed = 1; /* no room for the mark: the next window's end sends them */
        }
    } else if (!flush && e->in_len > 0) {
        e->unflushed = 1; /* run, not sent: the window's end sends them */
    }
    if (e->in_len == 0) {
        return;
    }
    if (!e->thread_on) { /* kv-events-thread off: run them here, now */
        if (e->started && !e->closed) {
            drain(e, e->in, e->in_len);
        }
    } else {
        pthread_mutex_lock(&e->mu);
        if (e->q_len == 0) {
            char *t = e->q;
            size_t tc = e->q_cap;
            e->q = e->in;
            e->q_cap = e->in_cap;
            e->q_len = e->in_len;
            e->in = t;
            e->in_cap = tc;
        } else if (room_in(&e->q, &e->q_cap, e->q_len, e->in_len, 16384) != NULL) {
            memcpy(e->q + e->q_len, e->in, e->in_len); /* the thread is behind: after its */
            e->q_len += e->in_len;                     /* records, its flush points kept */
        } else {
            e->lc[KS_GAPS] += blocks_in(e->in, e->in_len);
        }
        e->handed++;
        pthread_mutex_unlock(&e->mu);
        pthread_cond_signal(&e->work_cv); /* after the unlock: one wake-up, not two */
    }
    e->in_len = 0;
    if (e->in_cap > INTAKE_KEEP) { /* a burst's buffer (a huge Commit with token ids) goes back */
        free(e->in);
        e->in = NULL;
        e->in_cap = 0;
    }
}

/* Has the records so far run (handed over and waited for; without the thread: run here). */
static void sync_thread(kvd_kvevents *e) {
    handoff(e, 0);
    if (!e->thread_on) {
        return;
    }
    pthread_mutex_lock(&e->mu);
    while (e->done < e->handed) {
        pthread_cond_wait(&e->done_cv, &e->mu);
    }
    pthread_mutex_unlock(&e->mu);
}

/* (mu held) What stats reads: the thread's counters as of its last drain or flush. */
static void snapshot(kvd_kvevents *e) {
    memcpy(e->snap, e->c, sizeof(e->c));
    e->snap[KS_COUNT] = e->nblocks;
}

static void *events_main(void *arg) {
    kvd_kvevents *e = arg;
    flush_all(e); /* the start-up batches (AllBlocksCleared) alone, first */
    pthread_mutex_lock(&e->mu);
    snapshot(e);
    for (;;) {
        if (e->q_len > 0) {
            char *w = e->work;
            size_t wc = e->work_cap, n = e->q_len;
            uint64_t gen = e->handed;
            e->work = e->q;
            e->work_cap = e->q_cap;
            e->q = w;
            e->q_cap = wc;
            e->q_len = 0;
            pthread_mutex_unlock(&e->mu);
            drain(e, e->work, n); /* its IN_FLUSH records send the batches */
            if (e->work_cap > INTAKE_KEEP) {
                free(e->work);
                e->work = NULL;
                e->work_cap = 0;
            }
            pthread_mutex_lock(&e->mu);
            e->done = gen;
            snapshot(e);
            pthread_cond_broadcast(&e->done_cv);
            continue;
        }
        if (e->stop) {
            break;
        }
        pthread_cond_wait(&e->work_cv, &e->mu);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

/* Ends the thread once it ran every record handed over and sent every batch. */
static void stop_thread(kvd_kvevents *e) {
    handoff(e, 1);
    if (!e->thread_on) {
        return;
    }
    pthread_mutex_lock(&e->mu);
    e->stop = 1;
    pthread_cond_signal(&e->work_cv);
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->thread, NULL);
    e->thread_on = 0;
}

void kvd_kvevents_stored(kvd_kvevents *e, const kvd_reg_pool *p, const kvd_kvevent_block *blk,
                         size_t n, const kv_hash128 *parent, const uint8_t *parent_full) {
    if (!kvd_kvevents_publishes(e, p) || n == 0) {
        return;
    }
    uint32_t tpb = p->layout.tokens_per_block;
    /* Token ids only where the publisher sends them (a record stays small otherwise). */
    int tokens = pub_of(e, p->domain)->token_ids;
    size_t tok_bytes = IN_ALIGN((size_t)tpb * sizeof(uint32_t));
    size_t size = sizeof(in_stored);
    for (size_t i = 0; i < n; i++) {
        size += sizeof(in_block) + (tokens && blk[i].tokens != NULL ? tok_bytes : 0);
    }
    uint8_t *r = size <= UINT32_MAX ? in_room(e, size) : NULL;
    if (r == NULL) {
        e->lc[KS_GAPS] += n;
        return;
    }
    in_stored *h = (in_stored *)r;
    memset(h, 0, sizeof(*h));
    h->kind = IN_STORED;
    h->size = (uint32_t)size;
    h->pool_id = p->pool_id;
    h->domain = p->domain;
    h->tpb = tpb;
    h->n = (uint32_t)n;
    if (parent != NULL) {
        h->has_parent = 1;
        h->parent = *parent;
    }
    if (parent_full != NULL) {
        h->has_parent_full = 1;
        memcpy(h->parent_full, parent_full, 32);
    }
    uint8_t *q = r + sizeof(*h);
    for (size_t i = 0; i < n; i++) {
        in_block *ib = (in_block *)q;
        q += sizeof(*ib);
        ib->key = blk[i].key;
        ib->has_full = blk[i].full != NULL;
        if (ib->has_full) {
            memcpy(ib->full, blk[i].full, 32);
        }
        ib->has_tokens = tokens && blk[i].tokens != NULL;
        if (ib->has_tokens) {
            memcpy(q, blk[i].tokens, (size_t)tpb * sizeof(uint32_t));
            q += tok_bytes;
        }
    }
    e->in_len += size;
}

void kvd_kvevents_tier_change(void *arg, uint32_t pool_id, uint32_t domain, uint32_t block_size,
                              kv_hash128 hash, const kv_hash128 *parent, const uint8_t *tail,
                              int tier, int present) {
    kvd_kvevents *e = arg;
    if (!takes(e, domain) || tier < KVD_KVEV_T0 || tier > KVD_KVEV_REMOTE) {
        return;
    }
    in_tier *t = (in_tier *)in_room(e, sizeof(in_tier));
    if (t == NULL) {
        e->lc[KS_GAPS]++;
        return;
    }
    memset(t, 0, sizeof(*t));
    t->kind = IN_TIER;
    t->size = sizeof(*t);
    t->pool_id = pool_id;
    t->domain = domain;
    t->block_size = block_size;
    t->tier = tier;
    t->present = present;
    t->hash = hash;
    if (parent != NULL) {
        t->has_parent = 1;
        t->parent = *parent;
    }
    if (tail != NULL) {
        t->has_tail = 1;
        memcpy(t->tail, tail, 16);
    }
    e->in_len += sizeof(*t);
}

/* The pool's drop hook (KVD_DROP_HOOK_EVENTS): a block left T0. */
static void on_drop(void *arg, kvd_pool *pool, kv_hash128 hash, kv_hash128 parent, int reason) {
    (void)parent;
    (void)reason;
    kvd_kvevents *e = arg;
    const kvd_pool_config *pc = kvd_pool_config_get(pool);
    if (!takes(e, pc->domain)) {
        return;
    }
    in_drop *d = (in_drop *)in_room(e, sizeof(in_drop));
    if (d == NULL) {
        e->lc[KS_GAPS]++;
        return;
    }
    d->kind = IN_DROP;
    d->size = sizeof(*d);
    d->pool_id = pc->pool_id;
    d->domain = pc->domain;
    d->hash = hash;
    e->in_len += sizeof(*d);
}

void kvd_kvevents_attach(kvd_kvevents *e, kvd_reg_pool *p) {
    if (e == NULL || pub_of(e, p->domain) == NULL) {
        return;
    }
    kvd_pool_set_drop_hook(p->pool, KVD_DROP_HOOK_EVENTS, on_drop, e);
}

/* ---- replay ------------------------------------------------------------------------------ */

static void send_end(pub *b, const void *id, size_t idlen) {
    static const uint8_t end[8] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
    if (zmq_send(b->router, id, idlen, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) {
        return; /* full or gone */
    }
    zmq_send(b->router, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_send(b->router, end, 8, ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_send(b->router, "", 0, ZMQ_DONTWAIT);
}

/* Reads one request of b's ROUTER: a well-formed one joins the replays being answered (or, with
 * REPLAY_PENDING of them already, gets the end marker at once: it asks again); any other is
 * counted and logged. */
static void replay_take(kvd_kvevents *e, pub *b) {
    zmq_msg_t parts[3];
    int nparts = 0, more = 1, total = 0;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, b->router, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            break;
        }
        more = zmq_msg_more(&m);
        total++;
        if (nparts < 3) {
            zmq_msg_init(&parts[nparts]);
            zmq_msg_move(&parts[nparts++], &m);
        }
        zmq_msg_close(&m);
    }
    int good = total == 3 && zmq_msg_size(&parts[1]) == 0 && zmq_msg_size(&parts[2]) == 8 &&
               zmq_msg_size(&parts[0]) <= sizeof(b->pend[0].id);
    if (!good) {
        e->lc[KS_REPLAY_BAD]++;
        uint64_t now = uv_now(e->loop);
        if (b->last_warn_ms == 0 || now - b->last_warn_ms >= LOG_EVERY_MS) {
            b->last_warn_ms = now;
            KV_LOG(WARN, "KVD-EVENTS",
                   "%s: malformed replay request (%d frames; expected [identity, empty, 8-byte "
                   "start seq]); ignored (%llu so far)",
                   b->replay, total, (unsigned long long)e->lc[KS_REPLAY_BAD]);
        }
    } else if (b->npend == REPLAY_PENDING) {
        send_end(b, zmq_msg_data(&parts[0]), zmq_msg_size(&parts[0]));
        e->lc[KS_REPLAYS]++;
    } else {
        rpend *p = &b->pend[b->npend++];
        const uint8_t *s = zmq_msg_data(&parts[2]);
        p->next = 0;
        for (int i = 0; i < 8; i++) {
            p->next = (p->next << 8) | s[i];
        }
        p->idlen = zmq_msg_size(&parts[0]);
        p->sent = 0;
        memcpy(p->id, zmq_msg_data(&parts[0]), p->idlen);
    }
    for (int i = 0; i < nparts; i++) {
        zmq_msg_close(&parts[i]);
    }
}

/* The ring position of the oldest kept batch with seq >= next (b->n when none): the ring holds
 * increasing seqs. Under ring_mu. */
static size_t ring_find(const pub *b, uint64_t next) {
    size_t lo = 0, hi = b->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (b->ring[(b->head + mid) % b->cap].seq < next) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo;
}

/* Sends at most budget batches of b's replays, oldest replay first; a replay that reaches the
 * ring's end, or finds its peer's queue full, ends with the end marker; one whose peer is gone
 * ends. Returns the budget left. */
static int replay_more(kvd_kvevents *e, pub *b, int budget) {
    while (b->npend > 0 && budget > 0) {
        rpend *p = &b->pend[0];
        int done = 0, marker = 0;        /* the replay ends; with the end marker */
        pthread_mutex_lock(&e->ring_mu); /* the events thread keeps batches meanwhile */
        size_t i = ring_find(b, p->next);
        for (; i < b->n && budget > 0 && p->sent < REPLAY_HWM; i++) {
            const kept *k = &b->ring[(b->head + i) % b->cap];
            uint8_t sb[8];
            seq_bytes(k->seq, sb);
            /* ZMQ_ROUTER_MANDATORY: the first frame says whether the peer can take it. */
            if (zmq_send(b->router, p->id, p->idlen, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) {
                marker = zmq_errno() == EAGAIN; /* full: it asks again; else gone */
                done = 1;
                break;
            }
            zmq_send(b->router, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
            zmq_send(b->router, sb, 8, ZMQ_SNDMORE | ZMQ_DONTWAIT);
            (void)send_sbuf(b->router, k->buf, 0);
            p->next = k->seq + 1;
            p->sent++;
            budget--;
        }
        pthread_mutex_unlock(&e->ring_mu);
        if ((i >= b->n || p->sent >= REPLAY_HWM) && !done) {
            done = marker = 1; /* all sent, or all a replay sends */
        }
        if (!done) {
            /* The budget is spent: this replay goes on at the next wake-up, behind the others. */
            rpend keep = *p;
            memmove(&b->pend[0], &b->pend[1], (b->npend - 1) * sizeof(*p));
            b->pend[b->npend - 1] = keep;
            break;
        }
        if (marker) {
            send_end(b, p->id, p->idlen);
        }
        e->lc[KS_REPLAYS]++;
        memmove(&b->pend[0], &b->pend[1], (b->npend - 1) * sizeof(*p));
        b->npend--;
    }
    return budget;
}

/* Takes up to KVD_KVEVENTS_REPLAYS_PER_WAKE queued requests of b and sends at most
 * REPLAY_BATCHES_PER_WAKE batches of its replays; 1 when more is waiting. */
static int replay_some(kvd_kvevents *e, pub *b) {
    if (b->router == NULL) {
        return 0;
    }
    int budget = replay_more(e, b, REPLAY_BATCHES_PER_WAKE);
    for (int k = 0; k < KVD_KVEVENTS_REPLAYS_PER_WAKE && budget > 0; k++) {
        int zev = 0;
        size_t zl = sizeof(zev);
        if (zmq_getsockopt(b->router, ZMQ_EVENTS, &zev, &zl) != 0 || !(zev & ZMQ_POLLIN)) {
            return b->npend > 0;
        }
        replay_take(e, b);
        budget = replay_more(e, b, budget);
    }
    return 1;
}

static void on_again(uv_timer_t *h) {
    kvd_kvevents *e = h->data;
    int more = 0;
    for (uint32_t i = 0; i < e->npubs; i++) {
        more |= replay_some(e, &e->pubs[i]);
    }
    if (more && !e->closed) {
        uv_timer_start(&e->again, on_again, 0, 0); /* after the loop's other work */
    }
}

static void on_router(uv_poll_t *h, int status, int events) {
    (void)status;
    (void)events;
    pub *b = h->data;
    /* ZMQ_FD signals edges: read what is queued (a bounded number per wake-up; the rest on a
     * zero timer, so one flooding peer cannot hold the loop). */
    if (replay_some(b->e, b) && !b->e->closed) {
        uv_timer_start(&b->e->again, on_again, 0, 0);
    }
}

/* ---- lifetime ---------------------------------------------------------------------------- */

static kv_err add_pub(kvd_kvevents *e, const char *endpoint, const char *replay, const char *topic,
                      int token_ids, int hash_bytes, int map, uint64_t buffer, char *msg,
                      size_t len) {
    /* One endpoint per socket: ZMQ would let a second bind of an ipc path take it silently. */
    for (uint32_t i = 0; i < e->npubs; i++) {
        const pub *o = &e->pubs[i];
        const char *mine[2] = {endpoint, replay};
        for (int k = 0; k < 2; k++) {
            if (mine[k][0] != '\0' &&
                (strcmp(mine[k], o->endpoint) == 0 || strcmp(mine[k], o->replay) == 0)) {
                snprintf(msg, len, "kv events: endpoint %s is given to two publishers", mine[k]);
                return KV_EINVAL;
            }
        }
    }
    if (replay[0] != '\0' && strcmp(replay, endpoint) == 0) {
        snprintf(msg, len, "kv events: %s is both the PUB and the replay endpoint", endpoint);
        return KV_EINVAL;
    }
    pub *b = &e->pubs[e->npubs];
    memset(b, 0, sizeof(*b));
    b->e = e;
    b->index = e->npubs;
    snprintf(b->endpoint, sizeof(b->endpoint), "%s", endpoint);
    snprintf(b->replay, sizeof(b->replay), "%s", replay);
    snprintf(b->topic, sizeof(b->topic), "%s", topic);
    b->token_ids = token_ids;
    b->hash_bytes = hash_bytes;
    b->map = map;
    b->cap = buffer;
    b->ring = calloc(buffer, sizeof(kept));
    if (b->ring == NULL) {
        return KV_ENOMEM;
    }
    msgpack_sbuffer_init(&b->evbuf);
    msgpack_packer_init(&b->pk, &b->evbuf, msgpack_sbuffer_write);
    e->npubs++;
    return KV_OK;
}

/* The CPUs this daemon may use: its affinity, less where a cgroup CPU quota (cgroup v2 cpu.max,
 * v1 cpu.cfs_quota_us; a Kubernetes CPU limit) allows less time than that. */
static double cpus_usable(void) {
    cpu_set_t set;
    double n = sched_getaffinity(0, sizeof(set), &set) == 0 ? (double)CPU_COUNT(&set) : 2.0;
    double quota = -1, period = 0;
    FILE *f = fopen("/sys/fs/cgroup/cpu.max", "r");
    if (f != NULL) {
        char q[32] = "";
        if (fscanf(f, "%31s %lf", q, &period) == 2 && strcmp(q, "max") != 0) {
            quota = atof(q);
        }
        fclose(f);
    } else if ((f = fopen("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "r")) != NULL) {
        if (fscanf(f, "%lf", &quota) != 1) {
            quota = -1;
        }
        fclose(f);
        if ((f = fopen("/sys/fs/cgroup/cpu/cpu.cfs_period_us", "r")) != NULL) {
            if (fscanf(f, "%lf", &period) != 1) {
                period = 0;
            }
            fclose(f);
        }
    }
    if (quota > 0 && period > 0 && quota / period < n) {
        n = quota / period;
    }
    return n;
}

kv_err kvd_kvevents_alloc(uv_loop_t *loop, const kvd_config *cfg, const kvd_tenants *tenants,
                          const char *medium_t0, kvd_kvevents **out, char *msg, size_t len) {
    *out = NULL;
    const kvd_events_line *lines;
    uint32_t nl = kvd_tenants_event_lines(tenants, &lines);
    if (nl == 0 && cfg->kv_events_endpoint[0] == '\0') {
        if (cfg->kv_events_replay[0] != '\0') {
            KV_LOG(WARN, "KVD-EVENTS", "kv-events-replay without kv-events-endpoint: no events");
        }
        return KV_OK;
    }
    kvd_kvevents *e = calloc(1, sizeof(*e));
    if (e == NULL) {
        return KV_ENOMEM;
    }
    e->tfd = -1;
    e->loop = loop;
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->ring_mu, NULL);
    pthread_cond_init(&e->work_cv, NULL);
    pthread_cond_init(&e->done_cv, NULL);
    e->medium = medium_t0;
    e->vllm = strcmp(cfg->hash_mode, "vllm") == 0;
    e->flush_ms = cfg->kv_events_flush_ms;
    if (strcmp(cfg->kv_events_thread, "auto") == 0) {
        e->want_thread = cpus_usable() >= 2.0;
    } else {
        e->want_thread = strcmp(cfg->kv_events_thread, "off") != 0;
    }
    memset(e->by_tenant, NO_PUB, sizeof(e->by_tenant));
    memset(e->by_group, NO_PUB, sizeof(e->by_group));
    e->commons = e->dflt = NO_PUB;
    kv_err rc = KV_OK;
    for (uint32_t i = 0; i < nl && rc == KV_OK; i++) {
        const kvd_events_line *l = &lines[i];
        rc = add_pub(e, l->endpoint, l->replay, l->topic, l->token_ids, l->hash_bytes, l->map,
                     l->buffer, msg, len);
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
        rc = add_pub(e, cfg->kv_events_endpoint, cfg->kv_events_replay, cfg->kv_events_topic,
                     cfg->kv_events_token_ids, strcmp(cfg->kv_events_hash_form, "bytes") == 0,
                     strcmp(cfg->kv_events_format, "map") == 0, cfg->kv_events_buffer, msg, len);
        if (rc == KV_OK && cfg->kv_events_token_ids && nl > 0) {
            KV_LOG(WARN, "KVD-EVENTS",
                   "kv-events-token-ids: the prompts of every domain that no events line names "
                   "(groups and the commons too) go to %s",
                   cfg->kv_events_endpoint);
        }
    }
    if (rc != KV_OK) {
        kvd_kvevents_free(e);
        return rc;
    }
    e->lc[KS_PUBLISHERS] = e->npubs;
    *out = e;
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
            int linger = 100; /* the last batch still leaves */
            zmq_setsockopt(b->sock, ZMQ_LINGER, &linger, sizeof(linger));
            zmq_close(b->sock);
            b->sock = NULL;
        }
    }
}

kv_err kvd_kvevents_start(kvd_kvevents *e, char *msg, size_t len) {
    if (e == NULL || e->started) {
        return KV_OK;
    }
    e->ctx = zmq_ctx_new();
    if (e->ctx == NULL) {
        snprintf(msg, len, "kv events: zmq_ctx_new failed");
        return KV_ESYS;
    }
    kv_err rc = KV_OK;
    for (uint32_t i = 0; i < e->npubs && rc == KV_OK; i++) {
        pub *b = &e->pubs[i];
        int hwm = 100000, linger = 0;
        b->sock = zmq_socket(e->ctx, ZMQ_PUB);
        if (b->sock == NULL) {
            snprintf(msg, len, "kv events: zmq_socket: %s", zmq_strerror(zmq_errno()));
            rc = KV_ESYS;
            break;
        }
        zmq_setsockopt(b->sock, ZMQ_SNDHWM, &hwm, sizeof(hwm));
        zmq_setsockopt(b->sock, ZMQ_LINGER, &linger, sizeof(linger));
        if (zmq_bind(b->sock, b->endpoint) != 0) {
            snprintf(msg, len, "kv events: cannot bind %s: %s", b->endpoint,
                     zmq_strerror(zmq_errno()));
            rc = KV_ESYS;
            break;
        }
        if (b->replay[0] == '\0') {
            continue;
        }
        b->router = zmq_socket(e->ctx, ZMQ_ROUTER);
        if (b->router == NULL) {
            snprintf(msg, len, "kv events: zmq_socket: %s", zmq_strerror(zmq_errno()));
            rc = KV_ESYS;
            break;
        }
        /* A peer's queue holds REPLAY_HWM batches (a peer that stops reading pins no more of
         * them than that); a send to a full peer fails (ROUTER_MANDATORY) instead of being
         * dropped unseen, so the replay ends there with its end marker. Requests are 3 small
         * frames. */
        int rhwm = REPLAY_HWM + 8, mandatory = 1;
        int64_t maxmsg = 64;
        zmq_setsockopt(b->router, ZMQ_SNDHWM, &rhwm, sizeof(rhwm));
        zmq_setsockopt(b->router, ZMQ_ROUTER_MANDATORY, &mandatory, sizeof(mandatory));
        zmq_setsockopt(b->router, ZMQ_LINGER, &linger, sizeof(linger));
        zmq_setsockopt(b->router, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
        if (zmq_bind(b->router, b->replay) != 0) {
            snprintf(msg, len, "kv events: cannot bind replay %s: %s", b->replay,
                     zmq_strerror(zmq_errno()));
            rc = KV_ESYS;
        }
    }
    if (rc != KV_OK) {
        close_sockets(e);
        return rc;
    }
    /* The loop's handles once every socket is bound: a failure above leaves none. */
    for (uint32_t i = 0; i < e->npubs; i++) {
        pub *b = &e->pubs[i];
        int fd;
        size_t fl = sizeof(fd);
        if (b->router == NULL) {
            continue;
        }
        if (zmq_getsockopt(b->router, ZMQ_FD, &fd, &fl) != 0 ||
            uv_poll_init(e->loop, &b->poll, fd) != 0) {
            KV_LOG(WARN, "KVD-EVENTS", "%s: cannot watch the replay socket; no replays", b->replay);
            zmq_close(b->router);
            b->router = NULL;
            continue;
        }
        b->poll.data = b;
        b->polling = 1;
        uv_poll_start(&b->poll, UV_READABLE, on_router);
    }
    for (uint32_t i = 0; i < e->npubs; i++) {
        pub *b = &e->pubs[i];
        pack_head(b, "AllBlocksCleared", 0);
        b->nev = 1;
    }
    /* The thread sends the AllBlocksCleared batches alone, first, whatever flush-ms (without
     * it, they go now: the loop runs no other record before this returns). */
    int err = e->want_thread ? pthread_create(&e->thread, NULL, events_main, e) : 0;
    if (err != 0) {
        snprintf(msg, len, "kv events: cannot start the events thread: %s", strerror(err));
        for (uint32_t i = 0; i < e->npubs; i++) {
            pub *b = &e->pubs[i];
            if (b->polling) {
                uv_close((uv_handle_t *)&b->poll, NULL);
                b->polling = 0;
            }
        }
        close_sockets(e);
        return KV_ESYS;
    }
    e->thread_on = e->want_thread;
    if (!e->want_thread) {
        flush_all(e);
    }
    uv_check_init(e->loop, &e->check);
    uv_timer_init(e->loop, &e->timer);
    uv_timer_init(e->loop, &e->again);
    e->check.data = e->timer.data = e->again.data = e;
    e->tfd = e->flush_ms > 0 ? timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC) : -1;
    if (e->tfd >= 0 && uv_poll_init(e->loop, &e->tpoll, e->tfd) != 0) {
        close(e->tfd);
        e->tfd = -1;
    }
    if (e->tfd >= 0) {
        e->tpoll.data = e;
        if (uv_poll_start(&e->tpoll, UV_READABLE, on_tfd) != 0) {
            uv_close((uv_handle_t *)&e->tpoll, NULL);
            close(e->tfd);
            e->tfd = -1;
        }
    }
    e->handles = 1;
    e->started = 1;
    for (uint32_t i = 0; i < e->npubs; i++) {
        pub *b = &e->pubs[i];
        KV_LOG(INFO, "KVD-EVENTS",
               "publishing KV events on %s%s%s (token ids %s, hashes as %s, %s events, %s)",
               b->endpoint, b->replay[0] != '\0' ? ", replays on " : "", b->replay,
               b->token_ids ? "on" : "off", b->hash_bytes ? "bytes" : "int",
               b->map ? "map" : "array",
               e->thread_on ? "on a thread of their own" : "on the loop thread");
    }
    return KV_OK;
}

void kvd_kvevents_close(kvd_kvevents *e) {
    if (e == NULL || e->closed) {
        return;
    }
    stop_thread(e); /* it runs every record so far and sends every batch first */
    e->closed = 1;
    for (uint32_t i = 0; i < e->npubs; i++) {
        pub *b = &e->pubs[i];
        if (b->polling) {
            uv_poll_stop(&b->poll);
            uv_close((uv_handle_t *)&b->poll, NULL);
            b->polling = 0;
        }
    }
    close_sockets(e);
    if (e->handles) {
        uv_close((uv_handle_t *)&e->check, NULL);
        uv_close((uv_handle_t *)&e->timer, NULL);
        uv_close((uv_handle_t *)&e->again, NULL);
        if (e->tfd >= 0) {
            uv_poll_stop(&e->tpoll);
            uv_close((uv_handle_t *)&e->tpoll, NULL);
            close(e->tfd); /* (not polled any more) */
            e->tfd = -1;
        }
        e->handles = 0;
    }
}

void kvd_kvevents_free(kvd_kvevents *e) {
    if (e == NULL) {
        return;
    }
    stop_thread(e);   /* when close never ran */
    close_sockets(e); /* (likewise) */
    if (e->ctx != NULL) {
        zmq_ctx_term(e->ctx); /* every socket is closed: returns after their linger */
    }
    for (uint32_t i = 0; i < e->npubs; i++) {
        pub *b = &e->pubs[i];
        for (size_t k = 0; k < b->n; k++) {
            sbuf_unref(b->ring[(b->head + k) % b->cap].buf);
        }
        free(b->ring);
        msgpack_sbuffer_destroy(&b->evbuf);
    }
    free(e->in);
    free(e->q);
    free(e->work);
    free(e->blk);
    free(e->tab);
    pthread_mutex_destroy(&e->mu);
    pthread_mutex_destroy(&e->ring_mu);
    pthread_cond_destroy(&e->work_cv);
    pthread_cond_destroy(&e->done_cv);
    free(e);
}

void kvd_kvevents_stats(kvd_kvevents *e, kvd_stat_sink sink, void *arg) {
    uint64_t v[KS_COUNT + 1] = {0};
    if (e != NULL) {
        sync_thread(e); /* kv_events_blocks as of every record so far */
        if (e->thread_on) {
            pthread_mutex_lock(&e->mu);
            memcpy(v, e->snap, sizeof(v));
            pthread_mutex_unlock(&e->mu);
        } else { /* never started, or ended: the thread's own counters are final */
            memcpy(v, e->c, sizeof(e->c));
            v[KS_COUNT] = e->nblocks;
        }
        for (int i = 0; i < KS_COUNT; i++) {
            v[i] += e->lc[i];
        }
    }
    for (int i = 0; i < KS_COUNT; i++) {
        sink(arg, ks_stats[i].name, i == KS_BLOCKS ? v[KS_COUNT] : v[i]);
    }
}

const kv_stat_desc *kvd_kvevents_stat_descs(size_t *n) {
    *n = KS_COUNT;
    return ks_stats;
}
