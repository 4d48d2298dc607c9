/* domains_test: libkvclient and a real kvd with a tenants file (four token tenants a..d, group
 * "team" of a and b, commons with min-tenants=3). Checks, through the public API only: attach
 * maps the linked pools (group writable, commons read-only); a block committed in the group pool
 * by a is a hit for b with the same bytes, and the sequence helper mixes it with private blocks
 * (per-pool CSR export, release to the right pools); a prefix enters the commons after three
 * tenants committed it, hits there with equal bytes, and the commons mapping cannot be written
 * (mprotect fails, a write faults in a forked child); tenants sharing nothing get zero hits. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvclient.h"
#include "tests/integration/kvd_harness.h"

#define TPB 16   /* tokens per block of kvd_harness_layout */
#define NPREF 4  /* blocks of the shared prefix */
#define MAXT 256 /* tokens per test sequence at most */

typedef struct fixture {
    kvd_harness h;  /* the daemon */
    char dir[80];   /* tenants file and token files */
    char flag[128]; /* --tenants-file=... */
} fixture;

static const char *const names[] = {"a", "b", "c", "d"};

static void token_of(const char *name, char *out, size_t cap) {
    snprintf(out, cap, "tok-%s-0123456789abcdef0123456789", name);
}

static void write_file(const char *dir, const char *name, const char *text) {
    char path[160];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    assert_int_equal(fputs(text, f) >= 0, 1);
    assert_int_equal(fclose(f), 0);
}

static int setup(void **state) {
    fixture *f = calloc(1, sizeof(*f));
    assert_non_null(f);
    const char *tmp = getenv("TEST_TMPDIR");
    snprintf(f->dir, sizeof(f->dir), "%s/kvd-dom-XXXXXX", tmp && strlen(tmp) < 50 ? tmp : "/tmp");
    assert_non_null(mkdtemp(f->dir));
    char text[1024] = "";
    for (size_t i = 0; i < 4; i++) {
        char tok[64], file[32], line[200];
        token_of(names[i], tok, sizeof(tok));
        snprintf(file, sizeof(file), "%s.token", names[i]);
        write_file(f->dir, file, tok);
        snprintf(line, sizeof(line), "tenant %s token-file=%s/%s\n", names[i], f->dir, file);
        strcat(text, line);
    }
    strcat(text, "group team members=a,b\ncommons min-tenants=3\n");
    write_file(f->dir, "tenants", text);
    snprintf(f->flag, sizeof(f->flag), "--tenants-file=%s/tenants", f->dir);
    assert_true(strlen(f->flag) < sizeof(f->h.args[0]));
    const char *flags[] = {f->flag, "--segment-bytes=1048576", "--pool-memory=67108864", NULL};
    if (kvd_harness_start(&f->h, flags) != 0) {
        fail_msg("kvd did not start");
    }
    *state = f;
    return 0;
}

static int teardown(void **state) {
    fixture *f = *state;
    kvd_harness_fini(&f->h);
    char cmd[200];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", f->dir);
    if (system(cmd) != 0) {
        return -1;
    }
    free(f);
    return 0;
}

/* Connects as tenant name and attaches the test model. */
static kvc_conn *connect_as(fixture *f, const char *name, kvc_pool **pool) {
    char tok[64];
    token_of(name, tok, sizeof(tok));
    kvc_options o;
    kvc_options_init(&o);
    o.socket_path = f->h.sock;
    o.client_name = name;
    o.token = tok;
    o.token_len = strlen(tok);
    o.timeout_ms = 5000;
    kvc_conn *c;
    assert_int_equal(kvc_conn_open(&o, &c), KV_OK);
    assert_string_equal(kvc_conn_tenant(c), name);
    kv_layout l = kvd_harness_layout();
    kv_err err = kvc_pool_attach(c, "domains-model", &l, pool);
    if (err != KV_OK) {
        fail_msg("attach as %s: %s", name, kvc_last_error(c));
    }
    return c;
}

