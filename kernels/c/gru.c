/* gru: one GRU layer over a sequence, ONNX GRU semantics with linear_before_reset=1 (PyTorch's GRU):
 *     z = sigmoid(Wz x + Wbz + Rz h + Rbz)        r = sigmoid(Wr x + Wbr + Rr h + Rbr)
 *     n = tanh(Wh x + Wbh + r * (Rh h + Rbh))    h' = (1 - z) * n + z * h
 * dims: T, I, H. bufs: x[T, I], W[3H, I], R[3H, H], B[6H] (Wb then Rb), h0[H], Y[T, H] (every hidden state).
 * Gate order is z, r, h as in ONNX. Hidden units are padded to Hp (a multiple of VEC) in the packed weights and
 * the scratch buffers, so the gate math is whole vectors; padded lanes stay exactly zero.
 *
 * et_pack lays the constant W, R and B out once: the input-side biases [3][Hp] (Wbz+Rbz, Wbr+Rbr, Wbh), the
 * recurrent ones [3][Hp] (0, 0, Rbh), then R and W. With LAYOUT_COLS they are panels of TU = UT*VEC units: the
 * panel of the tile at u0 (w = min(TU, Hp - u0) units wide) holds P[(i*3 + g)*w + c] = A[(g*H + u0 + c)*n + i], so a
 * tile streams its panel sequentially with broadcast-FMAs over vectors of units. With LAYOUT_ROWS they keep their
 * row-major order and a tile takes dot products along rows (horizontal sums at the end).
 * ORDER_PRE computes the input projections of all T steps first, as one GEMM whose register tile is MT steps x
 * 3 gates x UT unit vectors (each weight vector loaded once feeds MT steps, each broadcast input feeds 3*UT
 * vectors; the same tile as the recurrence's, with MT = 1 there); ORDER_STEP computes W x_t inside each step.
 * The recurrence then computes R h for the step's units and the gate math.
 * Knobs: LAYOUT_COLS | LAYOUT_ROWS; ORDER_PRE | ORDER_STEP; UT units (rows) or unit vectors (cols) per register
 * tile, times 3 gates; MT time steps per register tile of the input GEMM; VEC; UNROLL of the inner product loop;
 * PREFETCH distance in weight rows; THREADS over the hidden units, PAR_UNITS (each thread computes its units'
 * input projections and their recurrence, a spin barrier per step) | PAR_GEMM (threads share the input GEMM's
 * work items, then the calling thread runs the recurrence alone: nothing waits on a preempted thread per step).
 */
#ifndef ET_UT
#define ET_UT 2
#endif
#ifndef ET_MT
#define ET_MT 2
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
#if !defined(ET_PAR_UNITS) && !defined(ET_PAR_GEMM)
#define ET_PAR_UNITS
#endif
#define ET_PACKS
#include <math.h>

#include "edgetune_kernel.h"

#if ET_MT < 1 || ET_MT > 4
#error "ET_MT must be in 1..4"
#endif
#if defined(ET_PAR_GEMM) && (ET_THREADS < 2 || !defined(ET_ORDER_PRE))
#error "ET_PAR_GEMM splits the input GEMM of ORDER_PRE over threads"
#endif

static inline int64_t padded(int64_t H) { return (H + ET_VEC - 1) / ET_VEC * ET_VEC; }

/* exp(x), cephes expf polynomial on x clamped to [-87, 88] (~2 ulp). */
static inline et_vf gru_exp(et_vf x) {
    x = et_min(et_max(x, et_splat(-87.0f)), et_splat(88.0f));
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
    et_vi e = (__builtin_convertvector(n, et_vi) + 127) << 23;
    return y * (et_vf)e;
}
static inline et_vf gru_sigmoid(et_vf x) { return 1.0f / (1.0f + gru_exp(-x)); }
static inline et_vf gru_tanh(et_vf x) { return 2.0f / (1.0f + gru_exp(-2.0f * x)) - 1.0f; }

#ifdef ET_LAYOUT_COLS
#define GRU_TU (ET_UT * ET_VEC)
#define GRU_GRAIN GRU_TU /* threads split the units in whole tiles */
static inline int64_t matrix_floats(int64_t H, int64_t n) { return 3 * padded(H) * n; }

/* Pack A [3H, n] into the panels of every unit tile (see the header comment). */
static void pack_matrix(const float *A, float *AP, int64_t n, int64_t H) {
    const int64_t Hp = padded(H);
    for (int64_t u0 = 0; u0 < Hp; u0 += GRU_TU) {
        const int64_t w = Hp - u0 < GRU_TU ? Hp - u0 : GRU_TU;
        float *P = AP + u0 * 3 * n;
        for (int64_t i = 0; i < n; i++)
            for (int g = 0; g < 3; g++)
                for (int64_t c = 0; c < w; c++)
                    P[(i * 3 + g) * w + c] = u0 + c < H ? A[(g * H + u0 + c) * n + i] : 0.0f;
    }
}

