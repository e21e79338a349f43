/* dwconv_3x3: depthwise 3x3 convolution, pad 1, stride 1 or 2, fp32, with a fused bias and activation.
 *   Y[oy,ox,c] = act(bias[c] + sum_{ky,kx} X[oy*S-1+ky, ox*S-1+kx, c] * Wt[ky,kx,c])   (X is 0 outside)
 * Layouts: X NHWC [H,W,C], Wt [3,3,C], Y NHWC [Ho,Wo,C], Ho = (H-1)/S + 1, Wo = (W-1)/S + 1.
 * dims: H, W, C, stride. bufs: X, Wt, bias, Y.
 *
 * Register tiles of RT output rows x WT output pixels x CV channel vectors. Each input row a tile touches is
 * loaded once and feeds every output row of the tile it belongs to (RT > 1 reuses input rows when stride is 1).
 * Border pixels (first/last output columns) run one-pixel tiles with clamped kx; out-of-range input rows are
 * skipped. Remainders reuse the full tile: the last pixel tile of a row and the last channel tile are shifted
 * back to end at the edge (recomputing a few outputs), and a last row tile stores only the rows that exist.
 * Channels past the last full vector run a scalar tail.
 * Knobs: CV channel vectors per tile, WT output pixels per tile, RT output rows per tile, VEC floats per vector,
 * ORDER (c_outer: a channel tile sweeps the whole row, so its 9 weight vectors stay hot; px_outer: a pixel tile
 * sweeps all channels, so input lines are read contiguously), PREFETCH distance in pixel tiles ahead along the
 * row (0 = off), THREADS over row tiles.
 */
#ifndef ET_CV
#define ET_CV 2
#endif
#ifndef ET_WT
#define ET_WT 4
#endif
#ifndef ET_RT
#define ET_RT 1
#endif
#if !defined(ET_ORDER_C_OUTER) && !defined(ET_ORDER_PX_OUTER)
#define ET_ORDER_C_OUTER
#endif
#define ET_EPILOGUE
#include "edgetune_kernel.h"

#if ET_WT < 1 || ET_WT > 8
#error "ET_WT must be in 1..8"
#endif
#if ET_RT < 1 || ET_RT > 4
#error "ET_RT must be in 1..4"
#endif

#define WT_MAX 8

/* ET_RT output rows from oy0 (only the first nrows are stored) x P output pixels from ox0 x ET_CV vectors from
 * channel c0. kx in [kx0, kx1) are the in-range taps (P == 1 whenever they are clamped); input rows outside
 * [0, H) are skipped. */
ET_INLINE void tile(const float *X, const float *Wt, const float *bias, float *Y, int64_t H, int64_t W, int64_t C,
                    int64_t Wo, int64_t oy0, int64_t nrows, int64_t ox0, const int P, int64_t c0, const int S, int kx0,
                    int kx1, int act) {
    et_vf acc[ET_RT][WT_MAX][ET_CV];
    ET_PRAGMA_UNROLL(4)
    for (int r = 0; r < ET_RT; r++)
        ET_PRAGMA_UNROLL(8)
        for (int p = 0; p < P; p++)
            ET_PRAGMA_UNROLL(4)
            for (int v = 0; v < ET_CV; v++) acc[r][p][v] = et_load(bias + c0 + v * ET_VEC);
    const int64_t iy0 = oy0 * S - 1, ix0 = ox0 * S - 1, xs = (int64_t)S * C;
    ET_PRAGMA_UNROLL(10)
    for (int j = 0; j < (ET_RT - 1) * S + 3; j++) { /* input rows of the tile */
        const int64_t iy = iy0 + j;
        if (iy < 0 || iy >= H) continue;
        for (int kx = kx0; kx < kx1; kx++) {
            const float *x = X + (iy * W + ix0 + kx) * C + c0;
#if ET_PREFETCH > 0
            for (int v = 0; v < ET_CV * ET_VEC; v += 16) __builtin_prefetch(x + ET_PREFETCH * P * xs + v, 0, 3);
#endif
            et_vf w[ET_RT][ET_CV];
            ET_PRAGMA_UNROLL(4)
            for (int r = 0; r < ET_RT; r++) {
                const int ky = j - r * S;
                ET_PRAGMA_UNROLL(4)
                for (int v = 0; v < ET_CV; v++)
                    w[r][v] = ky >= 0 && ky < 3 ? et_load(Wt + (ky * 3 + kx) * C + c0 + v * ET_VEC) : et_splat(0.0f);
            }
            ET_PRAGMA_UNROLL(8)
            for (int p = 0; p < P; p++)
                ET_PRAGMA_UNROLL(4)
                for (int v = 0; v < ET_CV; v++) {
                    const et_vf xv = et_load(x + p * xs + v * ET_VEC);
                    ET_PRAGMA_UNROLL(4)
                    for (int r = 0; r < ET_RT; r++) {
                        const int ky = j - r * S;
                        if (ky >= 0 && ky < 3) acc[r][p][v] += xv * w[r][v];
                    }
                }
        }
    }
    ET_PRAGMA_UNROLL(4)
    for (int r = 0; r < ET_RT; r++)
        if (r < nrows)
            ET_PRAGMA_UNROLL(8)
            for (int p = 0; p < P; p++)
                ET_PRAGMA_UNROLL(4)
                for (int v = 0; v < ET_CV; v++)
                    et_store(Y + ((oy0 + r) * Wo + ox0 + p) * C + c0 + v * ET_VEC, et_activate(acc[r][p][v], act));
}

