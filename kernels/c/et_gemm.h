/* edgetune GEMM core: packed weight panels and an MR x NR register micro-kernel, shared by every kernel that is a
 * GEMM underneath (gemm; conv2d_3x3 and conv1d as implicit GEMMs). Include after edgetune_kernel.h.
 *
 * The kernel defines ET_MR (rows of a register tile), ET_NV (vectors per tile row; NR = NV * VEC columns) and
 * ET_UNROLL_K (unroll of the depth loop); ET_PREFETCH > 0 prefetches the weight panel that many depth steps ahead.
 *
 * Weights W [K][N] (a layer's constant input, row stride ldw) and bias [N] are packed once (et_pack) into panels of
 * NR columns, each [bias: NR][K rows: NR], zero past N, as XNNPACK packs its GEMM weights: a tile reads its panel
 * front to back, every load is a whole vector, and the bias is the accumulators' first value. The last panel's
 * padding makes edge columns the same vector code; only their store is partial (masked on AVX-512, a short copy
 * elsewhere).
 *
 * A tile is MR rows of the output (C rows as pointers) times one panel: etg_init_bias (or etg_init_c for a depth
 * block after the first), then etg_madd over runs of contiguous activations, one pointer per row and run (gemm:
 * the A row; conv1d: the K taps of one output step, contiguous in a time-major input; conv2d_3x3: per kernel row,
 * the 3 taps x Cin of one input row; near a border, one run per tap with out-of-range taps reading zeros), then
 * etg_store. Rows past the valid ones alias the last valid row (XNNPACK's trick), so a tile is always MR rows of
 * straight-line code and its duplicate stores write equal values. Pointers per row also make stride 2 free: no
 * gather pass, the rows just start further apart.
 */
#ifndef ET_GEMM_H
#define ET_GEMM_H

#if !defined(ET_MR) || !defined(ET_NV) || !defined(ET_UNROLL_K)
#error "et_gemm.h needs ET_MR, ET_NV and ET_UNROLL_K"
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define ETG_NR (ET_NV * ET_VEC)

static inline int64_t etg_panels(int64_t N) { return (N + ETG_NR - 1) / ETG_NR; }

/* Floats of the packed panels of a K x N weight matrix with its bias. */
static inline int64_t etg_packed_floats(int64_t K, int64_t N) { return etg_panels(N) * (K + 1) * ETG_NR; }

/* Pack W [K][N] (row stride ldw) and bias [N] (NULL: zeros) into panels (see the top of this file). */
static void etg_pack(const float *W, int64_t ldw, const float *bias, int64_t K, int64_t N, float *P) {
    for (int64_t n0 = 0; n0 < N; n0 += ETG_NR, P += (K + 1) * ETG_NR) {
        const int64_t n = N - n0 < ETG_NR ? N - n0 : ETG_NR;
        memset(P, 0, sizeof(float) * (K + 1) * ETG_NR);
        if (bias) memcpy(P, bias + n0, sizeof(float) * n);
        for (int64_t k = 0; k < K; k++) memcpy(P + (k + 1) * ETG_NR, W + k * ldw + n0, sizeof(float) * n);
    }
}

/* The first n lanes of v to p (0 < n <= ET_VEC). */
static inline void et_store_n(float *p, et_vf v, int64_t n) {
#if defined(__AVX512F__) && ET_VEC == 16
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), (__m512)v);
#elif defined(__AVX512VL__) && ET_VEC == 8
    _mm256_mask_storeu_ps(p, (__mmask8)((1u << n) - 1), (__m256)v);
#elif defined(__AVX512VL__) && ET_VEC == 4
    _mm_mask_storeu_ps(p, (__mmask8)((1u << n) - 1), (__m128)v);
#else
    float t[ET_VEC];
    et_store(t, v);
    memcpy(p, t, sizeof(float) * n);
#endif
}

/* The first n lanes from p, zero in the others (0 < n <= ET_VEC). */
static inline et_vf et_load_n(const float *p, int64_t n) {
#if defined(__AVX512F__) && ET_VEC == 16
    return (et_vf)_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
#else
    float t[ET_VEC] = {0};
    memcpy(t, p, sizeof(float) * n);
    return et_load(t);
#endif
}

/* One tile's accumulators: MR rows x NV vectors. */
typedef struct {
    et_vf v[ET_MR][ET_NV];
} etg_acc;

/* Start from the panel's bias. */
ET_INLINE void etg_init_bias(etg_acc *acc, const float *panel) {
    ET_PRAGMA_UNROLL(4)
    for (int j = 0; j < ET_NV; j++) {
        const et_vf b = et_load(panel + j * ET_VEC);
        ET_PRAGMA_UNROLL(16)
        for (int r = 0; r < ET_MR; r++) acc->v[r][j] = b;
    }
}

