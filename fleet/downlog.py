"""The log of a dependency (the fleet DB) that fails on every turn of a loop, shared by the loops that use it: the
rollout controller and the listener's writer."""

from __future__ import annotations

import logging
import time
from typing import Callable

REMIND_S = 60.0  # while the dependency stays down, the log says so again at most this often


class DownLog:
    """One error when the dependency goes away, a reminder at most every `remind_s` while it stays away, one line
    when it is back. Once per failed turn (every second) buried the rest of the log during a PostgreSQL outage, and
    once per outage only left an operator who came later no sign that it still lasted, nor that it ended.

    `stops` names what stops meanwhile ("rollouts"); `alarm` prefixes the failure lines (the listener's `ALARM`,
    which operators grep for)."""

    def __init__(self, what: str, stops: str, logger: logging.Logger, *, alarm: str = "", remind_s: float = REMIND_S,
                 clock: Callable[[], float] = time.monotonic):
        self.what, self.stops, self.log, self.alarm = what, stops, logger, alarm
        self.remind_s, self.clock = remind_s, clock
        self.failures = 0
        self._since = self._logged = 0.0

    def failed(self, e: Exception | str) -> None:
        now = self.clock()
        self.failures += 1
        if self.failures == 1:
            self._since = self._logged = now
            self.log.error("%s%s stopped: %s failed (%s); retrying, and saying so again every %.0f s while it fails",
                           self.alarm, self.stops, self.what, e, self.remind_s)
        elif now - self._logged >= self.remind_s:
            self._logged = now
            self.log.error("%s%s still stopped: %s has failed for %.0f s (%d turns): %s", self.alarm, self.stops,
                           self.what, now - self._since, self.failures, e)

    def ok(self) -> None:
        if self.failures:
            self.log.warning("%s resumed: %s works again after %.0f s (%d failed turns)", self.stops, self.what,
                             self.clock() - self._since, self.failures)
            self.failures = 0
