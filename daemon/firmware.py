"""The firmware-changed marker: how an update hook tells a daemon that is not running.

`<state_dir>/firmware-changed` holds {"source", "ts"}, written atomically (tmp + rename) so a daemon starting at
the same moment never reads half of it. The daemon consumes it once the retune it causes is journaled.
"""

from __future__ import annotations

import errno
import json
import time
from pathlib import Path

from edgetune import paths
from edgetune.atomic import write_atomic
from edgetune.errors import EdgetuneError

SOURCES = ("mender", "rauc", "swupdate")
# what to do when the marker cannot be written, by errno (else: make the state directory a writable directory)
FIXES = {errno.ENOSPC: "free space there", errno.EDQUOT: "free space there (its disk quota is full)",
         errno.EROFS: "its filesystem is read-only: set STATE_DIRECTORY to a writable directory",
         errno.EACCES: "give the update hook's user write access to it",
         errno.EPERM: "give the update hook's user write access to it"}


def marker_path() -> Path:
    return paths.state_dir() / "firmware-changed"


def write_marker(source: str) -> Path:
    """Leave the marker for the daemon's next start. A state dir that cannot take it (a full disk, a read-only
    filesystem) is an EdgetuneError naming the file and the fix for that cause: the update hook must hear that no
    retune was queued."""
    p = marker_path()
    try:
        write_atomic(p, json.dumps({"source": source, "ts": time.time()}).encode(), mode=0o644)
    except OSError as e:
        fix = FIXES.get(e.errno, f"make {p.parent} a writable directory")
        raise EdgetuneError(f"cannot leave the firmware-changed marker {p} for the daemon ({e.strerror}): {fix}, "
                            "or start the daemon, then run `edgetune notify firmware-changed` again") from e
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
