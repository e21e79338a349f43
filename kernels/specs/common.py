"""Knobs and constraints shared by every kernel spec, and a helper to build ONNX twins."""

from __future__ import annotations

import math
import random
from typing import Any, Callable

import numpy as np

from kernels.space import Config, Constraint, enum, pow2

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
