"""The config: TOML at <config_dir>/edgetune.toml plus conf.d/*.toml merged in name order, or one --config file.

It lives in the base package because verbs of several layers read it (the daemon; `tune --objective` reads
[power]). Checks that need a higher layer's vocabulary (strategies, workload files, power meters) import it
lazily, only while checking.

Every problem is collected with its file and key instead of stopping at the first, so `edgetune config check` can
show an operator the whole list in one go. A key whose value is wrong is reported and left at its default.
"""

from __future__ import annotations

import hashlib
import re
import socket
import tomllib
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable

from edgetune import paths
from edgetune.broker import PROTOCOLS, BrokerSettings
from edgetune.errors import BadInput
from edgetune.protocol import ID_MAX, ID_RE, ID_RULE

OBJECTIVES = ("latency", "energy", "edp")  # what tuning minimises (tuner.objective)
MACHINE_ID = Path("/etc/machine-id")


@dataclass
class OutboxConfig:
    max_bytes: int = 64 * 1024 * 1024
    max_age_s: float = 7 * 86400.0  # telemetry older than this is dropped; records and results never are


@dataclass
class TuningConfig:
    strategy: str = "llm"  # the tuner model; falls back to anneal without a usable model
    budget: int = 40  # evals per workload
    workloads: list[str] = field(default_factory=lambda: ["bundled", str(paths.config_dir() / "workloads.d/*.toml")])
    objective: str = "latency"


@dataclass
class DaemonConfig:
    device_id: str = ""  # empty: derived from /etc/machine-id (hashed), else the hostname
    telemetry_interval_s: float = 60.0
    idle_load_threshold: float = 0.5  # load1 per core under which background tuning runs
    mqtt: BrokerSettings = field(default_factory=BrokerSettings)
    outbox: OutboxConfig = field(default_factory=OutboxConfig)
    tuning: TuningConfig = field(default_factory=TuningConfig)
    power: dict = field(default_factory=dict)  # [power]: the meter, checked by hwprobe.power.meter_from_config


@dataclass(frozen=True)
class Problem:
    file: str
    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.key + ': ' if self.key else ''}{self.message}"


@dataclass
class Loaded:
    config: DaemonConfig
    files: list[str]
    problems: list[Problem]


def _positive(v: Any) -> str | None:
    return None if v > 0 else "must be > 0"


def _strategy(v: str) -> str | None:
    from tuner.strategies import STRATEGIES

    return None if v in STRATEGIES else f"unknown strategy {v!r}; strategies: {', '.join(STRATEGIES)}"


def _readable(v: str) -> str | None:
    p = Path(v)
    if not p.is_file():
        return f"{v} does not exist or is not a file"
    try:
        p.open("rb").close()
    except OSError as e:
        return f"{v} is not readable: {e.strerror}"
    return None


# value checks by dotted key; each returns the problem or None
CHECKS: dict[str, Callable[[Any], str | None]] = {
    "device_id": lambda v: None if ID_RE.fullmatch(v) else
    f"must be {ID_RULE} (it is an MQTT topic level and the client id)",
    "telemetry_interval_s": _positive,
    "idle_load_threshold": _positive,
    "mqtt.host": lambda v: None if v.strip() else "must not be empty (leave it out for no broker)",
    "mqtt.port": lambda v: None if 1 <= v <= 65535 else "must be 1-65535",
    "mqtt.keepalive": lambda v: None if 1 <= v <= 65535 else "must be 1-65535 seconds",
    "mqtt.will_delay_s": lambda v: None if v >= 0 else "must be >= 0",
    "mqtt.protocol": lambda v: None if v in PROTOCOLS else f"must be one of: {', '.join(PROTOCOLS)}",
    "mqtt.reconnect_min_s": _positive,
    "mqtt.reconnect_max_s": _positive,
    "mqtt.tls.ca": _readable,
    "mqtt.tls.cert": _readable,
    "mqtt.tls.key": _readable,
    "outbox.max_bytes": lambda v: None if v >= 64 * 1024 else "must be at least 65536",
    "outbox.max_age_s": _positive,
    "tuning.strategy": _strategy,
    "tuning.budget": lambda v: None if 1 <= v <= 100_000 else "must be 1-100000 evals",
    "tuning.objective": lambda v: None if v in OBJECTIVES else f"must be one of: {', '.join(OBJECTIVES)}",
}


def _type_ok(value: Any, hint: Any) -> tuple[bool, Any]:
    """Whether a TOML value fits a field's type (bool is not an int here); ints are accepted for floats."""
    args = typing.get_args(hint)
    if type(None) in args:
        return _type_ok(value, next(a for a in args if a is not type(None)))
    if typing.get_origin(hint) is list:
        return isinstance(value, list) and all(isinstance(x, str) for x in value), value
    if hint is dict:
        return isinstance(value, dict), value
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if hint is int:
        return type(value) is int, value
    return isinstance(value, hint), value


def _type_name(hint: Any) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is list:
        return "a list of strings"
    h = args[0] if args else hint
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false"}.get(h, str(h))


