/* Mapping arithmetic of libkvclient with local memfds, no daemon: the per-segment view
 * (kvc_pool_addr, kv_layout order) and the per-layer tensors (MAP_FIXED sections) must be two
 * windows on the same bytes, segment after segment, both advised for huge pages. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmocka.h>

#include "client/diag.h"
#include "client/map.h"
#include "common/kv_util.h"

static int make_memfd(uint64_t bytes) {
    int fd = memfd_create("pool-map-test", MFD_CLOEXEC);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)bytes), 0);
    return fd;
}

static uint64_t round_page(uint64_t b) {
    return (b + 4095) / 4096 * 4096;
}

static void test_layer_major_views_agree(void **state) {
    (void)state;
    kv_layout l;
    /* 3 layers, 2 heads, dim 64, 16 tokens/block fp16: kv_block_bytes 4096, block 24 KiB. */
    assert_int_equal(kv_layout_init(3, 2, 64, 16, KV_DTYPE_FP16, KV_LAYER_MAJOR, &l), KV_OK);
    kvc__diag diag = {0};
    kvc_pool p = {.diag = &diag};
    const uint32_t bps = 4;
    assert_int_equal(kvc__pool_init_geometry(&p, &l, bps, 8), KV_OK);
    assert_non_null(kvc_pool_layer_base(&p, 0, KV_K));
    uint64_t seg_bytes = round_page(kv_layout_segment_bytes(&l, bps));
    for (uint32_t s = 0; s < 3; s++) {
        int fd = make_memfd(seg_bytes);
        assert_int_equal(kvc__pool_map_segment(&p, s, fd, seg_bytes, bps, 0), KV_OK);
        close(fd); /* the mappings keep the memory */
    }
    assert_int_equal(kvc_pool_segments(&p), 3);
    /* Both views ask for transparent huge pages, where the kernel takes the advice (one built
     * without THP refuses it: probed on a scratch mapping) and smaps can tell. */
    void *probe = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(probe != MAP_FAILED);
    int thp = kv_map_advise_huge(probe, 4096) == 0 && kv_map_advised_huge(probe) == 1;
    munmap(probe, 4096);
    if (thp) {
        assert_int_equal(kv_map_advised_huge(kvc_pool_addr(&p, 2 * bps, 0, KV_K, 0, 0)), 1);
        uint8_t *layer = kvc_pool_layer_base(&p, 2, KV_V) + 2 * bps * l.kv_block_bytes;
        assert_int_equal(kv_map_advised_huge(layer), 1);
    }
    /* Write through the segment view, read through the layer tensors. */
    for (uint32_t b = 0; b < 3 * bps; b++) {
        for (uint32_t layer = 0; layer < 3; layer++) {
            for (int kv = 0; kv < 2; kv++) {
                for (uint32_t t = 0; t < 16; t++) {
                    uint16_t *e = kvc_pool_addr(&p, b, layer, kv, t, 1);
                    assert_non_null(e);
                    e[5] = (uint16_t)(b * 1000 + layer * 100 + (uint32_t)kv * 50 + t);
                }
            }
        }
    }
    for (uint32_t layer = 0; layer < 3; layer++) {
        for (int kv = 0; kv < 2; kv++) {
            uint8_t *base = kvc_pool_layer_base(&p, layer, kv);
            for (uint32_t b = 0; b < 3 * bps; b++) {
                for (uint32_t t = 0; t < 16; t++) {
                    /* [blocks][tokens][heads][dim] */
                    uint16_t *e =
                        (uint16_t *)(base + b * l.kv_block_bytes + t * l.token_bytes + 1 * 64 * 2);
                    assert_int_equal(e[5], b * 1000 + layer * 100 + (uint32_t)kv * 50 + t);
                }
            }
        }
    }
    /* Out of range or unmapped. */
    assert_null(kvc_pool_addr(&p, 3 * bps, 0, KV_K, 0, 0));
    assert_null(kvc_pool_addr(&p, 0, 3, KV_K, 0, 0));
    assert_null(kvc_pool_addr(&p, 0, 0, 2, 0, 0));
    assert_null(kvc_pool_addr(&p, 0, 0, KV_K, 16, 0));
    assert_null(kvc_pool_addr(&p, 0, 0, KV_K, 0, 2));
    assert_null(kvc_pool_layer_base(&p, 3, KV_K));
    assert_null(kvc_pool_scale_addr(&p, 0, 0, KV_K, 0));
    kvc__pool_unmap(&p);
}

