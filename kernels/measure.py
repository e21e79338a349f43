"""The estimator: one robust number per variant from noisy per-rep timings on a shared CPU."""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass, field

TIE_THRESHOLD = 0.03  # differences under ~3% are noise on these machines (DESIGN.md)


@dataclass
class Measurement:
    ok: bool
    reason: str = ""  # why it failed: compile error, crash, hang, wrong values
    ms: float | None = None  # the estimate
    cv: float | None = None  # coefficient of variation of the reps used
    reps: int = 0
    reps_used: int = 0  # reps with no involuntary context switch (or all, on fallback)
    estimator: str = ""  # "median-undisturbed" | "min-fallback"
    cpu_ms: float | None = None  # median thread-CPU ms
    nivcsw: int = 0  # involuntary context switches over all reps
    max_abs_err: float | None = None
    load1: float = field(default_factory=lambda: os.getloadavg()[0])
    wall_ms: list[float] = field(default_factory=list)
    # the timed window (CLOCK_MONOTONIC, comparable across processes) and the calls in it, for energy meters
    t0: float | None = None
    t1: float | None = None
    calls: int = 0
    energy_j: float | None = None  # joules per call above idle, when a power meter measured the window
    score: float | None = None  # what strategies minimise: ms, energy_j or their product (see tuner.objective)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def value(self) -> float:
        """The objective value strategies rank by: the score when one is set, else latency."""
        return self.score if self.score is not None else self.ms

    @classmethod
    def failed(cls, reason: str) -> "Measurement":
        return cls(ok=False, reason=reason)


def estimate(wall_ms: list[float], nivcsw: list[int]) -> tuple[float, float, int, str]:
    """Median of the reps that saw no involuntary context switch; the minimum when too few did.

    Returns (ms, cv, reps_used, estimator name).
    """
    clean = [w for w, n in zip(wall_ms, nivcsw) if n == 0]
    if len(clean) >= max(3, len(wall_ms) // 4):
        used, ms, name = clean, statistics.median(clean), "median-undisturbed"
    else:
        used, ms, name = wall_ms, min(wall_ms), "min-fallback"
    mean = statistics.fmean(used)
    cv = statistics.pstdev(used) / mean if len(used) > 1 and mean > 0 else 0.0
    return ms, cv, len(used), name


def is_tie(a_ms: float, b_ms: float, threshold: float = TIE_THRESHOLD) -> bool:
    return abs(a_ms - b_ms) <= threshold * min(a_ms, b_ms)
