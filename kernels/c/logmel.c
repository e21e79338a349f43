/* logmel: speech front end. Frames (no centering, frames = 1 + (samples - n_fft) / hop), a window, a real FFT,
 * the power spectrum of bins 0..n_fft/2, a mel filterbank and log(x + 1e-6).
 * dims: samples, n_fft (a power of two), hop, mels.
 * bufs: audio[samples], window[n_fft], twiddles[2, n_fft/2] (cos, -sin of 2*pi*k/n_fft), melfb[n_fft/2+1, mels],
 *       out[frames, mels].
 * The real FFT is an n_fft/2-point complex FFT (even samples real, odd samples imaginary) plus a split step.
 * A tile of FV*VEC frames is transformed at once in a frames-innermost layout, so every butterfly, the power
 * spectrum and the filterbank are whole-vector operations with broadcast twiddles/weights (no shuffles).
 * Knobs: FV frame vectors per tile, VEC floats per vector, GATHER_FRAME | GATHER_POINT (framing loop order: each
 * frame's samples in turn, scattered into the tile, or each FFT point across the tile's frames), FFT_R2 | FFT_R4
 * (radix-2 passes, or two radix-2 stages fused per pass: half the passes over the tile), MEL_DENSE | MEL_SPARSE
 * (all bins, or only each filter's nonzero bin range, found by a scan of the filterbank), UNROLL of the butterfly,
 * split and filterbank loops, PREFETCH of the audio PREFETCH frames ahead (0 = off), THREADS over frame tiles.
 */
#ifndef ET_FV
#define ET_FV 2
#endif
#ifndef ET_UNROLL
#define ET_UNROLL 2
#endif
#if !defined(ET_FFT_R2) && !defined(ET_FFT_R4)
#define ET_FFT_R4
#endif
#if !defined(ET_GATHER_FRAME) && !defined(ET_GATHER_POINT)
#define ET_GATHER_POINT
#endif
#if !defined(ET_MEL_DENSE) && !defined(ET_MEL_SPARSE)
#define ET_MEL_SPARSE
#endif
#include <stdlib.h>

#include "edgetune_kernel.h"

#define FT (ET_FV * ET_VEC) /* frames per tile */

typedef int32_t lm_vi __attribute__((vector_size(ET_VEC * sizeof(int32_t))));

/* Natural log of x > 0 (normal floats), cephes logf polynomial, ~1 ulp. */
static inline et_vf lm_log(et_vf x) {
    lm_vi bits = (lm_vi)x;
    lm_vi e = ((bits >> 23) & 0xff) - 126;
    et_vf m = (et_vf)((bits & (int32_t)0x807fffff) | 0x3f000000); /* [0.5, 1) */
    lm_vi small = m < 0.707106781186547524f;                         /* -1 where true */
    e += small;
    et_vf madd = (et_vf)((lm_vi)m & small); /* m where small, else 0 */
    m = m - 1.0f + madd;
    et_vf ef = __builtin_convertvector(e, et_vf);
    et_vf z = m * m;
    et_vf y = et_splat(7.0376836292E-2f);
    y = y * m - 1.1514610310E-1f;
    y = y * m + 1.1676998740E-1f;
    y = y * m - 1.2420140846E-1f;
    y = y * m + 1.4249322787E-1f;
    y = y * m - 1.6668057665E-1f;
    y = y * m + 2.0000714765E-1f;
    y = y * m - 2.4999993993E-1f;
    y = y * m + 3.3333331174E-1f;
    y = y * m * z;
    y += ef * -2.12194440e-4f;
    y += z * -0.5f;
    return m + y + ef * 0.693359375f;
}

#define LD(p) et_load(p)
#define ST(p, v) et_store(p, v)

/* One radix-2 butterfly on FT lanes: (a, b) <- (a + w b, a - w b). */
static inline void bfly(float *re, float *im, int64_t a, int64_t b, float wr, float wi) {
    const et_vf vwr = et_splat(wr), vwi = et_splat(wi);
    for (int v = 0; v < ET_FV; v++) {
        float *ar = re + a * FT + v * ET_VEC, *ai = im + a * FT + v * ET_VEC;
        float *br = re + b * FT + v * ET_VEC, *bi = im + b * FT + v * ET_VEC;
        et_vf xr = LD(br), xi = LD(bi);
        et_vf tr = xr * vwr - xi * vwi, ti = xr * vwi + xi * vwr;
        et_vf yr = LD(ar), yi = LD(ai);
        ST(br, yr - tr);
        ST(bi, yi - ti);
        ST(ar, yr + tr);
        ST(ai, yi + ti);
    }
}