/* The linked pool of p in domain dom, or NULL. */
static kvc_pool *domain_pool(kvc_pool *p, const char *dom) {
    for (uint32_t i = 0; i < kvc_pool_nlinked(p); i++) {
        kvc_pool *lp = kvc_pool_linked(p, i);
        if (strcmp(kvc_pool_domain(lp), dom) == 0) {
            return lp;
        }
    }
    return NULL;
}

/* The fp16 pattern value of one element of token position pos. */
static uint16_t value(uint32_t token, uint32_t pos, uint32_t layer, int kv, uint32_t head,
                      uint32_t d) {
    uint64_t x = (uint64_t)token * 0x9e3779b97f4a7c15ull ^ (uint64_t)pos << 40 ^
                 (uint64_t)layer << 32 ^ (uint64_t)kv << 28 ^ (uint64_t)head << 20 ^ d;
    x ^= x >> 29;
    return (uint16_t)(x * 0xbf58476d1ce4e5b9ull >> 48);
}

/* Writes (check 0) or counts mismatches of (check 1) the K/V of tokens tok[first_pos..+TPB)
 * in block b of pool p. */
static int block_io(kvc_pool *p, kvc_block b, const uint32_t *tok, uint32_t first_pos, int check) {
    const kv_layout *l = kvc_pool_layout(p);
    int bad = 0;
    for (uint32_t t = 0; t < TPB; t++) {
        for (uint32_t layer = 0; layer < l->num_layers; layer++) {
            for (int kv = KV_K; kv <= KV_V; kv++) {
                for (uint32_t h = 0; h < l->num_kv_heads; h++) {
                    uint16_t *row = kvc_pool_addr(p, b.id, layer, kv, t, h);
                    assert_non_null(row);
                    for (uint32_t d = 0; d < l->head_dim; d++) {
                        uint16_t v = value(tok[first_pos + t], first_pos + t, layer, kv, h, d);
                        if (!check) {
                            row[d] = v;
                        } else if (row[d] != v) {
                            bad++;
                        }
                    }
                }
            }
        }
    }
    return bad;
}

static void make_tokens(uint32_t *tok, size_t n, uint32_t salt) {
    for (size_t i = 0; i < n; i++) {
        tok[i] = salt * 1000 + (uint32_t)i;
    }
}

/* Commits tok's first NPREF blocks in pool p (allocate, write, commit) and releases them. */
static void put_prefix(kvc_pool *p, const uint32_t *tok) {
    kv_hash128 hs[NPREF];
    size_t nh;
    assert_int_equal(kvc_pool_hash_tokens(p, NULL, 0, tok, NPREF * TPB, hs, NPREF, &nh), KV_OK);
    assert_int_equal(nh, NPREF);
    kvc_block b[NPREF], canon[NPREF];
    assert_int_equal(kvc_allocate(p, NPREF, b), KV_OK);
    kvc_commit_entry e[NPREF];
    for (uint32_t i = 0; i < NPREF; i++) {
        block_io(p, b[i], tok, i * TPB, 0);
        e[i].block = b[i];
        e[i].hash = hs[i];
        e[i].parent = i == 0 ? KVC_NO_PARENT : b[i - 1].id;
    }
    assert_int_equal(kvc_commit(p, e, NPREF, canon), KV_OK);
    assert_int_equal(kvc_release(p, canon, NPREF), KV_OK);
}

/* Commits tok's first NPREF blocks through a sequence of pool p that searches nothing else. */
static void put_prefix_seq(kvc_pool *p, const uint32_t *tok) {
    kvc_seq *s;
    assert_int_equal(kvc_seq_alloc(p, MAXT, NULL, 0, &s), KV_OK);
    kvc_seq_set_search_domains(s, 0);
    size_t cached;
    assert_int_equal(kvc_seq_prefill(s, tok, NPREF * TPB, &cached), KV_OK);
    for (size_t i = cached / TPB; i < NPREF; i++) {
        assert_ptr_equal(kvc_seq_block_pool(s, i), p);
        block_io(p, kvc_seq_block(s, i), tok, (uint32_t)i * TPB, 0);
    }
    assert_int_equal(kvc_seq_commit(s, NPREF * TPB, NULL), KV_OK);
    assert_int_equal(kvc_seq_ncommitted(s), NPREF);
    kvc_seq_free(s);
}

