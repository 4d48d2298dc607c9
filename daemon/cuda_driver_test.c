/* cuda_driver_test: the dlopen loader, backend selection and both GPU backends, on a machine
 * without a GPU. A missing library and a library without the driver's symbols give clear
 * reasons; `auto` falls back to host saying why; an explicit GPU backend fails. With the test
 * driver (daemon/fake_cuda.c: VMM allocations are memfds) the real backend code runs: a cuda-vmm
 * segment's exported fd shows the daemon's bytes, a cuda-ipc segment's handle opens; and a real
 * server answers AttachPool with CUDA_VMM segments and fds, or CUDA_IPC handles and no fds. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cmocka.h>
#include <uv.h>

#include "common/kv_log.h"
#include "common/kv_wire.h"
#include "daemon/backend_cuda.h"
#include "daemon/config.h"
#include "daemon/cuda_driver.h"
#include "daemon/server.h"
#include "daemon/server_backend.h"
#include "daemon/server_int.h"
#include "daemon/testing/raw_client.h"

#define FAKE "daemon/testdata/libfakecuda.so"
#define MISSING "/nonexistent/libcuda.so.1"

static char fake_path[4096];

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
    unsetenv("KV_CUDA_LIBRARY");
    kv_log_threshold = KV_LOG_ERROR;
    return 0;
}

static void test_missing_library(void **state) {
    (void)state;
    kv_cuda cu;
    memset(&cu, 0x5a, sizeof(cu));
    char why[256] = "";
    assert_int_equal(kv_cuda_load(MISSING, &cu, why, sizeof(why)), KV_ENOGPU);
    assert_non_null(strstr(why, MISSING " not found"));
    assert_int_equal(((unsigned char *)&cu)[0], 0x5a); /* untouched on failure */
    /* The default name, and the environment override. */
    assert_string_equal(kv_cuda_library_name(), "libcuda.so.1");
    setenv("KV_CUDA_LIBRARY", MISSING, 1);
    assert_string_equal(kv_cuda_library_name(), MISSING);
    assert_int_equal(kv_cuda_load(NULL, &cu, why, sizeof(why)), KV_ENOGPU);
    unsetenv("KV_CUDA_LIBRARY");
    kv_cuda_unload(NULL);
}

static void test_library_without_symbols(void **state) {
    (void)state;
    kv_cuda cu;
    char why[256] = "";
    assert_int_equal(kv_cuda_load("libc.so.6", &cu, why, sizeof(why)), KV_ENOGPU);
    assert_non_null(strstr(why, "lacks cuInit"));
}

static void test_fake_driver(void **state) {
    (void)state;
    kv_cuda cu;
    char why[256] = "";
    assert_int_equal(kv_cuda_load(fake_path, &cu, why, sizeof(why)), KV_OK);
    assert_int_equal(cu.driver_version, 13000);
    kv_cuda_device d;
    assert_int_equal(kv_cuda_device_open(&cu, 0, &d, why, sizeof(why)), KV_OK);
    assert_true(d.vmm && d.posix_fd);
    assert_int_equal(d.granularity, 64u << 10);
    assert_string_equal(d.name, "kvd fake GPU");
    kv_cuda_device other;
    assert_int_equal(kv_cuda_device_open(&cu, 3, &other, why, sizeof(why)), KV_ENOGPU);
    assert_non_null(strstr(why, "device 3 does not exist"));
    char buf[128];
    assert_string_equal(kv_cuda_strerror(&cu, KV_CU_ERROR_NO_DEVICE, buf, sizeof(buf)),
                        "CUDA_ERROR_NO_DEVICE (no CUDA-capable device is detected)");
    assert_string_equal(kv_cuda_strerror(NULL, 7, buf, sizeof(buf)), "CUresult 7");
    kv_cuda_device_close(&cu, &d);
    kv_cuda_unload(&cu);
    assert_null(cu.lib);

    setenv("FAKE_CUDA_NO_DEVICE", "1", 1);
    assert_int_equal(kv_cuda_load(fake_path, &cu, why, sizeof(why)), KV_ENOGPU);
    assert_non_null(strstr(why, "cuInit failed: CUDA_ERROR_NO_DEVICE"));
    unsetenv("FAKE_CUDA_NO_DEVICE");
}

