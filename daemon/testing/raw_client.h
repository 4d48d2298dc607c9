/* raw_client: what the daemon's in-process tests share to drive a real kvd_daemon without
 * libkvclient. A test server runs the server on a temporary socket in a thread with its own
 * libuv loop; the raw client speaks kv_wire frames over plain blocking Unix sockets (encode and
 * send an Envelope, read one frame and the SCM_RIGHTS fds that came with it) and has the
 * small-layout Hello/AttachPool/Allocate/Commit/Lookup requests several tests send.
 *
 * Test-only (testonly = True): every function reports a failure through cmocka's assertions,
 * so it may only be called from a cmocka test's thread. Nothing here is thread-safe. */
#ifndef KVD_TESTING_RAW_CLIENT_H
#define KVD_TESTING_RAW_CLIENT_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "common/kv_err.h"
#include "common/kv_layout.h"
#include "daemon/config/config.h"
#include "daemon/app/daemon.h"
#include "proto/kvd.pb-c.h"

/* Capacity of the fd arrays kvd_raw_recv_* fill: more fds in one frame fail the test. */
#define KVD_RAW_MAX_FDS 200

/* ---- an in-process server on a temporary socket ----------------------------------------- */

typedef struct kvd_test_server {
    kvd_config cfg;                 /* options the server runs with; the test edits them */
    char dir[64];                   /* temporary directory holding the socket */
    uv_loop_t loop;                 /* the server thread's loop */
    kvd_daemon *srv;                /* the server */
    pthread_t thread;               /* runs the loop */
    pthread_mutex_t mu;             /* guards ready */
    pthread_cond_t cv;              /* signals ready */
    int ready;                      /* 1 started, -1 failed */
    int loop_close_rc;              /* uv_loop_close() after the loop ended */
    void (*on_loop)(kvd_daemon *s); /* NULL, or runs on the loop thread after a good start */
    uv_async_t call_async;          /* wakes the loop for kvd_test_server_call */
    void (*call_fn)(kvd_daemon *s, void *arg); /* the pending call, under mu */
    void *call_arg;                            /* its argument, under mu */
    int call_done;                             /* set by the loop when call_fn returned, under mu */
} kvd_test_server;

/* Zeroes *ts, sets ts->cfg to the defaults (kvd_config_init), makes a temporary directory
 * /tmp/kvd-<tag>-XXXXXX and points cfg.socket at kvd.sock in it. The test then edits ts->cfg
 * (and ts->on_loop) before kvd_test_server_start. Fails the test if the directory cannot be
 * made. Caller's storage; nothing to free until kvd_test_server_stop. */
void kvd_test_server_init(kvd_test_server *ts, const char *tag);

/* Sets kv_log_threshold to cfg.log_level, then allocates and starts the server on a new thread
 * (kvd_server_alloc, kvd_server_start, ts->on_loop) and returns once it listens. Fails the test
 * if the server did not start. */
void kvd_test_server_start(kvd_test_server *ts);

/* Runs fn(srv, arg) on the server's loop thread and returns when it has: the way a test reads
 * or checks loop-owned state without racing the loop (ThreadSanitizer checks this). Test thread
 * only; one call at a time. */
void kvd_test_server_call(kvd_test_server *ts, void (*fn)(kvd_daemon *s, void *arg), void *arg);

/* Stops the server (kvd_server_stop_async), joins its thread and checks that its loop closed
 * with every handle gone (uv_loop_close() == 0). Leaves the directory to the caller, whose
 * checks on what a stop leaves differ. */
void kvd_test_server_stop(kvd_test_server *ts);

/* ---- raw frames over a blocking socket -------------------------------------------------- */

/* Connects to the Unix socket at path; receives time out after 20 s so that a hung test fails
 * instead of hanging. Returns the fd (the caller closes it); fails the test otherwise. */
int kvd_raw_dial(const char *path);

