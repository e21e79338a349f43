"""The fleet DB's model registry and rollout tables (schema v3, fleet.store): reads and writes, on SQLite or
PostgreSQL alike (every function takes the store, whose `tx`/`query` speak both).

- `models`: every tuner model the fleet can release, file included (a few MB: one DB holds them, so several fleet
  servers on one PostgreSQL serve the same bytes). Versions are monotonic; version 1 is the model bundled with
  edgetune, which every device starts with and a rollback may return to.
- `rollouts`: one staged release each, with its signed manifest and the signed rollback made at publish time, so
  the server can abort without holding the private key.
- `rollout_devices`: each target's cohort (rank and first phase) and where it is with the release, from the
  devices' retained `model/state` reports; `model_states` keeps each device's newest report whatever its rollout.

State changes are compare-and-set updates (`WHERE state IN (…)`, `WHERE phase = ?`): several servers, or an
operator and the controller, never both act on one change.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from edgetune.errors import BadInput, EdgetuneError
from edgetune.sqlite import DBConflict
from fleet.rollout import REPORT_TIMEOUT, RETRYABLE, ROLLBACK_PHASE, TIMED_OUT, parse_rollout_id
from fleet.store import FleetStore

ROLLOUT_STATES = ("active", "paused", "completed", "aborted")
OPEN_ROLLOUT_STATES = ("active", "paused")
BUNDLED_VERSION = 1
ADD_ATTEMPTS = 5  # tries at the next version when registrations race for it on PostgreSQL
MODEL_COLUMNS = ("version", "name", "sha256", "size", "model_version", "prompt_format", "spaces_json", "card_json",
                 "source", "note", "created_at")


def _loads(s: str | None) -> Any:
    return None if s is None else json.loads(s)


def _model(row: Any) -> dict:
    d = {k: row[k] for k in MODEL_COLUMNS}
    d["spaces"], d["card"] = _loads(d.pop("spaces_json")), _loads(d.pop("card_json"))
    return d


# ---- models ------------------------------------------------------------------------------------------------------

def add_model(store: FleetStore, *, name: str, data: bytes, sha256: str, model_version: str | None,
              prompt_format: str, spaces: dict, card: dict | None, source: str, note: str | None, now: float,
              version: int | None = None) -> dict:
    """Register a model file under the next version (or `version`, for the bundled model); BadInput if the same
    file is registered already. Two registrations at once on PostgreSQL both read the same next version and the
    second insert fails on the unique key: it reads again and takes the version after, up to ADD_ATTEMPTS times."""
    row = (name, sha256, len(data), model_version, prompt_format, json.dumps(spaces, sort_keys=True),
           None if card is None else json.dumps(card, sort_keys=True), source, note, data, now)
    for _ in range(ADD_ATTEMPTS):
        try:
            return model(store, _insert_model(store, sha256, version, row))
        except DBConflict as e:
            if version is not None:  # the bundled model's fixed version: the caller decides
                raise
            conflict = e
    raise EdgetuneError(f"another registration took the next model version {ADD_ATTEMPTS} times in a row "
                        f"({conflict}); run `edgetune fleet model add` again")


def _insert_model(store: FleetStore, sha256: str, version: int | None, row: tuple) -> int:
    """One attempt: the next version (or `version`) read and inserted in one transaction."""
    with store.tx() as c:
        old = c.execute("SELECT version FROM models WHERE sha256=?", (sha256,)).fetchone()
        if old is not None:
            raise BadInput(f"this file (sha256 {sha256[:16]}…) is model v{old[0]} already; see `edgetune fleet "
                           "model list`")
        if version is None:
            top = c.execute("SELECT max(version) FROM models").fetchone()[0]
            version = max(top or BUNDLED_VERSION, BUNDLED_VERSION) + 1
        c.execute("INSERT INTO models (version, name, sha256, size, model_version, prompt_format, spaces_json,"
                  " card_json, source, note, data, created_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", (version, *row))
    return version


def models(store: FleetStore) -> list[dict]:
    cols = ", ".join(MODEL_COLUMNS)
    return [_model(r) for r in store.query(f"SELECT {cols} FROM models ORDER BY version")]


def model(store: FleetStore, version: int) -> dict | None:
    r = store.query_one(f"SELECT {', '.join(MODEL_COLUMNS)} FROM models WHERE version=?", (version,))
    return None if r is None else _model(r)


def model_by_sha(store: FleetStore, sha256: str) -> dict | None:
    r = store.query_one(f"SELECT {', '.join(MODEL_COLUMNS)} FROM models WHERE sha256=?", (sha256,))
    return None if r is None else _model(r)


def model_data(store: FleetStore, sha256: str) -> bytes | None:
    """A model file's bytes by its sha256 (what /releases/{sha256} serves)."""
    r = store.query_one("SELECT data FROM models WHERE sha256=?", (sha256,))
    return None if r is None else bytes(r[0])