static uint64_t refs_held(kvc_conn *c) {
    uint64_t v = UINT64_MAX;
    assert_int_equal(kvc_stat_get(c, 0, "session.refs_held", &v), KV_OK);
    return v;
}

static void test_linked_pools_mapped(void **state) {
    fixture *f = *state;
    kvc_pool *pa, *pc;
    kvc_conn *ca = connect_as(f, "a", &pa);
    kvc_conn *cc = connect_as(f, "c", &pc);
    /* a: its group, then the commons; c: the commons only. */
    assert_int_equal(kvc_pool_nlinked(pa), 2);
    assert_string_equal(kvc_pool_domain(pa), "a");
    assert_string_equal(kvc_pool_domain(kvc_pool_linked(pa, 0)), "group:team");
    assert_string_equal(kvc_pool_domain(kvc_pool_linked(pa, 1)), "commons");
    assert_false(kvc_pool_read_only(pa));
    assert_false(kvc_pool_read_only(kvc_pool_linked(pa, 0)));
    assert_true(kvc_pool_read_only(kvc_pool_linked(pa, 1)));
    assert_int_equal(kvc_pool_nlinked(pc), 1);
    assert_string_equal(kvc_pool_domain(kvc_pool_linked(pc, 0)), "commons");
    assert_int_equal(kvc_pool_id(kvc_pool_linked(pc, 0)), kvc_pool_id(kvc_pool_linked(pa, 1)));
    assert_int_not_equal(kvc_pool_id(pa), kvc_pool_id(pc));
    for (uint32_t i = 0; i < kvc_pool_nlinked(pa); i++) {
        kvc_pool *lp = kvc_pool_linked(pa, i);
        assert_ptr_equal(kvc_pool_owner(lp), pa);
        assert_ptr_equal(kvc_pool_find(pa, kvc_pool_id(lp)), lp);
        assert_ptr_equal(kvc_pool_find(lp, kvc_pool_id(pa)), pa);
        assert_true(kvc_pool_segments(lp) >= 1);
        assert_non_null(kvc_pool_segment_base(lp, 0, NULL));
        assert_non_null(kvc_pool_layer_base(lp, 1, KV_V));
        assert_int_equal(kvc_pool_block_read_only(lp, 0), kvc_pool_read_only(lp));
        kvc_pool_detach(lp); /* a linked pool goes with its owner: nothing happens */
    }
    assert_ptr_equal(kvc_pool_owner(pa), pa);
    assert_null(kvc_pool_linked(pa, 2));
    assert_null(kvc_pool_find(pa, kvc_pool_id(pc)));
    kvc_conn_close(ca);
    kvc_conn_close(cc);
}

