/* Engine correctness against a real kvd: the llama2.c loader; greedy tokens and logits equal
 * (tolerance below) with the cache off, on in one process, and across processes where the
 * second gets the prefix as hits; speculative decoding gives exactly plain greedy's tokens;
 * continuous batching with preemption gives each request's solo tokens; cascade attention and
 * 8-bit pools agree with the plain path. The whole group runs twice, with 1 and with 2 matmul
 * threads (examples/engine/gemm.h), and one case checks that 1, 2 and 3 threads give the same
 * bits; engine_test_scalar runs it all again on the scalar matmul (KVE_GEMM=scalar). The model
 * is tiny so each case takes well under a second. Tolerance: logits of paged runs against the dense
 * reference within 1e-4 (float32 summation order differs); paged runs against each other
 * bit-identical (every row is computed by the same code whatever the schedule), checked with 0
 * tolerance. */
#include <math.h>
#include <setjmp.h>
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
static int THREADS = 1; /* matmul threads of every engine the group opens */

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
    kvd_harness_fini(&H);
    return 0;
}

static void make_prompt(uint32_t *t, size_t n, uint32_t salt) {
    for (size_t i = 0; i < n; i++) {
        uint32_t s = i + 8 >= n ? salt : 0;
        t[i] = (uint32_t)((i * 2654435761u + s * 40503u + 17) % (uint32_t)CFG.vocab_size);
    }
}

static kve_options opts(void) {
    kve_options o;
    kve_options_init(&o);
    o.socket_path = H.sock;
    o.keep_logits = 1;
    o.token_budget = 32;
    o.threads = THREADS;
    return o;
}

/* Runs one request through a fresh engine with options o. */
static void run_one(const kve_options *o, const uint32_t *p, size_t n, uint32_t max_new,
                    kve_request *r, kve_stats *st) {
    kve_engine *e = NULL;
    assert_int_equal(kve_engine_open(&M, o, &e), KV_OK);
    memset(r, 0, sizeof(*r));
    r->prompt = p;
    r->prompt_len = n;
    r->max_new = max_new;
    assert_int_equal(kve_engine_run(e, r, 1), KV_OK);
    assert_int_equal(r->status, KV_OK);
    assert_int_equal(r->nout, max_new);
    if (st != NULL) {
        *st = *kve_engine_stats(e);
    }
    kve_engine_close(e);
}

static float max_diff(const float *a, const float *b, size_t n) {
    float m = 0;
    for (size_t i = 0; i < n; i++) {
        float d = fabsf(a[i] - b[i]);
        m = d > m ? d : m;
    }
    return m;
}

static void test_checkpoint_loader(void **state) {
    (void)state;
    /* Write a llama2.c file by hand: header, tensors in order, RoPE tables, unshared classifier. */
    kve_config c = {16, 40, 2, 4, 2, 32, 24};
    int hd = c.dim / c.n_heads, kvd = c.n_kv_heads * hd;
    size_t sizes[] = {(size_t)c.vocab_size * c.dim,
                      (size_t)c.n_layers * c.dim,
                      (size_t)c.n_layers * c.dim * c.dim,
                      (size_t)c.n_layers * kvd * c.dim,
                      (size_t)c.n_layers * kvd * c.dim,
                      (size_t)c.n_layers * c.dim * c.dim,
                      (size_t)c.n_layers * c.dim,
                      (size_t)c.n_layers * c.hidden_dim * c.dim,
                      (size_t)c.n_layers * c.dim * c.hidden_dim,
                      (size_t)c.n_layers * c.hidden_dim * c.dim,
                      (size_t)c.dim,
                      (size_t)c.seq_len * hd,
                      (size_t)c.vocab_size * c.dim};
    char path[128];
    snprintf(path, sizeof(path), "%s/model.bin", H.dir);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    int32_t hdr[7] = {c.dim,        c.hidden_dim,  c.n_layers, c.n_heads,
                      c.n_kv_heads, -c.vocab_size, c.seq_len};
    fwrite(hdr, sizeof(hdr), 1, f);
    float v = 0;
    for (size_t t = 0; t < sizeof(sizes) / sizeof(sizes[0]); t++) {
        for (size_t i = 0; i < sizes[t]; i++) {
            /* tensor t holds t*1000 + i/1000, the RoPE tables -1 */
            v = t == 11 ? -1.0f : (float)t * 1000.0f + (float)i / 1000.0f;
            fwrite(&v, sizeof(v), 1, f);
        }
    }
    fclose(f);
    kve_model m;
    assert_int_equal(kve_model_load(path, &m), KV_OK);
    assert_int_equal(m.cfg.vocab_size, 32);
    assert_int_equal(m.shared_cls, 0);
    const float *tensors[] = {m.tok_emb, m.rms_att, m.wq, m.wk,        m.wv, m.wo,  m.rms_ffn,
                              m.w1,      m.w2,      m.w3, m.rms_final, NULL, m.wcls};
    for (size_t t = 0; t < 13; t++) {
        if (tensors[t] == NULL) {
            continue;
        }
        assert_true(tensors[t][0] == (float)t * 1000.0f);
        assert_true(tensors[t][sizes[t] - 1] ==
                    (float)t * 1000.0f + (float)(sizes[t] - 1) / 1000.0f);
    }
    kve_model_fini(&m);
    /* A truncated file is refused. */
    assert_int_equal(truncate(path, 100), 0);
    assert_int_equal(kve_model_load(path, &m), KV_EINVAL);
}

