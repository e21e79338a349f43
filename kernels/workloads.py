"""Resolve what a verb should run on: a bundled workload by name, or a custom shape given as text."""

from __future__ import annotations

import math
import os

from edgetune.errors import BadInput
from kernels.space import Shape
from kernels.spec import KernelSpec, Workload

DEFAULT_MAX_INPUT_MB = 512.0  # an absurd shape is refused before anything is allocated


def max_input_mb() -> float:
    """The buffer cap for custom shapes, from $EDGETUNE_MAX_INPUT_MB; a value that is not a positive number is
    refused by name, as a cap of 0, below or NaN would refuse every shape with a misleading message."""
    text = os.environ.get("EDGETUNE_MAX_INPUT_MB") or ""
    if not text.strip():
        return DEFAULT_MAX_INPUT_MB
    try:
        cap = float(text)
    except ValueError:
        cap = math.nan
    if not (0 < cap < math.inf):
        raise BadInput(f"EDGETUNE_MAX_INPUT_MB={text!r} is not a valid cap: give a number of megabytes above 0 "
                       f"(e.g. {DEFAULT_MAX_INPUT_MB:g}, the default), or unset it")
    return cap


def parse_shape_text(spec: KernelSpec, text: str) -> dict[str, str]:
    """`M=196,N=576,K=96` → {"M": "196", ...}; the values are checked by spec.validate_shape. A dimension given
    twice is refused: silently keeping the last would tune (or pin) another shape than the one the user read."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise BadInput(
                f"--shape item {part!r} is not NAME=VALUE; {spec.name} takes "
                + ",".join(f"{d.name}=<int>" for d in spec.dims)
            )
        name = name.strip()
        if name in out:
            raise BadInput(f"--shape gives {name} twice ({name}={out[name]} and {part}); give each dimension once")
        out[name] = value.strip()
    return out


def custom_name(spec: KernelSpec, shape: Shape) -> str:
    """A stable generated name, so a custom shape is a first-class workload in the DB and reports."""
    return "custom." + "-".join(f"{d.name}{shape[d.name]}" for d in spec.dims)


def check_size(spec: KernelSpec, shape: Shape) -> Shape:
    """`shape` if its buffers fit the cap: every user shape (--shape, a workloads file) is checked before a
    worker tries to allocate it."""
    mb, cap = spec.bytes_moved(shape) / 1e6, max_input_mb()
    if mb > cap:
        raise BadInput(
            f"{spec.name} shape {shape} needs about {_mb(mb)} MB of buffers, over the {_mb(cap)} MB cap "
            "(raise it with EDGETUNE_MAX_INPUT_MB)"
        )
    return shape


def _mb(x: float) -> str:
    """Megabytes to read: whole above 10, else two significant digits, so a small cap never reads as "0 MB"."""
    return f"{x:,.0f}" if x >= 10 else f"{x:.2g}"


def custom_workload(spec: KernelSpec, shape_text: str) -> Workload:
    shape = check_size(spec, spec.validate_shape(parse_shape_text(spec, shape_text)))
    return Workload(custom_name(spec, shape), shape, "custom shape")


def resolve(spec: KernelSpec, workload: str | None, shape_text: str | None) -> Workload:
    if workload and shape_text:
        raise BadInput("give either --workload or --shape, not both")
    if shape_text:
        return custom_workload(spec, shape_text)
    if workload:
        if workload.startswith("custom."):
            return custom_workload(spec, _shape_text_from_name(spec, workload))
        return spec.workload(workload)
    raise BadInput(f"name a workload (--workload, one of: {', '.join(w.name for w in spec.workloads)}) or give --shape")


def _shape_text_from_name(spec: KernelSpec, name: str) -> str:
    """Invert custom_name: `custom.M100-N200-K300` → `M=100,N=200,K=300`."""
    parts = name.removeprefix("custom.").split("-")
    out = []
    for d, p in zip(spec.dims, parts):
        if not p.startswith(d.name):
            raise BadInput(f"{name!r} is not a custom workload name of {spec.name}")
        out.append(f"{d.name}={p[len(d.name):]}")
    if len(parts) != len(spec.dims):
        raise BadInput(f"{name!r} is not a custom workload name of {spec.name}")
    return ",".join(out)
