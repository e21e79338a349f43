"""The tuner's config section, [tuning]: what the daemon tunes, how, and what it minimises (see edgetune.config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgetune import paths
from edgetune.config import Problem, Section, Source
from edgetune.errors import BadInput
from kernels.workload_files import load_workload_files
from tuner.objective import OBJECTIVES
from tuner.strategies import DEFAULT_STRATEGY, unknown_strategy


@dataclass
class TuningConfig:
    strategy: str = DEFAULT_STRATEGY
    budget: int = 40  # evals per workload
    workloads: list[str] = field(default_factory=lambda: ["bundled", str(paths.config_dir() / "workloads.d/*.toml")])
    objective: str = "latency"


def _problems(cfg: Any, src: Source) -> list[Problem]:
    out = []
    try:
        if not load_workload_files(cfg.tuning.workloads):
            out.append(Problem(src("tuning.workloads"), "tuning.workloads", "selects no workloads"))
    except BadInput as e:
        out.append(Problem(src("tuning.workloads"), "tuning.workloads", str(e)))
    # a [power] table with a problem is reported by its own section, not as a missing meter here
    if cfg.tuning.objective != "latency" and cfg.power.meter == "none" and cfg.power.problem() is None:
        out.append(Problem(src("tuning.objective"), "tuning.objective",
                           f"{cfg.tuning.objective!r} needs a power meter: set [power] meter (text, um or rapl)"))
    return out


SECTIONS = [Section("tuning", TuningConfig, {
    "strategy": unknown_strategy,
    "budget": lambda v: None if 1 <= v <= 100_000 else "must be 1-100000 evals",
    "objective": lambda v: None if v in OBJECTIVES else f"must be one of: {', '.join(OBJECTIVES)}",
}, _problems)]
