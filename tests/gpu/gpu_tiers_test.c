/* gpu_tiers_test: lower tiers under a GPU pool (issue 14). A real kvd on cuda-vmm or cuda-ipc
 * with tier 1 (host memory) and tier 2 (disk): a worker process writes a chain into device
 * blocks and commits it, other chains push it out of T0, and kvc_fetch brings it back into
 * device memory with the bytes as written (read back with cuMemcpyDtoH). Then the daemon
 * restarts and the chain comes back from its T2 file into a new process's device blocks. Formats:
 * raw, zstd, and a pool that asked for lossy tiers (int8: the bytes come back within the bound,
 * and not all bit-equal, which shows the quantized path ran). Raw blocks sit in page-locked T1
 * memory (kvd's tier1_pinned_bytes); on the test driver also a driver that refuses it (malloc'd
 * T1, counted in tier1_pinned_fallbacks). With tier 1 off, device memory to T2 and back directly
 * (T2's streamed transfers, chunk by chunk through the driver).
 *
 * Built twice (tests/gpu/BUILD), as gpu_share_test: with KVD_GPU_FAKE on the test driver
 * (daemon/fake_cuda.c: "device" memory a host load faults on, so a tier copy that touched T0
 * with memcpy instead of the driver would crash kvd here), and tagged requires-gpu on a real
 * device (the GPU check bundle runs it).
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

#define NB 8     /* blocks of the chain under test */
#define FLOOD 70 /* chains of NB blocks that push it out of a one-segment pool (512 blocks) */
#define TPB 16

static kv_cuda cu;
/* The pool is attached with KVC_ATTACH_LOSSY_TIERS (set before the workers fork): its lower tiers
 * keep blocks as int8 with per-head scales, and the bytes come back close, not equal. */
static int g_lossy;
/* What kvd's T1 buffers must be (checked after phase 1 through its stats): PIN_YES page-locked
 * (raw blocks of a GPU pool), PIN_NO none (compressed or quantized blocks are malloc'd),
 * PIN_FALLBACK none because the driver refused (FAKE_CUDA_NO_PINNED) and counted. */
enum { PIN_NO = 0, PIN_YES = 1, PIN_FALLBACK = 2 };
static int g_pin = PIN_YES;
/* PIN_YES: every chain written (FLOOD + 1 of NB blocks) went down into T1 (16M holds them all):
 * at least that much is page-locked, more than the buffers made ahead at attach (an eighth of
 * tier1-memory), so the copies themselves took page-locked buffers. */
/* Tier 1 off: blocks go from device memory straight to T2 (the streamed write, chunk by chunk
 * out of T0) and come back from there in phase 1 too. */
static int g_t1_off;

/* The bytes of chain `chain`, block b, (layer, K|V). Lossy pools: fp16 values, finite and under
 * 2 in magnitude (exponents 10..15), so the int8 round trip's error is under 2 / 254. */
static void pattern(uint8_t *buf, size_t n, uint32_t chain, uint32_t b, uint32_t layer, int kv) {
    uint32_t x = (chain + 1) * 2654435761u ^ (b + 1) * 40503u ^ layer * 977u ^ (uint32_t)kv * 31u;
    for (size_t k = 0; k < n; k++) {
        x = x * 1103515245u + 12345u;
        buf[k] = (uint8_t)(x >> 16);
        if (g_lossy && (k & 1)) { /* the high byte of a little-endian fp16 */
            buf[k] = (uint8_t)((buf[k] & 0x80) | (10 + (x >> 24) % 6) << 2 | (buf[k] & 0x3));
        }
    }
}

static float half_to_float(uint16_t h) {
    uint32_t e = (h >> 10) & 0x1fu;
    float m = (float)(h & 0x3ffu), v;
    if (e == 0) {
        v = m * (1.0f / 16777216.0f); /* subnormal: m x 2^-24 */
    } else {
        uint32_t pb = (e - 15u + 127u) << 23;
        float p2;
        memcpy(&p2, &pb, sizeof(p2));
        v = (1.0f + m / 1024.0f) * p2;
    }
    return (h & 0x8000u) ? -v : v;
}

/* Lossy pools: how many fp16 elements of got differ from want, and whether any is further than
 * the int8 bound allows (int8: absmax / 254 of its head's group, here < 2 / 254, plus the fp16
 * rounding of the result). */
