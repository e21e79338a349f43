"""What every peer of one workload is given and checked against: the kernel's inputs, an optional epilogue, the
reference output.

The inputs are the spec's own (`make_inputs`, seed 0, in the kernel's ABI order and layout: data, weights[, bias]);
each peer module converts them to its native layout outside the timed region. A kernel whose spec fuses the epilogue
(`spec.epilogue`) has the bias as its third input, already added by its reference; every peer then takes that bias,
and `--act` applies to the kernel and peers alike. For a kernel without one, the default is no epilogue, and
`--bias`/`--act` give the peers a bias vector and ReLU/ReLU6 (fused where the peer fuses them) and extend the
reference to match.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.space import Shape
from kernels.spec import ACTIVATIONS, KernelSpec, Workload, apply_act

# kernels whose output is a layer's pre-activation (channels last), so a bias + activation epilogue applies
EPILOGUE_KERNELS = ("gemm", "conv2d_3x3", "dwconv_3x3", "conv1d")


@dataclass(frozen=True)
class Epilogue:
    bias: bool = False
    act: str = "none"

    def __post_init__(self) -> None:
        if self.act not in ACTIVATIONS:
            from edgetune.errors import BadInput

            raise BadInput(f"activation {self.act!r} is not one of: {', '.join(ACTIVATIONS)}")

    @property
    def label(self) -> str:
        return "+".join((["bias"] if self.bias else []) + ([self.act] if self.act != "none" else [])) or "none"

    def apply(self, y: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        return apply_act(y + bias if bias is not None else y, self.act).astype(np.float32)


@dataclass(frozen=True)
class PeerCase:
    spec: KernelSpec
    workload: Workload
    inputs: list[np.ndarray]  # the kernel's inputs, ABI order and layout
    bias: np.ndarray | None  # per output channel, when the epilogue has one
    epilogue: Epilogue
    want: np.ndarray  # the reference of the kernel's first output, epilogue applied

    @property
    def shape(self) -> Shape:
        return self.workload.shape

    def check(self, got: np.ndarray) -> str | None:
        """Why `got` (in the kernel's layout) is wrong, or None when it matches the reference."""
        if got.shape != self.want.shape:
            return f"output shape {got.shape} != reference {self.want.shape}"
        if not np.allclose(got, self.want, rtol=self.spec.rtol, atol=self.spec.atol):
            return (f"wrong values: max_abs_err={float(np.max(np.abs(got - self.want))):.3g} beyond "
                    f"rtol={self.spec.rtol} atol={self.spec.atol}")
        return None


def fuses_epilogue(spec: KernelSpec) -> bool:
    """Whether the kernel itself takes the bias (as an input) and the activation (as a runtime argument)."""
    return spec.epilogue


def make_case(spec: KernelSpec, wl: Workload, epilogue: Epilogue = Epilogue()) -> PeerCase:
    inputs = [np.ascontiguousarray(a, dtype=np.float32)
              for a in spec.make_inputs(wl.shape, np.random.default_rng(0))]
    want = spec.reference(wl.shape, inputs)[0]
    if fuses_epilogue(spec):  # the reference has added the kernel's bias input
        ep = Epilogue(True, epilogue.act)
        return PeerCase(spec, wl, inputs, inputs[2], ep, ep.apply(want, None))
    ep = epilogue if spec.name in EPILOGUE_KERNELS else Epilogue()
    bias = (np.random.default_rng(1).standard_normal(want.shape[-1]) * 0.5).astype(np.float32) if ep.bias else None
    return PeerCase(spec, wl, inputs, bias, ep, ep.apply(want, bias))
