/* dwconv_3x3: depthwise 3x3 convolution, pad 1, stride 1 or 2, fp32, with a fused bias and activation.
 *   Y[oy,ox,c] = act(B[c] + sum_{ky,kx} X[oy*S-1+ky, ox*S-1+kx, c] * Wt[ky,kx,c])   (out-of-range X reads as 0)
 * Layouts: X NHWC [H,W,C], Wt [3,3,C], B [C], Y NHWC [Ho,Wo,C], Ho = (H-1)/S + 1, Wo = (W-1)/S + 1.
 * dims: H, W, C, stride. bufs: X, Wt, B, Y.
 *
 * Channels are cut into tiles of CV vectors (CT = CV*VEC channels); the last tile is shifted back to end at C,
 * recomputing a few channels, so every channel runs vector code (a C below CT runs one-vector tiles, a C below
 * VEC scalar code). et_pack lays each tile's bias and 9 taps out as one panel [bias, tap 0..8][CT].
 * A register tile is RT output rows x WT output pixels x CV vectors. It walks the (RT-1)*S+3 input rows and the
 * (WT-1)*S+3 input columns it covers, loading each input vector once and adding it into every output of the tile
 * that uses it (up to 9 at stride 1), with the tile's 9*CV tap vectors held in registers: input reuse across
 * rows and columns at stride 1 and 2 alike. Only the first and last pixel tiles of a row check which input
 * columns exist; input rows outside [0, H) are skipped; the last pixel tile of a row is shifted back to end at
 * Wo, and a row tile past Ho stores only its rows that exist. The activation is a clamp to [lo, hi] on the store
 * (XNNPACK's min/max), so one instantiation serves all three.
 * Knobs: CV channel vectors per tile, WT output pixels per tile, RT output rows per tile, VEC floats per vector,
 * ORDER of the work items (rows: a row tile runs every channel tile; channels: a channel tile runs every row tile,
 * so its input rows are reused from L1 by the next row tile; pixels: a row tile runs each pixel tile across all
 * channels, reading input pixels contiguously, taps reloaded per tile), PREFETCH: each tile prefetches into L2 the
 * input rows that the row tile PREFETCH tiles below starts on (0 = off), THREADS over the work items.
 * A build for one workload bakes in its stride, C and W (-DET_SHAPE_*), and compiles only the paths that shape
 * takes (one stride; scalar, one-vector or CV-vector channel tiles; rows narrower than WT or not): the fully
 * unrolled tiles are most of a compile, which this cuts to about 0.55x. Such a build returns 2 for any other shape.
 */
#ifndef ET_CV
#define ET_CV 2
#endif
#ifndef ET_WT
#define ET_WT 3
#endif
#ifndef ET_RT
#define ET_RT 2
#endif
#if !defined(ET_ORDER_ROWS) && !defined(ET_ORDER_CHANNELS) && !defined(ET_ORDER_PIXELS)
#define ET_ORDER_PIXELS
#endif
#define ET_EPILOGUE
#define ET_PACKS
#include <math.h>

#include "edgetune_kernel.h"

#if ET_CV < 1 || ET_CV > 4
#error "ET_CV must be in 1..4"
#endif
#if ET_WT < 1 || ET_WT > 8
#error "ET_WT must be in 1..8"
#endif
#if ET_RT < 1 || ET_RT > 4
#error "ET_RT must be in 1..4"
#endif

#define CT (ET_CV * ET_VEC)
/* DW_REG(x): x lives in a register from here on. Without it GCC folds the input load into every FMA that uses the
 * vector (x86 FMAs take a memory operand), loading it up to 9 times instead of once. */
#if (defined(__x86_64__) || defined(__i386__)) &&                                                                    \
    (defined(__AVX512F__) || (defined(__AVX__) && ET_VEC <= 8) || ET_VEC <= 4)
#define DW_REG(x) __asm__("" : "+v"(x))
#else
#define DW_REG(x) ((void)0)
#endif
#define UNROLL_ALL ET_PRAGMA_UNROLL(32)
/* Whether rows narrower than WT pixels occur: not in a build for one width with at least WT output pixels. */
#if defined(ET_SHAPE_W) && defined(ET_SHAPE_STRIDE) && (ET_SHAPE_W - 1) / ET_SHAPE_STRIDE + 1 >= ET_WT
#define NARROW_ROWS 0
#else
#define NARROW_ROWS 1
#endif

