"""Telemetry samples (DESIGN.md contract): what the fleet needs to judge a device's tuning conditions.

Temperature and frequency are reported where the platform exposes them and null elsewhere, never guessed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import psutil

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
# preferred sensor drivers for "the CPU temperature", in order; else the hottest sensor seen
CPU_SENSORS = ("coretemp", "k10temp", "cpu_thermal", "cpu-thermal", "soc_thermal", "zenpower", "acpitz")


def boot_id() -> str:
    try:
        return BOOT_ID.read_text().strip()
    except OSError:  # not Linux, or no procfs: one "boot" per daemon start
        return f"start-{int(psutil.boot_time())}"


def _temp_c() -> float | None:
    try:
        sensors = psutil.sensors_temperatures()
    except (AttributeError, OSError):
        return None
    for name in CPU_SENSORS:
        if sensors.get(name):
            return max(t.current for t in sensors[name])
    temps = [t.current for ts in sensors.values() for t in ts if t.current]
    return max(temps) if temps else None


def _freq_mhz() -> float | None:
    try:
        f = psutil.cpu_freq()
    except (AttributeError, OSError, NotImplementedError):
        return None
    return round(f.current, 1) if f and f.current else None


class Telemetry:
    def __init__(self, next_seq: Callable[[str], int], epoch: int | None = None):
        """`epoch`: set once daemon.db was recovered (DaemonStore.reseed): the seq counter of this boot was lost
        with the old file, so the boot_id gets `+<epoch>` and its seq starts afresh from 0."""
        self.boot_id = boot_id() + (f"+{epoch}" if epoch else "")
        self._next_seq = next_seq
        self._proc = psutil.Process()
        psutil.cpu_percent(None)  # prime: the first sample then covers the first interval

    def sample(self, state: str) -> dict:
        return {
            "seq": self._next_seq(self.boot_id),
            "boot_id": self.boot_id,
            "ts": time.time(),
            "cpu_percent": psutil.cpu_percent(None),
            "load1": os.getloadavg()[0],
            "temp_c": _temp_c(),
            "freq_mhz": _freq_mhz(),
            "mem_used": psutil.virtual_memory().used,
            "rss": self._proc.memory_info().rss,
            "state": state,
        }
