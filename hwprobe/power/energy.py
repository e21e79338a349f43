"""Energy of a benchmark window from a meter's samples, net of the idle baseline.

Joules come from trapezoid integration of the samples, interpolated exactly at the window's edges. A window is
only trusted when samples bracket both edges and no hole between samples exceeds the meter's `max_gap_s`;
otherwise `EnergyUnavailable` says why (unplug, no data, window too short) so the caller can fall back to
latency and log the reason, instead of ranking configs on a wrong number.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from itertools import pairwise

from hwprobe.power.base import PowerMeter, Sample


class EnergyUnavailable(Exception):
    """This window has no trustworthy energy figure; str(e) is the reason to log."""


@dataclass(frozen=True)
class Window:
    t0: float
    t1: float
    joules: float  # gross energy in [t0, t1]
    mean_watts: float
    samples: int  # samples strictly inside the window
    max_gap_s: float  # largest hole between the samples used


def _value_at(samples: list[Sample], t: float) -> float:
    i = bisect.bisect_left([s.t for s in samples], t)
    if i < len(samples) and samples[i].t == t or i == 0:
        return samples[i].watts
    a, b = samples[i - 1], samples[min(i, len(samples) - 1)]
    return a.watts if b.t == a.t else a.watts + (b.watts - a.watts) * (t - a.t) / (b.t - a.t)


def integrate(samples: list[Sample], t0: float, t1: float) -> float:
    """Joules over [t0, t1] by the trapezoid rule; `samples` are sorted and bracket both edges."""
    pts = [(t0, _value_at(samples, t0)), *((s.t, s.watts) for s in samples if t0 < s.t < t1),
           (t1, _value_at(samples, t1))]
    return sum((tb - ta) * (wa + wb) / 2 for (ta, wa), (tb, wb) in pairwise(pts))


def measure_window(meter: PowerMeter, t0: float, t1: float, *, min_samples: int = 2) -> Window:
    """Energy over [t0, t1] (monotonic seconds). Waits up to `max_gap_s` past t1 for the sample that closes
    the window. Raises EnergyUnavailable when the meter cannot vouch for the whole window."""
    if t1 <= t0:
        raise EnergyUnavailable(f"empty window ({t1 - t0:.3f} s)")
    gap = meter.max_gap_s
    meter.wait_until(t1, timeout=t1 + gap - time.monotonic())
    samples = meter.samples_between(t0 - gap, t1 + gap)
    status = meter.status
    if not samples:
        raise EnergyUnavailable(f"no meter samples in the window; meter {status.state}: {status.detail}")
    before = [s for s in samples if s.t <= t0]
    after = [s for s in samples if s.t >= t1]
    if not before or not after:
        edge = "start" if not before else "end"
        raise EnergyUnavailable(f"no meter sample within {gap} s of the window's {edge}; "
                                f"meter {status.state}: {status.detail}")
    used = samples[len(before) - 1: len(samples) - len(after) + 1]
    holes = [b.t - a.t for a, b in pairwise(used)]
    worst = max(holes, default=0.0)
    if worst > gap:
        raise EnergyUnavailable(f"{worst:.2f} s hole in meter samples during the window (unplugged?); "
                                f"meter {status.state}: {status.detail}")
    inside = len(used) - 2
    if inside < min_samples:
        raise EnergyUnavailable(f"window of {t1 - t0:.3f} s holds {inside} meter samples, need {min_samples}: "
                                f"run the benchmark longer than the meter's sample period")
    joules = integrate(used, t0, t1)
    return Window(t0, t1, joules, joules / (t1 - t0), inside, worst)


def measure_idle(meter: PowerMeter, seconds: float | None = None) -> float:
    """Mean watts over the next `seconds` (default: the meter's configured idle_s); blocks that long.
    Call it while nothing is being benchmarked: everything above this baseline is charged to the kernel."""
    meter.wait_until(time.monotonic(), timeout=meter.max_gap_s)  # a fresh sample to open the window with
    t0 = time.monotonic()
    return measure_window(meter, t0, t0 + (meter.idle_s if seconds is None else seconds)).mean_watts


def energy_per_call(meter: PowerMeter, t0: float, t1: float, calls: int, idle_watts: float) -> float:
    """Joules per kernel call above idle, for a window in which `calls` calls ran back to back.

    Raises EnergyUnavailable when the window is not trustworthy, or when its draw is not above the idle
    baseline (the kernel's power is lost in the meter's noise, so the figure would rank configs at random).
    """
    if calls <= 0:
        raise EnergyUnavailable(f"no calls in the window ({calls})")
    w = measure_window(meter, t0, t1)
    net = w.joules - idle_watts * (t1 - t0)
    if net <= 0:
        raise EnergyUnavailable(f"window mean {w.mean_watts:.3f} W is not above idle {idle_watts:.3f} W")
    return net / calls
