/* fake_kvd: see fake_kvd.h. One server thread, blocking I/O, a wake-up pipe to stop it. The
 * counters are read by the test thread after a reply arrived, so the socket orders them;
 * atomics keep TSan quiet all the same. */
#include "client/testing/fake_kvd.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "common/kv_layout.h"
#include "common/kv_wire.h"

#define MAX_BLOCKS 4096
#define MAX_SEGS 64

typedef struct fblock {
    int state;       /* 0 free, 1 writing, 2 committed */
    uint32_t gen;    /* generation */
    uint32_t refs;   /* references */
    uint64_t lo, hi; /* hash when committed */
} fblock;

struct fake_kvd {
    fake_kvd_config cfg;
    char dir[64];
    char path[108];
    int lfd;
    int wake[2];
    pthread_t thread;
    int running;
    /* pool state (one pool) */
    int attached;
    kv_layout layout;
    uint32_t nsegs;
    int segfd[MAX_SEGS];
    uint64_t segbytes;
    fblock blocks[MAX_BLOCKS];
    _Atomic uint32_t refs;
    _Atomic uint32_t writing;
    _Atomic uint64_t requests;
    uint64_t session;
};

const char *fake_kvd_path(const fake_kvd *f) {
    return f->path;
}
uint32_t fake_kvd_refs(const fake_kvd *f) {
    return atomic_load(&f->refs);
}
uint32_t fake_kvd_writing(const fake_kvd *f) {
    return atomic_load(&f->writing);
}
uint32_t fake_kvd_segments(const fake_kvd *f) {
    return f->nsegs;
}
uint64_t fake_kvd_requests(const fake_kvd *f) {
    return atomic_load(&f->requests);
}

static int send_all(int fd, const uint8_t *buf, size_t len, const int *fds, size_t nfds) {
    size_t off = 0;
    while (off < len) {
        struct iovec iov = {.iov_base = (void *)(buf + off), .iov_len = len - off};
        struct msghdr msg = {0};
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        union {
            char b[CMSG_SPACE(MAX_SEGS * sizeof(int))];
            struct cmsghdr a;
        } ctl;
        if (off == 0 && nfds > 0) {
            msg.msg_control = ctl.b;
            msg.msg_controllen = CMSG_SPACE(nfds * sizeof(int));
            struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
            cm->cmsg_level = SOL_SOCKET;
            cm->cmsg_type = SCM_RIGHTS;
            cm->cmsg_len = CMSG_LEN(nfds * sizeof(int));
            memcpy(CMSG_DATA(cm), fds, nfds * sizeof(int));
        }
        ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (n <= 0) {
            return -1;
        }
        off += (size_t)n;
    }
    return 0;
}

static int reply(fake_kvd *f, int fd, Kvd__Envelope *env, uint64_t id, const int *fds,
                 size_t nfds) {
    env->id = id;
    env->boot_epoch = f->cfg.epoch;
    uint8_t *buf;
    size_t len;
    if (kv_wire_encode(env, 1u << 24, &buf, &len) != KV_OK) {
        return -1;
    }
    int rc = send_all(fd, buf, len, fds, nfds);
    free(buf);
    return rc;
}

static int reply_error(fake_kvd *f, int fd, uint64_t id, kv_err code, const char *msg) {
    Kvd__Error e = KVD__ERROR__INIT;
    e.code = (Kvd__ErrorCode)code;
    e.message = (char *)msg;
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    env.body_case = KVD__ENVELOPE__BODY_ERROR;
    env.error = &e;
    return reply(f, fd, &env, id, NULL, 0);
}

static int grow(fake_kvd *f) {
    if (f->nsegs >= f->cfg.max_segments || f->nsegs >= MAX_SEGS ||
        (f->nsegs + 1) * f->cfg.blocks_per_segment > MAX_BLOCKS) {
        return -1;
    }
    int fd = memfd_create("fake-kvd-seg", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)f->segbytes) < 0) {
        return -1;
    }
    f->segfd[f->nsegs++] = fd;
    return 0;
}

static int fill_refs(Kvd__BlockRef **ptrs, Kvd__BlockRef *refs, fake_kvd *f, const uint32_t *ids,
                     size_t n) {
    for (size_t i = 0; i < n; i++) {
        kvd__block_ref__init(&refs[i]);
        refs[i].id = ids[i];
        refs[i].gen = f->blocks[ids[i]].gen;
        ptrs[i] = &refs[i];
    }
    return 0;
}

