"""Telemetry retention: a receiver deletes telemetry older than `retention_days`, once at start and then every
PRUNE_EVERY_S, so a fleet DB's biggest table stays bounded by time instead of growing for ever.

It runs in a thread of its own with its own store connection, never in the listener's message loop: a prune of
a large backlog must not delay acknowledgements. Several receivers on one PostgreSQL may all prune; the deletes
are idempotent and batched (FleetStore.prune_telemetry), so they only share the work. PostgreSQL keeps telemetry
in one table with an index on the receive time (schema v2) and deletes by it: at 1 Hz per device and days of
retention that is far from the sizes where time partitions pay for their extra DDL.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from edgetune.sqlite import DBError
from fleet.store import open_fleet_store

log = logging.getLogger("fleet.retention")

PRUNE_EVERY_S = 3600.0


class Pruner:
    def __init__(self, db: Path | str | None, retention_days: float, every_s: float = PRUNE_EVERY_S):
        self.db, self.retention_s, self.every_s = db, retention_days * 86400.0, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-prune", daemon=True)
        self.pruned = 0

    def start(self) -> "Pruner":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def prune_once(self) -> int:
        """One pass; a DB that cannot be reached now is logged and tried again at the next pass."""
        try:
            with open_fleet_store(self.db, threads=True) as store:
                n = store.prune_telemetry(time.time() - self.retention_s)
        except DBError as e:
            log.warning("telemetry retention: %s; trying again in %.0f s", e, self.every_s)
            return 0
        if n:
            log.info("telemetry retention: deleted %d samples older than %g days", n, self.retention_s / 86400)
        self.pruned += n
        return n

    def _run(self) -> None:
        while True:
            self.prune_once()
            if self._stop.wait(self.every_s):
                return
