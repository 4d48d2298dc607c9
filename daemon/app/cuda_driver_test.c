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
#include <sys/wait.h>
#include <signal.h>
#include <unistd.h>

#include <cmocka.h>
#include <uv.h>

#include "common/kv_log.h"
#include "common/kv_wire.h"
#include "daemon/mem/backend_cuda.h"
#include "daemon/config/config.h"
#include "common/kv_cuda.h"
#include "daemon/app/daemon.h"
#include "daemon/testing/raw_client.h"

#define FAKE "daemon/testing/libfakecuda.so"
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
    assert_int_equal(d.granularity, 2u << 20);
    char ubuf[48];
    assert_string_equal(kv_cuda_uuid_str(&d.uuid, ubuf, sizeof(ubuf)),
                        "GPU-6b76642d-6661-6b65-2d67-70752d303030");
    assert_string_equal(d.name, "kvd fake GPU");
    kv_cuda_device other;
    assert_int_equal(kv_cuda_device_open(&cu, 3, &other, why, sizeof(why)), KV_ENOGPU);
    assert_non_null(strstr(why, "device 3 does not exist"));
    char buf[128];
    assert_string_equal(kv_cuda_strerror(&cu, KV_CU_ERROR_NO_DEVICE, buf, sizeof(buf)),
                        "CUDA_ERROR_NO_DEVICE (no CUDA-capable device is detected)");
    assert_string_equal(kv_cuda_strerror(NULL, 7, buf, sizeof(buf)), "CUresult 7");
    /* The strict fake is what a real driver is: device memory is not host memory, and work
     * queued to the device completes at a synchronize. */
    kv_cu_deviceptr p = 0;
    assert_int_equal(cu.mem_alloc(&p, 1u << 20), KV_CU_SUCCESS);
    uint8_t in[16] = "device bytes", out[16] = "";
    assert_int_equal(cu.memcpy_htod(p, in, sizeof(in)), KV_CU_SUCCESS);
    assert_int_equal(cu.memcpy_dtoh(out, p, sizeof(out)), KV_CU_SUCCESS); /* orders after it */
    assert_memory_equal(in, out, sizeof(in));
    pid_t child = fork();
    assert_true(child >= 0);
    if (child == 0) {
        /* A host load through a device pointer faults, as on a GPU (cmocka's handler off: the
         * child must die of it). */
        signal(SIGSEGV, SIG_DFL);
        volatile uint8_t x = *(volatile uint8_t *)(uintptr_t)p;
        (void)x;
        _exit(0);
    }
    int st = 0;
    assert_int_equal(waitpid(child, &st, 0), child);
    assert_true(WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV);
    child = fork();
    assert_true(child >= 0);
    if (child == 0) {
        /* CUDA state does not survive fork: the child must exec (or not use CUDA). */
        int n = 0;
        _exit(cu.device_get_count(&n) == KV_CU_ERROR_NOT_INITIALIZED ? 0 : 1);
    }
    assert_int_equal(waitpid(child, &st, 0), child);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    assert_int_equal(cu.mem_free(p), KV_CU_SUCCESS);
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

