/* conn: libkvclient's transport: dialing, framing, the fd FIFO, batches and the I/O engine.
 *
 * The engine (kvc__exchange) is one loop per call that writes the batch's encoded frames and
 * reads replies at the same time (poll() while frames are left to write), so a long pipelined
 * batch never deadlocks against the daemon's flow control (it stops reading us while our unread
 * replies pile up); once everything is written it waits in a blocking recvmsg instead, one system
 * call a reply instead of two. Received fds go
 * into a FIFO in arrival order; a decoded frame takes as many from the front as it names
 * (PROTOCOL.md 2.2). Frames are decoded by common/kv_wire.h into the connection's arena, handed
 * to the installed completion function and dropped at once. Any transport failure closes the
 * socket and marks the connection broken; Hello and reconnecting are the request layer's
 * (client/rpc.c).
 */
#include "client/conn.h"

#include "common/kv_util.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "common/kv_arena.h"
#include "common/kv_wire.h"

#define RBUF_MIN (64u * 1024u)
#define CMSG_FDS 256      /* room for PROTOCOL.md's 200 fds per frame, and some */
#define RECV_SLICE_MS 100 /* longest blocking recvmsg before the deadline is looked at again */

void kvc_options_init(kvc_options *o) {
    memset(o, 0, sizeof(*o));
    o->log_level = KVC_LOG_WARN;
    o->timeout_ms = 30000;
}

kv_err kvc_default_socket_path(char *buf, size_t cap) {
    const char *env = getenv("KVD_SOCKET");
    if (env != NULL && env[0] != '\0') {
        int n = snprintf(buf, cap, "%s", env);
        if (n < 0 || (size_t)n >= cap) {
            return kvc__fail(NULL, KV_ETOOBIG, "$KVD_SOCKET is longer than %zu bytes", cap - 1);
        }
    } else if (kv_default_socket_path("kvd.sock", buf, cap) != 0) {
        return kvc__fail(NULL, KV_ETOOBIG, "the default socket path is longer than %zu bytes",
                         cap - 1);
    }
    return KV_OK;
}

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void fdq_clear(kvc_conn *c) {
    while (c->fdq_len > 0) {
        close(c->fdq[c->fdq_head]);
        c->fdq_head = (c->fdq_head + 1) % KVC__FDQ_CAP;
        c->fdq_len--;
    }
    c->fdq_head = 0;
}

void kvc__conn_break(kvc_conn *c) {
    if (c->fd >= 0) {
        close(c->fd);
        c->fd = -1;
    }
    c->broken = 1;
    c->rlen = 0;
    fdq_clear(c);
}

/* Takes n fds from the front of the FIFO. */
static kv_err fdq_take(kvc_conn *c, size_t n, int *fds) {
    if (n > c->fdq_len) {
        return KV_EPROTO;
    }
    for (size_t i = 0; i < n; i++) {
        fds[i] = c->fdq[c->fdq_head];
        c->fdq_head = (c->fdq_head + 1) % KVC__FDQ_CAP;
        c->fdq_len--;
    }
    return KV_OK;
}

/* ---- batches -------------------------------------------------------------------------- */

void kvc__batch_init(kvc_batch *b, kvc_conn *c) {
    memset(b, 0, sizeof(*b));
    b->conn = c;
    b->next = c->batches;
    if (c->batches != NULL) {
        c->batches->prev = b;
    }
    c->batches = b;
}

void kvc__batch_fini(kvc_batch *b) {
    if (b == NULL) {
        return;
    }
    if (b->conn != NULL && b->conn->active == b) {
        /* Sent and never waited for: its replies would confuse the next call. */
        kvc__conn_break(b->conn);
        b->conn->active = NULL;
    }
    if (b->conn != NULL) {
        if (b->prev != NULL) {
            b->prev->next = b->next;
        } else {
            b->conn->batches = b->next;
        }
        if (b->next != NULL) {
            b->next->prev = b->prev;
        }
    }
    free(b->ops);
    free(b->obuf);
    memset(b, 0, sizeof(*b));
}