static void test_select(void **state) {
    (void)state;
    kvd_backend_host_ctx host = {0};
    kvd_backend_sel sel;
    char why[512] = "";
    /* auto without a driver: host, and the reason names the library. */
    assert_int_equal(kvd_backend_select("auto", 0, MISSING, &host, &sel, why, sizeof(why)), KV_OK);
    assert_ptr_equal(sel.ops, &kvd_backend_host);
    assert_ptr_equal(sel.ctx, &host);
    assert_null(sel.cuda);
    assert_non_null(strstr(sel.reason, "backend host: no usable GPU: " MISSING " not found"));
    kvd_backend_sel_fini(&sel);
    /* An explicit GPU backend without a driver is an error. */
    assert_int_equal(kvd_backend_select("cuda-vmm", 0, MISSING, &host, &sel, why, sizeof(why)),
                     KV_ENOGPU);
    assert_non_null(strstr(why, "backend cuda-vmm: no usable GPU: " MISSING " not found"));
    assert_int_equal(kvd_backend_select("cuda-ipc", 0, MISSING, &host, &sel, why, sizeof(why)),
                     KV_ENOGPU);
    assert_int_equal(kvd_backend_select("floppy", 0, MISSING, &host, &sel, why, sizeof(why)),
                     KV_EINVAL);
    assert_int_equal(kvd_backend_select("host", 0, MISSING, &host, &sel, why, sizeof(why)), KV_OK);
    assert_ptr_equal(sel.ops, &kvd_backend_host);
    kvd_backend_sel_fini(&sel);
    /* With a (test) driver: auto takes cuda-vmm; without VMM support, cuda-ipc. */
    assert_int_equal(kvd_backend_select("auto", 0, fake_path, &host, &sel, why, sizeof(why)),
                     KV_OK);
    assert_ptr_equal(sel.ops, &kvd_backend_cuda_vmm);
    assert_non_null(sel.cuda);
    assert_non_null(strstr(sel.reason, "backend cuda-vmm: device 0 (kvd fake GPU)"));
    kvd_backend_sel_fini(&sel);
    setenv("FAKE_CUDA_NO_VMM", "1", 1);
    assert_int_equal(kvd_backend_select("auto", 0, fake_path, &host, &sel, why, sizeof(why)),
                     KV_OK);
    assert_ptr_equal(sel.ops, &kvd_backend_cuda_ipc);
    kvd_backend_sel_fini(&sel);
    assert_int_equal(kvd_backend_select("cuda-vmm", 0, fake_path, &host, &sel, why, sizeof(why)),
                     KV_ENOGPU);
    assert_non_null(strstr(why, "cannot export VMM memory"));
    unsetenv("FAKE_CUDA_NO_VMM");
    /* A device that does not exist. */
    assert_int_equal(kvd_backend_select("cuda-vmm", 5, fake_path, &host, &sel, why, sizeof(why)),
                     KV_ENOGPU);
    assert_non_null(strstr(why, "device 5 does not exist"));
}

