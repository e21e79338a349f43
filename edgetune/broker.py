"""The one MQTT broker client of the daemon and the fleet: settings, TLS and auth, and a connection kept up by one
thread (paho-mqtt 2.x, callback API v2).

Loop style: each `Client` owns one thread that drives paho's external-loop API (socket / loop_read /
loop_write / loop_misc) and also waits on a wake pipe, so that thread alone touches paho and every callback runs
in it. Other threads hand work over with `wake()` (the handler's `on_tick` runs soon), `call_soon()` (a function
of the live connection) or `publish_wait()`.
Each connection attempt gets a fresh paho client: paho then never replays its own in-flight queue after a
reconnect, so a user that keeps its own queue (the daemon's outbox) decides alone what is resent, and in which
order.

On every connect the client subscribes its filters again (a new session has none; with `retained_on_resume=False`
an MQTT 5 broker sends the retained messages only when the subscription is new, not to a resumed session that
has had them: mosquitto sends them to shared subscriptions too, so a fleet receiver that reconnects would
otherwise get every device's retained state again), speaks MQTT 5 first and falls
back to 3.1.1 for as long as it runs when the broker refuses protocol 5. Reconnects back off exponentially with
full jitter up to a cap, so a fleet that lost its broker does not come back in lockstep. Messages are dispatched
to one handler by topic, never by paho's per-filter callbacks (they do not match `$share/...` filters): parse
the topic with `edgetune.protocol.parse_topic`.

Flow control for a receiver that acknowledges by hand (after storing): `receive_maximum` tells an MQTT 5 broker how
many QoS 1 messages it may have unacknowledged with us (a broker otherwise applies its own limit, mosquitto's
max_inflight_messages, 20 by default: a receiver that acks after a commit would store 20-message batches, one per
round trip), and a handler whose queue is full says so with `accepting()`: the client then stops reading the
socket until it is woken.

paho is imported only when a client runs, so CLI verbs that merely register their flags pay nothing for it.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import select
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from edgetune.errors import BadInput, EdgetuneError
from edgetune.protocol import QOS

if TYPE_CHECKING:
    import paho.mqtt.client as paho

log = logging.getLogger("edgetune.broker")

PROTOCOLS = ("5", "3.1.1")
MAX_INFLIGHT = 64  # QoS 1 messages in flight per connection; the broker's Receive Maximum lowers it
CONNECT_TIMEOUT_S = 10.0  # TCP/TLS connect, and then the wait for CONNACK
UNSUPPORTED_PROTOCOL = 0x84  # CONNACK reason; paho maps a 3.1.1 broker's return code 1 to it


class BrokerError(EdgetuneError):
    """The broker cannot be reached, refused us, or did not acknowledge in time; the message says which."""


@dataclass
class TlsSettings:
    """TLS is on when `enabled`, or when a CA or a client certificate is given; no CA means the system store."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    enabled: bool = False

    def __post_init__(self) -> None:
        self.enabled = bool(self.enabled or self.ca or self.cert)

    def context(self) -> ssl.SSLContext:
        """The client context (certificate and host name checked); BadInput naming the file that is unusable."""
        try:
            ctx = ssl.create_default_context(cafile=self.ca)
        except (OSError, ssl.SSLError) as e:
            raise BadInput(f"TLS: cannot use CA file {self.ca}: {e}; give a PEM CA certificate") from None
        if self.cert:
            try:
                ctx.load_cert_chain(self.cert, self.key)
            except (OSError, ssl.SSLError) as e:
                raise BadInput(f"TLS: cannot use client certificate {self.cert} with key {self.key}: {e}; "
                               "give a PEM certificate and its matching key") from None
        return ctx


@dataclass
class BrokerSettings:
    """Where and how to connect. The daemon's [mqtt] config section is this dataclass; the fleet CLI's broker
    flags produce one (fleet/mqtt.py)."""

    host: str | None = None  # None: no broker (the daemon then tunes and keeps its results locally)
    port: int | None = None  # None: 8883 with TLS, else 1883
    tls: TlsSettings = field(default_factory=TlsSettings)
    username: str | None = None
    password: str | None = None
    protocol: str = "5"  # the first protocol tried: "5" or "3.1.1"
    keepalive: int = 60
    will_delay_s: int = 30  # MQTT 5: a blip shorter than this does not publish the will
    # a device's session (its queued commands) outlives an absence this long; longer than any command lifetime
    # the fleet gives (fleet.commands.MAX_TTL_S)
    session_expiry_s: int = 86400
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 60.0  # backoff cap

    @property
    def effective_port(self) -> int:
        return self.port or (8883 if self.tls.enabled else 1883)

    @property
    def label(self) -> str:
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        return f"{'mqtts' if self.tls.enabled else 'mqtt'}://{host}:{self.effective_port}"


