"""Strategy `anneal`: simulated annealing over one-knob neighbours."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kernels.measure import Measurement
from kernels.space import Config, SearchSpace
from tuner.strategies.base import Strategy

if TYPE_CHECKING:
    from kernels.spec import KernelSpec


class Anneal(Strategy):
    """Restarts from a random config when the neighbourhood is exhausted.

    Temperature is relative (a fraction of the current time), so it works for microsecond and millisecond
    kernels alike.
    """

    name = "anneal"

    def __init__(self, space: SearchSpace, seed: int = 0, *, kernel: KernelSpec | None = None, t0: float = 0.10,
                 cooling: float = 0.85):
        super().__init__(space, seed, kernel=kernel)
        self.current: tuple[float, Config] | None = None
        self.temp = t0
        self.cooling = cooling

    def ask(self, n: int) -> list[Config]:
        if self.current is None:
            start = self.space.valid_default()
            first = self._fresh([start], 1)
            return first + self._fresh(self.space.sample(n * 4, self.rng, exclude=self.seen), n - len(first))
        nbrs = self.space.neighbours(self.current[1])
        self.rng.shuffle(nbrs)
        out = self._fresh(nbrs, n)
        if len(out) < n:  # neighbourhood exhausted: restart around a random point
            out += self._fresh(self.space.sample(n * 4, self.rng, exclude=self.seen), n - len(out))
        return out

    def tell(self, cfg: Config, m: Measurement) -> None:
        super().tell(cfg, m)
        if not m.ok:
            return
        if self.current is None or m.value < self.current[0]:
            self.current = (m.value, cfg)
        else:
            worse = (m.value - self.current[0]) / self.current[0]
            if self.rng.random() < math.exp(-worse / max(self.temp, 1e-6)):
                self.current = (m.value, cfg)
        self.temp *= self.cooling
