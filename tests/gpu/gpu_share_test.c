/* gpu_share_test: a real kvd exports a GPU pool (cuda-vmm, then cuda-ipc) and separate client
 * processes share blocks through it: a writer allocates blocks, writes every (layer, K|V) of
 * each through the device address libkvclient gives it and commits; then two readers at once
 * look the prefix up and read the same bytes through their own mappings (for cuda-vmm both
 * through the per-layer tensors and the segment mapping).
 *
 * Built twice (tests/gpu/BUILD): with KVD_GPU_FAKE the processes load the test driver
 * (daemon/fake_cuda.c, host memory behind the driver API) so the whole path runs in CI without
 * a GPU; without it, tagged requires-gpu, on a real device. Device memory is only touched with
 * cuMemcpyHtoD / cuMemcpyDtoH, so the same code is right for both.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/kv_cuda.h"
#include "tests/gpu/gpu_testing.h"
#include "tests/integration/kvd_harness.h"

#define NBLOCKS 8
#define TPB 16

static kv_cuda cu;
static int g_committed[2]; /* writer -> parent: its blocks are committed */
static int g_done[2];      /* parent -> writer: the readers are done, detach */

/* The byte pattern of block i (by its position in the prefix), layer, K|V. */
static void pattern(uint8_t *buf, size_t n, uint32_t i, uint32_t layer, int kv) {
    uint32_t x = (i + 1) * 2654435761u ^ layer * 40503u ^ (uint32_t)kv * 977u;
    for (size_t k = 0; k < n; k++) {
        x = x * 1103515245u + 12345u;
        buf[k] = (uint8_t)(x >> 16);
    }
}

/* In a child: loads the driver and makes device 0's primary context current (the engine's). */
static int child_cuda(void) {
    char why[256];
    if (kv_cuda_load(NULL, &cu, why, sizeof(why)) != KV_OK) {
        fprintf(stderr, "child: %s\n", why);
        return -1;
    }
    kv_cuda_device d;
    if (kv_cuda_device_open(&cu, 0, &d, why, sizeof(why)) != KV_OK) {
        fprintf(stderr, "child: %s\n", why);
        return -1;
    }
    return 0;
}

static int attach(kvd_harness *h, const char *name, kvc_conn **c, kvc_pool **p) {
    if (kvd_harness_connect(h, name, c) != KV_OK) {
        fprintf(stderr, "%s: connect failed\n", name);
        return -1;
    }
    kv_layout l = kvd_harness_layout();
    kv_err rc = kvc_pool_attach(*c, "gpu-model", &l, p);
    if (rc != KV_OK) {
        fprintf(stderr, "%s: attach: %s\n", name, kvc_last_error(*c));
        return -1;
    }
    return 0;
}

static void hashes(kvc_pool *p, kv_hash128 *out) {
    uint32_t tokens[NBLOCKS * TPB];
    for (uint32_t i = 0; i < NBLOCKS * TPB; i++) {
        tokens[i] = 1000 + i * 7;
    }
    size_t n = 0;
    if (kvc_pool_hash_tokens(p, NULL, 0, tokens, NBLOCKS * TPB, out, NBLOCKS, &n) != KV_OK ||
        n != NBLOCKS) {
        fprintf(stderr, "hashing failed\n");
        exit(3);
    }
}

