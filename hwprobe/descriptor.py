"""The hardware descriptor: everything a kernel's speed depends on, as one typed record."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


def vector_registers(arch: str, vector_bits: int) -> int:
    """AVX-512 (EVEX) and aarch64 have 32 SIMD registers; SSE/AVX2 16, and armv7 NEON 16 quad (128-bit) ones."""
    if arch == "aarch64" or (arch == "x86_64" and vector_bits >= 512):
        return 32
    return 16


@dataclass(frozen=True)
class CacheLevel:
    level: int
    type: str  # Data | Instruction | Unified | unknown
    size_bytes: int | None  # None when unknown
    line_bytes: int | None
    shared_cpus: int | None  # how many logical cpus share this cache


@dataclass(frozen=True)
class Cluster:
    """Cpus of one performance class on a big.LITTLE part, as the kernel's topology reports them."""

    cpus: tuple[int, ...]
    capacity: int | None  # sysfs cpu_capacity (1024 = the biggest core), None when not exposed
    max_khz: int | None  # cpufreq cpuinfo_max_freq
    core: str  # core type from cpuinfo, e.g. "Cortex-A76"


@dataclass(frozen=True)
class Compiler:
    path: str | None  # None when no C compiler was found
    id: str  # e.g. "gcc-12.2.0", or "unknown"
    version: str


@dataclass(frozen=True)
class HwDescriptor:
    arch: str  # x86_64 | aarch64 | armv7l | ...
    cpu_model: str
    isa: str  # ISA level name used for -march, e.g. "x86-64-v3", "armv8.2-a+dotprod"
    isa_level: int  # ordinal within the arch's ladder (x86: 1..4, arm: 0..n)
    detected_isa: str  # what the hardware supports before any --isa cap
    features: tuple[str, ...]  # SIMD flags seen (sse4_2, avx2, avx512f, asimd, dotprod, ...)
    vector_bits: int  # widest SIMD register usable at `isa` (128, 256, 512)
    march: str  # the -march value builds use
    cores: int  # usable by this process (affinity-aware)
    cores_online: int
    caches: tuple[CacheLevel, ...]
    mem_total_bytes: int | None
    bandwidth_gbps: float | None  # measured; None when not measured (captured trees)
    compiler: Compiler
    hw_fingerprint: str
    fw_fingerprint: str
    firmware: dict[str, str] = field(default_factory=dict)  # the inputs to fw_fingerprint
    clusters: tuple[Cluster, ...] = ()  # biggest first; () when all cores are equal or the topology is unknown

    def cache_bytes(self, level: int, kind: str = "Data") -> int | None:
        """Size of the level-N data (or unified) cache, or None when unknown."""
        for c in self.caches:
            if c.level == level and c.type in (kind, "Unified"):
                return c.size_bytes
        return None

    @property
    def vector_registers(self) -> int:
        """Architectural SIMD registers a register tile may use: AVX-512 and aarch64 have 32, SSE/AVX2 16, and
        armv7 NEON 16 quad (128-bit) registers. A kernel's register-tile constraint reads this."""
        return vector_registers(self.arch, self.vector_bits)

    @property
    def big_cores(self) -> int:
        """Usable cores of the biggest cluster: the most threads that all run at the big cores' pace."""
        return min(self.cores, len(self.clusters[0].cpus)) if self.clusters else self.cores

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HwDescriptor":
        d = dict(d)
        d["caches"] = tuple(CacheLevel(**c) for c in d["caches"])
        d["compiler"] = Compiler(**d["compiler"])
        d["features"] = tuple(d["features"])
        d["clusters"] = tuple(Cluster(**{**c, "cpus": tuple(c["cpus"])}) for c in d.get("clusters", ()))
        return cls(**d)
