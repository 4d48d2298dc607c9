/* kvd_index: open-addressing prefix index (see index.h).
 *
 * Slots are 32 bytes, two per cache line, in one anonymous mapping on transparent huge pages;
 * home slots are the first of a line.
 * A table up to INDEX_PREFAULT_MAX bytes (the default index-entries' 64 MiB among them) is
 * faulted in when it is made: otherwise each of the first inserts into an untouched 2 MiB
 * region zeroes a huge page on the loop thread (measured: a fresh daemon's first Commit of 48
 * blocks took 138 ms, 48 such faults). A larger table stays lazy (zero pages cost nothing until
 * touched, so a table sized for 100 M entries is cheap while it is mostly empty). The home
 * slot comes from a keyed mix of (namespace, hash): block hashes arrive from clients, so a
 * per-index random key keeps a client from choosing hashes that pile onto one probe run.
 * Deletion shifts the following run back instead of leaving tombstones, so probe lengths
 * depend only on the current load.
 */
#include "daemon/core/index.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <time.h>

#include "common/kv_log.h"

typedef struct index_slot {
    uint64_t lo;    /* hash, low half */
    uint64_t hi;    /* hash, high half */
    uint64_t value; /* caller's value */
    uint32_t ns;    /* namespace (pool id) */
    uint32_t used;  /* 1 when the slot holds an entry */
} index_slot;

_Static_assert(sizeof(index_slot) == 32, "index slot must be 32 bytes");

struct kvd_index {
    index_slot *slots; /* capacity slots, mmap'd */
    size_t mask;       /* capacity - 1 */
    size_t count;      /* entries present */
    size_t max_load;   /* insert refuses beyond this many entries */
    size_t reserved;   /* entries pools may still make (kvd_index_reserve); <= max_load */
    unsigned shift;    /* 64 - log2(capacity) */
    uint64_t key;      /* random key of the home-slot mix */
};

/* Load limit for the table's own probe lengths; sizing guarantees max_entries fit below 0.7. */
#define INDEX_MAX_LOAD_NUM 7
#define INDEX_MAX_LOAD_DEN 8
/* 32 and 64 measured slower at 1e7 entries (core_bench's index row). */
#define INDEX_PREFETCH_AHEAD 16
#define INDEX_LINE_SLOTS 2 /* slots per 64-byte cache line */
/* Probes in flight at once in a table too large for the caches (probe_wide): 8 and 24 measured
 * slower at 1e7 entries; 12-20 alike. */
#define INDEX_WIDE_PROBES 16
/* Tables at least this large are probed by probe_wide: below it the table sits in the
 * last-level cache and the in-order loop is faster (measured: 8 MiB in-order 91-109 M probes/s,
 * interleaved 75-84; 16 MiB in-order 42-48, interleaved 49-55). */
#define INDEX_WIDE_BYTES ((size_t)16 << 20)

static inline size_t index_home(const kvd_index *idx, uint32_t ns, uint64_t lo, uint64_t hi) {
    uint64_t x = (lo ^ idx->key) + ((uint64_t)ns * 0x9E3779B97F4A7C15ull);
    x ^= hi + (x >> 29);
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 32;
    x *= 0x94D049BB133111EBull;
    /* Homes are the first slot of a cache line: a run then leaves its home line only past two
     * entries (measured at 1e7 entries, load 0.6: 16% of hits read a second line instead of
     * 22%, 1.29 lines per hit instead of 1.37). */
    return (size_t)(x >> idx->shift) & ~(size_t)(INDEX_LINE_SLOTS - 1);
}

static uint64_t index_random_key(void) {
    uint64_t k = 0;
    if (getrandom(&k, sizeof(k), GRND_NONBLOCK) != (ssize_t)sizeof(k)) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        k = (uint64_t)ts.tv_nsec * 0x9E3779B97F4A7C15ull ^ (uint64_t)ts.tv_sec;
    }
    return k;
}

