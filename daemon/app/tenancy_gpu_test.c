/* tenancy_gpu_test: promotion into a GPU commons, on a real in-process server whose backend is
 * cuda-vmm or cuda-ipc on the test driver (daemon/fake_cuda.c: the daemon's real device-copy
 * path, cuMemcpyDtoD through the dlopen'd table, runs; device memory is reached only through the
 * driver's copies, as on a GPU, so the test reads and writes segments through host staging
 * buffers). Three token tenants write and commit the same two-block
 * prefix in their private pools; a fourth then hits it in the commons, and every K/V run and
 * every scale of the commons blocks equals what the writers wrote. For layer-major and
 * block-major pools, fp16 and int8 (per-head float scales). */
#include <dlfcn.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>
#include <uv.h>

#include "common/kv_layout.h"
#include "common/kv_log.h"
#include "common/kv_wire.h"
#include "daemon/core/backend.h"
#include "daemon/config/config.h"
#include "common/kv_cuda.h"
#include "daemon/ops/selftest.h"
#include "daemon/app/daemon.h"
#include "daemon/testing/raw_client.h"

#define FAKE "daemon/testing/libfakecuda.so"
#define NBLOCKS 2 /* blocks of the shared prefix */
#define SALT 77   /* hash salt of the prefix */

static char fake_path[4096];
static kv_cuda cu; /* the test driver, loaded here too: opens cuda-ipc handles as a client would */

static const char *const names[] = {"t1", "t2", "t3", "t4"};

static int setup(void **state) {
    (void)state;
    /* Bazel runs tests in the runfiles tree; dlopen needs a path with a slash. */
    const char *src = getenv("TEST_SRCDIR");
    const char *ws = getenv("TEST_WORKSPACE");
    if (src != NULL && ws != NULL) {
        snprintf(fake_path, sizeof(fake_path), "%s/%s/%s", src, ws, FAKE);
    } else {
        snprintf(fake_path, sizeof(fake_path), "./%s", FAKE);
    }
    unsetenv("FAKE_CUDA_NO_DEVICE");
    unsetenv("FAKE_CUDA_NO_VMM");
    char why[256] = "";
    if (kv_cuda_load(fake_path, &cu, why, sizeof(why)) != KV_OK) {
        fprintf(stderr, "cannot load the test driver: %s\n", why);
        return -1;
    }
    return 0;
}

static int teardown(void **state) {
    (void)state;
    kv_cuda_unload(&cu);
    return 0;
}

/* Token of tenant name: 32 bytes derived from the name. */
static void token_of(const char *name, char *out) {
    snprintf(out, 40, "tok-%s-0123456789abcdef0123456789", name);
    out[32] = '\0';
}