/* The first pass of length 2 (twiddle 1): additions only. */
static void pass2_trivial(float *re, float *im, int64_t M) {
    for (int64_t s = 0; s < M; s += 2)
        for (int v = 0; v < ET_FV; v++) {
            const int64_t o = v * ET_VEC;
            et_vf r0 = LD(re + s * FT + o), m0 = LD(im + s * FT + o);
            et_vf r1 = LD(re + (s + 1) * FT + o), m1 = LD(im + (s + 1) * FT + o);
            ST(re + s * FT + o, r0 + r1), ST(im + s * FT + o, m0 + m1);
            ST(re + (s + 1) * FT + o, r0 - r1), ST(im + (s + 1) * FT + o, m0 - m1);
        }
}

#ifdef ET_FFT_R4
/* The first fused pass (lengths 2 and 4): twiddles 1, 1 and -i, so additions only. */
static void pass4_trivial(float *re, float *im, int64_t M) {
    for (int64_t s = 0; s < M; s += 4)
        for (int v = 0; v < ET_FV; v++) {
            const int64_t o = v * ET_VEC;
            float *pr = re + s * FT + o, *pi = im + s * FT + o;
            et_vf r0 = LD(pr), m0 = LD(pi), r1 = LD(pr + FT), m1 = LD(pi + FT);
            et_vf r2 = LD(pr + 2 * FT), m2 = LD(pi + 2 * FT), r3 = LD(pr + 3 * FT), m3 = LD(pi + 3 * FT);
            et_vf a0 = r0 + r1, b0 = m0 + m1, a1 = r0 - r1, b1 = m0 - m1;
            et_vf a2 = r2 + r3, b2 = m2 + m3, a3 = r2 - r3, b3 = m2 - m3;
            ST(pr, a0 + a2), ST(pi, b0 + b2), ST(pr + 2 * FT, a0 - a2), ST(pi + 2 * FT, b0 - b2);
            /* x3 * -i = (b3, -a3) */
            ST(pr + FT, a1 + b3), ST(pi + FT, b1 - a3), ST(pr + 3 * FT, a1 - b3), ST(pi + 3 * FT, b1 + a3);
        }
}
#endif

/* In-place complex FFT of M points (input already in bit-reversed order), FT lanes per point. */
static void fft_tile(float *re, float *im, int64_t M, int64_t N, const float *twr, const float *twi) {
    int64_t L = 2;
#ifdef ET_FFT_R4
    int stages = 0;
    while ((1LL << stages) < M) stages++;
    if (stages & 1) { /* one plain stage of length 2, then fused pairs */
        pass2_trivial(re, im, M);
        L = 4;
    } else if (M >= 4) {
        pass4_trivial(re, im, M);
        L = 8;
    }
    for (; 2 * L <= M; L <<= 2) {
        const int64_t q = L / 2, sa = N / L, sb = N / (2 * L);
        for (int64_t s = 0; s < M; s += 2 * L) {
            ET_PRAGMA_UNROLL(ET_UNROLL)
            for (int64_t j = 0; j < q; j++) {
                const et_vf w1r = et_splat(twr[j * sa]), w1i = et_splat(twi[j * sa]);
                const et_vf w2r = et_splat(twr[j * sb]), w2i = et_splat(twi[j * sb]);
                const et_vf w3r = et_splat(twr[(j + q) * sb]), w3i = et_splat(twi[(j + q) * sb]);
                const int64_t i0 = s + j, i1 = i0 + q, i2 = i0 + L, i3 = i2 + q;
                for (int v = 0; v < ET_FV; v++) {
                    const int64_t o = v * ET_VEC;
                    et_vf r0 = LD(re + i0 * FT + o), m0 = LD(im + i0 * FT + o);
                    et_vf r1 = LD(re + i1 * FT + o), m1 = LD(im + i1 * FT + o);
                    et_vf r2 = LD(re + i2 * FT + o), m2 = LD(im + i2 * FT + o);
                    et_vf r3 = LD(re + i3 * FT + o), m3 = LD(im + i3 * FT + o);
                    /* stage of length L: (i0, i1) and (i2, i3) with w1 */
                    et_vf tr = r1 * w1r - m1 * w1i, ti = r1 * w1i + m1 * w1r;
                    r1 = r0 - tr, m1 = m0 - ti, r0 = r0 + tr, m0 = m0 + ti;
                    tr = r3 * w1r - m3 * w1i, ti = r3 * w1i + m3 * w1r;
                    r3 = r2 - tr, m3 = m2 - ti, r2 = r2 + tr, m2 = m2 + ti;
                    /* stage of length 2L: (i0, i2) with w2, (i1, i3) with w3 */
                    tr = r2 * w2r - m2 * w2i, ti = r2 * w2i + m2 * w2r;
                    ST(re + i2 * FT + o, r0 - tr), ST(im + i2 * FT + o, m0 - ti);
                    ST(re + i0 * FT + o, r0 + tr), ST(im + i0 * FT + o, m0 + ti);
                    tr = r3 * w3r - m3 * w3i, ti = r3 * w3i + m3 * w3r;
                    ST(re + i3 * FT + o, r1 - tr), ST(im + i3 * FT + o, m1 - ti);
                    ST(re + i1 * FT + o, r1 + tr), ST(im + i1 * FT + o, m1 + ti);
                }
            }
        }
    }
#else
    if (M >= 2) {
        pass2_trivial(re, im, M);
        L = 4;
    }
#endif
    for (; L <= M; L <<= 1) {
        const int64_t half = L / 2, step = N / L;
        for (int64_t s = 0; s < M; s += L) {
            ET_PRAGMA_UNROLL(ET_UNROLL)
            for (int64_t j = 0; j < half; j++) bfly(re, im, s + j, s + j + half, twr[j * step], twi[j * step]);
        }
    }
}

