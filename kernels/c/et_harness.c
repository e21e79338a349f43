/* edgetune emulation harness: run one cross-built kernel variant once, under qemu-user, on inputs from the host.
 *
 *     qemu-aarch64 -L /usr/aarch64-linux-gnu et_harness VARIANT.so < request > reply
 *
 * request (native little-endian): int32 n_dims, n_inputs, n_outputs, act; int64 dims[n_dims];
 *                                 int64 floats[n_inputs + n_outputs]; then every buffer's floats (the outputs
 *                                 NaN-filled, so a value the kernel never writes is caught).
 * reply: int32 status (0 ok, else the kernel's return code or a negative harness error), then each output's floats.
 * The variant runs as an application runs it: its constant inputs packed once (et_pack into a buffer of
 * et_packed_floats), then et_run with that buffer and the activation code `act`.
 * Built with -DET_ABI_EXPECTED=<ET_ABI_VERSION of edgetune_kernel.h>.
 * Each buffer (the packed one too) starts 4 bytes past a 64-byte boundary: the ABI promises float alignment only,
 * so a variant that assumes vector alignment faults or misreads here rather than on a device.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

enum { ERR_PROTOCOL = -1, ERR_LOAD = -2, ERR_ABI = -3, MAX_BUFS = 64, MISALIGN = 4 };

static int read_all(void *p, size_t n) { return fread(p, 1, n, stdin) == n; }

/* n floats starting MISALIGN bytes past a 64-byte boundary. */
static float *misaligned_floats(int64_t n) {
    char *base = aligned_alloc(64, ((n * sizeof(float) + MISALIGN) / 64 + 1) * 64);
    return base ? (float *)(base + MISALIGN) : NULL;
}

static int reply(int32_t status) {
    fwrite(&status, sizeof status, 1, stdout);
    return status == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
    int32_t head[4];
    if (argc != 2 || !read_all(head, sizeof head) || head[0] < 0 || head[1] < 0 || head[2] < 0 ||
        head[1] + head[2] > MAX_BUFS)
        return reply(ERR_PROTOCOL);
    int n_dims = head[0], n_in = head[1], n_bufs = head[1] + head[2];
    int64_t dims[MAX_BUFS], sizes[MAX_BUFS];
    float *bufs[MAX_BUFS];
    if (n_dims > MAX_BUFS || !read_all(dims, n_dims * sizeof *dims) || !read_all(sizes, n_bufs * sizeof *sizes))
        return reply(ERR_PROTOCOL);
    for (int i = 0; i < n_bufs; i++)
        if (!(bufs[i] = misaligned_floats(sizes[i])) || !read_all(bufs[i], sizes[i] * sizeof(float)))
            return reply(ERR_PROTOCOL);
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "et_harness: %s\n", dlerror());
        return reply(ERR_LOAD);
    }
    int (*abi)(void) = (int (*)(void))dlsym(lib, "et_abi_version");
    int64_t (*packed_floats)(const int64_t *) = (int64_t(*)(const int64_t *))dlsym(lib, "et_packed_floats");
    int (*pack)(const int64_t *, float *const *, float *) =
        (int (*)(const int64_t *, float *const *, float *))dlsym(lib, "et_pack");
    int (*run)(const int64_t *, float *const *, const float *, int) =
        (int (*)(const int64_t *, float *const *, const float *, int))dlsym(lib, "et_run");
    if (!abi || !packed_floats || !pack || !run || abi() != ET_ABI_EXPECTED) return reply(ERR_ABI);
    const int64_t n_packed = packed_floats(dims);
    float *packed = NULL;
    if (n_packed > 0 && !(packed = misaligned_floats(n_packed))) return reply(ERR_PROTOCOL);
    int32_t rc = packed ? pack(dims, bufs, packed) : 0;
    if (!rc) rc = run(dims, bufs, packed, head[3]);
    if (reply(rc)) return 1;
    for (int i = n_in; i < n_bufs; i++) fwrite(bufs[i], sizeof(float), sizes[i], stdout);
    return fflush(stdout) != 0;
}
