"""The firmware-changed marker: how an update hook tells a daemon that is not running.

`<state_dir>/firmware-changed` holds {"source", "ts"}, written atomically (tmp + rename) so a daemon starting at
the same moment never reads half of it. The daemon consumes it once the retune it causes is journaled.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from edgetune import paths

SOURCES = ("mender", "rauc", "swupdate")


def marker_path() -> Path:
    return paths.state_dir() / "firmware-changed"


def write_marker(source: str) -> Path:
    p = marker_path()
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump({"source": source, "ts": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
    return p


def read_marker() -> dict | None:
    """The marker's content, or None when there is none; an unreadable marker still means "changed"."""
    p = marker_path()
    if not p.exists():
        return None
    try:
        doc = json.loads(p.read_text())
        return doc if isinstance(doc, dict) else {"source": "unknown"}
    except (OSError, ValueError):
        return {"source": "unknown"}


def clear_marker() -> None:
    marker_path().unlink(missing_ok=True)