# ---- rollouts ----------------------------------------------------------------------------------------------------

def create_rollout(store: FleetStore, r: dict, targets: Iterable[tuple[str, int, int]], now: float,
                   actor: str | None) -> None:
    """A new rollout (`r`: the rollouts columns) and its targets (device, rank, first phase); BadInput while
    another rollout is open, since two releases on one retained topic would replace each other."""
    cols = list(r)
    with store.tx() as c:
        busy = c.execute("SELECT id, state FROM rollouts WHERE state IN (?, ?)", OPEN_ROLLOUT_STATES).fetchone()
        if busy is not None:
            raise BadInput(f"rollout {busy[0]} is {busy[1]}: finish or abort it first (`edgetune fleet rollout "
                           f"abort {busy[0]}`)")
        c.execute(f"INSERT INTO rollouts ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)})",
                  [r[k] for k in cols])
        for device, rank, phase in targets:
            c.execute("INSERT INTO rollout_devices (rollout_id, device_id, cohort_rank, phase) VALUES (?,?,?,?)",
                      (r["id"], device, rank, phase))
        phases = " → ".join(f"{p:g}%" for p in json.loads(r["phases_json"]))
        _event(c, r["id"], now, "published", actor, f"v{r['version']} to phases {phases}")


def _event(c: Any, rollout_id: str, now: float, kind: str, actor: str | None, detail: str) -> None:
    c.execute("INSERT INTO rollout_events (rollout_id, ts, kind, actor, detail) VALUES (?,?,?,?,?)",
              (rollout_id, now, kind, actor, detail))


def _rollout(row: Any) -> dict:
    d = dict(row)
    d.pop("rowid", None)
    for k in ("phases", "selector", "manifest", "rollback_manifest"):
        d[k] = _loads(d.pop(f"{k}_json"))
    return d


def rollouts(store: FleetStore, states: tuple[str, ...] = ROLLOUT_STATES) -> list[dict]:
    marks = ", ".join("?" for _ in states)
    return [_rollout(r) for r in store.query(f"SELECT * FROM rollouts WHERE state IN ({marks})"
                                             " ORDER BY created_at DESC, id", states)]


def rollout(store: FleetStore, rollout_id: str) -> dict | None:
    r = store.query_one("SELECT * FROM rollouts WHERE id=?", (rollout_id,))
    return None if r is None else _rollout(r)


def targets(store: FleetStore, rollout_id: str) -> list[dict]:
    rows = store.query("SELECT * FROM rollout_devices WHERE rollout_id=? ORDER BY cohort_rank", (rollout_id,))
    out = []
    for r in rows:
        d = dict(r)
        d.pop("rowid", None)
        out.append(d)
    return out


def events(store: FleetStore, rollout_id: str) -> list[dict]:
    return [dict(r) for r in store.query("SELECT ts, kind, actor, detail FROM rollout_events WHERE rollout_id=?"
                                         " ORDER BY id", (rollout_id,))]


def pending_rollbacks(store: FleetStore) -> list[dict]:
    """Aborted rollouts with a device that was sent the release but not yet the rollback."""
    return [_rollout(r) for r in store.query(
        "SELECT * FROM rollouts WHERE state='aborted' AND id IN (SELECT rollout_id FROM rollout_devices"
        " WHERE sent_at IS NOT NULL AND rollback_sent_at IS NULL)")]


def baseline_version(store: FleetStore) -> int:
    """The model the fleet runs: that of the newest completed rollout, else the bundled model."""
    r = store.query_one("SELECT version FROM rollouts WHERE state='completed' ORDER BY ended_at DESC LIMIT 1")
    return r[0] if r else BUNDLED_VERSION


