/* tenancy_test: multi-tenancy on a real server (temp socket, its own loop thread) driven with
 * raw kv_wire frames. Tenants are real identities the server proves: tokens from token files,
 * and a forked child that setuid()s to another uid. Checks: different tenants never hit each
 * other's blocks nor reach them by id; group members hit; the commons fills only after
 * min-tenants tenants committed and is mapped read-only; quotas refuse with KV_EQUOTA; a flood
 * cannot push a tenant below its guarantee; the isolation self-test passes on a live server. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <uv.h>

#include "common/kv_layout.h"
#include "common/kv_log.h"
#include "common/kv_wire.h"
#include "daemon/config/config.h"
#include "daemon/tenancy/quota.h"
#include "daemon/ops/selftest.h"
#include "daemon/app/daemon.h"
#include "daemon/testing/raw_client.h"

typedef struct harness {
    kvd_test_server ts; /* the server; its dir also holds the tenants file and tokens */
    kv_err selftest_rc; /* on_loop's verdict where it runs the self-test */
    char report[2048];  /* its report */
} harness;

static harness *cur; /* the running harness, for on_loop hooks */

/* pool-memory for `segs` segments over `pools` pools of the small layout with start()'s 64 KiB
 * segments: each segment costs its 64 KiB and its 128 block records (64 bytes each), each pool
 * its own metadata (KVD_POOL_META_BASE at most). */
#define BUDGET(segs, pools) ((segs) * ((64u << 10) + 128u * 64u) + (pools)*KVD_POOL_META_BASE)

static void write_file(const char *dir, const char *name, const char *text) {
    char path[256];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

/* Token of tenant name: 32 bytes derived from the name. */
static void token_of(const char *name, char *out) {
    snprintf(out, 40, "tok-%s-0123456789abcdef0123456789", name);
    out[32] = '\0';
}

static int start_vllm; /* the next start() runs hash-mode vllm */
static int cur_vllm;   /* the running server does: Commits carry 32-byte digests */

/* Starts a server whose tenants file is `lines`, after giving each of names[] a token file
 * ("%T" in lines is replaced by the directory). */
static harness *start(const char *lines, const char *const *names, size_t nnames,
                      uint64_t pool_memory, void (*on_loop)(kvd_daemon *)) {
    harness *h = calloc(1, sizeof(*h));
    assert_non_null(h);
    kvd_test_server_init(&h->ts, "tenancy-test");
    assert_int_equal(chmod(h->ts.dir, 0755), 0); /* the setuid child dials the socket too */
    for (size_t i = 0; i < nnames; i++) {
        char tok[40], file[80];
        token_of(names[i], tok);
        snprintf(file, sizeof(file), "%s.token", names[i]);
        strcat(tok, "\n"); /* a trailing newline is cut */
        write_file(h->ts.dir, file, tok);
    }
    char text[4096];
    size_t o = 0;
    for (const char *p = lines; *p != '\0' && o + 80 < sizeof(text); p++) {
        if (p[0] == '%' && p[1] == 'T') {
            o += (size_t)snprintf(text + o, sizeof(text) - o, "%s", h->ts.dir);
            p++;
        } else {
            text[o++] = *p;
        }
    }
    text[o] = '\0';
    write_file(h->ts.dir, "tenants", text);
    snprintf(h->ts.cfg.tenants_file, sizeof(h->ts.cfg.tenants_file), "%s/tenants", h->ts.dir);
    h->ts.cfg.socket_mode = 0666; /* the setuid child connects too */
    h->ts.cfg.pool_memory = pool_memory;
    h->ts.cfg.segment_bytes = 64 << 10;
    h->ts.cfg.index_entries = 4096;
    h->ts.cfg.log_level = KV_LOG_WARN;
    cur_vllm = start_vllm;
    if (start_vllm) {
        snprintf(h->ts.cfg.hash_mode, sizeof(h->ts.cfg.hash_mode), "vllm");
        snprintf(h->ts.cfg.vllm_hash_seed, sizeof(h->ts.cfg.vllm_hash_seed), "7");
    }
    h->ts.on_loop = on_loop;
    cur = h;
    kvd_test_server_start(&h->ts);
    return h;
}

static void stop(harness *h) {
    kvd_test_server_stop(&h->ts);
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", h->ts.dir);
    assert_int_equal(system(cmd), 0);
    free(h);
}

static int dial(harness *h) {
    return kvd_raw_dial(h->ts.cfg.socket);
}

/* Sends req with a new id; returns the reply (fds closed). */
static Kvd__Envelope *rpc(int fd, Kvd__Envelope *req) {
    req->id = kvd_raw_next_id();
    return kvd_raw_rpc(fd, req);
}

static void expect_code(Kvd__Envelope *r, kv_err code, const char *needle) {
    if (code == KV_OK) {
        if (r->body_case == KVD__ENVELOPE__BODY_ERROR) {
            fail_msg("expected success, got %s: %s", kv_err_name(r->error->code),
                     r->error->message);
        }
    } else {
        if (r->body_case != KVD__ENVELOPE__BODY_ERROR) {
            fail_msg("expected %s, got body %d", kv_err_name(code), r->body_case);
        }
        if ((int)r->error->code != (int)code) {
            fail_msg("expected %s, got %s: %s", kv_err_name(code), kv_err_name(r->error->code),
                     r->error->message);
        }
        if (needle != NULL && strstr(r->error->message, needle) == NULL) {
            fail_msg("message '%s' does not name '%s'", r->error->message, needle);
        }
    }
    kv_wire_free(r);
}

/* Hello with the token of `name` (NULL: no token); expect code; *tenant_out gets the tenant. */
static int hello_as(harness *h, const char *name, kv_err code, char *tenant_out, size_t *ndomains) {
    int fd = dial(h);
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Hello hl = KVD__HELLO__INIT;
    char tok[40];
    hl.protocol_version = 1;
    hl.client_name = "tenancy_test";
    if (name != NULL) {
        token_of(name, tok);
        hl.token.data = (uint8_t *)tok;
        hl.token.len = strlen(tok);
    }
    e.body_case = KVD__ENVELOPE__BODY_HELLO;
    e.hello = &hl;
    Kvd__Envelope *r = rpc(fd, &e);
    if (code == KV_OK && r->body_case == KVD__ENVELOPE__BODY_HELLO_REPLY) {
        if (tenant_out != NULL) {
            snprintf(tenant_out, 64, "%s", r->hello_reply->tenant);
        }
        if (ndomains != NULL) {
            *ndomains = r->hello_reply->n_domains;
        }
    }
    expect_code(r, code, NULL);
    return fd;
}

static int connect_as(harness *h, const char *name) {
    return hello_as(h, name, KV_OK, NULL, NULL);
}

typedef struct att {
    uint32_t pool_id;       /* private pool */
    uint32_t bps;           /* blocks per segment */
    uint32_t nlinked;       /* linked pools */
    uint32_t linked[4];     /* their ids */
    int linked_ro[4];       /* their read_only */
    char linked_dom[4][64]; /* their domain names */
    uint8_t *base;          /* our mapping of segment 0 of the private pool */
    uint64_t seg_bytes;     /* its size */
    kv_layout layout;       /* the layout */
} att;

/* AttachPool of model; with map_linked, then MapSegments{linked pool, 0} of each linked pool,
 * as a client must before it uses one (PROTOCOL.md §6). */
static att attach_ex(int fd, const char *model, int map_linked) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__AttachPool a = KVD__ATTACH_POOL__INIT;
    Kvd__Layout l = KVD__LAYOUT__INIT;
    kvd_raw_fill_layout(&l);
    a.model_id = (char *)model;
    a.layout = &l;
    e.id = kvd_raw_next_id();
    e.body_case = KVD__ENVELOPE__BODY_ATTACH_POOL;
    e.attach_pool = &a;
    kvd_raw_send_env(fd, &e);
    int fds[200];
    size_t nfds;
    Kvd__Envelope *r = kvd_raw_recv_env_fds(fd, fds, &nfds);
    assert_non_null(r);
    if (r->body_case == KVD__ENVELOPE__BODY_ERROR) {
        fail_msg("attach: %s", r->error->message);
    }
    Kvd__AttachPoolReply *ar = r->attach_pool_reply;
    att at;
    memset(&at, 0, sizeof(at));
    at.pool_id = ar->pool_id;
    at.bps = ar->blocks_per_segment;
    at.seg_bytes = ar->segments[0]->bytes;
    assert_false(ar->segments[0]->read_only);
    assert_true(ar->n_linked <= 4);
    at.nlinked = (uint32_t)ar->n_linked;
    for (size_t i = 0; i < ar->n_linked; i++) {
        at.linked[i] = ar->linked[i]->pool_id;
        at.linked_ro[i] = ar->linked[i]->read_only;
        snprintf(at.linked_dom[i], sizeof(at.linked_dom[i]), "%s", ar->linked[i]->domain);
    }
    assert_int_equal(kv_layout_init(2, 2, 8, 4, KV_DTYPE_FP16, KV_LAYER_MAJOR, &at.layout), KV_OK);
    at.base = mmap(NULL, at.seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                   fds[ar->segments[0]->fd_index], 0);
    assert_true(at.base != MAP_FAILED);
    for (size_t i = 0; i < nfds; i++) {
        close(fds[i]);
    }
    kv_wire_free(r);
    for (uint32_t i = 0; map_linked && i < at.nlinked; i++) {
        assert_true(kvd_raw_map_segments(fd, at.linked[i], 0) >= 1);
    }
    return at;
}

