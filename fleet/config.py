"""The `[fleet]` config section of `edgetune fleet serve`: its databases, where it listens, when a device is stale,
how long telemetry is kept, and the shared-subscription group of a receiver that shares the load with others.

It is one of the registered config sections (edgetune.config SECTION_MODULES), so `edgetune config check` checks
it with the rest of the files (`<config dir>/edgetune.toml` and `conf.d/*.toml`, or one `--config FILE`).

    [fleet]
    database = "/var/lib/edgetune/fleet.db"        # a path, sqlite:///path, or postgresql://user@host/db
    auth_database = "/var/lib/edgetune/fleet-auth.db"  # API tokens and the session key (SQLite), mode 0600
    host = "127.0.0.1"                             # bind address; put TLS in a reverse proxy in front
    port = 8080
    stale_minutes = 10                             # an `online` device not heard from this long is `stale`
    retention_days = 30                            # telemetry received longer ago than this is deleted
    share_group = ""                               # "fleet": N receivers split $share/fleet/edgetune/v1/+/…
    session_hours = 12                             # browser login lifetime
    secure_cookies = false                         # true behind an HTTPS proxy: cookies only over TLS
    anonymous_read = false                         # true: pages and GET API without a login (viewer role)
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from edgetune import paths
from edgetune.config import Problem, Section, load
from edgetune.errors import BadInput
from edgetune.protocol import ProtocolError, topic_filter
from fleet.db import is_postgres


@dataclass(frozen=True)
class FleetConfig:
    database: str = ""
    auth_database: str = ""
    host: str = "127.0.0.1"
    port: int = 8080
    stale_minutes: float = 10.0
    retention_days: float = 30.0
    share_group: str = ""
    session_hours: float = 12.0
    secure_cookies: bool = False
    anonymous_read: bool = False

    @property
    def db(self) -> Path | str:
        """The fleet DB: a postgresql:// URL, or the SQLite file."""
        if is_postgres(self.database):
            return self.database
        return _sqlite_path(self.database) if self.database else paths.state_dir() / "fleet.db"

    @property
    def auth_path(self) -> Path:
        return _sqlite_path(self.auth_database) if self.auth_database else paths.state_dir() / "fleet-auth.db"


def _sqlite_path(url: str) -> Path:
    return Path(url[len("sqlite:///") - 1:] if url.startswith("sqlite:///") else url)


def _database(v: str) -> str | None:
    if is_postgres(v):
        return None
    if "://" in v and not v.startswith("sqlite:///"):
        return "must be a file path, sqlite:///ABSOLUTE/PATH or postgresql://USER@HOST/DB"
    return None if v.strip() else "must not be empty (leave it out for the default)"


def _auth_database(v: str) -> str | None:
    if is_postgres(v):
        return "the auth DB is a local SQLite file (credentials stay off the shared fleet DB); give a path"
    return _database(v)


def _share_group(v: str) -> str | None:
    if not v:
        return None
    try:
        topic_filter(share=v)
    except ProtocolError as e:
        return str(e)
    return None


def _positive(v: float) -> str | None:
    return None if v > 0 else "must be > 0"


SECTIONS = [Section("fleet", FleetConfig, {
    "database": _database,
    "auth_database": _auth_database,
    "host": lambda v: None if v.strip() else "must not be empty",
    "port": lambda v: None if 1 <= v <= 65535 else "must be 1-65535",
    "stale_minutes": _positive,
    "retention_days": _positive,
    "share_group": _share_group,
    "session_hours": _positive,
})]


def load_fleet_config(path: str | Path | None = None, **overrides: Any) -> FleetConfig:
    """The [fleet] section of the config files, with `overrides` (CLI flags that were given) on top. Raises
    BadInput listing every problem of the files and flags with its file and key; problems of other sections are
    `edgetune config check`'s business, not a reason to refuse serving."""
    if path is not None and not Path(path).is_file():
        raise BadInput(f"--config {path}: no such file")
    loaded = load(path)
    problems = [p for p in loaded.problems if p.key == "" or p.key.split(".")[0] == "fleet"]
    given = {k: v for k, v in overrides.items() if v is not None}
    checks = SECTIONS[0].checks
    for k, v in given.items():
        msg = checks[k](v) if k in checks else None
        if msg:
            problems.append(Problem("(command line)", f"fleet.{k}", msg))
    if problems:
        raise BadInput("fleet config has problems:\n  " + "\n  ".join(map(str, problems)))
    assert set(given) <= {f.name for f in fields(FleetConfig)}
    return replace(loaded.config.fleet, **given)