def set_state(store: FleetStore, rollout_id: str, allowed_from: tuple[str, ...], to: str, now: float,
              actor: str | None, reason: str | None) -> bool:
    """Move a rollout to `to` if it is in one of `allowed_from`; False (nothing changed) otherwise."""
    marks = ", ".join("?" for _ in allowed_from)
    sets = "state=?, reason=?, updated_at=?" + (", ended_at=?" if to in ("completed", "aborted") else "") + \
        (", phase_started_at=?" if to == "active" else "")  # a resumed phase dwells again
    values = [to, reason, now] + ([now] if to in ("completed", "aborted") else []) + ([now] if to == "active" else [])
    with store.tx() as c:
        n = c.execute(f"UPDATE rollouts SET {sets} WHERE id=? AND state IN ({marks})",
                      (*values, rollout_id, *allowed_from)).rowcount
        if n:
            _event(c, rollout_id, now, to, actor, reason or "")
    return bool(n)


# action: (the states it is allowed from, the state it leads to, what a refusal says)
ACTIONS = {"pause": (("active",), "paused", "only an active rollout can be paused"),
           "resume": (("paused",), "active", "only a paused rollout can be resumed"),
           "abort": (("active", "paused"), "aborted", "only an active or paused rollout can be aborted")}


class Unknown(BadInput):
    """No rollout, or no target device of it, by the name given (HTTP 404)."""


def act(store: FleetStore, rollout_id: str, action: str, now: float, actor: str | None,
        reason: str | None) -> dict | None:
    """An operator's pause, resume or abort; the rollout afterwards, None if there is none by that id, BadInput
    when its state does not allow the action (the controller acts on the change at its next turn)."""
    allowed, to, only = ACTIONS[action]
    r = rollout(store, rollout_id)
    if r is None:
        return None
    if not set_state(store, rollout_id, allowed, to, now, actor, reason):
        r = rollout(store, rollout_id) or r
        raise BadInput(f"rollout {rollout_id} is {r['state']}: {only}")
    return rollout(store, rollout_id)


def retry(store: FleetStore, rollout_id: str, devices: list[str] | None, now: float, actor: str | None) -> list[str]:
    """Send the release again (with the next attempt's rollout_id) to the targets whose download or staging
    `failed` (disk full, download failed, interrupted, withdrawn) or that `timed_out`, all or those in `devices`; the devices retried.
    Unknown when there is no such rollout or a named device is not one of its targets (nothing is retried then, as
    a retune to an unknown device sends nothing); BadInput unless the rollout is active or paused."""
    r = rollout(store, rollout_id)
    if r is None:
        raise Unknown(f"no rollout {rollout_id!r}; see `edgetune fleet rollout list`")
    known = {t["device_id"] for t in targets(store, rollout_id)}
    strangers = [d for d in devices or [] if d not in known]
    if strangers:
        raise Unknown(f"rollout {rollout_id} does not target {', '.join(map(repr, strangers))}; nothing was retried")
    if r["state"] not in OPEN_ROLLOUT_STATES:
        raise BadInput(f"rollout {rollout_id} is {r['state']}: only an active or paused rollout retries devices")
    marks = ", ".join("?" for _ in RETRYABLE)
    with store.tx() as c:
        rows = c.execute(f"SELECT device_id FROM rollout_devices WHERE rollout_id=? AND state IN ({marks})"
                         " ORDER BY cohort_rank", (rollout_id, *RETRYABLE)).fetchall()
        chosen = [x[0] for x in rows if devices is None or x[0] in devices]
        for d in chosen:
            c.execute("UPDATE rollout_devices SET attempt=attempt+1, sent_at=NULL, state=NULL, reason=NULL,"
                      " detail=NULL, ts=NULL WHERE rollout_id=? AND device_id=?", (rollout_id, d))
        if chosen:
            _event(c, rollout_id, now, "retried", actor, ", ".join(chosen))
    return chosen