static att attach(int fd, const char *model) {
    return attach_ex(fd, model, 1);
}

/* Allocates n blocks in pool; expect code; writes handles. */
static void allocate(int fd, uint32_t pool, uint32_t n, kv_err code, const char *needle,
                     Kvd__BlockRef *out) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Allocate a = KVD__ALLOCATE__INIT;
    a.pool_id = pool;
    a.count = n;
    e.body_case = KVD__ENVELOPE__BODY_ALLOCATE;
    e.allocate = &a;
    Kvd__Envelope *r = rpc(fd, &e);
    if (code == KV_OK && r->body_case == KVD__ENVELOPE__BODY_ALLOCATE_REPLY) {
        assert_int_equal(r->allocate_reply->n_blocks, n);
        for (uint32_t i = 0; i < n; i++) {
            kvd__block_ref__init(&out[i]);
            out[i].id = r->allocate_reply->blocks[i]->id;
            out[i].gen = r->allocate_reply->blocks[i]->gen;
        }
    }
    expect_code(r, code, needle);
}

static Kvd__Hash128 hash_of(uint64_t salt, size_t i) {
    Kvd__Hash128 h = KVD__HASH128__INIT;
    h.lo = salt * 1000 + i;
    h.hi = 0x7e4a4c1ull;
    return h;
}

/* Commits blocks[0..n) as a prefix with hashes hash_of(salt, i). */
static void commit(int fd, uint32_t pool, Kvd__BlockRef *blocks, size_t n, uint64_t salt,
                   kv_err code) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Commit c = KVD__COMMIT__INIT;
    Kvd__CommitEntry ent[64];
    Kvd__CommitEntry *pe[64];
    Kvd__Hash128 h[64];
    Kvd__BlockRef br[64];
    uint8_t full[64][32]; /* hash-mode vllm: the digest, the hash its first 16 bytes */
    assert_true(n <= 64);
    for (size_t i = 0; i < n; i++) {
        kvd__commit_entry__init(&ent[i]);
        kvd__block_ref__init(&br[i]);
        br[i] = blocks[i];
        kvd__block_ref__init(&br[i]);
        br[i].id = blocks[i].id;
        br[i].gen = blocks[i].gen;
        h[i] = hash_of(salt, i);
        ent[i].block = &br[i];
        ent[i].hash = &h[i];
        ent[i].parent = i == 0 ? UINT32_MAX : blocks[i - 1].id;
        if (cur_vllm) {
            for (int b = 0; b < 8; b++) {
                full[i][b] = (uint8_t)(h[i].lo >> (8 * b));
                full[i][8 + b] = (uint8_t)(h[i].hi >> (8 * b));
            }
            memset(full[i] + 16, 0x5a, 16);
            ent[i].hash_full.data = full[i];
            ent[i].hash_full.len = 32;
        }
        pe[i] = &ent[i];
    }
    c.pool_id = pool;
    c.n_entries = n;
    c.entries = pe;
    e.body_case = KVD__ENVELOPE__BODY_COMMIT;
    e.commit = &c;
    Kvd__Envelope *r = rpc(fd, &e);
    if (r->body_case == KVD__ENVELOPE__BODY_COMMIT_REPLY) {
        /* A duplicate moved our reference to the block that already held the hash. */
        for (size_t i = 0; i < n; i++) {
            blocks[i].id = r->commit_reply->canonical[i]->id;
            blocks[i].gen = r->commit_reply->canonical[i]->gen;
        }
    }
    expect_code(r, code, NULL);
}

/* Releases (or pins, with pin=1) blocks; expect code. */
static void release_or_pin(int fd, uint32_t pool, Kvd__BlockRef *blocks, size_t n, int pin,
                           kv_err code, const char *needle) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Release rl = KVD__RELEASE__INIT;
    Kvd__Pin pn = KVD__PIN__INIT;
    Kvd__BlockRef *pv[64];
    assert_true(n <= 64);
    for (size_t i = 0; i < n; i++) {
        pv[i] = &blocks[i];
    }
    if (pin) {
        pn.pool_id = pool;
        pn.n_blocks = n;
        pn.blocks = pv;
        pn.retention_ms = 60000;
        e.body_case = KVD__ENVELOPE__BODY_PIN;
        e.pin = &pn;
    } else {
        rl.pool_id = pool;
        rl.n_blocks = n;
        rl.blocks = pv;
        e.body_case = KVD__ENVELOPE__BODY_RELEASE;
        e.release = &rl;
    }
    expect_code(rpc(fd, &e), code, needle);
}

/* Looks up hash_of(salt, 0..n); returns hits, their handles and (search) their pools. */
static size_t lookup(int fd, uint32_t pool, uint64_t salt, size_t n, int search, Kvd__BlockRef *out,
                     uint32_t *pools) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Lookup lk = KVD__LOOKUP__INIT;
    Kvd__Hash128 h[64];
    Kvd__Hash128 *ph[64];
    assert_true(n <= 64);
    for (size_t i = 0; i < n; i++) {
        h[i] = hash_of(salt, i);
        ph[i] = &h[i];
    }
    lk.pool_id = pool;
    lk.n_hashes = n;
    lk.hashes = ph;
    lk.search_domains = search;
    e.body_case = KVD__ENVELOPE__BODY_LOOKUP;
    e.lookup = &lk;
    Kvd__Envelope *r = rpc(fd, &e);
    if (r->body_case != KVD__ENVELOPE__BODY_LOOKUP_REPLY) {
        fail_msg("lookup: %s", r->error->message);
    }
    size_t k = r->lookup_reply->n_blocks;
    assert_int_equal(r->lookup_reply->n_pool_ids, search ? k : 0);
    for (size_t i = 0; i < k; i++) {
        if (out != NULL) {
            kvd__block_ref__init(&out[i]);
            out[i].id = r->lookup_reply->blocks[i]->id;
            out[i].gen = r->lookup_reply->blocks[i]->gen;
        }
        if (pools != NULL) {
            pools[i] = search ? r->lookup_reply->pool_ids[i] : pool;
        }
    }
    kv_wire_free(r);
    return k;
}

/* Allocates, fills with byte `fill`, commits under salt and releases n blocks in pool. */
static void put_prefix(int fd, const att *a, uint32_t pool, size_t n, uint64_t salt) {
    Kvd__BlockRef b[64];
    allocate(fd, pool, (uint32_t)n, KV_OK, NULL, b);
    for (size_t i = 0; a != NULL && i < n; i++) {
        assert_true(b[i].id < a->bps);
        for (uint32_t layer = 0; layer < 2; layer++) {
            for (int kv = 0; kv < 2; kv++) {
                uint64_t off = kv_layout_offset(&a->layout, a->bps, b[i].id, layer, kv, 0, 0);
                memset(a->base + off, (int)(salt + i) & 0xff, a->layout.kv_block_bytes);
            }
        }
    }
    commit(fd, pool, b, n, salt, KV_OK);
    release_or_pin(fd, pool, b, n, 0, KV_OK, NULL);
}

/* ---- tests -------------------------------------------------------------------------------- */

static const char *const two[] = {"alice", "bob"};

