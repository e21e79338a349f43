"""The active config of each kernel/workload slot: which result is in use, pins over it, and whether it is
current. The entry's fields are the config/active payload (DESIGN.md contract)."""

from __future__ import annotations

import time
from typing import Any

from kernels.measure import Measurement
from kernels.space import Config
from kernels.spec import KernelSpec, Workload
from tuner.db import ResultsDB
from tuner.resultkey import ResultKey


def _device(hw: Any) -> dict:
    return {"hw_fingerprint": hw.hw_fingerprint, "fw_fingerprint": hw.fw_fingerprint, "isa": hw.isa}


def activate(db: ResultsDB, kernel: str, workload: str, tuned: dict, hw: Any) -> None:
    """Make a tuned result (`TuneResult.active_entry()`) active; under a pin it is remembered instead, so unpin
    restores it."""
    entry = tuned | _device(hw)
    if not db.set_active(kernel, workload, entry):
        pinned = {k: v for k, v in db.active_entry(kernel, workload).items() if k != "pinned"}
        pinned["tuned_entry"] = entry
        db.set_active(kernel, workload, pinned, pinned=True)


def pin(db: ResultsDB, spec: KernelSpec, wl: Workload, cfg: Config, m: Measurement, hw: Any) -> dict:
    """Pin `cfg` (measured as `m` on this device) for the slot; a pin wins over tuning. Returns the entry."""
    old = db.active_entry(spec.name, wl.name)
    tuned = tuned_entry(old)
    entry = {"config": cfg, "ms": m.ms, "default_ms": old.get("default_ms") if old else None,
             "speedup": (old["default_ms"] / m.ms) if old and old.get("default_ms") else None,
             "evals": 0, "tuning_s": 0.0, "strategy": "pinned", "shape": wl.shape, "ort_ms": old and old.get("ort_ms"),
             "tuned_at": time.time(), **_device(hw), "tuned_entry": tuned}
    db.set_active(spec.name, wl.name, entry, pinned=True)
    return entry


def unpin(db: ResultsDB, kernel: str | None = None, workload: str | None = None) -> int:
    """Drop pins (all, a kernel's, or one); the tuned result under each becomes active again."""
    n = 0
    for slot, entry in db.active().items():
        k, w = slot.split("/", 1)
        if not entry["pinned"] or (kernel and k != kernel) or (workload and w != workload):
            continue
        n += 1
        if entry.get("tuned_entry"):
            db.set_active(k, w, entry["tuned_entry"], force=True)
        else:
            db.remove_active(k, w)
    return n


def forget(db: ResultsDB, kernel: str, workload: str) -> dict | None:
    """Drop a slot from the active configs, its pin and the tuned result under it (returned; None when there was
    none). Sessions and measurements stay: a later tune of the slot is served from them unless forced."""
    entry = db.active_entry(kernel, workload)
    if entry is not None:
        db.remove_active(kernel, workload)
    return entry


def tuned_entry(entry: dict | None) -> dict | None:
    """The tuned result of a slot's entry: the entry itself, or the one a pin holds under it."""
    if not entry:
        return None
    if entry.get("pinned"):
        return entry.get("tuned_entry")
    return {k: v for k, v in entry.items() if k != "pinned"}


def stale(db: ResultsDB, hw: Any, model_version: str | None, spec: KernelSpec,
          wl: Workload) -> tuple[str, bool] | None:
    """(why the slot needs tuning, whether the tune must be forced), or None when its tuned result is current:
    measured on this hw_fingerprint and fw_fingerprint, with the current model version, under the current result
    key. A firmware or model change needs `force`: neither is in the key's digest, so an unforced tune would just
    re-activate the old cached result."""
    entry = tuned_entry(db.active_entry(spec.name, wl.name))
    if not entry:
        return "no result", False
    if entry.get("hw_fingerprint") != hw.hw_fingerprint:
        return "hardware changed", False  # hw_fingerprint is in the result key
    if entry.get("fw_fingerprint") != hw.fw_fingerprint:
        return "firmware changed", True
    # only entries that record a model version can be out of date with the model
    if "model_version" in entry and entry["model_version"] != model_version:
        return "model changed", True
    now = ResultKey.of(spec, wl, hw, entry.get("strategy", ""), entry.get("strategy_version", ""),
                       entry.get("objective", "latency"))
    if entry.get("key") != now.digest():
        return "kernel source, shape or strategy changed", False
    return None