static int writer(kvd_harness *h, int layers_expected) {
    kvc_conn *c;
    kvc_pool *p;
    if (child_cuda() != 0 || attach(h, "gpu-writer", &c, &p) != 0) {
        return 2;
    }
    const kv_layout *l = kvc_pool_layout(p);
    if ((kvc_pool_layer_base(p, 0, KV_K) != NULL) != layers_expected) {
        fprintf(stderr, "writer: layer tensors %s\n", layers_expected ? "missing" : "unexpected");
        return 4;
    }
    kvc_block b[NBLOCKS];
    if (kvc_allocate(p, NBLOCKS, b) != KV_OK) {
        fprintf(stderr, "writer: allocate: %s\n", kvc_last_error(c));
        return 5;
    }
    uint8_t *buf = malloc(l->kv_block_bytes);
    for (uint32_t i = 0; i < NBLOCKS; i++) {
        for (uint32_t layer = 0; layer < l->num_layers; layer++) {
            for (int kv = KV_K; kv <= KV_V; kv++) {
                pattern(buf, l->kv_block_bytes, i, layer, kv);
                /* Layer tensors where there are (the engine's view), else the segment view. */
                uint8_t *dst = layers_expected ? (uint8_t *)kvc_pool_layer_base(p, layer, kv) +
                                                     (uint64_t)b[i].id * l->kv_block_bytes
                                               : kvc_pool_addr(p, b[i].id, layer, kv, 0, 0);
                if (dst == NULL || cu.memcpy_htod((kv_cu_deviceptr)(uintptr_t)dst, buf,
                                                  l->kv_block_bytes) != KV_CU_SUCCESS) {
                    fprintf(stderr, "writer: copy to block %u failed\n", b[i].id);
                    return 6;
                }
            }
        }
    }
    free(buf);
    kv_hash128 hs[NBLOCKS];
    hashes(p, hs);
    kvc_commit_entry e[NBLOCKS];
    for (uint32_t i = 0; i < NBLOCKS; i++) {
        e[i].block = b[i];
        e[i].hash = hs[i];
        e[i].parent = i == 0 ? KVC_NO_PARENT : b[i - 1].id;
    }
    /* cuMemcpyHtoD from pageable memory may return before the bytes are in device memory: the
     * writes must be complete before Commit publishes the blocks (docs/GPU.md, docs/CLIENT.md). */
    if (cu.ctx_synchronize() != KV_CU_SUCCESS) {
        fprintf(stderr, "writer: cuCtxSynchronize failed\n");
        return 6;
    }
    kvc_block canon[NBLOCKS];
    if (kvc_commit(p, e, NBLOCKS, canon) != KV_OK || kvc_release(p, canon, NBLOCKS) != KV_OK) {
        fprintf(stderr, "writer: commit: %s\n", kvc_last_error(c));
        return 7;
    }
    /* Stay alive, mappings and all, while the readers read: a writer that exits (or unmaps)
     * first would let a missing synchronize go unnoticed. */
    char go = 'c';
    if (write(g_committed[1], &go, 1) != 1 || read(g_done[0], &go, 1) != 1) {
        return 9;
    }
    kvc_pool_detach(p);
    kvc_conn_close(c);
    return 0;
}

static int reader(kvd_harness *h, int layers_expected) {
    kvc_conn *c;
    kvc_pool *p;
    if (child_cuda() != 0 || attach(h, "gpu-reader", &c, &p) != 0) {
        return 2;
    }
    const kv_layout *l = kvc_pool_layout(p);
    kv_hash128 hs[NBLOCKS];
    hashes(p, hs);
    kvc_block b[NBLOCKS];
    size_t nhit = 0;
    if (kvc_lookup(p, hs, NBLOCKS, b, &nhit) != KV_OK || nhit != NBLOCKS) {
        fprintf(stderr, "reader: lookup found %zu of %d: %s\n", nhit, NBLOCKS, kvc_last_error(c));
        return 4;
    }
    uint8_t *want = malloc(l->kv_block_bytes);
    uint8_t *got = malloc(l->kv_block_bytes);
    int bad = 0;
    for (uint32_t i = 0; i < NBLOCKS; i++) {
        for (uint32_t layer = 0; layer < l->num_layers; layer++) {
            for (int kv = KV_K; kv <= KV_V; kv++) {
                pattern(want, l->kv_block_bytes, i, layer, kv);
                uint8_t *src[2] = {kvc_pool_addr(p, b[i].id, layer, kv, 0, 0), NULL};
                if (layers_expected) {
                    src[1] = (uint8_t *)kvc_pool_layer_base(p, layer, kv) +
                             (uint64_t)b[i].id * l->kv_block_bytes;
                }
                for (int v = 0; v < 2 && src[v] != NULL; v++) {
                    memset(got, 0, l->kv_block_bytes);
                    if (cu.memcpy_dtoh(got, (kv_cu_deviceptr)(uintptr_t)src[v],
                                       l->kv_block_bytes) != KV_CU_SUCCESS ||
                        memcmp(got, want, l->kv_block_bytes) != 0) {
                        fprintf(stderr, "reader: block %u layer %u kv %d view %d differs\n",
                                b[i].id, layer, kv, v);
                        bad = 1;
                    }
                }
            }
        }
    }
    free(want);
    free(got);
    kvc_release(p, b, NBLOCKS);
    kvc_pool_detach(p); /* closes IPC handles before the pool goes */
    kvc_conn_close(c);
    return bad ? 8 : 0;
}

static int run_child(int (*fn)(kvd_harness *, int), kvd_harness *h, int layers) {
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        _exit(fn(h, layers));
    }
    return pid;
}