/* Channels [c1, C), for nrows rows from oy0: scalar (the channels that fill no vector, or every channel when C
 * holds fewer than ET_CV vectors). */
static void scalar_part(const float *X, const float *Wt, const float *bias, float *Y, int64_t H, int64_t W, int64_t C,
                        int64_t Wo, int64_t oy0, int64_t nrows, int64_t c1, int S, int act) {
    for (int64_t oy = oy0; oy < oy0 + nrows; oy++) {
        const int64_t iy0 = oy * S - 1;
        for (int64_t ox = 0; ox < Wo; ox++) {
            const int64_t ix0 = ox * S - 1;
            for (int64_t c = c1; c < C; c++) {
                float s = bias[c];
                for (int ky = 0; ky < 3; ky++) {
                    const int64_t iy = iy0 + ky;
                    if (iy < 0 || iy >= H) continue;
                    for (int kx = 0; kx < 3; kx++) {
                        const int64_t ix = ix0 + kx;
                        if (ix < 0 || ix >= W) continue;
                        s += X[(iy * W + ix) * C + c] * Wt[(ky * 3 + kx) * C + c];
                    }
                }
                Y[(oy * Wo + ox) * C + c] = et_activate1(s, act);
            }
        }
    }
}

/* Every pixel tile of a row: DO(ox, P, kx0, kx1). The left border pixel and the right border run [hi, Wo) get
 * one-pixel tiles with clamped taps. The interior run [lo, hi) gets WT-pixel tiles, the last one shifted left to
 * end at hi (it recomputes a few pixels rather than needing a remainder tile); a run shorter than WT gets
 * one-pixel tiles. */
#define BORDER(DO, ox)                                                                                       \
    do {                                                                                                     \
        const int64_t ix0_ = (ox) * S - 1;                                                                   \
        DO((ox), 1, ix0_ < 0 ? (int)-ix0_ : 0, W - ix0_ < 3 ? (int)(W - ix0_) : 3);                          \
    } while (0)
#define PIXEL_TILES(DO)                                                                                      \
    do {                                                                                                     \
        for (int64_t ox = 0; ox < lo; ox++) BORDER(DO, ox);                                                  \
        if (hi - lo >= ET_WT)                                                                                \
            for (int64_t ox = lo; ox < hi; ox += ET_WT) DO(ox + ET_WT <= hi ? ox : hi - ET_WT, ET_WT, 0, 3);  \
        else                                                                                                 \
            for (int64_t ox = lo; ox < hi; ox++) BORDER(DO, ox);                                             \
        for (int64_t ox = hi; ox < Wo; ox++) BORDER(DO, ox);                                                 \
    } while (0)
/* Channel tiles of ET_CV vectors; the last is shifted down to end at vector nv (nv >= ET_CV here). */
#define CHANNEL_TILES(DO)                                                                                    \
    do {                                                                                                     \
        for (int64_t v = 0; v < nv; v += ET_CV) DO((v + ET_CV <= nv ? v : nv - ET_CV) * ET_VEC);             \
    } while (0)