kv_err kvc__batch_add(kvc_batch *b, kvc__op_kind kind, Kvd__Envelope *env, kvc__op **op) {
    kvc_conn *c = b->conn;
    if (b->in_flight) {
        return kvc__fail(&c->diag, KV_ESTATE, "batch already sent; wait for it or reset it first");
    }
    /* Id and epoch first: they change the encoded size. Hello goes out with epoch 0: a new
     * daemon would refuse a stale one before saying who it is, and the reconnect logic compares
     * epochs itself. */
    env->id = c->next_id + 1;
    env->boot_epoch = kind == KVC__OP_HELLO ? 0 : c->epoch;
    size_t size = kv_wire_frame_size(env);
    if (size - KV_WIRE_HEADER_BYTES > c->max_frame) {
        return kvc__fail(&c->diag, KV_ETOOBIG, "request of %zu bytes exceeds the daemon's %u", size,
                         c->max_frame);
    }
    if (b->nops == b->cap) {
        size_t ncap = b->cap ? b->cap * 2 : 8;
        kvc__op *n = realloc(b->ops, ncap * sizeof(*n));
        if (n == NULL) {
            return kvc__fail(&c->diag, KV_ENOMEM, "out of memory queuing a request");
        }
        b->ops = n;
        b->cap = ncap;
    }
    if (b->olen + size > b->ocap) {
        size_t ncap = b->ocap ? b->ocap : 4096;
        while (ncap < b->olen + size) {
            ncap *= 2;
        }
        uint8_t *n = realloc(b->obuf, ncap);
        if (n == NULL) {
            return kvc__fail(&c->diag, KV_ENOMEM, "out of memory encoding a request");
        }
        b->obuf = n;
        b->ocap = ncap;
    }
    c->next_id++;
    kvc__op *o = &b->ops[b->nops++];
    memset(o, 0, sizeof(*o));
    o->id = env->id;
    o->kind = kind;
    o->frame_off = b->olen;
    o->frame_len = kv_wire_encode_into(env, b->obuf + b->olen);
    o->status = KV_EINTERNAL;
    b->olen += o->frame_len;
    *op = o;
    return KV_OK;
}

/* ---- receiving ------------------------------------------------------------------------ */

/* Reads what the socket has: at once (block 0), or waiting up to the socket's receive timeout
 * (block 1; RECV_SLICE_MS, see kvc__conn_dial). KV_OK with nothing read is fine (EAGAIN). */
