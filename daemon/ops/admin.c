/* kvd_admin: the admin socket's listener, connections and line handling (see admin.h). The
 * commands themselves live in admin_cmds.c. Connections are libuv pipes: admin traffic is
 * small and rare, so the simplicity of uv_read/uv_write beats the hand-rolled I/O the client
 * socket needs for SCM_RIGHTS. */
#include "daemon/ops/admin.h"

#include <errno.h>
#include <grp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/kv_log.h"
#include "daemon/ops/admin_cmds.h"

#define ADMIN_MAX_CONNS 64           /* admin connections open at once */
#define ADMIN_MAX_QUEUED (16u << 20) /* unsent reply bytes before a reader is dropped */

typedef struct admin_conn {
    uv_pipe_t pipe;                /* the connection; freed in its close callback */
    kvd_admin *adm;                /* owner */
    char line[KVD_ADMIN_LINE_MAX]; /* bytes of the current, unfinished line */
    size_t len;                    /* bytes in line */
    int closing;                   /* uv_close called */
    int close_after_write;         /* close once pending writes are done */
    int greeted;                   /* the first byte was looked at (text or not) */
    unsigned pending;              /* writes not yet completed */
    uid_t uid;                     /* peer credentials */
    pid_t pid;
    struct admin_conn *prev, *next; /* the admin's connection list */
} admin_conn;

struct kvd_admin {
    kvd_ops *ops;      /* what the commands work on */
    uv_pipe_t listen;  /* the admin socket */
    int listen_active; /* listen initialised and not closed */
    int bound;         /* the socket file is ours to unlink */
    char path[108];    /* sun_path in use */
    gid_t group;       /* admin-group */
    int have_group;    /* admin-group was set */
    admin_conn *conns; /* open connections */
    unsigned nconns;   /* entries of conns */
};

typedef struct admin_write {
    uv_write_t req; /* the write */
    admin_conn *c;  /* the connection */
    char *buf;      /* reply bytes, freed when written */
} admin_write;

static void conn_close(admin_conn *c);

static void on_conn_closed(uv_handle_t *h) {
    admin_conn *c = h->data;
    kvd_admin *a = c->adm;
    if (c->prev != NULL) {
        c->prev->next = c->next;
    } else {
        a->conns = c->next;
    }
    if (c->next != NULL) {
        c->next->prev = c->prev;
    }
    a->nconns--;
    free(c);
}

static void conn_close(admin_conn *c) {
    if (c->closing) {
        return;
    }
    c->closing = 1;
    uv_close((uv_handle_t *)&c->pipe, on_conn_closed);
}

static void on_written(uv_write_t *req, int status) {
    admin_write *w = (admin_write *)req;
    admin_conn *c = w->c;
    free(w->buf);
    free(w);
    c->pending--;
    if (status < 0 || (c->close_after_write && c->pending == 0)) {
        conn_close(c);
    }
}

