/* gemm: C[M,N] = A[M,K] * B[K,N], row-major fp32. Pointwise (1x1) conv in NHWC and fully-connected layers.
 * dims: M, N, K. bufs: A, B, C.
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
#include "edgetune_kernel.h"

#define NR (ET_NV * ET_VEC)

/* Full MR x NR tile over k in [k0, k1). */
static inline void tile_full(const float *A, const float *B, float *C, int64_t N, int64_t K, int64_t k0, int64_t k1) {
    et_vf acc[ET_MR][ET_NV];
    for (int r = 0; r < ET_MR; r++)
        for (int v = 0; v < ET_NV; v++) acc[r][v] = k0 ? et_load(C + r * N + v * ET_VEC) : et_splat(0.0f);
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
    for (int r = 0; r < ET_MR; r++)
        for (int v = 0; v < ET_NV; v++) et_store(C + r * N + v * ET_VEC, acc[r][v]);
}

/* Remainder tile: rows x cols <= MR x NR, scalar. */
static void tile_edge(const float *A, const float *B, float *C, int64_t N, int64_t K, int64_t k0, int64_t k1,
                      int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            float s = k0 ? C[r * N + c] : 0.0f;
            for (int64_t k = k0; k < k1; k++) s += A[r * K + k] * B[k * N + c];
            C[r * N + c] = s;
        }
}

static int et_kernel(const int64_t *dims, float *const *bufs) {
    const int64_t M = dims[0], N = dims[1], K = dims[2];
    const float *A = bufs[0], *B = bufs[1];
    float *C = bufs[2];
    const int64_t tiles = (M + ET_MR - 1) / ET_MR;
    if (K == 0) {
        memset(C, 0, sizeof(float) * M * N);
        return 0;
    }
    ET_PARALLEL_FOR
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t i = t * ET_MR, rows = M - i < ET_MR ? M - i : ET_MR;
        for (int64_t k0 = 0; k0 < K; k0 += ET_KC) {
            const int64_t k1 = k0 + ET_KC < K ? k0 + ET_KC : K;
            int64_t n = 0;
            if (rows == ET_MR)
                for (; n + NR <= N; n += NR) tile_full(A + i * K, B + n, C + i * N + n, N, K, k0, k1);
            for (int64_t n2 = n; n2 < N; n2 += NR)
                tile_edge(A + i * K, B + n2, C + i * N + n2, N, K, k0, k1, rows, N - n2 < NR ? N - n2 : NR);
        }
    }
    return 0;
}