static kv_err recv_some(kvc_conn *c, int block) {
    if (c->rcap - c->rlen < RBUF_MIN / 2) {
        size_t ncap = c->rcap ? c->rcap * 2 : RBUF_MIN;
        uint8_t *n = realloc(c->rbuf, ncap);
        if (n == NULL) {
            return kvc__fail(&c->diag, KV_ENOMEM, "out of memory for the receive buffer");
        }
        c->rbuf = n;
        c->rcap = ncap;
    }
    union {
        char buf[CMSG_SPACE(CMSG_FDS * sizeof(int))];
        struct cmsghdr align;
    } ctl;
    struct iovec iov = {.iov_base = c->rbuf + c->rlen, .iov_len = c->rcap - c->rlen};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctl.buf;
    msg.msg_controllen = sizeof(ctl.buf);
    ssize_t n;
    do {
        n = recvmsg(c->fd, &msg, MSG_CMSG_CLOEXEC | (block ? 0 : MSG_DONTWAIT));
    } while (n < 0 && errno == EINTR && !block);
    if (n < 0) {
        /* A blocking read cut short by a signal is nothing read: the caller looks at its
         * deadline before it reads again. */
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
            return KV_OK;
        }
        int e = errno; /* (the log callback may change errno) */
        kvc__log(&c->diag, KVC_LOG_WARN, "KVC-CONN-RECV", "recvmsg: %s", strerror(e));
        return kvc__fail(&c->diag, KV_ECLOSED, "connection to kvd failed: %s", strerror(e));
    }
    kv_err err = KV_OK;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm != NULL; cm = CMSG_NXTHDR(&msg, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) {
            continue;
        }
        size_t nfd = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        const unsigned char *data = CMSG_DATA(cm);
        for (size_t i = 0; i < nfd; i++) {
            int fd;
            memcpy(&fd, data + i * sizeof(int), sizeof(int));
            if (c->fdq_len == KVC__FDQ_CAP) {
                close(fd);
                err = KV_EPROTO;
                continue;
            }
            c->fdq[(c->fdq_head + c->fdq_len) % KVC__FDQ_CAP] = fd;
            c->fdq_len++;
        }
    }
    if (err != KV_OK || (msg.msg_flags & MSG_CTRUNC)) {
        kvc__log(&c->diag, KVC_LOG_ERROR, "KVC-CONN-FDS",
                 "file descriptors lost (FIFO full or truncated)");
        return kvc__fail(&c->diag, KV_EPROTO, "file descriptors from kvd were lost");
    }
    if (n == 0) {
        kvc__log(&c->diag, KVC_LOG_INFO, "KVC-CONN-EOF", "kvd closed the connection");
        return kvc__fail(&c->diag, KV_ECLOSED, "kvd closed the connection");
    }
    c->rlen += (size_t)n;
    return KV_OK;
}

/* The number of fds a reply frame names (PROTOCOL.md 2.2). */
static size_t frame_fd_count(const Kvd__Envelope *env) {
    Kvd__Segment **segs = NULL;
    size_t n = 0, k = 0;
    if (env->body_case == KVD__ENVELOPE__BODY_ATTACH_POOL_REPLY) {
        segs = env->attach_pool_reply->segments;
        n = env->attach_pool_reply->n_segments;
    } else if (env->body_case == KVD__ENVELOPE__BODY_MAP_SEGMENTS_REPLY) {
        segs = env->map_segments_reply->segments;
        n = env->map_segments_reply->n_segments;
    }
    for (size_t i = 0; i < n; i++) {
        if (segs[i]->kind == KVD__MEMORY_KIND__HOST_MEMFD ||
            segs[i]->kind == KVD__MEMORY_KIND__CUDA_VMM) {
            k += segs[i]->n_part_bytes > 0 ? segs[i]->n_part_bytes : 1; /* parts: one fd each */
        }
    }
    return k;
}

/* The op of b whose request had this id. Ids increase along a batch but may have gaps (the
 * deferred-Release batch is queued between other calls' requests, and a call's own ops are
 * appended to it): the position is tried first, then a binary search. */
static kvc__op *find_op(kvc_batch *b, uint64_t id) {
    if (b->nops == 0 || id < b->ops[0].id) {
        return NULL;
    }
    uint64_t guess = id - b->ops[0].id;
    if (guess < b->nops && b->ops[guess].id == id) {
        return &b->ops[guess];
    }
    size_t lo = 0, hi = b->nops;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (b->ops[mid].id < id) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo < b->nops && b->ops[lo].id == id ? &b->ops[lo] : NULL;
}

