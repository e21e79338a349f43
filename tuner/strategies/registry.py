"""The strategies by name: the one place a strategy name is known, made and checked.

The config, the `tune` verb and the daemon's commands all check a name here, so adding a strategy is one line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgetune.errors import BadInput
from kernels.space import SearchSpace
from tuner.strategies.anneal import Anneal
from tuner.strategies.base import Strategy
from tuner.strategies.exhaustive import Exhaustive
from tuner.strategies.llm import LLMStrategy
from tuner.strategies.random_search import RandomSearch

if TYPE_CHECKING:
    from kernels.spec import KernelSpec

DEFAULT_STRATEGY = "llm"  # the tuner model; falls back to anneal without a usable model

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (Exhaustive, RandomSearch, Anneal, LLMStrategy)}


def unknown_strategy(name: object) -> str | None:
    """Why `name` is not a strategy, or None when it is one."""
    if isinstance(name, str) and name in STRATEGIES:
        return None
    return f"unknown strategy {name!r}; strategies: {', '.join(STRATEGIES)}"


def check_strategy(name: object) -> str:
    """`name`, or BadInput naming it and the strategies there are."""
    problem = unknown_strategy(name)
    if problem:
        raise BadInput(problem)
    return name  # type: ignore[return-value]


def make_strategy(name: str, space: SearchSpace, seed: int = 0, *, kernel: KernelSpec | None = None) -> Strategy:
    """A fresh strategy `name` over `space` (the space of `kernel`, the spec it belongs to)."""
    return STRATEGIES[check_strategy(name)](space, seed, kernel=kernel)
