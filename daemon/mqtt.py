"""The daemon's broker link: the shared broker client (edgetune.broker), draining the outbox in order.

The outbox, not paho, owns undelivered messages. The client starts every connection with a fresh paho client, so
paho never replays its own in-flight queue; instead the link resends from the oldest unacknowledged outbox row,
so order is kept and a message lost in flight is sent again (QoS 1 is at-least-once). Rows are deleted only on
PUBACK, and no more are in flight than the broker's Receive Maximum allows. Rows that wait for the fleet's `ack`
(tuning records, final command responses) are deleted by that ack, and when it does not come within the
outbox's resend interval the link sends them again from the oldest.

The session outlives the will delay (`[mqtt] session_expiry_s`), so commands sent while the device is away wait
at the broker for as long as the fleet's commands live.

The will (`lost`, retained) waits for the settings' will delay under MQTT 5, so a short blip does not flip the
device's status.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from daemon.outbox import Outbox
from edgetune.broker import BrokerSettings, Client, Connection, Handler, Message, Will
from edgetune.protocol import ACK, ProtocolError, Topics, decode
from edgetune.sqlite import DBError

log = logging.getLogger(__name__)

RESEND_CHECK_S = 5.0  # how often the link looks for rows whose fleet ack is overdue


class Link(Handler):
    def __init__(self, cfg: BrokerSettings, topics: Topics, outbox: Outbox, *, will: Callable[[], bytes],
                 on_connected: Callable[[], None], on_command: Callable[[bytes], None],
                 on_release: Callable[[bytes], None] | None = None,
                 on_chunk: Callable[[bytes], None] | None = None):
        self.cfg, self.topics, self.outbox = cfg, topics, outbox
        self._on_connected, self._on_command, self._on_release = on_connected, on_command, on_release
        self._on_chunk = on_chunk
        subs = (topics.cmd_req, topics.ack) + ((topics.model_release,) if on_release else ()) + \
            ((topics.model_chunk,) if on_chunk else ())
        self.client = Client(cfg, topics.device_id, self, subscriptions=subs,
                             session_expiry_s=cfg.session_expiry_s, will=lambda: Will(topics.status, will()))
        self._resend_checked = 0.0
        self._drained = threading.Condition()
        self._reset_flight()

    # ---- public, any thread --------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self.client.connected

    @property
    def attempted(self) -> threading.Event:
        return self.client.attempted

    def start(self) -> None:
        self.client.start()

    def alive(self) -> bool:
        return self.client.alive()

    def wake(self) -> None:
        """New rows in the outbox: send them now instead of at the next poll."""
        self.client.wake()

    def send_now(self, topic: str, payload: bytes) -> None:
        """Publish once, outside the outbox: on this connection, or the next one if there is none now."""
        self.client.call_soon(lambda conn: conn.publish(topic, payload))

    def flush(self, timeout: float) -> bool:
        """Wait until the broker has acknowledged everything queued, while connected; True when empty."""
        deadline = time.monotonic() + timeout
        with self._drained:
            while self.outbox.unsent() and self.connected and time.monotonic() < deadline:
                self._drained.wait(min(0.5, max(0.0, deadline - time.monotonic())))
        return self.outbox.unsent() == 0

    def stop(self, timeout: float = 10.0) -> None:
        """Disconnect cleanly (no will) and end the thread."""
        self.client.stop(timeout)

    def snapshot(self) -> dict:
        c = self.client
        return {"configured": True, "host": self.cfg.host, "port": self.cfg.effective_port,
                "tls": self.cfg.tls.enabled, "connected": c.connected, "subscribed": c.ready.is_set(),
                "protocol": c.protocol, "connects": c.connects, "last_error": c.last_error}

    # ---- the client's callbacks (its thread) ---------------------------------------------------------------

    def _reset_flight(self) -> None:
        self._inflight: dict[int, int] = {}  # mid → outbox row id
        self._acked: list[int] = []
        self._last_sent = 0  # resend from the oldest unacknowledged row
        self._window = 0

    def on_connect(self, conn: Connection, session_present: bool) -> None:
        self._window = conn.window
        self._on_connected()

    def on_tick(self, conn: Connection) -> None:
        self._settle()
        now = time.monotonic()
        if not self._inflight and now - self._resend_checked >= RESEND_CHECK_S:
            self._resend_checked = now
            if self.outbox.resend_due():
                self._last_sent = 0  # nothing in flight: start over from the oldest row the fleet did not ack
        room = self._window - len(self._inflight)
        if room <= 0:
            return
        for msg in self.outbox.after(self._last_sent, room):
            mid = conn.publish(msg.topic, msg.payload, qos=msg.qos, retain=msg.retain)
            if mid is None:
                return  # the connection is going; the next one resends from the outbox
            self._inflight[mid] = msg.id
            self._last_sent = msg.id

    def on_publish(self, mid: int, error: str | None) -> None:
        row = self._inflight.pop(mid, None)
        if row is None:
            return
        if error:  # e.g. not authorized: retrying would block the queue forever
            log.error("mqtt: broker refused outbox message %d (%s); dropping it", row, error)
        self._acked.append(row)  # deleted in the next tick, one transaction for a whole batch

    def on_message(self, conn: Connection, msg: Message) -> None:
        if msg.topic == self.topics.cmd_req:
            self._on_command(msg.payload)
        elif msg.topic == self.topics.ack:
            self._fleet_ack(msg.payload)
        elif msg.topic == self.topics.model_release and self._on_release:
            self._on_release(msg.payload)  # daemon.model_update checks it, in its own thread
        elif msg.topic == self.topics.model_chunk and self._on_chunk:
            self._on_chunk(msg.payload)

    def _fleet_ack(self, payload: bytes) -> None:
        try:
            keys = decode(payload, ACK.sub).get("keys")
        except ProtocolError as e:
            log.warning("mqtt: ignoring an ack: %s", e)
            return
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            log.warning("mqtt: ignoring an ack whose keys are not a list of strings")
            return
        if self.outbox.confirm(keys):
            with self._drained:
                self._drained.notify_all()

    def on_disconnect(self) -> None:
        self._settle()
        self._reset_flight()
        with self._drained:
            self._drained.notify_all()

    def _settle(self) -> None:
        """Delete acknowledged rows, and tell flush() waiters. On a full disk they stay for the next tick (the
        daemon pauses and says why); a row deleted late is at worst sent again."""
        if self._acked:
            try:
                self.outbox.ack(self._acked)
            except DBError as e:
                log.warning("mqtt: cannot mark %d acknowledged row(s) yet: %s", len(self._acked), e)
                return
            self._acked = []
            with self._drained:
                self._drained.notify_all()
