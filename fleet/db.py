"""The fleet DB on PostgreSQL: the same surface as edgetune.sqlite.Store (schema, tx, query, typed errors), so the
fleet store's queries and its one list of migrations run on either backend.

This module is the whole dialect layer, kept in one place:
- placeholders: the store writes `?`; PostgreSQL gets `%s`;
- DDL types: INTEGER PRIMARY KEY -> BIGSERIAL PRIMARY KEY, INTEGER -> BIGINT (SQLite integers are 64-bit),
  REAL -> DOUBLE PRECISION, BLOB -> BYTEA, ifnull -> coalesce;
- SQLite's implicit rowid: a table without an INTEGER PRIMARY KEY gets an explicit `rowid BIGSERIAL` column, so
  `ORDER BY rowid` (insertion order) means the same on both;
- identity and version: SQLite keeps them in PRAGMA application_id / user_version; here a one-row table
  `edgetune_store` does, and a database holding other tables but not that one is refused as foreign.
The queries themselves stay in the common subset (upserts are `INSERT … ON CONFLICT …`, which both speak).

Errors map onto the SQLite base's typed errors: a server that cannot be reached (down, restarting, network) is
`DBUnavailable`, a full disk `DBFull`, lock timeouts and deadlocks `DBBusy`. The receiver treats all of them as
"do not acknowledge, retry later"; the connection is reopened on the next transaction. A value PostgreSQL cannot
hold (a NUL character in text) is the payload's fault, not the DB's: psycopg's DataError passes through
unchanged, so the receiver counts the message as malformed instead of retrying it for ever.

psycopg is imported only when a PostgreSQL URL is opened: a device never needs it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import re
import threading
from typing import Any, ClassVar, Iterator, Self, Sequence

from edgetune.errors import BadInput
from edgetune.sqlite import (DBBusy, DBConflict, DBCorrupt, DBError, DBForeign, DBFull, DBTooNew, DBUnavailable,
                            Schema)

META_TABLE = "edgetune_store"
CONNECT_TIMEOUT_S = 10


def is_postgres(db: object) -> bool:
    return isinstance(db, str) and db.startswith(("postgresql://", "postgres://"))


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    return re.sub(r"^(\w+://[^:/@]*):[^@]*@", r"\1:***@", url)


@functools.lru_cache(maxsize=512)
def pg_sql(sql: str, binary: bool = False) -> str:
    """A query of the common subset, with PostgreSQL's placeholders (the store's SQL holds no literal ? or %);
    `binary`: parameters sent in binary (arrays of text in text format are escaped character by character in
    Python, some 20 µs a row)."""
    return sql.replace("%", "%%").replace("?", "%b" if binary else "%s")


_TYPES = [(re.compile(p, re.I), r) for p, r in [
    (r"\bINTEGER\s+PRIMARY\s+KEY\b", "BIGSERIAL PRIMARY KEY"), (r"\bINTEGER\b", "BIGINT"),
    (r"\bREAL\b", "DOUBLE PRECISION"), (r"\bBLOB\b", "BYTEA"), (r"\bifnull\(", "coalesce(")]]
_CREATE_TABLE = re.compile(r"^\s*CREATE\s+TABLE\s+\w+\s*\(", re.I)


def pg_ddl(stmt: str) -> str:
    """One migration statement, written for SQLite, as PostgreSQL DDL."""
    rowid = _CREATE_TABLE.match(stmt) and not re.search(r"\bINTEGER\s+PRIMARY\s+KEY\b", stmt, re.I)
    for pattern, repl in _TYPES:
        stmt = pattern.sub(repl, stmt)
    if rowid:
        m = _CREATE_TABLE.match(stmt)
        stmt = f"{stmt[:m.end()]}rowid BIGSERIAL, {stmt[m.end():]}"
    return stmt


class Row(tuple):
    """A result row read by position or by column name, and convertible with dict(), like sqlite3.Row."""

    _index: dict[str, int]

    def __new__(cls, values: Sequence[Any], index: dict[str, int]) -> "Row":
        row = super().__new__(cls, values)
        row._index = index
        return row

    def __getitem__(self, key: Any) -> Any:  # type: ignore[override]
        return super().__getitem__(self._index[key] if isinstance(key, str) else key)

    def keys(self) -> list[str]:
        return list(self._index)


def _row_factory(cursor: Any) -> Any:
    index = {c.name: i for i, c in enumerate(cursor.description or ())}
    return lambda values: Row(values, index)


class _Conn:
    """What `tx` yields: `execute` with the store's `?` SQL, like a sqlite3.Connection."""

    def __init__(self, conn: Any):
        self._conn = conn

    def execute(self, sql: str, args: Sequence[Any] = (), *, binary: bool = False) -> Any:
        return self._conn.execute(pg_sql(sql, binary), tuple(args))

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """Every row's statement in one pipeline (psycopg sends them without waiting for each answer), in order."""
        with self._conn.cursor() as cur:
            cur.executemany(pg_sql(sql), [tuple(r) for r in rows])


