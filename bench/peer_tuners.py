"""Classical peer tuners as edgetune strategies (ask/tell), so they tune through the same Session, builds and worker.

- `OptunaTPE`: Optuna's TPE sampler over the knobs as categoricals (its own ask/tell). A suggestion that breaks a
  constraint is told as failed and suggested again (no evaluation spent); one already measured is told its value.
  When TPE keeps suggesting measured configs (it has converged on a small space), a random unmeasured valid config
  is enqueued for it, so it spends its budget as a user running it to a budget would.
- `KernelTunerStrategy`: one of Kernel Tuner's strategies (genetic_algorithm, bayes_opt, ...) over the space's
  valid configs, population sizes scaled to the budget. Kernel Tuner drives its own loop and calls a runner, so it runs in a thread whose runner hands
  each batch to `ask` and waits for the `tell`s; `close` (or the end of the budget) stops it.

Peers live in bench/ only (DESIGN.md: the product's strategies are in tuner/strategies).
"""

from __future__ import annotations

import queue
import random
import threading
import warnings
from typing import Any

from kernels.measure import Measurement
from kernels.space import Config, SearchSpace, config_key
from tuner.strategies.base import Strategy

BIG = 1e30  # the value a failed config is told, for samplers that need a number


class OptunaTPE(Strategy):
    name = "optuna-tpe"

    def __init__(self, space: SearchSpace, seed: int = 0, *, kernel: Any = None, startup: int = 5):
        import optuna

        super().__init__(space, seed, kernel=kernel)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        self.version = f"optuna-{optuna.__version__}-startup{startup}"
        self.study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup))
        self.pending: dict[str, Any] = {}  # config key -> its open trial
        self.values: dict[str, float] = {}

    def ask(self, n: int) -> list[Config]:
        from optuna.trial import TrialState

        out: list[Config] = []
        stalled = 0
        for _ in range(200 * n):
            if len(out) >= n:
                break
            if stalled >= 50:
                fresh = self.space.sample(1, self.rng, exclude=self.seen | set(self.pending))
                if not fresh:
                    break
                self.study.enqueue_trial(fresh[0])
                stalled = 0
            stalled += 1
            t = self.study.ask()
            cfg = {p.name: t.suggest_categorical(p.name, list(p.values)) for p in self.space.params}
            k = config_key(cfg)
            if k in self.values:
                self.study.tell(t, self.values[k])
            elif not self.space.is_valid(cfg) or k in self.pending:
                self.study.tell(t, state=TrialState.FAIL)
            else:
                self.pending[k] = t
                out.append(cfg)
                stalled = 0
        return out

    def tell(self, cfg: Config, m: Measurement) -> None:
        super().tell(cfg, m)
        k = config_key(cfg)
        t = self.pending.pop(k, None)
        self.values[k] = m.value if m.ok else BIG
        if t is not None:
            self.study.tell(t, self.values[k])


