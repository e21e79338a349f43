"""Roofline ceiling for a variant: min(measured peak FMA rate x threads, arithmetic intensity x bandwidth).

Peak is measured once per hw_fingerprint with a tiny FMA loop built like a kernel (same -march), because
nominal clocks and FMA-unit counts are not readable on most edge boards.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from edgetune import paths
from hwprobe.compiler import compiler_path

_PEAK_SRC = r"""
#include <stdio.h>
#include <time.h>
typedef float vf __attribute__((vector_size(VEC * 4)));
/* keep each accumulator in a vector register, so the loop is 12 independent FMA chains and nothing else */
#if defined(__x86_64__) || defined(__i386__)
#define KEEP(x) __asm__ volatile("" : "+v"(x))
#elif defined(__aarch64__) || defined(__arm__)
#define KEEP(x) __asm__ volatile("" : "+w"(x))
#else
#define KEEP(x)
#endif
#define F(x) x = x * b + c; KEEP(x);
int main(void) {
    vf b = (vf){0} + 1.0000001f, c = (vf){0} + 1e-7f;
    vf a0 = b, a1 = b + c, a2 = b + 2 * c, a3 = b + 3 * c, a4 = b + 4 * c, a5 = b + 5 * c;
    vf a6 = b + 6 * c, a7 = b + 7 * c, a8 = b + 8 * c, a9 = b + 9 * c, a10 = b + 10 * c, a11 = b + 11 * c;
    long iters = 20000000;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long n = 0; n < iters; n++) {
        F(a0) F(a1) F(a2) F(a3) F(a4) F(a5) F(a6) F(a7) F(a8) F(a9) F(a10) F(a11)
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    vf s = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11;
    double sec = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
    printf("%f %f\n", 2.0 * 12 * VEC * iters / sec / 1e9, (double)s[0]);
    return 0;
}
"""


def peak_gflops_per_core(hw: Any) -> float | None:
    """Single-core fp32 FMA GFLOP/s at the descriptor's ISA; cached per hw_fingerprint. None if unmeasurable."""
    cache = paths.cache_dir() / f"peak2-{hw.hw_fingerprint}.json"
    if cache.exists():
        return json.loads(cache.read_text())["gflops"]
    try:
        cc = compiler_path(fallback=hw.compiler.path)
        with tempfile.TemporaryDirectory() as d:
            src, exe = Path(d) / "peak.c", Path(d) / "peak"
            src.write_text(_PEAK_SRC)
            flags = [f"-DVEC={max(4, hw.vector_bits // 32)}"]
            subprocess.run([cc, "-O2", *([f"-march={hw.march}"] if hw.march else []), *flags, str(src), "-o", str(exe)],
                           check=True, capture_output=True, timeout=60)
            best = max(float(subprocess.run([str(exe)], capture_output=True, text=True, timeout=60).stdout.split()[0])
                       for _ in range(3))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    cache.write_text(json.dumps({"gflops": best, "measured_at": time.time()}))
    return best


def roofline_fraction(gflops: float, flops: float, bytes_moved: float, threads: int, hw: Any) -> float | None:
    peak = peak_gflops_per_core(hw)
    if peak is None or not hw.bandwidth_gbps:
        return None
    ceiling = min(peak * threads, flops / bytes_moved * hw.bandwidth_gbps)
    return gflops / ceiling if ceiling > 0 else None