class PgStore:
    """One connection to one PostgreSQL database, migrated to `SCHEMA` on open; the PostgreSQL twin of
    edgetune.sqlite.Store. `path` is the URL without its password. Thread-safe: `tx` and `query` serialize on
    `lock` like the SQLite store with threads=True."""

    SCHEMA: ClassVar[Schema]

    def __init__(self, url: str, *, fix: str, full_fix: str = "free some space on the database server and retry"):
        if importlib.util.find_spec("psycopg") is None:
            raise BadInput(f"{redact(url)}: PostgreSQL needs psycopg; install edgetune[fleet] "
                           "(pip install 'edgetune[fleet]')")
        self.url, self.path, self.fix, self.full_fix = url, redact(url), fix, full_fix
        self.lock = threading.RLock()
        self.conn: Any = None
        self._connection()
        self._migrate()

    def _connection(self) -> Any:
        """The open connection, reopened when the last one broke (the server restarted or went away)."""
        import psycopg

        if self.conn is not None and not self.conn.closed and not self.conn.broken:
            return self.conn
        if self.conn is not None:
            with contextlib.suppress(psycopg.Error):
                self.conn.close()
            self.conn = None
        try:
            self.conn = psycopg.connect(self.url, autocommit=True, row_factory=_row_factory,
                                        connect_timeout=CONNECT_TIMEOUT_S, application_name="edgetune-fleet")
        except psycopg.Error as e:
            raise self.error(e) from e
        return self.conn

    def _migrate(self) -> None:
        s = self.SCHEMA
        with self.tx() as c:
            # receivers starting together: one migrates, the others wait and then find it done
            c.execute("SELECT pg_advisory_xact_lock(?)", (s.app_id,))
            tables = {r[0] for r in c.execute("SELECT table_name FROM information_schema.tables"
                                              " WHERE table_schema = current_schema()")}
            app_id, version = 0, 0
            if META_TABLE in tables:
                row = c.execute(f"SELECT app_id, version FROM {META_TABLE}").fetchone()
                app_id, version = (row[0], row[1]) if row else (0, 0)
            if app_id != s.app_id and (version or tables):
                raise DBForeign(f"{self.path} is not an edgetune {s.label} (the database holds other tables); "
                                f"{self.fix}", self.path)
            if version > s.version:
                raise DBTooNew(f"{s.label} {self.path} has schema v{version}, newer than this edgetune "
                               f"(v{s.version}); upgrade edgetune", self.path)
            if version == s.version:
                return
            for v in range(version, s.version):
                for stmt in filter(str.strip, s.migrations[v].split(";")):
                    c.execute(pg_ddl(stmt))
            c.execute(f"CREATE TABLE IF NOT EXISTS {META_TABLE} (app_id BIGINT NOT NULL, version BIGINT NOT NULL)")
            c.execute(f"DELETE FROM {META_TABLE}")
            c.execute(f"INSERT INTO {META_TABLE} (app_id, version) VALUES (?, ?)", (s.app_id, s.version))

    def error(self, e: Exception) -> DBError:
        """The typed, readable form of a psycopg error on this database."""
        from psycopg import OperationalError, errors

        label, path = f"{self.SCHEMA.label} {self.path}", self.path
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, errors.DiskFull):
            return DBFull(f"disk full on the server of the {label}: the write was rolled back; {self.full_fix}", path)
        if isinstance(e, (errors.LockNotAvailable, errors.DeadlockDetected, errors.SerializationFailure,
                          errors.QueryCanceled)):
            return DBBusy(f"{label}: {first}; retry when the other transaction is done", path)
        if isinstance(e, errors.UniqueViolation):
            return DBConflict(f"{label}: {first}", path)
        if isinstance(e, (errors.DataCorrupted, errors.IndexCorrupted)):
            return DBCorrupt(f"{label} is damaged ({first}); restore it from a backup", path)
        if isinstance(e, OperationalError):
            return DBUnavailable(f"{label} cannot be reached ({first}); retrying until it is back", path)
        return DBError(f"{label}: {first}", path)

    @contextlib.contextmanager
    def tx(self) -> Iterator[_Conn]:
        """One transaction: COMMIT on leaving, ROLLBACK on any exception; a server error comes out as a DBError
        (a DataError, a value PostgreSQL cannot hold, as itself)."""
        import psycopg

        with self.lock:
            conn = self._connection()
            try:
                with conn.transaction():
                    yield _Conn(conn)
            except psycopg.DataError:
                raise
            except psycopg.Error as e:
                raise self.error(e) from e

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        with self.tx() as c:
            return c.execute(sql, args).fetchall()

    def query_one(self, sql: str, args: Sequence[Any] = ()) -> Row | None:
        rows = self.query(sql, args)
        return rows[0] if rows else None

    def iter_query(self, sql: str, args: Sequence[Any] = ()) -> Iterator[Row]:
        yield from self.query(sql, args)

    @property
    def schema_version(self) -> int:
        return self.query_one(f"SELECT version FROM {META_TABLE}")[0]

    def close(self) -> None:
        with self.lock:
            if self.conn is not None:
                self.conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
