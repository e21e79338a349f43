"""The daemon across stops, restarts, a full disk and a recovered state file, as real processes against a real
mosquitto: firmware retunes survive a stop, a stop while a tune starts is an interruption, commands that arrive
while it stops get one terminal status, a full disk mid-tune pauses the job instead of killing the tuner, and a
fresh daemon.db never repeats session or telemetry ids."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import threading

from edgetune.protocol import TERMINAL_STATES
from tests.polling import wait_until
from tests.test_daemon_support import WORKLOAD_PW4, Bus, DaemonProc, daemon_config

DEV = "edgetune/v1/dev-test"
T = 120


def online(session: int | None = None):
    return lambda s: s["state"] == "online" and (session is None or s["session"] == session)


def test_a_firmware_retune_interrupted_by_a_stop_runs_again_at_the_next_start(tmp_path, mosquitto):
    """The marker was removed as soon as the retune was journaled: a stop while it waited for idle lost it."""
    d = DaemonProc(daemon_config(tmp_path, mosquitto, idle_load_threshold=1e-9))  # never idle: it waits
    marker = d.state_dir / "firmware-changed"
    assert d.cli("notify", "firmware-changed", "--source", "mender").returncode == 0  # daemon down: the marker
    bus = Bus(mosquitto, (f"{DEV}/status", f"{DEV}/cmd/res/#"))
    d.start()
    try:
        d.wait_status(lambda s: s["state"] == "waiting-idle", T)
        first = json.loads(marker.read_text())
        assert first["source"] == "mender" and first["command"].startswith("firmware-hook-")
        assert d.signal(signal.SIGTERM) == 0
        assert bus.on(f"/cmd/res/{first['command']}", lambda c: c["status"] == "failed")["reason"] == "interrupted"
        assert json.loads(marker.read_text())["command"] == first["command"]  # still pending

        daemon_config(tmp_path, mosquitto)  # idle enough now
        d.start()
        done = bus.on("/cmd/res/", lambda c: c["origin"] == "firmware-hook" and c["id"] != first["command"]
                      and c["status"] in TERMINAL_STATES, T)
        assert done["status"] == "succeeded" and done["note"] == "firmware changed (mender)", done
        wait_until(lambda: not marker.exists(), "the finished firmware retune to remove the marker")
        assert d.signal(signal.SIGTERM) == 0
    finally:
        d.stop()
        bus.close()


def test_a_stop_while_the_tune_child_starts_is_an_interruption(tmp_path, mosquitto):
    """SIGTERM before the child installed its handler ended it with -15: reported as a tune failure."""
    d = DaemonProc(daemon_config(tmp_path, mosquitto)).start()
    bus = Bus(mosquitto, (f"{DEV}/status", f"{DEV}/cmd/res/#"))
    try:
        d.wait_status(lambda s: s["state"] == "idle" and s.get("last_tune"), T)
        bus.publish(f"{DEV}/cmd/req", json.dumps({"id": "early", "op": "retune", "args": {"force": True}}))
        bus.on("/cmd/res/early", lambda c: c["status"] == "in_progress")  # the child is being started
        assert d.signal(signal.SIGTERM) == 0
        final = bus.on("/cmd/res/early", lambda c: c["status"] in TERMINAL_STATES)
        assert (final["status"], final["reason"]) == ("failed", "interrupted"), final
        assert "exited with code" not in d.log
    finally:
        d.stop()
        bus.close()


def _flood(bus: Bus, stop: threading.Event, sent: list[str]) -> None:
    """Pings until told to stop, each once the previous one was answered (or after 1 s without an answer: the
    daemon is down), so the flood spans the whole stop without queueing thousands for the restart."""
    pub = Bus(bus.broker, ())
    try:
        while not stop.is_set():
            cid, mark = f"fl-{len(sent)}", len(bus.msgs)
            pub.publish(f"{DEV}/cmd/req", json.dumps({"id": cid, "op": "ping"}))
            sent.append(cid)
            try:
                bus.wait(lambda m, cid=cid: m.topic.endswith(f"/cmd/res/{cid}"), 1.0, since=mark)
            except AssertionError:
                pass
    finally:
        pub.close()


def test_commands_arriving_while_the_daemon_stops_get_exactly_one_terminal_status(tmp_path, mosquitto):
    """Pings flooding in during SIGTERM were accepted, then answered `internal error: RuntimeError` (the ops pool
    was shut down) on cmd/res/invalid, then `failed/interrupted` after the restart."""
    d = DaemonProc(daemon_config(tmp_path, mosquitto)).start()
    bus = Bus(mosquitto, (f"{DEV}/status", f"{DEV}/cmd/res/#"))
    stop, sent = threading.Event(), []
    flood = threading.Thread(target=_flood, args=(bus, stop, sent))
    try:
        bus.on("/status", online(1))
        flood.start()
        bus.on("/cmd/res/fl-20", lambda c: c["status"] == "succeeded")
        assert d.signal(signal.SIGTERM) == 0
        stop.set()
        flood.join(30)
        d.start()
        bus.on("/status", online(2))
        last = sent[-1]
        bus.on(f"/cmd/res/{last}", lambda c: c["status"] in TERMINAL_STATES)  # the queued ones are handled too
        finals: dict[str, set] = {}
        for m in bus.msgs:
            if "/cmd/res/" in m.topic and m.doc["status"] in TERMINAL_STATES:
                finals.setdefault(m.topic.rsplit("/", 1)[1], set()).add(m.doc["status"])
        assert "invalid" not in finals, [m.doc for m in bus.msgs if m.topic.endswith("/invalid")]
        assert {c: s for c, s in finals.items() if len(s) > 1} == {}
        assert set(sent) <= set(finals)
        assert "Traceback" not in d.log
    finally:
        stop.set()
        d.stop()
        bus.close()


def test_a_full_disk_mid_tune_pauses_the_job_and_resumes_it(tmp_path, mosquitto):
    """DBFull from the tuner thread's journal or outbox writes killed the thread: its commands stayed open for
    good and status said idle with a job queued."""
    from tests.test_delivery import fill, tmpfs

    with tmpfs(tmp_path / "fs", "16m") as fs:
        d = DaemonProc(daemon_config(tmp_path, mosquitto, WORKLOAD_PW4, telemetry_interval_s=0.2),
                       env={**os.environ, "STATE_DIRECTORY": str(fs)}).start()
        try:
            d.wait_status(lambda s: s["state"] == "idle" and s.get("last_tune"), T)
            cid = d.request({"op": "retune", "force": True, "budget": 40, "strategy": "random"})["id"]
            d.wait_status(lambda s: s["job"] and s["job"]["progress"] > 0, T)
            filler = fill(fs)
            d.wait_status(lambda s: s["state"] == "paused", T)
            filler.unlink()
            d.wait_status(lambda s: s["state"] == "idle" and s["job"] is None and s["queue"]["jobs"] == 0, T)
            with sqlite3.connect(d.state_dir / "daemon.db") as db:
                status = db.execute("SELECT status FROM commands WHERE id=?", (cid,)).fetchone()[0]
            assert status in TERMINAL_STATES, status
            again = d.request({"op": "retune", "force": True, "budget": 2})["id"]  # the tuner still works
            wait_until(lambda: _status(d, again) in TERMINAL_STATES, "a retune after the disk had space again", T)
            assert _status(d, again) == "succeeded"
            assert "Exception in thread" not in d.log and "paused: disk full" in d.log
            assert d.signal(signal.SIGTERM) == 0
        finally:
            d.stop()


def _status(d: DaemonProc, cid: str) -> str:
    with sqlite3.connect(d.state_dir / "daemon.db") as db:
        return db.execute("SELECT status FROM commands WHERE id=?", (cid,)).fetchone()[0]


def test_a_recovered_daemon_db_repeats_no_session_and_no_telemetry_id(tmp_path, mosquitto):
    """A corrupt daemon.db moved aside restarted session at 1 and seq at 0 under the same boot_id: the fleet,
    deduplicating on (device, boot_id, seq), silently dropped the new samples."""
    bus = Bus(mosquitto, (f"{DEV}/status", f"{DEV}/telemetry"))
    d = DaemonProc(daemon_config(tmp_path, mosquitto, telemetry_interval_s=0.2)).start()
    try:
        bus.on("/status", online(1))
        bus.on("/telemetry", lambda t: t["seq"] >= 2)
        assert d.signal(signal.SIGTERM) == 0
        for name in ("daemon.db", "daemon.db-wal", "daemon.db-shm"):
            (d.state_dir / name).unlink(missing_ok=True)
        (d.state_dir / "daemon.db").write_bytes(b"this is not a database " * 200)
        mark = len(bus.msgs)
        d.start()
        restarted = bus.on("/status", lambda s: s["state"] == "online" and s["session"] != 1)
        assert restarted["session"] > 2
        bus.wait(lambda m: m.topic.endswith("/telemetry") and m.doc["seq"] >= 1, T, since=mark)
        ids = [(t["boot_id"], t["seq"]) for t in bus.docs("/telemetry")]
        assert len(ids) == len(set(ids)), ids
        assert d.signal(signal.SIGTERM) == 0
    finally:
        d.stop()
        bus.close()
