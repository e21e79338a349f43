"""Power meters and kernel energy: serial text meters (INA219/INA226 sketches), RDTech UM USB meters and
powercap/RAPL, behind one `PowerMeter` interface, plus window integration net of an idle baseline.

    meter = meter_from_config(config.get("power", {}))   # None when [power] meter = "none"
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

from collections.abc import Mapping
from typing import Any

from hwprobe.power.base import MeterStatus, PowerMeter, Sample, ThreadedMeter
from hwprobe.power.energy import EnergyUnavailable, Window, energy_per_call, integrate, measure_idle, measure_window
from hwprobe.power.rapl import DEFAULT_ZONE, RaplMeter
from hwprobe.power.serial_text import TextFormat, TextMeter
from hwprobe.power.um import UMMeter
from edgetune.errors import BadInput

__all__ = [
    "EnergyUnavailable", "MeterStatus", "PowerMeter", "RaplMeter", "Sample", "TextFormat", "TextMeter",
    "ThreadedMeter", "UMMeter", "Window", "energy_per_call", "integrate", "meter_from_config", "measure_idle",
    "measure_window",
]

# [power] keys by meter kind; `common` apply to all.
_KEYS = {
    "common": {"meter", "max_gap_s", "idle_s", "lag_s", "retry_s"},
    "none": set(),
    "text": {"port", "baud", "format", "columns", "power", "voltage", "current"},
    "um": {"port", "baud", "poll_s", "timeout_s"},
    "rapl": {"zone", "poll_s"},
}


def _num(cfg: Mapping[str, Any], key: str, default: float, *, positive: bool = True) -> float:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (positive and v == 0):
        raise BadInput(f"power.{key} must be a {'positive' if positive else 'non-negative'} number, not {v!r}")
    return float(v)


def meter_from_config(cfg: Mapping[str, Any]) -> PowerMeter | None:
    """Build (not start) the meter a `[power]` table describes; None for `meter = "none"` (the default).
    Raises BadInput naming the offending key."""
    kind = cfg.get("meter", "none")
    if kind not in _KEYS or kind == "common":
        raise BadInput(f"power.meter must be one of none, text, um, rapl; not {kind!r}")
    unknown = set(cfg) - _KEYS["common"] - _KEYS[kind]
    if unknown:
        raise BadInput(f"power: unknown key(s) for meter {kind!r}: {', '.join(sorted(unknown))}")
    if kind == "none":
        return None
    common = {
        "max_gap_s": _num(cfg, "max_gap_s", 1.0),
        "idle_s": _num(cfg, "idle_s", 5.0),
        "lag_s": _num(cfg, "lag_s", 0.0, positive=False),
        "retry_s": _num(cfg, "retry_s", 1.0),
    }
    if kind == "rapl":
        return RaplMeter(str(cfg.get("zone", DEFAULT_ZONE)), poll_s=_num(cfg, "poll_s", 0.05), **common)
    port = cfg.get("port")
    if not isinstance(port, str) or not port:
        raise BadInput(f"power.port is required for meter {kind!r} (e.g. /dev/serial/by-id/...)")
    baud = cfg.get("baud", 9600 if kind == "um" else 115200)
    if isinstance(baud, bool) or not isinstance(baud, int) or baud <= 0:
        raise BadInput(f"power.baud must be a positive integer, not {baud!r}")
    if kind == "um":
        return UMMeter(port, baud=baud, poll_s=_num(cfg, "poll_s", 0.2), timeout_s=_num(cfg, "timeout_s", 1.0),
                       **common)
    columns = cfg.get("columns", [])
    if not isinstance(columns, list) or not all(isinstance(c, str) for c in columns):
        raise BadInput(f"power.columns must be a list of column names, not {columns!r}")
    fmt = TextFormat(str(cfg.get("format", "csv")), tuple(columns), cfg.get("power"), cfg.get("voltage"),
                     cfg.get("current"))
    return TextMeter(port, fmt, baud=baud, **common)
