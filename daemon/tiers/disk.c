/* kvd_disk: one pool's T2 slot file, read and written with pread/pwrite from any thread.
 *
 * Every integer is stored little-endian through the put/get helpers below, so the format does not
 * depend on struct layout or host byte order.
 *
 * File header, bytes [0, 4096):
 *     0  8  magic "KVDTIER2"
 *     8  4  u32 file format version (1 or 2)
 *    12  4  u32 header bytes (4096)
 *    16  8  u64 slot_bytes
 *    24  8  u64 block_bytes
 *    32  4  u32 num_layers
 *    36  4  u32 num_kv_heads
 *    40  4  u32 head_dim
 *    44  4  u32 tokens_per_block
 *    48  4  u32 dtype
 *    52  4  u32 arrangement
 *    56  8  u64 seed lo
 *    64  8  u64 seed hi
 *    72  4  u32 model id bytes (1..256)
 *    76  4  u32 domain name bytes (1..256)
 *    80 256 model id, zero padded
 *   336 256 domain name, zero padded
 *   592     zero up to 4088
 *  4088  8  u64 XXH3_64bits of bytes [0, 4088)
 *
 * Record header, the first 64 bytes of a slot (slot i at 4096 + i * slot_bytes):
 *     0  2  u16 magic 0x524B ("KR")
 *     2  1  u8  record version (1)
 *     3  1  u8  kvd_tier_format of the payload; bit 7: a 16-byte digest tail precedes it
 *     4  4  u32 payload bytes
 *     8  8  u64 hash lo
 *    16  8  u64 hash hi
 *    24  8  u64 parent lo
 *    32  8  u64 parent hi
 *    40  8  u64 seq
 *    48  8  u64 XXH3_64bits of the payload
 *    56  8  u64 XXH3_64bits of bytes [0, 56)
 * then, format 1: the payload at byte 64 (with bit 7: the tail at 64, the payload at 80) and
 * zeros to the end of the slot; format 2: the tail (with bit 7) at 64, zeros to byte 4096, the
 * payload at byte 4096 and zeros to the end of the slot. The payload bytes count only the
 * payload; its checksum is XXH3_64bits of the tail (when there is one) followed by the payload,
 * in both formats. A slot whose first 64 bytes are all zero is empty. The magic is short so that
 * both checksums keep all 64 bits; the header checksum is what rejects garbage.
 *
 * I/O: whole slots, the 4096-byte file header, or a slot's first 4096 bytes (scan reads and
 * clear writes only those), always at 4096-aligned offsets, so O_DIRECT works where the file
 * system takes it. Where it refuses O_DIRECT at I/O time (EINVAL), O_DIRECT is cleared on the
 * descriptor with fcntl(F_SETFL), which every thread sees at once without swapping descriptors
 * under them. Nothing is fsync'ed: after a crash a slot may be stale or torn, and its checksums
 * tell.
 */
#include "daemon/tiers/disk.h"

#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

#include "common/kv_log.h"
#include "daemon/tiers/codec.h"

#define FILE_MAGIC "KVDTIER2"
#define FILE_HDR KVD_DISK_ALIGN
#define FILE_SUM_OFF (FILE_HDR - 8u)
#define FILE_MODEL_OFF 80u
#define FILE_DOMAIN_OFF (FILE_MODEL_OFF + KVD_DISK_KEY_MAX)

#define REC_MAGIC 0x524Bu
#define REC_VERSION 1u
#define REC_SUM_OFF 56u

struct kvd_disk {
    char *path;          /* <dir>/<name>, heap */
    atomic_int fd;       /* read/write, O_CLOEXEC; -1 once closed */
    atomic_int direct;   /* 1 while the descriptor has O_DIRECT */
    unsigned version;    /* file format, 1 or 2 */
    uint64_t slot_bytes; /* bytes of one slot, a multiple of KVD_DISK_ALIGN */
    /* Preallocation (kvd_disk_preallocate): the file's blocks reach alloc_end (what kvd made
     * or found; not lowered when the file is cut under it); grow_mu orders the fallocate calls;
     * prealloc_max 0 is off; after a refusal, no new try before a write reaches prealloc_retry.
     * prealloc_step (whole slots) and prealloc_logged under grow_mu. */
    pthread_mutex_t grow_mu;
    atomic_ullong alloc_end;
    atomic_ullong prealloc_max;
    atomic_ullong prealloc_retry;
    uint64_t prealloc_step;
    int prealloc_logged;
};

/* Slot bytes of a format-version file of block_bytes blocks. */
static uint64_t slot_bytes_for(unsigned version, uint64_t block_bytes) {
    uint64_t head = version == 1 ? KVD_DISK_REC_HDR : KVD_DISK_ALIGN;
    return (head + block_bytes + KVD_DISK_ALIGN - 1) / KVD_DISK_ALIGN * KVD_DISK_ALIGN;
}

static void put_u16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) {
        p[i] = (uint8_t)(v >> (8 * i));
    }
}

static void put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) {
        p[i] = (uint8_t)(v >> (8 * i));
    }
}

static uint16_t get_u16(const uint8_t *p) {
    return (uint16_t)(p[0] | (p[1] << 8));
}

static uint32_t get_u32(const uint8_t *p) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) {
        v |= (uint32_t)p[i] << (8 * i);
    }
    return v;
}

static uint64_t get_u64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) {
        v |= (uint64_t)p[i] << (8 * i);
    }
    return v;
}

static void disk_msg(char *msg, size_t msglen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void disk_msg(char *msg, size_t msglen, const char *fmt, ...) {
    if (msg == NULL || msglen == 0) {
        return;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, msglen, fmt, ap);
    va_end(ap);
}

/* Byte offset of slot, or 0 when it does not fit off_t (slot 0 is at FILE_HDR, never 0). */
static uint64_t disk_slot_off(const kvd_disk *d, uint64_t slot) {
    uint64_t max = (uint64_t)INT64_MAX - FILE_HDR - d->slot_bytes;
    if (slot > max / d->slot_bytes) {
        return 0;
    }
    return FILE_HDR + slot * d->slot_bytes;
}

/* Turns O_DIRECT off for good after the file system refused an O_DIRECT transfer. Threads that
 * race here all clear the same flag; the first logs. */
static int disk_drop_direct(kvd_disk *d, int fd, int err) {
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_DIRECT) != 0) {
        return -1;
    }
    if (atomic_exchange(&d->direct, 0)) {
        KV_LOG(INFO, "KVD-TIER2-FILE", "%s: O_DIRECT I/O refused (%s); using buffered I/O", d->path,
               strerror(err));
    }
    return 0;
}

/* Moves n bytes between buf and the file at off, looping over short transfers and EINTR.
 * *done gets the bytes moved (fewer than n only for a read that met the end of the file).
 * Returns 0, or -1 with errno set. */
static int disk_io(kvd_disk *d, int wr, void *buf, size_t n, uint64_t off, size_t *done) {
    size_t got = 0;
    while (got < n) {
        int fd = atomic_load(&d->fd);
        ssize_t r = wr ? pwrite(fd, (const uint8_t *)buf + got, n - got, (off_t)(off + got))
                       : pread(fd, (uint8_t *)buf + got, n - got, (off_t)(off + got));
        if (r < 0) {
            int e = errno;
            if (e == EINTR) {
                continue;
            }
            /* Only a transfer that has not started is aligned for sure: EINVAL there is the
             * file system (or a buffer) that O_DIRECT cannot serve. */
            if (e == EINVAL && got == 0 && atomic_load(&d->direct) &&
                disk_drop_direct(d, fd, e) == 0) {
                continue;
            }
            errno = e;
            return -1;
        }
        if (r == 0) {
            if (wr) {
                errno = EIO;
                return -1;
            }
            break;
        }
        got += (size_t)r;
    }
    *done = got;
    return 0;
}

/* mkdir -p: creates each missing component 0700; existing ones are used as they are. */
static kv_err disk_mkdirs(const char *dir, char *msg, size_t msglen) {
    size_t n = strlen(dir);
    char *p = malloc(n + 1);
    if (p == NULL) {
        disk_msg(msg, msglen, "no memory for directory path %s", dir);
        return KV_ENOMEM;
    }
    memcpy(p, dir, n + 1);
    kv_err rc = KV_ESYS;
    for (size_t i = 1; i <= n; i++) {
        if (p[i] != '/' && p[i] != '\0') {
            continue;
        }
        if (p[i - 1] == '/') {
            continue;
        }
        char c = p[i];
        p[i] = '\0';
        /* An existing component may answer EACCES or EROFS rather than EEXIST: a directory
         * already there is fine whatever mkdir said. */
        struct stat cst;
        if (mkdir(p, 0700) != 0 && errno != EEXIST) {
            int e = errno;
            if (stat(p, &cst) != 0 || !S_ISDIR(cst.st_mode)) {
                disk_msg(msg, msglen, "cannot create directory %s: %s", p, strerror(e));
                goto cleanup_path;
            }
        }
        p[i] = c;
    }
    struct stat st;
    if (stat(dir, &st) != 0) {
        disk_msg(msg, msglen, "cannot use directory %s: %s", dir, strerror(errno));
        goto cleanup_path;
    }
    if (!S_ISDIR(st.st_mode)) {
        disk_msg(msg, msglen, "cannot use directory %s: %s", dir, strerror(ENOTDIR));
        goto cleanup_path;
    }
    rc = KV_OK;
cleanup_path:
    free(p);
    return rc;
}

