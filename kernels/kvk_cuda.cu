// kvk_cuda: CUDA implementations of the KV kernels behind kernels/kvk.h, plus the small device
// memory and timing helpers the tests and benchmarks use from C.
//
// Each kernel mirrors its CPU twin (kvk_cache.c, kvk_attn.c, kvk_quant.c) and shares its element
// conversions (kvk_dtype.h), so copies, cache writes and (de)quantization match the twin bit for
// bit; attention differs only in float summation order, which is fixed (no atomics), so repeated
// runs on equal inputs and the same device give bitwise-equal outputs. Index arrays live on the
// device and cannot be checked on the host, so kernels skip out-of-range ids rather than touch
// memory outside the caller's cache. Decode attention: one CTA per (request, KV head, split)
// handles the whole GQA group so K and V are read once per group; each token's head row is read
// by L lanes with 16-byte loads (8-byte for 8-bit dtypes); scores use an online softmax in base
// 2; long sequences are split over several CTAs (split-K) whose states are merged by log-sum-exp
// in split order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>

#include "kernels/kvk_dtype.h"
#include "kernels/kvk_internal.h"

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Maps a runtime failure to kv_err: no device or driver is KV_ENOGPU, the rest KV_EINTERNAL.
kv_err cuda_fail(cudaError_t e, const char *op) {
    kv_err code = KV_EINTERNAL;
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver ||
        e == cudaErrorInitializationError) {
        code = KV_ENOGPU;
    } else if (e == cudaErrorMemoryAllocation) {
        code = KV_ENOMEM;
    }
    return kvk__fail(code, "%s: %s", op, cudaGetErrorString(e));
}

// Before a launch: an error an earlier call left pending (cudaGetLastError would report it
// after our launch and blame it) is reported as what it is, and cleared, without launching.
kv_err pre_launch(const char *op) {
    cudaError_t e = cudaPeekAtLastError();
    if (e == cudaSuccess) {
        return KV_OK;
    }
    (void)cudaGetLastError();
    kv_err code = cuda_fail(e, op);
    return kvk__fail(code, "%s: not launched: an earlier CUDA call had failed: %s", op,
                     cudaGetErrorString(e));
}

// After a launch: only this launch's error can be pending now (pre_launch cleared the rest).
kv_err launched(const char *op) {
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? KV_OK : cuda_fail(e, op);
}

// Streaming multiprocessors of the current device, asked once per device (the attribute query
// is a driver call; the decode launcher needs it on every call).
kv_err device_sms(int *out) {
    static int cached[64];
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) {
        return cuda_fail(e, "cudaGetDevice");
    }
    if (dev >= 0 && dev < 64 && cached[dev] > 0) {
        *out = cached[dev];
        return KV_OK;
    }
    int sms = 0;
    e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (e != cudaSuccess) {
        return cuda_fail(e, "cudaDeviceGetAttribute");
    }
    if (dev >= 0 && dev < 64) {
        cached[dev] = sms; // the same value from every thread: a benign race
    }
    *out = sms;
    return KV_OK;
}

cudaStream_t as_stream(void *s) {
    return static_cast<cudaStream_t>(s);
}

// Scales are read and written as floats: an 8-bit cache's scales and scale strides must be
// 4-byte aligned (a misaligned access would kill the caller's context). True for other dtypes.
bool scales_aligned(const kvk_cache *c) {
    return !kvk__is_scaled(c->dtype) ||
           ((c->scales | (uintptr_t)c->scale_block_stride | (uintptr_t)c->scale_section_stride) &
            3u) == 0;
}

// ---- copy_blocks -------------------------------------------------------------------------------

struct CopyParams {
    const char *src;        // src data, (block 0, section 0)
    char *dst;              // dst data
    int64_t src_bs, src_ss; // src block and section strides
    int64_t dst_bs, dst_ss; // dst block and section strides
    const char *src_sc;     // src scales or null
    char *dst_sc;           // dst scales or null
    int64_t src_sbs, src_sss;
    int64_t dst_sbs, dst_sss;
    uint32_t src_nb, dst_nb; // block counts, for range checks
    uint64_t chunk;          // bytes of one (block, section)
    uint32_t heads;          // scales per (block, section)
    const int32_t *sb;       // device src block ids
    const int32_t *db;       // device dst block ids
};

// grid (pairs, sections): each CTA copies one contiguous chunk, 16 bytes per thread per step
// with four loads in flight, or bytewise when an address or the length is not 16-aligned.
__global__ void __launch_bounds__(256) copy_blocks_kernel(CopyParams p) {
    const int32_t sblk = p.sb[blockIdx.x];
    const int32_t dblk = p.db[blockIdx.x];
    if (sblk < 0 || (uint32_t)sblk >= p.src_nb || dblk < 0 || (uint32_t)dblk >= p.dst_nb) {
        return;
    }
    const int64_t sec = blockIdx.y;
    const char *from = p.src + sblk * p.src_bs + sec * p.src_ss;
    char *to = p.dst + dblk * p.dst_bs + sec * p.dst_ss;
    if ((((uintptr_t)from | (uintptr_t)to | p.chunk) & 15u) == 0) {
        const uint4 *f = reinterpret_cast<const uint4 *>(from);
        uint4 *t = reinterpret_cast<uint4 *>(to);
        const uint64_t n = p.chunk / 16;
        const uint64_t stride = blockDim.x;
        uint64_t i = threadIdx.x;
        for (; i + 3 * stride < n; i += 4 * stride) {
            uint4 a = f[i], b = f[i + stride], c = f[i + 2 * stride], d = f[i + 3 * stride];
            t[i] = a;
            t[i + stride] = b;
            t[i + 2 * stride] = c;
            t[i + 3 * stride] = d;
        }
        for (; i < n; i += stride) {
            t[i] = f[i];
        }
    } else {
        for (uint64_t i = threadIdx.x; i < p.chunk; i += blockDim.x) {
            to[i] = from[i];
        }
    }
    if (p.src_sc != nullptr) {
        const float *sf =
            reinterpret_cast<const float *>(p.src_sc + sblk * p.src_sbs + sec * p.src_sss);
        float *df = reinterpret_cast<float *>(p.dst_sc + dblk * p.dst_sbs + sec * p.dst_sss);
        for (uint32_t h = threadIdx.x; h < p.heads; h += blockDim.x) {
            df[h] = sf[h];
        }
    }
}

// ---- reshape_and_cache -------------------------------------------------------------------------

struct ReshapeParams {
    const char *k, *v;    // new tokens
    int64_t row_stride;   // bytes between tokens' rows
    kv_dtype src_dtype;   // fp16/bf16/fp32
    const float *k_scale; // 8-bit: per-head scales
    const float *v_scale;
    char *data;     // cache data (block 0, section 0)
    int64_t bs, ss; // cache strides
    char *scales;   // cache scales or null
    int64_t sbs, sss;
    kv_dtype dtype;   // cache dtype
    uint32_t section; // layer * 2 (K); V is section + 1
    uint32_t page_size, heads, dim, num_blocks;
    const int64_t *slots;
};

// grid (tokens, 2): one CTA per (token, K|V), threads over the token's heads * dim elements.
__global__ void __launch_bounds__(128) reshape_kernel(ReshapeParams p) {
    const int64_t slot = p.slots[blockIdx.x];
    if (slot < 0 || (uint64_t)slot >= (uint64_t)p.num_blocks * p.page_size) {
        return;
    }
    const int kv = blockIdx.y;
    const int64_t block = slot / p.page_size;
    const int64_t off = slot % p.page_size;
    const uint32_t section = p.section + kv;
    const uint64_t token_elems = (uint64_t)p.heads * p.dim;
    const char *src = (kv == 0 ? p.k : p.v) + (int64_t)blockIdx.x * p.row_stride;
    char *dst = p.data + block * p.bs + (int64_t)section * p.ss +
                off * (int64_t)(token_elems * kvk_elem_bytes(p.dtype));
    const float *scale = kv == 0 ? p.k_scale : p.v_scale;
    const bool scaled = p.scales != nullptr;
    for (uint64_t e = threadIdx.x; e < token_elems; e += blockDim.x) {
        float x = kvk_load_f32(p.src_dtype, src, e);
        kvk_store_f32(p.dtype, dst, e, scaled ? x / scale[e / p.dim] : x);
    }
    if (scaled) {
        float *s = reinterpret_cast<float *>(p.scales + block * p.sbs + (int64_t)section * p.sss);
        for (uint32_t h = threadIdx.x; h < p.heads; h += blockDim.x) {
            s[h] = scale[h];
        }
    }
}

// ---- merge_states ------------------------------------------------------------------------------

