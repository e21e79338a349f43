"""The configs the kernels' every-knob-value tests build and check: each value of each knob, in the valid config
nearest the shape's valid default."""

from __future__ import annotations

import dataclasses
from typing import Any

from kernels.space import Config, config_key
from kernels.spec import KernelSpec


def roomy(hw: Any) -> Any:
    """`hw` with the most a knob can ask of the hardware: 512-bit vectors (so 32 registers) and 8 equal cores."""
    return dataclasses.replace(hw, vector_bits=512, cores=8, clusters=())


def every_knob_value(spec: KernelSpec, shape: dict, hw: Any) -> list[Config]:
    """The shape's valid default, then for each value of each knob the valid config nearest it. A value that no
    valid config holds must be a vector width or a thread count (the ISA's width, the cores and the work a thread
    gets rule those out), or be ruled out by this hardware alone, as a register tile over AVX2's 16 registers is:
    some config with it is valid on a roomier device."""
    space = spec.space(shape, hw)
    base, valid = space.valid_default(), list(space.enumerate())
    out = {config_key(base): base}
    roomier: list[Config] | None = None
    for p in spec.params:
        for v in p.values:
            with_v = [c for c in valid if c[p.name] == v]
            if with_v:
                cfg = min(with_v, key=lambda c: space.distance(c, base))
                out.setdefault(config_key(cfg), cfg)
                continue
            if p.name in ("vec", "threads"):
                continue
            roomier = roomier if roomier is not None else list(spec.space(shape, roomy(hw)).enumerate())
            assert any(c[p.name] == v for c in roomier), f"{p.name}={v} is never valid on {shape}, on any hardware"
    return list(out.values())
