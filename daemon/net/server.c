/* kvd_server: sockets, connections and their byte streams. Requests are decoded here and handed
 * to the handlers (daemon/proto/rpc.h); the encoded replies they return go into a per-connection
 * queue. Reading a
 * connection pauses while it has max-inflight unsent replies (backpressure without refusing),
 * and a connection whose queue passes max-output-bytes is closed, so one client that does not
 * read never holds memory or the loop hostage. */
#include "daemon/net/server.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "common/kv_log.h"
#include "common/kv_util.h"
#include "common/kv_wire.h"
#include "daemon/net/server_int.h"

#define READ_CHUNK 65536
#define OUT_CHUNK_MIN 16384             /* bytes of a new output chunk */
#define OUT_CHUNK_COALESCE (256u << 10) /* replies are appended to a chunk up to this size */

static void conn_close(kvd_conn *c);
static void conn_update_events(kvd_conn *c);
static void conn_charge(kvd_conn *c);

/* ---- output ---------------------------------------------------------------------------- */

static void frame_free(kvd_out_frame *f) {
    if (f == NULL) {
        return;
    }
    for (uint32_t i = 0; i < f->nfds; i++) {
        close(f->fds[i]);
    }
    free(f->fds);
    free(f->buf);
    free(f);
}

/* A chunk that was written: kept as the connection's spare (the next reply reuses its buffer)
 * unless one is kept already or it grew large. */
static void frame_done(kvd_conn *c, kvd_out_frame *f) {
    if (c->out_spare != NULL || f->cap > OUT_CHUNK_COALESCE || f->nfds > 0) {
        frame_free(f);
        return;
    }
    free(f->fds);
    f->fds = NULL;
    f->next = NULL;
    f->len = f->off = 0;
    f->nreplies = 0;
    c->out_spare = f;
}

/* An empty chunk with room for len bytes: the spare when it is big enough, else a new one. */
static kvd_out_frame *frame_new(kvd_conn *c, size_t len) {
    kvd_out_frame *f = c->out_spare;
    if (f != NULL && f->cap >= len) {
        c->out_spare = NULL;
        return f;
    }
    f = calloc(1, sizeof(*f));
    if (f == NULL) {
        return NULL;
    }
    f->cap = len > OUT_CHUNK_MIN ? len : OUT_CHUNK_MIN;
    f->buf = malloc(f->cap);
    if (f->buf == NULL) {
        free(f);
        return NULL;
    }
    return f;
}

/* Appends a reply of len bytes to the queue's last chunk when it carries no fds and the chunk
 * stays below OUT_CHUNK_COALESCE. Returns 0 when it was not appended (no memory included). */
static int frame_append(kvd_conn *c, const uint8_t *frame, size_t len) {
    kvd_out_frame *t = c->out_tail;
    if (t == NULL || t->len + len > OUT_CHUNK_COALESCE) {
        return 0;
    }
    if (t->cap - t->len < len) {
        size_t ncap = t->cap * 2 > t->len + len ? t->cap * 2 : t->len + len;
        uint8_t *n = realloc(t->buf, ncap);
        if (n == NULL) {
            return 0;
        }
        t->buf = n;
        t->cap = ncap;
    }
    memcpy(t->buf + t->len, frame, len);
    t->len += len;
    t->nreplies++;
    return 1;
}

/* A reply was encoded in place (reserve_reply): the queue's bounds are checked as for any. */
static kv_err conn_queued(kvd_conn *c) {
    conn_charge(c);
    if (c->out_bytes > c->srv->cfg->max_output_bytes && !c->close_after_flush) {
        KV_LOG(WARN, "KVD-CONN-SLOW",
               "session %llu (pid %d): %zu reply bytes queued, above max-output-bytes %llu; "
               "disconnecting a client that does not read",
               (unsigned long long)c->sess.id, (int)c->sess.pid, c->out_bytes,
               (unsigned long long)c->srv->cfg->max_output_bytes);
        conn_close(c);
    }
    return KV_OK;
}

/* Queues one encoded frame with fds[0..nfds) (dup'ed here; the caller keeps its fds). A queue
 * above max-output-bytes closes the connection (the client does not read): KV_OK all the same,
 * the reply is dropped with the connection. KV_ECLOSED when the connection is closing, KV_ENOMEM,
 * KV_ESYS (a dup failed). */
static kv_err conn_queue(kvd_conn *c, const uint8_t *frame, size_t len, const int *fds,
                         uint32_t nfds) {
    if (c->closing) {
        return KV_ECLOSED;
    }
    if (nfds == 0 && frame_append(c, frame, len)) {
        c->out_frames++;
        c->out_bytes += len;
        goto check_size;
    }
    kvd_out_frame *f = frame_new(c, len);
    if (f == NULL) {
        return KV_ENOMEM;
    }
    memcpy(f->buf, frame, len);
    f->len = len;
    f->nreplies = 1;
    if (nfds > 0) {
        f->fds = malloc(sizeof(int) * nfds);
        if (f->fds == NULL) {
            frame_free(f);
            return KV_ENOMEM;
        }
        /* Dup: a segment freed before this frame is written must not leave a dangling fd. */
        for (uint32_t i = 0; i < nfds; i++) {
            int d = fcntl(fds[i], F_DUPFD_CLOEXEC, 3);
            if (d < 0) {
                KV_LOG(ERROR, "KVD-CONN-FD", "dup of a segment fd failed: %s", strerror(errno));
                frame_free(f);
                return KV_ESYS;
            }
            f->fds[f->nfds++] = d;
        }
    }
    if (c->out_tail != NULL) {
        c->out_tail->next = f;
    } else {
        c->out_head = f;
    }
    c->out_tail = f;
    c->out_frames++;
    c->out_bytes += f->len;
check_size:
    conn_charge(c);
    if (c->out_bytes > c->srv->cfg->max_output_bytes && !c->close_after_flush) {
        KV_LOG(WARN, "KVD-CONN-SLOW",
               "session %llu (pid %d): %zu reply bytes queued, above max-output-bytes %llu; "
               "disconnecting a client that does not read",
               (unsigned long long)c->sess.id, (int)c->sess.pid, c->out_bytes,
               (unsigned long long)c->srv->cfg->max_output_bytes);
        conn_close(c);
    }
    return KV_OK;
}

