"""The bundled kernels, by name."""

from __future__ import annotations

import importlib
from functools import cache

from edgetune.errors import BadInput
from kernels.spec import KernelSpec

KERNEL_NAMES = ("gemm", "conv2d_3x3", "dwconv_3x3", "logmel", "conv1d", "gru")


@cache
def all_specs() -> dict[str, KernelSpec]:
    return {name: importlib.import_module(f"kernels.specs.{name}").SPEC for name in KERNEL_NAMES}


def get_spec(name: str) -> KernelSpec:
    specs = all_specs()
    if name not in specs:
        raise BadInput(f"unknown kernel {name!r}; kernels: {', '.join(specs)}")
    return specs[name]