static void write_file(const char *dir, const char *name, const char *text) {
    char path[256];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

/* Starts a server with backend, four token tenants and `commons min-tenants=3`. */
static void start(kvd_test_server *ts, const char *backend) {
    kvd_test_server_init(ts, "tenancy-gpu");
    char text[2048];
    size_t o = 0;
    for (size_t i = 0; i < 4; i++) {
        char tok[40], file[32];
        token_of(names[i], tok);
        snprintf(file, sizeof(file), "%s.token", names[i]);
        write_file(ts->dir, file, tok);
        o += (size_t)snprintf(text + o, sizeof(text) - o, "tenant %s token-file=%s/%s\n", names[i],
                              ts->dir, file);
    }
    snprintf(text + o, sizeof(text) - o, "commons min-tenants=3\n");
    write_file(ts->dir, "tenants", text);
    snprintf(ts->cfg.tenants_file, sizeof(ts->cfg.tenants_file), "%s/tenants", ts->dir);
    snprintf(ts->cfg.backend, sizeof(ts->cfg.backend), "%s", backend);
    ts->cfg.pool_memory = 256ull << 20;
    ts->cfg.segment_bytes = 2 << 20;
    ts->cfg.index_entries = 4096;
    ts->cfg.log_level = KV_LOG_WARN;
    /* The server thread opens the backend before kvd_test_server_start returns (in this process:
     * the test thread uses the same, already initialised driver). */
    setenv("KV_CUDA_LIBRARY", fake_path, 1);
    kvd_test_server_start(ts);
    unsetenv("KV_CUDA_LIBRARY");
}

static void stop(kvd_test_server *ts) {
    kvd_test_server_stop(ts);
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", ts->dir);
    assert_int_equal(system(cmd), 0);
}

static Kvd__Envelope *rpc_fds(int fd, Kvd__Envelope *req, int *fds, size_t *nfds) {
    req->id = kvd_raw_next_id();
    kvd_raw_send_env(fd, req);
    Kvd__Envelope *r = kvd_raw_recv_env_fds(fd, fds, nfds);
    assert_non_null(r);
    assert_int_equal(r->id, req->id);
    if (r->body_case == KVD__ENVELOPE__BODY_ERROR) {
        fail_msg("request %d: %s: %s", req->body_case, kv_err_name(r->error->code),
                 r->error->message);
    }
    return r;
}

static Kvd__Envelope *rpc(int fd, Kvd__Envelope *req) {
    int fds[KVD_RAW_MAX_FDS];
    size_t nfds = 0;
    Kvd__Envelope *r = rpc_fds(fd, req, fds, &nfds);
    for (size_t i = 0; i < nfds; i++) {
        close(fds[i]);
    }
    return r;
}

static int hello_as(kvd_test_server *ts, const char *name) {
    int fd = kvd_raw_dial(ts->cfg.socket);
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Hello hl = KVD__HELLO__INIT;
    char tok[40];
    token_of(name, tok);
    hl.protocol_version = 1;
    hl.client_name = "tenancy_gpu_test";
    hl.token.data = (uint8_t *)tok;
    hl.token.len = strlen(tok);
    e.body_case = KVD__ENVELOPE__BODY_HELLO;
    e.hello = &hl;
    Kvd__Envelope *r = rpc(fd, &e);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_HELLO_REPLY);
    assert_string_equal(r->hello_reply->tenant, name);
    kv_wire_free(r);
    return fd;
}

/* A segment mapped into this process as a client would, through the driver: VMM parts (or the
 * one allocation) imported and mapped back to back at offset 0, or the IPC handle opened. The
 * bytes are reached with cuMemcpyHtoD / cuMemcpyDtoH into the host image `host`. */
typedef struct mapped {
    kv_cu_deviceptr va; /* 0: not mapped */
    uint64_t bytes;     /* its size */
    int ipc;            /* opened with cuIpcOpenMemHandle */
    uint64_t parts[64]; /* VMM: sizes of the mappings, in address order */
    size_t nparts;      /* entries of parts */
    uint8_t *host;      /* host image of the segment (seg_pull / seg_push) */
} mapped;

static void set_rw(kv_cu_deviceptr va, uint64_t bytes) {
    kv_cu_access_desc acc;
    memset(&acc, 0, sizeof(acc));
    acc.location.type = KV_CU_MEM_LOCATION_TYPE_DEVICE;
    acc.flags = KV_CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    assert_int_equal(cu.mem_set_access(va, (size_t)bytes, &acc, 1), KV_CU_SUCCESS);
}

