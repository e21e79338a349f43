"""The active-configs file: what applications and firmware builds read, written by the tuner on every change.

A plain JSON file (the config/active payload of DESIGN.md) keeps `kernels.load_tuned` free of the results DB,
and lets an application read it without SQLite or locks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from edgetune import paths


def active_path() -> Path:
    return paths.state_dir() / "active.json"


def read_active() -> dict:
    p = active_path()
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        return {"kernels": {}}
    except (json.JSONDecodeError, OSError):
        return {"kernels": {}, "error": f"{p} is unreadable"}


def write_active(doc: dict) -> None:
    p = active_path()
    tmp = p.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True))
    os.replace(tmp, p)
