/* gru: one GRU layer over a sequence, ONNX GRU semantics with linear_before_reset=1 (PyTorch's GRU):
 *     z = sigmoid(Wz x + Wbz + Rz h + Rbz)        r = sigmoid(Wr x + Wbr + Rr h + Rbr)
 *     n = tanh(Wh x + Wbh + r * (Rh h + Rbh))    h' = (1 - z) * n + z * h
 * dims: T, I, H. bufs: x[T, I], W[3H, I], R[3H, H], B[6H] (Wb then Rb), h0[H], Y[T, H] (every hidden state).
 * Gate order is z, r, h as in ONNX. Hidden units are padded to Hp (a multiple of VEC) in all scratch buffers, so
 * the gate math is whole vectors; padded lanes stay exactly zero.
 * Knobs: LAYOUT_COLS (W and R transposed once per call to [in, 3, Hp]: each step is broadcast-FMA over vectors of
 * units) | LAYOUT_ROWS (read W and R in place: dot products over rows, horizontal sums); ORDER_PRE (all input
 * projections W x_t as one GEMM before the recurrence) | ORDER_STEP (W x_t computed inside each step);
 * UT units (rows) or unit vectors (cols) per register tile, times 3 gates; VEC; UNROLL of the inner product loop;
 * PREFETCH distance in weight rows; THREADS over the hidden units of each step (one barrier per step).
 */
#ifndef ET_UT
#define ET_UT 2
#endif
#ifndef ET_UNROLL
#define ET_UNROLL 2
#endif
#if !defined(ET_LAYOUT_ROWS) && !defined(ET_LAYOUT_COLS)
#define ET_LAYOUT_COLS
#endif
#if !defined(ET_ORDER_PRE) && !defined(ET_ORDER_STEP)
#define ET_ORDER_PRE
#endif
#include <math.h>
#include <stdlib.h>

#include "edgetune_kernel.h"

#if defined(_OPENMP) && ET_THREADS > 1
#include <omp.h>
#define GRU_NTH ET_THREADS
#define GRU_TID omp_get_thread_num()
#define GRU_PARALLEL ET_PRAGMA(omp parallel num_threads(ET_THREADS))
#define GRU_FOR ET_PRAGMA(omp for schedule(static))
#define GRU_BARRIER ET_PRAGMA(omp barrier)
#else
#define GRU_NTH 1
#define GRU_TID 0
#define GRU_PARALLEL
#define GRU_FOR
#define GRU_BARRIER
#endif

typedef int32_t gru_vi __attribute__((vector_size(ET_VEC * sizeof(int32_t))));

static inline et_vf gru_sel(gru_vi m, et_vf a, et_vf b) { return (et_vf)(((gru_vi)a & m) | ((gru_vi)b & ~m)); }

/* exp(x), cephes expf polynomial on x clamped to [-87, 88] (~2 ulp). */
static inline et_vf gru_exp(et_vf x) {
    x = gru_sel(x > 88.0f, et_splat(88.0f), x);
    x = gru_sel(x < -87.0f, et_splat(-87.0f), x);
    const et_vf magic = et_splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    et_vf n = (x * 1.44269504088896341f + magic) - magic;
    et_vf r = x - n * 0.693359375f - n * -2.12194440e-4f;
    et_vf y = et_splat(1.9875691500E-4f);
    y = y * r + 1.3981999507E-3f;
    y = y * r + 8.3334519073E-3f;
    y = y * r + 4.1665795894E-2f;
    y = y * r + 1.6666665459E-1f;
    y = y * r + 5.0000001201E-1f;
    y = y * r * r + r + 1.0f;
    gru_vi e = (__builtin_convertvector(n, gru_vi) + 127) << 23;
    return y * (et_vf)e;
}
static inline et_vf gru_sigmoid(et_vf x) { return 1.0f / (1.0f + gru_exp(-x)); }
static inline et_vf gru_tanh(et_vf x) { return 2.0f / (1.0f + gru_exp(-2.0f * x)) - 1.0f; }

