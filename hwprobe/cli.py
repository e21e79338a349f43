"""`edgetune probe`: show what edgetune sees on this device, and under which fingerprints results are kept."""

from __future__ import annotations

import argparse

from edgetune.output import emit, json_flag, table
from hwprobe.descriptor import CacheLevel, Cluster, HwDescriptor
from hwprobe.probe import probe

_TYPE_SUFFIX = {"Data": "d", "Instruction": "i", "Unified": ""}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("probe", help="describe this device: ISA, caches, cores, memory, compiler, fingerprints")
    p.add_argument("--isa", metavar="LEVEL", help="cap the ISA to emulate a smaller device, e.g. x86-64-v3")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the memory bandwidth measurement")
    json_flag(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    d = probe(isa_cap=args.isa, measure_bandwidth=not args.no_bandwidth)
    emit(d.to_dict(), args.json, lambda _: _render(d))
    return 0


def _bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n} B"


def _cache(c: CacheLevel) -> str:
    shared = f", shared by {c.shared_cpus}" if c.shared_cpus else ""
    line = f", {c.line_bytes} B lines" if c.line_bytes else ""
    return f"L{c.level}{_TYPE_SUFFIX.get(c.type, '?')} {_bytes(c.size_bytes)}{line}{shared}"


def _cluster(c: Cluster) -> str:
    what = [f"capacity {c.capacity}" if c.capacity else "", f"{c.max_khz / 1e6:.2f} GHz" if c.max_khz else ""]
    return f"{len(c.cpus)}x {c.core} ({', '.join(w for w in what if w)})"


def _render(d: HwDescriptor) -> None:
    capped = f" (capped from {d.detected_isa})" if d.isa != d.detected_isa else ""
    rows = [
        ["cpu", d.cpu_model],
        ["arch", d.arch],
        ["isa", f"{d.isa}, level {d.isa_level}, {d.vector_bits}-bit vectors{capped}"],
        ["-march", d.march or "(none)"],
        ["features", " ".join(d.features) or "-"],
        ["cores", f"{d.cores} usable of {d.cores_online} online, {d.big_cores} big"],
        ["clusters", " + ".join(map(_cluster, d.clusters)) or "all cores equal (no cpu_capacity or cpufreq)"],
        ["caches", "\n".join(map(_cache, d.caches)) or "unknown"],
        ["memory", _bytes(d.mem_total_bytes)],
        ["bandwidth", f"{d.bandwidth_gbps} GB/s (copy, read+write)" if d.bandwidth_gbps else "not measured"],
        ["compiler", f"{d.compiler.id} ({d.compiler.path})" if d.compiler.path else "none found"],
        ["firmware", ", ".join(f"{k}={v}" for k, v in d.firmware.items() if v)],
        ["hw_fingerprint", d.hw_fingerprint],
        ["fw_fingerprint", d.fw_fingerprint],
    ]
    table("edgetune probe", ["field", "value"], rows)
