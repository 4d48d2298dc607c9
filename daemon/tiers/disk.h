/* kvd_disk: the T2 tier's file of one pool (one (model, layout, domain)): fixed-size slots of
 * block records, written and read with pwrite/pread so that several copy threads can use one
 * file at once, with O_DIRECT where the file system takes it.
 *
 * File `<dir>/<name>`, created 0600 in a directory created 0700 (the caller makes one directory
 * per domain). Layout: a 4096-byte header (magic "KVDTIER2", format version, slot_bytes,
 * block_bytes, the pool key: model id, layout fields, domain name, hash seed; an XXH3-64 of the
 * header), then slot i at byte 4096 + i * slot_bytes; every slot starts and ends on a 4096-byte
 * boundary (O_DIRECT's alignment). A slot holds one record: a 64-byte header (magic, format,
 * payload length, the block's chain hash, its parent's chain hash, a sequence number, XXH3-64
 * of the digest tail and payload, XXH3-64 of the header), the optional 16-byte digest tail, and
 * the payload (the block's bytes as kvd_codec stored them), zero padded.
 *
 * Two file formats. Format 2: the record header and tail fill the slot's first 4096 bytes and
 * the payload starts at byte 4096 of the slot, so a payload's whole pages can go between the
 * disk and the caller's memory with O_DIRECT and no copy (kvd_disk_write_from / read_into);
 * slot_bytes = 4096 + block_bytes rounded up to 4096. Format 1: the payload follows the header
 * (and tail) at byte 64 (80); slot_bytes = 64 + block_bytes rounded up to 4096. A new file is
 * format 2 where that costs no room (block_bytes a multiple of 4096, or at most 63 bytes under
 * one: every real model's blocks), else format 1 (a small block would pay a page a slot for
 * the header); files made by kvd before format 2 are format 1 and stay so.
 *
 * The file survives a restart: kvd_disk_scan reads every slot header and reports the valid
 * ones, so the daemon rebuilds its T2 entries. A file whose header is corrupt, truncated or of
 * another pool key is never used: kvd_disk_open renames it aside (`<name>.bad`, replacing an
 * older one) with a log line and starts a new file. A record whose header or payload fails a
 * check is never returned (KV_ECORRUPT). Slot allocation is the caller's (the tier store on the
 * loop thread); the file only grows to the slots written.
 *
 * Threads: open, scan and close on one thread with no read/write in flight; read, write and
 * clear of distinct slots from any threads at once.
 */
#ifndef KVD_DISK_H
#define KVD_DISK_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"
#include "common/kv_hash.h"
#include "common/kv_layout.h"

#define KVD_DISK_ALIGN 4096u  /* header size, slot alignment, buffer alignment for O_DIRECT */
#define KVD_DISK_REC_HDR 64u  /* bytes of a record header */
#define KVD_DISK_KEY_MAX 256u /* model id and domain name: at most this many bytes each */

/* kvd_disk_open's flags. */
#define KVD_DISK_DIRECT 1u  /* try O_DIRECT */
#define KVD_DISK_FORMAT1 2u /* a new file gets format 1 (tests: files older kvds made) */
#define KVD_DISK_FORMAT2 4u /* a new file gets format 2 whatever the room (tests) */

typedef struct kvd_disk kvd_disk;

/* What a file belongs to. Two keys match when every field is equal. */
typedef struct kvd_disk_key {
    char model[KVD_DISK_KEY_MAX + 1];  /* model id, NUL-terminated */
    char domain[KVD_DISK_KEY_MAX + 1]; /* domain name, NUL-terminated */
    kv_layout layout;                  /* shape (kv_layout_init'ed) */
    kv_hash128 seed;                   /* the pool's hash seed (model and layout) */
} kvd_disk_key;

/* One record's header fields as the caller gives and gets them. */
typedef struct kvd_disk_rec {
    kv_hash128 hash;   /* the block's chain hash */
    kv_hash128 parent; /* its parent's chain hash (zero for a first block) */
    uint64_t seq;      /* caller's sequence number (newest wins when a hash is in two slots) */
    uint32_t format;   /* kvd_tier_format of the payload */
    uint32_t len;      /* payload bytes (at most the slot's payload room, less the tail's) */
    uint32_t has_tail; /* hash-mode vllm: tail holds the digest's last 16 bytes */
    uint8_t tail[16];
} kvd_disk_rec;

/* The tail sits right after the record header, inside the payload checksum, so a scan reads it
 * with the header. kvd_disk_payload_off: where rec's payload starts in a slot buffer (4096 in a
 * format 2 file; 64, or 80 with a tail, in a format 1 file). */
#define KVD_DISK_TAIL 16u
uint64_t kvd_disk_payload_off(const kvd_disk *d, const kvd_disk_rec *rec);

