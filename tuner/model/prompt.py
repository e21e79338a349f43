"""The text the tuner model reads and writes (shared by training and inference; no heavy imports).

Prompt: kernel, workload shape (each dim with its log2 bucket, so nearby sizes share a token), the work it implies
(log2 buckets of the kernel's flop and byte counts: the product of the dims that decides threads and tiling, which
a tiny model does not learn to multiply from a few hundred shapes), and the hardware descriptor (ISA, vector bits,
cache sizes, cores, bandwidth as a log2 bucket). Completion: ` name=value` pairs in space order.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

ISA_VECTOR_BITS = {"x86-64": 128, "x86-64-v2": 128, "x86-64-v3": 256, "x86-64-v4": 512}


def _kb(n: int | None) -> str:
    if not n:
        return "?"
    return f"{n // (1 << 20)}M" if n >= (1 << 20) else f"{n // 1024}K"


def hw_fields(hw: Any) -> dict:
    """The descriptor fields the prompt uses, from an HwDescriptor or an already-flat dict."""
    if isinstance(hw, Mapping):
        return {k: hw.get(k) for k in ("isa", "vector_bits", "cores", "l1d", "l2", "l3", "bandwidth_gbps")}
    return {"isa": hw.isa, "vector_bits": hw.vector_bits, "cores": hw.cores, "l1d": hw.cache_bytes(1),
            "l2": hw.cache_bytes(2), "l3": hw.cache_bytes(3), "bandwidth_gbps": hw.bandwidth_gbps}


def _log2(x: float) -> int:
    return max(0, round(math.log2(max(1.0, float(x)))))


def prompt_text(kernel: str, shape: Mapping[str, int], hw: Any) -> str:
    from kernels.registry import all_specs  # lazy: importing this module stays cheap (no numpy, no specs)

    h = hw_fields(hw)
    dims = " ".join(f"{k} {int(v)} ^{_log2(v)}" for k, v in shape.items())
    spec = all_specs().get(kernel)
    if spec is not None:
        dims += f" fl^{_log2(spec.flops(shape))} by^{_log2(spec.bytes_moved(shape))}"
    bw = h.get("bandwidth_gbps")
    # a log2 bucket: run-to-run noise (13.0 vs 14.2 GB/s) must not change the prompt
    bw_txt = f"bw^{_log2(bw)}" if bw else "bw?"
    return (f"{kernel} {dims} | {h['isa']} v{h['vector_bits']} L1 {_kb(h['l1d'])} L2 {_kb(h['l2'])} "
            f"L3 {_kb(h['l3'])} c{h['cores']} {bw_txt} ;")


def field_text(name: str, value: Any) -> str:
    return f" {name}={value}"


def completion_text(cfg: Mapping[str, Any], names: list[str]) -> str:
    return "".join(field_text(n, cfg[n]) for n in names)
