"""XNNPACK through LiteRT as a peer: a one-op `.tflite` model built here, run by `ai_edge_litert`'s interpreter
with its default XNNPACK delegate and `num_threads`.

The model is written with the flatbuffer schema module that ships inside ai-edge-litert (`schema_py_generated`),
weights as constant buffers (XNNPACK packs them once, at delegate init, as it would for a real model), NHWC
activations: FULLY_CONNECTED for gemm, CONV_2D, DEPTHWISE_CONV_2D, and conv1d as a CONV_2D of height 1. TFLite's
SAME padding differs from the kernels' symmetric pad where the window does not fit evenly (stride 2 on an even
size): there an explicit PAD precedes a VALID convolution, which XNNPACK fuses into the convolution's padding.
A call's time is `invoke()`'s wall time; an op under TINY_US runs as R independent copies in one model, so Python's
call overhead is spread over R.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from bench.peers.cases import PeerCase
from bench.peers.timing import time_calls

TINY_US = 200.0  # invoke() costs a few microseconds of Python: below this an op runs as R copies
MAX_COPIES = 256
WARMUP_CALLS = 3
NO_XNNPACK = {
    "gru": "TFLite has no GRU builtin (a converted GRU is a WHILE loop of FULLY_CONNECTED and element-wise ops), "
           "so there is no one-op XNNPACK model",
    "logmel": "TFLite's RFFT2D has no XNNPACK kernel (it runs on the builtin path), so XNNPACK has no log-mel",
}
ACT = {"none": 0, "relu": 1, "relu6": 3}  # schema ActivationFunctionType


def available() -> str | None:
    """Why LiteRT cannot run here, or None."""
    try:
        import ai_edge_litert.interpreter  # noqa: F401
        import flatbuffers  # noqa: F401
    except ImportError as e:
        return f"ai-edge-litert is not installed ({e}); pip install -e '.[bench]'"
    return None


@dataclass
class _Model:
    """A single-subgraph model under construction: buffer 0 is the empty sentinel the schema requires."""

    tensors: list = field(default_factory=list)
    buffers: list = field(default_factory=lambda: [None])
    ops: list = field(default_factory=list)
    codes: list[int] = field(default_factory=list)

    def tensor(self, name: str, shape: tuple[int, ...], data: np.ndarray | None = None, dtype: str = "f32") -> int:
        from ai_edge_litert import schema_py_generated as S

        t = S.TensorT()
        t.name, t.shape = name, list(shape)
        t.type = S.TensorType.FLOAT32 if dtype == "f32" else S.TensorType.INT32
        t.buffer = len(self.buffers)
        self.buffers.append(None if data is None else np.ascontiguousarray(data))
        self.tensors.append(t)
        return len(self.tensors) - 1

    def op(self, code: int, inputs: list[int], outputs: list[int], options_type: int = 0, options: Any = None) -> None:
        from ai_edge_litert import schema_py_generated as S

        if code not in self.codes:
            self.codes.append(code)
        o = S.OperatorT()
        o.opcodeIndex, o.inputs, o.outputs = self.codes.index(code), inputs, outputs
        o.builtinOptionsType, o.builtinOptions = options_type, options
        self.ops.append(o)

    def serialize(self, inputs: list[int], outputs: list[int]) -> bytes:
        import flatbuffers
        from ai_edge_litert import schema_py_generated as S

        m = S.ModelT()
        m.version, m.description = 3, "edgetune peer bench"
        m.operatorCodes = []
        for c in self.codes:
            oc = S.OperatorCodeT()
            oc.builtinCode, oc.deprecatedBuiltinCode, oc.version = c, min(c, 127), 1
            m.operatorCodes.append(oc)
        m.buffers = []
        for data in self.buffers:
            b = S.BufferT()
            if data is not None:
                b.data = np.frombuffer(data.tobytes(), np.uint8)
            m.buffers.append(b)
        sg = S.SubGraphT()
        sg.tensors, sg.inputs, sg.outputs, sg.operators = self.tensors, inputs, outputs, self.ops
        m.subgraphs = [sg]
        builder = flatbuffers.Builder(1 << 16)
        builder.Finish(m.Pack(builder), file_identifier=b"TFL3")
        return bytes(builder.Output())


@dataclass(frozen=True)
class TfliteGraph:
    model: bytes
    x: np.ndarray
    to_kernel: Callable[[np.ndarray], np.ndarray]


def _bias(case: PeerCase, channels: int) -> np.ndarray:
    """XNNPACK's convolutions take a bias; without an epilogue it is zero, which changes nothing."""
    return case.bias if case.bias is not None else np.zeros(channels, np.float32)