static mapped map_segment(const Kvd__Segment *s, const int *fds, size_t nfds, int expect_kind) {
    mapped m;
    memset(&m, 0, sizeof(m));
    m.bytes = s->bytes;
    assert_int_equal(s->kind, expect_kind);
    if (s->kind == KVD__MEMORY_KIND__CUDA_VMM) {
        size_t n = s->n_part_bytes > 0 ? s->n_part_bytes : 1;
        assert_true(n <= 64 && s->fd_index + n <= nfds);
        assert_int_equal(cu.mem_address_reserve(&m.va, (size_t)s->bytes, 0, 0, 0), KV_CU_SUCCESS);
        uint64_t off = 0;
        for (size_t k = 0; k < n; k++) {
            uint64_t len = s->n_part_bytes > 0 ? s->part_bytes[k] : s->bytes;
            kv_cu_mem_handle h;
            assert_int_equal(cu.mem_import(&h, (void *)(intptr_t)fds[s->fd_index + k],
                                           KV_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                             KV_CU_SUCCESS);
            assert_int_equal(cu.mem_map(m.va + off, (size_t)len, 0, h, 0), KV_CU_SUCCESS);
            set_rw(m.va + off, len);
            assert_int_equal(cu.mem_release(h), KV_CU_SUCCESS);
            m.parts[m.nparts++] = len;
            off += len;
        }
    } else {
        assert_int_equal(s->ipc_handle.len, KV_CU_IPC_HANDLE_SIZE);
        kv_cu_ipc_mem_handle h;
        memcpy(h.reserved, s->ipc_handle.data, KV_CU_IPC_HANDLE_SIZE);
        assert_int_equal(cu.ipc_open_mem_handle(&m.va, h, KV_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                         KV_CU_SUCCESS);
        m.ipc = 1;
    }
    m.host = calloc(1, (size_t)m.bytes);
    assert_non_null(m.host);
    return m;
}

/* Device -> host image, and back (synchronized: the daemon reads it next). */
static void seg_pull(mapped *m) {
    assert_int_equal(cu.memcpy_dtoh(m->host, m->va, (size_t)m->bytes), KV_CU_SUCCESS);
}

static void seg_push(mapped *m) {
    assert_int_equal(cu.memcpy_htod(m->va, m->host, (size_t)m->bytes), KV_CU_SUCCESS);
    assert_int_equal(cu.ctx_synchronize(), KV_CU_SUCCESS);
}

static void unmap_segment(mapped *m) {
    if (m->va == 0) {
        return;
    }
    if (m->ipc) {
        assert_int_equal(cu.ipc_close_mem_handle(m->va), KV_CU_SUCCESS);
    } else {
        uint64_t off = 0;
        for (size_t k = 0; k < m->nparts; k++) {
            assert_int_equal(cu.mem_unmap(m->va + off, (size_t)m->parts[k]), KV_CU_SUCCESS);
            off += m->parts[k];
        }
        assert_int_equal(cu.mem_address_free(m->va, (size_t)m->bytes), KV_CU_SUCCESS);
    }
    free(m->host);
    m->va = 0;
}

typedef struct tenant_view {
    int fd;           /* session socket */
    uint32_t pool_id; /* private pool */
    uint32_t bps;     /* its blocks per segment */
    uint32_t commons; /* the linked commons pool */
    uint32_t cbps;    /* its blocks per segment */
    mapped seg0;      /* segment 0 of the private pool */
} tenant_view;

static tenant_view attach(kvd_test_server *ts, const char *name, const kv_layout *l, int kind) {
    tenant_view t;
    memset(&t, 0, sizeof(t));
    t.fd = hello_as(ts, name);
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__AttachPool a = KVD__ATTACH_POOL__INIT;
    Kvd__Layout pl = KVD__LAYOUT__INIT;
    pl.num_layers = l->num_layers;
    pl.num_kv_heads = l->num_kv_heads;
    pl.head_dim = l->head_dim;
    pl.tokens_per_block = l->tokens_per_block;
    pl.dtype = (Kvd__DType)l->dtype;
    pl.arrangement = (Kvd__Arrangement)l->arrangement;
    a.model_id = "m";
    a.layout = &pl;
    e.body_case = KVD__ENVELOPE__BODY_ATTACH_POOL;
    e.attach_pool = &a;
    int fds[KVD_RAW_MAX_FDS];
    size_t nfds = 0;
    Kvd__Envelope *r = rpc_fds(t.fd, &e, fds, &nfds);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_ATTACH_POOL_REPLY);
    Kvd__AttachPoolReply *ar = r->attach_pool_reply;
    assert_int_equal(ar->layout->block_bytes, l->block_bytes);
    t.pool_id = ar->pool_id;
    t.bps = ar->blocks_per_segment;
    assert_int_equal(ar->n_linked, 1);
    assert_string_equal(ar->linked[0]->domain, "commons");
    assert_true(ar->linked[0]->read_only);
    t.commons = ar->linked[0]->pool_id;
    t.cbps = ar->linked[0]->blocks_per_segment;
    assert_true(ar->n_segments >= 1);
    t.seg0 = map_segment(ar->segments[0], fds, nfds, kind);
    for (size_t i = 0; i < nfds; i++) {
        close(fds[i]);
    }
    kv_wire_free(r);
    return t;
}

static Kvd__Hash128 hash_of(size_t i) {
    Kvd__Hash128 h = KVD__HASH128__INIT;
    h.lo = SALT * 1000 + i;
    h.hi = 0x6770755f636f6dull;
    return h;
}

/* The byte at offset j of block i's (layer, kv) run, and the scale of (i, layer, kv, head). */
static uint8_t pattern(size_t i, uint32_t layer, int kv, uint64_t j) {
    return (uint8_t)(1 + i * 53 + layer * 17 + (uint64_t)kv * 7 + j * 3 + (j >> 8));
}

static float scale_of(size_t i, uint32_t layer, int kv, uint32_t h) {
    return 0.5f + (float)(i * 1000 + layer * 100 + (uint32_t)kv * 10 + h);
}

/* Writes prefix block i into block id of a segment mapping (segment-local slot id % bps). */
static void fill_block(uint8_t *base, const kv_layout *l, uint32_t bps, uint32_t slot, size_t i) {
    for (uint32_t layer = 0; layer < l->num_layers; layer++) {
        for (int kv = KV_K; kv <= KV_V; kv++) {
            uint64_t off = kv_layout_offset(l, bps, slot, layer, kv, 0, 0);
            for (uint64_t j = 0; j < l->kv_block_bytes; j++) {
                base[off + j] = pattern(i, layer, kv, j);
            }
            for (uint32_t h = 0; l->scale_bytes != 0 && h < l->num_kv_heads; h++) {
                float f = scale_of(i, layer, kv, h);
                memcpy(base + kv_layout_scale_offset(l, bps, slot, layer, kv, h), &f, sizeof(f));
            }
        }
    }
}

/* Checks that block slot of a segment mapping holds prefix block i. */
static void check_block(const uint8_t *base, const kv_layout *l, uint32_t bps, uint32_t slot,
                        size_t i) {
    for (uint32_t layer = 0; layer < l->num_layers; layer++) {
        for (int kv = KV_K; kv <= KV_V; kv++) {
            uint64_t off = kv_layout_offset(l, bps, slot, layer, kv, 0, 0);
            for (uint64_t j = 0; j < l->kv_block_bytes; j++) {
                if (base[off + j] != pattern(i, layer, kv, j)) {
                    fail_msg("block %zu layer %u kv %d byte %llu: %u, wrote %u", i, layer, kv,
                             (unsigned long long)j, base[off + j], pattern(i, layer, kv, j));
                }
            }
            for (uint32_t h = 0; l->scale_bytes != 0 && h < l->num_kv_heads; h++) {
                float f;
                memcpy(&f, base + kv_layout_scale_offset(l, bps, slot, layer, kv, h), sizeof(f));
                if (f != scale_of(i, layer, kv, h)) {
                    fail_msg("block %zu layer %u kv %d head %u: scale %f, wrote %f", i, layer, kv,
                             h, (double)f, (double)scale_of(i, layer, kv, h));
                }
            }
        }
    }
}

/* Allocates NBLOCKS blocks in t's private pool, writes the prefix into them through t's
 * mapping, commits them as one chain and releases them. */
static void put_prefix(tenant_view *t, const kv_layout *l) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Allocate al = KVD__ALLOCATE__INIT;
    al.pool_id = t->pool_id;
    al.count = NBLOCKS;
    e.body_case = KVD__ENVELOPE__BODY_ALLOCATE;
    e.allocate = &al;
    Kvd__Envelope *r = rpc(t->fd, &e);
    assert_int_equal(r->allocate_reply->n_blocks, NBLOCKS);
    Kvd__BlockRef br[NBLOCKS];
    Kvd__BlockRef *pbr[NBLOCKS];
    for (size_t i = 0; i < NBLOCKS; i++) {
        kvd__block_ref__init(&br[i]);
        br[i].id = r->allocate_reply->blocks[i]->id;
        br[i].gen = r->allocate_reply->blocks[i]->gen;
        pbr[i] = &br[i];
        assert_true(br[i].id < t->bps); /* segment 0, which we mapped */
    }
    kv_wire_free(r);
    seg_pull(&t->seg0);
    for (size_t i = 0; i < NBLOCKS; i++) {
        fill_block(t->seg0.host, l, t->bps, br[i].id, i);
    }
    seg_push(&t->seg0); /* written and synchronized before the Commit */
    Kvd__Envelope c = KVD__ENVELOPE__INIT;
    Kvd__Commit cm = KVD__COMMIT__INIT;
    Kvd__CommitEntry ent[NBLOCKS];
    Kvd__CommitEntry *pe[NBLOCKS];
    Kvd__Hash128 h[NBLOCKS];
    for (size_t i = 0; i < NBLOCKS; i++) {
        kvd__commit_entry__init(&ent[i]);
        h[i] = hash_of(i);
        ent[i].block = &br[i];
        ent[i].hash = &h[i];
        ent[i].parent = i == 0 ? UINT32_MAX : br[i - 1].id;
        pe[i] = &ent[i];
    }
    cm.pool_id = t->pool_id;
    cm.n_entries = NBLOCKS;
    cm.entries = pe;
    c.body_case = KVD__ENVELOPE__BODY_COMMIT;
    c.commit = &cm;
    r = rpc(t->fd, &c);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_COMMIT_REPLY);
    kv_wire_free(r);
    Kvd__Envelope rl = KVD__ENVELOPE__INIT;
    Kvd__Release rel = KVD__RELEASE__INIT;
    rel.pool_id = t->pool_id;
    rel.n_blocks = NBLOCKS;
    rel.blocks = pbr;
    rl.body_case = KVD__ENVELOPE__BODY_RELEASE;
    rl.release = &rel;
    kv_wire_free(rpc(t->fd, &rl));
}

