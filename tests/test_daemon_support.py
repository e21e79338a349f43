"""Helpers shared by the daemon tests (no tests here): a real MQTT subscriber that tests await on, a daemon run as
a real subprocess, and config/workload files. Every wait is on an event with a deadline, never a fixed sleep."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

REPO = Path(__file__).resolve().parent.parent
WORKLOAD_FC = """# edgetune workloads file
[[workload]]
kernel = "gemm"
name = "kws_dscnn.fc"
shape = { M = 1, N = 12, K = 64 }
"""
# a bigger gemm, so a tune lasts long enough to be interrupted on purpose
WORKLOAD_PW4 = """# edgetune workloads file
[[workload]]
kernel = "gemm"
name = "kws_dscnn.pw4"
shape = { M = 125, N = 64, K = 64 }
"""


def toml(d: dict, prefix: str = "") -> str:
    """Enough TOML for daemon configs: scalars, lists of strings, nested tables."""
    lines, tables = [], []
    for k, v in d.items():
        if isinstance(v, dict):
            tables.append((k, v))
        else:
            lines.append(f"{k} = {json.dumps(v)}")
    out = ([f"[{prefix[:-1]}]"] if prefix and lines else []) + lines
    for k, v in tables:
        out.append(toml(v, f"{prefix}{k}."))
    return "\n".join(out)


def daemon_config(tmp: Path, broker: Any | None, workload: str = WORKLOAD_FC, **over: Any) -> Path:
    """A config for a test daemon: one small workload, no idle gating, fast telemetry, short keepalive."""
    wl = tmp / "workloads.toml"
    wl.write_text(workload)
    cfg: dict[str, Any] = {"device_id": over.pop("device_id", "dev-test"), "telemetry_interval_s": 60.0,
                           "idle_load_threshold": 1000.0,
                           "tuning": {"budget": 3, "workloads": [str(wl)]}}
    if broker is not None:
        cfg["mqtt"] = {"host": broker.host, "port": broker.port, "keepalive": 5, "will_delay_s": 0,
                       "reconnect_max_s": 1.0}
    for k, v in over.items():
        if isinstance(v, dict):
            cfg.setdefault(k, {}).update(v)
        else:
            cfg[k] = v
    path = tmp / "edgetune.toml"
    path.write_text(toml(cfg) + "\n")
    return path


def _under(topic: str, suffix: str) -> bool:
    return topic.endswith(suffix) or (suffix.endswith("/") and suffix in topic)


@dataclass
class Msg:
    topic: str
    payload: bytes
    retain: bool

    @property
    def doc(self) -> Any:
        return json.loads(self.payload)


class Bus:
    """A real subscriber on the test broker. Messages are kept in arrival order; `wait` blocks until one matches."""

    def __init__(self, broker: Any, topics: tuple[str, ...] = ("edgetune/v1/#",), *, client_id: str = "",
                 persistent: bool = False, tls: dict | None = None, auth: tuple[str, str] | None = None):
        self.broker = broker
        self.msgs: list[Msg] = []
        self._cond = threading.Condition()
        self._connected = threading.Event()
        self._topics = topics
        kw = {"clean_session": False} if persistent else {}
        self.c = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv311, **kw)
        if tls:
            self.c.tls_set(**tls)
        if auth:
            self.c.username_pw_set(*auth)
        self.c.on_connect = self._on_connect
        self.c.on_message = self._on_message
        self.c.reconnect_delay_set(0.1, 0.5)
        self.c.connect(broker.host, broker.port, 30)
        self.c.loop_start()
        assert self._connected.wait(10), "test subscriber could not connect"

    def _on_connect(self, c: paho.Client, _u: Any, _f: Any, rc: Any, _p: Any) -> None:
        if not rc.is_failure:
            for t in self._topics:
                c.subscribe(t, qos=1)
            self._connected.set()

    def _on_message(self, _c: paho.Client, _u: Any, m: paho.MQTTMessage) -> None:
        with self._cond:
            self.msgs.append(Msg(m.topic, bytes(m.payload), bool(m.retain)))
            self._cond.notify_all()

    def wait(self, pred: Callable[[Msg], bool], timeout: float = 30.0, what: str = "message", since: int = 0) -> Msg:
        """The first message from index `since` on that matches, waiting for it if need be."""
        deadline = time.monotonic() + timeout
        seen = since
        with self._cond:
            while True:
                for m in self.msgs[seen:]:
                    if pred(m):
                        return m
                seen = len(self.msgs)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out waiting for {what}; got {[m.topic for m in self.msgs][-20:]}")
                self._cond.wait(left)

    def on(self, suffix: str, pred: Callable[[dict], bool] = lambda d: True, timeout: float = 30.0) -> dict:
        """The first received message on a topic ending with `suffix` (or under it, if `suffix` ends with '/')
        whose JSON matches."""
        return self.wait(lambda m: _under(m.topic, suffix) and pred(json.loads(m.payload)), timeout,
                         what=f"{suffix}").doc

    def docs(self, suffix: str) -> list[dict]:
        with self._cond:
            return [json.loads(m.payload) for m in self.msgs if _under(m.topic, suffix)]

    def publish(self, topic: str, payload: bytes | str) -> None:
        self.c.publish(topic, payload, qos=1).wait_for_publish(10)

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def retained(broker: Any, topic: str, timeout: float = 10.0, **kw: Any) -> dict:
    """The retained message on a topic, read by a fresh subscriber."""
    b = Bus(broker, (topic,), **kw)
    try:
        return b.wait(lambda m: m.retain, timeout, what=f"retained {topic}").doc
    finally:
        b.close()


@dataclass
class DaemonProc:
    """`python -m edgetune.main daemon --config FILE` as a real process, with its own state/runtime dirs."""

    config: Path
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    def start(self, *args: str) -> "DaemonProc":
        """`args`: extra `edgetune daemon` flags for this start (e.g. --reset)."""
        self.log_path = self.config.parent / f"daemon-{time.monotonic_ns()}.log"
        with open(self.log_path, "wb") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen([sys.executable, "-m", "edgetune.main", "daemon", "--config",
                                          str(self.config), *args], cwd=REPO, env=self.env,
                                         stdout=subprocess.DEVNULL, stderr=log)
        return self

    @property
    def log(self) -> str:
        return self.log_path.read_text() if self.log_path else ""

    @property
    def state_dir(self) -> Path:
        return Path(self.env["STATE_DIRECTORY"])

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "edgetune.main", *args], cwd=REPO, env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def request(self, req: dict) -> dict:
        from daemon import control

        return next(control.request(req, path=Path(self.env["RUNTIME_DIRECTORY"]) / "control.sock"))

    def wait_status(self, pred: Callable[[dict], bool], timeout: float = 30.0) -> dict:
        """Poll the control socket until the status matches (the daemon may still be starting)."""
        from daemon.control import DaemonDown

        deadline = time.monotonic() + timeout
        last: dict = {}
        while time.monotonic() < deadline:
            assert self.proc and self.proc.poll() is None, f"daemon exited:\n{self.log[-3000:]}"
            try:
                last = self.request({"op": "status"})
                if pred(last):
                    return last
            except (DaemonDown, OSError, StopIteration):
                pass
            time.sleep(0.05)
        raise AssertionError(f"status never matched; last: {last}\n{self.log[-3000:]}")

    def signal(self, sig: int, timeout: float = 60) -> int:
        assert self.proc
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def kill9(self) -> None:
        self.signal(signal.SIGKILL)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def env_for(tmp: Path, cache: Path) -> dict[str, str]:
    """Explicit dirs, for daemons that outlive one test's isolated_dirs (module-scoped fixtures)."""
    env = dict(os.environ)
    for name, sub in (("STATE_DIRECTORY", "state"), ("RUNTIME_DIRECTORY", "run"), ("CONFIGURATION_DIRECTORY", "etc")):
        (tmp / sub).mkdir(parents=True, exist_ok=True)
        env[name] = str(tmp / sub)
    env["CACHE_DIRECTORY"] = str(cache)
    return env
