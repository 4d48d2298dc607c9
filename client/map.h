/* map: libkvclient's pool record and the mapping of its segments into the worker.
 *
 * A kvc_pool is the client's view of one daemon pool: its geometry, its segment table (one
 * kvc__segment per slot, holes allowed), the per-(layer, K|V) ranges of LAYER_MAJOR pools, and
 * its links (a tenant's groups and the commons are kvc_pools of their own, owned by the attached
 * pool that linked them). This module maps host (memfd) segments itself; GPU segments
 * (CUDA_VMM, CUDA_IPC) go through the kvc__gpu_ops table that whoever makes the pool installs
 * (client/gpu_map.h's kvc__gpu_mapper), because the GPU mapper works on this record and so sits
 * on top of it. Requests (MapSegments and friends) are not made here: see client/rpc.h.
 * Threads: the pool's (see kvclient.h).
 */
#ifndef KVC_MAP_H
#define KVC_MAP_H

#include <stddef.h>
#include <stdint.h>

#include "client/diag.h"
#include "client/include/kvclient.h"
#include "proto/kvd.pb-c.h"

#define KVC__MAX_SEGMENTS 4096 /* the daemon's per-pool limit (KVD_MAX_SEGMENTS) */

/* One mapped segment of a pool. */
typedef struct kvc__segment {
    uint8_t *base;    /* whole-segment mapping (a device address for GPU pools), NULL: none */
    uint64_t bytes;   /* mapped length (host: the range owned, at least the segment's bytes) */
    uint32_t nblocks; /* blocks in the segment */
    int read_only;    /* mapped PROT_READ (advisory for GPU memory) */
} kvc__segment;

/* How a pool maps GPU segments (implemented by client/gpu_map.c). */
typedef struct kvc__gpu_ops {
    /* Maps one CUDA_VMM or CUDA_IPC segment s of a reply into p; fds[0..nfds) are the frame's
     * fds (borrowed). device_uuid: the 16-byte UUID of kvd's GPU (AttachPoolReply), or NULL.
     * Errors as kvc__pool_map_reply's, with p's last error set. */
    kv_err (*map_segment)(kvc_pool *p, const Kvd__Segment *s, const int *fds, size_t nfds,
                          const unsigned char *device_uuid);
    /* Unmaps every GPU mapping of p and frees p->gpu (leaves segment bases NULL). */
    void (*unmap)(kvc_pool *p);
    int (*device)(const kvc_pool *p);
} kvc__gpu_ops;

struct kvc_pool {
    kvc_conn *conn;                /* owning connection (client/conn.h) */
    kvc__diag *diag;               /* where errors and logs of this pool go: the connection's */
    const kvc__gpu_ops *gpu_ops;   /* GPU segment mapper, or NULL: GPU segments are refused */
    kvc_pool *next;                /* conn's list of pools */
    uint32_t pool_id;              /* daemon's id */
    kv_layout layout;              /* derived fields filled by kv_layout_init */
    uint32_t attach_flags;         /* KVC_ATTACH_* it was attached with */
    uint32_t blocks_per_segment;   /* from AttachPoolReply */
    uint32_t max_segments;         /* capacity of segs[] and of the layer ranges */
    uint32_t budget_segments;      /* the daemon's limit at attach (AttachPoolReply.max_segments) */
    uint32_t nsegs;                /* highest mapped index + 1 (slots below may be unmapped) */
    kvc__segment *segs;            /* [max_segments] */
    uint8_t **layer_base;          /* LAYER_MAJOR: [num_layers * 2] reserved ranges, else NULL */
    uint64_t layer_range_bytes;    /* bytes reserved per (layer, kv) range */
    int layers_off;                /* layer ranges kept (addresses handed out stay valid) but no
                                      longer the pool's memory: kvc_pool_layer_base says NULL */
    struct kvc__retired *retired;  /* host ranges no longer mapped to the pool (anonymous memory
                                      so old addresses stay valid), unmapped at detach */
    kv_hash128 seed;               /* hash chain seed */
    int hash_algo;                 /* kv_hash_algo */
    uint8_t none_hash[32];         /* KV_HASH_VLLM: vLLM's NONE_HASH (the chain's start) */
    uint64_t epoch;                /* boot epoch it was attached under */
    uint64_t session;              /* session it was attached in; its references die with it */
    int need_map;                  /* a reply announced segments we lack, or handed us a block in
                                      one: MapSegments from our first unmapped slot */
    struct kvc__gpu_pool *gpu;     /* GPU pools: device mappings (opaque: client/gpu_map.c) */
    kvc_pool *owner;               /* linked pool: the attached pool that linked it; else NULL */
    kvc_pool **linked;             /* attached pool: its linked pools in lookup order, or NULL */
    uint32_t nlinked;              /* entries of linked */
    int read_only;                 /* the session may only read this pool (the commons) */
    char domain[136];              /* "group:NAME", "commons", or the tenant (private pool) */
    unsigned char device_uuid[16]; /* GPU pools: the UUID of kvd's GPU (AttachPoolReply) */
    int has_device_uuid;           /* device_uuid was sent */
    int layout_conflict;           /* AttachPoolReply.layout_conflict */
    void **users;                  /* objects made on this pool (sequences), told when it goes */
    size_t nusers, users_cap;      /* entries of users */
    void (*orphan)(void *user);    /* what they are told: the pool is gone */
};