struct MergeParams {
    const void *v[KVK_MAX_MERGE_STATES];  // states' outputs [rows][dim]
    const float *s[KVK_MAX_MERGE_STATES]; // states' lse [rows]
    uint32_t num_states;
    kv_dtype in_dtype;  // dtype of v[j]
    kv_dtype out_dtype; // dtype of out
    uint64_t rows;
    uint32_t dim;
    void *out;
    float *s_out;
};

// One thread per output element; each recomputes its row's weights (at most 16 cached loads),
// which keeps the kernel free of shared state and makes out aliasing v[0] safe.
__global__ void __launch_bounds__(256) merge_kernel(MergeParams p) {
    const uint64_t total = p.rows * p.dim;
    for (uint64_t e = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (uint64_t)gridDim.x * blockDim.x) {
        const uint64_t r = e / p.dim;
        float m = -INFINITY;
        for (uint32_t j = 0; j < p.num_states; j++) {
            m = fmaxf(m, p.s[j][r]);
        }
        float sum = 0.0f, acc = 0.0f;
        if (m != -INFINITY) {
            for (uint32_t j = 0; j < p.num_states; j++) {
                const float w = expf(p.s[j][r] - m);
                sum += w;
                acc += w * kvk_load_f32(p.in_dtype, p.v[j], e);
            }
        }
        kvk_store_f32(p.out_dtype, p.out, e, sum > 0.0f ? acc / sum : 0.0f);
        if (p.s_out != nullptr && e % p.dim == 0) {
            p.s_out[r] = m == -INFINITY ? -INFINITY : m + logf(sum);
        }
    }
}

// One thread per row: the merged lse, written after it read every state's lse of that row. The
// merge's own s_out write races with other threads of the row still reading s[j] when s_out
// aliases one of them, so aliased merges write s_out here, after the merge kernel.
__global__ void __launch_bounds__(256) merge_lse_kernel(MergeParams p) {
    for (uint64_t r = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; r < p.rows;
         r += (uint64_t)gridDim.x * blockDim.x) {
        float m = -INFINITY;
        for (uint32_t j = 0; j < p.num_states; j++) {
            m = fmaxf(m, p.s[j][r]);
        }
        float sum = 0.0f;
        for (uint32_t j = 0; m != -INFINITY && j < p.num_states; j++) {
            sum += expf(p.s[j][r] - m);
        }
        p.s_out[r] = m == -INFINITY ? -INFINITY : m + logf(sum);
    }
}

kv_err launch_merge(const MergeParams &p, cudaStream_t stream) {
    const uint64_t total = p.rows * p.dim;
    if (total == 0) {
        return KV_OK;
    }
    kv_err rc = pre_launch("merge_states");
    if (rc != KV_OK) {
        return rc;
    }
    int alias = 0;
    for (uint32_t j = 0; p.s_out != nullptr && j < p.num_states; j++) {
        alias |= p.s[j] == p.s_out;
    }
    MergeParams q = p;
    if (alias) {
        q.s_out = nullptr;
    }
    const uint64_t blocks = (total + 255) / 256;
    merge_kernel<<<(unsigned)(blocks < 65536 ? blocks : 65536), 256, 0, stream>>>(q);
    rc = launched("merge_states");
    if (rc != KV_OK || !alias) {
        return rc;
    }
    const uint64_t rblocks = (p.rows + 255) / 256;
    merge_lse_kernel<<<(unsigned)(rblocks < 65536 ? rblocks : 65536), 256, 0, stream>>>(p);
    return launched("merge_states (lse)");
}

// ---- quantize / dequantize ---------------------------------------------------------------------

struct QuantParams {
    const void *src;
    void *dst;
    float *scales;
    kv_dtype src_dtype, dst_dtype;
    uint32_t tokens, heads, dim;
    float qmax;
};

// One CTA per (group, head): block-wide absmax, then every element divided by the scale.
__global__ void __launch_bounds__(256) quantize_kernel(QuantParams p) {
    __shared__ float warp_max[8];
    const uint64_t g = blockIdx.x / p.heads;
    const uint32_t h = blockIdx.x % p.heads;
    const uint64_t token_elems = (uint64_t)p.heads * p.dim;
    const uint64_t base = g * p.tokens * token_elems + (uint64_t)h * p.dim;
    const uint32_t n = p.tokens * p.dim;
    float absmax = 0.0f;
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
        const uint64_t e = base + (uint64_t)(i / p.dim) * token_elems + i % p.dim;
        absmax = fmaxf(absmax, fabsf(kvk_load_f32(p.src_dtype, p.src, e)));
    }
    for (int o = 16; o > 0; o >>= 1) {
        absmax = fmaxf(absmax, __shfl_xor_sync(0xffffffffu, absmax, o));
    }
    if (threadIdx.x % 32 == 0) {
        warp_max[threadIdx.x / 32] = absmax;
    }
    __syncthreads();
    absmax = 0.0f;
    for (uint32_t w = 0; w < blockDim.x / 32; w++) {
        absmax = fmaxf(absmax, warp_max[w]);
    }
    const float scale = absmax > 0.0f ? absmax / p.qmax : 1.0f;
    if (threadIdx.x == 0) {
        p.scales[blockIdx.x] = scale;
    }
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
        const uint64_t e = base + (uint64_t)(i / p.dim) * token_elems + i % p.dim;
        kvk_store_f32(p.dst_dtype, p.dst, e, kvk_load_f32(p.src_dtype, p.src, e) / scale);
    }
}

__global__ void __launch_bounds__(256) dequantize_kernel(QuantParams p, uint64_t total) {
    for (uint64_t e = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (uint64_t)gridDim.x * blockDim.x) {
        const uint64_t token = e / ((uint64_t)p.heads * p.dim);
        const uint64_t g = token / p.tokens;
        const uint32_t h = (uint32_t)(e / p.dim % p.heads);
        kvk_store_f32(p.dst_dtype, p.dst, e,
                      kvk_load_f32(p.src_dtype, p.src, e) * p.scales[g * p.heads + h]);
    }
}

// ---- paged decode attention --------------------------------------------------------------------

struct DecodeParams {
    const char *k, *v;       // section data of the layer's K and V, block 0
    int64_t bs;              // block stride
    const char *k_sc, *v_sc; // scales of K and V, block 0 (8-bit) or null
    int64_t sbs;             // scale block stride
    uint32_t num_blocks, page_size, kv_heads, group, gchunks, qo_heads, batch, nsplit;
    const int32_t *indptr, *indices, *last_page_len;
    const void *q;
    kv_dtype qo_dtype;
    float scale_log2; // sm_scale * log2(e): scores are kept in base 2
    void *out;        // final output (nsplit == 1)
    float *lse;       // final lse or null (nsplit == 1)
    float *ws_o;      // split partial outputs [nsplit][batch][qo_heads][dim]
    float *ws_lse;    // split partial lse [nsplit][batch][qo_heads]
};

constexpr int kDecodeThreads = 128;
constexpr int kUnroll = 4; // tokens per subgroup per step: loads in flight per thread

// Loads VEC consecutive elements as float. Vector width: 16 bytes (8 bytes for 8-bit dtypes).
template <int KVT> struct KVVec;
template <> struct KVVec<KV_DTYPE_FP16> {
    static constexpr int VEC = 8;
    using raw = uint4;
    __device__ static void cvt(const raw &r, float *o) {
        const __half2 *h = reinterpret_cast<const __half2 *>(&r);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float2 f = __half22float2(h[i]);
            o[2 * i] = f.x;
            o[2 * i + 1] = f.y;
        }
    }
};
template <> struct KVVec<KV_DTYPE_BF16> {
    static constexpr int VEC = 8;
    using raw = uint4;
    __device__ static void cvt(const raw &r, float *o) {
        const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&r);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float2 f = __bfloat1622float2(h[i]);
            o[2 * i] = f.x;
            o[2 * i + 1] = f.y;
        }
    }
};
template <> struct KVVec<KV_DTYPE_FP32> {
    static constexpr int VEC = 4;
    using raw = float4;
    __device__ static void cvt(const raw &r, float *o) {
        o[0] = r.x;
        o[1] = r.y;
        o[2] = r.z;
        o[3] = r.w;
    }
};
template <> struct KVVec<KV_DTYPE_FP8_E4M3> {
    static constexpr int VEC = 8;
    using raw = uint2;
    __device__ static void cvt(const raw &r, float *o) {
        const __nv_fp8x2_storage_t *p = reinterpret_cast<const __nv_fp8x2_storage_t *>(&r);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(p[i], __NV_E4M3);
            float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&hr));
            o[2 * i] = f.x;
            o[2 * i + 1] = f.y;
        }
    }
};
template <> struct KVVec<KV_DTYPE_INT8> {
    static constexpr int VEC = 8;
    using raw = uint2;
    __device__ static void cvt(const raw &r, float *o) {
        const int8_t *p = reinterpret_cast<const int8_t *>(&r);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            o[i] = (float)p[i];
        }
    }
};

