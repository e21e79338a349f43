"""Where the device's current tuner model lives: A/B slots in the state dir and one `current` pointer.

<state_dir>/models/ holds slots `a` and `b` (each `model.gguf` plus the `release.json` it came with) and the
pointer `current.json`: {"current": entry or null, "previous": entry or null}, an entry being {slot, name,
version (the release's), model_version (the GGUF's), sha256, rollout_id}. A null current is the model bundled in
quantized_models/. The daemon's updater (daemon.model_update) is the only writer: it stages a release into the
slot the pointer does not name, and only a model that passed its health check is ever named, by rewriting the
pointer atomically (temp file, fsync, rename, fsync of the directory). So a crash or power cut at any point leaves
the pointer naming a complete, checked model, and nothing half-written is ever loaded. The tuner reads the
pointer here, below the daemon, so a tune child and a CLI run load the same model the daemon committed.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from edgetune import paths
from edgetune.atomic import write_atomic

log = logging.getLogger(__name__)

SLOTS = ("a", "b")
MODEL_FILE = "model.gguf"
RELEASE_FILE = "release.json"
POINTER = "current.json"


def models_dir() -> Path:
    return paths.state_dir() / "models"


def slot_dir(slot: str) -> Path:
    if slot not in SLOTS:
        raise ValueError(f"model slot {slot!r}: must be one of {SLOTS}")
    return models_dir() / slot


def slot_model(slot: str) -> Path:
    return slot_dir(slot) / MODEL_FILE


def read_pointer() -> dict[str, Any]:
    """{"current": entry | None, "previous": entry | None}; a missing or unreadable pointer means the bundled
    model (logged: a pointer is only ever replaced whole, so an unreadable one was damaged outside edgetune)."""
    p = models_dir() / POINTER
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        return {"current": None, "previous": None}
    except (OSError, ValueError) as e:
        log.error("model pointer %s is unreadable (%s): using the bundled tuner model", p, e)
        return {"current": None, "previous": None}
    ok = isinstance(doc, dict) and all(_entry_ok(doc.get(k)) for k in ("current", "previous"))
    if not ok:
        log.error("model pointer %s is not a pointer document: using the bundled tuner model", p)
        return {"current": None, "previous": None}
    return {"current": doc.get("current"), "previous": doc.get("previous")}


def _entry_ok(e: Any) -> bool:
    return e is None or isinstance(e, dict) and (e.get("slot") is None or e.get("slot") in SLOTS)


def committed_model() -> Path | None:
    """The committed slot's model file, or None for the bundled model."""
    cur = read_pointer()["current"]
    if not cur or not cur.get("slot"):
        return None
    path = slot_model(cur["slot"])
    if not path.is_file():
        log.error("model pointer names slot %s but %s is missing: using the bundled tuner model", cur["slot"], path)
        return None
    return path


def write_pointer(current: dict | None, previous: dict | None) -> None:
    models_dir().mkdir(parents=True, exist_ok=True)
    write_atomic(models_dir() / POINTER, json.dumps({"current": current, "previous": previous}, indent=1).encode())


def repair() -> str | None:
    """At start: if the committed slot's file no longer matches the pointer (damaged on disk, or removed), point
    back at the previous model when that one still matches, else the bundled one. Returns what was done, or None
    when the pointer is sound. A rewrite of the pointer, so a model is never half-switched."""
    ptr = read_pointer()
    cur, prev = ptr["current"], ptr["previous"]
    if not cur or not cur.get("slot") or _matches(cur):
        return None
    fallback = prev if prev and prev.get("slot") and _matches(prev) else None
    where = f"slot {fallback['slot']} (v{fallback.get('version')})" if fallback else "the bundled model"
    what = f"the committed model in slot {cur['slot']} (v{cur.get('version')}) is missing or damaged"
    try:
        write_pointer(fallback, None)
    except OSError as e:  # a full or read-only disk: the tuner's own model check still refuses the damaged file
        return f"{what}, and the pointer cannot be rewritten to {where}: {e}"
    return f"{what}: back to {where}"


def _matches(e: dict) -> bool:
    try:
        return hashlib.sha256(slot_model(e["slot"]).read_bytes()).hexdigest() == e.get("sha256")
    except OSError:
        return False