/* Room for one more reply of len bytes at the end of c's output queue, counted as queued (the
 * handler encodes it there); NULL when it does not fit the last chunk (the reply then comes
 * back encoded in the arena). */
static uint8_t *reserve_reply(void *arg, size_t len) {
    kvd_conn *c = arg;
    kvd_out_frame *t = c->out_tail;
    if (c->closing || t == NULL || t->nfds > 0 || t->len + len > OUT_CHUNK_COALESCE ||
        t->cap - t->len < len) {
        return NULL;
    }
    uint8_t *at = t->buf + t->len;
    t->len += len;
    t->nreplies++;
    c->out_frames++;
    c->out_bytes += len;
    return at;
}

/* What the handlers get for a request on c (conn NULL: no in-place replies). */
static kvd_rpc_ctx rpc_ctx(kvd_server *s, kvd_conn *c) {
    kvd_rpc_ctx x = {s->reg,        s->cfg, s->boot_epoch, s->draining, &s->req_arena, &s->counts,
                     reserve_reply, c,      s->tiers,      s->kvevents, &s->later};
    if (c == NULL) {
        x.reserve = NULL;
    }
    return x;
}

/* Queues a reply the handlers made; a reply that cannot be queued closes the connection (the
 * session's state already says it was sent). Closes the reply's temporary fds. */
static void conn_queue_reply(kvd_conn *c, const kvd_reply *r) {
    if (r->deferred) {
        return; /* a Fetch in flight: its reply comes through later_send */
    }
    kv_err rc = r->queued          ? conn_queued(c)
                : r->frame != NULL ? conn_queue(c, r->frame, r->len, r->fds, r->nfds)
                                   : KV_ENOMEM;
    for (uint32_t i = 0; i < r->ntmp; i++) {
        close(r->tmp_fds[i]);
    }
    if (rc == KV_ECLOSED) {
        return;
    }
    if (rc != KV_OK) {
        KV_LOG(ERROR, "KVD-CONN-NOMEM", "session %llu: cannot queue a reply (%s); closing",
               (unsigned long long)c->sess.id, kv_strerror(rc));
        conn_close(c);
        return;
    }
    if (r->close_after) {
        c->close_after_flush = 1;
    }
}

/* Queues an Error reply for request id. */
static void conn_send_error(kvd_conn *c, uint64_t id, kv_err code, const char *msg) {
    kvd_rpc_ctx x = rpc_ctx(c->srv, NULL);
    kvd_reply r;
    kvd_rpc_error(&x, &c->sess, id, code, msg, &r);
    conn_queue_reply(c, &r);
    kv_arena_reset(&c->srv->req_arena);
}

/* Logs a protocol error of c, rate-limited, with a hex sample of the offending bytes. */
static void conn_log_proto(kvd_conn *c, const char *what, const uint8_t *bytes, size_t len) {
    kvd_server *s = c->srv;
    uint64_t now = uv_now(s->loop);
    /* At most 10 lines a second over all connections; the rest are counted. */
    if (now - s->log_window_ms >= 1000) {
        s->log_window_ms = now;
        s->log_in_window = 0;
    }
    if (s->log_in_window >= 10) {
        s->log_suppressed++;
        return;
    }
    s->log_in_window++;
    char hex[3 * 32 + 1];
    size_t n = len < 32 ? len : 32;
    for (size_t i = 0; i < n; i++) {
        snprintf(hex + 3 * i, 4, "%02x ", bytes[i]);
    }
    hex[n > 0 ? 3 * n - 1 : 0] = '\0';
    if (len > 0) {
        KV_LOG(WARN, "KVD-CONN-PROTO",
               "session %llu (pid %d uid %d): %s; %zu bytes, first: %s (%llu similar lines "
               "suppressed)",
               (unsigned long long)c->sess.id, (int)c->sess.pid, (int)c->sess.uid, what, len, hex,
               (unsigned long long)s->log_suppressed);
    } else {
        KV_LOG(WARN, "KVD-CONN-PROTO",
               "session %llu (pid %d uid %d): %s (%llu similar lines suppressed)",
               (unsigned long long)c->sess.id, (int)c->sess.pid, (int)c->sess.uid, what,
               (unsigned long long)s->log_suppressed);
    }
    s->log_suppressed = 0;
}

/* Writes as much of the queue as the socket takes. A frame with fds starts its own sendmsg so
 * its fds ride with its first byte. Returns -1 when the connection was closed. */