/* Handles one decoded frame. Returns a transport-level error (the stream cannot go on). */
static kv_err handle_frame(kvc_conn *c, kvc_batch *b, Kvd__Envelope *env) {
    int fds[CMSG_FDS];
    size_t nfds = frame_fd_count(env);
    if (nfds > CMSG_FDS || fdq_take(c, nfds, fds) != KV_OK) {
        return kvc__fail(&c->diag, KV_EPROTO, "reply names %zu fds but fewer arrived", nfds);
    }
    kv_err err = KV_OK;
    if (c->epoch != 0 && env->boot_epoch != c->epoch) {
        kvc__log(&c->diag, KVC_LOG_WARN, "KVC-CONN-EPOCH", "boot epoch changed: %016llx -> %016llx",
                 (unsigned long long)c->epoch, (unsigned long long)env->boot_epoch);
        err = kvc__fail(&c->diag, KV_EEPOCH, "kvd restarted (boot epoch changed); attach again");
        goto cleanup;
    }
    if (env->body_case == KVD__ENVELOPE__BODY_ERROR && env->id == 0) {
        /* Connection-level: oversized frame, undecodable frame, too many connections. None of
         * our requests will get its reply, so the stream is over for us. */
        int code = (int)env->error->code;
        kvc__log(&c->diag, KVC_LOG_ERROR, "KVC-CONN-ERROR", "kvd: %s: %s", kv_err_name(code),
                 env->error->message ? env->error->message : "");
        err = kvc__fail(&c->diag, code > 0 && code < KV_ERR_COUNT ? (kv_err)code : KV_EPROTO,
                        "kvd refused the connection: %s", env->error->message);
        goto cleanup;
    }
    kvc__op *op = find_op(b, env->id);
    if (op == NULL || op->done) {
        kvc__log(&c->diag, KVC_LOG_ERROR, "KVC-CONN-ID", "reply with unexpected id %llu",
                 (unsigned long long)env->id);
        err = kvc__fail(&c->diag, KV_EPROTO, "kvd replied to unknown request id %llu",
                        (unsigned long long)env->id);
        goto cleanup;
    }
    op->status = c->complete(c, op, env, fds, nfds);
    op->done = 1;
    if (op->sent) {
        b->nwait--;
    }
    if (op->status == KV_EPROTO && env->body_case != KVD__ENVELOPE__BODY_ERROR) {
        /* A reply we cannot make sense of: do not trust the rest of the stream. */
        err = KV_EPROTO;
    }
cleanup:
    for (size_t i = 0; i < nfds; i++) {
        close(fds[i]);
    }
    return err;
}

/* Decodes and handles every whole frame in the input buffer. */
static kv_err drain_frames(kvc_conn *c, kvc_batch *b) {
    size_t off = 0;
    kv_err err = KV_OK;
    uint32_t limit = c->max_frame + KVC__REPLY_SLACK;
    while (off < c->rlen) {
        Kvd__Envelope *env = NULL;
        size_t used = 0;
        err = kv_wire_decode_with(c->rbuf + off, c->rlen - off, limit,
                                  kv_arena_allocator(&c->arena), &env, &used);
        if (err != KV_OK && c->rbuf[off] == '{') {
            /* A text line where a frame belongs: kvd's admin socket answering a binary frame. */
            kv_arena_reset(&c->arena);
            size_t n = c->rlen - off < 120 ? c->rlen - off : 120;
            const uint8_t *nl = memchr(c->rbuf + off, '\n', n);
            if (nl != NULL) {
                n = (size_t)(nl - (c->rbuf + off));
            }
            err = kvc__fail(&c->diag, KV_EPROTO,
                            "%s answered with a text line (%.*s): that is kvd's admin socket; "
                            "workers connect to the client socket (kvd.sock beside it)",
                            c->path, (int)n, (const char *)c->rbuf + off);
            break;
        }
        if (err != KV_OK) {
            kv_arena_reset(&c->arena); /* what a failed unpack left there */
            kvc__log(&c->diag, KVC_LOG_ERROR, "KVC-CONN-DECODE", "undecodable reply from kvd: %s",
                     kv_err_name(err));
            err = kvc__fail(&c->diag, err, "undecodable reply from kvd (%s)", kv_strerror(err));
            break;
        }
        if (env == NULL) {
            /* Incomplete frame: make sure the buffer can hold the whole of it. */
            if (c->rlen - off >= KV_WIRE_HEADER_BYTES) {
                size_t need = KV_WIRE_HEADER_BYTES + (size_t)kv_wire_le32(c->rbuf + off);
                if (need + RBUF_MIN > c->rcap) {
                    uint8_t *n = realloc(c->rbuf, need + RBUF_MIN);
                    if (n == NULL) {
                        err = kvc__fail(&c->diag, KV_ENOMEM, "out of memory for a %zu-byte reply",
                                        need);
                        break;
                    }
                    c->rbuf = n;
                    c->rcap = need + RBUF_MIN;
                }
            }
            break;
        }
        off += used;
        err = handle_frame(c, b, env);
        /* Completion copies what it keeps: nothing of the reply outlives this. */
        kv_arena_reset(&c->arena);
        if (err != KV_OK) {
            break;
        }
    }
    if (off > 0 && err == KV_OK) {
        memmove(c->rbuf, c->rbuf + off, c->rlen - off);
        c->rlen -= off;
    }
    return err;
}