static void test_vmm_segments(void **state) {
    (void)state;
    kvd_backend_cuda_ctx c;
    char why[256];
    assert_int_equal(kvd_backend_cuda_open(&c, KVD_MEM_CUDA_VMM, 0, fake_path, why, sizeof(why)),
                     KV_OK);
    const kvd_backend_ops *be = &kvd_backend_cuda_vmm;
    assert_int_equal(be->kind, KVD_MEM_CUDA_VMM);
    assert_int_equal(be->align(&c), 64u << 10);
    kvd_segment_mem m;
    assert_int_equal(be->segment_alloc(&c, 0, &m), KV_EINVAL);
    assert_int_equal(be->segment_alloc(&c, 100000, &m), KV_OK);
    assert_int_equal(m.bytes, 128u << 10); /* rounded to the granularity */
    assert_true(m.fd > 2);
    assert_int_equal(c.segments, 1);
    /* The daemon's mapping is zeroed, and the exported fd is the same memory. */
    uint8_t *base = m.base;
    assert_int_equal(base[0], 0);
    assert_int_equal(base[m.bytes - 1], 0);
    base[12345] = 0xab;
    uint8_t *other = mmap(NULL, m.bytes, PROT_READ, MAP_SHARED, m.fd, 0);
    assert_true(other != MAP_FAILED);
    assert_int_equal(other[12345], 0xab);
    /* Freeing in the daemon leaves an importer's mapping valid (memory is refcounted). */
    be->segment_free(&c, &m);
    assert_int_equal(other[12345], 0xab);
    munmap(other, 128u << 10);
    assert_int_equal(c.segments, 0);
    kvd_segment_mem zero;
    memset(&zero, 0, sizeof(zero));
    be->segment_free(&c, &zero);
    kvd_backend_cuda_close(&c);
    kvd_backend_cuda_close(NULL);
}

static void test_ipc_segments(void **state) {
    (void)state;
    kvd_backend_cuda_ctx c;
    char why[256];
    assert_int_equal(kvd_backend_cuda_open(&c, KVD_MEM_CUDA_IPC, 0, fake_path, why, sizeof(why)),
                     KV_OK);
    const kvd_backend_ops *be = &kvd_backend_cuda_ipc;
    kvd_segment_mem m;
    assert_int_equal(be->segment_alloc(&c, 5000, &m), KV_OK);
    assert_int_equal(m.bytes, 2u << 20);
    assert_int_equal(m.fd, -1);
    uint8_t zeros[64] = {0};
    assert_memory_not_equal(m.ipc_handle, zeros, 64);
    ((uint8_t *)m.base)[777] = 0x42;
    /* Open the handle as a client would (here through the same driver table). */
    kv_cu_ipc_mem_handle h;
    memcpy(h.reserved, m.ipc_handle, 64);
    kv_cu_deviceptr p;
    assert_int_equal(c.cu.ipc_open_mem_handle(&p, h, KV_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                     KV_CU_SUCCESS);
    assert_int_equal(((uint8_t *)(uintptr_t)p)[777], 0x42);
    assert_int_equal(c.cu.ipc_close_mem_handle(p), KV_CU_SUCCESS);
    be->segment_free(&c, &m);
    kvd_backend_cuda_close(&c);
}

/* ---- a real server with a GPU backend --------------------------------------------------- */

typedef kvd_test_server harness;

/* What the loop thread reports about one segment (read there: the loop owns it). */
typedef struct seg_query {
    uint32_t pool_id;
    uint32_t seg;
    int mappers;
    int may_free;
} seg_query;

static void seg_query_on_loop(kvd_server *s, void *arg) {
    seg_query *q = arg;
    q->mappers = (int)kvd_segment_mappers(s, q->pool_id, q->seg);
    q->may_free = kvd_segment_may_free(s, q->pool_id, q->seg);
}

static seg_query seg_state(harness *h, uint32_t pool_id, uint32_t seg) {
    seg_query q = {pool_id, seg, 0, 0};
    kvd_test_server_call(h, seg_query_on_loop, &q);
    return q;
}

static void start(harness *h, const char *backend) {
    kvd_test_server_init(h, "cuda-test");
    snprintf(h->cfg.backend, sizeof(h->cfg.backend), "%s", backend);
    h->cfg.pool_memory = 16 << 20;
    h->cfg.segment_bytes = 64 << 10;
    h->cfg.index_entries = 4096;
    h->cfg.log_level = KV_LOG_ERROR;
    /* The server thread opens the backend before kvd_test_server_start returns. */
    setenv("KV_CUDA_LIBRARY", fake_path, 1);
    kvd_test_server_start(h);
    unsetenv("KV_CUDA_LIBRARY");
}

static void stop(harness *h) {
    kvd_test_server_stop(h);
    rmdir(h->dir);
}

static int dial(harness *h) {
    return kvd_raw_dial(h->cfg.socket);
}

static Kvd__Envelope *call(int fd, Kvd__Envelope *req, int *fds, size_t *nfds) {
    kvd_raw_send_env(fd, req);
    Kvd__Envelope *r = kvd_raw_recv_env_fds(fd, fds, nfds);
    assert_non_null(r);
    assert_int_equal(r->id, req->id);
    return r;
}

static Kvd__AttachPoolReply *hello_attach(int fd, Kvd__Envelope **keep, int *fds, size_t *nfds) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Hello h = KVD__HELLO__INIT;
    h.protocol_version = 1;
    h.client_name = "cuda_driver_test";
    e.id = 1;
    e.body_case = KVD__ENVELOPE__BODY_HELLO;
    e.hello = &h;
    Kvd__Envelope *r = call(fd, &e, fds, nfds);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_HELLO_REPLY);
    kv_wire_free(r);
    Kvd__Envelope a = KVD__ENVELOPE__INIT;
    Kvd__AttachPool ap = KVD__ATTACH_POOL__INIT;
    Kvd__Layout l = KVD__LAYOUT__INIT;
    l.num_layers = 2;
    l.num_kv_heads = 2;
    l.head_dim = 64;
    l.tokens_per_block = 16;
    l.dtype = KVD__DTYPE__FP16;
    l.arrangement = KVD__ARRANGEMENT__LAYER_MAJOR;
    ap.model_id = "m";
    ap.layout = &l;
    a.id = 2;
    a.body_case = KVD__ENVELOPE__BODY_ATTACH_POOL;
    a.attach_pool = &ap;
    r = call(fd, &a, fds, nfds);
    if (r->body_case == KVD__ENVELOPE__BODY_ERROR) {
        fail_msg("attach: %s", r->error->message);
    }
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_ATTACH_POOL_REPLY);
    *keep = r;
    return r->attach_pool_reply;
}

