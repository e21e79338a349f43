"""Power meters and kernel energy: serial text meters (INA219/INA226 sketches), RDTech UM USB meters and
powercap/RAPL, behind one `PowerMeter` interface, plus window integration net of an idle baseline.

    meter = meter_from_config(config.power)               # None when [power] meter = "none"
    meter.start()
    idle = measure_idle(meter)                            # watts, over meter.idle_s seconds
    t0 = time.monotonic(); run_bench(); t1 = time.monotonic()
    try:
        j = energy_per_call(meter, t0, t1, calls, idle)
    except EnergyUnavailable as e:                        # unplugged, no data, window too short, ...
        log.warning("energy unavailable (%s); ranking by latency", e)
    meter.stop()
"""

from __future__ import annotations

from hwprobe.power.base import MeterStatus, PowerMeter, Sample, ThreadedMeter
from hwprobe.power.config import PowerConfig, meter_from_config
from hwprobe.power.energy import EnergyUnavailable, Window, energy_per_call, integrate, measure_idle, measure_window
from hwprobe.power.rapl import RaplMeter
from hwprobe.power.serial_text import TextFormat, TextMeter
from hwprobe.power.um import UMMeter

__all__ = [
    "EnergyUnavailable", "MeterStatus", "PowerConfig", "PowerMeter", "RaplMeter", "Sample", "TextFormat", "TextMeter",
    "ThreadedMeter", "UMMeter", "Window", "energy_per_call", "integrate", "meter_from_config", "measure_idle",
    "measure_window",
]