static void test_cache_equivalence(void **state) {
    (void)state;
    enum { N = 90, NEW = 12 };
    uint32_t p[N];
    make_prompt(p, N, 1);
    int V = CFG.vocab_size;
    /* Dense reference: greedy over the reference forward. */
    uint32_t seq[N + NEW];
    float *ref = malloc((size_t)(N + NEW) * V * sizeof(float));
    assert_non_null(ref);
    memcpy(seq, p, sizeof(p));
    uint32_t ref_tok[NEW];
    for (int j = 0; j < NEW; j++) {
        assert_int_equal(kve_model_dense_logits(&M, seq, N + (size_t)j, 0, ref, NULL, NULL), KV_OK);
        ref_tok[j] = kve_argmax(ref + (size_t)(N + j - 1) * V, V);
        seq[N + j] = ref_tok[j];
    }
    kve_options off = opts();
    off.prefix_cache = 0;
    off.model_id = "eq-model";
    kve_options on = off;
    on.prefix_cache = 1;
    kve_request a, b, c, d;
    run_one(&off, p, N, NEW, &a, NULL);
    /* Cache on, one process: the first run fills kvd, the second hits. */
    run_one(&on, p, N, NEW, &b, NULL);
    run_one(&on, p, N, NEW, &c, NULL);
    assert_int_equal(b.cached_tokens, 0);
    assert_int_equal(c.cached_tokens, 80);
    assert_true(c.computed_tokens < b.computed_tokens);
    /* Across processes: a child computes a prompt with the same prefix, the parent hits it. */
    uint32_t p2[N];
    make_prompt(p2, N, 2);
    kve_options on2 = on;
    on2.model_id = "eq-model-2";
    pid_t pid = fork();
    if (pid == 0) {
        kve_request r;
        kve_engine *e = NULL;
        int ok = kve_engine_open(&M, &on2, &e) == KV_OK;
        memset(&r, 0, sizeof(r));
        r.prompt = p;
        r.prompt_len = N;
        r.max_new = 1;
        ok = ok && kve_engine_run(e, &r, 1) == KV_OK && r.status == KV_OK;
        kve_engine_close(e);
        _exit(ok ? 0 : 1);
    }
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    run_one(&on2, p, N, NEW, &d, NULL);
    assert_int_equal(d.cached_tokens, 80);
    for (int j = 0; j < NEW; j++) {
        assert_int_equal(a.out[j], ref_tok[j]);
        assert_int_equal(b.out[j], ref_tok[j]);
        assert_int_equal(c.out[j], ref_tok[j]);
        assert_int_equal(d.out[j], ref_tok[j]);
        /* Logits of token j came from position N + j - 1. */
        const float *rl = ref + (size_t)(N + j - 1) * V;
        assert_true(max_diff(a.logits + (size_t)j * V, rl, (size_t)V) <= 1e-4f);
    }
    size_t all = (size_t)NEW * V;
    assert_true(max_diff(a.logits, b.logits, all) == 0.0f);
    assert_true(max_diff(a.logits, c.logits, all) == 0.0f);
    assert_true(max_diff(a.logits, d.logits, all) == 0.0f);
    kve_request_fini(&a), kve_request_fini(&b), kve_request_fini(&c), kve_request_fini(&d);
    free(ref);
}

