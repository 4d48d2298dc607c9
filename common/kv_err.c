/* kv_err: strings for the shared error codes, generated from KV_ERR_MAP. */
#include "common/kv_err.h"

const char *kv_strerror(int err) {
    switch (err) {
#define KV_ERR_STR(name, num, msg)                                                                 \
    case num:                                                                                      \
        return msg;
        KV_ERR_MAP(KV_ERR_STR)
#undef KV_ERR_STR
    }
    return "unknown error";
}

const char *kv_err_name(int err) {
    switch (err) {
#define KV_ERR_NAME(name, num, msg)                                                                \
    case num:                                                                                      \
        return #name;
        KV_ERR_MAP(KV_ERR_NAME)
#undef KV_ERR_NAME
    }
    return "UNKNOWN";
}
