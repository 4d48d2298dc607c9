/* Tests of kvd_disk: file and directory creation, slot round trips, scan after reopen, checksum
 * and hash checks, clear, foreign and damaged files put aside, O_DIRECT and its fallback, the
 * streamed and zero-copy transfers, and concurrent writers. Each test works in its own mkdtemp
 * directory under /tmp. Every test runs twice: on format 2 files (what kvd makes) and on format 1
 * files (what kvd made before, still used). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/kv_log.h"
#include "daemon/tiers/codec.h"
#include "daemon/tiers/disk.h"

#define NAME "pool.t2"

/* KVD_DISK_FORMAT2 in the first run of the group, KVD_DISK_FORMAT1 in the second: every open_ok
 * adds it. */
static unsigned fmt_flags = KVD_DISK_FORMAT2;
#define FMT1 (fmt_flags == KVD_DISK_FORMAT1)

/* Where rec's payload starts in a slot of d, and the one-page header's room in format 2. */
static uint64_t poff(const kvd_disk *d, int tail) {
    kvd_disk_rec r;
    memset(&r, 0, sizeof(r));
    r.has_tail = (uint32_t)tail;
    return kvd_disk_payload_off(d, &r);
}

/* What the log sink saw. */
static struct {
    int file_warns;     /* WARN lines with id KVD-TIER2-FILE */
    char last[1024];    /* the last of them */
    pthread_mutex_t mu; /* the fallback line may come from a worker thread */
} logs = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void log_sink(void *arg, kv_log_level level, const char *id, const char *msg) {
    (void)arg;
    pthread_mutex_lock(&logs.mu);
    if (level == KV_LOG_WARN && strcmp(id, "KVD-TIER2-FILE") == 0) {
        logs.file_warns++;
        snprintf(logs.last, sizeof(logs.last), "%s", msg);
    }
    pthread_mutex_unlock(&logs.mu);
    kv_log_stderr_sink(NULL, level, id, msg);
}

typedef struct fixture {
    char root[64];  /* the mkdtemp directory */
    char dir[128];  /* root/a/b/dom: missing at the start */
    char path[192]; /* dir/NAME */
    char bad[200];  /* path.bad */
    char shm[64];   /* a mkdtemp directory on tmpfs, or "" */
} fixture;

static int rm_entry(const char *p, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st;
    (void)flag;
    (void)ftw;
    return remove(p);
}

static int setup(void **state) {
    fixture *fx = calloc(1, sizeof(*fx));
    if (fx == NULL) {
        return -1;
    }
    snprintf(fx->root, sizeof(fx->root), "/tmp/kvd_disk_test.XXXXXX");
    if (mkdtemp(fx->root) == NULL) {
        free(fx);
        return -1;
    }
    snprintf(fx->dir, sizeof(fx->dir), "%s/a/b/dom", fx->root);
    snprintf(fx->path, sizeof(fx->path), "%s/%s", fx->dir, NAME);
    snprintf(fx->bad, sizeof(fx->bad), "%s.bad", fx->path);
    logs.file_warns = 0;
    logs.last[0] = '\0';
    *state = fx;
    return 0;
}

