/* buffer_limit_test: the global bound on connection buffers (max-buffer-bytes). A raw client
 * pipelines 100 Pings with 32 KB payloads (3.2 MB of replies, below its own max-output-bytes)
 * and reads nothing: once the buffers over all connections pass the 64 KiB bound, kvd stops
 * reading that connection (daemon.conns_paused) instead of buffering more, while a bystander's
 * Ping is still answered. When the client reads, it drains, is read again, and every Ping gets
 * its reply in order; nothing is left paused. No timing is asserted. */
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/kv_wire.h"
#include "tests/integration/kvd_harness.h"

#define NPINGS 100
#define PAYLOAD 32000

static kvd_harness H;
static const char *const FLAGS[] = {"--max-buffer-bytes=64K", "--max-output-bytes=8M",
                                    "--max-inflight=1000", NULL};

static int setup(void **state) {
    (void)state;
    signal(SIGPIPE, SIG_IGN);
    return kvd_harness_start(&H, FLAGS);
}

static int teardown(void **state) {
    (void)state;
    return kvd_harness_finish(&H);
}

static size_t encode(Kvd__Envelope *env, uint8_t **out) {
    size_t n = 0;
    assert_int_equal(kv_wire_encode(env, 1u << 20, out, &n), KV_OK);
    return n;
}

/* Sends the Pings (blocking: a paused connection blocks this thread, not the test). */
static void *sender(void *arg) {
    int fd = *(int *)arg;
    uint8_t *pl = calloc(1, PAYLOAD);
    for (uint64_t i = 1; i <= NPINGS && pl != NULL; i++) {
        Kvd__Envelope env = KVD__ENVELOPE__INIT;
        Kvd__Ping ping = KVD__PING__INIT;
        ping.nonce = i;
        ping.payload.data = pl;
        ping.payload.len = PAYLOAD;
        env.id = i;
        env.body_case = KVD__ENVELOPE__BODY_PING;
        env.ping = &ping;
        uint8_t *f = NULL;
        size_t n = 0;
        if (kv_wire_encode(&env, 1u << 20, &f, &n) != KV_OK) {
            break;
        }
        size_t off = 0;
        while (off < n) {
            ssize_t w = send(fd, f + off, n - off, MSG_NOSIGNAL);
            if (w <= 0) {
                break;
            }
            off += (size_t)w;
        }
        free(f);
    }
    free(pl);
    return NULL;
}

static void test_global_buffer_bound(void **state) {
    (void)state;
    kvc_conn *by;
    assert_int_equal(kvd_harness_connect(&H, "bystander", &by), KV_OK);
    int fd = kvd_harness_raw_connect(&H);
    assert_true(fd >= 0);
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    Kvd__Hello hello = KVD__HELLO__INIT;
    hello.protocol_version = 1;
    hello.client_name = "hog";
    env.id = 0;
    env.body_case = KVD__ENVELOPE__BODY_HELLO;
    env.hello = &hello;
    uint8_t *f = NULL;
    size_t n = encode(&env, &f);
    assert_int_equal(send(fd, f, n, MSG_NOSIGNAL), (ssize_t)n);
    free(f);
    Kvd__Envelope *e = NULL;
    assert_int_equal(kvd_harness_raw_read(fd, &e), 0);
    assert_int_equal(e->body_case, KVD__ENVELOPE__BODY_HELLO_REPLY);
    kv_wire_free(e);

    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, sender, &fd), 0);
    /* Wait (bounded) until kvd pauses the connection; the bystander is answered meanwhile. */
    uint64_t paused = 0;
    for (int i = 0; i < 1000 && paused == 0; i++) {
        assert_int_equal(kvc_ping(by, "x", 1), KV_OK);
        paused = kvd_harness_stat(by, 0, "daemon.conns_paused");
        if (paused == 0) {
            struct timespec ts = {0, 10 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
    }
    assert_int_equal(paused, 1);
    /* The client reads: every Ping is answered, in order, on the same connection. */
    for (uint64_t i = 1; i <= NPINGS; i++) {
        e = NULL;
        assert_int_equal(kvd_harness_raw_read(fd, &e), 0);
        assert_int_equal(e->body_case, KVD__ENVELOPE__BODY_PONG);
        assert_int_equal(e->id, i);
        kv_wire_free(e);
    }
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_int_equal(kvc_ping(by, NULL, 0), KV_OK);
    assert_int_equal(kvd_harness_stat(by, 0, "daemon.conns_paused"), 0);
    close(fd);
    kvc_conn_close(by);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_global_buffer_bound),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
