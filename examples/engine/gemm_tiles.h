/* gemm_tiles: the vector micro-kernels of gemm.c, written once and compiled per instruction set:
 * gemm.c defines GT_FN (the target attribute), GT_NAME(x) (a suffix per set), GT_W (lanes),
 * GT_VEC, GT_ZERO, GT_LOAD, GT_FMA and GT_HSUM (the set's fixed lane reduction), then includes
 * this file, which defines tile_<set> and undefines them. Nothing else includes it.
 *
 * Every element's sum, whatever the tile: lanes accumulate i = GT_W j + lane by FMA in order of
 * j, GT_HSUM reduces them, then the tail i >= GT_W * (nin / GT_W) is added in order by scalar
 * FMA. The tiles spell that out with named registers (GCC keeps arrays of vectors in memory).
 */
#ifndef GT_NAME
#error "gemm_tiles.h is included by gemm.c only"
#endif

static inline __attribute__((always_inline)) GT_FN float
GT_NAME(finish)(GT_VEC acc, const float *w, const float *x, int i, int nin) {
    float s = GT_HSUM(acc);
    for (int j = i; j < nin; j++) {
        s = __builtin_fmaf(w[j], x[j], s);
    }
    return s;
}

/* R rows x C columns, R = 2, 3 or 4 and C = 3 or 6 (constants at every call, so the rows and
 * columns past them compile away): RC accumulators, C weight registers, x read as a memory
 * operand. Row tails of 2 or 3 thus read each weight once, as a full tile does. C = 6 is for
 * AVX-512, whose 32 registers hold 4 x 6 (10 loads for 24 FMAs where 4 x 3 has 7 for 12). */
