/* kv_version: kvd's release version, the one definition (kvd, kvctl, libkvclient, metrics). */
#ifndef KV_VERSION_H
#define KV_VERSION_H

#define KV_VERSION "0.1.0"

#endif