static int conn_flush(kvd_conn *c) {
    while (c->out_head != NULL) {
        struct iovec iov[64];
        int niov = 0;
        kvd_out_frame *f = c->out_head;
        union {
            char buf[CMSG_SPACE(sizeof(int) * KV_WIRE_MAX_FDS)];
            struct cmsghdr align;
        } ctl;
        struct msghdr mh;
        memset(&mh, 0, sizeof(mh));
        int with_fds = f->off == 0 && f->nfds > 0;
        for (kvd_out_frame *g = f; g != NULL && niov < 64; g = g->next) {
            if (g != f && g->nfds > 0) {
                break;
            }
            iov[niov].iov_base = g->buf + g->off;
            iov[niov].iov_len = g->len - g->off;
            niov++;
        }
        mh.msg_iov = iov;
        mh.msg_iovlen = (size_t)niov;
        if (with_fds) {
            memset(&ctl, 0, sizeof(ctl));
            mh.msg_control = ctl.buf;
            mh.msg_controllen = CMSG_SPACE(sizeof(int) * f->nfds);
            struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
            cm->cmsg_level = SOL_SOCKET;
            cm->cmsg_type = SCM_RIGHTS;
            cm->cmsg_len = CMSG_LEN(sizeof(int) * f->nfds);
            memcpy(CMSG_DATA(cm), f->fds, sizeof(int) * f->nfds);
        }
        ssize_t n = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                return 0;
            }
            if (errno == EINTR) {
                continue;
            }
            KV_LOG(DEBUG, "KVD-CONN-WRITE", "session %llu: sendmsg: %s",
                   (unsigned long long)c->sess.id, strerror(errno));
            conn_close(c);
            return -1;
        }
        if (with_fds) {
            /* The kernel holds the fds in flight now; our dups can go. */
            for (uint32_t i = 0; i < f->nfds; i++) {
                close(f->fds[i]);
            }
            f->nfds = 0;
        }
        size_t left = (size_t)n;
        while (left > 0) {
            kvd_out_frame *h = c->out_head;
            size_t take = h->len - h->off < left ? h->len - h->off : left;
            h->off += take;
            left -= take;
            c->out_bytes -= take;
            if (h->off == h->len) {
                c->out_head = h->next;
                if (c->out_head == NULL) {
                    c->out_tail = NULL;
                }
                c->out_frames -= h->nreplies;
                frame_done(c, h);
            }
        }
    }
    if (c->close_after_flush) {
        conn_close(c);
        return -1;
    }
    return 0;
}

/* ---- input ----------------------------------------------------------------------------- */

static uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Decodes and handles the whole frames in the input buffer while the connection may take more
 * requests. Returns the number of frames handled. */
static size_t conn_process(kvd_conn *c) {
    kvd_server *s = c->srv;
    size_t handled = 0;
    while (!c->closing && !c->close_after_flush && c->out_frames < s->cfg->max_inflight) {
        const uint8_t *p = c->in + c->in_off;
        size_t avail = c->in_len - c->in_off;
        Kvd__Envelope *env = NULL;
        size_t used = 0;
        uint64_t id = 0;
        char why[KV_ERRMSG];
        /* Unpacked into the request arena: no malloc per submessage, one reset per request. */
        kv_err rc = kv_wire_decode_request(p, avail, (uint32_t)s->cfg->max_frame_bytes,
                                           s->boot_epoch, kv_arena_allocator(&s->req_arena), &env,
                                           &used, &id, why, sizeof(why));
        if (rc == KV_ETOOBIG) {
            char msg[KV_ERRMSG];
            snprintf(msg, sizeof(msg), "frame of %u bytes exceeds max_frame_bytes %llu; closing",
                     le32(p), (unsigned long long)s->cfg->max_frame_bytes);
            conn_log_proto(c, "frame too big", p, avail);
            conn_send_error(c, 0, KV_ETOOBIG, msg);
            /* The body is not read: the stream cannot be resynchronised. */
            c->in_off = c->in_len = 0;
            c->close_after_flush = 1;
            break;
        }
        if (rc != KV_OK) {
            kv_arena_reset(&s->req_arena);
            /* The length was valid, so skip exactly this frame and stay in sync; answer the
             * request's id where the envelope unpacked (0 where it did not). */
            conn_log_proto(c, why, p, used);
            conn_send_error(c, id, rc, why);
            c->in_off += used;
            c->sess.requests++;
            handled++;
            continue;
        }
        if (env == NULL) {
            break;
        }
        c->in_off += used;
        kvd_rpc_ctx x = rpc_ctx(s, c);
        kvd_reply r;
        kvd_rpc_handle(&x, &c->sess, env, &r);
        if (r.code == KV_EPROTO) {
            conn_log_proto(c, r.why != NULL ? r.why : "protocol error", NULL, 0);
        }
        conn_queue_reply(c, &r);
        kv_arena_reset(&s->req_arena); /* frees env, the handler's scratch and the reply */
        handled++;
    }
    if (c->in_off == c->in_len) {
        c->in_off = c->in_len = 0;
    }
    return handled;
}