static int teardown(void **state) {
    fixture *fx = *state;
    nftw(fx->root, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    if (fx->shm[0] != '\0') {
        nftw(fx->shm, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    }
    free(fx);
    return 0;
}

static void key_make(kvd_disk_key *k, const char *model, const char *domain, uint32_t layers,
                     uint32_t heads, uint32_t dim, kv_dtype dtype, uint64_t seed) {
    memset(k, 0, sizeof(*k));
    snprintf(k->model, sizeof(k->model), "%s", model);
    snprintf(k->domain, sizeof(k->domain), "%s", domain);
    assert_int_equal(kv_layout_init(layers, heads, dim, 16, dtype, KV_BLOCK_MAJOR, &k->layout),
                     KV_OK);
    k->seed.lo = seed;
    k->seed.hi = ~seed;
}

/* 2 layers, 2 heads of 60 fp16: 15360-byte blocks, so slots of 16384 with some padding. */
static void key_default(kvd_disk_key *k) {
    key_make(k, "llama-test", "tenant-a", 2, 2, 60, KV_DTYPE_FP16, 0x1234);
}

static uint8_t *slot_buf(const kvd_disk *d) {
    uint8_t *b = aligned_alloc(KVD_DISK_ALIGN, kvd_disk_slot_bytes(d));
    assert_non_null(b);
    return b;
}

static kv_hash128 hash_of(uint64_t k) {
    kv_hash128 h = {k * 0x9E3779B97F4A7C15ull + 1, k ^ 0xABCDEFull};
    return h;
}

static void fill_payload(uint8_t *p, size_t n, uint64_t seed) {
    uint64_t s = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        p[i] = (uint8_t)(s >> 56);
    }
}

static kvd_disk_rec rec_of(uint64_t k, uint32_t len) {
    kvd_disk_rec r;
    memset(&r, 0, sizeof(r));
    r.hash = hash_of(k);
    r.parent = k == 0 ? (kv_hash128){0, 0} : hash_of(k - 1);
    r.seq = 1000 + k;
    r.format = (uint32_t)(k % KVD_TF_COUNT);
    r.len = len;
    return r;
}

static void write_rec(kvd_disk *d, uint64_t slot, uint64_t k, uint32_t len) {
    uint8_t *buf = slot_buf(d);
    uint8_t *payload = malloc(len + 1);
    assert_non_null(payload);
    fill_payload(payload, len, k);
    kvd_disk_rec r = rec_of(k, len);
    int e = 0;
    assert_int_equal(kvd_disk_write(d, slot, &r, payload, buf, &e), KV_OK);
    free(payload);
    free(buf);
}

static void check_rec(const kvd_disk_rec *got, uint64_t k, uint32_t len) {
    kvd_disk_rec want = rec_of(k, len);
    assert_true(kv_hash_eq(got->hash, want.hash));
    assert_true(kv_hash_eq(got->parent, want.parent));
    assert_int_equal(got->seq, want.seq);
    assert_int_equal(got->format, want.format);
    assert_int_equal(got->len, want.len);
}

static void read_check(kvd_disk *d, uint64_t slot, uint64_t k, uint32_t len) {
    uint8_t *buf = slot_buf(d);
    uint8_t *want = malloc(len + 1);
    assert_non_null(want);
    fill_payload(want, len, k);
    kvd_disk_rec got;
    kv_hash128 h = hash_of(k);
    assert_int_equal(kvd_disk_read(d, slot, &h, &got, buf), KV_OK);
    check_rec(&got, k, len);
    uint64_t at = poff(d, 0);
    assert_memory_equal(buf + at, want, len);
    for (uint64_t i = KVD_DISK_REC_HDR; i < at; i++) {
        assert_int_equal(buf[i], 0); /* format 2: the header block's rest */
    }
    for (uint64_t i = at + len; i < kvd_disk_slot_bytes(d); i++) {
        assert_int_equal(buf[i], 0);
    }
    free(want);
    free(buf);
}

static kv_err read_slot(kvd_disk *d, uint64_t slot, const kv_hash128 *expect) {
    uint8_t *buf = slot_buf(d);
    kvd_disk_rec got;
    kv_err rc = kvd_disk_read(d, slot, expect, &got, buf);
    free(buf);
    return rc;
}

/* Records scan reported, by slot. */
typedef struct scan_log {
    int n;
    uint64_t slot[64];
    kvd_disk_rec rec[64];
} scan_log;

static void scan_cb(void *arg, uint64_t slot, const kvd_disk_rec *rec) {
    scan_log *s = arg;
    assert_true(s->n < 64);
    s->slot[s->n] = slot;
    s->rec[s->n] = *rec;
    s->n++;
}

static void do_scan(kvd_disk *d, scan_log *s, uint64_t *bad) {
    memset(s, 0, sizeof(*s));
    *bad = 12345;
    assert_int_equal(kvd_disk_scan(d, scan_cb, s, bad), KV_OK);
    for (int i = 1; i < s->n; i++) {
        assert_true(s->slot[i - 1] < s->slot[i]); /* slot order */
    }
}

static kvd_disk *open_ok(const fixture *fx, const kvd_disk_key *k, int direct) {
    kvd_disk *d = NULL;
    char msg[256] = "";
    kv_err rc = kvd_disk_open(fx->dir, NAME, k, (direct ? KVD_DISK_DIRECT : 0) | fmt_flags, &d, msg,
                              sizeof(msg));
    if (rc != KV_OK) {
        fail_msg("kvd_disk_open: %s: %s", kv_strerror(rc), msg);
    }
    assert_non_null(d);
    assert_int_equal(kvd_disk_format(d), FMT1 ? 1 : 2);
    return d;
}

static off_t file_size(const char *p) {
    struct stat st;
    if (stat(p, &st) != 0) {
        return -1;
    }
    return st.st_size;
}

/* Flips one byte of the file at off (the disk is closed meanwhile). */
static void flip_byte(const char *path, off_t off) {
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    uint8_t b;
    assert_int_equal(pread(fd, &b, 1, off), 1);
    b ^= 0x40;
    assert_int_equal(pwrite(fd, &b, 1, off), 1);
    close(fd);
}

static void test_open_creates(void **state) {
    fixture *fx = *state;
    kvd_disk_key k;
    key_default(&k);
    kvd_disk *d = open_ok(fx, &k, 0);
    const char *parts[] = {"a", "a/b", "a/b/dom"};
    for (int i = 0; i < 3; i++) {
        char p[256];
        snprintf(p, sizeof(p), "%s/%s", fx->root, parts[i]);
        struct stat st;
        assert_int_equal(stat(p, &st), 0);
        assert_true(S_ISDIR(st.st_mode));
        assert_int_equal(st.st_mode & 0777, 0700);
    }
    struct stat st;
    assert_int_equal(stat(fx->path, &st), 0);
    assert_true(S_ISREG(st.st_mode));
    assert_int_equal(st.st_mode & 0777, 0600);
    assert_int_equal(st.st_size, KVD_DISK_ALIGN);
    if (FMT1) {
        assert_int_equal(kvd_disk_slot_bytes(d), 16384); /* 64 + 15360, rounded up */
        assert_int_equal(kvd_disk_payload_max(d), 16384 - KVD_DISK_REC_HDR);
        assert_false(kvd_disk_fits(d, 16384 - KVD_DISK_REC_HDR, 1)); /* the tail takes room */
    } else {
        assert_int_equal(kvd_disk_slot_bytes(d), 20480); /* 4096 + 15360, rounded up */
        assert_int_equal(kvd_disk_payload_max(d), 16384);
        assert_true(kvd_disk_fits(d, 16384, 1)); /* the tail sits in the header block */
    }
    assert_false(kvd_disk_fits(d, kvd_disk_payload_max(d) + 1, 0));
    assert_int_equal(kvd_disk_slots(d), 0);
    assert_int_equal(kvd_disk_direct(d), 0);
    kvd_disk_close(d);
    kvd_disk_close(NULL);
    /* An existing directory is used as it is, and the file opens again untouched. */
    assert_int_equal(chmod(fx->dir, 0750), 0);
    d = open_ok(fx, &k, 0);
    assert_int_equal(stat(fx->dir, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0750);
    assert_int_equal(logs.file_warns, 0);
    assert_int_equal(file_size(fx->bad), -1);
    kvd_disk_close(d);
}

static void test_open_bad_args(void **state) {
    fixture *fx = *state;
    kvd_disk_key k;
    key_default(&k);
    kvd_disk *d = (kvd_disk *)0x1;
    char msg[256];
    const char *names[] = {"", "x/y", ".", "..", "/abs"};
    for (int i = 0; i < 5; i++) {
        msg[0] = '\0';
        assert_int_equal(kvd_disk_open(fx->dir, names[i], &k, 0, &d, msg, sizeof(msg)), KV_EINVAL);
        assert_true(msg[0] != '\0');
    }
    kvd_disk_key bad = k;
    bad.model[0] = '\0';
    assert_int_equal(kvd_disk_open(fx->dir, NAME, &bad, 0, &d, msg, sizeof(msg)), KV_EINVAL);
    bad = k;
    memset(bad.domain, 'x', sizeof(bad.domain)); /* no NUL */
    assert_int_equal(kvd_disk_open(fx->dir, NAME, &bad, 0, &d, NULL, 0), KV_EINVAL);
    bad = k;
    bad.layout.num_layers = 0;
    assert_int_equal(kvd_disk_open(fx->dir, NAME, &bad, 0, &d, msg, sizeof(msg)), KV_EINVAL);
    bad = k;
    bad.layout.block_bytes++; /* not what kv_layout_init derives */
    assert_int_equal(kvd_disk_open(fx->dir, NAME, &bad, 0, &d, msg, sizeof(msg)), KV_EINVAL);
    assert_int_equal(kvd_disk_open(NULL, NAME, &k, 0, &d, msg, sizeof(msg)), KV_EINVAL);
    assert_true(d == (kvd_disk *)0x1);
    /* Nothing was created by the refusals. */
    assert_int_equal(file_size(fx->dir), -1);
    /* A directory path through a regular file cannot be made. */
    char f[128], sub[160];
    snprintf(f, sizeof(f), "%s/plain", fx->root);
    int fd = open(f, O_CREAT | O_WRONLY, 0600);
    assert_true(fd >= 0);
    close(fd);
    snprintf(sub, sizeof(sub), "%s/sub", f);
    msg[0] = '\0';
    assert_int_equal(kvd_disk_open(sub, NAME, &k, 0, &d, msg, sizeof(msg)), KV_ESYS);
    assert_non_null(strstr(msg, f));
    assert_non_null(strstr(msg, strerror(ENOTDIR)));
    assert_int_equal(kvd_disk_open(f, NAME, &k, 0, &d, msg, sizeof(msg)), KV_ESYS);
    assert_true(d == (kvd_disk *)0x1);
}

static const struct {
    uint64_t slot, k;
    uint32_t len;
} recs[] = {{5, 50, 1000}, {0, 0, 16320}, {3, 30, 0}, {9, 90, 4033}, {7, 70, 4096 - 64}};
#define NRECS (sizeof(recs) / sizeof(recs[0]))

static void test_round_trip_and_scan(void **state) {
    fixture *fx = *state;
    kvd_disk_key k;
    key_default(&k);
    kvd_disk *d = open_ok(fx, &k, 0);
    for (size_t i = 0; i < NRECS; i++) {
        write_rec(d, recs[i].slot, recs[i].k, recs[i].len);
    }
    assert_int_equal(kvd_disk_slots(d), 10);
    assert_int_equal(file_size(fx->path), 4096 + 10 * (off_t)kvd_disk_slot_bytes(d));
    for (size_t i = NRECS; i-- > 0;) {
        read_check(d, recs[i].slot, recs[i].k, recs[i].len);
    }
    /* The payload may already sit where it goes in buf: no copy, same record. */
    uint8_t *buf = slot_buf(d);
    memset(buf, 0xEE, kvd_disk_slot_bytes(d));
    fill_payload(buf + poff(d, 0), 2000, 110);
    kvd_disk_rec r = rec_of(110, 2000);
    assert_int_equal(kvd_disk_write(d, 11, &r, buf + poff(d, 0), buf, NULL), KV_OK);
    read_check(d, 11, 110, 2000);
    /* Refusals: too long, unknown format. */
    r = rec_of(120, (uint32_t)kvd_disk_payload_max(d) + 1);
    int e = 0;
    assert_int_equal(kvd_disk_write(d, 12, &r, buf, buf, &e), KV_EINVAL);
    r = rec_of(120, 10);
    r.format = KVD_TF_COUNT;
    assert_int_equal(kvd_disk_write(d, 12, &r, buf, buf, &e), KV_EINVAL);
    free(buf);
    /* Holes read as empty, i.e. not a record; past the end is a short read. */
    assert_int_equal(read_slot(d, 1, NULL), KV_ECORRUPT);
    assert_int_equal(read_slot(d, 12, NULL), KV_ECORRUPT);
    assert_int_equal(read_slot(d, 1000, NULL), KV_ECORRUPT);
    assert_int_equal(read_slot(d, UINT64_MAX, NULL), KV_ECORRUPT);
    kvd_disk_close(d);

    d = open_ok(fx, &k, 0);
    assert_int_equal(logs.file_warns, 0);
    assert_int_equal(kvd_disk_slots(d), 12);
    scan_log s;
    uint64_t bad;
    do_scan(d, &s, &bad);
    assert_int_equal(bad, 0);
    assert_int_equal(s.n, NRECS + 1);
    /* Slot order 0, 3, 5, 7, 9, 11. */
    const size_t order[] = {1, 2, 0, 4, 3};
    for (size_t i = 0; i < NRECS; i++) {
        assert_int_equal(s.slot[i], recs[order[i]].slot);
        check_rec(&s.rec[i], recs[order[i]].k, recs[order[i]].len);
    }
    assert_int_equal(s.slot[NRECS], 11);
    check_rec(&s.rec[NRECS], 110, 2000);
    for (size_t i = 0; i < NRECS; i++) {
        read_check(d, recs[i].slot, recs[i].k, recs[i].len);
    }
    /* fn may be NULL (just count), bad may be NULL. */
    assert_int_equal(kvd_disk_scan(d, NULL, NULL, &bad), KV_OK);
    assert_int_equal(bad, 0);
    assert_int_equal(kvd_disk_scan(d, scan_cb, &s, NULL), KV_OK);
    kvd_disk_close(d);
}

/* A record with a digest tail: the tail sits at 64 and the payload after it (format 1) or at
 * 4096 (format 2), both inside the payload checksum; scan and read give the tail back; a tail
 * that does not fit beside the payload is refused (format 1); a flipped tail byte fails the
 * read. */
static void test_tail(void **state) {
    fixture *fx = *state;
    kvd_disk_key k;
    key_default(&k);
    kvd_disk *d = open_ok(fx, &k, 0);
    uint8_t *buf = slot_buf(d);
    uint32_t len = 3000;
    fill_payload(buf + poff(d, 1), len, 7);
    kvd_disk_rec r = rec_of(7, len);
    r.has_tail = 1;
    for (int i = 0; i < 16; i++) {
        r.tail[i] = (uint8_t)(0xA0 + i);
    }
    assert_int_equal(kvd_disk_write(d, 3, &r, buf + poff(d, 1), buf, NULL), KV_OK);
    memset(buf, 0, kvd_disk_slot_bytes(d));
    kvd_disk_rec got;
    kv_hash128 h = hash_of(7);
    assert_int_equal(kvd_disk_read(d, 3, &h, &got, buf), KV_OK);
    check_rec(&got, 7, len);
    assert_int_equal(got.has_tail, 1);
    assert_memory_equal(got.tail, r.tail, 16);
    assert_memory_equal(buf + KVD_DISK_REC_HDR, r.tail, 16);
    uint8_t *want = malloc(len);
    assert_non_null(want);
    fill_payload(want, len, 7);
    assert_memory_equal(buf + kvd_disk_payload_off(d, &got), want, len);
    free(want);
    /* A record without one, beside it: no tail. */
    write_rec(d, 4, 8, 100);
    scan_log sl;
    uint64_t bad;
    do_scan(d, &sl, &bad);
    assert_int_equal(sl.n, 2);
    assert_int_equal(bad, 0);
    assert_int_equal(sl.rec[0].has_tail, 1);
    assert_memory_equal(sl.rec[0].tail, r.tail, 16);
    assert_int_equal(sl.rec[1].has_tail, 0);
    /* Format 1: no room for the tail beside a full-size payload; format 2: room. */
    kvd_disk_rec big = rec_of(9, (uint32_t)kvd_disk_payload_max(d) - 8);
    big.has_tail = 1;
    assert_int_equal(kvd_disk_write(d, 5, &big, buf, buf, NULL), FMT1 ? KV_EINVAL : KV_OK);
    /* The tail is checked: one byte of it flipped on disk fails the read. */
    int fd = open(fx->path, O_RDWR);
    assert_true(fd >= 0);
    uint8_t b;
    off_t at = (off_t)(4096 + 3 * kvd_disk_slot_bytes(d) + KVD_DISK_REC_HDR + 5);
    assert_int_equal(pread(fd, &b, 1, at), 1);
    b ^= 0xFF;
    assert_int_equal(pwrite(fd, &b, 1, at), 1);
    close(fd);
    assert_int_equal(kvd_disk_read(d, 3, &h, &got, buf), KV_ECORRUPT);
    free(buf);
    kvd_disk_close(d);
}

static void test_corruption_and_clear(void **state) {
    fixture *fx = *state;
    kvd_disk_key k;
    key_default(&k);
    kvd_disk *d = open_ok(fx, &k, 0);
    for (uint64_t i = 0; i < 4; i++) {
        write_rec(d, i, 10 + i, 3000);
    }
    off_t s0 = 4096, s1 = 4096 + (off_t)kvd_disk_slot_bytes(d), p0 = (off_t)poff(d, 0);
    kvd_disk_close(d);
    flip_byte(fx->path, s0 + p0 + 1234); /* slot 0's payload */
    flip_byte(fx->path, s1 + 40);        /* slot 1's seq */
    d = open_ok(fx, &k, 0);
    scan_log s;
    uint64_t bad;
    do_scan(d, &s, &bad);
    assert_int_equal(bad, 1);
    assert_int_equal(s.n, 3);
    assert_int_equal(s.slot[0], 0); /* its header is fine: scan does not check payloads */
    check_rec(&s.rec[0], 10, 3000);
    assert_int_equal(s.slot[1], 2);
    assert_int_equal(s.slot[2], 3);
    kv_hash128 h0 = hash_of(10), h1 = hash_of(11), h2 = hash_of(12);
    assert_int_equal(read_slot(d, 0, &h0), KV_ECORRUPT);
    assert_int_equal(read_slot(d, 0, NULL), KV_ECORRUPT);
    assert_int_equal(read_slot(d, 1, &h1), KV_ECORRUPT);
    assert_int_equal(read_slot(d, 1, NULL), KV_ECORRUPT);
    read_check(d, 2, 12, 3000);
    assert_int_equal(read_slot(d, 2, &h1), KV_ECORRUPT); /* another block's hash */
    kv_hash128 near = h2;
    near.hi ^= 1;
    assert_int_equal(read_slot(d, 2, &near), KV_ECORRUPT);
    assert_int_equal(read_slot(d, 2, NULL), KV_OK);

    uint8_t *buf = slot_buf(d);
    assert_int_equal(kvd_disk_clear(d, 2, buf), KV_OK);
    assert_int_equal(kvd_disk_clear(d, 1, buf), KV_OK); /* a bad slot becomes empty */
    off_t size = file_size(fx->path);
    assert_int_equal(kvd_disk_clear(d, 100, buf), KV_OK); /* past the end: already empty */
    assert_int_equal(kvd_disk_clear(d, UINT64_MAX, buf), KV_OK);
    assert_int_equal(file_size(fx->path), size);
    free(buf);
    assert_int_equal(read_slot(d, 2, &h2), KV_ECORRUPT);
    do_scan(d, &s, &bad);
    assert_int_equal(bad, 0);
    assert_int_equal(s.n, 2);
    assert_int_equal(s.slot[0], 0);
    assert_int_equal(s.slot[1], 3);
    kvd_disk_close(d);
    /* Still so after a restart. */
    d = open_ok(fx, &k, 0);
    do_scan(d, &s, &bad);
    assert_int_equal(bad, 0);
    assert_int_equal(s.n, 2);
    read_check(d, 3, 13, 3000);
    kvd_disk_close(d);
    assert_int_equal(logs.file_warns, 0);
}

/* Another key: the file goes aside as .bad (the newest replacing the older) and a new one starts
 * empty; the same key opens it again without a rename. */
static void test_foreign_key_renamed(void **state) {
    fixture *fx = *state;
    kvd_disk_key keys[6];
    key_default(&keys[0]);
    key_make(&keys[1], "llama-test", "tenant-b", 2, 2, 60, KV_DTYPE_FP16, 0x1234);
    key_make(&keys[2], "llama-test", "tenant-b", 3, 2, 60, KV_DTYPE_FP16, 0x1234);
    key_make(&keys[3], "llama-test", "tenant-b", 3, 2, 60, KV_DTYPE_BF16, 0x1234);
    key_make(&keys[4], "llama-test", "tenant-b", 3, 2, 60, KV_DTYPE_BF16, 0x1235);
    key_make(&keys[5], "llama-other", "tenant-b", 3, 2, 60, KV_DTYPE_BF16, 0x1235);
    off_t prev_size = 0;
    for (int i = 0; i < 6; i++) {
        kvd_disk *d = open_ok(fx, &keys[i], 0);
        assert_int_equal(logs.file_warns, i);
        if (i > 0) {
            assert_non_null(strstr(logs.last, fx->path));
            assert_non_null(strstr(logs.last, ".bad"));
            assert_int_equal(file_size(fx->bad), prev_size); /* the file of key i-1 */
        }
        scan_log s;
        uint64_t bad;
        do_scan(d, &s, &bad);
        assert_int_equal(s.n, 0);
        assert_int_equal(bad, 0);
        assert_int_equal(kvd_disk_slots(d), 0);
        /* i + 1 records, so each generation of the file has its own size. */
        for (int j = 0; j <= i; j++) {
            write_rec(d, (uint64_t)j, (uint64_t)j, 100);
        }
        kvd_disk_close(d);
        prev_size = file_size(fx->path);
        d = open_ok(fx, &keys[i], 0);
        assert_int_equal(logs.file_warns, i);
        do_scan(d, &s, &bad);
        assert_int_equal(s.n, i + 1);
        kvd_disk_close(d);
    }
    assert_non_null(strstr(logs.last, "model id differs"));
    struct stat st;
    assert_int_equal(stat(fx->bad, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0600);
}

static void write_file(const char *path, const void *p, size_t n) {
    int fd = open(path, O_CREAT | O_TRUNC | O_WRONLY, 0600);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, p, n), (ssize_t)n);
    close(fd);
}

static void test_damaged_header_renamed(void **state) {
    fixture *fx = *state;
    kvd_disk_key k;
    key_default(&k);
    kvd_disk *d = open_ok(fx, &k, 0); /* makes the directory */
    write_rec(d, 0, 1, 100);
    kvd_disk_close(d);
    uint8_t good[4096];
    int fd = open(fx->path, O_RDONLY);
    assert_true(fd >= 0);
    assert_int_equal(read(fd, good, sizeof(good)), 4096);
    close(fd);

    /* Truncated inside the header. */
    write_file(fx->path, good, 100);
    d = open_ok(fx, &k, 0);
    assert_int_equal(logs.file_warns, 1);
    assert_non_null(strstr(logs.last, "truncated"));
    assert_int_equal(file_size(fx->bad), 100);
    assert_int_equal(file_size(fx->path), 4096);
    kvd_disk_close(d);

    /* One flipped byte in the model name: the checksum catches it. */
    uint8_t h[4096];
    memcpy(h, good, sizeof(h));
    h[81] ^= 1;
    write_file(fx->path, h, sizeof(h));
    d = open_ok(fx, &k, 0);
    assert_int_equal(logs.file_warns, 2);
    assert_non_null(strstr(logs.last, "checksum"));
    kvd_disk_close(d);

    /* Not ours at all. */
    memset(h, 'z', sizeof(h));
    write_file(fx->path, h, sizeof(h));
    d = open_ok(fx, &k, 0);
    assert_int_equal(logs.file_warns, 3);
    assert_non_null(strstr(logs.last, "magic"));
    kvd_disk_close(d);

    /* An empty file (a crash before the header was written) is simply started. */
    write_file(fx->path, h, 0);
    d = open_ok(fx, &k, 0);
    assert_int_equal(logs.file_warns, 3);
    assert_int_equal(file_size(fx->path), 4096);
    kvd_disk_close(d);

    /* The good header again, with a truncated last slot: the partial slot is not counted. */
    write_file(fx->path, good, sizeof(good));
    d = open_ok(fx, &k, 0);
    assert_int_equal(logs.file_warns, 3);
    write_rec(d, 0, 1, 100);
    write_rec(d, 1, 2, 100);
    off_t sb = (off_t)kvd_disk_slot_bytes(d);
    kvd_disk_close(d);
    assert_int_equal(truncate(fx->path, 4096 + sb + sb / 2), 0);
    d = open_ok(fx, &k, 0);
    assert_int_equal(kvd_disk_slots(d), 1);
    read_check(d, 0, 1, 100);
    assert_int_equal(read_slot(d, 1, NULL), KV_ECORRUPT);
    scan_log s;
    uint64_t bad;
    do_scan(d, &s, &bad);
    assert_int_equal(s.n, 1);
    kvd_disk_close(d);
}

/* direct = 1 on dir: works whether the file system takes O_DIRECT or not. */
static void direct_round_trip(const char *dir, const char *what) {
    kvd_disk_key k;
    key_default(&k);
    kvd_disk *d = NULL;
    char msg[256] = "";
    kv_err rc = kvd_disk_open(dir, NAME, &k, KVD_DISK_DIRECT | fmt_flags, &d, msg, sizeof(msg));
    if (rc != KV_OK) {
        fail_msg("kvd_disk_open(%s): %s", dir, msg);
    }
    int at_open = kvd_disk_direct(d);
    for (uint64_t i = 0; i < 6; i++) {
        write_rec(d, 5 - i, i, (uint32_t)(500 * i + 1));
    }
    for (uint64_t i = 0; i < 6; i++) {
        read_check(d, 5 - i, i, (uint32_t)(500 * i + 1));
    }
    print_message("O_DIRECT on %s (%s): %s at open, %s after I/O\n", what, dir,
                  at_open ? "on" : "off", kvd_disk_direct(d) ? "on" : "off");
    kvd_disk_close(d);
    d = NULL;
    assert_int_equal(kvd_disk_open(dir, NAME, &k, KVD_DISK_DIRECT, &d, msg, sizeof(msg)), KV_OK);
    assert_int_equal(kvd_disk_format(d), FMT1 ? 1 : 2); /* a file keeps its format */
    scan_log s;
    uint64_t bad;
    do_scan(d, &s, &bad);
    assert_int_equal(s.n, 6);
    assert_int_equal(bad, 0);
    if (kvd_disk_direct(d)) {
        /* A buffer O_DIRECT cannot take makes the kernel say EINVAL (where O_DIRECT has
         * alignment rules: ext4, xfs; tmpfs has none): the file falls back to buffered I/O for
         * good and the write still lands. */
        uint8_t *raw = aligned_alloc(KVD_DISK_ALIGN, kvd_disk_slot_bytes(d) + KVD_DISK_ALIGN);
        assert_non_null(raw);
        uint8_t *odd = raw + 1;
        fill_payload(odd + poff(d, 0), 700, 77);
        kvd_disk_rec r = rec_of(77, 700);
        assert_int_equal(kvd_disk_write(d, 6, &r, odd + poff(d, 0), odd, NULL), KV_OK);
        read_check(d, 6, 77, 700);
        print_message("O_DIRECT on %s: misaligned buffer %s\n", what,
                      kvd_disk_direct(d) ? "accepted (no fallback needed)"
                                         : "refused, fell back to buffered I/O");
        free(raw);
    }
    kvd_disk_close(d);
}

static void test_direct(void **state) {
    fixture *fx = *state;
    direct_round_trip(fx->dir, "/tmp");
    struct stat st;
    if (stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode)) {
        snprintf(fx->shm, sizeof(fx->shm), "/dev/shm/kvd_disk_test.XXXXXX");
        if (mkdtemp(fx->shm) != NULL) {
            char dir[96];
            snprintf(dir, sizeof(dir), "%s/dom", fx->shm);
            direct_round_trip(dir, "tmpfs");
        } else {
            fx->shm[0] = '\0';
        }
    }
}

