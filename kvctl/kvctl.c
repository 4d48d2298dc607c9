/* kvctl: the command-line client of kvd's admin socket (docs/ADMIN.md).
 *
 * Sends one command line, reads one JSON reply line, and prints it as human tables (default) or
 * as the raw line (--json). --watch repeats a command on a cleared screen. Exit codes come from
 * kvctl/exit_codes.h, which docs/ADMIN.md is generated from. JSON is parsed with jansson.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <jansson.h>

#include "common/kv_util.h"
#include "kvctl/exit_codes.h"

#define LINE_MAX_BYTES 4096         /* the daemon's command line limit */
#define REPLY_MAX_BYTES (64u << 20) /* largest reply kvctl reads */

static void usage(FILE *f) {
    fputs("usage: kvctl [--socket=PATH] [--json] [--watch[=SECONDS]] COMMAND [ARGS...]\n"
          "  COMMAND is an admin command (kvctl help lists them; docs/ADMIN.md explains them).\n"
          "  --socket=PATH  admin socket (default $KVD_ADMIN_SOCKET, else beside the default\n"
          "                 client socket: $XDG_RUNTIME_DIR/kvd/admin.sock or "
          "/tmp/kvd-$UID/admin.sock)\n"
          "  --json         print the reply line as kvd sent it\n"
          "  --watch[=S]    repeat the command (default stats) every S seconds (default 2)\n"
          "exit: 0 ok, 1 kvd error, 2 usage, 3 cannot connect, 4 bad reply, 5 not ready\n",
          f);
}

static void default_socket(char *buf, size_t len) {
    const char *env = getenv("KVD_ADMIN_SOCKET");
    if (env != NULL && env[0] != '\0') {
        snprintf(buf, len, "%s", env);
    } else {
        (void)kv_default_socket_path("admin.sock", buf, len); /* too long: connect says so */
    }
}

static int connect_admin(const char *path) {
    struct sockaddr_un sa;
    if (strlen(path) >= sizeof(sa.sun_path)) {
        fprintf(stderr, "kvctl: socket path too long: %s\n", path);
        return -1;
    }
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        fprintf(stderr, "kvctl: socket: %s\n", strerror(errno));
        return -1;
    }
    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    memcpy(sa.sun_path, path, strlen(path) + 1);
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        fprintf(stderr, "kvctl: cannot connect to %s: %s\n", path, strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}

/* Sends line and reads one reply line into a malloc'd string (NULL on error). A reply that
 * ends without a newline (the peer closed) is returned too, with *complete 0 and *len its
 * bytes, so the caller can tell what answered. */
static char *roundtrip(int fd, const char *line, size_t *got, int *complete) {
    *got = 0;
    *complete = 0;
    size_t n = strlen(line);
    char out[LINE_MAX_BYTES + 1];
    memcpy(out, line, n);
    out[n] = '\n';
    for (size_t off = 0; off < n + 1;) {
        ssize_t w = send(fd, out + off, n + 1 - off, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) {
                continue;
            }
            return NULL;
        }
        off += (size_t)w;
    }
    size_t cap = 65536, len = 0;
    char *buf = malloc(cap);
    while (buf != NULL) {
        if (len + 1 >= cap) {
            if (cap >= REPLY_MAX_BYTES) {
                break;
            }
            char *b = realloc(buf, cap * 2);
            if (b == NULL) {
                break;
            }
            buf = b;
            cap *= 2;
        }
        ssize_t r = recv(fd, buf + len, cap - 1 - len, 0);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            break;
        }
        char *nl = memchr(buf + len, '\n', (size_t)r);
        len += (size_t)r;
        if (nl != NULL) {
            *nl = '\0';
            *got = (size_t)(nl - buf);
            *complete = 1;
            return buf;
        }
    }
    if (buf != NULL && len > 0) {
        buf[len] = '\0';
        *got = len;
        return buf;
    }
    free(buf);
    return NULL;
}

/* The reply starts like a binary frame of kvd's client protocol (a little-endian length,
 * whose high bytes are zero for any frame kvd sends), not like a JSON line. */