static void test_speculative_equals_greedy(void **state) {
    (void)state;
    enum { N = 40, NEW = 30 };
    uint32_t p[N];
    make_prompt(p, N, 3);
    kve_options o = opts();
    o.model_id = "spec-model";
    kve_request plain, spec;
    kve_stats st;
    run_one(&o, p, N, NEW, &plain, NULL);
    for (int k = 1; k <= 5; k += 2) {
        for (int dl = 1; dl <= 2; dl++) {
            kve_options s = o;
            s.spec_k = k;
            s.draft_layers = dl;
            s.model_id = k == 1 ? "spec-model-a" : "spec-model-b"; /* some runs without hits */
            run_one(&s, p, N, NEW, &spec, &st);
            assert_memory_equal(plain.out, spec.out, NEW * sizeof(uint32_t));
            assert_true(st.spec_proposed > 0);
            assert_true(st.spec_accepted <= st.spec_proposed);
            kve_request_fini(&spec);
        }
    }
    kve_request_fini(&plain);
}

static void test_batching_preemption(void **state) {
    (void)state;
    enum { R = 6, NEW = 20 };
    uint32_t prompts[R][70];
    kve_request reqs[R], solo[R];
    kve_options o = opts();
    o.model_id = "batch-model";
    memset(reqs, 0, sizeof(reqs));
    for (int i = 0; i < R; i++) {
        size_t n = 20 + (size_t)i * 10;
        make_prompt(prompts[i], n, (uint32_t)i + 10);
        /* requests 0..2 share a 32-token prefix with each other */
        reqs[i] = (kve_request){.id = (uint32_t)i,
                                .prompt = prompts[i],
                                .prompt_len = n,
                                .max_new = NEW,
                                .arrival_ms = i * 0.1};
        run_one(&o, prompts[i], n, NEW, &solo[i], NULL);
    }
    kve_options b = o;
    b.model_id = "batch-model-2";
    b.block_budget = 14; /* far less than the 6 requests need together */
    b.token_budget = 16;
    kve_engine *e = NULL;
    assert_int_equal(kve_engine_open(&M, &b, &e), KV_OK);
    assert_int_equal(kve_engine_run(e, reqs, R), KV_OK);
    const kve_stats *st = kve_engine_stats(e);
    assert_true(st->preemptions > 0);
    for (int i = 0; i < R; i++) {
        assert_int_equal(reqs[i].status, KV_OK);
        assert_memory_equal(reqs[i].out, solo[i].out, NEW * sizeof(uint32_t));
        kve_request_fini(&reqs[i]);
        kve_request_fini(&solo[i]);
    }
    kve_engine_close(e);
}

static void test_cascade_and_static(void **state) {
    (void)state;
    enum { R = 5, N = 70, NEW = 10 };
    uint32_t prompts[R][N];
    kve_request plain[R], casc[R];
    int V = CFG.vocab_size;
    for (int pass = 0; pass < 3; pass++) {
        kve_options o = opts();
        o.model_id = pass == 0 ? "casc-plain" : pass == 1 ? "casc" : "casc-static";
        o.cascade = pass == 1;
        o.static_batching = pass == 2;
        kve_request *rq = pass == 0 ? plain : casc;
        memset(rq, 0, sizeof(kve_request) * R);
        for (int i = 0; i < R; i++) {
            make_prompt(prompts[i], N, (uint32_t)i + 20); /* 64 shared tokens, 4 blocks */
            rq[i] = (kve_request){
                .id = (uint32_t)i, .prompt = prompts[i], .prompt_len = N, .max_new = NEW};
        }
        kve_engine *e = NULL;
        assert_int_equal(kve_engine_open(&M, &o, &e), KV_OK);
        assert_int_equal(kve_engine_run(e, rq, R), KV_OK);
        if (pass == 1) {
            assert_true(kve_engine_stats(e)->cascade_groups > 0);
        }
        kve_engine_close(e);
        for (int i = 0; pass > 0 && i < R; i++) {
            assert_int_equal(rq[i].status, KV_OK);
            assert_memory_equal(rq[i].out, plain[i].out, NEW * sizeof(uint32_t));
            float tol = pass == 1 ? 1e-4f : 0.0f;
            assert_true(max_diff(rq[i].logits, plain[i].logits, (size_t)NEW * V) <= tol);
            kve_request_fini(&rq[i]);
        }
    }
    for (int i = 0; i < R; i++) {
        kve_request_fini(&plain[i]);
    }
}