/* The smallest power-of-two capacity keeping entries at load <= 0.7, and its log2. */
static size_t index_capacity_for(size_t entries, unsigned *bits_out) {
    size_t cap = 16;
    unsigned bits = 4;
    while ((double)entries > 0.7 * (double)cap) {
        cap <<= 1;
        bits++;
    }
    *bits_out = bits;
    return cap;
}

#define INDEX_PREFAULT_MAX ((size_t)256 << 20)
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

static index_slot *index_map(size_t cap) {
    size_t bytes = cap * sizeof(index_slot);
    void *mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mem == MAP_FAILED) {
        return NULL;
    }
    if (bytes >= ((size_t)4 << 20)) {
        (void)madvise(mem, bytes, MADV_HUGEPAGE); /* fewer TLB misses */
    }
    if (bytes <= INDEX_PREFAULT_MAX && madvise(mem, bytes, MADV_POPULATE_WRITE) != 0) {
        /* An older kernel: touch every page (the zero bytes change nothing). */
        volatile uint8_t *p = mem;
        for (size_t off = 0; off < bytes; off += 4096) {
            p[off] = 0;
        }
    }
    return mem;
}

kv_err kvd_index_alloc(size_t max_entries, kvd_index **out) {
    if (max_entries == 0 || max_entries > ((size_t)1 << 40)) {
        return KV_EINVAL;
    }
    unsigned bits;
    size_t cap = index_capacity_for(max_entries, &bits);
    kvd_index *idx = calloc(1, sizeof(*idx));
    if (idx == NULL) {
        return KV_ENOMEM;
    }
    idx->slots = index_map(cap);
    if (idx->slots == NULL) {
        free(idx);
        return KV_ENOMEM;
    }
    idx->mask = cap - 1;
    idx->shift = 64 - bits;
    idx->max_load = cap / INDEX_MAX_LOAD_DEN * INDEX_MAX_LOAD_NUM;
    idx->key = index_random_key();
    *out = idx;
    return KV_OK;
}

/* Moves every entry into a table of cap slots (same key, new home slots). */
static kv_err index_rehash(kvd_index *idx, size_t cap, unsigned bits) {
    index_slot *n = index_map(cap);
    if (n == NULL) {
        return KV_ENOMEM;
    }
    index_slot *old = idx->slots;
    size_t old_cap = idx->mask + 1;
    idx->slots = n;
    idx->mask = cap - 1;
    idx->shift = 64 - bits;
    idx->max_load = cap / INDEX_MAX_LOAD_DEN * INDEX_MAX_LOAD_NUM;
    for (size_t i = 0; i < old_cap; i++) {
        const index_slot *s = &old[i];
        if (!s->used) {
            continue;
        }
        size_t j = index_home(idx, s->ns, s->lo, s->hi);
        while (n[j].used) {
            j = (j + 1) & idx->mask;
        }
        n[j] = *s;
    }
    munmap(old, old_cap * sizeof(index_slot));
    return KV_OK;
}

kv_err kvd_index_reserve(kvd_index *idx, size_t n) {
    if (n > ((size_t)1 << 40) - idx->reserved) {
        return KV_ENOMEM;
    }
    size_t want = idx->reserved + n;
    if (want > idx->max_load) {
        unsigned bits;
        size_t cap = index_capacity_for(want, &bits);
        size_t old_cap = idx->mask + 1;
        kv_err err = index_rehash(idx, cap, bits);
        if (err != KV_OK) {
            KV_LOG(WARN, "KVD-INDEX-GROW", "prefix index: no memory to grow from %zu to %zu slots",
                   old_cap, cap);
            return err;
        }
        KV_LOG(INFO, "KVD-INDEX-GROW",
               "prefix index grew from %zu to %zu slots (%zu entries, room for %zu)", old_cap, cap,
               idx->count, want);
    }
    idx->reserved = want;
    return KV_OK;
}

void kvd_index_unreserve(kvd_index *idx, size_t n) {
    KV_ASSERT(n <= idx->reserved);
    idx->reserved -= n;
}

