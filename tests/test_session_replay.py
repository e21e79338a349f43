"""The session's logic on the replay evaluator: budget, patience, resume, finalists, ties to the default and the
energy fallback, with recorded measurements instead of a compiler and a worker."""

from __future__ import annotations

import random

import pytest

from kernels.measure import Measurement
from kernels.registry import get_spec
from kernels.space import config_key
from tuner.db import ResultsDB
from tuner.evaluate import Replay, TableSpace, interleave_plan
from tuner.objective import Objective
from tuner.session import FINAL_ROUNDS, FINALIST_MARGIN, Budget, Session

GEMM = get_spec("gemm")
SMALL = GEMM.workload("kws_dscnn.fc")


def _table(space, ms_of, n: int = 40, seed: int = 0) -> tuple[TableSpace, dict[str, Measurement]]:
    """A recorded table of `n` sampled configs and the default, timed by `ms_of(config)`."""
    cfgs = [space.valid_default()] + space.sample(n, random.Random(seed), exclude={config_key(space.valid_default())})
    return TableSpace.over(space, cfgs), {config_key(c): Measurement(ok=True, ms=ms_of(c), load1=0.0) for c in cfgs}


def _session(universe, table, **kw) -> Session:
    return Session(ResultsDB(), None, universe.hw,
                   evaluators=lambda spec, wl, obj: Replay(universe=universe, table=table, objective=obj), **kw)


def _by_distance(space, base: float = 1.0, step: float = 0.1):
    """Faster the further from the default: the default is the slowest config."""
    return lambda c: base / (1 + step * space.distance(c, space.valid_default()))


def test_budget_finals_and_cache(hw):
    space = GEMM.space(SMALL.shape, hw)
    universe, table = _table(space, _by_distance(space))
    s = _session(universe, table)
    r = s.tune(GEMM, SMALL, strategy="random", budget=Budget(evals=10, patience=None))
    assert r.evals == 10 and not r.cached and r.ort_ms is None
    search = s.db.measurements(r.session_id, "search")
    assert len(search) == 10 and all(config_key(m["config"]) in table for m in search)
    finals = s.db.measurements(r.session_id, "final")
    keys = {config_key(m["config"]) for m in finals}
    assert config_key(space.valid_default()) in keys and len(finals) == FINAL_ROUNDS * len(keys)
    best = min(table[config_key(m["config"])].ms for m in search)
    assert r.ms == best and r.default_ms == table[config_key(space.valid_default())].ms
    assert r.speedup == pytest.approx(r.default_ms / r.ms)
    assert s.db.active_entry("gemm", SMALL.name)["config"] == r.config
    key = s.db.finished_session(r.key).result_key  # the typed key, stored with the session
    assert key.digest() == r.key and (key.kernel, key.workload, key.shape) == ("gemm", SMALL.name, SMALL.shape)
    assert (key.hw_fingerprint, key.strategy, key.objective) == (hw.hw_fingerprint, "random", "latency")
    again = s.tune(GEMM, SMALL, strategy="random", budget=Budget(evals=10, patience=None))
    assert again.cached and again.session_id == r.session_id


def test_a_session_hands_its_strategy_the_devices_earlier_winners(hw):
    """Before its first ask, a strategy is told this device's winners of the kernel from sessions that finished
    before this one began (`Strategy.warm_start`): here the earlier tune's winner of the same shape."""
    from tuner.strategies import RandomSearch

    space = GEMM.space(SMALL.shape, hw)
    universe, table = _table(space, _by_distance(space))
    s = _session(universe, table)
    told: list[list] = []

    class Recording(RandomSearch):
        def warm_start(self, known):
            told.append(list(known))

    s.tune(GEMM, SMALL, strategy_obj=Recording(universe, 0), budget=Budget(evals=3, patience=None))
    first = s.db.active_entry("gemm", SMALL.name)["config"]
    s.tune(GEMM, SMALL, strategy_obj=Recording(universe, 1), budget=Budget(evals=3, patience=None), force=True)
    assert told == [[], [(SMALL.shape, first)]]


def test_patience_stops_a_search_that_stopped_improving(hw):
    space = GEMM.space(SMALL.shape, hw)
    universe, table = _table(space, lambda c: 1.0)  # every config ties: nothing ever improves on the first
    r = _session(universe, table).tune(GEMM, SMALL, strategy="random", budget=Budget(evals=30, patience=5))
    assert r.evals == 6  # the first sets the best, five more without a gain beyond the tie threshold


def test_a_converged_strategy_ends_a_session_without_an_explicit_budget_only(hw):
    from tuner.strategies import RandomSearch

    class Settles(RandomSearch):  # says it has converged after 4 evaluations
        def converged(self) -> bool:
            return len(self.seen) >= 4

    space = GEMM.space(SMALL.shape, hw)
    universe, table = _table(space, _by_distance(space))
    auto = _session(universe, table).tune(GEMM, SMALL, strategy_obj=Settles(universe, 0), batch=2, force=True,
                                          budget=Budget(evals=12))
    assert (auto.evals, auto.converged_at) == (4, 4)
    spent = _session(universe, table).tune(GEMM, SMALL, strategy_obj=Settles(universe, 0), batch=2, force=True,
                                           budget=Budget.whole(12))
    assert (spent.evals, spent.converged_at) == (12, 4)


def test_an_explicit_budget_is_spent_whole_when_nothing_improves(hw):
    """`tune --budget N` (Budget.whole) runs N evaluations: the default budget's patience does not cut it short."""
    space = GEMM.space(SMALL.shape, hw)
    universe, table = _table(space, lambda c: 1.0)  # every config ties: patience alone would stop after 16
    r = _session(universe, table).tune(GEMM, SMALL, strategy="random", budget=Budget.whole(20))
    assert r.evals == 20


