"""The fleet server's rollout controller: a thread that, every INTERVAL_S, counts the devices of each open rollout
that never reported as timed out and applies fleet.rollout.decide to it (abort, advance, complete) and publishes what follows, retained, on each device's `model/release`:
the release to every device of a released phase that has not been sent it, and after an abort the pre-signed
rollback to every device that was.

What was sent is written to the fleet DB after the broker acknowledged it (PUBACK), so a crash in between sends
it again, which a device ignores (the same release). Operators' pause/resume/abort only change the DB; this loop
acts on them at its next turn. Several servers on one PostgreSQL may each run one: every state change is a
compare-and-set, and a second publish of the same retained message changes nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

from edgetune.broker import BrokerError, BrokerSettings, Client, Handler
from edgetune.sqlite import DBError
from fleet import rollout_store as rs
from fleet.mqtt import hostname
from fleet.rollout import Decision, decide, release_message, release_topic
from fleet.store import FleetStore, open_fleet_store

log = logging.getLogger("fleet.rollouts")

INTERVAL_S = 1.0
PUBLISH_TIMEOUT_S = 10.0
REMIND_S = 60.0  # while the fleet DB stays down, the log says so again at most this often


class DownLog:
    """The log of a dependency that fails on every turn of a loop: one error when it goes away, a reminder at most
    every `remind_s` while it stays away, one line when it is back. Once per failed turn (every second) buried the
    rest of the log during a PostgreSQL outage."""

    def __init__(self, what: str, remind_s: float = REMIND_S, clock: Callable[[], float] = time.monotonic):
        self.what, self.remind_s, self.clock = what, remind_s, clock
        self.failures = 0
        self._since = self._logged = 0.0

    def failed(self, e: Exception) -> None:
        now = self.clock()
        self.failures += 1
        if self.failures == 1:
            self._since = self._logged = now
            log.error("rollouts stopped: %s failed (%s); retrying, and saying so again every %.0f s while it fails",
                      self.what, e, self.remind_s)
        elif now - self._logged >= self.remind_s:
            self._logged = now
            log.error("rollouts still stopped: %s has failed for %.0f s (%d turns): %s", self.what,
                      now - self._since, self.failures, e)

    def ok(self) -> None:
        if self.failures:
            log.warning("rollouts resumed: %s works again after %.0f s (%d failed turns)", self.what,
                        self.clock() - self._since, self.failures)
            self.failures = 0


class RolloutController(Handler):
    def __init__(self, settings: BrokerSettings, db: Path | str | None, interval_s: float = INTERVAL_S):
        self.store: FleetStore = open_fleet_store(db, threads=True)
        self.interval_s = interval_s
        self.client = Client(settings, f"edgetune-fleet-rollouts-{hostname()}-{os.getpid()}", self,
                             name="fleet-rollouts-mqtt")
        self.db_down = DownLog(f"the fleet DB {self.store.path}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-rollouts", daemon=True)

    def start(self) -> "RolloutController":
        self.client.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.client.stop()
        self.store.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self.client.ready.is_set():
                continue
            try:
                self.turn(time.time())
            except DBError as e:
                self.db_down.failed(e)
            except BrokerError as e:
                log.warning("rollouts: %s; trying again in %.0f s", e, self.interval_s)
            except Exception:
                log.exception("rollouts: unexpected error; trying again")
            else:
                self.db_down.ok()

    def turn(self, now: float) -> None:
        for r in rs.rollouts(self.store, ("active", "paused")):
            timed_out = rs.time_out(self.store, r, now)
            if timed_out:
                log.warning("rollout %s: no report from %s within %.0f s: counted as timed out", r["id"],
                            ", ".join(timed_out), r["report_timeout_s"])
            targets = rs.targets(self.store, r["id"])
            d = decide(r, targets, now)
            if d is not None:
                self._apply(r, d, now)
        for r in rs.rollouts(self.store, ("active",)) + rs.pending_rollbacks(self.store):
            self._publish(r)

    def _apply(self, r: dict, d: Decision, now: float) -> None:
        if d.action == "abort":
            if rs.set_state(self.store, r["id"], ("active", "paused"), "aborted", now, "abort rule", d.detail):
                log.warning("rollout %s aborted: %s; publishing the signed rollback to v%d", r["id"], d.detail,
                            r["rollback_version"])
        elif d.action == "advance":
            if rs.advance(self.store, r["id"], r["phase"], now, d.detail):
                log.info("rollout %s: %s", r["id"], d.detail)
        elif rs.set_state(self.store, r["id"], ("active",), "completed", now, None, d.detail):
            log.info("rollout %s completed: %s", r["id"], d.detail)

    def _publish(self, r: dict) -> None:
        """Send what is due to each target (the release, or after an abort the rollback)."""
        rollback = r["state"] == "aborted"
        if r["state"] not in ("active", "aborted"):
            return
        for t in rs.targets(self.store, r["id"]):
            due = (t["sent_at"] is not None and t["rollback_sent_at"] is None) if rollback else \
                (t["phase"] <= r["phase"] and t["sent_at"] is None)
            if not due:
                continue
            self.client.publish_wait(release_topic(t["device_id"]), release_message(r, rollback, t["attempt"]),
                                     PUBLISH_TIMEOUT_S, retain=True)
            rs.mark_sent(self.store, r["id"], t["device_id"], time.time(), rollback=rollback)
            log.info("rollout %s: sent %s v%d to %s", r["id"], "the rollback to" if rollback else "release",
                     r["rollback_version"] if rollback else r["version"], t["device_id"])