static void test_identity_and_isolation(void **state) {
    (void)state;
    harness *h = start("tenant alice token-file=%T/alice.token\n"
                       "tenant bob token-file=%T/bob.token uid=0\n",
                       two, 2, 1 << 20, NULL);
    char tenant[64];
    size_t ndom = 0;
    int fa = hello_as(h, "alice", KV_OK, tenant, &ndom);
    assert_string_equal(tenant, "alice");
    assert_int_equal(ndom, 1);
    int fb = hello_as(h, "bob", KV_OK, tenant, NULL);
    assert_string_equal(tenant, "bob");
    /* No token: the uid's own tenant (token tenants are never reached without their token). */
    int fu = hello_as(h, NULL, KV_OK, tenant, NULL);
    assert_string_equal(tenant, "uid-0");
    close(fu);
    /* A token that names nobody. */
    int fx = dial(h);
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Hello hl = KVD__HELLO__INIT;
    hl.protocol_version = 1;
    hl.token.data = (uint8_t *)"tok-alicX-0123456789abcdef012345";
    hl.token.len = 32;
    e.body_case = KVD__ENVELOPE__BODY_HELLO;
    e.hello = &hl;
    expect_code(rpc(fx, &e), KV_EAUTH, "token");
    close(fx);

    att a = attach(fa, "m");
    att b = attach(fb, "m");
    assert_int_not_equal(a.pool_id, b.pool_id);
    Kvd__BlockRef blocks[4];
    allocate(fa, a.pool_id, 4, KV_OK, NULL, blocks);
    commit(fa, a.pool_id, blocks, 4, 11, KV_OK);
    /* Same tokens (hashes), different tenant: zero hits, with or without the domain search. */
    assert_int_equal(lookup(fb, b.pool_id, 11, 4, 0, NULL, NULL), 0);
    assert_int_equal(lookup(fb, b.pool_id, 11, 4, 1, NULL, NULL), 0);
    /* alice's own second session hits all four. */
    int fa2 = connect_as(h, "alice");
    att a2 = attach(fa2, "m");
    assert_int_equal(a2.pool_id, a.pool_id);
    Kvd__BlockRef hit[4];
    assert_int_equal(lookup(fa2, a.pool_id, 11, 4, 0, hit, NULL), 4);
    release_or_pin(fa2, a.pool_id, hit, 4, 0, KV_OK, NULL);
    /* bob cannot name alice's pool at all. */
    release_or_pin(fb, a.pool_id, blocks, 1, 0, KV_ENOENT, NULL);
    release_or_pin(fb, a.pool_id, blocks, 1, 1, KV_ENOENT, NULL);
    commit(fb, a.pool_id, blocks, 1, 12, KV_ENOENT);
    allocate(fb, a.pool_id, 1, KV_ENOENT, NULL, NULL);
    assert_int_equal(lookup(fb, b.pool_id, 11, 1, 1, NULL, NULL), 0);
    /* Guessing ids in his own pool reaches only his own (empty) blocks: every id is refused. */
    for (uint32_t id = 0; id < 8; id++) {
        Kvd__BlockRef g = KVD__BLOCK_REF__INIT;
        g.id = id;
        g.gen = blocks[id % 4].gen;
        release_or_pin(fb, b.pool_id, &g, 1, 0, id == 0 && g.gen == 0 ? KV_EPERM : KV_EPERM, NULL);
        release_or_pin(fb, b.pool_id, &g, 1, 1, KV_EPERM, NULL);
        commit(fb, b.pool_id, &g, 1, 13, KV_EPERM);
    }
    /* alice's blocks are untouched by all that: still committed, still hit. */
    assert_int_equal(lookup(fa2, a.pool_id, 11, 4, 0, hit, NULL), 4);
    close(fa2);
    close(fa);
    close(fb);
    munmap(a.base, a.seg_bytes);
    munmap(a2.base, a2.seg_bytes);
    munmap(b.base, b.seg_bytes);
    stop(h);
}

/* A child that setuid()s to another uid is another tenant: the server proves it by
 * SO_PEERCRED. It commits a prefix; the parent (uid 0) must not see it. */
static void test_setuid_child_is_another_tenant(void **state) {
    (void)state;
    if (geteuid() != 0) {
        skip();
    }
    harness *h = start("tenant nobody uid=65534\n", NULL, 0, 1 << 20, NULL);
    int p[2];
    assert_int_equal(pipe(p), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(p[0]);
        if (setgid(65534) != 0 || setuid(65534) != 0) {
            _exit(2);
        }
        char tenant[64];
        int fd = hello_as(h, NULL, KV_OK, tenant, NULL);
        if (strcmp(tenant, "nobody") != 0) {
            _exit(3);
        }
        att a = attach(fd, "m");
        put_prefix(fd, &a, a.pool_id, 3, 21);
        if (lookup(fd, a.pool_id, 21, 3, 0, NULL, NULL) != 3) {
            _exit(4);
        }
        char done = 'x';
        if (write(p[1], &done, 1) != 1) {
            _exit(5);
        }
        _exit(0);
    }
    close(p[1]);
    char c;
    assert_int_equal(read(p[0], &c, 1), 1);
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    close(p[0]);
    char tenant[64];
    int fd = hello_as(h, NULL, KV_OK, tenant, NULL);
    assert_string_equal(tenant, "uid-0");
    att a = attach(fd, "m");
    assert_int_equal(lookup(fd, a.pool_id, 21, 3, 1, NULL, NULL), 0);
    close(fd);
    munmap(a.base, a.seg_bytes);
    stop(h);
}

static const char *const three[] = {"carol", "dave", "erin"};

static void test_group_shares(void **state) {
    (void)state;
    harness *h = start("tenant carol token-file=%T/carol.token\n"
                       "tenant dave token-file=%T/dave.token\n"
                       "tenant erin token-file=%T/erin.token\n"
                       "group team members=carol,dave\n",
                       three, 3, 1 << 20, NULL);
    size_t ndom = 0;
    int fc = hello_as(h, "carol", KV_OK, NULL, &ndom);
    assert_int_equal(ndom, 2);
    int fd = connect_as(h, "dave");
    int fe = connect_as(h, "erin");
    att c = attach(fc, "m");
    att d = attach(fd, "m");
    att e = attach(fe, "m");
    assert_int_equal(c.nlinked, 1);
    assert_int_equal(d.nlinked, 1);
    assert_int_equal(e.nlinked, 0);
    assert_int_equal(c.linked[0], d.linked[0]);
    assert_false(c.linked_ro[0]);
    assert_string_equal(c.linked_dom[0], "group:team");
    uint32_t group = c.linked[0];
    /* A linked pool is used only after its segments were fetched (PROTOCOL.md §6). */
    int fc2 = connect_as(h, "carol");
    att c2 = attach_ex(fc2, "m", 0);
    allocate(fc2, group, 1, KV_ESTATE, "MapSegments", NULL);
    assert_true(kvd_raw_map_segments(fc2, group, 0) >= 1);
    Kvd__BlockRef one;
    allocate(fc2, group, 1, KV_OK, NULL, &one);
    close(fc2);
    munmap(c2.base, c2.seg_bytes);
    /* carol writes into the group's pool; dave hits it from his private pool, with the pool
     * named; erin (not a member) neither hits nor can name the group pool. */
    put_prefix(fc, NULL, group, 3, 31);
    Kvd__BlockRef hit[3];
    uint32_t pools[3];
    assert_int_equal(lookup(fd, d.pool_id, 31, 3, 0, NULL, NULL), 0);
    assert_int_equal(lookup(fd, d.pool_id, 31, 3, 1, hit, pools), 3);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(pools[i], group);
    }
    release_or_pin(fd, group, hit, 3, 0, KV_OK, NULL);
    assert_int_equal(lookup(fe, e.pool_id, 31, 3, 1, NULL, NULL), 0);
    allocate(fe, group, 1, KV_ENOENT, NULL, NULL);
    /* Private beats group: dave's own copy of block 0 is found first. */
    put_prefix(fd, NULL, d.pool_id, 1, 31);
    assert_int_equal(lookup(fd, d.pool_id, 31, 3, 1, hit, pools), 3);
    assert_int_equal(pools[0], d.pool_id);
    assert_int_equal(pools[1], group);
    close(fc);
    close(fd);
    close(fe);
    munmap(c.base, c.seg_bytes);
    munmap(d.base, d.seg_bytes);
    munmap(e.base, e.seg_bytes);
    stop(h);
}

static const char *const four[] = {"t1", "t2", "t3", "t4"};