/* Imports a VMM fd and maps it (offset 0) as a client would; returns the device address. */
static kv_cu_deviceptr import_map(kvd_backend_cuda_ctx *c, int fd, uint64_t bytes) {
    kv_cu_mem_handle h;
    assert_int_equal(
        c->cu.mem_import(&h, (void *)(intptr_t)fd, KV_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
        KV_CU_SUCCESS);
    kv_cu_deviceptr va = 0;
    assert_int_equal(c->cu.mem_address_reserve(&va, (size_t)bytes, 0, 0, 0), KV_CU_SUCCESS);
    assert_int_equal(c->cu.mem_map(va, (size_t)bytes, 0, h, 0), KV_CU_SUCCESS);
    kv_cu_access_desc acc;
    memset(&acc, 0, sizeof(acc));
    acc.location.type = KV_CU_MEM_LOCATION_TYPE_DEVICE;
    acc.flags = KV_CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    assert_int_equal(c->cu.mem_set_access(va, (size_t)bytes, &acc, 1), KV_CU_SUCCESS);
    assert_int_equal(c->cu.mem_release(h), KV_CU_SUCCESS);
    return va;
}

static void test_vmm_segments(void **state) {
    (void)state;
    kvd_backend_cuda_ctx c;
    char why[256];
    assert_int_equal(kvd_backend_cuda_open(&c, KVD_MEM_CUDA_VMM, 0, fake_path, why, sizeof(why)),
                     KV_OK);
    const kvd_backend_ops *be = &kvd_backend_cuda_vmm;
    assert_int_equal(be->kind, KVD_MEM_CUDA_VMM);
    assert_int_equal(be->align(&c), 2u << 20);
    kvd_segment_mem m;
    assert_int_equal(be->segment_alloc(&c, 0, &m), KV_EINVAL);
    assert_int_equal(be->segment_alloc(&c, 100000, &m), KV_OK);
    assert_int_equal(m.bytes, 2u << 20); /* rounded to the granularity */
    assert_true(m.fd > 2);
    assert_int_equal(m.nparts, 0);
    assert_int_equal(c.segments, 1);
    /* The daemon's mapping is zeroed, and the exported fd is the same memory. */
    uint8_t b[2];
    kv_cu_deviceptr base = (kv_cu_deviceptr)(uintptr_t)m.base;
    assert_int_equal(c.cu.memcpy_dtoh(&b[0], base, 1), KV_CU_SUCCESS);
    assert_int_equal(c.cu.memcpy_dtoh(&b[1], base + m.bytes - 1, 1), KV_CU_SUCCESS);
    assert_int_equal(b[0] | b[1], 0);
    uint8_t ab = 0xab;
    assert_int_equal(c.cu.memcpy_htod(base + 12345, &ab, 1), KV_CU_SUCCESS);
    assert_int_equal(c.cu.ctx_synchronize(), KV_CU_SUCCESS);
    kv_cu_deviceptr other = import_map(&c, m.fd, m.bytes);
    /* Freeing in the daemon leaves an importer's mapping valid (memory is refcounted). */
    be->segment_free(&c, &m);
    assert_int_equal(c.cu.memcpy_dtoh(&b[0], other + 12345, 1), KV_CU_SUCCESS);
    assert_int_equal(b[0], 0xab);
    assert_int_equal(c.cu.mem_unmap(other, 2u << 20), KV_CU_SUCCESS);
    assert_int_equal(c.cu.mem_address_free(other, 2u << 20), KV_CU_SUCCESS);
    assert_int_equal(c.segments, 0);
    /* A segment of parts: one allocation (and fd) each, back to back in the daemon's range. */
    uint64_t parts[3] = {2u << 20, 2u << 20, 100};
    assert_int_equal(be->segment_alloc_parts(&c, parts, 3, &m), KV_OK);
    assert_int_equal(m.nparts, 3);
    assert_int_equal(m.fd, -1);
    assert_int_equal(m.bytes, 6u << 20);
    assert_int_equal(m.part_bytes[2], 2u << 20);
    base = (kv_cu_deviceptr)(uintptr_t)m.base;
    uint8_t mark[3] = {1, 2, 3};
    for (int k = 0; k < 3; k++) {
        assert_int_equal(c.cu.memcpy_htod(base + (uint64_t)k * (2u << 20) + 7, &mark[k], 1),
                         KV_CU_SUCCESS);
    }
    assert_int_equal(c.cu.ctx_synchronize(), KV_CU_SUCCESS);
    for (int k = 0; k < 3; k++) {
        kv_cu_deviceptr q = import_map(&c, m.part_fds[k], 2u << 20);
        assert_int_equal(c.cu.memcpy_dtoh(&b[0], q + 7, 1), KV_CU_SUCCESS);
        assert_int_equal(b[0], mark[k]);
        assert_int_equal(c.cu.mem_unmap(q, 2u << 20), KV_CU_SUCCESS);
        assert_int_equal(c.cu.mem_address_free(q, 2u << 20), KV_CU_SUCCESS);
    }
    be->segment_free(&c, &m);
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
    uint8_t v = 0x42;
    assert_int_equal(c.cu.memcpy_htod((kv_cu_deviceptr)(uintptr_t)m.base + 777, &v, 1),
                     KV_CU_SUCCESS);
    assert_int_equal(c.cu.ctx_synchronize(), KV_CU_SUCCESS);
    /* Open the handle as a client would (here through the same driver table). */
    kv_cu_ipc_mem_handle h;
    memcpy(h.reserved, m.ipc_handle, 64);
    kv_cu_deviceptr p;
    assert_int_equal(c.cu.ipc_open_mem_handle(&p, h, KV_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                     KV_CU_SUCCESS);
    v = 0;
    assert_int_equal(c.cu.memcpy_dtoh(&v, p + 777, 1), KV_CU_SUCCESS);
    assert_int_equal(v, 0x42);
    assert_int_equal(c.cu.ipc_close_mem_handle(p), KV_CU_SUCCESS);
    be->segment_free(&c, &m);
    kvd_backend_cuda_close(&c);
}

/* ---- a real server with a GPU backend --------------------------------------------------- */

typedef kvd_test_server harness;

/* Whether the registry still has a pool (read on the loop thread, which owns it). */
typedef struct pool_query {
    uint32_t pool_id;
    int exists;
} pool_query;

static void pool_query_on_loop(kvd_daemon *s, void *arg) {
    pool_query *q = arg;
    q->exists = kvd_registry_peek(kvd_daemon_registry(s), q->pool_id) != NULL;
}

static void start(harness *h, const char *backend) {
    kvd_test_server_init(h, "cuda-test");
    snprintf(h->cfg.backend, sizeof(h->cfg.backend), "%s", backend);
    h->cfg.pool_memory = 64 << 20;
    h->cfg.segment_bytes = 2 << 20;
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
    assert_string_equal(kvd_daemon_config(h.srv)->backend, "cuda-vmm");
    int fd = dial(&h);
    int fds[200];
    size_t nfds;
    Kvd__Envelope *keep;
    Kvd__AttachPoolReply *ar = hello_attach(fd, &keep, fds, &nfds);
    assert_true(ar->n_segments >= 1);
    const Kvd__Segment *s0 = ar->segments[0];
    assert_int_equal(s0->kind, KVD__MEMORY_KIND__CUDA_VMM);
    assert_int_equal(s0->bytes % (2u << 20), 0);
    assert_int_equal(s0->ipc_handle.len, 0);
    assert_int_equal(ar->device_uuid.len, 16);
    /* A LAYER_MAJOR segment is one allocation per (layer, K|V) section, one fd each, so that a
     * client maps each section at offset 0: 2 layers x K, V = 4 parts of one section each. */
    kv_layout lay;
    assert_int_equal(kv_layout_init(2, 2, 64, 16, KV_DTYPE_FP16, KV_LAYER_MAJOR, &lay), KV_OK);
    uint64_t section = (uint64_t)ar->blocks_per_segment * lay.kv_block_bytes;
    assert_int_equal(section % (2u << 20), 0);
    assert_int_equal(s0->n_part_bytes, 4);
    size_t want_fds = 0;
    for (size_t i = 0; i < ar->n_segments; i++) {
        want_fds += ar->segments[i]->n_part_bytes;
    }
    assert_int_equal(nfds, want_fds);
    for (size_t k = 0; k < 4; k++) {
        assert_int_equal(s0->part_bytes[k], section);
    }
    /* Part 1 (layer 0's V) is the daemon's allocation: what we write through it, the daemon's
     * mapping holds at the section's offset. */
    kvd_backend_cuda_ctx *gpu = kvd_daemon_registry(h.srv)->sel->cuda;
    kv_cu_deviceptr dev =
        (kv_cu_deviceptr)(uintptr_t)kvd_pool_segment(kvd_daemon_registry(h.srv)->pools[0].pool, 0)
            ->base;
    kv_cu_deviceptr mine = import_map(gpu, fds[s0->fd_index + 1], section);
    uint8_t v = 0x77;
    assert_int_equal(gpu->cu.memcpy_htod(mine + 4096, &v, 1), KV_CU_SUCCESS);
    assert_int_equal(gpu->cu.ctx_synchronize(), KV_CU_SUCCESS);
    v = 0;
    assert_int_equal(gpu->cu.memcpy_dtoh(&v, dev + section + 4096, 1), KV_CU_SUCCESS);
    assert_int_equal(v, 0x77);
    assert_int_equal(gpu->cu.mem_unmap(mine, (size_t)section), KV_CU_SUCCESS);
    assert_int_equal(gpu->cu.mem_address_free(mine, (size_t)section), KV_CU_SUCCESS);
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
    assert_memory_equal(s0->ipc_handle.data,
                        kvd_pool_segment(kvd_daemon_registry(h.srv)->pools[0].pool, 0)->ipc_handle,
                        64);
    uint32_t pool_id = ar->pool_id;
    kv_wire_free(keep);
    close(fd);
    /* Once the connection is gone (the loop notices the close): ask the loop over a second
     * connection until it reports only that one session (reading the registry from this thread
     * while the loop may still be closing the first would race). */
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
    /* The closed session's worker may still have the IPC memory open (a broken connection does
     * not close the handles): a cuda-ipc pool is never reclaimed while kvd runs. */
    pool_query q = {pool_id, 0};
    kvd_test_server_call(&h, pool_query_on_loop, &q);
    assert_int_equal(q.exists, 1);
    close(fd2);
    stop(&h);
}

static void stop_on_loop(kvd_daemon *s, void *arg) {
    (void)arg;
    kvd_daemon_stop(s);
}

/* A cuda-ipc daemon that is stopped with a session open waits for it (shutdown-grace-ms) before it
 * frees memory the session may still map: the session keeps being served, no new one is taken,
 * and the stop completes once it closed. */
static void test_server_ipc_waits_for_sessions(void **state) {
    (void)state;
    harness h;
    start(&h, "cuda-ipc");
    int fd = dial(&h);
    int fds[200];
    size_t nfds;
    Kvd__Envelope *keep;
    (void)hello_attach(fd, &keep, fds, &nfds);
    kv_wire_free(keep);
    kvd_test_server_call(&h, stop_on_loop, NULL);
    /* Still served. */
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Ping ping = KVD__PING__INIT;
    e.id = kvd_raw_next_id();
    e.body_case = KVD__ENVELOPE__BODY_PING;
    e.ping = &ping;
    Kvd__Envelope *r = kvd_raw_rpc(fd, &e);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_PONG);
    kv_wire_free(r);
    /* No new session. */
    int probe = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    memcpy(sa.sun_path, h.cfg.socket, strlen(h.cfg.socket) + 1); /* short: /tmp/kvd-... */
    assert_int_not_equal(connect(probe, (struct sockaddr *)&sa, sizeof(sa)), 0);
    close(probe);
    close(fd);
    stop(&h); /* joins the loop: it ends once the session is gone */
}

static void test_server_explicit_gpu_fails(void **state) {
    (void)state;
    kvd_config cfg;
    kvd_config_init(&cfg);
    snprintf(cfg.backend, sizeof(cfg.backend), "cuda-vmm");
    uv_loop_t loop;
    assert_int_equal(uv_loop_init(&loop), 0);
    setenv("KV_CUDA_LIBRARY", MISSING, 1);
    kvd_daemon *srv = NULL;
    assert_int_equal(kvd_daemon_alloc(&cfg, &loop, &srv), KV_ENOGPU);
    assert_null(srv);
    /* auto on the same machine starts, on host. */
    snprintf(cfg.backend, sizeof(cfg.backend), "auto");
    assert_int_equal(kvd_daemon_alloc(&cfg, &loop, &srv), KV_OK);
    assert_string_equal(kvd_daemon_config(srv)->backend, "host");
    kvd_daemon_free(srv);
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
        cmocka_unit_test_setup(test_server_ipc_waits_for_sessions, setup),
        cmocka_unit_test_setup(test_server_explicit_gpu_fails, setup),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