size_t kvd_index_reserved(const kvd_index *idx) {
    return idx->reserved;
}

void kvd_index_free(kvd_index *idx) {
    if (idx == NULL) {
        return;
    }
    if (idx->slots != NULL) {
        munmap(idx->slots, (idx->mask + 1) * sizeof(index_slot));
    }
    free(idx);
}

/* Position of (ns, h), or SIZE_MAX when absent. */
static size_t index_locate(const kvd_index *idx, uint32_t ns, kv_hash128 h) {
    size_t i = index_home(idx, ns, h.lo, h.hi);
    for (;;) {
        const index_slot *s = &idx->slots[i];
        if (!s->used) {
            return SIZE_MAX;
        }
        if (s->lo == h.lo && s->hi == h.hi && s->ns == ns) {
            return i;
        }
        i = (i + 1) & idx->mask;
    }
}

kv_err kvd_index_insert(kvd_index *idx, uint32_t ns, kv_hash128 h, uint64_t value,
                        uint64_t *existing) {
    size_t i = index_home(idx, ns, h.lo, h.hi);
    for (;;) {
        index_slot *s = &idx->slots[i];
        if (!s->used) {
            break;
        }
        if (s->lo == h.lo && s->hi == h.hi && s->ns == ns) {
            if (existing != NULL) {
                *existing = s->value;
            }
            return KV_EEXIST;
        }
        i = (i + 1) & idx->mask;
    }
    if (idx->count >= idx->max_load) {
        return KV_ENOSPC;
    }
    index_slot *s = &idx->slots[i];
    s->lo = h.lo;
    s->hi = h.hi;
    s->value = value;
    s->ns = ns;
    s->used = 1;
    idx->count++;
    return KV_OK;
}

kv_err kvd_index_find(const kvd_index *idx, uint32_t ns, kv_hash128 h, uint64_t *value) {
    size_t i = index_locate(idx, ns, h);
    if (i == SIZE_MAX) {
        return KV_ENOENT;
    }
    *value = idx->slots[i].value;
    return KV_OK;
}

kv_err kvd_index_remove(kvd_index *idx, uint32_t ns, kv_hash128 h) {
    size_t i = index_locate(idx, ns, h);
    if (i == SIZE_MAX) {
        return KV_ENOENT;
    }
    /* Backward shift: move each later entry of the run into the hole unless its home lies
     * cyclically in (hole, j], where moving it would put it before its home. */
    size_t j = i;
    for (;;) {
        j = (j + 1) & idx->mask;
        index_slot *s = &idx->slots[j];
        if (!s->used) {
            break;
        }
        size_t k = index_home(idx, s->ns, s->lo, s->hi);
        int stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            idx->slots[i] = *s;
            i = j;
        }
    }
    memset(&idx->slots[i], 0, sizeof(index_slot));
    KV_ASSERT(idx->count > 0);
    idx->count--;
    return KV_OK;
}

/* In order, prefetching the home slots INDEX_PREFETCH_AHEAD hashes ahead: a long prompt's
 * probes are independent cache misses, and this lets the memory system serve them in parallel.
 * Each home is computed once and kept in a ring until its probe (the mix is ~10 instructions). */
static size_t probe_in_order(const kvd_index *idx, uint32_t ns, const kv_hash128 *hashes, size_t n,
                             uint64_t *values) {
    size_t home[INDEX_PREFETCH_AHEAD];
    size_t ahead = n < INDEX_PREFETCH_AHEAD ? n : INDEX_PREFETCH_AHEAD;
    for (size_t i = 0; i < ahead; i++) {
        home[i] = index_home(idx, ns, hashes[i].lo, hashes[i].hi);
        __builtin_prefetch(&idx->slots[home[i]], 0, 1);
    }
    for (size_t i = 0; i < n; i++) {
        size_t at = i % INDEX_PREFETCH_AHEAD;
        size_t pos = home[at];
        if (i + INDEX_PREFETCH_AHEAD < n) {
            const kv_hash128 *p = &hashes[i + INDEX_PREFETCH_AHEAD];
            home[at] = index_home(idx, ns, p->lo, p->hi);
            __builtin_prefetch(&idx->slots[home[at]], 0, 1);
        }
        kv_hash128 h = hashes[i];
        for (;;) {
            const index_slot *s = &idx->slots[pos];
            if (!s->used) {
                return i;
            }
            if (s->lo == h.lo && s->hi == h.hi && s->ns == ns) {
                values[i] = s->value;
                break;
            }
            pos = (pos + 1) & idx->mask;
        }
    }
    return n;
}

