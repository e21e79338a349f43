"""onnxruntime as a peer: the op in its native layout (NCHW Conv, MatMul/Gemm, GRU, STFT) with the weights as
initializers, timed op-only by ORT's own session profiler.

The kernel's ONNX twin (kernels/ort_twin.py) reads the kernel's layout, so its time includes NHWC<->NCHW and
weight transposes and Python's `sess.run`; a device shipping ORT runs neither. Here layout conversion happens
outside the graph, and the time is the profiler's node durations of each run: with the ReorderInput/ReorderOutput
nodes ORT inserts for its NCHWc convolutions (what a one-op graph pays), and without them (what a layer inside an
NCHWc network pays, as consecutive convs stay blocked). The profiler counts whole microseconds, so an op under
TINY_US runs as a graph of R independent copies and its time is the profiled run's duration over R (which then
includes ORT's per-node dispatch, as a network of such ops pays it).
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench.peers.cases import PeerCase
from bench.peers.timing import warm_up
from kernels.specs.common import const, onnx_model

TINY_US = 50.0  # the profiler counts whole microseconds: 2% of this
TARGET_US = 200.0  # an R-copy graph runs about this long
MAX_COPIES = 256
REORDER_OPS = ("ReorderInput", "ReorderOutput")
WARMUP_RUNS = 3
RUNS_PER_ROUND = (3, 40)  # min, max profiled runs per round (the profiler keeps every event in memory)


@dataclass(frozen=True)
class OrtGraph:
    model: bytes  # `copies` independent copies of the op, each with its own initializers, outputs Y0..Y{R-1}
    feed: dict[str, np.ndarray]
    to_kernel: Callable[[np.ndarray], np.ndarray]  # Y0 back into the kernel's layout, to check it


def _act_nodes(case: PeerCase, src: str, dst: str, i: int) -> tuple[list, list]:
    """The epilogue's activation after the op (ORT fuses Relu/Clip into Conv and Gemm)."""
    from onnx import helper

    act = case.epilogue.act
    if act == "none":
        return [helper.make_node("Identity", [src], [dst], name=f"out{i}")], []
    if act == "relu":
        return [helper.make_node("Relu", [src], [dst], name=f"relu{i}")], []
    lo, hi = f"lo{i}", f"hi{i}"
    return ([helper.make_node("Clip", [src, lo, hi], [dst], name=f"relu6_{i}")],
            [const(lo, np.float32(0)), const(hi, np.float32(6))])


def _copies(case: PeerCase, copies: int, feed: dict[str, np.ndarray], out_shape: tuple[int, ...],
            op: Callable[[int], tuple[list, list]], to_kernel: Callable[[np.ndarray], np.ndarray]) -> OrtGraph:
    """R copies of `op(i)` (nodes writing `o{i}`, initializers) on the shared feed, each with the epilogue."""
    nodes, inits = [], []
    for i in range(copies):
        n, init = op(i)
        an, ainit = _act_nodes(case, f"o{i}", f"Y{i}", i)
        nodes += n + an
        inits += init + ainit
    model = onnx_model(nodes, [(k, v.shape) for k, v in feed.items()], [(f"Y{i}", out_shape) for i in range(copies)],
                       inits)
    return OrtGraph(model, feed, to_kernel)


def _bias_inputs(case: PeerCase, i: int) -> tuple[list[str], list]:
    return ([f"b{i}"], [const(f"b{i}", case.bias)]) if case.bias is not None else ([], [])


def _gemm(case: PeerCase, copies: int) -> OrtGraph:
    from onnx import helper

    a, b = case.inputs[:2]

    def op(i: int) -> tuple[list, list]:
        bn, binit = _bias_inputs(case, i)
        kind = "Gemm" if bn else "MatMul"
        return [helper.make_node(kind, ["A", f"B{i}", *bn], [f"o{i}"], name=f"{kind}{i}")], [const(f"B{i}", b), *binit]

    return _copies(case, copies, {"A": a}, case.want.shape, op, lambda y: y)


def _conv(case: PeerCase, copies: int, x: np.ndarray, w: np.ndarray, out_shape: tuple[int, ...],
          to_kernel: Callable[[np.ndarray], np.ndarray], **attrs: Any) -> OrtGraph:
    from onnx import helper

    def op(i: int) -> tuple[list, list]:
        bn, binit = _bias_inputs(case, i)
        return ([helper.make_node("Conv", ["X", f"W{i}", *bn], [f"o{i}"], name=f"Conv{i}", **attrs)],
                [const(f"W{i}", w), *binit])

    return _copies(case, copies, {"X": x}, out_shape, op, to_kernel)


