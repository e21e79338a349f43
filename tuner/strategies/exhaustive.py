"""Strategy `exhaustive`: every valid config, in enumeration order."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from edgetune.errors import BadInput
from kernels.space import Config, SearchSpace, config_key
from tuner.strategies.base import Strategy

if TYPE_CHECKING:
    from kernels.spec import KernelSpec

EXHAUSTIVE_LIMIT = 5000


class Exhaustive(Strategy):
    """Refuses spaces over EXHAUSTIVE_LIMIT valid configs: a budget would cut such a walk at an arbitrary corner."""

    name = "exhaustive"

    def __init__(self, space: SearchSpace, seed: int = 0, *, kernel: KernelSpec | None = None,
                 limit: int = EXHAUSTIVE_LIMIT):
        super().__init__(space, seed, kernel=kernel)
        if sum(1 for _ in itertools.islice(space.enumerate(), limit + 1)) > limit:
            raise BadInput(f"exhaustive refuses this space: its valid configs are over the limit of {limit}; "
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
