/* conv1d: temporal convolution, time-major and channels-last, zero padding K/2 on both ends ("same" at stride 1),
 * with a fused bias and activation, as an implicit GEMM on the shared MR x NR micro-kernel (et_gemm.h).
 *     out[t, co] = act(bias[co] + sum_{k, ci} x[t*stride + k - K/2, ci] * w[k, ci, co]),
 *     To = (T + 2*(K/2) - K) / stride + 1
 * dims: T, Cin, Cout, K, stride. bufs: x[T, Cin], w[K, Cin, Cout], bias[Cout], out[To, Cout].
 *
 * w is a [K*Cin][Cout] matrix: et_pack packs it with the bias into panels, plus Cin zeros for the padding. The
 * GEMM's rows are output steps; in a time-major input the K taps of one step are K*Cin contiguous floats, so an
 * interior tile is a plain strided GEMM (one micro-kernel run per tile, rows stride*Cin apart). A tile that
 * reaches into the padding runs per tap, padded taps reading the zeros.
 * Knobs: MR steps x NV vectors register tile, VEC, MB tiles and NB panels per block (what the threads share),
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
    return etg_packed_floats(dims[3] * dims[1], dims[2]) + dims[1];
}

static int et_kernel_pack(const int64_t *dims, float *const *bufs, float *packed) {
    const int64_t Cin = dims[1], Cout = dims[2], K = dims[3];
    etg_pack(bufs[1], Cout, bufs[2], K * Cin, Cout, packed);
    memset(packed + etg_packed_floats(K * Cin, Cout), 0, sizeof(float) * Cin);
    return 0;
}

typedef struct {
    const float *x, *P, *zero;
    float *out;
    int64_t T, Cin, Cout, K, stride, To, tiles, panels;
    int act;
} conv1d_args;

/* Row tile t (output steps t*MR ...) x panel p. */
ET_INLINE void tile(const conv1d_args *c, int64_t t, int64_t p) {
    const int64_t Cin = c->Cin, K = c->K, pad = K / 2;
    int64_t i0[ET_MR];
    float *y[ET_MR];
    int border = 0;
    ET_PRAGMA_UNROLL(16)
    for (int r = 0; r < ET_MR; r++) {
        const int64_t s = t * ET_MR + r < c->To ? t * ET_MR + r : c->To - 1; /* alias past the last step */
        i0[r] = s * c->stride - pad;
        border |= i0[r] < 0 || i0[r] + K > c->T;
        y[r] = c->out + s * c->Cout + p * ETG_NR;
    }
    const float *panel = c->P + p * (K * Cin + 1) * ETG_NR, *w = panel + ETG_NR;
    etg_acc acc;
    etg_init_bias(&acc, panel);
    const float *a[ET_MR];
    if (!border) {
        ET_PRAGMA_UNROLL(16)
        for (int r = 0; r < ET_MR; r++) a[r] = c->x + i0[r] * Cin;
        etg_madd(&acc, a, w, K * Cin);
    } else {
        for (int64_t k = 0; k < K; k++) {
            ET_PRAGMA_UNROLL(16)
            for (int r = 0; r < ET_MR; r++) {
                const int64_t i = i0[r] + k;
                a[r] = i >= 0 && i < c->T ? c->x + i * Cin : c->zero;
            }
            etg_madd(&acc, a, w + k * Cin * ETG_NR, Cin);
        }
    }
    etg_store(&acc, y, c->Cout - p * ETG_NR, c->act, 1);
}

static void block(void *ctx, int64_t i) {
    const conv1d_args *c = ctx;
    int64_t t0, t1, p0, p1;
    etg_block(i, c->tiles, c->panels, ET_MB, ET_NB, &t0, &t1, &p0, &p1);
    ETG_FOR_TILES(t, p, t0, t1, p0, p1) tile(c, t, p);
}

static int et_kernel(const int64_t *dims, float *const *bufs, const float *packed, int act) {
    const int64_t T = dims[0], Cin = dims[1], Cout = dims[2], K = dims[3], stride = dims[4];
    if (T < 1 || Cin < 1 || Cout < 1 || K < 1 || stride < 1) return 1;
    const int64_t To = (T + 2 * (K / 2) - K) / stride + 1;
    if (To < 1) return 1;
    const conv1d_args c = {bufs[0], packed, packed + etg_packed_floats(K * Cin, Cout), bufs[3], T, Cin, Cout, K,
                           stride, To, (To + ET_MR - 1) / ET_MR, etg_panels(Cout), act};
    return et_parallel_for(etg_blocks(c.tiles, c.panels, ET_MB, ET_NB), block, (void *)&c);
}