def _conv2d(case: PeerCase, copies: int) -> OrtGraph:
    x, w = case.inputs[:2]  # [H,W,Cin], HWIO
    s = case.shape["stride"]
    ho, wo, cout = case.want.shape
    return _conv(case, copies, x.transpose(2, 0, 1)[None].copy(), w.transpose(3, 2, 0, 1).copy(), (1, cout, ho, wo),
                 lambda y: y[0].transpose(1, 2, 0), kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[s, s])


def _dwconv(case: PeerCase, copies: int) -> OrtGraph:
    x, w = case.inputs[:2]  # [H,W,C], [3,3,C]
    s, c = case.shape["stride"], case.shape["C"]
    ho, wo, _ = case.want.shape
    return _conv(case, copies, x.transpose(2, 0, 1)[None].copy(), w.transpose(2, 0, 1)[:, None].copy(),
                 (1, c, ho, wo), lambda y: y[0].transpose(1, 2, 0), kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                 strides=[s, s], group=c)


def _conv1d(case: PeerCase, copies: int) -> OrtGraph:
    """A 2-D Conv of height 1 on [1, Cin, 1, T]: ORT's NCHWc path takes only 2-D convolutions, and op-only it ran
    1.1-1.4x faster than the 1-D Conv on these workloads (the peer gets its faster form)."""
    x, w = case.inputs[:2]  # [T,Cin], [K,Cin,Cout]
    k, p = case.shape["K"], case.shape["K"] // 2
    to, cout = case.want.shape
    return _conv(case, copies, x.T[None, :, None].copy(), w.transpose(2, 1, 0)[:, :, None].copy(), (1, cout, 1, to),
                 lambda y: y[0, :, 0].T, kernel_shape=[1, k], pads=[0, p, 0, p], strides=[1, case.shape["stride"]])


def _gru(case: PeerCase, copies: int) -> OrtGraph:
    from onnx import helper

    x, w, r, b, h0 = case.inputs
    t, h = case.want.shape

    def op(i: int) -> tuple[list, list]:
        names = [f"W{i}", f"R{i}", f"Bg{i}", f"h0{i}"]
        node = helper.make_node("GRU", ["X", names[0], names[1], names[2], "", names[3]], [f"y4{i}"], name=f"GRU{i}",
                                hidden_size=h, linear_before_reset=1)
        shape = helper.make_node("Reshape", [f"y4{i}", "yshape"], [f"o{i}"], name=f"reshape{i}")
        inits = [const(n, a) for n, a in zip(names, (w[None], r[None], b[None], h0.reshape(1, 1, h)))]
        return [node, shape], inits + ([const("yshape", np.array([t, h], np.int64))] if i == 0 else [])

    return _copies(case, copies, {"X": x[:, None].copy()}, (t, h), op, lambda y: y)


def _logmel(case: PeerCase, copies: int) -> OrtGraph:
    """STFT -> |X|^2 -> mel MatMul -> log: ORT has no fused log-mel, so its native path is these ops."""
    from onnx import helper

    from kernels.specs.logmel import EPS

    audio, window, _, melfb = case.inputs
    frames, _ = case.want.shape

    def op(i: int) -> tuple[list, list]:
        nodes = [
            helper.make_node("STFT", ["X", "step", f"win{i}"], [f"stft{i}"], onesided=1, name=f"STFT{i}"),
            helper.make_node("Mul", [f"stft{i}", f"stft{i}"], [f"sq{i}"], name=f"square{i}"),
            helper.make_node("ReduceSum", [f"sq{i}", "last"], [f"pow{i}"], keepdims=0, name=f"power{i}"),
            helper.make_node("MatMul", [f"pow{i}", f"fb{i}"], [f"mel{i}"], name=f"mel{i}"),
            helper.make_node("Add", [f"mel{i}", "eps"], [f"mele{i}"], name=f"eps{i}"),
            helper.make_node("Log", [f"mele{i}"], [f"o{i}"], name=f"log{i}"),
        ]
        inits = [const(f"win{i}", window), const(f"fb{i}", melfb)]
        if i == 0:
            inits += [const("step", np.array(case.shape["hop"], np.int64)), const("last", np.array([-1], np.int64)),
                      const("eps", np.float32(EPS))]
        return nodes, inits

    return _copies(case, copies, {"X": audio[None, :, None].copy()}, (1, frames, case.shape["mels"]), op,
                   lambda y: y[0])