def _walk(raw: dict, cls: type, prefix: str, file: str, problems: list[Problem]) -> dict:
    """Check one file's table against a dataclass; returns only the keys that passed, for merging."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    out: dict[str, Any] = {}
    for k, v in raw.items():
        key = prefix + k
        if k not in known:
            problems.append(Problem(file, key, f"unknown key; keys{' in [' + prefix[:-1] + ']' if prefix else ''}: "
                                               f"{', '.join(sorted(known))}"))
            continue
        hint = hints[k]
        if is_dataclass(hint):
            if not isinstance(v, dict):
                problems.append(Problem(file, key, f"must be a table ([{key}])"))
                continue
            out[k] = _walk(v, hint, key + ".", file, problems)
            continue
        ok, v = _type_ok(v, hint)
        if not ok:
            problems.append(Problem(file, key, f"must be {_type_name(hint)}, not {v!r}"))
            continue
        msg = CHECKS.get(key, lambda _: None)(v)
        if msg:
            problems.append(Problem(file, key, msg))
            continue
        out[k] = v
    return out


def _merge(into: dict, new: dict, sources: dict[str, str], file: str, prefix: str = "") -> None:
    for k, v in new.items():
        if isinstance(v, dict):
            _merge(into.setdefault(k, {}), v, sources, file, prefix + k + ".")
        else:
            into[k] = v  # lists replace, they do not append
            sources[prefix + k] = file


def _build(cls: type, values: dict) -> Any:
    hints = typing.get_type_hints(cls)
    return cls(**{k: _build(hints[k], v) if is_dataclass(hints[k]) else v for k, v in values.items()})


def default_device_id() -> str:
    """Stable per installation without exposing the machine-id itself (it is a secret-ish unique id)."""
    try:
        mid = MACHINE_ID.read_text().strip()
    except OSError:
        mid = ""
    if mid:
        return "et-" + hashlib.sha256(f"edgetune:{mid}".encode()).hexdigest()[:16]
    host = re.sub(r"[^A-Za-z0-9_.:-]", "-", socket.gethostname()).strip("-.") or "device"
    return host[:ID_MAX]


def config_files(path: str | Path | None) -> list[Path]:
    if path is not None:
        return [Path(path)]
    base = paths.config_dir()
    return [p for p in [base / "edgetune.toml", *sorted((base / "conf.d").glob("*.toml"))] if p.exists()]


def load(path: str | Path | None = None) -> Loaded:
    """Read and check the config; never raises for config problems (they are in .problems)."""
    problems: list[Problem] = []
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    files = config_files(path)
    for f in files:
        try:
            raw = tomllib.loads(f.read_bytes().decode("utf-8"))
        except OSError as e:
            problems.append(Problem(str(f), "", f"cannot read: {e.strerror}"))
            continue
        except UnicodeDecodeError as e:
            problems.append(Problem(str(f), "", f"not UTF-8 text (byte {e.start})"))
            continue
        except tomllib.TOMLDecodeError as e:
            problems.append(Problem(str(f), "", f"not valid TOML: {e}"))  # tomllib names line and column
            continue
        _merge(merged, _walk(raw, DaemonConfig, "", str(f), problems), sources, str(f))
    cfg = _build(DaemonConfig, merged)
    problems += _cross_checks(cfg, sources)
    if not cfg.device_id:
        cfg.device_id = default_device_id()
    return Loaded(cfg, [str(f) for f in files], problems)


def _cross_checks(cfg: DaemonConfig, sources: dict[str, str]) -> list[Problem]:
    """Checks that span keys, each reported at the file that set the key."""
    out = []
    src = lambda key: sources.get(key, "(defaults)")  # noqa: E731
    tls = cfg.mqtt.tls
    if tls.cert and not tls.key:
        out.append(Problem(src("mqtt.tls.cert"), "mqtt.tls.key", "a client cert needs its key"))
    if tls.key and not tls.cert:
        out.append(Problem(src("mqtt.tls.key"), "mqtt.tls.cert", "a client key needs its cert"))
    if cfg.mqtt.password is not None and cfg.mqtt.username is None:
        out.append(Problem(src("mqtt.password"), "mqtt.username", "a password needs a username"))
    try:
        from kernels.workload_files import load_workload_files

        if not load_workload_files(cfg.tuning.workloads):
            out.append(Problem(src("tuning.workloads"), "tuning.workloads", "selects no workloads"))
    except BadInput as e:
        out.append(Problem(src("tuning.workloads"), "tuning.workloads", str(e)))
    from hwprobe.power import meter_from_config

    try:
        meter = meter_from_config(cfg.power)
        if cfg.tuning.objective != "latency" and meter is None:
            out.append(Problem(src("tuning.objective"), "tuning.objective",
                               f"{cfg.tuning.objective!r} needs a power meter: set [power] meter (text, um or rapl)"))
    except BadInput as e:
        out.append(Problem(src("power.meter"), "power", str(e)))
    return out


def load_or_raise(path: str | Path | None = None) -> DaemonConfig:
    loaded = load(path)
    if loaded.problems:
        raise BadInput("config has problems (run `edgetune config check`):\n  "
                       + "\n  ".join(map(str, loaded.problems)))
    return loaded.config
