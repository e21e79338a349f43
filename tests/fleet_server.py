"""`edgetune fleet serve` as a real process for tests, with tokens made by the real CLI and a small HTTP client
that neither follows redirects nor raises on 4xx, so tests see exactly what the server answered."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.broker import free_port

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Resp:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    @property
    def doc(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode()


@dataclass
class FleetServer:
    broker: Any
    env: dict[str, str]
    config: Path | None = None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "edgetune.main", *args], cwd=REPO, env=self.env,
                              capture_output=True, text=True, timeout=60)

    def token(self, role: str, name: str | None = None) -> str:
        r = self.cli("fleet", "token", "create", "--role", role, *(["--name", name] if name else []), "--json",
                     *(["--config", str(self.config)] if self.config else []))
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["token"]

    def start(self, timeout: float = 30.0, prefix: list[str] | tuple[str, ...] = ()) -> "FleetServer":
        """Run it (under `prefix`, e.g. a confinement wrapper) until it answers and its receiver subscribed."""
        self.log_path = Path(self.env["STATE_DIRECTORY"]).parent / f"fleet-serve-{self.port}.log"
        argv = [*prefix, sys.executable, "-m", "edgetune.main", "fleet", "serve", "--broker",
                f"{self.broker.host}:{self.broker.port}", "--port", str(self.port),
                *(["--config", str(self.config)] if self.config else [])]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=self.env, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # an event to await, not a fixed sleep
            assert self.proc.poll() is None, f"fleet serve exited:\n{self.log}"
            try:
                health = self.request("GET", "/healthz").doc
                if health["listener"]["subscribed"]:
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"fleet serve did not come up:\n{self.log}")

    @property
    def log(self) -> str:
        return self.log_path.read_text() if self.log_path else ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)

    def request(self, method: str, path: str, body: bytes | str | None = None, *, token: str | None = None,
                headers: dict[str, str] | None = None) -> Resp:
        h = dict(headers or {})
        if token:
            h["Authorization"] = f"Bearer {token}"
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(method, path, body=body, headers=h)
            r = conn.getresponse()
            return Resp(r.status, r.headers, r.read())
        finally:
            conn.close()

    def get(self, path: str, token: str | None = None) -> Resp:
        return self.request("GET", path, token=token)

    def post_json(self, path: str, doc: Any, token: str | None = None, **kw: Any) -> Resp:
        return self.request("POST", path, json.dumps(doc), token=token,
                            headers={"Content-Type": "application/json", **kw.pop("headers", {})}, **kw)

    def wait_json(self, path: str, token: str, pred: Any, timeout: float = 30.0) -> Any:
        """GET path until pred(doc) holds: the receiver stores what the broker delivers a moment later."""
        deadline = time.monotonic() + timeout
        doc = None
        while time.monotonic() < deadline:
            r = self.get(path, token)
            if r.status == 200:
                doc = r.doc
                if pred(doc):
                    return doc
            time.sleep(0.05)
        raise AssertionError(f"{path} never matched; last: {json.dumps(doc)[:2000]}")


def form(fields: dict[str, str | list[str]]) -> str:
    return urllib.parse.urlencode([(k, v) for k, vs in fields.items() for v in (vs if isinstance(vs, list) else [vs])])