static int disk_key_str_ok(const char *s) {
    size_t n = strnlen(s, KVD_DISK_KEY_MAX + 1);
    return n >= 1 && n <= KVD_DISK_KEY_MAX;
}

static kv_err disk_key_check(const kvd_disk_key *key, char *msg, size_t msglen) {
    if (!disk_key_str_ok(key->model)) {
        disk_msg(msg, msglen, "T2 file key: model id must be 1..%u bytes", KVD_DISK_KEY_MAX);
        return KV_EINVAL;
    }
    if (!disk_key_str_ok(key->domain)) {
        disk_msg(msg, msglen, "T2 file key: domain name must be 1..%u bytes", KVD_DISK_KEY_MAX);
        return KV_EINVAL;
    }
    const kv_layout *l = &key->layout;
    kv_layout chk;
    if (kv_layout_init(l->num_layers, l->num_kv_heads, l->head_dim, l->tokens_per_block, l->dtype,
                       l->arrangement, &chk) != KV_OK) {
        const char *why = kv_layout_check_msg(l->num_layers, l->num_kv_heads, l->head_dim,
                                              l->tokens_per_block, l->dtype, l->arrangement);
        disk_msg(msg, msglen, "T2 file key: bad layout: %s", why != NULL ? why : "invalid");
        return KV_EINVAL;
    }
    if (chk.block_bytes != l->block_bytes) {
        disk_msg(msg, msglen, "T2 file key: layout not initialised (block_bytes %llu, not %llu)",
                 (unsigned long long)l->block_bytes, (unsigned long long)chk.block_bytes);
        return KV_EINVAL;
    }
    return KV_OK;
}

static int disk_name_ok(const char *name) {
    return name[0] != '\0' && strchr(name, '/') == NULL && strcmp(name, ".") != 0 &&
           strcmp(name, "..") != 0;
}

static void disk_header_build(uint8_t *h, const kvd_disk_key *key, unsigned version,
                              uint64_t slot_bytes) {
    memset(h, 0, FILE_HDR);
    memcpy(h, FILE_MAGIC, 8);
    put_u32(h + 8, version);
    put_u32(h + 12, FILE_HDR);
    put_u64(h + 16, slot_bytes);
    put_u64(h + 24, key->layout.block_bytes);
    put_u32(h + 32, key->layout.num_layers);
    put_u32(h + 36, key->layout.num_kv_heads);
    put_u32(h + 40, key->layout.head_dim);
    put_u32(h + 44, key->layout.tokens_per_block);
    put_u32(h + 48, (uint32_t)key->layout.dtype);
    put_u32(h + 52, (uint32_t)key->layout.arrangement);
    put_u64(h + 56, key->seed.lo);
    put_u64(h + 64, key->seed.hi);
    size_t ml = strlen(key->model);
    size_t dl = strlen(key->domain);
    put_u32(h + 72, (uint32_t)ml);
    put_u32(h + 76, (uint32_t)dl);
    memcpy(h + FILE_MODEL_OFF, key->model, ml);
    memcpy(h + FILE_DOMAIN_OFF, key->domain, dl);
    put_u64(h + FILE_SUM_OFF, XXH3_64bits(h, FILE_SUM_OFF));
}

/* NULL when header h (FILE_HDR bytes) belongs to key (*version gets its format), else why not
 * (for the log line). */
static const char *disk_header_mismatch(const uint8_t *h, const kvd_disk_key *key,
                                        unsigned *version) {
    if (memcmp(h, FILE_MAGIC, 8) != 0) {
        return "bad magic (not a kvd T2 file)";
    }
    if (get_u64(h + FILE_SUM_OFF) != XXH3_64bits(h, FILE_SUM_OFF)) {
        return "header checksum mismatch";
    }
    uint32_t v = get_u32(h + 8);
    if ((v != 1 && v != 2) || get_u32(h + 12) != FILE_HDR) {
        return "unknown file format version";
    }
    const kv_layout *l = &key->layout;
    if (get_u32(h + 32) != l->num_layers || get_u32(h + 36) != l->num_kv_heads ||
        get_u32(h + 40) != l->head_dim || get_u32(h + 44) != l->tokens_per_block ||
        get_u32(h + 48) != (uint32_t)l->dtype || get_u32(h + 52) != (uint32_t)l->arrangement) {
        return "layout differs";
    }
    if (get_u64(h + 24) != l->block_bytes || get_u64(h + 16) != slot_bytes_for(v, l->block_bytes)) {
        return "block or slot size differs";
    }
    if (get_u64(h + 56) != key->seed.lo || get_u64(h + 64) != key->seed.hi) {
        return "hash seed differs";
    }
    size_t ml = strlen(key->model);
    if (get_u32(h + 72) != ml || memcmp(h + FILE_MODEL_OFF, key->model, ml) != 0) {
        return "model id differs";
    }
    size_t dl = strlen(key->domain);
    if (get_u32(h + 76) != dl || memcmp(h + FILE_DOMAIN_OFF, key->domain, dl) != 0) {
        return "domain differs";
    }
    *version = v;
    return NULL;
}

/* Opens path read-write with flags (O_CREAT...), with O_DIRECT first when asked; sets d->fd and
 * d->direct. Returns 0 or -1 with errno. */
static int disk_open_fd(kvd_disk *d, int flags, int direct) {
    flags |= O_RDWR | O_CLOEXEC;
    int fd = -1;
    if (direct) {
        fd = open(d->path, flags | O_DIRECT, 0600);
        if (fd >= 0) {
            atomic_store(&d->fd, fd);
            atomic_store(&d->direct, 1);
            return 0;
        }
        if (errno != EINVAL) {
            return -1;
        }
        /* Refused for O_DIRECT: some file systems (tmpfs before Linux 6.6) refuse it only after
         * they made the file, which O_EXCL would now find. */
        flags &= ~O_EXCL;
    }
    fd = open(d->path, flags, 0600);
    if (fd < 0) {
        return -1;
    }
    atomic_store(&d->fd, fd);
    atomic_store(&d->direct, 0);
    return 0;
}

static void disk_close_fd(kvd_disk *d) {
    int fd = atomic_exchange(&d->fd, -1);
    if (fd >= 0) {
        close(fd);
    }
}

/* Checks the file just opened: *fresh = 1 when it is empty (new), *why = NULL when its header
 * is key's (d->version and slot_bytes then the file's), else *why says why it must be put
 * aside. KV_ESYS (msg) when it cannot be read. */
static kv_err disk_check_existing(kvd_disk *d, const kvd_disk_key *key, uint8_t *h, int *fresh,
                                  const char **why, char *msg, size_t msglen) {
    struct stat st;
    if (fstat(atomic_load(&d->fd), &st) != 0) {
        disk_msg(msg, msglen, "cannot stat T2 file %s: %s", d->path, strerror(errno));
        return KV_ESYS;
    }
    *fresh = 0;
    *why = NULL;
    if (st.st_size == 0) {
        *fresh = 1;
        return KV_OK;
    }
    if (st.st_size < (off_t)FILE_HDR) {
        *why = "truncated header";
        return KV_OK;
    }
    size_t done = 0;
    if (disk_io(d, 0, h, FILE_HDR, 0, &done) != 0) {
        disk_msg(msg, msglen, "cannot read T2 file header of %s: %s", d->path, strerror(errno));
        return KV_ESYS;
    }
    if (done < FILE_HDR) {
        *why = "truncated header";
        return KV_OK;
    }
    unsigned v = 0;
    *why = disk_header_mismatch(h, key, &v);
    if (*why == NULL) {
        d->version = v;
        d->slot_bytes = slot_bytes_for(v, key->layout.block_bytes);
    }
    return KV_OK;
}

