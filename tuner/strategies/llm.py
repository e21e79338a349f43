"""Strategy `llm`: the tuner model proposes, measurements steer it, and it stops when the neighbourhood says done.

1. First batch (`k`, default 5): the model's top configs, hedged where it is unsure. Its exact top-(3k) is first
   re-ranked by the scorer its file carries (tuner.model.scorer: regression trees fitted to every measured config,
   which order neighbours inside the region the model picked better than the model does). Then the
   knobs whose probability mass is split (thread count, vector width, tile shape: whichever the model doubts for
   this prompt) each get a config holding the runner-up value, so one wrong guess cannot sink the whole batch; the
   vector width, gru's parallel split and the register tile's width are hedged however sure the model is, since
   there a model can be sure and wrong by 1.2-2x (ALWAYS_HEDGE); the GEMM tile's width (nv) is hedged two or
   more steps from the top pick's, since a wider register file's best tile often is (FAR_HEDGE). Such a hedge
   costs the config nearest another one of the batch (a near-duplicate tells least), not a diverse pick. One more
   such slot goes to a winner this device found before on another shape of the kernel (the results DB's,
   `warm_start`; on a retune, the shape's own last one too), the one the model ranks first among them: on
   silicon the model never saw, the device's own history holds configs the model's pool misses. That history
   also settles a hedge: where the device's earlier winners of the kernel all hold the top pick's value of an
   always-hedged knob (SETTLE or more of them), the batch keeps the model's next config instead of a config with
   the other value.
2. Then each batch is steered by what was measured: the model is prompted with the measured configs and their
   relative times (`tuner.model.prompt.history_text`; it is trained on such histories), and each knob value gets
   a log-weight from the evidence (the best time among configs holding it, relative to the best of all: a value
   that only ever measured slow is down-weighted). The batch holds the model's best unmeasured config under that
   evidence, and its best unmeasured one-knob neighbour of the incumbent (the model as acquisition function over
   a local step, as in LLM-seeded local search). The first such steps give each hedged value that came close a
   clean test: the incumbent with that one knob changed. A hedge differs from the incumbent in several knobs, so
   its time alone would leave the value under the evidence weight for the rest of the session.
3. It has converged once `patience` evaluations in a row brought no gain beyond the noise (3%); a first batch that
   spread widely (the model's guesses were far apart) doubles the patience, since the optimum may still be far. A
   session without an explicit budget stops there. One with a budget goes on, each batch now an exploration step
   (the model's best, under the measurements, among a pool of random unmeasured configs away from the incumbent:
   the model as acquisition function over a global sample, where steering alone stays in the incumbent's basin)
   and the local step; local search once the model has nothing left to propose.

A model trained before the kernel's knobs changed proposes the knobs it knows (the others at their defaults, which
every other neighbour step then explores; tuner.model.proposer.unknown_knobs), with a version marked `mapped`. A
missing, corrupt or incompatible model file is a warning naming the file; the strategy then is plain `anneal`
(with a distinct version, so its results are keyed apart) and tuning completes. The model's version and sha256 are
part of the strategy version, so results are keyed by the model that proposed them.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgetune.errors import BadInput
from kernels.measure import TIE_THRESHOLD, Measurement
from kernels.space import Config, SearchSpace, config_key, table_predicate
from tuner.strategies.anneal import Anneal
from tuner.strategies.base import Strategy

if TYPE_CHECKING:
    from kernels.spec import KernelSpec

log = logging.getLogger(__name__)

FALLBACK_SUFFIX = "-anneal-fallback"  # on the version of a session that ran anneal for want of a usable model
STRATEGY_VERSION = "14"  # bumped when the first batch, the steering or the stop changes: results are keyed by it
# the first batch: 5 beat 4 at 5, 10 and 20 evals on the 18 real held-out layers in two runs (@5 geomean 1.07 vs
# 1.09 and 1.11 vs 1.14): the fifth hedge is worth more than the first steered step
DEFAULT_K = 5
UNSURE = 0.85  # a knob whose leading value holds under this share of the top configs' mass is hedged
# knobs hedged however sure the model is (each where the space has it): vector width and gru's parallel split are
# where a model was confidently wrong by 2x on held-out real layers (a Cout-16 conv: all five vec=4, best vec=16; an
# RNNoise GRU: all five par=units, best gemm). The register tile's width (nv: gemm and the convs' vectors per row
# tile; cv: dwconv's channel vectors; fv: logmel's frame vectors) is where a model trained on one host was sure and
# wrong on another (all five nv=1 or cv=1, best 2-4). On 35 real layers of that unseen host (an Intel Xeon), side by
# side with the hedge of vec and par alone: @5 geomean 1.087-1.114 vs 1.098-1.117 in four seeds with the last config
# given up, and 1.079-1.099 vs 1.098-1.116 (@20 1.028-1.058 vs 1.057-1.076) in two with the nearest one given up.
# The thread count is hedged only where the model is unsure: once the measuring worker stopped sharing its cores
# with idle BLAS threads (kernels.worker.ONE_BLAS_THREAD), a sure model's threads=2 held up, and the slot it freed
# did better (35 real layers, two seeds: @5 within 5% 77-80% vs 71-74% with threads hedged too)
ALWAYS_HEDGE = ("vec", "par", "nv", "cv", "fv")
# always-hedged knobs whose hedge reaches two or more steps from the top pick's value (the adjacent one when none
# two away is valid), even where the batch already holds an adjacent one: the register tile's width on a wider
# register file. On the unseen Intel host (AVX-512, 32 vector registers) conv1d's best tiles hold nv = 3-4 where the
# model's first batch held nv = 1-2. 35 real layers, budget 10, side by side with the adjacent hedge (seeds 52-54,
# load 1.0-2.1): the session without a budget (auto, 7 evals) 1.055 / 69% within 5% vs 1.070 / 57%, 1.062 / 63% vs
# 1.065 / 54%, 1.056 / 60% vs 1.065 / 49%; @10 71 / 71 / 71% vs 69 / 60 / 54%; conv1d @10 67-83% vs 17-33%. It
# costs conv2d_3x3 at 5 evals (33 / 50 / 50% vs 50 / 67 / 50%; level at 10), and a hedge of the value only where the
# batch has a single one kept conv1d at 33% (quantized_models/data/recipe-trials.md). Beside an adjacent value the
# far one is no sole hedge (`_sole_hedges`), so the device's earlier winner may take its slot: keeping it from that
# read level with the adjacent hedge (seed 54: auto 54% vs 54%; as shipped, 60% vs 49%)
FAR_HEDGE = ("nv",)
HEDGE_POOL = 3  # the first batch is hedged from the model's exact top-(3k): top-15 costs 10 ms CPU p50, 22 p95 on
#                 the 35 real held-out layers at idle (top-10: 10 / 17; top-5: 9 / 14), and sets the p95 of a
#                 budget-10 session's calls (20 ms at load 1-2); a pool of 2 was within 5% on fewer layers at
#                 10 evals in both of two runs
EVIDENCE_WEIGHT = 1.5  # log-weight per log of a value's best time over the best of all
# evals without a gain that end a session (counted from the end of the first batch; doubled after a wide one). Later
# batches hold one config per core, so with two cores 2 stops after one steered batch (7 evals) where 3 stopped after
# two (9). On the 35 real layers of an AMD Zen 4 host, side by side in two seeds (load 0.7-2.5): the stop 0.48 and
# 0.64 s sooner (2.23 / 2.34 s vs 2.71 / 2.98 s to the last eval) at geomean 1.009 / 0.985 (89% / 89% within 5%)
# vs 1.001 / 0.990 (91% / 86%); a replay of 280 sessions of the unseen Intel host read 66% vs 70% (recipe-trials.md,
# "The stop rule's patience")
PATIENCE = 2
WIDE_SPREAD = 2.0  # the first batch's slowest over fastest: beyond this, patience doubles
EXPLORE_POOL = 32  # random unmeasured configs the model picks its exploration step from, once converged
EXPLORE_AWAY = 3  # knob steps a pooled config is at least from the incumbent
# a hedged value whose best measured config came within this factor of the incumbent gets a clean test on it (one
# knob changed): on 35 real layers of the unseen Intel host, side by side with steps that skip it (three seeds, load
# 0.1-2.1): @10 geomean 1.040-1.046 vs 1.064 and @20 1.022-1.024 vs 1.043-1.046 in two, level in the third (@20
# 1.027 vs 1.023); in all three a log-mel layer whose fv=1 hedge also changed fft and vec went 1.18-1.36 -> 0.95-1.00
# at 10, and a conv1d whose nv=2 hedge also changed mr, mb and order 1.15-1.27 -> 0.97-0.99
RETEST_WITHIN = 2.0

# which of the device's earlier winners of the kernel takes a first-batch slot (warm_start): the model's pick among
# them. On 35 real layers of the unseen Intel host, tuned in order (each layer sees the arm's own winners on the
# layers before it), side by side with none: @5 geomean 1.059 / 63% within 5% vs 1.087 / 54%, 1.052 / 69% vs
# 1.069 / 60% and 1.041 / 63% vs 1.058 / 66% in three seeds (@20 1.017 vs 1.036, 1.031 vs 1.029, 1.019 vs 1.034);
# the nearest shape's winner instead: 1.075 / 60% (first seed)
WARM = "model"
WARM_CHOICES = ("nearest", "model", "off")
# an always-hedged knob is not hedged when at least this many of the device's earlier winners of the kernel
# (warm_start) all hold the top pick's value of it (0: always hedged). On the unseen Intel host (AVX-512) the vector
# width hedge came within 5% of the best known on 1 of 35 layers and ran over 1.2x on 30. On its 35 real layers in
# order, side by side with the hedge kept: @5 geomean 1.030 / 68% within 5% vs 1.048 / 65%, 1.035 / 57% vs 1.050 /
# 51%, 1.061 / 60% vs 1.067 / 57% in three seeds (@10 1.016 vs 1.048, 1.015 vs 1.024, 1.043 vs 1.063; the default
# session's stop: 1.009 / 1.009 / 1.041 vs 1.038 / 1.016 / 1.064). One winner did worse (@5 46% vs 54% within 5%),
# three read level (57% vs 54%, 57% vs 60%; quantized_models/data/recipe-trials.md)
SETTLE = 2

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


def hedged(ranked: list[tuple[Config, float]], k: int, space: SearchSpace) -> list[Config]:
    """k configs from the model's ranked (config, logprob) list: its top pick, then for each knob the model is
    unsure about (most unsure first) the best config holding that knob's runner-up value, then the rest in rank
    order, preferring configs two or more knob steps from those taken."""
    if not ranked:
        return []
    z = max(lp for _, lp in ranked)
    mass = [(c, math.exp(lp - z)) for c, lp in ranked]
    total = sum(w for _, w in mass)
    top = ranked[0][0]
    unsure = []
    for p in space.params:
        share: dict[Any, float] = {}
        for c, w in mass:
            share[c[p.name]] = share.get(c[p.name], 0.0) + w / total
        lead = share.get(top[p.name], 0.0)
        runner = max((v for v in share if v != top[p.name]), key=lambda v: share[v], default=None)
        if lead < UNSURE and runner is not None:
            unsure.append((lead, p.name, runner))
    picked = [top]
    for _, name, value in sorted(unsure, key=lambda u: u[0]):
        if len(picked) >= k:
            break
        alt = next((c for c, _ in ranked if c[name] == value and c not in picked), None)
        if alt is not None:
            picked.append(alt)
    for min_steps in (2, 1):
        for c, _ in ranked:
            if len(picked) >= k:
                return picked
            if c not in picked and all(space.distance(c, p) >= min_steps for p in picked):
                picked.append(c)
    return picked


def shape_distance(a: dict, b: dict) -> float:
    """How far apart two shapes of a kernel are: the sum of |log| ratios of their sizes (a dim missing, zero or not
    a number on either side counts as a factor e apart)."""
    out = 0.0
    for d in set(a) | set(b):
        x, y = a.get(d), b.get(d)
        if x == y:
            continue
        ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (x, y))
        out += abs(math.log(x / y)) if ok else 1.0
    return out


def best_by_value(history: list[tuple[Config, float]], name: str) -> dict[Any, float]:
    """Value of knob `name` -> the best time among the measured configs holding it."""
    by: dict[Any, float] = {}
    for c, ms in history:
        by[c[name]] = min(by.get(c[name], math.inf), ms)
    return by


def evidence_bias(space: SearchSpace, history: list[tuple[Config, float]],
                  weight: float = EVIDENCE_WEIGHT) -> dict[str, dict[Any, float]]:
    """Knob -> value -> log-weight (<= 0): -weight * log(best time with the value / best time of all), for knobs
    whose measured configs hold two or more values (a value never measured keeps weight 0)."""
    if not history:
        return {}
    best = min(ms for _, ms in history)
    out: dict[str, dict[Any, float]] = {}
    for p in space.params:
        by = best_by_value(history, p.name)
        if len(by) >= 2:
            out[p.name] = {v: -weight * math.log(ms / best) for v, ms in by.items() if ms > best}
    return {k: v for k, v in out.items() if v}


class LLMStrategy(Strategy):
    """Without a `kernel` (the spec the space belongs to) the model has nothing to be prompted with: plain anneal."""

    name = "llm"

    def __init__(self, space: SearchSpace, seed: int = 0, *, kernel: KernelSpec | None = None, k: int = DEFAULT_K,
                 model_path: Path | None = None, proposer: Any = None, patience: int = PATIENCE,
                 evidence: float = EVIDENCE_WEIGHT, history: bool = True,
                 always_hedge: tuple[str, ...] = ALWAYS_HEDGE, hedge_pool: int = HEDGE_POOL, rescore: bool = True,
                 retest: bool = True, warm: str = WARM, settle: int = SETTLE, far: tuple[str, ...] = FAR_HEDGE):
        super().__init__(space, seed, kernel=kernel)
        self.k = k
        self.patience = patience
        self.evidence = evidence
        self.use_history = history  # prompt the model with the measurements (False: evidence bias alone)
        self.always_hedge = tuple(always_hedge)  # knobs the first batch holds two values of, however sure
        self.hedge_pool = hedge_pool  # the first batch is hedged from the model's exact top-(hedge_pool * k)
        self.rescore = rescore  # that pool in the scorer's order (False: the model's own)
        self.far = tuple(far)  # always-hedged knobs whose hedge holds a value two or more steps from the top pick's
        self.retest = retest  # local steps first test each hedged value on the incumbent itself
        self.retested: set[tuple[str, Any]] = set()  # (knob, value) so tested: once per session
        if warm not in WARM_CHOICES:
            raise ValueError(f"llm: warm={warm!r} is not one of {', '.join(WARM_CHOICES)}")
        self.warm = warm  # which of the device's winners on other shapes joins the first batch
        self.known: list[tuple[dict, Config]] = []  # those winners (warm_start)
        self.settle = settle  # that many winners agreeing with the top pick on an always-hedged knob settle it
        self.fallback: Anneal | None = None  # no usable model: plain anneal
        self.refiner: Anneal | None = None  # the model has nothing left to propose: local search, same patience
        self.proposer = None
        self.started = False
        self.first: list[Config] = []
        self.history: list[tuple[Config, float]] = []  # ok measurements, in the order told
        self.since_best = 0
        self.local_steps = 0  # with `mapped` knobs: every other local step explores one of them
        self.spread: float | None = None
        self.latency_ms: float | None = None
        self.calls: list[tuple[float, float]] = []  # (wall ms, CPU ms) of each proposal call
        self.model_version: str | None = None  # the proposing model's version; None when it fell back
        self.mapped: list[str] | None = None  # knobs the model was trained without (None: it knows this space)
        try:
            from tuner.model.inference import ModelError

            try:
                self.proposer = proposer or load_proposer(model_path)
                self._check_compatible()
                self.version = f"{STRATEGY_VERSION}-{self.proposer.version}-{self.proposer.m.info.sha256[:12]}" \
                    + ("-mapped" if self.mapped is not None else "")
                self.model_version = self.proposer.m.info.model_version
            except ModelError as e:
                self._fall_back(str(e))
        except ImportError as e:  # llama_cpp missing on this device
            self._fall_back(f"llama.cpp is not available ({e})")

    def _fall_back(self, why: str) -> None:
        log.warning("%s; strategy llm falls back to anneal", why)
        self.fallback = Anneal(self.space, self.rng.randrange(1 << 30))
        self.fallback.seen = set(self.seen)
        self.version = STRATEGY_VERSION + FALLBACK_SUFFIX
        self.proposer = None

    def _check_compatible(self) -> None:
        from tuner.model.inference import ModelError

        path = self.proposer.m.path
        if self.kernel is None:
            raise ModelError(f"tuner model {path}: no kernel given for this search space")
        name = self.kernel.name
        why = self.proposer.m.info.incompatibility(name, self.space.params)
        if why:
            raise ModelError(f"tuner model {path} is incompatible: {why}")
        known = self.proposer.m.info.spaces()[name]
        mine = {p.name: [str(v) for v in p.values] for p in self.space.params}
        if known != mine:  # an older model for a kernel whose knobs changed: it proposes the knobs it knows
            from tuner.model.proposer import unknown_knobs

            self.mapped = sorted(unknown_knobs(known, self.space))
            log.info("tuner model %s was trained before kernel %s's knobs changed: it proposes the knobs it knows "
                     "(%s at their defaults, then searched locally)", path, name, ", ".join(self.mapped) or "none new")

    # ---- the model ---------------------------------------------------------------------------------------

    def _propose(self, k: int, **kw) -> list[tuple[Config, float]]:
        """The model's top-k (config, logprob), conditioned on the measurements so far; [] after a fallback."""
        from tuner.model.inference import ModelError

        if self.mapped and self.best is not None:
            kw.setdefault("unknown_values", {k: self.best[1][k] for k in self.mapped})
        if self.history:
            kw.setdefault("bias", evidence_bias(self.space, self.history, self.evidence))
            if self.use_history:
                kw.setdefault("history", self.history)
        kw.setdefault("exclude", self.seen)
        try:
            res = self.proposer.propose(self.kernel.name, self.space, k, **kw)
        except ModelError as e:
            self._fall_back(f"tuner model {self.proposer.m.path} failed while proposing: {e}")
            return []
        self.latency_ms = res.latency_ms + (self.latency_ms or 0.0)
        self.calls.append((res.latency_ms, res.cpu_ms))
        return [(p.config, p.logprob) for p in res.proposals]

    def _rescored(self, ranked: list[tuple[Config, float]]) -> list[tuple[Config, float]]:
        """The model's candidates in the order of its file's scorer, predicted fastest first (unchanged when the
        file has no scorer for this kernel, or with `rescore` off). The scorer's time joins the call's latency."""
        scorer = self.proposer.scorer if self.proposer is not None and self.rescore else None
        if scorer is None or not scorer.knows(self.kernel.name) or len(ranked) < 2:
            return ranked
        t0, c0 = time.perf_counter(), time.thread_time()
        pred = scorer.score(self.kernel.name, self.space.hw, self.space.shape, [c for c, _ in ranked])
        wall, cpu = (time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3
        self.latency_ms = (self.latency_ms or 0.0) + wall
        self.calls[-1] = (self.calls[-1][0] + wall, self.calls[-1][1] + cpu)
        return [ranked[i] for i in sorted(range(len(ranked)), key=lambda i: pred[i])]

    def _always_hedged(self, batch: list[Config], fixed: set[int]) -> list[Config]:
        """The batch, with a config swapped in (one per knob) for the model's best one holding another value of
        each always-hedged knob that the batch lacks (when the constraints allow one); for a `far` knob, a value
        two or more steps from the top pick's, which an adjacent value in the batch does not stand in for."""
        for name in self.always_hedge:
            if not batch or name not in self.space.names:
                continue
            top = batch[0][name]
            for away in self._hedge_values(name, top):
                if any(c[name] in away for c in batch):
                    break
                if self._settled(name, top):
                    log.info("no %s hedge: this device's %d earlier winners all hold %s=%s", name, len(self.known),
                             name, top)
                    break
                alt = self._propose(1, extra=lambda c, n=name, a=away: n not in c or c[n] in a,
                                    exclude=self.seen | {config_key(c) for c in batch}) if away else []
                if alt:
                    batch = self._swap_in(batch, fixed, alt[0][0])
                    break
        return batch

    def _hedge_values(self, name: str, top: Any) -> list[set]:
        """The values a hedge of knob `name` may hold, in the order tried: for a `far` knob those two or more steps
        from `top` first; then every other value."""
        vals = self.space.param(name).values
        return [{v for v in vals if abs(vals.index(v) - vals.index(top)) >= step}
                for step in ((2, 1) if name in self.far else (1,))]

    def _settled(self, name: str, value: Any) -> bool:
        """The device's earlier winners of the kernel (`warm_start`) say `name=value`: at least `settle` of them,
        all holding it. A hedge guards against a model that is sure and wrong on this device; the device's own
        winners show where it is not."""
        held = [cfg.get(name) for _, cfg in self.known]
        return 0 < self.settle <= len(held) and all(v == value for v in held)

    def _swap_in(self, batch: list[Config], fixed: set[int], cfg: Config) -> list[Config]:
        """The batch with `cfg` in place of the config nearest another one of the batch (the later one on a tie),
        among those not `fixed` (appended when all are); its slot joins `fixed`. The model's top pick and the
        hedges stay: a near-duplicate of a kept config tells least, while a diverse pick may hold the region the
        model missed."""
        free = [i for i in range(len(batch)) if i not in fixed]
        if not free:
            fixed.add(len(batch))
            return batch + [cfg]
        slot = min(free, key=lambda i: (min(self.space.distance(batch[i], c) for j, c in enumerate(batch) if j != i),
                                        -i))
        fixed.add(slot)
        return batch[:slot] + [cfg] + batch[slot + 1:]

    def warm_start(self, known: list[tuple[dict, Config]]) -> None:
        self.known = [] if self.warm == "off" else known

    def _with_known_winner(self, batch: list[Config], fixed: set[int]) -> list[Config]:
        """The batch with one of this device's winners on other shapes of the kernel (`warm_start`), valid here
        and not already in it: the model's pick among them (`warm="model"`) or the nearest shape's
        (`warm="nearest"`), in place of a near-duplicate, never of the top pick or a hedge."""
        taken = {config_key(c) for c in batch}
        valid = []
        for shape, cfg in self.known:
            try:
                cfg = self.space.validate(cfg, complete=True)
            except BadInput:
                continue
            if config_key(cfg) not in taken:
                valid.append((shape, cfg))
        if not valid:
            return batch
        if self.warm == "model":
            got = self._propose(1, extra=table_predicate(self.space.names, [c for _, c in valid]))
            pick = next((sc for sc in valid if got and sc[1] == got[0][0]), None)
        else:
            pick = min(valid, key=lambda sc: shape_distance(sc[0], self.space.shape))
        if pick is None:
            return batch
        log.info("the first batch holds this device's winner on shape %s", pick[0])
        return self._swap_in(batch, fixed | self._sole_hedges(batch), pick[1])

    def _sole_hedges(self, batch: list[Config]) -> set[int]:
        """Slots that alone hold another value of an always-hedged knob than the top pick's: giving one up would
        undo that hedge."""
        out = set()
        for name in self.always_hedge:
            if name in self.space.names:
                others = [i for i, c in enumerate(batch) if c[name] != batch[0][name]]
                if len(others) == 1:
                    out.add(others[0])
        return out

    def _local(self) -> Config | None:
        """The model's best unmeasured one-knob neighbour of the incumbent, a clean test of a hedged value first
        (`_retests`). A knob the model was trained without (`mapped`) it cannot rank: every other step, retests
        pending or not, takes an unmeasured neighbour in such a knob instead."""
        if self.best is None:
            return None
        nbrs = [c for c in self.space.neighbours(self.best[1]) if config_key(c) not in self.seen]
        if self.mapped:
            new = [c for c in nbrs if any(c[k] != self.best[1][k] for k in self.mapped)]
            self.local_steps += 1
            if new and self.local_steps % 2 == 1:
                return self.rng.choice(new)
            nbrs = [c for c in nbrs if c not in new]
        retests = self._retests()
        if retests:
            got = self._propose(1, extra=table_predicate(self.space.names, retests))
            if got:
                self.retested |= {(n, v) for n, v in got[0][0].items() if v != self.best[1][n]}
                return got[0][0]
        if not nbrs:
            return None
        got = self._propose(1, extra=table_predicate(self.space.names, nbrs))
        return got[0][0] if got else None

    def _retests(self) -> list[Config]:
        """The incumbent with one always-hedged knob set to another value the session measured, unmeasured so far,
        where that value's best config came within RETEST_WITHIN of the incumbent; once per value. A hedge config
        differs from the incumbent in several knobs, so its time does not say whether the hedged value itself lost;
        the evidence bias would otherwise keep the model off that value for the rest of the session."""
        if not self.retest or self.best is None:
            return []
        ms_best, inc = self.best
        out = []
        for name in self.always_hedge:
            if name not in self.space.names:
                continue
            for v, ms in best_by_value(self.history, name).items():
                cand = {**inc, name: v}
                if v != inc[name] and ms <= RETEST_WITHIN * ms_best and (name, v) not in self.retested \
                        and config_key(cand) not in self.seen and self.space.is_valid(cand):
                    out.append(cand)
        return out

    # ---- ask / tell ----------------------------------------------------------------------------------------

    def ask(self, n: int) -> list[Config]:
        if self.fallback is None and not self.started:
            self.started = True
            pool = self._rescored(self._propose(self.hedge_pool * self.k))
            fixed = {0}
            batch = self._always_hedged(hedged(pool, self.k, self.space), fixed)
            self.first = self._with_known_winner(batch, fixed) if batch else batch
            if self.first:
                return list(self.first)
        if self.fallback is not None:  # no usable model (from the start, or it failed mid-session)
            return self.fallback.ask(n)
        if self.refiner is None:
            out = self._steered(n)
            if out or self.fallback is not None:
                return out or self.fallback.ask(n)
            # the model has nothing unmeasured left that the constraints allow: local search from the incumbent
            self.refiner = Anneal(self.space, self.rng.randrange(1 << 30), t0=0.02)
            self.refiner.seen, self.refiner.best = set(self.seen), self.best
            self.refiner.current = self.best
        return self.refiner.ask(n)

    def _explore(self) -> list[tuple[Config, float]]:
        """The model's best, under the measurements, among a seeded pool of random unmeasured valid configs at
        least EXPLORE_AWAY steps from the incumbent ([] when the space has none left)."""
        pool = [c for c in self.space.sample(EXPLORE_POOL, self.rng, exclude=self.seen)
                if self.best is None or self.space.distance(c, self.best[1]) >= EXPLORE_AWAY]
        return self._propose(1, extra=table_predicate(self.space.names, pool)) if pool else []

    def _steered(self, n: int) -> list[Config]:
        """The model's best unmeasured config(s) under the measurements (once converged: its exploration step),
        and its best neighbour step."""
        out = [c for c, _ in (self._explore() if self.converged() else self._propose(max(1, n - 1)))]
        local = self._local() if n > 1 else None
        if local is not None and config_key(local) not in {config_key(c) for c in out}:
            out = out[:n - 1] + [local]
        return out[:n]

    def converged(self) -> bool:
        if self.fallback is not None:
            return False
        wide = self.spread is not None and self.spread > WIDE_SPREAD
        return self.since_best >= self.patience * (2 if wide else 1)

    def tell(self, cfg: Config, m: Measurement) -> None:
        before = self.best[0] if self.best else None
        super().tell(cfg, m)
        for other in (self.fallback, self.refiner):
            if other is not None:
                other.tell(cfg, m)
        if m.ok:
            self.history.append((cfg, m.value))
        improved = m.ok and (before is None or m.value < before * (1 - TIE_THRESHOLD))
        self.since_best = 0 if improved else self.since_best + 1
        firsts = {config_key(c) for c in self.first}
        if self.spread is None and firsts and firsts <= self.seen:
            ms = [v for c, v in self.history if config_key(c) in firsts]
            self.spread = max(ms) / min(ms) if ms else None
            self.since_best = 0  # patience counts from the end of the first batch