static void test_server_vmm(void **state) {
    (void)state;
    harness h;
    start(&h, "cuda-vmm");
    assert_string_equal(h.srv->cfg.backend, "cuda-vmm");
    int fd = dial(&h);
    int fds[200];
    size_t nfds;
    Kvd__Envelope *keep;
    Kvd__AttachPoolReply *ar = hello_attach(fd, &keep, fds, &nfds);
    assert_true(ar->n_segments >= 1);
    assert_int_equal(nfds, ar->n_segments);
    const Kvd__Segment *s0 = ar->segments[0];
    assert_int_equal(s0->kind, KVD__MEMORY_KIND__CUDA_VMM);
    assert_int_equal(s0->bytes % (64u << 10), 0);
    assert_int_equal(s0->ipc_handle.len, 0);
    /* Layer sections are granularity multiples: blocks_per_segment * kv_block_bytes. */
    kv_layout lay;
    assert_int_equal(kv_layout_init(2, 2, 64, 16, KV_DTYPE_FP16, KV_LAYER_MAJOR, &lay), KV_OK);
    assert_int_equal(((uint64_t)ar->blocks_per_segment * lay.kv_block_bytes) % (64u << 10), 0);
    /* The fd is the daemon's allocation: what the daemon's mapping holds, we see. */
    uint8_t *dev = h.srv->pools[0].pool != NULL
                       ? (uint8_t *)kvd_pool_segment(h.srv->pools[0].pool, 0)->base
                       : NULL;
    assert_non_null(dev);
    uint8_t *mine = mmap(NULL, s0->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fds[s0->fd_index], 0);
    assert_true(mine != MAP_FAILED);
    mine[4096] = 0x77;
    assert_int_equal(dev[4096], 0x77);
    munmap(mine, s0->bytes);
    /* The session was sent segment 0; the rule for freeing holds for VMM anyway. */
    seg_query q = seg_state(&h, ar->pool_id, 0);
    assert_int_equal(q.mappers, 1);
    assert_int_equal(q.may_free, 1);
    for (size_t i = 0; i < nfds; i++) {
        close(fds[i]);
    }
    kv_wire_free(keep);
    close(fd);
    stop(&h);
}

