/* soak: see soak.h. Workers are processes (a death must be a real process death: the kernel
 * closes the socket and kvd sees EOF at any point of a request), counters live in one shared
 * anonymous mapping with a slot per worker, and the parent refills a slot whenever its worker
 * dies. Block bytes are a function of (block hash, tenant, layer, K|V), so whoever reads a hit
 * can check it without talking to the writer. */
#include "tests/soak/soak.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <msgpack.h>
#include <zmq.h>

#include "bench/benchutil.h"
#include "kvclient.h"
#include "tests/integration/kvd_harness.h"

#if defined(__SANITIZE_THREAD__)
/* ThreadSanitizer: libzmq is not built with it, and its I/O thread hands messages to the
 * subscriber through lock-free queues TSan cannot see (as in daemon/kvevents/kvevents.c). */
const char *__tsan_default_suppressions(void);
const char *__tsan_default_suppressions(void) {
    return "called_from_lib:libzmq.so\nrace:libzmq.so\n";
}
#endif

#define SOAK_MAX_CLIENTS 256
#define SOAK_MAX_TENANTS 16
#define SOAK_MAX_BLOCKS 8 /* blocks per sequence */
#define SOAK_FAMILIES 24  /* prompt families: sequences of one family share their prefix */
#define SOAK_MODEL "soak-model"

/* One worker slot's counters (written by the slot's current process, read by the parent after
 * waitpid). */
typedef struct soak_counters {
    uint64_t ops, requests, lookups, hit_blocks, promoted, allocated, committed, duplicates;
    uint64_t remote_lookups, remote_lookup_hits;
    uint64_t rewinds, pins;
    uint64_t enospc, verified, mismatched, unmapped, cross_domain, unexpected;
    uint32_t reported; /* mismatch lines printed by the slot's processes (capped) */
    int dying;         /* set just before the worker SIGKILLs itself */
    int started;       /* set once connected and attached */
} soak_counters;

typedef struct soak_ctx {
    const soak_options *o;
    char dir[80];                      /* temp dir: socket, tenants file, tokens */
    char sock[100];                    /* kvd socket */
    char tokens[SOAK_MAX_TENANTS][40]; /* token of each tenant */
    soak_counters *k;                  /* shared mapping, one per slot */
    uint64_t deadline_ms;              /* workers stop starting cycles after this */
    pid_t kvd;                         /* kvd's pid */
    pid_t redis;                       /* the redis-server's pid (options.redis), or 0 */
    int redis_port;
    /* options.events: kvd's PUB endpoint and the subscriber thread that checks its batches. */
    char evep[160];
    void *zctx, *zsub;
    pthread_t evth;
    int ev_started;
    atomic_int ev_stop; /* set once kvd is gone: the thread ends after a quiet poll */
    uint64_t ev_batches, ev_stored, ev_removed, ev_cleared, ev_gaps, ev_bad; /* the thread's */
    uint64_t ev_first, ev_last;                                              /* (likewise) */
} soak_ctx;

static uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t rng_next(uint64_t *s) {
    *s += 0x9e3779b97f4a7c15ull;
    return mix64(*s);
}

void soak_options_init(soak_options *o) {
    memset(o, 0, sizeof(*o));
    o->seconds = 60;
    o->clients = 64;
    o->tenants = 4;
    o->death_permille = 2;
    o->kvd = "daemon/kvd";
    o->pool_mem = "32M";
    o->seg_size = "1M";
}

/* ---- block contents --------------------------------------------------------------------- */

/* Word 0 of every (layer, K|V) run: the writer's tenant in the top byte, hash bits below. */
static uint64_t content_tag(kv_hash128 h, int tenant) {
    return (uint64_t)(tenant + 1) << 56 | (h.lo >> 8);
}

static uint64_t content_word(kv_hash128 h, int tenant, uint32_t run, size_t i) {
    return mix64(h.lo ^ mix64(h.hi + run) ^ (uint64_t)(tenant + 1) * 0x9e3779b97f4a7c15ull ^ i);
}

static int write_block(kvc_pool *p, kvc_block b, kv_hash128 h, int tenant) {
    const kv_layout *l = kvc_pool_layout(p);
    size_t words = (size_t)(l->kv_block_bytes / 8);
    for (uint32_t layer = 0; layer < l->num_layers; layer++) {
        for (int kv = 0; kv < 2; kv++) {
            uint64_t *w = kvc_pool_addr(p, b.id, layer, kv, 0, 0);
            if (w == NULL) {
                return -1;
            }
            uint32_t run = layer * 2 + (uint32_t)kv;
            w[0] = content_tag(h, tenant);
            for (size_t i = 1; i < words; i++) {
                w[i] = content_word(h, tenant, run, i);
            }
        }
    }
    return 0;
}

/* How a block's bytes compared with what its writer wrote (check_block). */
typedef enum soak_check {
    SOAK_OK,          /* every word as written */
    SOAK_UNMAPPED,    /* kvc_pool_addr gave NULL: the client has not mapped the block's segment */
    SOAK_BAD_TAG,     /* word 0 of a run is not this tenant's tag for the hash */
    SOAK_BAD_WORD,    /* the tag is right, a later word differs */
    SOAK_OTHER_TENANT /* another tenant's bytes for the same hash (a hit crossed domains) */
} soak_check;

/* The first difference check_block found. */
typedef struct soak_diff {
    uint32_t layer; /* layer of the run that differs */
    int kv;         /* K (0) or V (1) */
    size_t word;    /* word index inside the run */
    uint64_t seen;  /* the word found */
    uint64_t want;  /* the word the writer wrote */
} soak_diff;