# A connection that lasts this long resets the reconnect backoff. One the broker closes sooner (another client
# connected with our client id, as two devices cloned from one image do; a ban) counts as a failed attempt, so
# the two clients back off instead of taking the id from each other twice a second.
STABLE_CONNECTION_S = 10.0


def backoff(failures: int, low: float, cap: float) -> float:
    """Exponential backoff with full jitter: uniform between `low` and low·2^failures, at most `cap`."""
    return random.uniform(low, max(low, min(cap, low * 2 ** failures)))


@dataclass(frozen=True)
class Will:
    """The message the broker publishes when we vanish (MQTT 5: only after the settings' will delay)."""

    topic: str
    payload: bytes
    retain: bool = True


@dataclass(frozen=True)
class Message:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    mid: int


class Connection:
    """The live connection, handed to the handler's callbacks; use it only inside them (the client's thread)."""

    def __init__(self, client: paho.Client, receive_maximum: int):
        self._c = client
        self.window = min(MAX_INFLIGHT, receive_maximum)  # how many QoS 1 messages may be unacknowledged

    def publish(self, topic: str, payload: bytes, *, qos: int = QOS, retain: bool = False) -> int | None:
        """The message id, whose PUBACK reaches `Handler.on_publish`; None when the connection is going."""
        from paho.mqtt.enums import MQTTErrorCode

        info = self._c.publish(topic, payload, qos=qos, retain=retain)
        return info.mid if info.rc == MQTTErrorCode.MQTT_ERR_SUCCESS else None

    def ack(self, msg: Message) -> None:
        """With `manual_ack`: acknowledge a received message (after it is safely stored)."""
        self._c.ack(msg.mid, msg.qos)


class Handler:
    """What a Client reports, always in the client's thread. Override what you need; none may block long."""

    def on_connect(self, conn: Connection, session_present: bool) -> None:
        """After CONNACK; the subscriptions are on their way."""

    def on_subscribe(self, conn: Connection, error: str | None) -> None:
        """After SUBACK of every filter (error: the broker refused one)."""

    def on_message(self, conn: Connection, msg: Message) -> None:
        """A message on any subscribed filter; dispatch on `msg.topic`."""

    def on_publish(self, mid: int, error: str | None) -> None:
        """PUBACK of `Connection.publish`'s message `mid` (error: the broker refused it)."""

    def on_tick(self, conn: Connection) -> None:
        """Every turn of the loop while connected: after I/O, after `wake()`, and at least once a second."""

    def accepting(self) -> bool:
        """False while the handler cannot take more messages: the client stops reading the socket (the broker keeps
        the rest) until it is woken and this is True again."""
        return True

    def on_disconnect(self) -> None:
        """The connection (or an attempt) ended; everything not acknowledged is in doubt."""


