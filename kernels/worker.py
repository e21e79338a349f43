"""Measure variants (and the kernels' ONNX twins) in a recycled subprocess, so a segfault, hang or a variant's thread
pool never reaches the caller.

The parent (`Runner`) sends one JSON line per request; the worker (`python -m kernels.worker`) loads the .so
with ctypes, packs its constant inputs once (as a layer does at load), checks its output against the numpy
reference with the requested activation, then times the run alone with the C-side bench loop. The variant's
threads are its own pool (kernels/c/edgetune_kernel.h), the same one kernels.load_tuned and firmware run.
"""

from __future__ import annotations

import json
import math
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kernels.abi import aligned
from kernels.measure import Measurement, estimate
from kernels.space import Shape
from kernels.spec import KernelSpec

DEFAULT_TIMEOUT_S = 30.0
INNER_MIN_MS = 0.05  # a rep lasts at least this long, so clock overhead stays under ~1%
# Calls made before the timed reps, for at least this long: a 2-thread variant's first calls wait on its pool's
# second core waking up. On a 2-core KVM guest (AMD EPYC Zen 3) a 0.04 ms gemm ran 1.6-2.4x slow for its first
# 30 calls after one warm-up call, and the median of 300 timed calls read up to 21% high; after ~8 ms of calls the
# ramp was gone. A results DB shows a ramp: the first quarter of a threads=2 variant's `wall_ms` reps over the last
WARMUP_MS = 10.0
RECYCLE_AFTER = 16  # distinct libraries loaded before a fresh worker (ctypes never unloads one, nor its pool)
# The worker's numpy references run on one BLAS thread. OpenBLAS's idle threads busy-wait ~0.1 s after each call,
# and a variant timed in that window shares its cores with them: on 2 cores, threads=2 variants read ~2x slow.
ONE_BLAS_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class Runner:
    """Parent side: owns one worker process at a time and turns every failure into a failed Measurement.

    A worker is recycled after `recycle_after` distinct libraries: re-measuring one it has loaded (the finals) costs
    no new interpreter. Entering the Runner starts the first worker, whose imports then overlap the caller's
    single-threaded set-up (probe, model load) rather than the first measurement."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, recycle_after: int = RECYCLE_AFTER):
        self.timeout_s = timeout_s
        self.recycle_after = recycle_after
        self._proc: subprocess.Popen | None = None
        self._loaded: set[str] = set()  # libraries the current worker has loaded

    def __enter__(self) -> "Runner":
        self._start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> subprocess.Popen:
        env = {**os.environ, **ONE_BLAS_THREAD}
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kernels.worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=env, text=True, bufsize=1,
        )
        self._loaded = set()
        return self._proc

    def close(self) -> None:
        if self._proc is not None:
            if not self._loaded:  # possibly still importing: nothing to wind down, so do not wait for it
                self._proc.kill()
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=2)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def measure(
        self, spec: KernelSpec, shape: Shape, so_path: Path, *, min_time_s: float = 0.15,
        max_reps: int = 200, seed: int = 0, timeout_s: float | None = None, act: str = "none",
    ) -> Measurement:
        """Check correctness, then time, with fused activation `act` (kernels with an epilogue; see
        kernels.spec.ACTIVATIONS). A crash, hang or wrong result comes back as ok=False with a reason."""
        spec.check_act(act)  # a caller's bad argument, not a failed variant
        so = str(so_path)
        req = {"kernel": spec.name, "shape": shape, "so": so, "seed": seed,
               "min_time_s": min_time_s, "max_reps": max_reps, "act": act}
        reply = self._ask(req, timeout_s, so)
        if isinstance(reply, Measurement):
            return reply
        if not reply["ok"]:
            return Measurement(ok=False, reason=reply["reason"], max_abs_err=reply.get("max_abs_err"))
        ms, cv, used, name = estimate(reply["wall_ms"], reply["nivcsw"])
        return Measurement(
            ok=True, ms=ms, cv=cv, reps=len(reply["wall_ms"]), reps_used=used, estimator=name,
            cpu_ms=float(np.median(reply["cpu_ms"])), nivcsw=int(sum(reply["nivcsw"])),
            max_abs_err=reply["max_abs_err"], wall_ms=reply["wall_ms"], t0=reply["t0"], t1=reply["t1"],
            calls=reply["calls"],
        )

    def time_twin(self, spec: KernelSpec, shape: Shape, *, threads: int, min_time_s: float = 0.15,
                  timeout_s: float | None = None) -> Measurement:
        """The kernel's ONNX twin on the inputs of seed 0, timed in the worker as a variant is: onnxruntime's
        ~55 MB (library, arena, session) and any crash or hang of it stay out of the caller, the process that holds
        the tuner model."""
        reply = self._ask({"twin": True, "kernel": spec.name, "shape": shape, "threads": threads,
                           "min_time_s": min_time_s}, timeout_s)
        if isinstance(reply, Measurement):
            return reply
        if not reply["ok"]:
            return Measurement.failed(reply["reason"])
        return Measurement(ok=True, ms=reply["ms"], cv=reply["cv"])

    def _ask(self, req: dict[str, Any], timeout_s: float | None, so: str | None = None) -> dict | Measurement:
        """One request to the worker (a fresh one when the last died, or once it has loaded `recycle_after`
        libraries and `so` is a new one): its reply, or the failed Measurement of a worker that hung or died."""
        if (self._proc is None or self._proc.poll() is not None
                or (so is not None and so not in self._loaded and len(self._loaded) >= self.recycle_after)):
            self.close()
            self._start()
        proc = self._proc
        timeout = timeout_s or self.timeout_s
        try:
            proc.stdin.write(json.dumps(req) + "\n")
            proc.stdin.flush()
        except BrokenPipeError:
            return self._died(proc)
        line = self._readline(proc, timeout)
        if line is None:
            self._kill()
            return Measurement.failed(f"hung: no result within {timeout:.0f}s; worker killed")
        if not line:
            return self._died(proc)
        if so is not None:
            self._loaded.add(so)
        return json.loads(line)

    def _readline(self, proc: subprocess.Popen, timeout: float) -> str | None:
        """A line, "" on EOF (the worker died), None on timeout."""
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                return None
        return proc.stdout.readline()

    def _died(self, proc: subprocess.Popen) -> Measurement:
        rc = proc.wait()
        self._proc = None
        what = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
        return Measurement.failed(f"crashed: worker died with {what}")


# ---- worker side -------------------------------------------------------------------------------------------

_CASES: dict[tuple, tuple[list[np.ndarray], list[np.ndarray]]] = {}


def _case(spec: KernelSpec, shape: Shape, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Inputs and reference outputs, computed once per worker for each (kernel, shape, seed)."""
    key = (spec.name, tuple(sorted(shape.items())), seed)
    if key not in _CASES:
        inputs = [aligned(a.shape, a) for a in spec.make_inputs(shape, np.random.default_rng(seed))]
        _CASES.clear()  # one case at a time keeps worker memory flat
        _CASES[key] = (inputs, spec.reference(shape, inputs))
    return _CASES[key]