static int binary_reply(const char *reply, size_t len) {
    if (len < 4 || reply[0] == '{') {
        return 0;
    }
    for (size_t i = 0; i < 4; i++) {
        unsigned char b = (unsigned char)reply[i];
        if (b < 0x20 && b != '\t' && b != '\r') {
            return 1;
        }
    }
    return 0;
}

/* ---- human output ---------------------------------------------------------------------- */

/* A column: header and the key path ("hit_rate.value") in each row object. */
typedef struct column {
    const char *header; /* printed title */
    const char *path;   /* key, or key.key */
} column;

static void cell_text(const json_t *row, const char *path, char *buf, size_t len) {
    char key[64];
    const json_t *v = row;
    const char *p = path;
    while (v != NULL && *p != '\0') {
        const char *dot = strchr(p, '.');
        size_t kl = dot ? (size_t)(dot - p) : strlen(p);
        snprintf(key, sizeof(key), "%.*s", (int)kl, p);
        v = json_object_get(v, key);
        p += kl + (dot ? 1 : 0);
    }
    if (v == NULL || json_is_null(v)) {
        snprintf(buf, len, "-");
    } else if (json_is_string(v)) {
        snprintf(buf, len, "%s", json_string_value(v));
    } else if (json_is_integer(v)) {
        snprintf(buf, len, "%lld", (long long)json_integer_value(v));
    } else if (json_is_real(v)) {
        snprintf(buf, len, "%.3f", json_real_value(v));
    } else if (json_is_boolean(v)) {
        snprintf(buf, len, "%s", json_is_true(v) ? "yes" : "no");
    } else {
        char *t = json_dumps(v, JSON_COMPACT);
        snprintf(buf, len, "%s", t != NULL ? t : "?");
        free(t);
    }
}

static void print_table(const json_t *rows, const column *cols, size_t ncols) {
    size_t w[32] = {0};
    char cell[256];
    for (size_t c = 0; c < ncols; c++) {
        w[c] = strlen(cols[c].header);
    }
    for (size_t r = 0; r < json_array_size(rows); r++) {
        for (size_t c = 0; c < ncols; c++) {
            cell_text(json_array_get(rows, r), cols[c].path, cell, sizeof(cell));
            w[c] = strlen(cell) > w[c] ? strlen(cell) : w[c];
        }
    }
    for (size_t c = 0; c < ncols; c++) {
        printf("%-*s%s", (int)w[c], cols[c].header, c + 1 < ncols ? "  " : "\n");
    }
    for (size_t r = 0; r < json_array_size(rows); r++) {
        for (size_t c = 0; c < ncols; c++) {
            cell_text(json_array_get(rows, r), cols[c].path, cell, sizeof(cell));
            printf("%-*s%s", (int)w[c], cell, c + 1 < ncols ? "  " : "\n");
        }
    }
    if (json_array_size(rows) == 0) {
        printf("(none)\n");
    }
}

#define TABLE(rows, ...)                                                                           \
    do {                                                                                           \
        static const column cols_[] = {__VA_ARGS__};                                               \
        print_table(rows, cols_, sizeof(cols_) / sizeof(cols_[0]));                                \
    } while (0)

static void print_pairs(const json_t *obj, int indent) {
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)obj, k, v) {
        if (json_is_object(v)) {
            printf("%*s%s:\n", indent, "", k);
            print_pairs(v, indent + 2);
        } else if (json_is_array(v)) {
            char *t = json_dumps(v, JSON_COMPACT);
            printf("%*s%s: %s\n", indent, "", k, t != NULL ? t : "?");
            free(t);
        } else {
            char cell[4096];
            cell_text(obj, k, cell, sizeof(cell));
            printf("%*s%-24s %s\n", indent, "", k, cell);
        }
    }
}