// grid (batch, kv_heads * gchunks, nsplit). L lanes share one token's head row; the CTA's
// 128 / L subgroups stride over the split's tokens, kUnroll tokens each per step. Every lane
// runs the same trip count, so the shuffles inside see converged warps.
template <int KVT, int D, int GMAX>
__global__ void __launch_bounds__(kDecodeThreads) decode_kernel(DecodeParams p) {
    using V = KVVec<KVT>;
    constexpr int VEC = V::VEC;
    constexpr int L = D / VEC;
    constexpr int NSUB = kDecodeThreads / L;
    constexpr int EB =
        KVT == KV_DTYPE_FP32 ? 4 : (KVT == KV_DTYPE_FP16 || KVT == KV_DTYPE_BF16 ? 2 : 1);
    constexpr bool SCALED = KVT == KV_DTYPE_FP8_E4M3 || KVT == KV_DTYPE_INT8;
    static_assert(L >= 1 && L <= 32 && (L & (L - 1)) == 0, "lanes per row must be 1..32, pow2");

    constexpr int NW = kDecodeThreads / 32; // warps; each holds 32 / L whole subgroups
    static_assert(kDecodeThreads % 32 == 0, "whole warps");

    // The queries are dead once the token loop ends, so the warps' merged sums reuse their space.
    __shared__ union {
        float q[GMAX][D];     // scaled queries, read by the token loop
        float w[NW][GMAX][D]; // each warp's rescaled accumulator sums, written after it
    } sh;
    __shared__ float m_s[NSUB][GMAX];
    __shared__ float l_s[NSUB][GMAX];

    const uint32_t req = blockIdx.x;
    const uint32_t kvh = blockIdx.y / p.gchunks;
    const uint32_t g0 = (blockIdx.y % p.gchunks) * GMAX;
    const int gn = (int)min((uint32_t)GMAX, p.group - g0);
    const uint32_t split = blockIdx.z;
    const int lane = threadIdx.x % L;
    const int sub = threadIdx.x / L;

    const int32_t p0 = p.indptr[req];
    const int32_t npages = p.indptr[req + 1] - p0;
    int64_t len = 0;
    if (npages > 0) {
        const int32_t last = min(max(p.last_page_len[req], 1), (int32_t)p.page_size);
        len = (int64_t)(npages - 1) * p.page_size + last;
    }
    const int64_t per_split = (len + p.nsplit - 1) / p.nsplit;
    const int64_t t0 = (int64_t)split * per_split;
    const int64_t t1 = min(len, t0 + per_split);

    for (int i = threadIdx.x; i < GMAX * D; i += kDecodeThreads) {
        const int g = i / D, d = i % D;
        float x = 0.0f;
        if (g < gn) {
            const uint64_t row = (uint64_t)req * p.qo_heads + (uint64_t)kvh * p.group + g0 + g;
            x = kvk_load_f32(p.qo_dtype, p.q, row * D + d) * p.scale_log2;
        }
        sh.q[g][d] = x;
    }
    __syncthreads();

    float m[GMAX], l[GMAX], acc[GMAX][VEC];
#pragma unroll
    for (int g = 0; g < GMAX; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            acc[g][j] = 0.0f;
        }
    }
    const int64_t head_off = ((int64_t)kvh * D + lane * VEC) * EB;
    const int64_t token_bytes = (int64_t)p.kv_heads * D * EB;

    for (int64_t tb = t0; tb < t1; tb += NSUB * kUnroll) {
        typename V::raw kr[kUnroll], vr[kUnroll];
        float ks[kUnroll], vs[kUnroll];
        bool ok[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; u++) {
            const int64_t t = tb + sub + (int64_t)u * NSUB;
            ok[u] = false;
            ks[u] = vs[u] = 1.0f;
            if (t < t1) {
                const int64_t page = t / p.page_size;
                const int64_t off = t - page * p.page_size;
                const int32_t blk = p.indices[p0 + page];
                if (blk >= 0 && (uint32_t)blk < p.num_blocks) {
                    ok[u] = true;
                    const int64_t o = blk * p.bs + off * token_bytes + head_off;
                    kr[u] = __ldg(reinterpret_cast<const typename V::raw *>(p.k + o));
                    vr[u] = __ldg(reinterpret_cast<const typename V::raw *>(p.v + o));
                    if (SCALED) {
                        ks[u] = __ldg(reinterpret_cast<const float *>(p.k_sc + blk * p.sbs) + kvh);
                        vs[u] = __ldg(reinterpret_cast<const float *>(p.v_sc + blk * p.sbs) + kvh);
                    }
                }
            }
        }
#pragma unroll
        for (int g = 0; g < GMAX; g++) {
            if (g >= gn) {
                break; // uniform across the CTA
            }
            float qv[VEC];
#pragma unroll
            for (int j = 0; j < VEC; j++) {
                qv[j] = sh.q[g][lane * VEC + j];
            }
            float s[kUnroll];
            float mx = m[g];
#pragma unroll
            for (int u = 0; u < kUnroll; u++) {
                float kf[VEC];
                V::cvt(kr[u], kf);
                float dot = 0.0f;
#pragma unroll
                for (int j = 0; j < VEC; j++) {
                    dot += qv[j] * kf[j];
                }
#pragma unroll
                for (int o = L / 2; o > 0; o >>= 1) {
                    dot += __shfl_xor_sync(0xffffffffu, dot, o);
                }
                s[u] = ok[u] ? dot * ks[u] : -INFINITY;
                mx = fmaxf(mx, s[u]);
            }
            if (mx == -INFINITY) {
                continue; // nothing valid yet for this subgroup
            }
            const float corr = exp2f(m[g] - mx);
            l[g] *= corr;
#pragma unroll
            for (int j = 0; j < VEC; j++) {
                acc[g][j] *= corr;
            }
#pragma unroll
            for (int u = 0; u < kUnroll; u++) {
                const float w = exp2f(s[u] - mx);
                l[g] += w;
                if (ok[u]) {
                    float vf[VEC];
                    V::cvt(vr[u], vf);
                    const float wv = w * vs[u];
#pragma unroll
                    for (int j = 0; j < VEC; j++) {
                        acc[g][j] += wv * vf[j];
                    }
                }
            }
            m[g] = mx;
        }
    }

    // Merge the subgroups' states in a fixed order, so equal inputs give bitwise-equal outputs:
    // each subgroup's (m, l) goes to shared memory; every thread rescales its accumulators to the
    // CTA-wide max per head; the subgroups of one warp are summed by an xor butterfly over the
    // subgroup bits of the lane id (the same tree every run), the warp's first subgroup stores the
    // sum, and each output element then adds the NW warp sums in warp order.
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < GMAX; g++) {
            m_s[sub][g] = m[g];
            l_s[sub][g] = l[g];
        }
    }
    __syncthreads(); // also ends every read of sh.q before sh.w overwrites it
    const int warp = threadIdx.x / 32;
    const bool leader = threadIdx.x % 32 < L; // lanes of the warp's first subgroup
#pragma unroll
    for (int g = 0; g < GMAX; g++) {
        if (g >= gn) {
            break; // uniform across the CTA, so the shuffles below see converged warps
        }
        float mg = -INFINITY;
        for (int s2 = 0; s2 < NSUB; s2++) {
            mg = fmaxf(mg, m_s[s2][g]);
        }
        const bool live = mg != -INFINITY && m[g] != -INFINITY;
        const float f = live ? exp2f(m[g] - mg) : 0.0f;
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            float x = live ? acc[g][j] * f : 0.0f;
#pragma unroll
            for (int o = L; o < 32; o <<= 1) {
                x += __shfl_xor_sync(0xffffffffu, x, o);
            }
            if (leader) {
                sh.w[warp][g][lane * VEC + j] = x;
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < gn * D; i += kDecodeThreads) {
        const int g = i / D, d = i % D;
        float mg = -INFINITY;
        for (int s2 = 0; s2 < NSUB; s2++) {
            mg = fmaxf(mg, m_s[s2][g]);
        }
        float lg = 0.0f;
        if (mg != -INFINITY) {
            for (int s2 = 0; s2 < NSUB; s2++) {
                lg += m_s[s2][g] == -INFINITY ? 0.0f : l_s[s2][g] * exp2f(m_s[s2][g] - mg);
            }
        }
        float og = 0.0f;
#pragma unroll
        for (int w = 0; w < NW; w++) {
            og += sh.w[w][g][d];
        }
        const float o = lg > 0.0f ? og / lg : 0.0f;
        const float lse = lg > 0.0f ? (mg + log2f(lg)) * kLn2 : -INFINITY;
        const uint64_t row = (uint64_t)req * p.qo_heads + (uint64_t)kvh * p.group + g0 + g;
        if (p.nsplit == 1) {
            kvk_store_f32(p.qo_dtype, p.out, row * D + d, o);
            if (d == 0 && p.lse != nullptr) {
                p.lse[row] = lse;
            }
        } else {
            const uint64_t srow = (uint64_t)split * p.batch * p.qo_heads + row;
            p.ws_o[srow * D + d] = o;
            if (d == 0) {
                p.ws_lse[srow] = lse;
            }
        }
    }
}