def advance(store: FleetStore, rollout_id: str, from_phase: int, now: float, detail: str) -> bool:
    """Release the next phase, if the rollout is still active at `from_phase`."""
    with store.tx() as c:
        n = c.execute("UPDATE rollouts SET phase=?, phase_started_at=?, updated_at=? WHERE id=? AND phase=? AND"
                      " state='active'", (from_phase + 1, now, now, rollout_id, from_phase)).rowcount
        if n:
            _event(c, rollout_id, now, "advanced", None, detail)
    return bool(n)


def time_out(store: FleetStore, r: dict, now: float) -> list[str]:
    """Count the targets that were sent the release over `report_timeout_s` ago and reported nothing as timed out;
    the devices. Their ts stays empty, so a late report of theirs still replaces the verdict."""
    cutoff = now - r["report_timeout_s"]
    detail = f"no model/state within {r['report_timeout_s']:g} s of the release"
    with store.tx() as c:
        rows = c.execute("SELECT device_id FROM rollout_devices WHERE rollout_id=? AND sent_at < ? AND state IS NULL"
                         " ORDER BY cohort_rank", (r["id"], cutoff)).fetchall()
        devices = [x[0] for x in rows]
        for d in devices:
            c.execute("UPDATE rollout_devices SET state=?, reason=?, detail=? WHERE rollout_id=? AND device_id=? AND"
                      " state IS NULL", (TIMED_OUT, REPORT_TIMEOUT, detail, r["id"], d))
        if devices:
            _event(c, r["id"], now, TIMED_OUT, None, f"{', '.join(devices)}: {detail}")
    return devices


def mark_sent(store: FleetStore, rollout_id: str, device: str, now: float, rollback: bool = False) -> None:
    col = "rollback_sent_at" if rollback else "sent_at"
    with store.tx() as c:
        c.execute(f"UPDATE rollout_devices SET {col}=? WHERE rollout_id=? AND device_id=?", (now, rollout_id, device))


# ---- device reports ----------------------------------------------------------------------------------------------

def put_model_state(store: FleetStore, device: str, doc: dict, fields: dict, now: float,
                    seen: float | None = None) -> bool:
    """Keep a device's model/state report; returns whether it moved the device on in a rollout it targets.
    `fields` holds the validated state, rollout_id, phase, version, reason, detail and ts. A report older than
    the stored one (by the device's ts) changes nothing: the retained copy comes again on every reconnect."""
    f = fields
    with store.device_write(device, now, seen) as c:  # the listener's batch, if this runs inside one
        c.execute("INSERT INTO model_states (device_id, state, rollout_id, phase, version, reason, detail, ts,"
                  " doc_json, received_at) VALUES (?,?,?,?,?,?,?,?,?,?) ON CONFLICT(device_id) DO UPDATE SET"
                  " state=excluded.state, rollout_id=excluded.rollout_id, phase=excluded.phase,"
                  " version=excluded.version, reason=excluded.reason, detail=excluded.detail, ts=excluded.ts,"
                  " doc_json=excluded.doc_json, received_at=excluded.received_at"
                  " WHERE model_states.ts IS NULL OR excluded.ts IS NULL OR excluded.ts >= model_states.ts",
                  (device, f["state"], f["rollout_id"], f["phase"], f["version"], f["reason"], f["detail"], f["ts"],
                   json.dumps(doc, sort_keys=True), now))
        if not f["rollout_id"]:
            return False
        rollout_id, attempt = parse_rollout_id(f["rollout_id"])
        p = "rollback_" if f["phase"] == ROLLBACK_PHASE else ""
        which = "" if p else f" AND attempt={attempt:d}"  # a report on an attempt that was retried since is old
        newer = "" if f["ts"] is None else f" AND ({p}ts IS NULL OR {p}ts <= ?)"
        n = c.execute(f"UPDATE rollout_devices SET {p}state=?, {p}reason=?, {p}detail=?, {p}ts=? WHERE rollout_id=?"
                      f" AND device_id=?{which}{newer}", (f["state"], f["reason"], f["detail"], f["ts"], rollout_id,
                                                          device, *([] if f["ts"] is None else [f["ts"]]))).rowcount
    return bool(n)


def model_state(store: FleetStore, device: str) -> dict | None:
    r = store.query_one("SELECT doc_json, received_at FROM model_states WHERE device_id=?", (device,))
    return None if r is None else {**json.loads(r[0]), "received_at": r[1]}
