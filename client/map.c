/* map: the pool record's memory. Each segment's memfd is mapped whole (kv_layout byte order;
 * kvc_pool_addr works through it). For LAYER_MAJOR pools the library also reserves, at attach,
 * one PROT_NONE range per (layer, K|V) large enough for every segment the pool may ever have,
 * and maps each segment's (layer, K|V) section into its place with MAP_FIXED and the section's
 * file offset, so block id b of layer l is at layer_base + b * kv_block_bytes: one ordinary
 * paged tensor per layer, as vLLM and FlashInfer index it. Both views share the same pages
 * (MAP_SHARED of one file), so a write through either is seen through the other and by every
 * other worker. Read-only segments (the commons) are mapped PROT_READ from the read-only fd the
 * daemon sends. Every mapping asks for transparent huge pages (kv_map_advise_huge), granted where
 * the kernel's shmem THP mode allows.
 */
#include "client/map.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "client/conn.h"
#include "common/kv_util.h"

#define KVC__MAX_RESERVE (1ull << 40) /* address space reserved per pool at most (1 TiB) */

static uint64_t page_size(void) {
    long ps = sysconf(_SC_PAGESIZE);
    return ps > 0 ? (uint64_t)ps : 4096;
}

/* A host range that no longer shows pool memory but stays mapped until detach. */
struct kvc__retired {
    void *base;
    uint64_t bytes;
    struct kvc__retired *next;
};

/* Replaces [base, base + bytes) with private anonymous memory (so the segment's memfd is no
 * longer referenced, and an address the engine still holds reads zeros instead of faulting) and
 * remembers the range for kvc__pool_unmap. Unmaps it when that is not possible. */