def test_a_slow_search_result_is_no_finalist_and_ties_go_to_the_default(hw):
    space = GEMM.space(SMALL.shape, hw)
    default = space.valid_default()
    universe, table = _table(space, lambda c: 1.0 if config_key(c) == config_key(default) else 0.99)
    slow = next(k for k in table if k != config_key(default))
    table[slow] = Measurement(ok=True, ms=0.99 * FINALIST_MARGIN * 1.01, load1=0.0)
    s = _session(universe, table)
    r = s.tune(GEMM, SMALL, strategy="exhaustive", budget=Budget(evals=len(table), patience=None))
    finals = {config_key(m["config"]) for m in s.db.measurements(r.session_id, "final")}
    assert slow not in finals and config_key(default) in finals
    assert r.config == default and r.speedup == 1.0  # 1% faster is a tie: the device keeps its default


def test_among_tuned_configs_the_fastest_finalist_wins_a_tie(hw):
    """Two configs tie within the noise, neither the default: the faster one wins, not the one nearer the default."""
    space = GEMM.space(SMALL.shape, hw)
    default = space.valid_default()
    universe, table = _table(space, lambda c: 1.0 if config_key(c) == config_key(default) else 0.7)
    tuned = sorted((c for c in universe.table if config_key(c) != config_key(default)),
                   key=lambda c: space.distance(c, default))
    near, far = config_key(tuned[0]), config_key(tuned[-1])
    assert space.distance(tuned[0], default) < space.distance(tuned[-1], default)
    table[near] = Measurement(ok=True, ms=0.51, load1=0.0)
    table[far] = Measurement(ok=True, ms=0.50, load1=0.0)  # 2% faster than `near`: a tie by the threshold
    r = _session(universe, table).tune(GEMM, SMALL, strategy="exhaustive", budget=Budget(evals=len(table),
                                                                                        patience=None))
    assert config_key(r.config) == far and r.ms == 0.50


class _Killed(BaseException):
    """A kill: like ^C or the daemon's stop, no Exception, which the session would record as `failed`."""


class _DiesAfter(Replay):
    """A replay whose process is killed after `left` measurements; counts what it measured."""

    left: int | None = None
    measured: int = 0

    def _run(self, key):
        if self.left is not None and self.measured >= self.left:
            raise _Killed()
        self.measured += 1
        return super()._run(key)


def test_resume_replays_the_journal_and_measures_only_the_rest(hw):
    space = GEMM.space(SMALL.shape, hw)
    universe, table = _table(space, _by_distance(space))
    db = ResultsDB()
    evs: list[_DiesAfter] = []

    def session(left):
        def make(spec, wl, obj):
            evs.append(_DiesAfter(universe=universe, table=table, objective=obj))
            evs[-1].left = left
            return evs[-1]
        return Session(db, None, hw, evaluators=make)

    with pytest.raises(_Killed):
        session(4).tune(GEMM, SMALL, strategy="anneal", seed=3, budget=Budget(evals=9))
    before = db.measurements(1, "search")
    assert len(before) == 4 and db.session_info(1)["state"] == "running"
    r = session(None).tune(GEMM, SMALL, strategy="anneal", seed=3, budget=Budget(evals=9))
    after = db.measurements(r.session_id, "search")
    assert r.session_id == 1 and len(after) == 9 and after[:4] == before  # resumed; the journal untouched
    finals = len(db.measurements(1, "final"))
    assert evs[-1].measured == 5 + finals  # only the five unmeasured configs, then the finals


def test_energy_falls_back_to_latency_when_a_window_cannot_be_vouched_for(hw):
    space = GEMM.space(SMALL.shape, hw)
    default = space.valid_default()
    ms_of = _by_distance(space)
    universe, table = _table(space, ms_of, n=8)
    for k, m in table.items():  # energy ranks the other way round: the default is the most frugal
        m.energy_j = 1.0 / m.ms
    unvouched = next(k for k in table if k != config_key(default))
    table[unvouched] = Measurement(ok=True, ms=table[unvouched].ms, load1=0.0, t0=1.0, t1=1.0, calls=10)
    objective = Objective("energy", idle_w=0.5)  # no meter: only the unvouched window needs one
    r = _session(universe, table).tune(GEMM, SMALL, strategy="exhaustive", objective=objective,
                                       budget=Budget(evals=len(table), patience=None))
    assert r.objective == "latency" and "empty window" in r.objective_note
    assert r.ms == min(m.ms for m in table.values())  # ranked by latency, not by the energy recorded


def test_interleave_is_shuffled_rounds_and_same_round_ratios(hw):
    space = GEMM.space(SMALL.shape, hw)
    universe, table = _table(space, _by_distance(space), n=3)
    cfgs = list(universe.enumerate())
    seen = []
    got = Replay(universe=universe, table=table).interleave(cfgs, 3, seed=7,
                                                           record=lambda pos, c, m: seen.append(config_key(c)))
    plan = interleave_plan(len(cfgs), 3, 7)
    assert seen == [config_key(cfgs[j]) for j in plan] and sorted(plan) == sorted(list(range(len(cfgs))) * 3)
    assert plan != list(range(len(cfgs))) * 3  # not a fixed order
    assert got.ratios_to(0) == [pytest.approx(table[config_key(c)].ms / table[config_key(cfgs[0])].ms) for c in cfgs]
    resumed = Replay(universe=universe, table=table).interleave(cfgs, 3, seed=7, done=5)
    assert sum(m.ok for ms in resumed.per for m in ms) == len(plan) - 5 and all(len(ms) == 3 for ms in resumed.per)
