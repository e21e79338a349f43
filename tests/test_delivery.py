"""Issue 23, "nothing lost between device and fleet": each numbered fault case reproduced against a real mosquitto,
real daemons (tests/test_daemon_support.py) and the real fleet listener, waiting on events, never sleeping."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from edgetune.broker import BrokerSettings
from edgetune.protocol import Topics, encode
from fleet.listener import Listener
from fleet.store import FleetStore
from tests.broker import Mosquitto
from tests.polling import wait_until
from tests.test_daemon_support import Bus, DaemonProc, daemon_config

T = 60.0
DEV = "dev-test"


def settings(broker: Mosquitto) -> BrokerSettings:
    return BrokerSettings(host=broker.host, port=broker.port, reconnect_min_s=0.05, reconnect_max_s=0.5)


def listener(broker: Mosquitto, db: Path, client_id: str = "fleet-e2e") -> Listener:
    lst = Listener(settings(broker), db, client_id=client_id).start()
    assert lst.subscribed.wait(T), "listener did not subscribe"
    return lst


def stops_cleanly(d: DaemonProc) -> None:
    """SIGTERM ends it with 0, and nothing it logged was a traceback."""
    assert d.signal(15) == 0
    assert "Traceback" not in d.log, d.log[-3000:]


@contextmanager
def tmpfs(path: Path, size: str = "2m") -> Iterator[Path]:
    """A small real file system, so a full disk is the real thing (the tests run as root)."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> Path:
    """Fill the file system holding `path` to the last byte."""
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for chunk in (65536, 512, 1):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


# ---- 1: a broker outage with default queues loses no tuning record and no command result --------------------------

def test_records_and_results_stay_on_the_device_until_the_fleet_committed_them(tmp_path):
    """The broker's queue for the absent fleet overflows (mosquitto drops what does not fit, as in the issue's
    651 s outage); the device resends what the fleet did not acknowledge, and telemetry loss shows as gaps."""
    broker = Mosquitto(tmp_path / "broker", extra_conf=["max_queued_messages 3"]).start()
    db = tmp_path / "fleet.db"
    listener(broker, db).stop()  # the fleet's persistent session exists, and the fleet is away
    d = DaemonProc(daemon_config(tmp_path, broker, telemetry_interval_s=0.1, outbox={"resend_s": 1.0})).start()
    try:
        d.wait_status(lambda s: s.get("broker", {}).get("subscribed"), T)
        retune = d.request({"op": "retune", "force": True, "budget": 2})
        st = d.wait_status(lambda s: s["state"] == "idle" and s["last_tune"] is not None
                           and s["outbox"]["awaiting_fleet_ack"] >= 2, T)
        assert st["outbox"]["awaiting_fleet_ack"] >= 2  # the record and the final response: broker has, fleet not
        wait_until(lambda: "Outgoing messages are being dropped" in (broker.workdir / "mosquitto.log").read_text(),
                   "the broker dropping the fleet's queued messages", T)

        lst = listener(broker, db)
        try:
            assert lst.wait_for(lambda c: c["record"] >= 1 and c["cmd_res:succeeded"] >= 1, T), dict(lst.counts)
            d.wait_status(lambda s: s["outbox"]["awaiting_fleet_ack"] == 0 and s["outbox"]["messages"] == 0, T)
        finally:
            lst.stop()
    finally:
        d.stop()
        broker.stop()
    with sqlite3.connect(d.state_dir / "results.db") as r:
        ended = r.execute("SELECT count(*) FROM sessions WHERE state != 'running'").fetchone()[0]
    with FleetStore(db) as s:
        assert len(s.records(DEV)) == ended >= 2  # the start-up tune and the forced retune
        assert s.command(DEV, retune["id"])["status"] == "succeeded"
        gaps = s.telemetry_gaps()[DEV]
        assert gaps["missing"] > 0 and gaps["received"] > 0  # dropped telemetry is detected, not silent


# ---- 2: a fleet DB that cannot store stops acknowledging, alarms, and resumes ---------------------------------------