/* The channel tiling for C: tiles of `width` channels (CT, else VEC, else C for the scalar path); tile k starts at
 * min(k * width, C - width). */
typedef struct {
    int64_t width, n;
} ctiles;
static inline ctiles channel_tiles(int64_t C) {
    const int64_t w = C >= CT ? CT : C >= ET_VEC ? ET_VEC : C;
    return (ctiles){w, (C + w - 1) / w};
}
static inline int64_t tile_start(ctiles t, int64_t C, int64_t k) {
    return k * t.width + t.width <= C ? k * t.width : C - t.width;
}

static int64_t et_kernel_packed_floats(const int64_t *dims) {
    const ctiles t = channel_tiles(dims[2]);
    return t.n * 10 * t.width;
}

/* Panel k: [bias][tap 0]..[tap 8], each `width` floats of the channels from tile_start(k). */
static int et_kernel_pack(const int64_t *dims, float *const *bufs, float *packed) {
    const int64_t C = dims[2];
    const ctiles t = channel_tiles(C);
    const float *Wt = bufs[1], *B = bufs[2];
    for (int64_t k = 0; k < t.n; k++) {
        const int64_t c0 = tile_start(t, C, k);
        float *p = packed + k * 10 * t.width;
        memcpy(p, B + c0, sizeof(float) * t.width);
        for (int tap = 0; tap < 9; tap++) memcpy(p + (1 + tap) * t.width, Wt + tap * C + c0, sizeof(float) * t.width);
    }
    return 0;
}

typedef struct {
    const float *X, *packed;
    float *Y;
    int64_t H, W, C, Ho, Wo, nrt, nct, last_interior;
    ctiles ct;
    et_vf lo, hi; /* the activation as a clamp: [-inf, inf], [0, inf] or [0, 6] */
    int act;
} dw_args;

/* Output rows oy0.. (the first nrows stored) x P pixels from ox0 x NV vectors from channel c0, taps w[9][NV] and
 * bias b[NV] in registers. EDGE: some input columns of the tile may lie outside [0, W). */
ET_INLINE void tile(const dw_args *a, const et_vf *w, const et_vf *b, int64_t oy0, int64_t nrows, int64_t ox0,
                    int64_t c0, const int S, const int RT, const int P, const int NV, const int EDGE) {
    et_vf acc[ET_RT][ET_WT][ET_CV];
    UNROLL_ALL
    for (int r = 0; r < RT; r++)
        UNROLL_ALL
        for (int p = 0; p < P; p++)
            UNROLL_ALL
            for (int v = 0; v < NV; v++) acc[r][p][v] = b[v];
    const int64_t W = a->W, C = a->C, iy0 = oy0 * S - 1, ix0 = ox0 * S - 1;
    UNROLL_ALL
    for (int j = 0; j < (RT - 1) * S + 3; j++) {
        const int64_t iy = iy0 + j;
        if (iy < 0 || iy >= a->H) continue;
        const float *xrow = a->X + (iy * W + ix0) * C + c0;
        UNROLL_ALL
        for (int q = 0; q < (P - 1) * S + 3; q++) {
            if (EDGE && (ix0 + q < 0 || ix0 + q >= W)) continue;
            UNROLL_ALL
            for (int v = 0; v < NV; v++) {
                et_vf x = et_load(xrow + q * C + v * ET_VEC);
                DW_REG(x);
                UNROLL_ALL
                for (int r = 0; r < RT; r++) {
                    const int ky = j - r * S;
                    if (ky < 0 || ky > 2) continue;
                    UNROLL_ALL
                    for (int p = 0; p < P; p++) {
                        const int kx = q - p * S;
                        if (kx < 0 || kx > 2) continue;
                        acc[r][p][v] += x * w[(ky * 3 + kx) * NV + v];
                    }
                }
            }
        }
    }
#if ET_PREFETCH > 0
    /* the input rows that the row tile PREFETCH tiles below reads first (into L2), same columns and channels */
    UNROLL_ALL
    for (int j = 0; j < RT * S; j++) {
        const int64_t iy = iy0 + (RT - 1) * S + 3 + (ET_PREFETCH - 1) * RT * S + j;
        if (iy >= a->H) break;
        const float *xrow = a->X + (iy * W + ix0) * C + c0;
        UNROLL_ALL
        for (int q = 0; q < (P - 1) * S + 3; q++)
            UNROLL_ALL
            for (int v = 0; v < NV * ET_VEC; v += 64 / sizeof(float)) __builtin_prefetch(xrow + q * C + v, 0, 2);
    }
#endif
    UNROLL_ALL
    for (int r = 0; r < RT; r++) {
        if (r >= nrows) break;
        float *y = a->Y + ((oy0 + r) * a->Wo + ox0) * C + c0;
        UNROLL_ALL
        for (int p = 0; p < P; p++)
            UNROLL_ALL
            for (int v = 0; v < NV; v++) et_store(y + p * C + v * ET_VEC, et_min(et_max(acc[r][p][v], a->lo), a->hi));
    }
}

