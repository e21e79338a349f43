"""The fleet receiver's batches, against a real mosquitto and both fleet DB backends (the `db` fixture of
tests/test_fleet.py): a message is acknowledged only once the transaction that stored it committed, a batch
holding a value the database refuses is stored one message at a time, a full queue stops the client reading,
the broker never has more than the Receive Maximum out to the receiver, and a resumed session does not bring
the retained state again."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from typing import Iterator

from edgetune.broker import Connection, Message
from fleet import listener as listener_mod
from fleet import rollout_store
from fleet.listener import Listener
from fleet.store import open_fleet_store
from tests.test_fleet import DEV, T, Device, db, opts  # noqa: F401  (db is a fixture)


def telemetry(seq: int, boot: str = "boot-1") -> dict:
    return {"boot_id": boot, "seq": seq, "ts": time.time(), "cpu_percent": 12.5, "state": "idle"}


class HeldWriter:
    """Holds the listener's writer before it takes its first batch, until released: what arrives meanwhile
    queues up, so the tests decide what one batch holds."""

    def __init__(self, monkeypatch):
        self.release = threading.Event()
        self.batches: list[int] = []
        self.arrived = threading.Condition()
        take, ingest, on_message = Listener._take, listener_mod.ingest_batch, Listener.on_message

        def held_take(lst: Listener) -> list:
            assert self.release.wait(T), "the test never released the writer"
            return take(lst)

        def counted(store, messages, now=None):
            self.batches.append(len(messages))
            return ingest(store, messages, now)

        def arrived(lst: Listener, conn: Connection, msg: Message) -> None:
            on_message(lst, conn, msg)
            with self.arrived:
                self.arrived.notify_all()

        monkeypatch.setattr(Listener, "_take", held_take)
        monkeypatch.setattr(listener_mod, "ingest_batch", counted)
        monkeypatch.setattr(Listener, "on_message", arrived)

    def wait_backlog(self, lst: Listener, n: int) -> None:
        with self.arrived:
            assert self.arrived.wait_for(lambda: lst.backlog >= n, T), f"backlog {lst.backlog}, expected {n}"


def new_listener(mosquitto, db, **kw) -> Listener:
    lst = Listener(opts(mosquitto), db, client_id=f"fleet-batch-{uuid.uuid4().hex[:8]}", **kw).start()
    assert lst.subscribed.wait(T), "listener did not subscribe"
    return lst


@contextlib.contextmanager
def held_rig(mosquitto, db, monkeypatch) -> Iterator[tuple[HeldWriter, Listener, Device]]:
    """A listener whose writer is held, and a device publishing to it; both closed at the end."""
    held = HeldWriter(monkeypatch)
    lst = new_listener(mosquitto, db)
    dev = Device(mosquitto)
    try:
        yield held, lst, dev
    finally:
        held.release.set()
        dev.close()
        lst.stop()


def test_every_acknowledgement_follows_the_commit_that_stored_the_message(mosquitto, db, monkeypatch):
    """Each PUBACK the receiver sends is checked against a second connection to the DB at that moment: the sample
    it acknowledges must already be committed there."""
    seen = open_fleet_store(db, threads=True)  # read from the client thread
    unstored: list[int] = []
    acked: list[int] = []
    real_ack = Connection.ack

    def checked_ack(conn: Connection, msg: Message) -> None:
        seq = json.loads(msg.payload)["seq"]
        if seen.query_one("SELECT 1 FROM telemetry WHERE device_id=? AND seq=?", (DEV, seq)) is None:
            unstored.append(seq)
        acked.append(seq)
        real_ack(conn, msg)

    monkeypatch.setattr(Connection, "ack", checked_ack)
    lst = new_listener(mosquitto, db)
    dev = Device(mosquitto)
    try:
        for seq in range(300):
            info = dev.c.publish(f"edgetune/v1/{DEV}/telemetry", json.dumps(telemetry(seq)), qos=1)
        info.wait_for_publish(T)
        assert lst.wait_for(lambda c: c["telemetry"] >= 300, T), dict(lst.counts)
        assert lst.wait_for(lambda c: len(acked) >= 300, T), len(acked)
    finally:
        dev.close()
        lst.stop()
        seen.close()
    assert unstored == [] and sorted(acked) == list(range(300))
    assert lst.counts["batches"] < 300  # they were stored in batches, not one by one


def test_a_model_state_report_is_stored_in_the_batch_and_acknowledged_after_its_commit(mosquitto, db, monkeypatch):
    """model/state reports (fleet.rollout_store) take the batch's write path like every other message: written
    inside the writer's open batch, and acknowledged only once a second DB connection sees them (it, or a newer
    report: the table keeps each device's newest)."""
    seen = open_fleet_store(db, threads=True)
    unstored, acked, outside = [], [], []
    real_ack, real_put = Connection.ack, rollout_store.put_model_state

    def checked_ack(conn: Connection, msg: Message) -> None:
        if msg.topic.endswith("/model/state"):
            doc = json.loads(msg.payload)
            if seen.query_one("SELECT 1 FROM model_states WHERE device_id=? AND ts>=?", (DEV, doc["ts"])) is None:
                unstored.append(doc["ts"])
            acked.append(doc["ts"])
        real_ack(conn, msg)

    def in_batch(store, *a, **kw):
        if store._batch is None or store._batch[0] != threading.get_ident():
            outside.append(a[0])
        return real_put(store, *a, **kw)

    monkeypatch.setattr(Connection, "ack", checked_ack)
    monkeypatch.setattr(rollout_store, "put_model_state", in_batch)
    with held_rig(mosquitto, db, monkeypatch) as (held, lst, dev):
        for seq in range(10):
            dev.pub("telemetry", telemetry(seq))
            dev.pub("model/state", {"state": "downloading", "version": 2, "ts": 1000.0 + seq})
        held.wait_backlog(lst, 20)
        held.release.set()
        assert lst.wait_for(lambda c: c["model_state"] >= 10 and c["telemetry"] >= 10, T), dict(lst.counts)
        assert lst.wait_for(lambda c: len(acked) >= 10, T), len(acked)
    seen.close()
    assert held.batches[0] == 20 and outside == []
    assert unstored == [] and sorted(acked) == [1000.0 + i for i in range(10)]
    with open_fleet_store(db) as s:
        assert rollout_store.model_state(s, DEV)["ts"] == 1009.0


