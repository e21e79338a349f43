"""The daemon's config sections: its top-level keys and [outbox] (see edgetune.config)."""

from __future__ import annotations

from dataclasses import dataclass

from edgetune.config import Section, positive


@dataclass
class DaemonKeys:
    """The daemon's top-level keys."""

    telemetry_interval_s: float = 60.0
    idle_load_threshold: float = 0.5  # load1 per core under which background tuning runs


@dataclass
class OutboxConfig:
    max_bytes: int = 64 * 1024 * 1024
    max_age_s: float = 7 * 86400.0  # telemetry older than this is dropped; records and results never are
    # keep tuning records and final command responses until a fleet receiver acknowledges them (protocol `ack`);
    # false only without an edgetune fleet receiver, when the broker's PUBACK is all there is
    fleet_ack: bool = True
    resend_s: float = 300.0  # a record the fleet has not acknowledged this long after the broker had it goes again


SECTIONS = [
    Section("", DaemonKeys, {"telemetry_interval_s": positive, "idle_load_threshold": positive}),
    Section("outbox", OutboxConfig, {
        "max_bytes": lambda v: None if v >= 64 * 1024 else "must be at least 65536",
        "max_age_s": positive,
        "resend_s": positive,
    }),
]
