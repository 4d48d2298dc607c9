/* Integration: deferred Releases (kvc_release_deferred) against a real kvd. The call after
 * them sees their blocks released (a full pool has room again for that very call), another
 * session sees it once that call ran, a refused one is reported by kvc_flush without failing
 * the call that carried it, and a worker that dies with some queued leaks nothing. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "tests/integration/kvd_harness.h"

/* 16 KiB blocks, 64 KiB segments: 16 blocks in all (errors_test's budget). */
static const char *const FLAGS[] = {"--pool-memory=265K", "--segment-bytes=64K", NULL};
static kvd_harness H;

static int setup(void **state) {
    (void)state;
    return kvd_harness_start(&H, FLAGS);
}

static int teardown(void **state) {
    (void)state;
    return kvd_harness_finish(&H);
}

static void open_pool(const char *name, kvc_conn **c, kvc_pool **p) {
    kv_layout l = kvd_harness_layout();
    assert_int_equal(kvd_harness_connect(&H, name, c), KV_OK);
    assert_int_equal(kvc_pool_attach(*c, "deferred-model", &l, p), KV_OK);
}

static void commit_chain(kvc_pool *p, const kvc_block *b, size_t n, kv_hash128 *hs) {
    uint32_t tok[16 * 16];
    for (size_t i = 0; i < n * 16; i++) {
        tok[i] = 7 + (uint32_t)i;
    }
    size_t nh = 0;
    assert_int_equal(kvc_pool_hash_tokens(p, NULL, 0, tok, n * 16, hs, n, &nh), KV_OK);
    kvc_commit_entry e[16];
    for (size_t i = 0; i < n; i++) {
        e[i].block = b[i];
        e[i].hash = hs[i];
        e[i].parent = i == 0 ? KVC_NO_PARENT : b[i - 1].id;
    }
    kvc_block canon[16];
    assert_int_equal(kvc_commit(p, e, n, canon), KV_OK);
}

static void test_next_call_sees_release(void **state) {
    (void)state;
    kvc_conn *c, *obs;
    kvc_pool *p, *po;
    open_pool("worker", &c, &p);
    open_pool("observer", &obs, &po);
    uint32_t id = kvc_pool_id(p);
    kvc_block b[16], one;
    assert_int_equal(kvc_allocate(p, 16, b), KV_OK);
    assert_int_equal(kvc_allocate(p, 1, &one), KV_ENOSPC);
    /* WRITING blocks released deferred: the Allocate that carries the Release finds them free. */
    assert_int_equal(kvc_release_deferred(p, b, 16), KV_OK);
    uint64_t w = 0;
    assert_int_equal(kvc_stat_get(obs, id, "pool.blocks_writing", &w), KV_OK);
    assert_int_equal(w, 16); /* nothing was sent yet */
    assert_int_equal(kvc_allocate(p, 16, b), KV_OK);
    /* Committed, then released deferred while a Lookup re-takes the prefix in the same write. */
    kv_hash128 hs[16];
    commit_chain(p, b, 16, hs);
    assert_int_equal(kvc_release_deferred(p, b, 16), KV_OK);
    kvc_block hit[16];
    size_t nhit = 0;
    assert_int_equal(kvc_lookup(p, hs, 16, hit, &nhit), KV_OK);
    assert_int_equal(nhit, 16);
    assert_int_equal(kvc_release_deferred(p, hit, nhit), KV_OK);
    assert_int_equal(kvc_stat_get(obs, id, "pool.blocks_committed", &w), KV_OK);
    assert_int_equal(w, 16); /* still held: the Release waits for the next call */
    assert_int_equal(kvc_flush(c), KV_OK);
    assert_int_equal(kvc_stat_get(obs, id, "pool.blocks_committed", &w), KV_OK);
    assert_int_equal(w, 0);
    assert_int_equal(kvc_stat_get(obs, id, "pool.blocks_cached", &w), KV_OK);
    assert_int_equal(w, 16);
    /* Releasing again: the daemon refuses (not held); the carrying Ping still succeeds. */
    assert_int_equal(kvc_release_deferred(p, hit, 1), KV_OK);
    assert_int_equal(kvc_ping(c, NULL, 0), KV_OK);
    assert_int_equal(kvc_conn_deferred_failures(c), 1);
    assert_int_equal(kvc_flush(c), KV_EPERM);
    assert_non_null(strstr(kvc_last_error(c), "not held"));
    assert_int_equal(kvc_flush(c), KV_OK);
    kvc_conn_close(c);
    kvc_conn_close(obs);
}

/* Requests of a batch queued (not sent) between deferred Releases take ids in between theirs:
 * the merged write then has gaps in its ids, and every reply must still find its request. */
