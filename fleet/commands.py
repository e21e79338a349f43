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
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from edgetune.broker import BrokerError, BrokerSettings, Client, Connection, Handler, Message
from edgetune.errors import BadInput
from edgetune.protocol import COMMAND_STATES, EXPIRED, OPS, TERMINAL_STATES, Topics, encode
from fleet.mqtt import hostname

log = logging.getLogger("fleet.commands")


MAX_TTL_S = 86400.0  # no longer than a device's default MQTT session (BrokerSettings.session_expiry_s) lasts


def new_command(op: str, args: dict | None = None, ttl_s: float = 600.0, now: float | None = None) -> dict:
    """A cmd/req payload with a fresh id; the device rejects it after `expires_at` (unix seconds)."""
    if op not in OPS:
        raise BadInput(f"unknown op {op!r}; ops: {', '.join(OPS)}")
    if not 0 < ttl_s <= MAX_TTL_S:
        raise BadInput(f"command lifetime {ttl_s} s: must be > 0 and at most {MAX_TTL_S:.0f} s, as long as a device's "
                       "broker session keeps queued commands")
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
        if not self.responses and time.time() > self.command["expires_at"]:
            return EXPIRED  # unanswered past its lifetime: no device takes it any more
        if self.timed_out:
            return "timeout"
        return self.responses[-1]["status"] if self.responses else "sent"

    def to_dict(self) -> dict:
        f = self.final or {}
        return {"id": self.command["id"], "device": self.device, "op": self.command["op"], "args": self.command["args"],
                "expires_at": self.command["expires_at"], "status": self.status, "reason": f.get("reason"),
                "result": f.get("result"), "device_state": self.device_state, "responses": self.responses}


class _Conn(Handler):
    """A short-lived clean-session client for one command: its responses and the device's status are queued."""

    def __init__(self, settings: BrokerSettings, topics: list[str], connect_timeout_s: float):
        self.connect_timeout_s = connect_timeout_s
        self.messages: queue.Queue[tuple[str, bytes]] = queue.Queue()
        client_id = f"edgetune-fleet-cli-{hostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.client = Client(settings, client_id, self, subscriptions=topics, name="fleet-command")

    def open(self) -> "_Conn":
        self.client.start()
        try:
            self.client.wait_ready(self.connect_timeout_s)
        except BrokerError:
            self.client.stop()
            raise
        return self

    def on_message(self, conn: Connection, msg: Message) -> None:
        self.messages.put((msg.topic, msg.payload))

    def close(self) -> None:
        self.client.stop()

    def publish(self, topic: str, payload: dict) -> None:
        self.client.publish_wait(topic, encode(payload), self.connect_timeout_s)


def send_command(settings: BrokerSettings, device: str, command: dict, *, wait: bool, timeout_s: float,
                 on_response: Callable[[dict], None] | None = None,
                 on_status: Callable[[str, dict], None] | None = None,
                 connect_timeout_s: float = 10.0) -> CommandRun:
    """Publish `command` to `device`; with `wait`, collect cmd/res/{id} until a final status or `timeout_s`."""
    topics = Topics(device)  # BadInput naming a bad id, before anything is sent
    res_topic, status_topic = topics.cmd_res(command["id"]), topics.status
    run = CommandRun(device, command)
    conn = _Conn(settings, [res_topic, status_topic] if wait else [], connect_timeout_s).open()
    try:
        conn.publish(topics.cmd_req, command)
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
            if obj.get("status") not in COMMAND_STATES:
                log.warning("ignoring a response with status %r", obj.get("status"))
                continue
            run.responses.append(obj)
            if on_response:
                on_response(obj)
            if obj["status"] in TERMINAL_STATES:
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