/* Records user (a sequence made on p); when p is destroyed, orphan(user) is called so the user
 * stops using it. KV_ENOMEM. */
kv_err kvc__pool_add_user(kvc_pool *p, void *user, void (*orphan)(void *user));

/* Forgets user (it was freed first). */
void kvc__pool_forget_user(kvc_pool *p, void *user);

/* bytes (a multiple of the page size) of address space, no access (PROT_NONE, MAP_NORESERVE),
 * starting on a 2 MiB boundary when bytes >= 2 MiB: a section mapped at a 2 MiB-aligned offset
 * of its memfd can then be mapped with huge entries (the kernel needs the address and the file
 * offset congruent mod 2 MiB; kv_map_advise_huge). Kernels from 6.7 align large anonymous
 * mappings whose size is a multiple of 2 MiB themselves; this does it for any size and kernel.
 * MAP_FAILED (errno set) when out of address space. munmap(p, bytes) gives it back. */
void *kvc__reserve_aligned(uint64_t bytes);

/* Sets up a pool object's geometry and reserves its layer ranges (no daemon involved).
 * KV_EINVAL for a zero or oversized geometry, KV_ENOMEM. */
kv_err kvc__pool_init_geometry(kvc_pool *p, const kv_layout *layout, uint32_t blocks_per_segment,
                               uint32_t max_segments);

/* Maps one host segment from fd (borrowed) at index seg with nblocks blocks of bytes bytes.
 * KV_EPROTO for a bad index or geometry, KV_ESYS when mmap fails. Pure mapping arithmetic,
 * testable with a local memfd. */
kv_err kvc__pool_map_segment(kvc_pool *p, uint32_t seg, int fd, uint64_t bytes, uint32_t nblocks,
                             int read_only);

/* Maps the segments of a reply (AttachPoolReply or MapSegmentsReply) into p; fds[0..nfds) are
 * the frame's fds (borrowed). KV_EPROTO for an fd_index out of range or a bad segment,
 * KV_ENOTSUP for a memory kind p cannot map, the GPU mapper's errors; p's last error says
 * which. */
kv_err kvc__pool_map_reply(kvc_pool *p, Kvd__Segment *const *segs, size_t nsegs, const int *fds,
                           size_t nfds);

/* Gives back the host layer ranges of p (munmap) and leaves p->layer_base NULL. */
void kvc__pool_drop_layers(kvc_pool *p);

/* Unmaps everything and frees p's arrays (not p itself). Accepts NULL. */
void kvc__pool_unmap(kvc_pool *p);

/* The lowest segment slot of p that is not mapped (p->nsegs when every slot below it is). A
 * client asks MapSegments from here, never from the slot it happens to need: asking from a
 * higher slot would leave the hole unmapped (PROTOCOL.md §6, Segments a reply hands out). */
uint32_t kvc__pool_first_hole(const kvc_pool *p);

/* Segment slots the layer tensors (kvc_pool_layer_base) span: max_segments, or fewer where only
 * the attach-time budget's address space could be reserved; 0 without layer tensors. */
uint32_t kvc__pool_layer_segments(const kvc_pool *p);

/* The segment holding block of p and the block's slot in it (*slot), or NULL when that segment
 * is not mapped or does not hold the block. */
const kvc__segment *kvc__pool_block_seg(const kvc_pool *p, uint32_t block, uint32_t *slot);

/* 1 when block's segment of p is mapped and holds the block. */
int kvc__pool_block_mapped(const kvc_pool *p, uint32_t block);

/* The attached pool p belongs to: p's owner for a linked pool, else p. */
kvc_pool *kvc__pool_owner(const kvc_pool *p);

/* The pool with pool_id among p's owner and its linked pools, or NULL. */
kvc_pool *kvc__pool_find(const kvc_pool *p, uint32_t pool_id);

/* 1 when p belongs to an earlier daemon instance or session than its connection's (or has no
 * connection): its handles mean nothing to the daemon now. */
int kvc__pool_stale(const kvc_pool *p);

/* Frees p and its linked pools (unmapped, taken off the connection's list). Accepts NULL. */
void kvc__pool_destroy(kvc_pool *p);

#endif
