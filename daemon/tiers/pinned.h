/* kvd_pinned: the page-locked host buffers that hold GPU pools' tier-1 blocks (raw format), so
 * that the driver's copies into and out of them run asynchronously at the link's full rate
 * (pageable memory goes through the driver's staging buffers, a host memcpy more per copy).
 *
 * A T1 buffer is either page-locked (made here through the pool's backend: host_alloc) or
 * malloc'd (host pools, compressed and quantized formats, values the remote tier landed, and a
 * GPU pool's buffer when the driver had no page-locked memory to give). Every path that lets a
 * T1 buffer go calls kvd_pinned_free first: it takes the buffers it made (and says so) and leaves
 * the rest to free(). A page-locked buffer is not given back to the driver at once: freeing it
 * may wait for the context's copies, so it waits in a list until a copy thread's next job
 * (kvd_pinned_reap) or kvd_pinned_destroy frees it, and the loop thread never calls the driver
 * here (but when the list cannot grow for want of memory: then the buffer goes back at once).
 *
 * Thread-safe: copy threads allocate and reap, the loop thread frees (one mutex; a lookup is a
 * hash probe).
 */
#ifndef KVD_PINNED_H
#define KVD_PINNED_H

#include <stdint.h>

#include "daemon/core/backend.h"

typedef struct kvd_pinned kvd_pinned;

/* An empty set, or NULL when out of memory. */
kvd_pinned *kvd_pinned_new(void);

/* Gives every buffer still held back to its driver (held and waiting alike) and frees the set.
 * After the copy threads are done and before the backends close. Accepts NULL. */
void kvd_pinned_destroy(kvd_pinned *pn);

/* A page-locked buffer of n bytes from backend be (ctx), or NULL when be has none (no
 * host_alloc, or the driver refused: the caller mallocs and counts a fallback). Any thread. */
uint8_t *kvd_pinned_alloc(kvd_pinned *pn, const kvd_backend_ops *be, void *ctx, uint64_t n);

/* 1 when p is a buffer this set made and still holds. */
int kvd_pinned_is(kvd_pinned *pn, const void *p);

/* When p is one of this set's buffers: takes it (it goes back to the driver at the next reap)
 * and returns 1. Else 0, and p is the caller's to free(). Accepts NULL (0). */
int kvd_pinned_free(kvd_pinned *pn, void *p);

/* Gives the buffers kvd_pinned_free took back to their drivers. Copy threads (it may wait). */
void kvd_pinned_reap(kvd_pinned *pn);

/* Bytes of the buffers held (in use and waiting to go back). */
uint64_t kvd_pinned_bytes(kvd_pinned *pn);

#endif
