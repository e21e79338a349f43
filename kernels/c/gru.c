/* gru: one GRU layer over a sequence, ONNX GRU semantics with linear_before_reset=1 (PyTorch's GRU):
 *     z = sigmoid(Wz x + Wbz + Rz h + Rbz)        r = sigmoid(Wr x + Wbr + Rr h + Rbr)
 *     n = tanh(Wh x + Wbh + r * (Rh h + Rbh))    h' = (1 - z) * n + z * h
 * dims: T, I, H. bufs: x[T, I], W[3H, I], R[3H, H], B[6H] (Wb then Rb), h0[H], Y[T, H] (every hidden state).
 * Gate order is z, r, h as in ONNX. Hidden units are padded to Hp (a multiple of VEC) in all scratch buffers, so
 * the gate math is whole vectors; padded lanes stay exactly zero.
 * Knobs: LAYOUT_COLS (W and R transposed once per call into panels of UT*VEC units: each step is broadcast-FMA
 * over vectors of units, streaming each panel sequentially) | LAYOUT_ROWS (read W and R in place: dot products
 * over rows, horizontal sums); ORDER_PRE (all input projections W x_t as one GEMM before the recurrence) |
 * ORDER_STEP (W x_t computed inside each step); UT units (rows) or unit vectors (cols) per register tile, times 3
 * gates; VEC; UNROLL of the inner product loop; PREFETCH distance in weight rows; THREADS over the hidden units of
 * each step (a spin barrier per step).
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
#include <sched.h>

#include "edgetune_kernel.h"

#define GRU_NTH ET_THREADS

typedef struct {
    int count, sense;
} gru_bar;

#if GRU_NTH > 1
/* Sense-reversing spin barrier for the per-step sync (the pool's threads all run at once, see et_parallel): a
 * sleeping barrier costs tens of microseconds, more than a whole step. Spins briefly, then yields. */
static inline void gru_barrier(gru_bar *b, int *local) {
    *local ^= 1;
    if (__atomic_add_fetch(&b->count, 1, __ATOMIC_ACQ_REL) == GRU_NTH) {
        __atomic_store_n(&b->count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->sense, *local, __ATOMIC_RELEASE);
    } else {
        for (unsigned spins = 0; __atomic_load_n(&b->sense, __ATOMIC_ACQUIRE) != *local; spins++) {
            if (spins < 1000)
                et_cpu_relax();
            else
                sched_yield();
        }
    }
}
#else
static inline void gru_barrier(gru_bar *b, int *local) { (void)b, (void)local; }
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
/* Packed panels: units are cut into tiles of TU = UT*VEC (the last one narrower, w = min(TU, Hp - u0)); the panel
 * of the tile at u0 holds P[(i*3 + g)*w + c] = A[(g*H + u0 + c)*n + i] (0 for padded units) at AP + u0*3*n, so a
 * step streams each panel sequentially. */
#define GRU_TU (ET_UT * ET_VEC)
#define GRU_GRAIN GRU_TU

/* out[g*Hp + j*VEC + c] += sum_i v[i] * P[(i*3 + g)*w + j*VEC + c] for nv vectors j, 3 gates. */
static inline __attribute__((always_inline)) void tile_cols(int nv, const float *P, int64_t w, int64_t n,
                                                             int64_t Hp, const float *v, float *out) {
    et_vf acc[3][ET_UT];
    for (int g = 0; g < 3; g++)
        for (int j = 0; j < nv; j++) acc[g][j] = et_splat(0.0f);
    ET_PRAGMA_UNROLL(ET_UNROLL)
    for (int64_t i = 0; i < n; i++) {
        const et_vf s = et_splat(v[i]);
        const float *row = P + i * 3 * w;
#if ET_PREFETCH > 0
        __builtin_prefetch(row + ET_PREFETCH * 3 * w, 0, 3);
#endif
        for (int g = 0; g < 3; g++)
            for (int j = 0; j < nv; j++) acc[g][j] += s * et_load(row + g * w + j * ET_VEC);
    }
    for (int g = 0; g < 3; g++)
        for (int j = 0; j < nv; j++) et_store(out + g * Hp + j * ET_VEC, acc[g][j]);
}

/* Projections of the 3 gates for padded units [U0, U1) (U0 a tile start). */
static void proj(const float *AP, int64_t n, int64_t H, int64_t Hp, const float *v, int64_t U0, int64_t U1,
                 float *out) {
    (void)H;
    for (int64_t u = U0; u < U1; u += GRU_TU) {
        const int64_t w = Hp - u < GRU_TU ? Hp - u : GRU_TU;
        const float *P = AP + u * 3 * n;
        if (w == GRU_TU)
            tile_cols(ET_UT, P, w, n, Hp, v, out + u);
        else
            for (int64_t j = 0; j < w; j += ET_VEC) tile_cols(1, P + j, w, n, Hp, v, out + u + j);
    }
}

/* Register tiles of the input projection GEMM: how many tiles cover the layer, and where one ends. */
static inline int64_t gemm_tiles(int64_t H, int64_t Hp) { (void)H; return (Hp + GRU_TU - 1) / GRU_TU; }
static inline int64_t tile_end(int64_t H, int64_t Hp, int64_t u) { (void)H; return u + GRU_TU < Hp ? u + GRU_TU : Hp; }
#define GRU_TILE_UNITS GRU_TU

/* Pack input rows i in [i0, i1) of A [3H, n] into panels (a block whose destination rows stay in L1 while each
 * source row is read one cache line at a time). */