/* Compares block b with what tenant wrote for h; *d gets the first difference, if any. */
static soak_check check_block(kvc_pool *p, kvc_block b, kv_hash128 h, int tenant, soak_diff *d) {
    const kv_layout *l = kvc_pool_layout(p);
    size_t words = (size_t)(l->kv_block_bytes / 8);
    memset(d, 0, sizeof(*d));
    for (uint32_t layer = 0; layer < l->num_layers; layer++) {
        for (int kv = 0; kv < 2; kv++) {
            const uint64_t *w = kvc_pool_addr(p, b.id, layer, kv, 0, 0);
            d->layer = layer;
            d->kv = kv;
            if (w == NULL) {
                return SOAK_UNMAPPED;
            }
            uint32_t run = layer * 2 + (uint32_t)kv;
            if (w[0] != content_tag(h, tenant)) {
                d->seen = w[0];
                d->want = content_tag(h, tenant);
                uint64_t t = w[0] >> 56;
                int other = (w[0] << 8 >> 8) == (h.lo >> 8) && t != (uint64_t)(tenant + 1);
                return other ? SOAK_OTHER_TENANT : SOAK_BAD_TAG;
            }
            for (size_t i = 1; i < words; i++) {
                if (w[i] != content_word(h, tenant, run, i)) {
                    d->word = i;
                    d->seen = w[i];
                    d->want = content_word(h, tenant, run, i);
                    return SOAK_BAD_WORD;
                }
            }
        }
    }
    return SOAK_OK;
}

/* ---- worker ----------------------------------------------------------------------------- */

typedef struct worker {
    soak_counters *k;
    kvc_pool *p;
    int tenant;
    int permille;
    int tiers;  /* Fetch instead of Lookup (soak_options.tiers) */
    int remote; /* a remote tier: a quarter of the cycles ask it with kvc_lookup_remote */
    uint64_t rng;
} worker;

/* A fault: the worker dies here, at whatever point of its cycle it is. */
static void maybe_die(worker *w) {
    if ((int)(rng_next(&w->rng) % 1000) < w->permille) {
        w->k->dying = 1;
        raise(SIGKILL);
    }
}

#define SOAK_MAX_REPORTS 16 /* mismatch lines per worker slot */

/* Checks block b (what: "hit", "commit", "duplicate commit") and counts the outcome; a mismatch is
 * printed with the block, what was seen and what was wanted. */
static void verify(worker *w, kvc_block b, kv_hash128 h, const char *what) {
    soak_diff d;
    soak_check v = check_block(w->p, b, h, w->tenant, &d);
    w->k->verified++;
    if (v == SOAK_OK) {
        return;
    }
    if (v == SOAK_OTHER_TENANT) {
        w->k->cross_domain++;
    } else {
        w->k->mismatched++;
        w->k->unmapped += v == SOAK_UNMAPPED;
    }
    if (w->k->reported >= SOAK_MAX_REPORTS) {
        return;
    }
    w->k->reported++;
    uint32_t bps = kvc_pool_blocks_per_segment(w->p);
    if (v == SOAK_UNMAPPED) {
        fprintf(stderr,
                "soak: worker pid %d tenant %d: %s block %u gen %u: NULL address (segment %u not "
                "mapped; client maps %u segments)\n",
                (int)getpid(), w->tenant, what, b.id, b.gen, b.id / bps, kvc_pool_segments(w->p));
        return;
    }
    fprintf(stderr,
            "soak: worker pid %d tenant %d: %s block %u gen %u (hash %016llx%016llx): %s at layer "
            "%u %c word %zu: seen %016llx, wanted %016llx\n",
            (int)getpid(), w->tenant, what, b.id, b.gen, (unsigned long long)h.hi,
            (unsigned long long)h.lo,
            v == SOAK_OTHER_TENANT ? "another tenant's bytes"
            : v == SOAK_BAD_TAG    ? "tag mismatch"
                                   : "word mismatch",
            d.layer, d.kv == 0 ? 'K' : 'V', d.word, (unsigned long long)d.seen,
            (unsigned long long)d.want);
}

static void unexpected(worker *w, const char *what, kv_err rc) {
    w->k->unexpected++;
    fprintf(stderr, "soak: worker pid %d: %s: %s\n", (int)getpid(), what, kv_strerror(rc));
}

static void release(worker *w, kvc_block *held, size_t n) {
    if (n == 0) {
        return;
    }
    w->k->requests++;
    kv_err rc = kvc_release(w->p, held, n);
    if (rc != KV_OK) {
        unexpected(w, "release", rc);
    }
}

/* One cycle: look a prompt up, verify the hits, allocate and write the rest, commit it (or
 * throw it away as rejected drafts), maybe pin, release everything. */
