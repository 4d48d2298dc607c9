/* The example engine's IceCache mode against a real kvd with a host-memory tier (issue 16):
 * a budget that covers the whole context is full attention exactly (tokens and logits bit for
 * bit); an offload whose selection takes every page agrees with full attention within float
 * summation order (the packed pages are the same tokens in another order) and gives its greedy
 * tokens; under a small pool the offloaded pages are demoted and the ones selected come back up,
 * and kvd's tier counters show exactly the promoted pages' bytes moved; an engine killed while it
 * fetches leaks nothing. */
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "examples/engine/engine.h"
#include "examples/engine/model.h"
#include "tests/integration/kvd_harness.h"

static kvd_harness H;
static kve_model M;
static const kve_config CFG = {32, 96, 3, 4, 2, 64, 4096};

static int setup(void **state) {
    (void)state;
    /* Small T0 (one 256 KiB segment of 6 KiB blocks), a 64 MiB tier 1 written through. */
    static const char *const flags[] = {"--pool-memory=300K",   "--segment-bytes=256K",
                                        "--tier1-memory=64M",   "--tier-write=write-through",
                                        "--fetch-min-tokens=1", NULL};
    if (kvd_harness_start(&H, flags) != 0) {
        return -1;
    }
    return kve_model_random(&CFG, 7, 0, &M) == KV_OK ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    kve_model_fini(&M);
    return kvd_harness_finish(&H);
}

static void make_prompt(uint32_t *t, size_t n, uint32_t salt) {
    for (size_t i = 0; i < n; i++) {
        t[i] = (uint32_t)((i * 2654435761u + salt * 40503u + 17) % (uint32_t)CFG.vocab_size);
    }
}

static kve_options opts(const char *model) {
    kve_options o;
    kve_options_init(&o);
    o.socket_path = H.sock;
    o.keep_logits = 1;
    o.token_budget = 64;
    o.model_id = model;
    o.prefix_cache = 0;
    return o;
}

enum { R = 3, PLEN = 160, NEW = 48 };

static void run_all(const kve_options *o, kve_request *reqs, uint32_t (*p)[PLEN], kve_stats *st) {
    memset(reqs, 0, sizeof(kve_request) * R);
    for (int i = 0; i < R; i++) {
        make_prompt(p[i], PLEN, (uint32_t)i + 1);
        reqs[i] = (kve_request){.id = (uint32_t)i,
                                .prompt = p[i],
                                .prompt_len = PLEN,
                                .max_new = NEW,
                                .arrival_ms = i * 0.1};
    }
    /* kvd ends the engine's session when it reads the close, after kve_engine_close returns:
     * the next engine's pool needs this one's segment back (pool-memory holds one), so the
     * sessions are counted before and waited for after (under load the next attach could
     * otherwise come first and fail with ENOSPC). */
    kvc_conn *obs;
    assert_int_equal(kvd_harness_connect(&H, "ice-observer", &obs), KV_OK);
    uint64_t sessions = kvd_harness_stat(obs, 0, "daemon.sessions");
    kve_engine *e = NULL;
    assert_int_equal(kve_engine_open(&M, o, &e), KV_OK);
    assert_int_equal(kve_engine_run(e, reqs, R), KV_OK);
    for (int i = 0; i < R; i++) {
        assert_int_equal(reqs[i].status, KV_OK);
    }
    if (st != NULL) {
        *st = *kve_engine_stats(e);
    }
    kve_engine_close(e);
    assert_int_equal(kvd_harness_wait_stat(obs, 0, "daemon.sessions", sessions), sessions);
    kvc_conn_close(obs);
}

static void fini_all(kve_request *r) {
    for (int i = 0; i < R; i++) {
        kve_request_fini(&r[i]);
    }
}

static void test_budget_covers_context(void **state) {
    (void)state;
    uint32_t p[R][PLEN];
    kve_request full[R], ice[R];
    kve_options o = opts("ice-eq");
    run_all(&o, full, p, NULL);
    o.ice_budget = (PLEN + NEW) / 16 + 1;
    kve_stats st;
    run_all(&o, ice, p, &st);
    assert_int_equal(st.ice_offloads, 0);
    for (int i = 0; i < R; i++) {
        assert_memory_equal(ice[i].out, full[i].out, NEW * sizeof(uint32_t));
        assert_memory_equal(ice[i].logits, full[i].logits,
                            (size_t)NEW * CFG.vocab_size * sizeof(float));
    }
    fini_all(full);
    fini_all(ice);
}

static uint64_t tier_stat(kvc_conn *c, const char *name) {
    return kvd_harness_stat(c, 0, name);
}

