"""Strategy `random`: uniform samples of the valid configs, without repeats."""

from __future__ import annotations

from kernels.space import Config
from tuner.strategies.base import Strategy


class RandomSearch(Strategy):
    name = "random"

    def ask(self, n: int) -> list[Config]:
        return self.space.sample(n, self.rng, exclude=self.seen)