typedef struct {
    const float *audio, *win, *twr, *twi, *fb;
    float *out, *scratch;
    const int32_t *rev, *lo, *hi;
    int64_t N, hop, mels, M, frames, tiles, per;
} lm_args;

/* Thread p's frame tiles, in its own scratch. */
static void lm_thread(void *ctx, int p) {
    const lm_args *a = ctx;
    const float *audio = a->audio, *win = a->win, *twr = a->twr, *twi = a->twi, *fb = a->fb;
    float *out = a->out;
    const int32_t *rev = a->rev, *lo = a->lo, *hi = a->hi;
    const int64_t N = a->N, hop = a->hop, mels = a->mels, M = a->M, frames = a->frames, tiles = a->tiles;
    const int64_t per = a->per;
    float *scratch = a->scratch;
    float *re = scratch + p * per, *im = re + M * FT, *pw = im + M * FT;
    const int64_t t0 = tiles * p / ET_THREADS, t1 = tiles * (p + 1) / ET_THREADS;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t f0 = t * FT, nf = frames - f0 < FT ? frames - f0 : FT;
        /* gather: window, split even/odd samples into re/im, bit-reversed point order, frames innermost */
#ifdef ET_GATHER_POINT
        /* points outer, frames inner: strided reads (one hop apart), contiguous writes */
        for (int64_t f = nf; f < FT; f++)
            for (int64_t n = 0; n < M; n++) re[n * FT + f] = 0.0f, im[n * FT + f] = 0.0f;
        {
            const float *src0 = audio + f0 * hop;
#if ET_PREFETCH > 0
            /* the audio that the next PREFETCH frames after this tile add */
            if (f0 + FT < frames)
                for (int64_t o = 0; o < ET_PREFETCH * hop; o += 16)
                    __builtin_prefetch(src0 + (FT - 1) * hop + N + o, 0, 3);
#endif
            for (int64_t n = 0; n < M; n++) {
                const int64_t j = rev[n];
                const float we = win[2 * n], wo = win[2 * n + 1];
                float *dr = re + j * FT, *di = im + j * FT;
                for (int64_t f = 0; f < nf; f++) {
                    dr[f] = src0[f * hop + 2 * n] * we;
                    di[f] = src0[f * hop + 2 * n + 1] * wo;
                }
            }
        }
#else
        for (int64_t f = 0; f < FT; f++) {
            if (f >= nf) {
                for (int64_t n = 0; n < M; n++) re[n * FT + f] = 0.0f, im[n * FT + f] = 0.0f;
                continue;
            }
            const float *src = audio + (f0 + f) * hop;
#if ET_PREFETCH > 0
            if (f0 + f + ET_PREFETCH < frames)
                for (int64_t o = 0; o < N; o += 16) __builtin_prefetch(src + ET_PREFETCH * hop + o, 0, 3);
#endif
            for (int64_t n = 0; n < M; n++) {
                const int64_t j = rev[n];
                re[j * FT + f] = src[2 * n] * win[2 * n];
                im[j * FT + f] = src[2 * n + 1] * win[2 * n + 1];
            }
        }
#endif
        fft_tile(re, im, M, N, twr, twi);
        /* split the half-length complex spectrum Z into the real signal's spectrum X, then |X|^2 */
        for (int v = 0; v < ET_FV; v++) {
            const int64_t o = v * ET_VEC;
            et_vf a = LD(re + o), b = LD(im + o);
            ST(pw + o, (a + b) * (a + b));
            ST(pw + M * FT + o, (a - b) * (a - b));
        }
        ET_PRAGMA_UNROLL(ET_UNROLL)
        for (int64_t k = 1; k < M; k++) {
            const et_vf wr = et_splat(twr[k]), wi = et_splat(twi[k]);
            for (int v = 0; v < ET_FV; v++) {
                const int64_t o = v * ET_VEC;
                et_vf a = LD(re + k * FT + o), b = LD(im + k * FT + o);
                et_vf c = LD(re + (M - k) * FT + o), d = LD(im + (M - k) * FT + o);
                et_vf er = (a + c) * 0.5f, ei = (b - d) * 0.5f;
                et_vf or_ = (b + d) * 0.5f, oi = (c - a) * 0.5f;
                et_vf xr = er + wr * or_ - wi * oi, xi = ei + wr * oi + wi * or_;
                ST(pw + k * FT + o, xr * xr + xi * xi);
            }
        }
        /* filterbank + log, frames innermost; transposed store into out[frame, mel] */
        for (int64_t m = 0; m < mels; m++) {
            et_vf acc[ET_FV];
            for (int v = 0; v < ET_FV; v++) acc[v] = et_splat(0.0f);
            const int64_t k1 = hi[m];
            ET_PRAGMA_UNROLL(ET_UNROLL)
            for (int64_t k = lo[m]; k < k1; k++) {
                const et_vf w = et_splat(fb[k * mels + m]);
                for (int v = 0; v < ET_FV; v++) acc[v] += w * LD(pw + k * FT + v * ET_VEC);
            }
            for (int v = 0; v < ET_FV; v++) {
                et_vf l = lm_log(acc[v] + 1e-6f);
                for (int i = 0; i < ET_VEC; i++) {
                    const int64_t f = v * ET_VEC + i;
                    if (f < nf) out[(f0 + f) * mels + m] = l[i];
                }
            }
        }
    }
}

