"""Send a command to one device (cmd/req) and follow its responses (cmd/res/{id}).

The response topic is subscribed before the request is published, so no response can slip past. The device's
retained status is subscribed too, so the operator learns at once when the device is offline or lost.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import paho.mqtt.client as mqtt

from edgetune.errors import BadInput, EdgetuneError
from fleet.ingest import PREFIX, RESPONSE_STATES
from fleet.mqtt import BrokerOpts, connect_kwargs, hostname, make_client, unsupported_protocol

log = logging.getLogger("fleet.commands")

FINAL = ("succeeded", "failed", "rejected")
OPS = ("retune", "probe", "report", "ping")


def check_device_id(device: str) -> str:
    if not device or any(ch in device for ch in "/+#\0") or len(device) > 256:
        raise BadInput(f"device id {device!r}: must be non-empty, at most 256 characters, without / + # or NUL")
    return device


def new_command(op: str, args: dict | None = None, ttl_s: float = 600.0, now: float | None = None) -> dict:
    """A cmd/req payload with a fresh id; the device rejects it after `expires_at` (unix seconds)."""
    if op not in OPS:
        raise BadInput(f"unknown op {op!r}; ops: {', '.join(OPS)}")
    now = time.time() if now is None else now
    return {"id": uuid.uuid4().hex, "op": op, "args": args or {}, "expires_at": round(now + ttl_s, 3)}


@dataclass
class CommandRun:
    device: str
    command: dict
    responses: list[dict] = field(default_factory=list)
    final: dict | None = None
    timed_out: bool = False
    device_state: str | None = None  # from the device's retained status, when seen

    @property
    def status(self) -> str:
        if self.final:
            return self.final["status"]
        if self.timed_out:
            return "timeout"
        return self.responses[-1]["status"] if self.responses else "sent"

    def to_dict(self) -> dict:
        f = self.final or {}
        return {"id": self.command["id"], "device": self.device, "op": self.command["op"], "args": self.command["args"],
                "expires_at": self.command["expires_at"], "status": self.status, "reason": f.get("reason"),
                "result": f.get("result"), "device_state": self.device_state, "responses": self.responses}


class _Conn:
    """A short-lived clean-session client running paho's loop in a background thread."""

    def __init__(self, opts: BrokerOpts, topics: list[str], connect_timeout_s: float):
        self.opts, self.topics, self.connect_timeout_s = opts, topics, connect_timeout_s
        self.messages: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.client: mqtt.Client | None = None

    def open(self) -> "_Conn":
        opts = self.opts
        for attempt in range(2):
            refused: list[Any] = []
            ready = threading.Event()
            client_id = f"edgetune-fleet-cli-{hostname()}-{os.getpid()}-{secrets.token_hex(3)}"
            c = make_client(opts, client_id, persistent=False)

            def on_connect(client: mqtt.Client, userdata: Any, flags: Any, rc: Any, props: Any) -> None:
                if rc.is_failure:
                    refused.append(rc)
                    ready.set()
                elif self.topics:
                    client.subscribe([(t, 1) for t in self.topics])
                else:
                    ready.set()

            def on_subscribe(client: mqtt.Client, userdata: Any, mid: int, rcs: Any, props: Any) -> None:
                bad = [rc for rc in rcs if rc.is_failure]
                if bad:
                    refused.append(f"subscription refused: {bad[0]}")
                ready.set()

            c.on_connect = on_connect
            c.on_subscribe = on_subscribe
            c.on_message = lambda client, userdata, msg: self.messages.put((msg.topic, msg.payload))
            try:
                c.connect(opts.host, opts.port, keepalive=opts.keepalive,
                          **connect_kwargs(opts, persistent=False, session_expiry_s=0))
            except (OSError, ValueError) as e:
                raise EdgetuneError(f"cannot reach broker {opts.label}: {e}") from e
            c.loop_start()
            if not ready.wait(self.connect_timeout_s):
                self._close(c)
                raise EdgetuneError(f"broker {opts.label} did not answer within {self.connect_timeout_s:.0f} s")
            if refused:
                self._close(c)
                if attempt == 0 and opts.v5 and unsupported_protocol(refused[0]):
                    opts = replace(opts, protocol="3.1.1")
                    continue
                raise EdgetuneError(f"broker {opts.label} refused: {refused[0]}")
            self.client = c
            return self
        raise EdgetuneError(f"broker {opts.label} refused MQTT 5 and 3.1.1")

    @staticmethod
    def _close(c: mqtt.Client) -> None:
        try:
            c.disconnect()
        finally:
            c.loop_stop()

    def close(self) -> None:
        if self.client is not None:
            self._close(self.client)
            self.client = None

    def publish(self, topic: str, payload: dict) -> None:
        assert self.client is not None
        info = self.client.publish(topic, json.dumps(payload), qos=1, retain=False)
        try:
            info.wait_for_publish(self.connect_timeout_s)
        except (RuntimeError, ValueError) as e:
            raise EdgetuneError(f"could not publish to {self.opts.label}: {e}") from e
        if not info.is_published():
            raise EdgetuneError(f"broker {self.opts.label} did not acknowledge the command within "
                                f"{self.connect_timeout_s:.0f} s")