static int wait_child(pid_t pid) {
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static void share(const char *backend, int layers) {
#ifdef KVD_GPU_FAKE
    kvd_gpu_test_use_fake_driver();
#endif
    /* Without a usable GPU: skip, unless the bundle (KVD_EXPECT_GPU=1) says one must be there. The
     * probe runs in a throwaway child: CUDA state does not survive fork, so a parent that ran
     * cuInit could not fork the writer and readers below (they would get
     * CUDA_ERROR_NOT_INITIALIZED). */
    char why[256];
    if (kvd_gpu_test_probe(why, sizeof(why)) != 0) {
        const char *expect = getenv("KVD_EXPECT_GPU");
        if (expect != NULL && expect[0] == '1') {
            fail_msg("KVD_EXPECT_GPU=1 but %s", why);
        }
        fprintf(stderr, "skipping: %s\n", why);
        skip();
    }
    kvd_harness h;
    char flag[64];
    snprintf(flag, sizeof(flag), "--backend=%s", backend);
    const char *flags[] = {flag, "--pool-memory=256M", "--segment-bytes=4M", NULL};
    assert_int_equal(kvd_harness_start(&h, flags), 0);
    assert_int_equal(pipe(g_committed), 0);
    assert_int_equal(pipe(g_done), 0);
    pid_t w = run_child(writer, &h, layers);
    char c = 0;
    int committed = read(g_committed[0], &c, 1) == 1;
    pid_t r1 = committed ? run_child(reader, &h, layers) : 0;
    pid_t r2 = committed ? run_child(reader, &h, layers) : 0;
    int st1 = committed ? wait_child(r1) : -1, st2 = committed ? wait_child(r2) : -1;
    assert_int_equal(write(g_done[1], "d", 1), 1);
    assert_int_equal(wait_child(w), 0);
    assert_int_equal(st1, 0);
    assert_int_equal(st2, 0);
    close(g_committed[0]);
    close(g_committed[1]);
    close(g_done[0]);
    close(g_done[1]);
    assert_int_equal(kvd_harness_stop(&h), 0);
    kvd_harness_fini(&h);
}

static void test_vmm(void **state) {
    (void)state;
    share("cuda-vmm", 1);
}

/* A driver that refuses cuMemMap at a non-zero offset (cuda.h: "currently must be zero"): the
 * per-layer tensors must still be there, since every part of a segment is mapped at offset 0 of
 * its own allocation. Fake build only: the switch is the test driver's. */
static void test_vmm_no_map_offsets(void **state) {
    (void)state;
#ifdef KVD_GPU_FAKE
    setenv("FAKE_CUDA_NO_MAP_OFFSET", "1", 1);
    share("cuda-vmm", 1);
    unsetenv("FAKE_CUDA_NO_MAP_OFFSET");
#else
    skip();
#endif
}

/* A worker whose GPU is not kvd's (another UUID): attaching is refused with KV_ENOGPU naming
 * both GPUs, instead of mapping kvd's memory over NVLink or PCIe at a fraction of the speed.
 * Only the test driver can pretend to be another GPU. */
#ifdef KVD_GPU_FAKE
static int other_gpu(kvd_harness *h, int layers) {
    (void)layers;
    setenv("FAKE_CUDA_UUID", "0123456789abcdef0123456789abcdef", 1);
    if (child_cuda() != 0) {
        return 2;
    }
    kvc_conn *c;
    kvc_pool *p;
    if (kvd_harness_connect(h, "other-gpu", &c) != KV_OK) {
        return 3;
    }
    kv_layout l = kvd_harness_layout();
    kv_err rc = kvc_pool_attach(c, "gpu-model", &l, &p);
    int ok = rc == KV_ENOGPU && strstr(kvc_last_error(c), "GPU-01234567") != NULL;
    if (!ok) {
        fprintf(stderr, "other_gpu: attach gave %s: %s\n", kv_err_name(rc), kvc_last_error(c));
    }
    kvc_conn_close(c);
    return ok ? 0 : 4;
}
#endif

static void test_vmm_other_gpu(void **state) {
    (void)state;
#ifdef KVD_GPU_FAKE
    kvd_gpu_test_use_fake_driver();
    kvd_harness h;
    const char *flags[] = {"--backend=cuda-vmm", "--pool-memory=64M", "--segment-bytes=4M", NULL};
    assert_int_equal(kvd_harness_start(&h, flags), 0);
    assert_int_equal(wait_child(run_child(other_gpu, &h, 1)), 0);
    assert_int_equal(kvd_harness_stop(&h), 0);
    kvd_harness_fini(&h);
#else
    skip();
#endif
}

static void test_ipc(void **state) {
    (void)state;
    share("cuda-ipc", 0); /* IPC memory cannot be mapped at offsets: no layer tensors */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_vmm),
        cmocka_unit_test(test_vmm_no_map_offsets),
        cmocka_unit_test(test_vmm_other_gpu),
        cmocka_unit_test(test_ipc),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
