"""Strategy `llm`: the tuner model proposes, measurement decides, local search polishes.

1. The first `ask` returns the model's top-K configs (default 5; K is widened when the model is unsure, i.e. its
   top-K probability mass is flat) so the session compiles them as one batch and measures them; the session then
   re-measures its finalists interleaved and keeps the best (the default is always a finalist).
2. When the proposals measure far apart (the model's ranking disagrees with the machine) or all failed, the next
   `ask` widens to the model's next K proposals once.
3. The rest of the budget goes to local refinement around the winner: an `Anneal` seeded at the best measured
   config, which stops after `refine_patience` evaluations without an improvement beyond the noise threshold.

A missing, corrupt or incompatible model file is a warning naming the file; the strategy then is plain `anneal`
(with a distinct version, so its results are keyed apart) and tuning completes. The model's version and
sha256 are part of the strategy version, so results are keyed by the model that proposed them.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernels.measure import TIE_THRESHOLD, Measurement
from kernels.space import Config, SearchSpace, config_key
from tuner.strategies.anneal import Anneal
from tuner.strategies.base import Strategy

if TYPE_CHECKING:
    from kernels.spec import KernelSpec

log = logging.getLogger(__name__)

STRATEGY_VERSION = "1"
DEFAULT_K = 5
UNSURE_TOP1_SHARE = 0.22  # top-1 holds under this share of the top-K mass: the model is unsure -> widen K
DIVERSE_STEPS = 2  # hedged top-K: proposals differ from each other by at least this many knob steps
FAR_APART = 1.5  # the model's first pick measures over 1.5x the best proposal: ranking is off -> widen once

_PROPOSERS: dict[str, Any] = {}  # path -> Proposer (or the ModelError it raised): load a model once per process


def load_proposer(path: Path | None = None):
    """The process-wide Proposer for a model file; raises ModelError (cached) when it cannot be used."""
    from tuner.model.inference import ModelError, default_model_path
    from tuner.model.proposer import Proposer

    p = str(Path(path) if path else default_model_path())
    hit = _PROPOSERS.get(p)
    if isinstance(hit, Exception):
        raise hit
    if hit is None:
        try:
            hit = _PROPOSERS[p] = Proposer(path=Path(p))
        except ModelError as e:
            _PROPOSERS[p] = e
            raise
        except OSError as e:
            err = ModelError(f"tuner model file {p} cannot be read: {e}")
            _PROPOSERS[p] = err
            raise err
    return hit


class LLMStrategy(Strategy):
    """Without a `kernel` (the spec the space belongs to) the model has nothing to be prompted with: plain anneal."""

    name = "llm"

    def __init__(self, space: SearchSpace, seed: int = 0, *, kernel: KernelSpec | None = None, k: int = DEFAULT_K,
                 model_path: Path | None = None, proposer: Any = None, refine_patience: int = 2, pool: int = 1):
        super().__init__(space, seed, kernel=kernel)
        self.k = k
        self.pool = pool  # the hedged top-K is drawn from the model's exact top-(k*pool)
        self.refine_patience = refine_patience
        self.fallback: Anneal | None = None
        self.proposer = None
        self.phase = "propose"
        self.proposals: list[Config] = []
        self.logprobs: dict[str, float] = {}
        self.results: dict[str, Measurement] = {}  # measurements of the model's proposals
        self.widened = False
        self.refiner: Anneal | None = None
        self.since_best = 0
        self.latency_ms: float | None = None
        self.model_version: str | None = None  # the proposing model's version; None when it fell back
        try:
            from tuner.model.inference import ModelError

            try:
                self.proposer = proposer or load_proposer(model_path)
                self._check_compatible()
                self.version = f"{STRATEGY_VERSION}-{self.proposer.version}-{self.proposer.m.info.sha256[:12]}"
                self.model_version = self.proposer.m.info.model_version
            except ModelError as e:
                self._fall_back(str(e))
        except ImportError as e:  # llama_cpp missing on this device
            self._fall_back(f"llama.cpp is not available ({e})")

    def _fall_back(self, why: str) -> None:
        log.warning("%s; strategy llm falls back to anneal", why)
        self.fallback = Anneal(self.space, self.rng.randrange(1 << 30))
        self.version = f"{STRATEGY_VERSION}-anneal-fallback"
        self.proposer = None

    def _check_compatible(self) -> None:
        from tuner.model.inference import ModelError

        path = self.proposer.m.path
        if self.kernel is None:
            raise ModelError(f"tuner model {path}: no kernel given for this search space")
        why = self.proposer.m.info.incompatibility(self.kernel.name, self.space.params)
        if why:
            raise ModelError(f"tuner model {path} is incompatible: {why}")

    # ---- ask / tell ------------------------------------------------------------------------------------------

    def _propose(self, k: int) -> list[Config]:
        from tuner.model.inference import ModelError

        try:
            res = self.proposer.propose(self.kernel.name, self.space, k)
        except ModelError as e:
            self._fall_back(f"tuner model {self.proposer.m.path} failed while proposing: {e}")
            return []
        self.latency_ms = res.latency_ms if self.latency_ms is None else self.latency_ms + res.latency_ms
        for p in res.proposals:
            self.logprobs[config_key(p.config)] = p.logprob
        return [p.config for p in res.proposals]

    def _diverse(self, k: int) -> list[Config]:
        """The model's top-k, hedged: walk its exact top-(pool) list in log-prob order and take configs at least
        DIVERSE_STEPS knob steps from every one already taken (near-duplicates that differ in one minor knob
        would share one fate), filling up in log-prob order when that runs short."""
        ranked = self._propose(k * self.pool)
        picked: list[Config] = []
        for c in ranked:
            if len(picked) == k:
                break
            if all(self.space.distance(c, p) >= DIVERSE_STEPS for p in picked):
                picked.append(c)
        for c in ranked:
            if len(picked) == k:
                break
            if c not in picked:
                picked.append(c)
        return picked

    def ask(self, n: int) -> list[Config]:
        if self.fallback is not None:
            return self.fallback.ask(n)
        if self.phase == "propose":
            self.phase = "check"
            k = self.k
            cfgs = self._diverse(k) if self.pool > 1 else self._propose(k)
            if self.fallback is not None:
                return self.fallback.ask(n)
            ps = [math.exp(self.logprobs[config_key(c)]) for c in cfgs]
            if ps and ps[0] / sum(ps) < UNSURE_TOP1_SHARE and k == self.k:
                cfgs = self._diverse(2 * k) if self.pool > 1 else self._propose(2 * k)  # flat: widen K up front
                self.widened = True
            self.proposals = self._fresh(cfgs, len(cfgs))
            if self.proposals:
                return list(self.proposals)
            self.phase = "refine"  # the model had nothing valid: pure local search
        if self.phase == "check":
            self.phase = "refine"
            if not self.widened and self._far_apart():
                self.widened = True
                more = self._fresh(self._propose(3 * self.k), self.k)
                if more:
                    self.proposals = self.proposals + more
                    return list(more)
        return self._refine(n)

    def _far_apart(self) -> bool:
        ok = [self.results[config_key(c)] for c in self.proposals if self.results.get(config_key(c), None)]
        ok = [m for m in ok if m.ok]
        if not ok:
            return True
        first = self.results.get(config_key(self.proposals[0]))
        best = min(m.value for m in ok)
        return first is None or not first.ok or first.value > FAR_APART * best

    def _refine(self, n: int) -> list[Config]:
        if self.refiner is None:
            self.refiner = Anneal(self.space, self.rng.randrange(1 << 30), t0=0.02)
            self.refiner.seen = set(self.seen)
            if self.best is not None:
                self.refiner.best = self.best
                self.refiner.current = self.best
            self.since_best = 0
        if self.since_best >= self.refine_patience:
            return []  # converged: stop well before the budget, the session re-measures the finalists
        return self.refiner.ask(n)

    def tell(self, cfg: Config, m: Measurement) -> None:
        before = self.best[0] if self.best else None
        super().tell(cfg, m)
        if config_key(cfg) in self.logprobs:  # only the model's proposals are compared (_far_apart)
            self.results[config_key(cfg)] = m
        if self.fallback is not None:
            self.fallback.tell(cfg, m)
            return
        if self.refiner is not None:
            self.refiner.tell(cfg, m)
            improved = m.ok and before is not None and m.value < before * (1 - TIE_THRESHOLD)
            self.since_best = 0 if improved else self.since_best + 1
