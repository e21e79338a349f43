"""The daemon as a real process against a real mosquitto: publish contract, lifecycle, will, firmware hook."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import stat
import subprocess

import pytest

from edgetune.protocol import parse_topic
from tests.polling import wait_until
from tests.test_daemon_support import Bus, DaemonProc, daemon_config, retained

DEV = "edgetune/v1/dev-test"


def test_end_to_end_publishes_contract_and_stops_offline(tmp_path, mosquitto):
    bus = Bus(mosquitto)
    d = DaemonProc(daemon_config(tmp_path, mosquitto, telemetry_interval_s=0.5)).start()
    try:
        online = bus.on("/status", lambda s: s["state"] == "online")
        assert online["session"] == 1 and online["version"] and online["ts"]

        info = bus.on("/info")
        assert info["device_id"] == "dev-test"
        assert info["hw_fingerprint"] == info["hw"]["hw_fingerprint"] and info["fw_fingerprint"]
        assert info["model"] is None or set(info["model"]) == {"name", "version", "sha256"}
        assert "gemm" in info["kernels"]
        assert set(info["commands"]) == {"retune", "probe", "report", "ping"}
        assert info["tuning"]["targets"] == ["gemm/kws_dscnn.fc"]

        active = bus.on("/config/active", lambda a: "gemm/kws_dscnn.fc" in a["kernels"])
        entry = active["kernels"]["gemm/kws_dscnn.fc"]
        assert {"config", "ms", "default_ms", "speedup", "evals", "tuning_s", "strategy"} <= set(entry)
        assert active["hw_fingerprint"] == info["hw_fingerprint"]
        assert active["fw_fingerprint"] == info["fw_fingerprint"]

        rec = bus.on("/tuning/record")
        assert rec["kernel"] == "gemm" and rec["workload"] == "kws_dscnn.fc" and rec["state"] == "done"
        assert rec["origin"] == "daemon" and rec["device_id"] == "dev-test" and rec["record_id"]
        assert len(rec["measurements"]) >= 3
        assert all({"config", "stats", "ok"} <= set(m) for m in rec["measurements"])

        tel = bus.on("/telemetry")
        assert set(tel) == {"seq", "boot_id", "ts", "cpu_percent", "load1", "temp_c", "freq_mhz", "mem_used", "rss",
                            "state"}
        assert tel["rss"] > 0 and tel["state"] in ("idle", "tuning", "waiting-idle")

        assert retained(mosquitto, f"{DEV}/info")["device_id"] == "dev-test"
        assert "gemm/kws_dscnn.fc" in retained(mosquitto, f"{DEV}/config/active")["kernels"]

        st = json.loads(d.cli("status", "--json").stdout)
        assert st["broker"]["connected"] and st["broker"]["protocol"] == "5"
        assert st["last_tune"]["target"] == "gemm/kws_dscnn.fc"
        assert d.cli("ping").returncode == 0
        sock = os.stat(os.path.join(d.env["RUNTIME_DIRECTORY"], "control.sock"))
        assert stat.S_IMODE(sock.st_mode) == 0o660

        for m in list(bus.msgs):  # every payload carries only fields the contract documents (docs/protocol.md)
            spec = parse_topic(m.topic).spec
            assert spec is not None and set(m.doc) <= set(spec.fields), (m.topic, set(m.doc) - set(spec.fields))

        assert d.signal(signal.SIGTERM) == 0
        assert retained(mosquitto, f"{DEV}/status")["state"] == "offline"
        assert "Traceback" not in d.log
    finally:
        d.stop()
        bus.close()


# A tune still running seconds after its first "best" progress message, for the signal and kill tests: random spends
# its whole budget, while llm stops after a few refinement evals (about 1 s on a fast host, so under the full
# suite's load the tune could finish before the signal lands; one CI run saw that).
MID_TUNE = {"workloads": ["gemm/kws_dscnn.pw4"], "force": True, "budget": 40, "strategy": "random"}


def test_kill9_leaves_lost_and_restart_reports_interrupted_command(tmp_path, mosquitto):
    d = DaemonProc(daemon_config(tmp_path, mosquitto)).start()
    bus = Bus(mosquitto, (f"{DEV}/status", f"{DEV}/cmd/res/#"))
    try:
        bus.on("/status", lambda s: s["state"] == "online" and s["session"] == 1)
        bus.publish(f"{DEV}/cmd/req", json.dumps({"id": "k9", "op": "retune", "args": MID_TUNE}))
        bus.on("/cmd/res/k9", lambda c: c["status"] == "in_progress" and "best" in (c["message"] or ""), 60)
        d.kill9()
        lost = bus.on("/status", lambda s: s["state"] == "lost")
        assert lost["session"] == 1
        assert retained(mosquitto, f"{DEV}/status")["state"] == "lost"
        d.start()
        bus.on("/status", lambda s: s["state"] == "online" and s["session"] == 2)
        failed = bus.on("/cmd/res/k9", lambda c: c["status"] == "failed")
        assert failed["reason"] == "interrupted"
    finally:
        d.stop()
        bus.close()


def test_sigterm_mid_tune_checkpoints_and_exits_0(tmp_path, mosquitto):
    d = DaemonProc(daemon_config(tmp_path, mosquitto)).start()
    bus = Bus(mosquitto, (f"{DEV}/status", f"{DEV}/cmd/res/#"))
    try:
        bus.on("/status", lambda s: s["state"] == "online")
        bus.publish(f"{DEV}/cmd/req", json.dumps({"id": "term", "op": "retune", "args": MID_TUNE}))
        bus.on("/cmd/res/term", lambda c: c["status"] == "in_progress" and "best" in (c["message"] or ""), 60)
        assert d.signal(signal.SIGTERM, timeout=30) == 0
        assert bus.on("/cmd/res/term", lambda c: c["status"] == "failed")["reason"] == "interrupted"
        assert bus.on("/status", lambda s: s["state"] == "offline")["session"] == 1
        with sqlite3.connect(d.state_dir / "results.db") as db:
            state, n = db.execute("SELECT s.state, count(m.id) FROM sessions s JOIN measurements m "
                                  "ON m.session_id = s.id WHERE s.workload = 'kws_dscnn.pw4'").fetchone()
        assert state == "running" and n >= 1  # checkpointed: the journaled measurements stay for a resume
    finally:
        d.stop()
        bus.close()


def test_cli_says_daemon_down(tmp_path):
    d = DaemonProc(daemon_config(tmp_path, None))
    for verb in (["status"], ["ping"], ["retune"]):
        r = d.cli(*verb)
        assert r.returncode == 1 and "not running" in r.stderr


def test_status_json_says_the_daemon_is_down_on_stdout(tmp_path):
    """`status --json` printed nothing on stdout when the daemon was down: a script reading it got no JSON."""
    d = DaemonProc(daemon_config(tmp_path, None))
    sock = os.path.join(d.env["RUNTIME_DIRECTORY"], "control.sock")
    r = d.cli("status", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and (doc["running"], doc["socket"], doc["reason"]) == (False, sock, "no control socket")
    assert "the edgetune daemon is not running" in doc["error"] and doc["exit_code"] == 1
    os.makedirs(os.path.dirname(sock), exist_ok=True)
    with socket.socket(socket.AF_UNIX) as stale:  # bound, never listening: what a killed daemon leaves behind
        stale.bind(sock)
        r = d.cli("status", "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["reason"] == "connection refused by the control socket"
    r = d.cli("status")  # for a person: the message, on stderr
    assert r.returncode == 1 and r.stdout == ""
    assert "not running (connection refused by the control socket" in " ".join(r.stderr.split()), r.stderr


def test_ping_and_retune_json_say_the_daemon_is_down_on_stdout(tmp_path):
    """`ping --json` and `retune --json` printed nothing on stdout when the daemon was down, as `status --json`
    once did; without --json they still say it on stderr only."""
    d = DaemonProc(daemon_config(tmp_path, None))
    sock = os.path.join(d.env["RUNTIME_DIRECTORY"], "control.sock")
    for verb in (["ping"], ["retune"], ["retune", "--wait"]):
        r = d.cli(*verb, "--json")
        assert r.returncode == 1 and r.stdout, (verb, r.stdout, r.stderr)
        doc = json.loads(r.stdout)
        assert (doc["running"], doc["socket"], doc["reason"]) == (False, sock, "no control socket"), verb
        assert "the edgetune daemon is not running" in doc["error"]
        r = d.cli(*verb)
        assert r.returncode == 1 and r.stdout == "" and "not running" in r.stderr, (verb, r.stderr)


def test_an_error_from_a_running_daemon_is_not_called_daemon_down(tmp_path):
    """A daemon that is up but refuses a request (here: paused on a full disk before it is ready) was reported as
    DaemonDown: `notify` then left a marker and said "daemon not running" for a daemon that was there."""
    from tests.test_delivery import fill, tmpfs

    with tmpfs(tmp_path / "fs") as fs:
        fill(fs)
        d = DaemonProc(daemon_config(tmp_path, None), env={**os.environ, "STATE_DIRECTORY": str(fs)}).start()
        try:
            d.wait_status(lambda s: s["state"] == "paused", 60)
            r = d.cli("retune")
            said = " ".join(r.stderr.split())
            assert r.returncode == 1 and "the daemon replied with an error: the daemon is paused" in said, said
            r = d.cli("notify", "firmware-changed", "--source", "mender", "--json")
            said = " ".join(r.stderr.split())
            assert r.returncode == 1 and "replied with an error" in said, (r.stdout, said)
            assert "replied with an error" in json.loads(r.stdout)["error"], r.stdout  # --json: the error as JSON
            assert not (fs / "firmware-changed").exists()
            assert d.signal(signal.SIGTERM) == 0
        finally:
            d.stop()


def test_notify_with_the_daemon_down_and_a_full_state_dir_says_so(tmp_path):
    """The update hook must hear that no retune was queued: a clear error naming the marker, exit 1, no traceback
    and no temp file left behind (it ended in a traceback from the marker's write)."""
    from tests.test_delivery import fill, tmpfs

    with tmpfs(tmp_path / "fs") as fs:
        fill(fs)
        d = DaemonProc(daemon_config(tmp_path, None), env={**os.environ, "STATE_DIRECTORY": str(fs)})
        r = d.cli("notify", "firmware-changed", "--source", "mender", "--json")
        said = " ".join(r.stderr.split())
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert f"cannot leave the firmware-changed marker {fs / 'firmware-changed'}" in said and "free space" in said
        assert sorted(os.listdir(fs)) == ["filler"]


def test_notify_on_a_read_only_state_dir_names_that_fix_not_free_space(tmp_path):
    """A state directory on a read-only filesystem cannot take the marker either: the error names that cause and
    its fix (another STATE_DIRECTORY), not "free space"."""
    from tests.test_delivery import tmpfs

    with tmpfs(tmp_path / "fs") as fs:
        r = subprocess.run(["mount", "-o", "remount,ro", str(fs)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot remount a tmpfs read-only here: {r.stderr.strip()}")
        d = DaemonProc(daemon_config(tmp_path, None), env={**os.environ, "STATE_DIRECTORY": str(fs)})
        r = d.cli("notify", "firmware-changed", "--source", "mender", "--json")
        said = " ".join(r.stderr.split())
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert f"cannot leave the firmware-changed marker {fs / 'firmware-changed'}" in said, said
        assert "read-only" in said and "set STATE_DIRECTORY to a writable directory" in said, said
        assert "free space" not in said and os.listdir(fs) == []


def test_no_broker_still_tunes(tmp_path):
    d = DaemonProc(daemon_config(tmp_path, None)).start()
    try:
        st = d.wait_status(lambda s: s.get("last_tune") is not None and s["state"] == "idle")
        assert st["broker"] == {"configured": False}
        assert st["outbox"]["messages"] == 1  # only the tuning record is kept for a broker added later
        assert d.signal(signal.SIGINT) == 0
    finally:
        d.stop()


def test_firmware_marker_and_notify_retune_everything(tmp_path, mosquitto):
    d = DaemonProc(daemon_config(tmp_path, mosquitto))
    r = d.cli("notify", "firmware-changed", "--source", "mender", "--json")  # daemon down: leaves the marker
    assert r.returncode == 0 and json.loads(r.stdout)["delivered"] is False
    marker = d.state_dir / "firmware-changed"
    assert json.loads(marker.read_text())["source"] == "mender"

    bus = Bus(mosquitto)
    d.start()
    try:
        done = bus.on("/cmd/res/", lambda c: c["origin"] == "firmware-hook" and c["status"] == "succeeded", 60)
        assert done["id"].startswith("firmware-hook-") and done["op"] == "retune"
        assert done["note"] == "firmware changed (mender)"
        wait_until(lambda: not marker.exists(), "the finished firmware retune to remove its marker")

        r = d.cli("notify", "firmware-changed", "--source", "rauc", "--json")
        cid = json.loads(r.stdout)["command_id"]
        assert r.returncode == 0 and cid.startswith("firmware-hook-")
        final = bus.on(f"/cmd/res/{cid}", lambda c: c["status"] == "succeeded", 60)
        assert final["note"] == "firmware changed (rauc)"  # why it started, on the final state too
        with sqlite3.connect(d.state_dir / "results.db") as db:
            origins = [o for (o,) in db.execute("SELECT origin FROM sessions ORDER BY id")]
        assert origins == ["firmware-hook", "firmware-hook"]  # forced: a new session each time

        assert d.signal(signal.SIGTERM) == 0  # a new fw_fingerprint seen at start is a firmware change too
        with sqlite3.connect(d.state_dir / "daemon.db") as db:
            db.execute("""UPDATE kv SET value='"an older firmware"' WHERE key='fw_fingerprint'""")
        d.start()
        # the final response: the earlier ones of a command may be coalesced in the outbox while the broker is not
        # yet connected at start, so only the final one is sure to be sent; it carries the note as well
        final = bus.on("/cmd/res/", lambda c: c["origin"] == "firmware-hook" and c["id"] not in (done["id"], cid)
                       and c["status"] == "succeeded", 60)
        assert final["note"] == "firmware changed (fw_fingerprint)"
    finally:
        d.stop()
        bus.close()


def test_sd_notify_ready_watchdog_status(tmp_path, mosquitto):
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(30)
    env = dict(os.environ, NOTIFY_SOCKET=str(path), WATCHDOG_USEC="400000")
    d = DaemonProc(daemon_config(tmp_path, mosquitto), env=env).start()
    try:
        got: list[str] = []
        while got.count("WATCHDOG=1") < 2:
            got += sock.recv(4096).decode().splitlines()
        assert "READY=1" in got and got.index("READY=1") < got.index("WATCHDOG=1")
        assert any(line.startswith("STATUS=") for line in got[:got.index("READY=1") + 2])
        assert d.signal(signal.SIGTERM) == 0
        while "STOPPING=1" not in got:
            got += sock.recv(4096).decode().splitlines()
    finally:
        d.stop()
        sock.close()