/* Maps segment 0 of pool through MapSegments; checks the read-only fd. Returns the mapping. */
static const uint8_t *map_commons(int fd, uint32_t pool, uint64_t *bytes) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__MapSegments m = KVD__MAP_SEGMENTS__INIT;
    m.pool_id = pool;
    e.id = kvd_raw_next_id();
    e.body_case = KVD__ENVELOPE__BODY_MAP_SEGMENTS;
    e.map_segments = &m;
    kvd_raw_send_env(fd, &e);
    int fds[200];
    size_t nfds;
    Kvd__Envelope *r = kvd_raw_recv_env_fds(fd, fds, &nfds);
    assert_non_null(r);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_MAP_SEGMENTS_REPLY);
    assert_true(r->map_segments_reply->n_segments >= 1);
    Kvd__Segment *s = r->map_segments_reply->segments[0];
    assert_true(s->read_only);
    int sfd = fds[s->fd_index];
    *bytes = s->bytes;
    /* The fd is open read-only and the memfd's mode is 0400. */
    assert_int_equal(fcntl(sfd, F_GETFL) & O_ACCMODE, O_RDONLY);
    struct stat st;
    assert_int_equal(fstat(sfd, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0400);
    /* Writable shared mapping refused; mprotect to writable refused too. */
    void *w = mmap(NULL, s->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, sfd, 0);
    assert_true(w == MAP_FAILED);
    assert_int_equal(errno, EACCES);
    const uint8_t *ro = mmap(NULL, s->bytes, PROT_READ, MAP_SHARED, sfd, 0);
    assert_true(ro != MAP_FAILED);
    assert_int_not_equal(mprotect((void *)ro, s->bytes, PROT_READ | PROT_WRITE), 0);
    /* A non-root process cannot reopen its copy writable through /proc (mode 0400). */
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        if (geteuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0)) {
            _exit(2);
        }
        prctl(PR_SET_DUMPABLE, 1); /* so /proc/self/fd stays ours after setuid */
        char path[64];
        snprintf(path, sizeof(path), "/proc/self/fd/%d", sfd);
        int w2 = open(path, O_RDWR);
        _exit(w2 < 0 && errno == EACCES ? 0 : 3);
    }
    int wst;
    assert_int_equal(waitpid(pid, &wst, 0), pid);
    assert_true(WIFEXITED(wst));
    assert_int_equal(WEXITSTATUS(wst), 0);
    for (size_t i = 0; i < nfds; i++) {
        close(fds[i]);
    }
    kv_wire_free(r);
    return ro;
}

/* Four token tenants and the commons, entered at 3 tenants. */
#define FOUR_AND_COMMONS                                                                           \
    "tenant t1 token-file=%T/t1.token\n"                                                           \
    "tenant t2 token-file=%T/t2.token\n"                                                           \
    "tenant t3 token-file=%T/t3.token\n"                                                           \
    "tenant t4 token-file=%T/t4.token\n"                                                           \
    "commons min-tenants=3\n"

static void test_commons_after_k_tenants(void **state) {
    (void)state;
    harness *h = start(FOUR_AND_COMMONS, four, 4, 2 << 20, NULL);
    int f[4];
    att a[4];
    for (int i = 0; i < 4; i++) {
        size_t ndom;
        f[i] = hello_as(h, four[i], KV_OK, NULL, &ndom);
        assert_int_equal(ndom, 2);
        a[i] = attach(f[i], "m");
        assert_int_equal(a[i].nlinked, 1);
        assert_true(a[i].linked_ro[0]);
        assert_string_equal(a[i].linked_dom[0], "commons");
    }
    uint32_t commons = a[0].linked[0];
    for (int i = 1; i < 4; i++) {
        assert_int_equal(a[i].linked[0], commons);
    }
    /* Tenants may not write the commons. */
    allocate(f[3], commons, 1, KV_EPERM, "read-only", NULL);
    /* t1 and t2 commit the same prefix: not enough tenants, nobody else hits. */
    put_prefix(f[0], &a[0], a[0].pool_id, 4, 41);
    assert_int_equal(lookup(f[3], a[3].pool_id, 41, 4, 1, NULL, NULL), 0);
    put_prefix(f[1], &a[1], a[1].pool_id, 4, 41);
    /* Committing twice in one tenant does not count twice. */
    put_prefix(f[1], &a[1], a[1].pool_id, 4, 41);
    assert_int_equal(lookup(f[3], a[3].pool_id, 41, 4, 1, NULL, NULL), 0);
    /* The third tenant: the prefix enters the commons, and everyone hits it there. */
    put_prefix(f[2], &a[2], a[2].pool_id, 4, 41);
    Kvd__BlockRef hit[4];
    uint32_t pools[4];
    assert_int_equal(lookup(f[3], a[3].pool_id, 41, 4, 1, hit, pools), 4);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(pools[i], commons);
    }
    /* The read-only mapping holds the committed bytes. */
    uint64_t bytes;
    const uint8_t *ro = map_commons(f[3], commons, &bytes);
    for (int i = 0; i < 4; i++) {
        assert_true(hit[i].id < a[3].bps);
        uint64_t off = kv_layout_offset(&a[3].layout, a[3].bps, hit[i].id, 1, 1, 0, 0);
        assert_int_equal(ro[off], (41 + i) & 0xff);
        assert_int_equal(ro[off + a[3].layout.kv_block_bytes - 1], (41 + i) & 0xff);
    }
    /* Commons blocks cannot be pinned by a tenant; they can be released. */
    release_or_pin(f[3], commons, hit, 4, 1, KV_EPERM, "commons");
    release_or_pin(f[3], commons, hit, 4, 0, KV_OK, NULL);
    /* Without the domain search the private pool alone answers: no hit. */
    assert_int_equal(lookup(f[3], a[3].pool_id, 41, 4, 0, NULL, NULL), 0);
    munmap((void *)ro, bytes);
    for (int i = 0; i < 4; i++) {
        close(f[i]);
        munmap(a[i].base, a[i].seg_bytes);
    }
    stop(h);
}

/* hash-mode vllm gives every pool one seed (vLLM's hashes do not name the model): the commons
 * counts tenants per model and layout all the same. Two tenants commit a prefix in model m, a
 * third the same hashes in model n: nothing enters either commons (the counts were shared, and
 * the third tenant's block went into n's commons, telling everyone it had that prompt). */
static void test_commons_counts_per_model_in_vllm_mode(void **state) {
    (void)state;
    start_vllm = 1;
    harness *h = start(FOUR_AND_COMMONS, four, 4, 4 << 20, NULL);
    start_vllm = 0;
    int f[4];
    att am[4], an[4];
    for (int i = 0; i < 4; i++) {
        f[i] = hello_as(h, four[i], KV_OK, NULL, NULL);
        am[i] = attach(f[i], "m");
        an[i] = attach(f[i], "n");
    }
    put_prefix(f[0], &am[0], am[0].pool_id, 2, 61);
    put_prefix(f[1], &am[1], am[1].pool_id, 2, 61);
    put_prefix(f[2], &an[2], an[2].pool_id, 2, 61); /* the same hashes, another model */
    assert_int_equal(lookup(f[3], an[3].pool_id, 61, 2, 1, NULL, NULL), 0);
    assert_int_equal(lookup(f[3], am[3].pool_id, 61, 2, 1, NULL, NULL), 0);
    /* A third tenant in m: m's commons has it. */
    put_prefix(f[2], &am[2], am[2].pool_id, 2, 61);
    assert_int_equal(lookup(f[3], am[3].pool_id, 61, 2, 1, NULL, NULL), 2);
    for (int i = 0; i < 4; i++) {
        close(f[i]);
        munmap(am[i].base, am[i].seg_bytes);
        munmap(an[i].base, an[i].seg_bytes);
    }
    stop(h);
}