static void retire_range(kvc_pool *p, void *base, uint64_t bytes) {
    struct kvc__retired *r = malloc(sizeof(*r));
    void *m = r == NULL ? MAP_FAILED
                        : mmap(base, (size_t)bytes, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (m == MAP_FAILED) {
        free(r);
        munmap(base, (size_t)bytes);
        return;
    }
    r->base = base;
    r->bytes = bytes;
    r->next = p->retired;
    p->retired = r;
}

static void drop_retired(kvc_pool *p) {
    while (p->retired != NULL) {
        struct kvc__retired *r = p->retired;
        p->retired = r->next;
        munmap(r->base, (size_t)r->bytes);
        free(r);
    }
}

/* Layer tensors can no longer be kept (a section that cannot be mapped in place): the ranges
 * become anonymous memory until detach, and kvc_pool_layer_base answers NULL from now on. */
static void disable_layers(kvc_pool *p) {
    if (p->layer_base == NULL || p->layers_off) {
        return;
    }
    for (uint32_t i = 0; i < p->layout.num_layers * 2; i++) {
        if (p->layer_base[i] != NULL) {
            void *m = mmap(p->layer_base[i], (size_t)p->layer_range_bytes, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
            (void)m; /* on failure the old mapping stays: still valid memory */
        }
    }
    p->layers_off = 1;
}

void kvc__pool_drop_layers(kvc_pool *p) {
    if (p->layer_base == NULL) {
        return;
    }
    for (uint32_t i = 0; i < p->layout.num_layers * 2; i++) {
        if (p->layer_base[i] != NULL) {
            munmap(p->layer_base[i], p->layer_range_bytes);
        }
    }
    free(p->layer_base);
    p->layer_base = NULL;
    p->layer_range_bytes = 0;
}

void kvc__pool_unmap(kvc_pool *p) {
    if (p == NULL) {
        return;
    }
    if (p->gpu != NULL) {
        p->gpu_ops->unmap(p); /* GPU pools: device mappings first; leaves bases NULL */
    }
    if (p->segs != NULL) {
        for (uint32_t i = 0; i < p->max_segments; i++) {
            if (p->segs[i].base != NULL) {
                munmap(p->segs[i].base, p->segs[i].bytes);
            }
        }
        free(p->segs);
        p->segs = NULL;
    }
    kvc__pool_drop_layers(p);
    drop_retired(p);
    p->nsegs = 0;
}

void *kvc__reserve_aligned(uint64_t bytes) {
    const uint64_t huge = 2ull << 20;
    int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    if (bytes < huge || bytes > UINT64_MAX - huge) {
        return mmap(NULL, (size_t)bytes, PROT_NONE, flags, -1, 0);
    }
    uint8_t *m = mmap(NULL, (size_t)(bytes + huge), PROT_NONE, flags, -1, 0);
    if (m == MAP_FAILED) {
        return MAP_FAILED;
    }
    uint8_t *a = (uint8_t *)(((uintptr_t)m + huge - 1) & ~(uintptr_t)(huge - 1));
    if (a > m) {
        munmap(m, (size_t)(a - m));
    }
    if (a + bytes < m + bytes + huge) {
        munmap(a + bytes, (size_t)(m + bytes + huge - (a + bytes)));
    }
    return a;
}

/* Reserves the per-(layer, K|V) ranges; leaves layer_base NULL where that is not possible. */
static void reserve_layers(kvc_pool *p) {
    const kv_layout *l = &p->layout;
    uint64_t stride = (uint64_t)p->blocks_per_segment * l->kv_block_bytes;
    if (l->arrangement != KV_LAYER_MAJOR || stride % page_size() != 0) {
        return;
    }
    uint64_t range;
    uint64_t total;
    if (__builtin_mul_overflow(stride, (uint64_t)p->max_segments, &range) ||
        __builtin_mul_overflow(range, (uint64_t)l->num_layers * 2, &total) ||
        total > KVC__MAX_RESERVE) {
        kvc__log(p->diag, KVC_LOG_WARN, "KVC-POOL-RESERVE",
                 "layer tensors would need more than 1 TiB of address space; use kvc_pool_addr");
        return;
    }
    uint8_t **bases = calloc((size_t)l->num_layers * 2, sizeof(*bases));
    if (bases == NULL) {
        return;
    }
    for (uint32_t i = 0; i < l->num_layers * 2; i++) {
        void *m = kvc__reserve_aligned(range);
        if (m == MAP_FAILED) {
            kvc__log(p->diag, KVC_LOG_WARN, "KVC-POOL-RESERVE", "reserving layer ranges: %s",
                     strerror(errno));
            for (uint32_t j = 0; j < i; j++) {
                munmap(bases[j], range);
            }
            free(bases);
            return;
        }
        bases[i] = m;
    }
    p->layer_base = bases;
    p->layer_range_bytes = range;
}

kv_err kvc__pool_init_geometry(kvc_pool *p, const kv_layout *layout, uint32_t blocks_per_segment,
                               uint32_t max_segments) {
    if (blocks_per_segment == 0 || max_segments == 0 || max_segments > KVC__MAX_SEGMENTS ||
        layout->block_bytes == 0) {
        return kvc__fail(p->diag, KV_EPROTO,
                         "the daemon's pool geometry is invalid (%u blocks per segment, %u "
                         "segments at most)",
                         blocks_per_segment, max_segments);
    }
    p->layout = *layout;
    p->blocks_per_segment = blocks_per_segment;
    p->budget_segments = max_segments;
    /* The daemon's limit moves with its memory budget; room for its hard maximum keeps
     * segments it adds later inside the layer tensors. */
    p->max_segments = KVC__MAX_SEGMENTS;
    p->segs = calloc(p->max_segments, sizeof(*p->segs));
    if (p->segs == NULL) {
        return kvc__fail(p->diag, KV_ENOMEM, "out of memory for the segment table");
    }
    reserve_layers(p);
    if (p->layer_base == NULL && layout->arrangement == KV_LAYER_MAJOR) {
        /* Try the daemon's current limit before giving up on layer tensors. */
        uint32_t keep = p->max_segments;
        p->max_segments = max_segments;
        reserve_layers(p);
        p->max_segments = keep; /* layer_segments() says how far the ranges reach */
    }
    return KV_OK;
}

/* How many segments the layer ranges cover. */
static uint32_t layer_segments(const kvc_pool *p) {
    uint64_t stride = (uint64_t)p->blocks_per_segment * p->layout.kv_block_bytes;
    return p->layer_base == NULL ? 0 : (uint32_t)(p->layer_range_bytes / stride);
}

uint32_t kvc__pool_layer_segments(const kvc_pool *p) {
    return layer_segments(p);
}

kv_err kvc__pool_map_segment(kvc_pool *p, uint32_t seg, int fd, uint64_t bytes, uint32_t nblocks,
                             int read_only) {
    const kv_layout *l = &p->layout;
    if (seg >= p->max_segments || nblocks == 0 || nblocks > p->blocks_per_segment ||
        bytes < kv_layout_segment_bytes(l, nblocks) || bytes > SIZE_MAX) {
        return kvc__fail(p->diag, KV_EPROTO,
                         "segment %u of %llu bytes and %u blocks does not fit the pool's layout",
                         seg, (unsigned long long)bytes, nblocks);
    }
    int prot = read_only ? PROT_READ : PROT_READ | PROT_WRITE;
    kvc__segment *s = &p->segs[seg];
    /* The daemon freed this segment and grew a new one at the same index. Addresses the engine
     * was given stay valid until detach (kvclient.h): the new segment is mapped over the old
     * range when it fits; otherwise it goes elsewhere and the old range is retired. */
    int in_place = s->base != NULL && bytes <= s->bytes;
    void *base = mmap(in_place ? s->base : NULL, (size_t)bytes, prot,
                      MAP_SHARED | (in_place ? MAP_FIXED : 0), fd, 0);
    if (base == MAP_FAILED) {
        int e = errno;
        kvc__log(p->diag, KVC_LOG_ERROR, "KVC-POOL-MMAP", "mmap of segment %u (%llu bytes): %s",
                 seg, (unsigned long long)bytes, strerror(e));
        return kvc__fail(p->diag, KV_ESYS, "mmap of segment %u (%llu bytes): %s", seg,
                         (unsigned long long)bytes, strerror(e));
    }
    kv_map_advise_huge(base, bytes); /* the daemon advises its mapping too (kv_util.h) */
    if (in_place) {
        uint64_t pg = page_size();
        uint64_t end = (bytes + pg - 1) / pg * pg;
        if (end < s->bytes) {
            /* the old segment was longer: its tail shows zeros now, still ours until detach */
            void *m = mmap(s->base + end, (size_t)(s->bytes - end), PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
            (void)m; /* on failure the tail keeps the old segment's pages: valid memory */
        }
    } else {
        if (s->base != NULL) {
            retire_range(p, s->base, s->bytes);
        }
        s->base = base;
        s->bytes = bytes;
    }
    s->nblocks = nblocks;
    s->read_only = read_only;
    if (seg + 1 > p->nsegs) {
        p->nsegs = seg + 1;
    }
    if (p->layer_base == NULL || p->layers_off || seg >= layer_segments(p)) {
        return KV_OK;
    }
    uint64_t stride = (uint64_t)p->blocks_per_segment * l->kv_block_bytes;
    uint64_t len = (uint64_t)nblocks * l->kv_block_bytes;
    for (uint32_t layer = 0; layer < l->num_layers; layer++) {
        for (int kv = KV_K; kv <= KV_V; kv++) {
            uint64_t off = kv_layout_offset(l, nblocks, 0, layer, kv, 0, 0);
            uint8_t *dst = p->layer_base[layer * 2 + (uint32_t)kv] + (uint64_t)seg * stride;
            if (off % page_size() != 0) {
                /* Sections are page aligned when blocks_per_segment makes them so (the daemon
                 * promises it); a short last segment of another daemon might not be. */
                kvc__log(p->diag, KVC_LOG_WARN, "KVC-POOL-ALIGN",
                         "segment %u: layer section not page aligned; layer tensors disabled", seg);
                goto no_layers;
            }
            void *m = mmap(dst, (size_t)len, prot, MAP_SHARED | MAP_FIXED, fd, (off_t)off);
            if (m == MAP_FAILED) {
                kvc__log(p->diag, KVC_LOG_WARN, "KVC-POOL-MMAP",
                         "segment %u: mapping layer section: %s; layer tensors disabled", seg,
                         strerror(errno));
                goto no_layers;
            }
            kv_map_advise_huge(m, len);
        }
    }
    return KV_OK;
no_layers:
    disable_layers(p);
    return KV_OK;
}

kv_err kvc__pool_map_reply(kvc_pool *p, Kvd__Segment *const *segs, size_t nsegs, const int *fds,
                           size_t nfds) {
    for (size_t i = 0; i < nsegs; i++) {
        const Kvd__Segment *s = segs[i];
        if ((s->kind == KVD__MEMORY_KIND__CUDA_VMM || s->kind == KVD__MEMORY_KIND__CUDA_IPC) &&
            p->gpu_ops != NULL) {
            /* The daemon's GPU is named in the attached pool's reply only. */
            const kvc_pool *o = kvc__pool_owner(p);
            kv_err err = p->gpu_ops->map_segment(p, s, fds, nfds,
                                                 o->has_device_uuid ? o->device_uuid : NULL);
            if (err != KV_OK) {
                return err;
            }
            continue;
        }
        if (s->kind != KVD__MEMORY_KIND__HOST_MEMFD || p->gpu != NULL) {
            return kvc__fail(p->diag, KV_ENOTSUP,
                             "segment %u has memory kind %d, which this pool cannot map", s->index,
                             (int)s->kind);
        }
        if (s->fd_index >= nfds) {
            return kvc__fail(p->diag, KV_EPROTO, "segment %u names fd %u of %zu", s->index,
                             s->fd_index, nfds);
        }
        kv_err err = kvc__pool_map_segment(p, s->index, fds[s->fd_index], s->bytes, s->nblocks,
                                           s->read_only);
        if (err != KV_OK) {
            return kvc__fail(p->diag, err, "cannot map segment %u (%u blocks, %llu bytes): %s",
                             s->index, s->nblocks, (unsigned long long)s->bytes, kv_strerror(err));
        }
    }
    return KV_OK;
}

/* Takes p off its connection's list and frees its mappings and itself. */
kv_err kvc__pool_add_user(kvc_pool *p, void *user, void (*orphan)(void *user)) {
    if (p->nusers == p->users_cap) {
        size_t ncap = p->users_cap ? p->users_cap * 2 : 8;
        void **n = realloc(p->users, ncap * sizeof(*n));
        if (n == NULL) {
            return kvc__fail(p->diag, KV_ENOMEM, "out of memory recording a sequence");
        }
        p->users = n;
        p->users_cap = ncap;
    }
    p->users[p->nusers++] = user;
    p->orphan = orphan;
    return KV_OK;
}

void kvc__pool_forget_user(kvc_pool *p, void *user) {
    for (size_t i = 0; i < p->nusers; i++) {
        if (p->users[i] == user) {
            p->users[i] = p->users[--p->nusers];
            return;
        }
    }
}

static void pool_free_one(kvc_pool *p) {
    /* Sequences made on the pool outlive it as empty shells (their references went with the
     * pool's session, or with DetachPool): every call on them says so. */
    for (size_t i = 0; i < p->nusers && p->orphan != NULL; i++) {
        p->orphan(p->users[i]);
    }
    free(p->users);
    if (p->conn != NULL && p->conn->later != NULL) {
        /* A deferred Release of this pool still goes out; its reply needs no pool. */
        for (size_t i = 0; i < p->conn->later->nops; i++) {
            if (p->conn->later->ops[i].pool == p) {
                p->conn->later->ops[i].pool = NULL;
            }
        }
    }
    if (p->conn != NULL) {
        for (kvc_pool **pp = &p->conn->pools; *pp != NULL; pp = &(*pp)->next) {
            if (*pp == p) {
                *pp = p->next;
                break;
            }
        }
    }
    kvc__pool_unmap(p);
    free(p);
}

void kvc__pool_destroy(kvc_pool *p) {
    if (p == NULL) {
        return;
    }
    for (uint32_t i = 0; i < p->nlinked; i++) {
        if (p->linked[i] != NULL) {
            pool_free_one(p->linked[i]);
        }
    }
    free(p->linked);
    pool_free_one(p);
}

/* The segment and slot of block, or NULL when it is not mapped. */
const kvc__segment *kvc__pool_block_seg(const kvc_pool *p, uint32_t block, uint32_t *slot) {
    uint32_t seg = block / p->blocks_per_segment;
    if (seg >= p->nsegs || p->segs[seg].base == NULL) {
        return NULL;
    }
    *slot = block % p->blocks_per_segment;
    if (*slot >= p->segs[seg].nblocks) {
        return NULL;
    }
    return &p->segs[seg];
}

int kvc__pool_block_mapped(const kvc_pool *p, uint32_t block) {
    uint32_t slot;
    return kvc__pool_block_seg(p, block, &slot) != NULL;
}

uint32_t kvc__pool_first_hole(const kvc_pool *p) {
    for (uint32_t i = 0; i < p->nsegs; i++) {
        if (p->segs[i].base == NULL) {
            return i;
        }
    }
    return p->nsegs;
}

kvc_pool *kvc__pool_owner(const kvc_pool *p) {
    return p->owner != NULL ? p->owner : (kvc_pool *)p;
}

kvc_pool *kvc__pool_find(const kvc_pool *p, uint32_t pool_id) {
    const kvc_pool *o = kvc__pool_owner(p);
    if (o->pool_id == pool_id) {
        return (kvc_pool *)o;
    }
    for (uint32_t i = 0; i < o->nlinked; i++) {
        if (o->linked[i]->pool_id == pool_id) {
            return o->linked[i];
        }
    }
    return NULL;
}

int kvc__pool_stale(const kvc_pool *p) {
    return p->conn == NULL || p->epoch != p->conn->epoch || p->session != p->conn->session_id;
}