/* kvc__reserve_aligned: from 2 MiB on the range starts on a 2 MiB boundary, whatever its size
 * (6 MiB + 4 KiB: a size kernels from 6.7 do not align by themselves), and the whole range is
 * reserved (a page at each end can be mapped over); below 2 MiB, a plain page-aligned range. */
static void test_reserve_aligned(void **state) {
    (void)state;
    const uint64_t huge = 2u << 20,
                   sizes[] = {4096, (2u << 20) - 4096, 2u << 20, (6u << 20) + 4096, 4097u * 4096};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        uint64_t n = sizes[i];
        uint8_t *r = kvc__reserve_aligned(n);
        assert_true(r != MAP_FAILED);
        assert_int_equal((uintptr_t)r % (n >= huge ? huge : 4096), 0);
        for (int end = 0; end < 2; end++) {
            uint8_t *pg = end ? r + n - 4096 : r;
            void *m = mmap(pg, 4096, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
            /* the range is ours: NOREPLACE refuses (EEXIST) where a mapping is */
            assert_true(m == MAP_FAILED);
        }
        assert_int_equal(munmap(r, n), 0);
    }
}

/* Layer ranges of 2 MiB or more start on a 2 MiB boundary, so a section at a 2 MiB-aligned
 * offset of its memfd lands at a 2 MiB-aligned address (what a huge mapping needs), and the
 * views still read what the segment view wrote. */
static void test_layer_ranges_huge_aligned(void **state) {
    (void)state;
    kv_layout l;
    /* 2 layers, 8 heads, dim 128, 16 tokens/block fp16: kv_block_bytes 32 KiB, 64 blocks a
     * segment: each section 2 MiB. */
    assert_int_equal(kv_layout_init(2, 8, 128, 16, KV_DTYPE_FP16, KV_LAYER_MAJOR, &l), KV_OK);
    kvc__diag diag = {0};
    kvc_pool p = {.diag = &diag};
    const uint32_t bps = 64;
    assert_int_equal(kvc__pool_init_geometry(&p, &l, bps, 3), KV_OK);
    uint64_t seg_bytes = round_page(kv_layout_segment_bytes(&l, bps));
    for (uint32_t s = 0; s < 2; s++) {
        int fd = make_memfd(seg_bytes);
        assert_int_equal(kvc__pool_map_segment(&p, s, fd, seg_bytes, bps, 0), KV_OK);
        close(fd);
    }
    for (uint32_t layer = 0; layer < 2; layer++) {
        for (int kv = 0; kv < 2; kv++) {
            uint8_t *base = kvc_pool_layer_base(&p, layer, kv);
            assert_non_null(base);
            assert_int_equal((uintptr_t)base % (2u << 20), 0);
            assert_int_equal(kv_layout_offset(&l, bps, 0, layer, kv, 0, 0) % (2u << 20), 0);
            for (uint32_t b = 0; b < 2 * bps; b += 37) {
                *(uint32_t *)kvc_pool_addr(&p, b, layer, kv, 15, 7) = b * 10 + layer * 2 + kv;
                assert_int_equal(
                    *(uint32_t *)(base + b * l.kv_block_bytes + 15 * l.token_bytes + 7 * 128 * 2),
                    b * 10 + layer * 2 + kv);
            }
        }
    }
    kvc__pool_unmap(&p);
}

/* Segments so large that layer tensors for 4096 of them would need more than 1 TiB of address
 * space: they span the attach-time budget only, and kvc_pool_max_segments says so (it said
 * 4096, and an engine sizing its tensors by it read blocks past the ranges as other layers'). */
static void test_layer_ranges_of_the_budget_only(void **state) {
    (void)state;
    kv_layout l;
    /* 1 layer, 8 heads, dim 256, 16 tokens/block fp16: kv_block_bytes 64 KiB; 4096 blocks a
     * segment: a 256 MiB section per segment, 2 TiB for 4096 segments' K and V. */
    assert_int_equal(kv_layout_init(1, 8, 256, 16, KV_DTYPE_FP16, KV_LAYER_MAJOR, &l), KV_OK);
    kvc__diag diag = {0};
    kvc_pool p = {.diag = &diag};
    assert_int_equal(kvc__pool_init_geometry(&p, &l, 4096, 2), KV_OK);
    assert_non_null(kvc_pool_layer_base(&p, 0, KV_K));
    assert_int_equal(kvc_pool_max_segments(&p), 2);
    kvc__pool_unmap(&p);
}

