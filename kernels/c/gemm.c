/* gemm: C[M,N] = act(A[M,K] * B[K,N] + bias[N]), row-major fp32. Pointwise (1x1) conv in NHWC and fully-connected
 * layers. dims: M, N, K. bufs: A, B, bias, C. act: none | relu | relu6 (runtime).
 * Knobs: MR rows x NV vectors register tile, KC depth block, VEC floats per vector, UNROLL of the k loop,
 * PREFETCH rows of B ahead (0 = off), THREADS over row tiles.
 */
#ifndef ET_MR
#define ET_MR 4
#endif
#ifndef ET_NV
#define ET_NV 2
#endif
#ifndef ET_KC
#define ET_KC 128
#endif
#ifndef ET_UNROLL_K
#define ET_UNROLL_K 4
#endif
#define ET_EPILOGUE
#include "edgetune_kernel.h"

#define NR (ET_NV * ET_VEC)

/* Full MR x NR tile over k in [k0, k1): starts from the bias (k0 == 0) or C, activates after the last block. */
ET_INLINE void tile_full(const float *A, const float *B, const float *bias, float *C, int64_t N, int64_t K,
                         int64_t k0, int64_t k1, int act) {
    et_vf acc[ET_MR][ET_NV];
    for (int r = 0; r < ET_MR; r++)
        for (int v = 0; v < ET_NV; v++) acc[r][v] = k0 ? et_load(C + r * N + v * ET_VEC) : et_load(bias + v * ET_VEC);
    ET_PRAGMA_UNROLL(ET_UNROLL_K)
    for (int64_t k = k0; k < k1; k++) {
        const float *b = B + k * N;
#if ET_PREFETCH > 0
        __builtin_prefetch(b + ET_PREFETCH * N, 0, 3);
#endif
        et_vf bv[ET_NV];
        for (int v = 0; v < ET_NV; v++) bv[v] = et_load(b + v * ET_VEC);
        for (int r = 0; r < ET_MR; r++) {
            et_vf a = et_splat(A[r * K + k]);
            for (int v = 0; v < ET_NV; v++) acc[r][v] += a * bv[v];
        }
    }
    const int last = k1 == K;
    for (int r = 0; r < ET_MR; r++)
        for (int v = 0; v < ET_NV; v++)
            et_store(C + r * N + v * ET_VEC, last ? et_activate(acc[r][v], act) : acc[r][v]);
}

/* Remainder tile: rows x cols <= MR x NR, scalar. */
static void tile_edge(const float *A, const float *B, const float *bias, float *C, int64_t N, int64_t K, int64_t k0,
                      int64_t k1, int64_t rows, int64_t cols, int act) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            float s = k0 ? C[r * N + c] : bias[c];
            for (int64_t k = k0; k < k1; k++) s += A[r * K + k] * B[k * N + c];
            C[r * N + c] = k1 == K ? et_activate1(s, act) : s;
        }
}

typedef struct {
    const float *A, *B, *bias;
    float *C;
    int64_t M, N, K;
    int act;
} gemm_args;

/* One row tile: every column tile over every depth block. */
ET_INLINE void row_tile(const gemm_args *g, int64_t t, const int act) {
    const int64_t M = g->M, N = g->N, K = g->K, i = t * ET_MR, rows = M - i < ET_MR ? M - i : ET_MR;
    const float *A = g->A + i * K;
    float *C = g->C + i * N;
    for (int64_t k0 = 0; k0 < K; k0 += ET_KC) {
        const int64_t k1 = k0 + ET_KC < K ? k0 + ET_KC : K;
        int64_t n = 0;
        if (rows == ET_MR)
            for (; n + NR <= N; n += NR) tile_full(A, g->B + n, g->bias + n, C + n, N, K, k0, k1, act);
        for (int64_t n2 = n; n2 < N; n2 += NR)
            tile_edge(A, g->B + n2, g->bias + n2, C + n2, N, K, k0, k1, rows, N - n2 < NR ? N - n2 : NR, act);
    }
}

#define ROW_TILE_FN(a)                                                                                                \
    static void row_tile_##a(void *ctx, int64_t t) { row_tile(ctx, t, a); }
ROW_TILE_FN(0)
ROW_TILE_FN(1)
ROW_TILE_FN(2)
static const et_item_fn row_tiles[3] = {row_tile_0, row_tile_1, row_tile_2};

static int et_kernel(const int64_t *dims, float *const *bufs, const float *packed, int act) {
    (void)packed;
    gemm_args g = {bufs[0], bufs[1], bufs[2], bufs[3], dims[0], dims[1], dims[2], act};
    if (g.K == 0) {
        for (int64_t i = 0; i < g.M; i++)
            for (int64_t j = 0; j < g.N; j++) g.C[i * g.N + j] = et_activate1(g.bias[j], act);
        return 0;
    }
    return et_parallel_for((g.M + ET_MR - 1) / ET_MR, row_tiles[act], &g);
}
