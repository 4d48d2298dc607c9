/* engine_int: what the example engine's files share (not part of engine.h's API): the request,
 * row and span records, the engine itself, the scheduler's lists, and the functions one file
 * gives the others. engine.c holds the scheduler and the forward pass, engine_zip.c Zipage's
 * compression (docs/ZIPAGE.md), engine_ice.c IceCache's offload, selection and fetch
 * (docs/ICECACHE.md). Thread: the engine's thread, except kve__zip_main (the compression
 * thread; engine_zip.c says what it touches).
 */
#ifndef KVE_ENGINE_INT_H
#define KVE_ENGINE_INT_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "examples/engine/engine.h"
#include "examples/engine/gemm.h"
#include "kernels/kvk.h"
#include "kvclient.h"

typedef struct req_state {
    kve_request *r;  /* the caller's request */
    uint32_t *toks;  /* prompt then generated tokens */
    size_t ntoks;    /* tokens in toks */
    size_t done;     /* tokens whose K/V are written in seq's blocks */
    kvc_seq *seq;    /* its blocks while running */
    int phase;       /* PH_* */
    int admitted;    /* admitted at least once (cached_tokens recorded) */
    double arrive;   /* absolute arrival, ms on the engine clock */
    uint64_t order;  /* admission order; the largest running one is preempted first */
    size_t reserved; /* static batching: blocks reserved */
    /* Work of the current step: */
    size_t nrows;       /* rows planned from toks[done] on */
    int spec;           /* speculating this step */
    size_t kdraft;      /* draft tokens proposed this step */
    uint32_t draft[65]; /* d_0..d_k of this step */
    /* Zipage: */
    size_t dropped;    /* tokens compressions removed: slot = position - dropped */
    int zstate;        /* Z_* */
    float *qring;      /* [zip_queries][layers][heads * head_dim] queries by position % nq */
    size_t qvalid;     /* contiguous latest positions whose queries are in the ring */
    size_t qlast;      /* position of the newest query in the ring */
    uint32_t *slotpos; /* [cap] position of each slot */
    float *gscore;     /* [cap] carried global score per slot */
    size_t cap;        /* slots slotpos and gscore hold */
    size_t zbase;      /* slots [0, zbase) have their positions in slotpos (the rest: + dropped) */
    kvc_block *fresh;  /* a compression's private blocks */
    size_t nfresh;
    uint32_t *kept;  /* [keep] the slots a compression keeps */
    float *gout;     /* [keep] their final scores */
    int32_t *zpages; /* the table when the job was submitted */
    size_t zslots;   /* slots when the job was submitted */
    uint8_t *swap;   /* preempted compressed sequence: its blocks' bytes */
    size_t swap_blocks;
    size_t swap_slots;
    uint64_t swapped_at; /* steps + 1 at the swap-out (0: none) */
    /* IceCache: */
    int ice_on;           /* its middle was offloaded: the table holds sinks and window only */
    size_t ice_n;         /* offloaded pages */
    size_t ice_cap;       /* room of ice_hash and ice_summ */
    kv_hash128 *ice_hash; /* [ice_n] the offloaded pages' hashes */
    float *ice_summ;      /* [ice_n] their summaries (kvc_summaries) */
    uint32_t ice_serial;  /* pages offloaded so far (their hashes' counter) */
} req_state;

enum { Z_NONE = 0, Z_PENDING = 1, Z_JOB = 2 };

enum { PH_FUTURE = 0, PH_WAITING = 1, PH_RUNNING = 2, PH_DONE = 3 };

/* One token row of a forward pass. */
typedef struct row {
    req_state *rs; /* owner */
    uint32_t pos;  /* position (RoPE) */
    uint32_t slot; /* K/V slot in rs->seq: pos, less what Zipage dropped */
    uint32_t tok;  /* input token */
    float *logits; /* where to put logits, or NULL */
} row;

