"""One round's sample of an in-process peer. The rounds themselves (seeded shuffled order, same-round ratios) are
tuner.evaluate's, the one interleave protocol."""

from __future__ import annotations

import statistics
import time
from typing import Callable

from kernels.worker import WARMUP_MS


def warm_up(fn: Callable[[], object]) -> int:
    """Call `fn` for `WARMUP_MS` (at least once), the warm-up edgetune's own variants get before their timed reps (a
    threaded call's first ones wait on its pool's other cores); returns the number of calls."""
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        if time.perf_counter() - t0 >= WARMUP_MS / 1e3:
            return n


def time_calls(fn: Callable[[], object], min_time_s: float, min_calls: int = 3) -> float:
    """Median ms of one call of `fn` over at least `min_calls` calls filling `min_time_s`: one round's sample of
    an in-process peer, after `warm_up`."""
    warm_up(fn)
    calls, t0 = [], time.perf_counter()
    while len(calls) < min_calls or time.perf_counter() - t0 < min_time_s:
        t = time.perf_counter()
        fn()
        calls.append((time.perf_counter() - t) * 1e3)
    return statistics.median(calls)
