"""`edgetune fleet listen`: subscribe to every device's topics and store what arrives in the fleet DB.

- Subscribes `edgetune/v1/+/#` at QoS 1 on a persistent session under a fixed client id
  (`edgetune-fleet-<hostname>`), so the broker queues messages while the listener is down. With a share group
  it subscribes `$share/<group>/edgetune/v1/+/#` instead (MQTT 5 shared subscription): the broker hands each
  message to one of the receivers in the group, which then write to one PostgreSQL (each needs its own client id).
- Acknowledges a message (manual PUBACK) only after its transaction committed. When the DB cannot be written
  (disk full, locked), it stops acknowledging, reconnects after a backoff and gets the messages again.
- A malformed payload is logged, noted in the `malformed` table, acknowledged and skipped: it never stops the
  listener.
- The shared broker client (edgetune.broker) reconnects with backoff and jitter, resubscribes on every connect,
  speaks MQTT 5 and falls back to 3.1.1 when the broker refuses 5.

`Listener(...).start()` runs it in the client's thread (tests); `run()` blocks until `request_stop()` (the CLI,
with signals).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from pathlib import Path
from typing import Callable

from edgetune.broker import BrokerSettings, Client, Connection, Handler, Message
from edgetune.sqlite import DBError
from edgetune.protocol import topic_filter
from fleet.ingest import SUBSCRIPTION, Outcome, ingest
from fleet.mqtt import hostname
from fleet.store import open_fleet_store

log = logging.getLogger("fleet.listener")

DEFAULT_SESSION_EXPIRY_S = 7 * 24 * 3600  # the broker keeps our queue this long while we are away


def default_client_id() -> str:
    return f"edgetune-fleet-{hostname()}"


class Listener(Handler):
    def __init__(self, settings: BrokerSettings, db: Path | str | None = None, *, client_id: str | None = None,
                 session_expiry_s: int = DEFAULT_SESSION_EXPIRY_S, on_outcome: Callable[[Outcome], None] | None = None,
                 share: str | None = None):
        self.settings = settings
        self.store = open_fleet_store(db, threads=True)  # used only by the client's thread once started
        self.client_id = client_id or default_client_id()
        self.subscription = topic_filter(share=share) if share else SUBSCRIPTION
        self.client = Client(settings, self.client_id, self, subscriptions=(self.subscription,),
                             session_expiry_s=session_expiry_s, manual_ack=True, name="fleet-listener")
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
        record:duplicate), retry (DB writes that failed and will come again), subscribes (one per connect)."""
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

    def on_message(self, conn: Connection, msg: Message) -> None:
        if self._retry:
            return  # not acknowledged: the broker sends it again after the reconnect, in order
        try:
            out = ingest(self.store, msg.topic, msg.payload, msg.retain)
        except DBError as e:
            log.error("fleet DB %s: cannot store %s (%s); not acknowledging it, reconnecting to get it again",
                      self.store.path, msg.topic, e)
            self._retry = True
            self._count("retry", None)
            self.client.drop()
            return
        except Exception:  # ingest catches payload errors itself; this is a bug, but never a crash
            log.exception("unexpected error storing %s; skipping it", msg.topic)
            out = Outcome("malformed", None, error="internal error")
        conn.ack(msg)
        self._count(out.kind, out.detail)
        if self.on_outcome is not None:
            try:
                self.on_outcome(out)
            except Exception:
                log.exception("on_outcome callback failed")

    def _count(self, kind: str, detail: str | None) -> None:
        with self._cond:
            self.counts["messages"] += 1
            self.counts[kind] += 1
            if detail:
                self.counts[f"{kind}:{detail}"] += 1
            self._cond.notify_all()
