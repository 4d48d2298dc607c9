/* disk_bench: a T2 record's write and read (daemon/tiers/disk.h), plain against streamed, and a
 * raw O_DIRECT pwrite / pread of the same slot-sized buffers to a file in the same directory, in
 * one process, interleaved: the disk module's own cost, without a daemon, a client or the copy
 * threads' scheduling around it.
 *
 * 48 raw blocks of 2 MiB (Llama-3-8B-sized: 32 layers x 8 KV heads x 128 dims x 16 tokens, fp16)
 * go from a "T0" image in memory to 48 slots and back. Per round, each way in turn (the order
 * rotates): raw (the baseline: pwrite/pread of a prepared slot image, no copy, no checksum);
 * plain (kvd_disk_write / kvd_disk_read: copy the block into the slot image, checksum, one
 * pwrite; one pread, checksum, copy out); streamed (kvd_disk_write_stream / read_stream: the same
 * work in 256 KiB chunks through io_uring, the copy and checksum of a chunk overlapping the disk's
 * work on the ones before); zero-copy (kvd_disk_write_from / read_into, a format 2 file: the
 * block's pages go between the disk and the "T0" image with no copy, the checksum runs while the
 * disk works; a host pool's raw block-major blocks go this way); zero-copy in 64 pieces
 * (kvd_disk_write_fromv / read_intov, one vectored transfer per 256 KiB of pieces: a layer-major
 * block whose pieces are whole pages). GB/s of each, and each way's ratio to raw taken per
 * round; median [min-max] over the rounds. Reads land in a block-sized place of their own per
 * block, as a Fetch's do, and are checked against "T0" after the clock stops. Every buffer of
 * every way asks for huge pages (kv_alloc_huge, as kvd's copy threads' do), so the ways meet at
 * one page size. Usage: disk_bench
 * [--dir DIR] [--rounds N] [--fresh: the CPU stores every source byte again just before each
 * write round] [--memfd: "T0", the raw way's images and the reads' places are memfds mapped
 * shared and advised for huge pages as kvd's mappings are, T0's stores made by a child process].
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench/benchutil.h"
#include "common/kv_util.h"
#include "daemon/tiers/codec.h"
#include "daemon/tiers/disk.h"

#define NBLK 48

static kv_err fill_copy(void *arg, uint8_t *dst, uint64_t off, uint64_t n) {
    memcpy(dst, (const uint8_t *)arg + off, n);
    return KV_OK;
}

static kv_err sink_copy(void *arg, const uint8_t *src, uint64_t off, uint64_t n) {
    memcpy((uint8_t *)arg + off, src, n);
    return KV_OK;
}

enum { RAW = 0, PLAIN = 1, STREAM = 2, ZERO = 3, ZEROV = 4, NWAYS = 5 };
static const char *const way_name[NWAYS] = {
    "raw pwrite / pread (baseline)", "plain (kvd_disk_write / read)",
    "streamed (io_uring, 256 KiB chunks)", "zero-copy (kvd_disk_write_from / read_into)",
    "zero-copy, 64 pieces of 32 KiB (write_fromv / read_intov: layer-major)"};
#define NPIECES 64

/* bytes of a new memfd mapped shared and advised for huge pages, as kvd maps a host pool's
 * segment (the mapping keeps the memory; a fork's child shares it). */
static uint8_t *shared_memfd(const char *name, uint64_t bytes) {
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)bytes) != 0) {
        bench_die("memfd: %s", strerror(errno));
    }
    uint8_t *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        bench_die("mmap: %s", strerror(errno));
    }
    kv_map_advise_huge(p, bytes);
    close(fd);
    return p;
}