def test_a_full_fleet_db_alarms_acknowledges_nothing_and_resumes_when_space_returns(tmp_path, mosquitto,
                                                                                   monkeypatch, caplog):
    import fleet.listener

    # expiring commands every turn: on a full disk a no-op UPDATE still commits, which must not end the alarm
    monkeypatch.setattr(fleet.listener, "EXPIRE_EVERY_S", 0.0)
    caplog.set_level(logging.INFO, logger="fleet.listener")
    with tmpfs(tmp_path / "fs") as fs:
        db = fs / "fleet.db"
        lst = listener(mosquitto, db)
        try:
            bus = Bus(mosquitto, ("edgetune/v1/+/ack",))
            dev = Topics("dev-full")
            filler = fill(fs)
            for i in range(30):
                bus.publish(dev.telemetry, encode({"seq": i, "boot_id": "b", "pad": "x" * 2000}))
            bus.publish(dev.record, encode({"record_id": "r1", "kernel": "gemm", "workload": "w", "started_at": 1.0,
                                            "measurements": [{"seq": i, "pad": "y" * 500} for i in range(50)]}))
            assert lst.wait_for(lambda c: c["retry"] >= 4, T), dict(lst.counts)
            assert lst.alarm and "disk full" in lst.alarm
            said = [r.getMessage() for r in caplog.records if r.name == "fleet.listener"]
            assert [m for m in said if "stopped: the fleet DB" in m] and not [m for m in said if "resumed" in m], said
            assert bus.docs("/ack") == []  # nothing committed, nothing acknowledged to the device
            filler.unlink()
            assert lst.wait_for(lambda c: c["telemetry"] >= 30 and c["record"] >= 1, T), dict(lst.counts)
            assert lst.alarm is None
            assert bus.on("/ack", lambda a: a["keys"] == ["record:r1"])
            bus.close()
        finally:
            lst.stop()
        with FleetStore(db) as s:
            assert len(s.telemetry("dev-full")) == 30 and len(s.records("dev-full")) == 1


def test_the_listener_logs_a_fleet_db_outage_once_reminds_and_says_when_it_is_back(mosquitto, caplog):
    """It logged a PostgreSQL outage once and never again: no reminder while it lasted, and no line when it ended
    if no batch had to be stored. Now fleet.downlog, as the rollout controller: once, a reminder at most every
    `remind_s` (a minute; a second here, for a short outage), and once when the DB is back."""
    from tests.pg import PgCluster, missing_reason

    if missing_reason():
        pytest.skip(missing_reason())
    caplog.set_level(logging.INFO, logger="fleet.listener")
    cluster = PgCluster().init()
    try:
        lst = listener(mosquitto, cluster.create_db(), client_id="fleet-pg-outage")
        bus = Bus(mosquitto, ())
        try:
            lst.db_down.remind_s = 1.0
            cluster.stop()
            bus.publish(Topics("dev-pg").telemetry, encode({"seq": 0, "boot_id": "b"}))  # resent on each reconnect
            wait_until(lambda: lst.db_down.failures >= 8, lambda: f"8 failed writes ({dict(lst.counts)})", T)
            failures = lst.db_down.failures
            cluster.start()
            wait_until(lambda: lst.counts["telemetry"] >= 1 and lst.alarm is None, "the telemetry stored", T)
        finally:
            bus.close()
            lst.stop()
    finally:
        cluster.destroy()
    lines = [r.getMessage() for r in caplog.records if r.name == "fleet.listener" and "the fleet DB" in r.getMessage()]
    assert lines[0].startswith("ALARM storing and acknowledging stopped: the fleet DB "), lines
    reminders = [line for line in lines if line.startswith("ALARM storing and acknowledging still stopped: ")]
    assert 1 <= len(reminders) < failures - 1, lines  # reminded, but not on every failed write
    assert len(lines) == 2 + len(reminders), lines
    assert lines[-1].startswith("storing and acknowledging resumed: the fleet DB ") and "works again" in lines[-1]


