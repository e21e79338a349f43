"""How many cpus this process may really use: affinity mask, then any cgroup v2 cpu quota."""

from __future__ import annotations

import math
import os
from pathlib import Path

from hwprobe.descriptor import Cluster
from hwprobe.sysfs import cpu_list, read


def online(root: Path) -> list[int]:
    """Cpus the kernel has up; hotplugged-off cores are not in cpuinfo either."""
    return cpu_list(read(root, "sys/devices/system/cpu/online"))


def usable_cpus(root: Path, live: bool, cpuinfo_cpus: list[int]) -> list[int]:
    """Live: our affinity mask (taskset, systemd CPUAffinity=). Captured tree: the cpus it lists."""
    if live:
        return sorted(os.sched_getaffinity(0))
    return cpuinfo_cpus or online(root) or [0]


def quota_cpus(root: Path) -> int | None:
    """Tightest cpu.max (systemd CPUQuota=, container --cpus) from our cgroup up to the root, in whole cpus."""
    lines = (read(root, "proc/self/cgroup") or "").splitlines()
    parts = next((line[3:].split("/") for line in lines if line.startswith("0::")), [])
    parts = [p for p in parts if p]
    limits = []
    for depth in range(len(parts), -1, -1):
        text = read(root, "/".join(["sys/fs/cgroup", *parts[:depth], "cpu.max"])) or ""
        quota, _, period = text.partition(" ")
        if quota.isdigit() and period.isdigit() and int(period) > 0:
            limits.append(math.ceil(int(quota) / int(period)))
    return min(limits, default=None)


def count_cores(root: Path, usable: list[int]) -> int:
    """Threads worth starting: more than the quota allows only adds throttling."""
    quota = quota_cpus(root)
    return max(1, min(len(usable), quota) if quota else len(usable))


SAME_CLASS_FREQ = 0.9  # cpufreq maxima within 10% are one class: x86 "favoured cores" differ by ~100 MHz


def _cpu_int(root: Path, cpu: int, rel: str) -> int | None:
    text = read(root, f"sys/devices/system/cpu/cpu{cpu}/{rel}") or ""
    return int(text) if text.isdigit() else None


def clusters(root: Path, usable: list[int], core_kind: dict[int, str]) -> tuple[Cluster, ...]:
    """Usable cpus grouped by performance class, biggest first: by the kernel's cpu_capacity (its big.LITTLE
    scale, 1024 = the biggest core) where exposed, else by cpufreq's cpuinfo_max_freq. () when a cpu has neither
    (most x86 VMs): all cores count as equal.

    A statically scheduled team of threads ends with its slowest member, so a thread placed on a LITTLE core sets
    the pace: thread-count constraints read the big cluster (`HwDescriptor.big_cores`)."""
    info = [(_cpu_int(root, c, "cpu_capacity"), _cpu_int(root, c, "cpufreq/cpuinfo_max_freq"), c) for c in usable]
    if not info or any(cap is None and khz is None for cap, khz, _ in info):
        return ()
    by_capacity = all(cap is not None for cap, _, _ in info)
    groups: list[list[tuple[int | None, int | None, int]]] = []
    for row in sorted(info, key=lambda r: (r[0] or 0, r[1] or 0), reverse=True):
        lead = groups[-1][0] if groups else None
        same = lead is not None and (row[0] == lead[0] if by_capacity
                                     else (row[1] or 0) >= SAME_CLASS_FREQ * (lead[1] or 0))
        if same:
            groups[-1].append(row)
        else:
            groups.append([row])
    return tuple(Cluster(tuple(sorted(c for _, _, c in g)), g[0][0], max(k or 0 for _, k, _ in g) or None,
                         core_kind.get(min(c for _, _, c in g), "unknown")) for g in groups)
