/* make_seeds: writes the fuzz seed corpus. The messages are the ones the unit tests
 * (daemon/validate_test, daemon/server_test) and integration tests (tests/integration) send,
 * good and bad, so the fuzzers start from every request kind and every refusal path. Output:
 * DIR/wire/ (framed envelopes; one file per message plus whole sessions as one stream) and
 * DIR/validate/ (one parameter byte + one envelope body). Usage: make_seeds DIR. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_wire.h"

static const char *outdir;

static void write_file(const char *sub, const char *name, const uint8_t *p, size_t n) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s/%s", outdir, sub, name);
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(p, 1, n, f) != n || fclose(f) != 0) {
        fprintf(stderr, "make_seeds: cannot write %s\n", path);
        exit(1);
    }
}

static uint8_t stream[1 << 16];
static size_t stream_len;

/* Writes env as wire/<name> (framed), validate/<name> (bare, default limit, and a limit of 2),
 * and appends the frame to the session stream. */
static void seed(const char *name, Kvd__Envelope *env) {
    uint8_t *buf;
    size_t len;
    if (kv_wire_encode(env, 1u << 20, &buf, &len) != KV_OK) {
        fprintf(stderr, "make_seeds: encode %s\n", name);
        exit(1);
    }
    write_file("wire", name, buf, len);
    uint8_t *v = malloc(len);
    v[0] = 0x80;
    memcpy(v + 1, buf + KV_WIRE_HEADER_BYTES, len - KV_WIRE_HEADER_BYTES);
    write_file("validate", name, v, len - KV_WIRE_HEADER_BYTES + 1);
    char lim[256];
    snprintf(lim, sizeof(lim), "%s-limit2", name);
    v[0] = 0x01;
    write_file("validate", lim, v, len - KV_WIRE_HEADER_BYTES + 1);
    free(v);
    if (stream_len + len <= sizeof(stream)) {
        memcpy(stream + stream_len, buf, len);
        stream_len += len;
    }
    free(buf);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: make_seeds DIR\n");
        return 2;
    }
    outdir = argv[1];
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    env.id = 1;

    Kvd__Hello hello = KVD__HELLO__INIT;
    hello.protocol_version = 1;
    hello.client_name = "worker-1";
    env.body_case = KVD__ENVELOPE__BODY_HELLO;
    env.hello = &hello;
    seed("hello", &env);
    hello.protocol_version = 0;
    seed("hello-badversion", &env);
    hello.protocol_version = 1;
    uint8_t tok[3] = {1, 2, 3};
    hello.token.data = tok;
    hello.token.len = sizeof(tok);
    seed("hello-token", &env);
    hello.token.len = 0;

    Kvd__Layout lay = KVD__LAYOUT__INIT;
    lay.num_layers = 2;
    lay.num_kv_heads = 2;
    lay.head_dim = 64;
    lay.tokens_per_block = 16;
    lay.dtype = KVD__DTYPE__FP16;
    lay.arrangement = KVD__ARRANGEMENT__LAYER_MAJOR;
    Kvd__AttachPool att = KVD__ATTACH_POOL__INIT;
    att.model_id = "it-model";
    att.layout = &lay;
    env.id = 2;
    env.body_case = KVD__ENVELOPE__BODY_ATTACH_POOL;
    env.attach_pool = &att;
    seed("attach", &env);
    Kvd__Layout big = lay;
    big.num_layers = 4;
    big.num_kv_heads = 8;
    big.head_dim = 128;
    big.dtype = KVD__DTYPE__INT8;
    big.arrangement = KVD__ARRANGEMENT__BLOCK_MAJOR;
    att.layout = &big;
    seed("attach-int8-blockmajor", &env);
    big.dtype = 77;
    seed("attach-baddtype", &env);
    att.layout = NULL;
    seed("attach-nolayout", &env);
    att.layout = &lay;

    Kvd__Allocate alloc = KVD__ALLOCATE__INIT;
    alloc.pool_id = 1;
    alloc.count = 4;
    env.id = 3;
    env.body_case = KVD__ENVELOPE__BODY_ALLOCATE;
    env.allocate = &alloc;
    seed("allocate", &env);
    alloc.count = 0;
    seed("allocate-zero", &env);
    alloc.count = 4;

    Kvd__BlockRef refs[3] = {KVD__BLOCK_REF__INIT, KVD__BLOCK_REF__INIT, KVD__BLOCK_REF__INIT};
    Kvd__BlockRef *refp[3];
    Kvd__Hash128 hashes[3] = {KVD__HASH128__INIT, KVD__HASH128__INIT, KVD__HASH128__INIT};
    Kvd__Hash128 *hashp[3];
    Kvd__CommitEntry ents[3] = {KVD__COMMIT_ENTRY__INIT, KVD__COMMIT_ENTRY__INIT,
                                KVD__COMMIT_ENTRY__INIT};
    Kvd__CommitEntry *entp[3];
    for (int i = 0; i < 3; i++) {
        refs[i].id = (uint32_t)i;
        refs[i].gen = 1;
        refp[i] = &refs[i];
        hashes[i].lo = 0x0123456789abcdefull * (uint64_t)(i + 1);
        hashes[i].hi = 0xfedcba9876543210ull ^ (uint64_t)i;
        hashp[i] = &hashes[i];
        ents[i].block = &refs[i];
        ents[i].hash = &hashes[i];
        ents[i].parent = i == 0 ? 0xFFFFFFFFu : (uint32_t)(i - 1);
        entp[i] = &ents[i];
    }
    Kvd__Commit com = KVD__COMMIT__INIT;
    com.pool_id = 1;
    com.n_entries = 3;
    com.entries = entp;
    env.id = 4;
    env.body_case = KVD__ENVELOPE__BODY_COMMIT;
    env.commit = &com;
    seed("commit", &env);
    ents[1].hash = NULL;
    seed("commit-nohash", &env);
    ents[1].hash = &hashes[1];
    /* The packed form (PROTOCOL.md 6): 3 records with their digests and token ids (the
     * validate fuzzer takes id % 64 + 1 = 5 tokens a block for id 4), a parent digest; and one
     * cut a byte short. */
    uint8_t pent[3 * KV_WIRE_COMMIT_BYTES], pfull[3 * 32], ptok[3 * 5 * 4];
    for (int i = 0; i < 3; i++) {
        kv_wire_commit w = {refs[i].id, refs[i].gen, hashes[i].lo, hashes[i].hi, ents[i].parent};
        kv_wire_commit_put(pent, (size_t)i, &w);
    }
    memset(pfull, 0x11, sizeof(pfull));
    for (int i = 0; i < 15; i++) {
        kv_wire_put_le32(ptok + 4 * i, 1000u + (uint32_t)i * 40000u);
    }
    Kvd__Commit pcom = KVD__COMMIT__INIT;
    pcom.pool_id = 1;
    pcom.entries_packed.data = pent;
    pcom.entries_packed.len = sizeof(pent);
    pcom.hash_full_packed.data = pfull;
    pcom.hash_full_packed.len = sizeof(pfull);
    pcom.token_ids_packed.data = ptok;
    pcom.token_ids_packed.len = sizeof(ptok);
    pcom.parent_hash_full.data = pfull;
    pcom.parent_hash_full.len = 32;
    env.commit = &pcom;
    seed("commit-packed", &env);
    pcom.entries_packed.len = sizeof(pent) - 1;
    seed("commit-packed-cut", &env);
    env.commit = &com;

    Kvd__Lookup look = KVD__LOOKUP__INIT;
    look.pool_id = 1;
    look.n_hashes = 3;
    look.hashes = hashp;
    env.id = 5;
    env.body_case = KVD__ENVELOPE__BODY_LOOKUP;
    env.lookup = &look;
    seed("lookup", &env);
    look.search_domains = 1;
    seed("lookup-domains", &env);

    Kvd__Release rel = KVD__RELEASE__INIT;
    rel.pool_id = 1;
    rel.n_blocks = 3;
    rel.blocks = refp;
    env.id = 6;
    env.body_case = KVD__ENVELOPE__BODY_RELEASE;
    env.release = &rel;
    seed("release", &env);

    Kvd__Rewind rew = KVD__REWIND__INIT;
    rew.pool_id = 1;
    rew.n_blocks = 2;
    rew.blocks = refp + 1;
    env.id = 7;
    env.body_case = KVD__ENVELOPE__BODY_REWIND;
    env.rewind = &rew;
    seed("rewind", &env);

    Kvd__Pin pin = KVD__PIN__INIT;
    pin.pool_id = 1;
    pin.n_blocks = 2;
    pin.blocks = refp;
    pin.retention_ms = 1000;
    pin.priority = 5;
    env.id = 8;
    env.body_case = KVD__ENVELOPE__BODY_PIN;
    env.pin = &pin;
    seed("pin", &env);
    pin.priority = 300;
    seed("pin-badpriority", &env);
    pin.priority = 5;
    pin.retention_ms = 604800001ull;
    seed("pin-longretention", &env);
    pin.unpin = 1;
    seed("unpin", &env);

    Kvd__Stats st = KVD__STATS__INIT;
    st.pool_id = 1;
    env.id = 9;
    env.body_case = KVD__ENVELOPE__BODY_STATS;
    env.stats = &st;
    seed("stats", &env);

    Kvd__MapSegments ms = KVD__MAP_SEGMENTS__INIT;
    ms.pool_id = 1;
    ms.first_index = 1;
    env.id = 10;
    env.body_case = KVD__ENVELOPE__BODY_MAP_SEGMENTS;
    env.map_segments = &ms;
    seed("mapsegments", &env);

    Kvd__Ping ping = KVD__PING__INIT;
    uint8_t payload[64];
    memset(payload, 'p', sizeof(payload));
    ping.nonce = 42;
    ping.payload.data = payload;
    ping.payload.len = sizeof(payload);
    env.id = 11;
    env.boot_epoch = 0x1122334455667788ull;
    env.body_case = KVD__ENVELOPE__BODY_PING;
    env.ping = &ping;
    seed("ping-epoch", &env);
    env.boot_epoch = 0;

    Kvd__Error err = KVD__ERROR__INIT;
    err.code = KVD__ERROR_CODE__EPROTO;
    err.message = "reply sent as request";
    env.id = 12;
    env.body_case = KVD__ENVELOPE__BODY_ERROR;
    env.error = &err;
    seed("error-as-request", &env);

    Kvd__Goodbye bye = KVD__GOODBYE__INIT;
    env.id = 13;
    env.body_case = KVD__ENVELOPE__BODY_GOODBYE;
    env.goodbye = &bye;
    seed("goodbye", &env);

    write_file("wire", "session-stream", stream, stream_len);
    /* Raw frames the integration tests send: a length past max_frame, a body with no oneof,
     * garbage that does not decode, and a frame cut short. */
    const uint8_t toobig[] = {0xff, 0xff, 0xff, 0x7f, 0x08, 0x01};
    write_file("wire", "raw-toobig", toobig, sizeof(toobig));
    const uint8_t nobody[] = {0x02, 0x00, 0x00, 0x00, 0x08, 0x07};
    write_file("wire", "raw-nobody", nobody, sizeof(nobody));
    const uint8_t garbage[] = {0x05, 0x00, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff, 0xff};
    write_file("wire", "raw-garbage", garbage, sizeof(garbage));
    write_file("wire", "raw-cut", stream, stream_len > 9 ? 9 : stream_len);
    return 0;
}