def test_damaged_fleet_db_pages_are_a_db_error_not_a_malformed_payload(tmp_path, mosquitto):
    db = tmp_path / "fleet.db"
    with FleetStore(db) as s:
        for i in range(200):
            s.put_telemetry("dev-x", {"seq": i, "boot_id": "b", "ts": 1.0, "state": "idle",
                                      **dict.fromkeys(("cpu_percent", "load1", "temp_c", "freq_mhz", "mem_used",
                                                       "rss"))}, {"pad": "z" * 400}, 1.0, 1.0)
    with sqlite3.connect(db) as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        # telemetry's pages but its root (the schema's pages lie among them: where, depends on the migrations)
        damaged = [p for (p,) in c.execute("SELECT pageno FROM dbstat WHERE name='telemetry' AND pageno !="
                                           " (SELECT rootpage FROM sqlite_master WHERE name='telemetry')")]
    raw = bytearray(db.read_bytes())
    page = 4096
    assert len(damaged) >= 10
    for p in damaged:
        raw[(p - 1) * page: (p - 1) * page + 200] = os.urandom(200)
    db.write_bytes(bytes(raw))
    lst = listener(mosquitto, db, client_id="fleet-damaged")
    bus = Bus(mosquitto, ())
    try:
        for i in range(200, 205):
            bus.publish(Topics("dev-x").telemetry, encode({"seq": i, "boot_id": "b"}))
        assert lst.wait_for(lambda c: c["retry"] >= 1, T), dict(lst.counts)
        assert lst.alarm and "corrupt" in lst.alarm and lst.counts["malformed"] == 0
    finally:
        bus.close()
        lst.stop()
    # a fresh DB under the same session gets every message the damaged one could not take
    fresh = tmp_path / "fresh.db"
    lst = listener(mosquitto, fresh, client_id="fleet-damaged")
    try:
        assert lst.wait_for(lambda c: c["telemetry"] >= 5, T), dict(lst.counts)
    finally:
        lst.stop()


def test_the_listener_reconnect_backoff_is_capped_at_a_few_seconds(mosquitto, tmp_path):
    lst = Listener(BrokerSettings(host=mosquitto.host, port=mosquitto.port, reconnect_max_s=60.0),
                   tmp_path / "fleet.db")
    try:
        assert lst.settings.reconnect_max_s <= 5.0
    finally:
        lst.store.close()


# ---- 3: a full disk pauses the daemon, which resumes when space returns ------------------------------------------

def test_a_full_disk_pauses_telemetry_and_tuning_and_space_resumes_them(tmp_path, mosquitto):
    with tmpfs(tmp_path / "fs") as fs:
        bus = Bus(mosquitto, (f"edgetune/v1/{DEV}/telemetry",))
        d = DaemonProc(daemon_config(tmp_path, mosquitto, telemetry_interval_s=0.2),
                       env={**os.environ, "STATE_DIRECTORY": str(fs)}).start()
        try:
            d.wait_status(lambda s: s["state"] == "idle" and s["last_tune"] is not None, T)
            filler = fill(fs)
            st = d.wait_status(lambda s: s["state"] == "paused", T)
            assert "disk full" in st["paused"]
            d.request({"op": "retune", "force": True, "budget": 2})  # accepted or refused, never a crash
            filler.unlink()
            st = d.wait_status(lambda s: s["state"] != "paused" and s["paused"] is None, T)
            since = len(bus.msgs)
            bus.wait(lambda m: True, T, "telemetry after the disk had space again", since=since)
            assert "paused: disk full" in d.log and "resuming" in d.log
            stops_cleanly(d)
        finally:
            d.stop()
            bus.close()


def test_a_daemon_started_on_a_full_disk_waits_paused_then_starts(tmp_path):
    with tmpfs(tmp_path / "fs") as fs:
        filler = fill(fs)
        d = DaemonProc(daemon_config(tmp_path, None), env={**os.environ, "STATE_DIRECTORY": str(fs)}).start()
        try:
            st = d.wait_status(lambda s: s["state"] == "paused", T)
            assert "disk full" in st["paused"]
            filler.unlink()
            d.wait_status(lambda s: s["state"] == "idle" and s["last_tune"] is not None, T)
            stops_cleanly(d)
        finally:
            d.stop()


# ---- 4: corrupt DBs: the re-derivable ones are moved aside, the results DB stops the daemon with its fix ---------

def test_corrupt_daemon_and_outbox_dbs_are_moved_aside_and_started_afresh(tmp_path):
    state = Path(os.environ["STATE_DIRECTORY"])
    state.mkdir(parents=True, exist_ok=True)
    for name in ("daemon.db", "outbox.db"):
        (state / name).write_bytes(b"this is not a database " * 200)
    d = DaemonProc(daemon_config(tmp_path, None)).start()
    try:
        d.wait_status(lambda s: s["state"] == "idle", T)
        for name in ("daemon.db", "outbox.db"):
            aside = list(state.glob(f"{name}.broken-*"))
            assert len(aside) == 1 and aside[0].read_bytes().startswith(b"this is not a database")
            assert f"{state / name} is corrupt" in d.log and f"moved it aside to {aside[0]}" in d.log
        stops_cleanly(d)
    finally:
        d.stop()