/* ---- streamed write and read ------------------------------------------------------------- */

/* A fill or sink over a flat payload: checks the calls come in payload order, back to back, and
 * can fail at a chosen call. */
typedef struct flow {
    uint8_t *bytes; /* the payload (fill reads it, sink writes it) */
    uint64_t len;
    uint64_t next; /* the offset the next call must start at */
    int calls;
    int fail_at;      /* the call that fails (0: none) */
    int out_of_order; /* a call that did not start where the last ended */
} flow;

static kv_err flow_fill(void *arg, uint8_t *dst, uint64_t off, uint64_t n) {
    flow *f = arg;
    f->calls++;
    if (off != f->next || off + n > f->len) {
        f->out_of_order = 1;
    }
    if (f->fail_at != 0 && f->calls == f->fail_at) {
        return KV_ESYS;
    }
    memcpy(dst, f->bytes + off, n);
    f->next = off + n;
    return KV_OK;
}

static kv_err flow_sink(void *arg, const uint8_t *src, uint64_t off, uint64_t n) {
    flow *f = arg;
    f->calls++;
    if (off != f->next || off + n > f->len) {
        f->out_of_order = 1;
        return KV_EINVAL;
    }
    if (f->fail_at != 0 && f->calls == f->fail_at) {
        return KV_ENOMEM;
    }
    memcpy(f->bytes + off, src, n);
    f->next = off + n;
    return KV_OK;
}

