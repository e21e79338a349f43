"""Brokers for tests: a real mosquitto (on a free loopback port, stoppable and restartable), and a small fake for
the one thing mosquitto cannot be made to do, refuse MQTT 5."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Mosquitto:
    """One broker process. `extra_conf` lines are appended to the listener config (TLS, auth)."""

    workdir: Path
    port: int = field(default_factory=free_port)
    extra_conf: list[str] = field(default_factory=list)
    persistence: bool = True
    proc: subprocess.Popen | None = None

    @property
    def host(self) -> str:
        return "127.0.0.1"

    def start(self) -> "Mosquitto":
        exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        self.workdir.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "mosquitto.conf"
        # started as root, mosquitto drops to its own user and could not read pytest's private tmp dirs
        lines = [f"listener {self.port} 127.0.0.1", *(["user root"] if os.geteuid() == 0 else []), *self.extra_conf]
        if not any(ln.startswith(("password_file", "allow_anonymous")) for ln in self.extra_conf):
            lines.append("allow_anonymous true")
        if self.persistence:
            lines += ["persistence true", f"persistence_location {self.workdir}/"]
        conf.write_text("\n".join(lines) + "\n")
        with open(self.workdir / "mosquitto.log", "ab") as log:
            self.proc = subprocess.Popen([exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # wait for the listener, not a fixed sleep
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited: {(self.workdir / 'mosquitto.log').read_text()[-2000:]}")
            try:
                socket.create_connection((self.host, self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("mosquitto did not start listening")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None


class Mqtt311OnlyBroker:
    """Just enough of an MQTT 3.1.1-only broker for what mosquitto cannot be made to do: refuse protocol 5 (with
    CONNACK return code 1, as MQTT 3.1.1 §3.1.2.2 requires), withhold PUBACKs, and drop a connection on cue.
    It acks CONNECT and SUBSCRIBE, and keeps every PUBLISH it receives."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.levels: list[int] = []
        self.published: list[tuple[str, bytes]] = []
        self.acking = True
        self.got = threading.Condition()
        self._conn: socket.socket | None = None
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    def drop(self) -> None:
        """End the current connection abruptly (no PUBACK for what it received)."""
        self._conn.shutdown(socket.SHUT_RDWR)

    @staticmethod
    def _packet(f) -> tuple[int, bytes] | None:
        head = f.read(1)
        if not head:
            return None
        n, shift = 0, 0
        while True:
            b = f.read(1)[0]
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        return head[0], f.read(n)

    def _client(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rwb", buffering=0) as f:
            while (pkt := self._packet(f)) is not None:
                kind, body = pkt
                if kind >> 4 == 1:  # CONNECT: protocol name, then the level
                    level = body[2 + int.from_bytes(body[:2], "big")]
                    self.levels.append(level)
                    f.write(b"\x20\x02\x00" + (b"\x01" if level != 4 else b"\x00"))
                    if level != 4:
                        return
                    self._conn = conn
                elif kind >> 4 == 8:  # SUBSCRIBE → SUBACK granting QoS 1
                    f.write(b"\x90\x03" + body[:2] + b"\x01")
                elif kind >> 4 == 3:  # PUBLISH, QoS 1 → PUBACK (unless withheld)
                    tl = int.from_bytes(body[:2], "big")
                    topic, mid, payload = body[2:2 + tl].decode(), body[2 + tl:4 + tl], body[4 + tl:]
                    if self.acking:
                        f.write(b"\x40\x02" + mid)
                    with self.got:
                        self.published.append((topic, payload))
                        self.got.notify_all()
                elif kind >> 4 == 12:  # PINGREQ
                    f.write(b"\xd0\x00")
                elif kind >> 4 == 14:  # DISCONNECT
                    return

    def wait(self, n: int) -> list[int]:
        with self.got:
            assert self.got.wait_for(lambda: len(self.published) >= n, 30), self.published
            return [json.loads(p)["seq"] for _, p in self.published]


def make_certs(tmp: Path) -> dict[str, Path]:
    """A test CA, a server cert for 127.0.0.1 and a client cert, with the openssl CLI (EC keys: fast)."""
    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=edgetune test CA")
    (tmp / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, ext in (("server", ["-extfile", "san.ext"]), ("client", [])):
        ssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=edgetune test {name}")
        ssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.crt", "-days", "2", *ext)
    return {n: tmp / n for n in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")}
