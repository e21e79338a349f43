"""edgetune.broker against a real mosquitto: connect, publish and receive, resubscribe after a broker restart,
persistent sessions with manual acks, shared subscriptions, TLS, and the MQTT 3.1.1 fallback (against the fake
broker of tests/broker.py, since mosquitto speaks both)."""

from __future__ import annotations

import subprocess
import threading
import uuid

import pytest

from edgetune.broker import BrokerError, BrokerSettings, Client, Connection, Handler, Message, TlsSettings, backoff
from edgetune.errors import BadInput
from edgetune.protocol import Topics, parse_topic, topic_filter
from tests.broker import Mosquitto, Mqtt311OnlyBroker, make_certs

T = 15.0


class Recorder(Handler):
    """Keeps what the client reports; tests wait on its condition, never sleep."""

    def __init__(self, ack: bool = True, cond: threading.Condition | None = None):
        self.messages: list[Message] = []
        self.subscribes = 0
        self.ack = ack
        self.cond = cond or threading.Condition()

    def on_subscribe(self, conn: Connection, error: str | None) -> None:
        with self.cond:
            self.subscribes += error is None
            self.cond.notify_all()

    def on_message(self, conn: Connection, msg: Message) -> None:
        if self.ack:
            conn.ack(msg)
        with self.cond:
            self.messages.append(msg)
            self.cond.notify_all()

    def wait(self, pred, what: str) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: pred(self), T), f"timed out waiting for {what}: {self.messages}"


def settings(broker, **kw) -> BrokerSettings:
    return BrokerSettings(host=broker.host, port=broker.port, reconnect_min_s=0.05, reconnect_max_s=0.5, **kw)


def client(broker_settings: BrokerSettings, handler: Handler, **kw) -> Client:
    return Client(broker_settings, f"t-{uuid.uuid4().hex[:10]}", handler, **kw).start()


def test_publish_wait_reaches_a_subscriber(mosquitto):
    sub_h, pub_h = Recorder(), Recorder()
    topics = Topics("dev-1")
    sub = client(settings(mosquitto), sub_h, subscriptions=(topic_filter("telemetry"),))
    pub = client(settings(mosquitto), pub_h)
    try:
        sub.wait_ready(T)
        pub.wait_ready(T)
        assert sub.protocol == "5" and sub.connects == 1
        pub.publish_wait(topics.telemetry, b'{"seq": 1}', T)
        sub_h.wait(lambda h: h.messages, "the message")
        m = sub_h.messages[0]
        assert (m.topic, m.payload, m.qos, m.retain) == (topics.telemetry, b'{"seq": 1}', 1, False)
        assert parse_topic(m.topic).device_id == "dev-1"
    finally:
        sub.stop()
        pub.stop()


def test_resubscribes_after_a_broker_restart(mosquitto):
    h = Recorder()
    sub = client(settings(mosquitto), h, subscriptions=(topic_filter("status"),))
    try:
        sub.wait_ready(T)
        mosquitto.stop()
        mosquitto.start()  # same port, and a clean session: only a new SUBSCRIBE brings messages again
        h.wait(lambda r: r.subscribes >= 2, "the second subscription")
        pub = client(settings(mosquitto), Recorder())
        pub.wait_ready(T)
        pub.publish_wait(Topics("dev-2").status, b'{"state": "online"}', T)
        pub.stop()
        h.wait(lambda r: r.messages, "a message after the restart")
        assert sub.connects == 2
    finally:
        sub.stop()


def test_a_persistent_session_redelivers_what_was_not_acknowledged(mosquitto):
    """Manual acks: a message the handler did not ack comes again after a reconnect, as a receiver that could not
    store it needs."""
    h = Recorder(ack=False)
    cid = f"persist-{uuid.uuid4().hex[:8]}"
    sub = Client(settings(mosquitto), cid, h, subscriptions=(topic_filter("tuning/record"),), session_expiry_s=60,
                 manual_ack=True).start()
    pub = client(settings(mosquitto), Recorder())
    try:
        sub.wait_ready(T)
        pub.wait_ready(T)
        pub.publish_wait(Topics("dev-3").record, b'{"id": 1}', T)
        h.wait(lambda r: len(r.messages) == 1, "the first delivery")
        h.ack = True
        sub.drop()  # a clean reconnect keeps the session, and the broker resends the unacknowledged message
        h.wait(lambda r: len(r.messages) == 2, "the redelivery")
        assert h.messages[1].payload == b'{"id": 1}' and sub.connects == 2
    finally:
        sub.stop()
        pub.stop()


def test_shared_subscription_splits_messages_between_receivers(mosquitto):
    """`$share/<group>/…`: each message reaches one receiver of the group, on its plain topic."""
    arrived = threading.Condition()
    receivers = [Recorder(cond=arrived), Recorder(cond=arrived)]
    subs = [client(settings(mosquitto), r, subscriptions=(topic_filter("telemetry", share="fleet"),))
            for r in receivers]
    pub = client(settings(mosquitto), Recorder())
    try:
        for s in subs:
            s.wait_ready(T)
        pub.wait_ready(T)
        for i in range(20):
            pub.publish_wait(Topics(f"dev-{i}").telemetry, b"{}", T)
        receivers[0].wait(lambda _: sum(len(r.messages) for r in receivers) >= 20, "20 messages in all")
        got = [parse_topic(m.topic).device_id for r in receivers for m in r.messages]
        assert sorted(got) == sorted(f"dev-{i}" for i in range(20))  # each exactly once
        assert all(r.messages for r in receivers)  # and the group shared them
    finally:
        for s in subs:
            s.stop()
        pub.stop()