/* 32 layers, 8 heads of 128 fp16: 2 MiB blocks, slots of 2 MiB + 4 KiB (8 chunks). */
static void key_big(kvd_disk_key *k) {
    key_make(k, "llama-big", "tenant-a", 32, 8, 128, KV_DTYPE_FP16, 0x5678);
}

static kvd_disk_rec rec_stream(uint64_t k, uint32_t len, int tail) {
    kvd_disk_rec r = rec_of(k, len);
    r.format = KVD_TF_RAW;
    if (tail) {
        r.has_tail = 1;
        for (int i = 0; i < (int)KVD_DISK_TAIL; i++) {
            r.tail[i] = (uint8_t)(k * 7 + (uint64_t)i);
        }
    }
    return r;
}

/* Writes record k (len bytes) streamed, reads it back both ways and checks every byte. */
static void stream_case(kvd_disk *d, uint64_t slot, uint64_t k, uint32_t len, int tail) {
    uint8_t *buf = slot_buf(d);
    uint8_t *want = malloc(len + 1), *got = calloc(1, len + 1);
    assert_non_null(want);
    assert_non_null(got);
    fill_payload(want, len, k);
    kvd_disk_rec r = rec_stream(k, len, tail);
    flow f = {.bytes = want, .len = len};
    int e = 0, ff = 0;
    assert_int_equal(kvd_disk_write_stream(d, slot, &r, flow_fill, &f, buf, &e, &ff), KV_OK);
    assert_int_equal(ff, 0);
    assert_false(f.out_of_order);
    assert_int_equal(f.next, len);
    /* The plain read sees the same record the plain write would have made. */
    kvd_disk_rec rr;
    kv_hash128 h = hash_of(k);
    memset(buf, 0xee, kvd_disk_slot_bytes(d));
    assert_int_equal(kvd_disk_read(d, slot, &h, &rr, buf), KV_OK);
    assert_int_equal(rr.len, len);
    assert_int_equal(rr.has_tail, (uint32_t)tail);
    assert_memory_equal(rr.tail, r.tail, tail ? KVD_DISK_TAIL : 0);
    assert_memory_equal(buf + kvd_disk_payload_off(d, &rr), want, len);
    for (uint64_t i = kvd_disk_payload_off(d, &rr) + len; i < kvd_disk_slot_bytes(d); i++) {
        assert_int_equal(buf[i], 0);
    }
    /* And the streamed read. */
    flow g = {.bytes = got, .len = len};
    memset(&rr, 0, sizeof(rr));
    assert_int_equal(kvd_disk_read_stream(d, slot, &h, &rr, buf, flow_sink, &g), KV_OK);
    assert_false(g.out_of_order);
    assert_int_equal(g.next, len);
    assert_memory_equal(got, want, len);
    assert_true(kv_hash_eq(rr.hash, h));
    assert_int_equal(rr.len, len);
    free(want);
    free(got);
    free(buf);
}

static void stream_lengths(kvd_disk *d) {
    uint32_t max = (uint32_t)kvd_disk_payload_max(d) - KVD_DISK_TAIL;
    /* Around the header block's end (4096 - 64 - the tail's 16 on either side) and a chunk's. */
    uint32_t lens[] = {0,
                       1,
                       100,
                       4015,
                       4016,
                       4017,
                       4032,
                       4033,
                       5000,
                       KVD_DISK_CHUNK + 4016,
                       KVD_DISK_CHUNK + 4032,
                       KVD_DISK_CHUNK + 4033,
                       max / 2 + 3,
                       max};
    uint64_t slot = 0;
    for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++) {
        if (lens[i] > max) {
            continue;
        }
        for (int tail = 0; tail < 2; tail++) {
            stream_case(d, slot, 40 + slot, lens[i], tail);
            slot++;
        }
    }
}