/* Queues one reply line (obj + '\n'); consumes the reference on obj. */
static void conn_reply(admin_conn *c, json_t *obj) {
    if (obj == NULL) {
        conn_close(c);
        return;
    }
    char *text = json_dumps(obj, JSON_COMPACT | JSON_ENSURE_ASCII);
    json_decref(obj);
    admin_write *w = calloc(1, sizeof(*w));
    if (text == NULL || w == NULL || c->closing) {
        free(text);
        free(w);
        conn_close(c);
        return;
    }
    size_t n = strlen(text);
    w->buf = realloc(text, n + 2);
    if (w->buf == NULL) {
        free(text);
        free(w);
        conn_close(c);
        return;
    }
    w->buf[n] = '\n';
    w->buf[n + 1] = '\0';
    w->c = c;
    if (uv_stream_get_write_queue_size((uv_stream_t *)&c->pipe) > ADMIN_MAX_QUEUED) {
        KV_LOG(WARN, "KVD-ADMIN-SLOW", "admin peer pid %d does not read its replies; closing",
               (int)c->pid);
        free(w->buf);
        free(w);
        conn_close(c);
        return;
    }
    uv_buf_t b = uv_buf_init(w->buf, (unsigned)(n + 1));
    if (uv_write(&w->req, (uv_stream_t *)&c->pipe, &b, 1, on_written) != 0) {
        free(w->buf);
        free(w);
        conn_close(c);
        return;
    }
    c->pending++;
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
    (void)suggested;
    admin_conn *c = h->data;
    buf->base = c->line + c->len;
    buf->len = sizeof(c->line) - c->len;
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf) {
    (void)buf;
    admin_conn *c = st->data;
    if (nread < 0) {
        /* EOF or error: answer what was asked, then close. */
        uv_read_stop(st);
        if (c->pending == 0) {
            conn_close(c);
        } else {
            c->close_after_write = 1;
        }
        return;
    }
    if (c->len == 0 && nread > 0 && !c->greeted) {
        /* The first byte of a connection: the admin protocol is text. A binary byte is a worker
         * (or a tool) dialling the wrong socket; say so at once instead of waiting for a newline
         * that never comes. */
        unsigned char b0 = (unsigned char)c->line[0];
        c->greeted = 1;
        if (b0 < 0x20 && b0 != '\t' && b0 != '\n' && b0 != '\r') {
            conn_reply(c, kvd_admin_error(KV_EPROTO,
                                          "this is kvd's admin socket (text commands, one per "
                                          "line); workers connect to the client socket"));
            uv_read_stop(st);
            c->close_after_write = 1;
            return;
        }
    }
    c->len += (size_t)nread;
    size_t start = 0;
    for (size_t i = 0; i < c->len && !c->closing && !c->close_after_write; i++) {
        if (c->line[i] != '\n') {
            continue;
        }
        c->line[i] = '\0';
        const char *l = c->line + start;
        start = i + 1;
        if (strspn(l, " \t\r") == strlen(l)) {
            continue; /* blank lines are ignored, as a shell would */
        }
        conn_reply(c, kvd_admin_execute(c->adm->ops, l));
    }
    if (c->closing) {
        return;
    }
    memmove(c->line, c->line + start, c->len - start);
    c->len -= start;
    if (c->len == sizeof(c->line)) {
        char msg[KVD_ADMIN_MSG];
        snprintf(msg, sizeof(msg), "command line longer than %d bytes; closing",
                 KVD_ADMIN_LINE_MAX - 1);
        conn_reply(c, kvd_admin_error(KV_ETOOBIG, msg));
        uv_read_stop(st);
        c->close_after_write = 1;
        c->len = 0;
    }
}

/* Root, our own uid, or a member of admin-group (primary or supplementary group). */
static int peer_allowed(const kvd_admin *a, int fd, struct ucred *cred) {
    if (cred->uid == 0 || cred->uid == geteuid()) {
        return 1;
    }
    if (!a->have_group) {
        return 0;
    }
    if (cred->gid == a->group) {
        return 1;
    }
    gid_t groups[256];
    socklen_t len = sizeof(groups);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) == 0) {
        for (size_t i = 0; i < len / sizeof(gid_t); i++) {
            if (groups[i] == a->group) {
                return 1;
            }
        }
    }
    return 0;
}

