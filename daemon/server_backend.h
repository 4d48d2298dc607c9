/* kvd_server_backend: the server's memory backend, chosen at start, and which segments live
 * sessions may have mapped.
 *
 * kvd_server_backend_open reads the `backend` and `device` options, chooses (auto: a GPU
 * backend when a GPU is usable, else host), logs one KVD-BACKEND line saying what and why, and
 * records the chosen name in the server's config copy (so `kvctl info` shows it). The mapping
 * query exists for cuda-ipc: CUDA leaves it undefined what an importer sees when the exporter
 * frees memory it still has open, so a segment a live session was sent must not be freed while
 * that session lives. Loop thread only.
 */
#ifndef KVD_SERVER_BACKEND_H
#define KVD_SERVER_BACKEND_H

#include <stdint.h>

#include "common/kv_err.h"
#include "daemon/server.h"

/* Chooses and opens the backend into s->be / s->be_ctx / s->backend_sel. An explicit GPU
 * backend that cannot be had is KV_ENOGPU, logged at ERROR with the reason (kvd exits non-zero);
 * KV_EINVAL for an unknown name. Called by kvd_server_alloc. */
kv_err kvd_server_backend_open(kvd_server *s);

/* Closes the GPU backend after every pool is freed. Idempotent. */
void kvd_server_backend_close(kvd_server *s);

/* Live sessions that were sent segment seg of pool pool_id (and so may have it mapped). */
uint32_t kvd_segment_mappers(const kvd_server *s, uint32_t pool_id, uint32_t seg);

/* 1 when the backend lets the server free (pool_id, seg) now: always for host and cuda-vmm (the
 * memory outlives the daemon's handle while a client maps it), for cuda-ipc only when no live
 * session was sent it. Whoever shrinks pools must ask this first. */
int kvd_segment_may_free(const kvd_server *s, uint32_t pool_id, uint32_t seg);

#endif
