"""`edgetune fleet listen`: subscribe to every device's topics and store what arrives in the fleet DB.

- Subscribes `edgetune/v1/+/#` at QoS 1 on a persistent session under a fixed client id
  (`edgetune-fleet-<hostname>`), so the broker queues messages while the listener is down.
- Acknowledges a message (manual PUBACK) only after its transaction committed. When the DB cannot be written
  (disk full, locked), it stops acknowledging, reconnects after a backoff and gets the messages again.
- A malformed payload is logged, noted in the `malformed` table, acknowledged and skipped: it never stops the
  listener.
- Reconnects with exponential backoff and jitter, resubscribes on every connect, speaks MQTT 5 and falls back to
  3.1.1 when the broker refuses 5.

`Listener(...).start()` runs it in a thread (tests); `run()` blocks until `stop()` (the CLI, with signals).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import paho.mqtt.client as mqtt

from edgetune.sqlite import DBError
from fleet.ingest import SUBSCRIPTION, Outcome, ingest
from fleet.mqtt import BrokerOpts, connect_kwargs, hostname, jitter, make_client, unsupported_protocol
from fleet.store import FleetStore

log = logging.getLogger("fleet.listener")

DEFAULT_SESSION_EXPIRY_S = 7 * 24 * 3600  # the broker keeps our queue this long while we are away


def default_client_id() -> str:
    return f"edgetune-fleet-{hostname()}"


class Listener:
    def __init__(self, opts: BrokerOpts, db: Path | str | None = None, *, client_id: str | None = None,
                 session_expiry_s: int = DEFAULT_SESSION_EXPIRY_S, min_backoff_s: float = 0.5,
                 max_backoff_s: float = 60.0, on_outcome: Callable[[Outcome], None] | None = None):
        self.opts = opts
        self.store = FleetStore(db, threads=True)  # used only by the loop's thread once started
        self.client_id = client_id or default_client_id()
        self.session_expiry_s = session_expiry_s
        self.min_backoff_s, self.max_backoff_s = min_backoff_s, max_backoff_s
        self.on_outcome = on_outcome
        self.counts: Counter[str] = Counter()
        self.connected = threading.Event()
        self.subscribed = threading.Event()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._protocol = opts.protocol
        self._retry = False  # a DB write failed: ack nothing more, reconnect, get the unacked messages again
        self._delay = min_backoff_s

    # ---- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> "Listener":
        self._thread = threading.Thread(target=self.run, name="fleet-listener", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("fleet listener thread did not stop within %.0f s", timeout)
                return
            self._thread = None
        self.store.close()

    def request_stop(self) -> None:
        """Safe from a signal handler: the loop notices within its poll interval and disconnects cleanly."""
        self._stop.set()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_for(self, predicate: Callable[[Counter], bool], timeout: float) -> bool:
        """Block until predicate(counts) holds, or timeout. Counts: messages, <kind>, <kind>:<detail> (e.g.
        record:duplicate), retry (DB writes that failed and will come again), subscribes (one per connect)."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.counts), timeout)

    def run(self) -> None:
        log.info("fleet listener %s → %s, client id %s, db %s", self.opts.label, SUBSCRIPTION, self.client_id,
                 self.store.path)
        while not self._stop.is_set():
            client = self._client()
            try:
                client.connect(self.opts.host, self.opts.port, keepalive=self.opts.keepalive,
                               **connect_kwargs(self._opts(), persistent=True, session_expiry_s=self.session_expiry_s))
            except (OSError, ValueError) as e:
                self._backoff(f"cannot reach broker {self.opts.label}: {e}")
                continue
            self._retry = False
            protocol = self._protocol
            while not self._stop.is_set() and not self._retry and protocol == self._protocol:
                rc = client.loop(timeout=0.2)
                if rc != mqtt.MQTT_ERR_SUCCESS:
                    break
            self.connected.clear()
            self.subscribed.clear()
            self._disconnect(client)
            if protocol != self._protocol:
                continue  # fall back to 3.1.1 right away
            if not self._stop.is_set():
                self._backoff("DB write failed; reconnecting to get the unacknowledged messages again" if self._retry
                              else f"lost the broker {self.opts.label}")
        log.info("fleet listener stopped: %s", dict(self.counts))

    def _opts(self) -> BrokerOpts:
        return replace(self.opts, protocol=self._protocol)

    def _client(self) -> mqtt.Client:
        c = make_client(self._opts(), self.client_id, persistent=True, manual_ack=True)
        c.on_connect = self._on_connect
        c.on_subscribe = self._on_subscribe
        c.on_message = self._on_message
        c.on_disconnect = self._on_disconnect
        return c

    def _backoff(self, why: str) -> None:
        d = jitter(self._delay)
        log.warning("%s; retrying in %.1f s", why, d)
        self._delay = min(self._delay * 2, self.max_backoff_s)
        self._stop.wait(d)

    @staticmethod
    def _disconnect(client: mqtt.Client) -> None:
        """A clean DISCONNECT keeps the persistent session (and our queue) on the broker."""
        try:
            if client.is_connected():
                client.disconnect()
                deadline = time.monotonic() + 2
                while client.is_connected() and time.monotonic() < deadline:
                    client.loop(timeout=0.05)
        except Exception as e:  # the socket may already be gone
            log.debug("disconnect: %s", e)

    # ---- paho callbacks (run in the loop's thread) ---------------------------------------------------------

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        if reason_code.is_failure:
            if unsupported_protocol(reason_code) and self._protocol == "5":
                log.warning("broker %s does not speak MQTT 5; falling back to 3.1.1", self.opts.label)
                self._protocol = "3.1.1"
            else:
                log.error("broker %s refused the connection: %s", self.opts.label, reason_code)
            return
        self._delay = self.min_backoff_s
        log.info("connected to %s (MQTT %s, session %s)", self.opts.label, self._protocol,
                 "resumed" if getattr(flags, "session_present", False) else "new")
        self.connected.set()
        client.subscribe(SUBSCRIPTION, qos=1)  # every connect: a lost session lost its subscription too

    def _on_subscribe(self, client: mqtt.Client, userdata: Any, mid: int, reason_codes: Any, properties: Any) -> None:
        bad = [rc for rc in reason_codes if rc.is_failure]
        if bad:
            log.error("broker %s refused the subscription to %s: %s", self.opts.label, SUBSCRIPTION, bad[0])
            return
        log.debug("subscribed to %s", SUBSCRIPTION)
        with self._cond:
            self.counts["subscribes"] += 1  # one per (re)connect
            self._cond.notify_all()
        self.subscribed.set()

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        if not self._stop.is_set():
            log.debug("disconnected from %s: %s", self.opts.label, reason_code)

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        if self._retry:
            return  # not acknowledged: the broker sends it again after the reconnect, in order
        try:
            topic = msg.topic
        except UnicodeDecodeError:
            topic = msg._topic.decode("utf-8", "replace")
        try:
            out = ingest(self.store, topic, msg.payload, bool(msg.retain))
        except DBError as e:
            log.error("fleet DB %s: cannot store %s (%s); not acknowledging it", self.store.path, topic, e)
            self._retry = True
            self._count("retry", None)
            return
        except Exception:  # ingest catches payload errors itself; this is a bug, but never a crash
            log.exception("unexpected error storing %s; skipping it", topic)
            out = Outcome("malformed", None, error="internal error")
        client.ack(msg.mid, msg.qos)
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