static void test_quotas(void **state) {
    (void)state;
    harness *h = start("tenant alice token-file=%T/alice.token\n"
                       "tenant bob token-file=%T/bob.token\n"
                       "quota default max-sessions=2\n"
                       "quota alice max-held=6 max-pinned=2 max-sessions=1\n",
                       two, 2, 1 << 20, NULL);
    int fa = connect_as(h, "alice");
    /* max-sessions: alice has 1, bob the default 2. */
    close(hello_as(h, "alice", KV_EQUOTA, NULL, NULL));
    int fb1 = connect_as(h, "bob");
    int fb2 = connect_as(h, "bob");
    close(hello_as(h, "bob", KV_EQUOTA, NULL, NULL));
    att a = attach(fa, "m");
    Kvd__BlockRef b[8];
    allocate(fa, a.pool_id, 7, KV_EQUOTA, "max-held", b);
    allocate(fa, a.pool_id, 4, KV_OK, NULL, b);
    allocate(fa, a.pool_id, 3, KV_EQUOTA, "max-held", NULL);
    commit(fa, a.pool_id, b, 4, 51, KV_OK);
    /* max-pinned 2. */
    release_or_pin(fa, a.pool_id, b, 3, 1, KV_EQUOTA, "max-pinned");
    release_or_pin(fa, a.pool_id, b, 2, 1, KV_OK, NULL);
    release_or_pin(fa, a.pool_id, b, 2, 1, KV_OK, NULL); /* pinning again is no new pin */
    release_or_pin(fa, a.pool_id, b + 2, 1, 1, KV_EQUOTA, "max-pinned");
    /* Lookup returns at most what max-held leaves: 4 held, 2 more. */
    Kvd__BlockRef hit[4];
    assert_int_equal(lookup(fa, a.pool_id, 51, 4, 0, hit, NULL), 2);
    release_or_pin(fa, a.pool_id, hit, 2, 0, KV_OK, NULL);
    release_or_pin(fa, a.pool_id, b, 4, 0, KV_OK, NULL);
    allocate(fa, a.pool_id, 6, KV_OK, NULL, b);
    /* A closed session frees its slot. */
    close(fb2);
    int tries = 0, fb3 = -1;
    while (fb3 < 0 && tries++ < 200) {
        int fd = dial(h);
        Kvd__Envelope e = KVD__ENVELOPE__INIT;
        Kvd__Hello hl = KVD__HELLO__INIT;
        char tok[40];
        token_of("bob", tok);
        hl.protocol_version = 1;
        hl.token.data = (uint8_t *)tok;
        hl.token.len = strlen(tok);
        e.body_case = KVD__ENVELOPE__BODY_HELLO;
        e.hello = &hl;
        Kvd__Envelope *r = rpc(fd, &e);
        if (r->body_case == KVD__ENVELOPE__BODY_HELLO_REPLY) {
            fb3 = fd;
        } else {
            close(fd);
            usleep(10000);
        }
        kv_wire_free(r);
    }
    assert_true(fb3 >= 0);
    close(fb3);
    close(fb1);
    close(fa);
    munmap(a.base, a.seg_bytes);
    stop(h);
}

static void test_quota_fields(void **state) {
    (void)state;
    kvd_quota q;
    memset(&q, 0, sizeof(q));
    assert_int_equal(kvd_quota_parse_field(&q, "max-held", "10"), KV_OK);
    assert_int_equal(kvd_quota_parse_field(&q, "guarantee", "3"), KV_OK);
    assert_int_equal(kvd_quota_parse_field(&q, "max-pinned", "0"), KV_OK);
    assert_int_equal(kvd_quota_parse_field(&q, "max-sessions", "7"), KV_OK);
    assert_int_equal(q.max_held, 10);
    assert_int_equal(q.guarantee, 3);
    assert_int_equal(q.max_sessions, 7);
    assert_int_equal(kvd_quota_parse_field(&q, "max-held", "-1"), KV_EINVAL);
    assert_int_equal(kvd_quota_parse_field(&q, "max-held", "12x"), KV_EINVAL);
    assert_int_equal(kvd_quota_parse_field(&q, "nope", "1"), KV_ENOENT);
    assert_int_equal(q.max_held, 10);
    /* Only the byte limits take a size suffix. */
    assert_int_equal(kvd_quota_parse_field(&q, "tier-guarantee-bytes", "1M"), KV_OK);
    assert_int_equal(q.tier_guarantee_bytes, 1 << 20);
    assert_int_equal(kvd_quota_parse_field(&q, "tier-total-bytes", "2G"), KV_OK);
    assert_int_equal(q.tier_total_bytes, 2ull << 30);
    assert_int_equal(kvd_quota_parse_field(&q, "tier-total-bytes", "x"), KV_EINVAL);
    assert_int_equal(q.tier_total_bytes, 2ull << 30);
    assert_int_equal(kvd_quota_parse_field(&q, "tier-max-bytes", "64K"), KV_OK);
    assert_int_equal(q.tier_max_bytes, 64 << 10);
    assert_int_equal(kvd_quota_parse_field(&q, "tier-max-bytes", "12345"), KV_OK);
    assert_int_equal(q.tier_max_bytes, 12345);
    assert_int_equal(kvd_quota_parse_field(&q, "tier-max-bytes", "2X"), KV_EINVAL);
    assert_int_equal(kvd_quota_parse_field(&q, "tier-max", "4K"), KV_EINVAL);
    assert_int_equal(q.tier_max_bytes, 12345);
}

/* Run-time change (what admin `quota set` calls), on the loop thread before serving. */
static void set_runtime_quota(kvd_daemon *s) {
    char err[256];
    kv_err rc = kvd_registry_quota_set_field(kvd_daemon_registry(s), "alice", "max-held", "2", err,
                                             sizeof(err));
    kvd_quota q;
    if (rc == KV_OK) {
        rc = kvd_registry_quota_get(kvd_daemon_registry(s), "alice", &q);
    }
    if (rc == KV_OK && q.max_held != 2) {
        rc = KV_EINTERNAL;
    }
    if (rc == KV_OK && kvd_registry_quota_set_field(kvd_daemon_registry(s), "nobody", "max-held",
                                                    "2", err, sizeof(err)) != KV_ENOENT) {
        rc = KV_EINTERNAL;
    }
    if (rc == KV_OK && kvd_registry_quota_set_field(kvd_daemon_registry(s), "alice", "max-nothing",
                                                    "2", err, sizeof(err)) != KV_ENOENT) {
        rc = KV_EINTERNAL;
    }
    cur->selftest_rc = rc;
}

static void test_quota_set_at_run_time(void **state) {
    (void)state;
    harness *h =
        start("tenant alice token-file=%T/alice.token\n", two, 1, 1 << 20, set_runtime_quota);
    assert_int_equal(h->selftest_rc, KV_OK);
    int fa = connect_as(h, "alice");
    att a = attach(fa, "m");
    allocate(fa, a.pool_id, 3, KV_EQUOTA, "max-held is 2", NULL);
    close(fa);
    munmap(a.base, a.seg_bytes);
    stop(h);
}

/* Counts which of hash_of(salt, 0..n) are still cached in pool, one lookup each. */
static size_t still_cached(int fd, uint32_t via, uint32_t pool, uint64_t salt, size_t n) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        Kvd__BlockRef hit;
        uint32_t p;
        Kvd__Envelope e = KVD__ENVELOPE__INIT;
        Kvd__Lookup lk = KVD__LOOKUP__INIT;
        Kvd__Hash128 h = hash_of(salt, i);
        Kvd__Hash128 *ph = &h;
        lk.pool_id = via;
        lk.n_hashes = 1;
        lk.hashes = &ph;
        lk.search_domains = 1;
        e.body_case = KVD__ENVELOPE__BODY_LOOKUP;
        e.lookup = &lk;
        Kvd__Envelope *r = rpc(fd, &e);
        assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_LOOKUP_REPLY);
        if (r->lookup_reply->n_blocks == 1) {
            p = r->lookup_reply->pool_ids[0];
            kvd__block_ref__init(&hit);
            hit.id = r->lookup_reply->blocks[0]->id;
            hit.gen = r->lookup_reply->blocks[0]->gen;
            kv_wire_free(r);
            assert_int_equal(p, pool);
            release_or_pin(fd, pool, &hit, 1, 0, KV_OK, NULL);
            k++;
        } else {
            kv_wire_free(r);
        }
    }
    return k;
}

/* pq shares the group pool with flooder; returns how many of pq's 8 cached blocks survive a
 * flood of the group pool (capacity: the budget leaves it 2 segments). */
static size_t flood_survivors(const char *quota_line) {
    static const char *const names[] = {"pq", "flooder"};
    char lines[512];
    snprintf(lines, sizeof(lines),
             "tenant pq token-file=%%T/pq.token\n"
             "tenant flooder token-file=%%T/flooder.token\n"
             "group shared members=pq,flooder\n"
             "%s\n",
             quota_line);
    /* 64 KiB segments: two private pools + the group pool + one more segment of budget. */
    harness *h = start(lines, names, 2, BUDGET(4, 3), NULL);
    int fq = connect_as(h, "pq");
    int ff = connect_as(h, "flooder");
    att q = attach(fq, "m");
    att f = attach(ff, "m");
    uint32_t group = q.linked[0];
    assert_int_equal(f.linked[0], group);
    put_prefix(fq, NULL, group, 8, 61);
    assert_int_equal(still_cached(fq, q.pool_id, group, 61, 8), 8);
    /* The flood: many prefixes of fresh blocks, each committed and released (cached). */
    for (uint64_t round = 0; round < 40; round++) {
        put_prefix(ff, NULL, group, 32, 1000 + round);
    }
    size_t k = still_cached(fq, q.pool_id, group, 61, 8);
    close(fq);
    close(ff);
    munmap(q.base, q.seg_bytes);
    munmap(f.base, f.seg_bytes);
    stop(h);
    return k;
}

