"""conv2d_3x3: regular 3x3 convolution (pad 1, stride 1 or 2) in NHWC with HWIO weights."""

from __future__ import annotations

import random

import numpy as np

from kernels.space import Constraint, enum
from kernels.spec import C_DIR, Dim, KernelSpec, Workload
from kernels.specs.common import (PREFETCH, THREADS, THREADS_FIT_CORES, VEC, VEC_FITS_ISA, bias, const, onnx_model,
                                  out_size, rand, registers_fit)
from kernels.specs.common import logu, round_to


def _inputs(s: dict, rng: np.random.Generator) -> list[np.ndarray]:
    return [rand(rng, s["H"], s["W"], s["Cin"]), rand(rng, 3, 3, s["Cin"], s["Cout"], scale=1 / np.sqrt(9 * s["Cin"])),
            bias(rng, s["Cout"])]


def _reference(s: dict, x: list[np.ndarray]) -> list[np.ndarray]:
    H, W, S = s["H"], s["W"], s["stride"]
    Ho, Wo = out_size(H, S), out_size(W, S)
    xp = np.pad(x[0].astype(np.float64), ((1, 1), (1, 1), (0, 0)))
    w = x[1].astype(np.float64)
    y = np.zeros((Ho, Wo, s["Cout"]), np.float64) + x[2]
    for ky in range(3):
        for kx in range(3):
            patch = xp[ky:ky + S * (Ho - 1) + 1:S, kx:kx + S * (Wo - 1) + 1:S, :]
            y += patch @ w[ky, kx]
    return [y.astype(np.float32)]


def _twin(s: dict) -> bytes:
    """ONNX Conv (with its bias input) on NCHW/OIHW, wrapped in Transposes so the graph reads NHWC X and HWIO Wt
    and writes NHWC Y."""
    from onnx import helper

    S = s["stride"]
    Ho, Wo = out_size(s["H"], S), out_size(s["W"], S)
    nodes = [
        helper.make_node("Unsqueeze", ["X", "axes0"], ["X4"]),  # [1,H,W,Cin]
        helper.make_node("Transpose", ["X4"], ["Xn"], perm=[0, 3, 1, 2]),  # [1,Cin,H,W]
        helper.make_node("Transpose", ["Wt"], ["Woihw"], perm=[3, 2, 0, 1]),  # HWIO -> OIHW
        helper.make_node("Conv", ["Xn", "Woihw", "bias"], ["Yn"], kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                         strides=[S, S]),
        helper.make_node("Transpose", ["Yn"], ["Y4"], perm=[0, 2, 3, 1]),  # [1,Ho,Wo,Cout]
        helper.make_node("Squeeze", ["Y4", "axes0"], ["Y"]),
    ]
    return onnx_model(nodes, [("X", (s["H"], s["W"], s["Cin"])), ("Wt", (3, 3, s["Cin"], s["Cout"])),
                              ("bias", (s["Cout"],))],
                      [("Y", (Ho, Wo, s["Cout"]))], initializers=[const("axes0", np.array([0], np.int64))])


def _flops(s: dict) -> float:
    return 2.0 * 9 * s["Cin"] * s["Cout"] * out_size(s["H"], s["stride"]) * out_size(s["W"], s["stride"])


def _bytes(s: dict) -> float:
    Ho, Wo = out_size(s["H"], s["stride"]), out_size(s["W"], s["stride"])
    return 4.0 * (s["H"] * s["W"] * s["Cin"] + 9 * s["Cin"] * s["Cout"] + Ho * Wo * s["Cout"])


def _synthetic(rng: random.Random) -> dict:
    """A seeded edge-range shape for the collector: 7-112 px feature maps, RGB or 8-256 channels."""
    hw_ = logu(rng, 7, 112)
    return {"H": hw_, "W": rng.choice([hw_, logu(rng, 5, 112)]),
            "Cin": rng.choice([1, 3, round_to(logu(rng, 8, 256), 8)]), "Cout": round_to(logu(rng, 8, 256), 8),
            "stride": rng.choice([1, 1, 2])}