static void drop_ref(fake_kvd *f, uint32_t id) {
    fblock *b = &f->blocks[id];
    if (b->refs > 0) {
        b->refs--;
        atomic_fetch_sub(&f->refs, 1);
    }
    if (b->state == 1) {
        b->state = 0;
        b->gen++;
        atomic_fetch_sub(&f->writing, 1);
    }
}

/* Checks a block list; returns 0 or replies with the error. */
static int check_refs(fake_kvd *f, Kvd__BlockRef **refs, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t id = refs[i]->id;
        if (id >= f->nsegs * f->cfg.blocks_per_segment) {
            return KV_ENOENT;
        }
        if (refs[i]->gen != f->blocks[id].gen) {
            return KV_ESTALE;
        }
        if (f->blocks[id].refs == 0) {
            return KV_EPERM;
        }
    }
    return 0;
}

static int handle(fake_kvd *f, int cfd, Kvd__Envelope *req) {
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    uint64_t id = req->id;
    atomic_fetch_add(&f->requests, 1);
    if (req->boot_epoch != 0 && req->boot_epoch != f->cfg.epoch) {
        return reply_error(f, cfd, id, KV_EEPOCH, "epoch");
    }
    uint32_t total = f->nsegs * f->cfg.blocks_per_segment;
    switch (req->body_case) {
        case KVD__ENVELOPE__BODY_HELLO: {
            Kvd__HelloReply r = KVD__HELLO_REPLY__INIT;
            r.session_id = ++f->session;
            r.tenant = "test";
            r.boot_epoch = f->cfg.epoch;
            r.protocol_version = 1;
            r.max_frame_bytes = 1u << 20;
            r.max_inflight = 64;
            r.max_blocks_per_request = f->cfg.max_blocks;
            env.body_case = KVD__ENVELOPE__BODY_HELLO_REPLY;
            env.hello_reply = &r;
            return reply(f, cfd, &env, id, NULL, 0);
        }
        case KVD__ENVELOPE__BODY_ATTACH_POOL: {
            const Kvd__Layout *l = req->attach_pool->layout;
            kv_layout lay;
            if (l == NULL ||
                kv_layout_init(l->num_layers, l->num_kv_heads, l->head_dim, l->tokens_per_block,
                               (kv_dtype)l->dtype, (kv_arrangement)l->arrangement, &lay) != KV_OK) {
                return reply_error(f, cfd, id, KV_EINVAL, "bad layout");
            }
            if (!f->attached) {
                f->layout = lay;
                uint64_t b = kv_layout_segment_bytes(&lay, f->cfg.blocks_per_segment);
                f->segbytes = (b + 4095) / 4096 * 4096;
                for (uint32_t i = 0; i < f->cfg.initial_segments; i++) {
                    if (grow(f) != 0) {
                        return reply_error(f, cfd, id, KV_ESYS, "memfd");
                    }
                }
                f->attached = 1;
            }
            Kvd__Layout rl = *l;
            rl.block_bytes = f->layout.block_bytes;
            Kvd__Hash128 seed = KVD__HASH128__INIT;
            seed.lo = 0x1234;
            seed.hi = 0x5678;
            Kvd__AttachPoolReply r = KVD__ATTACH_POOL_REPLY__INIT;
            r.pool_id = 7;
            r.layout = &rl;
            r.blocks_per_segment = f->cfg.blocks_per_segment;
            r.hash_seed = &seed;
            r.hash_algo = 1;
            r.max_segments = f->cfg.max_segments;
            env.body_case = KVD__ENVELOPE__BODY_ATTACH_POOL_REPLY;
            env.attach_pool_reply = &r;
            uint32_t nseg = f->nsegs;
            if (f->cfg.hide_from != 0 && nseg > f->cfg.hide_from) {
                nseg = f->cfg.hide_from;
            }
            Kvd__Segment *segs = calloc(nseg, sizeof(*segs));
            Kvd__Segment **sp = calloc(nseg, sizeof(*sp));
            int fds[MAX_SEGS];
            for (uint32_t i = 0; i < nseg; i++) {
                kvd__segment__init(&segs[i]);
                segs[i].index = i;
                segs[i].nblocks = f->cfg.blocks_per_segment;
                segs[i].bytes = f->segbytes;
                segs[i].kind = KVD__MEMORY_KIND__HOST_MEMFD;
                segs[i].fd_index = i;
                sp[i] = &segs[i];
                fds[i] = f->segfd[i];
            }
            r.n_segments = nseg;
            r.segments = sp;
            int rc = reply(f, cfd, &env, id, fds, nseg);
            free(segs);
            free(sp);
            return rc;
        }
        case KVD__ENVELOPE__BODY_MAP_SEGMENTS: {
            uint32_t from = req->map_segments->first_index;
            uint32_t upto = f->nsegs;
            if (f->cfg.hide_from != 0 && upto > f->cfg.hide_from) {
                upto = f->cfg.hide_from;
            }
            uint32_t n = from < upto ? upto - from : 0;
            Kvd__Segment *segs = calloc(n ? n : 1, sizeof(*segs));
            Kvd__Segment **sp = calloc(n ? n : 1, sizeof(*sp));
            int fds[MAX_SEGS];
            for (uint32_t i = 0; i < n; i++) {
                kvd__segment__init(&segs[i]);
                segs[i].index = from + i;
                segs[i].nblocks = f->cfg.blocks_per_segment;
                segs[i].bytes = f->segbytes;
                segs[i].kind = KVD__MEMORY_KIND__HOST_MEMFD;
                segs[i].fd_index = i;
                sp[i] = &segs[i];
                fds[i] = f->segfd[from + i];
            }
            Kvd__MapSegmentsReply r = KVD__MAP_SEGMENTS_REPLY__INIT;
            r.n_segments = n;
            r.segments = sp;
            env.body_case = KVD__ENVELOPE__BODY_MAP_SEGMENTS_REPLY;
            env.map_segments_reply = &r;
            int rc = reply(f, cfd, &env, id, fds, n);
            free(segs);
            free(sp);
            return rc;
        }
        case KVD__ENVELOPE__BODY_ALLOCATE: {
            uint32_t count = req->allocate->count;
            if (count == 0) {
                return reply_error(f, cfd, id, KV_EINVAL, "count 0");
            }
            if (count > f->cfg.max_blocks) {
                return reply_error(f, cfd, id, KV_ETOOBIG, "too many");
            }
            uint32_t grown_from = 0;
            uint32_t nfree = 0;
            for (uint32_t i = 0; i < total; i++) {
                nfree += f->blocks[i].state == 0;
            }
            while (nfree < count) {
                uint32_t before = f->nsegs;
                if (grow(f) != 0) {
                    return reply_error(f, cfd, id, KV_ENOSPC, "asked more than could be had");
                }
                if (grown_from == 0) {
                    grown_from = before;
                }
                nfree += f->cfg.blocks_per_segment;
                total += f->cfg.blocks_per_segment;
            }
            uint32_t ids[MAX_BLOCKS];
            uint32_t k = 0;
            for (uint32_t i = 0; i < total && k < count; i++) {
                if (f->blocks[i].state == 0) {
                    f->blocks[i].state = 1;
                    f->blocks[i].refs = 1;
                    atomic_fetch_add(&f->refs, 1);
                    atomic_fetch_add(&f->writing, 1);
                    ids[k++] = i;
                }
            }
            Kvd__BlockRef *refs = calloc(count, sizeof(*refs));
            Kvd__BlockRef **ptrs = calloc(count, sizeof(*ptrs));
            fill_refs(ptrs, refs, f, ids, count);
            Kvd__AllocateReply r = KVD__ALLOCATE_REPLY__INIT;
            r.n_blocks = count;
            r.blocks = ptrs;
            r.new_segments_from =
                f->cfg.hide_from != 0 && grown_from >= f->cfg.hide_from ? 0 : grown_from;
            env.body_case = KVD__ENVELOPE__BODY_ALLOCATE_REPLY;
            env.allocate_reply = &r;
            int rc = reply(f, cfd, &env, id, NULL, 0);
            free(refs);
            free(ptrs);
            return rc;
        }
        case KVD__ENVELOPE__BODY_LOOKUP: {
            size_t n = req->lookup->n_hashes;
            uint32_t ids[MAX_BLOCKS];
            size_t k = 0;
            for (; k < n; k++) {
                const Kvd__Hash128 *h = req->lookup->hashes[k];
                uint32_t i = 0;
                for (; i < total; i++) {
                    if (f->blocks[i].state == 2 && f->blocks[i].lo == h->lo &&
                        f->blocks[i].hi == h->hi) {
                        break;
                    }
                }
                if (i == total) {
                    break;
                }
                ids[k] = i;
                f->blocks[i].refs++;
                atomic_fetch_add(&f->refs, 1);
            }
            Kvd__BlockRef *refs = calloc(k ? k : 1, sizeof(*refs));
            Kvd__BlockRef **ptrs = calloc(k ? k : 1, sizeof(*ptrs));
            fill_refs(ptrs, refs, f, ids, k);
            Kvd__LookupReply r = KVD__LOOKUP_REPLY__INIT;
            r.n_blocks = k;
            r.blocks = ptrs;
            env.body_case = KVD__ENVELOPE__BODY_LOOKUP_REPLY;
            env.lookup_reply = &r;
            int rc = reply(f, cfd, &env, id, NULL, 0);
            free(refs);
            free(ptrs);
            return rc;
        }
        case KVD__ENVELOPE__BODY_COMMIT: {
            size_t n = req->commit->n_entries;
            for (size_t i = 0; i < n; i++) {
                const Kvd__CommitEntry *e = req->commit->entries[i];
                Kvd__BlockRef *one = e->block;
                int err = check_refs(f, &one, 1);
                if (err == 0 && f->blocks[one->id].state != 1) {
                    err = KV_ESTATE;
                }
                if (err != 0) {
                    return reply_error(f, cfd, id, err, "bad commit");
                }
            }
            uint32_t ids[MAX_BLOCKS];
            for (size_t i = 0; i < n; i++) {
                const Kvd__CommitEntry *e = req->commit->entries[i];
                uint32_t bid = e->block->id;
                uint32_t dup = UINT32_MAX;
                for (uint32_t j = 0; j < total; j++) {
                    if (f->blocks[j].state == 2 && f->blocks[j].lo == e->hash->lo &&
                        f->blocks[j].hi == e->hash->hi) {
                        dup = j;
                        break;
                    }
                }
                if (dup != UINT32_MAX) {
                    drop_ref(f, bid);
                    f->blocks[dup].refs++;
                    atomic_fetch_add(&f->refs, 1);
                    ids[i] = dup;
                } else {
                    f->blocks[bid].state = 2;
                    f->blocks[bid].lo = e->hash->lo;
                    f->blocks[bid].hi = e->hash->hi;
                    atomic_fetch_sub(&f->writing, 1);
                    ids[i] = bid;
                }
            }
            Kvd__BlockRef *refs = calloc(n ? n : 1, sizeof(*refs));
            Kvd__BlockRef **ptrs = calloc(n ? n : 1, sizeof(*ptrs));
            fill_refs(ptrs, refs, f, ids, n);
            Kvd__CommitReply r = KVD__COMMIT_REPLY__INIT;
            r.n_canonical = n;
            r.canonical = ptrs;
            env.body_case = KVD__ENVELOPE__BODY_COMMIT_REPLY;
            env.commit_reply = &r;
            int rc = reply(f, cfd, &env, id, NULL, 0);
            free(refs);
            free(ptrs);
            return rc;
        }
        case KVD__ENVELOPE__BODY_RELEASE:
        case KVD__ENVELOPE__BODY_REWIND: {
            int rel = req->body_case == KVD__ENVELOPE__BODY_RELEASE;
            Kvd__BlockRef **refs = rel ? req->release->blocks : req->rewind->blocks;
            size_t n = rel ? req->release->n_blocks : req->rewind->n_blocks;
            int err = check_refs(f, refs, n);
            if (err != 0) {
                return reply_error(f, cfd, id, err, "bad release");
            }
            for (size_t i = 0; i < n; i++) {
                drop_ref(f, refs[i]->id);
            }
            Kvd__ReleaseReply r1 = KVD__RELEASE_REPLY__INIT;
            Kvd__RewindReply r2 = KVD__REWIND_REPLY__INIT;
            if (rel) {
                env.body_case = KVD__ENVELOPE__BODY_RELEASE_REPLY;
                env.release_reply = &r1;
            } else {
                env.body_case = KVD__ENVELOPE__BODY_REWIND_REPLY;
                env.rewind_reply = &r2;
            }
            return reply(f, cfd, &env, id, NULL, 0);
        }
        case KVD__ENVELOPE__BODY_STATS: {
            Kvd__Stat s1 = KVD__STAT__INIT, s2 = KVD__STAT__INIT;
            s1.name = "session.refs_held";
            s1.value = atomic_load(&f->refs);
            s2.name = "pool.blocks_writing";
            s2.value = atomic_load(&f->writing);
            Kvd__Stat *sp[2] = {&s1, &s2};
            Kvd__StatsReply r = KVD__STATS_REPLY__INIT;
            r.n_stats = 2;
            r.stats = sp;
            env.body_case = KVD__ENVELOPE__BODY_STATS_REPLY;
            env.stats_reply = &r;
            return reply(f, cfd, &env, id, NULL, 0);
        }
        case KVD__ENVELOPE__BODY_PING: {
            Kvd__Pong r = KVD__PONG__INIT;
            r.nonce = req->ping->nonce;
            r.payload = req->ping->payload;
            env.body_case = KVD__ENVELOPE__BODY_PONG;
            env.pong = &r;
            return reply(f, cfd, &env, id, NULL, 0);
        }
        default:
            return reply_error(f, cfd, id, KV_EPROTO, "unsupported by the fake");
    }
}

