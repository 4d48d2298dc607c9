/* kvd: the daemon's entry point. Parses options, builds the daemon on the default libuv loop,
 * prints one startup line and runs until SIGTERM/SIGINT; exits 0 after a clean stop. */
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include <uv.h>

#include "common/kv_log.h"
#include "common/kv_version.h"
#include "daemon/app/daemon.h"
#include "daemon/config/config.h"
#include "daemon/ops/admin_cmds.h"
#include "daemon/ops/man.h"

int main(int argc, char **argv) {
    /* Started with stdin, stdout or stderr closed, the daemon's next fd (a segment's memfd)
     * would take that number: log lines written into KV memory, or a segment never closed (fds
     * 0-2 are never a segment's). /dev/null holds the numbers instead. */
    for (int fd = 0; fd <= 2; fd++) {
        if (fcntl(fd, F_GETFD) == -1 && open("/dev/null", O_RDWR) != fd) {
            return 1;
        }
    }
    /* Generators of committed files (tests compare them with these outputs). */
    if (argc == 2 && strcmp(argv[1], "--print-config") == 0) {
        kvd_config_print_example(stdout);
        return 0;
    }
    if (argc == 2 && strcmp(argv[1], "--print-admin-doc") == 0) {
        kvd_admin_write_doc(stdout);
        return 0;
    }
    if (argc == 2 && strncmp(argv[1], "--print-man=", 12) == 0) {
        if (kvd_man_write(stdout, argv[1] + 12) != 0) {
            fprintf(stderr, "kvd: --print-man takes kvd or kvctl\n");
            return 2;
        }
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
    /* A peer that closes before it read its reply (an admin client, a worker) must cost a write
     * error (EPIPE), not the daemon: the admin socket writes through libuv, which does not ask
     * for MSG_NOSIGNAL. */
    signal(SIGPIPE, SIG_IGN);
    uv_loop_t *loop = uv_default_loop();
    kvd_daemon *d;
    if (kvd_daemon_alloc(&cfg, loop, &d) != KV_OK) {
        return 1;
    }
    kv_err rc = kvd_daemon_start(d, 1);
    if (rc == KV_OK) {
        char mem[32];
        snprintf(mem, sizeof(mem), "%llu", (unsigned long long)cfg.pool_memory);
        KV_LOG(INFO, "KVD-START",
               "kvd %s serving %s: backend %s%s, pool memory %s bytes, boot epoch %016llx",
               KV_VERSION, kvd_daemon_socket_path(d), kvd_daemon_config(d)->backend,
               cfg.hugepages ? " (huge pages)" : "", mem,
               (unsigned long long)kvd_daemon_boot_epoch(d));
    } else {
        kvd_daemon_stop(d);
    }
    uv_run(loop, UV_RUN_DEFAULT);
    kvd_daemon_free(d);
    int closed = uv_loop_close(loop);
    if (rc == KV_OK) {
        KV_LOG(INFO, "KVD-STOP", "kvd stopped%s", closed == 0 ? "" : " (loop not empty)");
    }
    return rc == KV_OK ? 0 : 1;
}