/* ---- the engine ----------------------------------------------------------------------- */

static void mark_sent(kvc_batch *b) {
    while (b->nsent < b->nops &&
           b->ops[b->nsent].frame_off + b->ops[b->nsent].frame_len <= b->osent) {
        kvc__op *op = &b->ops[b->nsent++];
        op->sent = 1;
        if (!op->done) {
            b->nwait++;
        }
    }
}

static void fail_pending(kvc_batch *b, kv_err err) {
    for (size_t i = 0; i < b->nops; i++) {
        if (!b->ops[i].done) {
            b->ops[i].done = 1;
            b->ops[i].status = err;
        }
    }
    b->nwait = 0;
    b->nsent = b->nops;
    b->osent = b->olen;
}

kv_err kvc__exchange(kvc_batch *b, int wait) {
    kvc_conn *c = b->conn;
    kv_err err = KV_OK;
    if (c->fd < 0) {
        err = kvc__fail(&c->diag, KV_ECLOSED, "not connected to kvd");
        goto fail;
    }
    if (c->active != NULL && c->active != b) {
        err = kvc__fail(&c->diag, KV_ESTATE, "another batch is in flight on this connection");
        fail_pending(b, err);
        return err;
    }
    c->active = b;
    b->in_flight = 1;
    int64_t deadline = c->timeout_ms < 0 ? -1 : now_ms() + c->timeout_ms;
    for (;;) {
        err = drain_frames(c, b);
        if (err != KV_OK) {
            goto fail;
        }
        if (b->osent == 0 && b->olen > 0) {
            /* The socket is nearly always writable: try before paying for a poll. */
            ssize_t n = send(c->fd, b->obuf, b->olen, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (n > 0) {
                b->osent = (size_t)n;
                mark_sent(b);
            }
        }
        int want_write = b->osent < b->olen;
        if (!want_write && (!wait || b->nwait == 0)) {
            break;
        }
        int timeout = -1;
        if (deadline >= 0) {
            int64_t left = deadline - now_ms();
            if (left <= 0) {
                kvc__log(&c->diag, KVC_LOG_WARN, "KVC-CONN-TIMEOUT", "no reply within %d ms",
                         c->timeout_ms);
                err = kvc__fail(&c->diag, KV_ETIMEDOUT, "kvd did not reply within %d ms",
                                c->timeout_ms);
                goto fail;
            }
            timeout = left > 1000000 ? 1000000 : (int)left;
        }
        if (!want_write && (deadline < 0 || timeout >= RECV_SLICE_MS)) {
            /* Only replies are awaited (every sync call, once its frame is out): a blocking
             * recvmsg, bounded by the socket's receive timeout, saves the poll's system call and
             * its second wake-up. EAGAIN after a slice comes back as nothing read; the deadline
             * is checked above on the next turn. Less than a slice left: the poll below waits
             * for exactly what is left. */
            err = recv_some(c, 1);
            if (err != KV_OK) {
                kv_err why = drain_frames(c, b);
                err = why != KV_OK ? why : err;
                goto fail;
            }
            continue;
        }
        struct pollfd pfd = {.fd = c->fd, .events = POLLIN | (want_write ? POLLOUT : 0)};
        int pr = poll(&pfd, 1, timeout);
        if (pr < 0) {
            if (errno == EINTR) {
                continue;
            }
            err = kvc__fail(&c->diag, KV_ESYS, "poll: %s", strerror(errno));
            goto fail;
        }
        if (pr == 0) {
            continue;
        }
        if (pfd.revents & POLLOUT) {
            ssize_t n =
                send(c->fd, b->obuf + b->osent, b->olen - b->osent, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
                int e = errno; /* (the log callback may change errno) */
                kvc__log(&c->diag, KVC_LOG_INFO, "KVC-CONN-SEND", "send: %s", strerror(e));
                err = kvc__fail(&c->diag, KV_ECLOSED, "connection to kvd lost: %s", strerror(e));
                /* The daemon may have said why before closing (ETOOBIG): read that first. */
                if (recv_some(c, 0) == KV_OK) {
                    kv_err why = drain_frames(c, b);
                    err = why != KV_OK ? why : err;
                }
                goto fail;
            }
            if (n > 0) {
                b->osent += (size_t)n;
                mark_sent(b);
            }
        }
        if (pfd.revents & (POLLIN | POLLHUP | POLLERR)) {
            err = recv_some(c, 0);
            if (err != KV_OK) {
                /* Frames already buffered still count (e.g. the Error before a close). */
                kv_err why = drain_frames(c, b);
                err = why != KV_OK ? why : err;
                goto fail;
            }
        }
    }
    if (b->nwait == 0 && b->nsent == b->nops) {
        b->in_flight = 0;
        c->active = NULL;
    }
    return KV_OK;
fail:
    fail_pending(b, err);
    b->in_flight = 0;
    if (c->active == b) {
        c->active = NULL;
    }
    kvc__conn_break(c);
    return err;
}

/* ---- making, dialing, freeing --------------------------------------------------------- */

kv_err kvc__conn_alloc(const kvc_options *opts, kvc__complete_fn complete, kvc_conn **out) {
    kvc_options defaults;
    if (opts == NULL) {
        kvc_options_init(&defaults);
        opts = &defaults;
    }
    kvc_conn *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        return kvc__fail(NULL, KV_ENOMEM, "out of memory for a connection");
    }
    c->fd = -1;
    c->complete = complete;
    c->diag.log = opts->log;
    c->diag.log_arg = opts->log_arg;
    c->diag.log_level = opts->log_level;
    c->timeout_ms = opts->timeout_ms;
    kv_arena_init(&c->arena);
    kv_err err = KV_OK;
    if (opts->socket_path != NULL) {
        if (strlen(opts->socket_path) >= sizeof(c->path)) {
            err = KV_ETOOBIG;
        } else {
            strcpy(c->path, opts->socket_path);
        }
    } else {
        err = kvc_default_socket_path(c->path, sizeof(c->path));
    }
    if (err != KV_OK) {
        kvc__log(&c->diag, KVC_LOG_ERROR, "KVC-CONN-PATH", "socket path too long");
        (void)kvc__fail(NULL, err, "the socket path is too long (at most %zu bytes)",
                        sizeof(c->path) - 1); /* kvc_last_error(NULL) says why */
        goto fail;
    }
    const char *name = opts->client_name ? opts->client_name : "kvclient";
    snprintf(c->name, sizeof(c->name), "%s", name);
    if (opts->token_len > 0) {
        c->token = malloc(opts->token_len);
        if (c->token == NULL) {
            err = kvc__fail(NULL, KV_ENOMEM, "out of memory for the token");
            goto fail;
        }
        memcpy(c->token, opts->token, opts->token_len);
        c->token_len = opts->token_len;
    }
    *out = c;
    return KV_OK;
fail:
    kvc__conn_free(c);
    return err;
}