static inline __attribute__((always_inline)) GT_FN void
GT_NAME(tile_rxc)(float *out, const float *x, const float *w, int nin, int nout, const int R,
                  const int C) {
    const float *w0 = w, *w1 = w + nin, *w2 = w + 2 * (size_t)nin;
    const float *w3 = C > 3 ? w + 3 * (size_t)nin : w, *w4 = C > 3 ? w + 4 * (size_t)nin : w;
    const float *w5 = C > 3 ? w + 5 * (size_t)nin : w;
    const float *x0 = x, *x1 = x + nin;
    const float *x2 = R > 2 ? x + 2 * (size_t)nin : x, *x3 = R > 3 ? x + 3 * (size_t)nin : x;
    GT_VEC a00 = GT_ZERO(), a01 = a00, a02 = a00, a03 = a00, a04 = a00, a05 = a00;
    GT_VEC a10 = a00, a11 = a00, a12 = a00, a13 = a00, a14 = a00, a15 = a00;
    GT_VEC a20 = a00, a21 = a00, a22 = a00, a23 = a00, a24 = a00, a25 = a00;
    GT_VEC a30 = a00, a31 = a00, a32 = a00, a33 = a00, a34 = a00, a35 = a00;
    int i = 0;
    for (; i + GT_W <= nin; i += GT_W) {
        GT_VEC v0 = GT_LOAD(w0 + i), v1 = GT_LOAD(w1 + i), v2 = GT_LOAD(w2 + i), xv;
        GT_VEC v3 = v0, v4 = v0, v5 = v0;
        if (C > 3) {
            v3 = GT_LOAD(w3 + i), v4 = GT_LOAD(w4 + i), v5 = GT_LOAD(w5 + i);
        }
#define GT_ROW(r, xr)                                                                              \
    do {                                                                                           \
        xv = GT_LOAD(xr + i);                                                                      \
        a##r##0 = GT_FMA(v0, xv, a##r##0), a##r##1 = GT_FMA(v1, xv, a##r##1);                      \
        a##r##2 = GT_FMA(v2, xv, a##r##2);                                                         \
        if (C > 3) {                                                                               \
            a##r##3 = GT_FMA(v3, xv, a##r##3), a##r##4 = GT_FMA(v4, xv, a##r##4);                  \
            a##r##5 = GT_FMA(v5, xv, a##r##5);                                                     \
        }                                                                                          \
    } while (0)
        GT_ROW(0, x0);
        GT_ROW(1, x1);
        if (R > 2) {
            GT_ROW(2, x2);
        }
        if (R > 3) {
            GT_ROW(3, x3);
        }
#undef GT_ROW
    }
#define GT_OUT(r, xr)                                                                              \
    do {                                                                                           \
        float *o = out + (size_t)(r)*nout;                                                         \
        o[0] = GT_NAME(finish)(a##r##0, w0, xr, i, nin);                                           \
        o[1] = GT_NAME(finish)(a##r##1, w1, xr, i, nin);                                           \
        o[2] = GT_NAME(finish)(a##r##2, w2, xr, i, nin);                                           \
        if (C > 3) {                                                                               \
            o[3] = GT_NAME(finish)(a##r##3, w3, xr, i, nin);                                       \
            o[4] = GT_NAME(finish)(a##r##4, w4, xr, i, nin);                                       \
            o[5] = GT_NAME(finish)(a##r##5, w5, xr, i, nin);                                       \
        }                                                                                          \
    } while (0)
    GT_OUT(0, x0);
    GT_OUT(1, x1);
    if (R > 2) {
        GT_OUT(2, x2);
    }
    if (R > 3) {
        GT_OUT(3, x3);
    }
#undef GT_OUT
}

/* The three shapes as functions of their own: each carries the target attribute, which a
 * caller without it needs to call into the always-inline kernel. */
static GT_FN void GT_NAME(tile_4x3)(float *out, const float *x, const float *w, int nin, int nout) {
    GT_NAME(tile_rxc)(out, x, w, nin, nout, 4, 3);
}

static GT_FN void GT_NAME(tile_3x3)(float *out, const float *x, const float *w, int nin, int nout) {
    GT_NAME(tile_rxc)(out, x, w, nin, nout, 3, 3);
}

static GT_FN void GT_NAME(tile_2x3)(float *out, const float *x, const float *w, int nin, int nout) {
    GT_NAME(tile_rxc)(out, x, w, nin, nout, 2, 3);
}

/* 1 row x 3 columns (one-row decode steps). */
static GT_FN void GT_NAME(tile_1x3)(float *out, const float *x, const float *w, int nin) {
    const float *w0 = w, *w1 = w + nin, *w2 = w + 2 * (size_t)nin;
    GT_VEC a0 = GT_ZERO(), a1 = a0, a2 = a0;
    int i = 0;
    for (; i + GT_W <= nin; i += GT_W) {
        GT_VEC xv = GT_LOAD(x + i);
        a0 = GT_FMA(GT_LOAD(w0 + i), xv, a0);
        a1 = GT_FMA(GT_LOAD(w1 + i), xv, a1);
        a2 = GT_FMA(GT_LOAD(w2 + i), xv, a2);
    }
    out[0] = GT_NAME(finish)(a0, w0, x, i, nin);
    out[1] = GT_NAME(finish)(a1, w1, x, i, nin);
    out[2] = GT_NAME(finish)(a2, w2, x, i, nin);
}

/* 1 x 1 (column tails). */
static GT_FN void GT_NAME(tile_1x1)(float *out, const float *x, const float *w, int nin) {
    GT_VEC a = GT_ZERO();
    int i = 0;
    for (; i + GT_W <= nin; i += GT_W) {
        a = GT_FMA(GT_LOAD(w + i), GT_LOAD(x + i), a);
    }
    out[0] = GT_NAME(finish)(a, w, x, i, nin);
}

#if GT_W == 16
static GT_FN void GT_NAME(tile_4x6)(float *out, const float *x, const float *w, int nin, int nout) {
    GT_NAME(tile_rxc)(out, x, w, nin, nout, 4, 6);
}

static GT_FN void GT_NAME(tile_3x6)(float *out, const float *x, const float *w, int nin, int nout) {
    GT_NAME(tile_rxc)(out, x, w, nin, nout, 3, 6);
}

static GT_FN void GT_NAME(tile_2x6)(float *out, const float *x, const float *w, int nin, int nout) {
    GT_NAME(tile_rxc)(out, x, w, nin, nout, 2, 6);
}
#endif

/* R rows x C <= 3 columns: a row tail of 2 or 3 reads the weights once, as a full tile. */
static void GT_NAME(tile3)(float *out, const float *x, const float *w, int nin, int nout, int R,
                           int C) {
    if (C == TILE_C && R > 1) {
        if (R == TILE_R) {
            GT_NAME(tile_4x3)(out, x, w, nin, nout);
        } else if (R == 3) {
            GT_NAME(tile_3x3)(out, x, w, nin, nout);
        } else {
            GT_NAME(tile_2x3)(out, x, w, nin, nout);
        }
        return;
    }
    for (int r = 0; r < R; r++) {
        const float *xr = x + (size_t)r * nin;
        float *o = out + (size_t)r * nout;
        if (C == TILE_C) {
            GT_NAME(tile_1x3)(o, xr, w, nin);
            continue;
        }
        for (int c = 0; c < C; c++) {
            GT_NAME(tile_1x1)(o + c, xr, w + (size_t)c * nin, nin);
        }
    }
}

/* The tile_fn of this set: C <= 3 columns (AVX2), or <= 6 (AVX-512, span_for in gemm.c). */
static void GT_NAME(tile)(float *out, const float *x, const float *w, int nin, int nout, int R,
                          int C) {
#if GT_W == 16
    if (C == 2 * TILE_C && R > 1) {
        if (R == TILE_R) {
            GT_NAME(tile_4x6)(out, x, w, nin, nout);
        } else if (R == 3) {
            GT_NAME(tile_3x6)(out, x, w, nin, nout);
        } else {
            GT_NAME(tile_2x6)(out, x, w, nin, nout);
        }
        return;
    }
#endif
    for (int c = 0; c < C; c += TILE_C) {
        GT_NAME(tile3)
        (out + c, x, w + (size_t)c * nin, nin, nout, R, C - c < TILE_C ? C - c : TILE_C);
    }
}

#undef GT_FN
#undef GT_NAME
#undef GT_W
#undef GT_VEC
#undef GT_ZERO
#undef GT_LOAD
#undef GT_FMA
#undef GT_HSUM