ET_INLINE void load_panel(const float *panel, et_vf *w, et_vf *b, const int NV) {
    UNROLL_ALL
    for (int v = 0; v < NV; v++) {
        b[v] = et_load(panel + v * ET_VEC);
        UNROLL_ALL
        for (int t = 0; t < 9; t++) w[t * NV + v] = et_load(panel + (1 + t) * NV * ET_VEC + v * ET_VEC);
    }
}

/* DO(ox, P, EDGE) for every pixel tile of a row: WT-pixel tiles, the first and the last (shifted back to end at
 * Wo) checking which of their input columns exist; one-pixel tiles when the row is narrower than WT. */
#define PIXEL_TILES(a, DO)                                                                                            \
    do {                                                                                                              \
        if (NARROW_ROWS && (a)->Wo < ET_WT) {                                                                         \
            for (int64_t ox_ = 0; ox_ < (a)->Wo; ox_++) DO(ox_, 1, 1);                                                \
            break;                                                                                                    \
        }                                                                                                             \
        DO(0, ET_WT, 1);                                                                                              \
        int64_t ox_ = ET_WT;                                                                                          \
        for (; ox_ <= (a)->last_interior; ox_ += ET_WT) DO(ox_, ET_WT, 0);                                            \
        if (ox_ < (a)->Wo) DO((a)->Wo - ET_WT, ET_WT, 1);                                                             \
    } while (0)

/* One row tile: every pixel tile of one channel tile (its taps loaded once), or (ORDER_PIXELS) every channel tile
 * of each pixel tile in turn. */
ET_INLINE void row_tile(const dw_args *a, int64_t oy0, int64_t nrows, int64_t k, const int S, const int NV) {
    et_vf w[9 * ET_CV], b[ET_CV];
#ifdef ET_ORDER_PIXELS
    (void)k;
#define DO(ox, P, EDGE)                                                                                               \
    for (int64_t k_ = 0; k_ < a->ct.n; k_++) {                                                                        \
        load_panel(a->packed + k_ * 10 * NV * ET_VEC, w, b, NV);                                                      \
        tile(a, w, b, oy0, nrows, ox, tile_start(a->ct, a->C, k_), S, ET_RT, P, NV, EDGE);                       \
    }
#else
    load_panel(a->packed + k * 10 * NV * ET_VEC, w, b, NV);
    const int64_t c0 = tile_start(a->ct, a->C, k);
#define DO(ox, P, EDGE) tile(a, w, b, oy0, nrows, ox, c0, S, ET_RT, P, NV, EDGE)
#endif
    PIXEL_TILES(a, DO);
#undef DO
}

/* Channels below VEC: scalar, panel of C channels. */
static void scalar_rows(const dw_args *a, int64_t oy0, int64_t nrows, int S) {
    const int64_t H = a->H, W = a->W, C = a->C;
    const float *bias = a->packed, *wt = a->packed + C;
    for (int64_t oy = oy0; oy < oy0 + nrows; oy++)
        for (int64_t ox = 0; ox < a->Wo; ox++)
            for (int64_t c = 0; c < C; c++) {
                float s = bias[c];
                for (int ky = 0; ky < 3; ky++)
                    for (int kx = 0; kx < 3; kx++) {
                        const int64_t iy = oy * S - 1 + ky, ix = ox * S - 1 + kx;
                        if (iy >= 0 && iy < H && ix >= 0 && ix < W)
                            s += a->X[(iy * W + ix) * C + c] * wt[(ky * 3 + kx) * C + c];
                    }
                a->Y[(oy * a->Wo + ox) * C + c] = et_activate1(s, a->act);
            }
}