/* Opens (or creates) file `name` in directory dir (created 0700 with its parents if missing;
 * an existing directory is used as it is) for key. flags: KVD_DISK_DIRECT tries O_DIRECT first
 * (falls back to buffered I/O where the file system refuses it; kvd_disk_direct tells);
 * KVD_DISK_FORMAT1 / FORMAT2 choose a new file's format (else as above). An existing file keeps
 * its format. A file that
 * exists with a bad or foreign header is renamed aside and replaced (log line KVD-TIER2-FILE).
 * KV_ESYS (errno's text in msg) when the directory or file cannot be made or opened, KV_EINVAL for
 * a bad key or name (containing '/'). msg (msglen bytes, may be NULL) gets a sentence on error. */
kv_err kvd_disk_open(const char *dir, const char *name, const kvd_disk_key *key, unsigned flags,
                     kvd_disk **out, char *msg, size_t msglen);

/* Closes the file (nothing in flight). Accepts NULL. */
void kvd_disk_close(kvd_disk *d);

/* Bytes of one slot, and the most payload bytes a record without a tail may have (slot_bytes
 * less 4096 in format 2, less 64 in format 1). kvd_disk_fits: 1 when a record of len payload
 * bytes, with a tail or not, fits a slot (format 1's tail takes payload room). */
uint64_t kvd_disk_slot_bytes(const kvd_disk *d);
uint64_t kvd_disk_payload_max(const kvd_disk *d);
int kvd_disk_fits(const kvd_disk *d, uint64_t len, int has_tail);

/* The file's format (1 or 2). */
unsigned kvd_disk_format(const kvd_disk *d);

/* Preallocation: from now on, a write that needs the file to grow first grows it by a step
 * (step_bytes rounded down to whole slots, at least one) with fallocate, up to max_bytes of
 * file (0: off, the default), so the writes that fill new slots do not extend the file one by
 * one (an extending write is serialized by the file system's inode lock). The file so holds at
 * most one step more than its written slots. The slots so made read as empty (kvd_disk_slots
 * counts them; a scan skips them). A refusal (log line KVD-TIER2-FILE, once) is tried again a
 * step later. Any thread. */
void kvd_disk_preallocate(kvd_disk *d, uint64_t max_bytes, uint64_t step_bytes);

/* 1 when the file is open with O_DIRECT. */
int kvd_disk_direct(const kvd_disk *d);

/* Slots the file holds now (its size past the header / slot_bytes, a partial last slot not
 * counted). */
uint64_t kvd_disk_slots(const kvd_disk *d);

/* Reads every slot's header in slot order and calls fn for each valid record (magic and header
 * checksum good, format known, len within the slot). *bad (may be NULL) gets the slots that hold
 * something but failed a check (zeroed slots are empty, not bad). KV_ESYS on a read error. The
 * payload checksum is not read here (that would read the whole file); kvd_disk_read checks it. */
typedef void (*kvd_disk_scan_fn)(void *arg, uint64_t slot, const kvd_disk_rec *rec);
kv_err kvd_disk_scan(kvd_disk *d, kvd_disk_scan_fn fn, void *arg, uint64_t *bad);

/* Writes record rec with payload[0..rec->len) into slot (any slot number; the file grows).
 * buf: caller scratch of kvd_disk_slot_bytes(d) bytes aligned to KVD_DISK_ALIGN (O_DIRECT needs
 * it); payload may point into buf at kvd_disk_payload_off(d, rec) to save a copy. KV_EINVAL for
 * a record that does not fit (kvd_disk_fits); KV_ESYS (ENOSPC, EIO...) with errno kept in
 * *sys_errno (may be NULL). Any thread. */
kv_err kvd_disk_write(kvd_disk *d, uint64_t slot, const kvd_disk_rec *rec, const void *payload,
                      uint8_t *buf, int *sys_errno);

/* Reads slot into buf (kvd_disk_slot_bytes(d) bytes, KVD_DISK_ALIGN-aligned) and checks it: the
 * header's magic and checksum, its hash equal to *expect (when not NULL), and the payload's
 * checksum. On success *rec gets the header (and tail) and the payload is at buf +
 * kvd_disk_payload_off(d, rec).
 * KV_ECORRUPT for any failed check or a short read (a slot past the end), KV_ESYS for an I/O
 * error. Any thread. */
kv_err kvd_disk_read(kvd_disk *d, uint64_t slot, const kv_hash128 *expect, kvd_disk_rec *rec,
                     uint8_t *buf);

/* The streamed forms of write and read (raw blocks, the copy threads' path): the payload moves in
 * chunks of KVD_DISK_CHUNK bytes through this thread's io_uring (liburing), so the disk works on
 * one chunk while the caller produces or consumes the next, and the payload checksum is computed
 * on the way. The record's first 4096 bytes (its header, whose checksum needs the whole payload)
 * go with the last chunks: as with one pwrite, a slot cut off midway fails its payload checksum
 * and is never read back as good. Where io_uring is unavailable (an old kernel, io_uring_disabled,
 * or KVD_TIER2_URING=off in the environment) or refuses a transfer, both fall back to the
 * whole-slot write and read above, with the same results.
 *
 * write_stream: fill(arg, dst, off, n) writes payload bytes [off, off + n) at dst (called in
 * payload order; its error is returned as it is, with *fill_failed set, and nothing is written
 * after it). rec->len is the payload length. Otherwise as kvd_disk_write.
 * read_stream: reads slot and hands the payload to sink(arg, src, off, n) in payload order as it
 * arrives, then checks the payload checksum: on KV_ECORRUPT the bytes already handed over are
 * garbage (the caller must not use them). The record header is checked (and *expect) before any
 * byte is handed over. sink's error stops the read and is returned. Otherwise as kvd_disk_read
 * (buf: a slot-sized aligned scratch; the payload is there afterwards too). */