/* Interleaved: INDEX_WIDE_PROBES probes in flight, visited in turn. A probe reads the slots of
 * the one cache line it has fetched; when its run goes on into the next line, it prefetches that
 * line and yields to the others instead of waiting for it (in order, that second miss was a
 * stall nothing overlapped: at 1e7 entries 28 M probes/s in order, 40-45 interleaved). A probe
 * that finishes takes the next hash. Probes past the first miss found are dropped, and every
 * probe before it finishes, so the result is the in-order one. */
static size_t probe_wide(const kvd_index *idx, uint32_t ns, const kv_hash128 *hashes, size_t n,
                         uint64_t *values) {
    size_t at_i[INDEX_WIDE_PROBES], at_pos[INDEX_WIDE_PROBES];
    size_t first_miss = n, next = 0;
    uint32_t live = 0;
    _Static_assert(INDEX_WIDE_PROBES <= 32, "live is a 32-bit mask");
    for (unsigned k = 0; k < INDEX_WIDE_PROBES && next < n; k++, next++) {
        at_i[k] = next;
        at_pos[k] = index_home(idx, ns, hashes[next].lo, hashes[next].hi);
        __builtin_prefetch(&idx->slots[at_pos[k]], 0, 1);
        live |= 1u << k;
    }
    for (unsigned k = 0; live != 0; k = (k + 1) % INDEX_WIDE_PROBES) {
        if (!(live & (1u << k))) {
            continue;
        }
        size_t i = at_i[k], pos = at_pos[k];
        int done = 1;
        if (i < first_miss) {
            kv_hash128 h = hashes[i];
            for (;;) {
                const index_slot *s = &idx->slots[pos];
                if (!s->used) {
                    first_miss = i;
                    break;
                }
                if (s->lo == h.lo && s->hi == h.hi && s->ns == ns) {
                    values[i] = s->value;
                    break;
                }
                pos = (pos + 1) & idx->mask;
                if (pos % INDEX_LINE_SLOTS == 0) { /* the run goes on in the next line */
                    at_pos[k] = pos;
                    __builtin_prefetch(&idx->slots[pos], 0, 1);
                    done = 0;
                    break;
                }
            }
        }
        if (!done) {
            continue;
        }
        if (next < first_miss) { /* first_miss <= n */
            at_i[k] = next;
            at_pos[k] = index_home(idx, ns, hashes[next].lo, hashes[next].hi);
            __builtin_prefetch(&idx->slots[at_pos[k]], 0, 1);
            next++;
        } else {
            live &= ~(1u << k);
        }
    }
    return first_miss;
}

size_t kvd_index_probe_prefix(const kvd_index *idx, uint32_t ns, const kv_hash128 *hashes, size_t n,
                              uint64_t *values) {
    if (kvd_index_bytes(idx) >= INDEX_WIDE_BYTES) {
        return probe_wide(idx, ns, hashes, n, values);
    }
    return probe_in_order(idx, ns, hashes, n, values);
}

size_t kvd_index_count(const kvd_index *idx) {
    return idx->count;
}

size_t kvd_index_capacity(const kvd_index *idx) {
    return idx->mask + 1;
}

size_t kvd_index_bytes(const kvd_index *idx) {
    return (idx->mask + 1) * sizeof(index_slot) + sizeof(*idx);
}
