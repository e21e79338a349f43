"""Issue 27 end to end: real daemons follow staged rollouts that a real `fleet serve` runs over a real mosquitto,
downloading the model from its /releases/ route, or in MQTT chunks from it when they have no fleet URL. Models are the bundled GGUF padded (another file, the same
model) and a patched copy trained for other knobs (it loads, then proposes nothing valid). Every wait is on an
event: a model/state the fleet stored, a retained message, a daemon status."""

from __future__ import annotations

import hashlib
import http.server
import json
import sqlite3
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.broker import Mosquitto
from tests.fleet_server import FleetServer
from tests.test_daemon_support import Bus, DaemonProc, daemon_config, env_for
from tests.test_fleet import HW, Device
from tuner.model.inference import PROMPT_FORMAT, bundled_model_path

T = 300.0  # health checks build and measure kernels on a shared, loaded host
BUNDLED = bundled_model_path().read_bytes()
BAD = BUNDLED.replace(b'"gemm"', b'"gemx"')  # loads, but was "trained" for a kernel the device does not have
assert BAD != BUNDLED and len(BAD) == len(BUNDLED) and PROMPT_FORMAT


class Rig:
    """A broker, a fleet server with an operator and a viewer token and a signing key, and daemons that trust it."""

    def __init__(self, tmp: Path, cache: Path, devices: list[str], fleet_url: str | None = None, isa: str = "",
                 db: str | None = None):
        """`fleet_url`: what the daemons download from; None: the fleet server, "": none (MQTT chunks only).
        `db`: the fleet DB's PostgreSQL URL (None: SQLite in the fleet's state dir)."""
        self.isa = isa  # the daemons' ISA cap (empty: the CPU's)
        self.tmp, self.cache, self.db = tmp, cache, db
        self.broker = Mosquitto(tmp / "broker").start()
        config = None
        if db:
            config = tmp / "fleet.toml"
            config.write_text(f'[fleet]\ndatabase = "{db}"\n')
        self.server = FleetServer(self.broker, env_for(tmp / "fleet", cache), config=config).start()
        self.op, self.viewer = self.server.token("operator", "op"), self.server.token("viewer", "view")
        key = tmp / "keys" / "release.key"
        r = self.server.cli("fleet", "key", "create", "--out", str(key), "--json")
        assert r.returncode == 0, r.stderr
        self.key, self.pub = key, Path(json.loads(r.stdout)["public_key"])
        self.daemons = {d: self._daemon(d, self.server.base if fleet_url is None else fleet_url) for d in devices}
        self.server.wait_json("/api/v1/overview", self.viewer, lambda o: o["statuses"]["online"] == len(devices), T)

    def _daemon(self, name: str, url: str) -> DaemonProc:
        (self.tmp / name).mkdir()
        cfg = daemon_config(self.tmp / name, self.broker, device_id=name, isa=self.isa,
                            model_update={"trusted_keys": [str(self.pub)], "fleet_url": url, "top_k": 2,
                                          "rounds": 3})
        return DaemonProc(cfg, env=env_for(self.tmp / name, self.cache)).start()

    def cli(self, *args: str) -> dict:
        r = self.server.cli("fleet", *args, *(["--db", self.db] if self.db else []), "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def add(self, data: bytes, name: str) -> int:
        path = self.tmp / f"{name}.gguf"
        path.write_bytes(data)
        return self.cli("model", "add", str(path))["version"]

    def publish(self, version: int, *args: str, key: Path | None = None) -> str:
        return self.cli("model", "publish", str(version), "--key", str(key or self.key), *args)["rollout"]

    def rollout(self, rid: str, pred, what: str) -> dict:
        try:
            return self.server.wait_json(f"/api/v1/rollouts/{rid}", self.viewer, pred, T)
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}\n{self.server.log[-3000:]}") from None

    def pointer(self, device: str) -> dict:
        p = self.daemons[device].state_dir / "models" / "current.json"
        return json.loads(p.read_text()) if p.exists() else {"current": None, "previous": None}

    def retained_releases(self) -> dict[str, dict]:
        """Every retained model/release on the broker, read by a fresh subscriber: a retained sentinel topic
        subscribed after the release filter arrives after every retained release."""
        bus = Bus(self.broker, ("x",))
        bus.c.publish("edgetune-test/sentinel", b"1", qos=1, retain=True).wait_for_publish(10)
        bus.close()
        bus = Bus(self.broker, ("edgetune/v1/+/model/release", "edgetune-test/sentinel"))
        try:
            bus.wait(lambda m: m.topic == "edgetune-test/sentinel", 30, "the sentinel")
            return {m.topic.split("/")[2]: m.doc for m in bus.msgs if m.topic.endswith("/model/release") and m.payload}
        finally:
            bus.close()

    def close(self) -> None:
        for d in self.daemons.values():
            d.stop()
        self.server.stop()
        self.broker.stop()

    def clean_exit(self) -> None:
        for name, d in self.daemons.items():
            assert d.signal(15) == 0 and "Traceback" not in d.log, (name, d.log[-3000:])
        assert "Traceback" not in self.server.log, self.server.log[-3000:]


