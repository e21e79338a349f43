"""The seam between a strategy and measurement: `evaluate(configs)` and `interleave(configs, rounds)`.

`Measured` builds a batch (a compile error becomes a failed measurement, in place), runs the rest in the worker
and scores them by the objective. `Replay` answers from a recorded table (the collector's journal, the committed
dataset), as Kernel Tuner's simulation runner answers from a cache file: the session, the collector and the
benches run unchanged on either, and the session's logic is testable without a compiler.

Interleaving is one protocol: every round measures each config once, in a seeded shuffled order, so drift and
bursts of load hit every config alike and no config always runs first. A config is then judged by its median over
the rounds, or by its median same-round ratio to a reference (`Rounds.ratios_to`), the least noisy comparison this
shared host allows (its speed drifts by up to ~40% within minutes): the best-known config measured against itself
(bench/compare_tuners.py's control) came within 5% on 69 of 72 held-out cases with same-round ratios over 7
shuffled rounds (load 0.1-0.4; a ratio of median ms over 3 of those same rounds gave 60), and on 58 of 72 with 3
rounds in a fixed order and a ratio of median ms (load 0.7-1.7).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

from edgetune.errors import EdgetuneError
from kernels.build import CompileError, build_many
from kernels.measure import Measurement
from kernels.space import Config, SearchSpace, config_key
from kernels.spec import KernelSpec
from kernels.worker import Runner
from tuner.objective import Objective

Record = Callable[[int, Config, Measurement], None]  # (position in the interleaved plan, config, measurement)


@dataclass
class Rounds:
    """An interleave's measurements: `per[i][r]` is config i's measurement in round r."""

    per: list[list[Measurement]]

    def merged(self, i: int, prior: Measurement | None = None) -> Measurement:
        """Config i's median over its ok rounds (and `prior`, a measurement of the same window, when ok)."""
        good = [m for m in ([prior] if prior is not None and prior.ok else []) + self.per[i] if m.ok]
        if not good:
            return self.per[i][0] if self.per[i] else Measurement.failed("not measured")
        cvs = [m.cv for m in good if m.cv is not None]
        energies = [m.energy_j for m in good if m.energy_j is not None]
        return Measurement(ok=True, ms=statistics.median(m.ms for m in good),
                           cv=statistics.median(cvs) if cvs else None,
                           reps=sum(m.reps for m in good), reps_used=sum(m.reps_used for m in good),
                           estimator="median-of-interleaved", max_abs_err=max(m.max_abs_err or 0 for m in good),
                           load1=good[-1].load1, energy_j=statistics.median(energies) if energies else None)

    def times(self, i: int) -> list[float | None]:
        """Config i's ms per round (None where it failed)."""
        return [m.ms if m.ok else None for m in self.per[i]]

    def ratios_to(self, ref: int = 0) -> list[float | None]:
        """Each config's same-round ratio to config `ref` (see same_round_ratio)."""
        return [same_round_ratio(self.times(i), self.times(ref)) for i in range(len(self.per))]

    def median_ms(self, i: int) -> float | None:
        return median_time(self.times(i))


def same_round_ratio(times: Sequence[float | None], ref: Sequence[float | None]) -> float | None:
    """The median over rounds of times[r] / ref[r], skipping rounds where either failed (None or 0): drift within
    minutes hits both sides of a round alike, and an outlier round is voted down."""
    paired = [a / b for a, b in zip(times, ref) if a and b]
    return statistics.median(paired) if paired else None


def median_time(times: Sequence[float | None]) -> float | None:
    ok = [t for t in times if t]
    return statistics.median(ok) if ok else None


def interleave_plan(n: int, rounds: int, seed: int | str = 0) -> list[int]:
    """The order an interleave measures n configs in: each round a seeded shuffle of them all. Deterministic, so
    a journaled interleave resumes where it stopped."""
    rng = random.Random(seed)
    return [j for _ in range(rounds) for j in rng.sample(range(n), n)]


class Evaluator(Protocol):
    """What a session, the collector and the benches measure configs with."""

    timing: dict[str, float]  # seconds spent, by part: compile_s, measure_s

    def space(self) -> SearchSpace:
        """The configs this evaluator can answer: what a strategy searches."""

    def evaluate(self, configs: list[Config], *, prebuild: Iterable[Config] = (),
                 record: Record | None = None) -> list[Measurement]:
        """One measurement per config, in order; a config that cannot run is a failed measurement. `prebuild`
        configs are only built (a batch the caller will measure later); `record` is called after each
        measurement (its index in `configs`), so a journal loses at most the one in flight."""

    def interleave(self, configs: list[Config], rounds: int, *, seed: int | str = 0, done: int = 0,
                   record: Record | None = None) -> Rounds:
        """`rounds` shuffled rounds (`interleave_plan`); the first `done` plan positions were measured before and
        are skipped (failed measurements in their rounds); `record` is called after each new measurement."""

    def ort_ms(self) -> float | None:
        """The ONNX twin on the same inputs, when this evaluator can run it."""


