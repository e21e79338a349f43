"""API tokens of the fleet server (viewer and operator roles) and the key that signs its browser sessions.

They live in their own SQLite file (`[fleet] auth_database`, default `<state dir>/fleet-auth.db`, mode 0600), not
in the fleet DB: the fleet DB is data an operator exports, copies and backs up freely, and a credential store
should not travel with it.

A token is 32 random bytes (`et_` + base64url). Only its SHA-256 is stored. A fast hash is enough here, unlike for
passwords: a slow KDF protects low-entropy secrets against guessing, and 256 random bits cannot be guessed, so
bcrypt or argon2 would only add latency to every API request; an unsalted hash also lets a request find its
token by an indexed lookup instead of trying every row.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from edgetune.errors import BadInput
from edgetune.sqlite import DBError, Schema, Store
from fleet.downlog import DownLog
from fleet.text import whole_number

log = logging.getLogger("fleet.tokens")

ROLES = ("viewer", "operator")  # each role may do everything the roles before it may
APP_ID = 0x45544131  # "ETA1"
PREFIX = "et_"
TOUCH_EVERY_S = 60.0  # last_used_at is written at most this often per token, not on every request
MIGRATIONS = ("""
CREATE TABLE tokens (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    role TEXT NOT NULL,
    sha256 TEXT NOT NULL UNIQUE,
    created_at REAL NOT NULL,
    last_used_at REAL,
    revoked_at REAL
);
CREATE TABLE secrets (name TEXT PRIMARY KEY, value BLOB NOT NULL);
""", """
CREATE TABLE ended_sessions (id TEXT PRIMARY KEY, expires_at REAL NOT NULL);
""")


# one log of failed last_used_at writes for every thread's store: the first failure, a reminder a minute, the end
_touch_down = DownLog("writing the auth DB", "recording when tokens were last used", log)


@dataclass(frozen=True)
class Token:
    id: int
    name: str
    role: str
    created_at: float
    last_used_at: float | None
    revoked_at: float | None


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "replace")).hexdigest()


def role_allows(have: str | None, need: str) -> bool:
    """Whether a principal holding role `have` (None: no role) may act as `need`."""
    return have in ROLES and ROLES.index(have) >= ROLES.index(need)


def check_role(role: str) -> str:
    if role not in ROLES:
        raise BadInput(f"role {role!r}: must be one of {', '.join(ROLES)}")
    return role


def _create_private(path: Path) -> None:
    """Create the file with mode 0600 before SQLite opens it (SQLite gives -wal and -shm the same mode). Only
    when it is new: closing any descriptor of a file drops every POSIX lock this process holds on it, so
    touching a file that other connections in this process have open would break their locking."""
    if path.exists():
        return
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:  # another thread or process made it first
        pass


class TokenStore(Store):
    """The auth DB, on the SQLite base (identity, migration, typed errors). Each thread opens its own."""

    SCHEMA = Schema("fleet auth DB", APP_ID, MIGRATIONS)

    def __init__(self, path: Path):
        path = Path(path)
        with contextlib.suppress(OSError):  # Store names the problem when it cannot make the directory
            path.parent.mkdir(parents=True, exist_ok=True)
            _create_private(path)
        super().__init__(path, fix="set [fleet] auth_database to another path")

    @staticmethod
    def _token(r: sqlite3.Row) -> Token:
        return Token(r["id"], r["name"], r["role"], r["created_at"], r["last_used_at"], r["revoked_at"])

    def create(self, role: str, name: str | None = None) -> tuple[Token, str]:
        """A new token; the secret is returned once and never stored."""
        check_role(role)
        if name is not None and not name.strip():
            raise BadInput("--name: empty")
        secret = PREFIX + secrets.token_urlsafe(32)
        with self.tx() as c:  # the write lock from the start: the name check and the insert are one step
            if name is not None and c.execute("SELECT 1 FROM tokens WHERE name=?", (name,)).fetchone():
                raise BadInput(f"--name {name!r}: a token of that name exists; pick another or revoke it")
            cur = c.execute("INSERT INTO tokens (name, role, sha256, created_at) VALUES (?,?,?,?)",
                            (name or f"pending-{secrets.token_hex(8)}", role, digest(secret), time.time()))
            if name is None:
                c.execute("UPDATE tokens SET name=? WHERE id=?", (f"{role}-{cur.lastrowid}", cur.lastrowid))
        return self.get(cur.lastrowid), secret

    def get(self, token_id: int) -> Token:
        r = self.query_one("SELECT * FROM tokens WHERE id=?", (token_id,))
        if r is None:
            raise BadInput(f"no token with id {token_id}; see `edgetune fleet token list`")
        return self._token(r)

    def list(self) -> list[Token]:
        return [self._token(r) for r in self.query("SELECT * FROM tokens ORDER BY id")]

    def revoke(self, ref: str) -> Token:
        """Revoke by id or name; browser sessions opened with the token end with it."""
        r = self.query_one("SELECT * FROM tokens WHERE name=?", (ref,))
        token_id = whole_number(ref)
        if r is None and token_id is not None:
            r = self.query_one("SELECT * FROM tokens WHERE id=?", (token_id,))
        if r is None:
            raise BadInput(f"no token {ref!r} (an id or a name); see `edgetune fleet token list`")
        with self.tx() as c:
            c.execute("UPDATE tokens SET revoked_at=coalesce(revoked_at, ?) WHERE id=?", (time.time(), r["id"]))
        return self.get(r["id"])

    def verify(self, secret: str) -> Token | None:
        """The live token with this secret, or None (unknown or revoked)."""
        r = self.query_one("SELECT * FROM tokens WHERE sha256=? AND revoked_at IS NULL", (digest(secret),))
        return self.touch(self._token(r)) if r else None

    def active(self, token_id: int) -> Token | None:
        """The token behind a browser session, or None once revoked."""
        r = self.query_one("SELECT * FROM tokens WHERE id=? AND revoked_at IS NULL", (token_id,))
        return self.touch(self._token(r)) if r else None

    def touch(self, t: Token) -> Token:
        """Note when a token was last used, best effort: this write sits in every request's read path, and an auth
        DB that cannot be written (a full disk, a read-only file) must not fail requests it can still answer."""
        now = time.time()
        if t.last_used_at is None or now - t.last_used_at > TOUCH_EVERY_S:
            try:
                with self.tx() as c:
                    c.execute("UPDATE tokens SET last_used_at=? WHERE id=?", (now, t.id))
            except DBError as e:
                _touch_down.failed(e)
            else:
                _touch_down.ok()
        return t

    def end_session(self, session_id: str, expires_at: float) -> None:
        """Record a browser session as ended (logout) until its cookie would have expired anyway; entries past
        that are pruned here, so the table holds only sessions that could still be presented."""
        with self.tx() as c:
            c.execute("DELETE FROM ended_sessions WHERE expires_at < ?", (time.time(),))
            c.execute("INSERT INTO ended_sessions (id, expires_at) VALUES (?, ?) ON CONFLICT DO NOTHING",
                      (session_id, expires_at))

    def session_ended(self, session_id: str) -> bool:
        return self.query_one("SELECT 1 FROM ended_sessions WHERE id=?", (session_id,)) is not None

    def session_key(self) -> bytes:
        """The HMAC key of browser session cookies: made once, shared by every server on this auth DB."""
        with self.tx() as c:
            c.execute("INSERT INTO secrets (name, value) VALUES ('session_key', ?) ON CONFLICT DO NOTHING",
                      (secrets.token_bytes(32),))
            return c.execute("SELECT value FROM secrets WHERE name='session_key'").fetchone()[0]