/* out[m*os + g*Hp + j*VEC + c] = bias[g*Hp + j*VEC + c] + sum_i v[m*vs + i] * P[(i*3 + g)*w + j*VEC + c] for MT_ steps
 * m, NV unit vectors j, 3 gates. */
ET_INLINE void tile(const int MT_, const int NV, const float *P, int64_t w, int64_t n, int64_t Hp, const float *v,
                    int64_t vs, const float *bias, float *out, int64_t os) {
    et_vf acc[ET_MT][3][ET_UT];
    for (int m = 0; m < MT_; m++)
        for (int g = 0; g < 3; g++)
            for (int j = 0; j < NV; j++) acc[m][g][j] = et_load(bias + g * Hp + j * ET_VEC);
    ET_PRAGMA_UNROLL(ET_UNROLL)
    for (int64_t i = 0; i < n; i++) {
        const float *row = P + i * 3 * w;
#if ET_PREFETCH > 0
        __builtin_prefetch(row + ET_PREFETCH * 3 * w, 0, 3);
#endif
        et_vf a[3][ET_UT];
        for (int g = 0; g < 3; g++)
            for (int j = 0; j < NV; j++) a[g][j] = et_load(row + g * w + j * ET_VEC);
        for (int m = 0; m < MT_; m++) {
            const et_vf s = et_splat(v[m * vs + i]);
            for (int g = 0; g < 3; g++)
                for (int j = 0; j < NV; j++) acc[m][g][j] += s * a[g][j];
        }
    }
    for (int m = 0; m < MT_; m++)
        for (int g = 0; g < 3; g++)
            for (int j = 0; j < NV; j++) et_store(out + m * os + g * Hp + j * ET_VEC, acc[m][g][j]);
}

/* The 3 gates' projections of MT_ vectors v (vs apart) for padded units [U0, U1) (U0 a tile start), plus bias. */
ET_INLINE void proj(const int MT_, const float *AP, int64_t n, int64_t H, const float *v, int64_t vs,
                    const float *bias, int64_t U0, int64_t U1, float *out, int64_t os) {
    (void)H;
    const int64_t Hp = padded(H);
    for (int64_t u = U0; u < U1; u += GRU_TU) {
        const int64_t w = Hp - u < GRU_TU ? Hp - u : GRU_TU;
        const float *P = AP + u * 3 * n;
        if (w == GRU_TU)
            tile(MT_, ET_UT, P, w, n, Hp, v, vs, bias + u, out + u, os);
        else
            for (int64_t j = 0; j < w; j += ET_VEC) tile(MT_, 1, P + j, w, n, Hp, v, vs, bias + u + j, out + u + j, os);
    }
}
#else
#define GRU_GRAIN ET_VEC
static inline int64_t matrix_floats(int64_t H, int64_t n) { return 3 * H * n; }
static void pack_matrix(const float *A, float *AP, int64_t n, int64_t H) { memcpy(AP, A, sizeof(float) * 3 * H * n); }

/* out[m*os + g*Hp + u + j] = bias[g*Hp + u + j] + dot(A[g*H + u + j, 0:n], v[m*vs:]) for MT_ steps, NU units. */
ET_INLINE void tile(const int MT_, const int NU, const float *A, int64_t n, int64_t H, int64_t Hp, const float *v,
                    int64_t vs, const float *bias, int64_t u, float *out, int64_t os) {
    et_vf acc[ET_MT][3][ET_UT];
    const float *row[3][ET_UT];
    for (int g = 0; g < 3; g++)
        for (int j = 0; j < NU; j++) {
            row[g][j] = A + (g * H + u + j) * n;
            for (int m = 0; m < MT_; m++) acc[m][g][j] = et_splat(0.0f);
        }
    int64_t i = 0;
    ET_PRAGMA_UNROLL(ET_UNROLL)
    for (; i + ET_VEC <= n; i += ET_VEC) {
        et_vf xv[ET_MT];
        for (int m = 0; m < MT_; m++) xv[m] = et_load(v + m * vs + i);
        for (int g = 0; g < 3; g++)
            for (int j = 0; j < NU; j++) {
#if ET_PREFETCH > 0
                __builtin_prefetch(row[g][j] + ET_PREFETCH * n + i, 0, 3);
#endif
                const et_vf a = et_load(row[g][j] + i);
                for (int m = 0; m < MT_; m++) acc[m][g][j] += xv[m] * a;
            }
    }
    for (int m = 0; m < MT_; m++)
        for (int g = 0; g < 3; g++)
            for (int j = 0; j < NU; j++) {
                float s = et_hsum(acc[m][g][j]) + bias[g * Hp + u + j];
                for (int64_t k = i; k < n; k++) s += v[m * vs + k] * row[g][j][k];
                out[m * os + g * Hp + u + j] = s;
            }
}