/* Reads once. Returns -1 when the connection closed. */
static int conn_read(kvd_conn *c) {
    size_t need = c->srv->cfg->max_frame_bytes + KV_WIRE_HEADER_BYTES + READ_CHUNK;
    if (c->in_off > 0 && c->in_cap - c->in_len < READ_CHUNK) {
        memmove(c->in, c->in + c->in_off, c->in_len - c->in_off);
        c->in_len -= c->in_off;
        c->in_off = 0;
    }
    if (c->in_cap - c->in_len < READ_CHUNK && c->in_cap < need) {
        size_t ncap = c->in_cap == 0 ? 2 * READ_CHUNK : c->in_cap * 2;
        if (ncap > need) {
            ncap = need;
        }
        uint8_t *n = realloc(c->in, ncap);
        if (n == NULL) {
            KV_LOG(ERROR, "KVD-CONN-NOMEM", "session %llu: no memory for input; closing",
                   (unsigned long long)c->sess.id);
            conn_close(c);
            return -1;
        }
        c->in = n;
        c->in_cap = ncap;
    }
    size_t room = c->in_cap - c->in_len;
    if (room == 0) {
        /* A whole frame always fits, so a full buffer means requests are paused. */
        return 0;
    }
    union {
        char buf[CMSG_SPACE(sizeof(int) * 16)];
        struct cmsghdr align;
    } ctl;
    struct iovec iov = {c->in + c->in_len, room};
    struct msghdr mh;
    memset(&mh, 0, sizeof(mh));
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl.buf;
    mh.msg_controllen = sizeof(ctl.buf);
    ssize_t n = recvmsg(c->fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
            return 0;
        }
        KV_LOG(DEBUG, "KVD-CONN-READ", "session %llu: recvmsg: %s", (unsigned long long)c->sess.id,
               strerror(errno));
        conn_close(c);
        return -1;
    }
    /* Clients never send fds; close any that came so they cannot pile up in the daemon. */
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm != NULL; cm = CMSG_NXTHDR(&mh, cm)) {
        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
            size_t k = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            int fds[16];
            memcpy(fds, CMSG_DATA(cm), k * sizeof(int));
            for (size_t i = 0; i < k; i++) {
                close(fds[i]);
            }
        }
    }
    if (n == 0) {
        conn_close(c);
        return -1;
    }
    c->in_len += (size_t)n;
    return 0;
}

/* ---- the global buffer bound (max-buffer-bytes) --------------------------------------------- */

/* Brings c's share of srv->buf_bytes up to date (input capacity + unsent reply bytes; 0 once
 * closing). */
static void conn_charge(kvd_conn *c) {
    size_t now = c->closing ? 0 : c->in_cap + c->out_bytes;
    c->srv->counts.buffer_bytes = c->srv->counts.buffer_bytes - c->charged + now;
    c->charged = now;
}

static int cmp_backlog_desc(const void *a, const void *b) {
    const kvd_conn *x = *(kvd_conn *const *)a, *y = *(kvd_conn *const *)b;
    return x->out_bytes < y->out_bytes ? 1 : x->out_bytes > y->out_bytes ? -1 : 0;
}

/* Over max-buffer-bytes, stops reading the connections with the largest reply backlog, largest
 * first, until the buffers of those paused cover the excess; under it (or once they drained),
 * reads everyone again. Writing never stops, so paused connections drain and resume; one that
 * never reads stays paused and is disconnected by max-output-bytes as before. Connections without
 * a backlog are not paused (their input buffers are bounded per connection and given back when
 * idle). O(connections log connections), and only while over the bound or someone is paused. */
static void buffers_balance(kvd_server *s) {
    kvd_conn **v = NULL;
    uint32_t n = 0;
    uint64_t cap = s->cfg->max_buffer_bytes;
    if (s->counts.buffer_bytes > cap && s->counts.conns > 0) {
        v = malloc(sizeof(*v) * s->counts.conns);
        if (v == NULL) {
            return; /* keep the current pauses; the next event tries again */
        }
        for (kvd_conn *c = s->conns; c != NULL; c = c->next) {
            if (!c->closing && c->out_bytes > 0) {
                v[n++] = c;
            }
        }
        qsort(v, n, sizeof(*v), cmp_backlog_desc);
    }
    uint64_t excess = s->counts.buffer_bytes > cap ? s->counts.buffer_bytes - cap : 0;
    uint64_t covered = 0;
    for (kvd_conn *c = s->conns; c != NULL; c = c->next) {
        if (c->paused) {
            c->paused = 0;
            s->counts.paused--;
        }
    }
    for (uint32_t i = 0; i < n && covered < excess; i++) {
        v[i]->paused = 1;
        s->counts.paused++;
        covered += v[i]->charged;
    }
    free(v);
    for (kvd_conn *c = s->conns; c != NULL; c = c->next) {
        conn_update_events(c);
    }
}

