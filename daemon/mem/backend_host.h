/* kvd_backend_host: segments in memfd shared memory, the default backend without a GPU.
 *
 * Each segment is one memfd (MFD_CLOEXEC | MFD_ALLOW_SEALING, optionally MFD_HUGETLB), sized
 * with ftruncate to a page multiple and sealed against growing and shrinking, so a client that
 * maps it can never be hit by SIGBUS from the daemon resizing it. The daemon keeps one MAP_SHARED
 * mapping; the fd is what clients receive (SCM_RIGHTS). Without MFD_HUGETLB the mapping asks for
 * transparent huge pages (kv_map_advise_huge; libkvclient advises its mappings too), which the
 * kernel grants where its shmem THP mode allows (docs/ARCHITECTURE.md, "Huge pages"). Loop thread
 * only.
 */
#ifndef KVD_BACKEND_HOST_H
#define KVD_BACKEND_HOST_H

#include "daemon/core/backend.h"

/* The backend's ctx: options fixed at start. */
typedef struct kvd_backend_host_ctx {
    int hugepages; /* MFD_HUGETLB (2 MiB pages); segments rounded up to 2 MiB */
} kvd_backend_host_ctx;

/* segment_alloc: KV_ESYS (logged with errno text; KVD-HUGEPAGES when huge pages are missing),
 * KV_EINVAL for 0 bytes. segment_free: unmaps and closes; accepts a zeroed segment. */
extern const kvd_backend_ops kvd_backend_host;

/* A read-only fd for the memfd fd: reopens it through /proc/self/fd with O_RDONLY (mmap with
 * PROT_WRITE and MAP_SHARED of the result fails with EACCES) and makes the memfd mode 0400, so a
 * non-root receiver cannot reopen its copy writable either. The daemon's own mapping stays
 * writable. *out is the caller's to close. KV_ESYS (logged). */
kv_err kvd_backend_host_ro_fd(int fd, int *out);

#endif