/* Lookup of the prefix with the domain search from t's private pool: hits and their pools. */
static size_t lookup(tenant_view *t, Kvd__BlockRef *out, uint32_t *pools) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Lookup lk = KVD__LOOKUP__INIT;
    Kvd__Hash128 h[NBLOCKS];
    Kvd__Hash128 *ph[NBLOCKS];
    for (size_t i = 0; i < NBLOCKS; i++) {
        h[i] = hash_of(i);
        ph[i] = &h[i];
    }
    lk.pool_id = t->pool_id;
    lk.n_hashes = NBLOCKS;
    lk.hashes = ph;
    lk.search_domains = 1;
    e.body_case = KVD__ENVELOPE__BODY_LOOKUP;
    e.lookup = &lk;
    Kvd__Envelope *r = rpc(t->fd, &e);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_LOOKUP_REPLY);
    size_t k = r->lookup_reply->n_blocks;
    assert_int_equal(r->lookup_reply->n_pool_ids, k);
    for (size_t i = 0; i < k && out != NULL; i++) {
        out[i].id = r->lookup_reply->blocks[i]->id;
        out[i].gen = r->lookup_reply->blocks[i]->gen;
        pools[i] = r->lookup_reply->pool_ids[i];
    }
    kv_wire_free(r);
    return k;
}