static void on_conn_poll(uv_poll_t *h, int status, int events) {
    kvd_conn *c = h->data;
    if (c->closing) {
        return;
    }
    if (status < 0) {
        conn_close(c);
        return;
    }
    if ((events & UV_WRITABLE) && conn_flush(c) < 0) {
        return;
    }
    if ((events & UV_READABLE) && c->out_frames < c->srv->cfg->max_inflight &&
        !c->close_after_flush && !c->paused && conn_read(c) < 0) {
        return;
    }
    /* Handle, write, and go on while writing made room for buffered requests. */
    for (;;) {
        size_t handled = conn_process(c);
        if (c->closing || conn_flush(c) < 0) {
            return;
        }
        if (handled == 0 || c->out_frames >= c->srv->cfg->max_inflight) {
            break;
        }
    }
    kvd_server *s = c->srv;
    /* A frame whose bytes have not all arrived starts its clock (frame-timeout-ms); whole frames
     * waiting for flow control do not. */
    size_t avail = c->in_len - c->in_off;
    int partial = avail > 0 && (avail < KV_WIRE_HEADER_BYTES ||
                                avail < KV_WIRE_HEADER_BYTES + (size_t)le32(c->in + c->in_off));
    if (!partial) {
        c->partial_since = 0;
    } else if (c->partial_since == 0) {
        c->partial_since = uv_now(s->loop);
    }
    if (s->counts.buffer_bytes > s->cfg->max_buffer_bytes && c->in_off == c->in_len &&
        c->in_cap > 2 * READ_CHUNK) {
        /* Over the global bound: an idle connection gives its large input buffer back (the next
         * read allocates again). */
        free(c->in);
        c->in = NULL;
        c->in_cap = c->in_off = c->in_len = 0;
    }
    conn_charge(c);
    if (s->counts.buffer_bytes > s->cfg->max_buffer_bytes || s->counts.paused > 0) {
        buffers_balance(s);
    }
    conn_update_events(c);
}

static void conn_update_events(kvd_conn *c) {
    if (c->closing) {
        return;
    }
    int ev = 0;
    if (!c->close_after_flush && !c->paused && c->out_frames < c->srv->cfg->max_inflight) {
        ev |= UV_READABLE;
    }
    if (c->out_head != NULL) {
        ev |= UV_WRITABLE;
    }
    if (ev == c->events) {
        return;
    }
    c->events = ev;
    if (ev == 0) {
        uv_poll_stop(&c->poll);
    } else {
        uv_poll_start(&c->poll, ev, on_conn_poll);
    }
}

static void on_conn_closed(uv_handle_t *h) {
    kvd_conn *c = h->data;
    kvd_server *s = c->srv;
    uint64_t refs = kvd_session_refs_held(&c->sess);
    KV_LOG(INFO, "KVD-CONN-CLOSE", "session %llu closed (pid %d, %s): %llu references released",
           (unsigned long long)c->sess.id, (int)c->sess.pid,
           c->sess.hello ? kvd_tenants_name(s->reg->tenants, c->sess.tenant) : "no hello",
           (unsigned long long)refs);
    kvd_rpc_ctx x = rpc_ctx(s, NULL);
    kvd_rpc_session_close(&x, &c->sess); /* releases everything; idle empty pools go */
    s->counts.buffer_bytes -= c->charged;
    if (c->paused) {
        s->counts.paused--;
    }
    close(c->fd);
    while (c->out_head != NULL) {
        kvd_out_frame *f = c->out_head;
        c->out_head = f->next;
        frame_free(f);
    }
    frame_free(c->out_spare);
    free(c->in);
    if (c->prev != NULL) {
        c->prev->next = c->next;
    } else {
        s->conns = c->next;
    }
    if (c->next != NULL) {
        c->next->prev = c->prev;
    }
    s->counts.conns--;
    free(c);
}

static void conn_close(kvd_conn *c) {
    if (c->closing) {
        return;
    }
    c->closing = 1;
    uv_close((uv_handle_t *)&c->poll, on_conn_closed);
}

/* ---- accept ---------------------------------------------------------------------------- */