static void print_prefix(const json_t *node, int level) {
    char hash[64];
    cell_text(node, "hash", hash, sizeof(hash));
    printf("%*s%.12s..  hits %-6lld blocks %-5lld subtree %-6lld depth %lld\n", 2 * level, "", hash,
           (long long)json_integer_value(json_object_get(node, "hits")),
           (long long)json_integer_value(json_object_get(node, "blocks")),
           (long long)json_integer_value(json_object_get(node, "size")),
           (long long)json_integer_value(json_object_get(node, "depth")));
    const json_t *kids = json_object_get(node, "children");
    for (size_t i = 0; i < json_array_size(kids); i++) {
        print_prefix(json_array_get(kids, i), level + 1);
    }
    json_int_t more = json_integer_value(json_object_get(node, "more_children"));
    if (more > 0) {
        printf("%*s(+%lld more)\n", 2 * level + 2, "", (long long)more);
    }
}

static void print_human(const char *cmd, const json_t *res) {
    if (strcmp(cmd, "stats") == 0) {
        printf("daemon\n");
        print_pairs(json_object_get(res, "daemon"), 2);
        printf("\npools\n");
        TABLE(json_object_get(res, "pools"), {"POOL", "id"}, {"MODEL", "model"},
              {"DOMAIN", "domain"}, {"FREE", "blocks_free"}, {"WRITING", "blocks_writing"},
              {"COMMITTED", "blocks_committed"}, {"CACHED", "blocks_cached"},
              {"PINNED", "blocks_pinned"}, {"LOOKUPS", "queries"}, {"HIT", "hit_rate.value"},
              {"OF BLOCKS", "query_blocks"}, {"HIT TOKENS", "hit_tokens"}, {"COMMITS", "commits"},
              {"EVICT CAP", "evictions_capacity"}, {"EVICT ADM", "evictions_admin"},
              {"BYTES", "bytes"});
        const json_t *duel = json_object_get(res, "duel");
        if (json_array_size(duel) > 0) { /* evict-duel: each adaptive pool's set dueling */
            printf("\neviction duel\n");
            TABLE(duel, {"POOL", "id"}, {"MODEL", "model"}, {"UNREUSED FIRST", "unreused_first"},
                  {"SWITCHES", "switches"}, {"SAMPLED", "sampled"}, {"SKIPPED", "skipped"},
                  {"DROPPED", "dropped"}, {"QUEUED", "queued"}, {"MINI BLOCKS", "mini_blocks"},
                  {"BYTES", "bytes"});
        }
        printf("\ntenants\n");
        TABLE(json_object_get(res, "tenants"), {"TENANT", "name"}, {"SESS", "sessions"},
              {"LOOKUPS", "queries"}, {"HIT", "hit_rate.value"}, {"OF BLOCKS", "query_blocks"},
              {"HIT TOKENS", "hit_tokens"}, {"COMMITS", "commits"},
              {"EVICT CAP", "evictions_capacity"}, {"REFUSED", "refusals"}, {"HELD", "blocks_held"},
              {"CACHED", "blocks_cached"}, {"PINNED", "blocks_pinned"});
    } else if (strcmp(cmd, "pools") == 0) {
        TABLE(json_object_get(res, "pools"), {"POOL", "id"}, {"MODEL", "model"},
              {"DOMAIN", "domain"}, {"LAYERS", "layout.layers"}, {"HEADS", "layout.kv_heads"},
              {"DIM", "layout.head_dim"}, {"TOK/BLK", "layout.tokens_per_block"},
              {"DTYPE", "layout.dtype"}, {"SEGMENTS", "segments"}, {"BLOCKS", "blocks_total"},
              {"BYTES", "bytes"}, {"POLICY", "policy"}, {"UNREUSED FIRST", "duel.unreused_first"});
    } else if (strcmp(cmd, "tenants") == 0) {
        TABLE(json_object_get(res, "tenants"), {"ID", "id"}, {"TENANT", "name"},
              {"SESSIONS", "sessions"}, {"HELD", "blocks_held"}, {"CACHED", "blocks_cached"},
              {"PINNED", "blocks_pinned"}, {"LOOKUPS", "queries"}, {"HIT", "hit_rate.value"},
              {"REFUSED", "refusals"});
    } else if (strcmp(cmd, "sessions") == 0) {
        TABLE(json_object_get(res, "sessions"), {"SESSION", "id"}, {"PID", "pid"}, {"UID", "uid"},
              {"TENANT", "tenant"}, {"CLIENT", "client"}, {"BLOCKS HELD", "blocks_held"},
              {"POOLS", "pools"}, {"REQUESTS", "requests"}, {"ERRORS", "errors"});
    } else if (strcmp(cmd, "events") == 0) {
        TABLE(json_object_get(res, "events"), {"SEQ", "seq"}, {"KIND", "kind"},
              {"REASON", "reason"}, {"POOL", "pool"}, {"TENANT", "tenant"}, {"COUNT", "count"},
              {"DETAIL", "detail"});
    } else if (strcmp(cmd, "help") == 0) {
        TABLE(json_object_get(res, "commands"), {"COMMAND", "command"}, {"ARGS", "args"},
              {"WHAT", "summary"});
    } else if (strcmp(cmd, "config") == 0 && json_object_get(res, "options") != NULL) {
        TABLE(json_object_get(res, "options"), {"OPTION", "name"}, {"VALUE", "value"},
              {"DEFAULT", "default"}, {"RUNTIME", "runtime"});
    } else if (strcmp(cmd, "prefixes") == 0) {
        const json_t *pools = json_object_get(res, "pools");
        for (size_t i = 0; i < json_array_size(pools); i++) {
            const json_t *p = json_array_get(pools, i);
            printf("pool %lld (%s): %lld prefixes\n",
                   (long long)json_integer_value(json_object_get(p, "pool")),
                   json_string_value(json_object_get(p, "model")),
                   (long long)json_integer_value(json_object_get(p, "prefixes")));
            const json_t *top = json_object_get(p, "top");
            for (size_t k = 0; k < json_array_size(top); k++) {
                print_prefix(json_array_get(top, k), 1);
            }
        }
    } else if (strcmp(cmd, "evict") == 0 && json_is_true(json_object_get(res, "dry_run"))) {
        const json_t *pools = json_object_get(res, "pools");
        for (size_t i = 0; i < json_array_size(pools); i++) {
            const json_t *p = json_array_get(pools, i);
            printf("pool %lld: %lld blocks would go (%s order)\n",
                   (long long)json_integer_value(json_object_get(p, "pool")),
                   (long long)json_integer_value(json_object_get(p, "blocks")),
                   json_string_value(json_object_get(p, "policy")));
            TABLE(json_object_get(p, "would_evict"), {"BLOCK", "block"}, {"HASH", "hash"},
                  {"TENANT", "tenant"}, {"HITS", "hits"}, {"WHY", "why"});
        }
    } else {
        print_pairs(res, 0);
    }
}

