"""Runtime API for applications: call a bundled kernel with its active (tuned) config, in process."""

from __future__ import annotations

import logging

import numpy as np

from edgetune.errors import BadInput
from kernels.abi import KernelLibrary
from kernels.active import read_active
from kernels.build import build
from kernels.registry import get_spec
from kernels.space import Config
from kernels.spec import KernelSpec
from kernels.workloads import resolve

log = logging.getLogger(__name__)


class TunedKernel:
    """A callable bound to one build: `outputs = k(*inputs)` with float32 numpy arrays in the spec's order.

    With constant inputs bound (`load_tuned(weights=...)` or `bind`), they are packed once and a call takes only the
    others (e.g. gemm's A): what a layer does. Unbound, a call takes every input and packs them each time."""

    def __init__(self, spec: KernelSpec, shape: dict, config: Config, so_path: str, tuned: bool, act: str = "none"):
        spec.check_act(act)
        self.spec, self.shape, self.config, self.tuned, self.act = spec, shape, config, tuned, act
        self._lib = KernelLibrary(so_path, spec)
        self._dims = self._lib.dims(shape)
        self._out_shapes = spec.output_shapes(shape)
        self._bound: dict[int, np.ndarray] = {}
        self._packed: np.ndarray | None = None

    def bind(self, *constants: np.ndarray) -> None:
        """Hold the constant inputs (spec.constant_inputs, in order, e.g. gemm's B and bias) and pack them once."""
        names = [self.spec.inputs[i] for i in self.spec.constant_inputs]
        if len(constants) != len(names):
            raise BadInput(f"{self.spec.name} binds {len(names)} constant input(s) ({', '.join(names)}), "
                           f"got {len(constants)}")
        self._bound = {i: np.ascontiguousarray(a, dtype=np.float32)
                       for i, a in zip(self.spec.constant_inputs, constants)}
        ptrs = [self._bound.get(i) for i in range(len(self.spec.inputs))] + [None] * len(self._out_shapes)
        self._packed = self._lib.pack(self._dims, self._lib.pointers(ptrs))

    def _inputs(self, given: list[np.ndarray]) -> list[np.ndarray]:
        """Every input in order: the bound constants in their places, `given` in the others."""
        want = [n for i, n in enumerate(self.spec.inputs) if i not in self._bound]
        if len(given) != len(want):
            raise BadInput(f"{self.spec.name} takes {len(want)} input(s) here ({', '.join(want)}), got {len(given)}")
        it = iter(given)
        return [self._bound[i] if i in self._bound else next(it) for i in range(len(self.spec.inputs))]

    def __call__(self, *inputs: np.ndarray) -> list[np.ndarray]:
        ins = self._inputs([np.ascontiguousarray(a, dtype=np.float32) for a in inputs])
        outs = [np.empty(s, dtype=np.float32) for s in self._out_shapes]
        rc = self._lib.run(self._dims, self._lib.pointers(ins + outs), self._packed, self.act)
        if rc != 0:
            raise RuntimeError(f"{self.spec.name} returned error code {rc}")
        return outs


def load_tuned(kernel: str, workload: str | None = None, *, shape: dict | None = None, isa: str | None = None,
               act: str = "none", weights: list[np.ndarray] | tuple[np.ndarray, ...] | None = None) -> TunedKernel:
    """The active config's build for (kernel, workload or shape); rebuilt if the cache was wiped.

    `act` is the fused activation (none, relu, relu6) of a kernel with an epilogue. `weights`, the constant inputs
    (spec.constant_inputs, e.g. gemm's B and bias), are packed once; calls then take the other inputs only.
    Falls back to the default config, with a warning, when nothing is tuned for it yet.
    """
    from hwprobe import probe

    spec = get_spec(kernel)
    wl = resolve(spec, workload, ",".join(f"{k}={v}" for k, v in shape.items()) if shape else None)
    hw = probe(isa_cap=isa, measure_bandwidth=False)
    space = spec.space(wl.shape, hw)
    entry = read_active().get("kernels", {}).get(f"{spec.name}/{wl.name}")
    if entry and space.is_valid(entry["config"]):
        cfg, tuned = entry["config"], True
    else:
        log.warning("%s/%s: no tuned config on this device yet; using the default (run `edgetune tune`)",
                    spec.name, wl.name)
        cfg, tuned = space.valid_default(), False
    k = TunedKernel(spec, wl.shape, cfg, str(build(spec, cfg, hw, shape=wl.shape).path), tuned, act)
    if weights is not None:
        k.bind(*weights)
    return k