static void test_stream_round_trip(void **state) {
    fixture *fx = *state;
    assert_true(kvd_disk_thread_uring()); /* io_uring works here: the streamed path runs */
    uint64_t fallbacks = kvd_disk_stream_fallbacks();
    kvd_disk_key k;
    key_default(&k);
    kvd_disk *d = open_ok(fx, &k, 1);
    stream_lengths(d); /* 16 KiB slots: one chunk past the header block */
    kvd_disk_close(d);
    key_big(&k);
    snprintf(fx->dir + strlen(fx->dir), sizeof(fx->dir) - strlen(fx->dir), "-big");
    d = open_ok(fx, &k, 1);
    stream_lengths(d); /* 2 MiB slots: eight chunks */
    /* A plain write, read streamed. */
    uint32_t len = (uint32_t)kvd_disk_payload_max(d);
    write_rec(d, 30, 90, len);
    uint8_t *buf = slot_buf(d), *got = malloc(len), *want = malloc(len);
    assert_non_null(got);
    assert_non_null(want);
    fill_payload(want, len, 90);
    flow g = {.bytes = got, .len = len};
    kvd_disk_rec rr;
    kv_hash128 h = hash_of(90);
    assert_int_equal(kvd_disk_read_stream(d, 30, &h, &rr, buf, flow_sink, &g), KV_OK);
    assert_true(g.calls > 1);
    assert_memory_equal(got, want, len);
    check_rec(&rr, 90, len);
    /* Another hash expected, or a slot past the end: corrupt, nothing handed over. */
    kv_hash128 other = hash_of(91);
    g = (flow){.bytes = got, .len = len};
    assert_int_equal(kvd_disk_read_stream(d, 30, &other, &rr, buf, flow_sink, &g), KV_ECORRUPT);
    assert_int_equal(g.calls, 0);
    assert_int_equal(kvd_disk_read_stream(d, 500, NULL, &rr, buf, flow_sink, &g), KV_ECORRUPT);
    assert_int_equal(g.calls, 0);
    /* The caller's sink error stops the read. */
    g = (flow){.bytes = got, .len = len, .fail_at = 3};
    assert_int_equal(kvd_disk_read_stream(d, 30, &h, &rr, buf, flow_sink, &g), KV_ENOMEM);
    /* Every transfer above went through the ring: none fell back to the plain way, save the
     * read of a slot past the end of the file (a short read: the plain read says corrupt). */
    assert_int_equal(kvd_disk_stream_fallbacks() - fallbacks, 1);
    free(buf);
    free(got);
    free(want);
    kvd_disk_close(d);
}

/* A flipped payload byte in any chunk, or in the header: never served. */
static void test_stream_corruption(void **state) {
    fixture *fx = *state;
    kvd_disk_key k;
    key_big(&k);
    kvd_disk *d = open_ok(fx, &k, 1);
    uint64_t sb = kvd_disk_slot_bytes(d);
    uint32_t len = (uint32_t)kvd_disk_payload_max(d);
    uint8_t *buf = slot_buf(d), *want = malloc(len), *got = malloc(len);
    assert_non_null(want);
    assert_non_null(got);
    /* The payload's first bytes, chunks, the slot's last bytes, the header. */
    off_t flips[] = {(off_t)poff(d, 0) + 36, 4096 + 5, 4096 + 3 * KVD_DISK_CHUNK + 77,
                     (off_t)sb - 10, 20};
    for (int i = 0; i < 5; i++) {
        fill_payload(want, len, 60 + (uint64_t)i);
        kvd_disk_rec r = rec_stream(60 + (uint64_t)i, len, 0);
        flow f = {.bytes = want, .len = len};
        int e = 0, ff = 0;
        assert_int_equal(kvd_disk_write_stream(d, (uint64_t)i, &r, flow_fill, &f, buf, &e, &ff),
                         KV_OK);
    }
    kvd_disk_close(d);
    for (int i = 0; i < 5; i++) {
        flip_byte(fx->path, (off_t)KVD_DISK_ALIGN + (off_t)i * (off_t)sb + flips[i]);
    }
    d = open_ok(fx, &k, 1);
    for (int i = 0; i < 5; i++) {
        kvd_disk_rec rr;
        kv_hash128 h = hash_of(60 + (uint64_t)i);
        flow g = {.bytes = got, .len = len};
        kv_err rc = kvd_disk_read_stream(d, (uint64_t)i, &h, &rr, buf, flow_sink, &g);
        assert_int_equal(rc, KV_ECORRUPT); /* the last chunk's last bytes too (a full slot) */
        assert_int_equal(read_slot(d, (uint64_t)i, &h), KV_ECORRUPT);
        if (flips[i] == 20) {
            assert_int_equal(g.calls, 0); /* a bad header: nothing handed over */
        }
    }
    free(buf);
    free(want);
    free(got);
    kvd_disk_close(d);
}

/* fill fails midway over a slot that held a good record: the error comes back as it is, and the
 * slot's old header never vouches for the half-overwritten payload. */
static void test_stream_fill_error(void **state) {
    fixture *fx = *state;
    kvd_disk_key k;
    key_big(&k);
    kvd_disk *d = open_ok(fx, &k, 1);
    uint32_t len = (uint32_t)kvd_disk_payload_max(d);
    write_rec(d, 0, 70, len);
    read_check(d, 0, 70, len);
    uint8_t *buf = slot_buf(d), *want = malloc(len);
    assert_non_null(want);
    fill_payload(want, len, 71);
    kvd_disk_rec r = rec_stream(71, len, 0);
    flow f = {.bytes = want, .len = len, .fail_at = 5};
    int e = 0, ff = 0;
    assert_int_equal(kvd_disk_write_stream(d, 0, &r, flow_fill, &f, buf, &e, &ff), KV_ESYS);
    assert_int_equal(ff, 1);
    kv_hash128 h70 = hash_of(70), h71 = hash_of(71);
    assert_int_equal(read_slot(d, 0, &h70), KV_ECORRUPT); /* chunks written over it */
    assert_int_equal(read_slot(d, 0, &h71), KV_ECORRUPT); /* never vouched for */
    free(buf);
    free(want);
    kvd_disk_close(d);
}

/* KVD_TIER2_URING=off (read at a thread's first streamed I/O): the plain path, same bytes. */
typedef struct plain_arg {
    kvd_disk *d;
    int uring;
} plain_arg;

static void *plain_thread(void *arg) {
    plain_arg *a = arg;
    a->uring = kvd_disk_thread_uring();
    stream_case(a->d, 3, 80, (uint32_t)kvd_disk_payload_max(a->d) - 5, 0);
    stream_case(a->d, 4, 81, 5000, 1);
    return NULL;
}

static void test_stream_without_uring(void **state) {
    fixture *fx = *state;
    kvd_disk_key k;
    key_big(&k);
    kvd_disk *d = open_ok(fx, &k, 1);
    setenv("KVD_TIER2_URING", "off", 1);
    plain_arg a = {d, -1};
    pthread_t th;
    uint64_t before = kvd_disk_stream_fallbacks();
    assert_int_equal(pthread_create(&th, NULL, plain_thread, &a), 0);
    assert_int_equal(pthread_join(th, NULL), 0);
    unsetenv("KVD_TIER2_URING");
    assert_int_equal(a.uring, 0);
    assert_true(kvd_disk_stream_fallbacks() - before >= 4); /* two writes and two reads */
    kvd_disk_close(d);
}

/* ---- zero-copy write and read ------------------------------------------------------------- */

/* Reads slot (record k, len bytes, want) back plain and into the pieces tv (over back), and
 * checks the bytes and the plain read's zero padding. */
static void read_check_pieces(kvd_disk *d, uint64_t slot, uint64_t k, const kvd_disk_piece *tv,
                              uint32_t n, uint64_t len, const uint8_t *want, uint8_t *back,
                              uint8_t *buf) {
    kvd_disk_rec rr;
    kv_hash128 h = hash_of(k);
    memset(buf, 0xee, kvd_disk_slot_bytes(d));
    assert_int_equal(kvd_disk_read(d, slot, &h, &rr, buf), KV_OK);
    assert_int_equal(rr.len, len);
    uint64_t po = kvd_disk_payload_off(d, &rr);
    assert_memory_equal(buf + po, want, len);
    for (uint64_t i = po + len; i < kvd_disk_slot_bytes(d); i++) {
        assert_int_equal(buf[i], 0);
    }
    memset(back, 0, len);
    assert_int_equal(kvd_disk_read_intov(d, slot, &h, &rr, tv, n, len, buf, NULL), KV_OK);
    assert_memory_equal(back, want, len); /* the pieces lie back to back over back */
}

/* The concatenation of n pieces, into out. */
static void pieces_to(const kvd_disk_piece *v, uint32_t n, uint8_t *out) {
    for (uint32_t i = 0; i < n; i++) {
        memcpy(out, v[i].p, v[i].n);
        out += v[i].n;
    }
}

/* 1 when fallocate makes room in directory dir (tmpfs and ext4 do; some file systems do not). */
static int fallocate_works(const char *dir) {
    char p[256];
    snprintf(p, sizeof(p), "%s/falloc.probe", dir);
    int fd = open(p, O_CREAT | O_RDWR, 0600);
    assert_true(fd >= 0);
    int ok = fallocate(fd, 0, 0, 8192) == 0;
    close(fd);
    unlink(p);
    return ok;
}

