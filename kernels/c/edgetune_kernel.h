/* edgetune kernel ABI 2 (contract, see DESIGN.md "kernels").
 *
 * A kernel file defines its knobs as macros with #ifndef defaults, optionally ET_EPILOGUE (it takes a bias input
 * and a runtime activation) and ET_PACKS (it packs its constant inputs once), includes this header and implements
 *     static int et_kernel(const int64_t *dims, float *const *bufs, const float *packed, int act);
 * and, with ET_PACKS,
 *     static int64_t et_kernel_packed_floats(const int64_t *dims);
 *     static int et_kernel_pack(const int64_t *dims, float *const *bufs, float *packed);
 * dims: the runtime shape, in the spec's Dim order. bufs: the inputs, then the outputs, in the spec's order.
 * Return 0 on success. This header exports the same entry points from every kernel:
 *     int et_abi_version(void);
 *     int64_t et_packed_floats(const int64_t *dims);
 *     int et_pack(const int64_t *dims, float *const *bufs, float *packed);
 *     int et_run(const int64_t *dims, float *const *bufs, const float *packed, int act);
 *     int et_bench(int warmup, int reps, int inner, const int64_t *dims, float *const *bufs, const float *packed,
 *                  int act, double *wall_ms, double *cpu_ms, int64_t *nivcsw);
 * et_packed_floats: the floats of the packed-weights buffer for this shape; 0 when the kernel does not pack.
 * et_pack: fills `packed` from the constant inputs in bufs (weights, bias; the spec's constant_inputs), once per
 *     set of weights, as a layer loads. Its layout belongs to the build (its knobs), so pack with the same .so.
 * et_run: bufs holds every input, as for et_pack; `packed` is et_pack's buffer for the same dims and constant
 *     inputs, or NULL, and the call packs into a temporary (a one-off call; slower). `act` is the fused activation applied after
 *     the bias: ET_ACT_NONE 0, ET_ACT_RELU 1, ET_ACT_RELU6 2; a kernel without ET_EPILOGUE takes only 0.
 * Buffers need float alignment only. Return codes: the kernel's own (1-63), ET_ERR_ACT, ET_ERR_NOMEM,
 * ET_ERR_THREADS.
 * et_bench fills, per rep, wall ms and thread-CPU ms per call and the involuntary context switches seen during
 * that rep. A rep runs the kernel `inner` times, so microsecond kernels are not lost in clock overhead. Only the run
 * is timed: given no packed buffer, et_bench packs once before timing, as a layer packs at load.
 *
 * Threads (ET_THREADS > 1): a persistent pool of ET_THREADS - 1 pthreads per library, started on the first
 * parallel call. Between calls a worker spins for ET_SPIN_US microseconds, then sleeps on a futex (XNNPACK's
 * pthreadpool and onnxruntime's pool do the same), so back-to-back layers pay no wake-up and an idle process
 * burns no core. Kernels split work with et_parallel_for (items; static ranges with stealing) or et_parallel
 * (one call per thread, all running at once, for kernels that synchronise inside). Concurrent et_run calls on one
 * library take turns. Build with -pthread.
 *
 * Changes from ABI 1: OpenMP (`-fopenmp`, OMP_WAIT_POLICY) replaced by the pool above; et_packed_floats and
 * et_pack added, and et_run/et_bench take `packed` and `act`; kernels with an epilogue (gemm, conv2d_3x3,
 * dwconv_3x3, conv1d) take a bias vector as the input after their weights.
 */
#ifndef EDGETUNE_KERNEL_H
#define EDGETUNE_KERNEL_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#define ET_ABI_VERSION 2

#define ET_ACT_NONE 0
#define ET_ACT_RELU 1
#define ET_ACT_RELU6 2
#define ET_ERR_ACT 64     /* activation unknown, or given to a kernel without an epilogue */
#define ET_ERR_NOMEM 65   /* a temporary (packing or scratch) could not be allocated */
#define ET_ERR_THREADS 66 /* the thread pool could not start */