template <int KVT, int D>
kv_err launch_decode_d(const DecodeParams &p, uint32_t gmax, dim3 grid, cudaStream_t st) {
    kv_err rc = pre_launch("paged_decode_attention");
    if (rc != KV_OK) {
        return rc;
    }
    if (gmax == 2) {
        decode_kernel<KVT, D, 2><<<grid, kDecodeThreads, 0, st>>>(p);
    } else if (gmax == 4) {
        // GQA 3-4 (Llama 3 70B: 8 KV heads x 4): the 8-row variant would hold twice the
        // accumulators it uses.
        decode_kernel<KVT, D, 4><<<grid, kDecodeThreads, 0, st>>>(p);
    } else {
        decode_kernel<KVT, D, 8><<<grid, kDecodeThreads, 0, st>>>(p);
    }
    return launched("paged_decode_attention");
}

template <int KVT>
kv_err launch_decode_t(const DecodeParams &p, uint32_t dim, uint32_t gmax, dim3 grid,
                       cudaStream_t st) {
    switch (dim) {
        case 64:
            return launch_decode_d<KVT, 64>(p, gmax, grid, st);
        case 128:
            return launch_decode_d<KVT, 128>(p, gmax, grid, st);
        case 256:
            if constexpr (KVT != KV_DTYPE_FP32) {
                return launch_decode_d<KVT, 256>(p, gmax, grid, st);
            }
            break;
    }
    return kvk__fail(KV_ENOTSUP,
                     "paged_decode_attention_cuda: head_dim %u unsupported for this "
                     "dtype (64, 128, 256; fp32: 64, 128)",
                     dim);
}

// ---- Zipage: compact_tokens and token_scores ------------------------------------------------

struct CompactParams {
    const char *src;
    char *dst;
    int64_t src_bs, src_ss, dst_bs, dst_ss;
    const char *src_sc;
    char *dst_sc;
    int64_t src_sbs, src_sss, dst_sbs, dst_sss;
    uint32_t src_nb, dst_nb, tpb, heads, dim, ebytes;
    kv_dtype dtype;
    const int64_t *slots; // device: kept token i's src slot
    const int32_t *dblk;  // device: fresh block per tokens_per_block kept tokens
};

__device__ __forceinline__ float load_scale(const char *base, int64_t bs, int64_t ss, uint32_t b,
                                            uint32_t sec, uint32_t h) {
    return reinterpret_cast<const float *>(base + (int64_t)b * bs + (int64_t)sec * ss)[h];
}

// grid (kept tokens, sections): one CTA copies one token's row of one section; for 8-bit
// dtypes each head's elements are copied when its scale equals the fresh block's (the scale of
// the block the fresh block's first token comes from) and requantized otherwise, as the twin.
__global__ void __launch_bounds__(128) compact_kernel(CompactParams p) {
    const uint32_t i = blockIdx.x, sec = blockIdx.y;
    const int64_t slot = p.slots[i];
    const int64_t first = p.slots[(i / p.tpb) * p.tpb];
    const int32_t db = p.dblk[i / p.tpb];
    const uint64_t smax = (uint64_t)p.src_nb * p.tpb;
    if (slot < 0 || (uint64_t)slot >= smax || first < 0 || (uint64_t)first >= smax || db < 0 ||
        (uint32_t)db >= p.dst_nb) {
        return;
    }
    const uint32_t sb = (uint32_t)(slot / p.tpb), so = (uint32_t)(slot % p.tpb);
    const uint32_t fb = (uint32_t)(first / p.tpb), dof = i % p.tpb;
    const uint64_t row = (uint64_t)p.heads * p.dim * p.ebytes;
    const char *from = p.src + (int64_t)sb * p.src_bs + (int64_t)sec * p.src_ss + so * row;
    char *to = p.dst + (int64_t)db * p.dst_bs + (int64_t)sec * p.dst_ss + dof * row;
    if (p.src_sc == nullptr) {
        for (uint64_t b = threadIdx.x; b < row; b += blockDim.x) {
            to[b] = from[b];
        }
        return;
    }
    const uint32_t n = p.heads * p.dim; // 8-bit: one byte per element
    for (uint32_t e = threadIdx.x; e < n; e += blockDim.x) {
        const uint32_t h = e / p.dim;
        const float s_src = load_scale(p.src_sc, p.src_sbs, p.src_sss, sb, sec, h);
        const float s_dst = load_scale(p.src_sc, p.src_sbs, p.src_sss, fb, sec, h);
        if (__float_as_uint(s_src) == __float_as_uint(s_dst)) {
            to[e] = from[e];
        } else {
            const float ratio = s_dst != 0.0f ? s_src / s_dst : 0.0f;
            kvk_store_f32(p.dtype, to, e, kvk_load_f32(p.dtype, from, e) * ratio);
        }
    }
    if (dof == 0) {
        for (uint32_t h = threadIdx.x; h < p.heads; h += blockDim.x) {
            reinterpret_cast<float *>(p.dst_sc + (int64_t)db * p.dst_sbs +
                                      (int64_t)sec * p.dst_sss)[h] =
                load_scale(p.src_sc, p.src_sbs, p.src_sss, fb, sec, h);
        }
    }
}

struct ScoreParams {
    const char *data;
    int64_t bs, ss;
    const char *sc;
    int64_t sbs, sss;
    kv_dtype dtype;
    uint32_t sec, tpb, kv_heads, dim, num_blocks;
    const int32_t *pages;
    uint32_t ntokens;
    const void *q;
    kv_dtype q_dtype;
    uint32_t nq, qo_heads;
    float sm_scale, w;
    int causal;
    float *ws;     // [nq * qo_heads][2]: max, sum of exp
    float *scores; // [ntokens], accumulated
};

// The logit of query j, head h at token t, or -inf when t is not visible or its page is bad.
__device__ float score_logit(const ScoreParams &p, uint32_t j, uint32_t h, uint32_t t) {
    const int64_t visible = p.causal ? (int64_t)p.ntokens - p.nq + j + 1 : (int64_t)p.ntokens;
    const int32_t blk = p.pages[t / p.tpb];
    if ((int64_t)t >= visible || blk < 0 || (uint32_t)blk >= p.num_blocks) {
        return -INFINITY;
    }
    const uint32_t g = h / (p.qo_heads / p.kv_heads);
    const uint64_t ebytes = kvk_elem_bytes(p.dtype);
    const char *row = p.data + (int64_t)blk * p.bs + (int64_t)p.sec * p.ss +
                      (uint64_t)(t % p.tpb) * p.kv_heads * p.dim * ebytes;
    const float s =
        p.sc != nullptr ? load_scale(p.sc, p.sbs, p.sss, (uint32_t)blk, p.sec, g) : 1.0f;
    const uint64_t qoff = ((uint64_t)j * p.qo_heads + h) * p.dim;
    float d = 0.0f;
    for (uint32_t e = 0; e < p.dim; e++) {
        d += kvk_load_f32(p.q_dtype, p.q, qoff + e) *
             (kvk_load_f32(p.dtype, row, (uint64_t)g * p.dim + e) * s);
    }
    return d * p.sm_scale;
}