static void test_quantized_pools(void **state) {
    (void)state;
    enum { N = 60, NEW = 16 };
    uint32_t p[N];
    make_prompt(p, N, 4);
    int V = CFG.vocab_size;
    kve_options o = opts();
    o.model_id = "quant";
    kve_request ref, q;
    run_one(&o, p, N, NEW, &ref, NULL);
    const kv_dtype dts[] = {KV_DTYPE_INT8, KV_DTYPE_FP8_E4M3, KV_DTYPE_FP16};
    for (size_t i = 0; i < 3; i++) {
        kve_options qo = o;
        qo.kv_dtype = dts[i];
        kve_engine *e = NULL;
        assert_int_equal(kve_engine_open(&M, &qo, &e), KV_OK);
        /* fp32 block 2 layers... memory per token: 8-bit is a quarter of fp32 plus scales */
        const kv_layout *l = kve_engine_layout(e);
        assert_true(l->block_bytes < (uint64_t)CFG.n_layers * 2 * l->tokens_per_block *
                                         (uint64_t)(CFG.dim / CFG.n_heads) * CFG.n_kv_heads * 4);
        kve_engine_close(e);
        kve_request *r = &q;
        run_one(&qo, p, N, NEW, r, NULL);
        /* The first token comes from prompt logits close to fp32's. */
        float d = max_diff(r->logits, ref.logits, (size_t)V);
        print_message("%s: first-token max logit diff %.4f, first token %s\n",
                      kv_dtype_name(dts[i]), d, r->out[0] == ref.out[0] ? "same" : "differs");
        assert_true(d < 0.5f);
        kve_request_fini(r);
    }
    kve_request_fini(&ref);
}

static void test_threads_bit_identical(void **state) {
    (void)state;
    /* Prefill chunks of 32 rows are split between threads (the decode rows are not: too small);
     * both must give the one-thread bits, with batching and speculation on. */
    enum { R = 3, N = 75, NEW = 14 };
    uint32_t prompts[R][N];
    kve_request ref[R], got[R];
    int V = CFG.vocab_size;
    for (int t = 1; t <= 3; t++) {
        kve_options o = opts();
        o.prefix_cache = 0;
        o.threads = t;
        o.spec_k = t == 3 ? 3 : 0;
        kve_request *rq = t == 1 ? ref : got;
        memset(rq, 0, sizeof(kve_request) * R);
        for (int i = 0; i < R; i++) {
            make_prompt(prompts[i], N - (size_t)i * 7, (uint32_t)i + 30);
            rq[i] = (kve_request){.id = (uint32_t)i,
                                  .prompt = prompts[i],
                                  .prompt_len = N - (size_t)i * 7,
                                  .max_new = NEW};
        }
        kve_engine *e = NULL;
        assert_int_equal(kve_engine_open(&M, &o, &e), KV_OK);
        assert_int_equal(kve_engine_run(e, rq, R), KV_OK);
        kve_engine_close(e);
        for (int i = 0; t > 1 && i < R; i++) {
            assert_int_equal(got[i].status, KV_OK);
            assert_memory_equal(got[i].out, ref[i].out, NEW * sizeof(uint32_t));
            assert_true(max_diff(got[i].logits, ref[i].logits, (size_t)NEW * V) == 0.0f);
            kve_request_fini(&got[i]);
        }
    }
    for (int i = 0; i < R; i++) {
        kve_request_fini(&ref[i]);
    }
    /* A bad thread count is refused. */
    kve_options bad = opts();
    bad.threads = 0;
    kve_engine *e = NULL;
    assert_int_equal(kve_engine_open(&M, &bad, &e), KV_EINVAL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_checkpoint_loader),
        cmocka_unit_test(test_cache_equivalence),
        cmocka_unit_test(test_speculative_equals_greedy),
        cmocka_unit_test(test_batching_preemption),
        cmocka_unit_test(test_cascade_and_static),
        cmocka_unit_test(test_quantized_pools),
        cmocka_unit_test(test_threads_bit_identical),
    };
    int failed = 0;
    for (THREADS = 1; THREADS <= 2; THREADS++) {
        print_message("matmul threads: %d\n", THREADS);
        failed += cmocka_run_group_tests(tests, setup, teardown);
    }
    return failed;
}
