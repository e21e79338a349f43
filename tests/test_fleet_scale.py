"""The fleet at scale: PostgreSQL behind the store (tests/pg.py starts a throwaway cluster), receivers sharing one
MQTT 5 shared subscription on a real mosquitto, a database that goes away and comes back, telemetry retention.
The store's behaviour on both backends is covered by tests/test_fleet.py, whose `db` fixture runs each receiver
and store test on SQLite and on PostgreSQL."""

from __future__ import annotations

import json
import time
import uuid

import psycopg
import pytest

from edgetune.sqlite import DBForeign, DBTooNew, DBUnavailable
from fleet.db import pg_ddl, pg_sql, redact
from fleet.ingest import ingest
from fleet.listener import Listener
from fleet.retention import Pruner
from fleet.store import MIGRATIONS, open_fleet_store
from tests.test_fleet import T, Device, opts, record


def telemetry(seq: int, boot: str = "boot-1") -> dict:
    return {"boot_id": boot, "seq": seq, "ts": time.time(), "cpu_percent": 12.5, "load1": 0.3, "temp_c": 51.0,
            "freq_mhz": 1800.0, "mem_used": 0.4, "rss": 5.0e7, "state": "idle"}


def test_dialect_translates_the_sqlite_ddl_and_placeholders():
    assert pg_sql("SELECT * FROM t WHERE a=? AND b=?") == "SELECT * FROM t WHERE a=%s AND b=%s"
    ddl = pg_ddl("CREATE TABLE t (id INTEGER PRIMARY KEY, n INTEGER, x REAL, b BLOB)")
    assert ddl == "CREATE TABLE t (id BIGSERIAL PRIMARY KEY, n BIGINT, x DOUBLE PRECISION, b BYTEA)"
    # a table without an INTEGER PRIMARY KEY gets SQLite's implicit rowid made explicit
    assert (pg_ddl("CREATE TABLE c (a TEXT, PRIMARY KEY (a))")
            == "CREATE TABLE c (rowid BIGSERIAL, a TEXT, PRIMARY KEY (a))")
    assert pg_ddl("CREATE UNIQUE INDEX i ON t(a, ifnull(b, -1))") == "CREATE UNIQUE INDEX i ON t(a, coalesce(b, -1))"
    assert redact("postgresql://fleet:s3cret@db.local/fleet") == "postgresql://fleet:***@db.local/fleet"


def test_postgres_schema_is_versioned_and_foreign_or_newer_databases_are_refused(pg_cluster):
    url = pg_cluster.create_db()
    with open_fleet_store(url) as s:
        assert s.schema_version == len(MIGRATIONS) == 5
    with open_fleet_store(url) as s:  # reopening migrates nothing
        assert s.schema_version == 5
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("UPDATE edgetune_store SET version = 99")
    with pytest.raises(DBTooNew, match="v99, newer"):
        open_fleet_store(url)
    foreign = pg_cluster.create_db()
    with psycopg.connect(foreign, autocommit=True) as c:
        c.execute("CREATE TABLE invoices (id int)")
    with pytest.raises(DBForeign, match="not an edgetune fleet DB"):
        open_fleet_store(foreign)
    with psycopg.connect(foreign, autocommit=True) as c:
        assert c.execute("SELECT count(*) FROM information_schema.tables WHERE table_schema='public'").fetchone()[0] == 1


def test_unreachable_postgres_is_a_typed_error_naming_the_database():
    url = "postgresql://fleet:pw@127.0.0.1:1/fleet"
    with pytest.raises(DBUnavailable, match=r"fleet DB postgresql://fleet:\*\*\*@127\.0\.0\.1:1/fleet cannot be"):
        open_fleet_store(url)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_retention_prunes_old_telemetry_only(backend, tmp_path, request):
    db = tmp_path / "f.db" if backend == "sqlite" else request.getfixturevalue("pg_url")
    topic = "edgetune/v1/dev-1/telemetry"
    now = time.time()
    with open_fleet_store(db) as s:
        for seq in range(30):  # 20 samples received 40 days ago, 10 today
            ingest(s, topic, json.dumps(telemetry(seq)).encode(), now=now - 40 * 86400 if seq < 20 else now)
        ingest(s, "edgetune/v1/dev-1/tuning/record", json.dumps(record(1)).encode(), now=now - 40 * 86400)
    pruner = Pruner(db, retention_days=30)
    assert pruner.prune_once() == 20 and pruner.prune_once() == 0
    with open_fleet_store(db) as s:
        assert [t["seq"] for t in s.telemetry("dev-1")] == list(range(20, 30))
        assert len(s.records("dev-1")) == 1  # records are training data: never pruned


def _sharing(mosquitto, url: str, n: int) -> list[Listener]:
    group = f"g{uuid.uuid4().hex[:6]}"
    out = [Listener(opts(mosquitto), url, client_id=f"fleet-share-{i}-{group}", share=group).start() for i in range(n)]
    for lst in out:
        assert lst.subscribed.wait(T), "receiver did not subscribe"
        assert f"$share/{group}/edgetune/v1/+/status" in lst.subscriptions
    return out