// Pass 1, grid (nq, qo_heads): each (query, head)'s max and sum of exp over its visible tokens,
// per thread in token order, then a fixed tree over the threads.
__global__ void __launch_bounds__(256) score_stats_kernel(ScoreParams p) {
    __shared__ float sm[256], sz[256];
    const uint32_t j = blockIdx.x, h = blockIdx.y;
    float m = -INFINITY, z = 0.0f;
    for (uint32_t t = threadIdx.x; t < p.ntokens; t += blockDim.x) {
        const float l = score_logit(p, j, h, t);
        if (l == -INFINITY) {
            continue;
        }
        if (l > m) {
            z = z * expf(m - l) + 1.0f;
            m = l;
        } else {
            z += expf(l - m);
        }
    }
    sm[threadIdx.x] = m;
    sz[threadIdx.x] = z;
    __syncthreads();
    for (uint32_t step = blockDim.x / 2; step > 0; step /= 2) {
        if (threadIdx.x < step) {
            const float m1 = sm[threadIdx.x], m2 = sm[threadIdx.x + step];
            const float mm = m1 > m2 ? m1 : m2;
            const float z1 = m1 == -INFINITY ? 0.0f : sz[threadIdx.x] * expf(m1 - mm);
            const float z2 = m2 == -INFINITY ? 0.0f : sz[threadIdx.x + step] * expf(m2 - mm);
            sm[threadIdx.x] = mm;
            sz[threadIdx.x] = z1 + z2;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        p.ws[((uint64_t)j * p.qo_heads + h) * 2] = sm[0];
        p.ws[((uint64_t)j * p.qo_heads + h) * 2 + 1] = sz[0];
    }
}

// Pass 2, one thread per token: its probabilities summed in (query, head) order.
__global__ void __launch_bounds__(128) score_sum_kernel(ScoreParams p) {
    const uint32_t t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= p.ntokens) {
        return;
    }
    float acc = 0.0f;
    for (uint32_t j = 0; j < p.nq; j++) {
        for (uint32_t h = 0; h < p.qo_heads; h++) {
            const float l = score_logit(p, j, h, t);
            const float m = p.ws[((uint64_t)j * p.qo_heads + h) * 2];
            const float z = p.ws[((uint64_t)j * p.qo_heads + h) * 2 + 1];
            if (l != -INFINITY && z > 0.0f) {
                acc += expf(l - m) / z;
            }
        }
    }
    p.scores[t] += acc * p.w;
}

// ---- IceCache: page_summaries and page_select ----------------------------------------------

struct SummParams {
    const char *data;
    int64_t bs, ss;
    const char *sc;
    int64_t sbs, sss;
    kv_dtype dtype;
    uint32_t layers, heads, dim, tpb, num_blocks, n;
    const int32_t *blocks;
    const uint32_t *ntok;
    float *out;
};

// grid (n, layers * heads): threads over channels, each a min and max over the tokens.
__global__ void __launch_bounds__(128) summ_kernel(SummParams p) {
    const uint32_t i = blockIdx.x, lh = blockIdx.y, l = lh / p.heads, h = lh % p.heads;
    const int32_t b = p.blocks[i];
    const uint32_t nt = p.ntok != nullptr ? p.ntok[i] : p.tpb;
    if (b < 0 || (uint32_t)b >= p.num_blocks || nt > p.tpb) {
        return;
    }
    const uint64_t eb = kvk_elem_bytes(p.dtype), row = (uint64_t)p.heads * p.dim * eb;
    const char *base = p.data + (int64_t)b * p.bs + (int64_t)(l * 2) * p.ss;
    const float s = p.sc != nullptr ? load_scale(p.sc, p.sbs, p.sss, (uint32_t)b, l * 2, h) : 1.0f;
    float *mn = p.out + (uint64_t)i * p.layers * p.heads * KVK_SUMMARY_PARTS * p.dim +
                ((uint64_t)l * p.heads + h) * KVK_SUMMARY_PARTS * p.dim;
    float *mx = mn + p.dim, *me = mx + p.dim;
    for (uint32_t d = threadIdx.x; d < p.dim; d += blockDim.x) {
        float lo = INFINITY, hi = -INFINITY, sum = 0.0f;
        for (uint32_t t = 0; t < nt; t++) {
            const float x =
                __fmul_rn(kvk_load_f32(p.dtype, base + t * row, (uint64_t)h * p.dim + d), s);
            lo = x < lo ? x : lo;
            hi = x > hi ? x : hi;
            sum = __fadd_rn(sum, x);
        }
        mn[d] = lo;
        mx[d] = hi;
        me[d] = nt > 0 ? __fdiv_rn(sum, (float)nt) : 0.0f;
    }
}

struct SelParams {
    const float *summ;
    uint32_t npages, layers, layer, heads, dim, qo_heads, k;
    int mode;
    const float *q;
    int32_t *out;
    float *score;
};

// The score of page pg for KV head g, in the twin's order without fused operations.
__device__ float page_score(const SelParams &p, uint32_t pg, uint32_t g) {
    const uint32_t G = p.qo_heads / p.heads;
    const uint64_t per = (uint64_t)p.layers * p.heads * KVK_SUMMARY_PARTS * p.dim;
    const float *mn =
        p.summ + pg * per + ((uint64_t)p.layer * p.heads + g) * KVK_SUMMARY_PARTS * p.dim;
    const float *mx = mn + p.dim, *me = mx + p.dim;
    float best = -INFINITY;
    if (mn[0] > mx[0]) {
        return -INFINITY; // an empty page, as the twin
    }
    for (uint32_t j = 0; j < G; j++) {
        const float *q = p.q + (uint64_t)(g * G + j) * p.dim;
        float s = 0.0f;
        for (uint32_t d = 0; d < p.dim; d++) {
            if (q[d] == 0.0f) {
                continue; // contributes 0 whatever the key, as the twin
            }
            if (p.mode == KVK_SELECT_CENTROID) {
                s = __fadd_rn(s, __fmul_rn(q[d], me[d]));
            } else {
                const float x = __fmul_rn(q[d], mn[d]), y = __fmul_rn(q[d], mx[d]);
                s = __fadd_rn(s, x > y ? x : y);
            }
        }
        best = s > best ? s : best;
    }
    return best;
}