def by_device(r: dict) -> dict[str, dict]:
    return {t["device_id"]: t for t in r["devices"]}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_staged_rollout_commits_the_first_cohort_advances_completes_and_a_bad_model_is_rolled_back(
        tmp_path, build_cache, backend, request):
    db = request.getfixturevalue("pg_url") if backend == "postgresql" else None
    rig = Rig(tmp_path, build_cache, ["dev-a", "dev-b", "dev-c"], db=db)
    try:
        assert ("db postgresql://" in rig.server.log) == bool(db), rig.server.log[:2000]
        v2, v3, v4 = rig.add(BUNDLED + b"\0" * 32, "v2"), rig.add(BUNDLED + b"\0" * 64, "v3"), rig.add(BAD, "v4")
        assert (v2, v3, v4) == (2, 3, 4)

        # 1. a 5% cohort of three devices is one device: it commits; the others are never sent the release
        rid = rig.publish(v2, "--cohort", "5%", "--min-dwell", "1h")
        r = rig.rollout(rid, lambda r: r["totals"]["committed"] == 1, "the first cohort committing v2")
        first = [d for d, t in by_device(r).items() if t["phase"] == 0]
        assert len(first) == 1 and r["phase_label"] == "5%" and r["state"] == "active"
        first = first[0]
        assert by_device(r)[first]["bucket"] == "committed" and r["phases"][0]["counts"]["committed"] == 1
        assert all(t["sent_at"] is None and t["bucket"] == "pending" for d, t in by_device(r).items() if d != first)
        assert set(rig.retained_releases()) == {first}
        assert rig.pointer(first)["current"]["version"] == 2
        assert all(rig.pointer(d)["current"] is None for d in rig.daemons if d != first)

        # 2. the operator pauses and resumes it; a viewer may not; then the operator aborts: the signed rollback
        #    returns the first device to the bundled model (v1), and nobody else is touched
        path = f"/api/v1/rollouts/{rid}"
        assert rig.server.post_json(f"{path}/pause", {}, rig.viewer).status == 403
        assert rig.server.post_json(f"{path}/pause", {"reason": "look"}, rig.op).doc["state"] == "paused"
        assert rig.server.post_json(f"{path}/pause", {}, rig.op).status == 409
        assert rig.server.post_json(f"{path}/resume", {}, rig.op).doc["state"] == "active"
        assert rig.server.post_json(f"{path}/abort", {"reason": "why not"}, rig.viewer).status == 403
        assert rig.server.get(path, rig.viewer).doc["state"] == "active"
        assert rig.server.post_json(f"{path}/abort", {"reason": "operator test"}, rig.op).doc["state"] == "aborted"
        r = rig.rollout(rid, lambda r: by_device(r)[first]["rollback_state"] == "committed",
                        "the rollback to v1 committed")
        assert by_device(r)[first]["bucket"] == "rolled_back" and rig.pointer(first)["current"] is None
        assert rig.retained_releases()[first]["phase"] == "rollback"
        assert [e["kind"] for e in r["events"]][::-1] == ["published", "paused", "active", "aborted"]

        # 3. the next release advances through its phases by itself and completes: every device runs v3
        rid = rig.publish(v3, "--phases", "33,100", "--min-dwell", "0")
        r = rig.rollout(rid, lambda r: r["state"] == "completed", "the v3 rollout completing")
        assert r["totals"]["committed"] == 3 and [e["kind"] for e in r["events"]][::-1] == [
            "published", "advanced", "completed"]
        assert {rig.pointer(d)["current"]["version"] for d in rig.daemons} == {3}
        listed = rig.cli("model", "list")
        assert [m["version"] for m in listed if m["baseline"]] == [3]

        # 4. a model that proposes nothing valid fails the first phase's health check: the abort rule stops the
        #    rollout, the signed rollback to v3 goes to that device, and the other phases never get v4
        rid = rig.publish(v4, "--phases", "33,100", "--min-dwell", "0", "--abort-above", "0%")
        r = rig.rollout(rid, lambda r: r["state"] == "aborted" and all(
            t["rollback_state"] == "committed" for t in r["devices"] if t["sent_at"]), "the abort rule rolling back")
        bad = [t for t in r["devices"] if t["sent_at"]]
        assert len(bad) == 1 and (bad[0]["state"], bad[0]["reason"]) == ("rolled_back", "invalid_proposals")
        assert "1 of 1 reporting devices failed" in r["reason"] and "invalid_proposals" in r["reason"]
        assert r["events"][0]["actor"] == "abort rule" and r["phases"][1]["released"] is False
        assert {rig.pointer(d)["current"]["version"] for d in rig.daemons} == {3}
        releases = rig.retained_releases()
        assert releases[bad[0]["device_id"]]["phase"] == "rollback"
        assert all(releases[d]["manifest"]["version"] == 3 for d in rig.daemons)  # v4 reached no one else
        rig.clean_exit()
    finally:
        rig.close()


