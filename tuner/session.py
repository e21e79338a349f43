"""One tuning session for one kernel/workload: ask, compile a batch, measure, tell; journal every measurement.

Resumable: strategies are seeded and replay the journaled tells, so rerunning a killed command re-asks the same
configs and takes the finished measurements from the DB instead of measuring them again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from edgetune.errors import EdgetuneError
from kernels.build import CompileError, build_many
from kernels.measure import TIE_THRESHOLD, Measurement, is_tie
from kernels.space import Config, SearchSpace, config_key
from kernels.spec import KernelSpec, Workload
from kernels.worker import Runner
from tuner.db import ResultsDB
from tuner.objective import Objective
from tuner.strategies import Strategy, make_strategy

log = logging.getLogger(__name__)

# per-variant timing budget, while searching and per interleaved finalist round. Drift between rounds, not the
# window, sets the noise here: the same binary moves a median 4% from one round to the next at 0.025 s and at 0.05 s
# alike, so a shorter window buys rounds for the same time (bench/finals_study.py)
SEARCH_MIN_TIME_S = 0.025
FINAL_ROUNDS = 3  # interleaved re-measurements of each finalist; its search measurement joins them in the median
FINALISTS = 4
FINALIST_MARGIN = 1.15  # a config measured over 15% slower than the best while searching cannot win on noise


@dataclass
class Budget:
    evals: int = 40
    seconds: float | None = None
    patience: int | None = 15  # stop after this many evals without a >TIE improvement


@dataclass
class TuneResult:
    kernel: str
    workload: str
    shape: dict
    config: Config
    ms: float
    default_ms: float | None
    speedup: float | None
    evals: int
    tuning_s: float
    strategy: str
    session_id: int
    key: str
    strategy_version: str = ""
    model_version: str | None = None  # the tuner model behind an llm result: a new model marks results stale
    cached: bool = False
    ort_ms: float | None = None
    failed: int = 0
    objective: str = "latency"
    objective_note: str | None = None  # why an energy/edp run fell back to latency
    energy_j: float | None = None  # joules per call of the winner, when a meter measured it
    default_energy_j: float | None = None
    tuned_at: float = field(default_factory=time.time)
    # where tuning_s went: compile_s, measure_s, strategy_s (after a resume, this process's part only)
    timing: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def active_entry(self) -> dict:
        """The config/active entry (DESIGN.md contract) plus what `report` needs."""
        return {"config": self.config, "ms": self.ms, "default_ms": self.default_ms, "speedup": self.speedup,
                "evals": self.evals, "tuning_s": self.tuning_s, "strategy": self.strategy, "shape": self.shape,
                "ort_ms": self.ort_ms, "tuned_at": self.tuned_at, "session_id": self.session_id, "key": self.key,
                "objective": self.objective, "energy_j": self.energy_j, "default_energy_j": self.default_energy_j,
                "strategy_version": self.strategy_version,
                **({"model_version": self.model_version} if self.model_version else {})}


ProgressFn = Callable[[int, int, str], None]  # (evals done, eval budget, message)


def result_key(spec: KernelSpec, wl: Workload, hw: Any, strategy: Strategy, objective: str = "latency") -> str:
    """Helion-style cache key: kernel source hash + workload shape + hardware + isa + compiler + strategy version
    (+ the objective, since an energy-tuned winner answers a different question)."""
    parts = [spec.name, spec.source_hash(), wl.name, json.dumps(wl.shape, sort_keys=True), hw.hw_fingerprint, hw.isa,
             hw.compiler.id, f"{strategy.name}-{strategy.version}", objective]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


class Session:
    def __init__(self, db: ResultsDB, runner: Runner, hw: Any):
        self.db, self.runner, self.hw = db, runner, hw
        self.timing: dict[str, float] = {}

    @contextmanager
    def _timed(self, what: str) -> Iterator[None]:
        """Add the block's seconds to this run's `what` (compile_s, measure_s, strategy_s)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timing[what] = self.timing.get(what, 0.0) + time.perf_counter() - t0

    def tune(self, spec: KernelSpec, wl: Workload, *, strategy: str = "anneal", budget: Budget | None = None,
             seed: int = 0, force: bool = False, batch: int | None = None, origin: str = "cli",
             progress: ProgressFn | None = None, strategy_obj: Strategy | None = None,
             objective: Objective | None = None) -> TuneResult:
        budget = budget or Budget()
        objective = objective or Objective()
        space = spec.space(wl.shape, self.hw)
        strat = strategy_obj or make_strategy(strategy, space, seed, kernel=spec)
        key = result_key(spec, wl, self.hw, strat, objective.name)
        if not force:
            done = self.db.finished_session(key)
            if done and done.result:
                res = TuneResult(**{**done.result, "cached": True})
                self._activate(spec, wl, res)
                return res
        params = {"seed": seed, "evals": budget.evals, "seconds": budget.seconds, "patience": budget.patience}
        sess = None if force else self.db.running_session(key, params)
        if sess is None:
            sess = self.db.open_session(key, {
                "kernel": spec.name, "workload": wl.name, "shape": wl.shape, "hw_fingerprint": self.hw.hw_fingerprint,
                "fw_fingerprint": self.hw.fw_fingerprint, "source_hash": spec.source_hash(), "isa": self.hw.isa,
                "compiler_id": self.hw.compiler.id, "strategy": strat.name, "strategy_version": strat.version,
            }, params, origin)
        else:
            log.info("resuming session %d for %s/%s", sess.id, spec.name, wl.name)
        journal = {m["seq"]: m for m in self.db.measurements(sess.id, "search")}
        t0 = time.monotonic() - (self._elapsed(journal))
        self.timing = {"compile_s": 0.0, "measure_s": 0.0, "strategy_s": 0.0}
        evals: list[tuple[Config, Measurement]] = []
        batch = batch or max(1, self.hw.cores)
        best_ms, since_best = float("inf"), 0
        relearned = objective.fallback_reason is not None
        while len(evals) < budget.evals:
            if budget.seconds is not None and time.monotonic() - t0 >= budget.seconds:
                break
            if budget.patience is not None and since_best >= budget.patience:
                break
            # a strategy may return more than asked (llm: its top-K as one batch); never beyond the budget
            with self._timed("strategy_s"):
                asked = strat.ask(min(batch, budget.evals - len(evals)))[: budget.evals - len(evals)]
            if not asked:
                break
            # the first batch also builds the default, which the finals always re-measure: one compile round fewer
            prebuild = [] if evals else [space.valid_default()]
            measured = self._measure_batch(spec, wl, sess.id, len(evals), asked, journal, objective, prebuild)
            if objective.fallback_reason and not relearned:
                # an energy run fell back to latency: rescore everything, re-teach a fresh strategy in ms
                relearned = True
                for _, m in evals + measured:
                    m.score = m.ms if m.ok else None
                best_ms = min((m.ms for _, m in evals if m.ok), default=float("inf"))
                if strategy_obj is None:
                    strat = make_strategy(strategy, space, seed, kernel=spec)
                    for c, m in evals:
                        strat.tell(c, m)
            for cfg, m in measured:
                with self._timed("strategy_s"):
                    strat.tell(cfg, m)
                evals.append((cfg, m))
                if m.ok and m.value < best_ms * (1 - TIE_THRESHOLD):
                    best_ms, since_best = m.value, 0
                else:
                    since_best += 1
                best_ms = min(best_ms, m.value) if m.ok else best_ms
                if progress:
                    progress(len(evals), budget.evals, f"{spec.name}/{wl.name} best {best_ms:.4g} "
                                                       f"{'ms' if objective.active == 'latency' else objective.active}")
        return self._finish(spec, wl, space, strat, sess.id, key, evals, t0, objective)

    @staticmethod
    def _elapsed(journal: dict) -> float:
        """Tuning time already spent before a resume (from the journal's timestamps)."""
        if not journal:
            return 0.0
        ts = [m["ts"] for m in journal.values()]
        return max(ts) - min(ts)

    def _measure_batch(self, spec: KernelSpec, wl: Workload, session_id: int, seq0: int, cfgs: list[Config],
                       journal: dict, objective: Objective,
                       prebuild: list[Config] | None = None) -> list[tuple[Config, Measurement]]:
        """Replay journaled measurements; compile the rest (and `prebuild`, built only) as one batch, then measure
        them one by one."""
        out: list[tuple[Config, Measurement] | None] = [None] * len(cfgs)
        todo = []
        for i, cfg in enumerate(cfgs):
            j = journal.get(seq0 + i)
            if j and j["config_key"] == config_key(cfg):
                out[i] = (cfg, objective.score(_from_stats(j["stats"])))
            else:
                todo.append(i)
        if todo:
            t = time.perf_counter()
            extra = [c for c in prebuild or [] if config_key(c) not in {config_key(cfgs[i]) for i in todo}]
            with self._timed("compile_s"):
                builds = build_many(spec, [cfgs[i] for i in todo] + extra, self.hw, shape=wl.shape)[:len(todo)]
            compile_s = (time.perf_counter() - t) / len(todo)
            for i, b in zip(todo, builds):
                if isinstance(b, CompileError):
                    m = Measurement.failed(f"compile error: {b}")
                else:
                    with self._timed("measure_s"):
                        m = objective.score(self.runner.measure(
                            spec, wl.shape, b.path, min_time_s=max(SEARCH_MIN_TIME_S, objective.min_time_s)))
                self.db.add_measurement(session_id, "search", seq0 + i, cfgs[i], config_key(cfgs[i]), m, compile_s)
                out[i] = (cfgs[i], m)
        return [o for o in out if o is not None]

    def remeasure(self, spec: KernelSpec, wl: Workload, cfgs: list[Config], session_id: int, phase: str,
                  rounds: int = FINAL_ROUNDS, objective: Objective | None = None,
                  prior: list[Measurement | None] | None = None) -> list[Measurement]:
        """Interleaved A B C A B C ... so drift and bursts of load hit every finalist alike; median per config,
        over the rounds and the config's `prior` measurement from this session (same window), when it has one."""
        objective = objective or Objective()
        with self._timed("compile_s"):
            builds = build_many(spec, cfgs, self.hw, shape=wl.shape)
        per: list[list[Measurement]] = [[p] if p is not None and p.ok else [] for p in prior or [None] * len(cfgs)]
        seq = 0
        for _ in range(rounds):
            for i, (cfg, b) in enumerate(zip(cfgs, builds)):
                with self._timed("measure_s"):
                    m = (Measurement.failed(f"compile error: {b}") if isinstance(b, CompileError)
                         else objective.score(self.runner.measure(
                             spec, wl.shape, b.path, min_time_s=max(SEARCH_MIN_TIME_S, objective.min_time_s))))
                self.db.add_measurement(session_id, phase, seq, cfg, config_key(cfg), m, None)
                seq += 1
                per[i].append(m)
        out = []
        for ms in per:
            good = [m for m in ms if m.ok]
            if not good:
                out.append(ms[0])
                continue
            cvs = [m.cv for m in good if m.cv is not None]
            energies = [m.energy_j for m in good if m.energy_j is not None]
            merged = Measurement(ok=True, ms=statistics.median(m.ms for m in good),
                                 cv=statistics.median(cvs) if cvs else None,
                                 reps=sum(m.reps for m in good), reps_used=sum(m.reps_used for m in good),
                                 estimator="median-of-interleaved", max_abs_err=max(m.max_abs_err or 0 for m in good),
                                 load1=good[-1].load1, energy_j=statistics.median(energies) if energies else None)
            out.append(objective.score(merged))
        return out

    def _finish(self, spec: KernelSpec, wl: Workload, space: SearchSpace, strat: Strategy, session_id: int, key: str,
                evals: list[tuple[Config, Measurement]], t0: float, objective: Objective) -> TuneResult:
        ok = sorted(((c, m) for c, m in evals if m.ok), key=lambda cm: cm[1].value)
        failed = sum(1 for _, m in evals if not m.ok)
        default = space.valid_default()
        if not ok:
            self.db.finish_session(session_id, "failed", {"reason": "every variant failed", "failed": failed})
            raise EdgetuneError(f"{spec.name}/{wl.name}: all {len(evals)} variants failed "
                                f"(first: {evals[0][1].reason if evals else 'none measured'})")
        finalists = pick_finalists(ok, default)
        searched = {config_key(c): m for c, m in ok}
        final = self.remeasure(spec, wl, finalists, session_id, "final", objective=objective,
                               prior=[searched.get(config_key(c)) for c in finalists])
        if objective.fallback_reason:  # a finalist's window was refused: rank them all by latency
            for m in final:
                m.score = m.ms
        winner, wm = pick_winner([(c, m) for c, m in zip(finalists, final) if m.ok], space, default)
        dm = next((m for c, m in zip(finalists, final) if config_key(c) == config_key(default) and m.ok), None)
        res = TuneResult(
            kernel=spec.name, workload=wl.name, shape=wl.shape, config=winner, ms=wm.ms,
            default_ms=dm.ms if dm else None, speedup=(dm.ms / wm.ms) if dm else None, evals=len(evals),
            tuning_s=time.monotonic() - t0, strategy=strat.name, session_id=session_id, key=key, failed=failed,
            strategy_version=strat.version, model_version=getattr(strat, "model_version", None),
            ort_ms=self._ort_ms(spec, wl), objective=objective.active, objective_note=objective.fallback_reason,
            energy_j=wm.energy_j, default_energy_j=dm.energy_j if dm else None,
            timing={k: round(v, 3) for k, v in self.timing.items()},
        )
        self.db.finish_session(session_id, "done", res.to_dict())
        self._activate(spec, wl, res)
        return res

    def _ort_ms(self, spec: KernelSpec, wl: Workload) -> float | None:
        """The ONNX twin on the same inputs, so `report` can show tuned/ORT without re-measuring."""
        try:
            from kernels.ort_twin import run_ort

            return run_ort(spec, wl.shape, spec.make_inputs(wl.shape, np.random.default_rng(0)),
                           threads=self.hw.cores, min_time_s=SEARCH_MIN_TIME_S).ms
        except Exception as e:  # the twin is a peer, not a requirement for tuning
            log.warning("ORT twin of %s/%s failed: %s", spec.name, wl.name, e)
            return None

    def _activate(self, spec: KernelSpec, wl: Workload, res: TuneResult) -> None:
        entry = res.active_entry() | {"hw_fingerprint": self.hw.hw_fingerprint,
                                      "fw_fingerprint": self.hw.fw_fingerprint, "isa": self.hw.isa}
        if not self.db.set_active(spec.name, wl.name, entry):
            pinned = {k: v for k, v in self.db.active_entry(spec.name, wl.name).items() if k != "pinned"}
            pinned["tuned_entry"] = entry  # remembered, so unpin restores the tuned result
            self.db.set_active(spec.name, wl.name, pinned, pinned=True)


def pick_finalists(ok: list[tuple[Config, Measurement]], default: Config) -> list[Config]:
    """The fastest few search results (`ok`, sorted by value) that could still be the best once noise is averaged
    out, plus the default: a speedup is measured, not assumed."""
    limit = FINALIST_MARGIN * ok[0][1].value if ok[0][1].value > 0 else float("inf")
    finalists = [c for c, m in ok[:FINALISTS] if m.value <= limit]
    if config_key(default) not in {config_key(c) for c in finalists}:
        finalists.append(default)
    return finalists


def pick_winner(scored: list[tuple[Config, Measurement]], space: SearchSpace,
                default: Config) -> tuple[Config, Measurement]:
    """The fastest finalist; ties (within the noise threshold) go to the default, then to the config closest to it,
    so noise never moves a device off a config for nothing."""
    best = min(m.value for _, m in scored)
    tied = [(c, m) for c, m in scored if is_tie(m.value, best)]
    return min(tied, key=lambda cm: (space.distance(cm[0], default), cm[1].value))


def _from_stats(stats: dict) -> Measurement:
    return Measurement(**stats)