#define KVD_DISK_CHUNK (256u << 10)
typedef kv_err (*kvd_disk_fill_fn)(void *arg, uint8_t *dst, uint64_t off, uint64_t n);
typedef kv_err (*kvd_disk_sink_fn)(void *arg, const uint8_t *src, uint64_t off, uint64_t n);
kv_err kvd_disk_write_stream(kvd_disk *d, uint64_t slot, const kvd_disk_rec *rec,
                             kvd_disk_fill_fn fill, void *arg, uint8_t *buf, int *sys_errno,
                             int *fill_failed);
kv_err kvd_disk_read_stream(kvd_disk *d, uint64_t slot, const kv_hash128 *expect, kvd_disk_rec *rec,
                            uint8_t *buf, kvd_disk_sink_fn sink, void *arg);

/* The zero-copy forms (raw blocks whose bytes lie in one piece of host memory: a host pool's
 * T0 block). write_from writes record rec whose payload is src[0, rec->len): in a format 2 file
 * with io_uring, the payload's whole pages go to the disk straight from src (only the last
 * partial page is copied, into buf), while this thread checksums src; src must not change
 * until it returns. read_into reads slot, whose record must have exactly len payload bytes,
 * with the payload's whole pages straight into dst and the rest through buf, checking the
 * payload checksum as the pieces land. With O_DIRECT on, src / dst must be KVD_DISK_ALIGN-
 * aligned for the direct way. Otherwise (format 1, no io_uring, unaligned memory, a slot too
 * large to stream) both go the streamed or plain way with a copy, with the same results.
 * buf: a slot-sized aligned scratch, as for write and read. read_into: a record of another
 * length is KV_ECORRUPT, and after any error dst[0, len) is garbage. *zero_copy (may be NULL)
 * gets 1 when the transfer succeeded the zero-copy way, else 0. Otherwise as write_stream /
 * read_stream. */
kv_err kvd_disk_write_from(kvd_disk *d, uint64_t slot, const kvd_disk_rec *rec, const uint8_t *src,
                           uint8_t *buf, int *sys_errno, int *zero_copy);
kv_err kvd_disk_read_into(kvd_disk *d, uint64_t slot, const kv_hash128 *expect, kvd_disk_rec *rec,
                          uint8_t *dst, uint64_t len, uint8_t *buf, int *zero_copy);

/* The same for a block in several pieces of host memory (a layer-major block: one piece per
 * layer and K/V), its payload their concatenation in order (the block image a gather makes).
 * The zero-copy way (vectored transfers of whole pieces) needs a format 2 file, io_uring, and
 * every piece a whole number of KVD_DISK_ALIGN pages at an aligned address, at most
 * KVD_DISK_PIECES_MAX pieces; otherwise the copying way, same results. src[i].n summed is
 * rec->len (write) or len (read); else KV_EINVAL. */
#define KVD_DISK_PIECES_MAX 1024u
typedef struct kvd_disk_piece {
    uint8_t *p;
    uint64_t n;
} kvd_disk_piece;
kv_err kvd_disk_write_fromv(kvd_disk *d, uint64_t slot, const kvd_disk_rec *rec,
                            const kvd_disk_piece *src, uint32_t npieces, uint8_t *buf,
                            int *sys_errno, int *zero_copy);
kv_err kvd_disk_read_intov(kvd_disk *d, uint64_t slot, const kv_hash128 *expect, kvd_disk_rec *rec,
                           const kvd_disk_piece *dst, uint32_t npieces, uint64_t len, uint8_t *buf,
                           int *zero_copy);

/* Transfers kvd_disk_write_from / read_into (and the v forms) made the zero-copy way, over the
 * process's life. Any thread. */
uint64_t kvd_disk_direct_transfers(void);

/* 1 when this thread's streamed I/O goes through io_uring (made on its first use). */
int kvd_disk_thread_uring(void);

/* Streamed transfers, over the process's life, that went the plain way instead (no io_uring on
 * the thread, or the ring refused or cut short a transfer). Any thread. */
uint64_t kvd_disk_stream_fallbacks(void);

/* Makes slot empty (zeroes its header on disk) so that a restart does not find it: a block that
 * must never be served again (quarantined) or a slot given back. buf as for write. KV_ESYS.
 * Any thread. */
kv_err kvd_disk_clear(kvd_disk *d, uint64_t slot, uint8_t *buf);

#endif
