"""The results DB: SQLite in WAL mode in the state dir. Every measurement is kept; it is tomorrow's training data.

Sessions are journaled measurement by measurement, so a killed run resumes where it stopped.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from edgetune import paths
from edgetune.sqlite import DBError, Schema, Store, move_aside
from kernels.active import write_active
from tuner.resultkey import ResultKey

FINAL_PHASE = "final"  # a measurement of a session's side-by-side final rounds (training ranks them apart)
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


@dataclass(frozen=True)
class SessionRow:
    id: int
    key: str
    state: str
    params: dict
    started_at: float
    result: dict | None
    result_key: ResultKey | None = None


ENDED = "state IN ('done', 'failed', 'interrupted')"  # a session that ended: published, exported
RESET_FIX = "run `edgetune report --reset` to move it aside (nothing is deleted) and start fresh"


def default_path() -> Path:
    return paths.state_dir() / "results.db"


class ResultsDB(Store):
    """The results DB. `fix` is what a corrupt or foreign file's error tells the user to do: the default names
    the CLI's --reset; the daemon, which has no such option, passes its own."""

    SCHEMA = Schema("results DB", APP_ID, tuple(MIGRATIONS))

    def __init__(self, path: Path | None = None, *, fix: str = RESET_FIX):
        super().__init__(Path(path) if path else default_path(), fix=fix,
                         full_fix="free some space and rerun (finished measurements are kept and will be reused)")

    @classmethod
    def reset(cls, path: Path | None = None) -> Path | None:
        """Move a broken DB (and its WAL files) aside; never delete. Returns the new name, or None when nothing
        was moved: no file, or one that opens and passes SQLite's quick_check (--reset is the cure for a corrupt
        file, not a way to lose good results)."""
        path = Path(path) if path else default_path()
        return None if cls.healthy(path) else move_aside(path)

    @classmethod
    def healthy(cls, path: Path) -> bool:
        """`path` is a results DB that opens (migrated if old) and passes quick_check."""
        if not path.exists():
            return False
        try:
            with cls(path) as db:
                return db.query_one("PRAGMA quick_check")[0] == "ok"
        except DBError:
            return False

    # ---- sessions ------------------------------------------------------------------------------------------

    def finished_session(self, key: str) -> SessionRow | None:
        r = self.query_one("SELECT * FROM sessions WHERE key=? AND state='done' ORDER BY id DESC LIMIT 1", (key,))
        return self._session(r) if r else None

    def running_session(self, key: str, params: dict) -> SessionRow | None:
        r = self.query_one("SELECT * FROM sessions WHERE key=? AND state='running' AND params_json=? "
                           "ORDER BY id DESC LIMIT 1", (key, json.dumps(params, sort_keys=True)))
        return self._session(r) if r else None

    def open_session(self, rkey: ResultKey, fw_fingerprint: str, params: dict, origin: str) -> SessionRow:
        key, now = rkey.digest(), time.time()
        with self.tx() as c:
            cur = c.execute(
                "INSERT INTO sessions (key, kernel, workload, shape_json, hw_fingerprint, fw_fingerprint, source_hash,"
                " isa, compiler_id, strategy, strategy_version, objective, model_version, params_json, origin, state,"
                " started_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,'running',?)",
                (key, rkey.kernel, rkey.workload, rkey.shape_json, rkey.hw_fingerprint, fw_fingerprint,
                 rkey.source_hash, rkey.isa, rkey.compiler_id, rkey.strategy, rkey.strategy_version, rkey.objective,
                 rkey.model_version, json.dumps(params, sort_keys=True), origin, now))
        return SessionRow(cur.lastrowid, key, "running", params, now, None, rkey)

    def finish_session(self, session_id: int, state: str, result: dict) -> None:
        with self.tx() as c:
            c.execute("UPDATE sessions SET state=?, finished_at=?, result_json=? WHERE id=?",
                      (state, time.time(), json.dumps(result), session_id))

    def fail_session(self, session_id: int, reason: str) -> None:
        """Record a session that ended by an error as `failed` with `reason`, unless it already recorded its own
        end (done, or failed with its own result)."""
        with self.tx() as c:
            c.execute("UPDATE sessions SET state='failed', finished_at=?, result_json=? WHERE id=? AND state='running'",
                      (time.time(), json.dumps({"reason": reason}), session_id))

    def interrupt_running(self, kernel: str, workload: str, except_id: int) -> int:
        """Close the other unfinished sessions of this kernel/workload as `interrupted`: a new session supersedes
        them (other budget, strategy or firmware), so they would never resume, and closed they are published with
        the measurements they hold."""
        with self.tx() as c:
            return c.execute("UPDATE sessions SET state='interrupted', finished_at=? WHERE kernel=? AND workload=? "
                             "AND state='running' AND id<>?", (time.time(), kernel, workload, except_id)).rowcount

    def ended_sessions(self) -> list[SessionRow]:
        """Sessions that ended (done, failed or interrupted), oldest first: what the daemon publishes as tuning
        records."""
        return [self._session(r) for r in self.query(f"SELECT * FROM sessions WHERE {ENDED} ORDER BY id")]

    def _session(self, r: sqlite3.Row) -> SessionRow:
        rkey = ResultKey(r["kernel"], r["source_hash"], r["workload"], r["shape_json"], r["hw_fingerprint"], r["isa"],
                         r["compiler_id"], r["strategy"], r["strategy_version"], r["objective"], r["model_version"])
        return SessionRow(r["id"], r["key"], r["state"], json.loads(r["params_json"]), r["started_at"],
                          json.loads(r["result_json"]) if r["result_json"] else None, rkey)

    def winners(self, kernel: str, hw_fingerprint: str, isa: str, objective: str, before: float
                ) -> list[tuple[dict, dict]]:
        """(shape, config) of this device's tuned winners of `kernel` (the latest per shape, newest first), from
        sessions that finished before `before`: a session's own start, so a resumed session sees the same list."""
        rows = self.query("SELECT shape_json, result_json FROM sessions WHERE kernel=? AND hw_fingerprint=? AND isa=? "
                          "AND objective=? AND state='done' AND finished_at<? ORDER BY finished_at DESC",
                          (kernel, hw_fingerprint, isa, objective, before))
        out: dict[str, dict] = {}
        for r in rows:
            config = json.loads(r["result_json"] or "{}").get("config")
            if isinstance(config, dict):
                out.setdefault(r["shape_json"], config)
        return [(json.loads(shape), config) for shape, config in out.items()]

    def session_info(self, session_id: int) -> dict:
        r = self.query_one("SELECT * FROM sessions WHERE id=?", (session_id,))
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
        rows = self.query(q, (session_id, phase) if phase else (session_id,))
        return [self._measurement(r) for r in rows]

    @staticmethod
    def _measurement(r: sqlite3.Row) -> dict:
        d = dict(r)
        d["config"] = json.loads(d.pop("config_json"))
        d["stats"] = json.loads(d.pop("stats_json"))
        d["ok"] = bool(d["ok"])
        return d

    def record(self, session_id: int, hw: Any = None) -> dict:
        """One session with all its measurements: a tuning record. `hw` (an HwDescriptor) joins it as `hw` where the
        session was measured on that device (same hw_fingerprint, which the ISA cap is part of), so a trainer on
        another machine reads the device the times belong to; otherwise `hw` is None."""
        info = self.session_info(session_id)
        same = hw is not None and info["hw_fingerprint"] == hw.hw_fingerprint
        return {**info, "hw": hw.to_dict() if same else None, "measurements": self.measurements(session_id)}

    def iter_records(self, hw_at: Callable[[str], Any] | None = None, *, running: bool = False) -> Iterator[dict]:
        """Every ended session with all its measurements, oldest first: the training-data export, the sessions the
        daemon publishes (a running one would be exported half-measured, and again once it ends). With `running`,
        also the sessions still running or left so by a crash: a trainer reading the DB itself keeps their
        measurements. `hw_at(isa)` is this device's descriptor at a session's ISA (`record`)."""
        where = "" if running else f" WHERE {ENDED}"
        for r in self.query(f"SELECT id, isa FROM sessions{where} ORDER BY id"):
            yield self.record(r["id"], hw_at(r["isa"]) if hw_at else None)

    # ---- active configs ------------------------------------------------------------------------------------

    def set_active(self, kernel: str, workload: str, entry: dict, *, pinned: bool = False, force: bool = False) -> bool:
        """Make `entry` active unless a pin holds the slot (a pin wins over tuning). Returns whether it was set."""
        with self.tx() as c:
            row = c.execute("SELECT pinned FROM active WHERE kernel=? AND workload=?", (kernel, workload)).fetchone()
            if row and row["pinned"] and not pinned and not force:
                return False
            c.execute("INSERT OR REPLACE INTO active (kernel, workload, entry_json, pinned, updated_at) "
                      "VALUES (?,?,?,?,?)", (kernel, workload, json.dumps(entry), int(pinned), time.time()))
        write_active(self.active_document())
        return True

    def remove_active(self, kernel: str, workload: str) -> None:
        with self.tx() as c:
            c.execute("DELETE FROM active WHERE kernel=? AND workload=?", (kernel, workload))
        write_active(self.active_document())

    def active(self) -> dict[str, dict]:
        rows = self.query("SELECT * FROM active ORDER BY kernel, workload")
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
        r = self.query_one("SELECT * FROM active WHERE kernel=? AND workload=?", (kernel, workload))
        return {**json.loads(r["entry_json"]), "pinned": bool(r["pinned"])} if r else None