/* Sends one Error frame on a socket we will not serve, best effort, and closes it. */
static void refuse(kvd_server *s, int fd, kv_err code, const char *msg) {
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    Kvd__Error err = KVD__ERROR__INIT;
    err.code = (Kvd__ErrorCode)code;
    err.message = (char *)msg;
    env.boot_epoch = s->boot_epoch;
    env.body_case = KVD__ENVELOPE__BODY_ERROR;
    env.error = &err;
    uint8_t buf[512];
    if (kv_wire_frame_size(&env) <= sizeof(buf)) {
        size_t n = kv_wire_encode_into(&env, buf);
        ssize_t w = send(fd, buf, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        (void)w;
    }
    close(fd);
}

/* One descriptor held in reserve, process-wide like the limit it guards. When accept fails
 * with EMFILE/ENFILE the connection stays in the backlog and the level-triggered poll fires
 * again at once: the loop would spin (tests/integration/fault_test measured 80,000 log lines
 * in 200 ms). Instead the spare is closed, the waiting connections are accepted and closed at
 * once (their peers see EOF instead of hanging), and the spare is taken again. */
static int accept_spare_fd = -1;

static void accept_out_of_fds(kvd_server *s, int err) {
    static uint64_t last_log_ms, dropped;
    if (accept_spare_fd >= 0) {
        close(accept_spare_fd);
        accept_spare_fd = -1;
    }
    for (int i = 0; i < 64; i++) {
        int fd = accept4(s->listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            break;
        }
        close(fd);
        dropped++;
    }
    accept_spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    uint64_t now = uv_now(s->loop);
    if (last_log_ms == 0 || now - last_log_ms >= 1000) {
        KV_LOG(WARN, "KVD-ACCEPT", "accept: %s; %llu connection(s) closed unserved so far",
               strerror(err), (unsigned long long)dropped);
        last_log_ms = now;
    }
}

static void on_listen_poll(uv_poll_t *h, int status, int events) {
    kvd_server *s = h->data;
    (void)events;
    if (status < 0 || s->stopping) {
        return;
    }
    if (accept_spare_fd < 0) {
        accept_spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    }
    for (int i = 0; i < 64; i++) {
        int fd = accept4(s->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE) {
                accept_out_of_fds(s, errno);
            } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
                KV_LOG(WARN, "KVD-ACCEPT", "accept: %s", strerror(errno));
            }
            return;
        }
        if (s->counts.conns >= s->cfg->max_connections) {
            KV_LOG(WARN, "KVD-CONN-BUSY", "refusing a connection: %u open (max-connections)",
                   s->counts.conns);
            kvd_events_push(&s->reg->events, KVD_EVENT_REFUSE, 0, -1, 1, KV_EBUSY, "EBUSY",
                            "connection refused: %u open (max-connections)", s->counts.conns);
            refuse(s, fd, KV_EBUSY, "too many connections (max-connections); try again later");
            continue;
        }
        struct ucred cred;
        socklen_t clen = sizeof(cred);
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0) {
            KV_LOG(WARN, "KVD-ACCEPT", "SO_PEERCRED: %s", strerror(errno));
            close(fd);
            continue;
        }
        kvd_conn *c = calloc(1, sizeof(*c));
        if (c == NULL || uv_poll_init(s->loop, &c->poll, fd) != 0) {
            KV_LOG(ERROR, "KVD-ACCEPT", "no memory or poll for a new connection");
            free(c);
            close(fd);
            continue;
        }
        c->srv = s;
        c->fd = fd;
        c->poll.data = c;
        kvd_session_init(&c->sess, s->next_session_id++, cred.pid, cred.uid, cred.gid);
        c->next = s->conns;
        if (s->conns != NULL) {
            s->conns->prev = c;
        }
        s->conns = c;
        s->counts.conns++;
        KV_LOG(INFO, "KVD-CONN-OPEN", "session %llu opened: pid %d uid %d gid %d",
               (unsigned long long)c->sess.id, (int)cred.pid, (int)cred.uid, (int)cred.gid);
        conn_update_events(c);
    }
}

/* A client that started a frame and stopped sending holds a connection (and a max-connections
 * slot) for ever otherwise: such a connection gets ETIMEDOUT and is closed. */
static void on_frame_timer(uv_timer_t *t) {
    kvd_server *s = t->data;
    uint64_t limit = s->cfg->frame_timeout_ms;
    uint64_t now = uv_now(s->loop);
    kvd_conn *next;
    for (kvd_conn *c = s->conns; limit != 0 && c != NULL; c = next) {
        next = c->next;
        if (c->closing || c->close_after_flush || c->partial_since == 0) {
            continue;
        }
        if (c->paused || c->out_frames >= s->cfg->max_inflight) {
            /* kvd is not reading this connection (flow control): the rest of the frame may be
             * waiting in the socket. The clock counts only while kvd reads. */
            c->partial_since = now;
            continue;
        }
        if (now - c->partial_since < limit) {
            continue;
        }
        size_t avail = c->in_len - c->in_off;
        char msg[KV_ERRMSG];
        snprintf(msg, sizeof(msg),
                 "a request frame stayed incomplete for %llu ms (%zu bytes of it arrived); "
                 "frame-timeout-ms is %llu: closing",
                 (unsigned long long)(now - c->partial_since), avail, (unsigned long long)limit);
        KV_LOG(WARN, "KVD-CONN-TIMEOUT", "session %llu (pid %d): %s",
               (unsigned long long)c->sess.id, (int)c->sess.pid, msg);
        c->in_off = c->in_len = 0;
        c->partial_since = 0;
        conn_send_error(c, 0, KV_ETIMEDOUT, msg);
        c->close_after_flush = 1;
        /* Closes once the Error is written; the poll writes what the socket does not take now. */
        if (conn_flush(c) == 0 && !c->closing) {
            conn_update_events(c);
        }
    }
}

/* ---- lifecycle ------------------------------------------------------------------------- */

/* kvd_rpc_later: the open connection of a session (O(connections): Fetch replies only). */
static kvd_conn *conn_of_session(kvd_server *s, uint64_t id) {
    for (kvd_conn *c = s->conns; c != NULL; c = c->next) {
        if (c->sess.id == id && !c->closing) {
            return c;
        }
    }
    return NULL;
}

static kvd_session *later_find(void *arg, uint64_t id) {
    kvd_conn *c = conn_of_session(arg, id);
    return c != NULL ? &c->sess : NULL;
}

/* The end of the loop iteration in which deferred replies were queued: each such connection is
 * written and its buffered requests handled, as a writable event would (on_conn_poll). Here, not
 * in later_send: a reply may be deferred inside another connection's request (a Release that
 * lets a waiting Allocate go), where writing, or closing a connection whose write fails, would
 * run in the middle of that request. Here, not at the next writable event: that took four
 * epoll_ctl and one more epoll_wait a deferred reply (strace of remote Lookups). */