static void on_connection(uv_stream_t *server, int status) {
    kvd_admin *a = server->data;
    if (status < 0) {
        KV_LOG(WARN, "KVD-ADMIN-ACCEPT", "admin accept: %s", uv_strerror(status));
        return;
    }
    admin_conn *c = calloc(1, sizeof(*c));
    if (c == NULL || uv_pipe_init(a->ops->loop, &c->pipe, 0) != 0) {
        free(c);
        KV_LOG(ERROR, "KVD-ADMIN-ACCEPT", "no memory for an admin connection");
        return;
    }
    c->adm = a;
    c->pipe.data = c;
    c->next = a->conns;
    if (a->conns != NULL) {
        a->conns->prev = c;
    }
    a->conns = c;
    a->nconns++;
    if (uv_accept(server, (uv_stream_t *)&c->pipe) != 0) {
        conn_close(c);
        return;
    }
    uv_os_fd_t fd;
    struct ucred cred;
    socklen_t clen = sizeof(cred);
    if (uv_fileno((uv_handle_t *)&c->pipe, &fd) != 0 ||
        getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0) {
        KV_LOG(WARN, "KVD-ADMIN-ACCEPT", "admin peer credentials: %s", strerror(errno));
        conn_close(c);
        return;
    }
    c->uid = cred.uid;
    c->pid = cred.pid;
    if (!peer_allowed(a, fd, &cred)) {
        KV_LOG(WARN, "KVD-ADMIN-DENY", "admin connection refused: pid %d uid %d gid %d",
               (int)cred.pid, (int)cred.uid, (int)cred.gid);
        kvd_events_push(&a->ops->reg->events, KVD_EVENT_REFUSE, 0, -1, 1, KV_EPERM, "EPERM",
                        "admin connection of pid %d uid %d refused", (int)cred.pid, (int)cred.uid);
        c->close_after_write = 1;
        conn_reply(c,
                   kvd_admin_error(KV_EPERM, "not permitted: the admin socket serves root, kvd's "
                                             "uid and members of admin-group"));
        if (c->pending == 0) {
            conn_close(c);
        }
        return;
    }
    if (a->nconns > ADMIN_MAX_CONNS) {
        c->close_after_write = 1;
        conn_reply(c, kvd_admin_error(KV_EBUSY, "too many admin connections"));
        if (c->pending == 0) {
            conn_close(c);
        }
        return;
    }
    KV_LOG(DEBUG, "KVD-ADMIN-OPEN", "admin connection: pid %d uid %d", (int)cred.pid,
           (int)cred.uid);
    if (uv_read_start((uv_stream_t *)&c->pipe, on_alloc, on_read) != 0) {
        conn_close(c);
    }
}

static kv_err resolve_group(const char *name, gid_t *out) {
    char *end;
    errno = 0;
    unsigned long v = strtoul(name, &end, 10);
    if (*name != '\0' && *end == '\0' && errno == 0) {
        *out = (gid_t)v;
        return KV_OK;
    }
    struct group *g = getgrnam(name);
    if (g == NULL) {
        return KV_ENOENT;
    }
    *out = g->gr_gid;
    return KV_OK;
}