kv_err kvd_disk_open(const char *dir, const char *name, const kvd_disk_key *key, unsigned flags,
                     kvd_disk **out, char *msg, size_t msglen) {
    if (dir == NULL || dir[0] == '\0' || name == NULL || key == NULL || out == NULL) {
        disk_msg(msg, msglen, "T2 file: directory, name, key and out are required");
        return KV_EINVAL;
    }
    if (!disk_name_ok(name)) {
        disk_msg(msg, msglen, "T2 file name \"%s\" must be a plain file name", name);
        return KV_EINVAL;
    }
    kv_err rc = disk_key_check(key, msg, msglen);
    if (rc != KV_OK) {
        return rc;
    }
    rc = disk_mkdirs(dir, msg, msglen);
    if (rc != KV_OK) {
        return rc;
    }
    rc = KV_ENOMEM;
    kvd_disk *d = calloc(1, sizeof(*d));
    if (d == NULL) {
        disk_msg(msg, msglen, "no memory for T2 file %s/%s", dir, name);
        return rc;
    }
    atomic_init(&d->fd, -1);
    atomic_init(&d->direct, 0);
    atomic_init(&d->alloc_end, 0);
    atomic_init(&d->prealloc_max, 0);
    atomic_init(&d->prealloc_retry, 0);
    pthread_mutex_init(&d->grow_mu, NULL);
    int direct = (flags & KVD_DISK_DIRECT) != 0;
    /* Format 2 where its header page costs no room over format 1's 64 bytes (see disk.h). */
    uint64_t bb = key->layout.block_bytes;
    unsigned fresh_version = slot_bytes_for(2, bb) == slot_bytes_for(1, bb) ? 2u : 1u;
    if (flags & (KVD_DISK_FORMAT1 | KVD_DISK_FORMAT2)) {
        fresh_version = (flags & KVD_DISK_FORMAT1) ? 1u : 2u;
    }
    size_t plen = strlen(dir) + 1 + strlen(name) + 1;
    d->path = malloc(plen);
    if (d->path == NULL) {
        disk_msg(msg, msglen, "no memory for T2 file %s/%s", dir, name);
        goto cleanup_disk;
    }
    snprintf(d->path, plen, "%s/%s", dir, name);
    uint8_t *h = aligned_alloc(KVD_DISK_ALIGN, FILE_HDR);
    if (h == NULL) {
        disk_msg(msg, msglen, "no memory for T2 file %s", d->path);
        goto cleanup_disk;
    }
    rc = KV_ESYS;
    if (disk_open_fd(d, O_CREAT, direct) != 0) {
        disk_msg(msg, msglen, "cannot open T2 file %s: %s", d->path, strerror(errno));
        goto cleanup_header;
    }
    int fresh = 0;
    const char *why = NULL;
    rc = disk_check_existing(d, key, h, &fresh, &why, msg, msglen);
    if (rc != KV_OK) {
        goto cleanup_fd;
    }
    if (why != NULL) {
        rc = KV_ENOMEM;
        size_t blen = strlen(d->path) + sizeof(".bad");
        char *bad = malloc(blen);
        if (bad == NULL) {
            disk_msg(msg, msglen, "no memory for T2 file %s", d->path);
            goto cleanup_fd;
        }
        snprintf(bad, blen, "%s.bad", d->path);
        disk_close_fd(d);
        rc = KV_ESYS;
        if (rename(d->path, bad) != 0) {
            disk_msg(msg, msglen, "cannot rename T2 file %s to %s: %s", d->path, bad,
                     strerror(errno));
            free(bad);
            goto cleanup_header;
        }
        KV_LOG(WARN, "KVD-TIER2-FILE", "%s: %s; renamed to %s, starting an empty file", d->path,
               why, bad);
        free(bad);
        if (disk_open_fd(d, O_CREAT | O_EXCL, direct) != 0) {
            disk_msg(msg, msglen, "cannot create T2 file %s: %s", d->path, strerror(errno));
            goto cleanup_header;
        }
        fresh = 1;
    }
    if (fresh) {
        d->version = fresh_version;
        d->slot_bytes = slot_bytes_for(d->version, key->layout.block_bytes);
        disk_header_build(h, key, d->version, d->slot_bytes);
        size_t done = 0;
        if (disk_io(d, 1, h, FILE_HDR, 0, &done) != 0) {
            disk_msg(msg, msglen, "cannot write T2 file header of %s: %s", d->path,
                     strerror(errno));
            goto cleanup_fd;
        }
    }
    free(h);
    struct stat st;
    if (fstat(atomic_load(&d->fd), &st) == 0) {
        atomic_store(&d->alloc_end, (uint64_t)st.st_size);
    }
    *out = d;
    return KV_OK;
cleanup_fd:
    disk_close_fd(d);
cleanup_header:
    free(h);
cleanup_disk:
    pthread_mutex_destroy(&d->grow_mu);
    free(d->path);
    free(d);
    return rc;
}

void kvd_disk_close(kvd_disk *d) {
    if (d == NULL) {
        return;
    }
    disk_close_fd(d);
    pthread_mutex_destroy(&d->grow_mu);
    free(d->path);
    free(d);
}

void kvd_disk_preallocate(kvd_disk *d, uint64_t max_bytes, uint64_t step_bytes) {
    pthread_mutex_lock(&d->grow_mu);
    uint64_t step = step_bytes / d->slot_bytes * d->slot_bytes;
    d->prealloc_step = step > 0 ? step : d->slot_bytes;
    atomic_store(&d->prealloc_max, max_bytes);
    atomic_store(&d->prealloc_retry, 0);
    pthread_mutex_unlock(&d->grow_mu);
}

/* Before a write that reaches byte end of the file: with preallocation on, makes the file's
 * blocks reach at least end, growing it (fallocate) a step ahead, whole slots, up to
 * prealloc_max. A write into a file's allocated blocks runs beside the others; one that extends
 * the file takes the file system's exclusive inode lock (ext4, xfs: the writes of all copy
 * threads go one at a time, and io_uring hands each to a worker thread). A refusal (no room
 * for the step, a file system without fallocate) is tried again only once the writes have
 * grown the file by another step: meanwhile they extend it as before, and report a full disk
 * themselves. The common cases (room already made; preallocation off; a refusal being waited
 * out) take no lock. Any thread. */
static void disk_grow(kvd_disk *d, uint64_t end) {
    if (end <= atomic_load(&d->alloc_end) || end > atomic_load(&d->prealloc_max) ||
        end < atomic_load(&d->prealloc_retry)) {
        return;
    }
    pthread_mutex_lock(&d->grow_mu);
    uint64_t have = atomic_load(&d->alloc_end), max = atomic_load(&d->prealloc_max);
    if (end > have && end <= max && end >= atomic_load(&d->prealloc_retry)) {
        uint64_t want = end > have + d->prealloc_step ? end : have + d->prealloc_step;
        if (want > max) {
            want = end + (max - end) / d->slot_bytes * d->slot_bytes;
        }
        if (fallocate(atomic_load(&d->fd), 0, (off_t)have, (off_t)(want - have)) == 0) {
            atomic_store(&d->alloc_end, want);
        } else {
            int e = errno;
            if (!d->prealloc_logged) {
                d->prealloc_logged = 1;
                KV_LOG(INFO, "KVD-TIER2-FILE",
                       "%s: preallocating %llu bytes refused (%s); the file grows as it is "
                       "written until the next step",
                       d->path, (unsigned long long)(want - have), strerror(e));
            }
            atomic_store(&d->prealloc_retry, want);
        }
    }
    pthread_mutex_unlock(&d->grow_mu);
}

uint64_t kvd_disk_slot_bytes(const kvd_disk *d) {
    return d->slot_bytes;
}

uint64_t kvd_disk_payload_max(const kvd_disk *d) {
    return d->slot_bytes - (d->version == 1 ? KVD_DISK_REC_HDR : KVD_DISK_ALIGN);
}

int kvd_disk_fits(const kvd_disk *d, uint64_t len, int has_tail) {
    uint64_t tail = has_tail && d->version == 1 ? KVD_DISK_TAIL : 0;
    return len + tail <= kvd_disk_payload_max(d);
}

unsigned kvd_disk_format(const kvd_disk *d) {
    return d->version;
}

uint64_t kvd_disk_payload_off(const kvd_disk *d, const kvd_disk_rec *rec) {
    if (d->version != 1) {
        return KVD_DISK_ALIGN;
    }
    return KVD_DISK_REC_HDR + (rec->has_tail ? KVD_DISK_TAIL : 0u);
}

/* The payload checksum of the record rec in slot image buf: XXH3_64bits of its tail (when it
 * has one) followed by its payload. */
static uint64_t rec_sum(const kvd_disk *d, const uint8_t *buf, const kvd_disk_rec *rec) {
    uint64_t tail = rec->has_tail ? KVD_DISK_TAIL : 0;
    if (d->version == 1 || tail == 0) {
        /* Format 1 keeps them side by side; without a tail there is only the payload. */
        return XXH3_64bits(buf + (d->version == 1 ? KVD_DISK_REC_HDR : KVD_DISK_ALIGN),
                           rec->len + (d->version == 1 ? tail : 0));
    }
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    XXH3_64bits_reset(&st);
    XXH3_64bits_update(&st, buf + KVD_DISK_REC_HDR, KVD_DISK_TAIL);
    XXH3_64bits_update(&st, buf + KVD_DISK_ALIGN, rec->len);
    return XXH3_64bits_digest(&st);
}

int kvd_disk_direct(const kvd_disk *d) {
    return atomic_load(&((kvd_disk *)d)->direct);
}

uint64_t kvd_disk_slots(const kvd_disk *d) {
    struct stat st;
    if (fstat(atomic_load(&((kvd_disk *)d)->fd), &st) != 0 || st.st_size < (off_t)FILE_HDR) {
        return 0;
    }
    return ((uint64_t)st.st_size - FILE_HDR) / d->slot_bytes;
}

