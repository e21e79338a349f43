/* conv2d_3x3: regular 3x3 convolution, pad 1, stride 1 or 2, fp32, with a fused bias and activation, as an implicit
 * GEMM on the shared MR x NR micro-kernel (et_gemm.h).
 *   Y[oy,ox,co] = act(bias[co] + sum_{ky,kx,ci} X[oy*S-1+ky, ox*S-1+kx, ci] * Wt[ky,kx,ci,co])  (X is 0 outside)
 * Layouts: X NHWC [H,W,Cin], Wt HWIO [3,3,Cin,Cout], Y NHWC [Ho,Wo,Cout], Ho = (H-1)/S + 1, Wo = (W-1)/S + 1.
 * dims: H, W, Cin, Cout, stride. bufs: X, Wt, bias, Y.
 *
 * HWIO weights are a [9*Cin][Cout] matrix: et_pack packs them with the bias into panels, plus 3*Cin zeros that
 * stand for input rows above or below the image. The GEMM's rows are output pixels (Ho*Wo, a tile may span output
 * rows); a pixel's depth is read straight from X, without im2col: for each kernel row ky, its 3 taps x Cin are
 * one contiguous run of the input row (the zeros when the row is outside the image), so a tile is 3 micro-kernel
 * runs of 3*Cin. A tile holding a left or right border pixel runs per tap instead (9 runs of Cin, taps outside
 * the image reading zeros; measured: cheaper than building zero-padded copies of the border windows). Stride 2
 * only moves where each pixel's runs start: no gather pass.
 * Knobs: MR pixels x NV vectors register tile, VEC, MB tiles and NB panels per block (what the threads share),
 * ORDER_ROWS | ORDER_PANELS inside a block, UNROLL_K of the depth loop, PREFETCH panel rows ahead, THREADS.
 */
#ifndef ET_MR
#define ET_MR 6
#endif
#ifndef ET_NV
#define ET_NV 2
#endif
#ifndef ET_MB
#define ET_MB 16
#endif
#ifndef ET_NB
#define ET_NB 4
#endif
#ifndef ET_UNROLL_K
#define ET_UNROLL_K 4
#endif
#if !defined(ET_ORDER_ROWS) && !defined(ET_ORDER_PANELS)
#define ET_ORDER_PANELS
#endif
#define ET_EPILOGUE
#define ET_PACKS
#include "edgetune_kernel.h"
#include "et_gemm.h"

static int64_t et_kernel_packed_floats(const int64_t *dims) {
    return etg_packed_floats(9 * dims[2], dims[3]) + 3 * dims[2];
}

static int et_kernel_pack(const int64_t *dims, float *const *bufs, float *packed) {
    const int64_t Cin = dims[2], Cout = dims[3];
    etg_pack(bufs[1], Cout, bufs[2], 9 * Cin, Cout, packed);
    memset(packed + etg_packed_floats(9 * Cin, Cout), 0, sizeof(float) * 3 * Cin);
    return 0;
}

typedef struct {
    const float *X, *P, *zero;
    float *Y;
    int64_t H, W, Cin, Cout, Wo, M, tiles, panels;
    int act;
} conv_args;

/* Row tile t (pixels t*MR ..., a tile may span output rows) x panel p. */
ET_INLINE void tile(const conv_args *c, int64_t t, int64_t p, const int S) {
    const int64_t W = c->W, Cin = c->Cin;
    int64_t iy0[ET_MR], ix0[ET_MR];
    float *y[ET_MR];
    int border = 0;
    const int64_t m0 = t * ET_MR;
    int64_t oy = m0 / c->Wo, ox = m0 - oy * c->Wo; /* one division per tile, then step along the rows */
    ET_PRAGMA_UNROLL(16)
    for (int r = 0; r < ET_MR; r++) {
        if (r == 0 || m0 + r < c->M) { /* past the last pixel, rows alias the previous one */
            iy0[r] = oy * S - 1, ix0[r] = ox * S - 1;
            y[r] = c->Y + (m0 + r) * c->Cout + p * ETG_NR;
            if (++ox == c->Wo) ox = 0, oy++;
        } else {
            iy0[r] = iy0[r - 1], ix0[r] = ix0[r - 1], y[r] = y[r - 1];
        }
        border |= ix0[r] < 0 || ix0[r] + 3 > W;
    }
    const float *panel = c->P + p * (9 * Cin + 1) * ETG_NR, *w = panel + ETG_NR;
    etg_acc acc;
    etg_init_bias(&acc, panel);
    const float *a[ET_MR];
    if (!border) {
        for (int ky = 0; ky < 3; ky++) {
            ET_PRAGMA_UNROLL(16)
            for (int r = 0; r < ET_MR; r++) {
                const int64_t iy = iy0[r] + ky;
                a[r] = iy >= 0 && iy < c->H ? c->X + (iy * W + ix0[r]) * Cin : c->zero;
            }
            etg_madd(&acc, a, w + ky * 3 * Cin * ETG_NR, 3 * Cin);
        }
    } else {
        for (int ky = 0; ky < 3; ky++)
            for (int kx = 0; kx < 3; kx++) {
                ET_PRAGMA_UNROLL(16)
                for (int r = 0; r < ET_MR; r++) {
                    const int64_t iy = iy0[r] + ky, ix = ix0[r] + kx;
                    a[r] = iy >= 0 && iy < c->H && ix >= 0 && ix < W ? c->X + (iy * W + ix) * Cin : c->zero;
                }
                etg_madd(&acc, a, w + (ky * 3 + kx) * Cin * ETG_NR, Cin);
            }
    }
    etg_store(&acc, y, c->Cout - p * ETG_NR, c->act, 1);
}

ET_INLINE void block(const conv_args *c, int64_t i, const int S) {
    int64_t t0, t1, p0, p1;
    etg_block(i, c->tiles, c->panels, ET_MB, ET_NB, &t0, &t1, &p0, &p1);
    ETG_FOR_TILES(t, p, t0, t1, p0, p1) tile(c, t, p, S);
}
static void block_s1(void *c, int64_t i) { block(c, i, 1); }
static void block_s2(void *c, int64_t i) { block(c, i, 2); }

static int et_kernel(const int64_t *dims, float *const *bufs, const float *packed, int act) {
    const int64_t H = dims[0], W = dims[1], Cin = dims[2], Cout = dims[3], S = dims[4];
    if (H < 1 || W < 1 || Cin < 1 || Cout < 1) return 1;
    if (S != 1 && S != 2) return 2;
    const int64_t Ho = (H - 1) / S + 1, Wo = (W - 1) / S + 1, M = Ho * Wo;
    const conv_args c = {bufs[0], packed, packed + etg_packed_floats(9 * Cin, Cout), bufs[3], H, W, Cin, Cout, Wo,
                         M, (M + ET_MR - 1) / ET_MR, etg_panels(Cout), act};
    const int64_t n = etg_blocks(c.tiles, c.panels, ET_MB, ET_NB);
#if !defined(ET_SHAPE_STRIDE) || ET_SHAPE_STRIDE == 1 /* a build for one workload instantiates its stride only */
    if (S == 1) return et_parallel_for(n, block_s1, (void *)&c);
#endif
#if !defined(ET_SHAPE_STRIDE) || ET_SHAPE_STRIDE == 2
    if (S == 2) return et_parallel_for(n, block_s2, (void *)&c);
#endif
    return 2; /* not the stride this build was specialised to */
}