def test_a_corrupt_results_db_stops_the_daemon_naming_a_fix_it_accepts(tmp_path):
    state = Path(os.environ["STATE_DIRECTORY"])
    state.mkdir(parents=True, exist_ok=True)
    (state / "results.db").write_bytes(b"garbage " * 1000)
    d = DaemonProc(daemon_config(tmp_path, None)).start()
    try:
        assert d.proc.wait(T) == 78  # the unit's RestartPreventExitStatus: no restart loop
        log = d.log
        assert "results DB" in log and "is corrupt" in log and "edgetune daemon --reset" in log
        assert "Traceback" not in log and "cannot join thread" not in log
        d.start("--reset")  # the fix the message names
        d.wait_status(lambda s: s["state"] == "idle" and s["last_tune"] is not None, T)
        assert [p.read_bytes()[:8] for p in state.glob("results.db.broken-*")] == [b"garbage "]
        stops_cleanly(d)
    finally:
        d.stop()


# ---- 6: interrupted forced sessions resume, or are closed `interrupted` and published -----------------------------

def test_interrupted_forced_tunes_resume_or_are_closed_and_published(tmp_path, mosquitto):
    from tests.test_daemon_support import WORKLOAD_PW4

    bus = Bus(mosquitto, (f"edgetune/v1/{DEV}/tuning/record",))
    d = DaemonProc(daemon_config(tmp_path, mosquitto, workload=WORKLOAD_PW4)).start()
    results = Path(os.environ["STATE_DIRECTORY"]) / "results.db"

    def running() -> tuple[int, int]:
        """The unfinished session and its journaled search measurements (a kill may also land in its finals)."""
        with sqlite3.connect(results) as db:
            return db.execute("SELECT s.id, count(m.id) FROM sessions s JOIN measurements m ON m.session_id = s.id "
                              "WHERE s.state='running' AND m.phase='search' GROUP BY s.id").fetchone()

    def forced(budget: int) -> None:
        d.request({"op": "retune", "force": True, "budget": budget})
        # early in the search, so the kill lands mid-session and not in the finals
        d.wait_status(lambda s: "kws_dscnn.pw4 best" in ((s.get("job") or {}).get("message") or "")
                      and s["job"]["progress"] < 0.5, 120)
        d.kill9()

    try:
        d.wait_status(lambda s: s["state"] == "idle" and s["last_tune"] is not None, 120)  # the start-up tune
        forced(30)
        sid, done = running()
        d.start()
        d.wait_status(lambda s: s["state"] == "idle", T)
        forced(30)  # the same forced retune again: it resumes the interrupted session instead of starting over
        assert f"resuming session {sid}" in d.log
        sid2, done2 = running()
        assert sid2 == sid and done2 >= done

        d.start()
        d.wait_status(lambda s: s["state"] == "idle", T)
        d.request({"op": "retune", "force": True, "budget": 2, "wait": False})  # other params: supersedes it
        d.wait_status(lambda s: s["state"] == "idle" and s["last_tune"]["evals"] == 2
                      and s["outbox"]["messages"] == s["outbox"]["awaiting_fleet_ack"],
                      120)  # all sent (no fleet receiver here to ack them)
        with sqlite3.connect(results) as db:
            sessions = dict(db.execute("SELECT id, state FROM sessions").fetchall())
        assert "running" not in sessions.values() and sessions[sid] in ("interrupted", "done")
        recs = {r["id"]: r for r in bus.docs("/tuning/record")}
        assert set(recs) == set(sessions)  # every session, the interrupted one too, reached the fleet
        assert recs[sid]["state"] == sessions[sid]
        assert len([m for m in recs[sid]["measurements"] if m["phase"] == "search"]) >= done2
        if sessions[sid] == "interrupted":  # else the orphaned child finished it before it saw the kill
            assert "closed 1 earlier unfinished session(s)" in d.log
        stops_cleanly(d)
    finally:
        d.stop()
        bus.close()


# ---- 5: commands reach a device that was away, or are marked expired --------------------------------------------

