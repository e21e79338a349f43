"""fleet/: the receiver against a real mosquitto (tests/broker.py), a publisher speaking the DESIGN.md contract,
and the CLI verbs run as subprocesses. The fake responder below stands in for a device only here; the daemon's
own end-to-end test lives with the daemon."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgetune.sqlite import DBForeign, DBFull
from fleet import listener as listener_mod
from fleet.commands import describe_progress, new_command, progress_parts
from fleet.ingest import ingest, record_uid
from fleet.listener import Listener
from edgetune.broker import BrokerSettings
from fleet.mqtt import parse_broker
from fleet.db import is_postgres
from fleet.store import FleetStore, PgFleetStore, geomean, open_fleet_store

REPO = Path(__file__).resolve().parent.parent
DEV = "dev-1"
T = 15.0  # generous per-event timeout; every wait below is on an event, never a fixed sleep

HW = {"arch": "x86_64", "cpu_model": "Test CPU 9000", "isa": "x86-64-v3", "isa_level": 3, "vector_bits": 256,
      "cores": 4, "cores_online": 4, "hw_fingerprint": "hwfp-1", "fw_fingerprint": "fwfp-1"}


def edgetune(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgetune.main", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def record(rid: int, workload: str = "pw1", n: int = 3, state: str = "done", started_at: float = 1700000000.5) -> dict:
    return {
        "id": rid, "key": f"key-{rid}", "kernel": "gemm", "workload": workload, "shape": {"M": 64, "N": 64, "K": 64},
        "hw_fingerprint": "hwfp-1", "fw_fingerprint": "fwfp-1", "strategy": "anneal", "state": state,
        "started_at": started_at, "result": {"config": {"tile": 32}, "ms": 0.5, "speedup": 2.0},
        "measurements": [{"phase": "search", "seq": i, "config": {"tile": 2 ** (i + 3)}, "ok": True, "reason": "",
                          "ms": 1.0 / (i + 1), "cv": 0.01, "stats": {"reps": 10}, "compile_s": 0.2}
                         for i in range(n)],
        "some_future_field": {"kept": True},
    }


ACTIVE = {"tuned_at": 1700000100.0, "hw_fingerprint": "hwfp-1", "fw_fingerprint": "fwfp-1", "model_version": "m1",
          "kernels": {"gemm/pw1": {"config": {"tile": 32}, "ms": 0.5, "default_ms": 1.0, "speedup": 2.0, "evals": 12,
                                   "tuning_s": 1.5, "strategy": "anneal"},
                      "conv1d/ds1": {"config": {"tile": 8}, "ms": 2.0, "default_ms": 3.0, "speedup": 1.5, "evals": 9,
                                     "tuning_s": 2.5, "strategy": "anneal"}}}


class Device:
    """A publisher speaking the contract: client id = device id, QoS 1, each publish waited for (PUBACK)."""

    def __init__(self, broker, device: str = DEV, subscribe: str | None = None, on_message=None):
        self.device = device
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=device, protocol=mqtt.MQTTv5)
        self.ready = threading.Event()

        def on_connect(client, userdata, flags, rc, props):
            if subscribe:
                client.subscribe(subscribe, qos=1)
            else:
                self.ready.set()

        self.c.on_connect = on_connect
        self.c.on_subscribe = lambda *a: self.ready.set()
        if on_message:
            self.c.on_message = on_message
        self.c.connect(broker.host, broker.port)
        self.c.loop_start()
        assert self.ready.wait(T), "publisher could not connect"

    def pub(self, sub: str, payload, retain: bool = False) -> None:
        data = payload if isinstance(payload, (bytes, str)) else json.dumps(payload)
        info = self.c.publish(f"edgetune/v1/{self.device}/{sub}", data, qos=1, retain=retain)
        info.wait_for_publish(T)
        assert info.is_published()

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def opts(broker, **kw) -> BrokerSettings:
    return BrokerSettings(host=broker.host, port=broker.port, reconnect_min_s=0.05, **kw)


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path) -> Path | str:
    """The fleet DB each receiver and store test runs against: a SQLite file, then a fresh PostgreSQL database."""
    return tmp_path / "fleet.db" if request.param == "sqlite" else request.getfixturevalue("pg_url")


@pytest.fixture
def listener(mosquitto, db):
    lst = Listener(opts(mosquitto), db, client_id=f"fleet-test-{uuid.uuid4().hex[:8]}").start()
    assert lst.subscribed.wait(T), "listener did not subscribe"
    yield lst
    lst.stop()


def devices_json(db: Path | str) -> dict[str, dict]:
    r = edgetune("fleet", "devices", "--db", str(db), "--json")
    assert r.returncode == 0, r.stderr
    return {d["id"]: d for d in json.loads(r.stdout)}


# ---- the receiver, end to end over the broker -------------------------------------------------------------------

def test_listener_stores_dedupes_and_devices_shows_speedup(mosquitto, listener, db, tmp_path):
    dev = Device(mosquitto)
    dev.pub("status", {"state": "online", "session": 3, "version": "0.1.0", "ts": time.time()}, retain=True)
    dev.pub("info", {"device_id": DEV, "hw": HW, "hw_fingerprint": "hwfp-1", "fw_fingerprint": "fwfp-1",
                     "model": {"name": "tuner", "version": "m1", "sha256": "00"}, "kernels": ["gemm", "conv1d"],
                     "commands": ["retune", "probe", "report", "ping"]}, retain=True)
    dev.pub("config/active", ACTIVE, retain=True)
    dev.pub("tuning/record", record(1))
    dev.pub("tuning/record", record(1))  # an outbox re-send: the same record again
    dev.pub("tuning/record", record(2, workload="pw2"))
    for seq in (1, 2, 2):  # seq 2 twice: a QoS 1 redelivery
        dev.pub("telemetry", {"seq": seq, "boot_id": "b1", "ts": time.time(), "cpu_percent": 12.5, "load1": 0.3,
                              "temp_c": 51.0, "freq_mhz": 1800, "mem_used": 1 << 28, "rss": 40 << 20, "state": "idle"})
    assert listener.wait_for(lambda c: c["messages"] >= 9, T), dict(listener.counts)
    c = listener.counts
    assert (c["record:new"], c["record:duplicate"]) == (2, 1)
    assert (c["telemetry:new"], c["telemetry:duplicate"]) == (2, 1)
    assert c["malformed"] == 0

    with open_fleet_store(db) as s:
        recs = s.records(DEV)
        assert [r["kernel"] + "/" + r["workload"] for r in recs] == ["gemm/pw1", "gemm/pw2"]
        assert recs[0]["copies"] == 2 and recs[0]["record"] == record(1)
        assert [t["seq"] for t in s.telemetry(DEV)] == [1, 2]
        assert set(s.active_configs(DEV)) == {"gemm/pw1", "conv1d/ds1"}

    d = devices_json(db)[DEV]
    assert d["state"] == "online" and d["online"] is True
    assert (d["cpu_model"], d["isa"], d["cores"]) == ("Test CPU 9000", "x86-64-v3", 4)
    assert d["tuned_workloads"] == 2 and d["records"] == 2
    assert d["mean_speedup"] == pytest.approx(math.sqrt(2.0 * 1.5))
    assert d["model_version"] == "m1" and d["telemetry"]["temp_c"] == 51.0
    assert d["last_seen_ago_s"] is not None and d["last_seen_ago_s"] < 60

    # the broker's last will (retained `lost`) flips the device
    dev.pub("status", {"state": "lost", "session": 3, "version": "0.1.0", "ts": time.time()}, retain=True)
    assert listener.wait_for(lambda c: c["status"] >= 2, T)
    assert devices_json(db)[DEV]["state"] == "lost"

    # the human table renders too
    r = edgetune("fleet", "devices", "--db", str(db))
    assert r.returncode == 0 and DEV in r.stdout and "lost" in r.stdout, r.stdout + r.stderr

    # one device in detail: its config/active and its tuning records
    r = edgetune("fleet", "show", DEV, "--db", str(db), "--json")
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    assert shown["active"]["gemm/pw1"]["config"] == {"tile": 32} and shown["info"]["kernels"] == ["gemm", "conv1d"]
    assert [x["session_id"] for x in shown["records"]] == ["1", "2"]
    assert [h["state"] for h in shown["status_history"]] == ["online", "lost"]
    r = edgetune("fleet", "show", DEV, "--db", str(db))
    assert r.returncode == 0 and "gemm/pw1" in r.stdout, r.stderr
    assert edgetune("fleet", "show", "nope", "--db", str(db)).returncode == 2  # a bad value, as for `retune`

    # export: the deduplicated records as JSONL training data, as received
    out = tmp_path / "records.jsonl"
    r = edgetune("fleet", "export-records", "-o", str(out), "--db", str(db), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"path": str(out), "records": 2, "devices": 1}
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 2
    for line, rid in zip(lines, (1, 2)):
        sent = record(rid, workload="pw1" if rid == 1 else "pw2")
        assert {k: line[k] for k in sent} == sent  # every field as received, measurements included
        assert line["device_id"] == DEV and line["hw"]["cpu_model"] == "Test CPU 9000"
    dev.close()


def test_malformed_payloads_are_skipped_and_listener_keeps_running(mosquitto, listener, db):
    dev = Device(mosquitto)
    bad = [
        ("status", b"\xff\xfe\x00garbage"),  # not UTF-8
        ("status", b"not json at all"),
        ("status", b"[1, 2, 3]"),  # JSON, but not an object
        ("status", b'{"state": "sleeping"}'),  # unknown state
        ("info", b"3"),
        ("config/active", b'{"kernels": [1, 2]}'),
        ("tuning/record", b'{"measurements": []}'),  # no kernel/workload
        ("tuning/record", b'{"kernel": "gemm", "workload": "w", "measurements": 5}'),
        ("telemetry", b'{"boot_id": "b", "seq": "one"}'),
        ("telemetry", json.dumps({"boot_id": "b", "seq": 2 ** 70}).encode()),  # too big for SQLite
        ("cmd/res/abc", b'{"id": "abc", "status": "exploded"}'),
        ("cmd/req", b'{"op": "retune"}'),  # no id
        ("telemetry", b"[" * 100000),  # nesting deep enough to blow the parser's recursion
        ("telemetry", b'{"seq": NaN'),
    ]
    for sub, payload in bad:
        dev.pub(sub, payload)
    # not subscribed, so never received: a topic from a newer daemon, and the fleet's own model chunks and releases
    for sub in ("unknown/topic", "model/chunk", "model/release", "ack"):
        dev.pub(sub, b"{}")
    dev.pub("status", {"state": "online", "session": 1, "version": "0.1.0", "ts": time.time()})
    assert listener.wait_for(lambda c: c["status"] >= 1, T), dict(listener.counts)
    assert listener.alive
    assert listener.counts["malformed"] == len(bad) and listener.counts["messages"] == len(bad) + 1
    assert listener.counts["ignored"] == 0
    with open_fleet_store(db) as s:
        assert len(s.malformed()) == len(bad)
        assert all(m["device_id"] == DEV and m["error"] for m in s.malformed())
    assert devices_json(db)[DEV]["state"] == "online"
    dev.close()


def test_a_session_resumed_from_an_older_receiver_drops_its_all_topics_filter(mosquitto, db):
    cid = f"fleet-old-{uuid.uuid4().hex[:8]}"
    old = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=cid, protocol=mqtt.MQTTv5)
    held = threading.Event()
    old.on_subscribe = lambda *a: held.set()
    old.on_connect = lambda c, *a: c.subscribe("edgetune/v1/+/#", qos=1)  # what receivers used to subscribe
    expiry = mqtt.Properties(mqtt.PacketTypes.CONNECT)
    expiry.SessionExpiryInterval = 3600
    old.connect(mosquitto.host, mosquitto.port, clean_start=False, properties=expiry)
    old.loop_start()
    assert held.wait(T), "the older receiver's session was not set up"
    old.disconnect()
    old.loop_stop()
    lst = Listener(opts(mosquitto), db, client_id=cid).start()
    try:
        assert lst.subscribed.wait(T)
        dev = Device(mosquitto)
        dev.pub("model/chunk", b"{}")  # only the old filter matches it
        dev.pub("status", {"state": "online", "session": 1, "version": "0.1.0", "ts": time.time()})
        assert lst.wait_for(lambda c: c["status"] >= 1, T), dict(lst.counts)
        assert lst.counts["messages"] == 1 and lst.counts["ignored"] == 0, dict(lst.counts)
        dev.close()
    finally:
        lst.stop()


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_persistent_session_queues_while_the_listener_is_down(mosquitto, db, protocol):
    cid = f"fleet-persist-{protocol}"
    first = Listener(opts(mosquitto, protocol=protocol), db, client_id=cid).start()
    assert first.subscribed.wait(T)
    first.stop()
    dev = Device(mosquitto)
    dev.pub("tuning/record", record(7))  # published while nobody listens
    dev.pub("status", {"state": "online", "session": 1, "version": "0.1.0", "ts": time.time()}, retain=True)
    second = Listener(opts(mosquitto, protocol=protocol), db, client_id=cid).start()
    try:
        assert second.wait_for(lambda c: c["record"] >= 1 and c["status"] >= 1, T), dict(second.counts)
    finally:
        second.stop()
    with open_fleet_store(db) as s:
        assert [r["session_id"] for r in s.records(DEV)] == ["7"]
    dev.close()


def test_retained_state_reaches_a_new_listener(mosquitto, tmp_path):
    dev = Device(mosquitto)
    dev.pub("status", {"state": "offline", "session": 2, "version": "0.1.0", "ts": time.time()}, retain=True)
    dev.pub("info", {"device_id": DEV, "hw": HW}, retain=True)
    dev.pub("config/active", ACTIVE, retain=True)
    dev.close()
    db = tmp_path / "late.db"
    lst = Listener(opts(mosquitto), db, client_id="fleet-late").start()
    try:
        assert lst.wait_for(lambda c: c["status"] >= 1 and c["info"] >= 1 and c["active"] >= 1, T), dict(lst.counts)
    finally:
        lst.stop()
    d = devices_json(db)[DEV]
    assert d["state"] == "offline" and d["tuned_workloads"] == 2 and d["cpu_model"] == "Test CPU 9000"


def test_listener_reconnects_and_resubscribes_after_a_broker_restart(mosquitto, listener, db):
    assert listener.counts["subscribes"] == 1
    mosquitto.stop()
    mosquitto.start()  # same port; the listener backs off, reconnects and subscribes again
    assert listener.wait_for(lambda c: c["subscribes"] >= 2, T), dict(listener.counts)
    dev = Device(mosquitto)
    dev.pub("tuning/record", record(11))
    assert listener.wait_for(lambda c: c["record"] >= 1, T)
    assert listener.alive
    dev.close()


def test_a_failed_db_write_is_not_acked_and_arrives_again(mosquitto, db, monkeypatch):
    real = listener_mod.ingest_batch
    failures = []

    def flaky(store, messages, now=None):
        if any(topic.endswith("tuning/record") for topic, _, _ in messages) and not failures:
            failures.append(messages)
            raise DBFull("database or disk is full", Path(db))
        return real(store, messages, now)

    monkeypatch.setattr(listener_mod, "ingest_batch", flaky)
    lst = Listener(opts(mosquitto), db, client_id="fleet-flaky").start()
    try:
        assert lst.subscribed.wait(T)
        dev = Device(mosquitto)
        dev.pub("tuning/record", record(9))
        assert lst.wait_for(lambda c: c["record"] >= 1, T), dict(lst.counts)
        assert lst.counts["retry"] == 1 and failures
        dev.close()
    finally:
        lst.stop()
    with open_fleet_store(db) as s:
        assert len(s.records(DEV)) == 1


def test_a_telemetry_backlog_sent_after_live_samples_comes_back_in_time_order(mosquitto, listener, db):
    """A device's outbox publishes what it kept while offline after the live samples: plots need their x sorted."""
    now = time.time()
    sample = lambda seq, ts: {"seq": seq, "boot_id": "b1", "ts": ts, "cpu_percent": float(seq)}  # noqa: E731
    dev = Device(mosquitto)
    for seq in (10, 11, 12):  # live
        dev.pub("telemetry", sample(seq, now + seq))
    assert listener.wait_for(lambda c: c["telemetry"] >= 3, T), dict(listener.counts)
    for seq in (0, 1, 2):  # the backlog, older, stored after them
        dev.pub("telemetry", sample(seq, now - 100 + seq))
    dev.close()
    assert listener.wait_for(lambda c: c["telemetry"] >= 6, T), dict(listener.counts)
    with open_fleet_store(db) as s:
        window = s.telemetry_window(DEV, since=0)
        assert [t["seq"] for t in window] == [0, 1, 2, 10, 11, 12]
        assert [t["seq"] for t in s.telemetry_window(DEV, since=0, limit=4)] == [0, 1, 2, 12]  # the newest received
    assert [t["ts"] for t in window] == sorted(t["ts"] for t in window)