// grid (heads): each CTA scores every page for its KV head (one thread per page, channels in
// the twin's order, no fused multiply-add), then takes the k best in k rounds of a block-wide
// argmax (lower page on ties), then writes them in page order.
__global__ void __launch_bounds__(256) select_kernel(SelParams p) {
    __shared__ float bv[256];
    __shared__ uint32_t bi[256];
    const uint32_t g = blockIdx.x;
    float *sc = p.score + (uint64_t)g * p.npages;
    for (uint32_t pg = threadIdx.x; pg < p.npages; pg += blockDim.x) {
        sc[pg] = page_score(p, pg, g);
    }
    __syncthreads();
    int32_t *o = p.out + (uint64_t)g * p.k;
    for (uint32_t r = 0; r < p.k; r++) {
        float v = -INFINITY;
        uint32_t vi = UINT32_MAX;
        for (uint32_t pg = threadIdx.x; pg < p.npages; pg += blockDim.x) {
            if (!isnan(sc[pg]) && (vi == UINT32_MAX || sc[pg] > v)) {
                v = sc[pg];
                vi = pg;
            }
        }
        bv[threadIdx.x] = v;
        bi[threadIdx.x] = vi;
        __syncthreads();
        for (uint32_t step = blockDim.x / 2; step > 0; step /= 2) {
            if (threadIdx.x < step) {
                const float v2 = bv[threadIdx.x + step];
                const uint32_t i2 = bi[threadIdx.x + step];
                if (i2 != UINT32_MAX && (bi[threadIdx.x] == UINT32_MAX || v2 > bv[threadIdx.x] ||
                                         (v2 == bv[threadIdx.x] && i2 < bi[threadIdx.x]))) {
                    bv[threadIdx.x] = v2;
                    bi[threadIdx.x] = i2;
                }
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) {
            // Scores are numbers or -inf (page_score) and k <= npages, so an untaken page is
            // always found; the guard only keeps a broken invariant inside the arrays.
            o[r] = bi[0] != UINT32_MAX ? (int32_t)bi[0] : 0;
            if (bi[0] != UINT32_MAX) {
                sc[bi[0]] = __int_as_float(0x7fc00000); // taken: NaN, skipped from now on
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        // Page order (k is small: insertion sort), then the bounds back for the caller.
        for (uint32_t a = 1; a < p.k; a++) {
            const int32_t x = o[a];
            uint32_t b = a;
            while (b > 0 && o[b - 1] > x) {
                o[b] = o[b - 1];
                b--;
            }
            o[b] = x;
        }
    }
    __syncthreads();
    // Restore the taken pages' bounds (recomputed, same order).
    for (uint32_t r = threadIdx.x; r < p.k; r += blockDim.x) {
        const uint32_t pg = (uint32_t)o[r];
        sc[pg] = page_score(p, pg, g);
    }
}

} // namespace

// ---- Launchers
// -----------------------------------------------------------------------------------

extern "C" kv_err kvk_copy_blocks_cuda(const kvk_cache *src, const kvk_cache *dst,
                                       const int32_t *src_blocks, const int32_t *dst_blocks,
                                       uint32_t n, void *stream) {
    kv_err rc = kvk__check_copy(src, dst);
    if (rc != KV_OK) {
        return rc;
    }
    if (n == 0) {
        return KV_OK;
    }
    if (src_blocks == nullptr || dst_blocks == nullptr) {
        return kvk__fail(KV_EINVAL, "copy_blocks: null block list");
    }
    if (src->num_sections > 65535) {
        return kvk__fail(KV_ENOTSUP, "copy_blocks_cuda: more than 65535 sections");
    }
    CopyParams p = {};
    p.src = reinterpret_cast<const char *>(src->data);
    p.dst = reinterpret_cast<char *>(dst->data);
    p.src_bs = src->block_stride;
    p.src_ss = src->section_stride;
    p.dst_bs = dst->block_stride;
    p.dst_ss = dst->section_stride;
    if (kvk__is_scaled(src->dtype)) {
        p.src_sc = reinterpret_cast<const char *>(src->scales);
        p.dst_sc = reinterpret_cast<char *>(dst->scales);
        p.src_sbs = src->scale_block_stride;
        p.src_sss = src->scale_section_stride;
        p.dst_sbs = dst->scale_block_stride;
        p.dst_sss = dst->scale_section_stride;
    }
    p.src_nb = src->num_blocks;
    p.dst_nb = dst->num_blocks;
    p.chunk = (uint64_t)src->tokens_per_block * src->num_kv_heads * src->head_dim *
              kvk_elem_bytes(src->dtype);
    p.heads = src->num_kv_heads;
    p.sb = src_blocks;
    p.db = dst_blocks;
    // Element stores are done bytewise where an address or length is not 16-aligned, but scale
    // copies are float loads and stores: a misaligned one would kill the caller's context.
    if (!scales_aligned(src) || !scales_aligned(dst)) {
        return kvk__fail(KV_EINVAL, "copy_blocks_cuda: scales or scale strides not 4-byte aligned");
    }
    rc = pre_launch("copy_blocks");
    if (rc != KV_OK) {
        return rc;
    }
    dim3 grid(n, src->num_sections);
    copy_blocks_kernel<<<grid, 256, 0, as_stream(stream)>>>(p);
    return launched("copy_blocks");
}

extern "C" kv_err kvk_reshape_and_cache_cuda(const kvk_cache *cache, uint32_t layer,
                                             const kvk_tokens *t, const int64_t *slot_mapping,
                                             uint32_t ntokens, void *stream) {
    kv_err rc = kvk__check_reshape(cache, layer, t);
    if (rc != KV_OK) {
        return rc;
    }
    if (ntokens == 0) {
        return KV_OK;
    }
    if (slot_mapping == nullptr) {
        return kvk__fail(KV_EINVAL, "reshape_and_cache: null slot mapping");
    }
    ReshapeParams p = {};
    p.k = static_cast<const char *>(t->k);
    p.v = static_cast<const char *>(t->v);
    p.row_stride = t->row_stride;
    p.src_dtype = t->dtype;
    p.k_scale = t->k_scale;
    p.v_scale = t->v_scale;
    p.data = reinterpret_cast<char *>(cache->data);
    p.bs = cache->block_stride;
    p.ss = cache->section_stride;
    if (kvk__is_scaled(cache->dtype)) {
        p.scales = reinterpret_cast<char *>(cache->scales);
        p.sbs = cache->scale_block_stride;
        p.sss = cache->scale_section_stride;
    }
    p.dtype = cache->dtype;
    p.section = layer * 2;
    p.page_size = cache->tokens_per_block;
    p.heads = cache->num_kv_heads;
    p.dim = cache->head_dim;
    p.num_blocks = cache->num_blocks;
    p.slots = slot_mapping;
    // Elements are stored at their size and scales as floats: a misaligned address or stride
    // faults on the device and takes the caller's context with it, so refuse it here.
    const uint64_t eb = kvk_elem_bytes(cache->dtype), ib = kvk_elem_bytes(t->dtype);
    if (((cache->data | (uintptr_t)cache->block_stride | (uintptr_t)cache->section_stride) &
         (eb - 1)) != 0 ||
        (((uintptr_t)t->k | (uintptr_t)t->v | (uintptr_t)t->row_stride) & (ib - 1)) != 0 ||
        (kvk__is_scaled(cache->dtype) &&
         ((cache->scales | (uintptr_t)cache->scale_block_stride |
           (uintptr_t)cache->scale_section_stride | (uintptr_t)t->k_scale | (uintptr_t)t->v_scale) &
          3u) != 0)) {
        return kvk__fail(KV_EINVAL,
                         "reshape_and_cache_cuda: an address or stride is not aligned to its "
                         "element (cache %llu bytes, tokens %llu bytes, scales 4)",
                         (unsigned long long)eb, (unsigned long long)ib);
    }
    rc = pre_launch("reshape_and_cache");
    if (rc != KV_OK) {
        return rc;
    }
    reshape_kernel<<<dim3(ntokens, 2), 128, 0, as_stream(stream)>>>(p);
    return launched("reshape_and_cache");
}

extern "C" kv_err kvk_paged_decode_attention_cuda(const kvk_cache *cache, uint32_t layer,
                                                  const kvk_page_table *pt,
                                                  const kvk_decode_args *a, void *workspace,
                                                  size_t workspace_bytes, void *stream) {
    kv_err rc = kvk__check_decode(cache, layer, pt, a);
    if (rc != KV_OK) {
        return rc;
    }
    if (pt->batch == 0) {
        return KV_OK;
    }
    if (pt->indices == nullptr) {
        return kvk__fail(KV_EINVAL, "paged_decode_attention: null indices");
    }
    const uint32_t eb = kvk_elem_bytes(cache->dtype);
    const uint64_t align = eb == 1 ? 8 : 16;
    const int64_t sec = (int64_t)layer * 2;
    const uintptr_t k = cache->data + (uintptr_t)(sec * cache->section_stride);
    const uintptr_t v = k + (uintptr_t)cache->section_stride;
    if (((k | v | (uintptr_t)cache->block_stride) & (align - 1)) != 0) {
        return kvk__fail(KV_ENOTSUP,
                         "paged_decode_attention_cuda: K/V addresses or strides not "
                         "%llu-byte aligned",
                         (unsigned long long)align);
    }
    DecodeParams p = {};
    p.k = reinterpret_cast<const char *>(k);
    p.v = reinterpret_cast<const char *>(v);
    p.bs = cache->block_stride;
    if (kvk__is_scaled(cache->dtype)) {
        const uintptr_t ks = cache->scales + (uintptr_t)(sec * cache->scale_section_stride);
        if (((ks | (uintptr_t)cache->scale_section_stride | (uintptr_t)cache->scale_block_stride) &
             3u) != 0) {
            return kvk__fail(KV_ENOTSUP, "paged_decode_attention_cuda: scales not 4-byte aligned");
        }
        p.k_sc = reinterpret_cast<const char *>(ks);
        p.v_sc = reinterpret_cast<const char *>(ks + (uintptr_t)cache->scale_section_stride);
        p.sbs = cache->scale_block_stride;
    }
    const uint32_t group = a->num_qo_heads / cache->num_kv_heads;
    const uint32_t gmax = group <= 2 ? 2 : group <= 4 ? 4 : 8;
    p.num_blocks = cache->num_blocks;
    p.page_size = cache->tokens_per_block;
    p.kv_heads = cache->num_kv_heads;
    p.group = group;
    p.gchunks = (group + gmax - 1) / gmax;
    p.qo_heads = a->num_qo_heads;
    p.batch = pt->batch;
    p.indptr = pt->indptr;
    p.indices = pt->indices;
    p.last_page_len = pt->last_page_len;
    p.q = a->q;
    p.qo_dtype = a->qo_dtype;
    p.scale_log2 = a->sm_scale * kLog2e;
    p.out = a->out;
    p.lse = a->lse;

    // Split-K when the grid would leave SMs idle and the workspace allows: aim at 2 CTAs per SM.
    const uint64_t ctas = (uint64_t)pt->batch * cache->num_kv_heads * p.gchunks;
    if (ctas > 65535ull * 65535ull || cache->num_kv_heads * p.gchunks > 65535) {
        return kvk__fail(KV_ENOTSUP, "paged_decode_attention_cuda: grid too large");
    }
    uint32_t nsplit = 1;
    int sms = 0;
    rc = device_sms(&sms);
    if (rc != KV_OK) {
        return rc;
    }
    const size_t per_split =
        kvk_paged_decode_attention_workspace_bytes(pt->batch, a->num_qo_heads, cache->head_dim, 1);
    if (workspace != nullptr && ctas < (uint64_t)sms * 2) {
        uint64_t want = ((uint64_t)sms * 2 + ctas - 1) / ctas;
        uint64_t fit = workspace_bytes / per_split;
        nsplit = (uint32_t)(want < fit ? want : fit);
        nsplit = nsplit > KVK_MAX_MERGE_STATES ? KVK_MAX_MERGE_STATES : nsplit;
        nsplit = nsplit < 1 ? 1 : nsplit;
    }
    p.nsplit = nsplit;
    float *ws = static_cast<float *>(workspace);
    const uint64_t rows = (uint64_t)pt->batch * a->num_qo_heads;
    if (nsplit > 1) {
        p.ws_o = ws;
        p.ws_lse = ws + (uint64_t)nsplit * rows * cache->head_dim;
    }
    dim3 grid(pt->batch, cache->num_kv_heads * p.gchunks, nsplit);
    cudaStream_t st = as_stream(stream);
    switch (cache->dtype) {
        case KV_DTYPE_FP16:
            rc = launch_decode_t<KV_DTYPE_FP16>(p, cache->head_dim, gmax, grid, st);
            break;
        case KV_DTYPE_BF16:
            rc = launch_decode_t<KV_DTYPE_BF16>(p, cache->head_dim, gmax, grid, st);
            break;
        case KV_DTYPE_FP32:
            rc = launch_decode_t<KV_DTYPE_FP32>(p, cache->head_dim, gmax, grid, st);
            break;
        case KV_DTYPE_FP8_E4M3:
            rc = launch_decode_t<KV_DTYPE_FP8_E4M3>(p, cache->head_dim, gmax, grid, st);
            break;
        case KV_DTYPE_INT8:
            rc = launch_decode_t<KV_DTYPE_INT8>(p, cache->head_dim, gmax, grid, st);
            break;
    }
    if (rc != KV_OK || nsplit == 1) {
        return rc;
    }
    MergeParams mp = {};
    for (uint32_t j = 0; j < nsplit; j++) {
        mp.v[j] = p.ws_o + (uint64_t)j * rows * cache->head_dim;
        mp.s[j] = p.ws_lse + (uint64_t)j * rows;
    }
    mp.num_states = nsplit;
    mp.in_dtype = KV_DTYPE_FP32;
    mp.out_dtype = a->qo_dtype;
    mp.rows = rows;
    mp.dim = cache->head_dim;
    mp.out = a->out;
    mp.s_out = a->lse;
    return launch_merge(mp, st);
}

extern "C" kv_err kvk_merge_states_cuda(kv_dtype dtype, const void *const *v, const float *const *s,
                                        uint32_t num_states, uint64_t rows, uint32_t head_dim,
                                        void *out, float *s_out, void *stream) {
    if (!kvk__is_wide(dtype) || v == nullptr || s == nullptr || out == nullptr || head_dim == 0 ||
        num_states == 0 || num_states > KVK_MAX_MERGE_STATES) {
        return kvk__fail(KV_EINVAL, "merge_states: bad dtype, null array or %u states", num_states);
    }
    MergeParams p = {};
    for (uint32_t j = 0; j < num_states; j++) {
        if (v[j] == nullptr || s[j] == nullptr) {
            return kvk__fail(KV_EINVAL, "merge_states: state %u is null", j);
        }
        p.v[j] = v[j];
        p.s[j] = s[j];
    }
    p.num_states = num_states;
    p.in_dtype = dtype;
    p.out_dtype = dtype;
    p.rows = rows;
    p.dim = head_dim;
    p.out = out;
    p.s_out = s_out;
    return launch_merge(p, as_stream(stream));
}

extern "C" kv_err kvk_quantize_blocks_cuda(kv_dtype src_dtype, const void *src, kv_dtype dst_dtype,
                                           void *dst, float *scales, uint64_t n, uint32_t tokens,
                                           uint32_t heads, uint32_t dim, void *stream) {
    kv_err rc = kvk__check_quant(src_dtype, dst_dtype, n, tokens, heads, dim, 1);
    if (rc != KV_OK) {
        return rc;
    }
    if (n == 0) {
        return KV_OK;
    }
    if (src == nullptr || dst == nullptr || scales == nullptr) {
        return kvk__fail(KV_EINVAL, "quantize_blocks: null array");
    }
    if (n * heads > 0x7fffffffull || (uint64_t)tokens * dim > 0xffffffffull) {
        return kvk__fail(KV_ENOTSUP, "quantize_blocks_cuda: too many groups or group too large");
    }
    QuantParams p = {
        src,       dst,       scales,
        src_dtype, dst_dtype, tokens,
        heads,     dim,       dst_dtype == KV_DTYPE_INT8 ? KVK_INT8_MAX : KVK_FP8_E4M3_MAX};
    rc = pre_launch("quantize_blocks");
    if (rc != KV_OK) {
        return rc;
    }
    quantize_kernel<<<(unsigned)(n * heads), 256, 0, as_stream(stream)>>>(p);
    return launched("quantize_blocks");
}

extern "C" kv_err kvk_dequantize_blocks_cuda(kv_dtype src_dtype, const void *src,
                                             const float *scales, kv_dtype dst_dtype, void *dst,
                                             uint64_t n, uint32_t tokens, uint32_t heads,
                                             uint32_t dim, void *stream) {
    kv_err rc = kvk__check_quant(dst_dtype, src_dtype, n, tokens, heads, dim, 0);
    if (rc != KV_OK) {
        return rc;
    }
    const uint64_t total = n * tokens * (uint64_t)heads * dim;
    if (total == 0) {
        return KV_OK;
    }
    if (src == nullptr || dst == nullptr || scales == nullptr) {
        return kvk__fail(KV_EINVAL, "dequantize_blocks: null array");
    }
    QuantParams p = {src, dst, const_cast<float *>(scales), src_dtype, dst_dtype, tokens, heads,
                     dim, 0.0f};
    rc = pre_launch("dequantize_blocks");
    if (rc != KV_OK) {
        return rc;
    }
    const uint64_t blocks = (total + 255) / 256;
    dequantize_kernel<<<(unsigned)(blocks < 65536 ? blocks : 65536), 256, 0, as_stream(stream)>>>(
        p, total);
    return launched("dequantize_blocks");
}

// ---- Device helpers
// ------------------------------------------------------------------------------

extern "C" kv_err kvk_dev_alloc(size_t bytes, void **out) {
    void *p = nullptr;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
        return cuda_fail(e, "dev_alloc");
    }
    *out = p;
    return KV_OK;
}

extern "C" void kvk_dev_free(void *p) {
    if (p != nullptr) {
        cudaFree(p);
    }
}

extern "C" kv_err kvk_host_alloc_pinned(size_t bytes, void **out) {
    void *p = nullptr;
    cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
    if (e != cudaSuccess) {
        return cuda_fail(e, "host_alloc_pinned");
    }
    *out = p;
    return KV_OK;
}

extern "C" void kvk_host_free_pinned(void *p) {
    if (p != nullptr) {
        cudaFreeHost(p);
    }
}

static cudaMemcpyKind copy_kind(kvk_copy_kind k) {
    switch (k) {
        case KVK_H2D:
            return cudaMemcpyHostToDevice;
        case KVK_D2H:
            return cudaMemcpyDeviceToHost;
        case KVK_D2D:
            return cudaMemcpyDeviceToDevice;
    }
    return cudaMemcpyDefault;
}

extern "C" kv_err kvk_dev_memcpy(void *dst, const void *src, size_t bytes, kvk_copy_kind kind) {
    cudaError_t e = cudaMemcpy(dst, src, bytes, copy_kind(kind));
    return e == cudaSuccess ? KV_OK : cuda_fail(e, "dev_memcpy");
}

extern "C" kv_err kvk_dev_memcpy_async(void *dst, const void *src, size_t bytes, kvk_copy_kind kind,
                                       void *stream) {
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, copy_kind(kind), as_stream(stream));
    return e == cudaSuccess ? KV_OK : cuda_fail(e, "dev_memcpy_async");
}