def send_command(opts: BrokerOpts, device: str, command: dict, *, wait: bool, timeout_s: float,
                 on_response: Callable[[dict], None] | None = None,
                 on_status: Callable[[str, dict], None] | None = None,
                 connect_timeout_s: float = 10.0) -> CommandRun:
    """Publish `command` to `device`; with `wait`, collect cmd/res/{id} until a final status or `timeout_s`."""
    check_device_id(device)
    base = f"{PREFIX}{device}/"
    res_topic, status_topic = f"{base}cmd/res/{command['id']}", f"{base}status"
    run = CommandRun(device, command)
    conn = _Conn(opts, [res_topic, status_topic] if wait else [], connect_timeout_s).open()
    try:
        conn.publish(f"{base}cmd/req", command)
        log.debug("sent %s %s to %s", command["op"], command["id"], device)
        if not wait:
            return run
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                run.timed_out = True
                return run
            try:
                topic, payload = conn.messages.get(timeout=left)
            except queue.Empty:
                run.timed_out = True
                return run
            try:
                obj = json.loads(payload)
            except ValueError:
                obj = None
            if not isinstance(obj, dict):
                if payload:
                    log.warning("ignoring a non-JSON message on %s", topic)
                continue
            if topic == status_topic:
                run.device_state = obj.get("state") if isinstance(obj.get("state"), str) else None
                if on_status and run.device_state:
                    on_status(run.device_state, obj)
                continue
            if obj.get("status") not in RESPONSE_STATES:
                log.warning("ignoring a response with status %r", obj.get("status"))
                continue
            run.responses.append(obj)
            if on_response:
                on_response(obj)
            if obj["status"] in FINAL:
                run.final = obj
                return run
    finally:
        conn.close()


def progress_parts(p: Any) -> tuple[float | None, float | None, str]:
    """(done, total, text) from a response's `progress`, whatever shape the device chose: a {done, total,
    message}-like object, a fraction in 0..1, a percentage, or a text."""
    def num(x: Any) -> float | None:
        return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None

    if isinstance(p, dict):
        done = next((num(p[k]) for k in ("done", "evals", "completed", "current", "step", "n", "count")
                     if num(p.get(k)) is not None), None)
        total = next((num(p[k]) for k in ("total", "budget", "of", "steps", "evals_total")
                      if num(p.get(k)) is not None), None)
        if done is None:
            frac = next((num(p[k]) for k in ("fraction", "progress") if num(p.get(k)) is not None), None)
            pct = next((num(p[k]) for k in ("percent", "pct") if num(p.get(k)) is not None), None)
            if frac is not None:
                done, total = frac, 1.0
            elif pct is not None:
                done, total = pct, 100.0
        words = [str(p[k]) for k in ("message", "msg", "text", "phase", "stage", "job", "kernel", "workload")
                 if isinstance(p.get(k), (str, int, float)) and p.get(k) != ""]
        return done, total, " ".join(words)
    x = num(p)
    if x is not None:
        if 0 <= x <= 1:
            return x, 1.0, ""
        return x, 100.0, ""
    return None, None, str(p) if p not in (None, "") else ""


def describe_progress(p: Any) -> str:
    done, total, text = progress_parts(p)
    if done is None:
        return text
    if total == 1.0 and done <= 1:
        counted = f"{done:.0%}"
    elif total == 100.0 and not isinstance(p, dict):
        counted = f"{done:.0f}%"
    else:
        counted = f"{done:g}/{total:g}" if total else f"{done:g}"
    return f"{counted} {text}".strip()
