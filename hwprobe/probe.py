"""Assemble the HwDescriptor from the live system or a captured sysroot (tests, fleet debugging)."""

from __future__ import annotations

from pathlib import Path

from hwprobe import bandwidth, cpuinfo, isa
from hwprobe.caches import probe_caches
from hwprobe.compiler import describe_compiler
from hwprobe.cores import clusters, count_cores, online, usable_cpus
from hwprobe.descriptor import HwDescriptor
from hwprobe.fingerprint import fw_fingerprint, hw_fingerprint
from hwprobe.firmware import firmware_info
from hwprobe.memory import mem_total_bytes


def probe(
    root: str | Path = "/", isa_cap: str | None = None, measure_bandwidth: bool = True, cc: str | None = None
) -> HwDescriptor:
    """Describe the device. Missing files give "unknown"/None, never an error; only a bad `isa_cap` raises
    BadInput. Bandwidth is measured (~0.3 s) only on the live system; without `measure_bandwidth` the last
    measurement on this hw_fingerprint is used, if any. The compiler is always this host's."""
    root = Path(root)
    live = root.resolve() == Path("/")
    cpu = cpuinfo.parse(root, live)
    level = isa.detect(cpu.arch, cpu.flags, root, isa_cap)
    usable = usable_cpus(root, live, sorted(cpu.core_kind))
    cores = count_cores(root, usable)
    caches = probe_caches(root, usable, cpu.core_kind, live)
    mem = mem_total_bytes(root)
    llc = max((c.size_bytes or 0 for c in caches), default=None)
    compiler = describe_compiler(cc)
    firmware = firmware_info(root, live)
    fp = hw_fingerprint(cpu.arch, cpu.model, level.isa, level.features, caches, cores, compiler.id)
    # bandwidth does not depend on an ISA cap: remember it under the uncapped device's fingerprint
    device = hw_fingerprint(cpu.arch, cpu.model, level.detected_isa, level.features, caches, cores, compiler.id)
    gbps = None
    if live and measure_bandwidth:
        gbps = bandwidth.measure_gbps(llc, mem)
        if gbps:
            bandwidth.remember(device, gbps)
    elif live:
        gbps = bandwidth.remembered(device)
    return HwDescriptor(
        arch=cpu.arch,
        cpu_model=cpu.model,
        isa=level.isa,
        isa_level=level.isa_level,
        detected_isa=level.detected_isa,
        features=level.features,
        vector_bits=level.vector_bits,
        march=level.march,
        cores=cores,
        cores_online=len(online(root)) or len(cpu.core_kind) or cores,
        caches=caches,
        mem_total_bytes=mem,
        bandwidth_gbps=gbps,
        compiler=compiler,
        hw_fingerprint=fp,
        fw_fingerprint=fw_fingerprint(firmware),
        firmware=firmware,
        clusters=clusters(root, usable, cpu.core_kind),
    )
