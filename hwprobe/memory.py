"""Total RAM from /proc/meminfo: bounds buffer sizes and tells a 1 GB Pi from a 16 GB box."""

from __future__ import annotations

from pathlib import Path

from hwprobe.sysfs import read


def mem_total_bytes(root: Path) -> int | None:
    for line in (read(root, "proc/meminfo") or "").splitlines():
        key, _, value = line.partition(":")
        if key == "MemTotal":
            number, _, unit = value.strip().partition(" ")
            if number.isdigit():
                return int(number) * (1024 if unit.strip().lower() == "kb" else 1)
    return None
