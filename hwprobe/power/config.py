"""`[power]`: which meter energy objectives read, as a typed config section, and the meter it describes.

A key left at None takes its meter's default; a key of another meter kind is a problem, so a config written for a
UM meter cannot silently half-apply to a RAPL zone. A table is valid exactly when a meter can be built from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Callable

from edgetune.config import Problem, Section
from edgetune.errors import BadInput
from hwprobe.power.base import PowerMeter
from hwprobe.power.rapl import DEFAULT_ZONE, RaplMeter
from hwprobe.power.serial_text import TextFormat, TextMeter
from hwprobe.power.um import UMMeter

# keys by meter kind; `common` apply to all
_KEYS = {
    "common": {"meter", "max_gap_s", "idle_s", "lag_s", "retry_s"},
    "none": set(),
    "text": {"port", "baud", "format", "columns", "power", "voltage", "current"},
    "um": {"port", "baud", "poll_s", "timeout_s"},
    "rapl": {"zone", "poll_s"},
}


@dataclass
class PowerConfig:
    meter: str = "none"  # none | text (INA219/INA226 sketch) | um (RDTech UM24C/UM25C/UM34C) | rapl
    port: str | None = None  # text and um: the serial device
    baud: int | None = None  # default 115200 (text), 9600 (um)
    format: str | None = None  # text: csv (default) | kv
    columns: list[str] | None = None  # text, csv: column names with unit suffixes
    power: str | None = None  # text: the column or key holding watts ...
    voltage: str | None = None  # ... or these two, multiplied
    current: str | None = None
    zone: str | None = None  # rapl: the powercap zone directory
    poll_s: float | None = None  # default 0.2 (um), 0.05 (rapl)
    timeout_s: float | None = None  # um: default 1.0
    max_gap_s: float = 1.0  # a hole between samples longer than this marks a window as unmeasured
    idle_s: float = 5.0  # idle baseline before an energy run
    lag_s: float = 0.0  # how late a reading reaches the host
    retry_s: float = 1.0  # between reconnect attempts

    @classmethod
    def from_mapping(cls, table: Mapping[str, Any]) -> PowerConfig:
        """A `[power]` table given as a dict (the tune child's request, callers without a config file)."""
        names = {f.name for f in fields(cls)}
        _check_kind(table.get("meter", "none"), set(table) - names)
        return cls(**{k: v for k, v in table.items() if k in names})

    def given(self) -> set[str]:
        """The keys set, i.e. not left at None (the common keys always are)."""
        return {f.name for f in fields(self) if getattr(self, f.name) is not None}

    def problem(self) -> str | None:
        """What is wrong with this table, naming the key; None when a meter can be built from it."""
        try:
            meter_from_config(self)
        except BadInput as e:
            return str(e)
        return None


def _check_kind(kind: Any, keys: set[str]) -> None:
    if kind not in _KEYS or kind == "common":
        raise BadInput(f"power.meter must be one of none, text, um, rapl; not {kind!r}")
    unknown = keys - _KEYS["common"] - _KEYS[kind]
    if unknown:
        raise BadInput(f"power: unknown key(s) for meter {kind!r}: {', '.join(sorted(unknown))}")


def _num(cfg: PowerConfig, key: str, default: float, *, positive: bool = True) -> float:
    v = getattr(cfg, key)
    v = default if v is None else v
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (positive and v == 0):
        raise BadInput(f"power.{key} must be a {'positive' if positive else 'non-negative'} number, not {v!r}")
    return float(v)


def meter_from_config(cfg: PowerConfig | Mapping[str, Any]) -> PowerMeter | None:
    """Build (not start) the meter a `[power]` table describes; None for `meter = "none"` (the default).
    Raises BadInput naming the offending key."""
    if not isinstance(cfg, PowerConfig):
        cfg = PowerConfig.from_mapping(cfg)
    kind = cfg.meter
    _check_kind(kind, cfg.given())
    if kind == "none":
        return None
    common = {
        "max_gap_s": _num(cfg, "max_gap_s", 1.0),
        "idle_s": _num(cfg, "idle_s", 5.0),
        "lag_s": _num(cfg, "lag_s", 0.0, positive=False),
        "retry_s": _num(cfg, "retry_s", 1.0),
    }
    if kind == "rapl":
        return RaplMeter(str(DEFAULT_ZONE if cfg.zone is None else cfg.zone), poll_s=_num(cfg, "poll_s", 0.05), **common)
    port = cfg.port
    if not isinstance(port, str) or not port:
        raise BadInput(f"power.port is required for meter {kind!r} (e.g. /dev/serial/by-id/...)")
    baud = cfg.baud if cfg.baud is not None else 9600 if kind == "um" else 115200
    if isinstance(baud, bool) or not isinstance(baud, int) or baud <= 0:
        raise BadInput(f"power.baud must be a positive integer, not {baud!r}")
    if kind == "um":
        return UMMeter(port, baud=baud, poll_s=_num(cfg, "poll_s", 0.2), timeout_s=_num(cfg, "timeout_s", 1.0),
                       **common)
    columns = [] if cfg.columns is None else cfg.columns
    if not isinstance(columns, list) or not all(isinstance(c, str) for c in columns):
        raise BadInput(f"power.columns must be a list of column names, not {columns!r}")
    fmt = TextFormat(str("csv" if cfg.format is None else cfg.format), tuple(columns), cfg.power, cfg.voltage, cfg.current)
    return TextMeter(port, fmt, baud=baud, **common)


def _problems(cfg: Any, src: Callable[[str], str]) -> list[Problem]:
    msg = cfg.power.problem()
    return [Problem(src("power.meter"), "power", msg)] if msg else []


SECTIONS = [Section("power", PowerConfig, cross=_problems)]