static int lossy_close(const uint8_t *got, const uint8_t *want, size_t n, size_t *differ) {
    for (size_t k = 0; k + 1 < n; k += 2) {
        uint16_t g = (uint16_t)(got[k] | got[k + 1] << 8),
                 w = (uint16_t)(want[k] | want[k + 1] << 8);
        float d = half_to_float(g) - half_to_float(w);
        *differ += g != w;
        if (d > 0.01f || d < -0.01f) {
            return 0;
        }
    }
    return 1;
}

static void chain_hashes(kvc_pool *p, uint32_t chain, kv_hash128 *out) {
    uint32_t tok[NB * TPB];
    for (uint32_t i = 0; i < NB * TPB; i++) {
        tok[i] = chain * 100000 + i;
    }
    size_t n = 0;
    if (kvc_pool_hash_tokens(p, NULL, 0, tok, NB * TPB, out, NB, &n) != KV_OK || n != NB) {
        fprintf(stderr, "hashing failed\n");
        exit(3);
    }
}

/* Writes chain `chain` into NB new device blocks, commits and releases it. 0 or an exit code. */
static int put_chain(kvc_pool *p, uint32_t chain, uint8_t *buf) {
    const kv_layout *l = kvc_pool_layout(p);
    kvc_block blk[NB], canon[NB];
    /* Write-through copies hold a tier lease on the blocks they read: a full pool may have too
     * few evictable blocks for a moment. */
    kv_err err = kvc_allocate(p, NB, blk);
    for (int tries = 0; err == KV_ENOSPC && tries < 500; tries++) {
        kvd_harness_sleep_ms(10);
        err = kvc_allocate(p, NB, blk);
    }
    if (err != KV_OK) {
        fprintf(stderr, "allocate: %s\n", kv_err_name(err));
        return 5;
    }
    for (uint32_t b = 0; b < NB; b++) {
        for (uint32_t layer = 0; layer < l->num_layers; layer++) {
            for (int kv = KV_K; kv <= KV_V; kv++) {
                pattern(buf, l->kv_block_bytes, chain, b, layer, kv);
                void *dst = kvc_pool_addr(p, blk[b].id, layer, kv, 0, 0);
                if (dst == NULL || cu.memcpy_htod((kv_cu_deviceptr)(uintptr_t)dst, buf,
                                                  l->kv_block_bytes) != KV_CU_SUCCESS) {
                    fprintf(stderr, "copy into block %u failed\n", blk[b].id);
                    return 6;
                }
            }
        }
    }
    if (cu.ctx_synchronize() != KV_CU_SUCCESS) { /* the bytes land before the Commit */
        return 6;
    }
    kv_hash128 hs[NB];
    chain_hashes(p, chain, hs);
    kvc_commit_entry e[NB];
    for (uint32_t b = 0; b < NB; b++) {
        e[b].block = blk[b];
        e[b].hash = hs[b];
        e[b].parent = b == 0 ? KVC_NO_PARENT : blk[b - 1].id;
    }
    if (kvc_commit(p, e, NB, canon) != KV_OK || kvc_release(p, canon, NB) != KV_OK) {
        return 7;
    }
    return 0;
}

/* Fetches chain 1 and compares every byte through the device; want_tier: 1 or 2, the tier the
 * run below T0 must be in. 0 or an exit code. */
