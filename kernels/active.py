"""The active-configs file: what applications and firmware builds read, written by the tuner on every change.

A plain JSON file (the config/active payload of DESIGN.md) keeps `kernels.load_tuned` free of the results DB,
and lets an application read it without SQLite or locks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from edgetune import paths

# every activation (a tune, cached or not, a pin, an unpin) rewrites the whole file from the results DB
REWRITE_HINT = ("the tuned configs are still in the results DB: rerun any `edgetune tune` you ran before, with "
                "the same --kernel/--workload (its cached result takes about a second), and it rewrites the whole "
                "file from the DB")


def active_path() -> Path:
    return paths.state_dir() / "active.json"


def read_active() -> dict:
    """The document, or an empty one whose `error` says why the file could not be used: a caller that falls
    back to defaults must be able to tell "nothing tuned" from "the file is damaged"."""
    p = active_path()
    try:
        doc = json.loads(p.read_bytes())
    except FileNotFoundError:
        return {"kernels": {}}
    except OSError as e:
        return {"kernels": {}, "error": f"{p} is unreadable ({e.strerror}); {REWRITE_HINT}"}
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError both are
        return {"kernels": {}, "error": f"{p} is unreadable (not JSON: {e}); {REWRITE_HINT}"}
    if not isinstance(doc, dict) or not isinstance(doc.get("kernels"), dict):
        return {"kernels": {}, "error": f"{p} is unreadable (no \"kernels\" object); {REWRITE_HINT}"}
    return doc


def find_by_name(doc: dict, kernel: str, workload: str) -> dict | None:
    """The active entry of the slot `<kernel>/<workload>`: bundled, custom.* or imported from a model alike."""
    entry = doc["kernels"].get(f"{kernel}/{workload}")
    return entry if isinstance(entry, dict) else None


def find_by_shape(doc: dict, kernel: str, shape: dict, preferred: str) -> tuple[str, dict] | None:
    """(workload name, entry) of the active slot of `kernel` tuned for `shape`, whatever it is named.

    A shape can be active under several names (a bundled layer, a model's imported one, its custom.* name):
    `preferred` (the shape's generated name) wins when active, else the most recently tuned, as the newest
    measurement is the one to trust."""
    prefix = kernel + "/"
    same = {slot.removeprefix(prefix): e for slot, e in doc["kernels"].items()
            if slot.startswith(prefix) and isinstance(e, dict) and e.get("shape") == shape}
    if not same:
        return None
    name = preferred if preferred in same else max(same, key=lambda w: same[w].get("tuned_at") or 0)
    return name, same[name]


def write_active(doc: dict) -> None:
    p = active_path()
    tmp = p.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True))
    os.replace(tmp, p)