def _gemm(case: PeerCase, copies: int) -> TfliteGraph:
    from ai_edge_litert import schema_py_generated as S

    a, b = case.inputs[:2]
    m_, n = case.want.shape
    g = _Model()
    x = g.tensor("A", a.shape)
    outs = []
    for i in range(copies):
        w = g.tensor(f"W{i}", (n, a.shape[1]), b.T)  # FULLY_CONNECTED weights are [out, in]
        bias = g.tensor(f"b{i}", (n,), _bias(case, n))
        y = g.tensor(f"Y{i}", (m_, n))
        opts = S.FullyConnectedOptionsT()
        opts.fusedActivationFunction = ACT[case.epilogue.act]
        g.op(S.BuiltinOperator.FULLY_CONNECTED, [x, w, bias], [y], S.BuiltinOptions.FullyConnectedOptions, opts)
        outs.append(y)
    return TfliteGraph(g.serialize([x], outs), a, lambda y: y)


def _same_matches(size: int, k: int, stride: int, pad: int) -> bool:
    """Whether TFLite's SAME padding on this axis is the symmetric `pad` the kernel uses."""
    out = -(-size // stride)
    total = max((out - 1) * stride + k - size, 0)
    return total // 2 == pad and total - total // 2 == pad


def _conv(case: PeerCase, copies: int, x: np.ndarray, w: np.ndarray, kernel: tuple[int, int],
          stride: tuple[int, int], pad: tuple[int, int], out_shape: tuple[int, ...], depthwise: bool,
          to_kernel: Callable[[np.ndarray], np.ndarray]) -> TfliteGraph:
    """R copies of a CONV_2D / DEPTHWISE_CONV_2D on NHWC `x` with filter `w` (OHWI, or 1HWC when depthwise)."""
    from ai_edge_litert import schema_py_generated as S

    same = all(_same_matches(x.shape[1 + a], kernel[a], stride[a], pad[a]) for a in (0, 1))
    g = _Model()
    xin = g.tensor("X", x.shape)
    padded_shape = (1, x.shape[1] + 2 * pad[0], x.shape[2] + 2 * pad[1], x.shape[3])
    paddings = None if same else g.tensor("paddings", (4, 2), np.array([[0, 0], [pad[0]] * 2, [pad[1]] * 2, [0, 0]],
                                                                     np.int32), dtype="i32")
    outs = []
    for i in range(copies):
        src = xin
        if paddings is not None:  # one PAD per copy: XNNPACK fuses a PAD only into its single consumer
            src = g.tensor(f"Xp{i}", padded_shape)
            g.op(S.BuiltinOperator.PAD, [xin, paddings], [src], S.BuiltinOptions.PadOptions, S.PadOptionsT())
        wt = g.tensor(f"W{i}", w.shape, w)
        bias = g.tensor(f"b{i}", (out_shape[-1],), _bias(case, out_shape[-1]))
        y = g.tensor(f"Y{i}", out_shape)
        opts = S.DepthwiseConv2DOptionsT() if depthwise else S.Conv2DOptionsT()
        opts.padding = S.Padding.SAME if same else S.Padding.VALID
        opts.strideH, opts.strideW = stride
        opts.dilationHFactor = opts.dilationWFactor = 1
        opts.fusedActivationFunction = ACT[case.epilogue.act]
        if depthwise:
            opts.depthMultiplier = 1
            g.op(S.BuiltinOperator.DEPTHWISE_CONV_2D, [src, wt, bias], [y], S.BuiltinOptions.DepthwiseConv2DOptions,
                 opts)
        else:
            g.op(S.BuiltinOperator.CONV_2D, [src, wt, bias], [y], S.BuiltinOptions.Conv2DOptions, opts)
        outs.append(y)
    return TfliteGraph(g.serialize([xin], outs), x, to_kernel)


def _conv2d(case: PeerCase, copies: int) -> TfliteGraph:
    x, w = case.inputs[:2]  # [H,W,Cin], HWIO
    s = case.shape["stride"]
    return _conv(case, copies, x[None], w.transpose(3, 0, 1, 2).copy(), (3, 3), (s, s), (1, 1),
                 (1, *case.want.shape), False, lambda y: y[0])


def _dwconv(case: PeerCase, copies: int) -> TfliteGraph:
    x, w = case.inputs[:2]  # [H,W,C], [3,3,C]
    s = case.shape["stride"]
    return _conv(case, copies, x[None], w[None].copy(), (3, 3), (s, s), (1, 1), (1, *case.want.shape), True,
                 lambda y: y[0])


def _conv1d(case: PeerCase, copies: int) -> TfliteGraph:
    """conv1d as a CONV_2D over a [1, 1, T, Cin] image with a [Cout, 1, K, Cin] filter."""
    x, w = case.inputs[:2]  # [T,Cin], [K,Cin,Cout]
    k = case.shape["K"]
    return _conv(case, copies, x[None, None], w.transpose(2, 0, 1)[:, None].copy(), (1, k),
                 (1, case.shape["stride"]), (0, k // 2), (1, 1, *case.want.shape), False, lambda y: y[0, 0])


GRAPHS: dict[str, Callable[[PeerCase, int], TfliteGraph]] = {
    "gemm": _gemm, "conv2d_3x3": _conv2d, "dwconv_3x3": _dwconv, "conv1d": _conv1d,
}
OP_NAMES = {"gemm": "FULLY_CONNECTED", "conv2d_3x3": "CONV_2D", "dwconv_3x3": "DEPTHWISE_CONV_2D",
            "conv1d": "CONV_2D (H=1)"}


class TflitePeer:
    """One workload's XNNPACK contender; `error` says why its output is wrong (then it is not timed)."""

    def __init__(self, case: PeerCase, threads: int, min_time_s: float = 0.02):
        self.case, self.threads, self.min_time_s = case, threads, min_time_s
        self.times: list[float | None] = []
        self.copies = 1
        self.error = self._load(1)
        if self.error:
            return
        once_us = time_calls(self.interp.invoke, 0.0, min_calls=5) * 1e3
        if once_us < TINY_US:
            self.copies = min(MAX_COPIES, math.ceil(TINY_US / max(once_us, 1.0)))
            self.error = self._load(self.copies)

    def _load(self, copies: int) -> str | None:
        from ai_edge_litert.interpreter import Interpreter

        graph = GRAPHS[self.case.spec.name](self.case, copies)
        self.interp = Interpreter(model_content=graph.model, num_threads=self.threads)
        self.interp.allocate_tensors()
        if not any(op["op_name"] == "DELEGATE" for op in self.interp._get_ops_details()):
            raise RuntimeError("the XNNPACK delegate took no op (the model would run on TFLite's builtin kernels)")
        self.interp.set_tensor(self.interp.get_input_details()[0]["index"], graph.x)
        self.interp.invoke()
        y0 = self.interp.get_output_details()[0]["index"]
        error = self.case.check(graph.to_kernel(self.interp.get_tensor(y0)))
        for _ in range(WARMUP_CALLS):
            self.interp.invoke()
        return error

    def sample(self) -> None:
        self.times.append(time_calls(self.interp.invoke, self.min_time_s) / self.copies)

    def series(self) -> dict[str, list[float | None]]:
        return {"XNNPACK": self.times}