static int rec_is_empty(const uint8_t *p) {
    for (unsigned i = 0; i < KVD_DISK_REC_HDR; i++) {
        if (p[i] != 0) {
            return 0;
        }
    }
    return 1;
}

/* Parses and checks a record header (all but the payload checksum); 0 when valid. */
static int rec_parse(const kvd_disk *d, const uint8_t *p, kvd_disk_rec *rec, uint64_t *psum) {
    memset(rec, 0, sizeof(*rec));
    if (get_u16(p) != REC_MAGIC || p[2] != REC_VERSION) {
        return -1;
    }
    if (get_u64(p + REC_SUM_OFF) != XXH3_64bits(p, REC_SUM_OFF)) {
        return -1;
    }
    uint32_t len = get_u32(p + 4);
    uint32_t fmt = p[3] & 0x7fu, tail = (p[3] & 0x80u) != 0;
    if (fmt >= KVD_TF_COUNT || !kvd_disk_fits(d, len, (int)tail)) {
        return -1;
    }
    rec->format = fmt;
    rec->len = len;
    rec->has_tail = tail;
    if (tail) {
        memcpy(rec->tail, p + KVD_DISK_REC_HDR, KVD_DISK_TAIL);
    }
    rec->hash.lo = get_u64(p + 8);
    rec->hash.hi = get_u64(p + 16);
    rec->parent.lo = get_u64(p + 24);
    rec->parent.hi = get_u64(p + 32);
    rec->seq = get_u64(p + 40);
    *psum = get_u64(p + 48);
    return 0;
}

kv_err kvd_disk_scan(kvd_disk *d, kvd_disk_scan_fn fn, void *arg, uint64_t *bad) {
    uint8_t *p = aligned_alloc(KVD_DISK_ALIGN, KVD_DISK_ALIGN);
    if (p == NULL) {
        return KV_ENOMEM;
    }
    kv_err rc = KV_OK;
    uint64_t nbad = 0;
    uint64_t n = kvd_disk_slots(d);
    for (uint64_t s = 0; s < n; s++) {
        size_t done = 0;
        if (disk_io(d, 0, p, KVD_DISK_ALIGN, disk_slot_off(d, s), &done) != 0) {
            KV_LOG(ERROR, "KVD-TIER2-FILE", "%s: reading slot %llu failed: %s", d->path,
                   (unsigned long long)s, strerror(errno));
            rc = KV_ESYS;
            goto cleanup_buf;
        }
        if (done < KVD_DISK_REC_HDR) {
            break; /* the file shrank under us: nothing more to find */
        }
        if (rec_is_empty(p)) {
            continue;
        }
        kvd_disk_rec rec;
        uint64_t psum;
        if (rec_parse(d, p, &rec, &psum) != 0) {
            nbad++;
            continue;
        }
        if (fn != NULL) {
            fn(arg, s, &rec);
        }
    }
    if (bad != NULL) {
        *bad = nbad;
    }
cleanup_buf:
    free(p);
    return rc;
}

/* Whether rec can be written: a known format, its payload and tail within a slot. */
static int rec_fits(const kvd_disk *d, const kvd_disk_rec *rec) {
    return kvd_disk_fits(d, rec->len, (int)rec->has_tail) && rec->format < KVD_TF_COUNT;
}

/* The 64-byte record header of rec at buf, with psum the checksum of its tail and payload. */
static void rec_header(uint8_t *buf, const kvd_disk_rec *rec, uint64_t psum) {
    put_u16(buf, REC_MAGIC);
    buf[2] = REC_VERSION;
    buf[3] = (uint8_t)(rec->format | (rec->has_tail ? 0x80u : 0u));
    put_u32(buf + 4, rec->len);
    put_u64(buf + 8, rec->hash.lo);
    put_u64(buf + 16, rec->hash.hi);
    put_u64(buf + 24, rec->parent.lo);
    put_u64(buf + 32, rec->parent.hi);
    put_u64(buf + 40, rec->seq);
    put_u64(buf + 48, psum);
    put_u64(buf + REC_SUM_OFF, XXH3_64bits(buf, REC_SUM_OFF));
}

kv_err kvd_disk_write(kvd_disk *d, uint64_t slot, const kvd_disk_rec *rec, const void *payload,
                      uint8_t *buf, int *sys_errno) {
    if (rec == NULL || buf == NULL || !rec_fits(d, rec) || (rec->len > 0 && payload == NULL)) {
        return KV_EINVAL;
    }
    uint64_t off = disk_slot_off(d, slot);
    if (off == 0) {
        if (sys_errno != NULL) {
            *sys_errno = EFBIG;
        }
        return KV_ESYS;
    }
    disk_grow(d, off + d->slot_bytes);
    uint64_t poff = kvd_disk_payload_off(d, rec);
    uint8_t *pl = buf + poff;
    /* Move first: payload may overlap the header bytes about to be written. */
    if (payload != pl && rec->len > 0) {
        memmove(pl, payload, rec->len);
    }
    uint64_t tail = rec->has_tail ? KVD_DISK_TAIL : 0;
    if (tail > 0) {
        memcpy(buf + KVD_DISK_REC_HDR, rec->tail, KVD_DISK_TAIL);
    }
    memset(buf + KVD_DISK_REC_HDR + tail, 0, poff - KVD_DISK_REC_HDR - tail); /* format 2 */
    memset(pl + rec->len, 0, d->slot_bytes - poff - rec->len);
    rec_header(buf, rec, rec_sum(d, buf, rec));
    size_t done = 0;
    if (disk_io(d, 1, buf, d->slot_bytes, off, &done) != 0) {
        if (sys_errno != NULL) {
            *sys_errno = errno;
        }
        return KV_ESYS;
    }
    return KV_OK;
}

kv_err kvd_disk_read(kvd_disk *d, uint64_t slot, const kv_hash128 *expect, kvd_disk_rec *rec,
                     uint8_t *buf) {
    if (rec == NULL || buf == NULL) {
        return KV_EINVAL;
    }
    uint64_t off = disk_slot_off(d, slot);
    if (off == 0) {
        return KV_ECORRUPT; /* past any possible end of file */
    }
    size_t done = 0;
    if (disk_io(d, 0, buf, d->slot_bytes, off, &done) != 0) {
        KV_LOG(ERROR, "KVD-TIER2-FILE", "%s: reading slot %llu failed: %s", d->path,
               (unsigned long long)slot, strerror(errno));
        return KV_ESYS;
    }
    if (done < d->slot_bytes) {
        return KV_ECORRUPT;
    }
    kvd_disk_rec r;
    uint64_t psum;
    if (rec_parse(d, buf, &r, &psum) != 0) {
        return KV_ECORRUPT;
    }
    if (expect != NULL && !kv_hash_eq(r.hash, *expect)) {
        return KV_ECORRUPT;
    }
    if (rec_sum(d, buf, &r) != psum) {
        return KV_ECORRUPT;
    }
    *rec = r;
    return KV_OK;
}

kv_err kvd_disk_clear(kvd_disk *d, uint64_t slot, uint8_t *buf) {
    if (buf == NULL) {
        return KV_EINVAL;
    }
    uint64_t off = disk_slot_off(d, slot);
    struct stat st;
    if (fstat(atomic_load(&d->fd), &st) != 0) {
        return KV_ESYS;
    }
    /* A slot the file does not reach is empty already; writing would only grow the file. */
    if (off == 0 || off >= (uint64_t)st.st_size) {
        return KV_OK;
    }
    memset(buf, 0, KVD_DISK_ALIGN);
    size_t done = 0;
    if (disk_io(d, 1, buf, KVD_DISK_ALIGN, off, &done) != 0) {
        KV_LOG(ERROR, "KVD-TIER2-FILE", "%s: clearing slot %llu failed: %s", d->path,
               (unsigned long long)slot, strerror(errno));
        return KV_ESYS;
    }
    return KV_OK;
}

/* ---- streamed write and read (io_uring) ------------------------------------------------------ */

#define RING_DEPTH 128u /* submission entries; at most STREAM_MAX + 2 are in flight */
/* Chunks of one streamed transfer at most (16 MiB slots); larger slots go the plain way. */
#define STREAM_MAX 64u

static __thread struct io_uring tls_ring;
static __thread XXH3_state_t *tls_sum; /* the ring's transfers' payload checksum */
static __thread int tls_ring_state;    /* 0: not tried on this thread, 1: ready, -1: unavailable */
static __thread struct iovec *tls_iov; /* the vectored transfers' iovecs (thread_iov) */
static __thread uint32_t tls_iov_cap;
static pthread_key_t ring_key;
static pthread_once_t ring_once = PTHREAD_ONCE_INIT;

static void ring_exit(void *unused) {
    (void)unused;
    if (tls_ring_state == 1) {
        io_uring_queue_exit(&tls_ring);
        XXH3_freeState(tls_sum);
        tls_sum = NULL;
    }
    free(tls_iov);
    tls_iov = NULL;
    tls_iov_cap = 0;
    tls_ring_state = 0;
}