static void test_flood_keeps_guarantee(void **state) {
    (void)state;
    /* Control: without a guarantee the flood evicts pq's blocks. */
    size_t without = flood_survivors("");
    assert_true(without < 5);
    /* With guarantee 5, at least 5 of pq's blocks stay cached however long the flood. */
    size_t with = flood_survivors("quota pq guarantee=5");
    assert_true(with >= 5);
}

/* ---- lifecycle findings of the integrity audit (issue 12) ------------------------------- */

/* Commit of n entries with explicit hashes (hash_of(salt, hidx[i])) and parents; expect code
 * (and needle in its message). On success blocks[] get the canonical handles. */
static void commit_ex(int fd, uint32_t pool, Kvd__BlockRef *blocks, size_t n, uint64_t salt,
                      const size_t *hidx, const uint32_t *parents, kv_err code,
                      const char *needle) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Commit c = KVD__COMMIT__INIT;
    Kvd__CommitEntry ent[8], *pe[8];
    Kvd__Hash128 h[8];
    Kvd__BlockRef br[8];
    assert_true(n <= 8);
    for (size_t i = 0; i < n; i++) {
        kvd__commit_entry__init(&ent[i]);
        kvd__block_ref__init(&br[i]);
        br[i].id = blocks[i].id;
        br[i].gen = blocks[i].gen;
        h[i] = hash_of(salt, hidx != NULL ? hidx[i] : i);
        ent[i].block = &br[i];
        ent[i].hash = &h[i];
        ent[i].parent = parents[i];
        pe[i] = &ent[i];
    }
    c.pool_id = pool;
    c.n_entries = n;
    c.entries = pe;
    e.body_case = KVD__ENVELOPE__BODY_COMMIT;
    e.commit = &c;
    Kvd__Envelope *r = rpc(fd, &e);
    if (r->body_case == KVD__ENVELOPE__BODY_COMMIT_REPLY) {
        for (size_t i = 0; i < n; i++) {
            blocks[i].id = r->commit_reply->canonical[i]->id;
            blocks[i].gen = r->commit_reply->canonical[i]->gen;
        }
    }
    expect_code(r, code, needle);
}

/* Pin with a retention of ms milliseconds; expect code. */
static void pin_for(int fd, uint32_t pool, Kvd__BlockRef *blocks, size_t n, uint64_t ms,
                    kv_err code, const char *needle) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Pin pn = KVD__PIN__INIT;
    Kvd__BlockRef *pv[8];
    assert_true(n <= 8);
    for (size_t i = 0; i < n; i++) {
        pv[i] = &blocks[i];
    }
    pn.pool_id = pool;
    pn.n_blocks = n;
    pn.blocks = pv;
    pn.retention_ms = ms;
    e.body_case = KVD__ENVELOPE__BODY_PIN;
    e.pin = &pn;
    expect_code(rpc(fd, &e), code, needle);
}

/* The reply to a Pin (unpin: an unpin) of one block. */
static Kvd__Envelope *pin_one(int fd, uint32_t pool, Kvd__BlockRef *block, uint64_t ms, int unpin) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Pin pn = KVD__PIN__INIT;
    Kvd__BlockRef *pv[1] = {block};
    pn.pool_id = pool;
    pn.n_blocks = 1;
    pn.blocks = pv;
    pn.retention_ms = ms;
    pn.unpin = unpin;
    e.body_case = KVD__ENVELOPE__BODY_PIN;
    e.pin = &pn;
    return rpc(fd, &e);
}

/* Unpin of one block, expecting code (and needle in the error message). */
static void unpin_for(int fd, uint32_t pool, Kvd__BlockRef *block, kv_err code,
                      const char *needle) {
    expect_code(pin_one(fd, pool, block, 0, 1), code, needle);
}

/* pin_for without expectations: the reply's code (KV_OK for a PinReply). */
static kv_err pin_try(int fd, uint32_t pool, Kvd__BlockRef *block, uint64_t ms) {
    Kvd__Envelope *r = pin_one(fd, pool, block, ms, 0);
    kv_err rc = r->body_case == KVD__ENVELOPE__BODY_ERROR ? (kv_err)r->error->code : KV_OK;
    kv_wire_free(r);
    return rc;
}

/* Commit is all or nothing and a parent is a committed block the session holds or an earlier
 * entry: an entry naming itself used to answer EINTERNAL half way, leaving earlier entries
 * committed (and hit by others). */
static void test_commit_parents(void **state) {
    (void)state;
    harness *h = start("tenant alice token-file=%T/alice.token\n", two, 1, 1 << 20, NULL);
    int fa = connect_as(h, "alice");
    int fa2 = connect_as(h, "alice");
    att a = attach(fa, "m"), a2 = attach(fa2, "m");
    Kvd__BlockRef b[4];
    allocate(fa, a.pool_id, 4, KV_OK, NULL, b);
    uint32_t self[1] = {b[0].id};
    commit_ex(fa, a.pool_id, b, 1, 71, NULL, self, KV_EINVAL, "itself");
    uint32_t second_self[2] = {UINT32_MAX, b[1].id};
    commit_ex(fa, a.pool_id, b, 2, 71, NULL, second_self, KV_EINVAL, "entries[1]");
    assert_int_equal(lookup(fa2, a.pool_id, 71, 1, 0, NULL, NULL), 0); /* nothing went in */
    /* A FREE block, a WRITING block not committed before it, and a later entry are no parents. */
    uint32_t free_parent[1] = {a.bps - 1};
    commit_ex(fa, a.pool_id, b, 1, 71, NULL, free_parent, KV_EINVAL, "parent");
    uint32_t writing_parent[1] = {b[3].id};
    commit_ex(fa, a.pool_id, b, 1, 71, NULL, writing_parent, KV_EINVAL, "not committed");
    uint32_t later[2] = {b[1].id, UINT32_MAX};
    commit_ex(fa, a.pool_id, b, 2, 71, NULL, later, KV_EINVAL, "entries[0]");
    /* Another session's committed block is not this session's to name. */
    Kvd__BlockRef o[1];
    allocate(fa2, a.pool_id, 1, KV_OK, NULL, o);
    uint32_t none[1] = {UINT32_MAX};
    size_t nine[1] = {9};
    commit_ex(fa2, a.pool_id, o, 1, 71, nine, none, KV_OK, NULL);
    uint32_t foreign[1] = {o[0].id};
    commit_ex(fa, a.pool_id, b, 1, 71, NULL, foreign, KV_EINVAL, "not held");
    /* The valid forms: none, an earlier entry, a held committed block. */
    uint32_t chain[2] = {UINT32_MAX, b[0].id};
    commit_ex(fa, a.pool_id, b, 2, 71, NULL, chain, KV_OK, NULL);
    uint32_t held[1] = {b[1].id};
    size_t two_idx[1] = {2};
    commit_ex(fa, a.pool_id, b + 2, 1, 71, two_idx, held, KV_OK, NULL);
    assert_int_equal(lookup(fa2, a.pool_id, 71, 3, 0, NULL, NULL), 3);
    close(fa);
    close(fa2);
    munmap(a.base, a.seg_bytes);
    munmap(a2.base, a2.seg_bytes);
    stop(h);
}

/* client_name and model_id are protobuf strings: bytes that are not UTF-8 are refused at the
 * door (such a session and pool used to vanish from admin listings and metrics). */
