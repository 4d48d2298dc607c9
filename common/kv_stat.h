/* kv_stat: a statistic's descriptor. Each list of statistics (a pool's counters, the daemon's,
 * a tenant's) is ONE table of these where its values are produced; the admin JSON, the Stats RPC,
 * the Prometheus exposition and the docs (docs/ADMIN.md's stats section, PROTOCOL.md's Stats
 * names, checked by tests) are all generated from or checked against the tables, so a name
 * cannot exist in one place and be missing in another. */
#ifndef KV_STAT_H
#define KV_STAT_H

typedef struct kv_stat_desc {
    const char *name;        /* the field: admin JSON key, Stats name (after a section prefix) */
    const char *type;        /* "gauge" or "counter" (the Prometheus TYPE) */
    const char *unit;        /* what it counts: "blocks", "bytes", "requests", "sessions", ... */
    const char *help;        /* one line for the docs */
    const char *family;      /* Prometheus family it is exported in; NULL: not exported */
    const char *family_help; /* the family's HELP line (its first row only), else NULL */
    const char *label;       /* the family's extra label ("state"), or NULL */
    const char *label_value; /* this row's value of it ("free") */
} kv_stat_desc;

#endif
