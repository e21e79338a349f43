"""The durable outbox: every outbound MQTT message is a row here until the broker acknowledges it.

Rows are sent in id order and deleted only on PUBACK, so a broker outage, a crash or kill -9 loses nothing and
resending keeps the order. AUTOINCREMENT keeps ids increasing even after the newest row is deleted, which is what
lets the sender resume with "everything after the last id I sent". The store is bounded in bytes and age: only
telemetry (kinds in DROPPABLE) is ever dropped for room, oldest first; records, results and status never are.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from edgetune import paths
from edgetune.sqlite import Schema, Store

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


SCHEMA = Schema("outbox", 0x45544F31, (  # "ETO1"
    # v1; IF NOT EXISTS adopts an outbox.db written before the schema was versioned
    """
    CREATE TABLE IF NOT EXISTS outbox (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        topic TEXT NOT NULL, payload BLOB NOT NULL, qos INTEGER NOT NULL, retain INTEGER NOT NULL,
        kind TEXT NOT NULL, size INTEGER NOT NULL, created REAL NOT NULL);
    CREATE INDEX IF NOT EXISTS outbox_kind ON outbox(kind, id);
    """,
), legacy_tables=frozenset({"outbox", "sqlite_sequence"}))


class Outbox(Store):
    SCHEMA = SCHEMA

    def __init__(self, path: Path | None = None, max_bytes: int = 64 << 20, max_age_s: float = 7 * 86400.0):
        # WAL + NORMAL: a committed row survives a process crash (kill -9); power loss may lose the last commits
        super().__init__(Path(path) if path else paths.state_dir() / "outbox.db", threads=True,
                         fix="stop the daemon, move the file aside (rename it) and start the daemon again: "
                             "it starts a fresh one")
        self.max_bytes, self.max_age_s = max_bytes, max_age_s
        self._recount()
        self.dropped = 0  # since start, shown by `edgetune status`
        self._swept = 0.0

    def enqueue(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False, kind: str) -> int | None:
        """Append one message; returns its id, or None when it was telemetry and there was no room for it."""
        size = len(payload) + len(topic)
        now = time.time()
        with self.lock, self._recounted():
            with self.tx() as c:
                if now - self._swept >= _AGE_SWEEP_S:
                    self._drop_where("created < ?", (now - self.max_age_s,))
                    self._swept = now
                if self._bytes + size > self.max_bytes:
                    self._make_room(self._bytes + size - self.max_bytes)
                if self._bytes + size > self.max_bytes and kind in DROPPABLE:
                    self.dropped += 1
                    return None
                cur = c.execute(
                    "INSERT INTO outbox (topic, payload, qos, retain, kind, size, created) VALUES (?,?,?,?,?,?,?)",
                    (topic, payload, qos, int(retain), kind, size, now))
            self._count += 1
            self._bytes += size
            return cur.lastrowid

    def _make_room(self, need: int) -> None:
        """Drop the oldest droppable rows until `need` bytes are free (or none is left)."""
        marks = ",".join("?" * len(DROPPABLE))
        row = self.conn.execute(
            f"SELECT id FROM (SELECT id, sum(size) OVER (ORDER BY id) AS freed FROM outbox WHERE kind IN ({marks})) "
            "WHERE freed >= ? ORDER BY id LIMIT 1", (*DROPPABLE, need)).fetchone()
        self._drop_where("id <= ?", (row[0] if row else 2**63 - 1,))  # no cut-off: all droppable rows go

    def _drop_where(self, where: str, args: tuple) -> None:
        marks = ",".join("?" * len(DROPPABLE))
        n, size = self.conn.execute(f"SELECT count(*), coalesce(sum(size), 0) FROM outbox WHERE ({where}) "
                                     f"AND kind IN ({marks})", (*args, *DROPPABLE)).fetchone()
        if n:
            self.conn.execute(f"DELETE FROM outbox WHERE ({where}) AND kind IN ({marks})", (*args, *DROPPABLE))
            self._count -= n
            self._bytes -= size
            self.dropped += n
            log.warning("outbox full or aged: dropped %d telemetry message(s)", n)

    def after(self, last_id: int, limit: int) -> list[Message]:
        """The next messages to send, in order."""
        rows = self.query("SELECT id, topic, payload, qos, retain, kind FROM outbox WHERE id > ? ORDER BY id LIMIT ?",
                          (last_id, limit))
        return [Message(r[0], r[1], bytes(r[2]), r[3], bool(r[4]), r[5]) for r in rows]

    def ack(self, ids: Iterable[int]) -> None:
        """The broker has them (PUBACK): delete, in one transaction per batch."""
        ids = list(ids)
        if not ids:
            return
        with self.lock, self._recounted(), self.tx() as c:
            for i in range(0, len(ids), 500):
                chunk = ids[i:i + 500]
                marks = ",".join("?" * len(chunk))
                n, size = c.execute(f"SELECT count(*), coalesce(sum(size), 0) FROM outbox WHERE id IN ({marks})",
                                    chunk).fetchone()
                c.execute(f"DELETE FROM outbox WHERE id IN ({marks})", chunk)
                self._count -= n
                self._bytes -= size

    @contextlib.contextmanager
    def _recounted(self) -> Iterator[None]:
        """On a failed transaction, recount: the in-memory totals may have moved inside it before the rollback."""
        try:
            yield
        except BaseException:
            self._recount()
            raise

    def _recount(self) -> None:
        self._count, self._bytes = self.query_one("SELECT count(*), coalesce(sum(size), 0) FROM outbox")

    def depth(self) -> tuple[int, int]:
        """(messages, bytes) waiting."""
        with self.lock:
            return self._count, self._bytes
