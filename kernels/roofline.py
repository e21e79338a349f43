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
from kernels.build import find_compiler

_PEAK_SRC = r"""
#include <stdio.h>
#include <time.h>
typedef float vf __attribute__((vector_size(VEC * 4)));
int main(void) {
    vf a[12], b = (vf){0} + 1.0000001f, c = (vf){0} + 1e-7f;
    for (int i = 0; i < 12; i++) a[i] = (vf){0} + (float)i;
    long iters = 20000000;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long n = 0; n < iters; n++)
        for (int i = 0; i < 12; i++) { a[i] = a[i] * b + c; __asm__ volatile("" : "+x"(a[i])); }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    float s = 0; for (int i = 0; i < 12; i++) s += a[i][0];
    double sec = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
    printf("%f %f\n", 2.0 * 12 * VEC * iters / sec / 1e9, s);
    return 0;
}
"""


def peak_gflops_per_core(hw: Any) -> float | None:
    """Single-core fp32 FMA GFLOP/s at the descriptor's ISA; cached per hw_fingerprint. None if unmeasurable."""
    cache = paths.cache_dir() / f"peak-{hw.hw_fingerprint}.json"
    if cache.exists():
        return json.loads(cache.read_text())["gflops"]
    try:
        cc = find_compiler(hw)
        with tempfile.TemporaryDirectory() as d:
            src, exe = Path(d) / "peak.c", Path(d) / "peak"
            src.write_text(_PEAK_SRC)
            asm_ok = hw.arch in ("x86_64", "i686")
            flags = [f"-DVEC={max(4, hw.vector_bits // 32)}"] + ([] if asm_ok else ["-D__asm__(x)="])
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
