"""Search strategies behind one ask/tell interface (after Optuna's samplers).

A strategy proposes configs with `ask(n)` and learns from `tell(config, measurement)`. All are seeded, so a
replay of the same tells reproduces the same asks: that is what makes a killed session resumable.
"""

from __future__ import annotations

import math
import random
from typing import Protocol

from edgetune.errors import BadInput
from kernels.measure import Measurement
from kernels.space import Config, SearchSpace, config_key

EXHAUSTIVE_LIMIT = 5000


class Strategy(Protocol):
    name: str
    version: str

    def ask(self, n: int) -> list[Config]:
        """Up to n new configs; fewer (or none) when the strategy has nothing left to try."""

    def tell(self, cfg: Config, m: Measurement) -> None:
        ...


class _Base:
    name = "base"
    version = "1"

    def __init__(self, space: SearchSpace, seed: int = 0):
        self.space = space
        self.rng = random.Random(seed)
        self.seen: set[str] = set()
        self.best: tuple[float, Config] | None = None

    def tell(self, cfg: Config, m: Measurement) -> None:
        self.seen.add(config_key(cfg))
        if m.ok and (self.best is None or m.value < self.best[0]):
            self.best = (m.value, cfg)

    def _fresh(self, cfgs: list[Config], n: int) -> list[Config]:
        out, keys = [], set()
        for c in cfgs:
            k = config_key(c)
            if k not in self.seen and k not in keys:
                keys.add(k)
                out.append(c)
            if len(out) == n:
                break
        return out


class Exhaustive(_Base):
    """Every valid config, in enumeration order. Refuses spaces over EXHAUSTIVE_LIMIT."""

    name = "exhaustive"

    def __init__(self, space: SearchSpace, seed: int = 0, limit: int = EXHAUSTIVE_LIMIT):
        super().__init__(space, seed)
        if space.size() > limit:
            raise BadInput(f"exhaustive refuses this space: {space.size()} valid configs, over the limit of {limit}; "
                           "use --strategy anneal or random, or --budget")
        self._it = space.enumerate()

    def ask(self, n: int) -> list[Config]:
        out = []
        for c in self._it:
            if config_key(c) not in self.seen:
                out.append(c)
                if len(out) == n:
                    break
        return out


class RandomSearch(_Base):
    name = "random"

    def ask(self, n: int) -> list[Config]:
        return self.space.sample(n, self.rng, exclude=self.seen)


class Anneal(_Base):
    """Simulated annealing over one-knob neighbours, restarting from a random config when stuck.

    Temperature is relative (a fraction of the current time), so it works for microsecond and millisecond
    kernels alike.
    """

    name = "anneal"

    def __init__(self, space: SearchSpace, seed: int = 0, t0: float = 0.10, cooling: float = 0.85):
        super().__init__(space, seed)
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


def _llm(space: SearchSpace, seed: int = 0) -> Strategy:
    from tuner.llm import LLMStrategy  # lazy: loads llama.cpp only when the llm strategy is used

    return LLMStrategy(space, seed)


STRATEGIES: dict[str, type] = {"exhaustive": Exhaustive, "random": RandomSearch, "anneal": Anneal, "llm": _llm}


def make_strategy(name: str, space: SearchSpace, seed: int = 0) -> Strategy:
    if name not in STRATEGIES:
        raise BadInput(f"unknown strategy {name!r}; strategies: {', '.join(STRATEGIES)}")
    return STRATEGIES[name](space, seed)