static void ring_key_make(void) {
    (void)pthread_key_create(&ring_key, ring_exit);
}

/* This thread's ring and checksum state (made at its first use; freed when the thread exits),
 * or NULL. */
static struct io_uring *thread_ring(void) {
    if (tls_ring_state == 0) {
        const char *env = getenv("KVD_TIER2_URING");
        tls_ring_state = -1;
        if ((env == NULL || strcmp(env, "off") != 0) && (tls_sum = XXH3_createState()) != NULL) {
            if (io_uring_queue_init(RING_DEPTH, &tls_ring, 0) == 0) {
                tls_ring_state = 1;
                (void)pthread_once(&ring_once, ring_key_make);
                (void)pthread_setspecific(ring_key, &ring_key);
            } else {
                XXH3_freeState(tls_sum);
                tls_sum = NULL;
            }
        }
    }
    return tls_ring_state == 1 ? &tls_ring : NULL;
}

int kvd_disk_thread_uring(void) {
    return thread_ring() != NULL;
}

/* Transfers of one streamed I/O on the ring: chunk k's result lands in res[k]. */
#define KEY_HDR STREAM_MAX         /* the slot's first 4096 bytes (record header) */
#define KEY_REST (STREAM_MAX + 1u) /* a zero-copy transfer's last partial page and padding */
typedef struct stream_io {
    struct io_uring *ring;
    uint32_t inflight;
    int32_t res[KEY_REST + 1]; /* the transfer's result; INT32_MIN while in flight */
    uint32_t want[KEY_REST + 1];
} stream_io;

/* Streamed transfers that went the plain way (the ring refused, or none): tests and stats. */
static atomic_ullong stream_fallbacks;

uint64_t kvd_disk_stream_fallbacks(void) {
    return atomic_load(&stream_fallbacks);
}

/* A ring that lost track of a transfer: the kernel may still read or write a buffer the caller
 * is about to reuse, and nothing can tell when it stops. Not seen; never survived quietly. */
static void ring_lost(int err) {
    KV_LOG(ERROR, "KVD-TIER2-FILE", "io_uring failed with transfers in flight (%s): stopping",
           strerror(err));
    abort();
}

/* Waits for one completion (sending entries still unsent first), or the thread stops
 * (ring_lost). */
static void sio_reap(stream_io *io) {
    struct io_uring_cqe *cqe = NULL;
    for (;;) {
        int r = io_uring_submit_and_wait(io->ring, 1);
        if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY) {
            ring_lost(-r);
        }
        if (io_uring_peek_cqe(io->ring, &cqe) == 0 && cqe != NULL) {
            break;
        }
        if (r == -EAGAIN || r == -EBUSY) {
            sched_yield(); /* the kernel is short of something for a moment */
        }
    }
    uint64_t k = io_uring_cqe_get_data64(cqe);
    if (k <= KEY_REST) {
        io->res[k] = cqe->res;
    }
    io_uring_cqe_seen(io->ring, cqe);
    io->inflight--;
}

/* Queues a transfer of chunk k (n bytes at buf, file offset off) and submits it; it counts as
 * in flight from here (a submit the kernel put off goes with the next reap's). A full ring first
 * waits for a completion (every entry in it is in flight). */
static void sio_queue(stream_io *io, int wr, int fd, uint32_t k, uint8_t *buf, uint32_t n,
                      uint64_t off) {
    struct io_uring_sqe *sqe;
    while ((sqe = io_uring_get_sqe(io->ring)) == NULL) {
        sio_reap(io);
    }
    if (wr) {
        io_uring_prep_write(sqe, fd, buf, n, off);
    } else {
        io_uring_prep_read(sqe, fd, buf, n, off);
    }
    io_uring_sqe_set_data64(sqe, k);
    io->res[k] = INT32_MIN;
    io->want[k] = n;
    io->inflight++;
    int r = io_uring_submit(io->ring);
    if (r < 0 && r != -EAGAIN && r != -EBUSY && r != -EINTR) {
        ring_lost(-r); /* the entry is in the ring, neither sent nor taken back */
    }
}

/* Waits for every transfer still in flight (their buffers are the caller's again). */
static void sio_drain(stream_io *io) {
    while (io->inflight > 0) {
        sio_reap(io);
    }
}

/* Chunk k's result, waited for: 0 done in full; 1 short (a read past the end of the file, a
 * write that could not complete); -1 failed. */
static int sio_wait(stream_io *io, uint32_t k) {
    while (io->res[k] == INT32_MIN) {
        sio_reap(io);
    }
    if (io->res[k] < 0) {
        return -1;
    }
    return (uint32_t)io->res[k] == io->want[k] ? 0 : 1;
}

/* Chunks of a streamed transfer past the header block, or 0 when the slot is too small or
 * large for one (the callers go the plain way). */
static uint32_t stream_chunks(const kvd_disk *d) {
    uint64_t n = (d->slot_bytes - KVD_DISK_ALIGN + KVD_DISK_CHUNK - 1) / KVD_DISK_CHUNK;
    return d->slot_bytes > KVD_DISK_ALIGN && n <= STREAM_MAX ? (uint32_t)n : 0;
}

/* Slot bytes [*s0, *s1) of chunk k. */
static void chunk_range(const kvd_disk *d, uint32_t k, uint64_t *s0, uint64_t *s1) {
    *s0 = KVD_DISK_ALIGN + (uint64_t)k * KVD_DISK_CHUNK;
    *s1 = *s0 + KVD_DISK_CHUNK < d->slot_bytes ? *s0 + KVD_DISK_CHUNK : d->slot_bytes;
}

kv_err kvd_disk_write_stream(kvd_disk *d, uint64_t slot, const kvd_disk_rec *rec,
                             kvd_disk_fill_fn fill, void *arg, uint8_t *buf, int *sys_errno,
                             int *fill_failed) {
    *fill_failed = 0;
    if (rec == NULL || buf == NULL || fill == NULL || !rec_fits(d, rec)) {
        return KV_EINVAL;
    }
    uint64_t off = disk_slot_off(d, slot);
    uint32_t nch = stream_chunks(d);
    struct io_uring *ring = off != 0 && nch > 0 ? thread_ring() : NULL;
    uint64_t poff = kvd_disk_payload_off(d, rec);
    if (off != 0) {
        disk_grow(d, off + d->slot_bytes);
    }
    if (ring == NULL) {
        atomic_fetch_add(&stream_fallbacks, 1);
        kv_err rc = fill(arg, buf + poff, 0, rec->len);
        if (rc != KV_OK) {
            *fill_failed = 1;
            return rc;
        }
        return kvd_disk_write(d, slot, rec, buf + poff, buf, sys_errno);
    }
    XXH3_state_t *st = tls_sum;
    XXH3_64bits_reset(st);
    uint64_t tail = rec->has_tail ? KVD_DISK_TAIL : 0;
    if (tail > 0) {
        memcpy(buf + KVD_DISK_REC_HDR, rec->tail, KVD_DISK_TAIL);
        XXH3_64bits_update(st, buf + KVD_DISK_REC_HDR, KVD_DISK_TAIL);
    }
    uint64_t pend = poff + rec->len; /* where the payload ends in the slot */
    /* The header block's share of the payload first (the checksum runs in payload order);
     * format 2 has none (zeros after the tail). */
    kv_err rc = KV_OK;
    if (poff < KVD_DISK_ALIGN) {
        uint64_t first = pend < KVD_DISK_ALIGN ? rec->len : KVD_DISK_ALIGN - poff;
        if ((rc = fill(arg, buf + poff, 0, first)) != KV_OK) {
            *fill_failed = 1;
            return rc;
        }
        XXH3_64bits_update(st, buf + poff, first);
        if (pend < KVD_DISK_ALIGN) {
            memset(buf + pend, 0, KVD_DISK_ALIGN - pend);
        }
    } else {
        memset(buf + KVD_DISK_REC_HDR + tail, 0, KVD_DISK_ALIGN - KVD_DISK_REC_HDR - tail);
    }
    stream_io io = {.ring = ring};
    int fd = atomic_load(&d->fd);
    for (uint32_t k = 0; k < nch; k++) {
        uint64_t s0, s1;
        chunk_range(d, k, &s0, &s1);
        if (s0 < pend) {
            uint64_t e = s1 < pend ? s1 : pend;
            if ((rc = fill(arg, buf + s0, s0 - poff, e - s0)) != KV_OK) {
                *fill_failed = 1;
                break;
            }
            XXH3_64bits_update(st, buf + s0, e - s0);
        }
        uint64_t z = s0 > pend ? s0 : pend;
        if (z < s1) {
            memset(buf + z, 0, s1 - z);
        }
        sio_queue(&io, 1, fd, k, buf + s0, (uint32_t)(s1 - s0), off + s0);
    }
    if (*fill_failed) {
        sio_drain(&io);
        return rc;
    }
    /* The header block goes with the last chunks: what vouches for the record is the payload
     * checksum in it, so a slot cut off midway (here, or in one plain pwrite alike) never reads
     * back as good. */
    rec_header(buf, rec, XXH3_64bits_digest(st));
    sio_queue(&io, 1, fd, KEY_HDR, buf, KVD_DISK_ALIGN, off);
    sio_drain(&io);
    int plain = sio_wait(&io, KEY_HDR) != 0;
    for (uint32_t k = 0; k < nch && !plain; k++) {
        plain = sio_wait(&io, k) != 0;
    }
    if (!plain) {
        return KV_OK;
    }
    atomic_fetch_add(&stream_fallbacks, 1);
    /* A transfer the ring refused or cut short (O_DIRECT's alignment where the file system
     * wants more, a full disk): the whole slot again through pwrite, which knows those cases
     * and reports the error that stays. */
    size_t done = 0;
    if (disk_io(d, 1, buf, d->slot_bytes, off, &done) != 0) {
        if (sys_errno != NULL) {
            *sys_errno = errno;
        }
        return KV_ESYS;
    }
    return KV_OK;
}