def test_a_value_the_database_refuses_costs_only_its_own_message(mosquitto, db, monkeypatch):
    """A NUL in text makes PostgreSQL refuse the whole telemetry statement: the batch is stored again one message
    at a time, that message is logged as malformed and the others are stored. SQLite stores the NUL."""
    with held_rig(mosquitto, db, monkeypatch) as (held, lst, dev):
        for seq in range(20):
            dev.pub("telemetry", telemetry(seq, boot="bad\u0000boot" if seq == 7 else "boot-1"))
        dev.pub("status", {"state": "online", "session": 1, "version": "0.1.0", "ts": time.time()})
        held.wait_backlog(lst, 21)
        held.release.set()
        assert lst.wait_for(lambda c: c["messages"] >= 21, T), dict(lst.counts)
    assert held.batches[0] == 21  # one batch held them all
    postgres = isinstance(db, str)
    with open_fleet_store(db) as s:
        stored = sorted(t["seq"] for t in s.telemetry(DEV))
        assert stored == [q for q in range(20) if not (postgres and q == 7)]
        assert len(s.malformed()) == (1 if postgres else 0)
        assert s.devices()[0]["state"] == "online"
    assert lst.counts["malformed"] == (1 if postgres else 0) and lst.alarm is None


def test_a_full_queue_stops_the_client_reading_until_the_writer_catches_up(mosquitto, db, monkeypatch):
    monkeypatch.setattr(listener_mod, "QUEUE_MAX", 5)
    with held_rig(mosquitto, db, monkeypatch) as (held, lst, dev):
        for seq in range(40):
            dev.pub("telemetry", telemetry(seq))  # all at the broker, and on their way to us (Receive Maximum 2000)
        held.wait_backlog(lst, 5)
        # two turns of the client's loop: a client that read while the queue is full would have taken more
        for _ in range(2):
            turned = threading.Event()
            lst.client.call_soon(lambda conn: turned.set())
            assert turned.wait(T)
        assert lst.backlog == 5 and not lst.accepting()
        held.release.set()
        assert lst.wait_for(lambda c: c["telemetry"] >= 40, T), dict(lst.counts)
    with open_fleet_store(db) as s:
        assert sorted(t["seq"] for t in s.telemetry(DEV)) == list(range(40))


def test_the_broker_sends_no_more_than_the_receive_maximum_unacknowledged(mosquitto, db, monkeypatch):
    """With the writer held, mosquitto stops at the receiver's Receive Maximum. A QoS 0 message, which no window
    holds back, published after them all marks the moment the broker has handled everything before it."""
    monkeypatch.setattr(listener_mod, "RECEIVE_MAXIMUM", 8)
    with held_rig(mosquitto, db, monkeypatch) as (held, lst, dev):
        for seq in range(30):
            dev.pub("telemetry", telemetry(seq))
        dev.c.publish(f"edgetune/v1/{DEV}/telemetry", json.dumps(telemetry(1000)), qos=0).wait_for_publish(T)
        held.wait_backlog(lst, 9)
        assert lst.backlog == 9  # 8 QoS 1 samples and the marker
        held.release.set()
        assert lst.wait_for(lambda c: c["telemetry"] >= 31, T), dict(lst.counts)
    with open_fleet_store(db) as s:
        assert sorted(t["seq"] for t in s.telemetry(DEV)) == [*range(30), 1000]


def test_a_resumed_session_does_not_bring_the_retained_state_again(mosquitto, tmp_path):
    dev = Device(mosquitto)
    for i in range(3):
        dev.pub("status", {"state": "online", "session": 1, "version": "0.1.0", "ts": time.time()}, retain=True)
        dev.pub("info", {"device_id": DEV, "hw": {"cpu_model": "x"}}, retain=True)
    dev.close()
    cid = f"fleet-rh-{uuid.uuid4().hex[:8]}"
    db = tmp_path / "f.db"
    first = Listener(opts(mosquitto), db, client_id=cid).start()
    try:  # a new subscription gets the retained messages
        assert first.wait_for(lambda c: c["status"] >= 1 and c["info"] >= 1, T), dict(first.counts)
    finally:
        first.stop()
    dev = Device(mosquitto)
    second = Listener(opts(mosquitto), db, client_id=cid).start()
    try:  # the resumed one only what was published while it was away
        assert second.subscribed.wait(T)
        dev.pub("telemetry", telemetry(1))
        assert second.wait_for(lambda c: c["telemetry"] >= 1, T), dict(second.counts)
        assert second.counts["status"] == 0 and second.counts["info"] == 0
    finally:
        dev.close()
        second.stop()