def test_a_command_sent_while_the_device_is_away_reaches_it_when_it_returns(tmp_path, mosquitto):
    """The test config's will delay is 0: before, the session ended with the will, and the command with it."""
    from fleet.commands import new_command

    d = DaemonProc(daemon_config(tmp_path, mosquitto)).start()
    bus = Bus(mosquitto, (f"edgetune/v1/{DEV}/cmd/res/#",))
    try:
        d.wait_status(lambda s: s.get("broker", {}).get("subscribed") and s["state"] == "idle", T)
        d.kill9()
        cmd = new_command("ping", ttl_s=600)
        bus.publish(Topics(DEV).cmd_req, encode(cmd))
        d.start()
        assert bus.on(f"/cmd/res/{cmd['id']}", lambda r: r["status"] == "succeeded", T)["result"]["pong"]
        stops_cleanly(d)
    finally:
        d.stop()
        bus.close()


def test_a_command_nobody_answers_is_marked_expired_in_the_fleet_db_and_on_the_cli(tmp_path, mosquitto):
    from fleet.commands import new_command

    db = tmp_path / "fleet.db"
    lst = listener(mosquitto, db)
    bus = Bus(mosquitto, ())
    try:
        cmd = new_command("ping", ttl_s=0.5)
        bus.publish(Topics("dev-gone").cmd_req, encode(cmd))
        assert lst.wait_for(lambda c: c["expired"] >= 1, T), dict(lst.counts)
    finally:
        bus.close()
        lst.stop()
    with FleetStore(db) as s:
        assert s.command("dev-gone", cmd["id"])["status"] == "expired"
    r = subprocess.run([sys.executable, "-m", "edgetune.main", "fleet", "show", "dev-gone", "--db", str(db)],
                       capture_output=True, text=True, timeout=T)
    assert r.returncode == 0 and "expired" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "edgetune.main", "fleet", "retune", "dev-gone", "--broker",
                        f"{mosquitto.host}:{mosquitto.port}", "--ttl", "0.2", "--wait", "--timeout", "2"],
                       capture_output=True, text=True, timeout=T)
    assert r.returncode == 1 and "expired" in r.stdout + r.stderr, r.stdout + r.stderr


def test_nan_and_infinite_expires_at_are_rejected(tmp_path, mosquitto):
    d = DaemonProc(daemon_config(tmp_path, mosquitto)).start()
    bus = Bus(mosquitto, (f"edgetune/v1/{DEV}/cmd/res/#",))
    try:
        d.wait_status(lambda s: s.get("broker", {}).get("subscribed"), T)
        for i, bad in enumerate(("NaN", "Infinity", "-Infinity")):
            bus.publish(Topics(DEV).cmd_req, f'{{"id": "bad-{i}", "op": "ping", "expires_at": {bad}}}')
            r = bus.on(f"/cmd/res/bad-{i}", lambda r: r["status"] in ("rejected", "succeeded"), T)
            assert r["status"] == "rejected" and "bad expires_at" in r["reason"]
    finally:
        d.stop()
        bus.close()


# ---- 7: the smaller cases -----------------------------------------------------------------------------------------

def test_plaintext_mqtt_at_a_tls_port_says_why(tmp_path):
    from tests.broker import make_certs

    certs = make_certs(tmp_path)
    broker = Mosquitto(tmp_path / "broker", extra_conf=[
        f"cafile {certs['ca.crt']}", f"certfile {certs['server.crt']}", f"keyfile {certs['server.key']}"]).start()
    d = DaemonProc(daemon_config(tmp_path, broker)).start()
    try:
        st = d.wait_status(lambda s: (s.get("broker") or {}).get("last_error") is not None, T)
        assert "set [mqtt] tls" in st["broker"]["last_error"], st["broker"]
        assert not st["broker"]["connected"]
    finally:
        d.stop()
        broker.stop()


def test_config_check_warns_about_a_password_without_tls_in_a_world_readable_file(tmp_path, mosquitto):
    cfg = daemon_config(tmp_path, mosquitto, mqtt={"username": "edge", "password": "s3cret"})
    cfg.chmod(0o644)
    d = DaemonProc(cfg)
    r = d.cli("config", "check", "--config", str(cfg), "--json")
    assert r.returncode == 0, r.stderr
    warnings = json.loads(r.stdout)["warnings"]
    assert any("clear text" in w and "TLS" in w for w in warnings), warnings
    assert any(f"chmod 600 {cfg}" in w for w in warnings), warnings
    cfg.chmod(0o600)
    warnings = json.loads(d.cli("config", "check", "--config", str(cfg), "--json").stdout)["warnings"]
    assert not any("chmod" in w for w in warnings) and len(warnings) == 1