SPEC = KernelSpec(
    baked_dims=("stride",),
    name="conv2d_3x3",
    domain="vision",
    summary="3x3 convolution, pad 1, stride 1|2: act(NHWC input [H,W,Cin] * HWIO weights [3,3,Cin,Cout] + bias) -> "
            "[Ho,Wo,Cout]",
    source=C_DIR / "conv2d_3x3.c",
    dims=(Dim("H", "input height"), Dim("W", "input width"), Dim("Cin", "input channels"),
          Dim("Cout", "output channels"), Dim("stride", "spatial stride (pad is 1)", choices=(1, 2))),
    params=(
        enum("cv", 1, 2, 4, help="vectors of output channels per register tile"),
        enum("wt", 1, 2, 3, 4, 6, 8, help="output pixels (along a row) per register tile"),
        VEC,
        enum("unroll", 1, 2, 4, help="unroll of the input-channel loop"),
        enum("order", "ky_kx_ci", "ci_ky_kx", help="reduction loop order (and packed weight layout)"),
        enum("outer", "rows", "panels", help="outer loop: output rows (input rows stay hot) or channel panels "
             "(a weight panel stays hot)"),
        PREFETCH,
        THREADS,
    ),
    constraints=(
        VEC_FITS_ISA,
        THREADS_FIT_CORES,
        registers_fit("wt * cv accumulators + cv weight vectors + 1", lambda c: c["wt"] * c["cv"] + c["cv"] + 1),
        Constraint("a channel panel (cv * vec) must not hold a whole vector of padding beyond Cout",
                   lambda c, s, hw: (c["cv"] - 1) * c["vec"] < s["Cout"]),
        Constraint("wt beyond the output width only repeats a smaller tile",
                   lambda c, s, hw: c["wt"] <= max(1, out_size(s["W"], s["stride"]))),
    ),
    default={"cv": 2, "wt": 4, "vec": 8, "unroll": 2, "order": "ky_kx_ci", "outer": "rows",
             "prefetch": 0, "threads": 1},
    workloads=(
        Workload("mobilenetv2.stem", {"H": 224, "W": 224, "Cin": 3, "Cout": 32, "stride": 2},
                 "MobileNetV2 first conv, 224x224x3 -> 112x112x32, stride 2"),
        Workload("resnet18.layer1.conv", {"H": 56, "W": 56, "Cin": 64, "Cout": 64, "stride": 1},
                 "ResNet-18 layer1 3x3 conv, 56x56x64 -> 56x56x64"),
        Workload("resnet18.layer2.0.conv1", {"H": 56, "W": 56, "Cin": 64, "Cout": 128, "stride": 2},
                 "ResNet-18 layer2 first (downsampling) 3x3 conv, 56x56x64 -> 28x28x128, stride 2"),
        Workload("yolov3tiny.conv6", {"H": 13, "W": 13, "Cin": 256, "Cout": 512, "stride": 1},
                 "YOLOv3-tiny (416 input) 3x3 conv after the 5th maxpool, 13x13x256 -> 13x13x512"),
        Workload("kws_res8.conv0", {"H": 101, "W": 40, "Cin": 1, "Cout": 45, "stride": 1},
                 "Res8 keyword spotting (Tang & Lin) first conv on 101x40 MFCC, 45 maps"),
    ),
    make_inputs=_inputs,
    output_shapes=lambda s: [(out_size(s["H"], s["stride"]), out_size(s["W"], s["stride"]), s["Cout"])],
    reference=_reference,
    onnx_model=_twin,
    flops=_flops,
    bytes_moved=_bytes,
    rtol=1e-4,
    atol=1e-4,
    epilogue=True,
    inputs=("X", "Wt", "bias"),
    constant_inputs=(1, 2),
    synthetic=_synthetic,
)
