"""Which workloads the daemon tunes, and which of them need tuning now (`tuner.active.stale` says when a
result is current)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgetune.errors import BadInput
from kernels.registry import get_spec
from kernels.spec import KernelSpec, Workload
from kernels.workload_files import load_workload_files
from kernels.workloads import resolve
from tuner.active import stale
from tuner.db import ResultsDB

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
                try:
                    spec = get_spec(kernel)
                    hits = [(spec, resolve(spec, name, None))]
                except BadInput as e:  # name the whole string the sender gave, then why
                    raise BadInput(f"unknown workload {w!r}: {e}") from None
                except (OverflowError, ValueError):  # a dimension too large for a float (its buffer size) or int()
                    raise BadInput(f"unknown workload {w!r}: a shape dimension is far too large; give dimensions "
                                   "of a real layer") from None
            if not hits:
                known = ", ".join(f"{s.name}/{x.name}" for s, x in chosen)
                raise BadInput(f"unknown workload {w!r}; configured: {known}")
            picked += hits
        chosen = list({(s.name, x.name): (s, x) for s, x in picked}.values())
    if not chosen:
        raise BadInput("that selects no workloads")
    return chosen


def plan(db: ResultsDB, hw: Any, model: dict | None, pairs: list[Pair]) -> list[tuple[Target, str]]:
    """The targets whose results are not current, with the reason."""
    out = []
    for spec, wl in pairs:
        why = stale(db, hw, (model or {}).get("version"), spec, wl)
        if why:
            out.append((Target(spec, wl, force=why[1]), why[0]))
    return out
