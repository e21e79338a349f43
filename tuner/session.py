"""One tuning session for one kernel/workload: ask, compile a batch, measure, tell; journal every measurement.

Resumable: strategies are seeded and replay the journaled tells, so rerunning a killed command re-asks the same
configs and takes the finished measurements from the DB instead of measuring them again. A session stopped on
purpose (^C, the daemon's SIGTERM: a BaseException, not an Exception) or by its DB failing stays `running`, to be
resumed; one that ends by any other exception is recorded `failed`, with the error as its result's `reason`.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

from edgetune.errors import EdgetuneError
from edgetune.protocol import SESSION_CLI
from edgetune.sqlite import DBError
from kernels.build import prune_builds
from kernels.measure import TIE_THRESHOLD, Measurement, is_tie
from kernels.space import Config, SearchSpace, config_key
from kernels.spec import KernelSpec, Workload
from kernels.worker import Runner
from tuner.active import activate
from tuner.db import FINAL_PHASE, ResultsDB, SessionRow
from tuner.evaluate import Evaluator, Measured
from tuner.objective import Objective
from tuner.resultkey import ResultKey
from tuner.strategies import Strategy, make_strategy

log = logging.getLogger(__name__)

# per-variant timing budget, while searching and per interleaved finalist round, after the worker's warm-up
# (kernels.worker.WARMUP_MS, 10 ms: 25 ms a measurement in all). Drift between rounds, not the window, sets the
# noise here: the same binary moves a median 4% from one round to the next at 0.025 s and at 0.05 s alike, so a
# shorter window buys rounds for the same time (bench/finals_study.py)
SEARCH_MIN_TIME_S = 0.015
FINAL_ROUNDS = 3  # interleaved re-measurements of each finalist; its search measurement joins them in the median
FINALISTS = 4
FINALIST_MARGIN = 1.15  # a config measured over 15% slower than the best while searching cannot win on noise


@dataclass
class Budget:
    """What a session may spend. A strategy that can tell its search has converged (llm) ends the session there
    when `until_converged`, the default: a user who gave no budget wants the answer fast. An explicit eval budget
    (`tune --budget N`) is spent whole, as peers spend theirs, the strategy searching on past convergence."""
    evals: int = 40
    seconds: float | None = None
    patience: int | None = 15  # stop after this many evals without a >TIE improvement
    until_converged: bool = True

    @classmethod
    def whole(cls, evals: int, seconds: float | None = None) -> Budget:
        """An explicit eval budget, spent whole: no convergence stop and no patience (only `seconds` cuts it)."""
        return cls(evals=evals, seconds=seconds, patience=None, until_converged=False)


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
    converged_at: int | None = None  # evals done when the strategy first said it had converged
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


EvaluatorFactory = Callable[[KernelSpec, Workload, Objective], Evaluator]


@dataclass
class _Search:
    """One session's search in progress: where it measures, what it measured, and the best so far."""

    strat: Strategy
    ev: Evaluator
    space: SearchSpace
    session_id: int
    journal: dict  # seq -> journaled measurement, replayed on a resume
    objective: Objective
    evals: list[tuple[Config, Measurement]] = field(default_factory=list)
    best_ms: float = float("inf")
    since_best: int = 0  # evals since the best improved by more than a tie
    relearned: bool = False  # an energy run that fell back to latency has been rescored

    def add(self, cfg: Config, m: Measurement) -> None:
        self.evals.append((cfg, m))
        if m.ok and m.value < self.best_ms * (1 - TIE_THRESHOLD):
            self.best_ms, self.since_best = m.value, 0
        else:
            self.since_best += 1
        self.best_ms = min(self.best_ms, m.value) if m.ok else self.best_ms

    def relearn(self, measured: list[tuple[Config, Measurement]], remake: Callable[[], Strategy] | None) -> None:
        """An energy run fell back to latency: rescore everything in ms, and re-teach a fresh strategy (when the
        caller did not hand in its own) what was measured so far."""
        self.relearned = True
        for _, m in self.evals + measured:
            m.score = m.ms if m.ok else None
        self.best_ms = min((m.ms for _, m in self.evals if m.ok), default=float("inf"))
        if remake is not None:
            self.strat = remake()
            for c, m in self.evals:
                self.strat.tell(c, m)


