"""Runtime API for applications: call a bundled kernel with its active (tuned) config, in process."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from edgetune.errors import BadInput
from kernels.abi import KernelLibrary
from kernels.active import find_by_name, find_by_shape, read_active
from kernels.build import build
from kernels.registry import get_spec
from kernels.space import Config, SearchSpace
from kernels.spec import KernelSpec, Workload
from kernels.workloads import resolve

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Choice:
    """Which config a TunedKernel runs and why, so an application can log or check what it got: a default
    looks the same as a tuned config until it is timed."""

    workload: str  # the active slot's workload name; when nothing is active, the name asked for (or generated)
    config: Config
    tuned: bool
    why: str


class TunedKernel:
    """A callable bound to one build: `outputs = k(*inputs)` with float32 numpy arrays in the spec's order.

    With constant inputs bound (`load_tuned(weights=...)` or `bind`), they are packed once and a call takes only the
    others (e.g. gemm's A): what a layer does. Unbound, a call takes every input and packs them each time."""

    def __init__(self, spec: KernelSpec, shape: dict, choice: Choice, so_path: str, act: str = "none"):
        spec.check_act(act)
        self.spec, self.shape, self.act = spec, shape, act
        self.workload, self.config, self.tuned, self.why = choice.workload, choice.config, choice.tuned, choice.why
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

    `workload` is any active slot's name (a bundled layer, or one imported from a model and tuned from a
    workloads file) or a bundled one; `shape` finds the slot tuned for that shape whatever its name. The result's
    `workload`, `tuned` and `why` say which slot's config runs, or why it is the default (nothing tuned, an
    active.json that cannot be read, a config not valid under `isa`): each of those also logs a warning.
    `act` is the fused activation (none, relu, relu6) of a kernel with an epilogue. `weights`, the constant inputs
    (spec.constant_inputs, e.g. gemm's B and bias), are packed once; calls then take the other inputs only.
    """
    from hwprobe import probe

    spec = get_spec(kernel)
    doc = read_active()
    wl, entry, found = _active_workload(spec, workload, shape, doc)
    hw = probe(isa_cap=isa, measure_bandwidth=False)
    choice = _choose(spec, wl, entry, found, spec.space(wl.shape, hw), doc.get("error"))
    k = TunedKernel(spec, wl.shape, choice, str(build(spec, choice.config, hw, shape=wl.shape).path), act)
    if weights is not None:
        k.bind(*weights)
    return k


def _active_workload(spec: KernelSpec, workload: str | None, shape: dict | None,
                     doc: dict) -> tuple[Workload, dict | None, str]:
    """(the workload, its active entry or None, how the entry was found). A name finds its slot even when no
    spec knows it (a model's imported layer: the entry keeps its shape). Otherwise the slot is found by the
    shape its entry keeps, so `shape=`, a bundled name and a model's name for one layer load the same config."""
    if workload and shape:
        raise BadInput(f"load_tuned({spec.name!r}): give a workload name or shape=, not both")
    if workload:
        entry = find_by_name(doc, spec.name, workload)
        if entry and entry.get("shape"):
            return Workload(workload, spec.validate_shape(entry["shape"]), "active"), entry, "by name"
        if entry:  # an entry from before entries kept their shape: the name must say it
            return _named(spec, workload, doc), entry, "by name"
    text = ",".join(f"{k}={v}" for k, v in shape.items()) if shape else None
    wl = _named(spec, workload, doc) if workload else resolve(spec, None, text)
    match = find_by_shape(doc, spec.name, wl.shape, wl.name)
    if match is None:
        return wl, None, ""
    return Workload(match[0], wl.shape, "active"), match[1], "by shape"


def _named(spec: KernelSpec, workload: str, doc: dict) -> Workload:
    """A bundled or custom.* workload. An unknown name says how to make it one (tune it, or give its shape), or
    that the active configs, where a model's layer names live, could not be read."""
    try:
        return resolve(spec, workload, None)
    except BadInput as e:
        if doc.get("error"):
            raise BadInput(f"{e}. The active configs could not be searched for it: {doc['error']}") from e
        raise BadInput(f"{e}. No active config of {spec.name} is named {workload!r} either: tune it first "
                       f"(`edgetune tune --workloads FILE --workload {workload}`), or pass shape=") from e


def _choose(spec: KernelSpec, wl: Workload, entry: dict | None, found: str, space: SearchSpace,
            error: str | None) -> Choice:
    """The active entry's config when there is one valid here, else the default with a warning saying why."""
    slot = f"{spec.name}/{wl.name}"
    if entry and space.is_valid(entry["config"]):
        return Choice(wl.name, entry["config"], True, f"tuned config of {slot}, found {found}")
    if entry:
        why = f"its active config {entry['config']} is not valid in this device's space (tuned under another ISA?)"
    elif error:
        why = error
    else:
        why = "no tuned config on this device yet (run `edgetune tune`)"
    log.warning("%s: using the default config: %s", slot, why)
    return Choice(wl.name, space.valid_default(), False, f"default config: {why}")
