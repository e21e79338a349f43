"""Describe a device that is not this host: a named ISA level of another arch, built with a cross toolchain.

This is how `edgetune kernels --isa armv8-a` on an x86 machine shows the ARM spaces, and how builds for armv7 or
aarch64 are cross-compiled and checked under qemu-user. Timing such a target here is meaningless, so only what
does not depend on speed (space sizes, proposals, correctness) uses it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from edgetune.errors import BadInput
from hwprobe.compiler import describe_compiler
from hwprobe.cpuinfo import host_arch
from hwprobe.descriptor import HwDescriptor
from hwprobe.fingerprint import fw_fingerprint, hw_fingerprint
from hwprobe.isa import LADDERS, detect
from hwprobe.probe import probe

# a generic target stands for the common edge board: Raspberry Pi 4/5, i.MX8M Plus and RK3588's big cluster
TARGET_CORES = 4
_BASE_FLAGS = {"aarch64": frozenset({"asimd"}), "armv7l": frozenset()}
# what every edge core of a level also has, beyond the rung's own flags: fp16 arithmetic on the armv8.2 cores
# (Cortex-A55/A75/A76/A78), VFPv4 fused multiply-add on the armv7 NEON ones (Cortex-A7/A15/A17, AArch32 A53/A72)
_USUAL_AT = {"armv8.2-a+dotprod": frozenset({"fphp", "asimdhp"}), "armv7-a+neon": frozenset({"vfpv4"})}
_NO_SYSROOT = Path("/nonexistent")  # a target's SVE levels take the architectural minimum, 128 bits


@dataclass(frozen=True)
class Toolchain:
    """Debian's cross compiler, its sysroot and the qemu-user emulator for one arch."""

    arch: str
    triple: str  # e.g. aarch64-linux-gnu
    qemu: str  # qemu-user binary
    apt: str  # the Debian package of the compiler

    @property
    def cc(self) -> str:
        return f"{self.triple}-gcc"

    @property
    def sysroot(self) -> str:
        return f"/usr/{self.triple}"

    def which_cc(self) -> str | None:
        return shutil.which(self.cc)


TOOLCHAINS = {
    "aarch64": Toolchain("aarch64", "aarch64-linux-gnu", "qemu-aarch64", "gcc-aarch64-linux-gnu"),
    "armv7l": Toolchain("armv7l", "arm-linux-gnueabihf", "qemu-arm", "gcc-arm-linux-gnueabihf"),
}


def is_foreign(hw: HwDescriptor) -> bool:
    """Code for `hw` cannot run natively here: its arch is not the one this Python runs as."""
    return hw.arch != host_arch()


def toolchain(arch: str) -> Toolchain:
    if arch not in TOOLCHAINS:
        raise BadInput(f"no cross toolchain for arch {arch!r}; cross targets: {', '.join(TOOLCHAINS)}")
    return TOOLCHAINS[arch]


def arch_of(isa: str) -> str | None:
    """The arch whose ladder names `isa`, or None."""
    return next((arch for arch, ladder in LADDERS.items() if any(r.name == isa for r in ladder)), None)


def target_descriptor(isa: str, cores: int = TARGET_CORES) -> HwDescriptor:
    """A generic device at ISA level `isa` of a cross arch: the level's features and vector width, `cores` equal
    cores, caches and memory unknown, and the cross compiler as its compiler."""
    arch = arch_of(isa)
    if arch not in TOOLCHAINS:
        known = ", ".join(r.name for a in TOOLCHAINS for r in LADDERS[a])
        raise BadInput(f"--isa {isa!r} names no cross target; cross ISA levels: {known}")
    ladder = LADDERS[arch]
    rungs = ladder[: [r.name for r in ladder].index(isa) + 1]
    flags = frozenset().union(_BASE_FLAGS[arch], *(r.needs | _USUAL_AT.get(r.name, frozenset()) for r in rungs))
    level = detect(arch, flags, _NO_SYSROOT)
    compiler = describe_compiler(toolchain(arch).cc)
    model = f"generic {isa} target"
    firmware: dict[str, str] = {}
    return HwDescriptor(
        arch=arch, cpu_model=model, isa=level.isa, isa_level=level.isa_level, detected_isa=level.detected_isa,
        features=level.features, vector_bits=level.vector_bits, march=level.march, cores=cores,
        cores_online=cores, caches=(), mem_total_bytes=None, bandwidth_gbps=None, compiler=compiler,
        hw_fingerprint=hw_fingerprint(arch, model, level.isa, level.features, (), cores, compiler.id),
        fw_fingerprint=fw_fingerprint(firmware), firmware=firmware,
    )


def cross_levels() -> list[str]:
    """The ISA levels `describe` takes for a generic device of another arch than this host's."""
    return [r.name for a in TOOLCHAINS if a != host_arch() for r in LADDERS[a]]


def describe(isa: str | None = None, *, measure_bandwidth: bool = False) -> HwDescriptor:
    """This host capped to `isa`, or, when `isa` is a level of a cross arch, a generic target of that level."""
    arch = arch_of(isa) if isa else None
    if arch is None or arch == host_arch() or arch not in TOOLCHAINS:
        try:
            return probe(isa_cap=isa, measure_bandwidth=measure_bandwidth)
        except BadInput as e:  # the probe lists this host's levels only, and these verbs take the cross ones too
            if not cross_levels():
                raise
            raise BadInput(f"{e}; or, for a generic device of another arch: {', '.join(cross_levels())}") from None
    return target_descriptor(isa)