kv_err kvd_disk_read_stream(kvd_disk *d, uint64_t slot, const kv_hash128 *expect, kvd_disk_rec *rec,
                            uint8_t *buf, kvd_disk_sink_fn sink, void *arg) {
    if (rec == NULL || buf == NULL || sink == NULL) {
        return KV_EINVAL;
    }
    uint64_t off = disk_slot_off(d, slot);
    if (off == 0) {
        return KV_ECORRUPT; /* past any possible end of file */
    }
    uint32_t nch = stream_chunks(d);
    struct io_uring *ring = nch > 0 ? thread_ring() : NULL;
    if (ring == NULL) {
        atomic_fetch_add(&stream_fallbacks, 1);
        kv_err rc = kvd_disk_read(d, slot, expect, rec, buf);
        return rc != KV_OK ? rc : sink(arg, buf + kvd_disk_payload_off(d, rec), 0, rec->len);
    }
    XXH3_state_t *st = tls_sum;
    XXH3_64bits_reset(st);
    /* Every transfer at once: the header block, then the chunks in order. */
    stream_io io = {.ring = ring};
    int fd = atomic_load(&d->fd);
    sio_queue(&io, 0, fd, KEY_HDR, buf, KVD_DISK_ALIGN, off);
    for (uint32_t k = 0; k < nch; k++) {
        uint64_t s0, s1;
        chunk_range(d, k, &s0, &s1);
        sio_queue(&io, 0, fd, k, buf + s0, (uint32_t)(s1 - s0), off + s0);
    }
    kv_err rc = KV_OK;
    kvd_disk_rec r;
    uint64_t psum = 0, pend = 0, poff = 0;
    int plain = sio_wait(&io, KEY_HDR) != 0; /* short or refused: the plain read tells which */
    if (!plain) {
        if (rec_parse(d, buf, &r, &psum) != 0 || (expect != NULL && !kv_hash_eq(r.hash, *expect))) {
            rc = KV_ECORRUPT;
        } else {
            poff = kvd_disk_payload_off(d, &r);
            pend = poff + r.len;
            if (poff < KVD_DISK_ALIGN) { /* format 1: tail and payload side by side */
                uint64_t e = pend < KVD_DISK_ALIGN ? pend : KVD_DISK_ALIGN;
                XXH3_64bits_update(st, buf + KVD_DISK_REC_HDR, e - KVD_DISK_REC_HDR);
                rc = sink(arg, buf + poff, 0, e - poff);
            } else if (r.has_tail) {
                XXH3_64bits_update(st, buf + KVD_DISK_REC_HDR, KVD_DISK_TAIL);
            }
        }
    }
    for (uint32_t k = 0; k < nch && !plain && rc == KV_OK; k++) {
        uint64_t s0, s1;
        chunk_range(d, k, &s0, &s1);
        if (s0 >= pend) {
            break; /* padding: not looked at */
        }
        if (sio_wait(&io, k) != 0) {
            plain = 1;
            break;
        }
        uint64_t e = s1 < pend ? s1 : pend;
        XXH3_64bits_update(st, buf + s0, e - s0);
        rc = sink(arg, buf + s0, s0 - poff, e - s0);
    }
    sio_drain(&io);
    uint64_t got = !plain && rc == KV_OK ? XXH3_64bits_digest(st) : 0;
    if (plain) {
        atomic_fetch_add(&stream_fallbacks, 1);
        /* The ring refused or cut short a transfer: the whole slot the plain way (it knows
         * O_DIRECT's refusals, says corrupt for a slot past the end, and reports what stays an
         * error). */
        rc = kvd_disk_read(d, slot, expect, rec, buf);
        return rc != KV_OK ? rc : sink(arg, buf + kvd_disk_payload_off(d, rec), 0, rec->len);
    }
    if (rc != KV_OK) {
        return rc;
    }
    if (got != psum) {
        return KV_ECORRUPT;
    }
    *rec = r;
    return KV_OK;
}

/* ---- zero-copy write and read (format 2) ------------------------------------------------------
 */

static atomic_ullong direct_transfers;

uint64_t kvd_disk_direct_transfers(void) {
    return atomic_load(&direct_transfers);
}

/* Pieces as the copying ways see them: one flat payload. */
typedef struct pieces {
    const kvd_disk_piece *v;
    uint32_t n;
    uint64_t len;
} pieces;

/* Moves [off, off + n) of the pieces' concatenation to (out) or from h. 0, or -1 past the end. */
static int pieces_move(const pieces *ps, uint8_t *h, uint64_t off, uint64_t n, int out) {
    uint64_t base = 0;
    for (uint32_t i = 0; i < ps->n && n > 0; i++) {
        const kvd_disk_piece *pc = &ps->v[i];
        if (off < base + pc->n) {
            uint64_t at = off - base, k = pc->n - at < n ? pc->n - at : n;
            memcpy(out ? h : pc->p + at, out ? pc->p + at : h, k);
            h += k;
            off += k;
            n -= k;
        }
        base += pc->n;
    }
    return n > 0 ? -1 : 0;
}

static kv_err pieces_fill(void *arg, uint8_t *dst, uint64_t off, uint64_t n) {
    return pieces_move(arg, dst, off, n, 1) == 0 ? KV_OK : KV_EINVAL;
}

/* A record longer than the pieces is not the one asked for. */
static kv_err pieces_sink(void *arg, const uint8_t *src, uint64_t off, uint64_t n) {
    return pieces_move(arg, (uint8_t *)(uintptr_t)src, off, n, 0) == 0 ? KV_OK : KV_ECORRUPT;
}

/* The zero-copy reads' header: checks the record header in buf (its hash against *expect, its
 * length against len) and starts the payload checksum in this thread's state with the tail.
 * KV_OK with *r and *psum, or KV_ECORRUPT. */
static kv_err direct_read_head(const kvd_disk *d, const uint8_t *buf, const kv_hash128 *expect,
                               uint64_t len, kvd_disk_rec *r, uint64_t *psum) {
    XXH3_64bits_reset(tls_sum);
    if (rec_parse(d, buf, r, psum) != 0 || (expect != NULL && !kv_hash_eq(r->hash, *expect)) ||
        r->len != len) {
        return KV_ECORRUPT;
    }
    if (r->has_tail) {
        XXH3_64bits_update(tls_sum, buf + KVD_DISK_REC_HDR, KVD_DISK_TAIL);
    }
    return KV_OK;
}

/* The zero-copy reads' way back when the ring refused or cut short a transfer: the whole slot
 * the plain way (it knows O_DIRECT's refusals and says corrupt for a slot past the end), a
 * record of another length corrupt, the payload copied into the pieces. */
static kv_err read_plain_into(kvd_disk *d, uint64_t slot, const kv_hash128 *expect,
                              kvd_disk_rec *rec, uint8_t *buf, const pieces *ps) {
    atomic_fetch_add(&stream_fallbacks, 1);
    kv_err rc = kvd_disk_read(d, slot, expect, rec, buf);
    if (rc == KV_OK && rec->len != ps->len) {
        rc = KV_ECORRUPT;
    }
    if (rc == KV_OK) {
        (void)pieces_move(ps, buf + kvd_disk_payload_off(d, rec), 0, ps->len, 0);
    }
    return rc;
}

/* The ring for a zero-copy transfer of len payload bytes at mem into or out of slot, or NULL
 * when it goes the copying way: format 1, a slot the stream cannot take, memory O_DIRECT
 * cannot use, no io_uring on this thread. */
static struct io_uring *direct_ring(kvd_disk *d, uint64_t slot, const void *mem, uint64_t len) {
    if (d->version == 1 || stream_chunks(d) == 0 || disk_slot_off(d, slot) == 0 ||
        len > kvd_disk_payload_max(d)) {
        return NULL;
    }
    if (atomic_load(&d->direct) && (uintptr_t)mem % KVD_DISK_ALIGN != 0) {
        return NULL;
    }
    return thread_ring();
}

/* Starts a record's payload checksum in st with its tail (copied into buf's header block) and
 * returns the tail's bytes (0 without one). */
