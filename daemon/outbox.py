"""The durable outbox: every outbound MQTT message is a row here until the broker acknowledges it, and a row that
carries an `ack_key` (a tuning record, a final command response) until the fleet has committed it.

Rows are sent in id order and deleted on PUBACK, so a broker outage, a crash or kill -9 loses nothing and
resending keeps the order. AUTOINCREMENT keeps ids increasing even after the newest row is deleted, which is what
lets the sender resume with "everything after the last id I sent". A PUBACK only means the broker has the
message, and a broker may still drop it (its queue for an absent fleet overflows), so a row with an ack_key is
kept, marked `sent_at`, deleted by the fleet's `ack` (protocol.ACK) and sent again when that has not come within
the resend interval (the fleet dedupes). The store is bounded in bytes and age: only telemetry (kinds in
DROPPABLE) is ever dropped for room, oldest first; records, results and status never are. A row enqueued as
`replaceable` (retained state, progress) replaces the unsent rows on its topic: after an outage only the newest
matters.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

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
    # v2: end-to-end acknowledgement and coalescing
    """
    ALTER TABLE outbox ADD COLUMN ack_key TEXT;
    ALTER TABLE outbox ADD COLUMN sent_at REAL;
    ALTER TABLE outbox ADD COLUMN replaceable INTEGER NOT NULL DEFAULT 0;
    CREATE INDEX outbox_ack ON outbox(ack_key) WHERE ack_key IS NOT NULL;
    CREATE INDEX outbox_topic ON outbox(topic) WHERE replaceable = 1;
    CREATE INDEX outbox_sent ON outbox(sent_at) WHERE sent_at IS NOT NULL
    """,
), legacy_tables=frozenset({"outbox", "sqlite_sequence"}))

RESEND_S = 300.0  # a PUBACKed row the fleet has not acknowledged goes out again after this long


class Outbox(Store):
    SCHEMA = SCHEMA

    def __init__(self, path: Path | None = None, max_bytes: int = 64 << 20, max_age_s: float = 7 * 86400.0,
                 resend_s: float = RESEND_S):
        # WAL + NORMAL: a committed row survives a process crash (kill -9); power loss may lose the last commits
        super().__init__(Path(path) if path else paths.state_dir() / "outbox.db", threads=True,
                         fix="stop the daemon, move the file aside (rename it) and start the daemon again: "
                             "it starts a fresh one")
        self.max_bytes, self.max_age_s, self.resend_s = max_bytes, max_age_s, resend_s
        self._recount()
        self.dropped = 0  # since start, shown by `edgetune status`
        self.coalesced = 0  # unsent rows replaced by a newer one on their topic, since start
        self._swept = 0.0

    def enqueue(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False, kind: str,
                ack_key: str | None = None, replaceable: bool = False) -> int | None:
        """Append one message; returns its id, or None when it was telemetry and there was no room for it.
        `ack_key`: keep the row until the fleet acknowledges that key. `replaceable`: drop the unsent replaceable
        rows of the same topic first (a newer retained state or progress supersedes them)."""
        size = len(payload) + len(topic)
        now = time.time()
        with self.lock, self._recounted():
            with self.tx() as c:
                if replaceable:
                    n, freed = c.execute("SELECT count(*), coalesce(sum(size), 0) FROM outbox WHERE topic=? AND "
                                         "replaceable=1 AND sent_at IS NULL", (topic,)).fetchone()
                    if n:
                        c.execute("DELETE FROM outbox WHERE topic=? AND replaceable=1 AND sent_at IS NULL", (topic,))
                        self._count -= n
                        self._bytes -= freed
                        self.coalesced += n
                if now - self._swept >= _AGE_SWEEP_S:
                    self._drop_where("created < ?", (now - self.max_age_s,))
                    self._swept = now
                if self._bytes + size > self.max_bytes:
                    self._make_room(self._bytes + size - self.max_bytes)
                if self._bytes + size > self.max_bytes and kind in DROPPABLE:
                    self.dropped += 1
                    return None
                cur = c.execute(
                    "INSERT INTO outbox (topic, payload, qos, retain, kind, size, created, ack_key, replaceable) "
                    "VALUES (?,?,?,?,?,?,?,?,?)", (topic, payload, qos, int(retain), kind, size, now, ack_key,
                                                   int(replaceable)))
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
        """The next messages to send, in order: never sent, or sent and not acknowledged by the fleet within the
        resend interval."""
        rows = self.query("SELECT id, topic, payload, qos, retain, kind FROM outbox WHERE id > ? AND "
                          "(sent_at IS NULL OR sent_at < ?) ORDER BY id LIMIT ?",
                          (last_id, time.time() - self.resend_s, limit))
        return [Message(r[0], r[1], bytes(r[2]), r[3], bool(r[4]), r[5]) for r in rows]

    def resend_due(self) -> bool:
        """Whether a sent row waited for the fleet's ack longer than the resend interval."""
        return self.query_one("SELECT 1 FROM outbox WHERE sent_at < ? LIMIT 1",
                              (time.time() - self.resend_s,)) is not None

    def ack(self, ids: Iterable[int]) -> None:
        """The broker has them (PUBACK): delete, in one transaction per batch; a row that waits for the fleet's
        ack is only marked sent."""
        ids = list(ids)
        if not ids:
            return
        now = time.time()
        with self.lock, self._recounted(), self.tx() as c:
            for i in range(0, len(ids), 500):
                chunk = ids[i:i + 500]
                marks = ",".join("?" * len(chunk))
                c.execute(f"UPDATE outbox SET sent_at=? WHERE id IN ({marks}) AND ack_key IS NOT NULL", (now, *chunk))
                self._delete(c, f"id IN ({marks}) AND ack_key IS NULL", chunk)

    def confirm(self, keys: Iterable[str]) -> int:
        """The fleet committed these (protocol.ACK): delete their rows; returns how many."""
        keys = list(keys)
        done = 0
        with self.lock, self._recounted(), self.tx() as c:
            for i in range(0, len(keys), 500):
                chunk = keys[i:i + 500]
                done += self._delete(c, f"ack_key IN ({','.join('?' * len(chunk))})", chunk)
        return done

    def _delete(self, c: sqlite3.Connection, where: str, args: Sequence) -> int:
        n, size = c.execute(f"SELECT count(*), coalesce(sum(size), 0) FROM outbox WHERE {where}", args).fetchone()
        c.execute(f"DELETE FROM outbox WHERE {where}", args)
        self._count -= n
        self._bytes -= size
        return n

    def unsent(self) -> int:
        """Rows the broker has not acknowledged yet (those waiting only for the fleet's ack not counted)."""
        return self.query_one("SELECT count(*) FROM outbox WHERE sent_at IS NULL")[0]

    def awaiting_fleet(self) -> int:
        """Rows the broker has and the fleet has not acknowledged."""
        return self.query_one("SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL")[0]

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
