"""Nothing is lost: broker outages, kill -9 mid-tune, a full outbox; and the link's TLS, auth and MQTT 3.1.1 paths."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from daemon.mqtt import Link
from daemon.outbox import Outbox
from edgetune.broker import BrokerSettings
from edgetune.protocol import Topics
from tests.broker import Mosquitto, Mqtt311OnlyBroker, make_certs
from tests.test_daemon_support import WORKLOAD_FC, WORKLOAD_PW4, Bus, DaemonProc, daemon_config

DEV = "edgetune/v1/dev-test"


def first_seen(docs: list[dict], key: str) -> list:
    """Values in first-arrival order: QoS 1 may deliver a message twice, never out of order."""
    return list(dict.fromkeys(d[key] for d in docs))


def test_broker_outage_everything_arrives_in_order(tmp_path):
    broker = Mosquitto(tmp_path / "broker").start()
    fleet = Bus(broker, (f"{DEV}/telemetry", f"{DEV}/cmd/res/#"), client_id="fleet-outage", persistent=True)
    d = DaemonProc(daemon_config(tmp_path, broker, telemetry_interval_s=0.2)).start()
    try:
        fleet.on("/telemetry", lambda t: t["seq"] >= 2)
        broker.stop()
        d.wait_status(lambda s: not s["broker"]["connected"])
        retune = d.request({"op": "retune", "force": True, "budget": 2})  # results produced while offline
        d.wait_status(lambda s: s["outbox"]["messages"] >= 15 and s["state"] == "idle")
        broker.start()  # same port, persisted sessions: the fleet's queue survives
        d.wait_status(lambda s: s["broker"]["connected"] and s["broker"]["connects"] >= 2)
        fleet.on(f"/cmd/res/{retune['id']}", lambda c: c["status"] == "succeeded")
        assert d.signal(signal.SIGTERM) == 0
        with sqlite3.connect(d.state_dir / "daemon.db") as db:
            last = json.loads(db.execute("SELECT value FROM kv WHERE key='telemetry'").fetchone()[0])["seq"]
        fleet.on("/telemetry", lambda t: t["seq"] == last)
        seqs = first_seen(fleet.docs("/telemetry"), "seq")
        assert seqs == list(range(seqs[0], last + 1)), seqs  # every sample, in order, across the outage
        states = first_seen(fleet.docs(f"/cmd/res/{retune['id']}"), "status")
        assert states == ["in_progress", "succeeded"]  # queued offline: only the newest open status goes out
    finally:
        d.stop()
        fleet.close()
        broker.stop()


def outbox_rows(state: Path) -> list[tuple[str, bytes]]:
    """The queued rows that must arrive as they are: a replaceable one (retained state, an open command status)
    may be superseded by a newer one on its topic before it is sent."""
    with sqlite3.connect(state / "outbox.db") as db:
        return [(t, bytes(p)) for t, p in db.execute("SELECT topic, payload FROM outbox WHERE replaceable = 0 "
                                                     "ORDER BY id")]


def test_kill9_mid_tune_then_restart_recovers_and_loses_nothing(tmp_path):
    broker = Mosquitto(tmp_path / "broker").start()
    fleet = Bus(broker, (f"{DEV}/#",), client_id="fleet-kill", persistent=True)
    broker.stop()  # the daemon runs offline: everything it produces stays in its outbox
    both = WORKLOAD_FC + WORKLOAD_PW4.replace("# edgetune workloads file\n", "")
    d = DaemonProc(daemon_config(tmp_path, broker, workload=both, telemetry_interval_s=0.3,
                                 tuning={"budget": 30})).start()
    try:
        d.wait_status(lambda s: bool(s.get("job")) and "kws_dscnn.pw4 best" in (s["job"]["message"] or ""), 120)
        d.kill9()
        queued = outbox_rows(d.state_dir)
        assert any(t.endswith("/tuning/record") for t, _ in queued)  # kws_dscnn.fc finished before the kill
        with sqlite3.connect(d.state_dir / "results.db") as db:
            sid, done_before = db.execute(
                "SELECT s.id, count(m.id) FROM sessions s JOIN measurements m ON m.session_id = s.id "
                "WHERE s.workload='kws_dscnn.pw4' AND s.state='running' GROUP BY s.id").fetchone()
        assert done_before >= 1

        d.start()
        d.wait_status(lambda s: s["state"] == "idle" and s["last_tune"]["target"] == "gemm/kws_dscnn.pw4", 180)
        assert f"resuming session {sid}" in d.log
        broker.start()
        rec = fleet.on("/tuning/record", lambda r: r["workload"] == "kws_dscnn.pw4", 60)
        assert rec["id"] == sid and rec["state"] == "done"  # the interrupted session, finished
        search = [m for m in rec["measurements"] if m["phase"] == "search"]
        assert len(search) >= done_before and [m["seq"] for m in search] == list(range(len(search)))
        active = fleet.on("/config/active", lambda a: {"gemm/kws_dscnn.fc", "gemm/kws_dscnn.pw4"} <= set(a["kernels"]))
        assert active["kernels"]["gemm/kws_dscnn.pw4"]["session_id"] == sid

        # everything queued at the kill arrives, in the order it was queued
        fleet.wait(lambda m: (m.topic, m.payload) == queued[-1], 60, what="the last row queued before the kill")
        arrived = list(dict.fromkeys((m.topic, m.payload) for m in fleet.msgs))
        positions = [arrived.index(row) for row in queued]
        assert positions == sorted(positions)
        assert d.signal(signal.SIGTERM) == 0
    finally:
        d.stop()
        fleet.close()
        broker.stop()


def test_full_outbox_drops_only_oldest_telemetry(tmp_path, mosquitto):
    topics = Topics("dev-ob")
    ob = Outbox(tmp_path / "outbox.db", max_bytes=64 * 1024)
    pad = "x" * 1000
    for i in range(120):  # no link yet: a broker outage as far as the outbox knows
        ob.enqueue(topics.telemetry, json.dumps({"seq": i, "pad": pad}).encode(), kind="telemetry")
        if i % 6 == 0:
            ob.enqueue(topics.record, json.dumps({"n": i // 6, "pad": pad * 2}).encode(), kind="record")
    assert ob.dropped > 0 and ob.depth()[1] <= 64 * 1024
    kept = [json.loads(m.payload)["seq"] for m in ob.after(0, 1000) if m.kind == "telemetry"]
    assert kept == list(range(120 - len(kept), 120))  # the newest telemetry survived, the oldest went
    assert sum(m.kind == "record" for m in ob.after(0, 1000)) == 20

    # records alone over the bound are still kept; telemetry is what makes room, or is refused
    for n in range(40):
        assert ob.enqueue(topics.record, json.dumps({"n": 100 + n, "pad": pad}).encode(), kind="record")
    assert ob.depth()[1] > 64 * 1024
    assert ob.enqueue(topics.telemetry, b'{"seq": -1}', kind="telemetry") is None
    left = [json.loads(m.payload)["seq"] for m in ob.after(0, 1000) if m.kind == "telemetry"]

    fleet = Bus(mosquitto, ("edgetune/v1/dev-ob/#",))
    link = Link(BrokerSettings(host=mosquitto.host, port=mosquitto.port, will_delay_s=0), topics, ob,
                will=lambda: b"{}", on_connected=lambda: None, on_command=lambda p: None)
    link.start()
    try:
        assert link.attempted.wait(10) and link.flush(30)
        fleet.on("/tuning/record", lambda r: r["n"] == 139)
        assert [d["n"] for d in fleet.docs("/tuning/record")] == list(range(20)) + list(range(100, 140))
        assert [d["seq"] for d in fleet.docs("/telemetry")] == left
    finally:
        link.stop()
        fleet.close()


@pytest.fixture
def tls_broker(tmp_path):
    certs = make_certs(tmp_path)
    pw = tmp_path / "passwd"
    subprocess.run(["mosquitto_passwd", "-b", "-c", str(pw), "edge", "s3cret"], check=True, capture_output=True)
    b = Mosquitto(tmp_path / "broker", extra_conf=[
        f"cafile {certs['ca.crt']}", f"certfile {certs['server.crt']}", f"keyfile {certs['server.key']}",
        "require_certificate true", f"password_file {pw}", "allow_anonymous false"]).start()
    yield b, certs
    b.stop()


def test_tls_and_password_enforced_and_sighup_reload(tmp_path, tls_broker):
    broker, certs = tls_broker
    tls = {"ca": str(certs["ca.crt"]), "cert": str(certs["client.crt"]), "key": str(certs["client.key"])}
    fleet = Bus(broker, (f"{DEV}/status",), auth=("edge", "s3cret"),
                tls={"ca_certs": tls["ca"], "certfile": tls["cert"], "keyfile": tls["key"]})
    cfg = daemon_config(tmp_path, broker, mqtt={"tls": tls, "username": "edge", "password": "wrong"})
    d = DaemonProc(cfg).start()
    try:
        st = d.wait_status(lambda s: (s.get("broker") or {}).get("last_error") is not None)
        assert not st["broker"]["connected"] and st["broker"]["tls"]
        assert "authoriz" in st["broker"]["last_error"].lower() or "password" in st["broker"]["last_error"].lower()

        cfg.write_text(cfg.read_text().replace('"wrong"', '"s3cret"'))
        d.proc.send_signal(signal.SIGHUP)  # reload: new credentials, reconnect
        fleet.on("/status", lambda s: s["state"] == "online")
        st = d.wait_status(lambda s: s["broker"]["connected"])
        assert st["broker"]["protocol"] == "5"
        assert d.signal(signal.SIGTERM) == 0
        fleet.on("/status", lambda s: s["state"] == "offline")
    finally:
        d.stop()
        fleet.close()


def test_mqtt311_fallback_and_rows_deleted_only_on_puback(tmp_path):
    fake = Mqtt311OnlyBroker()
    fake.acking = False
    topics = Topics("dev-311")
    ob = Outbox(tmp_path / "outbox.db")
    for i in range(5):
        ob.enqueue(topics.telemetry, json.dumps({"seq": i}).encode(), kind="telemetry")
    link = Link(BrokerSettings(host="127.0.0.1", port=fake.port), topics, ob,
                will=lambda: b'{"state": "lost"}', on_connected=lambda: None, on_command=lambda p: None)
    link.start()
    try:
        assert fake.wait(5) == list(range(5))
        assert fake.levels[:2] == [5, 4] and link.snapshot()["protocol"] == "3.1.1"
        assert ob.depth()[0] == 5  # sent is not acknowledged: every row is still there

        fake.acking = True
        fake.drop()  # the connection dies with all five unacknowledged
        assert fake.wait(10)[5:] == list(range(5))  # resent from the oldest row, in order
        assert link.flush(10) and ob.depth() == (0, 0)
    finally:
        link.stop()


def test_a_storm_of_sighups_neither_hangs_nor_kills_the_daemon(tmp_path):
    """Thousands of reloads, each signal landing wherever the main loop happens to be: a handler that took the
    loop's own lock there (threading.Event.set while the loop was inside wait/clear) hung the daemon, and further
    signals nested handlers until a RecursionError killed it. It must stop cleanly on SIGTERM afterwards."""
    d = DaemonProc(daemon_config(tmp_path, None)).start()
    try:
        d.wait_status(lambda s: s.get("state") not in (None, "starting"))
        for _ in range(4000):
            d.proc.send_signal(signal.SIGHUP)
            time.sleep(0.0005)
        d.wait_status(lambda s: True)
        assert d.signal(signal.SIGTERM, timeout=30) == 0, d.log[-3000:]
        assert "config reloaded" in d.log and "Traceback" not in d.log, d.log[-3000:]
    finally:
        d.stop()
