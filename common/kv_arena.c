/* kv_arena: bump allocation for one message's lifetime. The block is reused across messages,
 * so the steady state allocates nothing. */
#include "common/kv_arena.h"

#include <stdlib.h>
#include <string.h>

#define ARENA_MIN_BLOCK 65536

static void *pb_alloc(void *data, size_t size) {
    return kv_arena_alloc(data, size);
}

static void pb_free(void *data, void *ptr) {
    (void)data;
    (void)ptr; /* released all together by kv_arena_reset */
}

void kv_arena_init(kv_arena *a) {
    memset(a, 0, sizeof(*a));
    a->allocator.alloc = pb_alloc;
    a->allocator.free = pb_free;
    a->allocator.allocator_data = a;
}

void kv_arena_fini(kv_arena *a) {
    if (a == NULL) {
        return;
    }
    for (size_t i = 0; i < a->nspill; i++) {
        free(a->spill[i]);
    }
    free(a->spill);
    free(a->buf);
    memset(a, 0, sizeof(*a));
}

static void *spill_alloc(kv_arena *a, size_t size) {
    if (a->nspill == a->spill_cap) {
        size_t ncap = a->spill_cap ? a->spill_cap * 2 : 16;
        void **n = realloc(a->spill, ncap * sizeof(*n));
        if (n == NULL) {
            return NULL;
        }
        a->spill = n;
        a->spill_cap = ncap;
    }
    void *p = malloc(size > 0 ? size : 1);
    if (p != NULL) {
        a->spill[a->nspill++] = p;
        a->spilled += size;
    }
    return p;
}

void *kv_arena_alloc(kv_arena *a, size_t size) {
    if (size > SIZE_MAX - 15) {
        return NULL;
    }
    size_t need = (size + 15) & ~(size_t)15;
    if (a->buf == NULL && need <= ARENA_MIN_BLOCK) {
        a->buf = malloc(ARENA_MIN_BLOCK);
        if (a->buf != NULL) {
            a->cap = ARENA_MIN_BLOCK;
        }
    }
    if (a->buf != NULL && need <= a->cap - a->used) {
        void *p = a->buf + a->used;
        a->used += need;
        return p;
    }
    return spill_alloc(a, size);
}

void kv_arena_reset(kv_arena *a) {
    for (size_t i = 0; i < a->nspill; i++) {
        free(a->spill[i]);
    }
    if (a->nspill > 0 && a->cap < KV_ARENA_MAX_BLOCK) {
        /* Room for what the last message took in all, rounded up to a power of two. */
        size_t want = a->cap > 0 ? a->cap : ARENA_MIN_BLOCK;
        while (want < a->used + a->spilled + 16 * a->nspill && want < KV_ARENA_MAX_BLOCK) {
            want *= 2;
        }
        /* Nothing in the block is live between messages: free + malloc, not realloc (no copy). */
        uint8_t *n = malloc(want);
        if (n != NULL) {
            free(a->buf);
            a->buf = n;
            a->cap = want;
        }
    }
    a->nspill = 0;
    a->spilled = 0;
    a->used = 0;
}

ProtobufCAllocator *kv_arena_allocator(kv_arena *a) {
    return &a->allocator;
}