static void test_names_are_utf8(void **state) {
    (void)state;
    harness *h = start("tenant alice token-file=%T/alice.token\n", two, 1, 1 << 20, NULL);
    int fd = dial(h);
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Hello hl = KVD__HELLO__INIT;
    hl.protocol_version = 1;
    hl.client_name = "bad\xff\xfename";
    e.body_case = KVD__ENVELOPE__BODY_HELLO;
    e.hello = &hl;
    expect_code(rpc(fd, &e), KV_EINVAL, "UTF-8");
    hl.client_name = "caf\xc3\xa9 \xe2\x9c\x93"; /* valid: accepted */
    expect_code(rpc(fd, &e), KV_OK, NULL);
    static const char *const bad[] = {"m\xc3", "\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80"};
    for (size_t i = 0; i < 4; i++) {
        Kvd__Envelope ae = KVD__ENVELOPE__INIT;
        Kvd__AttachPool at = KVD__ATTACH_POOL__INIT;
        Kvd__Layout l = KVD__LAYOUT__INIT;
        kvd_raw_fill_layout(&l);
        at.model_id = (char *)bad[i];
        at.layout = &l;
        ae.body_case = KVD__ENVELOPE__BODY_ATTACH_POOL;
        ae.attach_pool = &at;
        expect_code(rpc(fd, &ae), KV_EINVAL, "UTF-8");
    }
    close(fd);
    stop(h);
}

/* max-pinned is the pinning tenant's: in a group pool dave pinning carol's blocks uses dave's
 * limit, never carol's (carol got EQUOTA though she had pinned nothing). */
static void test_pin_quota_is_the_pinners(void **state) {
    (void)state;
    harness *h = start("tenant carol token-file=%T/carol.token\n"
                       "tenant dave token-file=%T/dave.token\n"
                       "group team members=carol,dave\n"
                       "quota default max-pinned=1\n",
                       three, 2, 1 << 20, NULL);
    int fc = connect_as(h, "carol"), fd = connect_as(h, "dave");
    att c = attach(fc, "m"), d = attach(fd, "m");
    uint32_t group = c.linked[0];
    put_prefix(fc, NULL, group, 3, 81);
    Kvd__BlockRef hit[3];
    assert_int_equal(lookup(fd, group, 81, 3, 0, hit, NULL), 3);
    pin_for(fd, group, hit, 1, 60000, KV_OK, NULL);
    pin_for(fd, group, hit + 1, 1, 60000, KV_EQUOTA, "max-pinned");
    Kvd__BlockRef mine[3];
    assert_int_equal(lookup(fc, group, 81, 3, 0, mine, NULL), 3);
    pin_for(fc, group, mine + 2, 1, 60000, KV_OK, NULL); /* carol's own limit is untouched */
    /* Dave's pin pinned again by carol would be charged to carol, past her max-pinned (it
     * used to extend dave's pin for free); and dave may not unpin carol's pin. */
    pin_for(fc, group, mine, 1, 60000, KV_EQUOTA, "max-pinned");
    pin_for(fc, group, mine, 1, 0, KV_OK, NULL); /* retention 0 pins nothing, takes nothing */
    unpin_for(fc, group, mine, KV_EPERM, "dave");
    unpin_for(fd, group, mine + 2, KV_EPERM, "carol");
    unpin_for(fc, group, mine + 2, KV_OK, NULL);
    pin_for(fc, group, mine, 1, 1, KV_OK, NULL); /* shorter than dave's: takes nothing over */
    unpin_for(fc, group, mine, KV_EPERM, "dave");
    pin_for(fc, group, mine, 1, 60000, KV_OK, NULL); /* now hers: dave's quota is free again */
    pin_for(fd, group, hit + 1, 1, 60000, KV_OK, NULL);
    close(fc);
    close(fd);
    munmap(c.base, c.seg_bytes);
    munmap(d.base, d.seg_bytes);
    stop(h);
}

/* An expired pin stops counting at once, also while its block is referenced: after a 1 ms pin a
 * tenant with max-pinned 1 pins again (it got EQUOTA for as long as the block stayed held). */
static void test_expired_pin_frees_quota(void **state) {
    (void)state;
    harness *h = start("tenant alice token-file=%T/alice.token\n"
                       "quota alice max-pinned=1\n",
                       two, 1, 1 << 20, NULL);
    int fa = connect_as(h, "alice");
    att a = attach(fa, "m");
    Kvd__BlockRef b[2];
    allocate(fa, a.pool_id, 2, KV_OK, NULL, b);
    commit(fa, a.pool_id, b, 2, 91, KV_OK);
    /* The first pin lasts long enough for the refusal to be checked under any load (it used
     * to last 1 ms, which a busy machine could let expire before the second request). */
    pin_for(fa, a.pool_id, b, 1, 2000, KV_OK, NULL);
    pin_for(fa, a.pool_id, b + 1, 1, 60000, KV_EQUOTA, "max-pinned");
    /* Once it has expired its quota is free again: the same pin succeeds (polled, not timed). */
    kv_err rc = KV_EQUOTA;
    for (int i = 0; i < 500 && rc == KV_EQUOTA; i++) {
        usleep(20000);
        rc = pin_try(fa, a.pool_id, b + 1, 60000);
    }
    assert_int_equal(rc, KV_OK);
    close(fa);
    munmap(a.base, a.seg_bytes);
    stop(h);
}

/* Each position of a domain search takes the first pool that has it: a run found in the group
 * stops where dave's private pool has the next block (it used to continue in the group). */
static void test_search_each_position(void **state) {
    (void)state;
    harness *h = start("tenant carol token-file=%T/carol.token\n"
                       "tenant dave token-file=%T/dave.token\n"
                       "group team members=carol,dave\n",
                       three, 2, 1 << 20, NULL);
    int fc = connect_as(h, "carol"), fd = connect_as(h, "dave");
    att c = attach(fc, "m"), d = attach(fd, "m");
    uint32_t group = c.linked[0];
    put_prefix(fc, NULL, group, 4, 101);
    Kvd__BlockRef x[1];
    allocate(fd, d.pool_id, 1, KV_OK, NULL, x);
    uint32_t none[1] = {UINT32_MAX};
    size_t idx2[1] = {2};
    commit_ex(fd, d.pool_id, x, 1, 101, idx2, none, KV_OK, NULL);
    Kvd__BlockRef hit[4];
    uint32_t pools[4];
    assert_int_equal(lookup(fd, d.pool_id, 101, 4, 1, hit, pools), 4);
    assert_int_equal(pools[0], group);
    assert_int_equal(pools[1], group);
    assert_int_equal(pools[2], d.pool_id);
    assert_int_equal(pools[3], group);
    close(fc);
    close(fd);
    munmap(c.base, c.seg_bytes);
    munmap(d.base, d.seg_bytes);
    stop(h);
}

/* A refused Allocate changes nothing: it neither parks another pool's segment (evicting that
 * tenant's cache) nor grows its own pool (bob's 64 cached blocks used to go to 0 hits). */
static void test_refused_allocate_changes_nothing(void **state) {
    (void)state;
    /* 64 KiB segments of 128 blocks: room for alice's and bob's first segment and one more. */
    harness *h = start("tenant alice token-file=%T/alice.token\n"
                       "tenant bob token-file=%T/bob.token\n",
                       two, 2, BUDGET(3, 2), NULL);
    int fa = connect_as(h, "alice"), fb = connect_as(h, "bob");
    att a = attach(fa, "m"), b = attach(fb, "m");
    static Kvd__BlockRef blk[64];
    allocate(fb, b.pool_id, 64, KV_OK, NULL, blk);
    for (size_t i = 0; i < 64; i += 8) {
        commit(fb, b.pool_id, blk + i, 8, 200 + i, KV_OK);
    }
    for (size_t i = 0; i < 64; i += 8) {
        release_or_pin(fb, b.pool_id, blk + i, 8, 0, KV_OK, NULL);
    }
    allocate(fa, a.pool_id, 1000, KV_ENOSPC, "could be had", NULL);
    size_t hits = 0;
    for (size_t i = 0; i < 64; i += 8) {
        hits += lookup(fb, b.pool_id, 200 + i, 8, 0, NULL, NULL);
    }
    assert_int_equal(hits, 64);
    /* A request that fits is still served (parking bob's idle memory as before). */
    Kvd__BlockRef ok[200];
    allocate(fa, a.pool_id, 200, KV_OK, NULL, ok);
    close(fa);
    close(fb);
    munmap(a.base, a.seg_bytes);
    munmap(b.base, b.seg_bytes);
    stop(h);
}

/* Parking for another pool never takes a guaranteed share: bob's idle segment of cached blocks
 * stays while bob is within his guarantee, and is parked without one. */