static int et_kernel(const int64_t *dims, float *const *bufs, const float *packed, int act) {
    (void)packed, (void)act;
    const int64_t S = dims[0], N = dims[1], hop = dims[2], mels = dims[3];
    if (N < 2 || (N & (N - 1)) || S < N || hop < 1 || mels < 1) return 1;
    const float *audio = bufs[0], *win = bufs[1], *twr = bufs[2], *twi = bufs[2] + N / 2, *fb = bufs[3];
    float *out = bufs[4];
    const int64_t M = N / 2, bins = M + 1, frames = 1 + (S - N) / hop;
    const int64_t tiles = (frames + FT - 1) / FT;
    const int64_t per = (2 * M + bins) * FT; /* floats of scratch per thread: re, im, power */

    /* Per call: bit-reversal table, each filter's nonzero bin range, one scratch tile per thread. */
    int32_t *rev = malloc(sizeof(int32_t) * (M + 2 * mels));
    float *scratch = aligned_alloc(64, sizeof(float) * ((per * ET_THREADS + 15) & ~(int64_t)15));
    if (!rev || !scratch) {
        free(rev);
        free(scratch);
        return 2;
    }
    int32_t *lo = rev + M, *hi = lo + mels;
    {
        int bits = 0;
        while ((1LL << bits) < M) bits++;
        for (int64_t n = 0; n < M; n++) {
            int64_t r = 0;
            for (int b = 0; b < bits; b++) r |= ((n >> b) & 1) << (bits - 1 - b);
            rev[n] = (int32_t)r;
        }
    }
#ifdef ET_MEL_SPARSE
    for (int64_t m = 0; m < mels; m++) lo[m] = (int32_t)bins, hi[m] = 0;
    for (int64_t k = 0; k < bins; k++) {
        const float *row = fb + k * mels;
        for (int64_t m = 0; m < mels; m++)
            if (row[m] != 0.0f) {
                if (lo[m] > k) lo[m] = (int32_t)k;
                hi[m] = (int32_t)(k + 1);
            }
    }
#else
    for (int64_t m = 0; m < mels; m++) lo[m] = 0, hi[m] = (int32_t)bins;
#endif

    const lm_args a = {audio, win, twr, twi, fb, out, scratch, rev, lo, hi, N, hop, mels, M, frames, tiles, per};
    const int rc = et_parallel(lm_thread, (void *)&a);
    free(rev);
    free(scratch);
    return rc;
}