extern "C" kv_err kvk_dev_sync(void) {
    cudaError_t e = cudaDeviceSynchronize();
    return e == cudaSuccess ? KV_OK : cuda_fail(e, "dev_sync");
}

static thread_local cudaEvent_t timer_ev[2];

extern "C" kv_err kvk_timer_start(void *stream) {
    for (int i = 0; i < 2; i++) {
        if (timer_ev[i] == nullptr) {
            cudaError_t e = cudaEventCreate(&timer_ev[i]);
            if (e != cudaSuccess) {
                return cuda_fail(e, "timer_start");
            }
        }
    }
    cudaError_t e = cudaEventRecord(timer_ev[0], as_stream(stream));
    return e == cudaSuccess ? KV_OK : cuda_fail(e, "timer_start");
}

extern "C" kv_err kvk_timer_stop(void *stream, float *ms) {
    if (timer_ev[1] == nullptr) {
        return kvk__fail(KV_EINVAL, "timer_stop: timer was not started");
    }
    cudaError_t e = cudaEventRecord(timer_ev[1], as_stream(stream));
    if (e == cudaSuccess) {
        e = cudaEventSynchronize(timer_ev[1]);
    }
    float t = 0.0f;
    if (e == cudaSuccess) {
        e = cudaEventElapsedTime(&t, timer_ev[0], timer_ev[1]);
    }
    if (e != cudaSuccess) {
        return cuda_fail(e, "timer_stop");
    }
    *ms = t;
    return KV_OK;
}

