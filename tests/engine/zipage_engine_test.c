/* The example engine's Zipage mode against a real kvd (issue 15): a budget larger than the
 * sequence gives full-KV greedy decoding exactly (tokens and logits, bit for bit); under a small
 * budget every request holds at most its budget of blocks, compressions run, asynchronous
 * compression gives the same bits as compression on the scheduler thread; compressed requests
 * preempted under a tight engine block budget are swapped and requeued (never recomputed) and
 * end with the same tokens as unpressured; the prompt prefix they share stays bit-identical in
 * kvd through every compression, and nothing is published after a compression; an engine
 * process killed while it compresses leaks no block. */
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
    static const char *const flags[] = {"--pool-memory=1G", "--segment-bytes=4M", NULL};
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
        uint32_t s = i + 8 >= n ? salt : 0;
        t[i] = (uint32_t)((i * 2654435761u + s * 40503u + 17) % (uint32_t)CFG.vocab_size);
    }
}

static kve_options opts(const char *model) {
    kve_options o;
    kve_options_init(&o);
    o.socket_path = H.sock;
    o.keep_logits = 1;
    o.token_budget = 32;
    o.model_id = model;
    return o;
}

enum { R = 5, NEW = 120, PLEN = 40 };

/* Runs R requests (a shared 32-token prefix, own tails) through one engine. */
static void run_all(const kve_options *o, kve_request *reqs, uint32_t (*prompts)[PLEN],
                    kve_stats *st) {
    memset(reqs, 0, sizeof(kve_request) * R);
    for (int i = 0; i < R; i++) {
        make_prompt(prompts[i], PLEN, (uint32_t)i + 3);
        reqs[i] = (kve_request){.id = (uint32_t)i,
                                .prompt = prompts[i],
                                .prompt_len = PLEN,
                                .max_new = NEW,
                                .arrival_ms = i * 0.2};
    }
    kve_engine *e = NULL;
    assert_int_equal(kve_engine_open(&M, o, &e), KV_OK);
    assert_int_equal(kve_engine_run(e, reqs, R), KV_OK);
    for (int i = 0; i < R; i++) {
        assert_int_equal(reqs[i].status, KV_OK);
        assert_int_equal(reqs[i].nout, NEW);
    }
    if (st != NULL) {
        *st = *kve_engine_stats(e);
    }
    kve_engine_close(e);
}

static void fini_all(kve_request *reqs) {
    for (int i = 0; i < R; i++) {
        kve_request_fini(&reqs[i]);
    }
}

static void test_budget_above_sequence_is_full_kv(void **state) {
    (void)state;
    uint32_t p[R][PLEN];
    kve_request full[R], zip[R];
    kve_options o = opts("zip-eq");
    run_all(&o, full, p, NULL);
    kve_options z = opts("zip-eq");
    z.zip_budget = (PLEN + NEW) / 16 + 2; /* never reached */
    kve_stats st;
    run_all(&z, zip, p, &st);
    assert_int_equal(st.compressions, 0);
    int V = CFG.vocab_size;
    for (int i = 0; i < R; i++) {
        assert_memory_equal(zip[i].out, full[i].out, NEW * sizeof(uint32_t));
        assert_memory_equal(zip[i].logits, full[i].logits, (size_t)NEW * V * sizeof(float));
    }
    fini_all(full);
    fini_all(zip);
}

/* Every block of pool `model` whose hash is one of the chain of toks[0..n), read back. */
static size_t lookup_bytes(const char *model, const uint32_t *toks, size_t n, uint8_t *out) {
    kvc_conn *c;
    assert_int_equal(kvd_harness_connect(&H, "zip-reader", &c), KV_OK);
    kv_layout want = {.num_layers = (uint32_t)CFG.n_layers,
                      .num_kv_heads = (uint32_t)CFG.n_kv_heads,
                      .head_dim = (uint32_t)kve_head_dim(&CFG),
                      .tokens_per_block = 16,
                      .dtype = KV_DTYPE_FP32,
                      .arrangement = KV_LAYER_MAJOR};
    kvc_pool *p;
    assert_int_equal(kvc_pool_attach(c, model, &want, &p), KV_OK);
    kv_hash128 h[64];
    size_t nh = 0, nhit = 0;
    assert_int_equal(kvc_pool_hash_tokens(p, NULL, 0, toks, n, h, 64, &nh), KV_OK);
    kvc_block b[64];
    assert_int_equal(kvc_lookup(p, h, nh, b, &nhit), KV_OK);
    const kv_layout *ly = kvc_pool_layout(p);
    for (size_t i = 0; out != NULL && i < nhit; i++) {
        for (uint32_t l = 0; l < ly->num_layers; l++) {
            for (int kv = 0; kv < 2; kv++) {
                memcpy(out, kvc_pool_addr(p, b[i].id, l, kv, 0, 0), ly->kv_block_bytes);
                out += ly->kv_block_bytes;
            }
        }
    }
    if (nhit > 0) {
        assert_int_equal(kvc_release(p, b, nhit), KV_OK);
    }
    kvc_pool_detach(p);
    kvc_conn_close(c);
    return nhit;
}