static int fetch_and_check(kvc_pool *p, int want_tier, uint8_t *buf, uint8_t *got) {
    const kv_layout *l = kvc_pool_layout(p);
    kv_hash128 hs[NB];
    chain_hashes(p, 1, hs);
    kvc_block out[NB];
    size_t nhit = 0;
    kvc_tier_hits th;
    if (kvc_lookup_tiers(p, hs, NB, out, &nhit, &th) != KV_OK ||
        kvc_release(p, out, nhit) != KV_OK) {
        return 10;
    }
    uint32_t below = want_tier == 1 ? th.t1 : th.t2;
    if (nhit + th.fetchable != NB || below == 0) {
        fprintf(stderr, "lookup: %zu in T0, %u fetchable, %u in T1, %u only in T2\n", nhit,
                th.fetchable, th.t1, th.t2);
        return 11;
    }
    kvc_fetch_result fr;
    kv_err err = kvc_fetch(p, hs, NB, TPB, out, &fr); /* a run of one block is worth it here */
    if (err != KV_OK || fr.status != KVC_FETCH_DONE || fr.nblocks != NB || fr.promoted == 0) {
        fprintf(stderr, "fetch: %s, status %d, %zu blocks, %u promoted\n", kv_err_name(err),
                (int)fr.status, fr.nblocks, fr.promoted);
        return 12;
    }
    int bad = 0;
    size_t differ = 0; /* lossy: elements not bit-equal (the quantized path ran) */
    for (uint32_t b = 0; b < NB; b++) {
        for (uint32_t layer = 0; layer < l->num_layers; layer++) {
            for (int kv = KV_K; kv <= KV_V; kv++) {
                pattern(buf, l->kv_block_bytes, 1, b, layer, kv);
                void *src = kvc_pool_addr(p, out[b].id, layer, kv, 0, 0);
                memset(got, 0, l->kv_block_bytes);
                if (cu.memcpy_dtoh(got, (kv_cu_deviceptr)(uintptr_t)src, l->kv_block_bytes) !=
                        KV_CU_SUCCESS ||
                    (g_lossy ? !lossy_close(got, buf, l->kv_block_bytes, &differ)
                             : memcmp(got, buf, l->kv_block_bytes) != 0)) {
                    fprintf(stderr, "block %u layer %u kv %d differs after the fetch\n", b, layer,
                            kv);
                    bad = 1;
                }
            }
        }
    }
    kvc_release(p, out, NB);
    if (g_lossy && differ == 0) {
        fprintf(stderr, "a lossy pool's blocks came back bit-equal: not quantized below T0\n");
        return 14;
    }
    return bad ? 13 : 0;
}

/* A worker process: loads the driver, attaches, then (phase 1) writes chain 1 and floods it
 * out of T0 before fetching it from T1, or (phase 2, after a restart) fetches it from T2. */
static int worker(kvd_harness *h, int phase) {
    char why[256];
    kv_cuda_device d;
    if (kv_cuda_load(NULL, &cu, why, sizeof(why)) != KV_OK ||
        kv_cuda_device_open(&cu, 0, &d, why, sizeof(why)) != KV_OK) {
        fprintf(stderr, "worker: %s\n", why);
        return 2;
    }
    kvc_conn *c;
    kvc_pool *p;
    kv_layout l = kvd_harness_layout();
    if (kvd_harness_connect(h, "gpu-tiers", &c) != KV_OK || !kvc_conn_has_tiers(c)) {
        fprintf(stderr, "worker: no connection to a daemon with tiers\n");
        return 3;
    }
    if (kvc_pool_attach_ex(c, "gpu-tiers-model", &l, g_lossy ? KVC_ATTACH_LOSSY_TIERS : 0, &p) !=
        KV_OK) {
        fprintf(stderr, "worker: attach: %s\n", kvc_last_error(c));
        return 3;
    }
    uint64_t kvb = kvc_pool_layout(p)->kv_block_bytes; /* the daemon's layout, filled in */
    uint8_t *buf = malloc(kvb), *got = malloc(kvb);
    int rc = 0;
    if (phase == 1) {
        rc = put_chain(p, 1, buf);
        kvd_harness_sleep_ms(50); /* write-through copies are asynchronous */
        for (uint32_t k = 0; rc == 0 && k < FLOOD; k++) {
            rc = put_chain(p, 100 + k, buf);
        }
        kvd_harness_sleep_ms(100);
    }
    if (rc == 0) {
        rc = fetch_and_check(p, g_t1_off ? 2 : phase, buf, got);
    }
    if (rc == 0 && phase == 1) {
        uint64_t pinned = 0, fallbacks = 0;
        if (kvc_stat_get(c, 0, "tiers.tier1_pinned_bytes", &pinned) != KV_OK ||
            kvc_stat_get(c, 0, "tiers.tier1_pinned_fallbacks", &fallbacks) != KV_OK) {
            rc = 20;
        } else if ((g_pin == PIN_YES &&
                    (pinned < (uint64_t)(FLOOD + 1) * NB * kvb || fallbacks != 0)) ||
                   (g_pin == PIN_NO && (pinned != 0 || fallbacks != 0)) ||
                   (g_pin == PIN_FALLBACK && (pinned != 0 || fallbacks == 0))) {
            fprintf(stderr, "T1 buffers: %llu page-locked bytes, %llu fallbacks (want %s)\n",
                    (unsigned long long)pinned, (unsigned long long)fallbacks,
                    g_pin == PIN_YES  ? "page-locked"
                    : g_pin == PIN_NO ? "none"
                                      : "fallbacks");
            rc = 21;
        }
    }
    free(buf);
    free(got);
    kvc_pool_detach(p);
    kvc_conn_close(c);
    return rc;
}