#ifndef ET_VEC /* floats per vector register */
#define ET_VEC 8
#endif
#ifndef ET_THREADS
#define ET_THREADS 1
#endif
#ifndef ET_PREFETCH /* software prefetch distance in elements (0 = off) */
#define ET_PREFETCH 0
#endif
#ifndef ET_SPIN_US /* how long an idle pool worker spins before it sleeps (bench/pool_spin.py measures it) */
#define ET_SPIN_US 1000
#endif

#define ET_PRAGMA(x) _Pragma(#x)
/* ET_PRAGMA_UNROLL(n): ask GCC to unroll the next loop n times. */
#define ET_PRAGMA_UNROLL(n) ET_PRAGMA(GCC unroll n)
#define ET_INLINE static inline __attribute__((always_inline))

/* GCC vector extensions: et_vf is ET_VEC floats; external memory goes through the unaligned type. */
typedef float et_vf __attribute__((vector_size(ET_VEC * sizeof(float))));
typedef float et_vf_u __attribute__((vector_size(ET_VEC * sizeof(float)), aligned(4), may_alias));
typedef int32_t et_vi __attribute__((vector_size(ET_VEC * sizeof(int32_t))));

static inline et_vf et_load(const float *p) { return *(const et_vf_u *)p; }
static inline void et_store(float *p, et_vf v) { *(et_vf_u *)p = v; }
static inline et_vf et_splat(float x) { return (et_vf){0} + x; }
static inline float et_hsum(et_vf v) {
    float s = 0.0f;
    for (int i = 0; i < ET_VEC; i++) s += v[i];
    return s;
}
/* Lane-wise select: m ? a : b, m a comparison result (all ones or zeros per lane). */
static inline et_vf et_select(et_vi m, et_vf a, et_vf b) { return (et_vf)(((et_vi)a & m) | ((et_vi)b & ~m)); }
static inline et_vf et_max(et_vf a, et_vf b) { return et_select(a > b, a, b); }
static inline et_vf et_min(et_vf a, et_vf b) { return et_select(a < b, a, b); }

/* The fused activation; act is a constant at the call sites that matter (ET_EPILOGUE_SWITCH), so this folds. */
ET_INLINE et_vf et_activate(et_vf v, int act) {
    if (act == ET_ACT_RELU) return et_max(v, et_splat(0.0f));
    if (act == ET_ACT_RELU6) return et_min(et_max(v, et_splat(0.0f)), et_splat(6.0f));
    return v;
}
ET_INLINE float et_activate1(float v, int act) {
    if (act != ET_ACT_NONE && v < 0.0f) v = 0.0f;
    if (act == ET_ACT_RELU6 && v > 6.0f) v = 6.0f;
    return v;
}
/* ET_EPILOGUE_SWITCH(act, CALL): CALL(a) with a a compile-time constant for each activation, so an always-inlined
 * kernel body is instantiated once per activation and its stores carry no runtime branch. */
#define ET_EPILOGUE_SWITCH(act, CALL)                                                                                 \
    ((act) == ET_ACT_RELU ? CALL(ET_ACT_RELU) : (act) == ET_ACT_RELU6 ? CALL(ET_ACT_RELU6) : CALL(ET_ACT_NONE))

#if ET_PREFETCH > 0
#define ET_PREFETCH_R(p) __builtin_prefetch((p) + ET_PREFETCH, 0, 3)
#define ET_PREFETCH_W(p) __builtin_prefetch((p) + ET_PREFETCH, 1, 3)
#else
#define ET_PREFETCH_R(p) ((void)0)
#define ET_PREFETCH_W(p) ((void)0)
#endif

static inline void et_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
    __asm__ __volatile__("yield");
#endif
}

