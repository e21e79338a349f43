"""Cache levels from sysfs (one cpu per core type, so big.LITTLE shows both), with a getconf fallback."""

from __future__ import annotations

import subprocess
from pathlib import Path

from hwprobe.descriptor import CacheLevel
from hwprobe.sysfs import cpu_list, read

_TYPE_ORDER = {"Data": 0, "Instruction": 1, "Unified": 2}
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
# getconf name prefix -> (level, type)
_GETCONF = {"LEVEL1_DCACHE": (1, "Data"), "LEVEL1_ICACHE": (1, "Instruction"),
            "LEVEL2_CACHE": (2, "Unified"), "LEVEL3_CACHE": (3, "Unified"), "LEVEL4_CACHE": (4, "Unified")}


def _size(text: str | None) -> int | None:
    """sysfs writes "48K", "2048K"; some kernels and tools use "1M"."""
    if not text:
        return None
    unit = _UNITS.get(text[-1].upper(), 1)
    digits = text[:-1] if unit > 1 else text
    return int(digits) * unit if digits.isdigit() else None


def _int(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None


def _from_sysfs(root: Path, cpu: int) -> list[CacheLevel]:
    out = []
    for d in sorted((root / f"sys/devices/system/cpu/cpu{cpu}/cache").glob("index*")):
        rel = str(d.relative_to(root))
        level = _int(read(root, f"{rel}/level"))
        if level is None:
            continue
        shared = cpu_list(read(root, f"{rel}/shared_cpu_list"))
        out.append(CacheLevel(
            level=level,
            type=read(root, f"{rel}/type") or "unknown",
            size_bytes=_size(read(root, f"{rel}/size")),
            line_bytes=_int(read(root, f"{rel}/coherency_line_size")),
            shared_cpus=len(shared) or None,
        ))
    return out


def _from_getconf() -> list[CacheLevel]:
    """glibc's view (cpuid on x86; often zeros on arm). Python's os.sysconf does not expose these names."""
    try:
        text = subprocess.run(["getconf", "-a"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    values = {key: value.strip() for key, _, value in (line.partition(" ") for line in text.splitlines())}
    return [
        CacheLevel(level, kind, size, _int(values.get(f"{name}_LINESIZE")), None)
        for name, (level, kind) in _GETCONF.items()
        if (size := _int(values.get(f"{name}_SIZE")))
    ]


def probe_caches(root: Path, usable: list[int], core_kind: dict[int, str], live: bool) -> tuple[CacheLevel, ...]:
    """Caches of the first usable cpu of each core type, deduplicated; () when unknown.

    Within a level and type the largest comes first, so `cache_bytes()` describes the big core, where a
    busy thread ends up.
    """
    first_of_kind: dict[str | None, int] = {}
    for cpu in usable:
        first_of_kind.setdefault(core_kind.get(cpu), cpu)
    found = [c for cpu in first_of_kind.values() for c in _from_sysfs(root, cpu)]
    if not found and live:
        found = _from_getconf()
    found.sort(key=lambda c: (c.level, _TYPE_ORDER.get(c.type, 3), -(c.size_bytes or 0)))
    return tuple(dict.fromkeys(found))
