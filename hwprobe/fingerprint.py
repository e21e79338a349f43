"""Short stable hashes that key results: hw_fingerprint for hardware+compiler, fw_fingerprint for the image."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from typing import Any

from hwprobe.descriptor import CacheLevel


def _digest(data: Any) -> str:
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def hw_fingerprint(
    arch: str, cpu_model: str, isa: str, features: tuple[str, ...], caches: tuple[CacheLevel, ...], cores: int,
    compiler_id: str,
) -> str:
    """Only what decides kernel speed; measured bandwidth is left out because it is noisy."""
    return _digest({
        "arch": arch, "cpu_model": cpu_model, "isa": isa, "features": list(features),
        "caches": [asdict(c) for c in caches], "cores": cores, "compiler": compiler_id,
    })


def fw_fingerprint(firmware: dict[str, str]) -> str:
    return _digest(firmware)
