"""conv1d: temporal convolution over a [T, Cin] feature sequence (Whisper's conv stem, TC-ResNet KWS layers)."""

from __future__ import annotations

import random

import numpy as np

from kernels.space import Constraint, enum
from kernels.spec import C_DIR, Dim, KernelSpec, Workload
from kernels.specs.common import (PREFETCH, THREADS, THREADS_FIT_CORES, VEC, VEC_FITS_ISA, bias, onnx_model, rand,
                                  registers_fit)
from kernels.specs.common import logu, round_to


def out_steps(s: dict) -> int:
    pad = s["K"] // 2
    return (s["T"] + 2 * pad - s["K"]) // s["stride"] + 1


def _inputs(s: dict, rng: np.random.Generator) -> list[np.ndarray]:
    return [rand(rng, s["T"], s["Cin"]),
            rand(rng, s["K"], s["Cin"], s["Cout"], scale=1 / np.sqrt(s["K"] * s["Cin"])), bias(rng, s["Cout"])]


def _reference(s: dict, x: list[np.ndarray]) -> list[np.ndarray]:
    T, K, stride, pad, to = s["T"], s["K"], s["stride"], s["K"] // 2, out_steps(s)
    xp = np.zeros((T + 2 * pad + stride, s["Cin"]))
    xp[pad:pad + T] = x[0]
    w = x[1].astype(np.float64)
    out = np.zeros((to, s["Cout"])) + x[2]
    for k in range(K):
        out += xp[k:k + stride * to:stride] @ w[k]
    return [out.astype(np.float32)]


def _twin(s: dict) -> bytes:
    """Transpose x to [1, Cin, T] and w to [Cout, Cin, K], a 1-D Conv (with the bias) with pads K/2, then back to
    [To, Cout]."""
    from onnx import TensorProto, helper

    T, cin, cout, K, pad, to = s["T"], s["Cin"], s["Cout"], s["K"], s["K"] // 2, out_steps(s)
    nodes = [
        helper.make_node("Unsqueeze", ["x", "axis0"], ["x3"]),
        helper.make_node("Transpose", ["x3"], ["xn"], perm=[0, 2, 1]),
        helper.make_node("Transpose", ["w"], ["wn"], perm=[2, 1, 0]),
        helper.make_node("Conv", ["xn", "wn", "bias"], ["yn"], kernel_shape=[K], strides=[s["stride"]],
                         pads=[pad, pad]),
        helper.make_node("Squeeze", ["yn", "axis0"], ["y2"]),
        helper.make_node("Transpose", ["y2"], ["out"], perm=[1, 0]),
    ]
    inits = [helper.make_tensor("axis0", TensorProto.INT64, [1], [0])]
    return onnx_model(nodes, [("x", (T, cin)), ("w", (K, cin, cout)), ("bias", (cout,))], [("out", (to, cout))],
                      inits)


def _shape_problems(s: dict) -> list[str]:
    if s["T"] + 2 * (s["K"] // 2) < s["K"]:
        return [f"T={s['T']} is too short for K={s['K']} with padding K//2"]
    return []


def _synthetic(rng: random.Random) -> dict:
    """A seeded edge-range shape for the collector: 16-400 frames, 8-512 channels, odd kernel widths."""
    return {"T": logu(rng, 16, 400), "Cin": round_to(logu(rng, 8, 512), 8), "Cout": round_to(logu(rng, 8, 512), 4),
            "K": rng.choice([1, 3, 3, 5, 7, 9]), "stride": rng.choice([1, 1, 2])}


SPEC = KernelSpec(
    name="conv1d",
    domain="speech",
    summary="temporal conv out[To,Cout] = act(sum_k x[t*stride+k-K/2, Cin] w[k,Cin,Cout] + bias), time-major "
            "channels-last",
    source=C_DIR / "conv1d.c",
    dims=(
        Dim("T", "input time steps (frames)"),
        Dim("Cin", "input channels / features"),
        Dim("Cout", "output channels"),
        Dim("K", "kernel size in time steps (zero padding K//2 on both ends)"),
        Dim("stride", "time stride", choices=(1, 2)),
    ),
    params=(
        enum("tt", 1, 2, 4, 6, 8, help="output time steps per register tile"),
        enum("nv", 1, 2, 3, 4, help="vectors of output channels per register tile"),
        VEC,
        enum("unroll", 1, 2, 4, 8, help="unroll of the depth (input channel) loop"),
        PREFETCH,
        THREADS,
        enum("order", "tc", "ct", help="tile loop order: time tiles outer (tc) or channel blocks outer (ct)"),
    ),
    constraints=(
        VEC_FITS_ISA,
        THREADS_FIT_CORES,
        registers_fit("tt * nv accumulators", lambda c: c["tt"] * c["nv"]),
        Constraint("a time tile longer than the output only computes padding",
                   lambda c, s, hw: c["tt"] == 1 or c["tt"] <= out_steps(s)),
        Constraint("a channel block wider than Cout only computes padding",
                   lambda c, s, hw: c["nv"] == 1 or c["nv"] * c["vec"] <= max(c["vec"], s["Cout"])),
    ),
    default={"tt": 4, "nv": 3, "vec": 8, "unroll": 4, "prefetch": 0, "threads": 1, "order": "ct"},
    workloads=(
        Workload("whisper_tiny.conv1", {"T": 300, "Cin": 80, "Cout": 384, "K": 3, "stride": 1},
                 "Whisper tiny encoder conv1 (80 mels -> 384, k3), on a 3 s chunk (300 of the 3000 frames)"),
        Workload("whisper_tiny.conv2", {"T": 300, "Cin": 384, "Cout": 384, "K": 3, "stride": 2},
                 "Whisper tiny encoder conv2 (384 -> 384, k3, stride 2), on a 3 s chunk"),
        Workload("tc_resnet8.block1.conv1", {"T": 101, "Cin": 24, "Cout": 36, "K": 9, "stride": 2},
                 "TC-ResNet8-1.5 keyword spotting, block 1 first conv (24 -> 36, k9, stride 2), 1 s of 10 ms frames"),
        Workload("tc_resnet8.block1.conv2", {"T": 51, "Cin": 36, "Cout": 36, "K": 9, "stride": 1},
                 "TC-ResNet8-1.5 keyword spotting, block 1 second conv (36 -> 36, k9)"),
    ),
    make_inputs=_inputs,
    output_shapes=lambda s: [(out_steps(s), s["Cout"])],
    reference=_reference,
    onnx_model=_twin,
    flops=lambda s: 2.0 * out_steps(s) * s["Cout"] * s["K"] * s["Cin"],
    bytes_moved=lambda s: 4.0 * (s["T"] * s["Cin"] + s["K"] * s["Cin"] * s["Cout"] + out_steps(s) * s["Cout"]),
    rtol=1e-4,
    atol=1e-4,
    epilogue=True,
    inputs=("x", "w", "bias"),
    constant_inputs=(1, 2),
    shape_problems=_shape_problems,
    synthetic=_synthetic,
)