static void cycle(worker *w) {
    w->k->ops++;
    /* Half the prompts come from a few shared families (hits, duplicates), half are new (misses,
     * allocations, eviction under memory pressure). */
    uint32_t fam = (uint32_t)(rng_next(&w->rng) % SOAK_FAMILIES);
    if (rng_next(&w->rng) % 2 == 0) {
        fam = SOAK_FAMILIES + (uint32_t)(rng_next(&w->rng) % 1000000u);
    }
    size_t nblocks = 1 + (size_t)(rng_next(&w->rng) % SOAK_MAX_BLOCKS);
    uint32_t tpb = kvc_pool_layout(w->p)->tokens_per_block;
    uint32_t tok[SOAK_MAX_BLOCKS * 64];
    for (size_t i = 0; i < nblocks * tpb; i++) {
        tok[i] = fam * 7919u + (uint32_t)i;
    }
    kv_hash128 h[SOAK_MAX_BLOCKS];
    size_t nh;
    kv_err rc = kvc_pool_hash_tokens(w->p, NULL, 0, tok, nblocks * tpb, h, SOAK_MAX_BLOCKS, &nh);
    if (rc != KV_OK || nh != nblocks) {
        unexpected(w, "hash", rc);
        return;
    }
    kvc_block held[SOAK_MAX_BLOCKS];
    size_t nhit = 0;
    maybe_die(w);
    w->k->requests++;
    w->k->lookups++;
    if (w->remote && rng_next(&w->rng) % 4 == 0) {
        /* Ask Redis how far the prefix goes on past the local tiers (the hits are T0's). */
        kvc_tier_hits th;
        kvc_remote_hits rh;
        w->k->remote_lookups++;
        rc = kvc_lookup_remote(w->p, h, nblocks, held, &nhit, &th, &rh);
        if (rc == KV_OK) {
            w->k->remote_lookup_hits += rh.blocks;
            if (rh.failure != KV_OK && rh.failure != KV_ESYS && rh.failure != KV_EBUSY) {
                unexpected(w, "lookup remote (failure)", rh.failure);
            }
            if (nhit + th.fetchable + rh.blocks > nblocks) {
                unexpected(w, "lookup remote (more hits than blocks)", KV_EINTERNAL);
            }
        }
    } else if (w->tiers) {
        /* Every hit's bytes are checked below, whether they were in T0 or came up. */
        kvc_fetch_result fr;
        rc = kvc_fetch(w->p, h, nblocks, 0, held, &fr);
        nhit = rc == KV_OK ? fr.nblocks : 0;
        if (rc == KV_OK) {
            w->k->promoted += fr.promoted;
            if (fr.status == KVC_FETCH_PARTIAL && fr.failure != KV_ENOSPC &&
                fr.failure != KV_ENOENT) {
                unexpected(w, "fetch", fr.failure);
            }
        }
    } else {
        rc = kvc_lookup(w->p, h, nblocks, held, &nhit);
    }
    if (rc != KV_OK) {
        unexpected(w, "lookup", rc);
        return;
    }
    w->k->hit_blocks += nhit;
    for (size_t i = 0; i < nhit; i++) {
        verify(w, held[i], h[i], "hit");
    }
    maybe_die(w);
    size_t nheld = nhit;
    size_t need = nblocks - nhit;
    if (need > 0) {
        kvc_block nb[SOAK_MAX_BLOCKS];
        w->k->requests++;
        rc = kvc_allocate(w->p, (uint32_t)need, nb);
        if (rc == KV_ENOSPC) {
            w->k->enospc++;
            release(w, held, nheld);
            return;
        }
        if (rc != KV_OK) {
            unexpected(w, "allocate", rc);
            release(w, held, nheld);
            return;
        }
        w->k->allocated += need;
        for (size_t j = 0; j < need; j++) {
            if (write_block(w->p, nb[j], h[nhit + j], w->tenant) != 0) {
                unexpected(w, "block address", KV_EINTERNAL);
            }
            if (j == need / 2) {
                maybe_die(w); /* mid-write: some blocks written, some not */
            }
        }
        if (rng_next(&w->rng) % 8 == 0) {
            /* Speculative decoding rejected these: give them back uncommitted. */
            w->k->requests++;
            w->k->rewinds++;
            rc = kvc_rewind(w->p, nb, need);
            if (rc != KV_OK) {
                unexpected(w, "rewind", rc);
            }
        } else {
            kvc_commit_entry e[SOAK_MAX_BLOCKS];
            for (size_t j = 0; j < need; j++) {
                e[j].block = nb[j];
                e[j].hash = h[nhit + j];
                if (j > 0) {
                    e[j].parent = nb[j - 1].id;
                } else {
                    e[j].parent = nhit > 0 ? held[nhit - 1].id : KVC_NO_PARENT;
                }
            }
            kvc_block canon[SOAK_MAX_BLOCKS];
            w->k->requests++;
            rc = kvc_commit(w->p, e, need, canon);
            if (rc != KV_OK) {
                unexpected(w, "commit", rc);
                release(w, nb, need);
            } else {
                w->k->committed += need;
                for (size_t j = 0; j < need; j++) {
                    if (canon[j].id != nb[j].id) {
                        w->k->duplicates++;
                    }
                    verify(w, canon[j], h[nhit + j],
                           canon[j].id != nb[j].id ? "duplicate commit" : "commit");
                    held[nheld++] = canon[j];
                }
            }
        }
    }
    maybe_die(w);
    if (nheld > 0 && rng_next(&w->rng) % 16 == 0) {
        w->k->requests++;
        w->k->pins++;
        rc = kvc_pin(w->p, held, nheld, 50, (uint8_t)(rng_next(&w->rng) % 256), 0);
        if (rc != KV_OK) {
            unexpected(w, "pin", rc);
        }
    }
    maybe_die(w);
    release(w, held, nheld);
}

static kv_layout soak_layout(int block_major) {
    kv_layout l;
    memset(&l, 0, sizeof(l));
    l.num_layers = 2;
    l.num_kv_heads = 2;
    l.head_dim = 64;
    l.tokens_per_block = 16;
    l.dtype = KV_DTYPE_FP16;
    l.arrangement = block_major ? KV_BLOCK_MAJOR : KV_LAYER_MAJOR;
    return l;
}

static kv_err open_tenant(const soak_ctx *x, int tenant, const char *name, kvc_conn **c,
                          kvc_pool **p) {
    kvc_options o;
    kvc_options_init(&o);
    o.socket_path = x->sock;
    o.client_name = name;
    o.token = x->tokens[tenant];
    o.token_len = strlen(x->tokens[tenant]);
    o.timeout_ms = 60000;
    kv_err rc = kvc_conn_open(&o, c);
    if (rc != KV_OK) {
        /* kvc_conn_open keeps no connection on failure: only the code is known. */
        fprintf(stderr, "soak: %s: tenant %d: connect: %s\n", name, tenant, kv_strerror(rc));
        return rc;
    }
    kv_layout l = soak_layout(x->o->block_major);
    rc = kvc_pool_attach(*c, SOAK_MODEL, &l, p);
    if (rc != KV_OK) {
        fprintf(stderr, "soak: %s: tenant %d: attach: %s: %s\n", name, tenant, kv_strerror(rc),
                kvc_last_error(*c));
        kvc_conn_close(*c);
    }
    return rc;
}

