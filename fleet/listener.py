"""`edgetune fleet listen`: subscribe to every device's topics and store what arrives in the fleet DB.

- Subscribes `edgetune/v1/+/#` at QoS 1 on a persistent session under a fixed client id
  (`edgetune-fleet-<hostname>`), so the broker queues messages while the listener is down. With a share group
  it subscribes `$share/<group>/edgetune/v1/+/#` instead (MQTT 5 shared subscription): the broker hands each
  message to one of the receivers in the group, which then write to one PostgreSQL (each needs its own client id).
- Acknowledges a message (manual PUBACK) only after its transaction committed. When the DB cannot be written
  (disk full, locked, damaged pages: any DBError, which is never a payload's fault), it stops acknowledging,
  raises the alarm (`alarm` holds the error, `counts["retry"]` counts the failures, the log says it once per
  outage), reconnects after a backoff of at most DB_BACKOFF_MAX_S and gets the messages again; the first message
  stored afterwards clears the alarm.
- A malformed payload is logged, noted in the `malformed` table, acknowledged and skipped: it never stops the
  listener.
- End-to-end delivery: after committing a tuning record or a final command response it publishes the protocol
  `ack` to the device, which keeps those in its outbox until then. Every receiver that committed a message acks it
  itself, so N receivers on one shared subscription need no coordination, and a duplicate (already stored) is
  acked again, since the device resends when an ack was lost.
- Commands whose expires_at passed with no final answer are marked `expired` (checked every EXPIRE_EVERY_S).
- The shared broker client (edgetune.broker) reconnects with backoff and jitter capped at RECONNECT_MAX_S (the
  broker's queue for us fills while we are away), resubscribes on every connect, speaks MQTT 5 and falls back to
  3.1.1 when the broker refuses 5.

`Listener(...).start()` runs it in the client's thread (tests); `run()` blocks until `request_stop()` (the CLI,
with signals).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable

from edgetune.broker import BrokerSettings, Client, Connection, Handler, Message, backoff
from edgetune.protocol import Topics, encode
from edgetune.sqlite import DBError
from edgetune.protocol import topic_filter
from fleet.ingest import SUBSCRIPTION, Outcome, ingest
from fleet.mqtt import hostname
from fleet.store import open_fleet_store

log = logging.getLogger("fleet.listener")

DEFAULT_SESSION_EXPIRY_S = 7 * 24 * 3600  # the broker keeps our queue this long while we are away
RECONNECT_MAX_S = 5.0  # reconnect backoff cap: every second away is queued at the broker, up to its limit
DB_BACKOFF_MAX_S = 5.0  # a DB that fails is retried at least this often
EXPIRE_EVERY_S = 10.0


def default_client_id() -> str:
    return f"edgetune-fleet-{hostname()}"


class Listener(Handler):
    def __init__(self, settings: BrokerSettings, db: Path | str | None = None, *, client_id: str | None = None,
                 session_expiry_s: int = DEFAULT_SESSION_EXPIRY_S, on_outcome: Callable[[Outcome], None] | None = None,
                 share: str | None = None):
        self.settings = dataclasses.replace(settings, reconnect_max_s=min(settings.reconnect_max_s, RECONNECT_MAX_S))
        self.store = open_fleet_store(db, threads=True)  # used only by the client's thread once started
        self.client_id = client_id or default_client_id()
        self.subscription = topic_filter(share=share) if share else SUBSCRIPTION
        self.client = Client(self.settings, self.client_id, self, subscriptions=(self.subscription,),
                             session_expiry_s=session_expiry_s, manual_ack=True, name="fleet-listener")
        self.alarm: str | None = None  # the fleet DB's error while it cannot store; None when it works
        self._db_failures = 0
        self._expired_at = 0.0
        self.on_outcome = on_outcome
        self.counts: Counter[str] = Counter()
        self.connected = threading.Event()
        self.subscribed = threading.Event()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._retry = False  # a DB write failed: ack nothing more, reconnect, get the unacked messages again

    # ---- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> "Listener":
        log.info("fleet listener %s → %s, client id %s, db %s", self.settings.label, self.subscription,
                 self.client_id, self.store.path)
        self.client.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.client.stop(timeout)
        if self.client.alive():
            log.warning("fleet listener thread did not stop within %.0f s", timeout)
            return
        self.store.close()

    def request_stop(self) -> None:
        """Safe from a signal handler: `run` notices within its poll interval and disconnects cleanly."""
        self._stop.set()

    @property
    def alive(self) -> bool:
        return self.client.alive()

    def wait_for(self, predicate: Callable[[Counter], bool], timeout: float) -> bool:
        """Block until predicate(counts) holds, or timeout. Counts: messages, <kind>, <kind>:<detail> (e.g.
        record:duplicate), retry (DB writes that failed and will come again), acks (sent to devices), expired,
        subscribes (one per connect)."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.counts), timeout)

    def run(self) -> None:
        """Until `request_stop` (the CLI, with signals); the store stays open for the caller's summary."""
        self.start()
        while not self._stop.wait(0.2):
            pass
        self.client.stop()
        log.info("fleet listener stopped: %s", dict(self.counts))

    # ---- the broker client's callbacks (its thread) --------------------------------------------------------

    def on_connect(self, conn: Connection, session_present: bool) -> None:
        self._retry = False
        self.connected.set()

    def on_subscribe(self, conn: Connection, error: str | None) -> None:
        if error:
            return  # the client logged it
        log.debug("subscribed to %s", self.subscription)
        with self._cond:
            self.counts["subscribes"] += 1  # one per (re)connect
            self._cond.notify_all()
        self.subscribed.set()

    def on_disconnect(self) -> None:
        self.connected.clear()
        self.subscribed.clear()

    def on_tick(self, conn: Connection) -> None:
        now = time.monotonic()
        if self._retry or now - self._expired_at < EXPIRE_EVERY_S:
            return
        self._expired_at = now
        try:
            n = self.store.expire_commands(time.time())
        except DBError as e:
            self._db_failed(e, "expiring commands")
            return
        if n:
            log.info("%d command(s) expired unanswered", n)
            self._count("expired", None, n, messages=False)

    def on_message(self, conn: Connection, msg: Message) -> None:
        if self._retry:
            return  # not acknowledged: the broker sends it again after the reconnect, in order
        try:
            out = ingest(self.store, msg.topic, msg.payload, msg.retain)
        except DBError as e:
            self._db_failed(e, f"storing {msg.topic}")
            return
        except Exception:  # ingest catches payload errors itself; this is a bug, but never a crash
            log.exception("unexpected error storing %s; skipping it", msg.topic)
            out = Outcome("malformed", None, error="internal error")
        if self.alarm is not None:
            log.warning("fleet DB %s works again after %d failed attempt(s); storing and acknowledging",
                        self.store.path, self._db_failures)
            self.alarm, self._db_failures = None, 0
        if out.ack and out.device:
            # before the PUBACK: if we die in between, the device's resend gets a duplicate, which is acked again
            if conn.publish(Topics(out.device).ack, encode({"keys": [out.ack], "ts": time.time()})) is not None:
                self._count("acks", None, messages=False)
        conn.ack(msg)
        self._count(out.kind, out.detail)
        if self.on_outcome is not None:
            try:
                self.on_outcome(out)
            except Exception:
                log.exception("on_outcome callback failed")

    def _db_failed(self, e: DBError, doing: str) -> None:
        """Stop acknowledging, alarm, and reconnect after a backoff: the broker sends the unacknowledged again."""
        self._db_failures += 1
        if self.alarm is None:
            log.error("ALARM fleet DB %s failed %s (%s); acknowledging nothing until it works again, retrying "
                      "every few seconds", self.store.path, doing, e)
        self.alarm = str(e)
        self._retry = True
        self._count("retry", None, messages=False)
        self.client.drop(backoff(self._db_failures, self.settings.reconnect_min_s, DB_BACKOFF_MAX_S))

    def _count(self, kind: str, detail: str | None, n: int = 1, *, messages: bool = True) -> None:
        with self._cond:
            if messages:
                self.counts["messages"] += 1
            self.counts[kind] += n
            if detail:
                self.counts[f"{kind}:{detail}"] += 1
            self._cond.notify_all()