extern "C" kv_err kvk_dev_info(int *num_sms, double *peak_gbps, char *name, size_t name_len) {
    int dev = 0, sms = 0, clock_khz = 0, bus_bits = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) {
        e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    }
    if (e != cudaSuccess) {
        return cuda_fail(e, "dev_info");
    }
    // Not every runtime reports the memory clock; then the peak is unknown (0).
    if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev) != cudaSuccess) {
        clock_khz = bus_bits = 0;
        (void)cudaGetLastError();
    }
    cudaDeviceProp prop;
    if (name != nullptr && name_len > 0) {
        name[0] = '\0';
        if (cudaGetDeviceProperties(&prop, dev) == cudaSuccess) {
            snprintf(name, name_len, "%s", prop.name);
        }
    }
    *num_sms = sms;
    // Double data rate: two transfers per clock over bus_bits / 8 bytes.
    *peak_gbps = 2.0 * clock_khz * 1e3 * (bus_bits / 8.0) / 1e9;
    return KV_OK;
}

extern "C" kv_err kvk_compact_tokens_cuda(const kvk_cache *src, const kvk_cache *dst,
                                          const int64_t *src_slots, uint32_t nkept,
                                          const int32_t *dst_blocks, void *stream) {
    kv_err rc = kvk__check_compact(src, dst, src_slots, nkept, dst_blocks);
    if (rc != KV_OK || nkept == 0) {
        return rc;
    }
    if (src->num_sections > 65535) {
        return kvk__fail(KV_ENOTSUP, "compact_tokens_cuda: more than 65535 sections");
    }
    CompactParams p = {};
    p.src = reinterpret_cast<const char *>(src->data);
    p.dst = reinterpret_cast<char *>(dst->data);
    p.src_bs = src->block_stride;
    p.src_ss = src->section_stride;
    p.dst_bs = dst->block_stride;
    p.dst_ss = dst->section_stride;
    if (kvk__is_scaled(src->dtype)) {
        if (!scales_aligned(src) || !scales_aligned(dst)) {
            return kvk__fail(KV_EINVAL,
                             "compact_tokens_cuda: scales or scale strides not 4-byte aligned");
        }
        p.src_sc = reinterpret_cast<const char *>(src->scales);
        p.dst_sc = reinterpret_cast<char *>(dst->scales);
        p.src_sbs = src->scale_block_stride;
        p.src_sss = src->scale_section_stride;
        p.dst_sbs = dst->scale_block_stride;
        p.dst_sss = dst->scale_section_stride;
    }
    p.src_nb = src->num_blocks;
    p.dst_nb = dst->num_blocks;
    p.tpb = src->tokens_per_block;
    p.heads = src->num_kv_heads;
    p.dim = src->head_dim;
    p.ebytes = kvk_elem_bytes(src->dtype);
    p.dtype = src->dtype;
    p.slots = src_slots;
    p.dblk = dst_blocks;
    rc = pre_launch("compact_tokens");
    if (rc != KV_OK) {
        return rc;
    }
    compact_kernel<<<dim3(nkept, src->num_sections), 128, 0, as_stream(stream)>>>(p);
    return launched("compact_tokens");
}

extern "C" size_t kvk_token_scores_workspace_bytes(uint32_t nq, uint32_t num_qo_heads) {
    return (size_t)nq * num_qo_heads * 2 * sizeof(float);
}

extern "C" kv_err kvk_token_scores_cuda(const kvk_cache *cache, uint32_t layer,
                                        const int32_t *pages, uint32_t ntokens,
                                        const kvk_score_args *a, float *scores, void *workspace,
                                        size_t workspace_bytes, void *stream) {
    kv_err rc = kvk__check_scores(cache, layer, pages, ntokens, a, scores);
    if (rc != KV_OK) {
        return rc;
    }
    if (workspace == nullptr ||
        workspace_bytes < kvk_token_scores_workspace_bytes(a->nq, a->num_qo_heads)) {
        return kvk__fail(KV_EINVAL, "token_scores_cuda: workspace of %zu bytes; %zu needed",
                         workspace_bytes, kvk_token_scores_workspace_bytes(a->nq, a->num_qo_heads));
    }
    if (!scales_aligned(cache) || ((uintptr_t)workspace & 3u) != 0 ||
        ((uintptr_t)scores & 3u) != 0) {
        return kvk__fail(KV_EINVAL, "token_scores_cuda: scales, workspace or scores misaligned");
    }
    ScoreParams p = {};
    p.data = reinterpret_cast<const char *>(cache->data);
    p.bs = cache->block_stride;
    p.ss = cache->section_stride;
    if (kvk__is_scaled(cache->dtype)) {
        p.sc = reinterpret_cast<const char *>(cache->scales);
        p.sbs = cache->scale_block_stride;
        p.sss = cache->scale_section_stride;
    }
    p.dtype = cache->dtype;
    p.sec = layer * 2;
    p.tpb = cache->tokens_per_block;
    p.kv_heads = cache->num_kv_heads;
    p.dim = cache->head_dim;
    p.num_blocks = cache->num_blocks;
    p.pages = pages;
    p.ntokens = ntokens;
    p.q = a->q;
    p.q_dtype = a->q_dtype;
    p.nq = a->nq;
    p.qo_heads = a->num_qo_heads;
    p.sm_scale = a->sm_scale;
    p.w = 1.0f / ((float)a->nq * (float)a->num_qo_heads);
    p.causal = a->causal;
    p.ws = static_cast<float *>(workspace);
    p.scores = scores;
    rc = pre_launch("token_scores");
    if (rc != KV_OK) {
        return rc;
    }
    cudaStream_t st = as_stream(stream);
    score_stats_kernel<<<dim3(a->nq, a->num_qo_heads), 256, 0, st>>>(p);
    rc = launched("token_scores");
    if (rc != KV_OK) {
        return rc;
    }
    score_sum_kernel<<<(ntokens + 127) / 128, 128, 0, st>>>(p);
    return launched("token_scores");
}

extern "C" kv_err kvk_page_summaries_cuda(const kvk_cache *cache, const int32_t *blocks,
                                          const uint32_t *ntok, uint32_t n, float *out,
                                          void *stream) {
    kv_err rc = kvk__check_summaries(cache, blocks, n, out);
    if (rc != KV_OK || n == 0) {
        return rc;
    }
    SummParams p = {};
    p.data = reinterpret_cast<const char *>(cache->data);
    p.bs = cache->block_stride;
    p.ss = cache->section_stride;
    if (kvk__is_scaled(cache->dtype)) {
        p.sc = reinterpret_cast<const char *>(cache->scales);
        p.sbs = cache->scale_block_stride;
        p.sss = cache->scale_section_stride;
    }
    p.dtype = cache->dtype;
    p.layers = cache->num_sections / 2;
    p.heads = cache->num_kv_heads;
    p.dim = cache->head_dim;
    p.tpb = cache->tokens_per_block;
    p.num_blocks = cache->num_blocks;
    p.n = n;
    p.blocks = blocks;
    p.ntok = ntok;
    p.out = out;
    if ((uint64_t)p.layers * p.heads > 65535) {
        return kvk__fail(KV_ENOTSUP, "page_summaries_cuda: more than 65535 (layer, head) pairs");
    }
    rc = pre_launch("page_summaries");
    if (rc != KV_OK) {
        return rc;
    }
    summ_kernel<<<dim3(n, p.layers * p.heads), 128, 0, as_stream(stream)>>>(p);
    return launched("page_summaries");
}

extern "C" kv_err kvk_page_select_cuda(const kvk_select_args *a, int32_t *out, float *score,
                                       void *stream) {
    kv_err rc = kvk__check_select(a, out);
    if (rc != KV_OK) {
        return rc;
    }
    if (score == nullptr) {
        return kvk__fail(KV_EINVAL, "page_select_cuda: score is the kernel's workspace");
    }
    SelParams p = {};
    p.summ = a->summaries;
    p.npages = a->npages;
    p.layers = a->num_layers;
    p.layer = a->layer;
    p.heads = a->num_kv_heads;
    p.dim = a->head_dim;
    p.qo_heads = a->num_qo_heads;
    p.k = a->k;
    p.mode = a->mode;
    p.q = a->q;
    p.out = out;
    p.score = score;
    rc = pre_launch("page_select");
    if (rc != KV_OK) {
        return rc;
    }
    select_kernel<<<a->num_kv_heads, 256, 0, as_stream(stream)>>>(p);
    return launched("page_select");
}