static void pack_block(const float *A, float *AP, int64_t n, int64_t H, int64_t Hp, int64_t i0, int64_t i1) {
    for (int64_t u0 = 0; u0 < Hp; u0 += GRU_TU) {
        const int64_t w = Hp - u0 < GRU_TU ? Hp - u0 : GRU_TU;
        float *P = AP + u0 * 3 * n;
        for (int g = 0; g < 3; g++)
            for (int64_t c = 0; c < w; c++) {
                const int64_t u = u0 + c;
                if (u < H) {
                    const float *src = A + (g * H + u) * n;
                    for (int64_t i = i0; i < i1; i++) P[(i * 3 + g) * w + c] = src[i];
                } else {
                    for (int64_t i = i0; i < i1; i++) P[(i * 3 + g) * w + c] = 0.0f;
                }
            }
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

#define GRU_TILE_UNITS ET_UT
#define GRU_GRAIN ET_VEC
static inline int64_t gemm_tiles(int64_t H, int64_t Hp) { (void)Hp; return (H + ET_UT - 1) / ET_UT; }
static inline int64_t tile_end(int64_t H, int64_t Hp, int64_t u) { (void)Hp; return u + ET_UT < H ? u + ET_UT : H; }
#endif

typedef struct {
    const float *x, *W, *R, *Wm, *Rm, *bias;
    float *Y, *hb, *S, *G, *RT, *WT;
    int64_t T, I, H, Hp;
    gru_bar bar;
} gru_args;

/* Thread p's share of the layer: its hidden units at every step, with a barrier per step (and after packing and
 * the input projections, which the threads split by blocks). */
static void gru_thread(void *ctx, int p) {
    gru_args *a = ctx;
    const float *x = a->x, *bias = a->bias;
    const int64_t T = a->T, I = a->I, H = a->H, Hp = a->Hp;
    float *Y = a->Y, *hb = a->hb, *S = a->S, *G = a->G;
    int sense = 0;
    /* this thread's hidden units: whole grains (a packed tile in the cols layout, a vector in rows) */
    const int64_t ngr = (Hp + GRU_GRAIN - 1) / GRU_GRAIN;
    const int64_t U0 = ngr * p / GRU_NTH * GRU_GRAIN, U1e = ngr * (p + 1) / GRU_NTH * GRU_GRAIN;
    const int64_t U1 = U1e < Hp ? U1e : Hp;
#ifdef ET_LAYOUT_COLS
    {
        const int64_t nbr = (H + 15) / 16, nbw = (I + 15) / 16, nb = nbr + nbw;
        for (int64_t b = nb * p / GRU_NTH; b < nb * (p + 1) / GRU_NTH; b++) {
            if (b < nbr)
                pack_block(a->R, a->RT, H, H, Hp, b * 16, b * 16 + 16 < H ? b * 16 + 16 : H);
            else
                pack_block(a->W, a->WT, I, H, Hp, (b - nbr) * 16, (b - nbr) * 16 + 16 < I ? (b - nbr) * 16 + 16 : I);
        }
        gru_barrier(&a->bar, &sense);
    }
#endif
    const float *Wm = a->Wm, *Rm = a->Rm;
#ifdef ET_ORDER_PRE
    {
        /* one register tile of units at a time over every step: its weights stay in L1 */
        const int64_t nk = gemm_tiles(H, Hp);
        for (int64_t k = nk * p / GRU_NTH; k < nk * (p + 1) / GRU_NTH; k++) {
            const int64_t u = k * GRU_TILE_UNITS, ue = tile_end(H, Hp, u);
            for (int64_t t = 0; t < T; t++) proj(Wm, I, H, Hp, x + t * I, u, ue, G + t * 3 * Hp);
        }
        gru_barrier(&a->bar, &sense);
    }
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
        gru_barrier(&a->bar, &sense);
    }
}

static int et_kernel(const int64_t *dims, float *const *bufs, const float *packed, int act) {
    (void)packed, (void)act;
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
    /* scratch, every part 64-byte aligned: bias [4][Hp] (z, r: Wb+Rb; h: Wb; Rbh), h ping-pong [2][Hp],
     * recurrent sums [3][Hp], input projections G, packed weight panels */
#define GRU_A16(n) (((n) + 15) & ~(int64_t)15)
    const int64_t n_scr = GRU_A16(4 * Hp) + GRU_A16(2 * Hp) + GRU_A16(3 * Hp) + GRU_A16(nG) + GRU_A16(nT);
    float *scr = aligned_alloc(64, sizeof(float) * n_scr);
    if (!scr) return 2;
    memset(scr, 0, sizeof(float) * (n_scr - GRU_A16(nT))); /* panels are written whole */
    gru_args a = {.x = x, .W = W, .R = R, .Y = Y, .T = T, .I = I, .H = H, .Hp = Hp, .bar = {0, 0}};
    float *bias = scr;
    a.bias = bias, a.hb = bias + GRU_A16(4 * Hp), a.S = a.hb + GRU_A16(2 * Hp), a.G = a.S + GRU_A16(3 * Hp);
#ifdef ET_LAYOUT_COLS
    a.RT = a.G + GRU_A16(nG), a.WT = a.RT + 3 * Hp * H;
    a.Rm = a.RT, a.Wm = a.WT;
#else
    a.Rm = R, a.Wm = W;
#endif
    for (int64_t u = 0; u < H; u++) {
        bias[u] = B[u] + B[3 * H + u];
        bias[Hp + u] = B[H + u] + B[4 * H + u];
        bias[2 * Hp + u] = B[2 * H + u];
        bias[3 * Hp + u] = B[5 * H + u];
        a.hb[u] = h0[u];
    }
    const int rc = et_parallel(gru_thread, &a);
    free(scr);
    return rc;
}
