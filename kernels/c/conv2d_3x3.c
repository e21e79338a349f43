/* conv2d_3x3: regular 3x3 convolution, pad 1, stride 1 or 2, fp32, with a fused bias and activation.
 *   Y[oy,ox,co] = act(bias[co] + sum_{ky,kx,ci} X[oy*S-1+ky, ox*S-1+kx, ci] * Wt[ky,kx,ci,co])  (X is 0 outside)
 * Layouts: X NHWC [H,W,Cin], Wt HWIO [3,3,Cin,Cout], Y NHWC [Ho,Wo,Cout], Ho = (H-1)/S + 1, Wo = (W-1)/S + 1.
 * dims: H, W, Cin, Cout, stride. bufs: X, Wt, bias, Y.
 *
 * et_pack packs the weights into zero-padded panels of CV*VEC output channels (so the channel tail runs the
 * same vector code and only its stores are partial), then the bias the same way; a run computes register tiles of WT output pixels (along a
 * row) x CV vectors of output channels. Border pixels (the first/last output columns whose taps fall in the
 * padding) run one-pixel tiles with clamped taps; border rows clamp ky. The last tile of a row's interior run
 * is shifted back to end at the run's end instead of needing a remainder tile.
 * Knobs: CV vectors of output channels per tile, WT output pixels per tile, VEC floats per vector, UNROLL of
 * the Cin loop, ORDER of the reduction (ky_kx_ci: taps outer, contiguous Cin inner; ci_ky_kx: Cin outer, the
 * 9 taps inner, with the panel laid out to match), OUTER loop (rows: output rows outer, so the input rows stay
 * hot; panels: channel panels outer, so one weight panel stays hot across the image), PREFETCH distance in Cin
 * steps of the weight stream (0 = off), THREADS over (output row, channel panel) pairs.
 */
#ifndef ET_CV
#define ET_CV 2
#endif
#ifndef ET_WT
#define ET_WT 4
#endif
#ifndef ET_UNROLL
#define ET_UNROLL 2
#endif
#if !defined(ET_ORDER_KY_KX_CI) && !defined(ET_ORDER_CI_KY_KX)
#define ET_ORDER_KY_KX_CI
#endif
#if !defined(ET_OUTER_ROWS) && !defined(ET_OUTER_PANELS)
#define ET_OUTER_ROWS
#endif
#define ET_EPILOGUE
#define ET_PACKS
#include "edgetune_kernel.h"

#if ET_WT < 1 || ET_WT > 8
#error "ET_WT must be in 1..8"
#endif

#define NT (ET_CV * ET_VEC) /* output channels per panel */
#define WT_MAX 8

/* Offset of (tap t = ky*3+kx, input channel ci) in a packed panel, in units of NT floats. */
#ifdef ET_ORDER_CI_KY_KX
#define PIDX(t, ci, Cin) ((int64_t)(ci) * 9 + (t))
#else
#define PIDX(t, ci, Cin) ((int64_t)(t) * (Cin) + (ci))
#endif

static int64_t et_kernel_packed_floats(const int64_t *dims) {
    const int64_t npanels = (dims[3] + NT - 1) / NT;
    return npanels * (9 * dims[2] + 1) * NT;
}

/* Weight panels [npanels][9 * Cin][NT], then the bias [npanels][NT], zero past Cout. */
static int et_kernel_pack(const int64_t *dims, float *const *bufs, float *Wp) {
    const int64_t Cin = dims[2], Cout = dims[3], npanels = (Cout + NT - 1) / NT, psize = 9 * Cin * NT;
    const float *Wt = bufs[1], *bias = bufs[2];
    float *bp = Wp + npanels * psize;
    memset(bp, 0, sizeof(float) * npanels * NT);
    memcpy(bp, bias, sizeof(float) * Cout);
    for (int64_t p = 0; p < npanels; p++) {
        const int64_t co0 = p * NT, n = Cout - co0 < NT ? Cout - co0 : NT;
        float *dst = Wp + p * psize;
        for (int t = 0; t < 9; t++)
            for (int64_t ci = 0; ci < Cin; ci++) {
                float *d = dst + PIDX(t, ci, Cin) * NT;
                const float *s = Wt + (t * Cin + ci) * Cout + co0;
                memcpy(d, s, sizeof(float) * n);
                if (n < NT) memset(d + n, 0, sizeof(float) * (NT - n));
            }
    }
    return 0;
}