static void worker_main(const soak_ctx *x, int slot) {
    worker w;
    memset(&w, 0, sizeof(w));
    w.k = &x->k[slot];
    w.tenant = slot % x->o->tenants;
    w.permille = x->o->death_permille;
    w.tiers = x->o->tiers;
    w.remote = x->o->tiers && x->o->redis != NULL;
    w.rng = mix64((uint64_t)slot << 32 ^ (uint64_t)getpid() ^ now_ms() << 20);
    kvc_conn *c;
    char name[32];
    snprintf(name, sizeof(name), "soak-%d", slot);
    kv_err rc = open_tenant(x, w.tenant, name, &c, &w.p);
    if (rc != KV_OK) {
        fprintf(stderr, "soak: worker %d cannot start: %s\n", slot, kv_strerror(rc));
        _exit(3);
    }
    w.k->started = 1;
    while (now_ms() < x->deadline_ms) {
        cycle(&w);
    }
    kvc_pool_detach(w.p);
    kvc_conn_close(c);
    _exit(0);
}

/* ---- supervisor ------------------------------------------------------------------------- */

static uint64_t proc_kb(pid_t pid, const char *field) {
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    uint64_t v = 0;
    size_t fl = strlen(field);
    while (f != NULL && fgets(line, sizeof(line), f) != NULL) {
        if (strncmp(line, field, fl) == 0 && line[fl] == ':') {
            v = strtoull(line + fl + 1, NULL, 10);
        }
    }
    if (f != NULL) {
        fclose(f);
    }
    return v;
}

static int write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        return -1;
    }
    fputs(text, f);
    return fclose(f);
}

/* A loopback TCP port free now (the kernel's pick), or -1. */
static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    int port = -1;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &len) == 0) {
        port = ntohs(a.sin_port);
    }
    if (fd >= 0) {
        close(fd);
    }
    return port;
}

/* Starts options.redis on a free loopback port and waits until it accepts connections. */
static int start_redis(soak_ctx *x) {
    x->redis_port = free_port();
    if (x->redis_port < 0) {
        return -1;
    }
    char port[16];
    snprintf(port, sizeof(port), "%d", x->redis_port);
    pid_t pid = fork();
    if (pid == 0) {
        int null = open("/dev/null", O_WRONLY);
        if (null >= 0) { /* its start-up warnings are not the soak's output */
            dup2(null, 1);
            dup2(null, 2);
        }
        execl(x->o->redis, x->o->redis, "--port", port, "--bind", "127.0.0.1", "--save", "",
              "--appendonly", "no", "--dir", x->dir, "--loglevel", "warning", (char *)NULL);
        _exit(127);
    }
    if (pid < 0) {
        return -1;
    }
    x->redis = pid;
    for (int i = 0; i < 500; i++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a;
        memset(&a, 0, sizeof(a));
        a.sin_family = AF_INET;
        a.sin_port = htons((uint16_t)x->redis_port);
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        int ok = fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0;
        if (fd >= 0) {
            close(fd);
        }
        if (ok) {
            return 0;
        }
        kvd_harness_sleep_ms(10);
    }
    fprintf(stderr, "soak: redis-server (%s) did not start on port %d\n", x->o->redis,
            x->redis_port);
    return -1;
}

static int start_kvd(soak_ctx *x) {
    if (kvd_harness_make_dir(x->dir, sizeof(x->dir), "kvd-soak", 50) != 0) {
        return -1;
    }
    snprintf(x->sock, sizeof(x->sock), "%s/kvd.sock", x->dir);
    char tenants[2048] = "", path[256], line[400];
    for (int t = 0; t < x->o->tenants; t++) {
        snprintf(x->tokens[t], sizeof(x->tokens[t]), "soak-token-%02d-%08x", t,
                 (unsigned)mix64((uint64_t)getpid() + (uint64_t)t));
        snprintf(path, sizeof(path), "%s/t%d.token", x->dir, t);
        if (write_text(path, x->tokens[t]) != 0) {
            return -1;
        }
        snprintf(line, sizeof(line), "tenant soak%d token-file=%s\n", t, path);
        strncat(tenants, line, sizeof(tenants) - strlen(tenants) - 1);
    }
    char tfile[160], sockflag[160], tflag[200], memflag[64], segflag[64];
    snprintf(tfile, sizeof(tfile), "%s/tenants", x->dir);
    if (write_text(tfile, tenants) != 0) {
        return -1;
    }
    snprintf(sockflag, sizeof(sockflag), "--socket=%s", x->sock);
    snprintf(tflag, sizeof(tflag), "--tenants-file=%s", tfile);
    snprintf(memflag, sizeof(memflag), "--pool-memory=%s", x->o->pool_mem);
    snprintf(segflag, sizeof(segflag), "--segment-bytes=%s", x->o->seg_size);
    char wrap[512] = "";
    char *argv[32];
    int n = 0;
    if (x->o->wrap != NULL) {
        snprintf(wrap, sizeof(wrap), "%s", x->o->wrap);
        char *save = NULL;
        for (char *t = strtok_r(wrap, " ", &save); t != NULL && n < 20;
             t = strtok_r(NULL, " ", &save)) {
            argv[n++] = t;
        }
    }
    argv[n++] = (char *)x->o->kvd;
    argv[n++] = sockflag;
    argv[n++] = tflag;
    argv[n++] = memflag;
    argv[n++] = segflag;
    argv[n++] = "--log-level=warn";
    char evflag[200];
    if (x->o->events) {
        snprintf(x->evep, sizeof(x->evep), "ipc://%s/ev", x->dir);
        snprintf(evflag, sizeof(evflag), "--kv-events-endpoint=%s", x->evep);
        argv[n++] = evflag;
        argv[n++] = "--kv-events-token-ids=true";
    }
    char t2flag[160], rflag[64], rwflag[64];
    if (x->o->tiers && x->o->redis != NULL) {
        /* T1 smaller than the pools and no T2: what T0 and T1 let go comes back from Redis. */
        if (start_redis(x) != 0) {
            return -1;
        }
        snprintf(rflag, sizeof(rflag), "--remote-redis=127.0.0.1:%d", x->redis_port);
        argv[n++] = "--tier1-memory=4M";
        argv[n++] = rflag;
        argv[n++] = "--remote-timeout-ms=2000";
        argv[n++] = "--fetch-min-tokens=1";
        argv[n++] = "--tier-write=write-through";
        if (x->o->remote_write != NULL) {
            snprintf(rwflag, sizeof(rwflag), "--remote-write=%s", x->o->remote_write);
            argv[n++] = rwflag;
        }
    } else if (x->o->tiers) {
        /* T1 smaller than the pools, T2 larger: blocks go down, come up, and are dropped from
         * T1 for room while T2 still has them. fetch-min-tokens 1: every run is fetched. */
        snprintf(t2flag, sizeof(t2flag), "--tier2-path=%s/t2", x->dir);
        argv[n++] = "--tier1-memory=4M";
        argv[n++] = t2flag;
        argv[n++] = "--tier2-bytes=256M";
        argv[n++] = "--fetch-min-tokens=1";
        argv[n++] = x->o->tiers == 2 ? "--tier-write=write-through" : "--tier-write=write-back";
        if (x->o->block_major) {
            /* the zero-copy way whatever the page size (auto would copy from 4 KiB pages) */
            argv[n++] = "--tier2-zero-copy=on";
        }
    }
    argv[n] = NULL;
    /* 60 s: valgrind starts slowly. A kvd still starting then is left running (x->kvd). */
    return kvd_harness_spawn(argv, x->sock, 60000, "soak", &x->kvd);
}

