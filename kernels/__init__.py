"""Bundled C kernels: specs, builds, the measuring worker, and the runtime API for applications."""

from typing import Any


def load_tuned(kernel: str, workload: str | None = None, **kw: Any) -> Any:
    """See kernels.runtime.load_tuned (imported lazily: the package import stays light)."""
    from kernels.runtime import load_tuned as _load

    return _load(kernel, workload, **kw)
