"""powercap/RAPL energy counters in sysfs: the CPU package's own power, no extra hardware.

`energy_uj` is a monotonically increasing µJ counter that wraps at `max_energy_range_uj`. Sampling it every
`poll_s` gives the mean power of each interval, stamped at the interval's midpoint so trapezoid integration
stays unbiased. Since Linux 5.10 (CVE-2020-8694) `energy_uj` is root-only by default: the edgetune user needs
a udev or tmpfiles rule granting read access, and the status says so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from hwprobe.power.base import ThreadedMeter

DEFAULT_ZONE = "/sys/class/powercap/intel-rapl:0"


@dataclass
class _Counter:
    max_uj: int
    t: float
    uj: int


class RaplMeter(ThreadedMeter):
    name = "rapl"

    def __init__(self, zone: str = DEFAULT_ZONE, *, poll_s: float = 0.05, **kw) -> None:
        super().__init__(zone, **kw)
        self.zone, self.poll_s = Path(zone), poll_s

    def _read(self, name: str) -> int:
        # Re-opened per read: sysfs attributes are regenerated on open, and it costs microseconds.
        try:
            return int((self.zone / name).read_text())
        except PermissionError as e:
            raise PermissionError(f"{e}; energy_uj is root-only since Linux 5.10, grant the edgetune user "
                                  "read access with a udev or tmpfiles rule") from None
        except ValueError as e:
            raise OSError(f"{self.zone / name}: not a number ({e})") from None

    def _connect(self) -> _Counter:
        max_uj = self._read("max_energy_range_uj")
        return _Counter(max_uj, time.monotonic(), self._read("energy_uj"))

    def _close(self, counter: _Counter) -> None:
        pass  # nothing held open between reads

    def _session(self, c: _Counter) -> None:
        while not self._stop.wait(self.poll_s):
            uj, t = self._read("energy_uj"), time.monotonic()
            delta = uj - c.uj if uj >= c.uj else uj + c.max_uj - c.uj  # wrapped
            if t > c.t:
                self._add((c.t + t) / 2, delta * 1e-6 / (t - c.t))
            c.t, c.uj = t, uj
