"""gemm: pointwise (1x1) convolution in NHWC and fully-connected layers, as C[M,N] = act(A[M,K] B[K,N] + bias)."""

from __future__ import annotations

import random

import numpy as np

from kernels.space import Constraint, enum, pow2
from kernels.spec import C_DIR, Dim, KernelSpec, Workload
from kernels.specs.common import (PREFETCH, THREADS, THREADS_FIT_CORES, VEC, VEC_FITS_ISA, bias, onnx_model, rand,
                                  registers_fit)
from kernels.specs.common import logu, round_to


def _inputs(s: dict, rng: np.random.Generator) -> list[np.ndarray]:
    return [rand(rng, s["M"], s["K"]), rand(rng, s["K"], s["N"], scale=1 / np.sqrt(s["K"])), bias(rng, s["N"])]


def _reference(s: dict, x: list[np.ndarray]) -> list[np.ndarray]:
    return [(x[0].astype(np.float64) @ x[1].astype(np.float64) + x[2]).astype(np.float32)]


def _twin(s: dict) -> bytes:
    from onnx import helper

    return onnx_model([helper.make_node("Gemm", ["A", "B", "bias"], ["C"])],
                      [("A", (s["M"], s["K"])), ("B", (s["K"], s["N"])), ("bias", (s["N"],))],
                      [("C", (s["M"], s["N"]))])


def _synthetic(rng: random.Random) -> dict:
    """A seeded edge-range shape for the collector: fc layers (M=1, 16) and conv-as-gemm panels."""
    return {"M": rng.choice([1, 16, logu(rng, 8, 4096), logu(rng, 49, 3136), logu(rng, 49, 3136)]),
            "N": round_to(logu(rng, 8, 512), rng.choice([4, 8, 16])), "K": round_to(logu(rng, 8, 1024), 8)}


SPEC = KernelSpec(
    name="gemm",
    domain="vision",
    summary="C[M,N] = act(A[M,K] B[K,N] + bias[N]): pointwise conv (M = H*W pixels) and FC layers",
    source=C_DIR / "gemm.c",
    dims=(Dim("M", "rows (output pixels H*W, or batch)"), Dim("N", "output channels / features"),
          Dim("K", "input channels / features")),
    params=(
        enum("mr", 1, 2, 4, 8, help="rows per register tile"),
        enum("nv", 1, 2, 4, help="vectors per register-tile row"),
        pow2("kc", 32, 256, help="depth (K) block"),
        VEC,
        enum("unroll_k", 1, 2, 4, 8, help="unroll of the inner k loop"),
        PREFETCH,
        THREADS,
    ),
    constraints=(
        VEC_FITS_ISA,
        THREADS_FIT_CORES,
        registers_fit("mr * nv accumulators", lambda c: c["mr"] * c["nv"]),
        Constraint("kc beyond 2*K only repeats kc=K", lambda c, s, hw: c["kc"] <= max(32, 2 * s["K"])),
        Constraint("a column panel (nv * vec) wider than N runs as scalar edge tiles",
                   lambda c, s, hw: c["nv"] == 1 or c["nv"] * c["vec"] <= max(c["vec"], s["N"])),
    ),
    default={"mr": 4, "nv": 2, "kc": 128, "vec": 8, "unroll_k": 4, "prefetch": 0, "threads": 1},
    workloads=(
        Workload("mobilenetv2.b2.expand", {"M": 3136, "N": 144, "K": 24}, "MobileNetV2 block 2 1x1 expand, 56x56"),
        Workload("mobilenetv2.b6.project", {"M": 196, "N": 64, "K": 384}, "MobileNetV2 block 6 1x1 project, 14x14"),
        Workload("kws_dscnn.pw4", {"M": 125, "N": 64, "K": 64}, "DS-CNN keyword spotting pointwise 4, 25x5"),
        Workload("kws_dscnn.fc", {"M": 1, "N": 12, "K": 64}, "DS-CNN keyword spotting classifier"),
    ),
    make_inputs=_inputs,
    output_shapes=lambda s: [(s["M"], s["N"])],
    reference=_reference,
    onnx_model=_twin,
    flops=lambda s: 2.0 * s["M"] * s["N"] * s["K"],
    bytes_moved=lambda s: 4.0 * (s["M"] * s["K"] + s["K"] * s["N"] + s["M"] * s["N"]),
    rtol=1e-4,
    atol=1e-4,
    epilogue=True,
    inputs=("A", "B", "bias"),
    constant_inputs=(1, 2),
    synthetic=_synthetic,
)
