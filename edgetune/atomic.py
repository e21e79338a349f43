"""Replace a file whole: a reader sees the old bytes or the new ones, also after a crash or power cut.

Temp file in the same directory, fsync, rename over the target, fsync of the directory (so the rename itself
survives a power cut). One implementation for every file another process reads while it may be rewritten.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from edgetune.errors import EdgetuneError


def write_atomic(path: Path, data: bytes, *, mode: int | None = None) -> None:
    """Write `data` to `path` (whose directory exists) atomically; `mode` sets the permissions (mkstemp's
    default is 0600)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_output(path: Path, data: bytes, mode: int = 0o644) -> None:
    """write_atomic for a file the user named (`-o FILE`): a path that cannot be written is a clear error naming
    it, not a traceback. 0644: what reads it (a daemon, a firmware build) may run as another user."""
    try:
        write_atomic(path, data, mode=mode)
    except OSError as e:
        raise EdgetuneError(f"cannot write {path}: {e.strerror}") from e


def fsync_dir(d: Path) -> None:
    """Make a rename into `d` durable."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