class Client:
    """Keeps one connection to the broker up until `stop()`.

    `session_expiry_s` > 0 asks for a persistent session: the broker keeps our subscriptions and queues QoS 1
    messages for us while we are away (MQTT 5 for that long; MQTT 3.1.1 has no expiry, so clean_session=False).
    MQTT 5 always resumes (clean_start=False), so a reconnect within the will delay cancels the will on every
    broker (a clean start ends the session, which some brokers take as the moment to publish it); the session is
    kept at least as long as the will delay, since the will waits for the session to end.
    """

    def __init__(self, settings: BrokerSettings, client_id: str, handler: Handler, *,
                 subscriptions: Sequence[str] = (), session_expiry_s: int = 0,
                 will: Callable[[], Will] | None = None, manual_ack: bool = False, receive_maximum: int | None = None,
                 retained_on_resume: bool = True, retired: Sequence[str] = (), name: str = "mqtt"):
        if not settings.host:
            raise BadInput("no broker host configured")
        self.settings, self.client_id, self.handler = settings, client_id, handler
        self.subscriptions = tuple(subscriptions)
        self.retired = tuple(retired)  # filters an older version may have left in a resumed session
        self.session_expiry_s, self._will, self._manual_ack = session_expiry_s, will, manual_ack
        self.receive_maximum, self.retained_on_resume = receive_maximum, retained_on_resume
        self.protocol = settings.protocol
        self.connected = False
        self.connects = 0
        self.last_error: str | None = None
        self.attempted = threading.Event()  # set after the first connection attempt, whatever its outcome
        self.ready = threading.Event()  # connected and subscribed, until the connection drops
        self._changed = threading.Condition()
        self._failed_attempts = 0
        self._stop = threading.Event()
        self._drop = False
        self._hold = 0.0
        self._fell_back = False
        self._answered = False
        self._up_since = 0.0  # time.monotonic() of the last CONNACK
        self._conn: Connection | None = None
        self._calls: queue.SimpleQueue[Callable[[Connection], None]] = queue.SimpleQueue()
        self._waiters: dict[int, Callable[[str | None], None]] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # ---- public, any thread --------------------------------------------------------------------------------

    def start(self) -> "Client":
        self._thread.start()
        return self

    def alive(self) -> bool:
        return self._thread.is_alive()

    def wake(self) -> None:
        """Run the handler's on_tick now rather than at the next poll (e.g. new messages are queued)."""
        try:
            os.write(self._wake_w, b"!")
        except BlockingIOError:  # already woken
            pass

    def call_soon(self, fn: Callable[[Connection], None]) -> None:
        """Run fn(conn) in the client's thread on the live connection: soon, or after the next connect (fn may
        compare `conn` with the connection it expects, e.g. to acknowledge only on the one a message came on)."""
        self._calls.put(fn)
        self.wake()

    def drop(self, hold_s: float = 0.0) -> None:
        """End this connection cleanly and reconnect after a backoff, at least `hold_s` (a persistent session is
        kept, so the broker sends what we did not acknowledge again)."""
        self._hold = hold_s
        self._drop = True
        self.wake()

    def stop(self, timeout: float = 10.0) -> None:
        """Disconnect cleanly (the broker drops the will) and end the thread."""
        self._stop.set()
        self.wake()
        if self._thread.is_alive():
            self._thread.join(timeout)
        # the wake pipe stays open: another thread may still call wake(), and a closed fd number could be reused

    def wait_ready(self, timeout: float) -> None:
        """Until connected and subscribed; BrokerError as soon as an attempt fails, or at the timeout."""
        with self._changed:
            self._changed.wait_for(lambda: self.ready.is_set() or self._failed_attempts or self._stop.is_set(),
                                   timeout)
        if not self.ready.is_set():
            raise BrokerError(self.last_error or f"broker {self.settings.label} did not answer within {timeout:.0f} s")

    def publish_wait(self, topic: str, payload: bytes, timeout: float, *, retain: bool = False) -> None:
        """Publish at QoS 1 and wait for the broker's PUBACK; BrokerError when it does not come in `timeout`."""
        done = threading.Event()
        outcome: list[str | None] = []

        def settle(error: str | None) -> None:
            outcome.append(error)
            done.set()

        def send(conn: Connection) -> None:
            mid = conn.publish(topic, payload, qos=QOS, retain=retain)
            if mid is None:
                settle("the connection dropped")
            else:
                self._waiters[mid] = settle

        self.call_soon(send)
        if not done.wait(timeout):
            raise BrokerError(f"broker {self.settings.label} did not acknowledge the message within {timeout:.0f} s")
        if outcome[0]:
            raise BrokerError(f"broker {self.settings.label} did not take the message: {outcome[0]}")

    # ---- the client thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            was = self.connects
            self._attempt()
            if self._fell_back and not self._stop.is_set():
                self._fell_back = False
                continue  # the same attempt again, in MQTT 3.1.1, at once
            with self._changed:
                if self.connects == was:
                    self._failed_attempts += 1
                self._changed.notify_all()
            self.attempted.set()
            if self._stop.is_set():
                break
            stable = self.connects > was and (self._drop or self._lived() >= STABLE_CONNECTION_S)
            failures = 0 if stable else failures + 1
            hold, self._hold = self._hold, 0.0
            self._stop.wait(max(hold, backoff(failures, self.settings.reconnect_min_s, self.settings.reconnect_max_s)))

    def _attempt(self) -> None:
        s = self.settings
        client = None
        self._drop = False
        try:
            client = self._paho()
            if self.protocol == "5":
                client.connect(s.host, s.effective_port, s.keepalive, clean_start=False,
                               properties=self._connect_properties())
            else:
                client.connect(s.host, s.effective_port, s.keepalive)
            self._serve(client)
        except BadInput as e:
            self._error(str(e))
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
            self._error(f"cannot reach broker {s.label}: {e}")
        except Exception:  # a bug must cost one connection, not the client thread
            log.exception("mqtt: connection to %s failed", s.label)
        finally:
            self._lost(client)

    def _paho(self) -> paho.Client:
        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion

        v5 = self.protocol == "5"
        c = paho.Client(CallbackAPIVersion.VERSION2, client_id=self.client_id,
                        protocol=paho.MQTTv5 if v5 else paho.MQTTv311,
                        clean_session=None if v5 else self.session_expiry_s <= 0, manual_ack=self._manual_ack)
        c.max_inflight_messages_set(MAX_INFLIGHT)
        c.connect_timeout = CONNECT_TIMEOUT_S
        if self._will is not None:
            will = self._will()
            c.will_set(will.topic, will.payload, qos=QOS, retain=will.retain, properties=self._will_properties())
        if self.settings.username is not None:
            c.username_pw_set(self.settings.username, self.settings.password)
        if self.settings.tls.enabled:
            c.tls_set_context(self.settings.tls.context())
        c.on_connect, c.on_disconnect, c.on_subscribe = self._connected, self._disconnected, self._subscribed
        c.on_message, c.on_publish = self._message, self._published
        return c

    def _will_properties(self) -> Any:
        if self.protocol != "5" or not self.settings.will_delay_s:
            return None
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        props = Properties(PacketTypes.WILLMESSAGE)
        props.WillDelayInterval = self.settings.will_delay_s
        return props

    def _connect_properties(self) -> Any:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        props = Properties(PacketTypes.CONNECT)
        delay = self.settings.will_delay_s if self._will is not None else 0
        props.SessionExpiryInterval = max(self.session_expiry_s, delay)
        if self.receive_maximum:
            props.ReceiveMaximum = self.receive_maximum
        return props

    def _serve(self, client: paho.Client) -> None:
        """Run one connection until it drops, we are told to drop it, or we stop."""
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        self._answered = False  # a CONNACK came on this connection (a refusal too: its reason is the error)
        while not self._fell_back:
            sock = client.socket()
            if sock is None:
                if not self.connected and not self._answered:
                    self._error(self._closed_before_connack())
                return
            if self._stop.is_set() or self._drop:
                if self._conn is not None:
                    self._run_calls(self._conn)  # e.g. acknowledgements of what was stored meanwhile
                self._disconnect(client)
                return
            if not self.connected and time.monotonic() > deadline:
                self._error(f"no CONNACK from broker {self.settings.label} within {CONNECT_TIMEOUT_S:.0f} s")
                return
            pending = getattr(sock, "pending", lambda: 0)()  # TLS may hold decrypted bytes select cannot see
            reading = [sock] if self.handler.accepting() else []
            r, w, _ = select.select([*reading, self._wake_r], [sock] if client.want_write() else [], [],
                                    0 if pending and reading else 1.0)
            if self._wake_r in r:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            if sock in r or (pending and reading):
                client.loop_read()
            if w and client.socket() is not None:
                client.loop_write()
            client.loop_misc()
            if self.connected and self._conn is not None:
                self._tick(self._conn)

    def _closed_before_connack(self) -> str:
        s = self.settings
        hint = ("; a TLS listener does that to a plaintext client: if the port speaks TLS, set [mqtt] tls "
                "(or `--tls`)") if not s.tls.enabled else "; check the broker's log for why"
        return f"broker {s.label} closed the connection before answering (no CONNACK){hint}"

    def _tick(self, conn: Connection) -> None:
        self._run_calls(conn)
        self.handler.on_tick(conn)

    def _run_calls(self, conn: Connection) -> None:
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                return
            call(conn)

    def _disconnect(self, client: paho.Client) -> None:
        """A normal DISCONNECT: the broker drops the will and keeps a persistent session."""
        client.disconnect()
        deadline = time.monotonic() + 2.0
        while client.socket() is not None and client.want_write() and time.monotonic() < deadline:
            client.loop_write()

    def _lost(self, client: paho.Client | None) -> None:
        """Forget this connection. A socket still open is closed without DISCONNECT: to the broker that is an
        abnormal end, so the will stands, which is right since we did not stop."""
        sock = client.socket() if client is not None else None
        if sock is not None:
            sock.close()
        self.connected = False
        self.ready.clear()
        self._conn = None
        waiters, self._waiters = self._waiters, {}
        for settle in waiters.values():
            settle("the connection dropped before the broker acknowledged it")
        try:
            self.handler.on_disconnect()
        except Exception:
            log.exception("mqtt: disconnect handler failed")

    def _error(self, msg: str) -> None:
        if msg != self.last_error:
            log.warning("mqtt: %s", msg)
        self.last_error = msg

    # ---- paho callbacks (called from loop_read / loop_misc, in this thread) -------------------------------

    def _connected(self, client: paho.Client, _ud: Any, flags: Any, reason: Any, props: Any) -> None:
        self._answered = True
        if reason.is_failure:
            if reason.value == UNSUPPORTED_PROTOCOL and self.protocol == "5":
                log.info("mqtt: broker %s refused MQTT 5; falling back to MQTT 3.1.1", self.settings.label)
                self.protocol = "3.1.1"  # kept for this client's life
                self._fell_back = True
            else:
                self._error(f"broker {self.settings.label} refused the connection: {reason}")
            return
        self.connected = True
        self.connects += 1
        self._up_since = time.monotonic()
        self.last_error = None
        self._conn = Connection(client, getattr(props, "ReceiveMaximum", MAX_INFLIGHT))
        session = bool(getattr(flags, "session_present", False))
        log.info("mqtt: connected to %s (MQTT %s, session %s)", self.settings.label, self.protocol,
                 "resumed" if session else "new")
        if session and self.retired:  # before the SUBACK that makes us ready: the broker handles them in order
            client.unsubscribe(list(self.retired))
        if self.subscriptions:  # every connect: a new session has no subscriptions
            client.subscribe([(f, self._subscribe_options()) for f in self.subscriptions])
        else:
            self._set_ready()
        self.attempted.set()
        self.handler.on_connect(self._conn, session)

    def _subscribe_options(self) -> Any:
        if self.protocol != "5" or self.retained_on_resume:
            return QOS
        from paho.mqtt.subscribeoptions import SubscribeOptions

        return SubscribeOptions(qos=QOS, retainHandling=SubscribeOptions.RETAIN_SEND_IF_NEW_SUB)

    def _subscribed(self, _c: paho.Client, _ud: Any, _mid: int, reasons: Any, _props: Any) -> None:
        bad = [r for r in reasons if r.is_failure]
        error = f"broker {self.settings.label} refused the subscription: {bad[0]}" if bad else None
        if error:
            self._error(error)
            with self._changed:
                self._failed_attempts += 1
                self._changed.notify_all()
        else:
            self._set_ready()
        if self._conn is not None:
            self.handler.on_subscribe(self._conn, error)

    def _set_ready(self) -> None:
        with self._changed:
            self.ready.set()
            self._changed.notify_all()

    def _disconnected(self, _c: paho.Client, _ud: Any, _flags: Any, reason: Any, _props: Any) -> None:
        if self.connected and not self._stop.is_set() and not self._drop:
            lived = self._lived()
            hint = (f" {lived:.1f} s after connecting; if this repeats, another client may be connecting with "
                    f"client id {self.client_id!r} (two devices with one device_id?)" if lived < STABLE_CONNECTION_S
                    else "")
            self._error(f"lost the connection to {self.settings.label}: {reason}{hint}")
        self.connected = False

    def _lived(self) -> float:
        """Seconds since the last connection was acknowledged."""
        return time.monotonic() - self._up_since

    def _message(self, _c: paho.Client, _ud: Any, m: paho.MQTTMessage) -> None:
        try:
            topic = m.topic
        except UnicodeDecodeError:
            topic = m._topic.decode("utf-8", "replace")
        msg = Message(topic, bytes(m.payload), m.qos, bool(m.retain), m.mid)
        try:
            if self._conn is not None:
                self.handler.on_message(self._conn, msg)
        except Exception:  # a handler bug must never take the connection down
            log.exception("mqtt: message handler failed on %s", topic[:200])

    def _published(self, _c: paho.Client, _ud: Any, mid: int, reason: Any, _props: Any) -> None:
        error = str(reason) if reason.is_failure else None
        waiter = self._waiters.pop(mid, None)
        if waiter is not None:
            waiter(error)
        else:
            self.handler.on_publish(mid, error)
