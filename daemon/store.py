"""Small durable daemon state in <state_dir>/daemon.db: counters and marks that must survive a restart.

- the daemon session counter (status `session`), so the fleet can tell restarts apart;
- the last fw_fingerprint seen, so a firmware change between two runs is noticed at start;
- the telemetry seq per boot, so (boot_id, seq) never repeats across daemon restarts;
- which tuning sessions were published as tuning/record, so each goes out once even after a crash.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterable

from edgetune import paths


def daemon_db_path() -> Path:
    return paths.state_dir() / "daemon.db"


class DaemonStore:
    def __init__(self, path: Path | None = None):
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(path or daemon_db_path(), timeout=30, isolation_level=None,
                                     check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.executescript("""
            CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
            CREATE TABLE IF NOT EXISTS published_records (record_id TEXT PRIMARY KEY, session_id INTEGER NOT NULL,
                                                          ts REAL NOT NULL);
        """)

    def get(self, key: str, default: Any = None) -> Any:
        with self._lock:
            row = self._conn.execute("SELECT value FROM kv WHERE key=?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def set(self, key: str, value: Any) -> None:
        with self._lock:
            self._conn.execute("INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)", (key, json.dumps(value)))

    def next_session(self) -> int:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            row = self._conn.execute("SELECT value FROM kv WHERE key='session'").fetchone()
            n = (json.loads(row[0]) if row else 0) + 1
            self._conn.execute("INSERT OR REPLACE INTO kv (key, value) VALUES ('session', ?)", (json.dumps(n),))
            self._conn.execute("COMMIT")
        return n

    def next_seq(self, boot_id: str) -> int:
        """Reserve the next telemetry seq of this boot (committed before the sample is queued: never reused)."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            row = self._conn.execute("SELECT value FROM kv WHERE key='telemetry'").fetchone()
            last = json.loads(row[0]) if row else {}
            seq = last.get("seq", -1) + 1 if last.get("boot_id") == boot_id else 0
            self._conn.execute("INSERT OR REPLACE INTO kv (key, value) VALUES ('telemetry', ?)",
                               (json.dumps({"boot_id": boot_id, "seq": seq}),))
            self._conn.execute("COMMIT")
        return seq

    def unpublished(self, record_ids: Iterable[str]) -> set[str]:
        ids = set(record_ids)
        with self._lock:
            done = {r[0] for r in self._conn.execute("SELECT record_id FROM published_records")}
        return ids - done

    def mark_published(self, record_id: str, session_id: int) -> None:
        with self._lock:
            self._conn.execute("INSERT OR REPLACE INTO published_records (record_id, session_id, ts) VALUES (?,?,?)",
                               (record_id, session_id, time.time()))