class Session:
    """Tunes on `evaluators(spec, workload, objective)`: by default real builds and the worker (`Measured`);
    a `Replay` over a recorded table runs the same logic without a compiler."""

    def __init__(self, db: ResultsDB, runner: Runner | None, hw: Any, *,
                 evaluators: EvaluatorFactory | None = None, ort_twin: bool = True):
        self.db, self.runner, self.hw = db, runner, hw
        self.evaluators = evaluators or self.measured
        self.ort_twin = ort_twin  # measure the ONNX twin for `report` (a bench timing the tuning itself does not)
        self.timing: dict[str, float] = {}

    def measured(self, spec: KernelSpec, wl: Workload, objective: Objective) -> Measured:
        return Measured(spec=spec, shape=wl.shape, hw=self.hw, runner=self.runner, objective=objective,
                        min_time_s=SEARCH_MIN_TIME_S)

    @contextmanager
    def _timed(self, what: str) -> Iterator[None]:
        """Add the block's seconds to this run's `what` (strategy_s; the evaluator times compile_s, measure_s)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timing[what] = self.timing.get(what, 0.0) + time.perf_counter() - t0

    def tune(self, spec: KernelSpec, wl: Workload, *, strategy: str = "anneal", budget: Budget | None = None,
             seed: int = 0, force: bool = False, batch: int | None = None, origin: str = SESSION_CLI,
             progress: ProgressFn | None = None, strategy_obj: Strategy | None = None,
             objective: Objective | None = None) -> TuneResult:
        budget = budget or Budget()
        objective = objective or Objective()
        ev = self.evaluators(spec, wl, objective)
        space = ev.space()
        strat = strategy_obj or make_strategy(strategy, space, seed, kernel=spec)
        rkey = ResultKey.of(spec, wl, self.hw, strat.name, strat.version, objective.name,
                            getattr(strat, "model_version", None))
        key = rkey.digest()
        if not force:
            done = self.db.finished_session(key)
            if done and done.result:
                res = TuneResult(**{**done.result, "cached": True})
                activate(self.db, spec.name, wl.name, res.active_entry(), self.hw)
                return res
        params = {"seed": seed, "evals": budget.evals, "seconds": budget.seconds, "patience": budget.patience}
        sess = self._session(spec, wl, rkey, params, origin)
        known = self.db.winners(spec.name, self.hw.hw_fingerprint, self.hw.isa, objective.name, sess.started_at)
        strat.warm_start(known)
        with self._failed_on_error(sess.id):
            journal = {m["seq"]: m for m in self.db.measurements(sess.id, "search")}
            t0 = time.monotonic() - (self._elapsed(journal))
            self.timing = {"strategy_s": 0.0}
            search = _Search(strat, ev, space, sess.id, journal, objective,
                             relearned=objective.fallback_reason is not None)
            remake = None if strategy_obj else (lambda: warmed(make_strategy(strategy, space, seed, kernel=spec),
                                                              known))
            self._search(search, budget, t0, batch or max(1, self.hw.cores), f"{spec.name}/{wl.name}", progress,
                         remake)
            result = self._finish(ev, spec, wl, space, search.strat, sess.id, key, search.evals, t0, objective)
            prune_builds()  # after the finals: this session's builds are the most recently used
            return result

    def _search(self, s: _Search, budget: Budget, t0: float, batch: int, label: str, progress: ProgressFn | None,
                remake: Callable[[], Strategy] | None) -> None:
        """Ask, measure (or replay from the journal), tell, until the budget, the patience or convergence ends it.
        `remake`: a fresh strategy, for an energy run that falls back to latency (None: the caller's own object)."""
        self.converged_at = None
        while len(s.evals) < budget.evals:
            if self.converged_at is None and s.evals and s.strat.converged():
                self.converged_at = len(s.evals)
            if budget.until_converged and self.converged_at is not None:
                break
            if budget.seconds is not None and time.monotonic() - t0 >= budget.seconds:
                break
            if budget.patience is not None and s.since_best >= budget.patience:
                break
            # a strategy may return more than asked (llm: its top-K as one batch); never beyond the budget
            left = budget.evals - len(s.evals)
            with self._timed("strategy_s"):
                asked = s.strat.ask(min(batch, left))[:left]
            if not asked:
                break
            # the first batch also builds the default, which the finals always re-measure: one compile round fewer
            prebuild = [] if s.evals else [s.space.valid_default()]
            measured = self._measure_batch(s.ev, s.session_id, len(s.evals), asked, s.journal, s.objective, prebuild)
            if s.objective.fallback_reason and not s.relearned:
                s.relearn(measured, remake)
            for cfg, m in measured:
                with self._timed("strategy_s"):
                    s.strat.tell(cfg, m)
                s.add(cfg, m)
                if progress:
                    unit = "ms" if s.objective.active == "latency" else s.objective.active
                    progress(len(s.evals), budget.evals, f"{label} best {s.best_ms:.4g} {unit}")

    def _session(self, spec: KernelSpec, wl: Workload, rkey: ResultKey, params: dict, origin: str) -> SessionRow:
        """The unfinished session with this key and params, to resume, or a new one (which supersedes the rest)."""
        # force skips the finished result, never an interrupted run: its measurements are resumed, not lost
        sess = self.db.running_session(rkey.digest(), params)
        if sess is None:
            sess = self.db.open_session(rkey, self.hw.fw_fingerprint, params, origin)
            closed = self.db.interrupt_running(spec.name, wl.name, sess.id)
            if closed:
                log.info("closed %d earlier unfinished session(s) of %s/%s as interrupted", closed, spec.name,
                         wl.name)
        else:
            log.info("resuming session %d for %s/%s", sess.id, spec.name, wl.name)
        return sess

    @contextmanager
    def _failed_on_error(self, session_id: int) -> Iterator[None]:
        """An exception ends the session `failed` with its message: left `running`, a compiler that is gone or a
        bug would show as a tune in progress forever. A DBError cannot be recorded (and its fix promises the
        measurements back on the rerun), and a stop (BaseException) is resumed: both stay `running`."""
        try:
            yield
        except DBError:
            raise
        except Exception as e:
            try:
                self.db.fail_session(session_id, f"{type(e).__name__}: {e}")
            except DBError as db_error:  # keep the first error, which says what went wrong
                log.error("could not record session %d as failed: %s", session_id, db_error)
            raise

    @staticmethod
    def _elapsed(journal: dict) -> float:
        """Tuning time already spent before a resume (from the journal's timestamps)."""
        if not journal:
            return 0.0
        ts = [m["ts"] for m in journal.values()]
        return max(ts) - min(ts)

    def _measure_batch(self, ev: Evaluator, session_id: int, seq0: int, cfgs: list[Config], journal: dict,
                       objective: Objective, prebuild: list[Config]) -> list[tuple[Config, Measurement]]:
        """Replay journaled measurements; evaluate the rest (building `prebuild` with them) and journal them."""
        out: list[tuple[Config, Measurement] | None] = [None] * len(cfgs)
        todo = []
        for i, cfg in enumerate(cfgs):
            j = journal.get(seq0 + i)
            if j and j["config_key"] == config_key(cfg):
                out[i] = (cfg, objective.score(_from_stats(j["stats"])))
            else:
                todo.append(i)
        if todo:
            compiled = ev.timing.get("compile_s", 0.0)

            def record(n: int, cfg: Config, m: Measurement) -> None:
                compile_s = (ev.timing.get("compile_s", 0.0) - compiled) / len(todo)  # the batch's, shared
                self.db.add_measurement(session_id, "search", seq0 + todo[n], cfg, config_key(cfg), m, compile_s)
                out[todo[n]] = (cfg, m)

            ev.evaluate([cfgs[i] for i in todo], prebuild=prebuild, record=record)
        return [o for o in out if o is not None]

    def remeasure(self, spec: KernelSpec, wl: Workload, cfgs: list[Config], session_id: int, phase: str,
                  rounds: int = FINAL_ROUNDS, objective: Objective | None = None,
                  prior: list[Measurement | None] | None = None, evaluator: Evaluator | None = None
                  ) -> list[Measurement]:
        """Interleaved rounds (`Evaluator.interleave`), journaled under `phase`; median per config over the rounds
        and the config's `prior` measurement from this session (same window), when it has one."""
        objective = objective or Objective()
        ev = evaluator or self.evaluators(spec, wl, objective)

        def record(seq: int, cfg: Config, m: Measurement) -> None:
            self.db.add_measurement(session_id, phase, seq, cfg, config_key(cfg), m, None)

        got = ev.interleave(cfgs, rounds, seed=interleave_seed(session_id, phase), record=record)
        return [objective.score(got.merged(i, p)) for i, p in enumerate(prior or [None] * len(cfgs))]

    def _finish(self, ev: Evaluator, spec: KernelSpec, wl: Workload, space: SearchSpace, strat: Strategy,
                session_id: int, key: str, evals: list[tuple[Config, Measurement]], t0: float,
                objective: Objective) -> TuneResult:
        ok = sorted(((c, m) for c, m in evals if m.ok), key=lambda cm: cm[1].value)
        failed = sum(1 for _, m in evals if not m.ok)
        default = space.valid_default()
        if not ok:
            self.db.finish_session(session_id, "failed", {"reason": "every variant failed", "failed": failed})
            raise EdgetuneError(f"{spec.name}/{wl.name}: all {len(evals)} variants failed "
                                f"(first: {evals[0][1].reason if evals else 'none measured'})")
        finalists = pick_finalists(ok, default)
        searched = {config_key(c): m for c, m in ok}
        final = self.remeasure(spec, wl, finalists, session_id, FINAL_PHASE, objective=objective,
                               prior=[searched.get(config_key(c)) for c in finalists], evaluator=ev)
        if objective.fallback_reason:  # a finalist's window was refused: rank them all by latency
            for m in final:
                m.score = m.ms
        winner, wm = pick_winner([(c, m) for c, m in zip(finalists, final) if m.ok], default)
        dm = next((m for c, m in zip(finalists, final) if config_key(c) == config_key(default) and m.ok), None)
        res = TuneResult(
            kernel=spec.name, workload=wl.name, shape=wl.shape, config=winner, ms=wm.ms,
            default_ms=dm.ms if dm else None, speedup=(dm.ms / wm.ms) if dm else None, evals=len(evals),
            tuning_s=time.monotonic() - t0, strategy=strat.name, session_id=session_id, key=key, failed=failed,
            strategy_version=strat.version, model_version=getattr(strat, "model_version", None),
            ort_ms=self._ort_ms(ev, spec, wl), objective=objective.active, objective_note=objective.fallback_reason,
            energy_j=wm.energy_j, default_energy_j=dm.energy_j if dm else None,
            timing={k: round(v, 3) for k, v in {**ev.timing, **self.timing}.items()},
            converged_at=self.converged_at,
        )
        self.db.finish_session(session_id, "done", res.to_dict())
        activate(self.db, spec.name, wl.name, res.active_entry(), self.hw)
        return res

    def _ort_ms(self, ev: Evaluator, spec: KernelSpec, wl: Workload) -> float | None:
        """The ONNX twin on the same inputs, so `report` can show tuned/ORT without re-measuring."""
        if not self.ort_twin:
            return None
        try:
            return ev.ort_ms()
        except Exception as e:  # the twin is a peer, not a requirement for tuning
            log.warning("ORT twin of %s/%s failed: %s", spec.name, wl.name, e)
            return None


def warmed(strat: Strategy, known: list[tuple[dict, Config]]) -> Strategy:
    strat.warm_start(known)
    return strat


def interleave_seed(session_id: int, phase: str) -> str:
    """The seed of a session's interleaved rounds under `phase`: fixed, so the journaled order can be read back."""
    return f"{session_id}:{phase}"


def pick_finalists(ok: list[tuple[Config, Measurement]], default: Config) -> list[Config]:
    """The fastest few search results (`ok`, sorted by value) that could still be the best once noise is averaged
    out, plus the default: a speedup is measured, not assumed."""
    limit = FINALIST_MARGIN * ok[0][1].value if ok[0][1].value > 0 else float("inf")
    finalists = [c for c, m in ok[:FINALISTS] if m.value <= limit]
    if config_key(default) not in {config_key(c) for c in finalists}:
        finalists.append(default)
    return finalists


def pick_winner(scored: list[tuple[Config, Measurement]], default: Config) -> tuple[Config, Measurement]:
    """The fastest finalist, unless the default ties it (within the noise threshold): a speedup inside the noise is
    not claimed, and the device keeps its default. Among tuned configs a tie has no such reason: the fastest
    measured is the best guess (nearness to the default, the rule before, is no evidence of speed)."""
    best = min(scored, key=lambda cm: cm[1].value)
    kept = next(((c, m) for c, m in scored if config_key(c) == config_key(default)), None)
    return kept if kept is not None and is_tie(kept[1].value, best[1].value) else best


def _from_stats(stats: dict) -> Measurement:
    return Measurement(**stats)