static void test_server_ipc(void **state) {
    (void)state;
    harness h;
    start(&h, "cuda-ipc");
    int fd = dial(&h);
    int fds[200];
    size_t nfds;
    Kvd__Envelope *keep;
    Kvd__AttachPoolReply *ar = hello_attach(fd, &keep, fds, &nfds);
    assert_int_equal(nfds, 0); /* handles, not fds */
    const Kvd__Segment *s0 = ar->segments[0];
    assert_int_equal(s0->kind, KVD__MEMORY_KIND__CUDA_IPC);
    assert_int_equal(s0->ipc_handle.len, 64);
    assert_memory_equal(s0->ipc_handle.data, kvd_pool_segment(h.srv->pools[0].pool, 0)->ipc_handle,
                        64);
    /* A live session was sent it: cuda-ipc must not free it. */
    uint32_t pool_id = ar->pool_id;
    seg_query q = seg_state(&h, pool_id, 0);
    assert_int_equal(q.mappers, 1);
    assert_int_equal(q.may_free, 0);
    assert_int_equal(seg_state(&h, pool_id, 1).may_free, 1);
    kv_wire_free(keep);
    close(fd);
    /* Once the connection is gone (the loop notices the close), it may be freed. Ask the loop
     * over a second connection until it reports only that one session: reading the server's
     * state from this thread while the loop may still be closing the first would race. */
    int fd2 = dial(&h);
    kvd_raw_hello(fd2, "ipc-check");
    uint64_t sessions = 0;
    for (int i = 0; i < 2000; i++) {
        Kvd__Stats st = KVD__STATS__INIT;
        Kvd__Envelope req = KVD__ENVELOPE__INIT;
        req.id = kvd_raw_next_id();
        req.body_case = KVD__ENVELOPE__BODY_STATS;
        req.stats = &st;
        Kvd__Envelope *rep = kvd_raw_rpc(fd2, &req);
        assert_int_equal(rep->body_case, KVD__ENVELOPE__BODY_STATS_REPLY);
        for (size_t j = 0; j < rep->stats_reply->n_stats; j++) {
            if (strcmp(rep->stats_reply->stats[j]->name, "daemon.sessions") == 0) {
                sessions = rep->stats_reply->stats[j]->value;
            }
        }
        kv_wire_free(rep);
        if (sessions == 1) {
            break;
        }
        usleep(1000);
    }
    assert_int_equal(sessions, 1);
    assert_int_equal(seg_state(&h, pool_id, 0).may_free, 1);
    close(fd2);
    stop(&h);
}

static void test_server_explicit_gpu_fails(void **state) {
    (void)state;
    kvd_config cfg;
    kvd_config_init(&cfg);
    snprintf(cfg.backend, sizeof(cfg.backend), "cuda-vmm");
    uv_loop_t loop;
    assert_int_equal(uv_loop_init(&loop), 0);
    setenv("KV_CUDA_LIBRARY", MISSING, 1);
    kvd_server *srv = NULL;
    assert_int_equal(kvd_server_alloc(&cfg, &loop, &srv), KV_ENOGPU);
    assert_null(srv);
    /* auto on the same machine starts, on host. */
    snprintf(cfg.backend, sizeof(cfg.backend), "auto");
    assert_int_equal(kvd_server_alloc(&cfg, &loop, &srv), KV_OK);
    assert_string_equal(srv->cfg.backend, "host");
    kvd_server_free(srv);
    unsetenv("KV_CUDA_LIBRARY");
    assert_int_equal(uv_loop_close(&loop), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_missing_library, setup),
        cmocka_unit_test_setup(test_library_without_symbols, setup),
        cmocka_unit_test_setup(test_fake_driver, setup),
        cmocka_unit_test_setup(test_select, setup),
        cmocka_unit_test_setup(test_vmm_segments, setup),
        cmocka_unit_test_setup(test_ipc_segments, setup),
        cmocka_unit_test_setup(test_server_vmm, setup),
        cmocka_unit_test_setup(test_server_ipc, setup),
        cmocka_unit_test_setup(test_server_explicit_gpu_fails, setup),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
