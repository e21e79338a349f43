"""Tolerant readers for procfs/sysfs under a sysroot, so probing never needs root and never crashes."""

from __future__ import annotations

from pathlib import Path


def read(root: Path, rel: str) -> str | None:
    """Stripped text of `<root>/<rel>`, or None when it is missing or unreadable."""
    try:
        return (root / rel).read_text(errors="replace").strip("\x00 \n\t")
    except OSError:
        return None


def cpu_list(text: str | None) -> list[int]:
    """Parse a kernel cpu list such as "0-3,8" into [0, 1, 2, 3, 8]; [] when absent or malformed."""
    cpus: list[int] = []
    try:
        for part in (text or "").split(","):
            if part.strip():
                lo, _, hi = part.partition("-")
                cpus.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        return []
    return cpus