static size_t parked_survivors(const char *quota_line) {
    char lines[256];
    snprintf(lines, sizeof(lines),
             "tenant alice token-file=%%T/alice.token\n"
             "tenant bob token-file=%%T/bob.token\n%s\n",
             quota_line);
    /* A parked segment keeps its block records: bob's stay counted. */
    harness *h = start(lines, two, 2, BUDGET(3, 2) + 128 * 64, NULL);
    int fa = connect_as(h, "alice"), fb = connect_as(h, "bob");
    att a = attach(fa, "m"), b = attach(fb, "m");
    static Kvd__BlockRef blk[128];
    allocate(fb, b.pool_id, 128, KV_OK, NULL, blk); /* bob's whole first segment */
    for (size_t i = 0; i < 128; i += 8) {
        commit(fb, b.pool_id, blk + i, 8, 300 + i, KV_OK);
        release_or_pin(fb, b.pool_id, blk + i, 8, 0, KV_OK, NULL);
    }
    /* alice wants two more segments: the budget has one, parking bob's would give the other. */
    static Kvd__BlockRef al[256];
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Allocate al_req = KVD__ALLOCATE__INIT;
    al_req.pool_id = a.pool_id;
    al_req.count = 3 * 128;
    e.body_case = KVD__ENVELOPE__BODY_ALLOCATE;
    e.allocate = &al_req;
    kv_wire_free(rpc(fa, &e));
    (void)al;
    size_t hits = 0;
    for (size_t i = 0; i < 128; i += 8) {
        hits += lookup(fb, b.pool_id, 300 + i, 8, 0, NULL, NULL);
    }
    close(fa);
    close(fb);
    munmap(a.base, a.seg_bytes);
    munmap(b.base, b.seg_bytes);
    stop(h);
    return hits;
}

static void test_parking_keeps_guarantees(void **state) {
    (void)state;
    assert_int_equal(parked_survivors(""), 0);                          /* parked for alice */
    assert_int_equal(parked_survivors("quota bob guarantee=128"), 128); /* kept */
}

/* The prefix index grows with the pools: 8192 blocks commit into a daemon whose index was sized
 * for 1024 (Commit failed half way with EINTERNAL "entries[42] failed after 42 were committed"). */
static void test_index_grows_with_pools(void **state) {
    (void)state;
    /* 64 segments, and the pool's per-slot records growing with them. */
    harness *h = start("tenant alice token-file=%T/alice.token\n", two, 1, BUDGET(66, 1), NULL);
    int fa = connect_as(h, "alice");
    att a = attach(fa, "m");
    for (uint64_t k = 0; k < 8192 / 64; k++) {
        Kvd__BlockRef b[64];
        allocate(fa, a.pool_id, 64, KV_OK, NULL, b);
        commit(fa, a.pool_id, b, 64, 1000 + k, KV_OK);
        release_or_pin(fa, a.pool_id, b, 64, 0, KV_OK, NULL);
    }
    size_t hits = 0;
    for (uint64_t k = 0; k < 8192 / 64; k++) {
        hits += lookup(fa, a.pool_id, 1000 + k, 64, 0, NULL, NULL);
    }
    assert_int_equal(hits, 8192);
    close(fa);
    munmap(a.base, a.seg_bytes);
    stop(h);
}

/* Reads stat `name` (daemon or session scope) through Stats on fd. */
static uint64_t daemon_stat(int fd, const char *name) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Stats st = KVD__STATS__INIT;
    e.body_case = KVD__ENVELOPE__BODY_STATS;
    e.stats = &st;
    Kvd__Envelope *r = rpc(fd, &e);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_STATS_REPLY);
    uint64_t v = UINT64_MAX;
    for (size_t i = 0; i < r->stats_reply->n_stats; i++) {
        if (strcmp(r->stats_reply->stats[i]->name, name) == 0) {
            v = r->stats_reply->stats[i]->value;
        }
    }
    kv_wire_free(r);
    assert_true(v != UINT64_MAX);
    return v;
}

/* Pools are bounded and freed: a tenant's max-pools quota refuses the next new pool with
 * EQUOTA; pools no session uses and that hold nothing are freed when their last session closes
 * (100 attached and dropped pools took kvd from 12 MB to 433 MB), while a pool with cached
 * blocks stays, as a cache. */
static void test_pools_bounded_and_freed(void **state) {
    (void)state;
    harness *h = start("tenant alice token-file=%T/alice.token\n"
                       "quota alice max-pools=3\n",
                       two, 1, 8u << 20, NULL);
    int fa = connect_as(h, "alice");
    att m[3];
    char name[16];
    for (int i = 0; i < 3; i++) {
        snprintf(name, sizeof(name), "m%d", i);
        m[i] = attach(fa, name);
    }
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__AttachPool ap = KVD__ATTACH_POOL__INIT;
    Kvd__Layout l = KVD__LAYOUT__INIT;
    kvd_raw_fill_layout(&l);
    ap.model_id = "m3";
    ap.layout = &l;
    e.body_case = KVD__ENVELOPE__BODY_ATTACH_POOL;
    e.attach_pool = &ap;
    expect_code(rpc(fa, &e), KV_EQUOTA, "max-pools");
    put_prefix(fa, &m[0], m[0].pool_id, 2, 400); /* m0 keeps a cache; m1, m2 stay empty */
    assert_int_equal(daemon_stat(fa, "daemon.pools"), 3);
    close(fa);
    for (int i = 0; i < 3; i++) {
        munmap(m[i].base, m[i].seg_bytes);
    }
    int fb = connect_as(h, "alice");
    /* m1 and m2 were freed with the last session; m0 holds two cached blocks. */
    for (int tries = 0; tries < 100 && daemon_stat(fb, "daemon.pools") != 1; tries++) {
        usleep(10000);
    }
    assert_int_equal(daemon_stat(fb, "daemon.pools"), 1);
    att again = attach(fb, "m0");
    assert_int_equal(lookup(fb, again.pool_id, 400, 2, 0, NULL, NULL), 2);
    att n1 = attach(fb, "n1"), n2 = attach(fb, "n2"); /* room again for two */
    expect_code(rpc(fb, &e), KV_EQUOTA, "max-pools");
    close(fb);
    munmap(again.base, again.seg_bytes);
    munmap(n1.base, n1.seg_bytes);
    munmap(n2.base, n2.seg_bytes);
    stop(h);
}

static void run_selftest(kvd_daemon *s) {
    cur->selftest_rc = kvd_selftest_isolation(kvd_daemon_ops(s), cur->report, sizeof(cur->report));
}

static void test_selftest_isolation(void **state) {
    (void)state;
    harness *h = start("tenant alice token-file=%T/alice.token\n", two, 1, 1 << 20, run_selftest);
    if (h->selftest_rc != KV_OK) {
        fail_msg("selftest: %s\n%s", kv_strerror(h->selftest_rc), h->report);
    }
    assert_non_null(strstr(h->report, "ok different domain -> no hit"));
    assert_non_null(strstr(h->report, "ok same domain -> hit"));
    assert_null(strstr(h->report, "FAIL"));
    /* The self-test made and closed pools of its own: pools made after it get later ids, and
     * requests still find each one (the daemon's pool table is searched by id). */
    int fa = connect_as(h, "alice");
    att a = attach(fa, "m"), b = attach(fa, "m2");
    assert_true(a.pool_id > 2 && b.pool_id > a.pool_id);
    Kvd__BlockRef blk[2];
    allocate(fa, b.pool_id, 1, KV_OK, NULL, &blk[0]);
    allocate(fa, a.pool_id, 1, KV_OK, NULL, &blk[1]);
    allocate(fa, b.pool_id + 1, 1, KV_ENOENT, "not attached", NULL);
    close(fa);
    munmap(a.base, a.seg_bytes);
    munmap(b.base, b.seg_bytes);
    stop(h);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_identity_and_isolation),
        cmocka_unit_test(test_setuid_child_is_another_tenant),
        cmocka_unit_test(test_group_shares),
        cmocka_unit_test(test_commons_after_k_tenants),
        cmocka_unit_test(test_commons_counts_per_model_in_vllm_mode),
        cmocka_unit_test(test_quotas),
        cmocka_unit_test(test_quota_fields),
        cmocka_unit_test(test_quota_set_at_run_time),
        cmocka_unit_test(test_flood_keeps_guarantee),
        cmocka_unit_test(test_selftest_isolation),
        cmocka_unit_test(test_commit_parents),
        cmocka_unit_test(test_names_are_utf8),
        cmocka_unit_test(test_pin_quota_is_the_pinners),
        cmocka_unit_test(test_expired_pin_frees_quota),
        cmocka_unit_test(test_search_each_position),
        cmocka_unit_test(test_refused_allocate_changes_nothing),
        cmocka_unit_test(test_parking_keeps_guarantees),
        cmocka_unit_test(test_index_grows_with_pools),
        cmocka_unit_test(test_pools_bounded_and_freed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
