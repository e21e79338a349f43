"""Knobs and constraints shared by every kernel spec, and a helper to build ONNX twins."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kernels.space import Config, Constraint, Param, enum, pow2

VEC = pow2("vec", 4, 16, help="floats per vector register (GCC vector extensions)")
THREADS = enum("threads", 1, 2, 4, help="threads of the kernel's pool (1: no pool)")
PREFETCH = enum("prefetch", 0, 2, 8, help="software prefetch distance (kernel-specific unit), 0 = off")

VEC_FITS_ISA = Constraint(
    "vec * 32 bits must fit the ISA's vector width", lambda c, s, hw: int(c["vec"]) * 32 <= hw.vector_bits
)
# big.LITTLE: a static team ends with its slowest thread, so threads count against the big cluster's cores
THREADS_FIT_CORES = Constraint("threads must not exceed the usable big cores (all cores where they are equal)",
                               lambda c, s, hw: int(c["threads"]) <= hw.big_cores)


def registers_fit(what: str, needed: Callable[[Config], int], share: float = 1.0) -> Constraint:
    """A register tile of `needed(config)` vector registers must fit `share` of the SIMD register file
    (HwDescriptor.vector_registers), the rest being left for loads and broadcasts."""
    return Constraint(f"{what} must fit {share:.0%} of the vector registers (32 on aarch64 and AVX-512, 16 on "
                      "AVX2/SSE and armv7 NEON)", lambda c, s, hw: needed(c) <= share * hw.vector_registers)


@dataclass(frozen=True)
class GemmCore:
    """The knobs and constraints of the shared GEMM core (kernels/c/et_gemm.h), bound to how a kernel's shape maps to
    the GEMM's rows (m) and columns (n)."""

    params: tuple[Param, ...]
    constraints: tuple[Constraint, ...]


def gemm_core(m: Callable[[Any], int], n: Callable[[Any], int]) -> GemmCore:
    def tiles(c: Config, s: Any) -> int:
        return -(-m(s) // int(c["mr"]))

    def panels(c: Config, s: Any) -> int:
        return -(-n(s) // (int(c["nv"]) * int(c["vec"])))

    mb = enum("mb", 1, 4, 16, 64, help="row tiles per block (an L2 block of the activations; blocks are what the "
              "threads share)")
    nb = enum("nb", 1, 2, 4, 16, help="panels per block (an L2 block of the packed weights)")
    params = (
        enum("mr", 1, 2, 3, 4, 5, 6, 7, 8, 12, help="rows of the register tile (MLAS runs 12 or 6, XNNPACK 7 or 5)"),
        enum("nv", 1, 2, 3, 4, help="vectors per register-tile row: a packed weight panel is nv * vec columns"),
        VEC,
        mb,
        nb,
        enum("order", "panels", "rows", help="inside a block: panels outer (a panel is reused from L1 by every row "
             "tile) or row tiles outer (a tile's activations are reused from L1 by every panel)"),
        enum("unroll_k", 1, 2, 4, 8, help="unroll of the micro-kernel's depth loop"),
        PREFETCH,
        THREADS,
    )
    constraints = (
        VEC_FITS_ISA,
        THREADS_FIT_CORES,
        registers_fit("mr * nv accumulators + nv panel vectors + 1 broadcast",
                      lambda c: c["mr"] * c["nv"] + c["nv"] + 1),
        Constraint("a tile taller than the GEMM's rows only repeats its last row",
                   lambda c, s, hw: c["mr"] == 1 or c["mr"] <= m(s)),
        Constraint("a panel must not hold a whole vector of padding beyond the output channels",
                   lambda c, s, hw: (c["nv"] - 1) * c["vec"] < n(s)),
        Constraint("every thread needs a block of its own", lambda c, s, hw: c["threads"] == 1
                   or -(-tiles(c, s) // c["mb"]) * -(-panels(c, s) // c["nb"]) >= c["threads"]),
    )
    return GemmCore(params, constraints)


GEMM_CORE_DEFAULT = {"mr": 6, "nv": 2, "vec": 8, "mb": 16, "nb": 4, "order": "panels", "unroll_k": 4, "prefetch": 0,
                     "threads": 1}


def onnx_model(nodes: list, inputs: list[tuple[str, tuple[int, ...]]], outputs: list[tuple[str, tuple[int, ...]]],
               initializers: list[Any] = (), opset: int = 17) -> bytes:
    """Serialize a single-graph fp32 ONNX model (onnx is imported lazily: only the twin needs it)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        nodes, "twin",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in outputs],
        initializer=list(initializers),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model.SerializeToString()


def const(name: str, value: np.ndarray) -> Any:
    from onnx import numpy_helper

    return numpy_helper.from_array(np.asarray(value), name)


def rand(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def bias(rng: np.random.Generator, n: int) -> np.ndarray:
    """A bias vector of n channels, large enough that relu and relu6 both clip part of the output."""
    return rand(rng, n, scale=0.5)


def out_size(n: int, stride: int) -> int:
    """Output extent of a 3x3 window with pad 1: (n + 2 - 3) // stride + 1."""
    return (n - 1) // stride + 1


def logu(rng: random.Random, lo: int, hi: int) -> int:
    """A log-uniform integer in [lo, hi]: edge shapes span orders of magnitude (synthetic shapes)."""
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def round_to(v: int, m: int) -> int:
    """v rounded to a multiple of m (at least m): channel counts as real layers have them."""
    return max(m, int(round(v / m)) * m)