static void on_later_check(uv_check_t *h) {
    kvd_server *s = h->data;
    /* Passes until none is left: a request handled here may defer a reply to a connection an
     * earlier pass went by (its reply would otherwise wait for the loop's next wake-up). */
    for (int again = 1; again;) {
        again = 0;
        kvd_conn *next;
        for (kvd_conn *c = s->conns; c != NULL; c = next) {
            next = c->next; /* (a closed connection stays listed until its close callback) */
            if (c->later) {
                c->later = 0;
                again = 1;
                if (!c->closing) {
                    /* As writable: the write comes first, so that the requests buffered behind
                     * the flow-control limit are handled once it makes room (handled nothing
                     * before it and nothing after, the connection would wait for a read that
                     * may never come). */
                    on_conn_poll(&c->poll, 0, UV_WRITABLE);
                }
            }
        }
    }
    uv_check_stop(&s->later_check);
}

static void later_send(void *arg, uint64_t id, const kvd_reply *r) {
    kvd_server *s = arg;
    kvd_conn *c = conn_of_session(s, id);
    if (c == NULL) {
        return;
    }
    conn_queue_reply(c, r);
    if (c->closing) {
        return;
    }
    if (!s->later_active) {
        conn_update_events(c); /* (stopping) the reply leaves at the next writable event */
        return;
    }
    c->later = 1;
    uv_check_start(&s->later_check, on_later_check); /* (started already: nothing changes) */
}

kv_err kvd_server_alloc(const kvd_server_deps *d, kvd_server **out) {
    kvd_server *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        return KV_ENOMEM;
    }
    s->cfg = d->cfg;
    s->loop = d->loop;
    s->reg = d->reg;
    s->boot_epoch = d->boot_epoch;
    s->on_stopped = d->on_stopped;
    s->on_stopped_arg = d->on_stopped_arg;
    s->tiers = d->tiers;
    s->kvevents = d->kvevents;
    s->later.find = later_find;
    s->later.send = later_send;
    s->later.arg = s;
    s->listen_fd = -1;
    s->next_session_id = 1;
    kv_arena_init(&s->req_arena);
    *out = s;
    return KV_OK;
}

/* Fills s->sock_path from the option or the default location and creates its directory. */
static kv_err socket_path_prepare(kvd_server *s) {
    char path[KVD_CONFIG_PATH_MAX];
    int own_dir = 0;
    if (s->cfg->socket[0] != '\0') {
        snprintf(path, sizeof(path), "%s", s->cfg->socket);
    } else {
        (void)kv_default_socket_path("kvd.sock", path, sizeof(path)); /* too long: below */
        own_dir = 1;
    }
    if (strlen(path) >= sizeof(s->sock_path)) {
        KV_LOG(ERROR, "KVD-SOCKET", "socket path '%s' is longer than %zu bytes", path,
               sizeof(s->sock_path) - 1);
        return KV_EINVAL;
    }
    memcpy(s->sock_path, path, strlen(path) + 1);
    char *slash = strrchr(path, '/');
    if (slash != NULL && slash != path) {
        *slash = '\0';
        struct stat st;
        if (stat(path, &st) != 0) {
            if (mkdir(path, (mode_t)s->cfg->socket_dir_mode) != 0 && errno != EEXIST) {
                KV_LOG(ERROR, "KVD-SOCKET", "cannot create socket directory %s: %s", path,
                       strerror(errno));
                return KV_ESYS;
            }
            (void)chmod(path, (mode_t)s->cfg->socket_dir_mode);
        } else if (!S_ISDIR(st.st_mode)) {
            KV_LOG(ERROR, "KVD-SOCKET", "%s is not a directory", path);
            return KV_ESYS;
        } else if (own_dir && st.st_uid != getuid()) {
            KV_LOG(ERROR, "KVD-SOCKET", "socket directory %s belongs to uid %u, not us", path,
                   (unsigned)st.st_uid);
            return KV_EPERM;
        }
    }
    return KV_OK;
}

kv_err kvd_server_start(kvd_server *s) {
    if (uv_timer_init(s->loop, &s->frame_timer) != 0) {
        return KV_ESYS;
    }
    s->frame_timer.data = s;
    s->timer_active = 1;
    uv_timer_start(&s->frame_timer, on_frame_timer, 250, 250);
    if (uv_check_init(s->loop, &s->later_check) != 0) {
        return KV_ESYS;
    }
    s->later_check.data = s;
    s->later_active = 1;
    kv_err rc = socket_path_prepare(s);
    if (rc != KV_OK) {
        return rc;
    }
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        KV_LOG(ERROR, "KVD-SOCKET", "socket: %s", strerror(errno));
        return KV_ESYS;
    }
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    memcpy(sa.sun_path, s->sock_path, strlen(s->sock_path) + 1);
    struct stat st;
    if (lstat(s->sock_path, &st) == 0) {
        if (!S_ISSOCK(st.st_mode)) {
            KV_LOG(ERROR, "KVD-SOCKET", "%s exists and is not a socket", s->sock_path);
            rc = KV_EEXIST;
            goto cleanup_fd;
        }
        /* A socket file nobody answers on is left over from a daemon that died: take it. */
        int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        int live = probe >= 0 && connect(probe, (struct sockaddr *)&sa, sizeof(sa)) == 0;
        if (probe >= 0) {
            close(probe);
        }
        if (live) {
            KV_LOG(ERROR, "KVD-SOCKET", "another kvd is serving %s", s->sock_path);
            rc = KV_EEXIST;
            goto cleanup_fd;
        }
        unlink(s->sock_path);
    }
    if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        KV_LOG(ERROR, "KVD-SOCKET", "bind %s: %s", s->sock_path, strerror(errno));
        rc = KV_ESYS;
        goto cleanup_fd;
    }
    s->bound = 1;
    if (chmod(s->sock_path, (mode_t)s->cfg->socket_mode) != 0 || listen(fd, 512) != 0) {
        KV_LOG(ERROR, "KVD-SOCKET", "chmod/listen %s: %s", s->sock_path, strerror(errno));
        rc = KV_ESYS;
        goto cleanup_fd;
    }
    if (uv_poll_init(s->loop, &s->listen_poll, fd) != 0) {
        rc = KV_ESYS;
        goto cleanup_fd;
    }
    s->listen_fd = fd;
    s->listen_poll.data = s;
    s->listen_active = 1;
    uv_poll_start(&s->listen_poll, UV_READABLE, on_listen_poll);
    return KV_OK;
