"""One SQLite file of edgetune: open it, tell it from a foreign file, migrate it, write to it in transactions,
and fail with an error a caller can act on.

Every store (results, fleet, daemon, outbox) is a `Store` subclass with its own `Schema`. The schema version
lives in PRAGMA user_version and the store's identity in PRAGMA application_id, so a file written by a newer
edgetune, by another edgetune store or by another program is refused instead of being altered. Failures come
out as `DBError` subclasses that name the file and the fix; the fix text is the caller's, because only the
calling command knows which of its own options repairs the file.

The surface (schema, tx, query) stays small and free of SQLite-only notions where that costs nothing: the fleet
store runs the same queries on PostgreSQL through fleet.db, its twin of `Store`.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterator, Literal, Self, Sequence

from edgetune.errors import EdgetuneError


class DBError(EdgetuneError):
    """A database failure. `path` is the file, so a caller can move it aside or name it."""

    def __init__(self, message: str, path: Path):
        super().__init__(message)
        self.path = path


class DBCorrupt(DBError):
    """Not a database, malformed, or damaged pages: only moving the file aside gets a working store back."""


class DBForeign(DBError):
    """Another program's SQLite file, or another edgetune store's, sits where this store belongs."""


class DBTooNew(DBError):
    """Written by a newer edgetune: its schema has migrations this version does not know."""


class DBFull(DBError):
    """The disk (or the DB's page limit) is full: the transaction was rolled back and the file is intact."""


class DBBusy(DBError):
    """Another connection held the write lock for longer than the open timeout."""


class DBConflict(DBError):
    """Another transaction wrote a row with the same unique key after this one read: reading again may succeed.
    PostgreSQL only, whose transactions run side by side (SQLite's BEGIN IMMEDIATE runs them one at a time)."""


class DBUnavailable(DBError):
    """A database server (the fleet's PostgreSQL) cannot be reached now; retrying later may work."""


@dataclass(frozen=True)
class Schema:
    label: str  # how messages name the file: "results DB"
    app_id: int  # PRAGMA application_id of this store
    migrations: tuple[str, ...]  # migrations[v] takes the file from version v to v + 1; statements split on ';'
    # tables an unversioned file of ours (application_id and user_version 0) may hold: the v1 migration adopts it
    legacy_tables: frozenset[str] = frozenset()

    @property
    def version(self) -> int:
        return len(self.migrations)


def move_aside(path: Path) -> Path | None:
    """Rename a broken DB and its -wal/-shm files to `<name>.broken-<time>`, never deleting or overwriting
    anything: the file may hold data worth rescuing. Returns the new name, or None when there was no file."""
    path = Path(path)
    if not path.exists():
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = path.with_name(f"{path.name}.broken-{stamp}"), 1
    while any(Path(f"{aside}{s}").exists() for s in ("", "-wal", "-shm")):
        aside, n = path.with_name(f"{path.name}.broken-{stamp}.{n}"), n + 1
    for suffix in ("", "-wal", "-shm"):
        src = Path(f"{path}{suffix}")
        if src.exists():
            os.replace(src, Path(f"{aside}{suffix}"))
    return aside


class Store:
    """One connection to one store file, migrated to `SCHEMA` on open.

    `fix` is what the user should do about a corrupt or foreign file and `full_fix` about a full disk; both are
    sentences the calling command accepts. `threads=True` lets several threads share the connection: `tx` and
    `query` then serialize on `lock` (an RLock, so a query inside a transaction is fine).
    `synchronous="FULL"` makes a commit durable against power loss before it returns, for stores whose commit
    acknowledges something to a peer; NORMAL survives a process crash, which is enough for local state.
    """

    SCHEMA: ClassVar[Schema]

    def __init__(self, path: Path, *, fix: str, full_fix: str = "free some space and retry",
                 synchronous: Literal["NORMAL", "FULL"] = "NORMAL", threads: bool = False, timeout: float = 30.0):
        self.path, self.fix, self.full_fix, self.timeout = Path(path), fix, full_fix, timeout
        self.lock = threading.RLock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DBError(f"{self.SCHEMA.label} {self.path}: cannot create its directory ({e.strerror})",
                          self.path) from e
        try:
            self.conn = sqlite3.connect(self.path, timeout=timeout, isolation_level=None,
                                        check_same_thread=not threads)
        except sqlite3.Error as e:
            raise self.error(e) from e
        try:
            self.conn.row_factory = sqlite3.Row
            with self._snapshot():
                version = self._identify()  # refuse a foreign or newer file before changing anything in it
            self._wal()
            self.conn.execute(f"PRAGMA synchronous={synchronous}")
            if version < self.SCHEMA.version:
                self._migrate()
        except BaseException as e:
            self.conn.close()
            if isinstance(e, sqlite3.Error):
                raise self.error(e) from e
            raise

    def _wal(self) -> None:
        """Switch the file to WAL. While another process opens the same new file, SQLite answers this with BUSY
        at once, without waiting in its busy handler; so wait here, up to the open timeout."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self.conn.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as e:
                if getattr(e, "sqlite_errorcode", 0) & 0xFF != sqlite3.SQLITE_BUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    @contextlib.contextmanager
    def _snapshot(self) -> Iterator[None]:
        """One read transaction: `_identify`'s reads see a single state of the file, not one half-way through
        another process's migration."""
        self.conn.execute("BEGIN")
        try:
            yield
        finally:
            self._rollback()

    def _identify(self) -> int:
        """Refuse a file that is not this store's; returns its schema version. Call it inside a transaction."""
        s = self.SCHEMA
        app_id = self.conn.execute("PRAGMA application_id").fetchone()[0]
        version = self.conn.execute("PRAGMA user_version").fetchone()[0]
        entries = self.conn.execute("SELECT type, name FROM sqlite_master").fetchall()
        tables = {name for kind, name in entries if kind == "table"}
        legacy = app_id == 0 and version == 0 and tables <= s.legacy_tables
        if app_id != s.app_id and (version or entries) and not legacy:
            raise DBForeign(f"{self.path} is not an edgetune {s.label} (another SQLite file); {self.fix}", self.path)
        if version > s.version:
            raise DBTooNew(f"{s.label} {self.path} has schema v{version}, newer than this edgetune (v{s.version}); "
                           "upgrade edgetune", self.path)
        return version

    def _migrate(self) -> None:
        """One transaction per step, each reading the version again under the write lock: processes opening a new
        file at once (the daemon's first start beside a CLI verb) migrate it once, the others wait and find it
        done."""
        s = self.SCHEMA
        while True:
            with self.tx() as c:
                v = self._identify()
                if v >= s.version:
                    return
                for stmt in filter(str.strip, s.migrations[v].split(";")):
                    c.execute(stmt)
                c.execute(f"PRAGMA user_version={v + 1}")
                c.execute(f"PRAGMA application_id={s.app_id}")

    def error(self, e: sqlite3.Error) -> DBError:
        """The typed, readable form of a SQLite error on this file."""
        code = getattr(e, "sqlite_errorcode", None)
        primary = None if code is None else code & 0xFF
        label, path = self.SCHEMA.label, self.path
        if primary in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
            return DBCorrupt(f"{label} {path} is corrupt ({e}); {self.fix}", path)
        if primary == sqlite3.SQLITE_FULL:
            return DBFull(f"disk full while writing the {label} {path}: the write was rolled back and the DB is "
                          f"intact; {self.full_fix}", path)
        if primary in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN):
            return DBError(f"{label} {path}: {e}: this user must be able to write the file and its directory "
                           f"{path.parent} (a WAL database writes beside itself even to read); fix their owner or "
                           "mode, or point this command at a writable location", path)
        if primary in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
            return DBBusy(f"{label} {path} stayed locked by another process for {self.timeout:g} s; retry when it "
                          "is done", path)
        return DBError(f"{label} {path}: {e}", path)

    @contextlib.contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: BEGIN IMMEDIATE (the write lock up front, so it cannot fail half-way on a lock
        upgrade), COMMIT on leaving, ROLLBACK on any exception; a SQLite error comes out as a DBError."""
        with self.lock:
            try:
                self.conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as e:
                raise self.error(e) from e
            try:
                yield self.conn
                self.conn.execute("COMMIT")
            except BaseException as e:
                self._rollback()
                if isinstance(e, sqlite3.Error):
                    raise self.error(e) from e
                raise

    def _rollback(self) -> None:
        # SQLite rolls back by itself on some errors (SQLITE_FULL, IOERR): then there is nothing left to undo, and
        # a failing ROLLBACK must not hide the error that caused it
        if self.conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self.conn.execute("ROLLBACK")

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        """All rows of one read; a SQLite error comes out as a DBError."""
        with self.lock:
            try:
                return self.conn.execute(sql, args).fetchall()
            except sqlite3.Error as e:
                raise self.error(e) from e

    def query_one(self, sql: str, args: Sequence[Any] = ()) -> sqlite3.Row | None:
        rows = self.query(sql, args)
        return rows[0] if rows else None

    def iter_query(self, sql: str, args: Sequence[Any] = ()) -> Iterator[sqlite3.Row]:
        """The rows of one read as they come, for results too big to hold (exports); one thread only."""
        try:
            yield from self.conn.execute(sql, args)
        except sqlite3.Error as e:
            raise self.error(e) from e

    @property
    def schema_version(self) -> int:
        return self.query_one("PRAGMA user_version")[0]

    def close(self) -> None:
        with self.lock:
            self.conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