static inline double et_ms(clockid_t clk) {
    struct timespec ts;
    clock_gettime(clk, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

/* ---- thread pool ---------------------------------------------------------------------------------------------- */

typedef void (*et_thread_fn)(void *ctx, int tid);
typedef void (*et_item_fn)(void *ctx, int64_t i);

#if ET_THREADS > 1
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

static struct {
    pthread_mutex_t lock; /* one dispatch at a time */
    int started;          /* a start was attempted (in this process: a forked child starts its own) */
    int ok;               /* every worker started */
    et_thread_fn fn;
    void *ctx;
    uint32_t gen;         /* bumped per dispatch; the futex word workers sleep on */
    int running;          /* workers still inside the current dispatch */
    int sleepers;         /* workers asleep (or about to be) on gen */
    int quit;
    pthread_t tid[ET_THREADS - 1];
} et_pool = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void et_futex(uint32_t *word, int op, uint32_t val) {
    syscall(SYS_futex, word, op | FUTEX_PRIVATE_FLAG, val, NULL, NULL, 0);
}

/* Wait until gen moves past `seen`: spin ET_SPIN_US, then sleep. The sleeper count and gen are a Dekker pair with
 * the dispatcher (both sequentially consistent): either the dispatcher sees the sleeper and wakes it, or the
 * sleeper sees the new gen (and futex_wait returns at once when gen already differs). */
static uint32_t et_pool_wait(uint32_t seen) {
    uint32_t g;
    double t0 = 0.0;
    for (unsigned i = 1;; i++) {
        if ((g = __atomic_load_n(&et_pool.gen, __ATOMIC_ACQUIRE)) != seen) return g;
        if (i % 64) {
            et_cpu_relax();
            continue;
        }
        const double now = et_ms(CLOCK_MONOTONIC);
        if (t0 == 0.0) t0 = now;
        if ((now - t0) * 1e3 < ET_SPIN_US) continue;
        __atomic_add_fetch(&et_pool.sleepers, 1, __ATOMIC_SEQ_CST);
        while ((g = __atomic_load_n(&et_pool.gen, __ATOMIC_SEQ_CST)) == seen) et_futex(&et_pool.gen, FUTEX_WAIT, seen);
        __atomic_sub_fetch(&et_pool.sleepers, 1, __ATOMIC_SEQ_CST);
        return g;
    }
}

static void *et_pool_worker(void *arg) {
    const int tid = (int)(intptr_t)arg;
    uint32_t seen = 0;
    for (;;) {
        seen = et_pool_wait(seen);
        if (__atomic_load_n(&et_pool.quit, __ATOMIC_ACQUIRE)) return NULL;
        et_pool.fn(et_pool.ctx, tid);
        __atomic_sub_fetch(&et_pool.running, 1, __ATOMIC_RELEASE);
    }
}

/* fork() copies no threads: the child starts its own pool on its first parallel call. Forking waits for any
 * dispatch in flight, so the child never inherits a held lock. */
static void et_pool_prefork(void) { pthread_mutex_lock(&et_pool.lock); }
static void et_pool_postfork_parent(void) { pthread_mutex_unlock(&et_pool.lock); }
static void et_pool_postfork_child(void) {
    et_pool.started = et_pool.ok = et_pool.sleepers = et_pool.running = et_pool.quit = 0;
    pthread_mutex_unlock(&et_pool.lock);
}

static void et_pool_start(void) {
    et_pool.started = 1;
    pthread_atfork(et_pool_prefork, et_pool_postfork_parent, et_pool_postfork_child);
    int n = 0;
    for (; n < ET_THREADS - 1; n++)
        if (pthread_create(&et_pool.tid[n], NULL, et_pool_worker, (void *)(intptr_t)(n + 1))) break;
    et_pool.ok = n == ET_THREADS - 1;
    if (!et_pool.ok) { /* release the ones that started: a pool is all its threads or nothing */
        __atomic_store_n(&et_pool.quit, 1, __ATOMIC_RELEASE);
        __atomic_add_fetch(&et_pool.gen, 1, __ATOMIC_SEQ_CST);
        et_futex(&et_pool.gen, FUTEX_WAKE, INT32_MAX);
        for (int i = 0; i < n; i++) pthread_join(et_pool.tid[i], NULL);
    }
}

/* Workers must be gone before the library is unmapped (dlclose), or they would run unmapped code. */
__attribute__((destructor)) static void et_pool_stop(void) {
    if (!et_pool.ok || pthread_mutex_trylock(&et_pool.lock)) return; /* busy: the process is exiting mid-call */
    __atomic_store_n(&et_pool.quit, 1, __ATOMIC_RELEASE);
    __atomic_add_fetch(&et_pool.gen, 1, __ATOMIC_SEQ_CST);
    et_futex(&et_pool.gen, FUTEX_WAKE, INT32_MAX);
    for (int i = 0; i < ET_THREADS - 1; i++) pthread_join(et_pool.tid[i], NULL);
    et_pool.ok = 0;
    pthread_mutex_unlock(&et_pool.lock);
}
#endif

/* fn(ctx, tid) for every tid in [0, ET_THREADS), each on its own thread, all running at once (the caller is
 * tid 0), so fn may synchronise its threads. Returns 0, or ET_ERR_THREADS when the pool could not start. */
__attribute__((unused)) static int et_parallel(et_thread_fn fn, void *ctx) {
#if ET_THREADS > 1
    pthread_mutex_lock(&et_pool.lock);
    if (!et_pool.started) et_pool_start();
    if (!et_pool.ok) {
        pthread_mutex_unlock(&et_pool.lock);
        return ET_ERR_THREADS;
    }
    et_pool.fn = fn, et_pool.ctx = ctx;
    __atomic_store_n(&et_pool.running, ET_THREADS - 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&et_pool.gen, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&et_pool.sleepers, __ATOMIC_SEQ_CST)) et_futex(&et_pool.gen, FUTEX_WAKE, INT32_MAX);
    fn(ctx, 0);
    for (unsigned i = 0; __atomic_load_n(&et_pool.running, __ATOMIC_ACQUIRE); i++) {
        if (i < (1u << 16))
            et_cpu_relax();
        else
            sched_yield(); /* a worker was preempted (a shared core): let it run */
    }
    pthread_mutex_unlock(&et_pool.lock);
#else
    fn(ctx, 0);
#endif
    return 0;
}

#if ET_THREADS > 1
/* et_parallel_for's shared state: each thread owns a contiguous range of items, takes them from its front, and
 * when done steals from the back of the others' (pthreadpool's scheme); `left` arbitrates, so no item runs twice. */
typedef struct {
    int64_t next, end, left;
} __attribute__((aligned(64))) et_range; /* one cache line per thread's range */
typedef struct {
    et_item_fn fn;
    void *ctx;
    et_range r[ET_THREADS];
} et_for_state;

static inline int et_take(int64_t *left) {
    int64_t n = __atomic_load_n(left, __ATOMIC_RELAXED);
    while (n > 0)
        if (__atomic_compare_exchange_n(left, &n, n - 1, 1, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) return 1;
    return 0;
}

static void et_for_thread(void *vs, int tid) {
    et_for_state *s = vs;
    et_range *mine = &s->r[tid];
    while (et_take(&mine->left)) s->fn(s->ctx, __atomic_fetch_add(&mine->next, 1, __ATOMIC_RELAXED));
    for (int k = 1; k < ET_THREADS; k++) {
        et_range *other = &s->r[(tid + k) % ET_THREADS];
        while (et_take(&other->left)) s->fn(s->ctx, __atomic_sub_fetch(&other->end, 1, __ATOMIC_RELAXED));
    }
}
#endif

/* fn(ctx, i) once for every i in [0, n), spread over the pool; a plain loop with one thread or one item. */
__attribute__((unused)) static int et_parallel_for(int64_t n, et_item_fn fn, void *ctx) {
#if ET_THREADS > 1
    if (n > 1) {
        et_for_state s;
        s.fn = fn, s.ctx = ctx;
        for (int t = 0; t < ET_THREADS; t++) {
            s.r[t].next = n * t / ET_THREADS;
            s.r[t].end = n * (t + 1) / ET_THREADS;
            s.r[t].left = s.r[t].end - s.r[t].next;
        }
        return et_parallel(et_for_thread, &s);
    }
#endif
    for (int64_t i = 0; i < n; i++) fn(ctx, i);
    return 0;
}

/* ---- entry points -------------------------------------------------------------------------------------------- */

static int et_kernel(const int64_t *dims, float *const *bufs, const float *packed, int act);

#ifdef ET_PACKS
static int64_t et_kernel_packed_floats(const int64_t *dims);
static int et_kernel_pack(const int64_t *dims, float *const *bufs, float *packed);
#else
static int64_t et_kernel_packed_floats(const int64_t *dims) {
    (void)dims;
    return 0;
}
static int et_kernel_pack(const int64_t *dims, float *const *bufs, float *packed) {
    (void)dims, (void)bufs, (void)packed;
    return 0;
}
#endif

int et_abi_version(void) { return ET_ABI_VERSION; }

int64_t et_packed_floats(const int64_t *dims) { return et_kernel_packed_floats(dims); }

int et_pack(const int64_t *dims, float *const *bufs, float *packed) { return et_kernel_pack(dims, bufs, packed); }

static int et_check_act(int act) {
#ifdef ET_EPILOGUE
    return act == ET_ACT_NONE || act == ET_ACT_RELU || act == ET_ACT_RELU6 ? 0 : ET_ERR_ACT;
#else
    return act == ET_ACT_NONE ? 0 : ET_ERR_ACT;
#endif
}

int et_run(const int64_t *dims, float *const *bufs, const float *packed, int act) {
    int rc = et_check_act(act);
    if (rc) return rc;
    const int64_t n = et_kernel_packed_floats(dims);
    if (n <= 0 || packed) return et_kernel(dims, bufs, packed, act);
    float *tmp = aligned_alloc(64, ((size_t)n * sizeof(float) + 63) / 64 * 64);
    if (!tmp) return ET_ERR_NOMEM;
    rc = et_kernel_pack(dims, bufs, tmp);
    if (!rc) rc = et_kernel(dims, bufs, tmp, act);
    free(tmp);
    return rc;
}

static int et_bench_runs(int warmup, int reps, int inner, const int64_t *dims, float *const *bufs,
                         const float *packed, int act, double *wall_ms, double *cpu_ms, int64_t *nivcsw) {
    int rc = 0;
    for (int i = 0; i < warmup; i++)
        if ((rc = et_kernel(dims, bufs, packed, act))) return rc;
    for (int r = 0; r < reps; r++) {
        struct rusage ru0, ru1;
        getrusage(RUSAGE_SELF, &ru0);
        double c0 = et_ms(CLOCK_THREAD_CPUTIME_ID), w0 = et_ms(CLOCK_MONOTONIC);
        for (int i = 0; i < inner && !rc; i++) rc = et_kernel(dims, bufs, packed, act);
        double w1 = et_ms(CLOCK_MONOTONIC), c1 = et_ms(CLOCK_THREAD_CPUTIME_ID);
        getrusage(RUSAGE_SELF, &ru1);
        if (rc) return rc;
        wall_ms[r] = (w1 - w0) / inner;
        cpu_ms[r] = (c1 - c0) / inner;
        nivcsw[r] = ru1.ru_nivcsw - ru0.ru_nivcsw;
    }
    return 0;
}

int et_bench(int warmup, int reps, int inner, const int64_t *dims, float *const *bufs, const float *packed, int act,
             double *wall_ms, double *cpu_ms, int64_t *nivcsw) {
    int rc = et_check_act(act);
    if (rc) return rc;
    float *tmp = NULL; /* no packed buffer given: pack once before timing, as a layer packs at load */
    const int64_t n = et_kernel_packed_floats(dims);
    if (n > 0 && !packed) {
        if (!(tmp = aligned_alloc(64, ((size_t)n * sizeof(float) + 63) / 64 * 64))) return ET_ERR_NOMEM;
        if ((rc = et_kernel_pack(dims, bufs, tmp))) goto done;
        packed = tmp;
    }
    rc = et_bench_runs(warmup, reps, inner, dims, bufs, packed, act, wall_ms, cpu_ms, nivcsw);
done:
    free(tmp);
    return rc;
}

#endif
