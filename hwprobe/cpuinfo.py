"""Parse /proc/cpuinfo into arch, model, ISA flags and each cpu's core type (big.LITTLE aware)."""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass
from pathlib import Path

from hwprobe.sysfs import read

# Arm Ltd (implementer 0x41) core part numbers, from the kernel's arch/arm64/include/asm/cputype.h.
ARM_PARTS = {
    0xB76: "ARM1176", 0xC07: "Cortex-A7", 0xC08: "Cortex-A8", 0xC09: "Cortex-A9", 0xC0E: "Cortex-A17",
    0xC0F: "Cortex-A15", 0xD03: "Cortex-A53", 0xD04: "Cortex-A35", 0xD05: "Cortex-A55", 0xD07: "Cortex-A57",
    0xD08: "Cortex-A72", 0xD09: "Cortex-A73", 0xD0A: "Cortex-A75", 0xD0B: "Cortex-A76", 0xD0C: "Neoverse-N1",
    0xD0D: "Cortex-A77", 0xD40: "Neoverse-V1", 0xD41: "Cortex-A78", 0xD42: "Cortex-A78AE", 0xD44: "Cortex-X1",
    0xD46: "Cortex-A510", 0xD47: "Cortex-A710", 0xD48: "Cortex-X2", 0xD49: "Neoverse-N2", 0xD4B: "Cortex-A78C",
    0xD4D: "Cortex-A715", 0xD4E: "Cortex-X3", 0xD4F: "Neoverse-V2", 0xD80: "Cortex-A520", 0xD81: "Cortex-A720",
    0xD82: "Cortex-X4", 0xD87: "Cortex-A725",
}
_MACHINE_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}


@dataclass(frozen=True)
class CpuInfo:
    arch: str  # x86_64 | aarch64 | armv7l | ... | unknown
    model: str  # e.g. "Intel(R) Core(TM) i5-8250U CPU @ 1.60GHz", "Cortex-A55 + Cortex-A76", or "unknown"
    flags: frozenset[str]  # raw ISA flags of the first cpu ("flags" on x86, "Features" on arm)
    core_kind: dict[int, str]  # cpu number -> core type name, to pick one cpu per kind on big.LITTLE


def _blocks(text: str) -> list[dict[str, str]]:
    blocks = []
    for chunk in text.split("\n\n"):
        fields = {}
        for line in chunk.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        if fields:
            blocks.append(fields)
    return blocks


def _core_name(block: dict[str, str]) -> str | None:
    """x86 names its cpu; arm only gives implementer/part numbers, which we translate."""
    if "CPU part" in block:
        try:
            impl, part = int(block.get("CPU implementer", "0"), 16), int(block["CPU part"], 16)
        except ValueError:
            return None
        return ARM_PARTS.get(part, f"0x{part:03x}") if impl == 0x41 else f"{impl:#04x}:{part:#05x}"
    return block.get("model name")


def _arch_from_cpuinfo(first: dict[str, str]) -> str:
    if "flags" in first:
        return "x86_64"
    cpu_arch = first.get("CPU architecture", "")
    if cpu_arch == "8" or cpu_arch.lower() == "aarch64" or "asimd" in first.get("Features", "").split():
        return "aarch64"
    return "armv7l" if cpu_arch == "7" else "unknown"


def host_arch() -> str:
    """The arch this Python, and so the native compiler and the measuring worker, runs as."""
    machine = platform.machine()
    arch = _MACHINE_ALIASES.get(machine.lower(), machine) or "unknown"
    # A 64-bit kernel under a 32-bit userland (the Raspberry Pi OS 32-bit default): the compiler targets armv7.
    return "armv7l" if arch == "aarch64" and sys.maxsize < 2**32 else arch


def parse(root: Path, live: bool) -> CpuInfo:
    """On the live system the arch comes from the running Python; for a captured tree, from its cpuinfo."""
    blocks = _blocks(read(root, "proc/cpuinfo") or "")
    procs = [b for b in blocks if "processor" in b]
    first = procs[0] if procs else {}
    kinds: dict[int, str] = {}
    for b in procs:
        name = _core_name(b)
        if name and b["processor"].isdigit():
            kinds[int(b["processor"])] = name
    return CpuInfo(
        arch=host_arch() if live else _arch_from_cpuinfo(first),
        model=" + ".join(dict.fromkeys(kinds.values())) or "unknown",
        flags=frozenset((first.get("flags") or first.get("Features") or "").split()),
        core_kind=kinds,
    )
