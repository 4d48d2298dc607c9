/* error_codes_test: every kv_err code has the same number and name in the wire enum
 * kvd.ErrorCode, and the wire enum has no code kv_err lacks. Uses protobuf-c's generated enum
 * descriptor, so the check follows proto/kvd.proto without a second list. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include "common/kv_err.h"
#include "proto/kvd.pb-c.h"

/* Every kv_err code, from the one X-macro list. */
static const struct {
    const char *name;
    int num;
} codes[] = {
#define ERR_ROW(name, num, msg) {#name, num},
    KV_ERR_MAP(ERR_ROW)
#undef ERR_ROW
};

static void test_every_kv_err_is_on_the_wire(void **state) {
    (void)state;
    const ProtobufCEnumDescriptor *d = &kvd__error_code__descriptor;
    assert_int_equal(sizeof(codes) / sizeof(codes[0]), KV_ERR_COUNT);
    for (size_t i = 0; i < sizeof(codes) / sizeof(codes[0]); i++) {
        const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value(d, codes[i].num);
        if (v == NULL) {
            fail_msg("kv_err %s = %d missing from kvd.ErrorCode", codes[i].name, codes[i].num);
        }
        assert_string_equal(v->name, codes[i].name);
        const ProtobufCEnumValue *byname =
            protobuf_c_enum_descriptor_get_value_by_name(d, codes[i].name);
        assert_non_null(byname);
        assert_int_equal(byname->value, codes[i].num);
        assert_string_equal(kv_err_name(codes[i].num), codes[i].name);
    }
}

static void test_wire_has_no_extra_codes(void **state) {
    (void)state;
    const ProtobufCEnumDescriptor *d = &kvd__error_code__descriptor;
    assert_int_equal(d->n_values, KV_ERR_COUNT);
    for (unsigned i = 0; i < d->n_values; i++) {
        const ProtobufCEnumValue *v = &d->values[i];
        assert_true(v->value >= 0 && v->value < KV_ERR_COUNT);
        assert_string_equal(kv_err_name(v->value), v->name);
    }
}

static void test_generated_constants_match(void **state) {
    (void)state;
    /* Spot checks through the generated C names that handlers use directly. */
    assert_int_equal(KVD__ERROR_CODE__OK, KV_OK);
    assert_int_equal(KVD__ERROR_CODE__ENOSPC, KV_ENOSPC);
    assert_int_equal(KVD__ERROR_CODE__EPROTO, KV_EPROTO);
    assert_int_equal(KVD__ERROR_CODE__EEPOCH, KV_EEPOCH);
    assert_int_equal(KVD__ERROR_CODE__EINTERNAL, KV_EINTERNAL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_kv_err_is_on_the_wire),
        cmocka_unit_test(test_wire_has_no_extra_codes),
        cmocka_unit_test(test_generated_constants_match),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
