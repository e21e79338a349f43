"""The C ABI of a built kernel (kernels/c/edgetune_kernel.h), seen from Python: load, pack, run, bench.

One wrapper for every in-process caller (the measuring worker, kernels.load_tuned), so the argument types (an
int64 return for et_packed_floats, the packed buffer, the activation code) are declared once.
"""

from __future__ import annotations

import ctypes
import re
from functools import cache
from typing import Any, Sequence

import numpy as np

from edgetune.errors import EdgetuneError
from kernels.spec import HEADER, KernelSpec, act_code

_I64P = ctypes.POINTER(ctypes.c_int64)


@cache
def abi_version() -> int:
    """ET_ABI_VERSION as the shared header defines it: what every build must report."""
    match = re.search(r"#define ET_ABI_VERSION (\d+)", HEADER.read_text())
    if not match:
        raise EdgetuneError(f"{HEADER} defines no ET_ABI_VERSION")
    return int(match.group(1))


class AbiMismatch(RuntimeError):
    """The library reports another ABI version than this Python side speaks."""


class KernelLibrary:
    """One loaded kernel build. `bufs` arguments are numpy arrays: the inputs then the outputs, in the spec's order."""

    def __init__(self, so_path: str, spec: KernelSpec):
        self.spec = spec
        self.lib = ctypes.CDLL(str(so_path), mode=ctypes.RTLD_LOCAL)
        lib = self.lib
        lib.et_abi_version.restype = ctypes.c_int
        version = lib.et_abi_version()
        if version != abi_version():
            raise AbiMismatch(f"ABI version {version} != {abi_version()}")
        lib.et_packed_floats.restype = ctypes.c_int64
        lib.et_packed_floats.argtypes = [_I64P]
        lib.et_pack.argtypes = [_I64P, ctypes.c_void_p, ctypes.c_void_p]
        lib.et_run.argtypes = [_I64P, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        lib.et_bench.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, _I64P, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]

    def dims(self, shape: dict) -> Any:
        return (ctypes.c_int64 * len(self.spec.dims))(*self.spec.dims_vector(shape))

    @staticmethod
    def pointers(bufs: Sequence[np.ndarray | None]) -> Any:
        """The bufs array of the C calls (None: a NULL pointer, for buffers a call does not read)."""
        return (ctypes.c_void_p * len(bufs))(*[None if a is None else a.ctypes.data for a in bufs])

    def pack(self, dims: Any, ptrs: Any) -> np.ndarray | None:
        """The packed constant inputs (None when this kernel does not pack), 64-byte aligned."""
        n = int(self.lib.et_packed_floats(dims))
        if n <= 0:
            return None
        raw = np.empty(n + 16, dtype=np.float32)
        skip = (-raw.ctypes.data % 64) // 4
        packed = raw[skip:skip + n]
        rc = self.lib.et_pack(dims, ptrs, packed.ctypes.data)
        if rc != 0:
            raise KernelError(f"{self.spec.name}: et_pack returned error code {rc}", rc)
        return packed

    def run(self, dims: Any, ptrs: Any, packed: np.ndarray | None, act: str = "none") -> int:
        return self.lib.et_run(dims, ptrs, None if packed is None else packed.ctypes.data, act_code(act))

    def bench(self, dims: Any, ptrs: Any, packed: np.ndarray | None, act: str, *, warmup: int, reps: int,
              inner: int) -> tuple[list[float], list[float], list[int]]:
        """Per rep: wall ms and thread-CPU ms per call, involuntary context switches."""
        wall, cpu, niv = (ctypes.c_double * reps)(), (ctypes.c_double * reps)(), (ctypes.c_int64 * reps)()
        rc = self.lib.et_bench(warmup, reps, inner, dims, ptrs, None if packed is None else packed.ctypes.data,
                               act_code(act), wall, cpu, niv)
        if rc != 0:
            raise KernelError(f"kernel returned error code {rc} while timing", rc)
        return list(wall), list(cpu), list(niv)


class KernelError(RuntimeError):
    """A kernel call returned a nonzero code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code