ET_INLINE void row_tile(const float *X, const float *Wt, const float *bias, float *Y, int64_t H, int64_t W, int64_t C,
                        int64_t Wo, int64_t oy0, int64_t nrows, int64_t lo, int64_t hi, int64_t nv, const int S,
                        int act) {
#ifdef ET_ORDER_C_OUTER
#define PX(ox, P, kx0, kx1) tile(X, Wt, bias, Y, H, W, C, Wo, oy0, nrows, ox, P, c0, S, kx0, kx1, act)
#define CH(c0_)                                                                                              \
    do {                                                                                                     \
        const int64_t c0 = (c0_);                                                                            \
        PIXEL_TILES(PX);                                                                                     \
    } while (0)
    CHANNEL_TILES(CH);
#else
#define CH(c0) tile(X, Wt, bias, Y, H, W, C, Wo, oy0, nrows, ox_, P_, c0, S, kx0_, kx1_, act)
#define PX(ox, P, kx0, kx1)                                                                                  \
    do {                                                                                                     \
        const int64_t ox_ = (ox);                                                                            \
        const int P_ = (P), kx0_ = (kx0), kx1_ = (kx1);                                                      \
        CHANNEL_TILES(CH);                                                                                   \
    } while (0)
    PIXEL_TILES(PX);
#endif
#undef PX
#undef CH
}

typedef struct {
    const float *X, *Wt, *bias;
    float *Y;
    int64_t H, W, C, Ho, Wo, nv, c1, lo, hi;
    int act;
} dw_args;

/* Row tile t: ET_RT output rows, vector channels then the scalar rest. */
ET_INLINE void dw_item(const dw_args *a, int64_t t, const int S) {
    const int64_t oy0 = t * ET_RT, nrows = a->Ho - oy0 < ET_RT ? a->Ho - oy0 : ET_RT;
    if (a->c1 > 0)
        row_tile(a->X, a->Wt, a->bias, a->Y, a->H, a->W, a->C, a->Wo, oy0, nrows, a->lo, a->hi, a->nv, S, a->act);
    if (a->c1 < a->C) scalar_part(a->X, a->Wt, a->bias, a->Y, a->H, a->W, a->C, a->Wo, oy0, nrows, a->c1, S, a->act);
}
static void dw_item_s1(void *a, int64_t t) { dw_item(a, t, 1); }
static void dw_item_s2(void *a, int64_t t) { dw_item(a, t, 2); }

static int et_kernel(const int64_t *dims, float *const *bufs, const float *packed, int act) {
    (void)packed;
    const int64_t H = dims[0], W = dims[1], C = dims[2], S = dims[3];
    if (H < 1 || W < 1 || C < 1) return 1;
    if (S != 1 && S != 2) return 2;
    const int64_t Wo = (W - 1) / S + 1, nv = C / ET_VEC; /* full channel vectors */
    /* interior output columns [lo, hi): ox*S-1 >= 0 and ox*S+1 <= W-1 */
    const int64_t lo = 1;
    int64_t hi = W >= 2 ? (W - 2) / S + 1 : 0;
    if (hi > Wo) hi = Wo;
    if (hi < lo) hi = lo;
    dw_args a = {bufs[0], bufs[1], bufs[2], bufs[3], H, W, C, (H - 1) / S + 1, Wo, nv,
                 nv >= ET_CV ? nv * ET_VEC : 0 /* [c1, C) runs scalar */, lo, hi, act};
    const int64_t ntiles = (a.Ho + ET_RT - 1) / ET_RT;
#if !defined(ET_SHAPE_STRIDE) || ET_SHAPE_STRIDE == 1 /* a build for one workload instantiates its stride only */
    if (S == 1) return et_parallel_for(ntiles, dw_item_s1, &a);
#endif
#if !defined(ET_SHAPE_STRIDE) || ET_SHAPE_STRIDE == 2
    if (S == 2) return et_parallel_for(ntiles, dw_item_s2, &a);
#endif
    return 2; /* unsupported stride, or not the one this build was specialised to */
}
