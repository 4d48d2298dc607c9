/* kvd: the daemon's entry point. Parses options, builds the server on the default libuv loop,
 * prints one startup line and runs until SIGTERM/SIGINT; exits 0 after a clean stop. */
#include <stdio.h>
#include <string.h>

#include <uv.h>

#include "common/kv_log.h"
#include "daemon/admin.h"
#include "daemon/config.h"
#include "daemon/server.h"

#define KVD_VERSION "0.1.0"

int main(int argc, char **argv) {
    /* Generators of committed files (tests compare them with these outputs). */
    if (argc == 2 && strcmp(argv[1], "--print-config") == 0) {
        kvd_config_print_example(stdout);
        return 0;
    }
    if (argc == 2 && strcmp(argv[1], "--print-admin-doc") == 0) {
        kvd_admin_write_doc(stdout);
        return 0;
    }
    kvd_config cfg;
    kvd_config_init(&cfg);
    int help = 0;
    char err[1024];
    if (kvd_config_parse_args(&cfg, argc, argv, &help, err, sizeof(err)) != KV_OK ||
        (!help && kvd_config_check(&cfg, err, sizeof(err)) != KV_OK)) {
        fprintf(stderr, "kvd: %s\n", err);
        return 2;
    }
    if (help) {
        kvd_config_print_help(stdout);
        return 0;
    }
    kv_log_threshold = cfg.log_level;
    uv_loop_t *loop = uv_default_loop();
    kvd_server *srv;
    if (kvd_server_alloc(&cfg, loop, &srv) != KV_OK) {
        return 1;
    }
    kv_err rc = kvd_server_start(srv, 1);
    if (rc == KV_OK) {
        char mem[32];
        snprintf(mem, sizeof(mem), "%llu", (unsigned long long)cfg.pool_memory);
        KV_LOG(INFO, "KVD-START",
               "kvd %s serving %s: backend %s%s, pool memory %s bytes, boot epoch %016llx",
               KVD_VERSION, kvd_server_socket_path(srv), cfg.backend,
               cfg.hugepages ? " (huge pages)" : "", mem,
               (unsigned long long)kvd_server_boot_epoch(srv));
    } else {
        kvd_server_stop(srv);
    }
    uv_run(loop, UV_RUN_DEFAULT);
    kvd_server_free(srv);
    int closed = uv_loop_close(loop);
    if (rc == KV_OK) {
        KV_LOG(INFO, "KVD-STOP", "kvd stopped%s", closed == 0 ? "" : " (loop not empty)");
    }
    return rc == KV_OK ? 0 : 1;
}