/* Page-aligned memory of n bytes (+ one page, so that mem + 1 is an unaligned view of n). */
static uint8_t *page_mem(uint64_t n) {
    uint8_t *p =
        aligned_alloc(KVD_DISK_ALIGN, (n + 2 * KVD_DISK_ALIGN) / KVD_DISK_ALIGN * KVD_DISK_ALIGN);
    assert_non_null(p);
    return p;
}

/* Record k of len bytes written from src (aligned or not), read back plain, streamed and into
 * dst (aligned or not); *direct counts the transfers that went the zero-copy way. */
static void direct_case(kvd_disk *d, uint64_t slot, uint64_t k, uint32_t len, int tail, int skew,
                        uint64_t *direct) {
    uint8_t *srcm = page_mem(len), *dstm = page_mem(len), *buf = slot_buf(d);
    uint8_t *src = srcm + skew, *dst = dstm + skew;
    uint8_t *want = malloc(len + 1);
    assert_non_null(want);
    fill_payload(want, len, k);
    memcpy(src, want, len);
    kvd_disk_rec r = rec_stream(k, len, tail);
    uint64_t before = kvd_disk_direct_transfers();
    int e = 0, zc = -1;
    assert_int_equal(kvd_disk_write_from(d, slot, &r, src, buf, &e, &zc), KV_OK);
    assert_memory_equal(src, want, len);                        /* the caller's bytes untouched */
    assert_int_equal(kvd_disk_direct_transfers() - before, zc); /* what it says it did */
    *direct += (uint64_t)zc;
    /* The plain read sees the record the plain write would have made. */
    kvd_disk_rec rr;
    kv_hash128 h = hash_of(k);
    memset(buf, 0xee, kvd_disk_slot_bytes(d));
    assert_int_equal(kvd_disk_read(d, slot, &h, &rr, buf), KV_OK);
    assert_int_equal(rr.len, len);
    assert_int_equal(rr.has_tail, (uint32_t)tail);
    assert_memory_equal(rr.tail, r.tail, tail ? KVD_DISK_TAIL : 0);
    assert_memory_equal(buf + kvd_disk_payload_off(d, &rr), want, len);
    for (uint64_t i = kvd_disk_payload_off(d, &rr) + len; i < kvd_disk_slot_bytes(d); i++) {
        assert_int_equal(buf[i], 0);
    }
    /* Into dst. */
    memset(dst, 0x5a, len);
    memset(&rr, 0, sizeof(rr));
    before = kvd_disk_direct_transfers();
    zc = -1;
    assert_int_equal(kvd_disk_read_into(d, slot, &h, &rr, dst, len, buf, &zc), KV_OK);
    assert_int_equal(kvd_disk_direct_transfers() - before, zc);
    *direct += (uint64_t)zc;
    assert_memory_equal(dst, want, len);
    assert_true(kv_hash_eq(rr.hash, h));
    assert_int_equal(rr.len, len);
    assert_int_equal(rr.has_tail, (uint32_t)tail);
    assert_memory_equal(rr.tail, r.tail, tail ? KVD_DISK_TAIL : 0);
    /* The streamed read of the same record. */
    uint8_t *got = calloc(1, len + 1);
    assert_non_null(got);
    flow g = {.bytes = got, .len = len};
    assert_int_equal(kvd_disk_read_stream(d, slot, &h, &rr, buf, flow_sink, &g), KV_OK);
    assert_int_equal(g.next, len);
    assert_memory_equal(got, want, len);
    free(got);
    /* Another length or another hash asked for: corrupt. */
    kv_hash128 other = hash_of(k + 1);
    assert_int_equal(kvd_disk_read_into(d, slot, &other, &rr, dst, len, buf, NULL), KV_ECORRUPT);
    if (len > 0) {
        assert_int_equal(kvd_disk_read_into(d, slot, &h, &rr, dst, len - 1, buf, NULL),
                         KV_ECORRUPT);
    }
    if (len + 1 <= kvd_disk_payload_max(d)) {
        uint8_t *more = page_mem(len + 1);
        assert_int_equal(kvd_disk_read_into(d, slot, &h, &rr, more + skew, len + 1, buf, NULL),
                         KV_ECORRUPT);
        free(more);
    }
    free(want);
    free(srcm);
    free(dstm);
    free(buf);
}

/* write_from / read_into over every shape of length (whole pages, a partial last page, less
 * than a page, empty), with a tail and without, from aligned and unaligned memory, on 16 KiB
 * and 2 MiB slots: the same records as the plain write, and in format 2 with io_uring the aligned
 * ones go the zero-copy way. */
static void test_direct_transfers(void **state) {
    fixture *fx = *state;
    kvd_disk_key k;
    for (int big = 0; big < 2; big++) {
        if (big) {
            key_big(&k);
            snprintf(fx->dir + strlen(fx->dir), sizeof(fx->dir) - strlen(fx->dir), "-big");
        } else {
            key_default(&k);
        }
        kvd_disk *d = open_ok(fx, &k, 1);
        uint32_t bb = (uint32_t)k.layout.block_bytes;
        uint32_t lens[] = {bb, 0, 1, 4095, 4096, 4097, 3 * 4096, bb - 1, bb / 2 + 7};
        int direct_at_open = kvd_disk_direct(d);
        uint64_t slot = 0, direct = 0, aligned = 0;
        for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++) {
            for (int tail = 0; tail < 2; tail++) {
                for (int skew = 0; skew < 2; skew++) {
                    direct_case(d, slot, 70 + slot, lens[i], tail, skew, &direct);
                    slot++;
                    aligned += skew == 0;
                }
            }
        }
        /* A streamed write read back into memory, and a plain one. */
        for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++) {
            for (int tail = 0; tail < 2; tail++) {
                uint32_t len = lens[i];
                uint8_t *want = malloc(len + 1), *dst = page_mem(len), *buf = slot_buf(d);
                assert_non_null(want);
                fill_payload(want, len, 500 + i);
                kvd_disk_rec r = rec_stream(500 + i, len, tail);
                flow f = {.bytes = want, .len = len};
                int e = 0, ff = 0, zc = -1;
                uint64_t s2 = 200 + 2 * i + (uint64_t)tail;
                assert_int_equal(kvd_disk_write_stream(d, s2, &r, flow_fill, &f, buf, &e, &ff),
                                 KV_OK);
                kvd_disk_rec rr;
                kv_hash128 h = hash_of(500 + i);
                assert_int_equal(kvd_disk_read_into(d, s2, &h, &rr, dst, len, buf, &zc), KV_OK);
                assert_memory_equal(dst, want, len);
                assert_memory_equal(rr.tail, r.tail, tail ? KVD_DISK_TAIL : 0);
                memcpy(buf + kvd_disk_payload_off(d, &r), want, len);
                assert_int_equal(
                    kvd_disk_write(d, s2, &r, buf + kvd_disk_payload_off(d, &r), buf, &e), KV_OK);
                memset(dst, 0, len);
                assert_int_equal(kvd_disk_read_into(d, s2, &h, &rr, dst, len, buf, &zc), KV_OK);
                assert_memory_equal(dst, want, len);
                free(want);
                free(dst);
                free(buf);
            }
        }
        print_message("format %u, %llu KiB slots, O_DIRECT %s: %llu of %llu transfers zero-copy\n",
                      kvd_disk_format(d), (unsigned long long)(kvd_disk_slot_bytes(d) >> 10),
                      kvd_disk_direct(d) ? "on" : "off", (unsigned long long)direct,
                      (unsigned long long)(2 * slot));
        if (FMT1) {
            assert_int_equal(direct, 0); /* format 1: the copying way, always */
        } else if (kvd_disk_thread_uring()) {
            /* Each case's write and good read (failed reads are not counted): every aligned
             * case's, and with O_DIRECT off (buffered) the unaligned ones' too. A file system
             * that took O_DIRECT at open and refused its first transfer turned it off midway. */
            if (direct_at_open == kvd_disk_direct(d)) {
                assert_int_equal(direct, kvd_disk_direct(d) ? 2 * aligned : 2 * slot);
            } else {
                assert_true(direct + 2 >= 2 * aligned);
            }
        }
        kvd_disk_close(d);
    }
}

/* A flipped byte in a whole page, in the partial last page or in the tail: read_into says
 * corrupt; a slot past the end too. */
