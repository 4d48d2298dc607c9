/* kvd_pinned: page-locked T1 buffers (pinned.h). An open-addressing table of the live buffers
 * (pointer -> backend, ctx, size; backward-shift deletion) and a list of taken ones waiting for
 * a copy thread to give them back. */
#include "daemon/tiers/pinned.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct pbuf {
    void *p; /* NULL: empty slot */
    const kvd_backend_ops *be;
    void *ctx;
    uint64_t n;
} pbuf;

struct kvd_pinned {
    pthread_mutex_t mu;
    pbuf *tab; /* [cap], a power of two, at most half full */
    uint64_t cap, count;
    pbuf *trash; /* taken, not yet given back */
    uint64_t ntrash, trash_cap;
    uint64_t bytes; /* live and taken */
};

static uint64_t slot_of(const void *p, uint64_t cap) {
    uint64_t x = (uint64_t)(uintptr_t)p >> 12; /* page-aligned buffers: the low bits are zero */
    x *= 0x9e3779b97f4a7c15ull;
    return (x >> 17) & (cap - 1);
}

kvd_pinned *kvd_pinned_new(void) {
    kvd_pinned *pn = calloc(1, sizeof(*pn));
    if (pn == NULL) {
        return NULL;
    }
    pn->cap = 64;
    pn->tab = calloc(pn->cap, sizeof(*pn->tab));
    if (pn->tab == NULL) {
        free(pn);
        return NULL;
    }
    pthread_mutex_init(&pn->mu, NULL);
    return pn;
}

/* Inserts b (not present); the table has room. Locked. */
static void put(pbuf *tab, uint64_t cap, pbuf b) {
    uint64_t i = slot_of(b.p, cap);
    while (tab[i].p != NULL) {
        i = (i + 1) & (cap - 1);
    }
    tab[i] = b;
}

/* The slot holding p, or cap. Locked. */
static uint64_t find(const kvd_pinned *pn, const void *p) {
    uint64_t i = slot_of(p, pn->cap);
    while (pn->tab[i].p != NULL) {
        if (pn->tab[i].p == p) {
            return i;
        }
        i = (i + 1) & (pn->cap - 1);
    }
    return pn->cap;
}

/* Removes slot i, shifting the run after it back so every entry stays reachable. Locked. */
static void del(kvd_pinned *pn, uint64_t i) {
    uint64_t m = pn->cap - 1;
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & m;
        if (pn->tab[j].p == NULL) {
            break;
        }
        uint64_t h = slot_of(pn->tab[j].p, pn->cap);
        /* j's entry may move to i when its home h is not cyclically in (i, j]. */
        if ((j > i && (h <= i || h > j)) || (j < i && h <= i && h > j)) {
            pn->tab[i] = pn->tab[j];
            i = j;
        }
    }
    memset(&pn->tab[i], 0, sizeof(pn->tab[i]));
    pn->count--;
}

uint8_t *kvd_pinned_alloc(kvd_pinned *pn, const kvd_backend_ops *be, void *ctx, uint64_t n) {
    if (pn == NULL || be == NULL || be->host_alloc == NULL || be->host_free == NULL || n == 0) {
        return NULL;
    }
    void *p = be->host_alloc(ctx, n);
    if (p == NULL) {
        return NULL;
    }
    pthread_mutex_lock(&pn->mu);
    if ((pn->count + 1) * 2 > pn->cap) {
        uint64_t nc = pn->cap * 2;
        pbuf *nt = calloc(nc, sizeof(*nt));
        if (nt == NULL) {
            pthread_mutex_unlock(&pn->mu);
            be->host_free(ctx, p);
            return NULL;
        }
        for (uint64_t i = 0; i < pn->cap; i++) {
            if (pn->tab[i].p != NULL) {
                put(nt, nc, pn->tab[i]);
            }
        }
        free(pn->tab);
        pn->tab = nt;
        pn->cap = nc;
    }
    put(pn->tab, pn->cap, (pbuf){p, be, ctx, n});
    pn->count++;
    pn->bytes += n;
    pthread_mutex_unlock(&pn->mu);
    return p;
}

int kvd_pinned_is(kvd_pinned *pn, const void *p) {
    if (pn == NULL || p == NULL) {
        return 0;
    }
    pthread_mutex_lock(&pn->mu);
    int yes = find(pn, p) != pn->cap;
    pthread_mutex_unlock(&pn->mu);
    return yes;
}

int kvd_pinned_free(kvd_pinned *pn, void *p) {
    if (pn == NULL || p == NULL) {
        return 0;
    }
    pthread_mutex_lock(&pn->mu);
    uint64_t i = find(pn, p);
    if (i == pn->cap) {
        pthread_mutex_unlock(&pn->mu);
        return 0;
    }
    if (pn->ntrash == pn->trash_cap) {
        uint64_t nc = pn->trash_cap == 0 ? 16 : pn->trash_cap * 2;
        pbuf *nt = realloc(pn->trash, sizeof(*nt) * nc);
        if (nt == NULL) {
            /* Nowhere to park it: give it back here (may wait for the context's copies). */
            pbuf b = pn->tab[i];
            del(pn, i);
            pn->bytes -= b.n;
            pthread_mutex_unlock(&pn->mu);
            b.be->host_free(b.ctx, b.p);
            return 1;
        }
        pn->trash = nt;
        pn->trash_cap = nc;
    }
    pn->trash[pn->ntrash++] = pn->tab[i];
    del(pn, i);
    pthread_mutex_unlock(&pn->mu);
    return 1;
}

void kvd_pinned_reap(kvd_pinned *pn) {
    if (pn == NULL) {
        return;
    }
    for (;;) {
        pthread_mutex_lock(&pn->mu);
        if (pn->ntrash == 0) {
            pthread_mutex_unlock(&pn->mu);
            return;
        }
        pbuf b = pn->trash[--pn->ntrash];
        pn->bytes -= b.n;
        pthread_mutex_unlock(&pn->mu);
        b.be->host_free(b.ctx, b.p); /* outside the lock: it may wait */
    }
}

uint64_t kvd_pinned_bytes(kvd_pinned *pn) {
    if (pn == NULL) {
        return 0;
    }
    pthread_mutex_lock(&pn->mu);
    uint64_t b = pn->bytes;
    pthread_mutex_unlock(&pn->mu);
    return b;
}

void kvd_pinned_destroy(kvd_pinned *pn) {
    if (pn == NULL) {
        return;
    }
    kvd_pinned_reap(pn);
    for (uint64_t i = 0; i < pn->cap; i++) {
        if (pn->tab[i].p != NULL) {
            pn->tab[i].be->host_free(pn->tab[i].ctx, pn->tab[i].p);
        }
    }
    free(pn->tab);
    free(pn->trash);
    pthread_mutex_destroy(&pn->mu);
    free(pn);
}
