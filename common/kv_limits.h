/* kv_limits: the wire protocol's fixed limits (PROTOCOL.md §11), one definition for the daemon
 * and the client; no dependencies, so any layer may include it. */
#ifndef KV_LIMITS_H
#define KV_LIMITS_H

#define KV_WIRE_MAX_MODEL_ID 128              /* bytes of AttachPool.model_id */
#define KV_WIRE_MAX_CLIENT_NAME 64            /* bytes of Hello.client_name */
#define KV_WIRE_MAX_TOKEN 256                 /* bytes of Hello.token */
#define KV_WIRE_MAX_RETENTION_MS 604800000ull /* Pin.retention_ms: 7 days */
#define KV_WIRE_MAX_FDS 200                   /* fds (segments and parts) in one reply */
#define KV_WIRE_PING_SLACK 64                 /* a Pong may exceed max_frame by the envelope */

#endif
