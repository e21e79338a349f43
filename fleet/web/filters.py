"""Jinja2 filters of the dashboard: numbers, times and sizes as an operator reads them ("-" for unknown)."""

from __future__ import annotations

import json
import math
import time
import urllib.parse
from typing import Any, Callable


def _known(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def num(x: Any, digits: int = 3) -> str:
    return f"{x:.{digits}g}" if _known(x) else "-"


def times(x: Any) -> str:
    """A speedup or ratio: 2.31x."""
    return f"{x:.2f}x" if _known(x) else "-"


def ago(ts: Any) -> str:
    if not _known(ts):
        return "never"
    s = max(0.0, time.time() - ts)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.0f}{unit} ago"
    return f"{s:.0f}s ago"


def when(ts: Any) -> str:
    """A unix time in UTC, saying so: the page's script renders the times it polls the same way (app.js `when`),
    so one page never shows one event in two zones. "-" for what is unknown or out of the platform's range (a
    device's clock can send anything)."""
    if not _known(ts):
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))
    except (OverflowError, OSError, ValueError):
        return "-"


def mib(x: Any) -> str:
    return f"{x / (1 << 20):.1f} MiB" if _known(x) else "-"


def compact(x: Any) -> str:
    """A config or a descriptor value, as short JSON (the template escapes it)."""
    return x if isinstance(x, str) else json.dumps(x, sort_keys=True, default=str)


def qs(query: dict, **changes: Any) -> str:
    """The device list's query string with some parameters changed (None: removed)."""
    merged = {k: v for k, v in {**query, **changes}.items() if v is not None}
    return urllib.parse.urlencode(merged)


def log2pos(x: float, lo: int, hi: int, width: float = 300.0, margin: float = 16.0) -> float:
    """Where a speedup sits on a log2 axis from 2**lo to 2**hi drawn `width` wide (the speedup strip plots)."""
    return round(margin + (width - 2 * margin) * (math.log2(x) - lo) / (hi - lo), 2)


FILTERS: dict[str, Callable[..., Any]] = {"num": num, "times": times, "ago": ago, "when": when, "mib": mib,
                                          "compact": compact, "log2pos": log2pos, "qs": qs}