def test_device_times_outside_any_plausible_clock_are_stored_as_unknown(db):
    with open_fleet_store(db) as s:
        for i, ts in enumerate((-1e20, 1e20, 5.0, 1.7e12)):  # overflow, unit bugs, a clock never set
            device = f"odd-{i}"
            ingest(s, f"edgetune/v1/{device}/status", json.dumps({"state": "lost", "session": 1, "ts": ts}).encode(),
                   retained=True)
            assert s.device(device)["last_seen"] is None and s.status_history(device)[0]["ts"] is None
            ingest(s, f"edgetune/v1/{device}/telemetry", json.dumps({"seq": 1, "boot_id": "b", "ts": ts}).encode())
            assert s.telemetry(device)[0]["ts"] is None


def test_listener_with_broker_auth(tmp_path):
    from tests.broker import Mosquitto

    pw = tmp_path / "passwd"
    subprocess.run(["mosquitto_passwd", "-c", "-b", str(pw), "fleet", "s3cret"], check=True, capture_output=True)
    broker = Mosquitto(tmp_path / "authbroker", extra_conf=[f"password_file {pw}", "allow_anonymous false"]).start()
    try:
        lst = Listener(opts(broker, username="fleet", password="s3cret"), tmp_path / "a.db",
                       client_id="fleet-auth").start()
        try:
            assert lst.subscribed.wait(T)
        finally:
            lst.stop()
        r = edgetune("fleet", "retune", DEV, "--broker", f"{broker.host}:{broker.port}", "--username", "fleet",
                     "--password", "wrong", "--json")
        assert r.returncode == 1 and "refused" in r.stderr, r.stderr
    finally:
        broker.stop()