#ifdef ET_LAYOUT_COLS
/* out[g*Hp + u] = sum_i v[i] * AT[(i*3 + g)*Hp + u] for u in [u0, u0 + nv*VEC): nv unit vectors x 3 gates. */
static inline __attribute__((always_inline)) void tile_cols(int nv, const float *AT, int64_t n, int64_t Hp,
                                                             const float *v, int64_t u0, float *out) {
    et_vf acc[3][ET_UT];
    for (int g = 0; g < 3; g++)
        for (int j = 0; j < nv; j++) acc[g][j] = et_splat(0.0f);
    const float *a = AT + u0;
    ET_PRAGMA_UNROLL(ET_UNROLL)
    for (int64_t i = 0; i < n; i++) {
        const et_vf s = et_splat(v[i]);
        const float *row = a + i * 3 * Hp;
#if ET_PREFETCH > 0
        __builtin_prefetch(row + ET_PREFETCH * 3 * Hp, 0, 3);
#endif
        for (int g = 0; g < 3; g++)
            for (int j = 0; j < nv; j++) acc[g][j] += s * et_load(row + g * Hp + j * ET_VEC);
    }
    for (int g = 0; g < 3; g++)
        for (int j = 0; j < nv; j++) et_store(out + g * Hp + u0 + j * ET_VEC, acc[g][j]);
}

/* Projections of the 3 gates for padded units [U0, U1) (multiples of VEC). */
static void proj(const float *AT, int64_t n, int64_t H, int64_t Hp, const float *v, int64_t U0, int64_t U1,
                 float *out) {
    (void)H;
    int64_t u = U0;
    for (; u + ET_UT * ET_VEC <= U1; u += ET_UT * ET_VEC) tile_cols(ET_UT, AT, n, Hp, v, u, out);
    for (; u < U1; u += ET_VEC) tile_cols(1, AT, n, Hp, v, u, out);
}

/* AT[(i*3 + g)*Hp + u] = A[(g*H + u)*n + i], zero for u >= H; rows i in [i0, i1). */
static void transpose_rows(const float *A, float *AT, int64_t n, int64_t H, int64_t Hp, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++)
        for (int g = 0; g < 3; g++) {
            float *dst = AT + (i * 3 + g) * Hp;
            for (int64_t u = 0; u < H; u++) dst[u] = A[(g * H + u) * n + i];
            for (int64_t u = H; u < Hp; u++) dst[u] = 0.0f;
        }
}
#else
/* out[g*Hp + u + r] = dot(A[g*H + u + r, 0:n], v) for nu units from u, 3 gates. */
static inline __attribute__((always_inline)) void tile_rows(int nu, const float *A, int64_t n, int64_t H, int64_t Hp,
                                                             const float *v, int64_t u, float *out) {
    et_vf acc[3][ET_UT];
    const float *row[3][ET_UT];
    for (int g = 0; g < 3; g++)
        for (int j = 0; j < nu; j++) acc[g][j] = et_splat(0.0f), row[g][j] = A + (g * H + u + j) * n;
    int64_t i = 0;
    ET_PRAGMA_UNROLL(ET_UNROLL)
    for (; i + ET_VEC <= n; i += ET_VEC) {
        const et_vf hv = et_load(v + i);
        for (int g = 0; g < 3; g++)
            for (int j = 0; j < nu; j++) {
#if ET_PREFETCH > 0
                __builtin_prefetch(row[g][j] + ET_PREFETCH * n + i, 0, 3);
#endif
                acc[g][j] += hv * et_load(row[g][j] + i);
            }
    }
    for (int g = 0; g < 3; g++)
        for (int j = 0; j < nu; j++) {
            float s = et_hsum(acc[g][j]);
            for (int64_t k = i; k < n; k++) s += v[k] * row[g][j][k];
            out[g * Hp + u + j] = s;
        }
}

static void proj(const float *A, int64_t n, int64_t H, int64_t Hp, const float *v, int64_t U0, int64_t U1,
                 float *out) {
    const int64_t end = U1 < H ? U1 : H;
    int64_t u = U0;
    for (; u + ET_UT <= end; u += ET_UT) tile_rows(ET_UT, A, n, H, Hp, v, u, out);
    for (; u < end; u++) tile_rows(1, A, n, H, Hp, v, u, out);
}
#endif