/* Start from partial sums in C (a depth block after the first); cols of the NR columns are real. */
ET_INLINE void etg_init_c(etg_acc *acc, float *const c[ET_MR], int64_t cols) {
    if (cols >= ETG_NR) {
        ET_PRAGMA_UNROLL(16)
        for (int r = 0; r < ET_MR; r++)
            ET_PRAGMA_UNROLL(4)
            for (int j = 0; j < ET_NV; j++) acc->v[r][j] = et_load(c[r] + j * ET_VEC);
        return;
    }
    ET_PRAGMA_UNROLL(16)
    for (int r = 0; r < ET_MR; r++)
        ET_PRAGMA_UNROLL(4)
        for (int j = 0; j < ET_NV; j++) {
            const int64_t n = cols - j * ET_VEC;
            acc->v[r][j] = n >= ET_VEC ? et_load(c[r] + j * ET_VEC) : n > 0 ? et_load_n(c[r] + j * ET_VEC, n)
                                                                          : et_splat(0.0f);
        }
}

/* acc[r] += a[r][0:kc] x w[0:kc][0:NR]: the micro-kernel. w is a panel's depth rows (NR floats each). */
ET_INLINE void etg_madd(etg_acc *acc, const float *const a[ET_MR], const float *w, int64_t kc) {
    const float *ar[ET_MR];
    ET_PRAGMA_UNROLL(16)
    for (int r = 0; r < ET_MR; r++) ar[r] = a[r];
    ET_PRAGMA_UNROLL(ET_UNROLL_K)
    for (int64_t k = 0; k < kc; k++) {
#if ET_PREFETCH > 0
        __builtin_prefetch(w + (k + ET_PREFETCH) * ETG_NR, 0, 3);
#endif
        et_vf b[ET_NV];
        ET_PRAGMA_UNROLL(4)
        for (int j = 0; j < ET_NV; j++) b[j] = et_load(w + k * ETG_NR + j * ET_VEC);
        ET_PRAGMA_UNROLL(16)
        for (int r = 0; r < ET_MR; r++) {
            const et_vf s = et_splat(ar[r][k]);
            ET_PRAGMA_UNROLL(4)
            for (int j = 0; j < ET_NV; j++) acc->v[r][j] += s * b[j];
        }
    }
}

/* Store rows to c[r] (cols of the NR columns are real), the activation applied when `last` (the final depth block;
 * earlier blocks store partial sums). */
ET_INLINE void etg_store(const etg_acc *acc, float *const c[ET_MR], int64_t cols, int act, int last) {
    if (cols >= ETG_NR) {
        ET_PRAGMA_UNROLL(16)
        for (int r = 0; r < ET_MR; r++)
            ET_PRAGMA_UNROLL(4)
            for (int j = 0; j < ET_NV; j++)
                et_store(c[r] + j * ET_VEC, last ? et_activate(acc->v[r][j], act) : acc->v[r][j]);
        return;
    }
    ET_PRAGMA_UNROLL(16)
    for (int r = 0; r < ET_MR; r++)
        ET_PRAGMA_UNROLL(4)
        for (int j = 0; j < ET_NV; j++) {
            const int64_t n = cols - j * ET_VEC;
            const et_vf v = last ? et_activate(acc->v[r][j], act) : acc->v[r][j];
            if (n >= ET_VEC)
                et_store(c[r] + j * ET_VEC, v);
            else if (n > 0)
                et_store_n(c[r] + j * ET_VEC, v, n);
        }
}

/* The blocks a layer is cut into for the pool: row blocks of mb tiles x column blocks of nb panels. Item i covers
 * tiles [*t0, *t1) and panels [*p0, *p1). */
ET_INLINE void etg_block(int64_t i, int64_t tiles, int64_t panels, int64_t mb, int64_t nb, int64_t *t0, int64_t *t1,
                         int64_t *p0, int64_t *p1) {
    const int64_t ncb = (panels + nb - 1) / nb, rb = i / ncb, cb = i % ncb;
    *t0 = rb * mb, *t1 = *t0 + mb < tiles ? *t0 + mb : tiles;
    *p0 = cb * nb, *p1 = *p0 + nb < panels ? *p0 + nb : panels;
}

static inline int64_t etg_blocks(int64_t tiles, int64_t panels, int64_t mb, int64_t nb) {
    return (tiles + mb - 1) / mb * ((panels + nb - 1) / nb);
}

/* ETG_FOR_TILES(t, p, t0, t1, p0, p1) { ... }: every (row tile, panel) of a block, in the ORDER knob's order:
 * ET_ORDER_ROWS (row tile outer: its activations stay in L1 across the panels) or ET_ORDER_PANELS (panel outer:
 * it stays in L1 across the row tiles). */
#ifdef ET_ORDER_ROWS
#define ETG_FOR_TILES(t, p, t0, t1, p0, p1)                                                                           \
    for (int64_t t = (t0); t < (t1); t++)                                                                             \
        for (int64_t p = (p0); p < (p1); p++)
#else
#define ETG_FOR_TILES(t, p, t0, t1, p0, p1)                                                                           \
    for (int64_t p = (p0); p < (p1); p++)                                                                             \
        for (int64_t t = (t0); t < (t1); t++)
#endif

#endif
