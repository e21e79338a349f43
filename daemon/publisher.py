"""Daemon events → outbox rows on the contract topics (DESIGN.md), all QoS 1.

Without a broker configured only tuning records are queued: they are training data a broker added later still
wants, while status, info, config/active and telemetry describe the present and are published afresh on connect.

With `fleet_ack` (the default), tuning records and final command responses carry their protocol ack key and stay
in the outbox until a fleet receiver acknowledges it. Retained state and open command statuses are replaceable:
a newer one on the same topic supersedes one not yet sent.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from daemon.outbox import Outbox
from edgetune import __version__
from edgetune.protocol import QOS, TERMINAL_STATES, Topics, encode, record_ack_key, result_ack_key


def status_doc(state: str, session: int) -> dict:
    return {"state": state, "session": session, "version": __version__, "ts": time.time()}


class Publisher:
    def __init__(self, outbox: Outbox, topics: Topics, broker: bool, wake: Callable[[], None] = lambda: None,
                 fleet_ack: bool = True):
        self.outbox, self.topics, self.broker, self.wake, self.fleet_ack = outbox, topics, broker, wake, fleet_ack

    def _put(self, topic: str, doc: Any, kind: str, retain: bool = False, ack_key: str | None = None,
             replaceable: bool = False) -> None:
        if self.broker or kind == "record":
            self.outbox.enqueue(topic, encode(doc), qos=QOS, retain=retain, kind=kind,
                                ack_key=ack_key if self.fleet_ack else None, replaceable=replaceable or retain)
            self.wake()

    def status(self, state: str, session: int) -> None:
        self._put(self.topics.status, status_doc(state, session), "status", retain=True)

    def info(self, doc: dict) -> None:
        self._put(self.topics.info, doc, "info", retain=True)

    def config_active(self, doc: dict) -> None:
        self._put(self.topics.config_active, doc, "config", retain=True)

    def model_state(self, doc: dict) -> None:
        self._put(self.topics.model_state, doc, "model", retain=True)

    def record(self, doc: dict) -> None:
        self._put(self.topics.record, doc, "record", ack_key=record_ack_key(doc["record_id"]))

    def telemetry(self, doc: dict) -> None:
        self._put(self.topics.telemetry, doc, "telemetry")

    def response(self, command_id: str | None, doc: dict) -> None:
        final = doc.get("status") in TERMINAL_STATES
        self._put(self.topics.cmd_res(command_id), doc, "response",
                  ack_key=result_ack_key(command_id) if final and command_id else None, replaceable=not final)
