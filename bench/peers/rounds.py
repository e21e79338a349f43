"""Interleaved rounds and same-round ratios: the least noisy way to compare speeds on a shared, drifting host.

Every contender is measured once per round in a seeded shuffled order, and a ratio is the median over rounds of
the two contenders' times in the same round: drift within minutes hits both alike, order bias averages out and an
outlier round is voted down (bench/compare_tuners.py's `ratios_to_first` says what that buys).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Callable, Iterator, Sequence


def shuffled_rounds(n: int, rounds: int, seed: int = 0) -> Iterator[tuple[int, int]]:
    """(round, contender index) pairs: each round visits all n contenders once, in a fresh seeded order."""
    rng = random.Random(seed)
    for r in range(rounds):
        for j in rng.sample(range(n), n):
            yield r, j


def same_round_ratio(times: Sequence[float | None], ref: Sequence[float | None]) -> float | None:
    """Median over rounds of times[r] / ref[r], skipping rounds where either failed."""
    paired = [a / b for a, b in zip(times, ref) if a and b]
    return statistics.median(paired) if paired else None


def median_ms(times: Sequence[float | None]) -> float | None:
    ok = [t for t in times if t]
    return statistics.median(ok) if ok else None


def time_calls(fn: Callable[[], object], min_time_s: float, min_calls: int = 3) -> float:
    """Median ms of one call of `fn` over at least `min_calls` calls filling `min_time_s`: one round's sample of
    an in-process peer."""
    calls, t0 = [], time.perf_counter()
    while len(calls) < min_calls or time.perf_counter() - t0 < min_time_s:
        t = time.perf_counter()
        fn()
        calls.append((time.perf_counter() - t) * 1e3)
    return statistics.median(calls)
