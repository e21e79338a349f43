"""The strategy interface every search strategy implements (after Optuna's samplers/_base.py).

A strategy proposes configs with `ask(n)` and learns from `tell(config, measurement)`; the session owns the
measurements, the journal and the budget. All strategies are seeded, so a replay of the same tells reproduces
the same asks: that is what makes a killed session resumable. A strategy keeps only the state its next `ask`
needs (what it has seen, its best), never a history of its own.
"""

from __future__ import annotations

import abc
import random
from typing import TYPE_CHECKING, ClassVar

from kernels.measure import Measurement
from kernels.space import Config, SearchSpace, config_key

if TYPE_CHECKING:
    from kernels.spec import KernelSpec


class Strategy(abc.ABC):
    """One search strategy over one kernel's space for one workload.

    `kernel` is the spec the space belongs to, for strategies that know kernels (the tuner model); the classical
    ones ignore it. `version` is part of every result key: a change in what a strategy proposes bumps it.
    """

    name: ClassVar[str]
    version: str = "1"

    def __init__(self, space: SearchSpace, seed: int = 0, *, kernel: KernelSpec | None = None):
        self.space = space
        self.kernel = kernel
        self.rng = random.Random(seed)
        self.seen: set[str] = set()
        self.best: tuple[float, Config] | None = None

    @abc.abstractmethod
    def ask(self, n: int) -> list[Config]:
        """Up to n new configs; fewer (or none) when the strategy has nothing left to try."""

    def warm_start(self, known: list[tuple[dict, Config]]) -> None:
        """This device's tuned winners of the same kernel, (shape, config), newest first (the results DB's, before
        the session began; the session passes them once, before the first `ask`). A strategy that can use what the
        device already learned on other shapes does; the classical ones start from their own state."""

    def converged(self) -> bool:
        """Whether the search has found what it can expect to: a session without an explicit budget stops here.
        Classical strategies cannot tell, and run to the budget or the session's patience."""
        return False

    def tell(self, cfg: Config, m: Measurement) -> None:
        self.seen.add(config_key(cfg))
        if m.ok and (self.best is None or m.value < self.best[0]):
            self.best = (m.value, cfg)

    def _fresh(self, cfgs: list[Config], n: int) -> list[Config]:
        """The first n of `cfgs` not seen yet, without duplicates."""
        out, keys = [], set()
        for c in cfgs:
            k = config_key(c)
            if k not in self.seen and k not in keys:
                keys.add(k)
                out.append(c)
            if len(out) == n:
                break
        return out
