/* conv1d: temporal convolution, time-major and channels-last, zero padding K/2 on both ends ("same" at stride 1),
 * with a fused bias and activation.
 *     out[t, co] = act(bias[co] + sum_{k, ci} x[t*stride + k - K/2, ci] * w[k, ci, co]),
 *     To = (T + 2*(K/2) - K) / stride + 1
 * dims: T, Cin, Cout, K, stride. bufs: x[T, Cin], w[K, Cin, Cout], bias[Cout], out[To, Cout].
 * It runs as a GEMM over depth K*Cin with a register tile of TT output steps x NV vectors of output channels;
 * each tile row reads its input row through a pointer, so padding rows point at a zero row and cost no branches.
 * Output channels left over after whole NV-vector blocks run one vector at a time, and a last partial vector
 * reads a zero-padded copy of those weight columns. et_pack holds the zero row, that copy and the bias padded to
 * whole vectors.
 * Knobs: TT, NV, VEC, UNROLL of the depth loop, PREFETCH weight rows ahead (0 = off), THREADS over tiles,
 * ORDER_TC (time tiles outer, channel blocks inner) | ORDER_CT (channel blocks outer: a weight panel stays hot).
 */
#ifndef ET_TT
#define ET_TT 4
#endif
#ifndef ET_NV
#define ET_NV 3
#endif
#ifndef ET_UNROLL
#define ET_UNROLL 4
#endif
#if !defined(ET_ORDER_TC) && !defined(ET_ORDER_CT)
#define ET_ORDER_CT
#endif
#define ET_EPILOGUE
#define ET_PACKS
#include "edgetune_kernel.h"

#define NR (ET_NV * ET_VEC)

/* One register tile: up to TT output steps from t0, nv vectors of channels at w (row stride ldw), cols <= nv*VEC
 * of them stored. nv is a compile-time constant at every call site (always inlined). */
ET_INLINE void tile(int nv, const float *x, const float *zero, const float *w, int64_t ldw, const float *bias,
                    float *out, int64_t T, int64_t Cin, int64_t Cout, int64_t K, int64_t stride, int64_t t0,
                    int64_t rows, int64_t cols, int act) {
    et_vf acc[ET_TT][ET_NV];
    for (int r = 0; r < ET_TT; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = et_load(bias + v * ET_VEC);
    const int64_t pad = K / 2;
    for (int64_t k = 0; k < K; k++) {
        const float *a[ET_TT];
        for (int r = 0; r < ET_TT; r++) {
            const int64_t i = (t0 + r) * stride + k - pad;
            a[r] = (r < rows && i >= 0 && i < T) ? x + i * Cin : zero;
        }
        const float *wk = w + k * Cin * ldw;
        ET_PRAGMA_UNROLL(ET_UNROLL)
        for (int64_t c = 0; c < Cin; c++) {
            const float *b = wk + c * ldw;
#if ET_PREFETCH > 0
            __builtin_prefetch(b + ET_PREFETCH * ldw, 0, 3);
#endif
            et_vf bv[ET_NV];
            for (int v = 0; v < nv; v++) bv[v] = et_load(b + v * ET_VEC);
            for (int r = 0; r < ET_TT; r++) {
                const et_vf s = et_splat(a[r][c]);
                for (int v = 0; v < nv; v++) acc[r][v] += s * bv[v];
            }
        }
    }
    for (int r = 0; r < ET_TT; r++) {
        if (r >= rows) break;
        float *o = out + (t0 + r) * Cout;
        if (cols == nv * ET_VEC) {
            for (int v = 0; v < nv; v++) et_store(o + v * ET_VEC, et_activate(acc[r][v], act));
        } else {
            for (int64_t j = 0; j < cols; j++) o[j] = et_activate1(acc[r][j / ET_VEC][j % ET_VEC], act);
        }
    }
}

/* Packed: a zero input row [Cin], the last partial vector's weight columns [K * Cin][VEC], the bias [Cout
 * rounded up to VEC]. */
static int64_t et_kernel_packed_floats(const int64_t *dims) {
    const int64_t Cin = dims[1], Cout = dims[2], K = dims[3];
    return Cin + (Cout % ET_VEC ? K * Cin * ET_VEC : 0) + (Cout + ET_VEC - 1) / ET_VEC * ET_VEC;
}

static int et_kernel_pack(const int64_t *dims, float *const *bufs, float *packed) {
    const int64_t Cin = dims[1], Cout = dims[2], K = dims[3], rem = Cout % ET_VEC;
    const float *w = bufs[1];
    memset(packed, 0, sizeof(float) * et_kernel_packed_floats(dims));
    float *wtail = packed + Cin, *bias = wtail + (rem ? K * Cin * ET_VEC : 0);
    if (rem)
        for (int64_t d = 0; d < K * Cin; d++)
            for (int64_t j = 0; j < rem; j++) wtail[d * ET_VEC + j] = w[d * Cout + Cout - rem + j];
    memcpy(bias, bufs[2], sizeof(float) * Cout);
    return 0;
}

typedef struct {
    const float *x, *w, *zero, *wtail, *bias;
    float *out;
    int64_t T, Cin, Cout, K, stride, To, nt, nb;
    int act;
} conv1d_args;

/* Item i of (time tile, channel block), in the ORDER knob's order. */
static void conv1d_item(void *ctx, int64_t i) {
    const conv1d_args *a = ctx;
#ifndef ET_ORDER_TC
    const int64_t jb = i / a->nt, it = i % a->nt;
#else
    const int64_t it = i / a->nb, jb = i % a->nb;
#endif
    const int64_t T = a->T, Cin = a->Cin, Cout = a->Cout, K = a->K, stride = a->stride;
    const int64_t t0 = it * ET_TT, rows = a->To - t0 < ET_TT ? a->To - t0 : ET_TT;
    const int64_t n = jb * NR, cols = Cout - n < NR ? Cout - n : NR;
    if (cols == NR) {
        tile(ET_NV, a->x, a->zero, a->w + n, Cout, a->bias + n, a->out + n, T, Cin, Cout, K, stride, t0, rows, NR,
             a->act);
    } else {
        int64_t j = 0;
        for (; j + ET_VEC <= cols; j += ET_VEC)
            tile(1, a->x, a->zero, a->w + n + j, Cout, a->bias + n + j, a->out + n + j, T, Cin, Cout, K, stride, t0,
                 rows, ET_VEC, a->act);
        if (j < cols)
            tile(1, a->x, a->zero, a->wtail, ET_VEC, a->bias + n + j, a->out + n + j, T, Cin, Cout, K, stride, t0,
                 rows, cols - j, a->act);
    }
}

static int et_kernel(const int64_t *dims, float *const *bufs, const float *packed, int act) {
    const int64_t T = dims[0], Cin = dims[1], Cout = dims[2], K = dims[3], stride = dims[4];
    if (T < 1 || Cin < 1 || Cout < 1 || K < 1 || stride < 1) return 1;
    const int64_t pad = K / 2, To = (T + 2 * pad - K) / stride + 1;
    if (To < 1) return 1;
    const float *zero = packed, *wtail = packed + Cin;
    const float *bias = wtail + (Cout % ET_VEC ? K * Cin * ET_VEC : 0);
    conv1d_args a = {bufs[0], bufs[1], zero, wtail, bias, bufs[3], T, Cin, Cout, K, stride, To,
                     (To + ET_TT - 1) / ET_TT, (Cout + NR - 1) / NR, act};
    return et_parallel_for(a.nt * a.nb, conv1d_item, &a);
}
