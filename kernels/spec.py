"""What a bundled kernel is: its C source, knobs, workloads, reference, ONNX twin and cost model."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np

from edgetune.errors import BadInput
from kernels.space import Config, Constraint, Param, SearchSpace, Shape

C_DIR = Path(__file__).resolve().parent / "c"
HEADER = C_DIR / "edgetune_kernel.h"

# The fused activations of ABI 2, in the order of their C codes (ET_ACT_NONE 0, ET_ACT_RELU 1, ET_ACT_RELU6 2).
ACTIVATIONS = ("none", "relu", "relu6")


def act_code(act: str) -> int:
    """The C code of activation `act` (et_run's `act` argument)."""
    if act not in ACTIVATIONS:
        raise BadInput(f"activation {act!r} is not one of: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS.index(act)


def apply_act(y: np.ndarray, act: str) -> np.ndarray:
    """What a kernel's fused activation does to its (bias-added) output."""
    act_code(act)
    if act == "relu":
        return np.maximum(y, 0).astype(y.dtype)
    if act == "relu6":
        return np.clip(y, 0, 6).astype(y.dtype)
    return y

# Set with ABI 1's OpenMP (passive wait), whose fork-join cost ~10 us here, the time of ~1e5 flops: in the 792
# collected cases (every kernel, three ISAs) threads=2 never beat threads=1 below 2e5 flops, and lost by up to 438x on
# the smallest. ABI 2's pool dispatches to a spinning worker in well under 1 us (a 16x32x16 gemm: 0.21 us on one
# thread, 0.24 us on two), so data collected with it may show a lower bound; test_thread_bound_matches_the_collected_data
# checks this one against the data.
MIN_FLOPS_PER_THREAD = 1e5


def threads_need_work(flops: Callable[[Shape], float]) -> Constraint:
    """Every thread must get MIN_FLOPS_PER_THREAD of the work, or the fork-join outweighs what it splits."""
    return Constraint(f"each thread needs >= {MIN_FLOPS_PER_THREAD:.0e} flops of the workload (fewer threads on tiny "
                      "shapes)", lambda c, s, hw: int(c["threads"]) == 1
                      or flops(s) >= MIN_FLOPS_PER_THREAD * int(c["threads"]))


@dataclass(frozen=True)
class Dim:
    """One runtime shape dimension, passed to C as int64 in declaration order."""

    name: str
    help: str
    choices: tuple[int, ...] | None = None  # e.g. stride in (1, 2); None means any positive int


@dataclass(frozen=True)
class Workload:
    """A named shape from a real edge model layer."""

    name: str
    shape: Shape
    source: str = ""  # model / layer it comes from


@dataclass(frozen=True)
class KernelSpec:
    name: str
    domain: Literal["vision", "speech"]
    summary: str
    source: Path  # the C file
    dims: tuple[Dim, ...]
    params: tuple[Param, ...]
    constraints: tuple[Constraint, ...]
    default: Config
    workloads: tuple[Workload, ...]
    # inputs in ABI order, generated deterministically from a seeded Generator
    make_inputs: Callable[[Shape, np.random.Generator], list[np.ndarray]]
    output_shapes: Callable[[Shape], list[tuple[int, ...]]]
    reference: Callable[[Shape, list[np.ndarray]], list[np.ndarray]]
    # ONNX twin: returns a serialized onnx ModelProto whose graph inputs are the kernel inputs (same order)
    # and whose first outputs are the kernel outputs.
    onnx_model: Callable[[Shape], bytes]
    flops: Callable[[Shape], float]
    bytes_moved: Callable[[Shape], float]
    rtol: float = 1e-4
    atol: float = 1e-4
    # the inputs' names, in ABI order (make_inputs returns them so)
    inputs: tuple[str, ...] = ()
    # a fused epilogue: the input after the weights is a bias vector (which `reference` adds) and et_run takes an
    # activation (ACTIVATIONS; `reference` leaves it to apply_act); kernels without one take only "none"
    epilogue: bool = False
    # the inputs a real layer holds constant (weights, bias): what et_pack reads, and what
    # kernels.load_tuned(weights=...) binds once
    constant_inputs: tuple[int, ...] = ()
    # cross-dimension rules (e.g. samples >= n_fft); returns the problems, empty when the shape is fine
    shape_problems: Callable[[Shape], list[str]] = lambda s: []
    extra_headers: tuple[Path, ...] = field(default_factory=tuple)
    # shape dims a build for one workload compiles in as constants (-DET_SHAPE_<DIM>=v), so the compiler
    # instantiates only that case (measured: a stride-specialised dwconv compiles in 0.54-0.59x the time, conv2d
    # in 0.8-0.9x; dwconv's C and W as well, 0.54x again: 30 builds, 6 real layers x 5 configs, median 0.51 ->
    # 0.28 s); builds meant for many shapes (the collector) leave them out
    baked_dims: tuple[str, ...] = ()
    # a seeded shape spanning the kernel's edge ranges (the collector's synthetic shapes; checked by
    # validate_shape, so it may return an invalid one now and then)
    synthetic: Callable[[random.Random], dict] | None = None

    def space(self, shape: Shape, hw: Any) -> SearchSpace:
        generic = (threads_need_work(self.flops),) if any(p.name == "threads" for p in self.params) else ()
        return SearchSpace(self.params, self.constraints + generic, self.default, shape, hw)

    def workload(self, name: str) -> Workload:
        for w in self.workloads:
            if w.name == name:
                return w
        raise BadInput(
            f"unknown workload {name!r} for kernel {self.name}; workloads: {', '.join(w.name for w in self.workloads)}"
        )

    def validate_shape(self, shape: dict[str, Any]) -> Shape:
        """Check a user shape: every dim present, known, a positive int, within its choices and cross-dim rules."""
        names = [d.name for d in self.dims]
        unknown = [k for k in shape if k not in names]
        missing = [n for n in names if n not in shape]
        if unknown or missing:
            what = f"unknown dimension(s) {', '.join(unknown)}" if unknown else f"missing dimension(s) {', '.join(missing)}"
            raise BadInput(f"{self.name}: {what}; dimensions are: {', '.join(names)}")
        out: Shape = {}
        for d in self.dims:
            v = shape[d.name]
            try:
                iv = int(v)
            except (TypeError, ValueError):
                iv = 0
            if iv <= 0 or str(v).strip() != str(iv) and v != iv:
                raise BadInput(f"{self.name}: dimension {d.name}={v} must be a positive integer")
            if d.choices and iv not in d.choices:
                raise BadInput(f"{self.name}: dimension {d.name}={iv} not allowed; allowed: {', '.join(map(str, d.choices))}")
            out[d.name] = iv
        problems = self.shape_problems(out)
        if problems:
            raise BadInput(f"{self.name}: shape {out} is invalid: {'; '.join(problems)}")
        return out

    def check_act(self, act: str) -> int:
        """The C code of fused activation `act`, which this kernel must take (every kernel takes "none")."""
        code = act_code(act)
        if code and not self.epilogue:
            raise BadInput(f"{self.name} has no fused activation; act must be 'none'")
        return code

    def activated(self, ref: list[np.ndarray], act: str) -> list[np.ndarray]:
        """The reference outputs `ref` as the kernel returns them with fused activation `act`."""
        return [apply_act(ref[0], act), *ref[1:]] if self.check_act(act) else ref

    def dims_vector(self, shape: Shape) -> list[int]:
        return [int(shape[d.name]) for d in self.dims]

    def source_hash(self) -> str:
        """Hash of the C source and the shared header: part of every build and result key."""
        h = hashlib.sha256()
        for p in (self.source, HEADER, *self.extra_headers):
            h.update(p.read_bytes())
        return h.hexdigest()[:16]
