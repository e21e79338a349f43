"""A real mosquitto broker for tests: started on a free loopback port, stoppable and restartable."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
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
