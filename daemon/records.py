"""tuning/record: one message per tuning session, with every measurement, for the fleet's training data.

Records are swept from the results DB rather than sent from the tune call, so a session finished by anyone
(the daemon, `edgetune tune` on the device, a run resumed after a crash, a failed run) goes out exactly once
per record id, and a crash between finishing and queueing only delays it to the next sweep.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from daemon.publisher import Publisher
from daemon.store import DaemonStore
from tuner.db import ResultsDB

log = logging.getLogger(__name__)


def record_id(device_id: str, session_id: int, key: str, started_at: float) -> str:
    """Stable across resends, and distinct after a results-DB reset restarts session ids."""
    return hashlib.sha256(f"{device_id}\0{session_id}\0{key}\0{started_at!r}".encode()).hexdigest()[:20]


def build(db: ResultsDB, session_id: int, rid: str, device_id: str, hw: Any, model: dict | None) -> dict:
    return {"record_id": rid, "device_id": device_id, **db.record(session_id, hw), "model": model}


def sweep(db: ResultsDB, store: DaemonStore, publisher: Publisher, device_id: str, hw: Any,
          model: dict | None) -> int:
    """Queue a record for every finished session not yet published; returns how many."""
    ids = {record_id(device_id, s.id, s.key, s.started_at): s.id for s in db.ended_sessions()}
    todo = store.unpublished(ids)
    for rid, sid in ids.items():
        if rid in todo:
            publisher.record(build(db, sid, rid, device_id, hw, model))
            store.mark_published(rid, sid)
    if todo:
        log.info("queued %d tuning record(s)", len(todo))
    return len(todo)
