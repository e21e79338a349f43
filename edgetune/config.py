"""The config: TOML at <config_dir>/edgetune.toml plus conf.d/*.toml merged in name order, or one --config file.

The base owns the loader and the problem reporting, not the vocabulary: each package declares its own sections
(a dataclass whose fields are the keys, value checks, checks across keys) in a module listed in SECTION_MODULES,
as each package registers its own verbs (edgetune.main). The base itself declares the device id and [mqtt], the
settings of the broker link.

Every problem is collected with its file and key instead of stopping at the first, so `edgetune config check` can
show an operator the whole list in one go. A key whose value is wrong is reported and left at its default.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import re
import socket
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, make_dataclass
from pathlib import Path
from typing import Any, Callable

from edgetune import paths
from edgetune.broker import PROTOCOLS, BrokerSettings
from edgetune.errors import BadInput
from edgetune.protocol import ID_MAX, ID_RE, ID_RULE

# Each module exposes SECTIONS, a list of Section; this order (after the base's own) is the order of the keys in
# `config check --json` and of the problems across keys.
SECTION_MODULES = ["daemon.config", "tuner.config", "hwprobe.power.config", "fleet.config"]
MACHINE_ID = Path("/etc/machine-id")


@dataclass
class DeviceConfig:
    """The top-level keys the base owns."""

    device_id: str = ""  # empty: derived from /etc/machine-id (hashed), else the hostname


@dataclass(frozen=True)
class Problem:
    file: str
    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.key + ': ' if self.key else ''}{self.message}"


Check = Callable[[Any], str | None]  # a value check: the problem, or None
Source = Callable[[str], str]  # the file that set a dotted key ("(defaults)" when none did)


class Config:
    """A loaded config: the top-level keys and one attribute per table (`cfg.tuning.budget`), as the registered
    sections declare them."""


@dataclass(frozen=True)
class Section:
    """One package's part of the config."""

    name: str  # its TOML table; "" puts the dataclass's fields among the top-level keys
    cls: type  # a dataclass: its fields are the keys, their type hints are checked
    checks: Mapping[str, Check] = field(default_factory=dict)  # value checks by key (dotted into sub-tables)
    cross: Callable[[Any, Source], list[Problem]] | None = None  # checks across keys, on the whole loaded config


@dataclass
class Loaded:
    config: Config
    files: list[str]
    problems: list[Problem]


def positive(v: Any) -> str | None:
    return None if v > 0 else "must be > 0"


def readable(v: str) -> str | None:
    p = Path(v)
    if not p.is_file():
        return f"{v} does not exist or is not a file"
    try:
        p.open("rb").close()
    except OSError as e:
        return f"{v} is not readable: {e.strerror}"
    return None


def _mqtt_pairs(cfg: Any, src: Source) -> list[Problem]:
    out = []
    tls = cfg.mqtt.tls
    if tls.cert and not tls.key:
        out.append(Problem(src("mqtt.tls.cert"), "mqtt.tls.key", "a client cert needs its key"))
    if tls.key and not tls.cert:
        out.append(Problem(src("mqtt.tls.key"), "mqtt.tls.cert", "a client key needs its cert"))
    if cfg.mqtt.password is not None and cfg.mqtt.username is None:
        out.append(Problem(src("mqtt.password"), "mqtt.username", "a password needs a username"))
    return out


BASE_SECTIONS = [
    Section("", DeviceConfig, {"device_id": lambda v: None if ID_RE.fullmatch(v) else
            f"must be {ID_RULE} (it is an MQTT topic level and the client id)"}),
    Section("mqtt", BrokerSettings, {
        "host": lambda v: None if v.strip() else "must not be empty (leave it out for no broker)",
        "port": lambda v: None if 1 <= v <= 65535 else "must be 1-65535",
        "keepalive": lambda v: None if 1 <= v <= 65535 else "must be 1-65535 seconds",
        "will_delay_s": lambda v: None if v >= 0 else "must be >= 0",
        "session_expiry_s": lambda v: None if v >= 60 else "must be >= 60 seconds (queued commands wait this long)",
        "protocol": lambda v: None if v in PROTOCOLS else f"must be one of: {', '.join(PROTOCOLS)}",
        "reconnect_min_s": positive,
        "reconnect_max_s": positive,
        "tls.ca": readable,
        "tls.cert": readable,
        "tls.key": readable,
    }, _mqtt_pairs),
]


def sections() -> list[Section]:
    """The base's sections, then those of every SECTION_MODULES module, in that order."""
    return BASE_SECTIONS + [s for name in SECTION_MODULES for s in importlib.import_module(name).SECTIONS]


@dataclass(frozen=True)
class _Schema:
    cls: type  # the Config dataclass: every section's top-level keys, then one field per table
    checks: dict[str, Check]  # by full dotted key
    cross: list[Callable[[Any, Source], list[Problem]]]


def _copy(f: Any) -> Any:
    """A fresh field with `f`'s default, for the Config dataclass."""
    return field(default=f.default) if f.default is not MISSING else field(default_factory=f.default_factory)


@functools.cache
def _schema() -> _Schema:
    top: list[tuple[str, Any, Any]] = []
    tables: list[tuple[str, Any, Any]] = []
    checks: dict[str, Check] = {}
    secs = sections()
    for s in secs:
        if s.name:
            tables.append((s.name, s.cls, field(default_factory=s.cls)))
        else:
            hints = typing.get_type_hints(s.cls)
            top += [(f.name, hints[f.name], _copy(f)) for f in fields(s.cls)]
        checks.update({(s.name + "." if s.name else "") + k: c for k, c in s.checks.items()})
    names = [n for n, _, _ in top + tables]
    if len(set(names)) != len(names):
        raise RuntimeError(f"config sections declare a key twice: {sorted(n for n in names if names.count(n) > 1)}")
    cls = make_dataclass("Config", top + tables, bases=(Config,))
    return _Schema(cls, checks, [s.cross for s in secs if s.cross])


def _type_ok(value: Any, hint: Any) -> tuple[bool, Any]:
    """Whether a TOML value fits a field's type (bool is not an int here); ints are accepted for floats."""
    args = typing.get_args(hint)
    if type(None) in args:
        return _type_ok(value, next(a for a in args if a is not type(None)))
    if typing.get_origin(hint) is list:
        return isinstance(value, list) and all(isinstance(x, str) for x in value), value
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


def _walk(raw: dict, cls: type, prefix: str, file: str, problems: list[Problem], checks: dict[str, Check]) -> dict:
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
            out[k] = _walk(v, hint, key + ".", file, problems, checks)
            continue
        ok, v = _type_ok(v, hint)
        if not ok:
            problems.append(Problem(file, key, f"must be {_type_name(hint)}, not {v!r}"))
            continue
        msg = checks.get(key, lambda _: None)(v)
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
    schema = _schema()
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
        _merge(merged, _walk(raw, schema.cls, "", str(f), problems, schema.checks), sources, str(f))
    cfg = _build(schema.cls, merged)
    src = lambda key: sources.get(key, "(defaults)")  # noqa: E731
    for cross in schema.cross:  # checks across keys, each reported at the file that set the key
        problems += cross(cfg, src)
    if not cfg.device_id:
        cfg.device_id = default_device_id()
    return Loaded(cfg, [str(f) for f in files], problems)


def load_or_raise(path: str | Path | None = None) -> Config:
    loaded = load(path)
    if loaded.problems:
        check = "edgetune config check" + (f" --config {path}" if path else "")
        raise BadInput(f"config has problems (run `{check}`):\n  "
                       + "\n  ".join(map(str, loaded.problems)))
    return loaded.config
