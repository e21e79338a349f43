"""edgetune's two contenders per workload and thread count: the default config, and the best tuned one.

The thread count is pinned (the spec's `threads` knob narrowed to one value), so a 2-thread row compares
edgetune's 2-thread kernel with peers on 2 threads rather than whatever the tuner preferred. The tuned config comes
from a long anneal (a Session over the pinned space, cached in the bench's own state dir so it never touches the
device's active configs), from a prior `edgetune tune` (`--tuned-from results.db`), or is left out.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgetune import paths
from edgetune.errors import BadInput
from kernels.space import Config, enum
from kernels.spec import KernelSpec, Workload
from tuner.evaluate import Measured
from tuner.strategies import Anneal


@dataclass(frozen=True)
class Tuned:
    config: Config
    source: str  # how it was found, printed beside the table


def pinned_spec(spec: KernelSpec, threads: int) -> KernelSpec | None:
    """`spec` with its threads knob fixed to `threads`; None when the kernel has no such knob and threads > 1."""
    if not any(p.name == "threads" for p in spec.params):
        return spec if threads == 1 else None
    params = tuple(enum("threads", threads, help=p.help) if p.name == "threads" else p for p in spec.params)
    return dataclasses.replace(spec, params=params, default={**spec.default, "threads": threads})


def default_config(spec: KernelSpec | None, wl: Workload, hw: Any) -> tuple[Config | None, str]:
    """The pinned space's valid default, or None and why no config runs on that many threads."""
    if spec is None:
        return None, "no threads knob"
    space = spec.space(wl.shape, hw)
    try:
        return space.valid_default(), ""
    except BadInput:  # every config breaks a rule: name the rules they all break
        common = set.intersection(*(set(space.violations(dict(zip(space.names, combo))))
                                    for combo in itertools.product(*(p.values for p in space.params))))
        return None, "; ".join(sorted(common))


class _PinnedAnneal(Anneal):
    """Anneal whose version names the pin and budget, so each (threads, evals) tune has its own cached result."""

    def __init__(self, space: Any, seed: int, tag: str):
        super().__init__(space, seed)
        self.version = f"{Anneal.version}+{tag}"


def tune_dir() -> Path:
    d = paths.cache_dir() / "peerbench"
    d.mkdir(parents=True, exist_ok=True)
    return d


class LongTune:
    """A Session over the pinned space; finished tunes are cached in tune_dir()'s results DB.

    The session's DB and active.json live in tune_dir() (STATE_DIRECTORY is pointed there for this process), so a
    bench tune never replaces what the device's applications load."""

    def __init__(self, runner: Any, hw: Any, evals: int, seed: int = 0):
        from tuner.db import ResultsDB
        from tuner.session import Session

        os.environ["STATE_DIRECTORY"] = str(tune_dir())
        self.evals, self.seed = evals, seed
        self.session = Session(ResultsDB(tune_dir() / "results.db"), runner, hw, ort_twin=False)  # no contender

    def __call__(self, spec: KernelSpec, wl: Workload, threads: int, progress: Any = None) -> Tuned:
        from tuner.session import Budget

        tag = f"threads{threads}-evals{self.evals}"
        strat = _PinnedAnneal(spec.space(wl.shape, self.session.hw), self.seed, tag)
        res = self.session.tune(spec, wl, strategy_obj=strat, seed=self.seed, progress=progress,
                                budget=Budget(evals=self.evals, patience=None))
        how = "cached" if res.cached else f"{res.tuning_s:.0f} s"
        return Tuned(res.config, f"anneal {res.evals} evals, threads pinned ({how})")


def from_results_db(path: Path, spec: KernelSpec, wl: Workload, threads: int, hw: Any) -> Tuned | None:
    """The active config of a prior `edgetune tune` for this workload, with its threads knob set to `threads`."""
    from tuner.db import ResultsDB

    if not path.exists():
        raise BadInput(f"--tuned-from {path}: no such file; pass the results.db of a prior `edgetune tune`")
    entry = ResultsDB(path).active().get(f"{spec.name}/{wl.name}")
    if not entry:
        return None
    cfg = {**entry["config"], **({"threads": threads} if "threads" in entry["config"] else {})}
    space = spec.space(wl.shape, hw)
    if not space.is_valid(cfg):
        return None
    return Tuned(cfg, f"active config of {path} ({entry.get('strategy')}, {entry.get('evals')} evals), "
                      f"threads set to {threads}")


class EdgetunePeer:
    """One edgetune config as a contender: each round is one checked, timed measurement through the tuner's own
    evaluator (tuner.evaluate.Measured: the worker, so the thread runtime and wait policy are the tuner's). Its
    series goes under every one of `names` (the default and the tuned config, when the tune kept the default)."""

    def __init__(self, names: tuple[str, ...], evaluator: Measured, config: Config):
        self.names, self.evaluator, self.config = names, evaluator, config
        self.times: list[float | None] = []
        self.error: str | None = None

    def sample(self) -> None:
        m = self.evaluator.evaluate([self.config])[0]
        self.times.append(m.ms if m.ok else None)
        if not m.ok:
            self.error = m.reason

    def series(self) -> dict[str, list[float | None]]:
        return {n: self.times for n in self.names}