static int run_worker(kvd_harness *h, int phase) {
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        _exit(worker(h, phase));
    }
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static void tiers_round_trip(const char *backend, const char *format) {
#ifdef KVD_GPU_FAKE
    kvd_gpu_test_use_fake_driver();
#endif
    char why[256];
    if (kvd_gpu_test_probe(why, sizeof(why)) != 0) {
        const char *expect = getenv("KVD_EXPECT_GPU");
        if (expect != NULL && expect[0] == '1') {
            fail_msg("KVD_EXPECT_GPU=1 but %s", why);
        }
        fprintf(stderr, "skipping: %s\n", why);
        skip();
    }
    char t2dir[96];
    assert_int_equal(kvd_harness_make_dir(t2dir, sizeof(t2dir), "gputiers", 60), 0);
    char fb[64], ff[64], ft2[128];
    snprintf(fb, sizeof(fb), "--backend=%s", backend);
    snprintf(ff, sizeof(ff), "--tier-format=%s", format);
    snprintf(ft2, sizeof(ft2), "--tier2-path=%s", t2dir);
    /* One segment in T0 (four 2 MiB sections: 512 blocks of 16 KiB); T1 and T2 hold all written. */
    const char *flags[] = {fb,
                           "--pool-memory=9M",
                           "--segment-bytes=4M",
                           g_t1_off ? "--tier1-memory=0" : "--tier1-memory=16M",
                           ft2,
                           "--tier2-bytes=64M",
                           "--tier-write=write-through",
                           ff,
                           NULL};
    kvd_harness h;
    assert_int_equal(kvd_harness_start(&h, flags), 0);
    int rc1 = run_worker(&h, 1);
    int rc2 = -1;
    if (rc1 == 0) {
        kvd_harness_sleep_ms(200); /* T1 -> T2 copies of the last chains */
        assert_int_equal(kvd_harness_restart(&h), 0);
        rc2 = run_worker(&h, 2);
    }
    assert_int_equal(kvd_harness_stop(&h), 0);
    kvd_harness_fini(&h);
    char cmd[160];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", t2dir);
    assert_int_equal(system(cmd), 0);
    assert_int_equal(rc1, 0);
    assert_int_equal(rc2, 0);
}

static void test_vmm_raw(void **state) {
    (void)state;
    tiers_round_trip("cuda-vmm", "raw");
}

/* Compressed blocks take the image path (gathered into scratch before the codec). */
static void test_vmm_zstd(void **state) {
    (void)state;
    g_pin = PIN_NO;
    tiers_round_trip("cuda-vmm", "zstd");
    g_pin = PIN_YES;
}

/* A pool that asked for lossy tiers: blocks go down as int8 with per-head scales (quantized from
 * the image gathered out of device memory) and come back within the bound. */
static void test_vmm_int8(void **state) {
    (void)state;
    g_lossy = 1;
    g_pin = PIN_NO;
    tiers_round_trip("cuda-vmm", "raw");
    g_lossy = 0;
    g_pin = PIN_YES;
}

static void test_ipc_raw(void **state) {
    (void)state;
    tiers_round_trip("cuda-ipc", "raw");
}

/* T1 off: T0 -> T2 and back with the driver's copies, the disk I/O streamed in chunks. */
static void test_vmm_raw_t2_only(void **state) {
    (void)state;
    g_t1_off = 1;
    g_pin = PIN_NO;
    tiers_round_trip("cuda-vmm", "raw");
    g_t1_off = 0;
    g_pin = PIN_YES;
}

#ifdef KVD_GPU_FAKE
/* The driver has no page-locked memory to give (the test driver's FAKE_CUDA_NO_PINNED): T1
 * buffers are malloc'd, counted as fallbacks, and the blocks still go down and come back. */
static void test_vmm_raw_unpinned(void **state) {
    (void)state;
    setenv("FAKE_CUDA_NO_PINNED", "1", 1);
    g_pin = PIN_FALLBACK;
    tiers_round_trip("cuda-vmm", "raw");
    g_pin = PIN_YES;
    unsetenv("FAKE_CUDA_NO_PINNED");
}
#endif

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_vmm_raw),          cmocka_unit_test(test_vmm_zstd),
        cmocka_unit_test(test_vmm_int8),         cmocka_unit_test(test_ipc_raw),
        cmocka_unit_test(test_vmm_raw_t2_only),
#ifdef KVD_GPU_FAKE
        cmocka_unit_test(test_vmm_raw_unpinned),
#endif
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
