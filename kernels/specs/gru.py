"""gru: one GRU layer over a feature sequence (ONNX GRU, linear_before_reset=1 as in PyTorch), all hidden states."""

from __future__ import annotations

import random

import numpy as np

from kernels.space import Constraint, enum
from kernels.spec import C_DIR, Dim, KernelSpec, Workload
from kernels.specs.common import (PREFETCH, THREADS, THREADS_FIT_CORES, VEC, VEC_FITS_ISA, onnx_model, rand,
                                  registers_fit)
from kernels.specs.common import logu, round_to


def _inputs(s: dict, rng: np.random.Generator) -> list[np.ndarray]:
    T, I, H = s["T"], s["I"], s["H"]
    return [
        rand(rng, T, I),
        rand(rng, 3 * H, I, scale=1 / np.sqrt(I)),
        rand(rng, 3 * H, H, scale=1 / np.sqrt(H)),
        rand(rng, 6 * H, scale=0.1),
        rand(rng, H, scale=0.5),
    ]


def _tile_units(c: dict) -> int:
    return int(c["ut"]) * (int(c["vec"]) if c["layout"] == "cols" else 1)


def _sigmoid(v: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-v))


def _reference(s: dict, x: list[np.ndarray]) -> list[np.ndarray]:
    H = s["H"]
    xs, W, R, B, h = (a.astype(np.float64) for a in x)
    gx = xs @ W.T + B[:3 * H]  # [T, 3H]: z, r, h
    rb = B[3 * H:]
    out = np.empty((s["T"], H))
    for t in range(s["T"]):
        gh = R @ h + rb
        z = _sigmoid(gx[t, :H] + gh[:H])
        r = _sigmoid(gx[t, H:2 * H] + gh[H:2 * H])
        n = np.tanh(gx[t, 2 * H:] + r * gh[2 * H:])
        h = (1.0 - z) * n + z * h
        out[t] = h
    return [out.astype(np.float32)]


def _twin(s: dict) -> bytes:
    """ONNX GRU (forward, linear_before_reset=1) on x [T, 1, I] with W/R/B/h0 given a leading num_directions axis."""
    from onnx import TensorProto, helper

    T, I, H = s["T"], s["I"], s["H"]
    nodes = [
        helper.make_node("Unsqueeze", ["x", "axis1"], ["x3"]),  # [T, 1, I]
        helper.make_node("Unsqueeze", ["W", "axis0"], ["W3"]),  # [1, 3H, I]
        helper.make_node("Unsqueeze", ["R", "axis0"], ["R3"]),  # [1, 3H, H]
        helper.make_node("Unsqueeze", ["B", "axis0"], ["B2"]),  # [1, 6H]
        helper.make_node("Reshape", ["h0", "h0_shape"], ["h03"]),  # [1, 1, H]
        helper.make_node("GRU", ["x3", "W3", "R3", "B2", "", "h03"], ["Y4"], hidden_size=H, linear_before_reset=1),
        helper.make_node("Reshape", ["Y4", "y_shape"], ["Y"]),  # [T, 1, 1, H] -> [T, H]
    ]
    inits = [
        helper.make_tensor("axis0", TensorProto.INT64, [1], [0]),
        helper.make_tensor("axis1", TensorProto.INT64, [1], [1]),
        helper.make_tensor("h0_shape", TensorProto.INT64, [3], [1, 1, H]),
        helper.make_tensor("y_shape", TensorProto.INT64, [2], [T, H]),
    ]
    return onnx_model(nodes, [("x", (T, I)), ("W", (3 * H, I)), ("R", (3 * H, H)), ("B", (6 * H,)), ("h0", (H,))],
                      [("Y", (T, H))], inits)


def _synthetic(rng: random.Random) -> dict:
    """A seeded edge-range shape for the collector: 10-200 steps, 16-256 inputs and hidden units."""
    return {"T": logu(rng, 10, 200), "I": round_to(logu(rng, 16, 256), 8), "H": round_to(logu(rng, 16, 256), 8)}


SPEC = KernelSpec(
    name="gru",
    domain="speech",
    summary="GRU layer over T steps (ONNX gates z,r,h; linear_before_reset=1 as PyTorch), Y[T,H] = all hidden states",
    source=C_DIR / "gru.c",
    dims=(Dim("T", "time steps"), Dim("I", "input features"), Dim("H", "hidden units")),
    params=(
        VEC,
        enum("ut", 1, 2, 4, 8, help="register tile: units (rows layout) or unit vectors (cols layout), x3 gates"),
        enum("unroll", 1, 2, 4, help="unroll of the inner product loop"),
        enum("layout", "rows", "cols", help="read W/R rows in place (dot products) or transposed per call (axpy)"),
        enum("order", "pre", "step", help="input projections for all steps first (one GEMM), or inside each step"),
        PREFETCH,
        THREADS,
    ),
    constraints=(
        VEC_FITS_ISA,
        THREADS_FIT_CORES,
        registers_fit("3 * ut accumulators", lambda c: 3 * c["ut"], share=0.75),
        Constraint("a unit tile wider than H only computes padding (it runs as narrower tiles)",
                   lambda c, s, hw: c["ut"] == 1 or _tile_units(c) <= max(c["vec"], s["H"])),
    ),
    default={"vec": 8, "ut": 2, "unroll": 2, "layout": "cols", "order": "pre", "prefetch": 0, "threads": 1},
    workloads=(
        Workload("rnnoise.gru", {"T": 100, "I": 96, "H": 96},
                 "RNNoise-style speech enhancement: the 96-unit noise GRU over 1 s of 10 ms frames"),
        Workload("kws_crnn.gru", {"T": 49, "I": 64, "H": 64},
                 "CRNN keyword spotting (Hello Edge): a 64-unit GRU over 49 conv-output frames"),
        Workload("vad_asr.gru", {"T": 100, "I": 80, "H": 128},
                 "small streaming VAD / ASR encoder: a 128-unit GRU over 1 s of 80-mel frames"),
    ),
    make_inputs=_inputs,
    output_shapes=lambda s: [(s["T"], s["H"])],
    reference=_reference,
    onnx_model=_twin,
    flops=lambda s: s["T"] * (2.0 * 3 * s["H"] * (s["I"] + s["H"]) + 12.0 * s["H"]),
    bytes_moved=lambda s: 4.0 * (s["T"] * s["I"] + 3 * s["H"] * (s["I"] + s["H"]) + 7 * s["H"] + s["T"] * s["H"]),
    rtol=1e-4,
    atol=1e-4,
    inputs=("x", "W", "R", "B", "h0"),
    constant_inputs=(1, 2, 3),
    synthetic=_synthetic,
)
