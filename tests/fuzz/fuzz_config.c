/* fuzz_config: the config file parser (daemon/config) on any text, and every option's value
 * parser. Input: text for kvd_config_parse_text (NULs cut it as C strings do). Properties: a
 * refused text comes with a non-empty message; whatever was applied is valid: each option's
 * value, formatted back to text, is accepted by kvd_config_set and formats to the same text
 * (the admin `config get` -> `config set` round trip); every numeric option is in its range. */
#include <string.h>

#include "daemon/config/config.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *text = malloc(size + 1);
    if (text == NULL) {
        return 0;
    }
    memcpy(text, data, size);
    text[size] = '\0';
    kvd_config c;
    kvd_config_init(&c);
    char err[256];
    err[0] = '\0';
    kv_err rc = kvd_config_parse_text(&c, text, "fuzz", err, sizeof(err));
    FUZZ_CHECK(rc == KV_OK || rc == KV_EINVAL || rc == KV_ENOENT || rc == KV_ENOMEM);
    if (rc != KV_OK) {
        FUZZ_CHECK(err[0] != '\0' && memchr(err, '\0', sizeof(err)) != NULL);
    }
    size_t n;
    const kvd_config_option *opts = kvd_config_options(&n);
    for (size_t i = 0; i < n; i++) {
        const kvd_config_option *o = &opts[i];
        FUZZ_CHECK(kvd_config_find(o->name) == o);
        char v1[KVD_CONFIG_PATH_MAX + 64], v2[KVD_CONFIG_PATH_MAX + 64];
        kvd_config_format(&c, o, v1, sizeof(v1));
        kvd_config copy = c;
        char e2[256];
        kv_err src = kvd_config_set(&copy, o->name, v1, e2, sizeof(e2));
        if (src != KV_OK) {
            fprintf(stderr, "option %s: formatted value '%s' refused: %s\n", o->name, v1, e2);
        }
        FUZZ_CHECK(src == KV_OK);
        kvd_config_format(&copy, o, v2, sizeof(v2));
        FUZZ_CHECK(strcmp(v1, v2) == 0);
        if (o->type == KVD_OPT_U64) {
            uint64_t v;
            memcpy(&v, (const char *)&c + o->offset, sizeof(v));
            FUZZ_CHECK(v >= o->min && v <= o->max);
        }
    }
    /* The same text as one option's value (the `--name=value` and admin path). */
    if (n > 0 && size > 0) {
        const kvd_config_option *o = &opts[data[0] % n];
        kvd_config before = c;
        rc = kvd_config_set(&c, o->name, text + 1, err, sizeof(err));
        if (rc != KV_OK) {
            FUZZ_CHECK(memcmp(&before, &c, sizeof(c)) == 0); /* unchanged on error */
        }
    }
    free(text);
    return 0;
}