int main(int argc, char **argv) {
    const char *dir = "/tmp";
    int rounds = 7, fresh = 0, use_memfd = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--dir") == 0 && i + 1 < argc) {
            dir = argv[++i];
        } else if (strcmp(argv[i], "--fresh") == 0) {
            fresh = 1;
        } else if (strcmp(argv[i], "--memfd") == 0) {
            use_memfd = 1;
        } else if (strcmp(argv[i], "--rounds") == 0 && i + 1 < argc) {
            rounds = atoi(argv[++i]);
        } else {
            bench_die("usage: disk_bench [--dir DIR] [--rounds N] [--fresh] [--memfd]");
        }
    }
    if (rounds < 1 || rounds > 64) {
        bench_die("--rounds: 1 to 64");
    }
    char tmp[256];
    snprintf(tmp, sizeof(tmp), "%s/kvd_disk_bench.XXXXXX", dir);
    if (mkdtemp(tmp) == NULL) {
        bench_die("mkdtemp %s: %s", tmp, strerror(errno));
    }
    kvd_disk_key key;
    memset(&key, 0, sizeof(key));
    snprintf(key.model, sizeof(key.model), "disk-bench");
    snprintf(key.domain, sizeof(key.domain), "bench");
    if (kv_layout_init(32, 8, 128, 16, KV_DTYPE_FP16, KV_BLOCK_MAJOR, &key.layout) != KV_OK) {
        bench_die("layout");
    }
    uint64_t bb = key.layout.block_bytes;
    char sub[300], msg[256] = "";
    snprintf(sub, sizeof(sub), "%s/dom", tmp);
    kvd_disk *d = NULL;
    if (kvd_disk_open(sub, "bench.t2", &key, KVD_DISK_DIRECT, &d, msg, sizeof(msg)) != KV_OK) {
        bench_die("kvd_disk_open: %s", msg);
    }
    uint64_t sb = kvd_disk_slot_bytes(d);
    char rawpath[320];
    snprintf(rawpath, sizeof(rawpath), "%s/raw.bin", tmp);
    int rfd = open(rawpath, O_RDWR | O_CREAT | O_DIRECT, 0600);
    int direct = rfd >= 0;
    if (rfd < 0) {
        rfd = open(rawpath, O_RDWR | O_CREAT, 0600);
    }
    if (rfd < 0) {
        bench_die("%s: %s", rawpath, strerror(errno));
    }
    /* Page-aligned, as a host pool's blocks are (zero-copy's O_DIRECT needs it), and every buffer
     * of every way in huge pages where the kernel gives them (kv_alloc_huge), so that the ways are
     * compared at one page size: on a VM that shadows page tables a transfer from 4 KiB pages
     * runs at a third of one from 2 MiB pages, the raw loop's as much as kvd's. */
    uint8_t *t0, *back, *img; /* T0, where reads land (a block each), raw's slot images */
    if (use_memfd) {
        /* A host pool's memory: T0 a memfd mapped shared (a child process writes it with
         * --fresh), and so the raw way's images and the reads' places, all advised alike. */
        t0 = shared_memfd("disk-bench-t0", NBLK * bb);
        back = shared_memfd("disk-bench-back", NBLK * bb);
        img = shared_memfd("disk-bench-img", NBLK * sb);
    } else {
        t0 = kv_alloc_huge(NBLK * bb);
        back = kv_alloc_huge(NBLK * bb);
        img = kv_alloc_huge(NBLK * sb);
    }
    uint8_t *buf = kv_alloc_huge(sb); /* the slot buffer, as a copy thread's (tiers.c) */
    if (t0 == NULL || back == NULL || buf == NULL || img == NULL) {
        bench_die("out of memory");
    }
    uint64_t x = 88172645463325252ull;
    for (uint64_t i = 0; i < NBLK * bb / 8; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        memcpy(t0 + i * 8, &x, 8);
    }
    /* Each raw slot holds its own block's bytes, as kvd's do: a storage layer that deduplicates
     * or compresses must not see the same bytes written 48 times where kvd writes 48 blocks. */
    for (uint64_t b = 0; b < NBLK; b++) {
        memcpy(img + b * sb, t0 + b * bb, bb);
        memset(img + b * sb + bb, 0, sb - bb);
    }
    double wr[NWAYS][64], rd[NWAYS][64], wratio[NWAYS][64], rratio[NWAYS][64];
    int uring = kvd_disk_thread_uring();
    for (int r = -1; r < rounds; r++) { /* round -1: the files grow, not counted */
        double w[NWAYS], rr[NWAYS];
        for (int o = 0; o < NWAYS; o++) {
            int way = (o + (r < 0 ? 0 : r)) % NWAYS;
            if (fresh) {
                /* Every source byte stored again by the CPU just before (same values): what an
                 * engine's blocks are when write-through sends them down at commit. With
                 * --memfd another process stores them (as a client does into its pool). */
                pid_t pid = use_memfd && way != RAW ? fork() : 0;
                if (pid < 0) {
                    bench_die("fork: %s", strerror(errno));
                }
                if (pid == 0) {
                    volatile uint64_t *p = (volatile uint64_t *)(way == RAW ? img : t0);
                    uint64_t n = (way == RAW ? NBLK * sb : NBLK * bb) / 8;
                    for (uint64_t i = 0; i < n; i++) {
                        p[i] = p[i];
                    }
                    if (use_memfd && way != RAW) {
                        _exit(0);
                    }
                } else if (waitpid(pid, NULL, 0) != pid) {
                    bench_die("waitpid: %s", strerror(errno));
                }
            }
            double t = bench_now_s();
            for (uint64_t b = 0; b < NBLK; b++) {
                kvd_disk_rec rec;
                memset(&rec, 0, sizeof(rec));
                rec.hash = (kv_hash128){b + 1, 7};
                rec.seq = b;
                rec.format = KVD_TF_RAW;
                rec.len = (uint32_t)bb;
                int e = 0, ff = 0;
                kv_err rc = KV_OK;
                if (way == RAW) {
                    if (pwrite(rfd, img + b * sb, sb, (off_t)(KVD_DISK_ALIGN + b * sb)) !=
                        (ssize_t)sb) {
                        bench_die("pwrite: %s", strerror(errno));
                    }
                } else if (way == PLAIN) {
                    uint8_t *pl = buf + kvd_disk_payload_off(d, &rec);
                    memcpy(pl, t0 + b * bb, bb);
                    rc = kvd_disk_write(d, b, &rec, pl, buf, &e);
                } else if (way == ZERO) {
                    rc = kvd_disk_write_from(d, b, &rec, t0 + b * bb, buf, &e, NULL);
                } else if (way == ZEROV) {
                    kvd_disk_piece pv[NPIECES];
                    for (int i = 0; i < NPIECES; i++) {
                        pv[i] = (kvd_disk_piece){t0 + b * bb + i * (bb / NPIECES), bb / NPIECES};
                    }
                    rc = kvd_disk_write_fromv(d, b, &rec, pv, NPIECES, buf, &e, NULL);
                } else {
                    rc = kvd_disk_write_stream(d, b, &rec, fill_copy, t0 + b * bb, buf, &e, &ff);
                }
                if (rc != KV_OK) {
                    bench_die("write: %s (%s)", kv_strerror(rc), strerror(e));
                }
            }
            w[way] = (double)(NBLK * bb) / (bench_now_s() - t) / 1e9;
        }
        for (int o = 0; o < NWAYS; o++) {
            int way = (o + (r < 0 ? 0 : r)) % NWAYS;
            double t = bench_now_s();
            for (uint64_t b = 0; b < NBLK; b++) {
                kvd_disk_rec rec;
                kv_hash128 h = {b + 1, 7};
                kv_err rc = KV_OK;
                if (way == RAW) {
                    if (pread(rfd, img + b * sb, sb, (off_t)(KVD_DISK_ALIGN + b * sb)) !=
                        (ssize_t)sb) {
                        bench_die("pread: %s", strerror(errno));
                    }
                } else if (way == PLAIN) {
                    rc = kvd_disk_read(d, b, &h, &rec, buf);
                    if (rc == KV_OK) {
                        memcpy(back + b * bb, buf + kvd_disk_payload_off(d, &rec), bb);
                    }
                } else if (way == ZERO) {
                    rc = kvd_disk_read_into(d, b, &h, &rec, back + b * bb, bb, buf, NULL);
                } else if (way == ZEROV) {
                    kvd_disk_piece pv[NPIECES];
                    for (int i = 0; i < NPIECES; i++) {
                        pv[i] = (kvd_disk_piece){back + b * bb + i * (bb / NPIECES), bb / NPIECES};
                    }
                    rc = kvd_disk_read_intov(d, b, &h, &rec, pv, NPIECES, bb, buf, NULL);
                } else {
                    rc = kvd_disk_read_stream(d, b, &h, &rec, buf, sink_copy, back + b * bb);
                }
                if (rc != KV_OK) {
                    bench_die("read: %s", kv_strerror(rc));
                }
            }
            rr[way] = (double)(NBLK * bb) / (bench_now_s() - t) / 1e9;
            /* Checked after the clock stopped (the raw way reads its images, unchecked). */
            for (uint64_t b = 0; b < NBLK && way != RAW; b++) {
                if (memcmp(back + b * bb, t0 + b * bb, bb) != 0) {
                    bench_die("block %llu read back wrong", (unsigned long long)b);
                }
            }
            if (way != RAW) {
                memset(back, 0, NBLK * bb); /* the next way must bring every byte itself */
            }
        }
        if (r < 0) {
            continue;
        }
        for (int way = 0; way < NWAYS; way++) {
            wr[way][r] = w[way];
            rd[way][r] = rr[way];
            wratio[way][r] = w[way] / w[RAW];
            rratio[way][r] = rr[way] / rr[RAW];
        }
    }
    char thp[32];
    printf("%d blocks of %llu KiB (32 x 8 x 128 x 16 fp16), slots of %llu KiB, in a directory of "
           "this machine's %s; O_DIRECT %s (kvd's file: %s, format %u); this thread's io_uring: "
           "%s; zero-copy transfers %llu of %llu. %d rounds, the ways' order rotating; median "
           "[min-max]; the ratio is taken per round. Shmem THP `%s`%s.\n\n",
           NBLK, (unsigned long long)(bb >> 10), (unsigned long long)(sb >> 10), dir,
           direct ? "on" : "off", kvd_disk_direct(d) ? "on" : "off", kvd_disk_format(d),
           uring ? "yes" : "no", (unsigned long long)kvd_disk_direct_transfers(),
           (unsigned long long)(4 * NBLK * (rounds + 1)), rounds,
           kv_shmem_thp_mode(thp, sizeof(thp)),
           use_memfd ? " (T0 and the raw way's images: memfds that ask for huge pages, as kvd's "
                       "mappings do)"
                     : "");
    printf("| way | write GB/s | x raw | read GB/s | x raw |\n|---|---:|---:|---:|---:|\n");
    for (int way = 0; way < NWAYS; way++) {
        double v[4][64];
        memcpy(v[0], wr[way], sizeof(v[0]));
        memcpy(v[1], wratio[way], sizeof(v[1]));
        memcpy(v[2], rd[way], sizeof(v[2]));
        memcpy(v[3], rratio[way], sizeof(v[3]));
        printf("| %s |", way_name[way]);
        for (int k = 0; k < 4; k++) {
            double lo = v[k][0], hi = v[k][0];
            for (int i = 1; i < rounds; i++) {
                lo = v[k][i] < lo ? v[k][i] : lo;
                hi = v[k][i] > hi ? v[k][i] : hi;
            }
            printf(" %.2f [%.2f-%.2f] |", bench_median(v[k], (size_t)rounds), lo, hi);
        }
        printf("\n");
    }
    kvd_disk_close(d);
    close(rfd);
    char cmd[400];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmp);
    if (system(cmd) != 0) {
        fprintf(stderr, "disk_bench: could not remove %s\n", tmp);
    }
    if (use_memfd) {
        munmap(t0, NBLK * bb);
        munmap(img, NBLK * sb);
        munmap(back, NBLK * bb);
    } else {
        free(t0);
        free(img);
        free(back);
    }
    free(buf);
    return 0;
}