def test_two_receivers_sharing_a_subscription_store_every_message_once(mosquitto, pg_url):
    receivers = _sharing(mosquitto, pg_url, 2)
    devices = [Device(mosquitto, f"share-{i}") for i in range(4)]
    try:
        sent = 0
        for seq in range(60):
            for d in devices:
                d.pub("telemetry", telemetry(seq))
                sent += 1
        for i, d in enumerate(devices):
            d.pub("tuning/record", record(i + 1))
            d.pub("tuning/record", record(i + 1))  # an outbox re-send: stored once, counted as a copy
            d.pub("status", {"state": "online", "session": 1, "version": "0.1.0", "ts": time.time()})
            sent += 3
        done = lambda: sum(r.counts["messages"] for r in receivers) >= sent  # noqa: E731
        assert receivers[0].wait_for(lambda c: done(), T) or receivers[1].wait_for(lambda c: done(), T)
        assert all(r.counts["messages"] > 0 for r in receivers), [dict(r.counts) for r in receivers]
        assert sum(r.counts["messages"] for r in receivers) == sent  # each message went to exactly one of them
    finally:
        for d in devices:
            d.close()
        for r in receivers:
            r.stop()
    with open_fleet_store(pg_url) as s:
        counts = s.counts()
        assert counts["telemetry"] == 240 and counts["records"] == 4 and counts["devices"] == 4
        assert all(r["copies"] == 2 for r in s.records())
        assert all(d["state"] == "online" for d in s.devices())


def test_postgres_going_away_stops_acks_and_nothing_is_lost(mosquitto, tmp_path):
    """The receiver keeps running while PostgreSQL is down, acknowledges nothing it could not store, and once
    the server is back every message published meanwhile is in the DB, each once."""
    from tests.pg import PgCluster, missing_reason

    if missing_reason():
        pytest.skip(missing_reason())
    cluster = PgCluster().init()
    try:
        url = cluster.create_db()
        lst = Listener(opts(mosquitto), url, client_id=f"fleet-pgdown-{uuid.uuid4().hex[:6]}").start()
        dev = Device(mosquitto, "pgdown")
        try:
            assert lst.subscribed.wait(T)
            for seq in range(10):
                dev.pub("telemetry", telemetry(seq))
            assert lst.wait_for(lambda c: c["telemetry"] >= 10, T), dict(lst.counts)
            cluster.stop()
            for seq in range(10, 30):
                dev.pub("telemetry", telemetry(seq))
            dev.pub("tuning/record", record(5))
            assert lst.wait_for(lambda c: c["retry"] >= 1, T), dict(lst.counts)
            assert lst.alive
            cluster.start()
            assert lst.wait_for(lambda c: c["telemetry"] >= 30 and c["record"] >= 1, 60), dict(lst.counts)
        finally:
            dev.close()
            lst.stop()
        with open_fleet_store(url) as s:
            assert [t["seq"] for t in s.telemetry("pgdown")] == list(range(30))
            assert len(s.records("pgdown")) == 1
    finally:
        cluster.destroy()


def test_config_check_knows_the_fleet_section(tmp_path):
    from edgetune.config import load

    cfg = tmp_path / "edgetune.toml"
    cfg.write_text('[fleet]\ndatabase = "postgresql://fleet@db.local/fleet"\nshare_group = "a/b"\nretention_days = 0\n')
    problems = {p.key: p.message for p in load(cfg).problems}
    assert set(problems) == {"fleet.share_group", "fleet.retention_days"}, problems
    assert "without / + or #" in problems["fleet.share_group"]
    cfg.write_text('[fleet]\ndatabase = "postgresql://fleet@db.local/fleet"\nshare_group = "fleet"\n')
    loaded = load(cfg)
    assert loaded.problems == [] and loaded.config.fleet.db == "postgresql://fleet@db.local/fleet"


def test_auth_db_is_a_store_on_the_sqlite_base(tmp_path):
    import sqlite3

    from edgetune.errors import BadInput
    from fleet.tokens import TokenStore

    with TokenStore(tmp_path / "auth" / "a.db") as s:
        token, secret = s.create("operator", "ops")
        assert s.verify(secret) == token and s.schema_version == 2
        with pytest.raises(BadInput, match="'ops': a token of that name exists"):
            s.create("viewer", "ops")
        assert [t.name for t in s.list()] == ["ops"]
        assert s.session_key() == s.session_key()
        s.end_session("gone", time.time() - 1)  # expired: the next logout prunes it
        s.end_session("live", time.time() + 3600)
        assert not s.session_ended("gone") and s.session_ended("live") and not s.session_ended("other")
    foreign = tmp_path / "foreign.db"
    sqlite3.connect(foreign).execute("CREATE TABLE x (y)").connection.commit()
    with pytest.raises(DBForeign, match="not an edgetune fleet auth DB.*auth_database"):
        TokenStore(foreign)