/* Sends exactly len bytes of buf in one send(); fails the test otherwise. */
void kvd_raw_send(int fd, const void *buf, size_t len);

/* Encodes env as one frame (its id as set) and sends it. */
void kvd_raw_send_env(int fd, Kvd__Envelope *env);

/* Reads exactly len bytes into buf. fds that arrive are appended to fds[*nfds...] (capacity
 * KVD_RAW_MAX_FDS in all), or closed where fds is NULL. Returns 0, or -1 on EOF or a receive
 * error (a timeout included) before len bytes. */
int kvd_raw_recv_exact(int fd, uint8_t *buf, size_t len, int *fds, size_t *nfds);

/* Receives one frame and decodes it (a frame that does not decode fails the test); *nfds is
 * set to the number of fds that came with it, stored in fds (capacity KVD_RAW_MAX_FDS), owned
 * by the caller. Returns NULL on EOF before the frame's first byte. Free with kv_wire_free. */
Kvd__Envelope *kvd_raw_recv_env_fds(int fd, int *fds, size_t *nfds);

/* kvd_raw_recv_env_fds with every fd closed. */
Kvd__Envelope *kvd_raw_recv_env(int fd);

/* Sends req (its id as set), receives the reply, checks it is not EOF and answers req's id.
 * fds that came with it are closed. The caller frees the reply with kv_wire_free. */
Kvd__Envelope *kvd_raw_rpc(int fd, Kvd__Envelope *req);

/* kvd_raw_rpc, then checks the reply is an Error with code and a non-empty message. */
void kvd_raw_expect_error(int fd, Kvd__Envelope *req, kv_err code);

/* ---- requests of the small test layout (2 layers, 2 heads, dim 8, 4 tokens, fp16) --------- */

/* A fresh request id: 100, 101, ... per process. */
uint64_t kvd_raw_next_id(void);

/* Hello (protocol 1, client_name); checks a session id, the boot epoch in both places,
 * protocol 1 and exactly one domain. */
void kvd_raw_hello(int fd, const char *client_name);

typedef struct kvd_raw_attached {
    uint32_t pool_id;   /* from the reply */
    uint32_t bps;       /* blocks per segment */
    uint64_t seg_bytes; /* bytes of segment 0 */
    uint8_t *base;      /* our read-write mapping of segment 0; the caller munmaps it */
    kv_layout layout;   /* the layout we asked */
} kvd_raw_attached;

/* Sets the small test layout in l. */
void kvd_raw_fill_layout(Kvd__Layout *l);

/* AttachPool of model with the small layout on a host backend: checks the reply (one fd per
 * segment, HOST_MEMFD, hash_algo 1 with a seed, the block size, memfds sealed against
 * resizing) and maps segment 0. Fails the test on an Error. */
kvd_raw_attached kvd_raw_attach(int fd, const char *model);

/* Allocate of count blocks in pool; returns the reply (an Error included). */
Kvd__Envelope *kvd_raw_allocate(int fd, uint32_t pool, uint32_t count);

/* Commit of blocks[0..n) (n <= 8) as one chain with hashes {lo = salt + i, hi = 0xabcdef}.
 * With expect KV_OK checks each block is its own canonical block; otherwise expects that
 * Error. */
void kvd_raw_commit(int fd, uint32_t pool, Kvd__BlockRef *blocks, size_t n, uint64_t salt,
                    kv_err expect);

/* Lookup of n (<= 8) hashes {lo = salt + i, hi = 0xabcdef}; returns the reply. */
Kvd__Envelope *kvd_raw_lookup(int fd, uint32_t pool, uint64_t salt, size_t n);

/* MapSegments{pool, first_index}; checks for a MapSegmentsReply (its fds are closed) and returns
 * how many segments it named. A linked pool must be mapped so before Allocate, Lookup or Commit
 * name it (PROTOCOL.md §6). */
uint32_t kvd_raw_map_segments(int fd, uint32_t pool, uint32_t first_index);

#endif