/* One work item: (row tile, channel tile) in the ORDER knob's sequence, or a whole row tile (ORDER_PIXELS). */
ET_INLINE void item(const dw_args *shared, int64_t i, const int S) {
    const dw_args local = *shared, *a = &local; /* a private copy: the output stores cannot alias it */
#ifdef ET_ORDER_CHANNELS
    const int64_t rt = i % a->nrt, k = i / a->nrt;
#else
    const int64_t rt = i / a->nct, k = i % a->nct;
#endif
    const int64_t oy0 = rt * ET_RT, nrows = a->Ho - oy0 < ET_RT ? a->Ho - oy0 : ET_RT;
    const int64_t width = a->ct.width;
    (void)width;
#if !defined(ET_SHAPE_C) || ET_SHAPE_C < ET_VEC /* a build for one workload instantiates its channel path only */
    if (width < ET_VEC) return scalar_rows(a, oy0, nrows, S);
#endif
#if ET_CV > 1 && (!defined(ET_SHAPE_C) || (ET_SHAPE_C >= ET_VEC && ET_SHAPE_C < CT))
    if (width == ET_VEC) return row_tile(a, oy0, nrows, k, S, 1);
#endif
#if !defined(ET_SHAPE_C) || ET_SHAPE_C >= CT
    row_tile(a, oy0, nrows, k, S, ET_CV);
#endif
}

#if !defined(ET_SHAPE_STRIDE) || ET_SHAPE_STRIDE == 1 /* a build for one workload instantiates its stride only */
static void item_s1(void *a, int64_t i) { item(a, i, 1); }
#else
#define item_s1 NULL
#endif
#if !defined(ET_SHAPE_STRIDE) || ET_SHAPE_STRIDE == 2
static void item_s2(void *a, int64_t i) { item(a, i, 2); }
#else
#define item_s2 NULL
#endif

static int et_kernel(const int64_t *dims, float *const *bufs, const float *packed, int act) {
    const int64_t H = dims[0], W = dims[1], C = dims[2], S = dims[3];
    if (H < 1 || W < 1 || C < 1) return 1;
    if (S != 1 && S != 2) return 2;
    /* a build for one workload (ET_SHAPE_*) runs that shape's stride, channels and width only */
#ifdef ET_SHAPE_STRIDE
    if (S != ET_SHAPE_STRIDE) return 2;
#endif
#ifdef ET_SHAPE_C
    if (C != ET_SHAPE_C) return 2;
#endif
#ifdef ET_SHAPE_W
    if (W != ET_SHAPE_W) return 2;
#endif
    const int64_t Ho = (H - 1) / S + 1;
    const ctiles ct = channel_tiles(C);
    dw_args a = {.X = bufs[0], .packed = packed, .Y = bufs[3], .H = H, .W = W, .C = C, .Ho = Ho,
                 .Wo = (W - 1) / S + 1, .nrt = (Ho + ET_RT - 1) / ET_RT, .ct = ct, .act = act,
                 .lo = et_splat(act == ET_ACT_NONE ? -INFINITY : 0.0f),
                 .hi = et_splat(act == ET_ACT_RELU6 ? 6.0f : INFINITY),
                 /* the last pixel tile start whose input columns all exist: (ox + WT - 1) * S + 1 <= W - 1 */
                 .last_interior = (W - 2) / S - (ET_WT - 1)};
#ifdef ET_ORDER_PIXELS
    a.nct = 1; /* a row tile runs every channel tile */
#else
    a.nct = ct.width < ET_VEC ? 1 : ct.n;
#endif
    et_item_fn fn = S == 1 ? item_s1 : item_s2;
    return et_parallel_for(a.nrt * a.nct, fn, &a);
}
