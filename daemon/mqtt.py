"""The broker link: one thread that connects, resubscribes, and drains the outbox in order.

Each connection gets a fresh paho client (CallbackAPIVersion.VERSION2), driven through paho's external-loop API
(socket / loop_read / loop_write / loop_misc) so this thread alone touches it and can also wait on a wake pipe.
The outbox, not paho, owns undelivered messages: a fresh client per connection means paho never replays its own
in-flight queue after a reconnect (which would interleave with new messages); instead the link resends from the
oldest unacknowledged outbox row, so order is kept and a message lost in flight is sent again (QoS 1 is
at-least-once). Rows are deleted on PUBACK (`on_publish` with the mid we mapped to the row id).

MQTT 5 first, with a will delay (the will `lost` is only published if the link stays down that long, which needs
a session expiry at least as long); a broker that refuses protocol 5 gets MQTT 3.1.1 from then on.
"""

from __future__ import annotations

import logging
import os
import random
import select
import ssl
import threading
import time
from typing import Any, Callable

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edgetune.config import MqttConfig
from daemon.outbox import Outbox
from daemon.topics import Topics

log = logging.getLogger(__name__)

WINDOW = 64  # messages in flight; the broker's Receive Maximum lowers it
CONNECT_TIMEOUT_S = 10.0
BACKOFF_MIN_S = 0.5
UNSUPPORTED_PROTOCOL = 0x84  # CONNACK reason (paho maps a 3.1.1 broker's return code 1 to it)


def backoff(failures: int, cap: float) -> float:
    """Exponential backoff with full jitter, so a fleet that lost its broker does not reconnect in lockstep."""
    return random.uniform(BACKOFF_MIN_S, max(BACKOFF_MIN_S, min(cap, BACKOFF_MIN_S * 2 ** failures)))


