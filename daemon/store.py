"""Small durable daemon state in <state_dir>/daemon.db: counters, marks and the command journal that must survive
a restart.

- the daemon session counter (status `session`), so the fleet can tell restarts apart;
- the last fw_fingerprint seen, so a firmware change between two runs is noticed at start;
- the telemetry seq per boot, so (boot_id, seq) never repeats across daemon restarts;
- which tuning sessions were published as tuning/record, so each goes out once even after a crash;
- the command journal (`Journal`), the dedupe table of commands.

Versions of edgetune before the schema was versioned created the same tables without a version; the v1
migration adopts such a file (CREATE ... IF NOT EXISTS), so an upgraded device keeps its counters.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, TypeVar

from edgetune import paths
from edgetune.sqlite import DBCorrupt, Schema, Store, move_aside
from tuner.db import ResultsDB

log = logging.getLogger(__name__)
S = TypeVar("S", bound=Store)

SCHEMA = Schema("daemon DB", 0x45544431, (  # "ETD1"
    # v1
    """
    CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE IF NOT EXISTS published_records (record_id TEXT PRIMARY KEY, session_id INTEGER NOT NULL,
                                                  ts REAL NOT NULL);
    CREATE TABLE IF NOT EXISTS commands (
        id TEXT PRIMARY KEY, op TEXT, args_json TEXT, origin TEXT NOT NULL, status TEXT NOT NULL,
        response_json TEXT NOT NULL, received_at REAL NOT NULL, updated_at REAL NOT NULL);
    """,
), legacy_tables=frozenset({"kv", "published_records", "commands"}))

# what the daemon's errors about its own files tell the user: the daemon takes no --reset
DAEMON_DB_FIX = "stop the daemon, move the file aside (rename it) and start the daemon again: it starts a fresh one"
RESULTS_DB_FIX = ("stop the daemon and start it once as `edgetune daemon --reset`: that moves the results DB aside "
                  "(renamed, never deleted) and starts a fresh one")


def daemon_db_path() -> Path:
    return paths.state_dir() / "daemon.db"


def results_db() -> ResultsDB:
    """The results DB as the daemon opens it: its errors name the fix that works for a daemon."""
    return ResultsDB(fix=RESULTS_DB_FIX)


def checked(store: S) -> S:
    """The store after PRAGMA quick_check: DBCorrupt for damaged pages, which opening alone does not notice."""
    row = store.query_one("PRAGMA quick_check")
    if row is None or row[0] != "ok":
        raise DBCorrupt(f"{store.SCHEMA.label} {store.path} has damaged pages ({row[0] if row else 'no answer'}); "
                        f"{store.fix}", store.path)
    return store


def rederivable(open_store: Callable[[], S], recovered: Callable[[S], None] | None = None) -> S:
    """Open (and check) a store whose contents the daemon can rebuild; a corrupt file is moved aside, never
    deleted, and a fresh one started (then passed to `recovered`, to re-seed what must not repeat)."""
    try:
        store = open_store()
    except DBCorrupt as e:
        bad = e
    else:
        try:
            return checked(store)
        except DBCorrupt as e:
            store.close()
            bad = e
    aside = move_aside(bad.path)
    log.error("%s: moved it aside to %s and starting a fresh one (its contents are re-derivable)",
              str(bad).partition(";")[0], aside)
    fresh = open_store()
    if recovered:
        recovered(fresh)
    return fresh


class DaemonStore(Store):
    """daemon.db, shared by the daemon's threads."""

    SCHEMA = SCHEMA

    def __init__(self, path: Path | None = None):
        # FULL: a journaled command is acknowledged (PUBACK, `accepted`) once its commit returns
        super().__init__(path or daemon_db_path(), fix=DAEMON_DB_FIX, synchronous="FULL", threads=True)

    def get(self, key: str, default: Any = None) -> Any:
        row = self.query_one("SELECT value FROM kv WHERE key=?", (key,))
        return json.loads(row[0]) if row else default

    def set(self, key: str, value: Any) -> None:
        with self.tx() as c:
            c.execute("INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)", (key, json.dumps(value)))

    def reseed(self) -> None:
        """A fresh file in place of a corrupt one: the counters the old one held are lost and must not repeat.
        The session counter goes on from the clock (unix seconds: more than any count of starts), and an `epoch`
        (the same seconds) goes into telemetry's boot_id, so (boot_id, seq) is new even within this boot."""
        now = json.dumps(int(time.time()))
        with self.tx() as c:
            c.executemany("INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)", [("session", now), ("epoch", now)])

    def next_session(self) -> int:
        with self.tx() as c:
            row = c.execute("SELECT value FROM kv WHERE key='session'").fetchone()
            n = (json.loads(row[0]) if row else 0) + 1
            c.execute("INSERT OR REPLACE INTO kv (key, value) VALUES ('session', ?)", (json.dumps(n),))
        return n

    def next_seq(self, boot_id: str) -> int:
        """Reserve the next telemetry seq of this boot (committed before the sample is queued: never reused)."""
        with self.tx() as c:
            row = c.execute("SELECT value FROM kv WHERE key='telemetry'").fetchone()
            last = json.loads(row[0]) if row else {}
            seq = last.get("seq", -1) + 1 if last.get("boot_id") == boot_id else 0
            c.execute("INSERT OR REPLACE INTO kv (key, value) VALUES ('telemetry', ?)",
                      (json.dumps({"boot_id": boot_id, "seq": seq}),))
        return seq

    def unpublished(self, record_ids: Iterable[str]) -> set[str]:
        done = {r[0] for r in self.query("SELECT record_id FROM published_records")}
        return set(record_ids) - done

    def mark_published(self, record_id: str, session_id: int) -> None:
        with self.tx() as c:
            c.execute("INSERT OR REPLACE INTO published_records (record_id, session_id, ts) VALUES (?,?,?)",
                      (record_id, session_id, time.time()))