/* Maps segment index seg of the commons pool through MapSegments (read_only set: advisory on
 * GPU, docs/TENANCY.md). */
static mapped map_commons(tenant_view *t, uint32_t seg, int kind) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__MapSegments ms = KVD__MAP_SEGMENTS__INIT;
    ms.pool_id = t->commons;
    e.body_case = KVD__ENVELOPE__BODY_MAP_SEGMENTS;
    e.map_segments = &ms;
    int fds[KVD_RAW_MAX_FDS];
    size_t nfds = 0;
    Kvd__Envelope *r = rpc_fds(t->fd, &e, fds, &nfds);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_MAP_SEGMENTS_REPLY);
    mapped m;
    memset(&m, 0, sizeof(m));
    for (size_t i = 0; i < r->map_segments_reply->n_segments; i++) {
        const Kvd__Segment *s = r->map_segments_reply->segments[i];
        if (s->index == seg) {
            assert_true(s->read_only);
            m = map_segment(s, fds, nfds, kind);
        }
    }
    assert_true(m.va != 0);
    for (size_t i = 0; i < nfds; i++) {
        close(fds[i]);
    }
    kv_wire_free(r);
    return m;
}

static void read_dtod_on_loop(kvd_daemon *s, void *arg) {
    (void)s;
    const unsigned long long *n = dlsym(cu.lib, "fake_cuda_dtod_bytes");
    *(unsigned long long *)arg = n != NULL ? *n : ~0ull;
}

/* Bytes the test driver's cuMemcpyDtoD copied so far, read on the loop thread (which writes the
 * counter). */
static unsigned long long dtod_bytes(kvd_test_server *ts) {
    unsigned long long n = 0;
    kvd_test_server_call(ts, read_dtod_on_loop, &n);
    assert_true(n != ~0ull);
    return n;
}