/* Runs one command; returns an exit code. */
static int run_once(const char *path, const char *line, const char *cmd, int json_out) {
    int fd = connect_admin(path);
    if (fd < 0) {
        return KVCTL_EXIT_CONNECT;
    }
    size_t got;
    int complete;
    char *reply = roundtrip(fd, line, &got, &complete);
    close(fd);
    if (reply == NULL) {
        fprintf(stderr, "kvctl: no reply line from %s\n", path);
        return KVCTL_EXIT_PROTO;
    }
    if (binary_reply(reply, got)) {
        fprintf(stderr,
                "kvctl: %s answered in kvd's binary wire protocol: that is the client socket "
                "(workers'); kvctl talks to the admin socket (admin.sock beside it, or "
                "--socket)\n",
                path);
        free(reply);
        return KVCTL_EXIT_PROTO;
    }
    if (!complete) {
        fprintf(stderr, "kvctl: %s closed before a whole reply line: %.200s\n", path, reply);
        free(reply);
        return KVCTL_EXIT_PROTO;
    }
    json_error_t jerr;
    json_t *obj = json_loads(reply, 0, &jerr);
    if (obj == NULL || !json_is_object(obj) || !json_is_boolean(json_object_get(obj, "ok"))) {
        fprintf(stderr, "kvctl: reply is not a kvd JSON object: %.200s\n", reply);
        json_decref(obj);
        free(reply);
        return KVCTL_EXIT_PROTO;
    }
    int rc = KVCTL_EXIT_OK;
    if (json_is_true(json_object_get(obj, "ok"))) {
        if (json_out) {
            printf("%s\n", reply);
        } else {
            print_human(cmd, json_object_get(obj, "result"));
        }
    } else {
        const json_t *e = json_object_get(obj, "error");
        const char *code = json_string_value(json_object_get(e, "code"));
        if (json_out) {
            printf("%s\n", reply);
        } else {
            fprintf(stderr, "kvctl: %s: %s\n", code != NULL ? code : "?",
                    json_string_value(json_object_get(e, "message")));
        }
        rc = KVCTL_EXIT_ERROR;
        if (strcmp(cmd, "ready") == 0 && code != NULL &&
            (strcmp(code, "EDRAINING") == 0 || strcmp(code, "ECLOSED") == 0)) {
            rc = KVCTL_EXIT_NOTREADY;
        }
    }
    json_decref(obj);
    free(reply);
    fflush(stdout);
    return rc;
}

