"""The fleet server's rollout controller: a thread that, every INTERVAL_S, counts the devices of each open rollout
that never reported as timed out and applies fleet.rollout.decide to it (abort, advance, complete) and publishes
what follows, retained, on each device's `model/release`: the release to every device of a released phase that has
not been sent it, and after an abort the pre-signed rollback to every device that was.

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

from edgetune.broker import BrokerError, BrokerSettings, Client, Handler
from edgetune.sqlite import DBError
from fleet import rollout_store as rs
from fleet.downlog import DownLog
from fleet.mqtt import hostname
from fleet.rollout import Decision, decide, release_message, release_topic
from fleet.store import FleetStore, open_fleet_store

log = logging.getLogger("fleet.rollouts")

INTERVAL_S = 1.0
PUBLISH_TIMEOUT_S = 10.0


class RolloutController(Handler):
    def __init__(self, settings: BrokerSettings, db: Path | str | None, interval_s: float = INTERVAL_S):
        self.store: FleetStore = open_fleet_store(db, threads=True)
        self.interval_s = interval_s
        self.client = Client(settings, f"edgetune-fleet-rollouts-{hostname()}-{os.getpid()}", self,
                             name="fleet-rollouts-mqtt")
        self.db_down = DownLog(f"the fleet DB {self.store.path}", "rollouts", log)
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
