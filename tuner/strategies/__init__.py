"""Search strategies behind one ask/tell interface: the `Strategy` base class and the registry by name.

    strat = make_strategy("anneal", spec.space(shape, hw), seed, kernel=spec)
    for cfg in strat.ask(4): strat.tell(cfg, measure(cfg))
"""

from tuner.strategies.anneal import Anneal
from tuner.strategies.base import Strategy
from tuner.strategies.exhaustive import EXHAUSTIVE_LIMIT, Exhaustive
from tuner.strategies.llm import LLMStrategy
from tuner.strategies.random_search import RandomSearch
from tuner.strategies.registry import DEFAULT_STRATEGY, STRATEGIES, check_strategy, make_strategy, unknown_strategy

__all__ = ["Anneal", "DEFAULT_STRATEGY", "EXHAUSTIVE_LIMIT", "Exhaustive", "LLMStrategy", "RandomSearch", "STRATEGIES",
           "Strategy", "check_strategy", "make_strategy", "unknown_strategy"]