static int stop_kvd(soak_ctx *x) {
    if (x->kvd == 0) {
        return -1;
    }
    int st = kvd_harness_kill(x->kvd, 60000);
    x->kvd = 0;
    return st;
}

static pid_t spawn_worker(const soak_ctx *x, int slot) {
    x->k[slot].dying = 0;
    x->k[slot].started = 0;
    pid_t pid = fork();
    if (pid == 0) {
        worker_main(x, slot);
    }
    return pid;
}

/* The number after key (a JSON member name with its colon) in the admin `stats` reply, from
 * admin.sock beside kvd's socket; 0 when it cannot be read. */
static uint64_t admin_stat(const soak_ctx *x, const char *key) {
    char path[160];
    snprintf(path, sizeof(path), "%s/admin.sock", x->dir);
    size_t cap = 4u << 20; /* the whole reply (every pool and tenant) */
    char *reply = malloc(cap);
    uint64_t v = 0;
    if (reply != NULL && bench_admin(path, "stats", reply, cap) == 0) {
        const char *at = strstr(reply, key);
        v = at != NULL ? strtoull(at + strlen(key), NULL, 10) : 0;
    }
    free(reply);
    return v;
}

/* With every worker gone: every block of every tenant's pool is free or cached. */
static int check_pools(soak_ctx *x, soak_result *r) {
    for (int t = 0; t < x->o->tenants; t++) {
        kvc_conn *c;
        kvc_pool *p;
        kv_err rc = open_tenant(x, t, "soak-check", &c, &p);
        if (rc != KV_OK) {
            fprintf(stderr, "soak: checker for tenant %d: %s\n", t, kv_strerror(rc));
            return -1;
        }
        /* Closes of dead workers are handled asynchronously: wait until only we are left. */
        uint64_t sessions = 0;
        for (int i = 0; i < 2000; i++) {
            if (kvc_stat_get(c, 0, "daemon.sessions", &sessions) == KV_OK && sessions == 1) {
                break;
            }
            kvd_harness_sleep_ms(10);
        }
        /* Copies the tiers still run (a Fetch of a dead worker, a write-back copy) hold blocks
         * until they are done: wait for them. */
        uint64_t jobs = 0;
        for (int i = 0; x->o->tiers && i < 2000; i++) {
            if (kvc_stat_get(c, 0, "tiers.jobs_inflight", &jobs) == KV_OK && jobs == 0) {
                break;
            }
            kvd_harness_sleep_ms(10);
        }
        if (t == 0 && x->o->tiers) {
            (void)kvc_stat_get(c, 0, "tiers.tier2_zero_copy", &r->t2_zero_copy);
        }
        if (t == 0 && x->o->events) {
            r->ev_published = admin_stat(x, "\"kv_events_batches\":");
        }
        if (t == 0 && x->o->redis != NULL) {
            (void)kvc_stat_get(c, 0, "tiers.remote_direct", &r->remote_direct);
            (void)kvc_stat_get(c, 0, "tiers.remote_bad", &r->remote_bad);
        }
        uint32_t id = kvc_pool_id(p);
        uint64_t total = 0, fr = 0, cached = 0, parked = 0, writing = 0, committed = 0, refs = 0;
        if (kvc_stat_get(c, id, "pool.blocks_total", &total) != KV_OK ||
            kvc_stat_get(c, id, "pool.blocks_free", &fr) != KV_OK ||
            kvc_stat_get(c, id, "pool.blocks_cached", &cached) != KV_OK ||
            kvc_stat_get(c, id, "pool.blocks_parked", &parked) != KV_OK ||
            kvc_stat_get(c, id, "pool.blocks_writing", &writing) != KV_OK ||
            kvc_stat_get(c, id, "pool.blocks_committed", &committed) != KV_OK ||
            kvc_stat_get(c, 0, "session.refs_held", &refs) != KV_OK) {
            fprintf(stderr, "soak: stats: %s\n", kvc_last_error(c));
            kvc_conn_close(c);
            return -1;
        }
        /* Parked segments' blocks (memory lent to other pools) are FREE on no list. */
        uint64_t leaked = total - fr - cached - parked;
        if (fr + cached + parked > total) {
            leaked = (fr + cached + parked) - total; /* counted twice: as bad as a leak */
        }
        if (x->o->verbose || leaked != 0 || sessions != 1) {
            printf("soak: tenant %d pool %u: total %llu free %llu cached %llu parked %llu "
                   "writing %llu committed %llu, sessions %llu\n",
                   t, id, (unsigned long long)total, (unsigned long long)fr,
                   (unsigned long long)cached, (unsigned long long)parked,
                   (unsigned long long)writing, (unsigned long long)committed,
                   (unsigned long long)sessions);
        }
        r->leaked += leaked;
        r->blocks_total += total;
        kvc_pool_detach(p);
        kvc_conn_close(c);
        if (refs != 0 || sessions != 1) {
            fprintf(stderr, "soak: %llu sessions still open, checker holds %llu refs\n",
                    (unsigned long long)sessions, (unsigned long long)refs);
            return -1; /* a dead worker's session was never closed */
        }
    }
    return 0;
}

