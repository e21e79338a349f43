"""dwconv_3x3: depthwise 3x3 convolution (pad 1, stride 1 or 2) in NHWC, weights [3,3,C]."""

from __future__ import annotations

import random

import numpy as np

from kernels.space import Constraint, enum
from kernels.spec import C_DIR, Dim, KernelSpec, Workload
from kernels.specs.common import (THREADS, THREADS_FIT_CORES, VEC, VEC_FITS_ISA, bias, const, onnx_model,
                                  out_size, rand, registers_fit)
from kernels.specs.common import logu, round_to


def _inputs(s: dict, rng: np.random.Generator) -> list[np.ndarray]:
    return [rand(rng, s["H"], s["W"], s["C"]), rand(rng, 3, 3, s["C"], scale=1 / 3), bias(rng, s["C"])]


def _reference(s: dict, x: list[np.ndarray]) -> list[np.ndarray]:
    S = s["stride"]
    Ho, Wo = out_size(s["H"], S), out_size(s["W"], S)
    xp = np.pad(x[0].astype(np.float64), ((1, 1), (1, 1), (0, 0)))
    w = x[1].astype(np.float64)
    y = np.zeros((Ho, Wo, s["C"]), np.float64) + x[2]
    for ky in range(3):
        for kx in range(3):
            y += xp[ky:ky + S * (Ho - 1) + 1:S, kx:kx + S * (Wo - 1) + 1:S, :] * w[ky, kx]
    return [y.astype(np.float32)]