static uint64_t sum_begin(XXH3_state_t *st, uint8_t *buf, const kvd_disk_rec *rec) {
    XXH3_64bits_reset(st);
    uint64_t tail = rec->has_tail ? KVD_DISK_TAIL : 0;
    if (tail > 0) {
        memcpy(buf + KVD_DISK_REC_HDR, rec->tail, KVD_DISK_TAIL);
        XXH3_64bits_update(st, buf + KVD_DISK_REC_HDR, KVD_DISK_TAIL);
    }
    return tail;
}

/* A zero-copy write's end, its payload's transfers queued (keys 0..n-1, and KEY_REST when rest)
 * and this thread's checksum state holding tail and payload: the header block (the header, the
 * tail, zeros) goes last (as in write_stream, a slot cut off midway fails its payload checksum),
 * and every transfer is waited for. 0 when all went through (counted, *zero_copy set), else 1
 * (counted as a fallback): the caller writes the slot the plain way. */
static int direct_write_end(stream_io *io, int fd, uint64_t off, const kvd_disk_rec *rec,
                            uint8_t *buf, uint64_t tail, uint32_t n, uint64_t rest,
                            int *zero_copy) {
    memset(buf + KVD_DISK_REC_HDR + tail, 0, KVD_DISK_ALIGN - KVD_DISK_REC_HDR - tail);
    rec_header(buf, rec, XXH3_64bits_digest(tls_sum));
    sio_queue(io, 1, fd, KEY_HDR, buf, KVD_DISK_ALIGN, off);
    sio_drain(io);
    int plain = sio_wait(io, KEY_HDR) != 0;
    for (uint32_t k = 0; k < n && !plain; k++) {
        plain = sio_wait(io, k) != 0;
    }
    if (!plain && rest > 0) {
        plain = sio_wait(io, KEY_REST) != 0;
    }
    if (plain) {
        atomic_fetch_add(&stream_fallbacks, 1);
        return 1;
    }
    atomic_fetch_add(&direct_transfers, 1);
    if (zero_copy != NULL) {
        *zero_copy = 1;
    }
    return 0;
}

kv_err kvd_disk_write_from(kvd_disk *d, uint64_t slot, const kvd_disk_rec *rec, const uint8_t *src,
                           uint8_t *buf, int *sys_errno, int *zero_copy) {
    if (zero_copy != NULL) {
        *zero_copy = 0;
    }
    if (rec == NULL || buf == NULL || (src == NULL && rec->len > 0) || !rec_fits(d, rec)) {
        return KV_EINVAL;
    }
    struct io_uring *ring = direct_ring(d, slot, src, rec->len);
    if (ring == NULL) {
        int fill_failed = 0;
        kvd_disk_piece one = {(uint8_t *)(uintptr_t)src, rec->len};
        pieces ps = {&one, 1, rec->len};
        return kvd_disk_write_stream(d, slot, rec, pieces_fill, &ps, buf, sys_errno, &fill_failed);
    }
    uint64_t off = disk_slot_off(d, slot);
    disk_grow(d, off + d->slot_bytes);
    uint64_t len = rec->len, full = len / KVD_DISK_ALIGN * KVD_DISK_ALIGN;
    stream_io io = {.ring = ring};
    int fd = atomic_load(&d->fd);
    /* The payload's whole pages straight from src, a chunk at a time: the disk starts on them
     * at once. */
    uint32_t nk = 0;
    for (uint64_t p = 0; p < full; p += KVD_DISK_CHUNK, nk++) {
        uint64_t n = full - p < KVD_DISK_CHUNK ? full - p : KVD_DISK_CHUNK;
        sio_queue(&io, 1, fd, nk, (uint8_t *)(uintptr_t)src + p, (uint32_t)n,
                  off + KVD_DISK_ALIGN + p);
    }
    /* The rest (the last partial page and the padding) through buf, where it sits in a slot
     * image. */
    uint64_t rest = d->slot_bytes - KVD_DISK_ALIGN - full;
    if (rest > 0) {
        uint8_t *r = buf + KVD_DISK_ALIGN + full;
        if (len > full) {
            memcpy(r, src + full, len - full);
        }
        memset(r + (len - full), 0, rest - (len - full));
        sio_queue(&io, 1, fd, KEY_REST, r, (uint32_t)rest, off + KVD_DISK_ALIGN + full);
    }
    /* The checksum while the disk reads the same bytes. */
    uint64_t tail = sum_begin(tls_sum, buf, rec);
    XXH3_64bits_update(tls_sum, src, len);
    if (direct_write_end(&io, fd, off, rec, buf, tail, nk, rest, zero_copy) == 0) {
        return KV_OK;
    }
    /* Refused or cut short: the whole slot through pwrite (see write_stream). */
    return kvd_disk_write(d, slot, rec, src, buf, sys_errno);
}

/* A zero-copy read's end once every transfer went through: the header's verdict rc, then the
 * payload checksum (this thread's state) against psum; on success *rec = *r, counted, and
 * *zero_copy set. */
static kv_err direct_read_end(kv_err rc, uint64_t psum, kvd_disk_rec *rec, const kvd_disk_rec *r,
                              int *zero_copy) {
    if (rc != KV_OK) {
        return rc;
    }
    if (XXH3_64bits_digest(tls_sum) != psum) {
        return KV_ECORRUPT;
    }
    *rec = *r;
    atomic_fetch_add(&direct_transfers, 1);
    if (zero_copy != NULL) {
        *zero_copy = 1;
    }
    return KV_OK;
}

kv_err kvd_disk_read_into(kvd_disk *d, uint64_t slot, const kv_hash128 *expect, kvd_disk_rec *rec,
                          uint8_t *dst, uint64_t len, uint8_t *buf, int *zero_copy) {
    if (zero_copy != NULL) {
        *zero_copy = 0;
    }
    if (rec == NULL || buf == NULL || (dst == NULL && len > 0)) {
        return KV_EINVAL;
    }
    kvd_disk_piece one = {dst, len};
    pieces ps = {&one, 1, len};
    struct io_uring *ring = direct_ring(d, slot, dst, len);
    kv_err rc;
    if (ring == NULL) {
        rc = kvd_disk_read_stream(d, slot, expect, rec, buf, pieces_sink, &ps);
        return rc == KV_OK && rec->len != len ? KV_ECORRUPT : rc;
    }
    uint64_t off = disk_slot_off(d, slot);
    uint64_t full = len / KVD_DISK_ALIGN * KVD_DISK_ALIGN;
    uint64_t rest = (len + KVD_DISK_ALIGN - 1) / KVD_DISK_ALIGN * KVD_DISK_ALIGN - full;
    stream_io io = {.ring = ring};
    int fd = atomic_load(&d->fd);
    /* Every transfer at once: the header block, the whole pages straight into dst, the last
     * partial page into buf. */
    sio_queue(&io, 0, fd, KEY_HDR, buf, KVD_DISK_ALIGN, off);
    uint32_t nk = 0;
    for (uint64_t p = 0; p < full; p += KVD_DISK_CHUNK, nk++) {
        uint64_t n = full - p < KVD_DISK_CHUNK ? full - p : KVD_DISK_CHUNK;
        sio_queue(&io, 0, fd, nk, dst + p, (uint32_t)n, off + KVD_DISK_ALIGN + p);
    }
    if (rest > 0) {
        sio_queue(&io, 0, fd, KEY_REST, buf + KVD_DISK_ALIGN + full, (uint32_t)rest,
                  off + KVD_DISK_ALIGN + full);
    }
    XXH3_state_t *st = tls_sum;
    kvd_disk_rec r;
    uint64_t psum = 0;
    rc = KV_OK;
    int plain = sio_wait(&io, KEY_HDR) != 0; /* short or refused: the plain read tells which */
    if (!plain) {
        rc = direct_read_head(d, buf, expect, len, &r, &psum);
    }
    /* Each piece checksummed as it lands, while the later ones are still on their way. */
    for (uint32_t k = 0; k < nk && !plain && rc == KV_OK; k++) {
        if (sio_wait(&io, k) != 0) {
            plain = 1;
            break;
        }
        uint64_t p = (uint64_t)k * KVD_DISK_CHUNK;
        XXH3_64bits_update(st, dst + p, full - p < KVD_DISK_CHUNK ? full - p : KVD_DISK_CHUNK);
    }
    if (!plain && rc == KV_OK && rest > 0) {
        if (sio_wait(&io, KEY_REST) != 0) {
            plain = 1;
        } else {
            XXH3_64bits_update(st, buf + KVD_DISK_ALIGN + full, len - full);
            memcpy(dst + full, buf + KVD_DISK_ALIGN + full, len - full);
        }
    }
    sio_drain(&io);
    if (plain) {
        return read_plain_into(d, slot, expect, rec, buf, &ps);
    }
    return direct_read_end(rc, psum, rec, &r, zero_copy);
}

/* ---- zero-copy write and read of a block in pieces (format 2) -------------------------------- */

/* The pieces' total, or UINT64_MAX for a bad array. *aligned: every piece whole pages at an
 * aligned address. */
