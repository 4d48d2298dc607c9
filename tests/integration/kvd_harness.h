/* kvd_harness: starts a real kvd (the //daemon:kvd runfile) on a socket in a fresh temp dir for
 * one integration test, waits until it accepts, and stops it again. Also a few raw-socket
 * helpers for feeding the daemon bytes that libkvclient would never send.
 * One harness per test process; not thread-safe.
 */
#ifndef KVD_HARNESS_H
#define KVD_HARNESS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "kvclient.h"

typedef struct kvd_harness {
    char dir[80];     /* temp dir holding the socket */
    char sock[100];   /* socket path */
    pid_t pid;        /* kvd's pid, 0 when stopped */
    char args[8][96]; /* extra --name=value flags */
    int nargs;        /* used entries of args */
} kvd_harness;

/* Starts kvd with the given extra flags (NULL-terminated list, may be NULL) and waits up to
 * 10 s until its socket accepts. Returns 0, or -1 with a message on stderr. */
int kvd_harness_start(kvd_harness *h, const char *const *flags);

/* SIGTERM, then SIGKILL after 5 s; returns kvd's exit status (or -1). Keeps the temp dir. */
int kvd_harness_stop(kvd_harness *h);

/* Stops and starts kvd again with the same flags and socket (a daemon restart). */
int kvd_harness_restart(kvd_harness *h);

/* Stops kvd if running and removes the temp dir. */
void kvd_harness_fini(kvd_harness *h);

/* Opens a libkvclient connection named name to the harness's kvd (5 s timeout, no logging). */
kv_err kvd_harness_connect(const kvd_harness *h, const char *name, kvc_conn **out);

/* The small layout the integration tests use: 2 layers, 2 heads, dim 64, 16 tokens/block,
 * fp16, layer-major (16 KiB blocks). */
kv_layout kvd_harness_layout(void);

/* Raw socket to kvd (blocking), or -1. */
int kvd_harness_raw_connect(const kvd_harness *h);

/* Reads one frame from a raw socket into *env (free with kv_wire_free); 0, or -1 on EOF or
 * error (5 s receive timeout). */
struct Kvd__Envelope;
int kvd_harness_raw_read(int fd, struct Kvd__Envelope **env);

/* Reads until EOF; returns 1 if the peer closed within 5 s, 0 otherwise. */
int kvd_harness_raw_closed(int fd);

/* Polls stat `name` of pool_id on c until it equals want (10 s at most); returns the last
 * value seen. For effects of other processes that the daemon applies asynchronously. */
uint64_t kvd_harness_wait_stat(kvc_conn *c, uint32_t pool_id, const char *name, uint64_t want);

/* Sleeps ms milliseconds. */
void kvd_harness_sleep_ms(int ms);

/* Stops kvd and removes the temp dir (kvd_harness_stop, then kvd_harness_fini). Returns 0 if kvd
 * exited with status 0, -1 otherwise: a cmocka group teardown's result. */
int kvd_harness_finish(kvd_harness *h);

/* Stat `name` of pool_id (0: daemon or session stats) on c; a cmocka assertion fails the test
 * unless kvc_stat_get returns KV_OK. Only for use inside a cmocka test. */
uint64_t kvd_harness_stat(kvc_conn *c, uint32_t pool_id, const char *name);

/* Allocates n blocks into out in requests of per blocks each (n a multiple of per). Returns
 * KV_OK, or the first error of kvc_allocate (blocks allocated before it stay held). */
kv_err kvd_harness_alloc_all(kvc_pool *p, kvc_block *out, uint32_t n, uint32_t per);

/* Creates a fresh temp dir "<base>/<prefix>-XXXXXX" into dir (cap bytes): base is $TEST_TMPDIR
 * when set and shorter than max_tmp_len (socket paths must fit 108 bytes), else /tmp; /tmp is
 * also the fallback when mkdtemp fails there. Returns 0, or -1. */
int kvd_harness_make_dir(char *dir, size_t cap, const char *prefix, size_t max_tmp_len);

/* Forks and execvp()s argv (argv[0] the program, NULL-terminated), then waits up to timeout_ms
 * until the Unix socket sock accepts. Returns 0 with *pid the child's. Returns -1 with a message
 * prefixed by who on stderr when fork fails or the child exits first (*pid = 0), or when the
 * time runs out (*pid the child's, still running: the caller decides whether to stop it). */
int kvd_harness_spawn(char *const *argv, const char *sock, int timeout_ms, const char *who,
                      pid_t *pid);

/* SIGTERM to pid, then SIGKILL after timeout_ms; reaps it. Returns its exit status if it exited
 * normally before the SIGKILL, -1 otherwise. */
int kvd_harness_kill(pid_t pid, int timeout_ms);

#endif
