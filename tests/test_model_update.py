"""Issue 27, device side: a real daemon follows signed tuner-model releases published retained through a real
mosquitto, fetches the file from a real HTTP server with range requests (the contract of the fleet's
`/releases/{sha256}` route: 206 + Content-Range), stages it A/B, health-checks it with llama.cpp and measured
top-K, and commits or rolls back. Releases are signed in the test with a fresh key; the only real model is the
bundled GGUF, so a "new" model is a copy of it (padded, so its sha256 differs) and the broken ones are cut or
patched copies. Every wait is on an event (a model/state message, a status, a server request), never a sleep."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edgetune import release as rel
from edgetune.protocol import MODEL_STATE, MODEL_STATES
from tests.test_daemon_support import Bus, DaemonProc, daemon_config, retained
from tuner.model.inference import PROMPT_FORMAT, bundled_model_path

DEV = "dev-test"
TOPIC = f"edgetune/v1/{DEV}/model/release"
T = 240.0  # a health check builds and measures kernels on a shared, loaded host
BUNDLED = bundled_model_path().read_bytes()
NEW = BUNDLED + b"\0" * 32  # the same model, another file: llama.cpp ignores bytes after the tensor data


# ---- the fleet's side, as small as the contract ------------------------------------------------------------------

@dataclass
class Files:
    """What the test HTTP server serves, and how it misbehaves on cue."""

    by_sha: dict[str, bytes] = field(default_factory=dict)
    ranges: list[str | None] = field(default_factory=list)  # each request's Range header, in order
    cut_after: int | None = None  # the first response stops (connection closed) after this many body bytes
    hold_after: int | None = None  # the first response waits on `release` after this many body bytes
    held: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    serve: dict[str, bytes] = field(default_factory=dict)  # sha -> other bytes than the real file (tampered)
    got: threading.Condition = field(default_factory=threading.Condition)

    def add(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        self.by_sha[sha] = data
        return sha


class RangeHandler(http.server.BaseHTTPRequestHandler):
    files: Files

    def log_message(self, *a) -> None:
        pass

    def do_GET(self) -> None:
        f = self.files
        m = re.fullmatch(r"/releases/([0-9a-f]{64})", self.path)
        data = f.serve.get(m[1], f.by_sha.get(m[1])) if m else None
        with f.got:
            f.ranges.append(self.headers.get("Range"))
            first = len(f.ranges) == 1
            f.got.notify_all()
        if data is None:
            self.send_error(404)
            return
        start = 0
        r = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
        if r:
            start = int(r[1])
            if start >= len(data):
                self.send_error(416)
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        stop = f.cut_after if first else None
        hold = f.hold_after if first else None
        try:
            if hold is not None:
                self.wfile.write(body[:hold])
                self.wfile.flush()
                f.held.set()
                f.release.wait(T)
                return  # the client was killed meanwhile: nothing more for it
            self.wfile.write(body if stop is None else body[:stop])
        except (BrokenPipeError, ConnectionResetError):
            pass
        if stop is not None:
            self.close_connection = True


class FleetFiles:
    def __init__(self) -> None:
        self.files = Files()
        handler = type("H", (RangeHandler,), {"files": self.files})
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.files.release.set()
        self.httpd.shutdown()


@pytest.fixture
def fleet_files():
    s = FleetFiles()
    yield s
    s.close()


@dataclass
class Signer:
    key: Ed25519PrivateKey
    pem: Path

    @property
    def key_id(self) -> str:
        return rel.key_id(rel.raw_public(self.key.public_key()))

    def manifest(self, data: bytes, version: int, **over) -> dict:
        sha = hashlib.sha256(data).hexdigest()
        doc = dict(name="edgetune-tuner", version=version, sha256=sha, size=len(data), prompt_format=rel.PROMPT_FORMAT,
                   spaces={}, min_edgetune="0.1.0", expires_at=time.time() + 3600, key_id=self.key_id,
                   url=f"/releases/{sha}", issued_at=time.time(), rollback=False, target_isa=[])
        doc.update(over)
        return doc

    def release(self, doc: dict, rollout: str = "r1", phase: str = "5%", signature: str | None = None) -> bytes:
        return json.dumps({"manifest": doc, "signature": signature or rel.sign(doc, self.key), "rollout_id": rollout,
                           "phase": phase}).encode()


def signer(tmp_path: Path, name: str = "fleet") -> Signer:
    k = Ed25519PrivateKey.generate()
    pem = tmp_path / f"{name}.pub.pem"
    pem.write_bytes(k.public_key().public_bytes(serialization.Encoding.PEM,
                                                serialization.PublicFormat.SubjectPublicKeyInfo))
    return Signer(k, pem)


def device(tmp_path: Path, broker, files: FleetFiles, s: Signer, env: dict | None = None, **mu) -> DaemonProc:
    cfg = daemon_config(tmp_path, broker, model_update={"trusted_keys": [str(s.pem)], "fleet_url": files.url,
                                                       "top_k": 2, "rounds": 3, **mu})
    return DaemonProc(cfg, env=env or dict(os.environ))


def publish(bus: Bus, payload: bytes) -> int:
    """Retain a release for the device; returns the bus index to wait from."""
    since = len(bus.msgs)
    bus.c.publish(TOPIC, payload, qos=1, retain=True).wait_for_publish(10)
    return since


def state(bus: Bus, pred, since: int, what: str, timeout: float = T) -> dict:
    return bus.wait(lambda m: m.topic.endswith("/model/state") and pred(m.doc), timeout, what, since=since).doc


def final(bus: Bus, since: int, version: int, timeout: float = T) -> dict:
    return state(bus, lambda d: d["version"] == version and d["state"] in rel_final(), since,
                 f"a final model/state for v{version}", timeout)


def rel_final() -> tuple[str, ...]:
    from edgetune.protocol import MODEL_FINAL_STATES

    return MODEL_FINAL_STATES


def pointer(d: DaemonProc) -> dict:
    p = d.state_dir / "models" / "current.json"
    return json.loads(p.read_text()) if p.exists() else {"current": None, "previous": None}


def model_status(d: DaemonProc) -> dict:
    st = d.request({"op": "status"})
    return {"model": st["model"], **st["model_update"]}


# ---- 1-4: a good release goes through every state and is committed; the contract holds -------------------------

def test_a_signed_release_is_downloaded_staged_checked_and_committed(tmp_path, mosquitto, fleet_files):
    s = signer(tmp_path)
    sha = fleet_files.files.add(NEW)
    bus = Bus(mosquitto, (f"edgetune/v1/{DEV}/#",))
    d = device(tmp_path, mosquitto, fleet_files, s).start()
    try:
        d.wait_status(lambda st: st["state"] == "idle" and st["last_tune"] is not None, T)
        assert model_status(d)["release"] is None  # the bundled model
        since = publish(bus, s.release(s.manifest(NEW, 2)))
        done = final(bus, since, 2)
        assert done["state"] == "committed", done
        seen = [m.doc["state"] for m in bus.msgs[since:] if m.topic.endswith("/model/state")]
        assert seen[:4] == ["downloading", "verifying", "evaluating", "committed"], seen
        assert done["current"]["sha256"] == sha and done["current"]["version"] == 2
        assert done["previous"]["sha256"] == hashlib.sha256(BUNDLED).hexdigest()
        assert done["rollout_id"] == "r1" and done["phase"] == "5%" and "not retuning" in done["detail"]
        for m in bus.msgs:  # every model/state carries only the documented fields and states
            if m.topic.endswith("/model/state"):
                assert set(m.doc) <= set(MODEL_STATE.fields) and m.doc["state"] in MODEL_STATES
        ptr = pointer(d)
        assert ptr["current"]["slot"] == "a" and (d.state_dir / "models/a/model.gguf").read_bytes() == NEW
        ms = model_status(d)
        assert ms["release"] == 2 and ms["slot"] == "a" and ms["state"]["state"] == "committed"
        assert ms["model"]["sha256"] == sha  # results are now attributed to the new model
        info = bus.on("/info", lambda i: (i.get("model_update") or {}).get("release") == 2)
        assert info["model"]["sha256"] == sha
        assert retained(mosquitto, f"edgetune/v1/{DEV}/model/state")["state"] == "committed"
        assert "release v2 (slot a)" in d.cli("status").stdout
        assert d.signal(15) == 0 and "Traceback" not in d.log, d.log[-3000:]
    finally:
        d.stop()
        bus.close()