static void run_case(const char *backend, kv_dtype dtype, kv_arrangement arr) {
    int kind =
        strcmp(backend, "cuda-vmm") == 0 ? KVD__MEMORY_KIND__CUDA_VMM : KVD__MEMORY_KIND__CUDA_IPC;
    kv_layout l;
    assert_int_equal(kv_layout_init(3, 2, 64, 16, dtype, arr, &l), KV_OK);
    kvd_test_server ts;
    start(&ts, backend);
    tenant_view t[4];
    for (int i = 0; i < 4; i++) {
        t[i] = attach(&ts, names[i], &l, kind);
        assert_int_equal(t[i].commons, t[0].commons);
    }
    /* Two tenants: not yet in the commons. */
    put_prefix(&t[0], &l);
    put_prefix(&t[1], &l);
    assert_int_equal(lookup(&t[3], NULL, NULL), 0);
    /* The third: the daemon copies the blocks into the commons on the device, every byte of
     * them (K and V runs and scales) with cuMemcpyDtoD. */
    unsigned long long before = dtod_bytes(&ts);
    put_prefix(&t[2], &l);
    assert_int_equal(dtod_bytes(&ts) - before, (unsigned long long)NBLOCKS * l.block_bytes);
    Kvd__BlockRef hit[NBLOCKS];
    uint32_t pools[NBLOCKS];
    assert_int_equal(lookup(&t[3], hit, pools), NBLOCKS);
    for (size_t i = 0; i < NBLOCKS; i++) {
        assert_int_equal(pools[i], t[3].commons);
        mapped m = map_commons(&t[3], hit[i].id / t[3].cbps, kind);
        seg_pull(&m);
        check_block(m.host, &l, t[3].cbps, hit[i].id % t[3].cbps, i);
        unmap_segment(&m);
    }
    for (int i = 0; i < 4; i++) {
        unmap_segment(&t[i].seg0);
        close(t[i].fd);
    }
    stop(&ts);
}

static void test_vmm_layer_major_fp16(void **state) {
    (void)state;
    run_case("cuda-vmm", KV_DTYPE_FP16, KV_LAYER_MAJOR);
}

static void test_vmm_block_major_fp16(void **state) {
    (void)state;
    run_case("cuda-vmm", KV_DTYPE_FP16, KV_BLOCK_MAJOR);
}

static void test_vmm_layer_major_int8(void **state) {
    (void)state;
    run_case("cuda-vmm", KV_DTYPE_INT8, KV_LAYER_MAJOR);
}

static void test_vmm_block_major_int8(void **state) {
    (void)state;
    run_case("cuda-vmm", KV_DTYPE_INT8, KV_BLOCK_MAJOR);
}

static void test_ipc_layer_major_int8(void **state) {
    (void)state;
    run_case("cuda-ipc", KV_DTYPE_INT8, KV_LAYER_MAJOR);
}

static void test_ipc_block_major_fp16(void **state) {
    (void)state;
    run_case("cuda-ipc", KV_DTYPE_FP16, KV_BLOCK_MAJOR);
}

static void run_selftest_on_loop(kvd_daemon *s, void *arg) {
    static char report[2048];
    *(kv_err *)arg = kvd_selftest_isolation(kvd_daemon_ops(s), report, sizeof(report));
    if (*(kv_err *)arg != KV_OK) {
        fprintf(stderr, "%s\n", report);
    }
}

/* `kvctl selftest isolation` on a GPU backend: the self-test writes and reads block bytes through
 * the backend (segment bases are device addresses there; it used to memset them from the host,
 * which on a GPU machine is a SIGSEGV of kvd). */
static void test_selftest_on_gpu(void **state) {
    (void)state;
    const char *backends[] = {"cuda-vmm", "cuda-ipc"};
    for (int i = 0; i < 2; i++) {
        kvd_test_server ts;
        start(&ts, backends[i]);
        kv_err rc = KV_EINTERNAL;
        kvd_test_server_call(&ts, run_selftest_on_loop, &rc);
        assert_int_equal(rc, KV_OK);
        stop(&ts);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_vmm_layer_major_fp16), cmocka_unit_test(test_vmm_block_major_fp16),
        cmocka_unit_test(test_vmm_layer_major_int8), cmocka_unit_test(test_vmm_block_major_int8),
        cmocka_unit_test(test_ipc_layer_major_int8), cmocka_unit_test(test_ipc_block_major_fp16),
        cmocka_unit_test(test_selftest_on_gpu),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
