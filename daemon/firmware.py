"""The firmware-changed marker: how an update hook tells the daemon's next start that the firmware changed.

`<state_dir>/firmware-changed` holds {"source", "ts"}, written atomically (tmp + rename) so a daemon starting at
the same moment never reads half of it. Update hooks that run on the old system before the reboot (RAUC,
SWUpdate) always leave it, since a running daemon would retune the old image. The daemon rewrites it with the
`command` of the firmware retune it queued, and removes it only once that retune finished (not interrupted): a
stop before that retunes again at the next start.
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


def write_marker(source: str, command: str | None = None) -> Path:
    """Leave the marker for the daemon's next start (`command`: the firmware retune the daemon queued for it). A
    state dir that cannot take it (a full disk, a read-only filesystem) is an EdgetuneError naming the file and
    the fix for that cause: the update hook must hear that no retune was queued."""
    p = marker_path()
    doc = {"source": source, "ts": time.time()} | ({"command": command} if command else {})
    try:
        write_atomic(p, json.dumps(doc).encode(), mode=0o644)
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