static void test_interleaved_ids(void **state) {
    (void)state;
    kvc_conn *c, *obs;
    kvc_pool *p, *po;
    open_pool("worker", &c, &p);
    open_pool("observer", &obs, &po);
    uint32_t id = kvc_pool_id(p);
    kvc_block b[8];
    assert_int_equal(kvc_allocate(p, 8, b), KV_OK);
    kvc_batch *u1, *u2;
    assert_int_equal(kvc_batch_alloc(c, &u1), KV_OK);
    assert_int_equal(kvc_batch_alloc(c, &u2), KV_OK);
    size_t i1 = 0, i2 = 0;
    assert_int_equal(kvc_release_deferred(p, b, 2), KV_OK);
    assert_int_equal(kvc_batch_ping(u1, NULL, 0, &i1), KV_OK);
    assert_int_equal(kvc_release_deferred(p, b + 2, 2), KV_OK);
    assert_int_equal(kvc_conn_deferred_pending(c), 2);
    assert_int_equal(kvc_ping(c, NULL, 0), KV_OK); /* carries both, ids with a gap */
    assert_int_equal(kvc_conn_deferred_pending(c), 0);
    assert_int_equal(kvc_batch_run(u1), KV_OK);
    assert_int_equal(kvc_batch_status(u1, i1), KV_OK);
    uint64_t w = 0;
    assert_int_equal(kvc_stat_get(obs, id, "pool.blocks_writing", &w), KV_OK);
    assert_int_equal(w, 4);
    /* The multi-pool release rides the same way. */
    assert_int_equal(kvc_release_deferred(p, b + 4, 1), KV_OK);
    assert_int_equal(kvc_batch_ping(u2, NULL, 0, &i2), KV_OK);
    assert_int_equal(kvc_release_deferred(p, b + 5, 1), KV_OK);
    kvc_pool *pools[2] = {p, p};
    assert_int_equal(kvc_release_multi(pools, b + 6, 2), KV_OK);
    assert_int_equal(kvc_conn_deferred_pending(c), 0);
    assert_int_equal(kvc_batch_run(u2), KV_OK);
    assert_int_equal(kvc_batch_status(u2, i2), KV_OK);
    assert_int_equal(kvc_stat_get(obs, id, "pool.blocks_writing", &w), KV_OK);
    assert_int_equal(w, 0);
    /* Queued behind a batch that is then sent: the batch's send carries them first. */
    assert_int_equal(kvc_allocate(p, 2, b), KV_OK);
    kvc_batch_reset(u1);
    assert_int_equal(kvc_release_deferred(p, b, 1), KV_OK);
    assert_int_equal(kvc_batch_ping(u1, NULL, 0, &i1), KV_OK);
    assert_int_equal(kvc_release_deferred(p, b + 1, 1), KV_OK);
    assert_int_equal(kvc_batch_run(u1), KV_OK);
    assert_int_equal(kvc_batch_status(u1, i1), KV_OK);
    assert_int_equal(kvc_conn_deferred_pending(c), 0);
    assert_int_equal(kvc_stat_get(obs, id, "pool.blocks_writing", &w), KV_OK);
    assert_int_equal(w, 0);
    kvc_batch_free(u1);
    kvc_batch_free(u2);
    assert_int_equal(kvc_conn_deferred_failures(c), 0);
    assert_int_equal(kvc_flush(c), KV_OK);
    kvc_conn_close(c);
    kvc_conn_close(obs);
}

/* A worker that exits with deferred Releases queued (never sent) holds nothing afterwards. */
static void test_dying_worker_leaks_nothing(void **state) {
    (void)state;
    pid_t pid = fork();
    if (pid == 0) {
        kvc_conn *c;
        kvc_pool *p;
        kv_layout l = kvd_harness_layout();
        kvc_block b[8];
        if (kvd_harness_connect(&H, "dying", &c) != KV_OK ||
            kvc_pool_attach(c, "deferred-model", &l, &p) != KV_OK ||
            kvc_allocate(p, 8, b) != KV_OK || kvc_release_deferred(p, b, 4) != KV_OK ||
            kvc_conn_deferred_pending(c) != 1) {
            _exit(1);
        }
        _exit(0); /* no close, no flush */
    }
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    kvc_conn *obs;
    kvc_pool *po;
    open_pool("observer", &obs, &po);
    uint32_t id = kvc_pool_id(po);
    assert_int_equal(kvd_harness_wait_stat(obs, 0, "daemon.sessions", 1), 1);
    assert_int_equal(kvd_harness_wait_stat(obs, id, "pool.blocks_writing", 0), 0);
    assert_int_equal(kvd_harness_wait_stat(obs, id, "pool.blocks_committed", 0), 0);
    kvc_conn_close(obs);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_next_call_sees_release),
        cmocka_unit_test(test_interleaved_ids),
        cmocka_unit_test(test_dying_worker_leaks_nothing),
    };
    return cmocka_run_group_tests_name("deferred", tests, setup, teardown);
}