ET_INLINE void proj(const int MT_, const float *A, int64_t n, int64_t H, const float *v, int64_t vs,
                    const float *bias, int64_t U0, int64_t U1, float *out, int64_t os) {
    const int64_t Hp = padded(H), end = U1 < H ? U1 : H;
    int64_t u = U0;
    for (; u + ET_UT <= end; u += ET_UT) tile(MT_, ET_UT, A, n, H, Hp, v, vs, bias, u, out, os);
    for (; u < end; u++) tile(MT_, 1, A, n, H, Hp, v, vs, bias, u, out, os);
    for (int m = 0; m < MT_; m++) /* padded units: zero, as the cols layout's zero panels give */
        for (int g = 0; g < 3; g++)
            for (int64_t p = H > U0 ? H : U0; p < U1; p++) out[m * os + g * Hp + p] = 0.0f;
}
#endif

/* Packed: input-side biases [3][Hp], recurrent biases [3][Hp], R, W (see the header comment). */
static int64_t et_kernel_packed_floats(const int64_t *dims) {
    const int64_t I = dims[1], H = dims[2];
    return 6 * padded(H) + matrix_floats(H, H) + matrix_floats(H, I);
}

static int et_kernel_pack(const int64_t *dims, float *const *bufs, float *packed) {
    const int64_t I = dims[1], H = dims[2], Hp = padded(H);
    const float *W = bufs[1], *R = bufs[2], *B = bufs[3];
    float *gb = packed, *rb = gb + 3 * Hp;
    memset(packed, 0, sizeof(float) * 6 * Hp);
    for (int64_t u = 0; u < H; u++) {
        gb[u] = B[u] + B[3 * H + u];
        gb[Hp + u] = B[H + u] + B[4 * H + u];
        gb[2 * Hp + u] = B[2 * H + u];
        rb[2 * Hp + u] = B[5 * H + u];
    }
    pack_matrix(R, rb + 3 * Hp, H, H);
    pack_matrix(W, rb + 3 * Hp + matrix_floats(H, H), I, H);
    return 0;
}

#if ET_THREADS > 1
/* Sense-reversing spin barrier for the per-step sync (a step lasts microseconds): spins, then yields the core. */
typedef struct {
    int count, sense;
} gru_bar;
static inline void gru_barrier(gru_bar *b, int *local) {
    *local ^= 1;
    if (__atomic_add_fetch(&b->count, 1, __ATOMIC_ACQ_REL) == ET_THREADS) {
        __atomic_store_n(&b->count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->sense, *local, __ATOMIC_RELEASE);
    } else {
        for (unsigned spins = 0; __atomic_load_n(&b->sense, __ATOMIC_ACQUIRE) != *local; spins++) {
            if (spins < 4096)
                et_cpu_relax();
            else
                sched_yield();
        }
    }
}
#endif

typedef struct {
    const float *x, *h0, *gb, *rb, *RP, *WP;
    float *Y, *hb, *S, *G;
    int64_t T, I, H, Hp;
#if ET_THREADS > 1
    gru_bar bar;
#endif
} gru_args;

#ifdef ET_ORDER_PRE
/* Input projections of hidden units [U0, U1) for steps [t0, t1), MT steps per register tile. */
static void input_gemm(const gru_args *a, int64_t U0, int64_t U1, int64_t t0, int64_t t1) {
    const int64_t I = a->I, H = a->H, os = 3 * a->Hp;
    int64_t t = t0;
    for (; t + ET_MT <= t1; t += ET_MT) proj(ET_MT, a->WP, I, H, a->x + t * I, I, a->gb, U0, U1, a->G + t * os, os);
    for (; t < t1; t++) proj(1, a->WP, I, H, a->x + t * I, I, a->gb, U0, U1, a->G + t * os, os);
}
#endif

/* The recurrence for hidden units [U0, U1); with SYNC, the other threads run the other units and every step ends
 * at the barrier (each step reads all of the previous hidden state). */
