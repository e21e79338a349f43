"""The text the tuner model reads and writes (shared by training and inference; no heavy imports).

Prompt: kernel, workload shape (each dim with its log2 bucket, so nearby sizes share a token), the work it implies
(log2 buckets of the kernel's flop and byte counts: the product of the dims that decides threads and tiling, which
a tiny model does not learn to multiply from a few hundred shapes), and the hardware descriptor (ISA, vector bits,
cache sizes, cores, bandwidth as a log2 bucket). Completion: ` name=value` pairs in space order.

After the first batch of a tuning session, the prompt also carries what was measured (`history_text`): each config
with its time relative to the fastest of them, as a bucket. The model is trained on such histories drawn from the
collected tables (tuner.train.train), so it proposes what is likely faster *given* how this device answered: a
device whose 2-thread configs measured slow, or whose wide tiles did, is steered away from more of them.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

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


# a measured config's time over the fastest of the history, as a bucket: ties (under 3%, the noise), a few
# percent, then roughly doubling steps; the last one is everything 4x and slower
TIME_BUCKETS = (1.03, 1.10, 1.25, 1.5, 2.0, 4.0)
HISTORY_MAX = 5  # measured configs a prompt carries: a first batch's worth


def time_bucket(rel: float) -> str:
    """`t0` (within noise of the fastest) ... `t6` (4x slower or worse)."""
    return f"t{next((i for i, b in enumerate(TIME_BUCKETS) if rel <= b), len(TIME_BUCKETS))}"


def history_kept(times: Sequence[float]) -> list[int]:
    """Which of the measured configs (by their times, in measurement order) a prompt carries, in that order: all
    up to HISTORY_MAX; beyond, the fastest half of them and the most recent of the rest."""
    n = len(times)
    if n <= HISTORY_MAX:
        return list(range(n))
    fast = sorted(range(n), key=lambda i: times[i])[:(HISTORY_MAX + 1) // 2]
    recent = [i for i in range(n - 1, -1, -1) if i not in fast][:HISTORY_MAX - len(fast)]
    return sorted(fast + recent)


def history_text(history: Sequence[tuple[Mapping[str, Any], float]], names: list[str]) -> str:
    """` h name=value ... tN ;` per measured (config, ms) that `history_kept` keeps, each timed relative to the
    fastest of them."""
    if not history:
        return ""
    keep = history_kept([ms for _, ms in history])
    fastest = min(history[i][1] for i in keep)
    return "".join(f" h{completion_text(history[i][0], names)} {time_bucket(history[i][1] / fastest)} ;"
                   for i in keep)


def prompt_text(kernel: str, shape: Mapping[str, int], hw: Any,
                history: Sequence[tuple[Mapping[str, Any], float]] = (), names: list[str] | None = None) -> str:
    from kernels.registry import all_specs  # lazy: importing this module stays cheap (no numpy, no specs)

    h = hw_fields(hw)
    dims = " ".join(f"{k} {int(v)} ^{_log2(v)}" for k, v in shape.items())
    spec = all_specs().get(kernel)
    if spec is not None:
        dims += f" fl^{_log2(spec.flops(shape))} by^{_log2(spec.bytes_moved(shape))}"
    bw = h.get("bandwidth_gbps")
    # a log2 bucket: run-to-run noise (13.0 vs 14.2 GB/s) must not change the prompt
    bw_txt = f"bw^{_log2(bw)}" if bw else "bw?"
    base = (f"{kernel} {dims} | {h['isa']} v{h['vector_bits']} L1 {_kb(h['l1d'])} L2 {_kb(h['l2'])} "
            f"L3 {_kb(h['l3'])} c{h['cores']} {bw_txt} ;")
    if not history:
        return base
    if names is None:
        names = [p.name for p in spec.params] if spec is not None else list(history[0][0])
    return base + history_text(history, names)


def field_text(name: str, value: Any) -> str:
    return f" {name}={value}"


def completion_text(cfg: Mapping[str, Any], names: list[str]) -> str:
    return "".join(field_text(n, cfg[n]) for n in names)