/* One register tile: P output pixels starting at (oy, ox0), one panel and its bias. Taps ky in [ky0, ky1), kx in
 * [kx0, kx1) are the in-range ones (P == 1 whenever kx is clamped). nco < NT means a partial channel tail. */
ET_INLINE void tile(const float *X, const float *panel, const float *bias, float *Y, int64_t W, int64_t Cin,
                    int64_t Cout, int64_t iy0, int64_t ix0, int ky0, int ky1, int kx0, int kx1, const int P,
                    const int S, int64_t nco, int act) {
    et_vf acc[WT_MAX][ET_CV];
    ET_PRAGMA_UNROLL(8)
    for (int p = 0; p < P; p++)
        ET_PRAGMA_UNROLL(4)
        for (int v = 0; v < ET_CV; v++) acc[p][v] = et_load(bias + v * ET_VEC);
    const int64_t xs = (int64_t)S * Cin; /* input floats between neighbouring output pixels */
#ifdef ET_ORDER_CI_KY_KX
    ET_PRAGMA_UNROLL(ET_UNROLL)
    for (int64_t ci = 0; ci < Cin; ci++) {
#if ET_PREFETCH > 0
        for (int j = 0; j < 9 * NT; j += 16) __builtin_prefetch(panel + (ci + ET_PREFETCH) * 9 * NT + j, 0, 3);
#endif
        for (int ky = ky0; ky < ky1; ky++)
            for (int kx = kx0; kx < kx1; kx++) {
                const float *w = panel + PIDX(ky * 3 + kx, ci, Cin) * NT;
                const float *x = X + ((iy0 + ky) * W + ix0 + kx) * Cin + ci;
                et_vf wv[ET_CV];
                ET_PRAGMA_UNROLL(4)
                for (int v = 0; v < ET_CV; v++) wv[v] = et_load(w + v * ET_VEC);
                ET_PRAGMA_UNROLL(8)
                for (int p = 0; p < P; p++) {
                    const et_vf a = et_splat(x[p * xs]);
                    ET_PRAGMA_UNROLL(4)
                    for (int v = 0; v < ET_CV; v++) acc[p][v] += a * wv[v];
                }
            }
    }
#else
    for (int ky = ky0; ky < ky1; ky++)
        for (int kx = kx0; kx < kx1; kx++) {
            const float *w = panel + PIDX(ky * 3 + kx, 0, Cin) * NT;
            const float *x = X + ((iy0 + ky) * W + ix0 + kx) * Cin;
            ET_PRAGMA_UNROLL(ET_UNROLL)
            for (int64_t ci = 0; ci < Cin; ci++) {
#if ET_PREFETCH > 0
                for (int j = 0; j < NT; j += 16) __builtin_prefetch(w + (ci + ET_PREFETCH) * NT + j, 0, 3);
#endif
                et_vf wv[ET_CV];
                ET_PRAGMA_UNROLL(4)
                for (int v = 0; v < ET_CV; v++) wv[v] = et_load(w + ci * NT + v * ET_VEC);
                ET_PRAGMA_UNROLL(8)
                for (int p = 0; p < P; p++) {
                    const et_vf a = et_splat(x[p * xs + ci]);
                    ET_PRAGMA_UNROLL(4)
                    for (int v = 0; v < ET_CV; v++) acc[p][v] += a * wv[v];
                }
            }
        }
#endif
    if (nco == NT) {
        ET_PRAGMA_UNROLL(8)
        for (int p = 0; p < P; p++)
            ET_PRAGMA_UNROLL(4)
            for (int v = 0; v < ET_CV; v++) et_store(Y + p * Cout + v * ET_VEC, et_activate(acc[p][v], act));
    } else {
        for (int p = 0; p < P; p++) {
            float tmp[NT];
            for (int v = 0; v < ET_CV; v++) et_store(tmp + v * ET_VEC, et_activate(acc[p][v], act));
            memcpy(Y + p * Cout, tmp, sizeof(float) * nco);
        }
    }
}

/* One output row x one channel panel. The left border pixel and the right border run [hi, Wo) get one-pixel
 * tiles with clamped taps. The interior run [lo, hi) gets WT-pixel tiles, the last one shifted left to end at
 * hi (it recomputes a few pixels rather than needing a remainder tile); a run shorter than WT gets one-pixel
 * tiles. Interior rows (all three ky in range) get a specialised copy of the WT-pixel tile. */