class Tamper(http.server.BaseHTTPRequestHandler):
    """A man in the middle between the devices and the fleet server: forwards each request (Range included) and,
    by `mode`, flips one byte of every model it passes on (tamper), answers 404 (missing) or passes it (pass)."""

    upstream: str
    mode = "tamper"

    def log_message(self, *a) -> None:
        pass

    def do_GET(self) -> None:
        if self.mode == "missing":
            self.send_error(404)
            return
        req = urllib.request.Request(self.upstream + self.path,
                                     headers={k: v for k, v in self.headers.items() if k.lower() == "range"})
        try:
            with urllib.request.urlopen(req, timeout=30) as up:
                status, headers, body = up.status, up.headers, up.read()
        except urllib.error.HTTPError as e:
            status, headers, body = e.code, e.headers, e.read()
        if body and self.mode == "tamper":
            body = bytes([body[0] ^ 1]) + body[1:]
        self.send_response(status)
        for k in ("Content-Range", "Content-Type"):
            if headers.get(k):
                self.send_header(k, headers[k])
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_a_tampered_file_or_untrusted_key_trips_the_abort_rule_and_a_failed_download_is_retried(tmp_path,
                                                                                                    build_cache):
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("T", (Tamper,), {"upstream": ""}))
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    rig = None
    try:
        rig = Rig(tmp_path, build_cache, ["dev-t"], fleet_url=f"http://127.0.0.1:{proxy.server_address[1]}",
                  isa="x86-64-v2")  # a smaller device of this machine's arch: the rollout selects it by class
        proxy.RequestHandlerClass.upstream = rig.server.base
        v2 = rig.add(BUNDLED + b"\0" * 32, "v2")
        # the fleet server itself serves the right bytes, with ranges (what the device resumes with)
        sha = hashlib.sha256(BUNDLED + b"\0" * 32).hexdigest()
        whole = rig.server.get(f"/releases/{sha}")
        assert whole.status == 200 and whole.body == BUNDLED + b"\0" * 32 and whole.headers["etag"] == f'"{sha}"'
        part = rig.server.request("GET", f"/releases/{sha}", headers={"Range": "bytes=1000-"})
        assert part.status == 206 and part.body == whole.body[1000:]
        assert part.headers["content-range"] == f"bytes 1000-{len(whole.body) - 1}/{len(whole.body)}"
        assert rig.server.request("GET", f"/releases/{sha}", headers={"Range": f"bytes={10 ** 8}-"}).status == 416
        assert rig.server.get(f"/releases/{'0' * 64}").status == 404 and rig.server.get("/releases/x").status == 404

        # tampered on the way: the device refuses it (checksum), the abort rule aborts, the rollback returns it
        assert rig.server.get("/api/v1/devices/dev-t", rig.viewer).doc["isa"] == "x86-64-v2"
        rid = rig.publish(v2, "--phases", "100", "--min-dwell", "0", "--where", "isa=x86-64-v2")
        r = rig.rollout(rid, lambda r: r["state"] == "aborted" and r["devices"][0]["rollback_state"] == "committed",
                        "the tampered release aborted and rolled back")
        assert (r["devices"][0]["state"], r["devices"][0]["reason"]) == ("rejected", "checksum")
        assert r["manifest"]["target_isa"] == ["x86-64-v2"]  # the class is in the signed manifest too
        assert r["phases"][0]["reasons"] == {"rejected: checksum": 1} and "checksum x1" in r["reason"]
        assert rig.pointer("dev-t")["current"] is None

        # signed by a key the device does not trust (forged, or a new key not yet on the devices): unknown_key
        stranger = tmp_path / "keys" / "stranger.key"
        assert rig.server.cli("fleet", "key", "create", "--out", str(stranger)).returncode == 0
        rid = rig.publish(v2, "--phases", "100", "--min-dwell", "0", key=stranger)
        r = rig.rollout(rid, lambda r: r["state"] == "aborted" and r["devices"][0]["rollback_state"] is not None,
                        "the untrusted release aborted")
        t = r["devices"][0]
        assert (t["state"], t["reason"]) == ("rejected", "unknown_key")
        assert (t["rollback_state"], t["rollback_reason"]) == ("rejected", "unknown_key")  # it signed that too
        assert rig.pointer("dev-t")["current"] is None

        # a download that fails for good (the server keeps answering 404) is `failed`; once the fault is gone the
        # operator retries it: the release goes again under another rollout_id and the device commits it
        proxy.RequestHandlerClass.mode = "missing"
        rid = rig.publish(v2, "--phases", "100", "--min-dwell", "0", "--abort-above", "100%")
        r = rig.rollout(rid, lambda r: r["devices"][0]["state"] == "failed", "the download failing")
        assert r["devices"][0]["reason"] == "download_failed" and r["state"] == "active"
        proxy.RequestHandlerClass.mode = "pass"
        path = f"/api/v1/rollouts/{rid}/retry"
        assert rig.server.post_json(path, {}, rig.viewer).status == 403
        assert rig.server.post_json(path, {"devices": "dev-t"}, rig.op).status == 400
        assert rig.server.post_json(path, {}, rig.op).doc["retried"] == ["dev-t"]
        r = rig.rollout(rid, lambda r: r["state"] == "completed", "the retried release committing")
        t = r["devices"][0]
        assert (t["state"], t["attempt"]) == ("committed", 1) and r["events"][1]["kind"] == "retried"
        assert rig.pointer("dev-t")["current"]["rollout_id"] == f"{rid}:retry1"
        assert rig.server.post_json(path, {}, rig.op).status == 409  # completed: nothing to retry
        rig.clean_exit()
    finally:
        if rig:
            rig.close()
        proxy.shutdown()


