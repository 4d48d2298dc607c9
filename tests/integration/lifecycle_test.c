/* Integration: what survives the death of a client and of the daemon. A worker killed with
 * SIGKILL in the middle of writing gives back every block it held (checked through Stats from
 * another session); a daemon restart is reported to clients as KV_EEPOCH, after which attaching
 * again works. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "tests/integration/kvd_harness.h"

static kvd_harness H;

static int setup(void **state) {
    (void)state;
    return kvd_harness_start(&H, NULL);
}

static int teardown(void **state) {
    (void)state;
    return kvd_harness_finish(&H);
}

/* The child: holds 4 committed blocks and 20 WRITING ones, writes into them, then waits to
 * be killed. Reports readiness by writing one byte. */
static void crash_child(int ready) {
    kvc_conn *c;
    kvc_pool *p;
    kv_layout l = kvd_harness_layout();
    if (kvd_harness_connect(&H, "doomed", &c) != KV_OK ||
        kvc_pool_attach(c, "crash-model", &l, &p) != KV_OK) {
        _exit(1);
    }
    uint32_t tok[64];
    for (int i = 0; i < 64; i++) {
        tok[i] = 7 + (uint32_t)i;
    }
    kv_hash128 hs[4];
    size_t nh;
    kvc_block b[24];
    kvc_commit_entry e[4];
    if (kvc_pool_hash_tokens(p, NULL, 0, tok, 64, hs, 4, &nh) != KV_OK ||
        kvc_allocate(p, 24, b) != KV_OK) {
        _exit(1);
    }
    for (int i = 0; i < 4; i++) {
        e[i].block = b[i];
        e[i].hash = hs[i];
        e[i].parent = i == 0 ? KVC_NO_PARENT : b[i - 1].id;
    }
    kvc_block canon[4];
    if (kvc_commit(p, e, 4, canon) != KV_OK) {
        _exit(1);
    }
    for (int i = 4; i < 24; i++) {
        memset(kvc_pool_addr(p, b[i].id, 0, KV_K, 0, 0), 0x5a, 256); /* mid-write */
    }
    if (write(ready, "r", 1) != 1) {
        _exit(1);
    }
    for (;;) {
        pause();
    }
}

static void test_sigkill_mid_write_returns_blocks(void **state) {
    (void)state;
    kvc_conn *c;
    kvc_pool *p;
    kv_layout l = kvd_harness_layout();
    assert_int_equal(kvd_harness_connect(&H, "observer", &c), KV_OK);
    assert_int_equal(kvc_pool_attach(c, "crash-model", &l, &p), KV_OK);
    uint32_t pool = kvc_pool_id(p);
    int pfd[2];
    assert_int_equal(pipe(pfd), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(pfd[0]);
        crash_child(pfd[1]);
    }
    close(pfd[1]);
    char b;
    assert_int_equal(read(pfd[0], &b, 1), 1);
    close(pfd[0]);
    uint64_t v = 0;
    assert_int_equal(kvc_stat_get(c, pool, "pool.blocks_writing", &v), KV_OK);
    assert_int_equal(v, 20);
    assert_int_equal(kvc_stat_get(c, pool, "pool.blocks_committed", &v), KV_OK);
    assert_int_equal(v, 4);
    assert_int_equal(kvc_stat_get(c, 0, "daemon.sessions", &v), KV_OK);
    assert_int_equal(v, 2);
    kill(pid, SIGKILL);
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFSIGNALED(st));
    /* The daemon sees the hang-up on its own time; wait for its effects. */
    assert_int_equal(kvd_harness_wait_stat(c, 0, "daemon.sessions", 1), 1);
    assert_int_equal(kvd_harness_wait_stat(c, pool, "pool.blocks_writing", 0), 0);
    assert_int_equal(kvc_stat_get(c, pool, "pool.blocks_committed", &v), KV_OK);
    assert_int_equal(v, 0);
    /* Committed blocks stay cached for others; the unfinished ones are free again. */
    assert_int_equal(kvc_stat_get(c, pool, "pool.blocks_cached", &v), KV_OK);
    assert_int_equal(v, 4);
    uint64_t total = 0, free_blocks = 0;
    assert_int_equal(kvc_stat_get(c, pool, "pool.blocks_total", &total), KV_OK);
    assert_int_equal(kvc_stat_get(c, pool, "pool.blocks_free", &free_blocks), KV_OK);
    assert_int_equal(free_blocks, total - 4);
    kvc_conn_close(c);
}

static void test_restart_reports_eepoch(void **state) {
    (void)state;
    kvc_conn *c;
    kvc_pool *p;
    kv_layout l = kvd_harness_layout();
    assert_int_equal(kvd_harness_connect(&H, "survivor", &c), KV_OK);
    assert_int_equal(kvc_pool_attach(c, "restart-model", &l, &p), KV_OK);
    kvc_block b[3];
    assert_int_equal(kvc_allocate(p, 3, b), KV_OK);
    uint64_t epoch = kvc_conn_boot_epoch(c);
    assert_int_equal(kvd_harness_restart(&H), 0);
    /* The first call finds the connection closed; the next reconnects and sees the epoch. */
    kv_err err = kvc_ping(c, NULL, 0);
    if (err == KV_ECLOSED) {
        err = kvc_ping(c, NULL, 0);
    }
    assert_int_equal(err, KV_EEPOCH);
    assert_int_not_equal(kvc_conn_boot_epoch(c), epoch);
    assert_true(kvc_pool_stale(p));
    assert_int_equal(kvc_release(p, b, 3), KV_EEPOCH);
    kvc_pool_detach(p);
    assert_int_equal(kvc_pool_attach(c, "restart-model", &l, &p), KV_OK);
    assert_int_equal(kvc_allocate(p, 3, b), KV_OK);
    memset(kvc_pool_addr(p, b[2].id, 1, KV_V, 15, 1), 1, 128);
    assert_int_equal(kvc_release(p, b, 3), KV_OK);
    assert_int_equal(kvc_ping(c, "x", 1), KV_OK);
    kvc_conn_close(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sigkill_mid_write_returns_blocks),
        cmocka_unit_test(test_restart_reports_eepoch),
    };
    return cmocka_run_group_tests_name("integration_lifecycle", tests, setup, teardown);
}
