"""The fleet DB: SQLite in WAL mode (default `<state_dir>/fleet.db`), or PostgreSQL for a fleet that outgrows one
file and one receiver (`postgresql://…`, through fleet.db: same schema, migrations and queries).

What devices publish (DESIGN.md "daemon and MQTT") lands here, deduplicated so that a QoS 1 redelivery, a
retained message seen again after a reconnect, or an outbox re-send never counts twice:

- tuning records by (device, record uid): the device's session id plus its `started_at`, or a content hash;
- telemetry by (device, boot_id, seq);
- status history by (device, state, session, ts).

Every write is one transaction that commits before the listener acknowledges the message to the broker; the
listener stores many messages in one transaction (`batch`: the put_* methods called inside join it), so a commit,
and its fsync, is paid per batch rather than per message.
The schema is versioned with PRAGMA user_version and tagged with PRAGMA application_id (on PostgreSQL: a metadata
table, see fleet.db).

Several receivers may write to one PostgreSQL at once (MQTT shared subscriptions split the messages between them).
That is safe without application locks: every write first upserts the device row (`device_write`, the one way a
received message is written, fleet.rollout_store's model/state included), which row-locks it until commit, so two
transactions about one device run one after the other; and every insert that could arrive twice carries a unique
constraint and `ON CONFLICT DO NOTHING`, so a copy that races its twin is dropped by the database, not by an
earlier read. A batch about many devices touches their rows all at once, in sorted order (`touch_devices`), so two
receivers' batches wait for each other instead of deadlocking; a batch of telemetry only does that last, just
before its commit, so the rows every sample updates stay locked for the least time.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager, Iterator, Mapping, NamedTuple, Sequence

from edgetune import paths
from edgetune.protocol import EXPIRED, ORIGIN_FLEET, TERMINAL_STATES
from edgetune.sqlite import Schema, Store
from fleet.db import PgStore, is_postgres

APP_ID = 0x45544631  # "ETF1": tells the fleet DB from a results DB or a foreign SQLite file
MALFORMED_KEEP = 1000  # rows kept in the malformed-message log
TERMINAL_RECORD_STATES = frozenset({"done", "failed", "interrupted", "cancelled", "aborted"})

MIGRATIONS: list[str] = [
    # v1
    """
    CREATE TABLE devices (
        id TEXT PRIMARY KEY,
        state TEXT NOT NULL DEFAULT 'unknown',   -- online | offline | lost | unknown (no status heard yet)
        session INTEGER,                         -- the daemon's session number from its last status
        version TEXT,                            -- the edgetune version the device runs
        state_ts REAL,                           -- the device's ts on that status
        state_changed_at REAL,                   -- when the fleet saw the state change
        first_seen REAL NOT NULL,                -- when the fleet first heard of the device
        last_seen REAL,                          -- newest device timestamp (payload ts, else receive time of a live message)
        last_received REAL NOT NULL,             -- receive time of the newest message about it, retained ones included
        info_json TEXT, info_at REAL,            -- the retained info document, whole
        cpu_model TEXT, arch TEXT, isa TEXT, vector_bits INTEGER, cores INTEGER,   -- hw summary from info
        hw_fingerprint TEXT, fw_fingerprint TEXT, model_version TEXT,
        active_json TEXT, active_at REAL         -- the retained config/active document, whole
    );
    CREATE TABLE status_history (
        id INTEGER PRIMARY KEY,
        device_id TEXT NOT NULL, state TEXT NOT NULL, session INTEGER, version TEXT, ts REAL,
        retained INTEGER NOT NULL, received_at REAL NOT NULL
    );
    CREATE UNIQUE INDEX status_history_dedup ON status_history(device_id, state, ifnull(session, -1), ifnull(ts, -1));
    CREATE TABLE hw_descriptors (                -- every hardware descriptor seen, so exports can describe old records
        hw_fingerprint TEXT PRIMARY KEY, descriptor_json TEXT NOT NULL, device_id TEXT NOT NULL, first_seen REAL NOT NULL
    );
    CREATE TABLE active_configs (                -- one row per "<kernel>/<workload>" of a device's config/active
        device_id TEXT NOT NULL, slot TEXT NOT NULL,
        kernel TEXT, workload TEXT, config_json TEXT, ms REAL, default_ms REAL, speedup REAL, evals INTEGER,
        tuning_s REAL, strategy TEXT, tuned_at REAL,
        entry_json TEXT NOT NULL, received_at REAL NOT NULL,
        PRIMARY KEY (device_id, slot)
    );
    CREATE TABLE records (                       -- tuning runs: the fleet's training data
        id INTEGER PRIMARY KEY,
        device_id TEXT NOT NULL,
        record_uid TEXT NOT NULL,                -- "<session id>@<started_at>", "<session id>", or "sha256:<content>"
        session_id TEXT, key TEXT, kernel TEXT, workload TEXT, hw_fingerprint TEXT, fw_fingerprint TEXT,
        strategy TEXT, state TEXT, started_at REAL, n_measurements INTEGER NOT NULL,
        payload_json TEXT NOT NULL,              -- the record as received (the most complete copy)
        received_at REAL NOT NULL, updated_at REAL NOT NULL,
        copies INTEGER NOT NULL DEFAULT 1,       -- how many times it arrived
        UNIQUE (device_id, record_uid)
    );
    CREATE TABLE telemetry (
        id INTEGER PRIMARY KEY,
        device_id TEXT NOT NULL, boot_id TEXT NOT NULL, seq INTEGER NOT NULL,
        ts REAL, cpu_percent REAL, load1 REAL, temp_c REAL, freq_mhz REAL, mem_used REAL, rss REAL, state TEXT,
        payload_json TEXT NOT NULL, received_at REAL NOT NULL,
        UNIQUE (device_id, boot_id, seq)
    );
    CREATE TABLE commands (                      -- cmd/req seen on the broker, with the newest response
        device_id TEXT NOT NULL, id TEXT NOT NULL,
        op TEXT, args_json TEXT, expires_at REAL, requested_at REAL,
        status TEXT, progress_json TEXT, reason TEXT, result_json TEXT, updated_at REAL NOT NULL,
        PRIMARY KEY (device_id, id)
    );
    CREATE TABLE command_responses (             -- every cmd/res/{id}, in arrival order
        id INTEGER PRIMARY KEY,
        device_id TEXT NOT NULL, command_id TEXT NOT NULL, status TEXT NOT NULL,
        progress_json TEXT, reason TEXT, result_json TEXT, received_at REAL NOT NULL
    );
    CREATE INDEX command_responses_cmd ON command_responses(device_id, command_id);
    CREATE TABLE malformed (                     -- payloads skipped, newest MALFORMED_KEEP kept
        id INTEGER PRIMARY KEY,
        device_id TEXT, topic TEXT NOT NULL, error TEXT NOT NULL, payload_head BLOB, payload_bytes INTEGER NOT NULL,
        received_at REAL NOT NULL
    );
    """,
    # v2: retention prunes telemetry by receive time; the dashboard reads a device's newest samples
    """
    CREATE INDEX telemetry_received ON telemetry(received_at);
    CREATE INDEX telemetry_device ON telemetry(device_id, id)
    """,
    # v3: tuner-model releases and their staged rollouts (queries in fleet.rollout_store)
    """
    CREATE TABLE models (                        -- tuner models the fleet can release, versions monotonic
        id INTEGER PRIMARY KEY,
        version INTEGER NOT NULL UNIQUE,         -- the release version devices compare (1: the bundled model)
        name TEXT NOT NULL, sha256 TEXT NOT NULL UNIQUE, size INTEGER NOT NULL,
        model_version TEXT,                      -- the GGUF's own version string
        prompt_format TEXT NOT NULL, spaces_json TEXT NOT NULL, card_json TEXT,
        source TEXT NOT NULL,                    -- bundled | added | built
        note TEXT, data BLOB NOT NULL, created_at REAL NOT NULL
    );
    CREATE TABLE rollouts (
        id TEXT PRIMARY KEY,
        version INTEGER NOT NULL,                -- the model released
        rollback_version INTEGER NOT NULL,       -- the model an abort returns the devices to
        state TEXT NOT NULL,                     -- active | paused | completed | aborted
        phases_json TEXT NOT NULL,               -- cumulative shares of the targets, e.g. [5, 25, 100]
        phase INTEGER NOT NULL,                  -- index into phases of the phase now released
        phase_started_at REAL NOT NULL,
        min_dwell_s REAL NOT NULL, advance_pct REAL NOT NULL, abort_pct REAL NOT NULL, abort_min INTEGER NOT NULL,
        selector_json TEXT NOT NULL,             -- how the targets were chosen
        manifest_json TEXT NOT NULL, signature TEXT NOT NULL,
        rollback_manifest_json TEXT NOT NULL, rollback_signature TEXT NOT NULL,   -- signed at publish time
        reason TEXT,                             -- why it was paused or aborted
        created_at REAL NOT NULL, updated_at REAL NOT NULL, ended_at REAL
    );
    CREATE TABLE rollout_devices (               -- each target device's cohort and where it is with the release
        rollout_id TEXT NOT NULL, device_id TEXT NOT NULL,
        cohort_rank INTEGER NOT NULL,            -- order by sha256(rollout id, device id): the cohort draw
        phase INTEGER NOT NULL,                  -- the first phase that includes it
        attempt INTEGER NOT NULL DEFAULT 0,      -- retries of a failed download: rollout_id "<id>:retry<n>"
        sent_at REAL, state TEXT, reason TEXT, detail TEXT, ts REAL,   -- ts: the device's, of its newest report
        rollback_sent_at REAL, rollback_state TEXT, rollback_reason TEXT, rollback_detail TEXT, rollback_ts REAL,
        PRIMARY KEY (rollout_id, device_id)
    );
    CREATE TABLE rollout_events (                -- what happened to a rollout, for the page and the audit
        id INTEGER PRIMARY KEY,
        rollout_id TEXT NOT NULL, ts REAL NOT NULL, kind TEXT NOT NULL, actor TEXT, detail TEXT
    );
    CREATE INDEX rollout_events_rollout ON rollout_events(rollout_id, id);
    CREATE TABLE model_states (                  -- each device's newest model/state document
        device_id TEXT PRIMARY KEY,
        state TEXT, rollout_id TEXT, phase TEXT, version INTEGER, reason TEXT, detail TEXT, ts REAL,
        doc_json TEXT NOT NULL, received_at REAL NOT NULL
    )
    """,
    # v4: a rollout counts a released device that never reported as timed out after this long
    """
    ALTER TABLE rollouts ADD COLUMN report_timeout_s REAL NOT NULL DEFAULT 3600
    """,
    # v5: who started a command (cmd/res `origin`; `fleet` for a cmd/req seen) and, for a device's own, why (`note`)
    """
    ALTER TABLE commands ADD COLUMN origin TEXT;
    ALTER TABLE commands ADD COLUMN note TEXT;
    UPDATE commands SET origin = 'fleet' WHERE requested_at IS NOT NULL
    """,
]
FIX = "move it aside (rename it) or pass --db with another path"
PRUNE_BATCH = 5000  # telemetry rows deleted per transaction, so a prune never holds the writers up for long


TOUCH_SQL = (  # create the device row if new; last_seen moves forward only, last_received to now
    "INSERT INTO devices (id, first_seen, last_seen, last_received) VALUES (?,?,?,?) "
    "ON CONFLICT(id) DO UPDATE SET last_received=excluded.last_received, last_seen=CASE "
    " WHEN excluded.last_seen IS NULL THEN devices.last_seen"
    " WHEN devices.last_seen IS NULL OR excluded.last_seen > devices.last_seen THEN excluded.last_seen"
    " ELSE devices.last_seen END")
# A batch moves last_seen / last_received only by steps of at least this: 1 Hz telemetry then rewrites a device's
# row (the hottest in the DB, holding its info and active documents) every few seconds instead of every second.
# A dashboard that calls a device stale after minutes loses nothing by it.
TOUCH_STEP_S = 5.0
BATCH_TOUCH_SQL = TOUCH_SQL + (
    f" WHERE devices.last_received < excluded.last_received - {TOUCH_STEP_S}"
    f" OR excluded.last_seen > coalesce(devices.last_seen, 0) + {TOUCH_STEP_S}")
SUMMARY_FIELDS = ("id", "state", "session", "version", "last_seen", "state_changed_at", "first_seen", "cpu_model",
                  "arch", "isa", "vector_bits", "cores", "hw_fingerprint", "fw_fingerprint", "model_version")
TELEMETRY_FIELDS = ("boot_id", "seq", "ts", "cpu_percent", "load1", "temp_c", "freq_mhz", "mem_used", "rss", "state")


class Started(NamedTuple):
    """Who started a command and why, as its cmd/res says (all None when it does not)."""
    op: str | None = None
    origin: str | None = None
    note: str | None = None


@dataclass(frozen=True)
class Sample:
    """One telemetry message, validated: `fields` holds TELEMETRY_FIELDS, `payload` the message as received."""

    device: str
    fields: dict
    payload: dict


def default_path() -> Path:
    return paths.state_dir() / "fleet.db"


def _dumps(x: Any) -> str | None:
    return None if x is None else json.dumps(x, sort_keys=True, default=str)


def _loads(s: str | None) -> Any:
    return None if s is None else json.loads(s)


def geomean(xs: list[float]) -> float | None:
    """The mean of speedups: ratios average geometrically (2x and 0.5x average to 1x)."""
    xs = [x for x in xs if x is not None and x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


class FleetStore(Store):
    """One connection to the fleet DB. Used from one thread at a time (the listener's loop, or a CLI verb);
    `threads=True` lets the listener open it in one thread and use it in its loop's."""

    SCHEMA = Schema("fleet DB", APP_ID, tuple(MIGRATIONS))

    _batch: tuple[int, Any] | None = None  # (thread, connection) of the open batch transaction

    def __init__(self, path: Path | str | None = None, *, threads: bool = False):
        # FULL: a commit is on disk before the listener acks the message to the broker
        super().__init__(Path(path) if path else default_path(), synchronous="FULL", threads=threads, fix=FIX)

    # ---- transactions --------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """One transaction for many writes: the put_* methods called inside it, in this thread, join it."""
        with self.tx() as c:
            self._batch = (threading.get_ident(), c)
            try:
                yield
            finally:
                self._batch = None

    def touch_devices(self, devices: Mapping[str, float | None], now: float) -> None:
        """`_touch` every device of a batch (each one's newest last_seen, or None) in steps of TOUCH_STEP_S, in
        sorted order: that row-locks them until the commit in the same order in every receiver, so receivers
        sharing one PostgreSQL wait for each other but never deadlock. Call it before any other write in the
        transaction that touches a device."""
        with self._write() as c:
            self._touch_many(c, sorted(devices.items()), now)

    def _write(self) -> ContextManager[Any]:
        """The transaction a write runs in: the open batch's (same thread), else one of its own."""
        if self._batch is not None and self._batch[0] == threading.get_ident():
            return contextlib.nullcontext(self._batch[1])
        return self.tx()

    @contextlib.contextmanager
    def device_write(self, device: str, now: float, seen: float | None) -> Iterator[Any]:
        """The connection for a write about one device received from it (every put_*, and the stores of other
        modules, e.g. fleet.rollout_store's model/state): the open batch's transaction in this thread, else one
        of its own, with the device row touched first (row-locked until the commit, see the module docstring)."""
        with self._write() as c:
            self._touch(c, device, now, seen)
            yield c

    # ---- writes (each its own transaction, or the open batch's) --------------------------------------------

    @staticmethod
    def _touch(c: Any, device: str, now: float, seen: float | None) -> None:
        """Create the device row if new; move last_seen forward (never back) and last_received to now."""
        c.execute(TOUCH_SQL, (device, now, seen, now))

    def _touch_many(self, c: Any, devices: Sequence[tuple[str, float | None]], now: float) -> None:
        """BATCH_TOUCH_SQL of each (device, seen), in this order."""
        c.executemany(BATCH_TOUCH_SQL, [(d, now, seen, now) for d, seen in devices])

    def put_status(self, device: str, state: str, session: int | None, version: str | None, ts: float | None,
                   retained: bool, now: float, seen: float | None) -> bool:
        """Record a status message; the newest one received sets the device state. Returns whether it changed."""
        with self.device_write(device, now, seen) as c:
            c.execute("INSERT INTO status_history (device_id, state, session, version, ts, retained, received_at)"
                      " VALUES (?,?,?,?,?,?,?) ON CONFLICT DO NOTHING",
                      (device, state, session, version, ts, int(retained), now))
            old = c.execute("SELECT state FROM devices WHERE id=?", (device,)).fetchone()["state"]
            c.execute("UPDATE devices SET state=?, session=?, version=coalesce(?, version), state_ts=?,"
                      " state_changed_at=CASE WHEN state=? THEN state_changed_at ELSE ? END WHERE id=?",
                      (state, session, version, ts, state, now, device))
        return old != state

    def put_info(self, device: str, info: dict, hw: dict, now: float, seen: float | None) -> None:
        with self.device_write(device, now, seen) as c:
            c.execute("UPDATE devices SET info_json=?, info_at=?, cpu_model=?, arch=?, isa=?, vector_bits=?, cores=?,"
                      " hw_fingerprint=coalesce(?, hw_fingerprint), fw_fingerprint=coalesce(?, fw_fingerprint),"
                      " model_version=coalesce(?, model_version) WHERE id=?",
                      (_dumps(info), now, hw.get("cpu_model"), hw.get("arch"), hw.get("isa"), hw.get("vector_bits"),
                       hw.get("cores"), hw.get("hw_fingerprint"), hw.get("fw_fingerprint"), hw.get("model_version"),
                       device))
            if hw.get("hw_fingerprint") and hw.get("descriptor"):
                c.execute("INSERT INTO hw_descriptors (hw_fingerprint, descriptor_json, device_id, first_seen)"
                          " VALUES (?,?,?,?) ON CONFLICT DO NOTHING",
                          (hw["hw_fingerprint"], _dumps(hw["descriptor"]), device, now))

    def put_active(self, device: str, doc: dict | None, meta: dict, entries: list[dict], now: float,
                   seen: float | None) -> None:
        """Replace the device's active configs with this document's (None: the retained document was cleared).
        `meta` holds the document's validated model_version, hw_fingerprint and fw_fingerprint."""
        with self.device_write(device, now, seen) as c:
            c.execute("DELETE FROM active_configs WHERE device_id=?", (device,))
            for e in entries:
                c.execute("INSERT INTO active_configs (device_id, slot, kernel, workload, config_json, ms,"
                          " default_ms, speedup, evals, tuning_s, strategy, tuned_at, entry_json, received_at)"
                          " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT DO NOTHING",
                          (device, e["slot"], e["kernel"], e["workload"], _dumps(e["config"]), e["ms"],
                           e["default_ms"], e["speedup"], e["evals"], e["tuning_s"], e["strategy"], e["tuned_at"],
                           _dumps(e["entry"]), now))
            c.execute("UPDATE devices SET active_json=?, active_at=?, model_version=coalesce(?, model_version),"
                      " hw_fingerprint=coalesce(hw_fingerprint, ?), fw_fingerprint=coalesce(fw_fingerprint, ?)"
                      " WHERE id=?", (_dumps(doc), now, meta.get("model_version"), meta.get("hw_fingerprint"),
                                      meta.get("fw_fingerprint"), device))

    def put_record(self, device: str, uid: str, fields: dict, payload: dict, now: float, seen: float | None) -> str:
        """Store one tuning record. Returns "new", "duplicate" (same content again), "updated" (a more complete
        copy of a known record replaced it) or "stale" (a less complete copy; the stored one is kept)."""
        text = _dumps(payload)
        n = fields["n_measurements"]
        terminal = fields.get("state") in TERMINAL_RECORD_STATES
        with self.device_write(device, now, seen) as c:
            old = c.execute("SELECT id, payload_json, n_measurements, state FROM records WHERE device_id=? AND"
                            " record_uid=?", (device, uid)).fetchone()
            if old is None:
                c.execute("INSERT INTO records (device_id, record_uid, session_id, key, kernel, workload,"
                          " hw_fingerprint, fw_fingerprint, strategy, state, started_at, n_measurements, payload_json,"
                          " received_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                          (device, uid, fields.get("session_id"), fields.get("key"), fields.get("kernel"),
                           fields.get("workload"), fields.get("hw_fingerprint"), fields.get("fw_fingerprint"),
                           fields.get("strategy"), fields.get("state"), fields.get("started_at"), n, text, now, now))
                return "new"
            c.execute("UPDATE records SET copies=copies+1 WHERE id=?", (old["id"],))
            if old["payload_json"] == text:
                return "duplicate"
            if (terminal, n) < (old["state"] in TERMINAL_RECORD_STATES, old["n_measurements"]):
                return "stale"
            c.execute("UPDATE records SET session_id=?, key=?, kernel=?, workload=?, hw_fingerprint=?, fw_fingerprint=?,"
                      " strategy=?, state=?, started_at=?, n_measurements=?, payload_json=?, updated_at=? WHERE id=?",
                      (fields.get("session_id"), fields.get("key"), fields.get("kernel"), fields.get("workload"),
                       fields.get("hw_fingerprint"), fields.get("fw_fingerprint"), fields.get("strategy"),
                       fields.get("state"), fields.get("started_at"), n, text, now, old["id"]))
            return "updated"

    def put_telemetry(self, device: str, t: dict, payload: dict, now: float, seen: float | None) -> bool:
        """Store one telemetry sample; False when (device, boot_id, seq) was already stored."""
        with self.device_write(device, now, seen) as c:
            return self._insert_telemetry(c, [Sample(device, t, payload)], now)[0]

    def put_telemetry_many(self, samples: Sequence[Sample], now: float) -> list[bool]:
        """Store telemetry samples (their devices are touched by the caller: `touch_devices`); per sample, False
        when (device, boot_id, seq) was already stored (a second copy in the same call included)."""
        with self._write() as c:
            return self._insert_telemetry(c, samples, now)

    def _insert_telemetry(self, c: Any, samples: Sequence[Sample], now: float) -> list[bool]:
        return [c.execute("INSERT INTO telemetry (device_id, boot_id, seq, ts, cpu_percent, load1, temp_c, freq_mhz,"
                          " mem_used, rss, state, payload_json, received_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)"
                          " ON CONFLICT DO NOTHING",
                          (x.device, *(x.fields[k] for k in TELEMETRY_FIELDS), _dumps(x.payload), now)).rowcount == 1
                for x in samples]

    def put_command(self, device: str, cmd_id: str, op: str | None, args: Any, expires_at: float | None,
                    now: float) -> None:
        """A cmd/req seen on the broker: the fleet sent it (devices never publish one)."""
        with self.device_write(device, now, None) as c:
            c.execute("INSERT INTO commands (device_id, id, op, args_json, expires_at, requested_at, updated_at,"
                      " origin) VALUES (?,?,?,?,?,?,?,?) ON CONFLICT(device_id, id) DO UPDATE SET"
                      " op=excluded.op, args_json=excluded.args_json, expires_at=excluded.expires_at,"
                      " requested_at=coalesce(commands.requested_at, excluded.requested_at),"
                      " origin=coalesce(commands.origin, excluded.origin)",
                      (device, cmd_id, op, _dumps(args), expires_at, now, now, ORIGIN_FLEET))

    def put_response(self, device: str, cmd_id: str, status: str, progress: Any, reason: str | None, result: Any,
                     now: float, started: Started = Started()) -> None:
        """Log a response; the command's status follows it, except that a final status is never undone. What
        `started` says fills the command's op, origin and note where they are unknown (a device's own command has
        no cmd/req to tell them)."""
        with self.device_write(device, now, now) as c:
            c.execute("INSERT INTO command_responses (device_id, command_id, status, progress_json, reason,"
                      " result_json, received_at) VALUES (?,?,?,?,?,?,?)",
                      (device, cmd_id, status, _dumps(progress), reason, _dumps(result), now))
            row = c.execute("SELECT status FROM commands WHERE device_id=? AND id=?", (device, cmd_id)).fetchone()
            if row is None:
                c.execute("INSERT INTO commands (device_id, id, status, progress_json, reason, result_json,"
                          " updated_at, op, origin, note) VALUES (?,?,?,?,?,?,?,?,?,?)",
                          (device, cmd_id, status, _dumps(progress), reason, _dumps(result), now, *started))
            elif not (row["status"] in TERMINAL_STATES and status not in TERMINAL_STATES):
                c.execute("UPDATE commands SET status=?, progress_json=?, reason=?, result_json=?, updated_at=?,"
                          " op=coalesce(op, ?), origin=coalesce(origin, ?), note=coalesce(note, ?)"
                          " WHERE device_id=? AND id=?",
                          (status, _dumps(progress), reason, _dumps(result), now, *started, device, cmd_id))

    def put_malformed(self, device: str | None, topic: str, error: str, payload: bytes, now: float) -> None:
        # the log must take whatever arrived: PostgreSQL text cannot hold NUL, so it is spelled out
        device, topic, error = (None if x is None else x.replace("\0", "\\0") for x in (device, topic, error[:500]))
        with self._write() as c:
            c.execute("INSERT INTO malformed (device_id, topic, error, payload_head, payload_bytes, received_at)"
                      " VALUES (?,?,?,?,?,?)", (device, topic, error, bytes(payload[:256]), len(payload), now))
            c.execute("DELETE FROM malformed WHERE id <= (SELECT max(id) FROM malformed) - ?", (MALFORMED_KEEP,))

    def prune_telemetry(self, before: float) -> int:
        """Delete telemetry received before `before` (receiver time: a device's clock may be off), in batches of
        PRUNE_BATCH rows per transaction. Returns how many rows went."""
        total = 0
        while True:
            with self.tx() as c:
                n = c.execute("DELETE FROM telemetry WHERE id IN (SELECT id FROM telemetry WHERE received_at < ?"
                              " LIMIT ?)", (before, PRUNE_BATCH)).rowcount
            total += n
            if n < PRUNE_BATCH:
                return total

    # ---- reads ---------------------------------------------------------------------------------------------

    def devices(self, now: float | None = None, *, device: str | None = None,
                newest_sample: bool = True) -> list[dict]:
        """One summary per device (only `device`'s when given): state, last seen, hw summary, tuned workloads and
        their mean speedup, and its newest telemetry sample (unless `newest_sample` is False). Every query is an
        index lookup per device or a pass over a table with a few rows per device, never over the telemetry."""
        now = time.time() if now is None else now
        one, args = (" WHERE device_id = ?", (device,)) if device is not None else ("", ())
        speedups: dict[str, list[float]] = {}
        tuned: dict[str, int] = {}
        for name, speedup in self.query(f"SELECT device_id, speedup FROM active_configs{one}", args):
            tuned[name] = tuned.get(name, 0) + 1
            if speedup is not None:
                speedups.setdefault(name, []).append(speedup)
        records = {r[0]: r[1] for r in self.query(f"SELECT device_id, count(*) FROM records{one} GROUP BY device_id",
                                                  args)}
        telemetry = self.newest_samples(None if device is None else [device]) if newest_sample else {}
        out = []
        for row in self.query(f"SELECT {', '.join(SUMMARY_FIELDS)} FROM devices"
                              + (" WHERE id = ?" if device is not None else "") + " ORDER BY id", args):
            d = dict(zip(SUMMARY_FIELDS, row))  # by position: a thousand rows read by name cost more than the query
            seen, name = d["last_seen"], d["id"]
            d.update(online=d["state"] == "online",
                     last_seen_ago_s=None if seen is None else round(max(0.0, now - seen), 1),
                     tuned_workloads=tuned.get(name, 0), mean_speedup=geomean(speedups.get(name, [])),
                     records=records.get(name, 0), telemetry=telemetry.get(name) if newest_sample else None)
            out.append(d)
        return out

    def newest_samples(self, devices: Sequence[str] | None = None) -> dict[str, dict]:
        """Each device's newest telemetry sample (of `devices`, else of all): one lookup per device in
        telemetry_device (device_id, id), never a pass over the telemetry."""
        where, args = "", ()
        if devices is not None:
            if not devices:
                return {}
            where, args = f" WHERE d.id IN ({', '.join('?' * len(devices))})", tuple(devices)
        return {r[0]: dict(zip(TELEMETRY_FIELDS, r[1:])) for r in self.query(
            f"SELECT t.device_id, {', '.join('t.' + k for k in TELEMETRY_FIELDS)} FROM devices d JOIN telemetry t"
            f" ON t.id = (SELECT max(id) FROM telemetry WHERE device_id = d.id){where}", args)}

    def device(self, device: str) -> dict | None:
        r = self.query_one("SELECT * FROM devices WHERE id=?", (device,))
        if r is None:
            return None
        d = dict(r)
        d["info"] = _loads(d.pop("info_json"))
        d["active"] = _loads(d.pop("active_json"))
        return d

    def active_configs(self, device: str) -> dict[str, dict]:
        rows = self.query("SELECT slot, entry_json FROM active_configs WHERE device_id=? ORDER BY slot", (device,))
        return {r["slot"]: json.loads(r["entry_json"]) for r in rows}

    def status_history(self, device: str) -> list[dict]:
        return [dict(r) for r in self.query(
            "SELECT state, session, version, ts, retained, received_at FROM status_history WHERE device_id=? ORDER BY id",
            (device,))]

    def records(self, device: str | None = None) -> list[dict]:
        """Record rows (metadata + the stored payload as `record`), in arrival order."""
        q = "SELECT * FROM records" + (" WHERE device_id=?" if device else "") + " ORDER BY id"
        out = []
        for r in self.query(q, (device,) if device else ()):
            d = dict(r)
            d["record"] = json.loads(d.pop("payload_json"))
            out.append(d)
        return out

    def iter_export(self, device: str | None = None) -> Iterator[dict]:
        """Training data: each stored record as received, plus `device_id` and, when the record does not carry
        one, the `hw` descriptor its device reported under the record's hw_fingerprint."""
        descriptors = {r["hw_fingerprint"]: r["descriptor_json"] for r in
                       self.query("SELECT hw_fingerprint, descriptor_json FROM hw_descriptors")}
        q = "SELECT device_id, hw_fingerprint, payload_json FROM records" + (" WHERE device_id=?" if device else "")
        for r in self.iter_query(q + " ORDER BY id", (device,) if device else ()):  # streamed: exports are big
            rec = json.loads(r["payload_json"])
            rec.setdefault("device_id", r["device_id"])
            if "hw" not in rec and r["hw_fingerprint"] in descriptors:
                rec["hw"] = json.loads(descriptors[r["hw_fingerprint"]])
            yield rec

    def telemetry(self, device: str) -> list[dict]:
        return [dict(r) for r in self.query(
            "SELECT boot_id, seq, ts, cpu_percent, load1, temp_c, freq_mhz, mem_used, rss, state, received_at"
            " FROM telemetry WHERE device_id=? ORDER BY id", (device,))]

    def command(self, device: str, cmd_id: str) -> dict | None:
        r = self.query_one("SELECT * FROM commands WHERE device_id=? AND id=?", (device, cmd_id))
        if r is None:
            return None
        d = dict(r)
        for k in ("args", "progress", "result"):
            d[k] = _loads(d.pop(f"{k}_json"))
        d["responses"] = [
            {"status": x["status"], "progress": _loads(x["progress_json"]), "reason": x["reason"],
             "result": _loads(x["result_json"]), "received_at": x["received_at"]}
            for x in self.query("SELECT * FROM command_responses WHERE device_id=? AND command_id=? ORDER BY id",
                                (device, cmd_id))]
        return d

    def commands(self, device: str) -> list[dict]:
        """The device's commands in the order first seen, each with its newest status."""
        out = []
        for r in self.query("SELECT * FROM commands WHERE device_id=? ORDER BY rowid", (device,)):
            d = dict(r)
            d.pop("rowid", None)  # PostgreSQL's stand-in for SQLite's implicit rowid (fleet.db)
            for k in ("args", "progress", "result"):
                d[k] = _loads(d.pop(f"{k}_json"))
            out.append(d)
        return out

    def malformed(self) -> list[dict]:
        return [dict(r) for r in self.query(
            "SELECT device_id, topic, error, payload_bytes, received_at FROM malformed ORDER BY id")]

    def counts(self) -> dict[str, int]:
        return {t: self.query_one(f"SELECT count(*) FROM {t}")[0] for t in (
            "devices", "status_history", "active_configs", "records", "telemetry", "commands", "command_responses",
            "malformed")}

    # ---- reads for the dashboard and its API (fleet.web) ----------------------------------------------------

    def dashboard_devices(self, now: float | None = None, stale_after_s: float = 600.0, *, device: str | None = None,
                          newest_sample: bool = True) -> list[dict]:
        """`devices()` plus what the dashboard shows: `status`, which splits `online` into online and `stale`
        (the retained status says online but nothing was heard for `stale_after_s`), so the statuses partition
        the fleet; the geomean of tuned/ORT over the active configs that carry `ort_ms`; the tuned slots."""
        now = time.time() if now is None else now
        ort: dict[str, list[float]] = {}
        slots: dict[str, list[str]] = {}
        one, args = (" WHERE device_id = ?", (device,)) if device is not None else ("", ())
        for name, slot, ms, entry in self.query(
                f"SELECT device_id, slot, ms, entry_json FROM active_configs{one} ORDER BY slot", args):
            slots.setdefault(name, []).append(slot)
            ort_ms = json.loads(entry).get("ort_ms")
            if isinstance(ort_ms, (int, float)) and ort_ms > 0 and ms:
                ort.setdefault(name, []).append(ms / ort_ms)
        out = []
        for d in self.devices(now, device=device, newest_sample=newest_sample):
            ago = d["last_seen_ago_s"]
            stale = d["state"] == "online" and (ago is None or ago > stale_after_s)
            out.append({**d, "status": "stale" if stale else d["state"], "ort_ratio": geomean(ort.get(d["id"], [])),
                        "slots": slots.get(d["id"], [])})
        return out

    def overview(self, now: float | None = None, stale_after_s: float = 600.0) -> dict:
        """Counts by dashboard status (as `dashboard_devices` gives them) and the breakdowns an operator filters
        the device list by: GROUP BYs over the devices table, not a summary of every device built in Python."""
        now = time.time() if now is None else now
        statuses = {s: 0 for s in ("online", "stale", "offline", "lost", "unknown")}
        for status, n in self.query("SELECT CASE WHEN state = 'online' AND (last_seen IS NULL OR last_seen < ?)"
                                    " THEN 'stale' ELSE state END, count(*) FROM devices GROUP BY 1",
                                    (now - stale_after_s,)):
            statuses[status] = statuses.get(status, 0) + n
        breakdowns = {k: sorted(({"value": v, "devices": n} for v, n in self.query(
                          f"SELECT coalesce({k}, ''), count(*) FROM devices GROUP BY 1")),
                                key=lambda x: (-x["devices"], x["value"]))
                      for k in ("version", "model_version", "fw_fingerprint", "cpu_model", "isa")}
        return {"devices": sum(statuses.values()), "statuses": statuses, "breakdowns": breakdowns}

    def telemetry_window(self, device: str, since: float, limit: int = 2000) -> list[dict]:
        """The device's newest `limit` telemetry samples received since `since`, in the order of their time (the
        device's ts, else when received), as plots need their x: a device's outbox sends its backlog after the
        live samples, so the order of arrival is not the order of time."""
        cols = "boot_id, seq, ts, cpu_percent, load1, temp_c, freq_mhz, mem_used, rss, state, received_at"
        rows = self.query(
            f"SELECT {cols} FROM (SELECT {cols}, id FROM telemetry WHERE device_id=? AND received_at>=?"
            " ORDER BY id DESC LIMIT ?) newest ORDER BY coalesce(ts, received_at), id", (device, since, limit))
        return [dict(r) for r in rows]

    def active_config_rows(self, device: str) -> list[dict]:
        """The device's active configs as table rows, with ORT ms and tuned/ORT from the entry when it has them."""
        out = []
        for r in self.query("SELECT * FROM active_configs WHERE device_id=? ORDER BY slot", (device,)):
            entry = json.loads(r["entry_json"])
            ort_ms = entry.get("ort_ms") if isinstance(entry.get("ort_ms"), (int, float)) else None
            out.append({k: r[k] for k in ("slot", "kernel", "workload", "ms", "default_ms", "speedup", "evals",
                                          "tuning_s", "strategy", "tuned_at")}
                       | {"config": _loads(r["config_json"]), "ort_ms": ort_ms,
                          "ort_ratio": r["ms"] / ort_ms if ort_ms and r["ms"] else None})
        return out

    def speedups(self) -> list[dict]:
        """Every device's speedup per kernel/workload, for the fleet-wide distribution."""
        return [dict(r) for r in self.query(
            "SELECT kernel, workload, slot, device_id, speedup, ms, default_ms FROM active_configs"
            " WHERE speedup IS NOT NULL ORDER BY slot, speedup")]

    # ---- delivery: expiry and telemetry gaps -------------------------------------------------------------------

    def expire_commands(self, now: float) -> int:
        """Mark `expired` the commands past their expires_at that no device ever answered: nobody will run them,
        and the CLI must say so rather than leave them pending. Returns how many."""
        with self.tx() as c:
            return c.execute("UPDATE commands SET status=?, reason=?, updated_at=? WHERE status IS NULL AND"
                             " expires_at IS NOT NULL AND expires_at < ?",
                             (EXPIRED, "no device answered before it expired", now, now)).rowcount

    def telemetry_gaps(self) -> dict[str, dict[str, int]]:
        """Per device: telemetry samples received, and missing ones: holes in each boot's seq, which a device
        counts from 0, so samples sent before this fleet DB existed count as missing too. Telemetry is best
        effort; this is how the fleet sees what it lost."""
        out: dict[str, dict[str, int]] = {}
        for r in self.query("SELECT device_id, count(*) AS n, max(seq) + 1 - count(*) AS missing"
                            " FROM telemetry GROUP BY device_id, boot_id"):
            d = out.setdefault(r["device_id"], {"received": 0, "missing": 0, "boots": 0})
            d["received"] += r["n"]
            d["missing"] += r["missing"]
            d["boots"] += 1
        return out