ET_INLINE void row(const float *X, const float *panel, const float *bias, float *y, int64_t H, int64_t W,
                   int64_t Cin, int64_t Cout, int64_t Wo, int64_t oy, int64_t nco, const int S, int act) {
    const int64_t iy0 = oy * S - 1;
    const int ky0 = iy0 < 0 ? (int)-iy0 : 0, ky1 = H - iy0 < 3 ? (int)(H - iy0) : 3;
    /* interior columns: ox*S-1 >= 0 and ox*S+1 <= W-1 */
    const int64_t lo = 1;
    int64_t hi = W >= 2 ? (W - 2) / S + 1 : 0;
    if (hi > Wo) hi = Wo;
    if (hi < lo) hi = lo;
    int64_t ox = 0;
    const int64_t run = hi - lo >= ET_WT ? hi : lo; /* [lo, run) goes in WT-pixel tiles */
    for (; ox < Wo; ox++) {
        if (ox == lo && run > lo) {
            if (ky0 == 0 && ky1 == 3)
                for (; ox < run; ox += ET_WT) {
                    const int64_t o = ox + ET_WT <= run ? ox : run - ET_WT;
                    tile(X, panel, bias, y + o * Cout, W, Cin, Cout, iy0, o * S - 1, 0, 3, 0, 3, ET_WT, S, nco, act);
                }
            else
                for (; ox < run; ox += ET_WT) {
                    const int64_t o = ox + ET_WT <= run ? ox : run - ET_WT;
                    tile(X, panel, bias, y + o * Cout, W, Cin, Cout, iy0, o * S - 1, ky0, ky1, 0, 3, ET_WT, S, nco, act);
                }
            ox = run;
            if (ox >= Wo) break;
        }
        const int64_t ix0 = ox * S - 1;
        const int kx0 = ix0 < 0 ? (int)-ix0 : 0, kx1 = W - ix0 < 3 ? (int)(W - ix0) : 3;
        tile(X, panel, bias, y + ox * Cout, W, Cin, Cout, iy0, ix0, ky0, ky1, kx0, kx1, 1, S, nco, act);
    }
}

typedef struct {
    const float *X, *Wp;
    float *Y;
    int64_t H, W, Cin, Cout, Ho, Wo, npanels;
    int act;
} conv_args;

/* Item i of (output row, channel panel), in the OUTER knob's order. */
ET_INLINE void conv_item(const conv_args *c, int64_t i, const int S) {
#ifdef ET_OUTER_PANELS
    const int64_t p = i / c->Ho, oy = i % c->Ho;
#else
    const int64_t oy = i / c->npanels, p = i % c->npanels;
#endif
    const int64_t co0 = p * NT, nco = c->Cout - co0 < NT ? c->Cout - co0 : NT, psize = 9 * c->Cin * NT;
    row(c->X, c->Wp + p * psize, c->Wp + c->npanels * psize + co0, c->Y + oy * c->Wo * c->Cout + co0, c->H, c->W,
        c->Cin, c->Cout, c->Wo, oy, nco, S, c->act);
}
static void conv_item_s1(void *c, int64_t i) { conv_item(c, i, 1); }
static void conv_item_s2(void *c, int64_t i) { conv_item(c, i, 2); }

static int et_kernel(const int64_t *dims, float *const *bufs, const float *packed, int act) {
    if (dims[0] < 1 || dims[1] < 1 || dims[2] < 1 || dims[3] < 1) return 1;
    const int64_t S = dims[4];
    if (S != 1 && S != 2) return 2;
    conv_args c = {bufs[0], packed, bufs[3], dims[0], dims[1], dims[2], dims[3], (dims[0] - 1) / S + 1,
                   (dims[1] - 1) / S + 1, (dims[3] + NT - 1) / NT, act};
#if !defined(ET_SHAPE_STRIDE) || ET_SHAPE_STRIDE == 1 /* a build for one workload instantiates its stride only */
    if (S == 1) return et_parallel_for(c.Ho * c.npanels, conv_item_s1, &c);
#endif
#if !defined(ET_SHAPE_STRIDE) || ET_SHAPE_STRIDE == 2
    if (S == 2) return et_parallel_for(c.Ho * c.npanels, conv_item_s2, &c);
#endif
    return 2; /* unsupported stride, or not the one this build was specialised to */
}
