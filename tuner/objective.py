"""What tuning minimises: latency (default), energy per call, or the energy-delay product.

Energy comes from a power meter integrated over each variant's timed window, minus the idle baseline. When
the meter cannot vouch for a window (unplugged, no data), the run falls back to latency and says why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from edgetune.errors import BadInput
from kernels.measure import Measurement

log = logging.getLogger(__name__)

OBJECTIVES = ("latency", "energy", "edp")
ENERGY_WINDOW_S = 0.5  # a timed window must span several meter samples


@dataclass
class Objective:
    name: str = "latency"
    meter: Any = None  # hwprobe.power.PowerMeter, started
    idle_w: float | None = None
    fallback_reason: str | None = None  # set when an energy run fell back to latency
    _notes: list[str] = field(default_factory=list)

    @classmethod
    def create(cls, name: str, meter: Any = None) -> "Objective":
        """Validate the choice and take the idle baseline; a meter that cannot deliver means latency, logged."""
        if name not in OBJECTIVES:
            raise BadInput(f"unknown objective {name!r}; objectives: {', '.join(OBJECTIVES)}")
        if name == "latency":
            return cls()
        if meter is None:
            raise BadInput(f"objective {name!r} needs a power meter: set [power] meter in the config "
                           "(text, um or rapl)")
        from hwprobe.power import EnergyUnavailable, measure_idle

        obj = cls(name, meter)
        try:
            obj.idle_w = measure_idle(meter)
        except EnergyUnavailable as e:
            obj.fall_back(f"no idle baseline: {e}")
        return obj

    @property
    def active(self) -> str:
        return "latency" if self.fallback_reason else self.name

    @property
    def min_time_s(self) -> float:
        return ENERGY_WINDOW_S if self.active != "latency" else 0.0

    def fall_back(self, reason: str) -> None:
        if not self.fallback_reason:
            self.fallback_reason = reason
            log.warning("objective %s unavailable (%s); ranking by latency for this run", self.name, reason)

    def score(self, m: Measurement) -> Measurement:
        """Fill m.energy_j and m.score. Returns m. May switch this run to latency (see fallback_reason)."""
        if not m.ok:
            return m
        if self.active != "latency" and m.energy_j is None:
            from hwprobe.power import EnergyUnavailable, energy_per_call

            try:
                m.energy_j = energy_per_call(self.meter, m.t0, m.t1, m.calls, self.idle_w)
            except EnergyUnavailable as e:
                self.fall_back(str(e))
        if self.active == "energy":
            m.score = m.energy_j
        elif self.active == "edp":
            m.score = m.energy_j * m.ms
        else:
            m.score = m.ms
        return m
