"""The daemon's config sections: its top-level keys, [outbox] and [model_update] (see edgetune.config)."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from edgetune.config import Section, positive
from edgetune.errors import BadInput
from edgetune.release import MAX_MODEL_BYTES
from hwprobe import cpuinfo, isa
from hwprobe.isa import LADDERS

ROOT = Path("/")  # the live system: the device whose config this is


@dataclass
class DaemonKeys:
    """The daemon's top-level keys."""

    telemetry_interval_s: float = 60.0
    idle_load_threshold: float = 0.5  # load1 per core under which background tuning runs
    isa: str = ""  # cap the ISA, e.g. "x86-64-v2": tune as a smaller device of this arch would (empty: the CPU's)


def _isa(v: str) -> str | None:
    """Checked against the levels this device's CPU has, not every arch's: a level of another arch (or above this
    CPU) passed `config check` and then stopped the daemon at start, with a message naming a CLI flag."""
    if v == "":
        return None
    cpu = cpuinfo.parse(ROOT, live=True)
    names = [r.name for r in LADDERS.get(cpu.arch, ())]
    if not names:
        return f"{v!r}: this {cpu.arch} device has no ISA levels to cap; leave isa empty"
    top = names.index(isa.detect(cpu.arch, cpu.flags, ROOT).detected_isa)
    allowed = names[:top + 1]
    return None if v in allowed else (f"{v!r} is not an ISA level of this {cpu.arch} device; one of "
                                      f"{', '.join(allowed)}, or empty for the CPU's own")


@dataclass
class OutboxConfig:
    max_bytes: int = 64 * 1024 * 1024
    max_age_s: float = 7 * 86400.0  # telemetry older than this is dropped; records and results never are
    # keep tuning records and final command responses until a fleet receiver acknowledges them (protocol `ack`);
    # false only without an edgetune fleet receiver, when the broker's PUBACK is all there is
    fleet_ack: bool = True
    resend_s: float = 300.0  # a record the fleet has not acknowledged this long after the broker had it goes again


SECTIONS = [
    Section("", DaemonKeys, {"telemetry_interval_s": positive, "idle_load_threshold": positive, "isa": _isa}),
    Section("outbox", OutboxConfig, {
        "max_bytes": lambda v: None if v >= 64 * 1024 else "must be at least 65536",
        "max_age_s": positive,
        "resend_s": positive,
    }),
]


@dataclass
class ModelUpdateConfig:
    """[model_update]: follow the fleet's signed tuner-model releases (daemon.model_update)."""

    enabled: bool = True
    trusted_keys: list[str] = field(default_factory=list)  # ed25519 public key files (PEM or base64 raw)
    fleet_url: str = ""  # the fleet server's base URL; a release's file is fleet_url + manifest url (else MQTT chunks)
    max_bytes: int = 16 << 20  # the largest model file this device takes
    latency_budget_ms: float = 5000.0  # the health check: proposing for one workload may take this long
    top_k: int = 3  # the health check compares the measured best of each model's top-K
    rounds: int = 5  # interleaved rounds of that comparison
    tolerance: float = 0.05  # the new model's top-K may measure up to this much slower (noise) and still pass
    http_timeout_s: float = 30.0
    mqtt_timeout_s: float = 30.0  # a download in MQTT chunks asks again after this long without a chunk


def _trusted(v: list[str]) -> str | None:
    from edgetune.release import load_trusted_keys

    try:
        load_trusted_keys([Path(p) for p in v])
    except BadInput as e:
        return str(e)
    return None


def _url(v: str) -> str | None:
    u = urllib.parse.urlsplit(v)
    if v and (u.scheme not in ("http", "https") or not u.netloc or u.query or u.fragment):
        return f"{v!r} must be an http:// or https:// base URL such as http://fleet.example:8080"
    return None


SECTIONS.append(Section("model_update", ModelUpdateConfig, {
    "trusted_keys": _trusted,
    "fleet_url": _url,
    "max_bytes": lambda v: None if 1 <= v <= MAX_MODEL_BYTES else f"must be 1-{MAX_MODEL_BYTES}",
    "latency_budget_ms": positive,
    "top_k": lambda v: None if 1 <= v <= 20 else "must be 1-20",
    "rounds": lambda v: None if 1 <= v <= 50 else "must be 1-50",
    "tolerance": lambda v: None if 0 <= v < 1 else "must be in [0, 1)",
    "http_timeout_s": positive,
    "mqtt_timeout_s": positive,
}))
