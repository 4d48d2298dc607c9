/* libkvclient.so exports the public API and nothing else: not the kvc__ internals, not the
 * statically linked common code (kv_*), not protobuf-c's generated symbols. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>
#include <dlfcn.h>

static void test_only_public_symbols(void **state) {
    (void)state;
    void *so = dlopen("client/shared/libkvclient.so", RTLD_NOW | RTLD_LOCAL);
    assert_non_null(so);
    const char *exported[] = {"kvc_conn_open",
                              "kvc_pool_attach",
                              "kvc_lookup",
                              "kvc_batch_run",
                              "kvc_seq_prefill",
                              "kvc_seq_export_csr",
                              "kvc_last_error",
                              "kvc_lookup_domains",
                              "kvc_release_multi",
                              "kvc_pool_linked",
                              "kvc_seq_export_csr_pool",
                              "kvc_strerror",
                              "kvc_err_name",
                              "kvc_seq_fork",
                              "kvc_seq_append_many",
                              "kvc_seq_export_slots",
                              "kvc_pool_copy_blocks",
                              "kvc_release_deferred",
                              "kvc_flush",
                              "kvc_batch_lookup_many",
                              "kvc_batch_release_many"};
    for (size_t i = 0; i < sizeof(exported) / sizeof(exported[0]); i++) {
        assert_non_null(dlsym(so, exported[i]));
    }
    const char *hidden[] = {"kvc__exchange",      "kvc__pool_map_segment", "kvc__op_complete",
                            "kvc__fail",          "kvc__gpu_mapper",       "kv_wire_decode",
                            "kv_arena_alloc",     "kv_hash_chain",         "kv_layout_offset",
                            "kvd__envelope__pack"};
    for (size_t i = 0; i < sizeof(hidden) / sizeof(hidden[0]); i++) {
        assert_null(dlsym(so, hidden[i]));
    }
    dlclose(so);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_only_public_symbols),
    };
    return cmocka_run_group_tests_name("client_exports", tests, NULL, NULL);
}
