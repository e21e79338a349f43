"""Runtime API for applications: call a bundled kernel with its active (tuned) config, in process."""

from __future__ import annotations

import ctypes
import logging

import numpy as np

from kernels.active import read_active
from kernels.build import build
from kernels.registry import get_spec
from kernels.space import Config
from kernels.spec import KernelSpec
from kernels.workloads import resolve

log = logging.getLogger(__name__)


class TunedKernel:
    """A callable bound to one build: `outputs = k(*inputs)` with float32 numpy arrays in the spec's order."""

    def __init__(self, spec: KernelSpec, shape: dict, config: Config, so_path: str, tuned: bool):
        self.spec, self.shape, self.config, self.tuned = spec, shape, config, tuned
        self._lib = ctypes.CDLL(so_path)
        self._dims = (ctypes.c_int64 * len(spec.dims))(*spec.dims_vector(shape))
        self._out_shapes = spec.output_shapes(shape)

    def __call__(self, *inputs: np.ndarray) -> list[np.ndarray]:
        ins = [np.ascontiguousarray(a, dtype=np.float32) for a in inputs]
        outs = [np.empty(s, dtype=np.float32) for s in self._out_shapes]
        arr = ins + outs
        bufs = (ctypes.c_void_p * len(arr))(*[a.ctypes.data for a in arr])
        rc = self._lib.et_run(self._dims, bufs)
        if rc != 0:
            raise RuntimeError(f"{self.spec.name} returned error code {rc}")
        return outs


def load_tuned(kernel: str, workload: str | None = None, *, shape: dict | None = None, isa: str | None = None) -> TunedKernel:
    """The active config's build for (kernel, workload or shape); rebuilt if the cache was wiped.

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
    return TunedKernel(spec, wl.shape, cfg, str(build(spec, cfg, hw, shape=wl.shape).path), tuned)