kv_err kvd_admin_start(kvd_ops *s) {
    kvd_admin *a = calloc(1, sizeof(*a));
    if (a == NULL) {
        return KV_ENOMEM;
    }
    a->ops = s;
    s->admin = a;
    if (s->cfg->admin_socket[0] != '\0') {
        if (strlen(s->cfg->admin_socket) >= sizeof(a->path)) {
            KV_LOG(ERROR, "KVD-ADMIN", "admin-socket '%s' is longer than %zu bytes",
                   s->cfg->admin_socket, sizeof(a->path) - 1);
            return KV_EINVAL;
        }
        /* Length checked above; memcpy because gcc -O1 (./dev asan) flags the snprintf as a
         * possible truncation of the 4096-byte option. */
        memcpy(a->path, s->cfg->admin_socket, strlen(s->cfg->admin_socket) + 1);
    } else {
        const char *slash = strrchr(kvd_server_socket_path(s->srv), '/');
        int dirlen = slash == NULL ? 0 : (int)(slash - kvd_server_socket_path(s->srv) + 1);
        if ((size_t)dirlen + sizeof("admin.sock") > sizeof(a->path)) {
            KV_LOG(ERROR, "KVD-ADMIN", "admin socket path beside %s is too long; set admin-socket",
                   kvd_server_socket_path(s->srv));
            return KV_EINVAL;
        }
        snprintf(a->path, sizeof(a->path), "%.*sadmin.sock", dirlen,
                 kvd_server_socket_path(s->srv));
    }
    if (s->cfg->admin_group[0] != '\0') {
        if (resolve_group(s->cfg->admin_group, &a->group) != KV_OK) {
            KV_LOG(ERROR, "KVD-ADMIN", "admin-group '%s' is not a group of this system",
                   s->cfg->admin_group);
            return KV_EINVAL;
        }
        a->have_group = 1;
    }
    struct stat st;
    /* libuv reports a missing directory as "permission denied": say what is wrong. */
    char dir[sizeof(a->path)];
    snprintf(dir, sizeof(dir), "%s", a->path);
    char *slash = strrchr(dir, '/');
    if (slash != NULL && slash != dir) {
        *slash = '\0';
        if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
            KV_LOG(ERROR, "KVD-ADMIN",
                   "admin-socket %s: its directory %s does not exist (create it, or leave "
                   "admin-socket empty for admin.sock beside the client socket)",
                   a->path, dir);
            return KV_ENOENT;
        }
    }
    if (lstat(a->path, &st) == 0) {
        if (!S_ISSOCK(st.st_mode)) {
            KV_LOG(ERROR, "KVD-ADMIN", "%s exists and is not a socket", a->path);
            return KV_EEXIST;
        }
        /* The client socket probe already proved no other kvd serves this directory. */
        unlink(a->path);
    }
    if (uv_pipe_init(s->loop, &a->listen, 0) != 0) {
        return KV_ESYS;
    }
    a->listen.data = a;
    a->listen_active = 1;
    int r = uv_pipe_bind(&a->listen, a->path);
    if (r != 0) {
        KV_LOG(ERROR, "KVD-ADMIN", "bind %s: %s", a->path, uv_strerror(r));
        return KV_ESYS;
    }
    a->bound = 1;
    if (a->have_group && chown(a->path, (uid_t)-1, a->group) != 0) {
        KV_LOG(ERROR, "KVD-ADMIN", "chown %s to group %s: %s", a->path, s->cfg->admin_group,
               strerror(errno));
        return KV_ESYS;
    }
    /* With an admin group its members must be able to connect: group read and write. */
    mode_t mode = (mode_t)s->cfg->admin_socket_mode | (a->have_group ? 0060 : 0);
    if (chmod(a->path, mode) != 0) {
        KV_LOG(ERROR, "KVD-ADMIN", "chmod %s: %s", a->path, strerror(errno));
        return KV_ESYS;
    }
    r = uv_listen((uv_stream_t *)&a->listen, 16, on_connection);
    if (r != 0) {
        KV_LOG(ERROR, "KVD-ADMIN", "listen %s: %s", a->path, uv_strerror(r));
        return KV_ESYS;
    }
    snprintf(s->admin_path, sizeof(s->admin_path), "%s", a->path);
    KV_LOG(INFO, "KVD-ADMIN", "admin socket %s (mode 0%o%s%s)", a->path, (unsigned)mode,
           a->have_group ? ", group " : "", a->have_group ? s->cfg->admin_group : "");
    return KV_OK;
}

void kvd_admin_stop(kvd_ops *s) {
    kvd_admin *a = s->admin;
    if (a == NULL) {
        return;
    }
    if (a->listen_active) {
        a->listen_active = 0;
        uv_close((uv_handle_t *)&a->listen, NULL);
    }
    if (a->bound) {
        unlink(a->path);
        a->bound = 0;
    }
    for (admin_conn *c = a->conns; c != NULL; c = c->next) {
        conn_close(c);
    }
}

void kvd_admin_free(kvd_ops *s) {
    if (s->admin == NULL) {
        return;
    }
    KV_ASSERT(s->admin->conns == NULL && !s->admin->listen_active);
    free(s->admin);
    s->admin = NULL;
}