static void test_offload_select_all_and_promotion(void **state) {
    (void)state;
    uint32_t p[R][PLEN];
    kve_request full[R], ice[R];
    kve_options o = opts("ice-all");
    run_all(&o, full, p, NULL);
    kvc_conn *c;
    assert_int_equal(kvd_harness_connect(&H, "ice-watch", &c), KV_OK);
    uint64_t up0 = tier_stat(c, "tiers.promotions_t1");
    uint64_t bytes0 = tier_stat(c, "tiers.copy_bytes_up_t1");
    o.ice_budget = 64;     /* more than there are pages: every page is selected */
    o.ice_offload_min = 1; /* but offload as soon as there is a middle */
    kve_stats st;
    run_all(&o, ice, p, &st);
    assert_int_equal(st.ice_offloads, R);
    assert_true(st.ice_pages_out > 0);
    assert_int_equal(st.ice_pages_missing, 0);
    int V = CFG.vocab_size;
    for (int i = 0; i < R; i++) {
        float worst = 0;
        for (size_t j = 0; j < (size_t)NEW * V; j++) {
            float d = fabsf(ice[i].logits[j] - full[i].logits[j]);
            worst = d > worst ? d : worst;
        }
        assert_true(worst <= 1e-4f);
        assert_memory_equal(ice[i].out, full[i].out, NEW * sizeof(uint32_t));
    }
    /* The small T0 could not keep every offloaded page: some came up from tier 1, and the
     * daemon moved exactly those pages' bytes. */
    uint64_t up = tier_stat(c, "tiers.promotions_t1") - up0;
    uint64_t bytes = tier_stat(c, "tiers.copy_bytes_up_t1") - bytes0;
    assert_true(st.ice_pages_promoted > 0);
    assert_int_equal(up, st.ice_pages_promoted);
    uint64_t block = (uint64_t)2 * CFG.n_layers * 16 * kve_kv_dim(&CFG) * sizeof(float);
    assert_int_equal(bytes, up * block);
    kvc_conn_close(c);
    fini_all(full);
    fini_all(ice);
}

static void test_small_budget_runs(void **state) {
    (void)state;
    uint32_t p[R][PLEN];
    kve_request ice[R];
    kve_options o = opts("ice-small");
    o.ice_budget = 2;
    kve_stats st;
    run_all(&o, ice, p, &st);
    assert_int_equal(st.ice_offloads, R);
    /* Selections per decode step and layer once offloaded; at most budget * heads pages each. */
    assert_true(st.ice_selections > 0);
    assert_true(st.ice_pages_fetched <= st.ice_selections * 2 * CFG.n_kv_heads);
    fini_all(ice);
    kve_options bad = opts("ice-bad");
    bad.ice_budget = 4;
    bad.spec_k = 2;
    kve_engine *e = NULL;
    assert_int_equal(kve_engine_open(&M, &bad, &e), KV_EINVAL);
}

static void test_killed_while_fetching(void **state) {
    (void)state;
    pid_t pid = fork();
    if (pid == 0) {
        enum { N = 4 };
        static uint32_t prompts[N][PLEN];
        kve_request reqs[N];
        memset(reqs, 0, sizeof(reqs));
        for (int i = 0; i < N; i++) {
            make_prompt(prompts[i], PLEN, (uint32_t)i + 70);
            reqs[i] = (kve_request){
                .id = (uint32_t)i, .prompt = prompts[i], .prompt_len = PLEN, .max_new = 3000};
        }
        kve_options o = opts("ice-kill");
        o.keep_logits = 0;
        o.ice_budget = 2;
        kve_engine *e = NULL;
        if (kve_engine_open(&M, &o, &e) != KV_OK) {
            _exit(3);
        }
        (void)kve_engine_run(e, reqs, N);
        _exit(4);
    }
    kvc_conn *c;
    assert_int_equal(kvd_harness_connect(&H, "ice-watch2", &c), KV_OK);
    kvd_harness_sleep_ms(500);
    assert_int_equal(kill(pid, SIGKILL), 0);
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFSIGNALED(st));
    kv_layout want = {.num_layers = (uint32_t)CFG.n_layers,
                      .num_kv_heads = (uint32_t)CFG.n_kv_heads,
                      .head_dim = (uint32_t)kve_head_dim(&CFG),
                      .tokens_per_block = 16,
                      .dtype = KV_DTYPE_FP32,
                      .arrangement = KV_LAYER_MAJOR};
    kvc_pool *p;
    assert_int_equal(kvc_pool_attach_ex(c, "ice-kill", &want, KVC_ATTACH_SUMMARIES, &p), KV_OK);
    uint32_t id = kvc_pool_id(p);
    assert_int_equal(kvd_harness_wait_stat(c, id, "pool.blocks_writing", 0), 0);
    assert_int_equal(kvd_harness_wait_stat(c, id, "pool.blocks_committed", 0), 0);
    kvc_pool_detach(p);
    kvc_conn_close(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_budget_covers_context),
        cmocka_unit_test(test_offload_select_all_and_promotion),
        cmocka_unit_test(test_small_budget_runs),
        cmocka_unit_test(test_killed_while_fetching),
    };
    return cmocka_run_group_tests_name("icecache_engine", tests, setup, teardown);
}
