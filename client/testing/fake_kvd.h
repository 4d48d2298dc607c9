/* fake_kvd: a small in-process stand-in for kvd, for libkvclient's unit tests.
 *
 * It speaks the real framing and fd passing (PROTOCOL.md) on a Unix socket in a temp dir and
 * serves one connection at a time on its own thread: Hello, AttachPool (memfd segments),
 * MapSegments, Lookup, Allocate (grows by a segment when out of blocks, announcing it with
 * new_segments_from), Commit (with duplicate detection), Release, Rewind, Stats, Ping. It keeps
 * only what the tests check; the real daemon is tested in tests/integration.
 */
#ifndef FAKE_KVD_H
#define FAKE_KVD_H

#include <stdint.h>

typedef struct fake_kvd fake_kvd;

typedef struct fake_kvd_config {
    uint32_t blocks_per_segment; /* blocks in each segment */
    uint32_t initial_segments;   /* segments made at attach */
    uint32_t max_segments;       /* growth limit */
    uint32_t max_blocks;         /* max_blocks_per_request announced */
    uint64_t epoch;              /* boot epoch */
    uint32_t hide_from;          /* > 0: a lying daemon that never sends or announces segments
                                    >= this (tests of libkvclient's segment guards) */
} fake_kvd_config;

/* Starts the server thread; *out gets it. Returns 0 or -1. */
int fake_kvd_start(const fake_kvd_config *cfg, fake_kvd **out);

/* The socket path clients connect to. */
const char *fake_kvd_path(const fake_kvd *f);

/* Stops the thread, closes every socket and frees all state; accepts NULL. */
void fake_kvd_stop(fake_kvd *f);

/* Stops and starts again on the same path with a new epoch (pools and blocks forgotten), as a
 * daemon restart does. Returns 0 or -1. */
int fake_kvd_restart(fake_kvd *f, uint64_t epoch);

/* Counters the tests read after a call returned (the reply was sent after they changed). */
uint32_t fake_kvd_refs(const fake_kvd *f);     /* references held over all blocks */
uint32_t fake_kvd_writing(const fake_kvd *f);  /* blocks in WRITING */
uint32_t fake_kvd_segments(const fake_kvd *f); /* segments made */
uint64_t fake_kvd_requests(const fake_kvd *f); /* requests handled */

#endif
