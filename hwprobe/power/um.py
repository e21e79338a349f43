"""RDTech UM24C / UM25C / UM34C USB meters (Bluetooth SPP or USB serial, 9600 baud).

The host sends 0xF0; the meter answers with one 130-byte big-endian frame:

    offset  size  field
    0       2     model id: 0x0963 UM24C, 0x09C9 UM25C, 0x0D4C UM34C
    2       2     voltage, 0.01 V (UM25C: 0.001 V)
    4       2     current, 0.001 A (UM25C: 0.0001 A)
    6       4     power, 0.001 W
    10      2     temperature, °C
    ...           data groups, D+/D-, charging mode, recording, settings
    128     2     0xFFF1 end marker (UM24C, UM25C); UM34C instead ends with an XOR checksum byte

A frame is accepted only with a known model id and a valid end marker/checksum, so a wrong baud rate or a
different device yields no samples rather than wrong ones. Layout as documented by sigrok's rdtech-um driver
and rdumtool.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from functools import reduce

import serial

from hwprobe.power.base import ThreadedMeter

FRAME = 130
REQUEST = b"\xf0"
# model id -> (name, volts per count, amps per count)
MODELS: dict[int, tuple[str, float, float]] = {
    0x0963: ("UM24C", 0.01, 0.001),
    0x09C9: ("UM25C", 0.001, 0.0001),
    0x0D4C: ("UM34C", 0.01, 0.001),
}
_UM34C_CHECKSUM_POSITIONS = (1, 3, 7, 9, 15, 17, 19, 23, 31, 39, 41, 45, 49, 53, 55, 57, 59, 63, 67, 69, 73,
                             79, 83, 89, 97, 99, 109, 111, 113, 119, 121, 127)


def um34c_checksum(frame: bytes) -> int:
    """The UM34C's trailer byte: XOR of a fixed set of frame bytes."""
    return reduce(lambda a, i: a ^ frame[i], _UM34C_CHECKSUM_POSITIONS, 0)


@dataclass(frozen=True)
class UMReading:
    model: str
    volts: float
    amps: float
    watts: float  # the meter's own power field (1 mW resolution)


def parse_frame(frame: bytes) -> UMReading | None:
    """Decode one 130-byte frame, or None when it is not a valid UM frame."""
    if len(frame) != FRAME:
        return None
    model_id, v_raw, a_raw, w_raw = struct.unpack_from(">HHHI", frame)
    if model_id not in MODELS:
        return None
    name, v_scale, a_scale = MODELS[model_id]
    valid = frame[-1] == um34c_checksum(frame) if name == "UM34C" else frame[-2:] == b"\xff\xf1"
    return UMReading(name, v_raw * v_scale, a_raw * a_scale, w_raw * 0.001) if valid else None


def find_frame(buf: bytes) -> UMReading | None:
    """The first valid frame anywhere in `buf`: resynchronises after stray or partial bytes."""
    for i in range(len(buf) - FRAME + 1):
        if int.from_bytes(buf[i:i + 2], "big") in MODELS and (r := parse_frame(buf[i:i + FRAME])):
            return r
    return None


class UMMeter(ThreadedMeter):
    """Polls a UM meter every `poll_s`. A sample is stamped with the request time: the meter answers with
    its reading at that moment, and the 130 bytes then take ~135 ms to cross a 9600 baud link."""

    name = "um"
    no_data_hint = "wrong baud rate (UM meters use 9600) or not a UM meter?"

    def __init__(self, port: str, *, baud: int = 9600, poll_s: float = 0.2, timeout_s: float = 1.0,
                 **kw) -> None:
        super().__init__(port, **kw)
        self.port, self.baud, self.poll_s, self.timeout_s = port, baud, poll_s, timeout_s

    def _connect(self) -> serial.Serial:
        return serial.Serial(self.port, self.baud, timeout=0.1)

    def _close(self, ser: serial.Serial) -> None:
        ser.close()

    def _session(self, ser: serial.Serial) -> None:
        while not self._stop.is_set():
            ser.reset_input_buffer()  # a late answer to the previous request would misalign this one
            t = time.monotonic()
            ser.write(REQUEST)
            buf = b""
            while len(buf) < FRAME and time.monotonic() < t + self.timeout_s and not self._stop.is_set():
                buf += ser.read(FRAME - len(buf))  # raises SerialException (an OSError) on unplug
            reading = find_frame(buf)
            if reading:
                self._add(t, reading.watts)
            else:
                self._bad_frame(f"{len(buf)} bytes, no valid UM frame" if buf else "no answer to 0xF0")
            self._stop.wait(max(0.0, self.poll_s - (time.monotonic() - t)))