int main(int argc, char **argv) {
    char path[4096]; /* longer than a Unix socket's: connect_admin names a path too long */
    default_socket(path, sizeof(path));
    int json_out = 0, watch = 0;
    unsigned interval = 2;
    int i = 1;
    for (; i < argc && strncmp(argv[i], "-", 1) == 0; i++) {
        if (strncmp(argv[i], "--socket=", 9) == 0) {
            snprintf(path, sizeof(path), "%s", argv[i] + 9);
        } else if (strcmp(argv[i], "--json") == 0) {
            json_out = 1;
        } else if (strcmp(argv[i], "--watch") == 0) {
            watch = 1;
        } else if (strncmp(argv[i], "--watch=", 8) == 0) {
            watch = 1;
            char *end;
            unsigned long v = strtoul(argv[i] + 8, &end, 10);
            if (*end != '\0' || v == 0 || v > 3600) {
                fprintf(stderr, "kvctl: --watch=SECONDS takes 1..3600\n");
                return KVCTL_EXIT_USAGE;
            }
            interval = (unsigned)v;
        } else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            usage(stdout);
            return KVCTL_EXIT_OK;
        } else if (strcmp(argv[i], "--dry-run") == 0) {
            break; /* an argument of evict, not ours */
        } else {
            fprintf(stderr, "kvctl: unknown flag %s\n", argv[i]);
            usage(stderr);
            return KVCTL_EXIT_USAGE;
        }
    }
    char line[LINE_MAX_BYTES];
    size_t len = 0;
    line[0] = '\0';
    for (int k = i; k < argc; k++) {
        int n = snprintf(line + len, sizeof(line) - len, "%s%s", k > i ? " " : "", argv[k]);
        if (n < 0 || (size_t)n >= sizeof(line) - len || strchr(argv[k], '\n') != NULL) {
            fprintf(stderr, "kvctl: command too long or has a newline\n");
            return KVCTL_EXIT_USAGE;
        }
        len += (size_t)n;
    }
    if (strspn(line, " \t") == len) { /* blank: kvd answers nothing to an empty line */
        len = 0;
    }
    if (len == 0) {
        if (!watch) {
            usage(stderr);
            return KVCTL_EXIT_USAGE;
        }
        snprintf(line, sizeof(line), "stats");
    }
    char cmd[64];
    snprintf(cmd, sizeof(cmd), "%.*s", (int)strcspn(line, " "), line);
    if (!watch) {
        return run_once(path, line, cmd, json_out);
    }
    signal(SIGPIPE, SIG_IGN);
    for (;;) {
        if (!json_out) {
            printf("\033[H\033[2J%s every %us (Ctrl-C stops)\n\n", line, interval);
        }
        int rc = run_once(path, line, cmd, json_out);
        if (rc == KVCTL_EXIT_CONNECT || rc == KVCTL_EXIT_PROTO) {
            return rc;
        }
        sleep(interval);
    }
}
