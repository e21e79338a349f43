"""The results DB: SQLite in WAL mode in the state dir. Every measurement is kept; it is tomorrow's training data.

Sessions are journaled measurement by measurement, so a killed run resumes where it stopped.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from edgetune import paths
from edgetune.errors import EdgetuneError
from kernels.active import write_active
from tuner.resultkey import ResultKey

APP_ID = 0x45544E31  # "ETN1" in PRAGMA application_id: tells our DB from a foreign SQLite file
MIGRATIONS: list[str] = [
    # v1
    """
    CREATE TABLE sessions (
        id INTEGER PRIMARY KEY,
        key TEXT NOT NULL,
        kernel TEXT NOT NULL, workload TEXT NOT NULL, shape_json TEXT NOT NULL,
        hw_fingerprint TEXT NOT NULL, fw_fingerprint TEXT NOT NULL, source_hash TEXT NOT NULL,
        isa TEXT NOT NULL, compiler_id TEXT NOT NULL, strategy TEXT NOT NULL, strategy_version TEXT NOT NULL,
        params_json TEXT NOT NULL,          -- seed, budget, seconds: a resume must match them
        origin TEXT NOT NULL DEFAULT 'cli',
        state TEXT NOT NULL,                -- running | done | failed
        started_at REAL NOT NULL, finished_at REAL, result_json TEXT
    );
    CREATE INDEX sessions_key ON sessions(key, state);
    CREATE TABLE measurements (
        id INTEGER PRIMARY KEY,
        session_id INTEGER NOT NULL REFERENCES sessions(id),
        phase TEXT NOT NULL,                -- search | final | verify | pin
        seq INTEGER NOT NULL,
        config_json TEXT NOT NULL, config_key TEXT NOT NULL,
        ok INTEGER NOT NULL, reason TEXT NOT NULL, ms REAL, cv REAL, load1 REAL,
        stats_json TEXT NOT NULL, compile_s REAL, ts REAL NOT NULL,
        UNIQUE (session_id, phase, seq)
    );
    CREATE TABLE active (
        kernel TEXT NOT NULL, workload TEXT NOT NULL,
        entry_json TEXT NOT NULL, pinned INTEGER NOT NULL DEFAULT 0, updated_at REAL NOT NULL,
        PRIMARY KEY (kernel, workload)
    );
    """,
    # v2: the rest of the result key (tuner.resultkey.ResultKey) with each session
    """
    ALTER TABLE sessions ADD COLUMN objective TEXT NOT NULL DEFAULT 'latency';
    ALTER TABLE sessions ADD COLUMN model_version TEXT
    """,
]


class DBError(EdgetuneError):
    pass


def _friendly(e: sqlite3.Error, path: Path) -> DBError:
    msg = str(e)
    if "full" in msg:
        return DBError(f"disk full while writing results to {path}: the write was rolled back and the DB is intact; "
                       "free some space and rerun (finished measurements are kept and will be reused)")
    if "not a database" in msg or "malformed" in msg:
        return DBError(f"results DB {path} is corrupt ({msg}); rerun with --reset to move it aside and start fresh")
    return DBError(f"results DB {path}: {msg}")


@dataclass(frozen=True)
class SessionRow:
    id: int
    key: str
    state: str
    params: dict
    started_at: float
    result: dict | None
    result_key: ResultKey | None = None


class ResultsDB:
    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path else paths.state_dir() / "results.db"
        try:
            self.conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            self.conn.row_factory = sqlite3.Row
            app_id = self.conn.execute("PRAGMA application_id").fetchone()[0]
            version = self.conn.execute("PRAGMA user_version").fetchone()[0]
            tables = self.conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
            if app_id != APP_ID and (tables or version):
                raise DBError(f"{self.path} is not an edgetune results DB (foreign SQLite file); "
                              "rerun with --reset to move it aside and start fresh")
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self._migrate(version)
        except sqlite3.Error as e:
            raise _friendly(e, self.path) from e

    def _migrate(self, version: int) -> None:
        if version > len(MIGRATIONS):
            raise DBError(f"{self.path} has schema v{version}, newer than this edgetune (v{len(MIGRATIONS)}); upgrade edgetune")
        for v in range(version, len(MIGRATIONS)):
            with self.tx():
                for stmt in filter(str.strip, MIGRATIONS[v].split(";")):
                    self.conn.execute(stmt)
                self.conn.execute(f"PRAGMA user_version={v + 1}")
                self.conn.execute(f"PRAGMA application_id={APP_ID}")

    class _Tx:
        def __init__(self, db: "ResultsDB"):
            self.db = db

        def __enter__(self) -> sqlite3.Connection:
            self.db.conn.execute("BEGIN IMMEDIATE")
            return self.db.conn

        def __exit__(self, et: Any, e: Any, tb: Any) -> None:
            if et is None:
                try:
                    self.db.conn.execute("COMMIT")
                    return
                except sqlite3.Error as ce:
                    self._rollback()
                    raise _friendly(ce, self.db.path) from ce
            self._rollback()
            if isinstance(e, sqlite3.Error):
                raise _friendly(e, self.db.path) from e

        def _rollback(self) -> None:
            if self.db.conn.in_transaction:  # SQLite may already have rolled back (e.g. on SQLITE_FULL)
                self.db.conn.execute("ROLLBACK")

    def tx(self) -> "_Tx":
        return ResultsDB._Tx(self)

    def close(self) -> None:
        self.conn.close()

    @staticmethod
    def reset(path: Path | None = None) -> Path | None:
        """Move a broken DB (and its WAL files) aside; never delete. Returns the new name."""
        path = Path(path) if path else paths.state_dir() / "results.db"
        if not path.exists():
            return None
        aside = path.with_name(f"{path.name}.broken-{time.strftime('%Y%m%d-%H%M%S')}")
        for suffix in ("", "-wal", "-shm"):
            src = Path(str(path) + suffix)
            if src.exists():
                os.replace(src, Path(str(aside) + suffix))
        return aside

    # ---- sessions ------------------------------------------------------------------------------------------

    def finished_session(self, key: str) -> SessionRow | None:
        r = self.conn.execute("SELECT * FROM sessions WHERE key=? AND state='done' ORDER BY id DESC LIMIT 1",
                              (key,)).fetchone()
        return self._session(r) if r else None

    def running_session(self, key: str, params: dict) -> SessionRow | None:
        r = self.conn.execute("SELECT * FROM sessions WHERE key=? AND state='running' AND params_json=? "
                              "ORDER BY id DESC LIMIT 1", (key, json.dumps(params, sort_keys=True))).fetchone()
        return self._session(r) if r else None

    def open_session(self, rkey: ResultKey, fw_fingerprint: str, params: dict, origin: str) -> SessionRow:
        key = rkey.digest()
        with self.tx() as c:
            cur = c.execute(
                "INSERT INTO sessions (key, kernel, workload, shape_json, hw_fingerprint, fw_fingerprint, source_hash,"
                " isa, compiler_id, strategy, strategy_version, objective, model_version, params_json, origin, state,"
                " started_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,'running',?)",
                (key, rkey.kernel, rkey.workload, rkey.shape_json, rkey.hw_fingerprint, fw_fingerprint,
                 rkey.source_hash, rkey.isa, rkey.compiler_id, rkey.strategy, rkey.strategy_version, rkey.objective,
                 rkey.model_version, json.dumps(params, sort_keys=True), origin, time.time()))
        return SessionRow(cur.lastrowid, key, "running", params, time.time(), None, rkey)

    def finish_session(self, session_id: int, state: str, result: dict) -> None:
        with self.tx() as c:
            c.execute("UPDATE sessions SET state=?, finished_at=?, result_json=? WHERE id=?",
                      (state, time.time(), json.dumps(result), session_id))

    def _session(self, r: sqlite3.Row) -> SessionRow:
        rkey = ResultKey(r["kernel"], r["source_hash"], r["workload"], r["shape_json"], r["hw_fingerprint"], r["isa"],
                         r["compiler_id"], r["strategy"], r["strategy_version"], r["objective"], r["model_version"])
        return SessionRow(r["id"], r["key"], r["state"], json.loads(r["params_json"]), r["started_at"],
                          json.loads(r["result_json"]) if r["result_json"] else None, rkey)

    def session_info(self, session_id: int) -> dict:
        r = self.conn.execute("SELECT * FROM sessions WHERE id=?", (session_id,)).fetchone()
        d = dict(r)
        d["shape"] = json.loads(d.pop("shape_json"))
        d["params"] = json.loads(d.pop("params_json"))
        d["result"] = json.loads(d.pop("result_json")) if d["result_json"] is not None else None
        return d

    # ---- measurements --------------------------------------------------------------------------------------

    def add_measurement(self, session_id: int, phase: str, seq: int, cfg: dict, key: str, m: Any,
                        compile_s: float | None) -> None:
        stats = m.to_dict()
        with self.tx() as c:
            c.execute(
                "INSERT OR REPLACE INTO measurements (session_id, phase, seq, config_json, config_key, ok, reason, ms,"
                " cv, load1, stats_json, compile_s, ts) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (session_id, phase, seq, json.dumps(cfg), key, int(m.ok), m.reason, m.ms, m.cv, m.load1,
                 json.dumps(stats), compile_s, time.time()))

    def measurements(self, session_id: int, phase: str | None = None) -> list[dict]:
        q = "SELECT * FROM measurements WHERE session_id=?" + (" AND phase=?" if phase else "") + " ORDER BY phase, seq"
        rows = self.conn.execute(q, (session_id, phase) if phase else (session_id,)).fetchall()
        return [self._measurement(r) for r in rows]

    @staticmethod
    def _measurement(r: sqlite3.Row) -> dict:
        d = dict(r)
        d["config"] = json.loads(d.pop("config_json"))
        d["stats"] = json.loads(d.pop("stats_json"))
        d["ok"] = bool(d["ok"])
        return d

    def iter_records(self) -> Iterator[dict]:
        """Every finished or interrupted session with all its measurements: the training-data export."""
        for r in self.conn.execute("SELECT id FROM sessions ORDER BY id").fetchall():
            info = self.session_info(r["id"])
            info["measurements"] = self.measurements(r["id"])
            yield info

    # ---- active configs ------------------------------------------------------------------------------------

    def set_active(self, kernel: str, workload: str, entry: dict, *, pinned: bool = False, force: bool = False) -> bool:
        """Make `entry` active unless a pin holds the slot (a pin wins over tuning). Returns whether it was set."""
        with self.tx() as c:
            row = c.execute("SELECT pinned FROM active WHERE kernel=? AND workload=?", (kernel, workload)).fetchone()
            if row and row["pinned"] and not pinned and not force:
                return False
            c.execute("INSERT OR REPLACE INTO active (kernel, workload, entry_json, pinned, updated_at) VALUES (?,?,?,?,?)",
                      (kernel, workload, json.dumps(entry), int(pinned), time.time()))
        write_active(self.active_document())
        return True

    def remove_active(self, kernel: str, workload: str) -> None:
        with self.tx() as c:
            c.execute("DELETE FROM active WHERE kernel=? AND workload=?", (kernel, workload))
        write_active(self.active_document())

    def active(self) -> dict[str, dict]:
        rows = self.conn.execute("SELECT * FROM active ORDER BY kernel, workload").fetchall()
        return {f"{r['kernel']}/{r['workload']}": {**json.loads(r["entry_json"]), "pinned": bool(r["pinned"])}
                for r in rows}

    def active_document(self) -> dict:
        """The config/active payload (DESIGN.md contract), also written to active.json for applications."""
        kernels = self.active()
        latest = max(kernels.values(), key=lambda e: e.get("tuned_at") or 0, default={})
        return {"tuned_at": latest.get("tuned_at"), "hw_fingerprint": latest.get("hw_fingerprint"),
                "fw_fingerprint": latest.get("fw_fingerprint"), "model_version": latest.get("model_version"),
                "kernels": kernels}

    def active_entry(self, kernel: str, workload: str) -> dict | None:
        r = self.conn.execute("SELECT * FROM active WHERE kernel=? AND workload=?", (kernel, workload)).fetchone()
        return {**json.loads(r["entry_json"]), "pinned": bool(r["pinned"])} if r else None