def compare(spec: KernelSpec, outputs: list[np.ndarray], ref: list[np.ndarray]) -> dict[str, Any]:
    """The correctness verdict on a variant's outputs, as reply fields: ok and max_abs_err, or not ok and why.
    NaN-filled output buffers make a value the kernel never wrote fail as non-finite."""
    err = 0.0
    for out, want in zip(outputs, ref):
        if not np.all(np.isfinite(out)):
            return {"ok": False, "reason": "wrong values: non-finite output (unwritten or overflow)"}
        err = max(err, float(np.max(np.abs(out - want))) if out.size else 0.0)
        if not np.allclose(out, want, rtol=spec.rtol, atol=spec.atol):
            return {"ok": False, "reason": f"wrong values: max_abs_err={err:.3g} beyond rtol={spec.rtol} atol={spec.atol}",
                    "max_abs_err": err}
    return {"ok": True, "max_abs_err": err}


def _serve_twin(req: dict[str, Any]) -> dict[str, Any]:
    from kernels.ort_twin import run_ort
    from kernels.registry import get_spec

    spec, shape = get_spec(req["kernel"]), req["shape"]
    r = run_ort(spec, shape, spec.make_inputs(shape, np.random.default_rng(0)), threads=req["threads"],
                min_time_s=req["min_time_s"])
    return {"ok": True, "ms": r.ms, "cv": r.cv}


def _serve_one(req: dict[str, Any]) -> dict[str, Any]:
    from kernels.abi import AbiMismatch, KernelError, KernelLibrary
    from kernels.registry import get_spec

    if req.get("twin"):
        return _serve_twin(req)
    spec = get_spec(req["kernel"])
    shape, act = req["shape"], req.get("act", "none")
    inputs, ref = _case(spec, shape, req["seed"])
    ref = spec.activated(ref, act)
    outputs = [aligned(s) for s in spec.output_shapes(shape)]
    try:
        lib = KernelLibrary(req["so"], spec)
    except AbiMismatch as e:
        return {"ok": False, "reason": str(e)}
    dims = lib.dims(shape)
    bufs = lib.pointers(inputs + outputs)
    try:
        packed = lib.pack(dims, bufs)
    except KernelError as e:
        return {"ok": False, "reason": str(e)}
    rc = lib.run(dims, bufs, packed, act)
    if rc != 0:
        return {"ok": False, "reason": f"kernel returned error code {rc}"}
    verdict = compare(spec, outputs, ref)
    if not verdict["ok"]:
        return verdict
    err = verdict["max_abs_err"]
    wall, cpu, niv = lib.bench(dims, bufs, packed, act, warmup=1, reps=3, inner=1)
    call_ms = max(min(wall), 1e-5)
    warmup = int(min(100_000, max(1, math.ceil(WARMUP_MS / call_ms))))
    # a rep lasts at least INNER_MIN_MS, and reps * inner calls fill min_time_s without exceeding max_reps
    want_calls = req["min_time_s"] * 1e3 / call_ms
    inner = int(min(100_000, max(1, math.ceil(INNER_MIN_MS / call_ms), math.ceil(want_calls / req["max_reps"]))))
    reps = int(min(req["max_reps"], max(5, math.ceil(want_calls / inner))))
    t0 = time.monotonic()
    wall, cpu, niv = lib.bench(dims, bufs, packed, act, warmup=warmup, reps=reps, inner=inner)
    t1 = time.monotonic()
    return {"ok": True, "max_abs_err": err, "wall_ms": wall, "cpu_ms": cpu, "nivcsw": niv, "inner": inner,
            "t0": t0, "t1": t1, "calls": warmup + reps * inner}


def main() -> None:
    for line in sys.stdin:
        try:
            reply = _serve_one(json.loads(line))
        except Exception as e:  # a bad request must not kill the worker silently
            reply = {"ok": False, "reason": f"worker error: {type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
