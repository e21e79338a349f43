/* gemm: C[M,N] = act(A[M,K] * B[K,N] + bias[N]), row-major fp32. Pointwise (1x1) conv in NHWC and fully-connected
 * layers. dims: M, N, K. bufs: A, B, bias, C. act: none | relu | relu6 (runtime).
 *
 * B and the bias are packed once into panels of NR = NV * VEC columns (et_gemm.h); a run computes MR x NR register
 * tiles. The layer is cut into blocks of MB row tiles x NB panels (the items the thread pool shares out); inside a
 * block, depth runs in KC blocks (partial sums kept in C between them) so a panel's KC slice stays in L1, and the
 * ORDER knob picks what the inner loop reuses.
 * Knobs: MR rows x NV vectors register tile, VEC floats per vector, KC depth block (L1), MB row tiles and NB panels
 * per block (L2), ORDER_ROWS (row tile outer: its A rows stay in L1 across the block's panels) | ORDER_PANELS
 * (panel outer: its KC slice stays in L1 across the block's row tiles), UNROLL_K of the depth loop, PREFETCH panel
 * rows ahead (0 = off), THREADS.
 */
#ifndef ET_MR
#define ET_MR 6
#endif
#ifndef ET_NV
#define ET_NV 2
#endif
#ifndef ET_KC
#define ET_KC 256
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

static int64_t et_kernel_packed_floats(const int64_t *dims) { return etg_packed_floats(dims[2], dims[1]); }

static int et_kernel_pack(const int64_t *dims, float *const *bufs, float *packed) {
    etg_pack(bufs[1], dims[1], bufs[2], dims[2], dims[1], packed);
    return 0;
}

typedef struct {
    const float *A, *P;
    float *C;
    int64_t M, N, K, tiles, panels;
    int act;
} gemm_args;

/* Row tile t x panel p over depth [k0, k0 + kc). */
ET_INLINE void tile(const gemm_args *g, int64_t t, int64_t p, int64_t k0, int64_t kc) {
    const float *a[ET_MR];
    float *c[ET_MR];
    ET_PRAGMA_UNROLL(16)
    for (int r = 0; r < ET_MR; r++) {
        const int64_t m = t * ET_MR + r < g->M ? t * ET_MR + r : g->M - 1; /* alias past the last row */
        a[r] = g->A + m * g->K + k0;
        c[r] = g->C + m * g->N + p * ETG_NR;
    }
    const float *panel = g->P + p * (g->K + 1) * ETG_NR;
    const int64_t cols = g->N - p * ETG_NR;
    etg_acc acc;
    if (k0 == 0)
        etg_init_bias(&acc, panel);
    else
        etg_init_c(&acc, c, cols);
    etg_madd(&acc, a, panel + (1 + k0) * ETG_NR, kc);
    etg_store(&acc, c, cols, g->act, k0 + kc == g->K);
}

static void block(void *ctx, int64_t i) {
    const gemm_args *g = ctx;
    int64_t t0, t1, p0, p1;
    etg_block(i, g->tiles, g->panels, ET_MB, ET_NB, &t0, &t1, &p0, &p1);
    int64_t k0 = 0;
    do { /* at least once: K == 0 still stores act(bias) */
        const int64_t kc = g->K - k0 < ET_KC ? g->K - k0 : ET_KC;
        ETG_FOR_TILES(t, p, t0, t1, p0, p1) tile(g, t, p, k0, kc);
        k0 += kc;
    } while (k0 < g->K);
}

static int et_kernel(const int64_t *dims, float *const *bufs, const float *packed, int act) {
    const int64_t M = dims[0], N = dims[1], K = dims[2];
    if (M < 1 || N < 1 || K < 0) return 1;
    const gemm_args g = {bufs[0], packed, bufs[3], M, N, K, (M + ET_MR - 1) / ET_MR, etg_panels(N), act};
    return et_parallel_for(etg_blocks(g.tiles, g.panels, ET_MB, ET_NB), block, (void *)&g);
}