static void test_group_hits_same_bytes(void **state) {
    fixture *f = *state;
    kvc_pool *pa, *pb, *pc;
    kvc_conn *ca = connect_as(f, "a", &pa);
    kvc_conn *cb = connect_as(f, "b", &pb);
    kvc_conn *cc = connect_as(f, "c", &pc);
    kvc_pool *ga = domain_pool(pa, "group:team");
    kvc_pool *gb = domain_pool(pb, "group:team");
    assert_non_null(ga);
    assert_non_null(gb);
    assert_null(domain_pool(pc, "group:team"));
    assert_int_equal(kvc_pool_id(ga), kvc_pool_id(gb));

    uint32_t tok[MAXT];
    make_tokens(tok, MAXT, 7);
    put_prefix(ga, tok); /* a writes the prefix into the group pool */

    kv_hash128 hs[NPREF];
    size_t nh, nhit;
    assert_int_equal(kvc_pool_hash_tokens(pb, NULL, 0, tok, NPREF * TPB, hs, NPREF, &nh), KV_OK);
    kvc_block hit[NPREF];
    kvc_pool *where[NPREF];
    /* The private pool alone has nothing. */
    assert_int_equal(kvc_lookup(pb, hs, NPREF, hit, &nhit), KV_OK);
    assert_int_equal(nhit, 0);
    /* With the domain search: every block, in the group pool, with a's bytes. */
    assert_int_equal(kvc_lookup_domains(pb, hs, NPREF, hit, where, &nhit), KV_OK);
    assert_int_equal(nhit, NPREF);
    for (uint32_t i = 0; i < NPREF; i++) {
        assert_ptr_equal(where[i], gb);
        assert_int_equal(block_io(gb, hit[i], tok, i * TPB, 1), 0);
    }
    assert_int_equal(refs_held(cb), NPREF);
    assert_int_equal(kvc_release_multi(where, hit, NPREF), KV_OK);
    assert_int_equal(refs_held(cb), 0);

    /* c is in no group: zero hits with or without the search. */
    kvc_pool *wc[NPREF];
    assert_int_equal(kvc_lookup_domains(pc, hs, NPREF, hit, wc, &nhit), KV_OK);
    assert_int_equal(nhit, 0);

    /* b's sequence: the prefix from the group, the rest private. */
    kvc_seq *s;
    assert_int_equal(kvc_seq_alloc(pb, MAXT, NULL, 0, &s), KV_OK);
    kvc_seq_set_search_domains(s, 1); /* hits in the group and commons pools */
    size_t n = (NPREF + 1) * TPB + 3, cached;
    assert_int_equal(kvc_seq_prefill(s, tok, n, &cached), KV_OK);
    assert_int_equal(cached, NPREF * TPB);
    assert_int_equal(kvc_seq_nblocks(s), NPREF + 2);
    for (size_t i = 0; i < kvc_seq_nblocks(s); i++) {
        assert_ptr_equal(kvc_seq_block_pool(s, i), i < NPREF ? gb : pb);
    }
    assert_true(kvc_seq_mixed(s));
    for (uint32_t i = 0; i < NPREF; i++) {
        assert_int_equal(block_io(gb, kvc_seq_block(s, i), tok, i * TPB, 1), 0);
    }
    block_io(pb, kvc_seq_block(s, NPREF), tok, NPREF * TPB, 0);
    /* One page table cannot hold two pools' ids; one table per pool can. */
    int32_t indptr[2], idx[8], last[1];
    size_t nidx;
    assert_int_equal(kvc_seq_export_csr(&s, 1, indptr, 2, idx, 8, last, 1, &nidx), KV_ENOTSUP);
    assert_int_equal(kvc_seq_export_csr_pool(&s, 1, gb, indptr, 2, idx, 8, last, 1, &nidx), KV_OK);
    assert_int_equal(nidx, NPREF);
    assert_int_equal(indptr[1], NPREF);
    assert_int_equal(last[0], TPB);
    for (uint32_t i = 0; i < NPREF; i++) {
        assert_int_equal(idx[i], (int32_t)kvc_seq_block(s, i).id);
    }
    assert_int_equal(kvc_seq_export_csr_pool(&s, 1, pb, indptr, 2, idx, 8, last, 1, &nidx), KV_OK);
    assert_int_equal(nidx, 2);
    assert_int_equal(idx[0], (int32_t)kvc_seq_block(s, NPREF).id);
    assert_int_equal(idx[1], (int32_t)kvc_seq_block(s, NPREF + 1).id);
    assert_int_equal(last[0], 3);
    /* The private block after group blocks commits (its parent is in another pool). */
    size_t ncom;
    assert_int_equal(kvc_seq_commit(s, (NPREF + 1) * TPB, &ncom), KV_OK);
    assert_int_equal(ncom, 1);
    /* Rewind into the group prefix: the group block goes back to the group pool. */
    size_t valid;
    assert_int_equal(kvc_seq_rewind(s, NPREF * TPB - 5, &valid), KV_OK);
    assert_int_equal(valid, (NPREF - 1) * TPB);
    assert_ptr_equal(kvc_seq_block_pool(s, NPREF - 1), pb);
    assert_int_equal(kvc_seq_nblocks(s), NPREF);
    /* Release goes to each block's own pool: the daemon would refuse a wrong one (EPERM). */
    assert_int_equal(kvc_seq_release(s), KV_OK);
    assert_int_equal(refs_held(cb), 0);

    /* Without the domain search the sequence keeps to its own pool. */
    kvc_seq_set_search_domains(s, 0);
    assert_int_equal(kvc_seq_prefill(s, tok, n, &cached), KV_OK);
    assert_int_equal(cached, 0);
    assert_false(kvc_seq_mixed(s));
    assert_int_equal(kvc_seq_export_csr(&s, 1, indptr, 2, idx, 8, last, 1, &nidx), KV_OK);
    assert_int_equal(nidx, NPREF + 2);
    kvc_seq_free(s);
    assert_int_equal(refs_held(cb), 0);
    kvc_conn_close(ca);
    kvc_conn_close(cb);
    kvc_conn_close(cc);
}

