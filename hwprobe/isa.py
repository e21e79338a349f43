"""Place the cpu on its arch's ISA ladder (-march level and vector width), and apply an --isa cap."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgetune.errors import BadInput
from hwprobe.sysfs import read


@dataclass(frozen=True)
class Rung:
    name: str  # ISA level name, which is also the base of the -march value
    needs: frozenset[str]  # flags required on top of the rungs below
    vector_bits: int | None  # None: the SVE vector length of the machine


def _rung(name: str, needs: str, bits: int | None) -> Rung:
    return Rung(name, frozenset(needs.split()), bits)


# x86 follows the psABI micro-architecture levels, with their full flag sets: a VM that hides e.g. movbe
# must not get -march=x86-64-v3, or builds would SIGILL.
_X86 = (
    _rung("x86-64", "", 128),
    _rung("x86-64-v2", "cx16 lahf_lm popcnt pni sse4_1 sse4_2 ssse3", 128),
    _rung("x86-64-v3", "avx avx2 bmi1 bmi2 f16c fma abm movbe xsave", 256),
    _rung("x86-64-v4", "avx512f avx512bw avx512cd avx512dq avx512vl", 512),
)
# Arm: -march must name each extension; a rung exists only where it changes what kernels can use.
# armv8.2-a implies LSE atomics and RDM, so dotprod alone is not enough evidence for it.
_AARCH64 = (
    _rung("armv8-a", "", 128),
    _rung("armv8.2-a+dotprod", "dotprod atomics asimdrdm", 128),
    _rung("armv8.2-a+dotprod+i8mm", "i8mm", 128),
    _rung("armv8.2-a+dotprod+i8mm+sve", "sve", None),
    _rung("armv8.2-a+dotprod+i8mm+sve2", "sve2", None),
)
# Without +neon, -march=armv7-a gives scalar VFP code only.
_ARMV7 = (
    _rung("armv7-a", "", 32),
    _rung("armv7-a+neon", "neon", 128),
)
LADDERS: dict[str, tuple[Rung, ...]] = {"x86_64": _X86, "aarch64": _AARCH64, "armv7l": _ARMV7}
_LEVEL_BASE = {"x86_64": 1}  # x86 levels are numbered v1..v4; arm ladders start at 0

_X86_SIMD_PREFIXES = ("sse", "ssse3", "avx", "fma", "f16c", "bmi", "popcnt", "amx")
_ARM_SIMD = frozenset("neon vfpv4 asimd asimdhp dotprod asimdfhm i8mm bf16 sve sve2".split())


@dataclass(frozen=True)
class Isa:
    isa: str  # the (capped) level name
    isa_level: int
    detected_isa: str
    features: tuple[str, ...]  # what the hardware has, even when capped below it
    vector_bits: int
    march: str  # the level's -march, with any extra extension (see _march); "" when the arch has no ladder


def _normalize(arch: str, flags: frozenset[str]) -> frozenset[str]:
    """Use one name per feature: cpuinfo says asimddp for dotprod, and a 64-bit kernel shows asimd to armv7."""
    out = set(flags)
    if "asimddp" in out:
        out.add("dotprod")
    if arch == "armv7l" and "asimd" in out:
        out.add("neon")
    return frozenset(out)


def _simd_features(arch: str, flags: frozenset[str]) -> tuple[str, ...]:
    if arch == "x86_64":
        return tuple(sorted(f for f in flags if f.startswith(_X86_SIMD_PREFIXES)))
    return tuple(sorted(flags & _ARM_SIMD))


def _march(arch: str, rung: Rung, level: int, flags: frozenset[str]) -> str:
    """The rung's name, plus the extensions the hardware has that do not make a rung of their own (they change
    no kernel knob): half-precision arithmetic on armv8.2 cores, fused multiply-add (VFPv4) on 32-bit NEON."""
    if arch == "aarch64" and level >= 1 and "asimdhp" in flags:
        return rung.name + "+fp16"
    if arch == "armv7l" and rung.name == "armv7-a+neon" and "vfpv4" in flags:
        return "armv7-a+neon-vfpv4"
    return rung.name


def _sve_bits(root: Path) -> int:
    """The kernel's default SVE vector length (in bytes) is the hardware's, capped at 512 bits."""
    text = read(root, "proc/sys/abi/sve_default_vector_length") or ""
    return int(text) * 8 if text.isdigit() and int(text) > 0 else 128


def detect(arch: str, flags: frozenset[str], root: Path, cap: str | None = None) -> Isa:
    """Highest rung whose flags (and all lower rungs' flags) are present, then lowered to `cap` if given."""
    ladder = LADDERS.get(arch, ())
    flags = _normalize(arch, flags)
    features = _simd_features(arch, flags)
    top = -1
    for rung in ladder:
        if not rung.needs <= flags:
            break
        top += 1
    allowed = [r.name for r in ladder[: top + 1]]
    if cap is not None and cap not in allowed:
        raise BadInput(
            f"--isa {cap!r} is not available on this {arch} device; allowed: {', '.join(allowed) or 'none'}"
        )
    if not ladder:
        return Isa("unknown", 0, "unknown", features, 128, "")
    level = allowed.index(cap) if cap else top
    rung = ladder[level]
    bits = rung.vector_bits or _sve_bits(root)
    return Isa(rung.name, level + _LEVEL_BASE.get(arch, 0), ladder[top].name, features, bits,
               _march(arch, rung, level, flags))