class PgFleetStore(PgStore, FleetStore):
    """The fleet DB on PostgreSQL: FleetStore's queries over fleet.db's connection (its methods come first)."""

    def __init__(self, url: str, *, threads: bool = False):  # a psycopg connection is thread-safe already
        PgStore.__init__(self, url, fix="point [fleet] database (or --db) at a database of its own")

    # A round trip, and a parse, per row is what limits a receiver on PostgreSQL: a batch's touches and its
    # telemetry are one statement each, the rows sent as arrays (in binary) and unnested in order.

    def _touch_many(self, c: Any, devices: Sequence[tuple[str, float | None]], now: float) -> None:
        if devices:
            c.execute(BATCH_TOUCH_SQL.replace("VALUES (?,?,?,?)", "SELECT d, ?::float8, s, ?::float8 FROM"
                                        " unnest(?::text[], ?::float8[]) WITH ORDINALITY AS u(d, s, i) ORDER BY i"),
                      (now, now, [d for d, _ in devices], [seen for _, seen in devices]), binary=True)

    def _insert_telemetry(self, c: Any, samples: Sequence[Sample], now: float) -> list[bool]:
        if not samples:
            return []
        # in key order: two receivers inserting the same redelivered samples wait for each other, never in a cycle
        rows = sorted(samples, key=lambda x: (x.device, x.fields["boot_id"], x.fields["seq"]))
        cols = [[x.device for x in rows], *([x.fields[k] for x in rows] for k in TELEMETRY_FIELDS),
                [_dumps(x.payload) for x in rows]]
        new = {tuple(r) for r in c.execute(
            "INSERT INTO telemetry (device_id, boot_id, seq, ts, cpu_percent, load1, temp_c, freq_mhz, mem_used, rss,"
            " state, payload_json, received_at) SELECT u.*, ?::float8 FROM unnest(?::text[], ?::text[], ?::bigint[],"
            " ?::float8[], ?::float8[], ?::float8[], ?::float8[], ?::float8[], ?::float8[], ?::float8[], ?::text[],"
            " ?::text[]) AS u ON CONFLICT DO NOTHING RETURNING device_id, boot_id, seq", (now, *cols),
            binary=True).fetchall()}
        out = []
        for x in samples:  # the first copy of a key is the new one
            key = (x.device, x.fields["boot_id"], x.fields["seq"])
            out.append(key in new)
            new.discard(key)
        return out


def open_fleet_store(db: Path | str | None = None, *, threads: bool = False) -> FleetStore:
    """The fleet DB `db` names: a postgresql:// URL, else a SQLite path (None: the default file)."""
    return PgFleetStore(db, threads=threads) if is_postgres(db) else FleetStore(db, threads=threads)