ET_INLINE void recurrence(gru_args *a, int64_t U0, int64_t U1, const int SYNC) {
    const int64_t T = a->T, H = a->H, Hp = a->Hp;
    float *hb = a->hb, *S = a->S, *Y = a->Y;
#if ET_THREADS > 1
    int sense = 0;
#else
    (void)SYNC;
#endif
    for (int64_t t = 0; t < T; t++) {
        const float *hp = hb + (t & 1) * Hp;
        float *hn = hb + ((t + 1) & 1) * Hp, *y = Y + t * H;
#ifdef ET_ORDER_PRE
        const float *g = a->G + t * 3 * Hp;
#else
        float *g = a->G;
        proj(1, a->WP, a->I, H, a->x + t * a->I, a->I, a->gb, U0, U1, g, 0);
#endif
        proj(1, a->RP, H, H, hp, 0, a->rb, U0, U1, S, 0);
        for (int64_t u = U0; u < U1 && u < H; u += ET_VEC) {
            const et_vf z = gru_sigmoid(et_load(g + u) + et_load(S + u));
            const et_vf r = gru_sigmoid(et_load(g + Hp + u) + et_load(S + Hp + u));
            const et_vf nn = gru_tanh(et_load(g + 2 * Hp + u) + r * et_load(S + 2 * Hp + u));
            const et_vf h = nn + z * (et_load(hp + u) - nn);
            et_store(hn + u, h);
            if (u + ET_VEC <= H)
                et_store(y + u, h);
            else
                for (int64_t j = 0; u + j < H; j++) y[u + j] = h[j];
        }
#if ET_THREADS > 1
        if (SYNC) gru_barrier(&a->bar, &sense);
#endif
    }
}

#ifdef ET_PAR_GEMM
#define GEMM_STEPS 16 /* steps per work item of the threaded input GEMM (a multiple of MT) */
/* Work item i of the input GEMM: one grain of units x GEMM_STEPS steps. Items are claimed dynamically (a thread
 * that is not running leaves its items to the others), and no thread waits for another until the GEMM ends. */
static void gemm_item(void *ctx, int64_t i) {
    const gru_args *a = ctx;
    const int64_t ngr = (a->Hp + GRU_GRAIN - 1) / GRU_GRAIN, u = i % ngr * GRU_GRAIN, t = i / ngr * GEMM_STEPS;
    input_gemm(a, u, u + GRU_GRAIN < a->Hp ? u + GRU_GRAIN : a->Hp, t, t + GEMM_STEPS < a->T ? t + GEMM_STEPS : a->T);
}
#else
/* Thread p: its share of the hidden units (whole grains), in the input GEMM and in every step of the recurrence. */
static void gru_thread(void *ctx, int p) {
    gru_args *a = ctx;
    const int64_t Hp = a->Hp, ngr = (Hp + GRU_GRAIN - 1) / GRU_GRAIN;
    const int64_t U0 = ngr * p / ET_THREADS * GRU_GRAIN, U1e = ngr * (p + 1) / ET_THREADS * GRU_GRAIN;
    const int64_t U1 = U1e < Hp ? U1e : Hp;
#ifdef ET_ORDER_PRE
    input_gemm(a, U0, U1, 0, a->T);
#endif
    recurrence(a, U0, U1, 1);
}
#endif

static int et_kernel(const int64_t *dims, float *const *bufs, const float *packed, int act) {
    (void)act;
    const int64_t T = dims[0], I = dims[1], H = dims[2];
    if (T < 1 || I < 1 || H < 1) return 1;
    const int64_t Hp = padded(H);
#ifdef ET_ORDER_PRE
    const int64_t nG = T * 3 * Hp;
#else
    const int64_t nG = 3 * Hp;
#endif
    /* scratch: h ping-pong [2][Hp] (padded lanes zero), recurrent sums [3][Hp], input projections G */
    float *scr = aligned_alloc(64, sizeof(float) * ((5 * Hp + nG + 15) & ~(int64_t)15));
    if (!scr) return ET_ERR_NOMEM;
    gru_args a = {.x = bufs[0], .gb = packed, .rb = packed + 3 * Hp, .RP = packed + 6 * Hp,
                  .WP = packed + 6 * Hp + matrix_floats(H, H), .Y = bufs[5], .hb = scr, .S = scr + 2 * Hp,
                  .G = scr + 5 * Hp, .T = T, .I = I, .H = H, .Hp = Hp};
    memset(a.hb, 0, sizeof(float) * 2 * Hp);
    memcpy(a.hb, bufs[4], sizeof(float) * H);
#ifdef ET_PAR_GEMM
    const int64_t ngr = (Hp + GRU_GRAIN - 1) / GRU_GRAIN;
    int rc = et_parallel_for(ngr * ((T + GEMM_STEPS - 1) / GEMM_STEPS), gemm_item, &a);
    if (!rc) recurrence(&a, 0, Hp, 0);
#else
    const int rc = et_parallel(gru_thread, &a);
#endif
    free(scr);
    return rc;
}