static void test_direct_corruption(void **state) {
    fixture *fx = *state;
    kvd_disk_key k;
    key_big(&k);
    kvd_disk *d = open_ok(fx, &k, 1);
    uint64_t sb = kvd_disk_slot_bytes(d);
    uint32_t len = (uint32_t)k.layout.block_bytes - 100; /* a partial last page */
    uint8_t *src = page_mem(len), *dst = page_mem(len), *buf = slot_buf(d);
    off_t at[4];
    for (int i = 0; i < 4; i++) {
        fill_payload(src, len, 90 + (uint64_t)i);
        kvd_disk_rec r = rec_stream(90 + (uint64_t)i, len, 1);
        int e = 0, zc = -1;
        assert_int_equal(kvd_disk_write_from(d, (uint64_t)i, &r, src, buf, &e, &zc), KV_OK);
        /* The zero-copy way where io_uring is (O_DIRECT on or off: src is aligned). */
        assert_int_equal(zc, FMT1 ? 0 : kvd_disk_thread_uring());
        uint64_t p = kvd_disk_payload_off(d, &r);
        off_t where[4] = {(off_t)(p + 5 * KVD_DISK_CHUNK + 11), (off_t)(p + len - 3),
                          KVD_DISK_REC_HDR + 2, (off_t)p};
        at[i] = (off_t)KVD_DISK_ALIGN + (off_t)i * (off_t)sb + where[i];
    }
    kvd_disk_close(d);
    for (int i = 0; i < 4; i++) {
        flip_byte(fx->path, at[i]);
    }
    d = open_ok(fx, &k, 1);
    for (int i = 0; i < 4; i++) {
        kvd_disk_rec rr;
        kv_hash128 h = hash_of(90 + (uint64_t)i);
        assert_int_equal(kvd_disk_read_into(d, (uint64_t)i, &h, &rr, dst, len, buf, NULL),
                         KV_ECORRUPT);
    }
    kvd_disk_rec rr;
    assert_int_equal(kvd_disk_read_into(d, 400, NULL, &rr, dst, len, buf, NULL), KV_ECORRUPT);
    /* Bad arguments. */
    int e = 0;
    kvd_disk_rec r = rec_stream(1, len, 0);
    assert_int_equal(kvd_disk_write_from(d, 0, &r, NULL, buf, &e, NULL), KV_EINVAL);
    r.len = (uint32_t)kvd_disk_payload_max(d) + 1;
    assert_int_equal(kvd_disk_write_from(d, 0, &r, src, buf, &e, NULL), KV_EINVAL);
    assert_int_equal(kvd_disk_read_into(d, 0, NULL, &rr, NULL, len, buf, NULL), KV_EINVAL);
    free(src);
    free(dst);
    free(buf);
    kvd_disk_close(d);
}

/* A block in pieces (layer-major): write_fromv / read_intov against every other way, pieces
 * of whole pages (zero-copy in format 2 with io_uring), pieces that are not (copying), a piece
 * list that does not add up (refused), and a flipped byte in the middle piece (corrupt). */
static void test_direct_pieces(void **state) {
    fixture *fx = *state;
    kvd_disk_key k;
    key_big(&k);
    kvd_disk *d = open_ok(fx, &k, 1);
    /* A file system that takes O_DIRECT at open and refuses its first transfer turns it off
     * then: that transfer copies. */
    int direct_at_open = kvd_disk_direct(d);
    uint32_t len = (uint32_t)k.layout.block_bytes; /* 2 MiB */
    uint8_t *img = page_mem(len), *back = page_mem(len), *buf = slot_buf(d);
    uint8_t *want = malloc(len);
    assert_non_null(want);
    /* 64 pieces of 32 KiB (32 layers x K, V), in the order they appear, at scattered places of
     * img (the second half first), as a layer-major pool's are; then 3 pieces not whole pages. */
    kvd_disk_piece pv[64], bv[64];
    uint32_t shapes[2] = {64, 3};
    uint64_t slot = 0;
    for (int shape = 0; shape < 2; shape++) {
        uint32_t n = shapes[shape];
        uint64_t each = len / n, at = 0;
        for (uint32_t i = 0; i < n; i++) {
            uint64_t sz = i + 1 == n ? len - at : each;
            uint64_t where = shape == 0 ? ((uint64_t)(i + n / 2) % n) * each : at;
            pv[i] = (kvd_disk_piece){img + where, sz};
            bv[i] = (kvd_disk_piece){back + where, sz};
            at += sz;
        }
        for (int tail = 0; tail < 2; tail++, slot++) {
            fill_payload(img, len, 300 + slot);
            pieces_to(pv, n, want);
            kvd_disk_rec r = rec_stream(300 + slot, len, tail);
            int e = 0, zc = -1;
            assert_int_equal(kvd_disk_write_fromv(d, slot, &r, pv, n, buf, &e, &zc), KV_OK);
            int expect_zc = !FMT1 && shape == 0 && kvd_disk_thread_uring();
            assert_true(zc == expect_zc || (direct_at_open && !kvd_disk_direct(d)));
            /* The plain read sees the concatenation of the pieces. */
            kvd_disk_rec rr;
            kv_hash128 h = hash_of(300 + slot);
            assert_int_equal(kvd_disk_read(d, slot, &h, &rr, buf), KV_OK);
            assert_memory_equal(buf + kvd_disk_payload_off(d, &rr), want, len);
            assert_memory_equal(rr.tail, r.tail, tail ? KVD_DISK_TAIL : 0);
            /* Into pieces, and into one piece. */
            memset(back, 0, len);
            zc = -1;
            assert_int_equal(kvd_disk_read_intov(d, slot, &h, &rr, bv, n, len, buf, &zc), KV_OK);
            assert_true(zc == expect_zc || (direct_at_open && !kvd_disk_direct(d)));
            uint8_t *got = malloc(len);
            assert_non_null(got);
            pieces_to(bv, n, got);
            assert_memory_equal(got, want, len);
            assert_int_equal(kvd_disk_read_into(d, slot, &h, &rr, back, len, buf, NULL), KV_OK);
            assert_memory_equal(back, want, len);
            /* A streamed write read back into pieces. */
            flow f = {.bytes = want, .len = len};
            int ff = 0;
            assert_int_equal(kvd_disk_write_stream(d, 40 + slot, &r, flow_fill, &f, buf, &e, &ff),
                             KV_OK);
            memset(back, 0, len);
            assert_int_equal(kvd_disk_read_intov(d, 40 + slot, &h, &rr, bv, n, len, buf, NULL),
                             KV_OK);
            pieces_to(bv, n, got);
            assert_memory_equal(got, want, len);
            free(got);
        }
    }
    /* Pieces that do not add up to the record, or none. */
    kvd_disk_rec r = rec_stream(9, len, 0);
    int e = 0;
    pv[0].n -= 4096;
    assert_int_equal(kvd_disk_write_fromv(d, 9, &r, pv, 3, buf, &e, NULL), KV_EINVAL);
    kvd_disk_rec rr;
    assert_int_equal(kvd_disk_read_intov(d, 0, NULL, &rr, pv, 3, len, buf, NULL), KV_EINVAL);
    assert_int_equal(kvd_disk_write_fromv(d, 9, &r, NULL, 0, buf, &e, NULL), KV_EINVAL);
    /* Shorter records than the slot (its padding written too) in pieces: 500 pieces of 4 KiB
     * (8 groups, the last one short), and 3 pieces of which one is 1 MiB. */
    for (int c = 0; c < 2; c++) {
        uint32_t n = c == 0 ? 500 : 3;
        kvd_disk_piece sv[500], tv[500];
        uint64_t tot = 0;
        for (uint32_t i = 0; i < n; i++) {
            uint64_t sz = c == 0 ? 4096 : (i == 1 ? (1u << 20) : 8192);
            sv[i] = (kvd_disk_piece){img + tot, sz};
            tv[i] = (kvd_disk_piece){back + tot, sz};
            tot += sz;
        }
        fill_payload(img, tot, 700 + (uint64_t)c);
        memcpy(want, img, tot);
        kvd_disk_rec sr = rec_stream(700 + (uint64_t)c, (uint32_t)tot, c);
        int e2 = 0, zc = -1;
        assert_int_equal(kvd_disk_write_fromv(d, 60 + (uint64_t)c, &sr, sv, n, buf, &e2, &zc),
                         KV_OK);
        assert_true(zc == (!FMT1 && kvd_disk_thread_uring()) ||
                    (direct_at_open && !kvd_disk_direct(d)));
        read_check_pieces(d, 60 + (uint64_t)c, 700 + (uint64_t)c, tv, n, tot, want, back, buf);
    }
    kvd_disk_close(d);
    /* A flipped byte inside piece 33 of slot 0 (64 pieces): corrupt. */
    flip_byte(fx->path, (off_t)(4096 + KVD_DISK_ALIGN * (FMT1 ? 0 : 1) + 33 * (len / 64) + 77));
    d = open_ok(fx, &k, 1);
    kv_hash128 h0 = hash_of(300);
    for (uint32_t i = 0; i < 64; i++) {
        bv[i] = (kvd_disk_piece){back + i * (len / 64), len / 64};
    }
    assert_int_equal(kvd_disk_read_intov(d, 0, &h0, &rr, bv, 64, len, buf, NULL), KV_ECORRUPT);
    free(img);
    free(back);
    free(buf);
    free(want);
    kvd_disk_close(d);
}

/* A format 1 file (made by kvd before format 2) opened by a kvd that makes format 2 files: kept,
 * read and written in its own format. New files: format 2 where it costs no room. */