# ---- retune -----------------------------------------------------------------------------------------------------

class FakeResponder:
    """Stands in for a device in these unit tests only: answers cmd/req with a fixed script of responses."""

    def __init__(self, broker, script: list[dict], device: str = DEV):
        self.requests: list[dict] = []
        self.script = script
        self.got = threading.Event()
        self.dev = Device(broker, device, subscribe=f"edgetune/v1/{device}/cmd/req", on_message=self._on_message)
        self.dev.pub("status", {"state": "online", "session": 1, "version": "0.1.0", "ts": time.time()}, retain=True)

    def _on_message(self, client, userdata, msg):
        req = json.loads(msg.payload)
        self.requests.append(req)
        for step in self.script:
            client.publish(f"edgetune/v1/{self.dev.device}/cmd/res/{req['id']}",
                           json.dumps({"id": req["id"], "progress": None, "reason": None, "result": None, **step}),
                           qos=1)
        self.got.set()

    def close(self):
        self.dev.close()


def test_retune_wait_follows_progress_to_success(mosquitto, listener):
    fake = FakeResponder(mosquitto, [
        {"status": "accepted"},
        {"status": "in_progress", "progress": {"done": 1, "total": 2, "message": "gemm/pw1"}},
        {"status": "in_progress", "progress": {"done": 2, "total": 2, "message": "gemm/pw2"}},
        {"status": "succeeded", "result": {"tuned": 2, "kernels": {"gemm/pw1": {"speedup": 2.0}}}},
    ])
    t0 = time.time()
    r = edgetune("fleet", "retune", DEV, "--kernel", "gemm", "--budget", "8", "--force", "--wait", "--timeout", "30",
                 "--broker", f"{mosquitto.host}:{mosquitto.port}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "in_progress 1/2 gemm/pw1" in r.stderr and "in_progress 2/2 gemm/pw2" in r.stderr, r.stderr
    assert "succeeded" in r.stdout
    assert fake.got.is_set() and len(fake.requests) == 1
    req = fake.requests[0]
    assert req["op"] == "retune" and req["args"] == {"kernels": ["gemm"], "budget": 8, "force": True}
    assert len(req["id"]) == 32 and req["expires_at"] > t0 + 60
    # the listener saw the command and every response
    assert listener.wait_for(lambda c: c["cmd_req"] >= 1 and c["cmd_res"] >= 4, T), dict(listener.counts)
    with open_fleet_store(listener.store.path) as s:
        cmd = s.command(DEV, req["id"])
    assert cmd["op"] == "retune" and cmd["status"] == "succeeded"
    assert [x["status"] for x in cmd["responses"]] == ["accepted", "in_progress", "in_progress", "succeeded"]
    fake.close()


def test_retune_json_lists_every_response(mosquitto):
    fake = FakeResponder(mosquitto, [{"status": "accepted"}, {"status": "in_progress", "progress": 0.5},
                                     {"status": "succeeded"}])
    r = edgetune("fleet", "retune", DEV, "--wait", "--timeout", "30", "--json", "--workload", "pw1",
                 "--broker", f"{mosquitto.host}:{mosquitto.port}")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["status"] == "succeeded" and out["device_state"] == "online"
    assert [x["status"] for x in out["responses"]] == ["accepted", "in_progress", "succeeded"]
    assert fake.requests[0]["args"] == {"workloads": ["pw1"]}
    fake.close()


def test_retune_rejected_exits_1(mosquitto):
    fake = FakeResponder(mosquitto, [{"status": "rejected", "reason": "expired"}])
    r = edgetune("fleet", "retune", DEV, "--wait", "--timeout", "30", "--broker", f"{mosquitto.host}:{mosquitto.port}")
    assert r.returncode == 1
    assert "rejected" in r.stderr and "expired" in r.stderr, r.stderr
    fake.close()


def test_retune_failed_exits_1_and_timeout_exits_1(mosquitto):
    fake = FakeResponder(mosquitto, [{"status": "accepted"}, {"status": "failed", "reason": "interrupted"}])
    r = edgetune("fleet", "retune", DEV, "--wait", "--json", "--timeout", "30",
                 "--broker", f"{mosquitto.host}:{mosquitto.port}")
    assert r.returncode == 1 and json.loads(r.stdout)["reason"] == "interrupted"
    fake.close()
    # nobody answers for dev-2: give up after --timeout
    r = edgetune("fleet", "retune", "dev-2", "--wait", "--json", "--timeout", "0.5",
                 "--broker", f"{mosquitto.host}:{mosquitto.port}")
    assert r.returncode == 1 and json.loads(r.stdout)["status"] == "timeout"


def test_retune_without_wait_just_sends(mosquitto):
    fake = FakeResponder(mosquitto, [])
    r = edgetune("fleet", "retune", DEV, "--strategy", "random", "--json",
                 "--broker", f"{mosquitto.host}:{mosquitto.port}")
    assert r.returncode == 0, r.stderr
    sent = json.loads(r.stdout)
    assert fake.got.wait(T)
    assert fake.requests[0]["id"] == sent["id"] and fake.requests[0]["args"] == {"strategy": "random"}
    fake.close()


def test_retune_cli_refuses_a_device_the_fleet_db_never_heard_from(mosquitto, tmp_path):
    db = tmp_path / "fleet.db"
    with FleetStore(db) as store:
        status = {"state": "online", "session": 1, "ts": time.time()}
        ingest(store, f"edgetune/v1/{DEV}/status", json.dumps(status).encode())
    ghost = FakeResponder(mosquitto, [], device="ghost")
    common = ["--broker", f"{mosquitto.host}:{mosquitto.port}", "--db", str(db), "--json"]
    r = edgetune("fleet", "retune", "ghost", *common)
    assert r.returncode == 2 and "'ghost'" in r.stderr and "--any-device" in r.stderr
    assert json.loads(r.stdout)["exit_code"] == 2 and "'ghost'" in json.loads(r.stdout)["error"]  # nothing was sent
    r = edgetune("fleet", "retune", DEV, *common)
    assert r.returncode == 0 and json.loads(r.stdout)["known"] is True
    r = edgetune("fleet", "retune", "ghost", "--any-device", *common)
    assert r.returncode == 0 and json.loads(r.stdout)["known"] is False
    assert ghost.got.wait(T) and ghost.requests[0]["id"] == json.loads(r.stdout)["id"]  # the refused one never went
    ghost.close()
    r = edgetune("fleet", "retune", "ghost", "--broker", f"{mosquitto.host}:{mosquitto.port}", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["known"] is None  # no fleet DB here to ask


def test_bad_input_exits_2_and_missing_db_exits_1(tmp_path):
    r = edgetune("fleet", "retune", DEV, "--budget", "0", "--broker", "localhost:1883")
    assert r.returncode == 2 and "--budget" in r.stderr
    r = edgetune("fleet", "retune", DEV, "--broker", "localhost:notaport")
    assert r.returncode == 2 and "port" in r.stderr
    r = edgetune("fleet", "retune", "a/b", "--broker", "localhost")
    assert r.returncode == 2
    r = edgetune("fleet", "listen", "--broker", "localhost", "--ca", str(tmp_path / "missing.pem"))
    assert r.returncode == 2
    r = edgetune("fleet", "devices", "--db", str(tmp_path / "none.db"), "--json")
    assert r.returncode == 1 and "no fleet DB" in r.stderr
    r = edgetune("fleet", "export-records", "--db", str(tmp_path / "none.db"), "-o", str(tmp_path / "x.jsonl"))
    assert r.returncode == 1
    r = edgetune("fleet", "retune", DEV, "--broker", "127.0.0.1:1", "--json")  # nothing listens on port 1
    assert r.returncode == 1 and "cannot reach broker" in r.stderr


def test_listen_cli_runs_until_sigterm(mosquitto, db):
    proc = subprocess.Popen([sys.executable, "-m", "edgetune.main", "fleet", "listen", "--broker",
                             f"{mosquitto.host}:{mosquitto.port}", "--db", str(db), "--client-id", "fleet-cli",
                             "--json"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stored, lines = threading.Event(), []

    def read_logs():  # the listener logs each state change; wait for that line instead of sleeping
        for line in proc.stderr:
            lines.append(line)
            if f"device {DEV} is online" in line:
                stored.set()

    reader = threading.Thread(target=read_logs, daemon=True)
    reader.start()
    try:
        dev = Device(mosquitto)
        # retained, so it reaches the listener whenever its subscription lands
        dev.pub("status", {"state": "online", "session": 1, "version": "0.1.0", "ts": time.time()}, retain=True)
        assert stored.wait(T), "".join(lines)
        dev.close()
    finally:
        proc.terminate()
        out = proc.stdout.read()
        proc.wait(timeout=T)
        reader.join(T)
    assert proc.returncode == 0, "".join(lines)
    summary = json.loads(out)
    assert summary["stored"]["devices"] == 1 and summary["messages"]["status"] == 1
    assert any("got SIGTERM" in ln for ln in lines)


# ---- ingest and store, without a broker -------------------------------------------------------------------------

def test_record_updates_keep_the_most_complete_copy(db):
    with open_fleet_store(db) as s:
        topic = f"edgetune/v1/{DEV}/tuning/record"
        assert ingest(s, topic, json.dumps(record(1, n=2, state="running")).encode()).detail == "new"
        assert ingest(s, topic, json.dumps(record(1, n=5)).encode()).detail == "updated"
        assert ingest(s, topic, json.dumps(record(1, n=2, state="running")).encode()).detail == "stale"
        assert ingest(s, topic, json.dumps(record(1, n=5)).encode()).detail == "duplicate"
        # same id after the device's DB restarted its ids: a different started_at, a different record
        assert ingest(s, topic, json.dumps(record(1, started_at=1800000000.0)).encode()).detail == "new"
        # no id at all: deduplicated by content
        anon = {k: v for k, v in record(3).items() if k != "id"}
        assert ingest(s, topic, json.dumps(anon).encode()).detail == "new"
        assert ingest(s, topic, json.dumps(anon).encode()).detail == "duplicate"
        recs = s.records(DEV)
        assert len(recs) == 3 and recs[0]["n_measurements"] == 5 and recs[0]["copies"] == 4
        assert record_uid(record(1)) == "1@1700000000.5"


def test_status_history_dedupes_retained_redelivery_and_final_responses_stick(db):
    with open_fleet_store(db) as s:
        st_topic = f"edgetune/v1/{DEV}/status"
        t0 = 1700000000.0
        online = json.dumps({"state": "online", "session": 1, "ts": t0}).encode()
        ingest(s, st_topic, online, retained=False, now=t0 + 0.5)
        ingest(s, st_topic, online, retained=True, now=t0 + 100)  # the same retained message after a reconnect
        ingest(s, st_topic, json.dumps({"state": "lost", "session": 1, "ts": t0 - 1}).encode(), retained=True,
               now=t0 + 200)
        assert [h["state"] for h in s.status_history(DEV)] == ["online", "lost"]
        d = s.device(DEV)
        assert d["state"] == "lost" and d["last_seen"] == t0  # a will is not a sign of life
        ingest(s, st_topic, b"", retained=True)  # a cleared retained status changes nothing
        assert s.device(DEV)["state"] == "lost"

        res = f"edgetune/v1/{DEV}/cmd/res/c1"
        for status in ("accepted", "succeeded", "in_progress"):  # a late duplicate after the final one
            ingest(s, res, json.dumps({"id": "c1", "status": status}).encode())
        assert s.command(DEV, "c1")["status"] == "succeeded"
        assert len(s.command(DEV, "c1")["responses"]) == 3

        act = f"edgetune/v1/{DEV}/config/active"
        ingest(s, act, json.dumps({"kernels": {"gemm/w": {"ms": 1.0, "default_ms": 3.0}}}).encode())
        assert s.devices()[0]["mean_speedup"] == pytest.approx(3.0)  # derived when speedup is missing
        ingest(s, act, b"", retained=True)  # retained config cleared
        assert s.devices()[0]["tuned_workloads"] == 0


def test_who_started_a_command_and_why_come_from_its_responses(db, monkeypatch):
    with open_fleet_store(db) as s:
        own = f"edgetune/v1/{DEV}/cmd/res/firmware-hook-1"  # the device's own: no cmd/req tells op or origin
        ingest(s, own, json.dumps({"id": "firmware-hook-1", "op": "retune", "origin": "firmware-hook",
                                   "status": "succeeded", "note": "firmware changed (rauc)"}).encode())
        c = s.command(DEV, "firmware-hook-1")
        assert (c["op"], c["origin"], c["note"], c["status"]) == ("retune", "firmware-hook", "firmware changed (rauc)",
                                                                  "succeeded")
        ingest(s, f"edgetune/v1/{DEV}/cmd/req", json.dumps({"id": "f1", "op": "probe", "args": {}}).encode())
        ingest(s, f"edgetune/v1/{DEV}/cmd/res/f1", json.dumps({"id": "f1", "op": "ping", "origin": "fleet",
                                                               "status": "accepted", "note": None}).encode())
        c = s.command(DEV, "f1")
        assert (c["op"], c["origin"], c["note"]) == ("probe", "fleet", None)  # the request's op stands
        ingest(s, f"edgetune/v1/{DEV}/cmd/req", json.dumps({"id": "f2", "op": "ping", "args": {}}).encode())
        assert s.command(DEV, "f2")["origin"] == "fleet"  # a cmd/req seen is the fleet's, before any response
        ingest(s, f"edgetune/v1/{DEV}/cmd/res/f1", json.dumps({"id": "f1", "status": "succeeded",
                                                               "origin": ["odd"], "note": 7}).encode())
        c = s.command(DEV, "f1")
        assert (c["status"], c["origin"], c["note"]) == ("succeeded", "fleet", "7")  # known values stay
    r = edgetune("fleet", "show", DEV, "--db", str(db), "--json")
    assert r.returncode == 0, r.stderr
    assert {c["id"]: c["origin"] for c in json.loads(r.stdout)["commands"]} == {
        "firmware-hook-1": "firmware-hook", "f1": "fleet", "f2": "fleet"}
    monkeypatch.setenv("COLUMNS", "160")  # the table's cells unwrapped
    r = edgetune("fleet", "show", DEV, "--db", str(db))
    assert r.returncode == 0 and "started by" in r.stdout and "firmware-hook: firmware changed (rauc)" in r.stdout, \
        r.stdout


def test_a_v4_fleet_db_upgrades_and_keeps_its_commands(db):
    v4 = {"SCHEMA": dataclasses.replace(FleetStore.SCHEMA, migrations=FleetStore.SCHEMA.migrations[:4])}
    old_store = type("V4", (PgFleetStore if is_postgres(db) else FleetStore,), v4)
    with old_store(db) as s:
        assert s.schema_version == 4
        with s.tx() as c:  # a fleet command (its cmd/req seen) and a device's own (a response only)
            for cid, requested in (("c1", 1.0), ("own-1", None)):
                c.execute("INSERT INTO commands (device_id, id, op, status, requested_at, updated_at)"
                          " VALUES (?,?,?,?,?,?)", (DEV, cid, "ping", "succeeded", requested, 2.0))
    with open_fleet_store(db) as s:
        assert s.schema_version == 5
        assert [(c["id"], c["op"], c["origin"], c["note"]) for c in s.commands(DEV)] == [
            ("c1", "ping", "fleet", None), ("own-1", "ping", None, None)]


def test_schema_is_versioned_and_foreign_files_are_refused(tmp_path):
    with FleetStore(tmp_path / "f.db") as s:
        assert s.schema_version == 5
    foreign = tmp_path / "foreign.db"
    sqlite3.connect(foreign).execute("CREATE TABLE x (y)").connection.commit()
    with pytest.raises(DBForeign, match="not an edgetune fleet DB"):
        FleetStore(foreign)
    assert geomean([2.0, 0.5]) == pytest.approx(1.0) and geomean([]) is None


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4),
    max_leaves=20)
_field_values = st.one_of(_json, st.sampled_from(["online", "lost", "done", "accepted", "succeeded", "b1",
                                                 "committed"]))
_contract_keys = ["state", "session", "ts", "seq", "boot_id", "kernel", "workload", "measurements", "id", "status",
                  "kernels", "hw", "progress", "record_id", "started_at", "op", "args", "expires_at", "cpu_model",
                  "rollout_id", "phase", "version", "origin", "note"]
_objects = st.dictionaries(st.sampled_from(_contract_keys), _field_values, max_size=8)
_payloads = st.one_of(st.binary(max_size=200), _json.map(lambda x: json.dumps(x).encode()),
                      _objects.map(lambda x: json.dumps(x).encode()))
_subs = st.sampled_from(["status", "info", "config/active", "tuning/record", "telemetry", "cmd/req", "cmd/res/x",
                         "cmd/res/", "cmd/res/a/b", "model/state", "other"])


def test_ingest_never_raises_on_fuzzed_payloads(db):
    store = open_fleet_store(db)

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(device=st.text(min_size=1, max_size=12).filter(lambda d: "/" not in d), sub=_subs, payload=_payloads,
           retained=st.booleans())
    def check(device, sub, payload, retained):
        out = ingest(store, f"edgetune/v1/{device}/{sub}", payload, retained)
        assert out.kind in {"status", "info", "active", "record", "telemetry", "cmd_req", "cmd_res", "model_state",
                            "ignored", "malformed"}
        assert (out.kind == "malformed") == (out.error is not None)

    check()
    store.devices()  # the DB is still consistent and readable
    list(store.iter_export())
    store.close()


def test_broker_and_progress_parsing():
    assert parse_broker("broker.local") == ("broker.local", 1883)
    assert parse_broker("broker.local", tls=True) == ("broker.local", 8883)
    assert parse_broker("10.0.0.2:1884") == ("10.0.0.2", 1884)
    assert parse_broker("[::1]:1885") == ("::1", 1885)
    assert parse_broker("mqtts://b.example") == ("b.example", 8883)
    assert progress_parts({"evals": 3, "budget": 10, "phase": "search"}) == (3.0, 10.0, "search")
    assert describe_progress({"done": 1, "total": 4, "message": "gemm/pw1"}) == "1/4 gemm/pw1"
    assert describe_progress(0.25) == "25%"
    assert describe_progress("compiling") == "compiling"
    assert describe_progress(None) == ""
    cmd = new_command("retune", {"kernels": ["gemm"]}, ttl_s=60, now=1000.0)
    assert cmd["expires_at"] == 1060.0 and cmd["op"] == "retune" and len(cmd["id"]) == 32
    assert os.environ.get("STATE_DIRECTORY")  # conftest isolates the default fleet DB location