struct kve_engine {
    const kve_model *m;  /* borrowed weights */
    kve_options o;       /* options (strings borrowed) */
    kvc_conn *conn;      /* connection to kvd */
    kvc_pool *pool;      /* the model's pool */
    kve_gemm *gemm;      /* matmul threads (o.threads in all) */
    kv_layout layout;    /* pool layout */
    uint32_t tpb;        /* tokens per block */
    float *kscale;       /* 8-bit pools: [layers][kv_heads] K scales */
    float *vscale;       /* same for V */
    kve_stats st;        /* counters */
    double t0;           /* engine clock origin (ms) */
    char model_id[64];   /* pool model id */
    char err[256];       /* last error */
    uint64_t next_order; /* admission counter */
    /* Zipage's compression thread: one job (a batch of sequences) at a time. */
    int zthread_on;       /* the thread runs */
    pthread_t zthread;    /* it */
    pthread_mutex_t zmu;  /* guards the fields below */
    pthread_cond_t zcv;   /* signalled on a new job, a finished job and stop */
    req_state **zjob;     /* the job's sequences (NULL: none) */
    size_t nzjob;         /* their count */
    int zjob_done;        /* the thread finished the job */
    kv_err zjob_rc;       /* its result */
    int zstop;            /* the thread must end */
    kvk_cache zcache[64]; /* per layer: the cache view compression reads and writes */
    uint32_t zlayer[64];  /* and the layer argument to pass with it */
    char zerr[160];       /* the job's error */
    uint64_t nonce;       /* IceCache: makes this engine's page hashes its own */
    size_t zkeep;         /* tokens a compression keeps (zip_keep or its default) */
    size_t zwindow;       /* last tokens always kept (zip_window or zip_queries) */
};

typedef struct span {
    const kvc_seq *seq; /* whose blocks */
    uint32_t p0, p1;    /* page range */
    int32_t last;       /* tokens in page p1 - 1 */
    const int32_t *ins; /* IceCache: fetched pages (block ids) to attend to before page ins_at */
    uint32_t nins;      /* their count */
    uint32_t ins_at;    /* a page index in [p0, p1) */
} span;

typedef struct sched {
    req_state *rs;    /* all requests */
    size_t n;         /* count */
    req_state **run;  /* running, in admission order */
    size_t nrun;      /* running count */
    req_state **wait; /* waiting, front first */
    size_t nwait;     /* waiting count */
} sched;

typedef struct ice_row {
    kvc_block *held; /* pages fetched for the row in this pass (released at its end) */
    size_t nheld, cap;
    int32_t *ins; /* the current layer group's pages, block ids */
    uint32_t nins;
} ice_row;

/* ---- engine.c ---- */
double kve__now_ms(void);
/* Records the engine's error message and returns err. */
kv_err kve__fail(kve_engine *e, kv_err err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
int kve__is_8bit(kv_dtype d);
/* The kvk descriptor of layer l and the layer index to pass with it. */
kv_err kve__layer_cache(kve_engine *e, uint32_t l, kvk_cache *c, uint32_t *layer_arg);
size_t kve__blocks_for(const kve_engine *e, size_t tokens);
/* The dequantized key of KV head `head` at offset `off` of block `blk` in cache view kc (layer
 * argument la, as kve__layer_cache gives them): head_dim floats into out. */
void kve__load_key(const kvk_cache *kc, uint32_t la, uint32_t blk, uint32_t off, uint32_t head,
                   float *out);
/* Blocks the running requests hold (a compression's fresh blocks included). */
size_t kve__held_blocks(const kve_engine *e, const sched *s);
/* Preempts the newest running request not in a compression job; KV_EBUSY when none. */
kv_err kve__preempt_newest(kve_engine *e, sched *s, req_state **victim);

/* ---- engine_zip.c (Zipage) ---- */
size_t kve__zcap(const kve_engine *e);
kv_err kve__zip_init(kve_engine *e, req_state *rs);
/* Frees a request's Zipage and IceCache state. */
void kve__zip_fini(req_state *rs);
/* Records the positions of slots appended since the last compaction. */
void kve__zip_note_slots(req_state *rs, size_t n);
/* The compression thread. */
void *kve__zip_main(void *arg);
/* Finishes the job in flight when done (wait: waits for it). */
kv_err kve__zip_poll(kve_engine *e, int wait);
/* Starts a job for the pending sequences. */
kv_err kve__zip_submit(kve_engine *e, sched *s);
/* A preempted compressed sequence: its blocks to engine memory, and back. */
kv_err kve__zip_swap_out(kve_engine *e, req_state *rs);
kv_err kve__zip_swap_in(kve_engine *e, sched *s, req_state *rs);

/* ---- engine_ice.c (IceCache) ---- */
/* Selects and fetches the pages of a decode row for one layer (group). */
kv_err kve__ice_select_fetch(kve_engine *e, req_state *rs, uint32_t layer, const float *q,
                             ice_row *ir);
/* After a step: offloads what left the resident pages of each decoding IceCache sequence. */
kv_err kve__ice_maintain(kve_engine *e, sched *s);

#endif
