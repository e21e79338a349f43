"""The `[fleet]` config section of `edgetune fleet serve`: its databases, where it listens, when a device is stale.

It reads the same files as the daemon config (`<config dir>/edgetune.toml` and `conf.d/*.toml`, or one
`--config FILE`) and looks only at their `[fleet]` tables, later files overriding earlier ones key by key. It is
self-contained so that it can register itself as a section once the base config loader takes per-package
sections; until then the daemon's loader does not know the key `fleet`.

    [fleet]
    database = "/var/lib/edgetune/fleet.db"        # a path or sqlite:///path; default <state dir>/fleet.db
    auth_database = "/var/lib/edgetune/fleet-auth.db"  # API tokens and the session key, mode 0600
    host = "127.0.0.1"                             # bind address; put TLS in a reverse proxy in front
    port = 8080
    stale_minutes = 10                             # an `online` device not heard from this long is `stale`
    retention_days = 30                            # telemetry older than this is not shown
    session_hours = 12                             # browser login lifetime
    secure_cookies = false                         # true behind an HTTPS proxy: cookies only over TLS
    anonymous_read = false                         # true: pages and GET API without a login (viewer role)
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable

from edgetune import paths
from edgetune.config import Problem, config_files
from edgetune.errors import BadInput


@dataclass(frozen=True)
class FleetConfig:
    database: str = ""
    auth_database: str = ""
    host: str = "127.0.0.1"
    port: int = 8080
    stale_minutes: float = 10.0
    retention_days: float = 30.0
    session_hours: float = 12.0
    secure_cookies: bool = False
    anonymous_read: bool = False

    @property
    def database_path(self) -> Path:
        return _sqlite_path(self.database) if self.database else paths.state_dir() / "fleet.db"

    @property
    def auth_path(self) -> Path:
        return _sqlite_path(self.auth_database) if self.auth_database else paths.state_dir() / "fleet-auth.db"


def _sqlite_path(url: str) -> Path:
    return Path(url[len("sqlite:///") - 1:] if url.startswith("sqlite:///") else url)


def _database(v: str) -> str | None:
    if v.startswith(("postgresql://", "postgres://")):
        return "PostgreSQL is not supported by this edgetune yet; use a SQLite path"
    if "://" in v and not v.startswith("sqlite:///"):
        return "must be a file path or sqlite:///ABSOLUTE/PATH"
    return None if v.strip() else "must not be empty (leave it out for the default)"


def _positive(v: float) -> str | None:
    return None if v > 0 else "must be > 0"


# key -> (type, check of the value)
_KEYS: dict[str, tuple[type, Callable[[Any], str | None]]] = {
    "database": (str, _database),
    "auth_database": (str, _database),
    "host": (str, lambda v: None if v.strip() else "must not be empty"),
    "port": (int, lambda v: None if 1 <= v <= 65535 else "must be 1-65535"),
    "stale_minutes": (float, _positive),
    "retention_days": (float, _positive),
    "session_hours": (float, _positive),
    "secure_cookies": (bool, lambda v: None),
    "anonymous_read": (bool, lambda v: None),
}
_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}
assert set(_KEYS) == {f.name for f in fields(FleetConfig)}


def _check(file: str, table: Any) -> tuple[dict[str, Any], list[Problem]]:
    if not isinstance(table, dict):
        return {}, [Problem(file, "fleet", "must be a table ([fleet])")]
    values, problems = {}, []
    for k, v in table.items():
        key = f"fleet.{k}"
        if k not in _KEYS:
            problems.append(Problem(file, key, f"unknown key; keys in [fleet]: {', '.join(sorted(_KEYS))}"))
            continue
        typ, check = _KEYS[k]
        if isinstance(v, bool) != (typ is bool) or not isinstance(v, (int, float) if typ is float else typ):
            problems.append(Problem(file, key, f"must be {_TYPE_NAMES[typ]}, not {v!r}"))
            continue
        msg = check(v)
        if msg:
            problems.append(Problem(file, key, msg))
        else:
            values[k] = float(v) if typ is float else v
    return values, problems


def load_fleet_config(path: str | Path | None = None, **overrides: Any) -> FleetConfig:
    """The [fleet] section of the config files, with `overrides` (CLI flags that were given) on top. Raises
    BadInput listing every problem with its file and key."""
    values: dict[str, Any] = {}
    problems: list[Problem] = []
    if path is not None and not Path(path).is_file():
        raise BadInput(f"--config {path}: no such file")
    for f in config_files(path):
        try:
            doc = tomllib.loads(f.read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            problems.append(Problem(str(f), "", f"cannot read as TOML: {e}"))
            continue
        if "fleet" in doc:
            v, p = _check(str(f), doc["fleet"])
            values.update(v)
            problems += p
    given = {k: v for k, v in overrides.items() if v is not None}
    v, p = _check("(command line)", given)
    problems += p
    if problems:
        raise BadInput("fleet config has problems:\n  " + "\n  ".join(map(str, problems)))
    return replace(FleetConfig(**values), **v)
