"""Which workloads the daemon tunes, and which of them need tuning now.

A result is current when its active entry was measured on this hw_fingerprint and fw_fingerprint, with the
current model version, under the current result key (kernel source, shape, isa, compiler, strategy version).
A firmware or model change needs `force`: neither is part of the tuner's result key, so an unforced tune would
just re-activate the old cached result.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from edgetune.errors import BadInput
from kernels.registry import get_spec
from kernels.spec import KernelSpec, Workload
from kernels.workload_files import load_workload_files
from kernels.workloads import resolve
from tuner.db import ResultsDB
from tuner.session import result_key

Pair = tuple[KernelSpec, Workload]


@dataclass(frozen=True)
class Target:
    spec: KernelSpec
    workload: Workload
    force: bool = False

    @property
    def name(self) -> str:
        return f"{self.spec.name}/{self.workload.name}"


def configured(patterns: list[str]) -> list[Pair]:
    return load_workload_files(patterns)


def select(pairs: list[Pair], kernels: list[str] | None, workloads: list[str] | None) -> list[Pair]:
    """A command's targets: the configured workloads filtered by kernel and workload names. A kernel with none
    configured means its bundled workloads; `kernel/workload` may name one outside the config."""
    chosen = pairs
    if kernels:
        specs = [get_spec(k) for k in kernels]  # BadInput names the known kernels
        chosen = [p for p in pairs if p[0].name in kernels]
        chosen += [(s, w) for s in specs if not any(p[0].name == s.name for p in chosen) for w in s.workloads]
    if workloads:
        picked: list[Pair] = []
        for w in workloads:
            hits = [p for p in chosen if w in (p[1].name, f"{p[0].name}/{p[1].name}")]
            if not hits and "/" in w:
                kernel, _, name = w.partition("/")
                spec = get_spec(kernel)
                hits = [(spec, resolve(spec, name, None))]
            if not hits:
                known = ", ".join(f"{s.name}/{x.name}" for s, x in chosen)
                raise BadInput(f"unknown workload {w!r}; configured: {known}")
            picked += hits
        chosen = list({(s.name, x.name): (s, x) for s, x in picked}.values())
    if not chosen:
        raise BadInput("that selects no workloads")
    return chosen


def stale(db: ResultsDB, hw: Any, model: dict | None, spec: KernelSpec, wl: Workload) -> tuple[str, bool] | None:
    """(why it needs tuning, whether the tune must be forced), or None when its active result is current."""
    entry = db.active_entry(spec.name, wl.name)
    if entry and entry.get("pinned"):
        entry = entry.get("tuned_entry")  # a pin holds the slot; what matters is the tuned result under it
    if not entry:
        return "no result", False
    if entry.get("hw_fingerprint") != hw.hw_fingerprint:
        return "hardware changed", False  # hw_fingerprint is in the result key
    if entry.get("fw_fingerprint") != hw.fw_fingerprint:
        return "firmware changed", True
    # only entries that record a model version can be out of date with the model
    if "model_version" in entry and entry["model_version"] != (model or {}).get("version"):
        return "model changed", True
    # the key covers kernel source, shape, hw, isa, compiler, strategy and objective: recompute it as it was made
    made_by = SimpleNamespace(name=entry.get("strategy", ""), version=entry.get("strategy_version", ""))
    if entry.get("key") != result_key(spec, wl, hw, made_by, entry.get("objective", "latency")):
        return "kernel source, shape or strategy changed", False
    return None


def plan(db: ResultsDB, hw: Any, model: dict | None, pairs: list[Pair]) -> list[tuple[Target, str]]:
    """The targets whose results are not current, with the reason."""
    out = []
    for spec, wl in pairs:
        why = stale(db, hw, model, spec, wl)
        if why:
            out.append((Target(spec, wl, force=why[1]), why[0]))
    return out
