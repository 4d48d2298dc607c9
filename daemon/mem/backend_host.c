/* kvd_backend_host: memfd segments. Sealing is what lets clients trust the size they map. */
#include "daemon/mem/backend_host.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/kv_log.h"
#include "common/kv_util.h"

#define HUGE_PAGE_BYTES (2ull << 20)
#ifndef MFD_HUGE_2MB
#define MFD_HUGE_2MB                                                                               \
    (21u << 26) /* linux/memfd.h: log2(2 MiB) << MFD_HUGE_SHIFT (glibc's                           \
                 * sys/mman.h does not define it) */
#endif

static kv_err host_segment_alloc(void *ctx, uint64_t bytes, kvd_segment_mem *out) {
    const kvd_backend_host_ctx *hc = ctx;
    int huge = hc != NULL && hc->hugepages;
    if (bytes == 0) {
        return KV_EINVAL;
    }
    uint64_t page = huge ? HUGE_PAGE_BYTES : (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t size = (bytes + page - 1) / page * page;
    /* 2 MiB pages by name, not the system's default huge page size (1 GiB on hosts booted with
     * default_hugepagesz=1G): segments are rounded and layer sections aligned to 2 MiB. */
    unsigned flags = MFD_CLOEXEC | MFD_ALLOW_SEALING | (huge ? MFD_HUGETLB | MFD_HUGE_2MB : 0);
    int fd = memfd_create("kvd-segment", flags);
    if (fd < 0) {
        int e = errno;
        if (huge) {
            KV_LOG(ERROR, "KVD-HUGEPAGES",
                   "memfd_create(MFD_HUGETLB, 2 MiB pages) failed: %s; this system has no "
                   "usable 2 MiB huge pages (set "
                   "/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages, or vm.nr_hugepages "
                   "where 2 MiB is the default size, or run with hugepages = false)",
                   strerror(e));
        } else {
            KV_LOG(ERROR, "KVD-SEGMENT", "memfd_create failed: %s", strerror(e));
        }
        return KV_ESYS;
    }
    kv_err rc = KV_ESYS;
    if (ftruncate(fd, (off_t)size) != 0) {
        KV_LOG(ERROR, "KVD-SEGMENT", "ftruncate of a %llu-byte segment failed: %s",
               (unsigned long long)size, strerror(errno));
        goto cleanup_fd;
    }
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        KV_LOG(ERROR, "KVD-SEGMENT", "sealing a segment failed: %s", strerror(errno));
        goto cleanup_fd;
    }
    void *base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        int e = errno;
        if (huge) {
            KV_LOG(ERROR, "KVD-HUGEPAGES",
                   "mmap of a %llu-byte huge-page segment failed: %s; not enough huge pages "
                   "(raise vm.nr_hugepages or run with hugepages = false)",
                   (unsigned long long)size, strerror(e));
        } else {
            KV_LOG(ERROR, "KVD-SEGMENT", "mmap of a %llu-byte segment failed: %s",
                   (unsigned long long)size, strerror(e));
        }
        rc = e == ENOMEM ? KV_ENOMEM : KV_ESYS;
        goto cleanup_fd;
    }
    if (!huge) {
        kv_map_advise_huge(base, size); /* transparent huge pages where shmem THP allows */
    }
    memset(out, 0, sizeof(*out));
    out->base = base;
    out->fd = fd;
    out->bytes = size;
    out->priv = NULL;
    return KV_OK;
cleanup_fd:
    close(fd);
    return rc;
}

static void host_segment_free(void *ctx, kvd_segment_mem *mem) {
    (void)ctx;
    if (mem == NULL) {
        return;
    }
    if (mem->base != NULL && mem->bytes != 0) {
        munmap(mem->base, mem->bytes);
    }
    /* A zeroed segment has fd 0, which is never ours to close: only close fds we made (> 2). */
    if (mem->fd > 2) {
        close(mem->fd);
    }
    mem->base = NULL;
    mem->fd = -1;
    mem->bytes = 0;
}

/* Punches out every page of the memfd: the file keeps its size and seals, mappings stay valid
 * and read zeros, and the pages go back to the system (tmpfs and hugetlbfs both support it). */
static kv_err host_segment_discard(void *ctx, kvd_segment_mem *mem) {
    (void)ctx;
    if (mem == NULL || mem->fd < 0 || mem->bytes == 0) {
        return KV_EINVAL;
    }
    if (fallocate(mem->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, (off_t)mem->bytes) != 0) {
        KV_LOG(WARN, "KVD-SEGMENT-DISCARD", "punching out a %llu-byte segment failed: %s",
               (unsigned long long)mem->bytes, strerror(errno));
        return KV_ESYS;
    }
    return KV_OK;
}

/* Takes a punched-out huge-page segment's pages back before its blocks are used again: a page
 * of hugetlbfs that is missing at its first touch is SIGBUS (another pool or process may have
 * taken the pages punching gave back). Ordinary memfds fault their pages in as written. */
static kv_err host_segment_restore(void *ctx, kvd_segment_mem *mem) {
    const kvd_backend_host_ctx *hc = ctx;
    if (hc == NULL || !hc->hugepages) {
        return KV_OK;
    }
    if (mem == NULL || mem->fd < 0 || mem->bytes == 0) {
        return KV_EINVAL;
    }
    if (fallocate(mem->fd, 0, 0, (off_t)mem->bytes) != 0) {
        int e = errno;
        /* The pages it did get go back too: the segment stays parked, counted as not resident. */
        (void)fallocate(mem->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, (off_t)mem->bytes);
        errno = e;
        KV_LOG(WARN, "KVD-HUGEPAGES",
               "a parked %llu-byte segment cannot have its huge pages back: %s (vm.nr_hugepages)",
               (unsigned long long)mem->bytes, strerror(errno));
        return KV_ENOMEM;
    }
    return KV_OK;
}

/* Huge-page memfds can only be mapped at 2 MiB offsets, so layer sections must be 2 MiB too. */
static uint64_t host_align(void *ctx) {
    const kvd_backend_host_ctx *hc = ctx;
    return hc != NULL && hc->hugepages ? HUGE_PAGE_BYTES : (uint64_t)sysconf(_SC_PAGESIZE);
}

const kvd_backend_ops kvd_backend_host = {
    .name = "host",
    .segment_alloc = host_segment_alloc,
    .segment_free = host_segment_free,
    .kind = KVD_MEM_HOST_MEMFD,
    .align = host_align,
    .segment_discard = host_segment_discard,
    .segment_restore = host_segment_restore,
};

kv_err kvd_backend_host_ro_fd(int fd, int *out) {
    /* Mode first: a receiver's /proc/self/fd/N reopen is checked against the inode's mode. */
    if (fchmod(fd, 0400) != 0) {
        KV_LOG(ERROR, "KVD-SEGMENT", "fchmod 0400 of a read-only segment: %s", strerror(errno));
        return KV_ESYS;
    }
    char path[64];
    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    int ro = open(path, O_RDONLY | O_CLOEXEC);
    if (ro < 0) {
        KV_LOG(ERROR, "KVD-SEGMENT", "reopening a segment read-only (%s): %s", path,
               strerror(errno));
        return KV_ESYS;
    }
    *out = ro;
    return KV_OK;
}