/* ---- the KV-event subscriber (options.events) -------------------------------------------- */

/* One batch's payload: [ts, [events...], dp_rank], each event an array whose first element is
 * its tag (vLLM's array-like tagged structs, kvd's default kv-events-format). 0 when it is. */
static int ev_check(soak_ctx *x, const char *buf, size_t len) {
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    size_t off = 0;
    int bad = msgpack_unpack_next(&u, buf, len, &off) != MSGPACK_UNPACK_SUCCESS || off != len;
    const msgpack_object *b = &u.data;
    bad = bad || b->type != MSGPACK_OBJECT_ARRAY || b->via.array.size != 3 ||
          b->via.array.ptr[0].type != MSGPACK_OBJECT_FLOAT64 ||
          b->via.array.ptr[1].type != MSGPACK_OBJECT_ARRAY ||
          b->via.array.ptr[2].type != MSGPACK_OBJECT_POSITIVE_INTEGER;
    for (uint32_t i = 0; !bad && i < b->via.array.ptr[1].via.array.size; i++) {
        const msgpack_object *ev = &b->via.array.ptr[1].via.array.ptr[i];
        if (ev->type != MSGPACK_OBJECT_ARRAY || ev->via.array.size < 1 ||
            ev->via.array.ptr[0].type != MSGPACK_OBJECT_STR) {
            bad = 1;
            break;
        }
        const msgpack_object_str *tag = &ev->via.array.ptr[0].via.str;
#define SOAK_TAG(name) (tag->size == sizeof(name) - 1 && memcmp(tag->ptr, name, tag->size) == 0)
        if (SOAK_TAG("BlockStored")) {
            x->ev_stored++;
        } else if (SOAK_TAG("BlockRemoved")) {
            x->ev_removed++;
        } else if (SOAK_TAG("AllBlocksCleared")) {
            x->ev_cleared++;
        } else {
            bad = 1;
        }
#undef SOAK_TAG
    }
    msgpack_unpacked_destroy(&u);
    return bad ? -1 : 0;
}

/* Receives every batch until told to stop and then quiet for a poll: [topic, seq (8 bytes,
 * big-endian), payload]; a sequence number that skips counts the batches skipped as gaps. */
static void *ev_main(void *arg) {
    soak_ctx *x = arg;
    uint64_t last = 0;
    int have_last = 0;
    for (;;) {
        zmq_pollitem_t it = {x->zsub, 0, ZMQ_POLLIN, 0};
        int rc = zmq_poll(&it, 1, 200);
        if (rc <= 0) {
            if (atomic_load(&x->ev_stop)) {
                break;
            }
            continue;
        }
        zmq_msg_t part[4];
        int np = 0, more = 1, extra = 0;
        while (more && np < 4) {
            zmq_msg_init(&part[np]);
            if (zmq_msg_recv(&part[np], x->zsub, 0) < 0) {
                zmq_msg_close(&part[np]);
                more = 0; /* (an interrupted read: this message is counted bad) */
                extra = 1;
                break;
            }
            more = zmq_msg_more(&part[np]);
            np++;
        }
        while (more) { /* more frames than a batch has: drain them */
            zmq_msg_t m;
            zmq_msg_init(&m);
            more = zmq_msg_recv(&m, x->zsub, 0) >= 0 && zmq_msg_more(&m);
            zmq_msg_close(&m);
            extra = 1;
        }
        if (extra || np != 3 || zmq_msg_size(&part[1]) != 8) {
            x->ev_bad++;
        } else {
            const uint8_t *sb = zmq_msg_data(&part[1]);
            uint64_t seq = 0;
            for (int i = 0; i < 8; i++) {
                seq = seq << 8 | sb[i];
            }
            if (have_last && seq <= last) {
                x->ev_bad++;
            } else {
                x->ev_gaps += have_last ? seq - last - 1 : 0;
                x->ev_first = have_last ? x->ev_first : seq;
                x->ev_last = seq;
                last = seq;
                have_last = 1;
                x->ev_batches++;
                if (ev_check(x, zmq_msg_data(&part[2]), zmq_msg_size(&part[2])) != 0) {
                    x->ev_bad++;
                }
            }
        }
        for (int i = 0; i < np; i++) {
            zmq_msg_close(&part[i]);
        }
    }
    return NULL;
}

static int ev_start(soak_ctx *x) {
    int hwm = 0; /* no high-water mark: a batch this side drops would be a gap it reports */
    x->zctx = zmq_ctx_new();
    x->zsub = x->zctx != NULL ? zmq_socket(x->zctx, ZMQ_SUB) : NULL;
    if (x->zsub == NULL || zmq_setsockopt(x->zsub, ZMQ_RCVHWM, &hwm, sizeof(hwm)) != 0 ||
        zmq_setsockopt(x->zsub, ZMQ_SUBSCRIBE, "", 0) != 0 || zmq_connect(x->zsub, x->evep) != 0 ||
        pthread_create(&x->evth, NULL, ev_main, x) != 0) {
        fprintf(stderr, "soak: cannot subscribe to %s: %s\n", x->evep, zmq_strerror(zmq_errno()));
        return -1;
    }
    x->ev_started = 1;
    kvd_harness_sleep_ms(300); /* the subscription reaches kvd before the first batch */
    return 0;
}