static int et_kernel(const int64_t *dims, float *const *bufs) {
    const int64_t T = dims[0], I = dims[1], H = dims[2];
    if (T < 1 || I < 1 || H < 1) return 1;
    const float *x = bufs[0], *W = bufs[1], *R = bufs[2], *B = bufs[3], *h0 = bufs[4];
    float *Y = bufs[5];
    const int64_t Hp = (H + ET_VEC - 1) / ET_VEC * ET_VEC;
#ifdef ET_ORDER_PRE
    const int64_t nG = T * 3 * Hp;
#else
    const int64_t nG = 3 * Hp;
#endif
#ifdef ET_LAYOUT_COLS
    const int64_t nT = 3 * Hp * (H + I);
#else
    const int64_t nT = 0;
#endif
    /* scratch: bias [4][Hp] (z, r: Wb+Rb; h: Wb; Rbh), h ping-pong [2][Hp], recurrent sums [3][Hp], G, transposes */
    float *scr = calloc(4 * Hp + 2 * Hp + 3 * Hp + nG + nT + ET_VEC, sizeof(float));
    if (!scr) return 2;
    float *bias = scr, *hb = bias + 4 * Hp, *S = hb + 2 * Hp, *G = S + 3 * Hp;
#ifdef ET_LAYOUT_COLS
    float *RT = G + nG, *WT = RT + 3 * Hp * H;
    const float *Rm = RT, *Wm = WT;
#else
    const float *Rm = R, *Wm = W;
#endif
    for (int64_t u = 0; u < H; u++) {
        bias[u] = B[u] + B[3 * H + u];
        bias[Hp + u] = B[H + u] + B[4 * H + u];
        bias[2 * Hp + u] = B[2 * H + u];
        bias[3 * Hp + u] = B[5 * H + u];
        hb[u] = h0[u];
    }

    GRU_PARALLEL
    {
        const int p = GRU_TID;
        const int64_t nvec = Hp / ET_VEC;
        const int64_t U0 = nvec * p / GRU_NTH * ET_VEC, U1 = nvec * (p + 1) / GRU_NTH * ET_VEC;
#ifdef ET_LAYOUT_COLS
        GRU_FOR
        for (int64_t i = 0; i < H + I; i++) {
            if (i < H)
                transpose_rows(R, RT, H, H, Hp, i, i + 1);
            else
                transpose_rows(W, WT, I, H, Hp, i - H, i - H + 1);
        }
#endif
#ifdef ET_ORDER_PRE
        GRU_FOR
        for (int64_t t = 0; t < T; t++) proj(Wm, I, H, Hp, x + t * I, 0, Hp, G + t * 3 * Hp);
#endif
        for (int64_t t = 0; t < T; t++) {
            const float *hp = hb + (t & 1) * Hp;
            float *hn = hb + ((t + 1) & 1) * Hp, *y = Y + t * H;
#ifdef ET_ORDER_PRE
            const float *g = G + t * 3 * Hp;
#else
            float *g = G;
            proj(Wm, I, H, Hp, x + t * I, U0, U1, g);
#endif
            proj(Rm, H, H, Hp, hp, U0, U1, S);
            for (int64_t u = U0; u < U1 && u < H; u += ET_VEC) {
                const et_vf z = gru_sigmoid(et_load(g + u) + et_load(S + u) + et_load(bias + u));
                const et_vf r = gru_sigmoid(et_load(g + Hp + u) + et_load(S + Hp + u) + et_load(bias + Hp + u));
                const et_vf nn = gru_tanh(et_load(g + 2 * Hp + u) + et_load(bias + 2 * Hp + u) +
                                          r * (et_load(S + 2 * Hp + u) + et_load(bias + 3 * Hp + u)));
                const et_vf h = nn + z * (et_load(hp + u) - nn);
                et_store(hn + u, h);
                if (u + ET_VEC <= H)
                    et_store(y + u, h);
                else
                    for (int64_t j = 0; u + j < H; j++) y[u + j] = h[j];
            }
            GRU_BARRIER
        }
    }
    free(scr);
    return 0;
}