/* 0 when writing one byte at addr kills a forked child with SIGSEGV. */
static int write_faults(volatile uint8_t *addr) {
    pid_t pid = fork();
    if (pid < 0) {
        return -1;
    }
    if (pid == 0) {
        signal(SIGSEGV, SIG_DFL);
        *addr = (uint8_t)(*addr + 1);
        _exit(0); /* the write went through */
    }
    int st;
    if (waitpid(pid, &st, 0) != pid) {
        return -1;
    }
    return WIFSIGNALED(st) && (WTERMSIG(st) == SIGSEGV || WTERMSIG(st) == SIGBUS) ? 0 : 1;
}

static void test_commons_after_three_tenants(void **state) {
    fixture *f = *state;
    kvc_pool *p[4];
    kvc_conn *c[4];
    for (int i = 0; i < 4; i++) {
        c[i] = connect_as(f, names[i], &p[i]);
    }
    uint32_t tok[MAXT];
    make_tokens(tok, MAXT, 11);
    kv_hash128 hs[NPREF];
    size_t nh, nhit;
    assert_int_equal(kvc_pool_hash_tokens(p[1], NULL, 0, tok, NPREF * TPB, hs, NPREF, &nh), KV_OK);
    kvc_block hit[NPREF];
    kvc_pool *where[NPREF];
    /* a, c and d commit the prefix in their private pools; b (sharing a group with a, but a
     * committed privately) sees nothing until the third tenant did. */
    int writers[3] = {0, 2, 3};
    for (int w = 0; w < 3; w++) {
        assert_int_equal(kvc_lookup_domains(p[1], hs, NPREF, hit, where, &nhit), KV_OK);
        assert_int_equal(nhit, 0);
        put_prefix_seq(p[writers[w]], tok);
        if (w == 0) {
            put_prefix_seq(p[0], tok); /* the same tenant twice counts once */
        }
    }
    kvc_pool *commons = domain_pool(p[1], "commons");
    assert_non_null(commons);
    assert_int_equal(kvc_lookup_domains(p[1], hs, NPREF, hit, where, &nhit), KV_OK);
    assert_int_equal(nhit, NPREF);
    for (uint32_t i = 0; i < NPREF; i++) {
        assert_ptr_equal(where[i], commons);
        assert_true(kvc_pool_block_read_only(commons, hit[i].id));
        assert_int_equal(block_io(commons, hit[i], tok, i * TPB, 1), 0);
    }
    /* The commons mapping is read-only: mprotect refuses, a write faults. */
    uint8_t *addr = kvc_pool_addr(commons, hit[0].id, 0, KV_K, 0, 0);
    assert_non_null(addr);
    long ps = sysconf(_SC_PAGESIZE);
    void *page = (void *)((uintptr_t)addr & ~(uintptr_t)(ps - 1));
    assert_int_not_equal(mprotect(page, (size_t)ps, PROT_READ | PROT_WRITE), 0);
    assert_int_equal(errno, EACCES);
    assert_int_equal(write_faults(addr), 0);
    uint8_t *laddr = kvc_pool_layer_base(commons, 1, KV_V);
    assert_non_null(laddr);
    assert_int_equal(
        write_faults(laddr + (uint64_t)hit[1].id * kvc_pool_layout(commons)->kv_block_bytes), 0);
    /* Tenants cannot pin, allocate in or commit to the commons. */
    assert_int_equal(kvc_pin_multi(where, hit, NPREF, 1000, 1, 0), KV_EPERM);
    kvc_block nb[1];
    assert_int_equal(kvc_allocate(commons, 1, nb), KV_EPERM);
    assert_int_equal(kvc_release_multi(where, hit, NPREF), KV_OK);
    assert_int_equal(refs_held(c[1]), 0);

    /* b's sequence: commons prefix, private rest; bytes through the block's own pool. */
    kvc_seq *s;
    assert_int_equal(kvc_seq_alloc(p[1], MAXT, NULL, 0, &s), KV_OK);
    kvc_seq_set_search_domains(s, 1); /* hits in the group and commons pools */
    size_t cached;
    assert_int_equal(kvc_seq_prefill(s, tok, NPREF * TPB + 1, &cached), KV_OK);
    assert_int_equal(cached, NPREF * TPB);
    for (uint32_t i = 0; i < NPREF; i++) {
        assert_ptr_equal(kvc_seq_block_pool(s, i), commons);
        assert_int_equal(block_io(commons, kvc_seq_block(s, i), tok, i * TPB, 1), 0);
    }
    assert_ptr_equal(kvc_seq_block_pool(s, NPREF), p[1]);
    kvc_seq_free(s);
    assert_int_equal(refs_held(c[1]), 0);
    for (int i = 0; i < 4; i++) {
        kvc_conn_close(c[i]);
    }
}

