"""How many cpus this process may really use: affinity mask, then any cgroup v2 cpu quota."""

from __future__ import annotations

import math
import os
from pathlib import Path

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