static void ev_stop(soak_ctx *x) {
    if (x->ev_started) {
        atomic_store(&x->ev_stop, 1);
        pthread_join(x->evth, NULL);
        x->ev_started = 0;
    }
    if (x->zsub != NULL) {
        int linger = 0;
        zmq_setsockopt(x->zsub, ZMQ_LINGER, &linger, sizeof(linger));
        zmq_close(x->zsub);
        x->zsub = NULL;
    }
    if (x->zctx != NULL) {
        zmq_ctx_term(x->zctx);
        x->zctx = NULL;
    }
}

int soak_run(const soak_options *o, soak_result *r) {
    memset(r, 0, sizeof(*r));
    r->kvd_status = -1;
    if (o->clients < 1 || o->clients > SOAK_MAX_CLIENTS || o->tenants < 1 ||
        o->tenants > SOAK_MAX_TENANTS) {
        fprintf(stderr, "soak: clients 1..%d, tenants 1..%d\n", SOAK_MAX_CLIENTS, SOAK_MAX_TENANTS);
        return -1;
    }
    signal(SIGPIPE, SIG_IGN);
    soak_ctx x;
    memset(&x, 0, sizeof(x));
    x.o = o;
    x.k = mmap(NULL, sizeof(soak_counters) * SOAK_MAX_CLIENTS, PROT_READ | PROT_WRITE,
               MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (x.k == MAP_FAILED) {
        return -1;
    }
    if (start_kvd(&x) != 0) {
        munmap(x.k, sizeof(soak_counters) * SOAK_MAX_CLIENTS);
        return -1;
    }
    r->rss_start_kb = proc_kb(x.kvd, "VmRSS");
    if (o->events && ev_start(&x) != 0) {
        ev_stop(&x);
        kill(x.kvd, SIGKILL);
        waitpid(x.kvd, NULL, 0);
        munmap(x.k, sizeof(soak_counters) * SOAK_MAX_CLIENTS);
        return -1;
    }
    /* CPU burners: with every core busy, the daemon and workers are preempted at random points,
     * which is what turned a one-in-six race into a one-in-three failure. */
    pid_t burners[16];
    int nburn = o->busy < 16 ? o->busy : 16;
    for (int i = 0; i < nburn; i++) {
        burners[i] = fork();
        if (burners[i] == 0) {
            volatile uint64_t spin = 0;
            for (;;) {
                spin++;
            }
        }
    }
    uint64_t t0 = now_ms();
    x.deadline_ms = t0 + (uint64_t)o->seconds * 1000u;
    uint64_t warm_at = t0 + (uint64_t)o->seconds * 250u;
    pid_t pids[SOAK_MAX_CLIENTS];
    int alive = 0;
    for (int i = 0; i < o->clients; i++) {
        pids[i] = spawn_worker(&x, i);
        alive += pids[i] > 0;
    }
    int kvd_died = 0;
    while (alive > 0) {
        if (r->rss_warm_kb == 0 && now_ms() >= warm_at) {
            r->rss_warm_kb = proc_kb(x.kvd, "VmRSS");
            r->anon_warm_kb = proc_kb(x.kvd, "RssAnon");
        }
        int st;
        pid_t pid = waitpid(-1, &st, WNOHANG);
        if (pid == 0) {
            kvd_harness_sleep_ms(5);
            continue;
        }
        if (pid < 0) {
            break;
        }
        int burner = 0;
        for (int i = 0; i < nburn; i++) {
            burner |= burners[i] == pid;
        }
        if (burner) {
            continue;
        }
        if (pid == x.kvd) {
            fprintf(stderr, "soak: kvd died during the run (status %d)\n", st);
            x.kvd = 0;
            kvd_died = 1;
            x.deadline_ms = 0;
            continue;
        }
        int slot = -1;
        for (int i = 0; i < o->clients; i++) {
            if (pids[i] == pid) {
                slot = i;
            }
        }
        if (slot < 0) {
            continue;
        }
        alive--;
        pids[slot] = 0;
        if (WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL && x.k[slot].dying) {
            r->deaths++;
        } else if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            fprintf(stderr, "soak: worker %d died: status 0x%x\n", slot, st);
            r->crashes++;
        }
        if (!kvd_died && now_ms() + 100 < x.deadline_ms) {
            pids[slot] = spawn_worker(&x, slot);
            alive += pids[slot] > 0;
        }
    }
    for (int i = 0; i < nburn; i++) {
        if (burners[i] > 0) {
            kill(burners[i], SIGKILL);
            waitpid(burners[i], NULL, 0);
        }
    }
    for (int i = 0; i < o->clients; i++) {
        soak_counters *k = &x.k[i];
        r->ops += k->ops;
        r->requests += k->requests;
        r->lookups += k->lookups;
        r->remote_lookups += k->remote_lookups;
        r->remote_lookup_hits += k->remote_lookup_hits;
        r->hit_blocks += k->hit_blocks;
        r->promoted += k->promoted;
        r->allocated += k->allocated;
        r->committed += k->committed;
        r->duplicates += k->duplicates;
        r->rewinds += k->rewinds;
        r->pins += k->pins;
        r->enospc += k->enospc;
        r->verified += k->verified;
        r->mismatched += k->mismatched;
        r->unmapped += k->unmapped;
        r->cross_domain += k->cross_domain;
        r->unexpected += k->unexpected;
    }
    if (!kvd_died) {
        r->check_failed = check_pools(&x, r) != 0;
        r->rss_end_kb = proc_kb(x.kvd, "VmRSS");
        r->anon_end_kb = proc_kb(x.kvd, "RssAnon");
        r->kvd_status = stop_kvd(&x);
    } else {
        r->check_failed = 1;
    }
    ev_stop(&x); /* after kvd: its stop sends the last batch */
    r->ev_batches = x.ev_batches;
    r->ev_stored = x.ev_stored;
    r->ev_removed = x.ev_removed;
    r->ev_cleared = x.ev_cleared;
    r->ev_gaps = x.ev_gaps;
    r->ev_bad = x.ev_bad;
    r->ev_first = x.ev_first;
    r->ev_last = x.ev_last;
    if (x.redis > 0) {
        kill(x.redis, SIGKILL);
        waitpid(x.redis, NULL, 0);
    }
    munmap(x.k, sizeof(soak_counters) * SOAK_MAX_CLIENTS);
    char path[256];
    for (int t = 0; t < o->tenants; t++) {
        snprintf(path, sizeof(path), "%s/t%d.token", x.dir, t);
        unlink(path);
    }
    snprintf(path, sizeof(path), "%s/tenants", x.dir);
    unlink(path);
    unlink(x.sock);
    snprintf(path, sizeof(path), "%s/admin.sock", x.dir);
    unlink(path);
    if (o->tiers) {
        /* The tier-2 files: one directory per domain under t2/. */
        char cmd[300];
        snprintf(cmd, sizeof(cmd), "rm -rf '%s/t2'", x.dir);
        if (system(cmd) != 0) {
            fprintf(stderr, "soak: could not remove %s/t2\n", x.dir);
        }
    }
    rmdir(x.dir);

    printf("soak: %d s, %d client processes over %d tenants, segments of %s, %d CPU burners, kvd "
           "%s%s\n",
           o->seconds, o->clients, o->tenants, o->seg_size, nburn, o->wrap != NULL ? "under " : "",
           o->wrap != NULL ? o->wrap : "");
    printf("soak: operations %llu cycles, %llu requests (lookups %llu, hit blocks %llu, "
           "allocated %llu, committed %llu, duplicates %llu, rewinds %llu, pins %llu, "
           "ENOSPC %llu)\n",
           (unsigned long long)r->ops, (unsigned long long)r->requests,
           (unsigned long long)r->lookups, (unsigned long long)r->hit_blocks,
           (unsigned long long)r->allocated, (unsigned long long)r->committed,
           (unsigned long long)r->duplicates, (unsigned long long)r->rewinds,
           (unsigned long long)r->pins, (unsigned long long)r->enospc);
    if (o->tiers && o->redis != NULL) {
        printf("soak: tiers on with a remote tier (remote-write %s, redis-server on port %d): %llu "
               "hit blocks came up, %llu remote values read straight into T0, %llu bad; %llu "
               "Lookups asked Redis, which held %llu blocks past their local runs\n",
               o->remote_write != NULL ? o->remote_write : "write-through", x.redis_port,
               (unsigned long long)r->promoted, (unsigned long long)r->remote_direct,
               (unsigned long long)r->remote_bad, (unsigned long long)r->remote_lookups,
               (unsigned long long)r->remote_lookup_hits);
    } else if (o->tiers) {
        printf("soak: tiers on (%s, %s pools): %llu hit blocks came up from tier 1 or 2; %llu T2 "
               "transfers with no copy\n",
               o->tiers == 2 ? "write-through" : "write-back",
               o->block_major ? "block-major" : "layer-major", (unsigned long long)r->promoted,
               (unsigned long long)r->t2_zero_copy);
    }
    printf("soak: faults injected %llu (workers SIGKILLed at a random step)\n",
           (unsigned long long)r->deaths);
    printf("soak: blocks verified %llu: bytes mismatched %llu (of which unmapped %llu), "
           "cross-domain hits %llu\n",
           (unsigned long long)r->verified, (unsigned long long)r->mismatched,
           (unsigned long long)r->unmapped, (unsigned long long)r->cross_domain);
    printf("soak: blocks leaked %llu of %llu%s\n", (unsigned long long)r->leaked,
           (unsigned long long)r->blocks_total, r->check_failed ? " (CHECK FAILED)" : "");
    printf("soak: kvd RSS start %llu KiB, after 1/4 of the run %llu KiB, end %llu KiB; "
           "anonymous %llu -> %llu KiB (growth %lld KiB)\n",
           (unsigned long long)r->rss_start_kb, (unsigned long long)r->rss_warm_kb,
           (unsigned long long)r->rss_end_kb, (unsigned long long)r->anon_warm_kb,
           (unsigned long long)r->anon_end_kb,
           (long long)r->anon_end_kb - (long long)r->anon_warm_kb);
    int ev_ok = 1;
    if (o->events) {
        ev_ok = r->ev_gaps == 0 && r->ev_bad == 0 && r->ev_batches > 0 && r->ev_stored > 0 &&
                r->ev_published > 0 && r->ev_last + 1 >= r->ev_published;
        printf("soak: KV events: %llu batches received, seq %llu..%llu (kvd had published %llu "
               "when the workers were gone; missing in sequence %llu, malformed or out of order "
               "%llu), %llu BlockStored, %llu BlockRemoved, %llu AllBlocksCleared%s\n",
               (unsigned long long)r->ev_batches, (unsigned long long)r->ev_first,
               (unsigned long long)r->ev_last, (unsigned long long)r->ev_published,
               (unsigned long long)r->ev_gaps, (unsigned long long)r->ev_bad,
               (unsigned long long)r->ev_stored, (unsigned long long)r->ev_removed,
               (unsigned long long)r->ev_cleared, ev_ok ? "" : " (CHECK FAILED)");
    }
    printf("soak: unexpected errors %llu, worker crashes %llu, kvd exit status %d\n",
           (unsigned long long)r->unexpected, (unsigned long long)r->crashes, r->kvd_status);
    int ok = r->leaked == 0 && r->mismatched == 0 && r->cross_domain == 0 && r->unexpected == 0 &&
             r->crashes == 0 && r->kvd_status == 0 && !r->check_failed && r->ops > 0 && ev_ok;
    printf("soak: %s\n", ok ? "PASS" : "FAIL");
    fflush(stdout);
    return ok ? 0 : -1;
}