static void test_unrelated_tenants_zero_hits(void **state) {
    fixture *f = *state;
    kvc_pool *pc, *pd;
    kvc_conn *cc = connect_as(f, "c", &pc);
    kvc_conn *cd = connect_as(f, "d", &pd);
    uint32_t tok[MAXT];
    make_tokens(tok, MAXT, 23);
    put_prefix_seq(pc, tok);
    kv_hash128 hs[NPREF];
    size_t nh, nhit;
    assert_int_equal(kvc_pool_hash_tokens(pd, NULL, 0, tok, NPREF * TPB, hs, NPREF, &nh), KV_OK);
    kvc_block hit[NPREF];
    kvc_pool *where[NPREF];
    assert_int_equal(kvc_lookup(pd, hs, NPREF, hit, &nhit), KV_OK);
    assert_int_equal(nhit, 0);
    assert_int_equal(kvc_lookup_domains(pd, hs, NPREF, hit, where, &nhit), KV_OK);
    assert_int_equal(nhit, 0);
    /* c itself hits its own prefix (the control). */
    assert_int_equal(kvc_lookup_domains(pc, hs, NPREF, hit, where, &nhit), KV_OK);
    assert_int_equal(nhit, NPREF);
    for (uint32_t i = 0; i < NPREF; i++) {
        assert_ptr_equal(where[i], pc);
    }
    assert_int_equal(kvc_release_multi(where, hit, NPREF), KV_OK);
    /* d's sequence searches every domain by default and still finds nothing. */
    kvc_seq *s;
    assert_int_equal(kvc_seq_alloc(pd, MAXT, NULL, 0, &s), KV_OK);
    kvc_seq_set_search_domains(s, 1); /* hits in the group and commons pools */
    size_t cached;
    assert_int_equal(kvc_seq_prefill(s, tok, NPREF * TPB + 1, &cached), KV_OK);
    assert_int_equal(cached, 0);
    kvc_seq_free(s);
    kvc_conn_close(cc);
    kvc_conn_close(cd);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_linked_pools_mapped, setup, teardown),
        cmocka_unit_test_setup_teardown(test_group_hits_same_bytes, setup, teardown),
        cmocka_unit_test_setup_teardown(test_commons_after_three_tenants, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unrelated_tenants_zero_hits, setup, teardown),
    };
    return cmocka_run_group_tests_name("domains", tests, NULL, NULL);
}