class KernelTunerStrategy(Strategy):
    name = "kerneltuner"

    def __init__(self, space: SearchSpace, seed: int = 0, *, kernel: Any = None, strategy: str = "bayes_opt",
                 max_fevals: int = 20):
        import kernel_tuner

        super().__init__(space, seed, kernel=kernel)
        self.name = f"kerneltuner-{strategy}"
        self.version = f"kernel_tuner-{kernel_tuner.__version__}-{strategy}"
        self.strategy, self.max_fevals, self.seed = strategy, max_fevals, seed
        self._asks: queue.Queue = queue.Queue()  # from the tuner thread: a batch of configs, or None when it ended
        self._tells: queue.Queue = queue.Queue()  # to the tuner thread: the batch's results, or None to stop
        self._batch: list[Config] = []
        self._known: dict[str, Measurement] = {}  # every config told so far
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._done = False

    # ---- the tuner thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        import numpy as np
        from kernel_tuner import util
        from kernel_tuner.interface import Options, strategy_map
        from kernel_tuner.searchspace import Searchspace

        try:
            random.seed(self.seed)
            np.random.seed(self.seed)
            names = self.space.names
            tune_params = {p.name: list(p.values) for p in self.space.params}
            valid = {",".join(str(c[n]) for n in names): c for c in self.space.enumerate()}
            ss = Searchspace(None, None, None, from_cache={"tune_params": tune_params, "cache": valid})
            opts = Options(tune_params=tune_params, restrictions=None, objective=["time"],
                           objective_higher_is_better=[False], verbose=False, metrics=None, cache={},
                           cachefile=None, simulated_time=0, max_fevals=self.max_fevals,
                           strategy_options=Options(max_fevals=self.max_fevals, **self._options()))
            opts["budget"] = util.TuningBudget(None, min(self.max_fevals, ss.size))
            strategy_map[self.strategy].tune(ss, _QueueRunner(self), opts)
        except BaseException as e:  # noqa: BLE001 (reported by ask; the thread must end either way)
            if not isinstance(e, _Stopped):
                self.error = e
        finally:
            self._asks.put(None)

    def _options(self) -> dict:
        """Population sizes scaled to the budget: with their defaults (20 initial samples for bayes_opt, 26 for the
        genetic algorithm) a 20-evaluation budget would end inside the random start."""
        if self.strategy in ("bayes_opt", "genetic_algorithm", "pso", "firefly_algorithm"):
            return {"popsize": max(4, self.max_fevals // 4)}
        return {}

    def _evaluate(self, configs: list[tuple]) -> list[dict | None]:
        """Called from the tuner thread: post the batch, wait for its results."""
        names = self.space.names
        self._asks.put([dict(zip(names, c)) for c in configs])
        got = self._tells.get()
        if got is None:
            raise _Stopped()
        return got

    # ---- ask / tell ----------------------------------------------------------------------------------------

    def ask(self, n: int) -> list[Config]:
        if self._done:
            return []
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        batch = self._asks.get()
        if batch is None:
            self._done = True
            if self.error is not None:
                raise RuntimeError(f"{self.name} failed: {type(self.error).__name__}: {self.error}")
            return []
        self._batch = batch
        fresh = self._fresh(batch, len(batch))
        if not fresh:  # every config of the batch was measured before: answer it from what we know
            self._answer()
            return self.ask(n)
        return fresh

    def tell(self, cfg: Config, m: Measurement) -> None:
        super().tell(cfg, m)
        self._known[config_key(cfg)] = m
        if self._batch and all(config_key(c) in self._known for c in self._batch):
            self._answer()

    def _answer(self) -> None:
        out = []
        for c in self._batch:
            m = self._known[config_key(c)]
            r: dict = dict(c)
            if m.ok:
                r.update(time=m.value, times=[m.value], compile_time=0.0, verification_time=0.0, benchmark_time=0.0)
            else:
                from kernel_tuner.util import RuntimeFailedConfig

                r["__error__"] = RuntimeFailedConfig()
            out.append(r)
        self._batch = []
        self._tells.put(out)

    def close(self) -> None:
        """Stop the tuner thread (the session's budget ended before Kernel Tuner's)."""
        if self._thread is not None and self._thread.is_alive():
            self._tells.put(None)
            self._thread.join(timeout=10)


class _Stopped(Exception):
    pass


class _QueueRunner:
    """The runner Kernel Tuner's strategies call: each batch goes to the strategy's ask, results come from tell."""

    def __init__(self, strat: KernelTunerStrategy):
        from kernel_tuner.util import Timer

        self.strat = strat
        self.timer = Timer()
        self.accumulated_strategy_time = 0.0
        self.simulation_mode = False
        self.dev = self.get_device_info()

    def add_strategy_time(self, seconds: float) -> None:
        self.accumulated_strategy_time += seconds

    def available_parallelism(self) -> int:
        return 1

    def get_device_info(self):
        from types import SimpleNamespace

        return SimpleNamespace(max_threads=1 << 30, name="edgetune-session")

    def get_environment(self, tuning_options) -> dict:
        return {}

    def shutdown(self) -> None:
        pass

    def run(self, parameter_space, tuning_options) -> list[dict | None]:
        configs = list(parameter_space)
        budget = tuning_options.budget
        out: list[dict | None] = [None] * len(configs)
        todo = []
        names = self.strat.space.names
        for i, c in enumerate(configs):
            new = config_key(dict(zip(names, c))) not in self.strat._known
            if new and budget.is_done():
                break
            todo.append(i)
            budget.add_evaluations(1 if new else 0)
        if todo:
            for i, r in zip(todo, self.strat._evaluate([tuple(configs[i]) for i in todo])):
                out[i] = r
        return out


def make_peer(name: str, space: SearchSpace, seed: int, budget: int) -> Strategy:
    """A peer by its bench name: optuna-tpe, kerneltuner-<strategy>."""
    if name == "optuna-tpe":
        return OptunaTPE(space, seed)
    if name.startswith("kerneltuner-"):
        return KernelTunerStrategy(space, seed, strategy=name.split("-", 1)[1], max_fevals=budget)
    raise ValueError(f"unknown peer {name!r}")