class Link:
    def __init__(self, cfg: MqttConfig, topics: Topics, outbox: Outbox, *, will: Callable[[], bytes],
                 on_connected: Callable[[], None], on_command: Callable[[bytes], None]):
        self.cfg, self.topics, self.outbox = cfg, topics, outbox
        self._will, self._on_connected, self._on_command = will, on_connected, on_command
        self.protocol = paho.MQTTv5
        self.connected = False
        self.last_error: str | None = None
        self.connects = 0
        self.attempted = threading.Event()  # set after the first connection attempt, whatever its outcome
        self._stop = threading.Event()
        self._drained = threading.Condition()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="mqtt", daemon=True)
        self._reset_flight()

    # ---- public, any thread --------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def wake(self) -> None:
        """New rows in the outbox: send them now instead of at the next poll."""
        try:
            os.write(self._wake_w, b"!")
        except BlockingIOError:  # already woken
            pass

    def flush(self, timeout: float) -> bool:
        """Wait until the broker has acknowledged everything queued, while connected; True when empty."""
        deadline = time.monotonic() + timeout
        with self._drained:
            while self.outbox.depth()[0] and self.connected and time.monotonic() < deadline:
                self._drained.wait(min(0.5, max(0.0, deadline - time.monotonic())))
        return self.outbox.depth()[0] == 0

    def stop(self, timeout: float = 10.0) -> None:
        """Disconnect cleanly (no will) and end the thread."""
        self._stop.set()
        self.wake()
        self._thread.join(timeout)
        # the wake pipe stays open: another thread may still call wake(), and a closed fd number could be reused

    def snapshot(self) -> dict:
        return {"configured": True, "host": self.cfg.host, "port": self.cfg.effective_port,
                "tls": self.cfg.tls.enabled, "connected": self.connected,
                "protocol": "5" if self.protocol == paho.MQTTv5 else "3.1.1", "connects": self.connects,
                "last_error": self.last_error}

    # ---- the link thread -----------------------------------------------------------------------------------

    def _reset_flight(self) -> None:
        self._inflight: dict[int, int] = {}  # mid → outbox row id
        self._acked: list[int] = []
        self._last_sent = 0  # resend from the oldest unacknowledged row
        self._window = WINDOW

    def _client(self) -> paho.Client:
        v5 = self.protocol == paho.MQTTv5
        c = paho.Client(CallbackAPIVersion.VERSION2, client_id=self.topics.device_id, protocol=self.protocol,
                        **({} if v5 else {"clean_session": True}))
        c.max_inflight_messages_set(WINDOW)
        c.connect_timeout = CONNECT_TIMEOUT_S
        will_props = None
        if v5 and self.cfg.will_delay_s:
            will_props = Properties(PacketTypes.WILLMESSAGE)
            will_props.WillDelayInterval = self.cfg.will_delay_s
        c.will_set(self.topics.status, self._will(), qos=1, retain=True, properties=will_props)
        if self.cfg.username is not None:
            c.username_pw_set(self.cfg.username, self.cfg.password)
        if self.cfg.tls.enabled:
            c.tls_set(ca_certs=self.cfg.tls.ca, certfile=self.cfg.tls.cert, keyfile=self.cfg.tls.key)
        c.on_connect, c.on_disconnect = self._connected, self._disconnected
        c.on_message, c.on_publish = self._message, self._published
        return c

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            client = self._client()
            was = self.connects
            try:
                if self.protocol == paho.MQTTv5:
                    props = Properties(PacketTypes.CONNECT)
                    props.SessionExpiryInterval = self.cfg.will_delay_s  # the will waits for the session to end
                    # resume the session: a reconnect within the will delay then cancels the will on every broker
                    # (a clean start ends the session, which some brokers take as the moment to publish it)
                    client.connect(self.cfg.host, self.cfg.effective_port, self.cfg.keepalive, clean_start=False,
                                   properties=props)
                else:
                    client.connect(self.cfg.host, self.cfg.effective_port, self.cfg.keepalive)
                self._serve(client)
            except (OSError, ssl.SSLError, ValueError) as e:
                self._error(f"cannot connect to {self.cfg.host}:{self.cfg.effective_port}: {e}")
            except Exception:  # a bug must cost one connection, not the link thread
                log.exception("mqtt: link failed")
            finally:
                self._lost(client)
            self.attempted.set()
            if self._stop.is_set():
                break
            failures = 0 if self.connects > was else failures + 1
            self._stop.wait(backoff(failures, self.cfg.reconnect_max_s))

    def _serve(self, client: paho.Client) -> None:
        """Run one connection until it drops or we stop."""
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:
            sock = client.socket()
            if sock is None:
                return
            if self._stop.is_set():
                self._disconnect(client)
                return
            if not self.connected and time.monotonic() > deadline:
                self._error("no CONNACK from the broker")
                return
            if self.connected:
                self._pump(client)
            pending = getattr(sock, "pending", lambda: 0)()  # TLS may hold decrypted bytes select cannot see
            r, w, _ = select.select([sock, self._wake_r], [sock] if client.want_write() else [], [],
                                    0 if pending else 1.0)
            if self._wake_r in r:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            if sock in r or pending:
                client.loop_read()
            if w and client.socket() is not None:
                client.loop_write()
            client.loop_misc()
            self._settle()

    def _pump(self, client: paho.Client) -> None:
        room = self._window - len(self._inflight)
        if room <= 0:
            return
        for msg in self.outbox.after(self._last_sent, room):
            info = client.publish(msg.topic, msg.payload, qos=msg.qos, retain=msg.retain)
            if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                return  # the connection is going; the next one resends from the outbox
            self._inflight[info.mid] = msg.id
            self._last_sent = msg.id

    def _settle(self) -> None:
        """Delete acknowledged rows, and tell flush() waiters."""
        if self._acked:
            self.outbox.ack(self._acked)
            self._acked = []
            with self._drained:
                self._drained.notify_all()

    def _disconnect(self, client: paho.Client) -> None:
        """A normal DISCONNECT: the broker drops the will, so status stays what we published (`offline`)."""
        self._settle()
        client.disconnect()
        deadline = time.monotonic() + 2.0
        while client.socket() is not None and client.want_write() and time.monotonic() < deadline:
            client.loop_write()

    def _lost(self, client: paho.Client) -> None:
        """Forget this connection. A socket still open is closed without DISCONNECT: to the broker that is an
        abnormal end, so the will stands, which is right since we did not stop."""
        self._settle()
        sock = client.socket()
        if sock is not None:
            sock.close()
        self.connected = False
        self._reset_flight()
        with self._drained:
            self._drained.notify_all()

    def _error(self, msg: str) -> None:
        if msg != self.last_error:
            log.warning("mqtt: %s", msg)
        self.last_error = msg


    # ---- paho callbacks (called from loop_read/loop_misc, in this thread) ---------------------------------

    def _connected(self, client: paho.Client, _ud: Any, _flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            if reason.value == UNSUPPORTED_PROTOCOL and self.protocol == paho.MQTTv5:
                log.info("mqtt: the broker refused MQTT 5; falling back to MQTT 3.1.1")
                self.protocol = paho.MQTTv311  # kept for this run; the next attempt comes after a short backoff
            else:
                self._error(f"broker refused the connection: {reason}")
            return
        self.connected = True
        self.connects += 1
        self.last_error = None
        self._window = min(WINDOW, getattr(props, "ReceiveMaximum", WINDOW))
        log.info("mqtt: connected to %s:%s (MQTT %s)", self.cfg.host, self.cfg.effective_port,
                 "5" if self.protocol == paho.MQTTv5 else "3.1.1")
        client.subscribe(self.topics.cmd_req, qos=1)  # every connect: a clean session has no subscriptions
        self.attempted.set()
        self._on_connected()

    def _disconnected(self, _c: paho.Client, _ud: Any, _flags: Any, reason: Any, _props: Any) -> None:
        if self.connected and not self._stop.is_set():
            self._error(f"connection lost: {reason}")
        self.connected = False

    def _message(self, _c: paho.Client, _ud: Any, msg: paho.MQTTMessage) -> None:
        if msg.topic == self.topics.cmd_req:
            try:
                self._on_command(msg.payload)
            except Exception:  # a command must never take the link down
                log.exception("mqtt: command handler failed")

    def _published(self, _c: paho.Client, _ud: Any, mid: int, reason: Any, _props: Any) -> None:
        row = self._inflight.pop(mid, None)
        if row is None:
            return
        if reason.is_failure:  # e.g. not authorized: retrying would block the queue forever
            log.error("mqtt: broker refused outbox message %d (%s); dropping it", row, reason)
        self._acked.append(row)