void kvc__conn_free(kvc_conn *c) {
    if (c == NULL) {
        return;
    }
    kvc__conn_break(c);
    if (c->later != NULL) {
        /* Unsent deferred Releases: the session's end releases everything it held anyway. */
        kvc__batch_fini(c->later);
        free(c->later);
        c->later = NULL;
    }
    /* Batches outlive their connection as empty shells (kvc_batch_free still frees them). */
    for (kvc_batch *b = c->batches; b != NULL; b = b->next) {
        b->conn = NULL;
    }
    free(c->rbuf);
    kv_arena_fini(&c->arena);
    free(c->token);
    free(c);
}

kv_err kvc__conn_dial(kvc_conn *c) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        return kvc__fail(&c->diag, KV_ESYS, "socket: %s", strerror(errno));
    }
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    memcpy(sa.sun_path, c->path, sizeof(sa.sun_path));
    /* Non-blocking: a blocking connect waits without limit while kvd's listen queue is full (a
     * daemon stopped or hung); this one is tried again every 10 ms until timeout_ms. */
    int fl = fcntl(fd, F_GETFL);
    (void)fcntl(fd, F_SETFL, fl | O_NONBLOCK);
    int64_t deadline = c->timeout_ms < 0 ? -1 : now_ms() + c->timeout_ms;
    int rc;
    for (;;) {
        rc = connect(fd, (struct sockaddr *)&sa, sizeof(sa));
        if (rc == 0 || (errno != EINTR && errno != EAGAIN)) {
            break;
        }
        if (errno == EAGAIN) {
            if (deadline >= 0 && now_ms() >= deadline) {
                close(fd);
                return kvc__fail(&c->diag, KV_ETIMEDOUT,
                                 "connect %s: kvd accepted no connection within %d ms (its "
                                 "listen queue is full: stopped or hung?)",
                                 c->path, c->timeout_ms);
            }
            (void)poll(NULL, 0, 10);
        }
    }
    (void)fcntl(fd, F_SETFL, fl);
    if (rc < 0) {
        int e = errno;
        close(fd);
        return kvc__fail(&c->diag, KV_ESYS, "connect %s: %s", c->path, strerror(e));
    }
    /* The descriptor stays blocking: every send and recvmsg but the engine's wait for replies
     * passes MSG_DONTWAIT, and that wait blocks in recvmsg for at most RECV_SLICE_MS at a time
     * (shorter for a shorter timeout) before it looks at the call's deadline again. */
    int slice = c->timeout_ms < 0 || c->timeout_ms > RECV_SLICE_MS ? RECV_SLICE_MS : c->timeout_ms;
    struct timeval tv = {.tv_sec = slice / 1000, .tv_usec = (slice % 1000) * 1000};
    if (slice == 0) {
        tv.tv_usec = 1000; /* 0 would mean no limit */
    }
    if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) < 0) {
        int e = errno;
        close(fd);
        return kvc__fail(&c->diag, KV_ESYS, "setsockopt SO_RCVTIMEO: %s", strerror(e));
    }
    c->fd = fd;
    c->dials++;
    c->broken = 0;
    c->rlen = 0;
    return KV_OK;
}

/* ---- public accessors ----------------------------------------------------------------- */

const char *kvc_last_error(const kvc_conn *c) {
    return c != NULL ? c->diag.err : kvc__thread_error();
}

const char *kvc_strerror(kv_err err) {
    return kv_strerror(err);
}

const char *kvc_err_name(kv_err err) {
    return kv_err_name(err);
}

uint64_t kvc_conn_session_id(const kvc_conn *c) {
    return c->session_id;
}

const char *kvc_conn_tenant(const kvc_conn *c) {
    return c->tenant;
}

uint64_t kvc_conn_boot_epoch(const kvc_conn *c) {
    return c->epoch;
}

int kvc_conn_fd(const kvc_conn *c) {
    return c->fd;
}
