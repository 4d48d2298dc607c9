/* kvd_rledger: the remote tier's ledger (see rledger.h).
 *
 * Slots of 24 bytes in sets of RL_WAYS; an entry lives in one of two sets chosen by a mix of the
 * pool id and the hash, the emptier one when it is added (block hashes come from clients, but a
 * client choosing hashes that share sets only pushes entries out of the ledger: the cost is
 * unreported drops of those values after a gap, as before there was a ledger).
 * An empty slot has stamp 0; stamps count from 1 and skip 0 when they wrap.
 */
#include "daemon/tiers/rledger.h"

#include <stdlib.h>

#define RL_WAYS 4

typedef struct rl_slot {
    uint64_t lo, hi;
    uint32_t pool_id;
    uint32_t stamp; /* 0: empty */
} rl_slot;

_Static_assert(sizeof(rl_slot) == 24, "ledger slot must be 24 bytes");

struct kvd_rledger {
    rl_slot *slots; /* nsets * RL_WAYS */
    size_t nsets;   /* a power of two */
    size_t count;   /* entries present */
    uint32_t next;  /* the next stamp (never 0) */
    uint64_t lost;  /* entries replaced for room */
};

kv_err kvd_rledger_alloc(size_t entries, kvd_rledger **out) {
    *out = NULL;
    if (entries == 0) {
        return KV_EINVAL;
    }
    size_t nsets = 1;
    while (nsets * RL_WAYS < 2 * entries) { /* half full at most: few entries pushed out */
        if (nsets > ((size_t)1 << 40)) {
            return KV_EINVAL;
        }
        nsets <<= 1;
    }
    kvd_rledger *l = calloc(1, sizeof(*l));
    if (l == NULL) {
        return KV_ENOMEM;
    }
    l->slots = calloc(nsets * RL_WAYS, sizeof(*l->slots));
    if (l->slots == NULL) {
        free(l);
        return KV_ENOMEM;
    }
    l->nsets = nsets;
    l->next = 1;
    *out = l;
    return KV_OK;
}

void kvd_rledger_free(kvd_rledger *l) {
    if (l != NULL) {
        free(l->slots);
        free(l);
    }
}

/* The two sets an entry may live in (two choices: the emptier one takes a new entry, so sets
 * fill evenly and a set overflows only when the ledger is nearly full). */
static void sets_of(const kvd_rledger *l, uint32_t pool_id, kv_hash128 h, rl_slot *sets[2]) {
    uint64_t x = h.lo ^ (h.hi * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)pool_id << 32);
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    size_t a = (size_t)(x & (l->nsets - 1));
    size_t b = (size_t)((x >> 32) & (l->nsets - 1));
    sets[0] = l->slots + a * RL_WAYS;
    sets[1] = l->slots + b * RL_WAYS;
}

static int slot_is(const rl_slot *s, uint32_t pool_id, kv_hash128 h) {
    return s->stamp != 0 && s->pool_id == pool_id && s->lo == h.lo && s->hi == h.hi;
}

static rl_slot *find(const kvd_rledger *l, uint32_t pool_id, kv_hash128 h) {
    rl_slot *sets[2];
    sets_of(l, pool_id, h, sets);
    for (int k = 0; k < 2; k++) {
        for (int w = 0; w < RL_WAYS; w++) {
            if (slot_is(&sets[k][w], pool_id, h)) {
                return &sets[k][w];
            }
        }
    }
    return NULL;
}

static uint32_t next_stamp(kvd_rledger *l) {
    uint32_t st = l->next++;
    if (l->next == 0) {
        l->next = 1;
    }
    return st;
}

void kvd_rledger_add(kvd_rledger *l, uint32_t pool_id, kv_hash128 hash) {
    if (pool_id == 0) {
        return;
    }
    rl_slot *s = find(l, pool_id, hash);
    if (s != NULL) {
        s->stamp = next_stamp(l);
        return;
    }
    rl_slot *sets[2];
    sets_of(l, pool_id, hash, sets);
    rl_slot *room[2] = {NULL, NULL}, *oldest = NULL;
    int free_ways[2] = {0, 0};
    for (int k = 0; k < 2; k++) {
        for (int w = 0; w < RL_WAYS; w++) {
            rl_slot *c = &sets[k][w];
            if (c->stamp == 0) {
                free_ways[k]++;
                if (room[k] == NULL) {
                    room[k] = c;
                }
            } else if (oldest == NULL || (int32_t)(c->stamp - oldest->stamp) < 0) {
                oldest = c; /* stamps compare by distance, so a wrap keeps the order */
            }
        }
    }
    s = free_ways[1] > free_ways[0] ? room[1] : room[0];
    if (s == NULL) {
        s = oldest;
        l->lost++;
        l->count--;
    }
    s->lo = hash.lo;
    s->hi = hash.hi;
    s->pool_id = pool_id;
    s->stamp = next_stamp(l);
    l->count++;
}

static int remove_where(kvd_rledger *l, uint32_t pool_id, kv_hash128 hash, int any,
                        uint32_t stamp) {
    rl_slot *s = find(l, pool_id, hash);
    if (s == NULL || (!any && s->stamp != stamp)) {
        return 0;
    }
    s->stamp = 0;
    l->count--;
    return 1;
}

int kvd_rledger_remove(kvd_rledger *l, uint32_t pool_id, kv_hash128 hash) {
    return remove_where(l, pool_id, hash, 1, 0);
}

int kvd_rledger_remove_if(kvd_rledger *l, uint32_t pool_id, kv_hash128 hash, uint32_t stamp) {
    return remove_where(l, pool_id, hash, 0, stamp);
}

size_t kvd_rledger_scan(const kvd_rledger *l, size_t *cursor, kvd_rledger_ent *out, size_t max) {
    size_t n = 0, i = *cursor, end = l->nsets * RL_WAYS;
    for (; i < end && n < max; i++) {
        const rl_slot *s = &l->slots[i];
        if (s->stamp != 0) {
            out[n].hash.lo = s->lo;
            out[n].hash.hi = s->hi;
            out[n].pool_id = s->pool_id;
            out[n].stamp = s->stamp;
            n++;
        }
    }
    *cursor = i;
    return n;
}

size_t kvd_rledger_slots(const kvd_rledger *l) {
    return l->nsets * RL_WAYS;
}

size_t kvd_rledger_count(const kvd_rledger *l) {
    return l->count;
}

uint64_t kvd_rledger_lost(const kvd_rledger *l) {
    return l->lost;
}

size_t kvd_rledger_bytes(const kvd_rledger *l) {
    return sizeof(*l) + l->nsets * RL_WAYS * sizeof(rl_slot);
}
