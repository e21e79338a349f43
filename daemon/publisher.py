"""Daemon events → outbox rows on the contract topics (DESIGN.md), all QoS 1.

Without a broker configured only tuning records are queued: they are training data a broker added later still
wants, while status, info, config/active and telemetry describe the present and are published afresh on connect.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from daemon.outbox import Outbox
from edgetune import __version__
from edgetune.protocol import QOS, Topics, encode


def status_doc(state: str, session: int) -> dict:
    return {"state": state, "session": session, "version": __version__, "ts": time.time()}


class Publisher:
    def __init__(self, outbox: Outbox, topics: Topics, broker: bool, wake: Callable[[], None] = lambda: None):
        self.outbox, self.topics, self.broker, self.wake = outbox, topics, broker, wake

    def _put(self, topic: str, doc: Any, kind: str, retain: bool = False) -> None:
        if self.broker or kind == "record":
            self.outbox.enqueue(topic, encode(doc), qos=QOS, retain=retain, kind=kind)
            self.wake()

    def status(self, state: str, session: int) -> None:
        self._put(self.topics.status, status_doc(state, session), "status", retain=True)

    def info(self, doc: dict) -> None:
        self._put(self.topics.info, doc, "info", retain=True)

    def config_active(self, doc: dict) -> None:
        self._put(self.topics.config_active, doc, "config", retain=True)

    def record(self, doc: dict) -> None:
        self._put(self.topics.record, doc, "record")

    def telemetry(self, doc: dict) -> None:
        self._put(self.topics.telemetry, doc, "telemetry")

    def response(self, command_id: str | None, doc: dict) -> None:
        self._put(self.topics.cmd_res(command_id), doc, "response")
