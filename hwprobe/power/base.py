"""One interface over every power source: a background reader that keeps timestamped watts and survives faults.

A meter is read on its own thread so a benchmark never waits on a serial port, and a fault (unplug, garbage,
wrong baud, missing port) becomes a status the tuner can log, never an exception in the tuning loop. The reader
reconnects forever with a fixed back-off: USB meters come back under the same /dev/serial/by-id path.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

log = logging.getLogger(__name__)


class Sample(NamedTuple):
    """A power reading. `t` is host `time.monotonic()` (CLOCK_MONOTONIC, so comparable with a worker
    process's clock), shifted back by the meter's configured lag."""

    t: float
    watts: float


@dataclass(frozen=True)
class MeterStatus:
    """What the reader is doing, for logs, `info` and the reason a run fell back to latency.

    state: "stopped" (not started), "connecting" (opening or waiting for first data), "ok" (valid samples
    within max_gap_s), "no_data" (open, but nothing valid: wrong baud, wrong protocol, silent device) or
    "disconnected" (cannot open / lost; retrying). `detail` says why in words.
    """

    state: str
    detail: str
    samples: int
    bad_frames: int
    reconnects: int
    last_sample_age_s: float | None


class PowerMeter(Protocol):
    """What the tuner relies on. All times are `time.monotonic()` seconds."""

    name: str
    max_gap_s: float  # a longer hole between samples means the window is not trustworthy
    idle_s: float  # configured length of the idle baseline measurement

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def samples_between(self, t0: float, t1: float) -> list[Sample]: ...

    def wait_until(self, t: float, timeout: float) -> bool:
        """Block until a sample at or after `t` exists (True) or `timeout` passes (False)."""
        ...

    @property
    def connected(self) -> bool: ...

    @property
    def status(self) -> MeterStatus: ...


class ThreadedMeter:
    """Sample store, status and the connect → session → reconnect loop. Subclasses supply `_connect` (open the
    device, raising OSError with a readable message), `_session` (read until stopped, raising OSError when the
    device goes away) and `_close`, and report through `_add` and `_bad_frame`."""

    name = "meter"
    no_data_hint = "wrong baud rate or protocol?"

    def __init__(self, source: str, *, max_gap_s: float, idle_s: float = 5.0, lag_s: float = 0.0,
                 retry_s: float = 1.0, history_s: float = 900.0) -> None:
        self.source = source
        self.max_gap_s = max_gap_s
        self.idle_s = idle_s
        self.lag_s = lag_s
        self.retry_s = retry_s
        self.history_s = history_s
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._times: list[float] = []
        self._watts: list[float] = []
        self._open = False
        self._opened_at = 0.0
        self._ever_opened = False
        self._tried = False  # a connect attempt finished: "disconnected" rather than "connecting"
        self._detail = "not started"
        self._samples = self._bad = self._bad_since_ok = self._reconnects = 0
        self._last_bad = ""

    # --- subclass hooks --------------------------------------------------------------------------------------

    def _connect(self) -> Any:
        raise NotImplementedError

    def _session(self, handle: Any) -> None:
        raise NotImplementedError

    def _close(self, handle: Any) -> None:
        raise NotImplementedError

    # --- reporting from the reader thread --------------------------------------------------------------------

    def _add(self, t: float, watts: float) -> None:
        with self._cond:
            self._times.append(t - self.lag_s)
            self._watts.append(watts)
            self._samples += 1
            self._bad_since_ok = 0
            if self._times[0] < t - 1.5 * self.history_s:  # prune in batches, not per sample
                cut = bisect.bisect_left(self._times, t - self.history_s)
                del self._times[:cut], self._watts[:cut]
            self._cond.notify_all()

    def _bad_frame(self, why: str) -> None:
        with self._cond:
            self._bad += 1
            self._bad_since_ok += 1
            self._last_bad = why

    def _set_open(self, is_open: bool, detail: str) -> None:
        with self._cond:
            if is_open and self._ever_opened:
                self._reconnects += 1
            was_open, first = self._open, not self._tried
            self._open, self._detail, self._tried = is_open, detail, True
            if is_open:
                self._ever_opened, self._opened_at, self._bad_since_ok = True, time.monotonic(), 0
            self._cond.notify_all()
        if is_open:
            log.info("power meter %s: %s", self.name, detail)
        elif was_open or first:
            log.warning("power meter %s: %s (retrying every %g s)", self.name, detail, self.retry_s)

    # --- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread and self._thread.is_alive():
            return
        self._stop.clear()
        self._detail, self._tried = f"opening {self.source}", False
        self._thread = threading.Thread(target=self._loop, name=f"power-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        self._thread = None
        with self._cond:
            self._open = False
            self._detail = "stopped"
            self._cond.notify_all()

    def _loop(self) -> None:
        failing = False  # log a persistent open failure once, not every retry
        while not self._stop.is_set():
            try:
                handle = self._connect()
            except OSError as e:
                if not failing:
                    self._set_open(False, f"cannot open {self.source}: {e}")
                failing = True
                self._stop.wait(self.retry_s)
                continue
            failing = False
            self._set_open(True, f"reading {self.source}")
            try:
                self._session(handle)
            except OSError as e:
                self._set_open(False, f"lost {self.source}: {e}")
            except Exception as e:  # a parser bug must not kill the reader; say so loudly
                log.exception("power meter %s: reader failed", self.name)
                self._set_open(False, f"reader error: {e!r}")
            finally:
                self._close(handle)
            self._stop.wait(self.retry_s)

    # --- queries ---------------------------------------------------------------------------------------------

    def samples_between(self, t0: float, t1: float) -> list[Sample]:
        with self._cond:
            lo = bisect.bisect_left(self._times, t0)
            hi = bisect.bisect_right(self._times, t1)
            return [Sample(t, w) for t, w in zip(self._times[lo:hi], self._watts[lo:hi])]

    def wait_until(self, t: float, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._times) and self._times[-1] >= t, max(0.0, timeout))

    @property
    def connected(self) -> bool:
        """True while valid samples are arriving; `status` says why not."""
        return self.status.state == "ok"

    @property
    def status(self) -> MeterStatus:
        now = time.monotonic()
        with self._cond:
            last = self._times[-1] + self.lag_s if self._times else None  # arrival time of the newest sample
            age = None if last is None else now - last
            if self._thread is None:
                state, detail = "stopped", self._detail
            elif not self._open:
                state, detail = ("disconnected" if self._tried else "connecting"), self._detail
            elif age is not None and age <= self.max_gap_s:
                state, detail = "ok", self._detail
            elif now - self._opened_at <= self.max_gap_s:
                state, detail = "connecting", f"{self._detail}, waiting for data"
            elif self._bad_since_ok:
                silent = now - max(self._opened_at, last or 0.0)
                state = "no_data"
                detail = (f"{self._bad_since_ok} invalid frames and no valid one for {silent:.1f} s "
                          f"(last: {self._last_bad}): {self.no_data_hint}")
            else:
                state, detail = "no_data", f"{self.source} is open but silent"
            return MeterStatus(state, detail, self._samples, self._bad, self._reconnects,
                               None if age is None else round(age, 3))