static void test_remap_replaces_segment(void **state) {
    (void)state;
    kv_layout l;
    assert_int_equal(kv_layout_init(1, 1, 128, 16, KV_DTYPE_FP16, KV_LAYER_MAJOR, &l), KV_OK);
    kvc__diag diag = {0};
    kvc_pool p = {.diag = &diag};
    assert_int_equal(kvc__pool_init_geometry(&p, &l, 2, 4), KV_OK);
    uint64_t seg_bytes = round_page(kv_layout_segment_bytes(&l, 2));
    int a = make_memfd(seg_bytes);
    int b = make_memfd(seg_bytes);
    assert_int_equal(kvc__pool_map_segment(&p, 0, a, seg_bytes, 2, 0), KV_OK);
    *(uint32_t *)kvc_pool_addr(&p, 1, 0, KV_V, 3, 0) = 0xabcd;
    /* The daemon freed segment 0 and grew a new one at the same index. */
    assert_int_equal(kvc__pool_map_segment(&p, 0, b, seg_bytes, 2, 0), KV_OK);
    uint8_t *v = kvc_pool_layer_base(&p, 0, KV_V);
    assert_int_equal(*(uint32_t *)(v + 1 * l.kv_block_bytes + 3 * l.token_bytes), 0);
    assert_int_equal(*(uint32_t *)kvc_pool_addr(&p, 1, 0, KV_V, 3, 0), 0);
    /* A segment too small for its blocks, or past the limit, is a protocol error. */
    assert_int_equal(kvc__pool_map_segment(&p, 1, b, 4096, 2, 0), KV_EPROTO);
    assert_int_equal(kvc__pool_map_segment(&p, 4096, b, seg_bytes, 2, 0), KV_EPROTO);
    close(a);
    close(b);
    kvc__pool_unmap(&p);
}

/* An address handed out stays valid until detach (kvclient.h), whatever the daemon does to the
 * segment under it: a same-size replacement shows the new segment at the same address; a bigger
 * one moves, and the old range reads zeros (no longer the daemon's memory) instead of faulting. */
static void test_addresses_survive_replacement(void **state) {
    (void)state;
    kv_layout l;
    assert_int_equal(kv_layout_init(1, 1, 128, 16, KV_DTYPE_FP16, KV_BLOCK_MAJOR, &l), KV_OK);
    kvc__diag diag = {0};
    kvc_pool p = {.diag = &diag};
    assert_int_equal(kvc__pool_init_geometry(&p, &l, 2, 4), KV_OK);
    uint64_t seg_bytes = round_page(kv_layout_segment_bytes(&l, 2));
    int a = make_memfd(seg_bytes), b = make_memfd(seg_bytes), c = make_memfd(4 * seg_bytes);
    assert_int_equal(kvc__pool_map_segment(&p, 0, a, seg_bytes, 2, 0), KV_OK);
    uint32_t *old = kvc_pool_addr(&p, 1, 0, KV_V, 3, 0);
    *old = 0xabcd;
    /* same size: in place */
    assert_int_equal(kvc__pool_map_segment(&p, 0, b, seg_bytes, 2, 0), KV_OK);
    assert_ptr_equal(kvc_pool_addr(&p, 1, 0, KV_V, 3, 0), old);
    assert_int_equal(*old, 0);
    *old = 0x1234; /* lands in b */
    uint32_t in_b;
    assert_int_equal(
        pread(b, &in_b, sizeof(in_b), (off_t)kv_layout_offset(&l, 2, 1, 0, KV_V, 3, 0)),
        (ssize_t)sizeof(in_b));
    assert_int_equal(in_b, 0x1234);
    /* bigger: moves; the old address is still readable and writable memory */
    assert_int_equal(kvc__pool_map_segment(&p, 0, c, 4 * seg_bytes, 2, 0), KV_OK);
    uint32_t *now = kvc_pool_addr(&p, 1, 0, KV_V, 3, 0);
    assert_ptr_not_equal(now, old);
    assert_int_equal(*old, 0);
    *old = 7;
    assert_int_equal(*now, 0);
    /* and the retired range no longer holds b's memory: b is unchanged by the write */
    assert_int_equal(
        pread(b, &in_b, sizeof(in_b), (off_t)kv_layout_offset(&l, 2, 1, 0, KV_V, 3, 0)),
        (ssize_t)sizeof(in_b));
    assert_int_equal(in_b, 0x1234);
    close(a);
    close(b);
    close(c);
    kvc__pool_unmap(&p);
}