/* Drops every reference of a closed session, as the daemon does. */
static void session_end(fake_kvd *f) {
    for (uint32_t i = 0; i < f->nsegs * f->cfg.blocks_per_segment; i++) {
        while (f->blocks[i].refs > 0) {
            drop_ref(f, i);
        }
    }
}

static void serve(fake_kvd *f, int cfd) {
    uint8_t *buf = malloc(1u << 21);
    size_t len = 0;
    for (;;) {
        struct pollfd p[2] = {{.fd = cfd, .events = POLLIN}, {.fd = f->wake[0], .events = POLLIN}};
        if (poll(p, 2, -1) < 0 && errno != EINTR) {
            break;
        }
        if (p[1].revents) {
            break;
        }
        ssize_t n = recv(cfd, buf + len, (1u << 21) - len, 0);
        if (n <= 0) {
            break;
        }
        len += (size_t)n;
        size_t off = 0;
        for (;;) {
            Kvd__Envelope *env;
            size_t used;
            if (kv_wire_decode(buf + off, len - off, 1u << 20, &env, &used) != KV_OK) {
                goto out;
            }
            if (env == NULL) {
                break;
            }
            off += used;
            int rc = handle(f, cfd, env);
            kv_wire_free(env);
            if (rc != 0) {
                goto out;
            }
        }
        memmove(buf, buf + off, len - off);
        len -= off;
    }
out:
    session_end(f);
    free(buf);
}