static uint64_t pieces_len(const kvd_disk_piece *v, uint32_t n, int *aligned) {
    uint64_t t = 0;
    *aligned = n > 0 && n <= KVD_DISK_PIECES_MAX;
    for (uint32_t i = 0; i < n; i++) {
        if (v[i].p == NULL && v[i].n > 0) {
            return UINT64_MAX;
        }
        *aligned =
            *aligned && v[i].n % KVD_DISK_ALIGN == 0 && (uintptr_t)v[i].p % KVD_DISK_ALIGN == 0;
        if (v[i].n > UINT64_MAX - t) {
            return UINT64_MAX;
        }
        t += v[i].n;
    }
    return t;
}

/* Groups of consecutive whole pieces of at least KVD_DISK_CHUNK bytes (the last may be less),
 * one vectored transfer each: group g is pieces [first[g], first[g + 1]). The number of groups,
 * or 0 when there would be more than STREAM_MAX. */
static uint32_t pieces_group(const kvd_disk_piece *v, uint32_t n, uint32_t *first) {
    uint32_t g = 0;
    uint64_t acc = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (acc == 0) {
            if (g == STREAM_MAX) {
                return 0;
            }
            first[g++] = i;
        }
        acc += v[i].n;
        if (acc >= KVD_DISK_CHUNK) {
            acc = 0;
        }
    }
    first[g] = n;
    return g;
}

/* This thread's iovec array for the vectored transfers (grown as needed; freed with the ring),
 * or NULL. Only on a thread with a ring. */
static struct iovec *thread_iov(uint32_t n) {
    if (tls_iov_cap < n) {
        struct iovec *v = realloc(tls_iov, n * sizeof(*v));
        if (v == NULL) {
            return NULL;
        }
        tls_iov = v;
        tls_iov_cap = n;
    }
    return tls_iov;
}

/* Queues a vectored transfer of group k (iov[0, cnt), bytes at file offset off). */
static void sio_queue_v(stream_io *io, int wr, int fd, uint32_t k, const struct iovec *iov,
                        uint32_t cnt, uint64_t bytes, uint64_t off) {
    struct io_uring_sqe *sqe;
    while ((sqe = io_uring_get_sqe(io->ring)) == NULL) {
        sio_reap(io);
    }
    if (wr) {
        io_uring_prep_writev(sqe, fd, iov, cnt, off);
    } else {
        io_uring_prep_readv(sqe, fd, iov, cnt, off);
    }
    io_uring_sqe_set_data64(sqe, k);
    io->res[k] = INT32_MIN;
    io->want[k] = (uint32_t)bytes;
    io->inflight++;
    int r = io_uring_submit(io->ring);
    if (r < 0 && r != -EAGAIN && r != -EBUSY && r != -EINTR) {
        ring_lost(-r);
    }
}

kv_err kvd_disk_write_fromv(kvd_disk *d, uint64_t slot, const kvd_disk_rec *rec,
                            const kvd_disk_piece *src, uint32_t npieces, uint8_t *buf,
                            int *sys_errno, int *zero_copy) {
    if (zero_copy != NULL) {
        *zero_copy = 0;
    }
    int aligned = 0;
    uint64_t len = src != NULL ? pieces_len(src, npieces, &aligned) : UINT64_MAX;
    if (rec == NULL || buf == NULL || len != rec->len || !rec_fits(d, rec)) {
        return KV_EINVAL;
    }
    if (npieces == 1) {
        return kvd_disk_write_from(d, slot, rec, src[0].p, buf, sys_errno, zero_copy);
    }
    uint32_t first[STREAM_MAX + 1];
    uint32_t ng = aligned ? pieces_group(src, npieces, first) : 0;
    struct io_uring *ring = ng > 0 ? direct_ring(d, slot, NULL, len) : NULL;
    struct iovec *iov = ring != NULL ? thread_iov(npieces) : NULL;
    if (iov == NULL) {
        pieces ps = {src, npieces, len};
        int fill_failed = 0;
        return kvd_disk_write_stream(d, slot, rec, pieces_fill, &ps, buf, sys_errno, &fill_failed);
    }
    uint64_t off = disk_slot_off(d, slot);
    disk_grow(d, off + d->slot_bytes);
    for (uint32_t i = 0; i < npieces; i++) {
        iov[i].iov_base = src[i].p;
        iov[i].iov_len = src[i].n;
    }
    stream_io io = {.ring = ring};
    int fd = atomic_load(&d->fd);
    uint64_t at = 0;
    for (uint32_t g = 0; g < ng; g++) {
        uint64_t bytes = 0;
        for (uint32_t i = first[g]; i < first[g + 1]; i++) {
            bytes += src[i].n;
        }
        sio_queue_v(&io, 1, fd, g, iov + first[g], first[g + 1] - first[g], bytes,
                    off + KVD_DISK_ALIGN + at);
        at += bytes;
    }
    /* Padding past the payload (a record shorter than the slot's room): zeros, through buf. */
    uint64_t rest = d->slot_bytes - KVD_DISK_ALIGN - len;
    if (rest > 0) {
        memset(buf + KVD_DISK_ALIGN + len, 0, rest);
        sio_queue(&io, 1, fd, KEY_REST, buf + KVD_DISK_ALIGN + len, (uint32_t)rest,
                  off + KVD_DISK_ALIGN + len);
    }
    uint64_t tail = sum_begin(tls_sum, buf, rec);
    for (uint32_t i = 0; i < npieces; i++) {
        XXH3_64bits_update(tls_sum, src[i].p, src[i].n);
    }
    if (direct_write_end(&io, fd, off, rec, buf, tail, ng, rest, zero_copy) == 0) {
        return KV_OK;
    }
    /* Refused or cut short: the whole slot through pwrite (see write_stream). */
    pieces ps = {src, npieces, len};
    (void)pieces_move(&ps, buf + KVD_DISK_ALIGN, 0, len, 1);
    return kvd_disk_write(d, slot, rec, buf + KVD_DISK_ALIGN, buf, sys_errno);
}

kv_err kvd_disk_read_intov(kvd_disk *d, uint64_t slot, const kv_hash128 *expect, kvd_disk_rec *rec,
                           const kvd_disk_piece *dst, uint32_t npieces, uint64_t len, uint8_t *buf,
                           int *zero_copy) {
    if (zero_copy != NULL) {
        *zero_copy = 0;
    }
    int aligned = 0;
    if (rec == NULL || buf == NULL || dst == NULL || pieces_len(dst, npieces, &aligned) != len) {
        return KV_EINVAL;
    }
    if (npieces == 1) {
        return kvd_disk_read_into(d, slot, expect, rec, dst[0].p, len, buf, zero_copy);
    }
    uint32_t first[STREAM_MAX + 1];
    uint32_t ng = aligned ? pieces_group(dst, npieces, first) : 0;
    struct io_uring *ring = ng > 0 ? direct_ring(d, slot, NULL, len) : NULL;
    struct iovec *iov = ring != NULL ? thread_iov(npieces) : NULL;
    kv_err rc;
    if (iov == NULL) {
        pieces ps = {dst, npieces, len};
        rc = kvd_disk_read_stream(d, slot, expect, rec, buf, pieces_sink, &ps);
        return rc == KV_OK && rec->len != len ? KV_ECORRUPT : rc;
    }
    uint64_t off = disk_slot_off(d, slot);
    for (uint32_t i = 0; i < npieces; i++) {
        iov[i].iov_base = dst[i].p;
        iov[i].iov_len = dst[i].n;
    }
    stream_io io = {.ring = ring};
    int fd = atomic_load(&d->fd);
    sio_queue(&io, 0, fd, KEY_HDR, buf, KVD_DISK_ALIGN, off);
    uint64_t at = 0;
    for (uint32_t g = 0; g < ng; g++) {
        uint64_t bytes = 0;
        for (uint32_t i = first[g]; i < first[g + 1]; i++) {
            bytes += dst[i].n;
        }
        sio_queue_v(&io, 0, fd, g, iov + first[g], first[g + 1] - first[g], bytes,
                    off + KVD_DISK_ALIGN + at);
        at += bytes;
    }
    XXH3_state_t *st = tls_sum;
    kvd_disk_rec r;
    uint64_t psum = 0;
    rc = KV_OK;
    int plain = sio_wait(&io, KEY_HDR) != 0; /* short or refused: the plain read tells which */
    if (!plain) {
        rc = direct_read_head(d, buf, expect, len, &r, &psum);
    }
    /* Each group checksummed as it lands, while the later ones are still on their way. */
    for (uint32_t g = 0; g < ng && !plain && rc == KV_OK; g++) {
        if (sio_wait(&io, g) != 0) {
            plain = 1;
            break;
        }
        for (uint32_t i = first[g]; i < first[g + 1]; i++) {
            XXH3_64bits_update(st, dst[i].p, dst[i].n);
        }
    }
    sio_drain(&io);
    if (plain) {
        pieces ps = {dst, npieces, len};
        return read_plain_into(d, slot, expect, rec, buf, &ps);
    }
    return direct_read_end(rc, psum, rec, &r, zero_copy);
}
