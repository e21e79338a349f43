"""Run a kernel's ONNX twin in onnxruntime: an independent oracle for correctness and a speed peer."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from kernels.space import Shape
from kernels.spec import KernelSpec


@dataclass(frozen=True)
class OrtResult:
    ms: float  # median per-run wall ms
    cv: float
    outputs: list[np.ndarray]


def ort_session(spec: KernelSpec, shape: Shape, threads: int = 1):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(spec.onnx_model(shape), opts, providers=["CPUExecutionProvider"])


def run_ort(spec: KernelSpec, shape: Shape, inputs: list[np.ndarray], *, threads: int = 1,
            min_time_s: float = 0.15, max_reps: int = 200) -> OrtResult:
    """Time the twin with the same budget the worker gives a variant; outputs are the twin's first outputs."""
    sess = ort_session(spec, shape, threads)
    feed = {i.name: a for i, a in zip(sess.get_inputs(), inputs)}
    n_out = len(spec.output_shapes(shape))
    out = sess.run(None, feed)[:n_out]
    t0 = time.perf_counter()
    sess.run(None, feed)
    once = time.perf_counter() - t0
    inner = max(1, int(5e-5 / max(once, 1e-7)))
    reps = int(min(max_reps, max(5, min_time_s / max(once * inner, 1e-7))))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            sess.run(None, feed)
        samples.append((time.perf_counter() - t0) * 1e3 / inner)
    mean = statistics.fmean(samples)
    return OrtResult(statistics.median(samples), statistics.pstdev(samples) / mean if mean else 0.0, out)
