"""The bundled kernels, by name."""

from __future__ import annotations

import importlib
from functools import cache

from edgetune.errors import BadInput
from kernels.spec import KernelSpec

KERNEL_NAMES = ("gemm", "conv2d_3x3", "dwconv_3x3", "logmel", "conv1d", "gru")


@cache
def all_specs() -> dict[str, KernelSpec]:
    out = {}
    for name in KERNEL_NAMES:
        try:
            out[name] = importlib.import_module(f"kernels.specs.{name}").SPEC
        except ModuleNotFoundError as e:  # a kernel still being written
            if e.name != f"kernels.specs.{name}":
                raise
    return out


def get_spec(name: str) -> KernelSpec:
    specs = all_specs()
    if name not in specs:
        raise BadInput(f"unknown kernel {name!r}; kernels: {', '.join(specs)}")
    return specs[name]