def test_mqtt311_fallback_when_the_broker_refuses_5():
    fake = Mqtt311OnlyBroker()
    h = Recorder()
    c = client(BrokerSettings(host="127.0.0.1", port=fake.port), h, subscriptions=("edgetune/v1/+/cmd/req",))
    try:
        c.wait_ready(T)  # the refusal is not a failed attempt: the fallback follows at once
        assert fake.levels[:2] == [5, 4] and c.protocol == "3.1.1"
        c.publish_wait("edgetune/v1/dev/telemetry", b'{"seq": 0}', T)
        assert fake.wait(1) == [0]
    finally:
        c.stop()


def test_unreachable_and_refused_brokers_fail_with_a_reason(tmp_path):
    with pytest.raises(BadInput, match="no broker host"):
        Client(BrokerSettings(), "x", Handler())
    c = client(BrokerSettings(host="127.0.0.1", port=1), Handler())  # nothing listens on port 1
    with pytest.raises(BrokerError, match="cannot reach broker mqtt://127.0.0.1:1"):
        c.wait_ready(T)
    c.stop()

    pw = tmp_path / "passwd"
    subprocess.run(["mosquitto_passwd", "-c", "-b", str(pw), "u", "right"], check=True, capture_output=True)
    broker = Mosquitto(tmp_path / "auth", extra_conf=[f"password_file {pw}", "allow_anonymous false"]).start()
    try:
        c = client(settings(broker, username="u", password="wrong"), Handler())
        with pytest.raises(BrokerError, match="refused the connection: Not authorized"):
            c.wait_ready(T)
        c.stop()
    finally:
        broker.stop()


def test_tls_settings_name_the_unusable_file(tmp_path):
    certs = make_certs(tmp_path)
    with pytest.raises(BadInput, match="CA file .*missing.pem"):
        TlsSettings(ca=str(tmp_path / "missing.pem")).context()
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(BadInput, match="client certificate .*junk.pem"):
        TlsSettings(ca=str(certs["ca.crt"]), cert=str(junk), key=str(junk)).context()
    assert TlsSettings(enabled=True).enabled and TlsSettings(ca="x").enabled and not TlsSettings().enabled
    assert BrokerSettings(host="h", tls=TlsSettings(enabled=True)).label == "mqtts://h:8883"
    assert BrokerSettings(host="::1", port=1884).label == "mqtt://[::1]:1884"


def test_tls_connects_with_the_right_ca_and_fails_with_another(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    certs, other = make_certs(tmp_path / "a"), make_certs(tmp_path / "b")
    broker = Mosquitto(tmp_path / "tls", extra_conf=[f"cafile {certs['ca.crt']}", f"certfile {certs['server.crt']}",
                                                      f"keyfile {certs['server.key']}"]).start()
    try:
        good = client(settings(broker, tls=TlsSettings(ca=str(certs["ca.crt"]))), Handler())
        good.wait_ready(T)
        good.stop()
        bad = client(settings(broker, tls=TlsSettings(ca=str(other["ca.crt"]))), Handler())
        with pytest.raises(BrokerError, match="certificate verify failed"):
            bad.wait_ready(T)
        bad.stop()
    finally:
        broker.stop()


def test_backoff_grows_with_failures_and_stays_under_the_cap():
    for failures in range(12):
        delays = [backoff(failures, 0.5, 3.0) for _ in range(200)]
        assert all(0.5 <= d <= min(3.0, 0.5 * 2 ** failures) for d in delays)
    assert max(backoff(10, 0.5, 3.0) for _ in range(200)) > 1.5  # jittered over the whole range, up to the cap


def test_two_clients_with_one_client_id_back_off_instead_of_flapping(mosquitto, monkeypatch, caplog):
    """Two devices cloned from one image share a client id: the broker closes each one's connection when the
    other connects. A connection that short counts as a failure, so the backoff grows (and the log says why)."""
    import edgetune.broker as broker_mod

    seen: list[int] = []
    cond = threading.Condition()

    def recording_backoff(failures: int, low: float, cap: float) -> float:
        with cond:
            seen.append(failures)
            cond.notify_all()
        return 0.05

    monkeypatch.setattr(broker_mod, "backoff", recording_backoff)
    same = f"t-{uuid.uuid4().hex[:10]}"
    a = Client(settings(mosquitto), same, Recorder()).start()
    b = Client(settings(mosquitto), same, Recorder()).start()
    try:
        with cond:
            assert cond.wait_for(lambda: len(seen) >= 8, T), seen
        assert max(seen) >= 3, seen  # unbroken runs of short connections, not a reset to 0 after each connect
        assert "another client may be connecting with client id" in caplog.text
    finally:
        a.stop()
        b.stop()
