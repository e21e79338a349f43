/* edgetune kernel ABI (contract, see DESIGN.md "kernels").
 *
 * A kernel file defines its knobs as macros with #ifndef defaults, includes this header and implements
 *     static int et_kernel(const int64_t *dims, float *const *bufs);
 * dims: the runtime shape, in the spec's Dim order. bufs: the inputs, then the outputs, in the spec's order.
 * Return 0 on success. This header exports the same entry points from every kernel:
 *     int et_abi_version(void);
 *     int et_run(const int64_t *dims, float *const *bufs);
 *     int et_bench(int warmup, int reps, int inner, const int64_t *dims, float *const *bufs,
 *                  double *wall_ms, double *cpu_ms, int64_t *nivcsw);
 * et_bench fills, per rep, wall ms and thread-CPU ms per call and the involuntary context switches seen during
 * that rep. A rep runs the kernel `inner` times, so microsecond kernels are not lost in clock overhead.
 */
#ifndef EDGETUNE_KERNEL_H
#define EDGETUNE_KERNEL_H

#include <stdint.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#define ET_ABI_VERSION 1

#ifndef ET_VEC /* floats per vector register */
#define ET_VEC 8
#endif
#ifndef ET_THREADS
#define ET_THREADS 1
#endif
#ifndef ET_PREFETCH /* software prefetch distance in elements (0 = off) */
#define ET_PREFETCH 0
#endif

#define ET_PRAGMA(x) _Pragma(#x)
/* ET_PRAGMA_UNROLL(n): ask GCC to unroll the next loop n times. */
#define ET_PRAGMA_UNROLL(n) ET_PRAGMA(GCC unroll n)
/* ET_PARALLEL_FOR: an OpenMP worksharing loop when built with threads > 1 (-fopenmp), a plain loop otherwise. */
#if defined(_OPENMP) && ET_THREADS > 1
#define ET_PARALLEL_FOR ET_PRAGMA(omp parallel for num_threads(ET_THREADS) schedule(static))
#define ET_PARALLEL_FOR_COLLAPSE2 ET_PRAGMA(omp parallel for collapse(2) num_threads(ET_THREADS) schedule(static))
#else
#define ET_PARALLEL_FOR
#define ET_PARALLEL_FOR_COLLAPSE2
#endif

/* GCC vector extensions: et_vf is ET_VEC floats; external memory goes through the unaligned type. */
typedef float et_vf __attribute__((vector_size(ET_VEC * sizeof(float))));
typedef float et_vf_u __attribute__((vector_size(ET_VEC * sizeof(float)), aligned(4), may_alias));

static inline et_vf et_load(const float *p) { return *(const et_vf_u *)p; }
static inline void et_store(float *p, et_vf v) { *(et_vf_u *)p = v; }
static inline et_vf et_splat(float x) { return (et_vf){0} + x; }
static inline float et_hsum(et_vf v) {
    float s = 0.0f;
    for (int i = 0; i < ET_VEC; i++) s += v[i];
    return s;
}

#if ET_PREFETCH > 0
#define ET_PREFETCH_R(p) __builtin_prefetch((p) + ET_PREFETCH, 0, 3)
#define ET_PREFETCH_W(p) __builtin_prefetch((p) + ET_PREFETCH, 1, 3)
#else
#define ET_PREFETCH_R(p) ((void)0)
#define ET_PREFETCH_W(p) ((void)0)
#endif

static int et_kernel(const int64_t *dims, float *const *bufs);

int et_abi_version(void) { return ET_ABI_VERSION; }

int et_run(const int64_t *dims, float *const *bufs) { return et_kernel(dims, bufs); }

static inline double et_ms(clockid_t clk) {
    struct timespec ts;
    clock_gettime(clk, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

int et_bench(int warmup, int reps, int inner, const int64_t *dims, float *const *bufs, double *wall_ms, double *cpu_ms,
             int64_t *nivcsw) {
    for (int i = 0; i < warmup; i++)
        if (et_kernel(dims, bufs)) return 1;
    for (int r = 0; r < reps; r++) {
        struct rusage ru0, ru1;
        getrusage(RUSAGE_SELF, &ru0);
        double c0 = et_ms(CLOCK_THREAD_CPUTIME_ID), w0 = et_ms(CLOCK_MONOTONIC);
        int rc = 0;
        for (int i = 0; i < inner && !rc; i++) rc = et_kernel(dims, bufs);
        double w1 = et_ms(CLOCK_MONOTONIC), c1 = et_ms(CLOCK_THREAD_CPUTIME_ID);
        getrusage(RUSAGE_SELF, &ru1);
        if (rc) return rc;
        wall_ms[r] = (w1 - w0) / inner;
        cpu_ms[r] = (c1 - c0) / inner;
        nivcsw[r] = ru1.ru_nivcsw - ru0.ru_nivcsw;
    }
    return 0;
}

#endif