static void *run(void *arg) {
    fake_kvd *f = arg;
    for (;;) {
        struct pollfd p[2] = {{.fd = f->lfd, .events = POLLIN},
                              {.fd = f->wake[0], .events = POLLIN}};
        if (poll(p, 2, -1) < 0 && errno != EINTR) {
            break;
        }
        if (p[1].revents) {
            break;
        }
        int cfd = accept(f->lfd, NULL, NULL);
        if (cfd < 0) {
            continue;
        }
        serve(f, cfd);
        close(cfd);
    }
    return NULL;
}

static int listen_start(fake_kvd *f) {
    f->lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", f->path);
    unlink(f->path);
    if (f->lfd < 0 || bind(f->lfd, (struct sockaddr *)&sa, sizeof(sa)) < 0 ||
        listen(f->lfd, 16) < 0 || pipe(f->wake) < 0) {
        return -1;
    }
    if (pthread_create(&f->thread, NULL, run, f) != 0) {
        return -1;
    }
    f->running = 1;
    return 0;
}

int fake_kvd_start(const fake_kvd_config *cfg, fake_kvd **out) {
    fake_kvd *f = calloc(1, sizeof(*f));
    if (f == NULL) {
        return -1;
    }
    f->cfg = *cfg;
    snprintf(f->dir, sizeof(f->dir), "/tmp/fake-kvd-XXXXXX");
    if (mkdtemp(f->dir) == NULL) {
        free(f);
        return -1;
    }
    snprintf(f->path, sizeof(f->path), "%s/kvd.sock", f->dir);
    if (listen_start(f) != 0) {
        fake_kvd_stop(f);
        return -1;
    }
    *out = f;
    return 0;
}

static void halt(fake_kvd *f) {
    if (f->running) {
        (void)!write(f->wake[1], "x", 1);
        pthread_join(f->thread, NULL);
        f->running = 0;
        close(f->wake[0]);
        close(f->wake[1]);
    }
    if (f->lfd >= 0) {
        close(f->lfd);
        f->lfd = -1;
    }
    for (uint32_t i = 0; i < f->nsegs; i++) {
        close(f->segfd[i]);
    }
    f->nsegs = 0;
    f->attached = 0;
    memset(f->blocks, 0, sizeof(f->blocks));
    atomic_store(&f->refs, 0);
    atomic_store(&f->writing, 0);
}

int fake_kvd_restart(fake_kvd *f, uint64_t epoch) {
    halt(f);
    f->cfg.epoch = epoch;
    return listen_start(f);
}

void fake_kvd_stop(fake_kvd *f) {
    if (f == NULL) {
        return;
    }
    halt(f);
    unlink(f->path);
    rmdir(f->dir);
    free(f);
}