static void test_block_major_and_scales(void **state) {
    (void)state;
    kv_layout l;
    assert_int_equal(kv_layout_init(2, 4, 32, 8, KV_DTYPE_INT8, KV_BLOCK_MAJOR, &l), KV_OK);
    kvc__diag diag = {0};
    kvc_pool p = {.diag = &diag};
    assert_int_equal(kvc__pool_init_geometry(&p, &l, 3, 2), KV_OK);
    assert_null(kvc_pool_layer_base(&p, 0, KV_K)); /* block-major has no layer tensors */
    uint64_t seg_bytes = round_page(kv_layout_segment_bytes(&l, 3));
    int fd = make_memfd(seg_bytes);
    assert_int_equal(kvc__pool_map_segment(&p, 1, fd, seg_bytes, 3, 1), KV_OK);
    close(fd);
    assert_null(kvc_pool_addr(&p, 0, 0, KV_K, 0, 0)); /* segment 0 not mapped */
    uint8_t *base = kvc_pool_segment_base(&p, 1, NULL);
    assert_non_null(base);
    uint8_t *e = kvc_pool_addr(&p, 4, 1, KV_V, 7, 3);
    assert_ptr_equal(e, base + kv_layout_offset(&l, 3, 1, 1, KV_V, 7, 3));
    float *sc = kvc_pool_scale_addr(&p, 5, 1, KV_V, 3);
    assert_ptr_equal((uint8_t *)sc, base + kv_layout_scale_offset(&l, 3, 2, 1, KV_V, 3));
    assert_true((uint8_t *)sc + sizeof(float) <= base + seg_bytes);
    assert_int_equal(kvc_pool_block_read_only(&p, 4), 1);
    assert_int_equal(kvc_pool_block_read_only(&p, 0), 0);
    kvc__pool_unmap(&p);
}

/* The client's hashing helpers reproduce docs/HASH.md's vectors with the pool's seed. */
static void test_hash_helpers_match_spec(void **state) {
    (void)state;
    kvc__diag diag = {0};
    kvc_pool p = {.diag = &diag, .hash_algo = KV_HASH_XXH3_128};
    assert_int_equal(kv_layout_init(1, 1, 64, 16, KV_DTYPE_FP16, KV_LAYER_MAJOR, &p.layout), KV_OK);
    uint32_t tok[40];
    for (uint32_t i = 0; i < 40; i++) {
        tok[i] = 1000 + i;
    }
    kv_hash128 h[4];
    size_t n = 0;
    char hex[33];
    /* 40 tokens: two full blocks (vectors 4a, 4b), the partial third is not hashed. */
    assert_int_equal(kvc_pool_hash_tokens(&p, NULL, 0, tok, 40, h, 4, &n), KV_OK);
    assert_int_equal(n, 2);
    kv_hash_hex(h[0], hex);
    assert_string_equal(hex, "f8d6f8989e27a6f707fb4fd28b71c193");
    kv_hash_hex(h[1], hex);
    assert_string_equal(hex, "44b9cc41652e844d4df58caa7aac6346");
    kv_hash128 next;
    assert_int_equal(kvc_pool_hash_next(&p, h[0], NULL, 0, tok + 16, &next), KV_OK);
    assert_true(kv_hash_eq(next, h[1]));
    for (uint32_t i = 0; i < 16; i++) {
        tok[i] = 1 + i;
    }
    assert_int_equal(kvc_pool_hash_tokens(&p, "lora:7", 6, tok, 16, h, 4, &n), KV_OK);
    kv_hash_hex(h[0], hex);
    assert_string_equal(hex, "ccc3edce67c8baae5f13f39a39535c51");
    assert_int_equal(kvc_pool_hash_tokens(&p, tok, KV_HASH_MAX_EXTRA + 1, tok, 16, h, 4, &n),
                     KV_EINVAL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layer_major_views_agree),
        cmocka_unit_test(test_reserve_aligned),
        cmocka_unit_test(test_layer_ranges_huge_aligned),
        cmocka_unit_test(test_layer_ranges_of_the_budget_only),
        cmocka_unit_test(test_remap_replaces_segment),
        cmocka_unit_test(test_addresses_survive_replacement),
        cmocka_unit_test(test_block_major_and_scales),
        cmocka_unit_test(test_hash_helpers_match_spec),
    };
    return cmocka_run_group_tests_name("client_pool_map", tests, NULL, NULL);
}