class Journal:
    """The command table of daemon.db: id → op, args, origin, last response. INSERT OR IGNORE makes the dedupe
    atomic. Which statuses are open or final is the command protocol's business, so callers pass them."""

    def __init__(self, store: DaemonStore):
        self._store = store

    def prune(self, final: Collection[str], keep_s: float) -> None:
        """Forget commands in a final status older than the dedupe window, so the journal does not grow forever."""
        with self._store.tx() as c:
            c.execute(f"DELETE FROM commands WHERE status IN ({','.join('?' * len(final))}) AND updated_at < ?",
                      (*final, time.time() - keep_s))

    def insert(self, cmd_id: str, op: str | None, args: dict | None, origin: str, response: dict) -> bool:
        """False when the id is already known (a duplicate)."""
        now = time.time()
        with self._store.tx() as c:
            cur = c.execute(
                "INSERT OR IGNORE INTO commands VALUES (?,?,?,?,?,?,?,?)",
                (cmd_id, op, json.dumps(args), origin, response["status"], json.dumps(response), now, now))
        return cur.rowcount == 1

    def update(self, cmd_id: str, response: dict) -> None:
        with self._store.tx() as c:
            c.execute("UPDATE commands SET status=?, response_json=?, updated_at=? WHERE id=?",
                      (response["status"], json.dumps(response), time.time(), cmd_id))

    def response(self, cmd_id: str) -> dict | None:
        row = self._store.query_one("SELECT response_json FROM commands WHERE id=?", (cmd_id,))
        return json.loads(row[0]) if row else None

    def in_status(self, statuses: Collection[str]) -> list[tuple[str, str, dict, str]]:
        """(id, op, args, origin) of the commands in one of `statuses`, oldest first."""
        rows = self._store.query(f"SELECT id, op, args_json, origin FROM commands WHERE status IN "
                                 f"({','.join('?' * len(statuses))}) ORDER BY received_at", tuple(statuses))
        return [(r[0], r[1], json.loads(r[2]) or {}, r[3]) for r in rows]