static void test_format1_file_kept(void **state) {
    fixture *fx = *state;
    kvd_disk_key k;
    key_default(&k);
    kvd_disk *d = NULL;
    char msg[256] = "";
    assert_int_equal(kvd_disk_open(fx->dir, NAME, &k, KVD_DISK_FORMAT1, &d, msg, sizeof(msg)),
                     KV_OK);
    assert_int_equal(kvd_disk_format(d), 1);
    write_rec(d, 0, 5, 15360);
    write_rec(d, 1, 6, 100);
    kvd_disk_close(d);
    d = NULL;
    assert_int_equal(kvd_disk_open(fx->dir, NAME, &k, KVD_DISK_DIRECT, &d, msg, sizeof(msg)),
                     KV_OK);
    assert_int_equal(kvd_disk_format(d), 1);
    assert_int_equal(kvd_disk_slot_bytes(d), 16384);
    assert_int_equal(logs.file_warns, 0);
    read_check(d, 0, 5, 15360);
    read_check(d, 1, 6, 100);
    uint64_t direct = 0;
    direct_case(d, 2, 7, 15360, 1, 0, &direct);
    assert_int_equal(direct, 0);
    scan_log s;
    uint64_t bad;
    do_scan(d, &s, &bad);
    assert_int_equal(s.n, 3);
    assert_int_equal(bad, 0);
    kvd_disk_close(d);
    /* New files: 15360-byte blocks would pay a page a slot for format 2's header (20480 against
     * 16384): format 1; 2 MiB blocks pay nothing: format 2. */
    d = NULL;
    assert_int_equal(kvd_disk_open(fx->dir, "small.t2", &k, 0, &d, msg, sizeof(msg)), KV_OK);
    assert_int_equal(kvd_disk_format(d), 1);
    kvd_disk_close(d);
    key_big(&k);
    d = NULL;
    assert_int_equal(kvd_disk_open(fx->dir, "big.t2", &k, 0, &d, msg, sizeof(msg)), KV_OK);
    assert_int_equal(kvd_disk_format(d), 2);
    assert_int_equal(kvd_disk_slot_bytes(d), (2u << 20) + 4096);
    kvd_disk_close(d);
}

/* Preallocation: the first write past the end grows the file a step ahead (here up to the
 * limit: 10 slots); the slots made so are empty to scan and read; a write past the limit
 * extends the file as without it; a reopened file keeps what is on disk. */
static void test_preallocate(void **state) {
    fixture *fx = *state;
    if (!fallocate_works(fx->root)) {
        skip(); /* the writes extend the file as without preallocation (test_threads) */
    }
    kvd_disk_key k;
    key_default(&k);
    kvd_disk *d = open_ok(fx, &k, 1);
    uint64_t sb = kvd_disk_slot_bytes(d);
    kvd_disk_preallocate(d, 4096 + 10 * sb, 64ull << 20);
    write_rec(d, 2, 20, 1000);
    assert_int_equal(file_size(fx->path), 4096 + 10 * (off_t)sb);
    assert_int_equal(kvd_disk_slots(d), 10);
    write_rec(d, 9, 29, 3000);
    assert_int_equal(kvd_disk_slots(d), 10);
    scan_log s;
    uint64_t bad;
    do_scan(d, &s, &bad);
    assert_int_equal(s.n, 2);
    assert_int_equal(bad, 0);
    assert_int_equal(read_slot(d, 5, NULL), KV_ECORRUPT); /* made, never written: empty */
    read_check(d, 2, 20, 1000);
    write_rec(d, 12, 32, 500); /* past the limit: the write extends the file itself */
    assert_int_equal(kvd_disk_slots(d), 13);
    kvd_disk_close(d);
    d = open_ok(fx, &k, 1);
    assert_int_equal(kvd_disk_slots(d), 13);
    do_scan(d, &s, &bad);
    assert_int_equal(s.n, 3);
    read_check(d, 9, 29, 3000);
    read_check(d, 12, 32, 500);
    /* With 2 MiB slots the step is 64 MiB of whole slots: 31 a step. */
    kvd_disk_close(d);
    key_big(&k);
    snprintf(fx->dir + strlen(fx->dir), sizeof(fx->dir) - strlen(fx->dir), "-big");
    snprintf(fx->path, sizeof(fx->path), "%s/%s", fx->dir, NAME);
    d = open_ok(fx, &k, 1);
    sb = kvd_disk_slot_bytes(d);
    kvd_disk_preallocate(d, 1ull << 30, 64ull << 20);
    uint64_t step = (64ull << 20) / sb;
    write_rec(d, 0, 1, 100);
    assert_int_equal(kvd_disk_slots(d), step);
    write_rec(d, step, 2, 100);
    assert_int_equal(kvd_disk_slots(d), 2 * step);
    read_check(d, 0, 1, 100);
    read_check(d, step, 2, 100);
    /* A smaller step: 3 slots. */
    kvd_disk_preallocate(d, 1ull << 30, 3 * sb + 100);
    write_rec(d, 2 * step, 3, 100);
    assert_int_equal(kvd_disk_slots(d), 2 * step + 3);
    kvd_disk_close(d);
}

#define NTHREADS 4
#define PER_THREAD 16

typedef struct worker {
    kvd_disk *d;
    int t;
    int failures; /* checks that failed (cmocka asserts are not for worker threads) */
} worker;

static void *worker_main(void *arg) {
    worker *w = arg;
    uint8_t *buf = aligned_alloc(KVD_DISK_ALIGN, kvd_disk_slot_bytes(w->d));
    uint8_t *want = malloc(kvd_disk_slot_bytes(w->d));
    if (buf == NULL || want == NULL) {
        w->failures++;
        goto done;
    }
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < PER_THREAD; i++) {
            uint64_t slot = (uint64_t)(w->t + NTHREADS * i);
            uint64_t k = slot * 7 + (uint64_t)round;
            uint32_t len = (uint32_t)(100 + slot * 211 % 16000);
            fill_payload(buf + poff(w->d, 0), len, k);
            kvd_disk_rec r = rec_of(k, len);
            int e = 0;
            if (kvd_disk_write(w->d, slot, &r, buf + poff(w->d, 0), buf, &e) != KV_OK) {
                w->failures++;
            }
        }
        for (int i = 0; i < PER_THREAD; i++) {
            uint64_t slot = (uint64_t)(w->t + NTHREADS * i);
            uint64_t k = slot * 7 + (uint64_t)round;
            uint32_t len = (uint32_t)(100 + slot * 211 % 16000);
            kv_hash128 h = hash_of(k);
            kvd_disk_rec got;
            fill_payload(want, len, k);
            if (kvd_disk_read(w->d, slot, &h, &got, buf) != KV_OK || got.len != len ||
                got.seq != 1000 + k || memcmp(buf + poff(w->d, 0), want, len) != 0) {
                w->failures++;
            }
        }
    }
done:
    free(buf);
    free(want);
    return NULL;
}

static void test_threads(void **state) {
    fixture *fx = *state;
    kvd_disk_key k;
    key_default(&k);
    kvd_disk *d = open_ok(fx, &k, 1);
    /* The file grows ahead under the writers, 5 slots a step, up to 3 slots past theirs. */
    uint64_t sb = kvd_disk_slot_bytes(d);
    kvd_disk_preallocate(d, 4096 + (NTHREADS * PER_THREAD + 3) * sb, 5 * sb);
    int grows = fallocate_works(fx->root);
    worker w[NTHREADS];
    pthread_t th[NTHREADS];
    for (int t = 0; t < NTHREADS; t++) {
        w[t] = (worker){.d = d, .t = t, .failures = 0};
        assert_int_equal(pthread_create(&th[t], NULL, worker_main, &w[t]), 0);
    }
    for (int t = 0; t < NTHREADS; t++) {
        assert_int_equal(pthread_join(th[t], NULL), 0);
        assert_int_equal(w[t].failures, 0);
    }
    kvd_disk_close(d);
    d = open_ok(fx, &k, 0);
    /* With fallocate, up to 3 made and never written (how many: the order of the writes). */
    uint64_t n = kvd_disk_slots(d);
    assert_true(n >= NTHREADS * PER_THREAD && n <= NTHREADS * PER_THREAD + (grows ? 3 : 0));
    scan_log s;
    uint64_t bad;
    do_scan(d, &s, &bad);
    assert_int_equal(bad, 0);
    assert_int_equal(s.n, NTHREADS * PER_THREAD);
    for (int i = 0; i < s.n; i++) {
        assert_int_equal(s.slot[i], (uint64_t)i);
        assert_int_equal(s.rec[i].seq, 1000 + (uint64_t)i * 7 + 1);
    }
    kvd_disk_close(d);
}

static int group_format1(void **state) {
    (void)state;
    fmt_flags = KVD_DISK_FORMAT1;
    return 0;
}

int main(void) {
    umask(022);
    kv_log_set_sink(log_sink, NULL);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_open_creates, setup, teardown),
        cmocka_unit_test_setup_teardown(test_open_bad_args, setup, teardown),
        cmocka_unit_test_setup_teardown(test_round_trip_and_scan, setup, teardown),
        cmocka_unit_test_setup_teardown(test_tail, setup, teardown),
        cmocka_unit_test_setup_teardown(test_corruption_and_clear, setup, teardown),
        cmocka_unit_test_setup_teardown(test_foreign_key_renamed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_damaged_header_renamed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_direct, setup, teardown),
        cmocka_unit_test_setup_teardown(test_threads, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stream_round_trip, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stream_corruption, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stream_fill_error, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stream_without_uring, setup, teardown),
        cmocka_unit_test_setup_teardown(test_direct_transfers, setup, teardown),
        cmocka_unit_test_setup_teardown(test_direct_corruption, setup, teardown),
        cmocka_unit_test_setup_teardown(test_direct_pieces, setup, teardown),
        cmocka_unit_test_setup_teardown(test_preallocate, setup, teardown),
    };
    const struct CMUnitTest once[] = {
        cmocka_unit_test_setup_teardown(test_format1_file_kept, setup, teardown),
    };
    int failed = cmocka_run_group_tests_name("format 2", tests, NULL, NULL);
    failed += cmocka_run_group_tests_name("both formats", once, NULL, NULL);
    failed += cmocka_run_group_tests_name("format 1", tests, group_format1, NULL);
    return failed;
}
