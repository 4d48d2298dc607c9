/* gpu_map: libkvclient's mapping of GPU segments (CUDA_VMM and CUDA_IPC) into the worker.
 *
 * The driver is loaded on first use (dlopen of libcuda.so.1 through common/kv_cuda.h), so
 * the library runs without CUDA as long as no GPU pool is attached. Mappings are made in the
 * CUDA context current on the calling thread when the first GPU segment of a pool arrives (the
 * engine's own context, as it would be for cudaMalloc); with none current, in the primary
 * context of device $KVC_CUDA_DEVICE (default 0), which the pool retains until detach. Each
 * call makes that context current and restores the caller's afterwards.
 *
 *  - CUDA_VMM: the segment's fd is imported (cuMemImportFromShareableHandle), reserved and
 *    mapped whole (kvc_pool_segment_base and kvc_pool_addr give device addresses), and for
 *    LAYER_MAJOR pools each (layer, K|V) section is also mapped at its offset into one reserved
 *    range per (layer, K|V), so kvc_pool_layer_base hands the engine one device tensor per layer
 *    as for host pools. The allocation handle is released once mapped: the mappings keep the
 *    memory alive. Sections must be multiples of the allocation granularity (the daemon picks
 *    blocks_per_segment so); where they are not, layer tensors are off and kvc_pool_addr works.
 *  - CUDA_IPC: each handle is opened once per pool (cuIpcOpenMemHandle, lazy peer access) and
 *    closed at detach, before the pool forgets it. IPC memory cannot be mapped at offsets, so
 *    layer tensors are not available (kvc_pool_layer_base returns NULL): engines index per
 *    segment through kvc_pool_segment_base / kvc_pool_addr.
 * read_only is not enforced for GPU memory (whoever holds the handle may map it writable).
 * This module works on the pool record of client/map.h and is reached only through the table
 * below (kvc_pool.gpu_ops, installed where pools are made), so map.c never calls it by name.
 * Threads: the pool's (see kvclient.h).
 */
#ifndef KVC_GPU_MAP_H
#define KVC_GPU_MAP_H

#include "client/map.h"

/* The GPU segment mapper, to install as kvc_pool.gpu_ops:
 *  - map_segment: maps one CUDA_VMM or CUDA_IPC segment of a reply into the pool. The first GPU
 *    segment turns the pool into a GPU pool (its host layer reservations are given back); a
 *    pool never mixes kinds (KV_EPROTO). With device_uuid, the device the mappings are made on
 *    must be that GPU (KV_ENOGPU otherwise). KV_ENOGPU when the driver or a context cannot be
 *    had, KV_EPROTO for a bad segment, KV_ESYS for a driver error; the pool's last error says
 *    which.
 *  - unmap: unmaps every GPU mapping of the pool (closes IPC handles, frees reserved ranges,
 *    releases a retained primary context) and leaves its segment bases and layer_base NULL.
 *    No-op for host pools.
 *  - device: the CUDA device ordinal the pool's mappings live on (a GPU pool). */
extern const kvc__gpu_ops kvc__gpu_mapper;

#endif