@dataclass
class _Batches:
    """`evaluate` and `interleave` on top of `_prepare`, the one part an implementation supplies: a batch of
    configs made runnable (built, or looked up), one measuring call each."""

    timing: dict[str, float] = field(default_factory=lambda: {"compile_s": 0.0, "measure_s": 0.0})

    def _add(self, what: str, t0: float) -> None:
        self.timing[what] = self.timing.get(what, 0.0) + time.perf_counter() - t0

    def interleave(self, configs: list[Config], rounds: int, *, seed: int | str = 0, done: int = 0,
                   record: Record | None = None) -> Rounds:
        runs = self._prepare(configs)
        per: list[list[Measurement]] = [[] for _ in configs]
        for pos, j in enumerate(interleave_plan(len(configs), rounds, seed)):
            # a position measured by an earlier run keeps its round's place, so rounds stay aligned across configs
            m = runs[j]() if pos >= done else Measurement.failed("measured before this run")
            per[j].append(m)
            if record and pos >= done:
                record(pos, configs[j], m)
        return Rounds(per)

    def evaluate(self, configs: list[Config], *, prebuild: Iterable[Config] = (),
                 record: Record | None = None) -> list[Measurement]:
        keys = {config_key(c) for c in configs}
        extra = [c for c in prebuild if config_key(c) not in keys]
        out = []
        for i, run in enumerate(self._prepare(list(configs) + extra)[:len(configs)]):
            out.append(run())
            if record:
                record(i, configs[i], out[-1])
        return out

    def _prepare(self, configs: list[Config]) -> list[Callable[[], Measurement]]:
        raise NotImplementedError


@dataclass(kw_only=True)
class Measured(_Batches):
    """Real measurement: build the batch in parallel, run each build in the worker, score it by the objective."""

    spec: KernelSpec
    shape: dict
    hw: Any
    runner: Runner
    objective: Objective = field(default_factory=Objective)
    min_time_s: float = 0.15
    max_reps: int = 200
    timeout_s: float | None = None
    bake: bool = True  # compile the shape's baked dims in (False: one build serves every shape, the collector)
    act: str = "none"  # the fused activation the runs apply (kernels with an epilogue)

    def space(self) -> SearchSpace:
        return self.spec.space(self.shape, self.hw)

    # config key -> its build or CompileError: each config is built once per evaluator (and, shared through
    # dataclasses.replace, once for every shape of a shape-generic batch)
    builds: dict[str, Any] = field(default_factory=dict)

    def _prepare(self, configs: list[Config]) -> list[Callable[[], Measurement]]:
        todo = list({config_key(c): c for c in configs if config_key(c) not in self.builds}.values())
        if todo:
            t0 = time.perf_counter()
            got = build_many(self.spec, todo, self.hw, shape=self.shape if self.bake else None)
            self.builds.update(zip(map(config_key, todo), got))
            self._add("compile_s", t0)
        return [lambda b=self.builds[config_key(c)]: self._run(b) for c in configs]

    def _run(self, b: Any) -> Measurement:
        if isinstance(b, CompileError):
            return Measurement.failed(f"compile error: {b}")
        t0 = time.perf_counter()
        try:
            return self.objective.score(self.runner.measure(
                self.spec, self.shape, b.path, min_time_s=max(self.min_time_s, self.objective.min_time_s),
                max_reps=self.max_reps, timeout_s=self.timeout_s, act=self.act))
        finally:
            self._add("measure_s", t0)

    def ort_ms(self) -> float | None:
        m = self.runner.time_twin(self.spec, self.shape, threads=self.hw.cores, min_time_s=self.min_time_s)
        if not m.ok:
            raise EdgetuneError(f"the ONNX twin did not run: {m.reason}")
        return m.ms


@dataclass(kw_only=True)
class Replay(_Batches):
    """Answers from a recorded table (config key -> measurement): no compiler, no worker. A config outside the
    table is a failed measurement ("not in the recorded table"); every round of an interleave returns the
    recorded measurement again."""

    universe: SearchSpace  # what strategies search: a `TableSpace` over the table, or a whole space it covers
    table: Mapping[str, Measurement]
    objective: Objective = field(default_factory=Objective)

    @classmethod
    def of_ms(cls, universe: SearchSpace, table: Mapping[str, float], objective: Objective | None = None) -> "Replay":
        return cls(universe=universe, table={k: Measurement(ok=True, ms=v, load1=0.0) for k, v in table.items()},
                   objective=objective or Objective())

    def space(self) -> SearchSpace:
        return self.universe

    def _prepare(self, configs: list[Config]) -> list[Callable[[], Measurement]]:
        return [lambda k=config_key(c): self._run(k) for c in configs]

    def _run(self, key: str) -> Measurement:
        m = self.table.get(key)
        if m is None:
            return Measurement.failed("not in the recorded table")
        return self.objective.score(Measurement(**m.to_dict()))  # a copy: scoring writes to it

    def ort_ms(self) -> float | None:
        return None


@dataclass(frozen=True)
class TableSpace(SearchSpace):
    """A search space whose configs are exactly a recorded table's (the replay universe): a strategy tuning over
    it asks only configs the table can answer, as in Kernel Tuner's simulation mode."""

    table: tuple = ()

    @classmethod
    def over(cls, base: SearchSpace, configs: Iterable[Config]) -> "TableSpace":
        from kernels.space import Constraint
        from kernels.space import table_predicate

        cfgs = tuple(configs)
        pred = table_predicate(base.names, cfgs)  # prunes partial configs too, for the proposer's grammar walk
        return cls(base.params, base.constraints + (Constraint("in the replay table", lambda c, s, h: pred(c)),),
                   base.default, base.shape, base.hw, cfgs)

    def enumerate(self):
        yield from (dict(c) for c in self.table)

    def sample(self, n: int, rng: random.Random, exclude: set[str] | None = None) -> list[Config]:
        pool = [c for c in self.table if config_key(c) not in (exclude or set())]
        rng.shuffle(pool)
        return [dict(c) for c in pool[:n]]

    def neighbours(self, cfg: Config) -> list[Config]:
        """Table configs at the smallest knob distance from cfg (one step when the table has them)."""
        ds = [(self.distance(cfg, c), c) for c in self.table if config_key(c) != config_key(cfg)]
        if not ds:
            return []
        dmin = min(d for d, _ in ds)
        return [dict(c) for d, c in ds if d == dmin]

    def valid_default(self) -> Config:
        return min(self.table, key=lambda c: self.distance(c, self.default))
