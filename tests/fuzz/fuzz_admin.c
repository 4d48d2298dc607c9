/* fuzz_admin: the admin line protocol (daemon/admin: word splitting, command lookup in the one
 * table, every command's argument parsing) on any text, against a real kvd_daemon that is
 * allocated once and never started (no sockets; the commands see its empty registry, tenants,
 * config and event ring). Input: lines as a peer would send them; each is executed as the
 * admin connection does. Properties: every line gets a reply object (never NULL: the connection
 * would be closed without an answer), with a boolean "ok"; a refusal carries an error object
 * with a code name and a non-empty message; every reply serialises. */
#include <string.h>

#include <jansson.h>
#include <uv.h>

#include "common/kv_log.h"
#include "daemon/ops/admin_cmds.h"
#include "daemon/config/config.h"
#include "daemon/app/daemon.h"
#include "tests/fuzz/fuzz.h"

static kvd_daemon *srv;
static uv_loop_t loop;

/* Commands may raise the log level (`log level debug`); the fuzzer's output stays readable. */
static void quiet_sink(void *arg, kv_log_level level, const char *id, const char *msg) {
    (void)arg;
    (void)level;
    (void)id;
    (void)msg;
}

static kvd_daemon *server(void) {
    if (srv != NULL) {
        return srv;
    }
    kv_log_set_sink(quiet_sink, NULL);
    kvd_config cfg;
    kvd_config_init(&cfg);
    cfg.pool_memory = 64u << 20;
    cfg.segment_bytes = 1u << 20;
    cfg.index_entries = 4096;
    FUZZ_CHECK(uv_loop_init(&loop) == 0);
    FUZZ_CHECK(kvd_daemon_alloc(&cfg, &loop, &srv) == KV_OK);
    return srv;
}

static void check_reply(json_t *r) {
    FUZZ_CHECK(r != NULL);
    FUZZ_CHECK(json_is_object(r));
    json_t *ok = json_object_get(r, "ok");
    FUZZ_CHECK(json_is_boolean(ok));
    if (json_is_false(ok)) {
        json_t *e = json_object_get(r, "error");
        FUZZ_CHECK(json_is_object(e));
        FUZZ_CHECK(json_is_string(json_object_get(e, "code")));
        const char *m = json_string_value(json_object_get(e, "message"));
        FUZZ_CHECK(m != NULL && m[0] != '\0');
    }
    char *text = json_dumps(r, JSON_COMPACT | JSON_ENSURE_ASCII);
    FUZZ_CHECK(text != NULL);
    free(text);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    kvd_daemon *s = server();
    char *text = malloc(size + 1);
    if (text == NULL) {
        return 0;
    }
    memcpy(text, data, size);
    text[size] = '\0';
    char *save = NULL;
    int lines = 0;
    for (char *l = strtok_r(text, "\n", &save); l != NULL && lines < 16;
         l = strtok_r(NULL, "\n", &save), lines++) {
        if (strspn(l, " \t\r") == strlen(l)) {
            continue; /* the connection skips blank lines before executing */
        }
        /* The connection never hands over a line longer than its buffer. */
        if (strlen(l) >= KVD_ADMIN_LINE_MAX) {
            l[KVD_ADMIN_LINE_MAX - 1] = '\0';
        }
        json_t *r = kvd_admin_execute(kvd_daemon_ops(s), l);
        check_reply(r);
        json_decref(r);
    }
    free(text);
    return 0;
}