GRAPHS: dict[str, Callable[[PeerCase, int], OrtGraph]] = {
    "gemm": _gemm, "conv2d_3x3": _conv2d, "dwconv_3x3": _dwconv, "conv1d": _conv1d, "gru": _gru, "logmel": _logmel,
}
OP_NAMES = {"gemm": "MatMul/Gemm", "conv2d_3x3": "Conv", "dwconv_3x3": "Conv (group)", "conv1d": "Conv (2-D, H=1)",
            "gru": "GRU", "logmel": "STFT+MatMul"}


def profiled_session(model: bytes, threads: int, prefix: str) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.enable_profiling = True
    opts.profile_file_prefix = prefix
    opts.log_severity_level = 3
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


@dataclass(frozen=True)
class Run:
    run_us: float  # the profiled model_run
    nodes_us: float  # every node's kernel time
    reorder_us: float  # the NCHWc ReorderInput/ReorderOutput nodes among them


def profiled_runs(path: str) -> list[Run]:
    """One Run per sess.run, in order: node events are assigned to the model_run whose interval holds them."""
    events = json.loads(Path(path).read_text())
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])
    nodes = [e for e in events if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time")]
    out = []
    for r in runs:
        inside = [e for e in nodes if r["ts"] <= e["ts"] <= r["ts"] + r["dur"]]
        reorder = sum(e["dur"] for e in inside if e.get("args", {}).get("op_name") in REORDER_OPS)
        out.append(Run(float(r["dur"]), float(sum(e["dur"] for e in inside)), float(reorder)))
    return out


class OrtPeer:
    """One workload's ORT contender: calibrate (and check) a one-copy graph, then time the timing graph per round.

    `series()` is only known after the last round, when the profile is read."""

    def __init__(self, case: PeerCase, threads: int, min_time_s: float = 0.02):
        self.case, self.threads, self.min_time_s = case, threads, min_time_s
        self._tmp = tempfile.TemporaryDirectory(prefix="peerbench-ort-")
        self.error: str | None = None
        single = self._session(1)
        if self.error:
            return
        for _ in range(10):
            single.run(None, self._graph.feed)
        op_us = statistics.median(r.nodes_us for r in profiled_runs(single.end_profiling())[1:])
        self.copies = 1 if op_us >= TINY_US else min(MAX_COPIES, math.ceil(TARGET_US / max(op_us, 1.0)))
        self.sess = self._session(self.copies)  # a fresh profile: end_profiling stopped the calibration's
        self._rounds: list[tuple[int, int]] = []
        for _ in range(WARMUP_RUNS):
            self.sess.run(None, self._graph.feed)
        self._runs = 1 + WARMUP_RUNS  # the checked run and the warm-up lead the profile, in no round

    def _session(self, copies: int) -> Any:
        self._graph = GRAPHS[self.case.spec.name](self.case, copies)
        sess = profiled_session(self._graph.model, self.threads, str(Path(self._tmp.name) / f"r{copies}"))
        self.error = self.case.check(self._graph.to_kernel(sess.run(["Y0"], self._graph.feed)[0]))
        return sess

    def sample(self) -> None:
        lo, hi = RUNS_PER_ROUND
        self._runs += warm_up(lambda: self.sess.run(None, self._graph.feed))  # profiled, in no round
        first, t0 = self._runs, time.perf_counter()
        while self._runs - first < hi and (self._runs - first < lo or time.perf_counter() - t0 < self.min_time_s):
            self.sess.run(None, self._graph.feed)
            self._runs += 1
        self._rounds.append((first, self._runs))

    def series(self) -> dict[str, list[float | None]]:
        """ms per round: with the NCHWc reorder nodes ('ORT') and without them ('ORT -reorder')."""
        runs = profiled_runs(self.sess.end_profiling())
        self._tmp.cleanup()

        def per_round(value: Callable[[Run], float]) -> list[float | None]:
            return [statistics.median(value(r) for r in runs[a:b]) / 1e3 for a, b in self._rounds]

        if self.copies == 1:
            return {"ORT": per_round(lambda r: r.nodes_us),
                    "ORT -reorder": per_round(lambda r: r.nodes_us - r.reorder_us)}
        return {"ORT": per_round(lambda r: r.run_us / self.copies),
                "ORT -reorder": per_round(lambda r: (r.run_us - r.reorder_us) / self.copies)}