static void test_compression_budget_async_and_shared_prefix(void **state) {
    (void)state;
    uint32_t p[R][PLEN];
    kve_request sync[R], async[R];
    /* The shared prefix, committed by an ordinary engine first. */
    kve_options o = opts("zip-share");
    uint32_t pre[PLEN];
    make_prompt(pre, PLEN, 3);
    {
        kve_request warm[R];
        run_all(&o, warm, p, NULL);
        fini_all(warm);
    }
    uint8_t *before = malloc(2u << 20), *after = malloc(2u << 20);
    size_t nb = lookup_bytes("zip-share", pre, 32, before);
    assert_int_equal(nb, 2);
    kve_options z = opts("zip-share");
    z.zip_budget = 4;
    z.zip_sync = 1;
    kve_stats ss, sa;
    run_all(&z, sync, p, &ss);
    z.zip_sync = 0;
    run_all(&z, async, p, &sa);
    assert_true(ss.compressions >= R * 3);
    assert_int_equal(sa.compressions, ss.compressions);
    assert_true(sa.zip_jobs > 0);
    int V = CFG.vocab_size;
    for (int i = 0; i < R; i++) {
        assert_true(async[i].peak_blocks <= 4);
        assert_true(async[i].compressions > 0);
        assert_memory_equal(async[i].out, sync[i].out, NEW * sizeof(uint32_t));
        assert_memory_equal(async[i].logits, sync[i].logits, (size_t)NEW * V * sizeof(float));
    }
    /* The prefix every request shared: same bytes as before any compression. */
    assert_int_equal(lookup_bytes("zip-share", pre, 32, after), 2);
    assert_memory_equal(before, after, 2 * 2 * CFG.n_layers * 16 * kve_kv_dim(&CFG) * 4);
    /* A compressed sequence publishes nothing: on a fresh pool, the chain of prompt +
     * generated tokens hits at most the blocks filled before the first compression (the
     * budget), where a full-KV run publishes all (PLEN + NEW) / 16 of them. */
    kve_request pub[R];
    kve_options zp = opts("zip-pub");
    zp.zip_budget = 4;
    run_all(&zp, pub, p, NULL);
    for (int i = 0; i < R; i++) {
        uint32_t all[PLEN + NEW];
        memcpy(all, p[i], PLEN * sizeof(uint32_t));
        memcpy(all + PLEN, pub[i].out, NEW * sizeof(uint32_t));
        assert_true(lookup_bytes("zip-pub", all, PLEN + NEW, NULL) <= 4);
    }
    fini_all(pub);
    free(before);
    free(after);
    fini_all(sync);
    fini_all(async);
}

static void test_preempted_compressed_are_swapped(void **state) {
    (void)state;
    uint32_t p[R][PLEN];
    kve_request free_run[R], tight[R];
    kve_options z = opts("zip-swap");
    z.zip_budget = 4;
    z.prefix_cache = 0;
    kve_stats st;
    run_all(&z, free_run, p, NULL);
    z.block_budget = 9; /* two requests at 4 blocks and a compression do not fit */
    run_all(&z, tight, p, &st);
    assert_true(st.zip_swaps > 0);
    for (int i = 0; i < R; i++) {
        assert_memory_equal(tight[i].out, free_run[i].out, NEW * sizeof(uint32_t));
    }
    fini_all(free_run);
    fini_all(tight);
}

static void test_bad_options(void **state) {
    (void)state;
    kve_options z = opts("zip-bad");
    kve_engine *e = NULL;
    z.zip_budget = 4;
    z.spec_k = 2;
    assert_int_equal(kve_engine_open(&M, &z, &e), KV_EINVAL);
    z.spec_k = 0;
    z.zip_keep = 64; /* == budget * tpb: no room left */
    assert_int_equal(kve_engine_open(&M, &z, &e), KV_EINVAL);
    z.zip_keep = 0;
    z.zip_budget = 1;
    assert_int_equal(kve_engine_open(&M, &z, &e), KV_EINVAL);
    z.zip_budget = 4;
    z.block_budget = 6; /* 4 blocks + 3 fresh ones cannot fit: it would never compress */
    assert_int_equal(kve_engine_open(&M, &z, &e), KV_EINVAL);
}

/* An engine process SIGKILLed while it compresses: the daemon frees every block it held. */
static void test_killed_while_compressing(void **state) {
    (void)state;
    pid_t pid = fork();
    if (pid == 0) {
        enum { N = 8 };
        static uint32_t prompts[N][PLEN];
        kve_request reqs[N];
        memset(reqs, 0, sizeof(reqs));
        for (int i = 0; i < N; i++) {
            make_prompt(prompts[i], PLEN, (uint32_t)i + 50);
            reqs[i] = (kve_request){.id = (uint32_t)i,
                                    .prompt = prompts[i],
                                    .prompt_len = PLEN,
                                    .max_new = CFG.seq_len - PLEN - 1};
        }
        kve_options z = opts("zip-kill");
        z.keep_logits = 0;
        z.zip_budget = 3;
        kve_engine *e = NULL;
        if (kve_engine_open(&M, &z, &e) != KV_OK) {
            _exit(3);
        }
        (void)kve_engine_run(e, reqs, N); /* killed long before it ends */
        _exit(4);
    }
    kvc_conn *c;
    assert_int_equal(kvd_harness_connect(&H, "zip-watch", &c), KV_OK);
    kvd_harness_sleep_ms(400); /* well into compressions (one every 16 tokens per request) */
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
    assert_int_equal(kvc_pool_attach(c, "zip-kill", &want, &p), KV_OK);
    uint32_t id = kvc_pool_id(p);
    assert_int_equal(kvd_harness_wait_stat(c, id, "pool.blocks_writing", 0), 0);
    assert_int_equal(kvd_harness_wait_stat(c, id, "pool.blocks_committed", 0), 0);
    assert_int_equal(kvd_harness_stat(c, id, "pool.blocks_private"), 0);
    kvc_pool_detach(p);
    kvc_conn_close(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_budget_above_sequence_is_full_kv),
        cmocka_unit_test(test_compression_budget_async_and_shared_prefix),
        cmocka_unit_test(test_preempted_compressed_are_swapped),
        cmocka_unit_test(test_bad_options),
        cmocka_unit_test(test_killed_while_compressing),
    };
    return cmocka_run_group_tests_name("zipage_engine", tests, setup, teardown);
}