def test_without_http_the_file_comes_in_mqtt_chunks_a_tampered_one_trips_the_abort_rule_a_sound_one_commits(
        tmp_path, build_cache):
    rig = Rig(tmp_path, build_cache, ["dev-m"], fleet_url="")  # the device knows no fleet URL: MQTT only
    try:
        v2, v3 = rig.add(BUNDLED + b"\0" * 32, "v2"), rig.add(BUNDLED + b"\0" * 64, "v3")
        # v2's bytes damaged in the fleet DB after it was registered: the chunks carry them, the sha256 catches it
        with sqlite3.connect(tmp_path / "fleet" / "state" / "fleet.db") as db:
            data = db.execute("SELECT data FROM models WHERE version=?", (v2,)).fetchone()[0]
            db.execute("UPDATE models SET data=? WHERE version=?", (bytes([data[0] ^ 1]) + data[1:], v2))
        rid = rig.publish(v2, "--phases", "100", "--min-dwell", "0")
        r = rig.rollout(rid, lambda r: r["state"] == "aborted" and r["devices"][0]["rollback_state"] == "committed",
                        "the tampered release aborted and rolled back")
        assert r["manifest"]["mqtt"] == {"chunk_size": 65536}  # offered, and signed with the rest
        assert (r["devices"][0]["state"], r["devices"][0]["reason"]) == ("rejected", "checksum")
        assert "checksum x1" in r["reason"] and rig.pointer("dev-m")["current"] is None
        assert "model download from" not in rig.daemons["dev-m"].log  # no HTTP attempt: there is no URL

        rid = rig.publish(v3, "--phases", "100", "--min-dwell", "0")
        r = rig.rollout(rid, lambda r: r["state"] == "completed", "the v3 rollout over MQTT completing")
        assert r["devices"][0]["state"] == "committed" and rig.pointer("dev-m")["current"]["version"] == 3
        d = rig.daemons["dev-m"]
        assert f"downloaded v3 ({len(BUNDLED) + 64} bytes) from MQTT chunks" in d.log, d.log[-3000:]
        n = -(-len(BUNDLED + b"\0" * 64) // 65536)
        assert f"sent chunks {n - 1 - (n - 1) % 16}-{n - 1} of" in rig.server.log  # the last window, as asked

        # a target that never reports is counted timed_out after --report-timeout: a failure for the abort rule,
        # shown with its reason in the API and on the page
        ghost = Device(rig.broker, "dev-ghost")
        ghost.pub("status", {"state": "online", "session": 1, "version": "0.1.0", "ts": time.time()}, retain=True)
        ghost.pub("info", {"hw": HW, "hw_fingerprint": "hw-ghost"}, retain=True)
        ghost.close()
        rig.server.wait_json("/api/v1/overview", rig.viewer, lambda o: o["devices"] == 2, T)
        rid = rig.publish(rig.add(BUNDLED + b"\0" * 96, "v4"), "--devices", "dev-ghost", "--phases", "100",
                          "--min-dwell", "0", "--report-timeout", "1s")
        r = rig.rollout(rid, lambda r: r["state"] == "aborted", "the silent device timing out")
        t = r["devices"][0]
        assert (t["state"], t["reason"], t["bucket"]) == ("timed_out", "report_timeout", "timed_out"), t
        assert r["report_timeout_s"] == 1.0 and r["totals"]["timed_out"] == 1 and "report_timeout x1" in r["reason"]
        html = rig.server.get(f"/rollouts/{rid}", rig.viewer).text
        assert "timed_out: report_timeout" in html and "no model/state within 1 s of the release" in html
        rig.clean_exit()
    finally:
        rig.close()