cleanup_fd:
    close(fd);
    return rc;
}

static void on_listen_closed(uv_handle_t *h) {
    kvd_server *s = h->data;
    close(s->listen_fd);
    s->listen_fd = -1;
}

static void stop_now(kvd_server *s);

/* cuda-ipc at stop: wait for the sessions (grace), then stop. */
static void on_linger_timer(uv_timer_t *t) {
    kvd_server *s = t->data;
    uint64_t waited = uv_now(s->loop) - s->linger_start;
    if (s->counts.conns == 0 || waited >= s->cfg->shutdown_grace_ms) {
        if (s->counts.conns > 0) {
            KV_LOG(WARN, "KVD-STOP",
                   "%u sessions still open after shutdown-grace-ms %llu: closing them; their "
                   "cuda-ipc mappings of kvd's memory become invalid",
                   s->counts.conns, (unsigned long long)s->cfg->shutdown_grace_ms);
        }
        uv_timer_stop(t);
        stop_now(s);
    }
}

void kvd_server_stop(kvd_server *s) {
    if (s->stopping || s->lingering) {
        return;
    }
    /* cuda-ipc memory freed while an importer has it open is undefined in CUDA (and kvd's exit
     * frees it): with sessions open, stop taking new ones and wait up to shutdown-grace-ms for
     * them to close, before anything is freed. Other backends' memory lives while a client maps
     * it (fds), so they stop at once. */
    if (s->reg->be->kind == KVD_MEM_CUDA_IPC && s->counts.conns > 0 &&
        s->cfg->shutdown_grace_ms > 0 && s->timer_active) {
        s->lingering = 1;
        s->draining = 1;
        s->linger_start = uv_now(s->loop);
        if (s->listen_active) {
            s->listen_active = 0;
            uv_close((uv_handle_t *)&s->listen_poll, on_listen_closed);
        }
        KV_LOG(INFO, "KVD-STOP",
               "stopping: %u sessions have cuda-ipc segments open; waiting up to %llu ms for them "
               "to close",
               s->counts.conns, (unsigned long long)s->cfg->shutdown_grace_ms);
        if (uv_timer_init(s->loop, &s->linger_timer) == 0) {
            s->linger_timer.data = s;
            s->linger_active = 1;
            uv_timer_start(&s->linger_timer, on_linger_timer, 50, 50);
            return;
        }
    }
    stop_now(s);
}

static void stop_now(kvd_server *s) {
    if (s->stopping) {
        return;
    }
    s->stopping = 1;
    if (s->listen_active) {
        s->listen_active = 0;
        uv_close((uv_handle_t *)&s->listen_poll, on_listen_closed);
    }
    if (s->bound) {
        unlink(s->sock_path);
        s->bound = 0;
    }
    kvd_conn *next;
    for (kvd_conn *c = s->conns; c != NULL; c = next) {
        next = c->next;
        if (!c->closing) {
            /* Best effort: what the socket takes now; a client that does not read loses it. */
            c->close_after_flush = 1;
            if (conn_flush(c) == 0) {
                conn_close(c);
            }
        }
    }
    if (s->timer_active) {
        s->timer_active = 0;
        uv_close((uv_handle_t *)&s->frame_timer, NULL);
    }
    if (s->later_active) {
        s->later_active = 0;
        uv_close((uv_handle_t *)&s->later_check, NULL);
    }
    if (s->linger_active) {
        s->linger_active = 0;
        uv_close((uv_handle_t *)&s->linger_timer, NULL);
    }
    if (s->on_stopped != NULL) {
        s->on_stopped(s->on_stopped_arg);
    }
}

void kvd_server_free(kvd_server *s) {
    if (s == NULL) {
        return;
    }
    KV_ASSERT(s->conns == NULL);
    kv_arena_fini(&s->req_arena);
    free(s);
}

const char *kvd_server_socket_path(const kvd_server *s) {
    return s->sock_path;
}

int kvd_server_listening(const kvd_server *s) {
    return s->listen_active && !s->stopping;
}

int kvd_server_draining(const kvd_server *s) {
    return s->draining;
}

void kvd_server_set_draining(kvd_server *s, int on) {
    s->draining = on;
}

const kvd_conn_counts *kvd_server_counts(const kvd_server *s) {
    return &s->counts;
}

void kvd_server_each_session(const kvd_server *s, void (*fn)(void *arg, const kvd_session *sess),
                             void *arg) {
    for (const kvd_conn *c = s->conns; c != NULL; c = c->next) {
        if (!c->closing) {
            fn(arg, &c->sess);
        }
    }
}

uint64_t kvd_server_take_session_id(kvd_server *s) {
    return s->next_session_id++;
}
