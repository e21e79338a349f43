"""The durable outbox: every outbound MQTT message is a row here until the broker acknowledges it.

Rows are sent in id order and deleted only on PUBACK, so a broker outage, a crash or kill -9 loses nothing and
resending keeps the order. AUTOINCREMENT keeps ids increasing even after the newest row is deleted, which is what
lets the sender resume with "everything after the last id I sent". The store is bounded in bytes and age: only
telemetry (kinds in DROPPABLE) is ever dropped for room, oldest first; records, results and status never are.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from edgetune import paths

log = logging.getLogger(__name__)

DROPPABLE = ("telemetry",)
_AGE_SWEEP_S = 10.0  # the age bound is enforced at most this often, not on every enqueue


@dataclass(frozen=True)
class Message:
    id: int
    topic: str
    payload: bytes
    qos: int
    retain: bool
    kind: str


class Outbox:
    def __init__(self, path: Path | None = None, max_bytes: int = 64 << 20, max_age_s: float = 7 * 86400.0):
        self.path = Path(path) if path else paths.state_dir() / "outbox.db"
        self.max_bytes, self.max_age_s = max_bytes, max_age_s
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        # WAL + NORMAL: a committed row survives a process crash (kill -9); power loss may lose the last commits
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.executescript("""
            CREATE TABLE IF NOT EXISTS outbox (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                topic TEXT NOT NULL, payload BLOB NOT NULL, qos INTEGER NOT NULL, retain INTEGER NOT NULL,
                kind TEXT NOT NULL, size INTEGER NOT NULL, created REAL NOT NULL);
            CREATE INDEX IF NOT EXISTS outbox_kind ON outbox(kind, id);
        """)
        self._count, self._bytes = self._conn.execute("SELECT count(*), coalesce(sum(size), 0) FROM outbox").fetchone()
        self.dropped = 0  # since start, shown by `edgetune status`
        self._swept = 0.0

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def enqueue(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False, kind: str) -> int | None:
        """Append one message; returns its id, or None when it was telemetry and there was no room for it."""
        size = len(payload) + len(topic)
        now = time.time()
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                if now - self._swept >= _AGE_SWEEP_S:
                    self._drop_where("created < ?", (now - self.max_age_s,))
                    self._swept = now
                if self._bytes + size > self.max_bytes:
                    self._make_room(self._bytes + size - self.max_bytes)
                if self._bytes + size > self.max_bytes and kind in DROPPABLE:
                    self.dropped += 1
                    self._conn.execute("COMMIT")
                    return None
                cur = self._conn.execute(
                    "INSERT INTO outbox (topic, payload, qos, retain, kind, size, created) VALUES (?,?,?,?,?,?,?)",
                    (topic, payload, qos, int(retain), kind, size, now))
                self._conn.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise
            self._count += 1
            self._bytes += size
            return cur.lastrowid

    def _make_room(self, need: int) -> None:
        """Drop the oldest droppable rows until `need` bytes are free (or none is left)."""
        marks = ",".join("?" * len(DROPPABLE))
        row = self._conn.execute(
            f"SELECT id FROM (SELECT id, sum(size) OVER (ORDER BY id) AS freed FROM outbox WHERE kind IN ({marks})) "
            "WHERE freed >= ? ORDER BY id LIMIT 1", (*DROPPABLE, need)).fetchone()
        self._drop_where("id <= ?", (row[0] if row else 2**63 - 1,))  # no cut-off: all droppable rows go

    def _drop_where(self, where: str, args: tuple) -> None:
        marks = ",".join("?" * len(DROPPABLE))
        n, size = self._conn.execute(f"SELECT count(*), coalesce(sum(size), 0) FROM outbox WHERE ({where}) "
                                     f"AND kind IN ({marks})", (*args, *DROPPABLE)).fetchone()
        if n:
            self._conn.execute(f"DELETE FROM outbox WHERE ({where}) AND kind IN ({marks})", (*args, *DROPPABLE))
            self._count -= n
            self._bytes -= size
            self.dropped += n
            log.warning("outbox full or aged: dropped %d telemetry message(s)", n)

    def after(self, last_id: int, limit: int) -> list[Message]:
        """The next messages to send, in order."""
        with self._lock:
            rows = self._conn.execute("SELECT id, topic, payload, qos, retain, kind FROM outbox WHERE id > ? "
                                      "ORDER BY id LIMIT ?", (last_id, limit)).fetchall()
        return [Message(r[0], r[1], bytes(r[2]), r[3], bool(r[4]), r[5]) for r in rows]

    def ack(self, ids: Iterable[int]) -> None:
        """The broker has them (PUBACK): delete, in one transaction per batch."""
        ids = list(ids)
        if not ids:
            return
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                for i in range(0, len(ids), 500):
                    chunk = ids[i:i + 500]
                    marks = ",".join("?" * len(chunk))
                    n, size = self._conn.execute(f"SELECT count(*), coalesce(sum(size), 0) FROM outbox "
                                                 f"WHERE id IN ({marks})", chunk).fetchone()
                    self._conn.execute(f"DELETE FROM outbox WHERE id IN ({marks})", chunk)
                    self._count -= n
                    self._bytes -= size
                self._conn.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise

    def _rollback(self) -> None:
        """Undo, and recount: the in-memory totals may have moved inside the failed transaction."""
        self._conn.execute("ROLLBACK")
        self._count, self._bytes = self._conn.execute("SELECT count(*), coalesce(sum(size), 0) FROM outbox").fetchone()

    def depth(self) -> tuple[int, int]:
        """(messages, bytes) waiting."""
        with self._lock:
            return self._count, self._bytes