def _twin(s: dict) -> bytes:
    """Grouped ONNX Conv (group = C, with the bias) on NCHW, wrapped so the graph reads NHWC X and [3,3,C] Wt, writes
    NHWC Y."""
    from onnx import helper

    S, C = s["stride"], s["C"]
    Ho, Wo = out_size(s["H"], S), out_size(s["W"], S)
    nodes = [
        helper.make_node("Unsqueeze", ["X", "axes0"], ["X4"]),  # [1,H,W,C]
        helper.make_node("Transpose", ["X4"], ["Xn"], perm=[0, 3, 1, 2]),  # [1,C,H,W]
        helper.make_node("Transpose", ["Wt"], ["Wc"], perm=[2, 0, 1]),  # [C,3,3]
        helper.make_node("Reshape", ["Wc", "wshape"], ["Wg"]),  # [C,1,3,3]
        helper.make_node("Conv", ["Xn", "Wg", "bias"], ["Yn"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[S, S],
                         group=C),
        helper.make_node("Transpose", ["Yn"], ["Y4"], perm=[0, 2, 3, 1]),  # [1,Ho,Wo,C]
        helper.make_node("Squeeze", ["Y4", "axes0"], ["Y"]),
    ]
    return onnx_model(nodes, [("X", (s["H"], s["W"], C)), ("Wt", (3, 3, C)), ("bias", (C,))], [("Y", (Ho, Wo, C))],
                      initializers=[const("axes0", np.array([0], np.int64)),
                                    const("wshape", np.array([C, 1, 3, 3], np.int64))])


def _flops(s: dict) -> float:
    return 2.0 * 9 * s["C"] * out_size(s["H"], s["stride"]) * out_size(s["W"], s["stride"])


def _bytes(s: dict) -> float:
    Ho, Wo = out_size(s["H"], s["stride"]), out_size(s["W"], s["stride"])
    return 4.0 * (s["H"] * s["W"] * s["C"] + 9 * s["C"] + Ho * Wo * s["C"])


def _synthetic(rng: random.Random) -> dict:
    """A seeded edge-range shape for the collector: 5-112 px feature maps, 8-576 channels."""
    hw_ = logu(rng, 5, 112)
    return {"H": hw_, "W": rng.choice([hw_, logu(rng, 5, 112)]), "C": round_to(logu(rng, 8, 576), 8),
            "stride": rng.choice([1, 1, 2])}


SPEC = KernelSpec(
    baked_dims=("stride", "C", "W"),
    name="dwconv_3x3",
    domain="vision",
    summary="depthwise 3x3 convolution, pad 1, stride 1|2: act(NHWC input [H,W,C] * weights [3,3,C] + bias) -> "
            "[Ho,Wo,C]",
    source=C_DIR / "dwconv_3x3.c",
    dims=(Dim("H", "input height"), Dim("W", "input width"), Dim("C", "channels"),
          Dim("stride", "spatial stride (pad is 1)", choices=(1, 2))),
    params=(
        enum("cv", 1, 2, 4, help="channel vectors per register tile (a tile's channels: cv * vec; the last tile of a "
             "row is shifted back to end at C, so no channel runs scalar unless C < vec)"),
        enum("wt", 1, 2, 3, 4, 5, 6, 8, help="output pixels along a row per register tile: its (wt-1)*stride+3 input "
             "columns are each loaded once per input row"),
        enum("rt", 1, 2, 3, 4, help="output rows per register tile: its (rt-1)*stride+3 input rows are each loaded "
             "once (rows shared by neighbouring output rows, at stride 1 and 2)"),
        VEC,
        enum("order", "rows", "channels", "pixels", help="work order: rows (a row tile runs every channel tile), "
             "channels (a channel tile runs every row tile: its input rows are reused from L1 by the next row tile), "
             "pixels (a row tile runs all channel tiles of one pixel tile, then the next: input pixels are read "
             "contiguously, taps reloaded per tile)"),
        enum("prefetch", 0, 1, 2, 8, help="software prefetch into L2 of the input rows that the row tile this many "
             "row tiles below starts on (0 = off)"),
        THREADS,
    ),
    constraints=(
        VEC_FITS_ISA,
        THREADS_FIT_CORES,
        registers_fit("rt * wt * cv accumulators + cv input vectors + 1 tap",
                      lambda c: c["rt"] * c["wt"] * c["cv"] + c["cv"] + 1),
        Constraint("a channel tile (cv * vec) must fit in C",
                   lambda c, s, hw: c["cv"] == 1 or c["cv"] * c["vec"] <= s["C"]),
        Constraint("a vector wider than C runs only scalar code",
                   lambda c, s, hw: c["vec"] <= max(4, s["C"])),
        Constraint("wt beyond the output width only repeats a smaller tile",
                   lambda c, s, hw: c["wt"] <= max(1, out_size(s["W"], s["stride"]))),
        Constraint("rt beyond the output height only repeats a smaller tile",
                   lambda c, s, hw: c["rt"] <= max(1, out_size(s["H"], s["stride"]))),
    ),
    default={"cv": 2, "wt": 3, "rt": 2, "vec": 8, "order": "pixels", "prefetch": 0, "threads": 1},
    workloads=(
        Workload("mobilenetv2.b2.dw", {"H": 56, "W": 56, "C": 144, "stride": 1},
                 "MobileNetV2 block 2 depthwise 3x3, 56x56x144, stride 1"),
        Workload("mobilenetv2.b1.dw", {"H": 112, "W": 112, "C": 96, "stride": 2},
                 "MobileNetV2 block 1 depthwise 3x3, 112x112x96 -> 56x56x96, stride 2"),
        Workload("mobilenetv2.b7.dw", {"H": 14, "W": 14, "C": 384, "stride": 1},
                 "MobileNetV2 block 7 depthwise 3x3, 14x14x384, stride 1"),
        Workload("kws_dscnn_l.dw1", {"H": 25, "W": 5, "C": 276, "stride": 1},
                 "DS-CNN-L keyword spotting depthwise 1, 25x5x276"),
    ),
    make_inputs=_inputs,
    output_shapes=lambda s: [(out_size(s["H"], s["stride"]), out_size(s["W"], s["stride"]), s["C"])],
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
