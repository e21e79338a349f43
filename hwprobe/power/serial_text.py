"""Line-oriented text meters: the INA219/INA226 Arduino sketches people actually wire up.

Two styles cover the common sketches:
- csv: one reading per line, fixed columns (`5.01,0.12,120.3,603.0`; commas, semicolons, tabs or spaces), with
  the unit in each column name's suffix (`bus_V`, `current_mA`, `power_mW`), since the stream carries none;
- kv: `Key: value unit` pairs (`Bus Voltage:   5.01 V`, `Current: 120.3 mA`), one or several per line separated
  by `,` `;` or tab, the unit next to the value. A reading is complete once its keys have all been seen.
Power is either a named column/key, or voltage × current.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import serial

from hwprobe.power.base import ThreadedMeter
from edgetune.errors import BadInput

# SI scale and dimension of each unit spelling we accept (lower-case, µ folded to u).
UNITS: dict[str, tuple[float, str]] = {
    "v": (1.0, "v"), "mv": (1e-3, "v"), "uv": (1e-6, "v"),
    "a": (1.0, "a"), "ma": (1e-3, "a"), "ua": (1e-6, "a"),
    "w": (1.0, "w"), "mw": (1e-3, "w"), "uw": (1e-6, "w"),
}
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_PAIR = re.compile(rf"^\s*([A-Za-z][\w .()/-]*?)\s*[:=]\s*({_NUMBER})\s*([A-Za-zµ]*)\s*$")
_CSV_SPLIT = re.compile(r"[,;\s]+")
MAX_LINE = 4096  # a "line" longer than this is noise (wrong baud rarely produces newlines)


def _unit(spelling: str) -> tuple[float, str] | None:
    return UNITS.get(spelling.lower().replace("µ", "u"))


@dataclass(frozen=True)
class TextFormat:
    """How to find watts in a line stream. Exactly one of `power` or (`voltage`, `current`) is set."""

    style: str  # "csv" | "kv"
    columns: tuple[str, ...] = ()
    power: str | None = None
    voltage: str | None = None
    current: str | None = None

    def __post_init__(self) -> None:
        if self.style not in ("csv", "kv"):
            raise BadInput(f"power.format must be 'csv' or 'kv', not {self.style!r}")
        if bool(self.power) == bool(self.voltage and self.current) or bool(self.voltage) != bool(self.current):
            raise BadInput("set either `power`, or both `voltage` and `current`")
        if self.style == "csv":
            for key, dim in self.wanted():
                if key not in self.columns:
                    raise BadInput(f"power: {key!r} is not one of columns {list(self.columns)}")
                unit = _unit(key.rsplit("_", 1)[-1]) if "_" in key else None
                if unit is None or unit[1] != dim:
                    want = {"w": "_W/_mW/_uW", "v": "_V/_mV", "a": "_A/_mA/_uA"}[dim]
                    raise BadInput(f"power: column {key!r} needs a unit suffix ({want})")

    def wanted(self) -> list[tuple[str, str]]:
        """(key, dimension) pairs a reading needs."""
        return [(self.power, "w")] if self.power else [(self.voltage, "v"), (self.current, "a")]


class LineParser:
    """Turns lines into watts, or None for a line that is not (the end of) a reading. `bad` is set when the
    line was noise rather than a header or an unrelated key."""

    def __init__(self, fmt: TextFormat) -> None:
        self.fmt = fmt
        self._wanted = {k.lower(): dim for k, dim in fmt.wanted()}
        self._record: dict[str, float] = {}
        self.bad = False

    def feed(self, line: str) -> float | None:
        self.bad = False
        line = line.strip()
        if not line:
            return None
        values = self._csv(line) if self.fmt.style == "csv" else self._kv(line)
        if values is None:
            self.bad = True
            return None
        self._record.update(values)
        if not self._wanted.keys() <= self._record.keys():
            return None
        r, self._record = self._record, {}
        if self.fmt.power:
            return r[self.fmt.power.lower()]
        return r[self.fmt.voltage.lower()] * r[self.fmt.current.lower()]

    def _csv(self, line: str) -> dict[str, float] | None:
        cells = _CSV_SPLIT.split(line)
        if cells == list(self.fmt.columns):  # the sketch's header line
            return {}
        if len(cells) != len(self.fmt.columns):
            return None
        out = {}
        for name, cell in zip(self.fmt.columns, cells):
            if name.lower() in self._wanted:
                try:
                    out[name.lower()] = float(cell) * _unit(name.rsplit("_", 1)[-1])[0]
                except ValueError:
                    return None
        return out

    def _kv(self, line: str) -> dict[str, float] | None:
        out = {}
        for part in re.split(r"[,;\t]", line):
            m = _PAIR.match(part)
            if not m:
                return None
            key, dim = m.group(1).lower(), self._wanted.get(m.group(1).lower())
            if dim is None:
                continue  # a quantity we do not need (shunt voltage, ...)
            unit = _unit(m.group(3)) if m.group(3) else (1.0, dim)
            if unit is None or unit[1] != dim:
                return None
            out[key] = float(m.group(2)) * unit[0]
        return out


class TextMeter(ThreadedMeter):
    """A serial port printing readings as text lines; each line is stamped with its arrival time."""

    name = "text"
    no_data_hint = "wrong baud rate, format or columns?"

    def __init__(self, port: str, fmt: TextFormat, *, baud: int = 115200, **kw) -> None:
        super().__init__(port, **kw)
        self.port, self.baud, self.fmt = port, baud, fmt

    def _connect(self) -> serial.Serial:
        return serial.Serial(self.port, self.baud, timeout=0.2)

    def _close(self, ser: serial.Serial) -> None:
        ser.close()

    def _session(self, ser: serial.Serial) -> None:
        parser = LineParser(self.fmt)
        buf = b""
        while not self._stop.is_set():
            chunk = ser.read(ser.in_waiting or 1)  # raises SerialException (an OSError) on unplug
            if not chunk:
                continue
            now = time.monotonic()
            *lines, buf = (buf + chunk).split(b"\n")
            if len(buf) > MAX_LINE:
                self._bad_frame(f"{len(buf)} bytes without a newline")
                buf = b""
            for raw in lines:
                text = raw.decode("ascii", "replace")
                watts = parser.feed(text)
                if watts is not None:
                    self._add(now, watts)
                elif parser.bad:
                    self._bad_frame(f"unparsable line {text.strip()[:40]!r}")