def test_a_runtime_dir_in_tmp_owned_by_someone_else_is_refused(tmp_path, monkeypatch):
    from edgetune import paths
    from edgetune.errors import EdgetuneError

    fake = tmp_path / "shared-tmp-dir"
    fake.mkdir(mode=0o777)
    fake.chmod(0o777)
    with pytest.raises(EdgetuneError, match="not private to uid"):
        paths._private(fake)
    os.chown(fake, 4242, 4242)
    fake.chmod(0o700)
    with pytest.raises(EdgetuneError, match="owner uid 4242"):
        paths._private(fake)
    mine = tmp_path / "mine"
    assert paths._private(mine) == mine and (mine.stat().st_mode & 0o777) == 0o700


def test_kill9_leaves_no_broken_pipe_traceback_from_the_tune_child(tmp_path):
    from tests.test_daemon_support import WORKLOAD_PW4

    d = DaemonProc(daemon_config(tmp_path, None, workload=WORKLOAD_PW4, tuning={"budget": 30})).start()
    try:
        d.wait_status(lambda s: "kws_dscnn.pw4 best" in ((s.get("job") or {}).get("message") or ""), 120)
        d.kill9()
        lock = Path(os.environ["STATE_DIRECTORY"]) / "tune.lock"
        import fcntl

        with open(lock) as f:  # the orphaned child holds it until it has exited
            fcntl.flock(f, fcntl.LOCK_EX)
        assert "BrokenPipeError" not in d.log and "Traceback" not in d.log, d.log[-3000:]
    finally:
        d.stop()


def test_a_fleet_command_may_not_ask_for_a_huge_custom_shape(tmp_path, mosquitto):
    d = DaemonProc(daemon_config(tmp_path, mosquitto)).start()
    bus = Bus(mosquitto, (f"edgetune/v1/{DEV}/cmd/res/#",))
    try:
        d.wait_status(lambda s: s.get("broker", {}).get("subscribed"), T)
        huge = {"id": "huge-1", "op": "retune", "args": {"workloads": ["gemm/custom.M4000-N4000-K4000"],
                                                        "budget": 100000}}
        bus.publish(Topics(DEV).cmd_req, encode(huge))
        r = bus.on("/cmd/res/huge-1", lambda r: r["status"] != "accepted", T)
        assert r["status"] == "rejected" and "192 MB" in r["reason"] and "64 MB" in r["reason"], r
    finally:
        d.stop()
        bus.close()


def test_stale_retained_state_and_progress_are_coalesced_while_offline(tmp_path):
    broker = Mosquitto(tmp_path / "broker").start()
    d = DaemonProc(daemon_config(tmp_path, broker)).start()
    try:
        d.wait_status(lambda s: s.get("broker", {}).get("subscribed") and s["state"] == "idle", T)
        broker.stop()
        d.wait_status(lambda s: not s["broker"]["connected"], T)
        for _ in range(3):
            d.request({"op": "retune", "force": True, "budget": 2})
            d.wait_status(lambda s: s["state"] == "idle" and s["queue"]["jobs"] == 0, T)
        st = d.wait_status(lambda s: s["state"] == "idle", T)
        assert st["outbox"]["coalesced"] > 0
        with sqlite3.connect(d.state_dir / "outbox.db") as db:
            per_topic = db.execute("SELECT topic, count(*) FROM outbox WHERE replaceable = 1 AND sent_at IS NULL "
                                   "GROUP BY topic").fetchall()
        assert per_topic and all(n == 1 for _, n in per_topic), per_topic
    finally:
        d.stop()
        broker.stop()


def test_the_shipped_fleet_broker_config_is_accepted_by_mosquitto(tmp_path):
    """systemd/mosquitto-fleet.conf as shipped, on a test port, after a main config that sets persistence and its
    location as Debian's /etc/mosquitto/mosquitto.conf does (a second persistence_location stops mosquitto)."""
    conf = (Path(__file__).resolve().parent.parent / "systemd" / "mosquitto-fleet.conf").read_text()
    kept = [ln for ln in conf.splitlines() if ln.strip() and not ln.startswith("#") and not ln.startswith("listener")]
    assert any(ln.startswith("max_queued_messages") and int(ln.split()[1]) >= 100000 for ln in kept)
    broker = Mosquitto(tmp_path / "broker", extra_conf=kept).start()
    try:
        bus = Bus(broker, ("edgetune/v1/#",))
        bus.publish("edgetune/v1/dev-conf/status", encode({"state": "online"}))
        assert bus.on("/status")["state"] == "online"
        bus.close()
    finally:
        broker.stop()
